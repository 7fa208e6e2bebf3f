// Paged causal attention, keys mode ("decode shape"): decode and verify steps, up to KEYS_MAX_ROWS
// (tileinfer/kernels/routing.py) rows per sequence and KV head, in row tiles of 16. Each of a block's 4 warps
// takes 16 keys of every key tile, with its own softmax state; the warps' states are merged at the end
// (merge_warps). Shared pieces, layout and rows: attention.cuh.
//
// Decode is bound by the bytes in flight: 3 stages over BF16, 4 over INT8 (3 for its _h8 build). Over an INT8
// cache the tensor-core operands come straight from the int8 tiles (attention.cuh, "INT8 decode operands").
// The _h8 builds take blocks of at most 8 rows (a decode step: one token x a group of G <= 8), whose score
// accumulator rows 8-15 would be padding: the BF16 one skips their scaling, softmax and P packing, and both
// keep O transposed, O^T = V^T P^T with the 8 rows as the mma's N (half the P V mmas and accumulators); the
// INT8 one transposes Q K^T too (direct_qk_t), which leaves it the registers for 4 blocks an SM. Their _fused
// builds take the fused input (attention.cuh): entry points of their own, so that the plain builds carry none of
// its code (with both in one kernel, selected by a null qkv, the plain launches ran slower).
#include "attention.cuh"

constexpr float REF_SLACK = 8.f;  // the _h8 builds: how far above the reference maximum a tile may go (softmax)

// ============================================================================= the prologue
// The tiles that hold only positions before this step's (written by earlier steps; the kernel before this
// one, attn_input, writes q and this step's keys and values only) are requested before waiting for that kernel
// (pdl_start), so their latency overlaps it; so are their lookups (cu_q, kv_lens and the block tables come
// from the host). Returns how many (`early`): commit groups 0 .. early - 1.
template <int STAGES, bool Q8>
__device__ __forceinline__ int request_old_tiles(const AttnArgs &a, const Block &w, const Tiles &sm) {
    const int old_end = min(w.kt_end, w.first_pos / KT);  // tiles kt < old_end hold positions < first_pos only
    const int early = max(0, min(STAGES - 1, old_end - w.kt_begin));
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < early) {
            load_tile(a, sm, lookup_tile<Q8, true>(a, w, w.kt_begin + s), s);
            cp_async_commit();
        }
    }
    return early;
}

// Fused input task `task` of a block: the group's query heads (rows 0 .. G - 1), then its key head (with the
// value head), in the block whose split holds the new position.
__device__ __forceinline__ int fused_task_head(const AttnArgs &a, const Block &w, int task) {
    return task < w.G ? w.kv_head * w.G + task : a.num_heads + w.kv_head;
}

// One fused input task's result, hin normed and rotated: a query head into the Q tile (row `task`), or the key
// and value into the cache.
template <bool Q8>
__device__ __forceinline__ void fused_result(const AttnArgs &a, const FusedInput &fin, int task, const HeadInput &hin,
                                             uint2 v, float f0, float f1, bf16 *sQ) {
    const int lane = threadIdx.x & 31;
    if (hin.is_q) {  // row `task`: channels 2l, 2l+1 in chunk l / 4, 64+2l, 64+2l+1 in chunk 8 + l / 4
        u32 lo, hi;
        query_pairs(hin, f0, f1, lo, hi);
        *reinterpret_cast<u32 *>(sQ + swz(task, lane >> 2) + 2 * (lane & 3)) = lo;
        *reinterpret_cast<u32 *>(sQ + swz(task, 8 + (lane >> 2)) + 2 * (lane & 3)) = hi;
    } else if constexpr (Q8) {
        store_key_value_int8(hin, v, f0, f1, static_cast<signed char *>(fin.k_pool),
                             static_cast<signed char *>(fin.v_pool), fin.k_scale, fin.v_scale, a.num_heads,
                             a.num_kv_heads, a.page_size);
    } else {
        store_key_value(hin, v, static_cast<bf16 *>(fin.k_pool), static_cast<bf16 *>(fin.v_pool), a.num_heads,
                        a.num_kv_heads, a.page_size);
    }
}

// The most fused input tasks a warp takes: a group of up to 8 query heads and the key head over 4 warps.
#define FUSED_TASKS 3

// The _fused builds' Q tile, made from fin.qkv, and the new key and value: each warp's tasks warp, warp + 4 and
// warp + 8, prepared before the wait for the kernel before (pdl_start; what no kernel writes), their heads
// requested together after it. The query rows past the group are zeroed.
template <bool Q8>
__device__ __forceinline__ void fused_input(const AttnArgs &a, const FusedInput &fin, const Block &w, bf16 *sQ) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int kt_new = (w.kv_len - 1) / KT;
    const int n_tasks = w.G + (kt_new >= w.kt_begin && kt_new < w.kt_end ? 1 : 0);
    float f0 = 1.f, f1 = 1.f;
    if (Q8 && fin.smooth) { f0 = fin.smooth[2 * lane]; f1 = fin.smooth[2 * lane + 1]; }
    HeadInput hin[FUSED_TASKS];
    bool hwork[FUSED_TASKS];
#pragma unroll
    for (int j = 0; j < FUSED_TASKS; ++j) {
        const int task = warp + 4 * j;
        hwork[j] = task < n_tasks && prepare_head(fin.positions, fin.slots, fin.q_norm_w, fin.k_norm_w, fin.inv_freq,
                                                  w.q0, fused_task_head(a, w, task), a.num_heads, a.num_kv_heads,
                                                  hin[j]);
    }
    pdl_start();
    HeadWords x[FUSED_TASKS];
#pragma unroll
    for (int j = 0; j < FUSED_TASKS; ++j)
        if (hwork[j]) x[j] = load_head(fin.qkv, w.q0, a.num_heads, a.num_kv_heads, hin[j]);
