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
#include "common.cuh"

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

// A shared-memory matrix descriptor: K-major rows of 128 bytes in 128-byte-swizzled 8-row atoms
// (1024 bytes apart: the stride byte offset), start address in 16-byte units.
__device__ __forceinline__ unsigned long long smem_desc(u32 addr) {
    unsigned long long d = 0;
    d |= (unsigned long long)((addr & 0x3FFFF) >> 4);      // bits 0-13: start address >> 4
    d |= (unsigned long long)(16 >> 4) << 16;                // bits 16-29: leading byte offset >> 4 (unused here)
    d |= (unsigned long long)(1024 >> 4) << 32;              // bits 32-45: stride byte offset >> 4
    d |= (unsigned long long)1 << 62;                        // bits 62-63: 128-byte swizzle
    return d;
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N> __device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}
__device__ __forceinline__ void fence_async_smem() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

// d (64 x 128 per warpgroup, 64 floats a thread) += A (64 x 16) * B (16 x 128), or = when !accumulate.
__device__ __forceinline__ void wgmma_m64n128k16(float (&d)[64], unsigned long long da, unsigned long long db,
                                                 int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "l"(da), "l"(db), "r"(accumulate));
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
