// Paged causal attention over the KV cache on tensor cores (flash-attention 2 style): what its kernels
// share. attention_prefill.cu runs prefill chunks (rows mode), attention_decode.cu decode and verify
// steps (keys mode), both over a BF16 or an INT8 cache, with an optional split over the key range
// (flash-decoding) whose partial results attention_combine.cu merges.
//
// Cache layout (tileinfer/kv/paged_cache.py): pool[page, kv_head, offset, head_dim], bf16 or
// int8; an INT8 cache adds one float32 scale per vector, scale[page, kv_head, offset]. Position p
// of sequence b lives in page block_tables[b * bt_stride + p / page_size] at offset p % page_size.
//
// Work decomposition. Grouped-query attention lets all G = H / KV query heads of a KV head share
// each key and value tile, so a block's "rows" are (token, head-in-group) pairs: row R is token
// R / G, query head kv_head * G + R % G. A block owns the rows of one row tile of one sequence and
// one KV head, and walks key tiles of 64 positions (gathered page by page). Two shapes:
//   - rows mode (prefill): 64 rows per block, each of the 4 warps owns 16 rows and every key;
//   - keys mode (decode, at most 16 rows): 16 rows per block, each warp owns 16 keys of every
//     tile, with its own softmax state; the 4 warps' states are merged at the end. A decode
//     step has G <= 16 rows per KV head, so rows mode would leave 3 of 4 warps with no work.
// S = Q K^T and O += P V run on mma.m16n8k16 with an online softmax in base 2. Shared-memory rows
// of bf16 are 256 bytes; chunk c of row r is stored at chunk c ^ (r % 8) so ldmatrix reads are
// free of bank conflicts.
//
// INT8 cache: tiles arrive as int8 (half the bytes of BF16) into a staging buffer; the scales are
// never applied to the cached values. A key's scale multiplies its column of scores, a value's scale
// multiplies its probability before the P V product; the softmax sum uses the probabilities
// themselves. (Key smoothing needs nothing here: the queries arrive already multiplied by c.)
//
// Queries: q[token, head, HD] for the step's tokens; cu_q[b]..cu_q[b+1] are sequence b's.
// kv_lens[b] counts sequence b's positions including this step's, so the step's first token
// sits at position kv_lens[b] - q_len and attends to every position up to its own.
//
// Fused input (the decode _h8 builds' _fused entry points, a step of one token a sequence): given the QKV
// product (`qkv`), a block does attn_input's work for its own token instead of reading q: its warps RMSNorm
// and rotate the group's query heads into the Q tile (bf16, times the smoothing factors: what attn_input
// writes), and the block whose split holds the new position stores the new key and value into the cache
// before it requests that tile. The step then skips the attn_input launch (tileinfer/kernels/routing.py
// fuses_input).
#pragma once
#include "attn_input.cuh"

// HD (head_dim, 128): attn_input.cuh
#define KT 64
#define THREADS 128
#define STAGE_BYTES (2 * KT * HD + 2 * KT * 4)  // an INT8 staging buffer: K, V codes + their scales

__device__ __forceinline__ int swz(int r, int c) { return r * HD + ((c ^ (r & 7)) << 3); }

// Pipeline depth (tiles in flight + the one being computed) and shared memory, in bytes: the Q
// tile, then the bf16 K and V tiles (one per stage for BF16, one for INT8 prefill), then for INT8 one
// staging buffer per stage (int8 K and V codes and their scales). Decode is bound by how many bytes
// are in flight, so keys mode runs deeper: BF16 3 stages (100 KB, 2 blocks per SM), INT8 4 (72 KB: its
// decode shape reads the int8 tiles directly, no bf16 tiles; 3 blocks per SM, as its 158 registers allow).
// The INT8 _h8 build (under 128 registers) runs 3 stages (55 KB) and 4 blocks an SM: a batch of 64 sequences x 8
// KV heads is then one wave of 512 blocks, not 1.3 (a grid just past one wave idles most SMs in its second).
// (tileinfer/kernels/attention.py smem_bytes mirrors TOTAL; tests/test_attention_routing.py checks it.)
template <bool Q8, bool KEYS, bool HALF = false>
struct Smem {
    static constexpr int ROWS = KEYS ? 16 : 64;
    static constexpr bool DIRECT = Q8 && KEYS;  // INT8 decode: tensor-core operands straight from int8
    static constexpr int STAGES = KEYS ? (Q8 ? (HALF ? 3 : 4) : 3) : 2;
    static constexpr int Q_BYTES = ROWS * HD * 2;
    static constexpr int KV_BUFS = Q8 ? (DIRECT ? 0 : 1) : STAGES;
    static constexpr int TILE_BYTES = KT * HD * 2;                         // one bf16 K or V tile
    static constexpr int STAGE = STAGE_BYTES;
    static constexpr int TOTAL = Q_BYTES + 2 * KV_BUFS * TILE_BYTES + (Q8 ? STAGES * STAGE : 0);
};

