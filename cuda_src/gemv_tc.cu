// Decode products for a few rows of x (M <= 16: small decode batches, a speculative verify step of
// k + 1 tokens) on tensor cores, with the GEMV's memory behaviour (gemv.cu): every weight byte read
// once, straight from HBM into registers with 16-byte streaming loads, no shared-memory staging. On
// qwen3-8b's matrices M = 5 costs 5-11% more than M = 1 here, where the FMA GEMV's work grows with M
// (1.2-1.6x slower at M = 5) and the small GEMM, which stages W through shared memory, streamed o_proj
// and down_proj at 1.9-2.4 TB/s (scripts/bench_gemm_small.py, H200).
//
// out^T = W x^T with mma.m16n8k16: W rows are the A operand (16 output features per warp), x rows the
// B operand (n8: up to 8 rows of x per mma; NT = 2 tiles for M <= 16). For one k16 step, lane
// (g = lane / 4, t = lane % 4) holds A = W[g][2t, 2t+1], W[g+8][2t, 2t+1], W[g][2t+8, 2t+9],
// W[g+8][2t+8, 2t+9] and B = x[g][2t, 2t+1], x[g][2t+8, 2t+9]; C = out features g and g+8 of x rows
// 2t and 2t+1 (PTX ISA, mma.m16n8k16 fragments). A dot product may take its k in any order as long as
// A and B use the same one, so lane t's 16-byte load of W[g][8t, 8t+8) (physical k) feeds two k16
// steps: elements 0-1 and 2-3 become logical k 2t..2t+1 and 2t+8..2t+9 of the first, 4-7 the same of
// the second; the 16-byte load of x[g][8t, 8t+8) lines up with it. A k-block is 32 * LOADS elements:
// LOADS such loads per row (u at 32u), i.e. 64 * LOADS contiguous bytes of each of the warp's 16 rows.
//
// A warp owns one tile of 16 features: W rows 16T .. 16T+15, or for SiLU(gate) * up (W = [gate; up],
// N = 2 I) gate rows 8T .. 8T+7 as tile rows 0-7 and the matching up rows as 8-15, so lane (g, t) ends
// with gate and up of feature 8T + g in c0/c1 and c2/c3. `ksplit` warps (1, 2, 4, 8; consecutive in
// the block) share a tile for matrices with few rows, taking k-blocks kpart, kpart + ksplit, ...;
// their partial tiles meet in shared memory, summed in warp order (deterministic).
//
// x is [M, K] bf16, W [N, K] bf16 (Hugging Face's [out, in]), K % 8 == 0; x rows are read through L1.
// Epilogues as gemv.cu: 0 bf16 out [M, N], 1 float32 out [M, N] +=, 2 SiLU(gate) * up bf16 [M, N/2],
// 3 float32 out [M, N].
#include "common.cuh"

enum Epilogue { EPI_BF16 = 0, EPI_RESIDUAL = 1, EPI_SILU_MUL = 2, EPI_F32 = 3 };

#define WARPS 8

// W row of tile row r (0..15) of tile T; false past the end.
template <int EPI>
__device__ __forceinline__ bool tc_row(int T, int r, int N, int &row) {
    if (EPI == EPI_SILU_MUL) {
        const int half = N / 2, j = T * 8 + (r & 7);
        row = r < 8 ? j : half + j;
        return j < half;
    }
    row = T * 16 + r;
    return row < N;
}

