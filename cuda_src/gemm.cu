// Prefill matrix products C[m, n] = sum_k A[m, k] * W[n, k] on Hopper's warpgroup tensor-core
// instructions (wgmma, sm_90a).
//
// A: [M, K] bf16 activations, W: [N, K] bf16 weights (Hugging Face [out, in]), K % 8 == 0.
// Block tile 128 x 128, k-step 64, STAGES cp.async stages; 2 warpgroups (256 threads), each
// computing 64 rows x 128 columns with wgmma.m64n128k16 (bf16 in, f32 accumulators in registers,
// both operands read by the tensor cores from shared memory through matrix descriptors).
// Shared-memory tiles: rows of 64 bf16 (128 bytes), the 16-byte chunk c of row r at chunk
// c ^ (r % 8), tiles 1024-byte aligned: exactly the 128-byte swizzle the descriptors name.
//
// Pipeline: tile kt + STAGES - 2 is loaded while the tensor cores work on tile kt and tile kt - 1
// may still be finishing (one wgmma group stays in flight: wgmma.wait_group 1), so a stage is
// refilled only once the group that read it has completed in both warpgroups (the barrier at the
// top of each iteration comes after every warpgroup's wait). Copies written by cp.async are made
// visible to the tensor cores' (async) proxy with fence.proxy.async before that barrier.
//
// Epilogues as in gemv.cu. For SILU_MUL, W is [gate; up] (N = 2 * intermediate) and the tile
// loader interleaves gate row j and up row j into adjacent tile rows, so each thread holds gate and
// up of the same output column in one accumulator pair.
//
// It replaced an mma.sync GEMM (same tile, 3 stages, ldmatrix; in git history). Measured on the H200
// (bench.py --models qwen3-4b --prefill 512,4096, whole prefill, two runs each): 512 tokens
// 152-154 -> 241-243 TFLOP/s, 4,096 tokens 264-265 -> 284-285 TFLOP/s.
//
// wgmma exists only on sm_90a: load_module compiles for it on Hopper; a plain sm_90 build (which
// test_compile also checks) gets kernels that trap.
#include "wgmma.cuh"

enum Epilogue { EPI_BF16 = 0, EPI_RESIDUAL = 1, EPI_SILU_MUL = 2, EPI_F32 = 3 };

#define BM 128
#define BN 128
#define BK 64
#define STAGES 4
#define THREADS 256
#define TILE_A (BM * BK * 2)
#define TILE_B (BN * BK * 2)
#define SMEM_BYTES (STAGES * (TILE_A + TILE_B) + 1024)  // + alignment slack

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


#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
template <int EPI>
__device__ __forceinline__ void gemm_block(const bf16 *__restrict__ A, const bf16 *__restrict__ W,
                                           void *__restrict__ out, int M, int N, int K) {
    extern __shared__ __align__(128) unsigned char smem_raw[];
    unsigned char *smem = reinterpret_cast<unsigned char *>(((size_t)smem_raw + 1023) & ~(size_t)1023);
    bf16 *sA = reinterpret_cast<bf16 *>(smem);                       // [STAGES][BM][BK]
    bf16 *sB = reinterpret_cast<bf16 *>(smem + STAGES * TILE_A);     // [STAGES][BN][BK]
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, wg = warp >> 2;
    const int m0 = blockIdx.y * BM, n0 = blockIdx.x * BN;
    const int ktiles = ceil_div(K, BK);

    float d[64];
#pragma unroll
    for (int i = 0; i < 64; ++i) d[i] = 0.f;

#pragma unroll
    for (int s = 0; s < STAGES - 2; ++s) {
        if (s < ktiles) load_stage<EPI>(sA + s * BM * BK, sB + s * BN * BK, A, W, M, N, K, m0, n0, s * BK);
        cp_async_commit();
    }
    for (int kt = 0; kt < ktiles; ++kt) {
        cp_async_wait<STAGES - 3>();  // this thread's copies of tile kt have landed
        fence_async_smem();           // ... and are visible to the tensor cores
        __syncthreads();              // everyone's; and every warpgroup is done with tile kt - 2
        const int next = kt + STAGES - 2;
        if (next < ktiles) {
            const int s = next % STAGES;
            load_stage<EPI>(sA + s * BM * BK, sB + s * BN * BK, A, W, M, N, K, m0, n0, next * BK);
        }
        cp_async_commit();

        const int s = kt % STAGES;
        const u32 a_base = smem_addr(sA + s * BM * BK + wg * 64 * BK), b_base = smem_addr(sB + s * BN * BK);
        wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < BK / 16; ++ks)
            wgmma_m64n128k16(d, smem_desc(a_base + ks * 32), smem_desc(b_base + ks * 32), 1);
        wgmma_commit();
        wgmma_wait<1>();
    }
    wgmma_wait<0>();
    cp_async_wait<0>();

    // Accumulators: warp w of the warpgroup holds rows 16 (w % 4) + g and + 8; d[4j + e] is column
    // 8j + 2t + (e & 1) of row g + 8 (e >> 1) (the mma.m16n8 fragment layout, 16 blocks of 8 columns).
    const int g = lane >> 2, t = lane & 3;
    const int row_base = m0 + wg * 64 + (warp & 3) * 16 + g;
#pragma unroll
    for (int j = 0; j < 16; ++j) {
        const int col = n0 + 8 * j + 2 * t;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int row = row_base + 8 * h;
            const float v0 = d[4 * j + 2 * h], v1 = d[4 * j + 2 * h + 1];
            if (row >= M) continue;
            if (EPI == EPI_SILU_MUL) {
                const int jj = col >> 1, half = N / 2;
                if (jj < half)
                    reinterpret_cast<bf16 *>(out)[(size_t)row * half + jj] = f32_to_bf16(v0 / (1.f + __expf(-v0)) * v1);
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

#else
template <int EPI>
__device__ __forceinline__ void gemm_block(const bf16 *, const bf16 *, void *, int, int, int) { __trap(); }
#endif

// ============================================================================= kernels
// grid (ceil(N / 128), ceil(M / 128)), block (256), dynamic shared memory SMEM_BYTES.
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
