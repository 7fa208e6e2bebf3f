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
    const float *xr = x + (size_t)src_row * dim;
    const float r = row_inv_rms(xr, dim, eps, scratch);
    store_normed_row(xr, r, w, out + (size_t)blockIdx.x * dim, dim);
}
