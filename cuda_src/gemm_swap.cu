// Batched-decode and verify matrix products (3 <= M <= 64 rows by default) as a "swap-AB"
// weight-streaming GEMM on Hopper's warpgroup tensor-core instructions (wgmma, sm_90a): every weight
// byte is read once for all rows.
//
// out[m, n] = epilogue(sum_k x[m, k] * W[n, k]); x: [M, K] bf16 activations, M <= 64; W: [N, K] bf16
// weights (Hugging Face [out, in]); K % 8 == 0, N % 8 == 0.
//
// Why swap: at M <= 64 a decode step is bound by HBM (every weight read once, ~M flops per byte).
// A GEMM that tiles M by 32 rows reads each weight tile twice at M = 64;
// a GEMV's CUDA cores stop keeping up with HBM past a few rows. Here the tensor cores compute the
// transpose D[n, m] = sum_k W[n, k] x[m, k] with wgmma.m64nBk16: the wgmma
// "A" operand (64 rows x 16 k) is a 64-row slice of W, the "B" operand (B x 16) is the whole batch,
// B = 16, 32 or 64 >= M (rows of x past M are zero-filled in shared memory and never stored).
//
// Tile. A block owns TR = 64 * WG rows of W (WG = 1 or 2 warpgroups, warpgroup wg computing tile
// rows 64 wg .. 64 wg + 63 against the same x tile) and a share of K. Shared-memory tiles as
// gemm_tma.cu's: rows of 64 bf16 (128 bytes), the 16-byte chunk c of row r at chunk c ^ (r % 8), tiles
// 1024-byte aligned, read through K-major, 128-byte-swizzle matrix descriptors (both operands).
// A k-chunk (BK = 64) is one W tile (TR x 64) and one x tile (B x 64) in one stage.
//
// Streaming. STAGES cp.async stages (6..12: ~96-100 KB per block for WG = 1, two blocks per SM; ~217-221 KB
// for WG = 2, one), AHEAD = STAGES - 1 chunks requested ahead (40-72 KB of W in flight per block for
// WG = 1, 128-176 KB for WG = 2; the deep B = 16 builds: 20 stages, ~201 KB, 152 KB ahead). A cp.async
// pipeline with no wgmma group left in flight (the tensor-core work per chunk is tiny next to its load): at the
// top of iteration i the block waits for chunk i's copies, makes them visible to the async proxy
// (fence.proxy.async) and meets at a barrier, then requests chunk i + AHEAD into the stage chunk i - 1 used
// (every warpgroup waited for its wgmma group before that barrier), then runs chunk i's wgmmas and waits for
// them. The first AHEAD chunks of W are requested (one cp.async group each) before pdl_start(): with
// programmatic dependent launch the weight stream starts while the kernel before is finishing (no kernel writes
// weights). x of those chunks is then copied with plain loads and stores (it is small and L2-resident), which
// keeps cp.async group i = chunk i, so the first wait is for chunk 0 alone; later chunks carry their x tile in
// their own group.
//
// Split K (KS, a compile-time thread-block cluster of KS in {1, 2, 4, 8} blocks, grid (KS, tiles)):
// block `rank` of a cluster takes the k-chunks rank, rank + KS, ..., so the KS blocks read consecutive
// 128-byte pieces of the same rows. Each block writes its partial D tile to its own shared memory
// (transposed to P[m][r], rows of TR + 4 floats: conflict-free writes, 16-byte aligned float4 reads).
// Block `rank` finishes units rank, rank + KS, ... (in 128-thread strides) of the tile, summing the KS
// partials in rank order 0, 1, ..., KS - 1 (Partials): after a relaxed cluster barrier (every block is past
// its main loop, so its pipeline's shared memory is free) each block pushes its pieces of the units the others
// finish into their shared memory (st.async), counted as transaction bytes on the receiver's mbarrier, and
// each block waits on its own. No memory fence: a release cluster barrier is a GPU-wide memory barrier on
// sm_90 (MEMBAR.ALL.GPU, which waits for the block's global stores), and reading the others' partials from
// their shared memory would need one before the reads and another before exiting. No workspace, no atomics,
// and the same bits on every run; KS = 1 goes through the same shared-memory path (a block barrier instead),
// which makes every store a 8- or 16-byte vector of 4 consecutive columns.
//
// Fragments (PTX ISA, wgmma .m64nNk16 D): warp w of a warpgroup holds D rows 16 w + g and 16 w + g + 8
// (g = lane / 4, t = lane % 4); d[4 j + e] is row 16 w + g + 8 (e >> 1), column (batch row m)
// 8 j + 2 t + (e & 1): the same as gemm_tma.cu's accumulators, with rows = weight rows and columns = batch.
//
// Epilogues as in gemm_tma.cu: 0 bf16 out [M, N]; 1 float32 out [M, N] += result (the
// residual stream); 2 SiLU(gate) * up with W = [gate; up] (N = 2 I, out [M, I] bf16); 3 float32 out; 4 bf16
// xIELU(result) with the parameters `act` (common.cuh; Apertus' up projection), which the plain and consumer
// builds take last (null for the other epilogues).
// For SILU_MUL each 16-row slab s of a tile holds gate rows j .. j + 7 in its rows 0-7 and up rows
// j .. j + 7 in rows 8-15 (j = tile * TR / 2 + 8 s), so D rows g and g + 8 of a warp pair up; the
// reduction reads gate at P[m][16 s + q] and up at P[m][16 s + 8 + q].
//
// Norm statistics from the residual epilogue (tileinfer/model/forward.py EPI_NORM, steps of 3-32 rows): a product
// that adds into the residual stream can also write what the next RMSNorm needs, and the product after
// that norm applies it, so no rmsnorm kernel runs between them. Producer (the _np builds, EPI_RESIDUAL): for
// each new residual r it writes next_x = bf16(r * next_w) ([M, N], the next norm's weights, no 1/rms) and
// for each row m its tile's sum of r^2, ss_out[m * tiles + tile] (tiles = gridDim.y; a fixed shuffle
// tree: the same bits on every run). Consumer (the _nc builds, x = that next_x): after its wait it sums row
// m's ss_tiles partials (rows of ss_tiles floats, in a fixed order), r_m = 1 / sqrt(sum / K + eps), and
// scales row m's sums by r_m before the epilogue: x W^T scaled by r_m is rmsnorm(r) W^T, up to where the
// bf16 rounding falls (before the 1 / rms here, after it in the rmsnorm kernel).
//
// Kernels gemm_swap_b{B}_w{WG}_c{KS}(x, W, out, M, N, K, epi, act, cap, cap_stride), the producer ..._np(..., epi,
// next_w, next_x, ss_out, cap, cap_stride) and the consumer ..._nc(..., epi, ss_in, ss_tiles, eps, act): cap and
// cap_stride (EPI_RESIDUAL; null and 0 for no capture): each new residual row m is also written at cap +
// m * cap_stride (floats; 16-byte aligned), a layer's hidden states for a drafter (tileinfer/model/forward.py,
// Capture) from the kernel that produces them. Grid (KS, tiles), block 128 * WG,
// dynamic shared memory Cfg<B, WG>::SMEM (tileinfer/kernels/linear.py, swap_smem: the same numbers);
// tiles = ceil(N / TR), or ceil((N / 2) / (TR / 2)) for SILU_MUL. `epi` is a kernel argument (16
// kernels a norm role, not 64; only WG = 1 is built, see the end of the file). The deep builds
// gemm_swap_b16d_* are B = 16 with DEEP_STAGES stages (Cfg's DEEP), for grids of one block an SM.
//
// wgmma exists only on sm_90a: a plain sm_90 build (which test_compile also checks) gets kernels
// that trap.
#include "cluster.cuh"
#include "mbarrier.cuh"
#include "wgmma.cuh"