// The persistent BF16 _h8 build's (attention_decode.cu, attention_decode_h8_items): Smem<false, true, true>'s layout
// with STAGES Q tiles (kernels/attention.py ITEMS_SMEM mirrors TOTAL).
struct ItemsSmem {
    static constexpr int ROWS = 16, STAGES = 3;
    static constexpr int Q_TILE = ROWS * HD;  // bf16 elements of a Q tile
    static constexpr int Q_BYTES = STAGES * Q_TILE * 2;
    static constexpr int KV_BUFS = STAGES, TILE_BYTES = KT * HD * 2;
    static constexpr int TOTAL = Q_BYTES + 2 * KV_BUFS * TILE_BYTES;
};

// ============================================================================= a block's work
// The entry points' arguments (ATTENTION_KERNEL), but for the fused input's (FusedInput).
struct AttnArgs {
    const bf16 *q;
    const void *k_pool, *v_pool;
    const float *k_scale, *v_scale;  // null for BF16
    bf16 *out;
    float *part_o, *part_ml;
    const int *cu_q, *kv_lens, *block_tables;
    int bt_stride, num_heads, num_kv_heads, page_size, num_splits, total_q;
    float scale_log2;
};

// The fused input's arguments (see the top of the file), which only the _fused builds read (null in the others).
struct FusedInput {
    const bf16 *qkv;
    const int *positions, *slots;
    const bf16 *q_norm_w, *k_norm_w;
    const float *inv_freq, *smooth;  // smooth: the INT8 cache's key-smoothing factors, or null
    void *k_pool, *v_pool;           // the cache attention reads, written at the new position
    float *k_scale, *v_scale;
    float eps;
};

// grid (row_tiles, num_kv_heads, num_seqs * num_splits): the block's rows are row tile blockIdx.x of sequence b
// for KV head blockIdx.y, its keys the tiles [kt_begin, kt_end) of split `split` of the sequence's.
struct Block {
    int kv_head, b, split, G, q0, rows, row0, kv_len, first_pos, max_qpos, kt_begin, kt_end;
    const int *table;  // the sequence's block table
};

// The work of row tile `row_tile` of KV head `kv_head` of z = sequence * num_splits + split (the grid's x, y, z);
// false when it has no rows (past the sequence's last row tile).
template <int ROWS>
__device__ __forceinline__ bool work_of(const AttnArgs &a, unsigned row_tile, unsigned kv_head, unsigned z, Block &w) {
    w.kv_head = kv_head;
    w.b = z / a.num_splits, w.split = z % a.num_splits;
    w.G = a.num_heads / a.num_kv_heads;
    w.q0 = a.cu_q[w.b];
    const int q_len = a.cu_q[w.b + 1] - w.q0;
    w.kv_len = a.kv_lens[w.b];
    w.rows = q_len * w.G, w.row0 = row_tile * ROWS;
    if (w.row0 >= w.rows) return false;
    w.first_pos = w.kv_len - q_len;
    w.max_qpos = w.first_pos + (min(w.row0 + ROWS, w.rows) - 1) / w.G;
    const int n_tiles = w.max_qpos / KT + 1;
    const int per_split = ceil_div(n_tiles, a.num_splits);
    w.kt_begin = w.split * per_split, w.kt_end = min(n_tiles, w.kt_begin + per_split);
    w.table = a.block_tables + (size_t)w.b * a.bt_stride;
    return true;
}

// This block's work (the grid's block).
template <int ROWS>
__device__ __forceinline__ bool block_work(const AttnArgs &a, Block &w) {
    return work_of<ROWS>(a, blockIdx.x, blockIdx.y, blockIdx.z, w);
}

// Row R's (token, query head) index into q and out [T, H].
__device__ __forceinline__ size_t query_row(const AttnArgs &a, const Block &w, int R) {
    return (size_t)(w.q0 + R / w.G) * a.num_heads + w.kv_head * w.G + R % w.G;
}

// Row R's query position; rows past the block's take its last, so they mask nothing the real rows need.
__device__ __forceinline__ int query_position(const Block &w, int R) {
    return R < w.rows ? w.first_pos + R / w.G : w.max_qpos;
}

// The block's shared memory (Smem): the Q tile, the bf16 K and V tiles [KV_BUFS][KT][HD], the INT8
// staging buffers [STAGES][STAGE_BYTES].
struct Tiles {
    bf16 *sQ, *sK, *sV;
    unsigned char *stage;
};

template <class S>
__device__ __forceinline__ Tiles shared_tiles() {
    extern __shared__ __align__(128) unsigned char smem[];
    bf16 *sK = reinterpret_cast<bf16 *>(smem + S::Q_BYTES);
    return {reinterpret_cast<bf16 *>(smem), sK, sK + S::KV_BUFS * KT * HD,
            smem + S::Q_BYTES + 2 * S::KV_BUFS * S::TILE_BYTES};
}

// ============================================================================= key tiles
// The rows of a key tile one thread copies (BF16: 8 rows of 16-byte chunks; INT8: 4 rows of codes
// and one row's scale), and their cache vectors' indices ((page * KV + kv_head) * page_size + offset,
// or -1 past kv_len). Looked up one iteration before the copy is issued, so the block-table read
// never stalls the copy.
template <bool Q8>
struct TileRows {
    static constexpr int N = Q8 ? 5 : 8;
    int vec[N];
};

