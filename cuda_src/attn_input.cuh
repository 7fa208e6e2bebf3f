// The attention input of one head of one token: RMSNorm over head_dim (q_norm / k_norm weights), RoPE,
// and for a key head the store of the new key and value into the paged cache. Shared by attn_input.cu
// (one warp a head, every token of a step) and attention_decode.cu's _h8 builds, which do it for their own
// sequence's token when a decode step skips attn_input (see attention.cuh, "fused input").
//
// Cache layout (one pool per layer for K and one for V; see tileinfer/kv/paged_cache.py):
//   pool[page, kv_head, offset, head_dim], slot = page * page_size + offset; bf16, or int8 plus one float32
//   scale per vector, scale[page, kv_head, offset] (tileinfer/kv/int8.py).
#pragma once
#include "common.cuh"

#define HD 128  // head_dim: every Qwen3 model uses 128

// One warp's head `head` of token t. Lane l owns channels 2l, 2l+1 and their rotary partners 64+2l, 64+2l+1
// (rotate-half pairing (i, i + 64): (x, y) -> (x cos - y sin, y cos + x sin)). prepare_head does everything
// that reads only what no kernel writes (the step's positions and slots, the norm weights, the rotary
// frequencies) before the kernel waits for the QKV product (pdl_start); after it load_head loads the head and
// norm_rotate RMSNorms it over its 128 channels and rotates it: a0, a1 (channels 2l, 2l+1), b0, b1 (64+2l, 64+2l+1).
struct HeadInput {
    int head, lane, slot;
    bool is_q;
    u32 wlo, whi;          // the norm weights of channels 2l, 2l+1 and 64+2l, 64+2l+1
    float s0, c0, s1, c1;  // sin and cos of the rotation of channel pairs 2l and 2l+1
    float a0, a1, b0, b1;
};

// False when there is nothing to do (past the last head, or a key head of a padding token).
__device__ __forceinline__ bool prepare_head(const int *__restrict__ positions, const int *__restrict__ slots,
                                             const bf16 *__restrict__ q_norm_w, const bf16 *__restrict__ k_norm_w,
                                             const float *__restrict__ inv_freq, int t, int head, int num_heads,
                                             int num_kv_heads, HeadInput &h) {
    h.head = head;
    h.lane = threadIdx.x & 31;
    if (h.head >= num_heads + num_kv_heads) return false;
    h.is_q = h.head < num_heads;
    h.slot = slots[t];
    if (!h.is_q && h.slot < 0) return false;
    const u32 *wn = reinterpret_cast<const u32 *>(h.is_q ? q_norm_w : k_norm_w);
    h.wlo = wn[h.lane];
    h.whi = wn[HD / 4 + h.lane];
    const float pos = (float)positions[t];
    sincosf(pos * inv_freq[2 * h.lane], &h.s0, &h.c0);
    sincosf(pos * inv_freq[2 * h.lane + 1], &h.s1, &h.c1);
    return true;
}

// The words of a head's row of qkv a lane holds: channels 2l, 2l+1 (lo) and 64+2l, 64+2l+1 (hi), and for a key
// head its value head's channels 4l .. 4l+3 (v).
struct HeadWords {
    u32 lo, hi;
    uint2 v;
};

// qkv's row of token t: the head's words (and a key head's value words), requested together (after the wait).
__device__ __forceinline__ HeadWords load_head(const bf16 *__restrict__ qkv, int t, int num_heads, int num_kv_heads,
                                               const HeadInput &h) {
    const int row_elems = (num_heads + 2 * num_kv_heads) * HD;
    const bf16 *src = qkv + (size_t)t * row_elems + (size_t)h.head * HD;
    HeadWords x;
    x.lo = reinterpret_cast<const u32 *>(src)[h.lane];
    x.hi = reinterpret_cast<const u32 *>(src + HD / 2)[h.lane];
    if (!h.is_q) x.v = reinterpret_cast<const uint2 *>(src + (size_t)num_kv_heads * HD)[h.lane];
    return x;
}

// The head RMSNormed over its 128 channels and rotated: a0, a1 (channels 2l, 2l+1), b0, b1 (64+2l, 64+2l+1).
__device__ __forceinline__ void norm_rotate(const HeadWords &x, float eps, HeadInput &h) {
    float x0 = bf16lo(x.lo), x1 = bf16hi(x.lo), y0 = bf16lo(x.hi), y1 = bf16hi(x.hi);
    const float r = rsqrtf(warp_sum(x0 * x0 + x1 * x1 + y0 * y0 + y1 * y1) / HD + eps);
    x0 *= r * bf16lo(h.wlo); x1 *= r * bf16hi(h.wlo);
    y0 *= r * bf16lo(h.whi); y1 *= r * bf16hi(h.whi);
    h.a0 = x0 * h.c0 - y0 * h.s0; h.b0 = y0 * h.c0 + x0 * h.s0;
    h.a1 = x1 * h.c1 - y1 * h.s1; h.b1 = y1 * h.c1 + x1 * h.s1;
}

