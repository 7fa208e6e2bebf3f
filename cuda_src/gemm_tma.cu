// Prefill matrix products C[m, n] = sum_k A[m, k] * W[n, k] on Hopper's warpgroup tensor-core
// instructions (wgmma, sm_90a), fed by the tensor memory accelerator (TMA), warp-specialized and
// persistent.
//
// A: [M, K] bf16 activations, W: [N, K] bf16 weights (Hugging Face [out, in]), K % 8 == 0, N % 8 == 0.
//
// Block: 3 warpgroups (384 threads). Warpgroup 0 is the producer: after `setmaxnreg.dec` to 40
// registers, one thread issues the TMA copies (cp.async.bulk.tensor) of each k-step's A tile
// (128 x 64) and W tile (BN x 64, two boxes of BN/2 rows) into a ring of STAGES shared-memory
// stages. Warpgroups 1 and 2 are the consumers (`setmaxnreg.inc` to 232 registers): each computes
// 64 rows x BN columns of the 128 x BN block tile with wgmma.m64n{BN}k16 (bf16 in, f32
// accumulators in registers: BN / 2 a thread, both operands read from shared memory through
// matrix descriptors), then runs the epilogue straight from its registers to global memory.
// BN = 256 (gemm_tma_e*: 4 stages of 48 KB) or 128 (gemm_tma_n128_e*: 6 stages of 32 KB), and for the persistent
// kernel alone also 160 (gemm_tma_n160_e*: 5 stages of 36 KB), 96 (gemm_tma_n96_e*: 6 stages of 28 KB) and 64
// (gemm_tma_n64_e*: 8 stages of 24 KB), widths whose tiles fill whole rounds of the SMs at batched-decode row counts
// (qwen3-4b at 256 rows: gate/up in 244 tiles of 160, two rounds of 132, against 304 of 128 in three; QKV in 128
// tiles of 96, one round, against 96 of 128; qwen3-0.6b's QKV in 128 tiles of 64 against 86 of 96) and
// for qwen3-4b's o_proj and down_proj at prefill sizes (N = 2,560: 16 tiles of 160). The launcher
// (tileinfer/kernels/routing.py, tma_plan) takes the width with the smallest (rounds of tiles per block) x (tile
// cost), and for the residual products of 512 rows on weighs a 2-way split against the round widths.
//
// Pipeline: per stage a "full" mbarrier (1 arrival: the producer's arrive.expect_tx of the stage's
// bytes; the TMA unit completes the transaction) and an "empty" mbarrier (8 arrivals: lane 0 of
// each consumer warp, once the wgmma group that read the stage has completed). Consumers keep one
// wgmma group in flight: after committing k-step kt's 4 wgmmas they wait for k-step kt - 1's group
// (wgmma.wait_group 1) and release its stage. Phases follow the usual parity convention: a
// fresh barrier counts its "previous" phase (parity 1) as completed, so the producer's first pass
// over the ring waits on nothing.
//
// Programmatic dependent launch (common.cuh, pdl_start): no kernel writes the weights, so the producer requests the
// W boxes of its first tile's first STAGES k-steps before its wait for the kernel before, and their A boxes after
// it; the weights' trip from HBM then overlaps that kernel's last blocks. Every other thread waits at its start.
//
// Persistent: a launch covers tiles [tile0, tile1) of a grouped order (GROUP_M row tiles share each
// column of W tiles, M fastest, so blocks running together share A and W tiles in L2); grid = min(tiles,
// SMs), block b takes tiles tile0 + b, + grid, ... The producer runs ahead across tile boundaries, so the
// next tile's first stages load while the consumers run the epilogue of the last one.
//
// Shared-memory tiles: rows of 64 bf16 (128 bytes), written by TMA with the 128-byte swizzle (the
// 16-byte chunk c of row r at chunk c ^ (r % 8)), tiles 1024-byte aligned: exactly the layout the
// descriptors (128-byte swizzle, 1024-byte stride between 8-row groups) name. Within a stage the
// k16 slices are 32 bytes apart (start address + 32 ks). Partial tiles: TMA zero-fills what lies
// outside [M or N rows, K columns], so the products there are 0 and the epilogue skips rows >= M
// and columns >= N. A W box entirely past N (plain epilogues, the last column tile) is not loaded:
// its columns are never stored. A box partly outside its map loads much slower, so the launcher's map of
// A runs to a whole 128-row tile where A's allocation does (linear.py, tile_rows): the rows past M hold
// whatever is there, and their products are not stored either.
//
// Epilogues as in gemv.cu. For SILU_MUL (W = [gate; up], N = 2 I) a column tile covers BN/2 outputs:
// the first W box holds gate rows j0 .. j0 + BN/2 - 1, the second the up rows I + j0 .. , so
// accumulator column c (gate) and BN/2 + c (up) sit in the same thread (d[4 j + e] and
// d[4 (j + BN/16) + e]). Gate rows past I read up rows (inside W): those outputs are not stored.
//
// Kernel arguments: (A, W, out, M, N, K, tile0, tile1, tmA, tmW, act, cap, cap_stride); tile0, tile1: the launch's
// range of the tile order (all of it, or a part: a persistent launch of whole rounds and a split one of the last
// round's tiles, tileinfer/kernels/routing.py tma_plan); act: xIELU's parameters for EPI_XIELU
// (common.cuh; Apertus' up projection), ignored (null) by the other epilogues; cap, cap_stride (EPI_RESIDUAL;
// null and 0 for none): each new residual row m is also written at cap + m * cap_stride (floats, 8-byte
// aligned), a layer's hidden states for a drafter (tileinfer/model/forward.py, Capture) from the kernel that
// produces them; tmA, tmW: CUtensorMaps (128 bytes, by value,
// __grid_constant__) of A ([M, K], box 64 x 128) and W ([N, K], box 64 x BN/2), bf16, 128-byte
// swizzle, zero out-of-bounds fill, made by cuTensorMapEncodeTiled on the host (tileinfer/cuda/tensormap.py).
// A and W themselves are not read (the maps hold the addresses). Launch: grid (min(tiles, SMs)),
// block (384), dynamic shared memory SMEM_BYTES.
//
// Registers (ptxas, CUDA 13): 168 a thread at launch (384 threads, one block per SM), no spills; the
// producer's code after setmaxnreg.dec uses < 24, the consumers' < 168 (232 available).
//
// Split K (gemm_tma_s{KS}_e*, gemm_tma_n128_s{KS}_e*; KS = 2, 3, 4; and 96 wide, gemm_tma_n96_s{KS}_e*, KS = 2, 4),
// for 65-256 rows (batched decode, prefill chunks): there the tiles are too few for the SMs (qwen3-4b's QKV at
// M = 256: 96 tiles of 128 x 128 for 132 SMs; its o_proj and down_proj 40), so KS blocks share one output tile's
// K range.
// Not persistent: grid = (tile1 - tile0) x KS, block b takes tile tile0 + b / KS (the grouped order above) and
// is block rank = b % KS of a thread-block cluster of (KS, 1, 1) (__cluster_dims__: the plain launch makes it);
// it runs the same producer / consumer pipeline over k-steps [ktiles rank / KS, ktiles (rank + 1) / KS)
// (a rank may get none when ktiles < KS: its partial tile is zero). Then, instead of the epilogue:
//   1. both consumer warpgroups meet at a named barrier (bar.sync 1, 256; the producer warpgroup has
//      exited): every stage the producer loaded has been consumed and every wgmma has completed, so the
//      stage ring is idle; each consumer thread writes its accumulators as float2 pairs to the ring
//      (pair p of thread tid of consumer c at float2 (c * BN/4 + p) * 128 + tid: 64 or 128 KB;
//      conflict-free);
//   2. cluster barrier (barrier.cluster arrive.release / wait.acquire: the partial tiles are visible
//      cluster-wide);
//   3. block `rank` takes the tile's 8-column blocks u = rank, rank + KS, ... (SILU_MUL: 8-output blocks,
//      gate block u with its up block u + BN/16, so SiLU sees the fully summed gate and up), and each
//      consumer thread loads those of its own pairs from the KS blocks' shared memory (mapa +
//      ld.shared::cluster, as gemm_swap.cu), sums them rank 0 first (the same order whichever block
//      sums: deterministic, no atomics, no workspace), and runs the epilogue on them: every output
//      element is stored (or, residual, added to `out`) by exactly one block, once;
//   4. a second cluster barrier: no block exits (freeing its shared memory) while another reads it.
// The producer and consumer code before that is the persistent kernel's (KS = 1 is the persistent
// kernel itself). The launcher (tileinfer/kernels/linear.py, tma_plan) picks KS and the width from (M, N, K)
// and the number of clusters that fit at once (cuOccupancyMaxActiveClusters). Registers: 168, no spills.
//
// Tiles of 256 rows (gemm_tma_m256_n96_e*, gemm_tma_m256_n96_s4_e*, gemm_tma_m256_n160_e*), up to 1,536 rows
// where tma_plan's cost model finds them cheaper (routing.py, tma_tall_rows: e.g. at 256 rows qwen3-4b's gate/up,
// o_proj and down_proj and qwen3-8b's gate/up; at 512 also the QKV products): a stage holds two A boxes (rows m0
// and m0 + 128; the second is not loaded where it lies wholly past M), and each consumer warpgroup computes 128
// rows, two m64 wgmmas a k16 sharing the W tile's descriptor, with BN accumulators a thread (d[2][BN / 2]). Each W
// tile is then read once for all of a batch's rows, where two 128-row tiles read it once each. Their ring is
// SMEM_TILES_TALL (5 stages at 96 wide, 4 at 160; dynamic shared memory SMEM_BYTES_TALL).
// The split epilogue stores and sums each wgmma's 64 rows in turn.
//
// Multicast (gemm_tma_mc_e*, gemm_tma_n128_mc_e*), the persistent kernel from TMA_MULTICAST_ROWS rows on
// (routing.py, tma_multicast): clusters of (2, 1, 1) blocks whose tiles are always a pair of row tiles under one
// column tile of W. With an even number of row tiles the tile order's tiles 2q and 2q + 1 are such a pair, so a
// grid of whole clusters starting at an even tile walks pairs. Each block loads its own A box and one of the two
// W boxes, multicast into the same stage of both blocks (cp.async.bulk.tensor ... .multicast::cluster, completing
// each block's own "full" barrier): a third less traffic from L2 into the SMs. A stage is refilled only once both
// blocks' consumers are done with it: its "empty" barrier counts 16 arrivals, lane 0 of each consumer warp of
// either block (the other block's through mbarrier.arrive.shared::cluster; with .release.cluster each arrival
// waited for the block's earlier global stores and the products ran up to twice as long). A cluster barrier
// after the mbarriers' init (nothing is multicast into a block before it has initialized them) and one at the end
// (no block exits while the other still writes into it or arrives on its barriers). Bit for bit the plain
// persistent kernel's results.
//
// wgmma, TMA and setmaxnreg exist only on sm_90a: load_module compiles for it on
// Hopper; a plain sm_90 build (which test_compile also checks) gets kernels that trap.
#include "cluster.cuh"
#include "mbarrier.cuh"
#include "wgmma.cuh"

