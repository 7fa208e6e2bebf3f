// Paged causal attention over the KV cache, on tensor cores (flash-attention 2 style), for
// prefill chunks and decode steps alike, with an optional split over the key range
// (flash-decoding) whose partial results `attention_combine` merges.
//
// Cache layout (tileinfer/kv/paged_cache.py): pool[page, kv_head, offset, head_dim] bf16.
// Position p of sequence b lives in page block_tables[b * bt_stride + p / page_size] at
// offset p % page_size.
//
// Work decomposition. Grouped-query attention lets all G = H / KV query heads of a KV head
// share each key and value tile, so a block's 64 "rows" are (token, head-in-group) pairs:
// row R is token R / G, query head kv_head * G + R % G. A block owns 64 such rows of one
// sequence and one KV head, and walks key tiles of 64 positions (gathered page by page);
// each of its 4 warps owns 16 rows. S = Q K^T and O += P V run on mma.m16n8k16 with an
// online softmax in base 2. Shared-memory rows are 256 bytes; chunk c of row r is stored at
// chunk c ^ (r % 8) so ldmatrix reads are free of bank conflicts.
//
// Queries: q[token, head, HD] for the step's tokens; cu_q[b]..cu_q[b+1] are sequence b's.
// kv_lens[b] counts sequence b's positions including this step's, so the step's first token
// sits at position kv_lens[b] - q_len and attends to every position up to its own.
#include "common.cuh"

#define HD 128
#define ROWS 64
#define KT 64
#define THREADS 128
#define SMEM_BYTES ((ROWS + 4 * KT) * HD * 2)  // Q, then K and V double-buffered: 80 KB

__device__ __forceinline__ int swz(int r, int c) { return r * HD + ((c ^ (r & 7)) << 3); }

__device__ __forceinline__ void load_kv_tile(bf16 *sK, bf16 *sV, const bf16 *__restrict__ k_pool,
                                             const bf16 *__restrict__ v_pool, const int *__restrict__ table,
                                             int kv_head, int num_kv_heads, int page_size, int kv_len, int key0) {
#pragma unroll
    for (int i = 0; i < KT * (HD / 8) / THREADS; ++i) {
        const int idx = threadIdx.x + i * THREADS, r = idx >> 4, c = idx & 15;
        const int p = key0 + r;
        const bool ok = p < kv_len;
        size_t at = 0;
        if (ok) {
            const int page = table[p / page_size];
            at = ((size_t)(page * num_kv_heads + kv_head) * page_size + p % page_size) * HD + c * 8;
        }
        cp_async16(smem_addr(sK + swz(r, c)), k_pool + at, ok);
        cp_async16(smem_addr(sV + swz(r, c)), v_pool + at, ok);
    }
}