template <bool Q8>
__device__ __forceinline__ int tile_row(int i) {
    if constexpr (Q8) return i < 4 ? (threadIdx.x >> 3) + 16 * i : (threadIdx.x & (KT - 1));
    return (threadIdx.x >> 4) + 8 * i;
}

// Rows 0 .. SPACED - 1 of a thread's tile rows are STEP positions apart, so only the first needs a
// division by the (run-time) page size; the others step their page offset. (A division per row cost
// more instructions than the rest of the lookup, and decode attention is short of issue slots.)
// Decode shape (KEYS): pages of KT positions (the engine's default) make a key tile one page, looked
// up with one block-table read and no division (key0 is a multiple of KT and below kv_len). (Not in
// the prefill builds, where the second path costs some 30 registers a thread.) In the decode builds other
// page sizes take the general path through a call (lookup_rows_paged), so that a kernel holds one copy of it
// rather than one at each of its five lookups: the plain BF16 _h8 build has 2,328 instructions instead of
// 3,232, and the engine's pages of KT ran 0.1-0.4% faster for it (docs/benchmarks.md).
template <bool Q8>
__device__ __noinline__ TileRows<Q8> lookup_rows_paged(const int *__restrict__ table, int kv_head, int num_kv_heads,
                                                       int page_size, int kv_len, int key0);

template <bool Q8, bool KEYS>
__device__ __forceinline__ TileRows<Q8> lookup_rows(const int *__restrict__ table, int kv_head, int num_kv_heads,
                                                    int page_size, int kv_len, int key0) {
    TileRows<Q8> rows;
    if (KEYS && page_size == KT) {
        const int base = (__ldg(table + key0 / KT) * num_kv_heads + kv_head) * KT;
#pragma unroll
        for (int i = 0; i < TileRows<Q8>::N; ++i) {
            const int r = tile_row<Q8>(i);
            rows.vec[i] = key0 + r < kv_len ? base + r : -1;
        }
        return rows;
    }
    if constexpr (KEYS) return lookup_rows_paged<Q8>(table, kv_head, num_kv_heads, page_size, kv_len, key0);
    constexpr int SPACED = Q8 ? 4 : 8, STEP = Q8 ? 16 : 8;
    int p = key0 + tile_row<Q8>(0), page = p / page_size, off = p - page * page_size;
#pragma unroll
    for (int i = 0; i < SPACED; ++i) {
        if (i > 0) {
            p += STEP;
            off += STEP;
            while (off >= page_size) { off -= page_size; ++page; }
        }
        rows.vec[i] = p < kv_len ? (__ldg(table + page) * num_kv_heads + kv_head) * page_size + off : -1;
    }
#pragma unroll
    for (int i = SPACED; i < TileRows<Q8>::N; ++i) {  // INT8: the row whose scale this thread copies
        const int q = key0 + tile_row<Q8>(i);
        rows.vec[i] = q < kv_len ? (__ldg(table + q / page_size) * num_kv_heads + kv_head) * page_size + q % page_size
                                 : -1;
    }
    return rows;
}

// The decode builds' lookup of pages other than KT positions: the general path, out of line (see lookup_rows).
template <bool Q8>
__device__ __noinline__ TileRows<Q8> lookup_rows_paged(const int *__restrict__ table, int kv_head, int num_kv_heads,
                                                       int page_size, int kv_len, int key0) {
    return lookup_rows<Q8, false>(table, kv_head, num_kv_heads, page_size, kv_len, key0);
}

// BF16: copy a K and V tile into sK / sV (zero past kv_len).
__device__ __forceinline__ void load_tile_bf16(bf16 *sK, bf16 *sV, const bf16 *__restrict__ k_pool,
                                               const bf16 *__restrict__ v_pool, const TileRows<false> &rows) {
#pragma unroll
    for (int i = 0; i < TileRows<false>::N; ++i) {
        const int r = tile_row<false>(i), c = threadIdx.x & 15;
        const bool ok = rows.vec[i] >= 0;
        const size_t at = ok ? (size_t)rows.vec[i] * HD + c * 8 : 0;
        cp_async16(smem_addr(sK + swz(r, c)), k_pool + at, ok);
        cp_async16(smem_addr(sV + swz(r, c)), v_pool + at, ok);
    }
}

// INT8: copy the codes of a K and V tile into stage ([K codes KT x HD][V codes KT x HD][K scales KT]
// [V scales KT]; chunk c of row r at chunk c ^ (r % 8)), zero past kv_len. Threads 0..63 copy keys' scales,
// 64..127 values'.
__device__ __forceinline__ void load_tile_int8(unsigned char *stage, const signed char *__restrict__ k_pool,
                                               const signed char *__restrict__ v_pool,
                                               const float *__restrict__ k_scale, const float *__restrict__ v_scale,
                                               const TileRows<true> &rows) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int r = tile_row<true>(i), c = threadIdx.x & 7;
        const bool ok = rows.vec[i] >= 0;
        const size_t at = ok ? (size_t)rows.vec[i] * HD + c * 16 : 0;
        const int sc = (c ^ (r & 7)) * 16;  // 16-byte chunks swizzled, as the bf16 tiles are
        cp_async16(smem_addr(stage + r * HD + sc), k_pool + at, ok);
        cp_async16(smem_addr(stage + KT * HD + r * HD + sc), v_pool + at, ok);
    }
    const int r = tile_row<true>(4), which = threadIdx.x / KT;
    const bool ok = rows.vec[4] >= 0;
    cp_async4(smem_addr(stage + 2 * KT * HD + (which * KT + r) * 4),
              (which ? v_scale : k_scale) + (ok ? rows.vec[4] : 0), ok);
}