enum Epilogue { EPI_BF16 = 0, EPI_RESIDUAL = 1, EPI_SILU_MUL = 2, EPI_F32 = 3, EPI_XIELU = 4 };

#define BM 128
#define BK 64
#define THREADS 384                            // warpgroup 0: producer; 1 and 2: consumers
#define TILE_A (BM * BK * 2)                   // bytes of one stage's A tile
#define SMEM_TILES (192 * 1024)                // the ring: 4 stages at BN = 256, 5 at 160, 6 at 128 and 96, 8 at 64
#define SMEM_BYTES (SMEM_TILES + 256 + 1024)   // + mbarriers + alignment slack
#define SMEM_TILES_TALL (224 * 1024)           // 256-row tiles: 5 stages at BN = 96, 4 at 160
#define SMEM_BYTES_TALL (SMEM_TILES_TALL + 256 + 1024)
#define GROUP_M 16                             // row tiles per group of the tile order
#define PRODUCER_REGS 40
#define CONSUMER_REGS 232                      // 128 x 40 + 256 x 232 <= 65536

// A CUtensorMap: 128 opaque bytes, 64-byte aligned.
struct __align__(64) TmaDesc { unsigned long long opaque[16]; };

// Where the residual epilogue also writes its rows (the kernel arguments cap, cap_stride; ptr null: nowhere).
struct Capture {
    float *ptr;
    int stride;
};

