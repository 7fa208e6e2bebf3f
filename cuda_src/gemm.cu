// Prefill matrix products C[m, n] = sum_k A[m, k] * W[n, k] on tensor cores.
//
// A: [M, K] bf16 activations, W: [N, K] bf16 weights (Hugging Face [out, in]), K % 8 == 0.
// Block tile 128x128, k-step 64, three cp.async stages; 8 warps as 2 (M) x 4 (N), each
// owning a 64x32 tile computed with mma.m16n8k16 (bf16 in, f32 accumulate). Shared-memory
// rows are 128 bytes; the 16-byte chunk c of row r lives at chunk c ^ (r % 8), so the eight
// rows an ldmatrix reads fall in eight different bank groups.
//
// Epilogues as in gemv.cu. For SILU_MUL, W is [gate; up] (N = 2 * intermediate) and the
// tile loader interleaves gate row j and up row j into adjacent tile rows, so each thread
// holds gate and up of the same output column in one accumulator pair.
#include "common.cuh"

enum Epilogue { EPI_BF16 = 0, EPI_RESIDUAL = 1, EPI_SILU_MUL = 2, EPI_F32 = 3 };

#define BM 128
#define BN 128
#define BK 64
#define STAGES 3
#define THREADS 256
#define SMEM_BYTES (STAGES * (BM + BN) * BK * 2)

__device__ __forceinline__ int swz(int r, int c) { return r * BK + ((c ^ (r & 7)) << 3); }  // element offset

template <int EPI>
__device__ __forceinline__ void load_stage(bf16 *sA, bf16 *sB, const bf16 *__restrict__ A,
                                           const bf16 *__restrict__ W, int M, int N, int K, int m0, int n0, int k0) {
#pragma unroll
    for (int i = 0; i < (BM * BK / 8) / THREADS; ++i) {
        const int idx = threadIdx.x + i * THREADS, r = idx >> 3, c = idx & 7;
        const int gm = m0 + r, gk = k0 + c * 8;
        const bool ok = gm < M && gk < K;
        cp_async16(smem_addr(sA + swz(r, c)), ok ? A + (size_t)gm * K + gk : A, ok);
    }
#pragma unroll
    for (int i = 0; i < (BN * BK / 8) / THREADS; ++i) {
        const int idx = threadIdx.x + i * THREADS, r = idx >> 3, c = idx & 7;
        int gn;
        bool ok = tile_weight_row(r, n0, N, EPI == EPI_SILU_MUL, gn);
        const int gk = k0 + c * 8;
        ok = ok && gk < K;
        cp_async16(smem_addr(sB + swz(r, c)), ok ? W + (size_t)gn * K + gk : W, ok);
    }
}

template <int EPI>
__device__ __forceinline__ void gemm_block(const bf16 *__restrict__ A, const bf16 *__restrict__ W,
                                           void *__restrict__ out, int M, int N, int K) {
    extern __shared__ __align__(128) unsigned char smem[];
    bf16 *sA = reinterpret_cast<bf16 *>(smem);
    bf16 *sB = sA + STAGES * BM * BK;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int wm = warp >> 2, wn = warp & 3;
    const int m0 = blockIdx.y * BM, n0 = blockIdx.x * BN;
    const int ktiles = ceil_div(K, BK);

    float acc[4][4][4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int v = 0; v < 4; ++v) acc[i][j][v] = 0.f;

#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < ktiles) load_stage<EPI>(sA + s * BM * BK, sB + s * BN * BK, A, W, M, N, K, m0, n0, s * BK);
        cp_async_commit();
    }

    for (int kt = 0; kt < ktiles; ++kt) {
        cp_async_wait<STAGES - 2>();
        __syncthreads();  // tile kt is visible to all; everyone is done with tile kt-1's stage
        const int next = kt + STAGES - 1;
        if (next < ktiles) {
            const int s = next % STAGES;
            load_stage<EPI>(sA + s * BM * BK, sB + s * BN * BK, A, W, M, N, K, m0, n0, next * BK);
        }
        cp_async_commit();

        const bf16 *tA = sA + (kt % STAGES) * BM * BK;
        const bf16 *tB = sB + (kt % STAGES) * BN * BK;
#pragma unroll
        for (int ks = 0; ks < BK / 16; ++ks) {
            u32 a[4][4], b[4][2];
#pragma unroll
            for (int mt = 0; mt < 4; ++mt) {
                const int r = wm * 64 + mt * 16 + (lane & 15), c = ks * 2 + (lane >> 4);
                ldmatrix_x4(a[mt], smem_addr(tA + swz(r, c)));
            }
#pragma unroll
            for (int np = 0; np < 2; ++np) {
                const int r = wn * 32 + np * 16 + (lane & 7) + ((lane >> 4) << 3);
                const int c = ks * 2 + ((lane >> 3) & 1);
                u32 q[4];
                ldmatrix_x4(q, smem_addr(tB + swz(r, c)));
                b[2 * np][0] = q[0]; b[2 * np][1] = q[1];
                b[2 * np + 1][0] = q[2]; b[2 * np + 1][1] = q[3];
            }
#pragma unroll
            for (int mt = 0; mt < 4; ++mt)
#pragma unroll
                for (int nt = 0; nt < 4; ++nt) mma_bf16_16816(acc[mt][nt], a[mt], b[nt]);
        }
    }
    cp_async_wait<0>();

    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int mt = 0; mt < 4; ++mt) {
#pragma unroll
        for (int nt = 0; nt < 4; ++nt) {
            const int col = n0 + wn * 32 + nt * 8 + 2 * t;
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int row = m0 + wm * 64 + mt * 16 + g + 8 * h;
                const float v0 = acc[mt][nt][2 * h], v1 = acc[mt][nt][2 * h + 1];
                if (row >= M) continue;
                if (EPI == EPI_SILU_MUL) {
                    const int j = col >> 1, half = N / 2;
                    if (j < half)
                        reinterpret_cast<bf16 *>(out)[(size_t)row * half + j] = f32_to_bf16(v0 / (1.f + __expf(-v0)) * v1);
                } else if (col < N) {
                    const size_t at = (size_t)row * N + col;
                    if (EPI == EPI_BF16) {
                        *reinterpret_cast<u32 *>(reinterpret_cast<bf16 *>(out) + at) = pack_bf16x2(v0, v1);
                    } else if (EPI == EPI_RESIDUAL) {
                        float2 *o = reinterpret_cast<float2 *>(reinterpret_cast<float *>(out) + at);
                        float2 r = *o;
                        *o = make_float2(r.x + v0, r.y + v1);
                    } else {
                        *reinterpret_cast<float2 *>(reinterpret_cast<float *>(out) + at) = make_float2(v0, v1);
                    }
                }
            }
        }
    }
}

// ============================================================================= kernels
// grid (ceil(N / 128), ceil(M / 128)), block (256), dynamic shared memory SMEM_BYTES (96 KB).
#define GEMM_KERNEL(EPI)                                                                                   \
    extern "C" __global__ void __launch_bounds__(THREADS) gemm_e##EPI(                                    \
            const bf16 *__restrict__ A, const bf16 *__restrict__ W, void *__restrict__ out, int M, int N, int K) { \
        pdl_start();                                                                                      \
        gemm_block<EPI>(A, W, out, M, N, K);                                                              \
    }
GEMM_KERNEL(0)
GEMM_KERNEL(1)
GEMM_KERNEL(2)
GEMM_KERNEL(3)