// ============================================================================= kernels
// grid (row_tiles, num_kv_heads, num_seqs * num_splits), block (128), dynamic smem SMEM_BYTES.
// num_splits == 1: writes normalized bf16 `out`. Otherwise writes, per split, the unnormalized
// f32 output to part_o [splits, total_q, H, HD] and (max, sum) in base 2 to part_ml
// [splits, total_q, H, 2], merged by attention_combine.
extern "C" __global__ void __launch_bounds__(THREADS) attention(
        const bf16 *__restrict__ q, const bf16 *__restrict__ k_pool, const bf16 *__restrict__ v_pool,
        bf16 *__restrict__ out, float *__restrict__ part_o, float *__restrict__ part_ml,
        const int *__restrict__ cu_q, const int *__restrict__ kv_lens, const int *__restrict__ block_tables,
        int bt_stride, int num_heads, int num_kv_heads, int page_size, int num_splits, int total_q,
        float scale_log2) {
    extern __shared__ __align__(128) unsigned char smem[];
    bf16 *sQ = reinterpret_cast<bf16 *>(smem);
    bf16 *sK = sQ + ROWS * HD;  // [2][KT][HD]
    bf16 *sV = sK + 2 * KT * HD;

    const int kv_head = blockIdx.y;
    const int b = blockIdx.z / num_splits, split = blockIdx.z % num_splits;
    const int G = num_heads / num_kv_heads;
    const int q0 = cu_q[b], q_len = cu_q[b + 1] - q0;
    const int kv_len = kv_lens[b];
    const int rows = q_len * G, row0 = blockIdx.x * ROWS;
    if (row0 >= rows) return;
    const int first_pos = kv_len - q_len;
    const int max_qpos = first_pos + (min(row0 + ROWS, rows) - 1) / G;
    const int n_tiles = max_qpos / KT + 1;
    const int per_split = ceil_div(n_tiles, num_splits);
    const int kt_begin = split * per_split, kt_end = min(n_tiles, kt_begin + per_split);
    const int *table = block_tables + (size_t)b * bt_stride;

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;

    // Q tile: 64 rows x 16 chunks; rows past the sequence's are zero.
#pragma unroll
    for (int i = 0; i < ROWS * (HD / 8) / THREADS; ++i) {
        const int idx = threadIdx.x + i * THREADS, r = idx >> 4, c = idx & 15;
        const int R = row0 + r;
        const bool ok = R < rows;
        const size_t at = ok ? ((size_t)(q0 + R / G) * num_heads + kv_head * G + R % G) * HD + c * 8 : 0;
        cp_async16(smem_addr(sQ + swz(r, c)), q + at, ok);
    }
    if (kt_begin < kt_end)
        load_kv_tile(sK, sV, k_pool, v_pool, table, kv_head, num_kv_heads, page_size, kv_len, kt_begin * KT);
    cp_async_commit();

    // The two rows this thread accumulates: warp*16 + g and +8.
    int qpos[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int R = row0 + warp * 16 + g + 8 * h;
        qpos[h] = R < rows ? first_pos + R / G : max_qpos;
    }

    float m[2] = {-TI_INF, -TI_INF}, l[2] = {0.f, 0.f};
    float o[16][4];
#pragma unroll
    for (int i = 0; i < 16; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
    u32 qf[8][4];

    for (int kt = kt_begin; kt < kt_end; ++kt) {
        const int cur = (kt - kt_begin) & 1;
        if (kt + 1 < kt_end)
            load_kv_tile(sK + (cur ^ 1) * KT * HD, sV + (cur ^ 1) * KT * HD, k_pool, v_pool, table, kv_head,
                         num_kv_heads, page_size, kv_len, (kt + 1) * KT);
        cp_async_commit();
        cp_async_wait<1>();
        __syncthreads();
        if (kt == kt_begin) {
#pragma unroll
            for (int ks = 0; ks < 8; ++ks)
                ldmatrix_x4(qf[ks], smem_addr(sQ + swz(warp * 16 + (lane & 15), ks * 2 + (lane >> 4))));
        }
        const bf16 *tK = sK + cur * KT * HD, *tV = sV + cur * KT * HD;

        // S = Q K^T: 16 rows x 64 keys per warp.
        float s[8][4];
#pragma unroll
        for (int i = 0; i < 8; ++i) s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.f;
#pragma unroll
        for (int ks = 0; ks < 8; ++ks) {
#pragma unroll
            for (int np = 0; np < 4; ++np) {
                u32 kb[4];
                ldmatrix_x4(kb, smem_addr(tK + swz(np * 16 + (lane & 7) + ((lane >> 4) << 3), ks * 2 + ((lane >> 3) & 1))));
                const u32 b0[2] = {kb[0], kb[1]}, b1[2] = {kb[2], kb[3]};
                mma_bf16_16816(s[2 * np], qf[ks], b0);
                mma_bf16_16816(s[2 * np + 1], qf[ks], b1);
            }
        }

        // Scale into base 2, mask (causal and past the end), online softmax.
        float mx[2] = {-TI_INF, -TI_INF};
#pragma unroll
        for (int nb = 0; nb < 8; ++nb)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int key = kt * KT + nb * 8 + 2 * t + (e & 1), h = e >> 1;
                const float x = (key > qpos[h] || key >= kv_len) ? -TI_INF : s[nb][e] * scale_log2;
                s[nb][e] = x;
                mx[h] = fmaxf(mx[h], x);
            }
        float alpha[2], m_use[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 1));
            mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 2));
            const float m_new = fmaxf(m[h], mx[h]);
            m_use[h] = m_new == -TI_INF ? 0.f : m_new;  // a row with no visible key yet: avoid inf - inf
            alpha[h] = exp2f(m[h] - m_use[h]);
            m[h] = m_new;
        }
        float rowsum[2] = {0.f, 0.f};