// Key tile kt's rows (lookup_rows for the block's sequence and KV head).
template <bool Q8, bool KEYS>
__device__ __forceinline__ TileRows<Q8> lookup_tile(const AttnArgs &a, const Block &w, int kt) {
    return lookup_rows<Q8, KEYS>(w.table, w.kv_head, a.num_kv_heads, a.page_size, w.kv_len, kt * KT);
}

// Request a key tile into pipeline buffer `buf` (BF16: its K and V tiles; INT8: its staging buffer).
__device__ __forceinline__ void load_tile(const AttnArgs &a, const Tiles &sm, const TileRows<false> &rows, int buf) {
    load_tile_bf16(sm.sK + buf * KT * HD, sm.sV + buf * KT * HD, static_cast<const bf16 *>(a.k_pool),
                   static_cast<const bf16 *>(a.v_pool), rows);
}
__device__ __forceinline__ void load_tile(const AttnArgs &a, const Tiles &sm, const TileRows<true> &rows, int buf) {
    load_tile_int8(sm.stage + buf * STAGE_BYTES, static_cast<const signed char *>(a.k_pool),
                   static_cast<const signed char *>(a.v_pool), a.k_scale, a.v_scale, rows);
}

// Q tile: ROWS rows x 16 chunks; rows past the sequence's are zero.
template <int ROWS>
__device__ __forceinline__ void load_q(const AttnArgs &a, const Block &w, bf16 *sQ) {
#pragma unroll
    for (int i = 0; i < ROWS * (HD / 8) / THREADS; ++i) {
        const int idx = threadIdx.x + i * THREADS, r = idx >> 4, c = idx & 15;
        const int R = w.row0 + r;
        const bool ok = R < w.rows;
        const size_t at = ok ? query_row(a, w, R) * HD + c * 8 : 0;
        cp_async16(smem_addr(sQ + swz(r, c)), a.q + at, ok);
    }
}

// The prologue's tiles from `first` on of the first STAGES - 1: one commit group each, empty past the end.
template <int STAGES, bool Q8, bool KEYS>
__device__ __forceinline__ void request_tiles(const AttnArgs &a, const Block &w, const Tiles &sm, int first) {
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s >= first) {
            if (w.kt_begin + s < w.kt_end) load_tile(a, sm, lookup_tile<Q8, KEYS>(a, w, w.kt_begin + s), s);
            cp_async_commit();
        }
    }
}

// The rows of the tile the first iteration requests (the prologue looks them up).
template <int STAGES, bool Q8, bool KEYS>
__device__ __forceinline__ TileRows<Q8> first_refill(const AttnArgs &a, const Block &w) {
    TileRows<Q8> rows;
    if (w.kt_begin + STAGES - 1 < w.kt_end) rows = lookup_tile<Q8, KEYS>(a, w, w.kt_begin + STAGES - 1);
    return rows;
}

// The top of key tile kt: wait until it has landed (this thread's copies: all but the newest STAGES - 2
// commit groups, or every group with `wait_all`; then everyone's), when everyone is also done with tile
// kt - 1's buffers; refill them with tile kt + STAGES - 1 and look up the rows of the one after.
template <int STAGES, bool Q8, bool KEYS>
__device__ __forceinline__ void advance(const AttnArgs &a, const Block &w, const Tiles &sm, int kt, bool wait_all,
                                        TileRows<Q8> &next_rows) {
    const int i = kt - w.kt_begin;
    if (wait_all) cp_async_wait<0>();
    else cp_async_wait<STAGES - 2>();
    __syncthreads();
    if (kt + STAGES - 1 < w.kt_end) {
        load_tile(a, sm, next_rows, (i + STAGES - 1) % STAGES);
        if (kt + STAGES < w.kt_end) next_rows = lookup_tile<Q8, KEYS>(a, w, kt + STAGES);
    }
    cp_async_commit();
}

// ============================================================================= the online softmax
// A thread's share of its rows' state: running maxima m and sums l (over its own keys) of its two rows (g and
// g + 8 of the warp's 16; the transposed builds: 2t and 2t + 1), and its O (or O^T) accumulators.
template <int NO>
struct RowState {
    float m[2], l[2];
    float o[NO][4];
};

template <int NO>
__device__ __forceinline__ void start_rows(RowState<NO> &st) {
    st.m[0] = st.m[1] = -TI_INF;
    st.l[0] = st.l[1] = 0.f;
#pragma unroll
    for (int i = 0; i < NO; ++i) st.o[i][0] = st.o[i][1] = st.o[i][2] = st.o[i][3] = 0.f;
}

