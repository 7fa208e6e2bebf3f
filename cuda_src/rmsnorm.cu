// RMSNorm of float32 residual rows into bf16: out = x / sqrt(mean(x^2) + eps) * w.
#include "common.cuh"

// ============================================================================= kernels
// grid (n_out), block (256). Row i of `out` normalizes row rows[i] of x (rows == nullptr: row i),
// so the final norm can pick each sequence's last token. dim % 4 == 0.
// The weights' pieces are loaded before the PDL wait (load_norm_weights): 4 chunks a thread cover
// rows of up to 4,096 (every Qwen3 model up to 8B); longer rows read the rest after the reduction.
#define RMSNORM_CHUNKS 4
extern "C" __global__ void rmsnorm(const float *__restrict__ x, const int *__restrict__ rows,
                                   const bf16 *__restrict__ w, bf16 *__restrict__ out, int dim, float eps) {
    u32 wa[RMSNORM_CHUNKS], wb[RMSNORM_CHUNKS];
    load_norm_weights(w, dim, wa, wb);
    pdl_start();
    __shared__ float scratch[32];
    const int src_row = rows ? rows[blockIdx.x] : blockIdx.x;
    const float *xr = x + (size_t)src_row * dim;
    const float r = row_inv_rms(xr, dim, eps, scratch);
    store_normed_row(xr, r, wa, wb, w, out + (size_t)blockIdx.x * dim, dim);
}