enum Epilogue { EPI_BF16 = 0, EPI_RESIDUAL = 1, EPI_SILU_MUL = 2, EPI_F32 = 3, EPI_XIELU = 4 };
// Builds of the swap-AB GEMM: the plain one, and the norm statistics' producer (_np) and consumer (_nc), so
// that the plain build carries none of their code (one build taking both as arguments made every product
// slower).
enum NormRole { NORM_NONE = 0, NORM_PRODUCER = 1, NORM_CONSUMER = 2 };
// Builds of an MLP's two products at 3-64 rows (the _fp and _fc kernels; see "The MLP's flow" below): the up
// product counts each chunk of its output it has written, and the down product, launched while the up product
// still runs, waits for each chunk of its input on those counts instead of for the whole up product.
enum Flow { FLOW_NONE = 0, FLOW_PRODUCER = 1, FLOW_CONSUMER = 2 };

#define BK 64  // k per chunk: one 128-byte shared-memory row
#define SS_LOADS 3  // the consumer sums at most 32 * SS_LOADS = 96 partials a row (rows of up to 6,144)

// Deep builds (the _b16d kernels): B = 16 with DEEP_STAGES stages (~201 KB, one block an SM), for grids of
// at most one block an SM, where the ordinary build's 9 chunks ahead (72 KB a block) may be too few bytes
// in flight for one SM's share of HBM bandwidth.
#define DEEP_STAGES 20

template <int B, int WG, bool DEEP = false> struct Cfg {
    static constexpr int THREADS = 128 * WG;
    static constexpr int TR = 64 * WG;                 // W rows per block
    static constexpr int TILE_W = TR * BK * 2;         // bytes: 8 or 16 KB
    static constexpr int TILE_X = B * BK * 2;          // bytes: 2, 4 or 8 KB
    static constexpr int STAGE = TILE_W + TILE_X;      // a multiple of 1024: every tile stays 1024-aligned
    static constexpr int BASE_STAGES = WG == 1 ? (B == 16 ? 10 : B == 32 ? 8 : 6) : (B == 16 ? 12 : B == 32 ? 11 : 9);
    static constexpr int STAGES = DEEP ? DEEP_STAGES : BASE_STAGES;
    static constexpr int AHEAD = STAGES - 1;           // chunks requested ahead of the one computed
    static constexpr int SMEM = STAGES * STAGE + 1024; // + alignment slack
    static constexpr int PS = TR + 4;                  // floats per row of the partial tile P[m][r]
    static constexpr int WP = TR * 8 / THREADS;        // 16-byte W pieces per thread per chunk (4)
    static constexpr int XP = (B * 8 + THREADS - 1) / THREADS;  // 16-byte x pieces per thread per chunk
    static_assert(STAGE % 1024 == 0, "tiles must stay 1024-byte aligned (128-byte swizzle atoms)");
    static_assert(STAGES >= 2, "the pipeline refills the stage read one chunk ago");
    static_assert(B * PS * 4 <= STAGES * STAGE, "the partial tile reuses the pipeline's shared memory");
    static_assert(SMEM <= 227 * 1024, "more dynamic shared memory than an H200 block may have");
};

// Byte offset of 16-byte chunk c of row r in a 128-byte-swizzled tile.
__device__ __forceinline__ u32 swz_bytes(int r, int c) { return (u32)(r * 128 + ((c ^ (r & 7)) << 4)); }