#pragma unroll
    for (int j = 0; j < FUSED_TASKS; ++j) {
        if (!hwork[j]) continue;  // no task, or the key head of a padding token
        norm_rotate(x[j], fin.eps, hin[j]);
        fused_result<Q8>(a, fin, warp + 4 * j, hin[j], x[j].v, f0, f1, sQ);
    }
    for (int idx = threadIdx.x; idx < (16 - w.G) * (HD / 8); idx += THREADS)  // rows past the group: zero
        st16(sQ + swz(w.G + idx / (HD / 8), idx % (HD / 8)), vec16{});
    __threadfence_block();  // the new key and value before this block's copy of their tile
    __syncthreads();
}

// Prologue: the old tiles (request_old_tiles), the wait, Q (the kernel before's output, or in the _fused builds
// the fused input's) in a commit group of its own (an empty one when fused: the waits count it all the same), the
// rest of the first STAGES - 1 tiles. Returns `early`: tile kt is then commit group i or i + 1 (i = kt - kt_begin).
template <bool Q8, int STAGES, bool FUSED>
__device__ __forceinline__ int decode_prologue(const AttnArgs &a, const FusedInput &fin, const Block &w,
                                               const Tiles &sm) {
    const int early = request_old_tiles<STAGES, Q8>(a, w, sm);
    if constexpr (FUSED) {
        fused_input<Q8>(a, fin, w, sm.sQ);
    } else {
        pdl_start();
        load_q<16>(a, w, sm.sQ);
    }
    cp_async_commit();
    request_tiles<STAGES, Q8, true>(a, w, sm, early);
    return early;
}

// Waiting for all but the newest STAGES - 2 commit groups covers tile kt, and Q (group `early`) from the first
// iteration on, unless two or more old tiles went before it: then the first iteration waits for everything.
__device__ __forceinline__ bool wait_all(const Block &w, int kt, int early) { return kt == w.kt_begin && early >= 2; }

// The INT8 builds' query fragments, fp16 times the softmax scale (see i8x4_to_f16x4): channels permuted within
// each 16-channel slice to match the int8 key fragments (see direct_qk): a0/a1 hold channels 4t, 4t+1 of rows
// g / g+8, a2/a3 4t+2, 4t+3.
__device__ __forceinline__ void query_fragments_f16(const bf16 *sQ, float scale_log2, u32 (&qf)[8][4]) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int ks = 0; ks < 8; ++ks) {
        const uint2 x = *reinterpret_cast<const uint2 *>(sQ + swz(g, 2 * ks + (t >> 1)) + 4 * (t & 1));
        const uint2 y = *reinterpret_cast<const uint2 *>(sQ + swz(g + 8, 2 * ks + (t >> 1)) + 4 * (t & 1));
        qf[ks][0] = bf16x2_to_f16x2(x.x, scale_log2); qf[ks][1] = bf16x2_to_f16x2(y.x, scale_log2);
        qf[ks][2] = bf16x2_to_f16x2(x.y, scale_log2); qf[ks][3] = bf16x2_to_f16x2(y.y, scale_log2);
    }
}

// ============================================================================= one key tile, per build
// Each: S for the warp's 16 keys of tile kt (pipeline buffer cur), scaled and masked (only in tiles that reach
// vis_end, the last of a sequence), the online softmax, O += P V.

// attention_decode: BF16, rows g and g + 8.
__device__ __forceinline__ void tile_bf16(const AttnArgs &a, const Tiles &sm, const u32 (&qf)[8][4], int kt, int cur,
                                          const int (&qpos)[2], int kv_len, int vis_end, RowState<16> &rs) {
    const int lane = threadIdx.x & 31, t = lane & 3, wkey = (threadIdx.x >> 5) * 16;
    const bf16 *tK = sm.sK + cur * KT * HD, *tV = sm.sV + cur * KT * HD;
    float s[2][4];
    scores_bf16<2>(tK, qf, s, wkey, lane);
    float mx[2] = {-TI_INF, -TI_INF};
    if ((kt + 1) * KT <= vis_end)
        scale_scores<false, true, false, 2, 2>(s, mx, a.scale_log2, nullptr, wkey, t, kt, qpos, kv_len);
    else
        scale_scores<true, true, false, 2, 2>(s, mx, a.scale_log2, nullptr, wkey, t, kt, qpos, kv_len);
    float alpha[2] = {1.f, 1.f}, m_use[2] = {0.f, 0.f};
    raise_max<2>(mx, rs.m, m_use, alpha);
    probabilities<false, 2, 2>(s, m_use, alpha, rs.l, nullptr, 1.f, wkey, t);
    rescale_rows(rs.o, alpha);
    pv_bf16<2>(tV, s, rs.o, wkey, lane);
}

