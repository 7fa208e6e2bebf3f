// Token embedding lookup: out[i, :] = table[tokens[i], :] as float32 (the residual stream).
#include "common.cuh"

// ============================================================================= kernels
// grid (n), block (128). dim % 8 == 0. Tokens outside [0, vocab) (padding rows) give zeros.
extern "C" __global__ void embedding(const int *__restrict__ tokens, const bf16 *__restrict__ table,
                                     float *__restrict__ out, int dim, int vocab) {
    pdl_start();
    const int row = blockIdx.x;
    const int token = tokens[row];
    const bool valid = token >= 0 && token < vocab;
    const bf16 *src = table + (size_t)(valid ? token : 0) * dim;
    float *dst = out + (size_t)row * dim;
    for (int c = threadIdx.x * 8; c < dim; c += blockDim.x * 8) {
        float f[8];
        unpack8(ld16(src + c), f);
#pragma unroll
        for (int i = 0; i < 8; ++i) f[i] = valid ? f[i] : 0.f;
        *reinterpret_cast<float4 *>(dst + c) = make_float4(f[0], f[1], f[2], f[3]);
        *reinterpret_cast<float4 *>(dst + c + 4) = make_float4(f[4], f[5], f[6], f[7]);
    }
}

// Decode tokens that the previous step sampled on the device, without a trip through the host:
// tokens[i] = sampled[src[i]] where src[i] >= 0 (the row of the previous step that sampled it),
// else tokens[i] is left as uploaded. grid (ceil(n / 256)), block (256).
extern "C" __global__ void resolve_tokens(int *__restrict__ tokens, const int *__restrict__ src,
                                          const int *__restrict__ sampled, int n) {
    pdl_start();
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n && src[i] >= 0) tokens[i] = sampled[src[i]];
}

// A decode step's inputs, fetched by the step itself: dst (the step buffers on the device) <- src (their
// page-locked host mirror, mapped into the device's address space), n16 16-byte pieces, one a thread, all
// requested at once. The first kernel of a decode step (engine/model.py), in place of a host-to-device
// copy before the step: a copy is one more operation in the stream (~12 us a token at batch 1 on the H200,
// session 14). grid (ceil(n16 / 256)), block (256).
extern "C" __global__ void fetch_step(const uint4 *__restrict__ src, uint4 *__restrict__ dst, int n16) {
    pdl_start();
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n16) dst[i] = src[i];
}