// ------------------------------------------------------------------- split K (the cluster helpers: cluster.cuh)
// A block's partial tile P and, with KS > 1, the other blocks' partials of the units this block sums, pushed into
// its receive region by those blocks (see the header). Unit u (4 outputs: TR / 4 a batch row, SILU_MUL TR / 8) is
// summed by block (u / THREADS) % KS; its float4s are the pieces of P at first(u) (SILU_MUL: gate at first(u),
// up at first(u) + 8). The receive region holds, for each source rank s and each unit this block sums (local
// index li = (u / (KS THREADS)) THREADS + u % THREADS), its pieces (2 for SILU_MUL, else 1) in 16-byte slots
// (s UPB + li) pieces + piece.
template <int B, int TR, int KS> struct Partials {
    static constexpr int THREADS = 2 * TR, PS = TR + 4;
    // Units a block sums, at most: whole groups of THREADS.
    static constexpr int UPB = (B * TR / 4 + KS * THREADS - 1) / (KS * THREADS) * THREADS;
    static constexpr int RECV = (B * PS * 4 + 15) / 16 * 16;  // the receive region's byte offset from P
    const float *P;  // this block's partial tile; its receive region follows at P + RECV / 4
    u32 bar;         // this block's mbarrier: its phase 0 completes when every other block's pushes have landed
    int rank;

    static __device__ __forceinline__ int first(int u, bool silu) {
        const int per_m = silu ? TR / 8 : TR / 4, m = u / per_m, q = u % per_m;
        return m * PS + (silu ? (q >> 1) * 16 + (q & 1) * 4 : 4 * q);
    }
    static __device__ __forceinline__ int local_index(int u) { return (u / (KS * THREADS)) * THREADS + u % THREADS; }
    // Groups g of THREADS units, summed by block g % KS; float4 pieces a unit.
    static __device__ __forceinline__ int groups(bool silu) { return (silu ? B * TR / 8 : B * TR / 4) / THREADS; }
    static __device__ __forceinline__ int pieces(bool silu) { return silu ? 2 : 1; }
    // Bytes the other blocks push into block `rank`: its units, one float4 a piece.
    static __device__ __forceinline__ u32 expected_bytes(int rank, bool silu) {
        const int mine = rank < groups(silu) ? (groups(silu) - rank + KS - 1) / KS : 0;
        return (u32)((KS - 1) * mine * THREADS * pieces(silu) * 16);
    }
    // Pushes this block's pieces of every unit another block sums into that block's receive region.
    __device__ __forceinline__ void push(bool silu) const {
        const int tid = threadIdx.x;
#pragma unroll
        for (int g = 0; g < B * TR / 4 / THREADS; ++g) {
            const int owner = g % KS;
            if (g >= groups(silu) || owner == rank) continue;
            const int u = g * THREADS + tid, li = (g / KS) * THREADS + tid;
            const u32 dst = cluster_addr(smem_addr(P) + RECV, owner), remote_bar = cluster_addr(bar, owner);
            for (int piece = 0; piece < pieces(silu); ++piece)
                st_async_f4(dst + ((rank * UPB + li) * pieces(silu) + piece) * 16,
                            *reinterpret_cast<const float4 *>(P + first(u, silu) + 8 * piece), remote_bar);
        }
    }
    // Unit u's piece summed over the KS partials in rank order (this block's own from P).
    __device__ __forceinline__ float4 sum(int u, bool silu, int piece) const {
        const float *own = P + first(u, silu) + 8 * piece;
        if (KS == 1) return *reinterpret_cast<const float4 *>(own);
        const int li = local_index(u);
        float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
        for (int s = 0; s < KS; ++s) {
            const float *at = s == rank ? own : P + RECV / 4 + ((s * UPB + li) * pieces(silu) + piece) * 4;
            const float4 x = *reinterpret_cast<const float4 *>(at);
            if (s == 0) {
                v = x;
            } else {
                v.x += x.x;
                v.y += x.y;
                v.z += x.z;
                v.w += x.w;
            }
        }
        return v;
    }
    __device__ __forceinline__ void wait() const {
        if (KS > 1) mbar_wait(bar, 0);
    }
};

// ------------------------------------------------- wgmma (sm_90a): the batch widths' products (the basics: wgmma.cuh)
// d (64 W rows x n batch rows per warpgroup, n / 2 floats a thread) += A (64 x 16, W) * B (16 x n, x^T).
// Both operands K-major in shared memory (transpose flags 0), scale-d on (d is zeroed first).
__device__ __forceinline__ void wgmma_n16(float (&d)[8], u64 da, u64 db) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %10, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7}, %8, %9, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
        : "l"(da), "l"(db), "r"(1));
}
__device__ __forceinline__ void wgmma_n32(float (&d)[16], u64 da, u64 db) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, %16, %17, p, 1, 1, 0, 0;\n}\n"
        : WGMMA_D16(0)
        : "l"(da), "l"(db), "r"(1));
}
__device__ __forceinline__ void wgmma_n64(float (&d)[32], u64 da, u64 db) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 0, 0;\n}\n"
        : WGMMA_D16(0), WGMMA_D16(16)
        : "l"(da), "l"(db), "r"(1));
}

template <int B> struct Mma;
template <> struct Mma<16> {
    static __device__ __forceinline__ void run(float (&d)[8], u64 a, u64 b) { wgmma_n16(d, a, b); }
};
template <> struct Mma<32> {
    static __device__ __forceinline__ void run(float (&d)[16], u64 a, u64 b) { wgmma_n32(d, a, b); }
};
template <> struct Mma<64> {
    static __device__ __forceinline__ void run(float (&d)[32], u64 a, u64 b) { wgmma_n64(d, a, b); }
};

// ----------------------------------------------------------------------------- tile rows
// The W row that row r of tile `tile` (TR rows) loads (gn); false past the end. With SILU_MUL (W = [gate;
// up], N = 2 I) the tile covers outputs j0 = tile * TR / 2 .. j0 + TR / 2 - 1 in 16-row slabs: slab
// s = r / 16 holds gate rows j0 + 8 s + (r % 8) in its rows 0-7 and the matching up rows in rows 8-15.
template <int TR>
__device__ __forceinline__ bool swap_weight_row(int r, int tile, int N, bool silu, int &gn) {
    if (silu) {
        const int half = N >> 1, j = tile * (TR / 2) + (r >> 4) * 8 + (r & 7);
        gn = (r & 8) ? half + j : j;
        return j < half;
    }
    gn = tile * TR + r;
    return gn < N;
}

// Store 4 consecutive output columns n .. n + 3 of row m (n % 4 == 0, N % 8 == 0: all in range or none), any
// epilogue but the residual one (swap_block's epilogue adds into the residual stream itself).
__device__ __forceinline__ void store4(void *__restrict__ out, int N, int epi, int m, int n, float4 v,
                                       const float *__restrict__ act) {
    const size_t at = (size_t)m * N + n;
    if (epi == EPI_BF16 || epi == EPI_XIELU) {
        if (epi == EPI_XIELU) {
            const float4 a = load_act(act);
            v = make_float4(xielu(v.x, a), xielu(v.y, a), xielu(v.z, a), xielu(v.w, a));
        }
        *reinterpret_cast<uint2 *>(reinterpret_cast<bf16 *>(out) + at) =
            make_uint2(pack_bf16x2(v.x, v.y), pack_bf16x2(v.z, v.w));
    } else {
        *reinterpret_cast<float4 *>(reinterpret_cast<float *>(out) + at) = v;
    }
}