// attention_int8_decode: INT8, rows g and g + 8, P's unit (direct_pv) from the largest value scale of the warp's
// 16 keys in this tile (each lane's own 4 keys first: keys depend on t only), raised with the maxima.
__device__ __forceinline__ void tile_int8(const AttnArgs &a, const Tiles &sm, const u32 (&qf)[8][4], int kt, int cur,
                                          const int (&qpos)[2], int kv_len, int vis_end, RowState<16> &rs, int &vexp) {
    const int lane = threadIdx.x & 31, t = lane & 3, wkey = (threadIdx.x >> 5) * 16;
    const unsigned char *st = sm.stage + cur * STAGE_BYTES;
    const float *ksc = reinterpret_cast<const float *>(st + 2 * KT * HD), *vsc = ksc + KT;
    float s[2][4];
#pragma unroll
    for (int i = 0; i < 2; ++i) s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.f;
    direct_qk(st, qf, s, wkey, lane);
    float mx[2] = {-TI_INF, -TI_INF};
    if ((kt + 1) * KT <= vis_end)
        scale_scores<false, false, true, 2, 2>(s, mx, a.scale_log2, ksc, wkey, t, kt, qpos, kv_len);
    else
        scale_scores<true, false, true, 2, 2>(s, mx, a.scale_log2, ksc, wkey, t, kt, qpos, kv_len);
    float vm = 0.f;
#pragma unroll
    for (int nb = 0; nb < 2; ++nb)
#pragma unroll
        for (int e1 = 0; e1 < 2; ++e1) vm = fmaxf(vm, vsc[wkey + nb * 8 + 2 * t + e1]);
    float alpha[2] = {1.f, 1.f}, m_use[2] = {0.f, 0.f};
    raise_max<2>(mx, rs.m, m_use, alpha);
    float o_alpha[2] = {alpha[0], alpha[1]};
    vm = fmaxf(vm, __shfl_xor_sync(0xffffffffu, vm, 1));
    vm = fmaxf(vm, __shfl_xor_sync(0xffffffffu, vm, 2));  // the same in every lane
    float shrink;
    if (raise_value_unit(vm, vexp, shrink)) {
        o_alpha[0] *= shrink;
        o_alpha[1] *= shrink;
    }
    const float pv_unit = __uint_as_float((u32)(253 - vexp) << 23);  // 2^(126 - vexp)
    probabilities<true, 2, 2>(s, m_use, alpha, rs.l, vsc, pv_unit, wkey, t);
    rescale_rows(rs.o, o_alpha);
    const u32 p[4] = {pack_f16x2(s[0][0], s[0][1]), pack_f16x2(s[0][2], s[0][3]), pack_f16x2(s[1][0], s[1][1]),
                      pack_f16x2(s[1][2], s[1][3])};  // P (fp16) as the A operand
    direct_pv(st + KT * HD, p, rs.o, wkey, lane);
}

// The _h8 builds' reference maximum: m is the row's reference maximum, not always its running maximum. A tile
// whose every score is at most m + REF_SLACK (INT8: and no value scale above P's unit) keeps m (and P's unit and
// O) as they are, decided by one vote instead of the lanes' shuffles, and with no rescale: P = 2^(s - m) then
// stays below 2^REF_SLACK (fp16 holds it, as it does P's smaller values, to 11 bits). The merges downstream take
// any common reference. Otherwise m moves to the running maximum, as in the other builds.

// O^T += V^T P^T for the BF16 _h8 build (8 rows): P^T the B operand from the S accumulators' rows g; O^T's
// accumulator dp holds channels 16 dp + g and + 8 of rows 2t and 2t + 1.
__device__ __forceinline__ void pv_bf16_t(const bf16 *tV, const float (&s)[2][4], float (&o)[8][4], int wkey,
                                          int lane) {
    const u32 pt[2] = {pack_bf16x2(s[0][0], s[0][1]), pack_bf16x2(s[1][0], s[1][1])};
#pragma unroll
    for (int dp = 0; dp < 8; ++dp) {
        u32 vb[4];  // as in pv_bf16; as A: channels 16 dp + g and + 8 x keys 2t.. and 8 + 2t..
        ldmatrix_x4_trans(vb, smem_addr(tV + swz(wkey + (lane & 7) + ((lane >> 3) & 1) * 8, dp * 2 + (lane >> 4))));
        const u32 a[4] = {vb[0], vb[2], vb[1], vb[3]};
        mma_bf16_16816(o[dp], a, pt);
    }
}

// attention_decode_h8: BF16, rows g only (rows g + 8 are padding), O transposed.
__device__ __forceinline__ void tile_bf16_h8(const AttnArgs &a, const Tiles &sm, const u32 (&qf)[8][4], int kt,
                                             int cur, const int (&qpos)[2], int kv_len, int vis_end, RowState<8> &rs) {
    const int lane = threadIdx.x & 31, t = lane & 3, wkey = (threadIdx.x >> 5) * 16;
    const bf16 *tK = sm.sK + cur * KT * HD, *tV = sm.sV + cur * KT * HD;
    float s[2][4];
    scores_bf16<2>(tK, qf, s, wkey, lane);
    float mx[2] = {-TI_INF, -TI_INF};
    if ((kt + 1) * KT <= vis_end)
        scale_scores<false, true, false, 2, 1>(s, mx, a.scale_log2, nullptr, wkey, t, kt, qpos, kv_len);
    else
        scale_scores<true, true, false, 2, 1>(s, mx, a.scale_log2, nullptr, wkey, t, kt, qpos, kv_len);
    const bool keep = __all_sync(0xffffffffu, mx[0] <= rs.m[0] + REF_SLACK);  // m = -inf: no visible key yet
    float alpha[2] = {1.f, 1.f}, m_use[2] = {0.f, 0.f};
    if (keep) m_use[0] = rs.m[0] == -TI_INF ? 0.f : rs.m[0];
    else raise_max<1>(mx, rs.m, m_use, alpha);
    probabilities<false, 2, 1>(s, m_use, alpha, rs.l, nullptr, 1.f, wkey, t);
    if (!keep) {
        // O^T's columns are rows 2t and 2t + 1, whose factors the lanes of g = 2t and 2t + 1 hold.
        const float a0 = __shfl_sync(0xffffffffu, alpha[0], 8 * t);
        const float a1 = __shfl_sync(0xffffffffu, alpha[0], 8 * t + 4);
        if (a0 != 1.f || a1 != 1.f) {
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                rs.o[i][0] *= a0; rs.o[i][1] *= a1; rs.o[i][2] *= a0; rs.o[i][3] *= a1;
            }
        }
    }
    pv_bf16_t(tV, s, rs.o, wkey, lane);
}

