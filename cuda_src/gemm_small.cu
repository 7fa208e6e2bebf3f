// Matrix products for small M on tensor cores: C[m, n] = sum_k A[m, k] * W[n, k], M ~ 9..256
// (decode steps with continuous batching). Same math and epilogues as gemm_tma.cu (prefill).
//
// A: [M, K] bf16 activations, W: [N, K] bf16 weights (Hugging Face [out, in]); K % 8 == 0, N % 8 == 0.
//
// Why another GEMM: at these M a step reads every weight once and does ~M flops per weight byte,
// so it is bound by HBM bandwidth (4.3 TB/s on the H200, GPU.md), not by tensor cores (M = 64 needs
// 64 flop/B * 4.3 TB/s = 275 TFLOP/s). 128-row prefill tiles give N = 1024 only 8 column blocks of 128:
// 8 of 132 SMs stream the whole matrix. Here every SM has to be streaming W.
//
// Tiling. A block owns BN = 64 W rows (output columns) and a tile of ROWS = 16 * MT rows of A
// (MT = 1, 2, 4: 16, 32, 64 rows; grid.y walks M in tiles, rows >= M are zero-filled and never
// stored). Its 4 warps split K, not N: every warp computes the whole ROWS x 64 tile over its own
// k-chunks (64 wide), so a warp's loads are 64 rows x 128 contiguous bytes of W plus ROWS x 128
// bytes of A. Every column block reads A (from L2): M / 64 times the bytes of W. Beyond 64 rows each
// M tile re-reads W, from L2 (those blocks run side by side); there, for large N, gemm_tma.cu's 128-row
// tiles move fewer bytes and may win: measure (scripts/bench_gemm_small.py).
//
// Pipelines. Each warp runs its own cp.async pipeline (STAGES chunks in its private smem, only
// __syncwarp inside the loop): warps drift freely and no block barrier stalls the loads. The
// load of chunk j + STAGES - 1 is issued before waiting for chunk j (its stage was consumed at
// j - 1), so STAGES chunks are in flight per warp: 2 * 8 KB of W for MT = 1, 2 (80 / 96 KB of
// smem: two blocks per SM, 128 KB of W in flight per SM) and 3 * 8 KB for MT = 4 (192 KB: one
// block per SM). Little's law needs ~4.3 TB/s * ~1 us / 132 SMs ~ 33 KB in flight per SM.
// Shared-memory rows are 128 bytes with chunk c of row r at c ^ (r % 8) and fragments come
// from ldmatrix (conflict-free).
//
// Split K across blocks (KS, a compile-time thread-block cluster). 64-column blocks still leave
// N = 1024 with 16 blocks, so the KS blocks of a cluster share one tile's K range: the KS * 4
// warps of a cluster take chunks worker, worker + KS * 4, ... (worker = rank * 4 + warp), i.e.
// each row is read as consecutive 128-byte pieces by consecutive warps. Partial tiles are summed
// in a fixed order: first the 4 warps of a block through shared memory, then the KS blocks
// through distributed shared memory (ld.shared::cluster), block `rank` finishing its share of the
// tile. That works for every epilogue (SiLU(gate) * up included), needs no workspace and no atomics,
// and is deterministic (grid-level split-K with float atomicAdd would make `out +=` depend on
// arrival order). The cluster shape is fixed at compile time (__cluster_dims__), so the plain
// cuLaunchKernel launches it; KS in {1, 2, 4, 8} (8 is the portable cluster limit).
//
// Epilogues as in gemm_tma.cu / gemv.cu: 0 bf16 out, 1 float32 out += (residual stream), 2 SiLU(gate)
// * up with W = [gate; up] (N = 2 * intermediate; the loader interleaves gate row j and up row j
// into adjacent tile rows, so each accumulator pair holds gate_j and up_j; out is [M, N / 2]),
// 3 float32 out (logits).
#include "cluster.cuh"