__device__ __forceinline__ float4 scale4(float4 v, float s) { return make_float4(v.x * s, v.y * s, v.z * s, v.w * s); }

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// ------------------------------------------------------------------- the MLP's flow
// act = up(x) [M, I] and resid += down(act): in the plain order the down product waits (pdl_start) until the
// whole up product has finished, and where the up product's blocks take more than one wave of the SMs (qwen3-4b's
// gate/up at 64 rows: 304 blocks for 264 block slots) its last blocks stream their weights alone. Here the down
// product (the consumer, _fc) skips the wait: programmatic dependent launch starts it once every block of the up
// product (the producer, _fp) has passed its own wait, so its blocks take the slots the up product leaves and
// stream their weights beside its last blocks. Each producer block, after its outputs, adds 1 to flags[c], c the
// k-chunk (BK columns of act) its tile lies in; a consumer block waits, before it reads chunk c of act, until
// flags[c] counts every block of the tiles in c (tiles_per_chunk tiles of up_ks blocks; fewer tiles in a last,
// partial chunk). The consumer reads act through L2 (cp.async.cg, ld.global.cg): it is written while the kernel
// runs. flags[chunks] counts the consumer's finished blocks; the last one zeroes every count for the next
// product (the next kernel waits for the consumer's end, so the zeros are in place before any later producer).
// Nothing the consumer writes (resid) is read or written by the up product or the norm before it, which have
// passed their waits (the consumer starts only then), and the kernel after the consumer waits for the consumer,
// whose end follows every producer block's last count. With the norm statistics (3-32 rows: the up product the
// consumer of o_proj's statistics, _nc_fp; the down product the producer of the next layer's, _np_fc) the down
// product also writes the next layer's normed input x, which the up product reads: its blocks wait for every
// chunk's count before their epilogue.
__device__ __forceinline__ int flow_need(int c, int up_tiles, int tiles_per_chunk, int up_ks) {
    return min(tiles_per_chunk, up_tiles - c * tiles_per_chunk) * up_ks;  // chunk c's up blocks
}
__device__ __forceinline__ int flow_count(const int *flags, int c) {
    int have;
    asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(have) : "l"(flags + c) : "memory");
    return have;
}
__device__ __forceinline__ void flow_wait(const int *flags, int c, int up_tiles, int tiles_per_chunk, int up_ks) {
    while (flow_count(flags, c) < flow_need(c, up_tiles, tiles_per_chunk, up_ks)) __nanosleep(64);
}