// attention_int8_decode_h8, S^T for the warp's 16 keys (direct_qk_t), scaled and masked: this lane's scores
// x, keys k0 = wkey + g (x[0], x[1]) and k0 + 8 (x[2], x[3]) of rows 2t + (e & 1), their values' scales vs, and
// the values' codes (vr), read before the softmax so that their shared-memory latency overlaps it.
__device__ __forceinline__ void scores_int8_t(const unsigned char *st, const u32 (&qf)[8][4], int kt,
                                              const int (&qpos)[2], int kv_len, int vis_end, float (&x)[4],
                                              float (&vs)[2], u32 (&vr)[4][4]) {
    const int lane = threadIdx.x & 31, g = lane >> 2, wkey = (threadIdx.x >> 5) * 16;
    const float *ksc = reinterpret_cast<const float *>(st + 2 * KT * HD), *vsc = ksc + KT;
    float sa[4] = {0.f, 0.f, 0.f, 0.f}, sb[4] = {0.f, 0.f, 0.f, 0.f};
    direct_qk_t(st, qf, sa, sb, wkey, lane);
    load_values_t(st + KT * HD, wkey, lane, vr);
    const int k0 = wkey + g;
    const float ks0 = ksc[k0], ks1 = ksc[k0 + 8];
    vs[0] = vsc[k0], vs[1] = vsc[k0 + 8];
#pragma unroll
    for (int e = 0; e < 4; ++e) x[e] = (sa[e] + sb[e]) * (e < 2 ? ks0 : ks1);
    if ((kt + 1) * KT > vis_end) {  // causal and past the end: only a sequence's last tiles
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int key = kt * KT + k0 + 8 * (e >> 1);
            if (key > qpos[e & 1] || key >= kv_len) x[e] = -TI_INF;
        }
    }
}

// attention_int8_decode_h8's online softmax over this lane's scores x (see scores_int8_t), the vote of the
// reference maximum (see above) covering P's unit too; x becomes P^T's operand, P times the values' scales vs0,
// vs1 in P's unit. The rows' keys are spread over the lanes of one t.
__device__ __forceinline__ void softmax_int8_t(float (&x)[4], float vs0, float vs1, RowState<8> &rs, float (&psum)[4],
                                               int &vexp) {
    float mx[2] = {fmaxf(x[0], x[2]), fmaxf(x[1], x[3])};
    float vm = fmaxf(vs0, vs1);
    const bool keep = __all_sync(0xffffffffu, mx[0] <= rs.m[0] + REF_SLACK && mx[1] <= rs.m[1] + REF_SLACK &&
                                                  (int)(__float_as_uint(vm) >> 23) <= vexp);
    float alpha[2] = {1.f, 1.f}, m_use[2], shrink = 1.f;
    if (keep) {
#pragma unroll
        for (int h = 0; h < 2; ++h) m_use[h] = rs.m[h] == -TI_INF ? 0.f : rs.m[h];
    } else {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
#pragma unroll
            for (int off = 4; off < 32; off <<= 1) mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], off));
            const float m_new = fmaxf(rs.m[h], mx[h]);
            m_use[h] = m_new == -TI_INF ? 0.f : m_new;  // a row with no visible key yet: avoid inf - inf
            alpha[h] = fast_exp2(rs.m[h] - m_use[h]);
            rs.m[h] = m_new;
        }
#pragma unroll
        for (int off = 4; off < 32; off <<= 1) vm = fmaxf(vm, __shfl_xor_sync(0xffffffffu, vm, off));
        raise_value_unit(vm, vexp, shrink);
    }
    const float pv_unit = __uint_as_float((u32)(253 - vexp) << 23);  // 2^(126 - vexp)
    float rowsum[2] = {0.f, 0.f};
#pragma unroll
    for (int e = 0; e < 4; ++e) {
        const float p = fast_exp2(x[e] - m_use[e & 1]);
        rowsum[e & 1] += p;
        x[e] = p * ((e < 2 ? vs0 : vs1) * pv_unit);
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) rs.l[h] = rs.l[h] * alpha[h] + rowsum[h];
    if (!keep) {  // O^T's columns are this lane's rows 2t and 2t + 1
        const float a0 = alpha[0] * shrink, a1 = alpha[1] * shrink;
        if (a0 != 1.f || a1 != 1.f) {
#pragma unroll
            for (int c = 0; c < 8; ++c) {
                rs.o[c][0] *= a0; rs.o[c][1] *= a1; rs.o[c][2] *= a0; rs.o[c][3] *= a1;
            }
            psum[0] *= a0; psum[1] *= a1; psum[2] *= a0; psum[3] *= a1;
        }
    }
}

// attention_int8_decode_h8: INT8, Q K^T and O transposed (rows 2t and 2t + 1).
__device__ __forceinline__ void tile_int8_h8(const Tiles &sm, const u32 (&qf)[8][4], int kt, int cur,
                                             const int (&qpos)[2], int kv_len, int vis_end, RowState<8> &rs,
                                             float (&psum)[4], int &vexp) {
    const unsigned char *st = sm.stage + cur * STAGE_BYTES;
    float x[4], vs[2];
    u32 vr[4][4];
    scores_int8_t(st, qf, kt, qpos, kv_len, vis_end, x, vs, vr);
    softmax_int8_t(x, vs[0], vs[1], rs, psum, vexp);
    // P^T's B fragment (keys 2t, 2t + 1 and 8 + 2t, 9 + 2t of row g): the transposes of this lane's pairs.
    const u32 pt[2] = {movmatrix_trans(pack_f16x2(x[0], x[1])), movmatrix_trans(pack_f16x2(x[2], x[3]))};
    direct_pv_t_biased(vr, pt, rs.o, psum);
}

// ============================================================================= the warps' merge
// The 4 warps' states (each saw a quarter of every key tile) meet in shared memory, reusing the K/V tiles:
// sO [4 warps][16 rows][HD] f32, then sM, sL [4][16].
struct MergeBuffers {
    float *sO, *sM, *sL;
};