// The A fragments of the warp's 16 query rows from wrow on (bf16, for mma_bf16_16816).
__device__ __forceinline__ void query_fragments(const bf16 *sQ, int wrow, int lane, u32 (&qf)[8][4]) {
#pragma unroll
    for (int ks = 0; ks < 8; ++ks) ldmatrix_x4(qf[ks], smem_addr(sQ + swz(wrow + (lane & 15), ks * 2 + (lane >> 4))));
}

// S = Q K^T for 16 rows x the NB * 8 keys from wkey on of a bf16 K tile.
template <int NB>
__device__ __forceinline__ void scores_bf16(const bf16 *tK, const u32 (&qf)[8][4], float (&s)[NB][4], int wkey,
                                            int lane) {
#pragma unroll
    for (int i = 0; i < NB; ++i) s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.f;
#pragma unroll
    for (int ks = 0; ks < 8; ++ks) {
#pragma unroll
        for (int np = 0; np < NB / 2; ++np) {
            u32 kb[4];
            ldmatrix_x4(kb, smem_addr(tK + swz(wkey + np * 16 + (lane & 7) + ((lane >> 4) << 3),
                                               ks * 2 + ((lane >> 3) & 1))));
            const u32 b0[2] = {kb[0], kb[1]}, b1[2] = {kb[2], kb[3]};
            mma_bf16_16816(s[2 * np], qf[ks], b0);
            mma_bf16_16816(s[2 * np + 1], qf[ks], b1);
        }
    }
}

// The scores of tile kt into base 2 (SCALE: times scale_log2; the INT8 decode builds' queries carry it), times
// the key's scale (Q8), masked where MASKED (causal and past the end); mx: the NH row halves' maxima over this
// lane's keys.
template <bool MASKED, bool SCALE, bool Q8, int NB, int NH>
__device__ __forceinline__ void scale_scores(float (&s)[NB][4], float (&mx)[2], float scale_log2, const float *ksc,
                                             int wkey, int t, int kt, const int (&qpos)[2], int kv_len) {
#pragma unroll
    for (int nb = 0; nb < NB; ++nb)
#pragma unroll
        for (int e = 0; e < 2 * NH; ++e) {
            const int kl = wkey + nb * 8 + 2 * t + (e & 1), h = e >> 1;
            float x = SCALE ? s[nb][e] * scale_log2 : s[nb][e];
            if constexpr (Q8) x *= ksc[kl];
            if constexpr (MASKED) {
                const int key = kt * KT + kl;
                x = (key > qpos[h] || key >= kv_len) ? -TI_INF : x;
            }
            s[nb][e] = x;
            mx[h] = fmaxf(mx[h], x);
        }
}

// The running maxima of the NH row halves after this tile (mx over a row's 4 lanes of one g): alpha, the factor
// the row's old sum and O take, and m_use, the maximum P is taken against.
template <int NH>
__device__ __forceinline__ void raise_max(float (&mx)[2], float (&m)[2], float (&m_use)[2], float (&alpha)[2]) {
#pragma unroll
    for (int h = 0; h < NH; ++h) {
        mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 1));
        mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 2));
        const float m_new = fmaxf(m[h], mx[h]);
        m_use[h] = m_new == -TI_INF ? 0.f : m_new;  // a row with no visible key yet: avoid inf - inf
        alpha[h] = exp2f(m[h] - m_use[h]);
        m[h] = m_new;
    }
}

// P = 2^(s - m_use) in place (Q8: times the value's scale and pv_unit, the P V operand), and the rows' sums:
// l = l * alpha + this tile's.
template <bool Q8, int NB, int NH>
__device__ __forceinline__ void probabilities(float (&s)[NB][4], const float (&m_use)[2], const float (&alpha)[2],
                                              float (&l)[2], const float *vsc, float pv_unit, int wkey, int t) {
    float rowsum[2] = {0.f, 0.f};
#pragma unroll
    for (int nb = 0; nb < NB; ++nb)
#pragma unroll
        for (int e = 0; e < 2 * NH; ++e) {
            const float p = exp2f(s[nb][e] - m_use[e >> 1]);
            rowsum[e >> 1] += p;
            if constexpr (Q8) {
                s[nb][e] = p * (vsc[wkey + nb * 8 + 2 * t + (e & 1)] * pv_unit);
            } else {
                s[nb][e] = p;
            }
        }
#pragma unroll
    for (int h = 0; h < NH; ++h) l[h] = l[h] * alpha[h] + rowsum[h];
}

// O of rows g and g + 8 times their factors, when the running maxima moved (rare after the first tiles).
__device__ __forceinline__ void rescale_rows(float (&o)[16][4], const float (&o_alpha)[2]) {
    if (o_alpha[0] != 1.f || o_alpha[1] != 1.f) {
#pragma unroll
        for (int nb = 0; nb < 16; ++nb) {
            o[nb][0] *= o_alpha[0]; o[nb][1] *= o_alpha[0];
            o[nb][2] *= o_alpha[1]; o[nb][3] *= o_alpha[1];
        }
    }
}