enum Epilogue { EPI_BF16 = 0, EPI_RESIDUAL = 1, EPI_SILU_MUL = 2, EPI_F32 = 3 };

#define BN 64                  // W rows per block (output columns; gate/up interleaved for SILU_MUL)
#define BK 64                  // k per chunk: one 128-byte shared-memory row
#define WARPS 4                // warps per block, each with its own k-chunks and pipeline
#define THREADS (WARPS * 32)
#define NT (BN / 8)            // n8 mma tiles across the block's columns

template <int MT> struct Tile {
    static constexpr int ROWS = 16 * MT;                        // rows of A per block
    static constexpr int STAGES = MT == 4 ? 3 : 2;              // chunks in flight per warp
    static constexpr int CHUNK = (ROWS + BN) * BK;              // bf16 elements: A tile, then W tile
    static constexpr int SMEM = WARPS * STAGES * CHUNK * 2;     // bytes: 80, 96, 192 KB
    static constexpr int PAIRS = MT * NT * 2;                   // accumulator pairs per lane
    static constexpr int RED = (WARPS + 1) * PAIRS * 32 * 8;    // reduction: per-warp + block sums
    static_assert(RED <= SMEM, "the reduction reuses the pipeline's shared memory");
};

__device__ __forceinline__ int swz(int r, int c) { return r * BK + ((c ^ (r & 7)) << 3); }  // element offset

// ----------------------------------------------------------------------------- helpers
// One warp copies k-chunk [k0, k0 + 64) of its A tile and W tile into one stage (zero-filled outside).
template <int MT>
__device__ __forceinline__ void load_chunk(bf16 *sA, bf16 *sW, const bf16 *__restrict__ A,
                                           const bf16 *__restrict__ W, int M, int N, int K, int m0, int n0,
                                           int k0, int lane, bool silu) {
#pragma unroll
    for (int i = 0; i < Tile<MT>::ROWS / 4; ++i) {  // ROWS * 8 16-byte pieces, 32 lanes
        const int idx = lane + i * 32, r = idx >> 3, c = idx & 7;
        const int gm = m0 + r, gk = k0 + c * 8;
        const bool ok = gm < M && gk < K;
        cp_async16(smem_addr(sA + swz(r, c)), ok ? A + (size_t)gm * K + gk : A, ok);
    }
#pragma unroll
    for (int i = 0; i < BN / 4; ++i) {
        const int idx = lane + i * 32, r = idx >> 3, c = idx & 7;
        int gn;
        bool ok = tile_weight_row(r, n0, N, silu, gn);
        const int gk = k0 + c * 8;
        ok = ok && gk < K;
        cp_async16(smem_addr(sW + swz(r, c)), ok ? W + (size_t)gn * K + gk : W, ok);
    }
}

// Store the adjacent columns (col, col + 1) of one row; col is even and N % 8 == 0.
__device__ __forceinline__ void store_pair(void *__restrict__ out, int M, int N, int epi, int row, int col, float2 v) {
    if (row >= M) return;
    if (epi == EPI_SILU_MUL) {
        const int j = col >> 1, half = N / 2;
        if (j < half) reinterpret_cast<bf16 *>(out)[(size_t)row * half + j] = f32_to_bf16(v.x / (1.f + __expf(-v.x)) * v.y);
    } else if (col < N) {
        const size_t at = (size_t)row * N + col;
        if (epi == EPI_BF16) {
            *reinterpret_cast<u32 *>(reinterpret_cast<bf16 *>(out) + at) = pack_bf16x2(v.x, v.y);
        } else if (epi == EPI_RESIDUAL) {
            float2 *o = reinterpret_cast<float2 *>(reinterpret_cast<float *>(out) + at);
            const float2 r = *o;
            *o = make_float2(r.x + v.x, r.y + v.y);
        } else {
            *reinterpret_cast<float2 *>(reinterpret_cast<float *>(out) + at) = v;
        }
    }
}