// ----------------------------------------------------------------------------- tile order
// Tile t -> (row tile mt, column tile nt): groups of GROUP_M row tiles; within a group the row tile
// varies fastest, so the blocks running at once cover ~GROUP_M row tiles x (SMs / GROUP_M) column tiles.
__device__ __forceinline__ void tile_coords(int t, int tiles_m, int tiles_n, int &mt, int &nt) {
    const int per_group = GROUP_M * tiles_n;
    const int group = t / per_group, r = t - group * per_group;
    const int first = group * GROUP_M;
    const int rows = min(GROUP_M, tiles_m - first);
    mt = first + r % rows;
    nt = r / rows;
}

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// ----------------------------------------------------------------------------- mbarriers, TMA
// Makes the initialized barriers visible to the other threads and to the async proxy (TMA); a
// __syncthreads follows.
__device__ __forceinline__ void mbar_fence_init() {
    mbar_fence_init_cluster();
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}
__device__ __forceinline__ void tma_prefetch_desc(const TmaDesc *map) {
    asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<unsigned long long>(map)) : "memory");
}
// The box of `map` at (inner coordinate c0 = k, outer c1 = row) -> shared memory at dst; its bytes
// complete the transaction of barrier `bar`. Out-of-bounds elements are written as zeros.
__device__ __forceinline__ void tma_load_2d(u32 dst, const TmaDesc *map, u32 bar, int c0, int c1) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];"
        ::"r"(dst), "l"(reinterpret_cast<unsigned long long>(map)), "r"(bar), "r"(c0), "r"(c1)
        : "memory");
}

// The same box into shared memory at dst in both blocks of a 2-block cluster (the multicast build), completing
// each block's barrier at `bar` (both addresses are this block's; the copies land at the same offsets).
__device__ __forceinline__ void tma_load_2d_pair(u32 dst, const TmaDesc *map, u32 bar, int c0, int c1) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"
        " [%0], [%1, {%3, %4}], [%2], %5;"
        ::"r"(dst), "l"(reinterpret_cast<unsigned long long>(map)), "r"(bar), "r"(c0), "r"(c1), "h"((unsigned short)3)
        : "memory");
}
// One arrival on the barrier at this shared-memory address in the other block of a 2-block cluster.
__device__ __forceinline__ void mbar_arrive_peer(u32 bar) {
    asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];" ::"r"(cluster_addr(bar, cluster_rank() ^ 1))
                 : "memory");
}

template <int N> __device__ __forceinline__ void setmaxnreg_dec() {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(N));
}
template <int N> __device__ __forceinline__ void setmaxnreg_inc() {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(N));
}

// ------------------------------------------------------------------- split K (the cluster helpers: cluster.cuh)
// The 256 consumer threads (warpgroups 1 and 2) only: named barrier 1 (0 is __syncthreads').
__device__ __forceinline__ void consumers_sync() { asm volatile("bar.sync 1, 256;" ::: "memory"); }
__device__ __forceinline__ void st_shared_f2(u32 addr, float x, float y) {
    asm volatile("st.shared.v2.f32 [%0], {%1, %2};" ::"r"(addr), "f"(x), "f"(y) : "memory");
}

// An output pair of the plain epilogues but the residual one (the persistent kernel's and the split-K one's):
// columns (col, col + 1) of `row` (col even, N % 8 == 0). EPI_XIELU reads its parameters here, pair by pair
// (from L1), rather than holding them in registers across the epilogue's loops.
template <int EPI>
__device__ __forceinline__ void store_pair(void *__restrict__ out, int N, int row, int col, float2 v,
                                           const float *__restrict__ act) {
    static_assert(EPI != EPI_RESIDUAL, "the residual epilogue stores through add_residual");
    const size_t at = (size_t)row * N + col;
    if (EPI == EPI_BF16 || EPI == EPI_XIELU) {
        if (EPI == EPI_XIELU) {
            const float4 a = load_act(act);
            v = make_float2(xielu(v.x, a), xielu(v.y, a));
        }
        *reinterpret_cast<u32 *>(reinterpret_cast<bf16 *>(out) + at) = pack_bf16x2(v.x, v.y);
    } else {
        *reinterpret_cast<float2 *>(reinterpret_cast<float *>(out) + at) = v;
    }
}