// Once every warp is done with the tiles.
__device__ __forceinline__ MergeBuffers merge_buffers(const Tiles &sm) {
    __syncthreads();
    float *sO = reinterpret_cast<float *>(sm.sK);
    float *sM = sO + 4 * 16 * HD;
    return {sO, sM, sM + 4 * 16};
}

// This warp's rows g and g + 8: O (DIRECT: in units of 2^(vexp - 126), o[2 b] holding channels 16 b + 4t and
// + 2, o[2 b + 1] channels 16 b + 4t + 1 and + 3: direct_pv), m and l.
template <bool DIRECT>
__device__ __forceinline__ void stage_rows(const MergeBuffers &mb, const RowState<16> &rs, int vexp) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int r = g + 8 * h;
        if constexpr (DIRECT) {
            const float unit = __uint_as_float((u32)(vexp + 1) << 23);
            float4 *dst = reinterpret_cast<float4 *>(mb.sO + (warp * 16 + r) * HD);
#pragma unroll
            for (int b = 0; b < 8; ++b)
                dst[b * 4 + t] = make_float4(rs.o[2 * b][2 * h] * unit, rs.o[2 * b + 1][2 * h] * unit,
                                             rs.o[2 * b][2 * h + 1] * unit, rs.o[2 * b + 1][2 * h + 1] * unit);
        } else {
            float2 *dst = reinterpret_cast<float2 *>(mb.sO + (warp * 16 + r) * HD);
#pragma unroll
            for (int nb = 0; nb < 16; ++nb) dst[nb * 4 + t] = make_float2(rs.o[nb][2 * h], rs.o[nb][2 * h + 1]);
        }
        if (t == 0) { mb.sM[warp * 16 + r] = rs.m[h]; mb.sL[warp * 16 + r] = rs.l[h]; }
    }
}

// The _h8 builds' O^T, rows 2t and 2t + 1 (rows 8-15 unused), less psum, times unit (INT8: psum is the bias,
// direct_pv_t_biased, and unit 2^(vexp - 126); BF16: 0 and 1). Accumulator i holds channels c0 and c1: DIRECT
// 32 (i / 2) + 16 (i % 2) + 2g and + 1 (direct_pv_t_biased), BF16 16 i + g and + 8 (pv_bf16_t).
// WR: rows a warp's share of the buffers (16; the persistent build's compact buffers 8).
template <bool DIRECT, int WR = 16>
__device__ __forceinline__ void stage_rows_t(const MergeBuffers &mb, const float (&o)[8][4], const float (&psum)[4],
                                             float unit) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    float *dst = mb.sO + (warp * WR + 2 * t) * HD;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const int c0 = DIRECT ? 32 * (i >> 1) + 16 * (i & 1) + 2 * g : 16 * i + g;
        const int c1 = DIRECT ? c0 + 1 : c0 + 8;
        dst[c0] = (o[i][0] - psum[0]) * unit; dst[HD + c0] = (o[i][1] - psum[1]) * unit;
        dst[c1] = (o[i][2] - psum[2]) * unit; dst[HD + c1] = (o[i][3] - psum[3]) * unit;
    }
}

// Thread -> (row r = tid / 8, 16 columns from (tid % 8) * 16): the 4 warps' states merged, normalized into out,
// or (num_splits > 1) the split's unnormalized O and (M, L) into the partials. WR: rows a warp's share of the
// buffers (stage_rows_t), at least the block's rows.
template <int WR = 16>
__device__ __forceinline__ void merge_warps(const AttnArgs &a, const Block &w, const MergeBuffers &mb) {
    __syncthreads();
    const int r = threadIdx.x >> 3, c0 = (threadIdx.x & 7) * 16;
    const int R = w.row0 + r;
    if (R >= w.rows) return;
    float M = -TI_INF;
#pragma unroll
    for (int k = 0; k < 4; ++k) M = fmaxf(M, mb.sM[k * WR + r]);
    float wt[4], L = 0.f;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        wt[k] = M == -TI_INF ? 0.f : exp2f(mb.sM[k * WR + r] - M);  // a warp with no visible key: 0
        L += wt[k] * mb.sL[k * WR + r];
    }
    float acc[16];
#pragma unroll
    for (int j = 0; j < 16; ++j) {
        float s = 0.f;
#pragma unroll
        for (int k = 0; k < 4; ++k) s += wt[k] * mb.sO[(k * WR + r) * HD + c0 + j];
        acc[j] = s;
    }
    const size_t row = query_row(a, w, R);
    if (a.num_splits == 1) {
        const float inv = L > 0.f ? 1.f / L : 0.f;
#pragma unroll
        for (int j = 0; j < 16; ++j) acc[j] *= inv;
        st16(a.out + row * HD + c0, pack8(acc));
        st16(a.out + row * HD + c0 + 8, pack8(acc + 8));
    } else {
        const size_t prow = (size_t)w.split * a.total_q * a.num_heads + row;
        float4 *dst = reinterpret_cast<float4 *>(a.part_o + prow * HD + c0);
#pragma unroll
        for (int j = 0; j < 4; ++j) dst[j] = make_float4(acc[4 * j], acc[4 * j + 1], acc[4 * j + 2], acc[4 * j + 3]);
        if ((threadIdx.x & 7) == 0) reinterpret_cast<float2 *>(a.part_ml)[prow] = make_float2(M, L);
    }
}

// ============================================================================= the blocks
// Each: the block's work, the prologue, the key tiles, the warps' merge.

