// RMSNorm of float32 residual rows into bf16: out = x / sqrt(mean(x^2) + eps) * w.
#include "common.cuh"

// ============================================================================= kernels
// grid (n_out), block (256). Row i of `out` normalizes row rows[i] of x (rows == nullptr: row i),
// so the final norm can pick each sequence's last token. dim % 4 == 0.
extern "C" __global__ void rmsnorm(const float *__restrict__ x, const int *__restrict__ rows,
                                   const bf16 *__restrict__ w, bf16 *__restrict__ out, int dim, float eps) {
    pdl_start();
    __shared__ float scratch[32];
    const int src_row = rows ? rows[blockIdx.x] : blockIdx.x;
    const float4 *xr = reinterpret_cast<const float4 *>(x + (size_t)src_row * dim);
    float ss = 0.f;
    for (int c = threadIdx.x; c < dim / 4; c += blockDim.x) {
        float4 v = xr[c];
        ss += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
    }
    const float r = rsqrtf(block_sum(ss, scratch) / dim + eps);
    u32 *o = reinterpret_cast<u32 *>(out + (size_t)blockIdx.x * dim);
    const u32 *w2 = reinterpret_cast<const u32 *>(w);
    for (int c = threadIdx.x; c < dim / 4; c += blockDim.x) {
        float4 v = xr[c];
        u32 wa = w2[2 * c], wb = w2[2 * c + 1];
        o[2 * c] = pack_bf16x2(v.x * r * bf16lo(wa), v.y * r * bf16hi(wa));
        o[2 * c + 1] = pack_bf16x2(v.z * r * bf16lo(wb), v.w * r * bf16hi(wb));
    }
}