// load_head, then norm_rotate; returns the words (a key head's value words for its store).
__device__ __forceinline__ HeadWords finish_head(const bf16 *__restrict__ qkv, int t, int num_heads,
                                                 int num_kv_heads, float eps, HeadInput &h) {
    const HeadWords x = load_head(qkv, t, num_heads, num_kv_heads, h);
    norm_rotate(x, eps, h);
    return x;
}

// A query head as bf16 (times the smoothing factors f0, f1 of channels 2l, 2l+1 and their partners; 1 for a
// BF16 cache or no smoothing): lo holds channels 2l, 2l+1, hi 64+2l, 64+2l+1.
__device__ __forceinline__ void query_pairs(const HeadInput &h, float f0, float f1, u32 &lo, u32 &hi) {
    lo = pack_bf16x2(h.a0 * f0, h.a1 * f1);
    hi = pack_bf16x2(h.b0 * f0, h.b1 * f1);
}

// The index of a key head's (position, KV head) vector in the pools [page, kv_head, offset].
__device__ __forceinline__ size_t cache_vector(const HeadInput &h, int num_heads, int num_kv_heads, int page_size) {
    const size_t page = h.slot / page_size, off = h.slot % page_size;
    return (page * num_kv_heads + (h.head - num_heads)) * page_size + off;
}

// A key head (rotated) and its value head (copied unchanged) into a BF16 cache.
__device__ __forceinline__ void store_key_value(const HeadInput &h, uint2 v, bf16 *__restrict__ k_pool,
                                                bf16 *__restrict__ v_pool, int num_heads, int num_kv_heads,
                                                int page_size) {
    const int lane = h.lane;
    const size_t at = cache_vector(h, num_heads, num_kv_heads, page_size) * HD;
    reinterpret_cast<u32 *>(k_pool + at)[lane] = pack_bf16x2(h.a0, h.a1);
    reinterpret_cast<u32 *>(k_pool + at + HD / 2)[lane] = pack_bf16x2(h.b0, h.b1);
    reinterpret_cast<uint2 *>(v_pool + at)[lane] = v;  // the value head unchanged: 256 bytes, 8 a lane
}

// The same into an INT8 cache: each key and value vector as 128 int8 values plus one float32 scale,
// symmetric, scale = max|x| / 127, q = round-half-even(x / scale). With key smoothing the key is stored as
// k / c (f0, f1: c of channels 2l, 2l+1, the same on their rotary partners).
__device__ __forceinline__ void store_key_value_int8(const HeadInput &h, uint2 v, float f0, float f1,
                                                     signed char *__restrict__ k_pool, signed char *__restrict__ v_pool,
                                                     float *__restrict__ k_scale, float *__restrict__ v_scale,
                                                     int num_heads, int num_kv_heads, int page_size) {
    const int lane = h.lane;
    const float a0 = __fdiv_rn(h.a0, f0), b0 = __fdiv_rn(h.b0, f0);
    const float a1 = __fdiv_rn(h.a1, f1), b1 = __fdiv_rn(h.b1, f1);
    const size_t vec = cache_vector(h, num_heads, num_kv_heads, page_size);
    const size_t at = vec * HD;

    const float kmax = warp_max(fmaxf(fmaxf(fabsf(a0), fabsf(a1)), fmaxf(fabsf(b0), fabsf(b1))));
    const float ks = __fdiv_rn(kmax, 127.f);
    const float kd = ks > 0.f ? ks : 1.f;
    const int qa0 = __float2int_rn(__fdiv_rn(a0, kd)), qa1 = __float2int_rn(__fdiv_rn(a1, kd));
    const int qb0 = __float2int_rn(__fdiv_rn(b0, kd)), qb1 = __float2int_rn(__fdiv_rn(b1, kd));
    reinterpret_cast<unsigned short *>(k_pool + at)[lane] = (unsigned short)((qa0 & 0xff) | ((qa1 & 0xff) << 8));
    reinterpret_cast<unsigned short *>(k_pool + at + HD / 2)[lane] =
        (unsigned short)((qb0 & 0xff) | ((qb1 & 0xff) << 8));
    if (lane == 0) k_scale[vec] = ks;

    // The value head, unchanged but quantized: lane l owns channels 4l .. 4l+3.
    const float v0 = bf16lo(v.x), v1 = bf16hi(v.x), v2 = bf16lo(v.y), v3 = bf16hi(v.y);
    const float vmax = warp_max(fmaxf(fmaxf(fabsf(v0), fabsf(v1)), fmaxf(fabsf(v2), fabsf(v3))));
    const float vs = __fdiv_rn(vmax, 127.f);
    const float vd = vs > 0.f ? vs : 1.f;
    const int q0 = __float2int_rn(__fdiv_rn(v0, vd)), q1 = __float2int_rn(__fdiv_rn(v1, vd));
    const int q2 = __float2int_rn(__fdiv_rn(v2, vd)), q3 = __float2int_rn(__fdiv_rn(v3, vd));
    reinterpret_cast<u32 *>(v_pool + at)[lane] =
        (u32)(q0 & 0xff) | ((u32)(q1 & 0xff) << 8) | ((u32)(q2 & 0xff) << 16) | ((u32)(q3 & 0xff) << 24);
    if (lane == 0) v_scale[vec] = vs;
}