__device__ __forceinline__ void decode_bf16(const AttnArgs &a, const FusedInput &fin) {
    using S = Smem<false, true>;
    constexpr int STAGES = S::STAGES;
    Block w;
    if (!block_work<S::ROWS>(a, w)) return;
    const Tiles sm = shared_tiles<S>();
    const int early = decode_prologue<false, STAGES, false>(a, fin, w, sm);
    TileRows<false> next_rows = first_refill<STAGES, false, true>(a, w);
    const int lane = threadIdx.x & 31, g = lane >> 2;
    const int qpos[2] = {query_position(w, w.row0 + g), query_position(w, w.row0 + g + 8)};
    const int vis_end = min(w.kv_len, min(qpos[0], qpos[1]) + 1);  // keys before it: visible to both rows
    RowState<16> rs;
    start_rows(rs);
    u32 qf[8][4];
    for (int kt = w.kt_begin; kt < w.kt_end; ++kt) {
        advance<STAGES, false, true>(a, w, sm, kt, wait_all(w, kt, early), next_rows);
        if (kt == w.kt_begin) query_fragments(sm.sQ, 0, lane, qf);
        tile_bf16(a, sm, qf, kt, (kt - w.kt_begin) % STAGES, qpos, w.kv_len, vis_end, rs);
    }
    cp_async_wait<0>();
    sum_over_lanes<2, 1, 4>(rs.l);
    const MergeBuffers mb = merge_buffers(sm);
    stage_rows<false>(mb, rs, 0);
    merge_warps(a, w, mb);
}

__device__ __forceinline__ void decode_int8(const AttnArgs &a, const FusedInput &fin) {
    using S = Smem<true, true>;
    constexpr int STAGES = S::STAGES;
    Block w;
    if (!block_work<S::ROWS>(a, w)) return;
    const Tiles sm = shared_tiles<S>();
    const int early = decode_prologue<true, STAGES, false>(a, fin, w, sm);
    TileRows<true> next_rows = first_refill<STAGES, true, true>(a, w);
    const int lane = threadIdx.x & 31, g = lane >> 2;
    const int qpos[2] = {query_position(w, w.row0 + g), query_position(w, w.row0 + g + 8)};
    const int vis_end = min(w.kv_len, min(qpos[0], qpos[1]) + 1);
    RowState<16> rs;
    start_rows(rs);
    int vexp = 1;  // the largest biased exponent of a value scale this warp has seen (see direct_pv)
    u32 qf[8][4];
    for (int kt = w.kt_begin; kt < w.kt_end; ++kt) {
        advance<STAGES, true, true>(a, w, sm, kt, wait_all(w, kt, early), next_rows);
        if (kt == w.kt_begin) query_fragments_f16(sm.sQ, a.scale_log2, qf);
        tile_int8(a, sm, qf, kt, (kt - w.kt_begin) % STAGES, qpos, w.kv_len, vis_end, rs, vexp);
    }
    cp_async_wait<0>();
    sum_over_lanes<2, 1, 4>(rs.l);
    const MergeBuffers mb = merge_buffers(sm);
    stage_rows<true>(mb, rs, vexp);
    merge_warps(a, w, mb);
}

template <bool FUSED>
__device__ __forceinline__ void decode_bf16_h8(const AttnArgs &a, const FusedInput &fin) {
    using S = Smem<false, true, true>;
    constexpr int STAGES = S::STAGES;
    Block w;
    if (!block_work<S::ROWS>(a, w)) return;
    const Tiles sm = shared_tiles<S>();
    const int early = decode_prologue<false, STAGES, FUSED>(a, fin, w, sm);
    TileRows<false> next_rows = first_refill<STAGES, false, true>(a, w);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int qpos[2] = {query_position(w, w.row0 + g), query_position(w, w.row0 + g + 8)};
    const int vis_end = min(w.kv_len, min(qpos[0], qpos[1]) + 1);
    RowState<8> rs;  // O^T: 128 channels x 8 rows in 8 accumulators of 16 channels (pv_bf16_t)
    start_rows(rs);
    u32 qf[8][4];
    for (int kt = w.kt_begin; kt < w.kt_end; ++kt) {
        advance<STAGES, false, true>(a, w, sm, kt, wait_all(w, kt, early), next_rows);
        if (kt == w.kt_begin) query_fragments(sm.sQ, 0, lane, qf);
        tile_bf16_h8(a, sm, qf, kt, (kt - w.kt_begin) % STAGES, qpos, w.kv_len, vis_end, rs);
    }
    cp_async_wait<0>();
    sum_over_lanes<1, 1, 4>(rs.l);
    const MergeBuffers mb = merge_buffers(sm);
    const float no_bias[4] = {0.f, 0.f, 0.f, 0.f};
    stage_rows_t<false>(mb, rs.o, no_bias, 1.f);
    if (t == 0) { mb.sM[warp * 16 + g] = rs.m[0]; mb.sL[warp * 16 + g] = rs.l[0]; }
    merge_warps(a, w, mb);
}

template <bool FUSED>
__device__ __forceinline__ void decode_int8_h8(const AttnArgs &a, const FusedInput &fin) {
    using S = Smem<true, true, true>;
    constexpr int STAGES = S::STAGES;
    Block w;
    if (!block_work<S::ROWS>(a, w)) return;
    const Tiles sm = shared_tiles<S>();
    const int early = decode_prologue<true, STAGES, FUSED>(a, fin, w, sm);
    TileRows<true> next_rows = first_refill<STAGES, true, true>(a, w);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int qpos[2] = {query_position(w, w.row0 + 2 * t), query_position(w, w.row0 + 2 * t + 1)};
    const int vis_end = min(w.kv_len, min(qpos[0], qpos[1]) + 1);
    RowState<8> rs;  // O^T (direct_pv_t_biased)
    start_rows(rs);
    float psum[4] = {0.f, 0.f, 0.f, 0.f};  // O^T's bias (direct_pv_t_biased)
    int vexp = 1;
    u32 qf[8][4];
    for (int kt = w.kt_begin; kt < w.kt_end; ++kt) {
        advance<STAGES, true, true>(a, w, sm, kt, wait_all(w, kt, early), next_rows);
        if (kt == w.kt_begin) query_fragments_f16(sm.sQ, a.scale_log2, qf);
        tile_int8_h8(sm, qf, kt, (kt - w.kt_begin) % STAGES, qpos, w.kv_len, vis_end, rs, psum, vexp);
    }
    cp_async_wait<0>();
    sum_over_lanes<2, 4, 32>(rs.l);  // a row's keys: over the lanes of one t
    const MergeBuffers mb = merge_buffers(sm);
    stage_rows_t<true>(mb, rs.o, psum, __uint_as_float((u32)(vexp + 1) << 23));
    if (g == 0) {
        mb.sM[warp * 16 + 2 * t] = rs.m[0]; mb.sL[warp * 16 + 2 * t] = rs.l[0];
        mb.sM[warp * 16 + 2 * t + 1] = rs.m[1]; mb.sL[warp * 16 + 2 * t + 1] = rs.l[1];
    }
    merge_warps(a, w, mb);
}