// O += P V over the NB * 8 keys from wkey on of a bf16 V tile: P (bf16) is the A operand straight from the S
// accumulators.
template <int NB>
__device__ __forceinline__ void pv_bf16(const bf16 *tV, const float (&s)[NB][4], float (&o)[16][4], int wkey,
                                        int lane) {
#pragma unroll
    for (int kk = 0; kk < NB / 2; ++kk) {
        const u32 a[4] = {pack_bf16x2(s[2 * kk][0], s[2 * kk][1]), pack_bf16x2(s[2 * kk][2], s[2 * kk][3]),
                          pack_bf16x2(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                          pack_bf16x2(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
        for (int dp = 0; dp < 8; ++dp) {
            u32 vb[4];
            ldmatrix_x4_trans(vb, smem_addr(tV + swz(wkey + kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8,
                                                     dp * 2 + (lane >> 4))));
            const u32 b0[2] = {vb[0], vb[1]}, b1[2] = {vb[2], vb[3]};
            mma_bf16_16816(o[2 * dp], a, b0);
            mma_bf16_16816(o[2 * dp + 1], a, b1);
        }
    }
}

// The rows' sums over the lanes that hold their keys: lanes FROM, 2 FROM, ... apart below TO.
template <int NH, int FROM, int TO>
__device__ __forceinline__ void sum_over_lanes(float (&l)[2]) {
#pragma unroll
    for (int h = 0; h < NH; ++h) {
#pragma unroll
        for (int off = FROM; off < TO; off <<= 1) l[h] += __shfl_xor_sync(0xffffffffu, l[h], off);
    }
}

// ============================================================================= INT8 decode operands
// INT8 decode's Q K^T in fp16: int8 codes are exact in fp16 and convert with fewer
// instructions than to bf16 (each byte, biased to unsigned, becomes the low byte of the half 1024 + u:
// two byte permutes and one packed subtraction for four values); the queries, bf16, convert exactly
// to fp16 times the softmax scale (1/sqrt(128) log2(e): 8x more headroom below fp16's 65504 for
// queries multiplied by the smoothing factors), so the scores need no scaling afterwards.
__device__ __forceinline__ void i8x4_to_f16x4(u32 w, u32 &lo, u32 &hi) {
    const u32 u = w ^ 0x80808080u;
    const u32 a = __byte_perm(u, 0x64646464u, 0x4140), b = __byte_perm(u, 0x64646464u, 0x4342);
    const u32 bias = 0x64806480u;  // 1152 = 1024 + 128, twice
    asm("sub.f16x2 %0, %1, %2;" : "=r"(lo) : "r"(a), "r"(bias));
    asm("sub.f16x2 %0, %1, %2;" : "=r"(hi) : "r"(b), "r"(bias));
}
// The same for the bytes of w taken as (0, 2) and (1, 3): lo holds bytes 0 and 2, hi bytes 1 and 3 (the
// even and odd columns direct_pv needs), the split folded into the two permutes.
__device__ __forceinline__ void i8x4_to_f16x4_split_biased(u32 w, u32 &lo, u32 &hi) {  // 1152 + code
    const u32 u = w ^ 0x80808080u;
    lo = __byte_perm(u, 0x64646464u, 0x4240);
    hi = __byte_perm(u, 0x64646464u, 0x4341);
}
__device__ __forceinline__ void i8x4_to_f16x4_split(u32 w, u32 &lo, u32 &hi) {
    u32 a, b;
    i8x4_to_f16x4_split_biased(w, a, b);
    const u32 bias = 0x64806480u;
    asm("sub.f16x2 %0, %1, %2;" : "=r"(lo) : "r"(a), "r"(bias));
    asm("sub.f16x2 %0, %1, %2;" : "=r"(hi) : "r"(b), "r"(bias));
}
__device__ __forceinline__ u32 bf16x2_to_f16x2(u32 v, float scale) {  // times scale, saturated
    u32 r;
    asm("cvt.rn.satfinite.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(bf16hi(v) * scale), "f"(bf16lo(v) * scale));
    return r;
}
__device__ __forceinline__ void mma_f16_16816(float d[4], const u32 a[4], const u32 b[2]) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
                 "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// INT8 decode ("direct"): tensor-core operands straight from the int8 tiles, converted in registers.
// ldmatrix reads the int8 rows as b16 pairs; what a lane receives fixes a channel or column order,
// which the other operand follows, so nothing is shuffled:
//  - S += Q K^T for the warp's 16 keys: a lane gets key g's channels 4t..4t+3 of a 16-channel slice
//    (one u32); widened, they are b0 (4t, 4t+1) and b1 (4t+2, 4t+3). The queries' A fragments use
//    the same permutation (loaded in the prologue).
__device__ __forceinline__ void direct_qk(const unsigned char *k_codes, const u32 (&qf)[8][4], float (&s)[2][4],
                                          int wkey, int lane) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        // Matrix m = lane / 8 of this ldmatrix: 8 keys (half m & 1) x channel slice 2j + (m >> 1).
        const int m = lane >> 3, key = wkey + (m & 1) * 8 + (lane & 7), ks = 2 * j + (m >> 1);
        u32 r[4];
        ldmatrix_x4(r, smem_addr(k_codes + key * HD + ((ks ^ (key & 7)) << 4)));
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            u32 b[2];
            i8x4_to_f16x4(r[i], b[0], b[1]);
            mma_f16_16816(s[i & 1], qf[2 * j + (i >> 1)], b);
        }
    }
}

//  - O += P V over the warp's 16 keys: ldmatrix.trans gives a lane the byte pairs (columns 2g, 2g+1)
//    of keys 2t and 2t+1; the even bytes are the B fragment of column 2g, the odd ones of 2g + 1.
//    So for each 16-column block b, o[2b] accumulates columns 16b + 2n and o[2b + 1] columns
//    16b + 2n + 1 (n = the mma's column): a thread holds 16b + 4t + {0, 1, 2, 3}. In fp16, as Q K^T:
//    the value codes widen with two byte permutes and a packed subtraction per four (bf16 took four
//    float32 subtractions, the kernel's extra FP32 work in ncu). P (probabilities times the values'
//    scales) goes to fp16 in units of 2^(vexp - 126), vexp the largest exponent of a value scale the warp
//    has seen (raised tile by tile, o rescaled by the power of two as for a new maximum): every P < 1,
//    and fp16's 11 bits hold it down to 2^-14 of the largest; o is scaled back before the warps merge.
__device__ __forceinline__ u32 pack_f16x2(float lo, float hi) {
    u32 r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}
// The value codes of the warp's 16 keys in channels 32j .. 32j + 31, widened to fp16: ldmatrix.trans gives
// a lane the byte pairs (channels 2g, 2g + 1 of a 16-channel slice) of keys 2t and 2t + 1. w[d] holds slice
// 2j + d: {channel 2g, keys 2t, 2t + 1}, {2g + 1, the same keys}, {2g, keys 8 + 2t, 9 + 2t}, {2g + 1, those}.
__device__ __forceinline__ void widen_values(const unsigned char *v_codes, int j, int wkey, int lane, u32 (&w)[2][4]) {
    // Matrix m: 8 keys (half m & 1) x the 16 columns of block 2j + (m >> 1).
    const int m = lane >> 3, key = wkey + (m & 1) * 8 + (lane & 7), blk = 2 * j + (m >> 1);
    u32 r[4];
    ldmatrix_x4_trans(r, smem_addr(v_codes + key * HD + ((blk ^ (key & 7)) << 4)));
#pragma unroll
    for (int d = 0; d < 2; ++d) {
        i8x4_to_f16x4_split(r[2 * d], w[d][0], w[d][1]);
        i8x4_to_f16x4_split(r[2 * d + 1], w[d][2], w[d][3]);
    }
}
__device__ __forceinline__ void direct_pv(const unsigned char *v_codes, const u32 (&a)[4], float (&o)[16][4],
                                          int wkey, int lane) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        u32 w[2][4];
        widen_values(v_codes, j, wkey, lane, w);
#pragma unroll
        for (int d = 0; d < 2; ++d) {
            const u32 be[2] = {w[d][0], w[d][2]}, bo[2] = {w[d][1], w[d][3]};  // keys 0..7 (b0), 8..15 (b1)
            mma_f16_16816(o[2 * (2 * j + d)], a, be);
            mma_f16_16816(o[2 * (2 * j + d) + 1], a, bo);
        }
    }
}