// Accumulator pair p = (mt * NT + nt) * 2 + h of lane (g, t) holds tile row mt*16 + g + 8h, columns nt*8 + 2t, +1.
__device__ __forceinline__ int pair_row(int p, int lane) { return (p / (2 * NT)) * 16 + (lane >> 2) + 8 * (p & 1); }
__device__ __forceinline__ int pair_col(int p, int lane) { return ((p >> 1) % NT) * 8 + 2 * (lane & 3); }

template <int MT, int KS>
__device__ __forceinline__ void gemm_small_block(const bf16 *__restrict__ A, const bf16 *__restrict__ W,
                                                 void *__restrict__ out, int M, int N, int K, int epi) {
    using T = Tile<MT>;
    extern __shared__ __align__(128) unsigned char smem[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int rank = KS > 1 ? cluster_rank() : 0;  // == blockIdx.x: this block's share of K
    const int m0 = blockIdx.y * T::ROWS, n0 = blockIdx.z * BN;
    const int chunks = ceil_div(K, BK);
    const int worker = rank * WARPS + warp, workers = KS * WARPS;
    const int mine = worker < chunks ? ceil_div(chunks - worker, workers) : 0;  // this warp's k-chunks
    const bool silu = epi == EPI_SILU_MUL;
    bf16 *stages = reinterpret_cast<bf16 *>(smem) + warp * T::STAGES * T::CHUNK;

    float acc[MT][NT][4];
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int v = 0; v < 4; ++v) acc[i][j][v] = 0.f;

#pragma unroll
    for (int s = 0; s < T::STAGES - 1; ++s) {
        if (s < mine) {
            bf16 *sA = stages + s * T::CHUNK;
            load_chunk<MT>(sA, sA + T::ROWS * BK, A, W, M, N, K, m0, n0, (worker + s * workers) * BK, lane, silu);
        }
        cp_async_commit();
    }

    for (int j = 0; j < mine; ++j) {
        __syncwarp();  // every lane is done reading stage (j - 1) % STAGES, which the next load refills
        const int next = j + T::STAGES - 1;
        if (next < mine) {
            bf16 *sA = stages + (next % T::STAGES) * T::CHUNK;
            load_chunk<MT>(sA, sA + T::ROWS * BK, A, W, M, N, K, m0, n0, (worker + next * workers) * BK, lane, silu);
        }
        cp_async_commit();
        cp_async_wait<T::STAGES - 1>();  // chunk j has landed (this lane's copies) ...
        __syncwarp();                     // ... and every lane's

        const bf16 *tA = stages + (j % T::STAGES) * T::CHUNK;
        const bf16 *tW = tA + T::ROWS * BK;
#pragma unroll
        for (int ks = 0; ks < BK / 16; ++ks) {
            u32 a[MT][4];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                const int r = mt * 16 + (lane & 15), c = ks * 2 + (lane >> 4);
                ldmatrix_x4(a[mt], smem_addr(tA + swz(r, c)));
            }
#pragma unroll
            for (int np = 0; np < NT / 2; ++np) {
                const int r = np * 16 + (lane & 7) + ((lane >> 4) << 3);
                const int c = ks * 2 + ((lane >> 3) & 1);
                u32 q[4];
                ldmatrix_x4(q, smem_addr(tW + swz(r, c)));
                const u32 b0[2] = {q[0], q[1]}, b1[2] = {q[2], q[3]};
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    mma_bf16_16816(acc[mt][2 * np], a[mt], b0);
                    mma_bf16_16816(acc[mt][2 * np + 1], a[mt], b1);
                }
            }
        }
    }
    cp_async_wait<0>();  // only empty groups remain; the pipeline's shared memory is reused below
    __syncthreads();

    // Partial tiles of the 4 warps, summed in warp order: part[warp][pair][lane], tot[pair][lane].
    float2 *part = reinterpret_cast<float2 *>(smem);
    float2 *tot = part + WARPS * T::PAIRS * 32;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int h = 0; h < 2; ++h)
                part[(warp * T::PAIRS + (mt * NT + nt) * 2 + h) * 32 + lane] =
                        make_float2(acc[mt][nt][2 * h], acc[mt][nt][2 * h + 1]);
    __syncthreads();

    for (int p = warp; p < T::PAIRS; p += WARPS) {
        float2 v = part[p * 32 + lane];
#pragma unroll
        for (int w = 1; w < WARPS; ++w) {
            const float2 u = part[(w * T::PAIRS + p) * 32 + lane];
            v.x += u.x;
            v.y += u.y;
        }
        if (KS == 1) store_pair(out, M, N, epi, m0 + pair_row(p, lane), n0 + pair_col(p, lane), v);
        else tot[p * 32 + lane] = v;
    }
    if (KS > 1) {
        // Block sums of the cluster, summed in rank order; block `rank` finishes pairs rank*4 + warp, + 4*KS, ...
        cluster_sync();
        for (int p = worker; p < T::PAIRS; p += workers) {
            const u32 at = smem_addr(tot + p * 32 + lane);
            float2 v = ld_cluster_f2(at, 0);
#pragma unroll
            for (int r = 1; r < KS; ++r) {
                const float2 u = ld_cluster_f2(at, r);
                v.x += u.x;
                v.y += u.y;
            }
            store_pair(out, M, N, epi, m0 + pair_row(p, lane), n0 + pair_col(p, lane), v);
        }
        cluster_sync();  // no block exits (freeing its shared memory) while another still reads it
    }
}