// ============================================================================= the persistent build
// attention_decode_h8_items: the BF16 _h8 build for a decode step whose blocks would take more than one wave
// (the launcher's rule: kernels/routing.py decode_items_blocks). gridDim.x blocks (at most a wave), each taking the
// items blockIdx.x, blockIdx.x + gridDim.x, ... in turn, item = (sequence * num_splits + split) * KV + kv_head
// (the plain grid's order of its blocks). Its cp.async pipeline runs on from an item's last key tiles into the
// next item's first ones, so a block waits for its first tiles once a launch, where the plain grid's blocks of a
// wave start, and wait, together. One commit group a key tile, in the block's order over its items, and one for
// the first item's Q tile (items_prologue); a later item's Q tile comes in the group of its first key tile. Item
// Q tiles go to Q buffer n % STAGES (n: the items with key tiles before it in the block's order): the buffer's
// previous item took its fragments STAGES items earlier. An item's warps
// merge in the buffers of its last key tile (sO [4 warps][8 rows][HD] in its K tile, sM and sL in its V tile),
// which the pipeline refills only at the next tile's top, after a barrier.

// Item `item`'s work; false when it has no key tile (a split past the sequence's keys, or no rows).
__device__ __forceinline__ bool item_work(const AttnArgs &a, int item, Block &w) {
    const unsigned u = (unsigned)item, kv = (unsigned)a.num_kv_heads;
    return work_of<ItemsSmem::ROWS>(a, 0u, u % kv, u / kv, w) && w.kt_begin < w.kt_end;
}

// The producer's place: the next key tile to request (kt of item `item`, whose work is w), its rows looked up one
// request ahead, and n, the items with key tiles this block has reached (item's Q buffer: (n - 1) % STAGES).
// item >= num_items: nothing left to request.
struct Feed {
    Block w;
    int item, kt, n;
    TileRows<false> rows;
};

// f at the first key tile of the next item with any, from f.item + gridDim.x on.
__device__ __forceinline__ void feed_next_item(const AttnArgs &a, int num_items, Feed &f) {
    do {
        f.item += gridDim.x;
    } while (f.item < num_items && !item_work(a, f.item, f.w));
    if (f.item < num_items) {
        f.kt = f.w.kt_begin;
        ++f.n;
        f.rows = lookup_tile<false, true>(a, f.w, f.kt);
    }
}

// Request f's tile into pipeline buffer `buf` (with its item's Q tile when it is the item's first, but for the
// block's first item's: the prologue's) and move on.
__device__ __forceinline__ void feed_request(const AttnArgs &a, const Tiles &sm, int num_items, Feed &f, int buf) {
    if (f.item >= num_items) return;
    using S = ItemsSmem;
    if (f.kt == f.w.kt_begin && f.n > 1) load_q<S::ROWS>(a, f.w, sm.sQ + ((f.n - 1) % S::STAGES) * S::Q_TILE);
    load_tile(a, sm, f.rows, buf);
    if (++f.kt < f.w.kt_end) f.rows = lookup_tile<false, true>(a, f.w, f.kt);
    else feed_next_item(a, num_items, f);
}

// An item with rows but no key tile (a split past its sequence's keys; one split always has a tile): what the
// plain build's merge writes for it, no key seen (O 0, M -inf, L 0).
__device__ __forceinline__ void empty_item(const AttnArgs &a, const Block &w) {
    const int r = threadIdx.x >> 3, c0 = (threadIdx.x & 7) * 16;
    if (w.row0 + r >= w.rows) return;
    const size_t prow = (size_t)w.split * a.total_q * a.num_heads + query_row(a, w, w.row0 + r);
    float4 *dst = reinterpret_cast<float4 *>(a.part_o + prow * HD + c0);
#pragma unroll
    for (int j = 0; j < 4; ++j) dst[j] = make_float4(0.f, 0.f, 0.f, 0.f);
    if ((threadIdx.x & 7) == 0) reinterpret_cast<float2 *>(a.part_ml)[prow] = make_float2(-TI_INF, 0.f);
}

// The prologue, as decode_prologue's for the block's first item: its tiles that hold only positions before this
// step's (no kernel before this one writes them) are requested before the wait for the kernel before (pdl_start),
// then its Q tile (attn_input's) in a commit group of its own, then the rest of the block's first STAGES - 1
// tiles. Returns `early` (those first tiles): the block's tile i is then commit group i or i + 1.
__device__ __forceinline__ int items_prologue(const AttnArgs &a, const Tiles &sm, int num_items, Feed &f) {
    constexpr int STAGES = ItemsSmem::STAGES;
    f.item = (int)blockIdx.x - (int)gridDim.x;
    f.n = 0;
    feed_next_item(a, num_items, f);
    const Block first = f.w;
    const bool any = f.item < num_items;
    const int early = any ? max(0, min(STAGES - 1, min(first.kt_end, first.first_pos / KT) - first.kt_begin)) : 0;
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < early) {
            feed_request(a, sm, num_items, f, s);
            cp_async_commit();
        }
    }
    pdl_start();
    if (any) load_q<ItemsSmem::ROWS>(a, first, sm.sQ);
    cp_async_commit();
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s >= early) {
            feed_request(a, sm, num_items, f, s);
            cp_async_commit();
        }
    }
    return early;
}