// The residual epilogue for P pairs: out[row, col .. col + 1] += v (float32; and the new values at the capture's
// row), where at(p, row, col) names pair p's place and returns its value v; a pair whose row >= M or col >= N is
// skipped. Every old value is loaded before the first store: through one pointer the compiler must keep each load
// after the store before it, so pair by pair the loads would wait one memory latency each (at 128 x 128 tiles
// that was most of the epilogue).
template <int P, typename At>
__device__ __forceinline__ void add_residual(float *__restrict__ out, int M, int N, Capture cap, At at) {
    float2 old[P];
#pragma unroll
    for (int p = 0; p < P; ++p) {
        int row, col;
        at(p, row, col);
        old[p] = row < M && col < N ? *reinterpret_cast<const float2 *>(out + (size_t)row * N + col)
                                    : make_float2(0.f, 0.f);
    }
#pragma unroll
    for (int p = 0; p < P; ++p) {
        int row, col;
        const float2 v = at(p, row, col);
        if (row >= M || col >= N) continue;
        const float2 r = make_float2(old[p].x + v.x, old[p].y + v.y);
        *reinterpret_cast<float2 *>(out + (size_t)row * N + col) = r;
        if (cap.ptr) *reinterpret_cast<float2 *>(cap.ptr + (size_t)row * cap.stride + col) = r;
    }
}

template <int BN> struct Wgmma;
template <> struct Wgmma<64> {
    static __device__ __forceinline__ void run(float (&d)[32], unsigned long long a, unsigned long long b, int acc) {
        wgmma_m64n64k16(d, a, b, acc);
    }
};
template <> struct Wgmma<96> {
    static __device__ __forceinline__ void run(float (&d)[48], unsigned long long a, unsigned long long b, int acc) {
        wgmma_m64n96k16(d, a, b, acc);
    }
};
template <> struct Wgmma<128> {
    static __device__ __forceinline__ void run(float (&d)[64], unsigned long long a, unsigned long long b, int acc) {
        wgmma_m64n128k16(d, a, b, acc);
    }
};
template <> struct Wgmma<160> {
    static __device__ __forceinline__ void run(float (&d)[80], unsigned long long a, unsigned long long b, int acc) {
        wgmma_m64n160k16(d, a, b, acc);
    }
};
template <> struct Wgmma<256> {
    static __device__ __forceinline__ void run(float (&d)[128], unsigned long long a, unsigned long long b, int acc) {
        wgmma_m64n256k16(d, a, b, acc);
    }
};