__device__ __forceinline__ vec16 ld16_cg(const void *p) {  // through L2 only: data written while the kernel runs
    vec16 v;
    asm volatile("ld.global.cg.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.w[0]), "=r"(v.w[1]), "=r"(v.w[2]), "=r"(v.w[3]) : "l"(p));
    return v;
}

// The consumer's last block (of every block's count at flags[chunks]) zeroes the counts.
template <int THREADS> __device__ __forceinline__ void flow_reset(int *flags, int chunks) {
    __shared__ int last;
    __syncthreads();  // (thread 0 alone read the counts; the barrier orders this block's stores before the count)
    if (threadIdx.x == 0) {
        __threadfence();
        last = atomicAdd(flags + chunks, 1) == (int)(gridDim.x * gridDim.y) - 1;
    }
    __syncthreads();
    if (last) {
        for (int c = threadIdx.x; c <= chunks; c += THREADS) flags[c] = 0;
    }
}

// Partials' mbarrier (a function so that only the split builds have it).
template <int KS> __device__ __forceinline__ u32 parts_bar() {
    __shared__ __align__(8) unsigned long long bar;
    return smem_addr(&bar);
}

// The consumer's 1 / rms a row, from the prologue to the epilogue (a function so that only the consumer
// builds have the static shared array).
template <int B> __device__ __forceinline__ float *row_scale_smem() {
    __shared__ float row_scale[B];
    return row_scale;
}

template <int B, int WG, int KS, int NORM, bool DEEP, int FLOW = FLOW_NONE>
__device__ __forceinline__ void swap_block(const bf16 *__restrict__ X, const bf16 *__restrict__ W,
                                           void *__restrict__ out, int M, int N, int K, int epi,
                                           const bf16 *__restrict__ next_w, bf16 *__restrict__ next_x,
                                           float *__restrict__ ss_out, const float *__restrict__ ss_in,
                                           int ss_tiles, float eps, const float *__restrict__ act,
                                           float *__restrict__ cap, int cap_stride, int *flags = nullptr,
                                           int up_tiles = 0, int tiles_per_chunk = 0, int up_ks = 0) {
    using C = Cfg<B, WG, DEEP>;
    constexpr int THREADS = C::THREADS, TR = C::TR, STAGES = C::STAGES, AHEAD = C::AHEAD;
    extern __shared__ __align__(128) unsigned char smem_raw[];
    unsigned char *smem = smem_raw + ((1024u - (smem_addr(smem_raw) & 1023u)) & 1023u);  // 1024-aligned
    const u32 smem0 = smem_addr(smem);
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, wg = warp >> 2;
    const int rank = KS > 1 ? cluster_rank() : 0;  // == blockIdx.x: this block's k-chunks
    const int tile = blockIdx.y;
    const bool silu = epi == EPI_SILU_MUL;
    const int chunks = ceil_div(K, BK);
    const int mine = rank < chunks ? ceil_div(chunks - rank, KS) : 0;  // chunks rank, rank + KS, ...
    const int c = tid & 7;  // this thread's 16-byte piece of every 128-byte row it copies
    using Parts = Partials<B, TR, KS>;
    static_assert(KS == 1 || Parts::RECV + KS * Parts::UPB * 2 * 16 <= STAGES * C::STAGE,
                  "the receive region (SILU_MUL: two pieces a unit) lies in the pipeline's shared memory");
    const u32 bar = KS > 1 ? parts_bar<KS>() : 0u;
    if (KS > 1 && tid == 0) {  // Parts' barrier: one arrival (this one) and the bytes the other blocks push
        mbar_init(bar, 1);
        mbar_fence_init_cluster();  // visible to their pushes from the cluster barrier before those on
        mbar_arrive_expect_tx(bar, Parts::expected_bytes(rank, silu));
    }

    // Thread piece p copies row (tid / 8) + p * THREADS / 8 of a tile, chunk c; (row % 8) == (tid / 8) % 8.
    const bf16 *wsrc[C::WP];
    bool wok[C::WP];
#pragma unroll
    for (int p = 0; p < C::WP; ++p) {
        const int r = (tid >> 3) + p * (THREADS / 8);
        int gn;
        wok[p] = swap_weight_row<TR>(r, tile, N, silu, gn);
        wsrc[p] = W + (size_t)(wok[p] ? gn : 0) * K + c * 8;
    }
    auto load_w = [&](int s, int i) {  // W part of local chunk i into stage s (zero past N and K)
        const int k0 = (rank + i * KS) * BK;
        const bool kin = k0 + c * 8 < K;
        const u32 base = smem0 + s * C::STAGE;
#pragma unroll
        for (int p = 0; p < C::WP; ++p) {
            const int r = (tid >> 3) + p * (THREADS / 8);
            const bool ok = wok[p] && kin;
            cp_async16(base + swz_bytes(r, c), ok ? wsrc[p] + k0 : W, ok);
        }
    };
    // x piece p of a chunk: row r = (tid / 8) + p * THREADS / 8 (those past B skipped), zero past M and K.
    auto x_row = [&](int p) { return (tid >> 3) + p * (THREADS / 8); };
    auto x_here = [&](int p) { return B * 8 % THREADS == 0 || x_row(p) < B; };
    auto load_x = [&](int s, int i) {  // x part of local chunk i into stage s, by cp.async
        const int gk = (rank + i * KS) * BK + c * 8;
        const u32 base = smem0 + s * C::STAGE + C::TILE_W;
#pragma unroll
        for (int p = 0; p < C::XP; ++p) {
            const int r = x_row(p);
            const bool ok = r < M && gk < K;
            if (x_here(p)) cp_async16(base + swz_bytes(r, c), ok ? X + (size_t)r * K + gk : X, ok);
        }
    };

    // Weights first, one cp.async group per chunk (no kernel writes them: this may run before the kernel
    // before has finished). Then wait for that kernel and copy the same chunks' x synchronously (plain
    // loads, all in flight at once, then shared stores), so that group i still holds chunk i alone and
    // the first wait below is for chunk 0's weights only. Chunks from AHEAD on carry their x in their group.
#pragma unroll
    for (int s = 0; s < AHEAD; ++s) {
        if (s < mine) load_w(s, s);
        cp_async_commit();
    }
    // The consumer's counts, read by warp 0: each lane one chunk's (this block's chunks known_ + 1 + lane), so that a
    // poll covers 32 chunks in one round trip; known_: this block's chunks whose counts are complete, in order.
    int known_ = -1;
    auto flow_poll = [&](int upto) {  // warp 0: until this block's chunks 0..upto are known complete
        while (known_ < upto) {
            const int j = known_ + 1 + lane;
            bool ok = true;
            if (j < mine) {
                const int ch = rank + j * KS;
                ok = flow_count(flags, ch) >= flow_need(ch, up_tiles, tiles_per_chunk, up_ks);
            }
            const unsigned missing = __ballot_sync(0xffffffffu, !ok);
            const int more = missing ? __ffs(missing) - 1 : 32;
            known_ += more;
            if (more == 0) __nanosleep(64);
        }
    };
    if constexpr (FLOW == FLOW_CONSUMER) {  // the first chunks' counts instead of the up product's end
        if (warp == 0) flow_poll(min(AHEAD, mine) - 1);
        __syncthreads();
        pdl_launch_dependents();
    } else {
        pdl_start();
    }
    // Consumer: row m's norm partials, rows warp, warp + 4, ... of this warp (requested with x, summed
    // after x is stored).
    constexpr int RPW = (B + C::THREADS / 32 - 1) / (C::THREADS / 32);
    float ssv[RPW][SS_LOADS];
    if constexpr (NORM == NORM_CONSUMER) {
#pragma unroll
        for (int i = 0; i < RPW; ++i) {
            const int m = warp + i * (C::THREADS / 32);
#pragma unroll
            for (int j = 0; j < SS_LOADS; ++j) {
                const int t = lane + 32 * j;
                ssv[i][j] = m < M && t < ss_tiles ? ss_in[(size_t)m * ss_tiles + t] : 0.f;
            }
        }
    }
    {
        vec16 xv[AHEAD][C::XP];
#pragma unroll
        for (int s = 0; s < AHEAD; ++s) {
            const int gk = (rank + s * KS) * BK + c * 8;
#pragma unroll
            for (int p = 0; p < C::XP; ++p) {
                const int r = x_row(p);
                xv[s][p] = vec16{{0u, 0u, 0u, 0u}};
                if (s < mine && x_here(p) && r < M && gk < K)
                    xv[s][p] = FLOW == FLOW_CONSUMER ? ld16_cg(X + (size_t)r * K + gk) : ld16(X + (size_t)r * K + gk);
            }
        }
        // Stored through a generic pointer: ptxas cannot tell these stores from global ones, so it keeps every
        // load above ahead of them, all in flight at once (through a shared one it pairs each load with its store,
        // one L2 latency a chunk). The same address as smem.
        unsigned char *generic = reinterpret_cast<unsigned char *>(((size_t)smem_raw + 1023) & ~(size_t)1023);
#pragma unroll
        for (int s = 0; s < AHEAD; ++s)
#pragma unroll
            for (int p = 0; p < C::XP; ++p)
                if (s < mine && x_here(p)) st16(generic + s * C::STAGE + C::TILE_W + swz_bytes(x_row(p), c), xv[s][p]);
    }
    if constexpr (NORM == NORM_CONSUMER) {  // row_scale is read in the epilogue, past the main loop's barriers
#pragma unroll
        for (int i = 0; i < RPW; ++i) {
            float part = ssv[i][0];
#pragma unroll
            for (int j = 1; j < SS_LOADS; ++j) part += ssv[i][j];
            const float sum = warp_sum(part);
            const int m = warp + i * (C::THREADS / 32);
            if (lane == 0 && m < B) row_scale_smem<B>()[m] = rsqrtf(sum / K + eps);
        }
    }

    float d[B / 2];
#pragma unroll
    for (int i = 0; i < B / 2; ++i) d[i] = 0.f;

    for (int i = 0; i < mine; ++i) {
        if constexpr (FLOW == FLOW_CONSUMER) {  // chunk i + AHEAD's count, before the barrier its copies follow
            if (warp == 0 && i + AHEAD < mine) flow_poll(i + AHEAD);  // (a load only where it is not known yet)
        }
        cp_async_wait<AHEAD - 1>();  // this thread's copies of chunk i have landed (group i)
        fence_async_smem();          // ... and they and the prologue's x stores are visible to the tensor cores
        __syncthreads();             // everyone's; and every warpgroup is done with chunk i - 1
        const int next = i + AHEAD;
        if (next < mine) {
            load_w(next % STAGES, next);
            load_x(next % STAGES, next);
        }
        cp_async_commit();

        const u32 st = smem0 + (i % STAGES) * C::STAGE;
        const u32 a_base = st + wg * 64 * 128, b_base = st + C::TILE_W;
        wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < BK / 16; ++ks) Mma<B>::run(d, smem_desc(a_base + ks * 32), smem_desc(b_base + ks * 32));
        wgmma_commit();
        wgmma_wait<0>();  // the stage is refilled at the next iteration (a few hundred cycles: the loads take longer)
    }
    if constexpr (FLOW == FLOW_CONSUMER && NORM == NORM_PRODUCER) {
        // This build writes the next norm's input x (next_x), which the up product reads: every up block's count
        // first (the last of them is done with x), not only the chunks this block read.
        for (int ch = tid; ch < chunks; ch += THREADS) flow_wait(flags, ch, up_tiles, tiles_per_chunk, up_ks);
    }
    cp_async_wait<0>();
    __syncthreads();  // no tensor-core read or copy into the pipeline's shared memory is left: reuse it

    // Partial tile, transposed: P[m][r] = d of tile row r, batch row m (see the header for the fragments).
    float *P = reinterpret_cast<float *>(smem);
    {
        const int g = lane >> 2, t = lane & 3, r0 = wg * 64 + (warp & 3) * 16 + g;
#pragma unroll
        for (int j = 0; j < B / 8; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) P[(8 * j + 2 * t + (e & 1)) * C::PS + r0 + 8 * (e >> 1)] = d[4 * j + e];
    }
    __syncthreads();  // P is whole: the threads below read each other's entries
    const Parts parts{P, bar, rank};
    if constexpr (KS > 1) {
        cluster_sync_relaxed();  // every block of the cluster is past its main loop: its receive region is free
        parts.push(silu);
    }

    // Units of 4 outputs: (m, 4 consecutive tile rows) or, for SILU_MUL, (m, 4 gate rows and their 4 up rows).
    const int per_m = silu ? TR / 8 : TR / 4;
    if constexpr (NORM == NORM_PRODUCER) {
        // Producer (EPI_RESIDUAL): the TR / 4 = 16 units of row m in this tile are 16 consecutive u, the
        // lanes of one half-warp, and B * per_m is a multiple of 32: every lane of a warp runs the same
        // iterations and meets the shuffles (rows past M and columns past N add 0).
        static_assert(TR / 4 == 16, "the producer's row sums take a half-warp a row");
        parts.wait();
        for (int u = rank * THREADS + tid; u < B * per_m; u += KS * THREADS) {
            const int m = u / per_m, q = u % per_m, n = tile * TR + 4 * q;
            float ss = 0.f;
            if (m < M && n < N) {
                const float4 v = parts.sum(u, false, 0);
                float4 *o = reinterpret_cast<float4 *>(reinterpret_cast<float *>(out) + (size_t)m * N + n);
                const float4 old = *o;
                const float4 r = make_float4(old.x + v.x, old.y + v.y, old.z + v.z, old.w + v.w);
                *o = r;
                if (cap) *reinterpret_cast<float4 *>(cap + (size_t)m * cap_stride + n) = r;
                const uint2 w = *reinterpret_cast<const uint2 *>(next_w + n);
                *reinterpret_cast<uint2 *>(next_x + (size_t)m * N + n) =
                        make_uint2(pack_bf16x2(r.x * bf16lo(w.x), r.y * bf16hi(w.x)),
                                   pack_bf16x2(r.z * bf16lo(w.y), r.w * bf16hi(w.y)));
                ss = (r.x * r.x + r.y * r.y) + (r.z * r.z + r.w * r.w);
            }
#pragma unroll
            for (int off = 8; off > 0; off >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, off);
            if (q == 0 && m < M) ss_out[(size_t)m * gridDim.y + tile] = ss;
        }
    } else if (epi == EPI_RESIDUAL) {
        // Every old residual value of a thread's units is loaded before it stores any (and before the wait for
        // the other blocks' partials): through one pointer the compiler must keep each load after the store
        // before it, so unit by unit each would wait one memory latency (as in gemm_tma.cu's add_residual).
        constexpr int UNITS = B * (TR / 4), ITER = (UNITS + KS * THREADS - 1) / (KS * THREADS);
        float *o = reinterpret_cast<float *>(out);
        float4 old[ITER];
        bool ok[ITER];
#pragma unroll
        for (int i = 0; i < ITER; ++i) {
            const int u = rank * THREADS + tid + i * KS * THREADS, m = u / (TR / 4), n = tile * TR + 4 * (u % (TR / 4));
            ok[i] = u < UNITS && m < M && n < N;
            if (ok[i]) old[i] = *reinterpret_cast<const float4 *>(o + (size_t)m * N + n);
        }
        parts.wait();
#pragma unroll
        for (int i = 0; i < ITER; ++i) {
            if (!ok[i]) continue;
            const int u = rank * THREADS + tid + i * KS * THREADS, m = u / (TR / 4), n = tile * TR + 4 * (u % (TR / 4));
            float4 v = parts.sum(u, false, 0);
            if (NORM == NORM_CONSUMER) v = scale4(v, row_scale_smem<B>()[m]);  // 1 / rms of row m
            const float4 r = make_float4(old[i].x + v.x, old[i].y + v.y, old[i].z + v.z, old[i].w + v.w);
            *reinterpret_cast<float4 *>(o + (size_t)m * N + n) = r;
            if (cap) *reinterpret_cast<float4 *>(cap + (size_t)m * cap_stride + n) = r;
        }
    } else {
        parts.wait();
        for (int u = rank * THREADS + tid; u < B * per_m; u += KS * THREADS) {
            const int m = u / per_m, q = u % per_m;
            if (m >= M) break;  // u only grows
            const float rs = NORM == NORM_CONSUMER ? row_scale_smem<B>()[m] : 1.f;  // consumer: 1 / rms of row m
            if (silu) {
                const int half = N >> 1, j = tile * (TR / 2) + (q >> 1) * 8 + (q & 1) * 4;
                if (j >= half) continue;
                float4 g = parts.sum(u, true, 0), v = parts.sum(u, true, 1);
                if constexpr (NORM == NORM_CONSUMER) {
                    g = scale4(g, rs);
                    v = scale4(v, rs);
                }
                *reinterpret_cast<uint2 *>(reinterpret_cast<bf16 *>(out) + (size_t)m * half + j) =
                        make_uint2(pack_bf16x2(silu_mul(g.x, v.x), silu_mul(g.y, v.y)),
                                   pack_bf16x2(silu_mul(g.z, v.z), silu_mul(g.w, v.w)));
            } else {
                const int n = tile * TR + 4 * q;
                if (n >= N) continue;
                const float4 v = parts.sum(u, false, 0);
                store4(out, N, epi, m, n, NORM == NORM_CONSUMER ? scale4(v, rs) : v, act);
            }
        }
    }
    if constexpr (FLOW == FLOW_PRODUCER) {  // this block's outputs, then its count for their chunk
        __threadfence();
        __syncthreads();
        if (tid == 0) atomicAdd(flags + tile * (silu ? TR / 2 : TR) / BK, 1);
    }
    if constexpr (FLOW == FLOW_CONSUMER) flow_reset<THREADS>(flags, chunks);
    // No barrier before exiting: no block reads another's shared memory, and every push into this block has
    // landed (parts.wait) before it exits.
}

