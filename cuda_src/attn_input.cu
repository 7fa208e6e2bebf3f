// The fused attention-input kernel: per token, RMSNorm each query and key head over head_dim
// (q_norm / k_norm weights), rotate both with RoPE, write the queries out and store the new
// keys and values into the paged cache at the token's slot (the per-head work: attn_input.cuh).
// A decode step whose attention runs a decode _h8 build skips this kernel: that build does the same
// for its own token (attention.cuh, "fused input").
#include "attn_input.cuh"

// ============================================================================= kernels
// grid (n_tokens, ceil((H + KV) / 4)), block (128): one warp per head; heads [0, H) are query
// heads, [H, H + KV) key heads (whose value head is stored alongside).
// qkv: [n, (H + 2 KV) * HD] bf16 (q heads, then k heads, then v heads), from the QKV GEMM.
// slots[t] < 0 marks a padding token: nothing is stored and its queries are still written.
extern "C" __global__ void attn_input(const bf16 *__restrict__ qkv, const int *__restrict__ positions,
                                      const int *__restrict__ slots, const bf16 *__restrict__ q_norm_w,
                                      const bf16 *__restrict__ k_norm_w, const float *__restrict__ inv_freq,
                                      bf16 *__restrict__ q_out, bf16 *__restrict__ k_pool, bf16 *__restrict__ v_pool,
                                      int num_heads, int num_kv_heads, int page_size, float eps) {
    const int t = blockIdx.x;
    HeadInput h;
    const bool work = prepare_head(positions, slots, q_norm_w, k_norm_w, inv_freq, t,
                                   blockIdx.y * 4 + (threadIdx.x >> 5), num_heads, num_kv_heads, h);
    pdl_start();
    if (!work) return;
    const HeadWords x = finish_head(qkv, t, num_heads, num_kv_heads, eps, h);
    if (h.is_q) {
        u32 lo, hi;
        query_pairs(h, 1.f, 1.f, lo, hi);
        bf16 *dst = q_out + ((size_t)t * num_heads + h.head) * HD;
        reinterpret_cast<u32 *>(dst)[h.lane] = lo;
        reinterpret_cast<u32 *>(dst + HD / 2)[h.lane] = hi;
        return;
    }
    store_key_value(h, x.v, k_pool, v_pool, num_heads, num_kv_heads, page_size);
}

// The same for an INT8 cache (tileinfer/kv/int8.py; attn_input.cuh store_key_value_int8). With key
// smoothing, keys are stored as k / c and queries written as q * c (c per channel, the same on both
// channels of a rotary pair), so scores are unchanged; `smooth` may be null (off).
// Pools: k_pool / v_pool int8 [page, kv_head, offset, HD]; k_scale / v_scale f32 [page, kv_head, offset].
extern "C" __global__ void attn_input_int8(const bf16 *__restrict__ qkv, const int *__restrict__ positions,
                                           const int *__restrict__ slots, const bf16 *__restrict__ q_norm_w,
                                           const bf16 *__restrict__ k_norm_w, const float *__restrict__ inv_freq,
                                           const float *__restrict__ smooth, bf16 *__restrict__ q_out,
                                           signed char *__restrict__ k_pool, signed char *__restrict__ v_pool,
                                           float *__restrict__ k_scale, float *__restrict__ v_scale,
                                           int num_heads, int num_kv_heads, int page_size, float eps) {
    const int t = blockIdx.x;
    HeadInput h;
    const bool work = prepare_head(positions, slots, q_norm_w, k_norm_w, inv_freq, t,
                                   blockIdx.y * 4 + (threadIdx.x >> 5), num_heads, num_kv_heads, h);
    // Channels 2l, 2l+1 (a) and 64+2l, 64+2l+1 (b) share the factors c[2l], c[2l+1].
    const float f0 = smooth ? smooth[2 * h.lane] : 1.f, f1 = smooth ? smooth[2 * h.lane + 1] : 1.f;
    pdl_start();
    if (!work) return;
    const HeadWords x = finish_head(qkv, t, num_heads, num_kv_heads, eps, h);
    if (h.is_q) {
        u32 lo, hi;
        query_pairs(h, f0, f1, lo, hi);
        bf16 *dst = q_out + ((size_t)t * num_heads + h.head) * HD;
        reinterpret_cast<u32 *>(dst)[h.lane] = lo;
        reinterpret_cast<u32 *>(dst + HD / 2)[h.lane] = hi;
        return;
    }
    store_key_value_int8(h, x.v, f0, f1, k_pool, v_pool, k_scale, v_scale, num_heads, num_kv_heads, page_size);
}