// ----------------------------------------------------------------------------- split-K epilogue
// The end of a split-K block's tile (KS > 1; see the header): its partial tile (this consumer thread's
// accumulators d) goes to its own shared memory, and after a cluster barrier the block sums its share
// of the tile over the cluster's KS partial tiles, rank 0 first (the same order whichever block sums),
// and stores it through the epilogue. Shares: column blocks u = rank, rank + KS, ... of the tile's 8-column
// blocks (SILU_MUL: 8-output blocks, gate block u with its up block u + BN / 16), all rows.
template <int EPI, int BN, int KS, int MW>
__device__ __forceinline__ void split_epilogue(const float (&d)[MW][BN / 2], void *__restrict__ out, u32 base, int M,
                                               int N, int mt, int nt, int c, int rank, const float *__restrict__ act,
                                               Capture cap) {
    constexpr int PAIRS = BN / 4;                   // float2 pairs a thread a wgmma: (d[mh][2p], d[mh][2p + 1])
    constexpr bool SILU = EPI == EPI_SILU_MUL;
    constexpr int U = SILU ? BN / 16 : BN / 8;      // column blocks of the tile
    constexpr int PU = SILU ? 4 : 2;                // pairs per column block: (gate, up) x (row g, row g + 8)
    constexpr int ITEMS = (U + KS - 1) / KS;        // column blocks of one rank's share, at most
    const int tid = threadIdx.x & 127;
    // Pair p of wgmma mh of thread tid of consumer c at float2 ((c * MW + mh) * PAIRS + p) * 128 + tid from the
    // ring's start: 64 KB (a 128 x 128 tile), 96 KB (256 x 96) or 128 KB (128 x 256), conflict-free (a warp writes
    // 256 contiguous bytes). The ring is idle once both consumer warpgroups have waited for their last wgmma
    // (every stage the producer loaded has been consumed: one tile per block).
    // Wgmma mh's pair p at pairs_at(mh) + 1024 p.
    auto pairs_at = [&](int mh) { return base + (u32)(((c * MW + mh) * PAIRS * 128 + tid) * 8); };
    consumers_sync();
#pragma unroll
    for (int mh = 0; mh < MW; ++mh)
#pragma unroll
        for (int p = 0; p < PAIRS; ++p) st_shared_f2(pairs_at(mh) + p * 1024, d[mh][2 * p], d[mh][2 * p + 1]);
    cluster_sync();

    // Pair p = 2j + h holds columns 8j + 2t, + 1 of row g + 8h (d[4j + 2h + e], the accumulator layout).
    // Items i of the share (column block u = rank + i KS) in chunks of CH, at most 16 pairs: v[i][e] = rank 0's
    // pair + rank 1's + ..., in that order. Branch-free, so that a chunk's loads are in flight together; an
    // item past the share's end (u >= U) repeats the last column block's loads and is not stored.
    const int lane = threadIdx.x & 31, warp = (threadIdx.x >> 5) & 3;
    const int g = lane >> 2, t = lane & 3;
    constexpr int CH = 16 / PU < ITEMS ? 16 / PU : ITEMS;
#pragma unroll
    for (int mh = 0; mh < MW; ++mh) {
        // The 64 rows of wgmma mh: its pairs at `mine`, its rows from row_base (as the persistent epilogue's).
        const u32 mine = pairs_at(mh);
        const int row_base = mt * (MW * BM) + (c * MW + mh) * 64 + warp * 16 + g;
#pragma unroll
        for (int i0 = 0; i0 < ITEMS; i0 += CH) {
            float2 v[CH][PU];
#pragma unroll
            for (int q = 0; q < KS; ++q) {
#pragma unroll
                for (int i = 0; i < CH; ++i) {
                    const int u = min(rank + (i0 + i) * KS, U - 1);
#pragma unroll
                    for (int e = 0; e < PU; ++e) {
                        const int p = 2 * u + (e & 1) + (e >> 1) * (BN / 8);   // e >> 1: the up half (SILU_MUL)
                        const float2 x = ld_cluster_f2(mine + p * 1024, q);
                        if (q == 0) {
                            v[i][e] = x;
                        } else {
                            v[i][e].x += x.x;
                            v[i][e].y += x.y;
                        }
                    }
                }
            }
            if constexpr (EPI == EPI_RESIDUAL) {
                // Pair p: item p / 2, row g + 8 (p % 2); an item past the share's end is not stored (col = N).
                add_residual<2 * CH>(reinterpret_cast<float *>(out), M, N, cap, [&](int p, int &row, int &col) {
                    const int i = p >> 1, h = p & 1, u = rank + (i0 + i) * KS;
                    row = row_base + 8 * h;
                    col = i0 + i < ITEMS && u < U ? nt * BN + 8 * u + 2 * t : N;
                    return v[i][h];
                });
            } else {
#pragma unroll
                for (int i = 0; i < CH; ++i) {
                    const int u = rank + (i0 + i) * KS;
                    if (i0 + i >= ITEMS || u >= U) continue;
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        const int row = row_base + 8 * h;
                        if (row >= M) continue;
                        if constexpr (SILU) {
                            const int half = N / 2, col = nt * (BN / 2) + 8 * u + 2 * t;   // even; half is even
                            if (col >= half) continue;
                            const float2 gt = v[i][h], up = v[i][2 + h];
                            *reinterpret_cast<u32 *>(reinterpret_cast<bf16 *>(out) + (size_t)row * half + col) =
                                    pack_bf16x2(silu_mul(gt.x, up.x), silu_mul(gt.y, up.y));
                        } else {
                            const int col = nt * BN + 8 * u + 2 * t;                       // even; N % 8 == 0
                            if (col < N) store_pair<EPI>(out, N, row, col, v[i][h], act);
                        }
                    }
                }
            }
        }
    }
    cluster_sync();  // no block exits (freeing its shared memory) while another still reads it
}