__device__ __forceinline__ void decode_bf16_h8_items(const AttnArgs &a, int num_items) {
    using S = ItemsSmem;
    constexpr int STAGES = S::STAGES;
    const Tiles sm = shared_tiles<S>();
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    Feed f;
    const int early = items_prologue(a, sm, num_items, f);
    int flat = 0, n = 0;  // key tiles and items with key tiles this block has taken
    for (int item = blockIdx.x; item < num_items; item += gridDim.x) {
        Block w;
        if (!item_work(a, item, w)) {
            if (work_of<S::ROWS>(a, 0u, (unsigned)item % a.num_kv_heads, (unsigned)item / a.num_kv_heads, w))
                empty_item(a, w);
            continue;
        }
        const bf16 *sQ = sm.sQ + (n++ % STAGES) * S::Q_TILE;
        const int qpos[2] = {query_position(w, w.row0 + g), query_position(w, w.row0 + g + 8)};
        const int vis_end = min(w.kv_len, min(qpos[0], qpos[1]) + 1);
        RowState<8> rs;
        start_rows(rs);
        u32 qf[8][4];
        for (int kt = w.kt_begin; kt < w.kt_end; ++kt, ++flat) {
            // Key tile `flat` (commit group flat or flat + 1; with an item's first, its Q) has landed: all but the
            // newest group, or for the first when two tiles went before the first Q's group, every group.
            if (flat == 0 && early >= 2) cp_async_wait<0>();
            else cp_async_wait<STAGES - 2>();
            __syncthreads();  // for every thread; and everyone is done with buffer flat - 1
            feed_request(a, sm, num_items, f, (flat + STAGES - 1) % STAGES);
            cp_async_commit();
            if (kt == w.kt_begin) query_fragments(sQ, 0, lane, qf);
            tile_bf16_h8(a, sm, qf, kt, flat % STAGES, qpos, w.kv_len, vis_end, rs);
        }
        sum_over_lanes<1, 1, 4>(rs.l);
        const int last = (flat - 1) % STAGES;
        __syncthreads();  // every warp is done with the last tile's buffers
        float *sM = reinterpret_cast<float *>(sm.sV + last * KT * HD);
        const MergeBuffers mb{reinterpret_cast<float *>(sm.sK + last * KT * HD), sM, sM + 4 * 8};
        const float no_bias[4] = {0.f, 0.f, 0.f, 0.f};
        stage_rows_t<false, 8>(mb, rs.o, no_bias, 1.f);
        if (t == 0) { mb.sM[warp * 8 + g] = rs.m[0]; mb.sL[warp * 8 + g] = rs.l[0]; }
        merge_warps<8>(a, w, mb);
    }
    cp_async_wait<0>();
}

// ============================================================================= kernels
// The INT8 _h8 build must fit 4 blocks an SM (<= 128 registers), as the engine's decode splits count on
// (tileinfer/kernels/routing.py int8_decode_blocks). (A minimum of 1 block on the others is not neutral:
// it changes their register allocation, for the worse.)
// Compiled one kernel a part, at once: a first request waits only for the builds it launches (the prompt's
// attention_decode, the decode step's _h8 or _h8_fused), each a compile of its own, not for their neighbours'.
#define KERNEL_PARTS 7
#if IN_PART(0)
// The ATTENTION_KERNEL arguments but the fused input's, and the launch's items (its grid is at most a wave).
extern "C" __global__ void __launch_bounds__(THREADS) attention_decode_h8_items(
        const bf16 *__restrict__ q, void *__restrict__ k_pool, void *__restrict__ v_pool, float *__restrict__ k_scale,
        float *__restrict__ v_scale, bf16 *__restrict__ out, float *__restrict__ part_o, float *__restrict__ part_ml,
        const int *__restrict__ cu_q, const int *__restrict__ kv_lens, const int *__restrict__ block_tables,
        int bt_stride, int num_heads, int num_kv_heads, int page_size, int num_splits, int total_q, float scale_log2,
        int num_items) {
    decode_bf16_h8_items(AttnArgs{q, k_pool, v_pool, k_scale, v_scale, out, part_o, part_ml, cu_q, kv_lens,
                                  block_tables, bt_stride, num_heads, num_kv_heads, page_size, num_splits, total_q,
                                  scale_log2},
                         num_items);
}
#endif
#if IN_PART(1)
ATTENTION_KERNEL(attention_decode, __launch_bounds__(THREADS), decode_bf16)
#endif
#if IN_PART(2)
ATTENTION_KERNEL(attention_decode_h8, __launch_bounds__(THREADS), decode_bf16_h8<false>)
#endif
#if IN_PART(3)
ATTENTION_KERNEL(attention_decode_h8_fused, __launch_bounds__(THREADS), decode_bf16_h8<true>)
#endif
#if IN_PART(4)
ATTENTION_KERNEL(attention_int8_decode, __launch_bounds__(THREADS), decode_int8)
#endif
#if IN_PART(5)
ATTENTION_KERNEL(attention_int8_decode_h8, __launch_bounds__(THREADS, 4), decode_int8_h8<false>)
#endif
#if IN_PART(6)
ATTENTION_KERNEL(attention_int8_decode_h8_fused, __launch_bounds__(THREADS, 4), decode_int8_h8<true>)
#endif
