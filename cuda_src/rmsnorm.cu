// RMSNorm of float32 residual rows into bf16: out = x / sqrt(mean(x^2) + eps) * w.
#include "common.cuh"

// ============================================================================= kernels
// grid (n_out), block (256). Row i of `out` normalizes row rows[i] of x (rows == nullptr: row i),
// so the final norm can pick each sequence's last token. dim % 4 == 0.
// A thread's first RMSNORM_CHUNKS chunks of 4 elements (rows of up to 4,096: every Qwen3 model up to 8B)
// stay in registers from the sum of squares to the store, so the row is read once; longer rows read the
// rest twice. The sums and products are row_inv_rms's and store_normed_chunk's, in the same order (the
// GEMV that normalizes its own input rounds the same way: tests/gpu/test_kernels.py checks it bit for bit),
// so nothing here needs the L1 cache: the launcher gives its SM configuration to shared memory.
// The weights' pieces are loaded before the PDL wait (load_norm_weights).
#define RMSNORM_CHUNKS 4
extern "C" __global__ void rmsnorm(const float *__restrict__ x, const int *__restrict__ rows,
                                   const bf16 *__restrict__ w, bf16 *__restrict__ out, int dim, float eps) {
    u32 wa[RMSNORM_CHUNKS], wb[RMSNORM_CHUNKS];
    load_norm_weights(w, dim, wa, wb);
    pdl_start();
    __shared__ float scratch[32];
    const int src_row = rows ? rows[blockIdx.x] : blockIdx.x;
    const float *xr = x + (size_t)src_row * dim;
    const float4 *x4 = reinterpret_cast<const float4 *>(xr);
    const int chunks = dim / 4, held = RMSNORM_CHUNKS * blockDim.x;
    float4 v[RMSNORM_CHUNKS];
#pragma unroll
    for (int i = 0; i < RMSNORM_CHUNKS; ++i) {
        const int c = threadIdx.x + i * blockDim.x;
        v[i] = c < chunks ? x4[c] : make_float4(0.f, 0.f, 0.f, 0.f);
    }
    float ss = 0.f;
#pragma unroll
    for (int i = 0; i < RMSNORM_CHUNKS; ++i)
        if (threadIdx.x + i * blockDim.x < chunks) ss += sum_squares4(v[i]);
    for (int c = threadIdx.x + held; c < chunks; c += blockDim.x) ss += sum_squares4(x4[c]);
    const float r = rsqrtf(block_sum(ss, scratch) / dim + eps);

    bf16 *o = out + (size_t)blockIdx.x * dim;
#pragma unroll
    for (int i = 0; i < RMSNORM_CHUNKS; ++i) {
        const int c = threadIdx.x + i * blockDim.x;
        if (c < chunks) store_normed4(v[i], r, wa[i], wb[i], o, c);
    }
    store_normed_row(xr, r, w, o, dim, threadIdx.x + held);
}