// ----------------------------------------------------------------------------- the kernel body
template <int EPI, int BN, int KS, bool MC, int TM>
__device__ __forceinline__ void gemm_ws(const TmaDesc *tmA, const TmaDesc *tmW, void *__restrict__ out,
                                        int M, int N, int K, int tile0, int tile1, const float *__restrict__ act,
                                        Capture cap) {
    constexpr int WBOX = BN / 2;                      // rows of one W box
    constexpr int MW = TM / BM;                       // A boxes of 128 rows a tile; m64 wgmmas a consumer a k16
    constexpr int TILE_AT = TM * BK * 2;              // bytes of one stage's A tile
    constexpr int TILE_B = BN * BK * 2;               // bytes of one stage's W tile
    constexpr int STAGES = (TM == BM ? SMEM_TILES : SMEM_TILES_TALL) / (TILE_AT + TILE_B);
    constexpr int R = BN / 2;                         // accumulators a consumer thread and wgmma
    constexpr bool SILU = EPI == EPI_SILU_MUL;
    static_assert(TM == BM || TM == 2 * BM, "tiles of 128 or 256 rows");
    static_assert(2 * STAGES * 8 <= 256, "mbarriers exceed their space");
    static_assert(KS == 1 || 2 * MW * (R / 2) * 128 * 8 <= STAGES * (TILE_AT + TILE_B),
                  "the partial tile fits the ring");
    static_assert(!MC || (KS == 1 && TM == BM), "the multicast build is the persistent kernel's, 128 rows a tile");

    extern __shared__ __align__(1024) unsigned char smem_raw[];
    const u32 base = (smem_addr(smem_raw) + 1023) & ~1023u;
    const u32 sA = base;                              // [STAGES][TM][BK], 128-byte swizzled
    const u32 sB = sA + STAGES * TILE_AT;             // [STAGES][BN][BK]
    const u32 full = sB + STAGES * TILE_B;            // [STAGES] mbarriers
    const u32 empty = full + STAGES * 8;              // [STAGES] mbarriers

    const int half = N / 2;
    const int tiles_m = ceil_div(M, TM);
    const int tiles_n = SILU ? ceil_div(half, WBOX) : ceil_div(N, BN);
    const int ktiles = ceil_div(K, BK);
    // Tiles [tile0, tile1) of the tile order. KS == 1: persistent, tiles tile0 + blockIdx.x, + gridDim.x, ...
    // over all k-steps. KS > 1: one tile per cluster (tile tile0 + blockIdx.x / KS, grid = (tile1 - tile0) * KS),
    // block `rank` of the cluster over k-steps [kbeg, kend).
#define FIRST_TILE (tile0 + (KS > 1 ? (int)blockIdx.x / KS : (int)blockIdx.x))
#define TILE_STRIDE (KS > 1 ? tile1 : (int)gridDim.x)
    const int rank = KS > 1 || MC ? cluster_rank() : 0;
    const int kbeg = KS > 1 ? ktiles * rank / KS : 0;
    const int kend = KS > 1 ? ktiles * (rank + 1) / KS : ktiles;

    if (threadIdx.x == 0) {
#pragma unroll
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(full + 8 * s, 1);
            mbar_init(empty + 8 * s, MC ? 16 : 8);   // MC: both blocks' consumer warps read what the stage holds
        }
        mbar_fence_init();
    }
    __syncthreads();
    if constexpr (MC) cluster_sync();   // the other block's barriers exist before any copy multicast into it

    const int wg = threadIdx.x >> 7;
    if (wg == 0) {
        // ------------------------------------------------------------------- producer
        setmaxnreg_dec<PRODUCER_REGS>();
        if (threadIdx.x == 0) {
            tma_prefetch_desc(tmA);
            tma_prefetch_desc(tmW);
            // What a tile loads: its first A row m0, its W boxes' first rows r0 and r1 (the second box only where
            // `second`), A's boxes (`aboxes`) and a stage's bytes.
            struct Loads {
                int m0, r0, r1, aboxes;
                bool second;
                u32 bytes;
            };
            auto loads_of = [&](int tile) {
                int mt, nt;
                tile_coords(tile, tiles_m, tiles_n, mt, nt);
                Loads l;
                l.m0 = mt * TM;
                l.r0 = SILU ? nt * WBOX : nt * BN;                 // first W box: gate rows, or the first half
                l.r1 = SILU ? half + nt * WBOX : nt * BN + WBOX;   // second: up rows, or the second half
                l.second = l.r1 < N;                               // always with SILU (r0 < half)
                // A's boxes from m0 on, but a 256-row tile's second one when it lies wholly past M: its rows'
                // products (whatever that stage holds) are not stored, and a product row reads its own A row only.
                l.aboxes = MW == 1 || l.m0 + BM < M ? MW : 1;
                l.bytes = l.aboxes * TILE_A + (l.second ? 2 : 1) * WBOX * BK * 2;
                return l;
            };
            auto load_w = [&](const Loads &l, int s, int k0) {
                if constexpr (MC) {
                    // The pair's tiles share W's column tile: rank 0 loads its first box into both blocks,
                    // rank 1 the second.
                    if (rank == 0) tma_load_2d_pair(sB + s * TILE_B, tmW, full + 8 * s, k0, l.r0);
                    else if (l.second) tma_load_2d_pair(sB + s * TILE_B + WBOX * BK * 2, tmW, full + 8 * s, k0, l.r1);
                } else {
                    tma_load_2d(sB + s * TILE_B, tmW, full + 8 * s, k0, l.r0);
                    if (l.second) tma_load_2d(sB + s * TILE_B + WBOX * BK * 2, tmW, full + 8 * s, k0, l.r1);
                }
            };
            // No kernel writes the weights, so the first tile's first STAGES k-steps request their W boxes before
            // pdl_start: the weights' trip from HBM overlaps the end of the kernel before. Their A boxes follow
            // the wait.
            const int first = FIRST_TILE;
            const int early = first < tile1 ? min(STAGES, kend - kbeg) : 0;
            if (early > 0) {
                const Loads l = loads_of(first);
                for (int i = 0; i < early; ++i) {   // stage i's first use: nothing to wait for
                    mbar_arrive_expect_tx(full + 8 * i, l.bytes);
                    load_w(l, i, (kbeg + i) * BK);
                }
            }
            pdl_start();
            int s = 0;
            u32 phase = 0;
            for (int tile = first; tile < tile1; tile += TILE_STRIDE) {
                const Loads l = loads_of(tile);
                for (int kt = kbeg; kt < kend; ++kt) {
                    const bool requested = tile == first && kt - kbeg < early;   // its W boxes, above
                    if (!requested) {
                        mbar_wait(empty + 8 * s, phase ^ 1);          // the consumers are done with stage s
                        mbar_arrive_expect_tx(full + 8 * s, l.bytes);
                    }
                    const int k0 = kt * BK;
#pragma unroll
                    for (int b = 0; b < MW; ++b)
                        if (b < l.aboxes)
                            tma_load_2d(sA + s * TILE_AT + b * TILE_A, tmA, full + 8 * s, k0, l.m0 + b * BM);
                    if (!requested) load_w(l, s, k0);
                    if (++s == STAGES) {
                        s = 0;
                        phase ^= 1;
                    }
                }
            }
        } else {
            pdl_start();
        }
        return;
    }

    // ----------------------------------------------------------------------- consumers
    pdl_start();                                      // before any read of A or write of `out`
    setmaxnreg_inc<CONSUMER_REGS>();
    const int c = wg - 1;                             // rows (TM / 2) c .. (TM / 2) (c + 1) - 1 of the block tile
    const int lane = threadIdx.x & 31, warp = (threadIdx.x >> 5) & 3;
    const int g = lane >> 2, t = lane & 3;
    float d[MW][R];                                   // d[mh]: rows (TM / 2) c + 64 mh .. + 63
#pragma unroll
    for (int mh = 0; mh < MW; ++mh)