// ============================================================================= kernels
// gemm_small_m{ROWS}_c{KS}(A, W, out, M, N, K, epi): grid (KS, ceil(M / ROWS), ceil(N / 64)), block (128),
// dynamic shared memory Tile<MT>::SMEM (ROWS 16: 81,920 B; 32: 98,304 B; 64: 196,608 B). KS > 1 kernels
// are clusters of (KS, 1, 1) blocks: the KS blocks of a cluster split K. The x-fastest launch order puts
// the blocks that share W columns (splits, then M tiles) next to each other, so W is read from HBM once.
// `epi` is a kernel argument rather than a template parameter: it only picks the loader's row order and
// the store, and 12 kernels compile in a quarter of the time of 48 (~5 s with NVRTC).
// Registers (ptxas 13.0, sm_90a), no spills: m16 ~165, m32 168-215, m64 214-224 per thread; occupancy
// is set by shared memory (two blocks per SM for m16 / m32, one for m64). The split is chosen by
// small_gemm_config in tileinfer/kernels/linear.py.
#define GEMM_SMALL_KERNEL(MT, ROWS, KS, CLUSTER)                                                          \
    extern "C" __global__ void __launch_bounds__(THREADS) CLUSTER gemm_small_m##ROWS##_c##KS(            \
            const bf16 *__restrict__ A, const bf16 *__restrict__ W, void *__restrict__ out, int M, int N, int K, \
            int epi) {                                                                                    \
        pdl_start();                                                                                      \
        gemm_small_block<MT, KS>(A, W, out, M, N, K, epi);                                               \
    }
#define GEMM_SMALL_SPLITS(MT, ROWS)                                                                       \
    GEMM_SMALL_KERNEL(MT, ROWS, 1, )                                                                     \
    GEMM_SMALL_KERNEL(MT, ROWS, 2, __cluster_dims__(2, 1, 1))                                            \
    GEMM_SMALL_KERNEL(MT, ROWS, 4, __cluster_dims__(4, 1, 1))                                            \
    GEMM_SMALL_KERNEL(MT, ROWS, 8, __cluster_dims__(8, 1, 1))
GEMM_SMALL_SPLITS(1, 16)
GEMM_SMALL_SPLITS(2, 32)
GEMM_SMALL_SPLITS(4, 64)