#else
template <int B, int WG, int KS, int NORM, bool DEEP, int FLOW = FLOW_NONE>
__device__ __forceinline__ void swap_block(const bf16 *, const bf16 *, void *, int, int, int, int, const bf16 *,
                                           bf16 *, float *, const float *, int, float, const float *, float *, int,
                                           int * = nullptr, int = 0, int = 0, int = 0) {
    pdl_start();
    __trap();
}
#endif

// ============================================================================= kernels
#define SWAP_KERNEL(TAG, B, WG, DEEP, KS, CLUSTER)                                                          \
    extern "C" __global__ void __launch_bounds__(128 * WG) CLUSTER gemm_swap_##TAG##_w##WG##_c##KS(       \
            const bf16 *__restrict__ x, const bf16 *__restrict__ W, void *__restrict__ out, int M, int N, int K, \
            int epi, const float *__restrict__ act, float *__restrict__ cap, int cap_stride) {             \
        swap_block<B, WG, KS, NORM_NONE, DEEP>(x, W, out, M, N, K, epi, nullptr, nullptr, nullptr, nullptr, 0, 0.f, \
                                               act, cap, cap_stride);                                       \
    }                                                                                                       \
    extern "C" __global__ void __launch_bounds__(128 * WG) CLUSTER gemm_swap_##TAG##_w##WG##_c##KS##_np(  \
            const bf16 *__restrict__ x, const bf16 *__restrict__ W, void *__restrict__ out, int M, int N, int K, \
            int epi, const bf16 *__restrict__ next_w, bf16 *__restrict__ next_x, float *__restrict__ ss_out,   \
            float *__restrict__ cap, int cap_stride) {                                                      \
        swap_block<B, WG, KS, NORM_PRODUCER, DEEP>(x, W, out, M, N, K, epi, next_w, next_x, ss_out, nullptr, 0, 0.f, \
                                                   nullptr, cap, cap_stride);                               \
    }                                                                                                       \
    extern "C" __global__ void __launch_bounds__(128 * WG) CLUSTER gemm_swap_##TAG##_w##WG##_c##KS##_nc(  \
            const bf16 *__restrict__ x, const bf16 *__restrict__ W, void *__restrict__ out, int M, int N, int K, \
            int epi, const float *__restrict__ ss_in, int ss_tiles, float eps, const float *__restrict__ act) { \
        swap_block<B, WG, KS, NORM_CONSUMER, DEEP>(x, W, out, M, N, K, epi, nullptr, nullptr, nullptr, ss_in,     \
                                                   ss_tiles, eps, act, nullptr, 0);                         \
    }