#pragma unroll
        for (int i = 0; i < R; ++i) d[mh][i] = 0.f;

    int s = 0;
    u32 phase = 0;
    for (int tile = FIRST_TILE; tile < tile1; tile += TILE_STRIDE) {
        int mt, nt;
        tile_coords(tile, tiles_m, tiles_n, mt, nt);
        int prev = 0;
        for (int kt = kbeg; kt < kend; ++kt) {
            mbar_wait(full + 8 * s, phase);                   // stage s has landed
            const u32 a = sA + s * TILE_AT + c * (TM / 2) * BK * 2, b = sB + s * TILE_B;
            wgmma_fence();
#pragma unroll
            for (int ks = 0; ks < BK / 16; ++ks)
#pragma unroll
                for (int mh = 0; mh < MW; ++mh)
                    Wgmma<BN>::run(d[mh], smem_desc(a + mh * 64 * BK * 2 + ks * 32), smem_desc(b + ks * 32),
                                   ((kt - kbeg) | ks) != 0);
            wgmma_commit();
            wgmma_wait<1>();                                  // k-step kt - 1's group has completed ...
            if (kt > kbeg && lane == 0) {                     // ... so its stage can be refilled
                mbar_arrive(empty + 8 * prev);
                if constexpr (MC) mbar_arrive_peer(empty + 8 * prev);
            }
            prev = s;
            if (++s == STAGES) {
                s = 0;
                phase ^= 1;
            }
        }
        wgmma_wait<0>();
#pragma unroll
        for (int mh = 0; mh < MW; ++mh) fence_regs(d[mh]);
        if (KS == 1 && lane == 0) {
            mbar_arrive(empty + 8 * prev);
            if constexpr (MC) mbar_arrive_peer(empty + 8 * prev);
        }
        if constexpr (KS > 1) {
            split_epilogue<EPI, BN, KS, MW>(d, out, base, M, N, mt, nt, c, rank, act, cap);
            return;  // the last (only) tile of this block: its accumulators are dead from here
        }

#pragma unroll
        for (int mh = 0; mh < MW; ++mh) {
            // Accumulators: warp w of the warpgroup holds rows 16 w + g and + 8; d[4j + e] is column
            // 8j + 2t + (e & 1) of row g + 8 (e >> 1) (the mma.m16n8 fragment layout, BN / 8 blocks of 8 columns).
            const int row_base = mt * TM + c * (TM / 2) + mh * 64 + warp * 16 + g;
            if constexpr (SILU) {
                // Columns c < BN/2: gate of output j0 + c; BN/2 + c: up of the same output.
                const int j0 = nt * WBOX;
#pragma unroll
                for (int j = 0; j < BN / 16; ++j) {
                    const int col = j0 + 8 * j + 2 * t;           // even; half is even, so col + 1 < half too
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        const int row = row_base + 8 * h;
                        const float *gt = d[mh] + 4 * j + 2 * h, *up = d[mh] + 4 * (j + BN / 16) + 2 * h;
                        const u32 v = pack_bf16x2(silu_mul(gt[0], up[0]), silu_mul(gt[1], up[1]));
                        if (row < M && col < half)
                            *reinterpret_cast<u32 *>(reinterpret_cast<bf16 *>(out) + (size_t)row * half + col) = v;
                    }
                }
            } else if constexpr (EPI == EPI_RESIDUAL) {
                // In chunks of 8 column blocks (16 pairs, 16 loads in flight a thread): wide tiles hold 128
                // accumulators a thread, and the chunk's old values must fit beside them. Widths of 96 and 160 (12
                // and 20 column blocks) in chunks of 4.
                constexpr int CJ = (BN / 8) % 8 == 0 ? 8 : 4;
#pragma unroll
                for (int j0 = 0; j0 < BN / 8; j0 += CJ)
                    add_residual<2 * CJ>(reinterpret_cast<float *>(out), M, N, cap, [&](int p, int &row, int &col) {
                        const int j = j0 + (p >> 1), h = p & 1;
                        row = row_base + 8 * h;
                        col = nt * BN + 8 * j + 2 * t;
                        return make_float2(d[mh][4 * j + 2 * h], d[mh][4 * j + 2 * h + 1]);
                    });
            } else {
                const int n0 = nt * BN;
#pragma unroll
                for (int j = 0; j < BN / 8; ++j) {
                    const int col = n0 + 8 * j + 2 * t;           // even; N % 8 == 0, so col + 1 < N too
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        const int row = row_base + 8 * h;
                        if (row >= M || col >= N) continue;
                        const float *v = d[mh] + 4 * j + 2 * h;
                        store_pair<EPI>(out, N, row, col, make_float2(v[0], v[1]), act);
                    }
                }
            }
        }
    }
    if constexpr (MC) cluster_sync();   // no block exits while the other still multicasts into it or arrives on it
}

#undef FIRST_TILE
#undef TILE_STRIDE
#else
template <int EPI, int BN, int KS, bool MC, int TM>
__device__ __forceinline__ void gemm_ws(const TmaDesc *, const TmaDesc *, void *, int, int, int, int, int,
                                        const float *, Capture) {
    pdl_start();
    __trap();
}
#endif

