// Paged causal attention, rows mode ("prefill shape"): prefill chunks, and in batch-invariant mode every
// step. A block owns 64 rows (4 warps x 16) of one sequence and one KV head and walks every key tile up to
// its last row's position, 2 stages deep. Over an INT8 cache each tile is widened to bf16 in shared memory
// (exact: the codes are integers in [-127, 127]) and the block computes as over BF16, with the keys' scales
// on the scores and the values' on the probabilities. On Hopper attention_wg.cu takes the BF16 cache's
// unsplit launches (tileinfer/kernels/routing.py kernel_name). Shared pieces, layout and rows: attention.cuh.
#include "attention.cuh"

// INT8: widen a staged K and V tile to bf16 (swizzled) in sK / sV, all 64 keys by the whole block.
__device__ __forceinline__ void widen_tile(const unsigned char *stage, bf16 *sK, bf16 *sV) {
    const int tid = threadIdx.x % THREADS;
#pragma unroll
    for (int i = 0; i < 2 * KT * (HD / 16) / THREADS; ++i) {
        const int idx = tid + i * THREADS;
        const int which = idx / (KT * HD / 16), r = (idx >> 3) % KT, c = idx & 7;
        const vec16 in = ld16(stage + which * KT * HD + r * HD + ((c ^ (r & 7)) << 4));
        vec16 lo, hi;
        i8x4_to_bf16x4(in.w[0], lo.w[0], lo.w[1]);
        i8x4_to_bf16x4(in.w[1], lo.w[2], lo.w[3]);
        i8x4_to_bf16x4(in.w[2], hi.w[0], hi.w[1]);
        i8x4_to_bf16x4(in.w[3], hi.w[2], hi.w[3]);
        bf16 *dst = which ? sV : sK;
        st16(dst + swz(r, 2 * c), lo);
        st16(dst + swz(r, 2 * c + 1), hi);
    }
}

// One key tile kt (pipeline buffer cur) for the warp's 16 rows from wrow: S = Q K^T over its 64 keys, masked,
// the online softmax, O += P V. INT8: the tile widened first, the scales from its staging buffer.
template <bool Q8>
__device__ __forceinline__ void rows_tile(const AttnArgs &a, const Tiles &sm, const u32 (&qf)[8][4], int kt, int cur,
                                          const int (&qpos)[2], int kv_len, RowState<16> &st) {
    const int lane = threadIdx.x & 31, t = lane & 3;
    const bf16 *tK = sm.sK + cur * KT * HD, *tV = sm.sV + cur * KT * HD;
    const float *ksc = nullptr, *vsc = nullptr;
    if constexpr (Q8) {
        const unsigned char *stage = sm.stage + cur * STAGE_BYTES;
        ksc = reinterpret_cast<const float *>(stage + 2 * KT * HD);
        vsc = ksc + KT;
        widen_tile(stage, sm.sK, sm.sV);
        __syncthreads();
        tK = sm.sK;
        tV = sm.sV;
    }
    float s[8][4];
    scores_bf16<8>(tK, qf, s, 0, lane);
    float mx[2] = {-TI_INF, -TI_INF};
    scale_scores<true, true, Q8, 8, 2>(s, mx, a.scale_log2, ksc, 0, t, kt, qpos, kv_len);
    float alpha[2] = {1.f, 1.f}, m_use[2] = {0.f, 0.f};
    raise_max<2>(mx, st.m, m_use, alpha);
    probabilities<Q8, 8, 2>(s, m_use, alpha, st.l, vsc, 1.f, 0, t);
    rescale_rows(st.o, alpha);
    pv_bf16<8>(tV, s, st.o, 0, lane);
}

// The warp's rows: normalized into out, or (num_splits > 1) the split's unnormalized O and (m, l) into the
// partials.
__device__ __forceinline__ void store_rows(const AttnArgs &a, const Block &w, int wrow, const RowState<16> &st) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int R = w.row0 + wrow + g + 8 * h;
        if (R >= w.rows) continue;
        const size_t row = query_row(a, w, R);
        if (a.num_splits == 1) {
            const float inv = st.l[h] > 0.f ? 1.f / st.l[h] : 0.f;
            u32 *dst = reinterpret_cast<u32 *>(a.out + row * HD);
#pragma unroll
            for (int nb = 0; nb < 16; ++nb)
                dst[nb * 4 + t] = pack_bf16x2(st.o[nb][2 * h] * inv, st.o[nb][2 * h + 1] * inv);
        } else {
            const size_t prow = (size_t)w.split * a.total_q * a.num_heads + row;
            float2 *dst = reinterpret_cast<float2 *>(a.part_o + prow * HD);
#pragma unroll
            for (int nb = 0; nb < 16; ++nb) dst[nb * 4 + t] = make_float2(st.o[nb][2 * h], st.o[nb][2 * h + 1]);
            if (t == 0) reinterpret_cast<float2 *>(a.part_ml)[prow] = make_float2(st.m[h], st.l[h]);
        }
    }
}

// The block: Q and the first tile in one commit group, then one group a tile.
template <bool Q8>
__device__ __forceinline__ void prefill(const AttnArgs &a, const FusedInput &) {
    using S = Smem<Q8, false>;
    constexpr int STAGES = S::STAGES;
    pdl_start();
    Block w;
    if (!block_work<S::ROWS>(a, w)) return;
    const Tiles sm = shared_tiles<S>();
    load_q<S::ROWS>(a, w, sm.sQ);
    request_tiles<STAGES, Q8, false>(a, w, sm, 0);
    TileRows<Q8> next_rows = first_refill<STAGES, Q8, false>(a, w);

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2;
    const int wrow = warp * 16;  // the warp's first row in the tile
    const int qpos[2] = {query_position(w, w.row0 + wrow + g), query_position(w, w.row0 + wrow + g + 8)};
    RowState<16> st;
    start_rows(st);
    u32 qf[8][4];
    for (int kt = w.kt_begin; kt < w.kt_end; ++kt) {
        advance<STAGES, Q8, false>(a, w, sm, kt, false, next_rows);
        if (kt == w.kt_begin) query_fragments(sm.sQ, wrow, lane, qf);
        rows_tile<Q8>(a, sm, qf, kt, (kt - w.kt_begin) % STAGES, qpos, w.kv_len, st);
    }
    cp_async_wait<0>();
    sum_over_lanes<2, 1, 4>(st.l);
    store_rows(a, w, wrow, st);
}

// ============================================================================= kernels
// {BF16, INT8 cache}. (A minimum of blocks an SM in __launch_bounds__ is not neutral: it changes their register
// allocation, for the worse.)
ATTENTION_KERNEL(attention, __launch_bounds__(THREADS), prefill<false>)
ATTENTION_KERNEL(attention_int8, __launch_bounds__(THREADS), prefill<true>)