// The MLP's flow builds, each role a macro of its own, so that a width has only the roles the engine runs at its rows
// (linear.mlp_flow): the up product gemm_swap_{TAG}_w1_c{KS}_fp(..., act, flags) and the down product
// gemm_swap_{TAG}_w1_c{KS}_fc(..., flags, up_tiles, tiles_per_chunk, up_ks) (no capture); with the norm statistics
// (3-32 rows) the up product gemm_swap_{TAG}_w1_c{KS}_nc_fp(..., ss_in, ss_tiles, eps, act, flags) and the down
// product gemm_swap_{TAG}_w1_c{KS}_np_fc(..., next_w, next_x, ss_out, flags, up_tiles, tiles_per_chunk, up_ks).
#define SWAP_FLOW_UP(TAG, B, DEEP, KS, CLUSTER)                                                             \
    extern "C" __global__ void __launch_bounds__(128) CLUSTER gemm_swap_##TAG##_w1_c##KS##_fp(              \
            const bf16 *__restrict__ x, const bf16 *__restrict__ W, void *__restrict__ out, int M, int N, int K, \
            int epi, const float *__restrict__ act, int *flags) {                                           \
        swap_block<B, 1, KS, NORM_NONE, DEEP, FLOW_PRODUCER>(x, W, out, M, N, K, epi, nullptr, nullptr, nullptr,   \
                                                              nullptr, 0, 0.f, act, nullptr, 0, flags);     \
    }
#define SWAP_FLOW_DOWN(TAG, B, DEEP, KS, CLUSTER)                                                           \
    extern "C" __global__ void __launch_bounds__(128) CLUSTER gemm_swap_##TAG##_w1_c##KS##_fc(              \
            const bf16 *__restrict__ x, const bf16 *__restrict__ W, void *__restrict__ out, int M, int N, int K, \
            int epi, int *flags, int up_tiles, int tiles_per_chunk, int up_ks) {                            \
        swap_block<B, 1, KS, NORM_NONE, DEEP, FLOW_CONSUMER>(x, W, out, M, N, K, epi, nullptr, nullptr, nullptr,   \
                                                              nullptr, 0, 0.f, nullptr, nullptr, 0, flags,  \
                                                              up_tiles, tiles_per_chunk, up_ks);            \
    }