// The INT8 _h8 build ("ST"): Q K^T transposed too, S^T = K Q^T, the warp's 16 keys as the mma's M and the block's
// 8 rows as its N, so no score is padding (half the mmas of direct_qk, half the query fragments). K's A fragment
// is what direct_qk widens (a0 / a1: keys g / g + 8, channels 4t, 4t + 1 of the slice; a2 / a3: 4t + 2, 4t + 3),
// Q^T's B fragment the queries' row g (qf[ks][0], qf[ks][2]). Even and odd slices accumulate apart (two chains of
// 4 mmas, not one of 8). sa + sb: keys g (c0, c1) and g + 8 (c2, c3) of rows 2t (c0, c2) and 2t + 1 (c1, c3).
__device__ __forceinline__ void direct_qk_t(const unsigned char *k_codes, const u32 (&qf)[8][4], float (&sa)[4],
                                            float (&sb)[4], int wkey, int lane) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const int m = lane >> 3, key = wkey + (m & 1) * 8 + (lane & 7), ks = 2 * j + (m >> 1);
        u32 r[4];  // keys g, g + 8 of slice 2j; the same of slice 2j + 1
        ldmatrix_x4(r, smem_addr(k_codes + key * HD + ((ks ^ (key & 7)) << 4)));
#pragma unroll
        for (int d = 0; d < 2; ++d) {
            u32 lo0, hi0, lo1, hi1;
            i8x4_to_f16x4(r[2 * d], lo0, hi0);
            i8x4_to_f16x4(r[2 * d + 1], lo1, hi1);
            const u32 a[4] = {lo0, lo1, hi0, hi1}, b[2] = {qf[2 * j + d][0], qf[2 * j + d][2]};
            mma_f16_16816(d ? sb : sa, a, b);
        }
    }
}
// The value codes of the warp's 16 keys as ldmatrix.trans gives them (widen_values' r, for j = 0..3).
__device__ __forceinline__ void load_values_t(const unsigned char *v_codes, int wkey, int lane, u32 (&r)[4][4]) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const int m = lane >> 3, key = wkey + (m & 1) * 8 + (lane & 7), blk = 2 * j + (m >> 1);
        ldmatrix_x4_trans(r[j], smem_addr(v_codes + key * HD + ((blk ^ (key & 7)) << 4)));
    }
}
// The INT8 _h8 build's P V, transposed: O^T += V^T P^T, the 16 channels of a slice as the mma's M and the block's
// 8 rows as its N, so no accumulator row is padding (half the mmas and half the accumulators of direct_pv).
// P^T's B fragment: b0 keys 2t, 2t+1, b1 keys 8 + 2t, 9 + 2t, of row g. V^T's A fragment is what widen_values
// gives (r: load_values_t): its rows g / g + 8 are the even / odd channels. So ot[2j + d] holds channels
// 32j + 16d + 2g (c0, c1) and + 1 (c2, c3), of rows 2t and 2t + 1. The codes are widened without the bias'
// subtraction: each value enters as 1152 + code, and psum accumulates 1152 x the sum of P (the same mma with
// 1152 for every value), which the end subtracts from O^T (psum c0 / c1: rows 2t / 2t + 1, as O^T's). Two
// permutes and a xor per four values instead of also two packed subtractions; the products are exact in fp32
// (11-bit P x 11-bit integer) and O's sum in fp32 loses to the bias at most log2(1279 / 127) ~ 3.3 of its 24
// bits, against INT8's 8.
__device__ __forceinline__ void direct_pv_t_biased(const u32 (&r)[4][4], const u32 (&p)[2], float (&ot)[8][4],
                                                   float (&psum)[4]) {
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int d = 0; d < 2; ++d) {
            u32 w[4];
            i8x4_to_f16x4_split_biased(r[j][2 * d], w[0], w[1]);
            i8x4_to_f16x4_split_biased(r[j][2 * d + 1], w[2], w[3]);
            mma_f16_16816(ot[2 * j + d], w, p);
        }
    const u32 bias[4] = {0x64806480u, 0x64806480u, 0x64806480u, 0x64806480u};  // 1152 in every element
    mma_f16_16816(psum, bias, p);
}
// INT8 decode: raise P's unit to cover vm, the largest value scale of the warp's keys in this tile (the same in
// every lane). vexp is the largest biased exponent seen so far (P goes to fp16 in units of 2^(vexp - 126)).
// False when vm fits the unit already; otherwise true, with `shrink` the factor O takes, 2^-(the rise).
__device__ __forceinline__ bool raise_value_unit(float vm, int &vexp, float &shrink) {
    const int eb = min(max((int)(__float_as_uint(vm) >> 23), 1), 252);  // vm < 2^(eb - 126)
    if (eb <= vexp) return false;
    const int up = eb - vexp;
    shrink = up <= 126 ? __uint_as_float((u32)(127 - up) << 23) : 0.f;  // 2^-up
    vexp = eb;
    return true;
}
__device__ __forceinline__ u32 movmatrix_trans(u32 x) {  // the transpose's fragment of an 8 x 8 b16 matrix
    u32 r;
    asm("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(r) : "r"(x));
    return r;
}
__device__ __forceinline__ float fast_exp2(float x) {  // 2^x, results below 2^-126 flushed to 0 (exp2f checks)
    float r;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
    return r;
}

// ============================================================================= the entry points
// grid (row_tiles, num_kv_heads, num_seqs * num_splits), block (THREADS), dynamic smem Smem::TOTAL.
// num_splits == 1: writes normalized bf16 `out`. Otherwise writes, per split, the unnormalized
// f32 output to part_o [splits, total_q, H, HD] and (max, sum) in base 2 to part_ml
// [splits, total_q, H, 2], merged by attention_combine (attention_combine.cu). k_scale / v_scale are null
// for BF16. The fused input's arguments (qkv .. eps) matter to the decode _h8 builds only; the others ignore
// them. BODY(const AttnArgs &, const FusedInput &) is the kernel's.
#define ATTENTION_KERNEL(NAME, BOUNDS, BODY)                                                                 \
    extern "C" __global__ void BOUNDS NAME(                                                                 \
            const bf16 *__restrict__ q, void *__restrict__ k_pool, void *__restrict__ v_pool,               \
            float *__restrict__ k_scale, float *__restrict__ v_scale, bf16 *__restrict__ out,                \
            float *__restrict__ part_o, float *__restrict__ part_ml, const int *__restrict__ cu_q,           \
            const int *__restrict__ kv_lens, const int *__restrict__ block_tables, int bt_stride,            \
            int num_heads, int num_kv_heads, int page_size, int num_splits, int total_q, float scale_log2,    \
            const bf16 *__restrict__ qkv, const int *__restrict__ positions, const int *__restrict__ slots,  \
            const bf16 *__restrict__ q_norm_w, const bf16 *__restrict__ k_norm_w,                           \
            const float *__restrict__ inv_freq, const float *__restrict__ smooth, float eps) {              \
        BODY(AttnArgs{q, k_pool, v_pool, k_scale, v_scale, out, part_o, part_ml, cu_q, kv_lens, block_tables, \
                      bt_stride, num_heads, num_kv_heads, page_size, num_splits, total_q, scale_log2},      \
             FusedInput{qkv, positions, slots, q_norm_w, k_norm_w, inv_freq, smooth, k_pool, v_pool,         \
                        k_scale, v_scale, eps});                                                            \
    }