#pragma unroll
        for (int nb = 0; nb < 8; ++nb)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const float p = exp2f(s[nb][e] - m_use[e >> 1]);
                s[nb][e] = p;
                rowsum[e >> 1] += p;
            }
#pragma unroll
        for (int h = 0; h < 2; ++h) l[h] = l[h] * alpha[h] + rowsum[h];
#pragma unroll
        for (int nb = 0; nb < 16; ++nb) {
            o[nb][0] *= alpha[0]; o[nb][1] *= alpha[0];
            o[nb][2] *= alpha[1]; o[nb][3] *= alpha[1];
        }

        // O += P V: P (bf16) is the A operand straight from the S accumulators.
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {
            const u32 a[4] = {pack_bf16x2(s[2 * kk][0], s[2 * kk][1]), pack_bf16x2(s[2 * kk][2], s[2 * kk][3]),
                              pack_bf16x2(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                              pack_bf16x2(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
            for (int dp = 0; dp < 8; ++dp) {
                u32 vb[4];
                ldmatrix_x4_trans(vb, smem_addr(tV + swz(kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8, dp * 2 + (lane >> 4))));
                const u32 b0[2] = {vb[0], vb[1]}, b1[2] = {vb[2], vb[3]};
                mma_bf16_16816(o[2 * dp], a, b0);
                mma_bf16_16816(o[2 * dp + 1], a, b1);
            }
        }
        __syncthreads();  // everyone is done with buffer `cur` before it is refilled
    }
    cp_async_wait<0>();

#pragma unroll
    for (int h = 0; h < 2; ++h) {
        l[h] += __shfl_xor_sync(0xffffffffu, l[h], 1);
        l[h] += __shfl_xor_sync(0xffffffffu, l[h], 2);
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int R = row0 + warp * 16 + g + 8 * h;
        if (R >= rows) continue;
        const size_t row = (size_t)(q0 + R / G) * num_heads + kv_head * G + R % G;
        if (num_splits == 1) {
            const float inv = l[h] > 0.f ? 1.f / l[h] : 0.f;
            u32 *dst = reinterpret_cast<u32 *>(out + row * HD);
#pragma unroll
            for (int nb = 0; nb < 16; ++nb) dst[nb * 4 + t] = pack_bf16x2(o[nb][2 * h] * inv, o[nb][2 * h + 1] * inv);
        } else {
            const size_t prow = (size_t)split * total_q * num_heads + row;
            float2 *dst = reinterpret_cast<float2 *>(part_o + prow * HD);
#pragma unroll
            for (int nb = 0; nb < 16; ++nb) dst[nb * 4 + t] = make_float2(o[nb][2 * h], o[nb][2 * h + 1]);
            if (t == 0) reinterpret_cast<float2 *>(part_ml)[prow] = make_float2(m[h], l[h]);
        }
    }
}

// grid (total_q, num_heads), block (128 = HD). Merges the splits' partial outputs.
extern "C" __global__ void attention_combine(const float *__restrict__ part_o, const float *__restrict__ part_ml,
                                             bf16 *__restrict__ out, int num_splits, int total_q, int num_heads) {
    const size_t row = (size_t)blockIdx.x * num_heads + blockIdx.y;
    const size_t stride = (size_t)total_q * num_heads;
    const float2 *ml = reinterpret_cast<const float2 *>(part_ml);
    float M = -TI_INF;
    for (int s = 0; s < num_splits; ++s) M = fmaxf(M, ml[s * stride + row].x);
    float L = 0.f, acc = 0.f;
    if (M != -TI_INF) {
        for (int s = 0; s < num_splits; ++s) {
            const float2 v = ml[s * stride + row];
            if (v.y == 0.f) continue;  // an empty split (no keys in its range)
            const float w = exp2f(v.x - M);
            L += w * v.y;
            acc += w * part_o[(s * stride + row) * HD + threadIdx.x];
        }
    }
    out[row * HD + threadIdx.x] = f32_to_bf16(L > 0.f ? acc / L : 0.f);
}