#define SWAP_FLOW_NORM_UP(TAG, B, DEEP, KS, CLUSTER)                                                        \
    extern "C" __global__ void __launch_bounds__(128) CLUSTER gemm_swap_##TAG##_w1_c##KS##_nc_fp(           \
            const bf16 *__restrict__ x, const bf16 *__restrict__ W, void *__restrict__ out, int M, int N, int K, \
            int epi, const float *__restrict__ ss_in, int ss_tiles, float eps, const float *__restrict__ act,   \
            int *flags) {                                                                                   \
        swap_block<B, 1, KS, NORM_CONSUMER, DEEP, FLOW_PRODUCER>(x, W, out, M, N, K, epi, nullptr, nullptr,   \
                                                                nullptr, ss_in, ss_tiles, eps, act, nullptr, 0, \
                                                                flags);                                     \
    }
#define SWAP_FLOW_NORM_DOWN(TAG, B, DEEP, KS, CLUSTER)                                                      \
    extern "C" __global__ void __launch_bounds__(128) CLUSTER gemm_swap_##TAG##_w1_c##KS##_np_fc(           \
            const bf16 *__restrict__ x, const bf16 *__restrict__ W, void *__restrict__ out, int M, int N, int K, \
            int epi, const bf16 *__restrict__ next_w, bf16 *__restrict__ next_x, float *__restrict__ ss_out,   \
            int *flags, int up_tiles, int tiles_per_chunk, int up_ks) {                                     \
        swap_block<B, 1, KS, NORM_PRODUCER, DEEP, FLOW_CONSUMER>(x, W, out, M, N, K, epi, next_w, next_x,     \
                                                                ss_out, nullptr, 0, 0.f, nullptr, nullptr, 0, \
                                                                flags, up_tiles, tiles_per_chunk, up_ks);   \
    }
// One role's builds at the four splits.
#define SWAP_FLOW_SPLITS(ROLE, TAG, B, DEEP)                                                                \
    ROLE(TAG, B, DEEP, 1, )                                                                                 \
    ROLE(TAG, B, DEEP, 2, __cluster_dims__(2, 1, 1))                                                        \
    ROLE(TAG, B, DEEP, 4, __cluster_dims__(4, 1, 1))                                                        \
    ROLE(TAG, B, DEEP, 8, __cluster_dims__(8, 1, 1))
// Each width's splits in two halves, KS = 1, 2 and KS = 4, 8 (6 kernels each).
#define SWAP_SPLITS_1_2(TAG, B, WG, DEEP)                                                                   \
    SWAP_KERNEL(TAG, B, WG, DEEP, 1, )                                                                      \
    SWAP_KERNEL(TAG, B, WG, DEEP, 2, __cluster_dims__(2, 1, 1))
#define SWAP_SPLITS_4_8(TAG, B, WG, DEEP)                                                                   \
    SWAP_KERNEL(TAG, B, WG, DEEP, 4, __cluster_dims__(4, 1, 1))                                             \
    SWAP_KERNEL(TAG, B, WG, DEEP, 8, __cluster_dims__(8, 1, 1))
// One warpgroup a block only: on the Qwen3 layer matrices two warpgroups were rarely faster and often
// slower, and the launcher's rule (linear.swap_config) is fitted to the WG = 1 builds.
// Compiled in eighteen parts (a width's half each, and the flow builds four kernels a part), at once: the whole file
// in one compile takes longer than its parts one after another. The flow builds are the roles linear.mlp_flow
// launches: at 33-64 rows (B = 64) the plain up and down products; at 3-32 rows (B = 16, 32) the up product is the
// norm statistics' consumer and the down product their producer, or plain after the last layer. The up product's
// grid is more than a wave of blocks (routing.uses_mlp_flow), so never a deep build's; the down product's may be.
#define KERNEL_PARTS 18
#if IN_PART(0)
SWAP_SPLITS_1_2(b16, 16, 1, false)
#endif
#if IN_PART(1)
SWAP_SPLITS_4_8(b16, 16, 1, false)
#endif
#if IN_PART(2)
SWAP_SPLITS_1_2(b32, 32, 1, false)
#endif
#if IN_PART(3)
SWAP_SPLITS_4_8(b32, 32, 1, false)
#endif
#if IN_PART(4)
SWAP_SPLITS_1_2(b64, 64, 1, false)
#endif
#if IN_PART(5)
SWAP_SPLITS_4_8(b64, 64, 1, false)
#endif
#if IN_PART(6)
SWAP_SPLITS_1_2(b16d, 16, 1, true)
#endif
#if IN_PART(7)
SWAP_SPLITS_4_8(b16d, 16, 1, true)
#endif
#if IN_PART(8)
SWAP_FLOW_UP(b64, 64, false, 1, )
SWAP_FLOW_UP(b64, 64, false, 2, __cluster_dims__(2, 1, 1))
SWAP_FLOW_DOWN(b64, 64, false, 1, )
SWAP_FLOW_DOWN(b64, 64, false, 2, __cluster_dims__(2, 1, 1))
#endif
#if IN_PART(9)
SWAP_FLOW_UP(b64, 64, false, 4, __cluster_dims__(4, 1, 1))
SWAP_FLOW_UP(b64, 64, false, 8, __cluster_dims__(8, 1, 1))
SWAP_FLOW_DOWN(b64, 64, false, 4, __cluster_dims__(4, 1, 1))
SWAP_FLOW_DOWN(b64, 64, false, 8, __cluster_dims__(8, 1, 1))
#endif
#if IN_PART(10)
SWAP_FLOW_SPLITS(SWAP_FLOW_DOWN, b16, 16, false)
#endif
#if IN_PART(11)
SWAP_FLOW_SPLITS(SWAP_FLOW_DOWN, b32, 32, false)
#endif
#if IN_PART(12)
SWAP_FLOW_SPLITS(SWAP_FLOW_DOWN, b16d, 16, true)
#endif
#if IN_PART(13)
SWAP_FLOW_SPLITS(SWAP_FLOW_NORM_UP, b16, 16, false)
#endif
#if IN_PART(14)
SWAP_FLOW_SPLITS(SWAP_FLOW_NORM_UP, b32, 32, false)
#endif
#if IN_PART(15)
SWAP_FLOW_SPLITS(SWAP_FLOW_NORM_DOWN, b16, 16, false)
#endif
#if IN_PART(16)
SWAP_FLOW_SPLITS(SWAP_FLOW_NORM_DOWN, b32, 32, false)
#endif
#if IN_PART(17)
SWAP_FLOW_SPLITS(SWAP_FLOW_NORM_DOWN, b16d, 16, true)
#endif