// ============================================================================= kernels
// Every build is gemm_ws<EPI, BN, KS, MC, TM> as an entry point named gemm_tma[_m256][_n{BN}]{TAG}_e{EPI} (no _n for
// BN = 256 with 128-row tiles), ATTR its cluster shape. Arguments (A, W, out, M, N, K, tile0, tile1, tmA, tmW, act,
// cap, cap_stride), A and W the matrices tmA and tmW describe; tiles numbered up to ceil(M / TM) * ceil(N / BN)
// (SILU_MUL: ceil(N / 2 / (BN / 2))); block (384), dynamic shared memory SMEM_BYTES (256-row tiles:
// SMEM_BYTES_TALL).
#define GEMM_KERNEL(NAME, EPI, TM, BN, KS, MC, ATTR)                                                        \
    extern "C" __global__ void __launch_bounds__(THREADS, 1) ATTR NAME(                                     \
            const bf16 *__restrict__ A, const bf16 *__restrict__ W, void *__restrict__ out, int M, int N, int K, \
            int tile0, int tile1, const __grid_constant__ TmaDesc tmA, const __grid_constant__ TmaDesc tmW, \
            const float *__restrict__ act, float *__restrict__ cap, int cap_stride) {                       \
        gemm_ws<EPI, BN, KS, MC, TM>(&tmA, &tmW, out, M, N, K, tile0, tile1, act, Capture{cap, cap_stride});\
    }
// One width's five builds, NAME_e{EPI} for each epilogue.
#define GEMM_EPILOGUES_TM(NAME, TM, BN, KS, MC, ATTR)                                                       \
    GEMM_KERNEL(NAME##_e0, 0, TM, BN, KS, MC, ATTR)                                                         \
    GEMM_KERNEL(NAME##_e1, 1, TM, BN, KS, MC, ATTR)                                                         \
    GEMM_KERNEL(NAME##_e2, 2, TM, BN, KS, MC, ATTR)                                                         \
    GEMM_KERNEL(NAME##_e3, 3, TM, BN, KS, MC, ATTR)                                                         \
    GEMM_KERNEL(NAME##_e4, 4, TM, BN, KS, MC, ATTR)
#define GEMM_EPILOGUES(NAME, BN, KS, MC, ATTR) GEMM_EPILOGUES_TM(NAME, BM, BN, KS, MC, ATTR)
// One kind's ten builds: the five epilogues at each width.
#define GEMM_BUILDS(TAG, KS, MC, ATTR)                                                                      \
    GEMM_EPILOGUES(gemm_tma##TAG, 256, KS, MC, ATTR)                                                        \
    GEMM_EPILOGUES(gemm_tma_n128##TAG, 128, KS, MC, ATTR)
// Cluster shapes, fixed at compile time (__cluster_dims__), so that the plain launch makes the clusters.
#define NO_CLUSTER
#define CLUSTER_2 __cluster_dims__(2, 1, 1)
#define CLUSTER_3 __cluster_dims__(3, 1, 1)
#define CLUSTER_4 __cluster_dims__(4, 1, 1)
// Compiled in nine parts of 5-10 kernels each, at once.
#define KERNEL_PARTS 9

// The persistent kernel, gemm_tma_e{EPI} and gemm_tma_n128_e{EPI}: grid min(tile1 - tile0, SMs).
#if IN_PART(0)
GEMM_BUILDS(, 1, false, NO_CLUSTER)
#endif

// Split K (batched decode, prefill chunks of 65-512 rows, the residual products of prefills, a persistent launch's
// last round), gemm_tma[_n128]_s{KS}_e{EPI}, KS = 2, 3, 4 blocks per cluster: grid (tile1 - tile0) * KS exactly.
#if IN_PART(1)
GEMM_BUILDS(_s2, 2, false, CLUSTER_2)
#endif
#if IN_PART(2)
GEMM_BUILDS(_s3, 3, false, CLUSTER_3)
#endif
#if IN_PART(3)
GEMM_BUILDS(_s4, 4, false, CLUSTER_4)
#endif

// Multicast, gemm_tma[_n128]_mc_e{EPI}: the persistent kernel in clusters of 2 blocks on pairs of row tiles (2q,
// 2q + 1 of the tile order) under one W column tile, each block loading one of the two W boxes into both. Grid
// even, tile0 even, ceil(M / 128) even (so that the tile order's pairs share a column tile).
#if IN_PART(4)
GEMM_BUILDS(_mc, 1, true, CLUSTER_2)
#endif

// The persistent kernel at the widths that fill rounds: gemm_tma_n96_e{EPI}, gemm_tma_n160_e{EPI}, gemm_tma_n64_e{EPI}.
#if IN_PART(5)
GEMM_EPILOGUES(gemm_tma_n96, 96, 1, false, NO_CLUSTER)
GEMM_EPILOGUES(gemm_tma_n160, 160, 1, false, NO_CLUSTER)
GEMM_EPILOGUES(gemm_tma_n64, 64, 1, false, NO_CLUSTER)
#endif

// Split K 2 and 4 ways on 96-wide tiles, gemm_tma_n96_s{KS}_e{EPI} (routing.py TMA_ROUND_SPLITS).
#if IN_PART(6)
GEMM_EPILOGUES(gemm_tma_n96_s2, 96, 2, false, CLUSTER_2)
GEMM_EPILOGUES(gemm_tma_n96_s4, 96, 4, false, CLUSTER_4)
#endif

// Tiles of 256 rows (two A boxes a stage, each consumer 128 rows in two m64 wgmmas a k16), dynamic shared memory
// SMEM_BYTES_TALL: gemm_tma_m256_n96_e{EPI}, gemm_tma_m256_n96_s4_e{EPI}, gemm_tma_m256_n160_e{EPI}
// (routing.py TMA_TALL_SPLITS).
#if IN_PART(7)
GEMM_EPILOGUES_TM(gemm_tma_m256_n96, 256, 96, 1, false, NO_CLUSTER)
GEMM_EPILOGUES_TM(gemm_tma_m256_n96_s4, 256, 96, 4, false, CLUSTER_4)
#endif
#if IN_PART(8)
GEMM_EPILOGUES_TM(gemm_tma_m256_n160, 256, 160, 1, false, NO_CLUSTER)
#endif
