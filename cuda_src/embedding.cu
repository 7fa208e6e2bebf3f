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

__device__ __forceinline__ u32 resolved(u32 token, u32 src, int j, int ntok, const int *__restrict__ sampled) {
    return j < ntok && (int)src >= 0 ? (u32)sampled[(int)src] : token;
}

// A decode step's inputs, fetched by the step itself: dst (the step buffers on the device) <- src (their
// page-locked host mirror, mapped into the device's address space), n16 16-byte pieces, one a thread, all
// requested at once. The first kernel of a decode step (engine/model.py), in place of a host-to-device
// copy before the step: a copy is one more operation in the stream (~12 us a token at batch 1 on the H200,
// session 14). It also does resolve_tokens' work: the ntok token ids from piece tok0 on are replaced by
// sampled[token_src[i]] where token_src[i] >= 0, token_src being the field src_delta pieces after them.
// grid (ceil(n16 / 256)), block (256).
extern "C" __global__ void fetch_step(const uint4 *__restrict__ src, uint4 *__restrict__ dst, int n16, int tok0,
                                      int ntok, int src_delta, const int *__restrict__ sampled) {
    pdl_start();
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n16) return;
    uint4 v = src[i];
    const int j = (i - tok0) * 4;  // the first token id of this piece, if it holds token ids
    if (i >= tok0 && j < ntok) {
        const uint4 s = src[i + src_delta];
        v = make_uint4(resolved(v.x, s.x, j, ntok, sampled), resolved(v.y, s.y, j + 1, ntok, sampled),
                       resolved(v.z, s.z, j + 2, ntok, sampled), resolved(v.w, s.w, j + 3, ntok, sampled));
    }
    dst[i] = v;
}