// LOADS 16-byte loads per row per k-block (KB = 32 * LOADS elements): 4, or 8 for long rows, where
// a warp's few k-blocks must each carry more bytes (qwen3-8b down_proj, K = 12288: 39.4 -> 34.6 us at
// M = 5 on the H200; shorter rows were as fast or slower with 8).
template <int NT, int EPI, int LOADS>
__device__ __forceinline__ void gemv_tc_tile(const bf16 *__restrict__ x, const bf16 *__restrict__ W,
                                             void *__restrict__ out, int M, int N, int K, int T, int kpart,
                                             int ksplit, float (*partial)[NT * 4][32]) {
    constexpr int KB = 32 * LOADS;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    int ra, rb;
    const bool va = tc_row<EPI>(T, g, N, ra), vb = tc_row<EPI>(T, g + 8, N, rb);
    const bf16 *wa = W + (size_t)(va ? ra : 0) * K, *wb = W + (size_t)(vb ? rb : 0) * K;

    float acc[NT][4];
#pragma unroll
    for (int n = 0; n < NT; ++n)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[n][i] = 0.f;

    // The first k-block's weight loads are issued before waiting for the kernel before this one
    // (weights depend on nothing); x is read only after the wait.
    bool started = false;
    const vec16 zero = {{0u, 0u, 0u, 0u}};
    for (int kb = kpart * KB; kb < K; kb += KB * ksplit) {
        vec16 a[LOADS], b[LOADS];
#pragma unroll
        for (int u = 0; u < LOADS; ++u) {
            const int k = kb + 32 * u + 8 * t;
            a[u] = va && k < K ? ld16_stream(wa + k) : zero;
            b[u] = vb && k < K ? ld16_stream(wb + k) : zero;
        }
        if (!started) { pdl_start(); started = true; }
#pragma unroll
        for (int u = 0; u < LOADS; ++u) {
            const int k = kb + 32 * u + 8 * t;
            if (kb + 32 * u >= K) break;  // warp-uniform: every lane still takes part in each mma below
            const u32 a0[4] = {a[u].w[0], b[u].w[0], a[u].w[1], b[u].w[1]};
            const u32 a1[4] = {a[u].w[2], b[u].w[2], a[u].w[3], b[u].w[3]};
#pragma unroll
            for (int n = 0; n < NT; ++n) {
                const int m = n * 8 + g;
                const vec16 xv = m < M && k < K ? ld16(x + (size_t)m * K + k) : zero;
                const u32 b0[2] = {xv.w[0], xv.w[1]}, b1[2] = {xv.w[2], xv.w[3]};
                mma_bf16_16816(acc[n], a0, b0);
                mma_bf16_16816(acc[n], a1, b1);
            }
        }
    }
    if (!started) pdl_start();

    if (ksplit > 1) {  // the ksplit warps of a tile are consecutive: the first sums them in order
#pragma unroll
        for (int n = 0; n < NT; ++n)
#pragma unroll
            for (int i = 0; i < 4; ++i) partial[warp][n * 4 + i][lane] = acc[n][i];
        __syncthreads();
        if (kpart != 0) return;
#pragma unroll
        for (int n = 0; n < NT; ++n)
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                float s = partial[warp][n * 4 + i][lane];
                for (int w = warp + 1; w < warp + ksplit; ++w) s += partial[w][n * 4 + i][lane];
                acc[n][i] = s;
            }
    }

#pragma unroll
    for (int n = 0; n < NT; ++n)
#pragma unroll
        for (int c = 0; c < 2; ++c) {  // x rows 2t and 2t + 1 of tile n
            const int m = n * 8 + 2 * t + c;
            if (m >= M) continue;
            const float lo = acc[n][c], hi = acc[n][2 + c];  // features g and g + 8 of the tile
            if (EPI == EPI_SILU_MUL) {
                if (va) {
                    const int half = N / 2;
                    reinterpret_cast<bf16 *>(out)[(size_t)m * half + ra] = f32_to_bf16(lo / (1.f + __expf(-lo)) * hi);
                }
            } else if (EPI == EPI_BF16) {
                bf16 *o = reinterpret_cast<bf16 *>(out) + (size_t)m * N;
                if (va) o[ra] = f32_to_bf16(lo);
                if (vb) o[rb] = f32_to_bf16(hi);
            } else if (EPI == EPI_RESIDUAL) {
                float *o = reinterpret_cast<float *>(out) + (size_t)m * N;
                if (va) o[ra] += lo;
                if (vb) o[rb] += hi;
            } else {
                float *o = reinterpret_cast<float *>(out) + (size_t)m * N;
                if (va) o[ra] = lo;
                if (vb) o[rb] = hi;
            }
        }
}

// ============================================================================= kernels
// gemv_tc_m{8,16}_l{4,8}_e{EPI}(x, W, out, M, N, K, ksplit): grid (ceil(tiles * ksplit / 8)), block (256);
// tiles = ceil(N / 16), or N / 16 rounded up for SiLU (8 features of [gate; up] per tile); M <= 8 for
// m8 (one n8 tile), <= 16 for m16; l: LOADS; ksplit in {1, 2, 4, 8} warps per tile.
#define GEMV_TC_KERNEL(ROWS, NT, LOADS, EPI)                                                            \
    extern "C" __global__ void __launch_bounds__(WARPS * 32)                                            \
        gemv_tc_m##ROWS##_l##LOADS##_e##EPI(const bf16 *__restrict__ x, const bf16 *__restrict__ W,     \
                                            void *__restrict__ out, int M, int N, int K, int ksplit) {  \
        __shared__ float partial[WARPS][NT * 4][32];                                                    \
        const int warp = threadIdx.x >> 5;                                                              \
        gemv_tc_tile<NT, EPI, LOADS>(x, W, out, M, N, K, (blockIdx.x * WARPS + warp) / ksplit, warp % ksplit, \
                                     ksplit, partial);                                                  \
    }
#define GEMV_TC_ALL_EPI(ROWS, NT, LOADS)                                                                \
    GEMV_TC_KERNEL(ROWS, NT, LOADS, 0) GEMV_TC_KERNEL(ROWS, NT, LOADS, 1) GEMV_TC_KERNEL(ROWS, NT, LOADS, 2) \
    GEMV_TC_KERNEL(ROWS, NT, LOADS, 3)
GEMV_TC_ALL_EPI(8, 1, 4)
GEMV_TC_ALL_EPI(16, 2, 4)
GEMV_TC_ALL_EPI(8, 1, 8)
GEMV_TC_ALL_EPI(16, 2, 8)
