// Paged causal attention over the KV cache, on tensor cores (flash-attention 2 style), for
// prefill chunks and decode steps alike, over a BF16 or an INT8 cache, with an optional split
// over the key range (flash-decoding) whose partial results `attention_combine` merges.
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
// INT8 cache: tiles arrive as int8 (half the bytes of BF16) into a staging buffer and are widened
// to bf16 in shared memory (exact: the codes are integers in [-127, 127]); the scales are never
// applied to the cached values. A key's scale multiplies its column of scores, a value's scale
// multiplies its probability before the P V product; the softmax sum uses the probabilities
// themselves. (Key smoothing needs nothing here: the queries arrive already multiplied by c.)
//
// Queries: q[token, head, HD] for the step's tokens; cu_q[b]..cu_q[b+1] are sequence b's.
// kv_lens[b] counts sequence b's positions including this step's, so the step's first token
// sits at position kv_lens[b] - q_len and attends to every position up to its own.
//
// Fused input (the decode _h8 builds, a step of one token a sequence): given the QKV product (`qkv` not
// null), a block does attn_input's work for its own token instead of reading q: its warps RMSNorm and rotate
// the group's query heads into the Q tile (bf16, times the smoothing factors: what attn_input writes), and the
// block whose split holds the new position stores the new key and value into the cache before it requests
// that tile. The step then skips the attn_input launch (tileinfer/kernels/attention.py fuses_input).
#include "attn_input.cuh"

// HD (head_dim, 128): attn_input.cuh
#define KT 64
#define THREADS 128

__device__ __forceinline__ int swz(int r, int c) { return r * HD + ((c ^ (r & 7)) << 3); }

// Pipeline depth (tiles in flight + the one being computed) and shared memory, in bytes: the Q
// tile, then the bf16 K and V tiles (one per stage for BF16, one for INT8), then for INT8 one
// staging buffer per stage (int8 K and V codes and their scales). Decode is bound by how many bytes
// are in flight, so keys mode runs deeper: BF16 3 stages (100 KB, 2 blocks per SM), INT8 4 (72 KB: its
// decode shape reads the int8 tiles directly, no bf16 tiles; 3 blocks per SM, as its 158 registers allow).
// The INT8 _h8 build (under 128 registers) runs 3 stages (55 KB) and 4 blocks an SM: a batch of 64 sequences x 8
// KV heads is then one wave of 512 blocks, not 1.3 (a grid just past one wave idles most SMs in its second).
template <bool Q8, bool KEYS, bool HALF = false>
struct Smem {
    static constexpr int ROWS = KEYS ? 16 : 64;
    static constexpr bool DIRECT = Q8 && KEYS;  // INT8 decode: tensor-core operands straight from int8
    static constexpr int STAGES = KEYS ? (Q8 ? (HALF ? 3 : 4) : 3) : 2;
    static constexpr int Q_BYTES = ROWS * HD * 2;
    static constexpr int KV_BUFS = Q8 ? (DIRECT ? 0 : 1) : STAGES;
    static constexpr int TILE_BYTES = KT * HD * 2;                         // one bf16 K or V tile
    static constexpr int STAGE = 2 * KT * HD + 2 * KT * 4;                 // INT8: K, V codes + scales
    static constexpr int TOTAL = Q_BYTES + 2 * KV_BUFS * TILE_BYTES + (Q8 ? STAGES * STAGE : 0);
};

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
// the prefill builds, where the second path costs some 30 registers a thread.)
template <bool Q8, bool KEYS>
__device__ __forceinline__ TileRows<Q8> lookup_rows(const int *__restrict__ table, int kv_head, int num_kv_heads,
                                                    int page_size, int kv_len, int key0) {
    constexpr int SPACED = Q8 ? 4 : 8, STEP = Q8 ? 16 : 8;
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
// [V scales KT]; chunk c of row r at chunk c ^ (r % 8)), zero past kv_len. Threads 0..63 copy keys' scales, 64..127 values'.
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
    cp_async4(smem_addr(stage + 2 * KT * HD + (which * KT + r) * 4), (which ? v_scale : k_scale) + (ok ? rows.vec[4] : 0),
              ok);
}

// INT8: widen a staged K and V tile to bf16 (swizzled) in sK / sV. Rows mode: the block widens all
// 64 keys together. Keys mode: each warp widens only its own 16 keys (the only ones it reads), so
// a __syncwarp suffices afterwards.
template <bool KEYS>
__device__ __forceinline__ void widen_tile(const unsigned char *stage, bf16 *sK, bf16 *sV) {
    constexpr int ROWS_W = KEYS ? 16 : KT;        // rows widened by this thread's group
    constexpr int GROUP = KEYS ? 32 : THREADS;    // threads in the group
    const int tid = threadIdx.x % GROUP, row0 = KEYS ? (threadIdx.x / 32) * 16 : 0;
#pragma unroll
    for (int i = 0; i < 2 * ROWS_W * (HD / 16) / GROUP; ++i) {
        const int idx = tid + i * GROUP;
        const int which = idx / (ROWS_W * HD / 16), r = row0 + (idx >> 3) % ROWS_W, c = idx & 7;
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

// The fused input's arguments (see the top of the file); qkv null: the queries come from q (attn_input ran).
struct FusedInput {
    const bf16 *qkv;
    const int *positions, *slots;
    const bf16 *q_norm_w, *k_norm_w;
    const float *inv_freq, *smooth;  // smooth: the INT8 cache's key-smoothing factors, or null
    void *k_pool, *v_pool;           // the cache attention reads, written at the new position
    float *k_scale, *v_scale;
    float eps;
};

// A compile-time flag for a generic lambda's argument (decltype(arg)::value).
template <bool V> struct Flag { static constexpr bool value = V; };

// ============================================================================= the kernel body
// grid (row_tiles, num_kv_heads, num_seqs * num_splits), block (128), dynamic smem Smem::TOTAL.
// num_splits == 1: writes normalized bf16 `out`. Otherwise writes, per split, the unnormalized
// f32 output to part_o [splits, total_q, H, HD] and (max, sum) in base 2 to part_ml
// [splits, total_q, H, 2], merged by attention_combine.
// HALF (decode shape only): the block has at most 8 rows (a decode step: one token x a group of G <= 8), so
// the score accumulator rows 8-15 each thread holds (h = 1 below; the mma computes them anyway) are padding:
// their scaling, softmax and P packing are skipped, about half the per-key FP32 work. And O is kept
// transposed, O^T = V^T P^T with the 8 rows as the mma's N (direct_pv_t_biased): half the P V mmas and accumulators
// (for INT8, with Q K^T transposed too, direct_qk_t, the registers that let 4 blocks share an SM).
template <bool Q8, bool KEYS, bool HALF = false>
__device__ __forceinline__ void attention_body(
        const bf16 *__restrict__ q, const void *__restrict__ k_pool, const void *__restrict__ v_pool,
        const float *__restrict__ k_scale, const float *__restrict__ v_scale,
        bf16 *__restrict__ out, float *__restrict__ part_o, float *__restrict__ part_ml,
        const int *__restrict__ cu_q, const int *__restrict__ kv_lens, const int *__restrict__ block_tables,
        int bt_stride, int num_heads, int num_kv_heads, int page_size, int num_splits, int total_q,
        float scale_log2, const FusedInput &fin) {
    using S = Smem<Q8, KEYS, HALF>;
    static_assert(KEYS || !HALF, "HALF is a decode-shape build");
    constexpr int ROWS = S::ROWS, STAGES = S::STAGES;
    // ST: the INT8 _h8 build's transposed Q K^T (direct_qk_t): a lane's rows are 2t and 2t + 1, not g and g + 8.
    constexpr bool ST = S::DIRECT && HALF;
    constexpr int NH = HALF && !ST ? 1 : 2;  // accumulator row halves (g, g + 8) that hold real rows
    constexpr int NB = KEYS ? 2 : 8;  // 8-key column blocks of S per warp
    extern __shared__ __align__(128) unsigned char smem[];
    bf16 *sQ = reinterpret_cast<bf16 *>(smem);
    bf16 *sK = reinterpret_cast<bf16 *>(smem + S::Q_BYTES);  // [KV_BUFS][KT][HD]
    bf16 *sV = sK + S::KV_BUFS * KT * HD;
    unsigned char *stage = smem + S::Q_BYTES + 2 * S::KV_BUFS * S::TILE_BYTES;  // INT8 only: [STAGES][STAGE]

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
    const int wrow = KEYS ? 0 : warp * 16;  // the warp's first row in the tile
    const int wkey = KEYS ? warp * 16 : 0;  // the warp's first key in each key tile

    auto lookup = [&](int kt) { return lookup_rows<Q8, KEYS>(table, kv_head, num_kv_heads, page_size, kv_len, kt * KT); };
    auto load_tile = [&](const TileRows<Q8> &tile_rows, int buf) {
        if constexpr (Q8) {
            load_tile_int8(stage + buf * S::STAGE, static_cast<const signed char *>(k_pool),
                           static_cast<const signed char *>(v_pool), k_scale, v_scale, tile_rows);
        } else {
            load_tile_bf16(sK + buf * KT * HD, sV + buf * KT * HD, static_cast<const bf16 *>(k_pool),
                           static_cast<const bf16 *>(v_pool), tile_rows);
        }
    };

    // Q tile: ROWS rows x 16 chunks; rows past the sequence's are zero.
    auto load_q = [&]() {
#pragma unroll
        for (int i = 0; i < ROWS * (HD / 8) / THREADS; ++i) {
            const int idx = threadIdx.x + i * THREADS, r = idx >> 4, c = idx & 15;
            const int R = row0 + r;
            const bool ok = R < rows;
            const size_t at = ok ? ((size_t)(q0 + R / G) * num_heads + kv_head * G + R % G) * HD + c * 8 : 0;
            cp_async16(smem_addr(sQ + swz(r, c)), q + at, ok);
        }
    };
    // Prologue: the first STAGES - 1 tiles in flight (one commit group each, empty past the end),
    // and the rows of the next one looked up. Decode shape: the tiles that hold only positions before
    // this step's (written by earlier steps; the kernel before this one, attn_input, writes q and this
    // step's keys and values only) are requested before waiting for that kernel (pdl_start), so their
    // latency overlaps it; so are their lookups (cu_q, kv_lens and the block tables come from the host).
    // Then Q (the kernel before's output) in a commit group of its own, and the rest of the prologue.
    // Groups: the `early` old tiles, Q, the other prologue tiles, then one per iteration. Prefill
    // shape: Q and the first tile in group 0 (the waits below then count as if early were 0).
    int early = 0;
    if constexpr (KEYS) {
        const int old_end = min(kt_end, first_pos / KT);  // tiles kt < old_end hold positions < first_pos only
        early = max(0, min(STAGES - 1, old_end - kt_begin));
#pragma unroll
        for (int s = 0; s < STAGES - 1; ++s) {
            if (s < early) {
                load_tile(lookup(kt_begin + s), s);
                cp_async_commit();
            }
        }
        // Fused input: this warp's first head prepared before the wait (what no kernel writes). Tasks: the
        // group's query heads (rows 0 .. G - 1), then, in the block whose split holds the new position, its key
        // head (with the value head).
        const bool fused = HALF && fin.qkv != nullptr;
        const int kt_new = (kv_len - 1) / KT;
        const int n_tasks = G + (kt_new >= kt_begin && kt_new < kt_end ? 1 : 0);
        auto task_head = [&](int task) { return task < G ? kv_head * G + task : num_heads + kv_head; };
        HeadInput hin;
        bool hwork = false;
        float f0 = 1.f, f1 = 1.f;
        if (fused) {
            if (Q8 && fin.smooth) { f0 = fin.smooth[2 * lane]; f1 = fin.smooth[2 * lane + 1]; }
            if (warp < n_tasks)
                hwork = prepare_head(fin.positions, fin.slots, fin.q_norm_w, fin.k_norm_w, fin.inv_freq, q0,
                                     task_head(warp), num_heads, num_kv_heads, hin);
        }
        pdl_start();
        if (fused) {
            for (int task = warp; task < n_tasks; task += 4) {
                if (task != warp)
                    hwork = prepare_head(fin.positions, fin.slots, fin.q_norm_w, fin.k_norm_w, fin.inv_freq, q0,
                                         task_head(task), num_heads, num_kv_heads, hin);
                if (!hwork) continue;  // the key head of a padding token
                finish_head(fin.qkv, q0, num_heads, num_kv_heads, fin.eps, hin);
                if (hin.is_q) {  // row `task`: channels 2l, 2l+1 in chunk l / 4, 64+2l, 64+2l+1 in chunk 8 + l / 4
                    u32 lo, hi;
                    query_pairs(hin, f0, f1, lo, hi);
                    *reinterpret_cast<u32 *>(sQ + swz(task, lane >> 2) + 2 * (lane & 3)) = lo;
                    *reinterpret_cast<u32 *>(sQ + swz(task, 8 + (lane >> 2)) + 2 * (lane & 3)) = hi;
                } else if constexpr (Q8) {
                    store_key_value_int8(hin, f0, f1, static_cast<signed char *>(fin.k_pool),
                                         static_cast<signed char *>(fin.v_pool), fin.k_scale, fin.v_scale, num_heads,
                                         num_kv_heads, page_size);
                } else {
                    store_key_value(hin, static_cast<bf16 *>(fin.k_pool), static_cast<bf16 *>(fin.v_pool), num_heads,
                                    num_kv_heads, page_size);
                }
            }
            for (int idx = threadIdx.x; idx < (ROWS - G) * (HD / 8); idx += THREADS)  // rows past the group: zero
                st16(sQ + swz(G + idx / (HD / 8), idx % (HD / 8)), vec16{});
            __threadfence_block();  // the new key and value before this block's copy of their tile
            __syncthreads();
        } else {
            load_q();
        }
        cp_async_commit();  // (an empty group when fused: the waits below count it all the same)
#pragma unroll
        for (int s = 0; s < STAGES - 1; ++s) {
            if (s >= early) {
                if (kt_begin + s < kt_end) load_tile(lookup(kt_begin + s), s);
                cp_async_commit();
            }
        }
    } else {
        load_q();
#pragma unroll
        for (int s = 0; s < STAGES - 1; ++s) {
            if (kt_begin + s < kt_end) load_tile(lookup(kt_begin + s), s);
            cp_async_commit();
        }
    }
    TileRows<Q8> next_rows;
    if (kt_begin + STAGES - 1 < kt_end) next_rows = lookup(kt_begin + STAGES - 1);

    // The two rows this thread accumulates: wrow + g and + 8 (ST: 2t and 2t + 1).
    int qpos[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int R = ST ? row0 + 2 * t + h : row0 + wrow + g + 8 * h;
        qpos[h] = R < rows ? first_pos + R / G : max_qpos;
    }
    // Keys before vis_end are visible to both of this thread's rows: tiles below it skip the mask.
    const int vis_end = min(kv_len, min(qpos[0], qpos[1]) + 1);

    float m[2] = {-TI_INF, -TI_INF}, l[2] = {0.f, 0.f};
    int vexp = 1;  // DIRECT: the largest biased exponent of a value scale this warp has seen (see direct_pv)
    // O: 16 rows x 128 channels in 16 accumulators of 8 channels; HALF: O^T, 128 channels x 8 rows in 8
    // accumulators of 16 channels (see direct_pv_t_biased; BF16: ot[dp] holds channels 16 dp + g and + 8).
    constexpr int NO = HALF ? 8 : 16;
    float o[NO][4];
#pragma unroll
    for (int i = 0; i < NO; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
    float psum[4] = {0.f, 0.f, 0.f, 0.f};  // ST: O^T's bias (direct_pv_t_biased)
    constexpr float REF_SLACK = 8.f;       // HALF: how far above the reference maximum a tile may go (below)
    u32 qf[8][4];

    for (int kt = kt_begin; kt < kt_end; ++kt) {
        const int i = kt - kt_begin, cur = i % STAGES;
        // Decode shape: tile kt is group i or i + 1 (after Q), so waiting for all but the newest STAGES - 2
        // groups covers it; Q (group `early`) too from the first iteration on, unless two or more old
        // tiles went before it: then the first iteration waits for everything in flight.
        if (KEYS && i == 0 && early >= 2) cp_async_wait<0>();
        else cp_async_wait<STAGES - 2>();  // tile kt has landed (this thread's copies) ...
        __syncthreads();              // ... everyone's, and everyone is done with tile kt - 1's buffers
        // Refill the buffer tile kt - 1 used with tile kt + STAGES - 1; look up the rows of the one after.
        if (kt + STAGES - 1 < kt_end) {
            load_tile(next_rows, (i + STAGES - 1) % STAGES);
            if (kt + STAGES < kt_end) next_rows = lookup(kt + STAGES);
        }
        cp_async_commit();
        if (kt == kt_begin) {
            if constexpr (S::DIRECT) {
                // Channels permuted within each 16-channel slice to match the int8 key fragments
                // (see direct_qk): a0/a1 hold channels 4t, 4t+1 of rows g / g+8, a2/a3 4t+2, 4t+3.
#pragma unroll
                for (int ks = 0; ks < 8; ++ks) {
                    const uint2 x = *reinterpret_cast<const uint2 *>(sQ + swz(g, 2 * ks + (t >> 1)) + 4 * (t & 1));
                    const uint2 y = *reinterpret_cast<const uint2 *>(sQ + swz(g + 8, 2 * ks + (t >> 1)) + 4 * (t & 1));
                    qf[ks][0] = bf16x2_to_f16x2(x.x, scale_log2); qf[ks][1] = bf16x2_to_f16x2(y.x, scale_log2);
                    qf[ks][2] = bf16x2_to_f16x2(x.y, scale_log2); qf[ks][3] = bf16x2_to_f16x2(y.y, scale_log2);
                }
            } else {
#pragma unroll
                for (int ks = 0; ks < 8; ++ks)
                    ldmatrix_x4(qf[ks], smem_addr(sQ + swz(wrow + (lane & 15), ks * 2 + (lane >> 4))));
            }
        }
        const bf16 *tK = nullptr, *tV = nullptr;
        const float *ksc = nullptr, *vsc = nullptr;
        const unsigned char *st = stage + cur * S::STAGE;
        if constexpr (Q8) {
            ksc = reinterpret_cast<const float *>(st + 2 * KT * HD);
            vsc = ksc + KT;
        }
        if constexpr (S::DIRECT) {
            // nothing to prepare: the fragments come straight from the int8 tiles
        } else if constexpr (Q8) {
            widen_tile<KEYS>(st, sK, sV);
            __syncthreads();
            tK = sK;
            tV = sV;
        } else {
            tK = sK + cur * KT * HD;
            tV = sV + cur * KT * HD;
        }

        if constexpr (ST) {
            // S^T for the warp's 16 keys (direct_qk_t); the values' codes are read before the softmax, so their
            // shared-memory latency overlaps it.
            float sa[4] = {0.f, 0.f, 0.f, 0.f}, sb[4] = {0.f, 0.f, 0.f, 0.f};
            direct_qk_t(st, qf, sa, sb, wkey, lane);
            u32 vr[4][4];
            load_values_t(st + KT * HD, wkey, lane, vr);
            // This lane's scores: keys k0 (x[0], x[1]) and k0 + 8 (x[2], x[3]), rows 2t + (e & 1).
            const int k0 = wkey + g;
            const float ks0 = ksc[k0], ks1 = ksc[k0 + 8], vs0 = vsc[k0], vs1 = vsc[k0 + 8];
            const bool masked = (kt + 1) * KT > vis_end;
            float x[4];
#pragma unroll
            for (int e = 0; e < 4; ++e) x[e] = (sa[e] + sb[e]) * (e < 2 ? ks0 : ks1);
            if (masked) {  // causal and past the end: only a sequence's last tiles
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int key = kt * KT + k0 + 8 * (e >> 1);
                    if (key > qpos[e & 1] || key >= kv_len) x[e] = -TI_INF;
                }
            }
            float mx[2] = {fmaxf(x[0], x[2]), fmaxf(x[1], x[3])};
            float vm = fmaxf(vs0, vs1);
            // The reference maximum, as in the other _h8 build (below): one vote keeps m, P's unit and O.
            const bool keep = __all_sync(0xffffffffu, mx[0] <= m[0] + REF_SLACK && mx[1] <= m[1] + REF_SLACK &&
                                                          (int)(__float_as_uint(vm) >> 23) <= vexp);
            float alpha[2] = {1.f, 1.f}, m_use[2], shrink = 1.f;
            if (keep) {
#pragma unroll
                for (int h = 0; h < 2; ++h) m_use[h] = m[h] == -TI_INF ? 0.f : m[h];
            } else {
#pragma unroll
                for (int h = 0; h < 2; ++h) {  // a row's keys are spread over the lanes of one t
#pragma unroll
                    for (int off = 4; off < 32; off <<= 1) mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], off));
                    const float m_new = fmaxf(m[h], mx[h]);
                    m_use[h] = m_new == -TI_INF ? 0.f : m_new;  // a row with no visible key yet: avoid inf - inf
                    alpha[h] = fast_exp2(m[h] - m_use[h]);
                    m[h] = m_new;
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
            for (int h = 0; h < 2; ++h) l[h] = l[h] * alpha[h] + rowsum[h];
            if (!keep) {  // O^T's columns are this lane's rows 2t and 2t + 1
                const float a0 = alpha[0] * shrink, a1 = alpha[1] * shrink;
                if (a0 != 1.f || a1 != 1.f) {
#pragma unroll
                    for (int c = 0; c < NO; ++c) {
                        o[c][0] *= a0; o[c][1] *= a1; o[c][2] *= a0; o[c][3] *= a1;
                    }
                    psum[0] *= a0; psum[1] *= a1; psum[2] *= a0; psum[3] *= a1;
                }
            }
            // P^T's B fragment (keys 2t, 2t + 1 and 8 + 2t, 9 + 2t of row g): the transposes of this lane's pairs.
            const u32 pt[2] = {movmatrix_trans(pack_f16x2(x[0], x[1])), movmatrix_trans(pack_f16x2(x[2], x[3]))};
            direct_pv_t_biased(vr, pt, o, psum);
        } else {
            // S = Q K^T: 16 rows x (NB * 8) keys per warp.
            float s[NB][4];
#pragma unroll
            for (int i = 0; i < NB; ++i) s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.f;
            if constexpr (S::DIRECT) {
                direct_qk(st, qf, s, wkey, lane);
            } else {
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

            // Scale into base 2 (times the key's scale for INT8), mask (causal and past the end; in the decode
            // shape only in tiles that reach vis_end, the last of a sequence), online softmax.
            float mx[2] = {-TI_INF, -TI_INF};
            auto scores = [&](auto masked) {
#pragma unroll
                for (int nb = 0; nb < NB; ++nb)
#pragma unroll
                    for (int e = 0; e < 2 * NH; ++e) {
                        const int kl = wkey + nb * 8 + 2 * t + (e & 1), h = e >> 1;
                        float x = S::DIRECT ? s[nb][e] : s[nb][e] * scale_log2;  // DIRECT: scaled in the queries
                        if constexpr (Q8) x *= ksc[kl];
                        if constexpr (decltype(masked)::value) {
                            const int key = kt * KT + kl;
                            x = (key > qpos[h] || key >= kv_len) ? -TI_INF : x;
                        }
                        s[nb][e] = x;
                        mx[h] = fmaxf(mx[h], x);
                    }
            };
            if (KEYS && (kt + 1) * KT <= vis_end) scores(Flag<false>{});  // the prefill shape: always masked
            else scores(Flag<true>{});                                       // (unmasked tiles cost it registers)
            // DIRECT: P's unit (direct_pv) from the largest value scale of the warp's 16 keys in this tile; each
            // lane's own 4 keys first (keys depend on t only).
            float vm = 0.f;
            if constexpr (S::DIRECT) {
#pragma unroll
                for (int nb = 0; nb < NB; ++nb)
#pragma unroll
                    for (int e1 = 0; e1 < 2; ++e1) vm = fmaxf(vm, vsc[wkey + nb * 8 + 2 * t + e1]);
            }
            // HALF (here the BF16 _h8 build; the INT8 one, above, does the same with its value scales' unit in the
            // vote): m is the row's reference maximum, not always its running maximum. A tile whose every score is
            // at most m + REF_SLACK (INT8: and no value scale above P's unit) keeps m, pv_unit and O as they
            // are, decided by one vote instead of the lanes' shuffles, and with no rescale: P = 2^(s - m) then stays
            // below 2^REF_SLACK (fp16 holds it, as it does P's smaller values, to 11 bits). The merges downstream
            // take any common reference. Otherwise m moves to the running maximum, as in the other builds.
            bool keep = false;
            if constexpr (HALF) {
                bool ok = mx[0] <= m[0] + REF_SLACK;  // m = -inf: only a tile with no visible key yet
                keep = __all_sync(0xffffffffu, ok);
            }
            float alpha[2] = {1.f, 1.f}, m_use[2] = {0.f, 0.f}, o_alpha[2] = {1.f, 1.f};
            if (keep) {
                m_use[0] = m[0] == -TI_INF ? 0.f : m[0];
            } else {
#pragma unroll
                for (int h = 0; h < NH; ++h) {
                    mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 1));
                    mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 2));
                    const float m_new = fmaxf(m[h], mx[h]);
                    m_use[h] = m_new == -TI_INF ? 0.f : m_new;  // a row with no visible key yet: avoid inf - inf
                    alpha[h] = exp2f(m[h] - m_use[h]);
                    m[h] = m_new;
                    o_alpha[h] = alpha[h];
                }
                if constexpr (S::DIRECT) {
                    vm = fmaxf(vm, __shfl_xor_sync(0xffffffffu, vm, 1));
                    vm = fmaxf(vm, __shfl_xor_sync(0xffffffffu, vm, 2));  // the same in every lane
                    float shrink;
                    if (raise_value_unit(vm, vexp, shrink)) {
                        o_alpha[0] *= shrink;
                        o_alpha[1] *= shrink;
                    }
                }
            }
            const float pv_unit = S::DIRECT ? __uint_as_float((u32)(253 - vexp) << 23) : 1.f;  // 2^(126 - vexp)
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
            if constexpr (HALF) {
                if (!keep) {
                    // O^T's columns are rows 2t and 2t + 1, whose factors the lanes of g = 2t and 2t + 1 hold.
                    const float a0 = __shfl_sync(0xffffffffu, o_alpha[0], 8 * t);
                    const float a1 = __shfl_sync(0xffffffffu, o_alpha[0], 8 * t + 4);
                    if (a0 != 1.f || a1 != 1.f) {
#pragma unroll
                        for (int i = 0; i < NO; ++i) {
                            o[i][0] *= a0; o[i][1] *= a1; o[i][2] *= a0; o[i][3] *= a1;
                        }
                    }
                }
            } else if (o_alpha[0] != 1.f || o_alpha[1] != 1.f) {  // the running maxima moved (rare after the first tiles)
#pragma unroll
                for (int nb = 0; nb < NO; ++nb) {
                    o[nb][0] *= o_alpha[0]; o[nb][1] *= o_alpha[0];
                    o[nb][2] *= o_alpha[1]; o[nb][3] *= o_alpha[1];
                }
            }

            // O += P V: P (bf16; fp16 for the INT8 decode shape) is the A operand straight from the S accumulators
            // (HALF: O^T += V^T P^T, P^T the B operand from the S accumulators' rows g).
#pragma unroll
            for (int kk = 0; kk < NB / 2; ++kk) {
                if constexpr (HALF) {
                    const u32 pt[2] = {pack_bf16x2(s[2 * kk][0], s[2 * kk][1]),
                                       pack_bf16x2(s[2 * kk + 1][0], s[2 * kk + 1][1])};
#pragma unroll
                    for (int dp = 0; dp < 8; ++dp) {
                        u32 vb[4];  // as below; as A: channels 16 dp + g and + 8 x keys 2t.. and 8 + 2t..
                        ldmatrix_x4_trans(vb, smem_addr(tV + swz(wkey + kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8,
                                                                 dp * 2 + (lane >> 4))));
                        const u32 a[4] = {vb[0], vb[2], vb[1], vb[3]};
                        mma_bf16_16816(o[dp], a, pt);
                    }
                } else if constexpr (S::DIRECT) {
                    const u32 a[4] = {pack_f16x2(s[2 * kk][0], s[2 * kk][1]), pack_f16x2(s[2 * kk][2], s[2 * kk][3]),
                                      pack_f16x2(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                                      pack_f16x2(s[2 * kk + 1][2], s[2 * kk + 1][3])};
                    direct_pv(st + KT * HD, a, o, wkey, lane);
                } else {
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
        }
    }
    cp_async_wait<0>();

#pragma unroll
    for (int h = 0; h < NH; ++h) {  // a row's keys: over the lanes of one g (ST: of one t)
#pragma unroll
        for (int off = ST ? 4 : 1; off < (ST ? 32 : 4); off <<= 1) l[h] += __shfl_xor_sync(0xffffffffu, l[h], off);
    }

    if constexpr (KEYS) {
        // Merge the 4 warps' states (each saw a quarter of every key tile) through shared memory,
        // reusing the K/V tiles: sO [4 warps][16 rows][HD] f32, then sM, sL [4][16].
        __syncthreads();
        float *sO = reinterpret_cast<float *>(sK);
        float *sM = sO + 4 * 16 * HD, *sL = sM + 4 * 16;
        if constexpr (HALF) {  // O^T: channels (see the P V product) of rows 2t and 2t + 1; rows 8-15 unused
            const float unit = S::DIRECT ? __uint_as_float((u32)(vexp + 1) << 23) : 1.f;
            float *dst = sO + (warp * 16 + 2 * t) * HD;
#pragma unroll
            for (int i = 0; i < NO; ++i) {
                const int c0 = S::DIRECT ? 32 * (i >> 1) + 16 * (i & 1) + 2 * g : 16 * i + g;
                const int c1 = S::DIRECT ? c0 + 1 : c0 + 8;
                dst[c0] = (o[i][0] - psum[0]) * unit; dst[HD + c0] = (o[i][1] - psum[1]) * unit;
                dst[c1] = (o[i][2] - psum[2]) * unit; dst[HD + c1] = (o[i][3] - psum[3]) * unit;
            }
            if constexpr (ST) {
                if (g == 0) {
                    sM[warp * 16 + 2 * t] = m[0]; sL[warp * 16 + 2 * t] = l[0];
                    sM[warp * 16 + 2 * t + 1] = m[1]; sL[warp * 16 + 2 * t + 1] = l[1];
                }
            } else if (t == 0) {
                sM[warp * 16 + g] = m[0]; sL[warp * 16 + g] = l[0];
            }
        } else {
#pragma unroll
        for (int h = 0; h < NH; ++h) {
            const int r = g + 8 * h;
            if constexpr (S::DIRECT) {
                // o[2 b] holds channels 16 b + 4t and + 2, o[2 b + 1] channels 16 b + 4t + 1 and + 3 (direct_pv),
                // in units of 2^(vexp - 126).
                const float unit = __uint_as_float((u32)(vexp + 1) << 23);
                float4 *dst = reinterpret_cast<float4 *>(sO + (warp * 16 + r) * HD);
#pragma unroll
                for (int b = 0; b < 8; ++b)
                    dst[b * 4 + t] = make_float4(o[2 * b][2 * h] * unit, o[2 * b + 1][2 * h] * unit,
                                                 o[2 * b][2 * h + 1] * unit, o[2 * b + 1][2 * h + 1] * unit);
            } else {
                float2 *dst = reinterpret_cast<float2 *>(sO + (warp * 16 + r) * HD);
#pragma unroll
                for (int nb = 0; nb < 16; ++nb) dst[nb * 4 + t] = make_float2(o[nb][2 * h], o[nb][2 * h + 1]);
            }
            if (t == 0) { sM[warp * 16 + r] = m[h]; sL[warp * 16 + r] = l[h]; }
        }
        }
        __syncthreads();
        // Thread -> (row r = tid / 8, 16 columns from (tid % 8) * 16).
        const int r = threadIdx.x >> 3, c0 = (threadIdx.x & 7) * 16;
        const int R = row0 + r;
        if (R >= rows) return;
        float M = -TI_INF;
#pragma unroll
        for (int w = 0; w < 4; ++w) M = fmaxf(M, sM[w * 16 + r]);
        float wt[4], L = 0.f;
#pragma unroll
        for (int w = 0; w < 4; ++w) {
            wt[w] = M == -TI_INF ? 0.f : exp2f(sM[w * 16 + r] - M);  // a warp with no visible key: 0
            L += wt[w] * sL[w * 16 + r];
        }
        float acc[16];
#pragma unroll
        for (int j = 0; j < 16; ++j) {
            float a = 0.f;
#pragma unroll
            for (int w = 0; w < 4; ++w) a += wt[w] * sO[(w * 16 + r) * HD + c0 + j];
            acc[j] = a;
        }
        const size_t row = (size_t)(q0 + R / G) * num_heads + kv_head * G + R % G;
        if (num_splits == 1) {
            const float inv = L > 0.f ? 1.f / L : 0.f;
#pragma unroll
            for (int j = 0; j < 16; ++j) acc[j] *= inv;
            st16(out + row * HD + c0, pack8(acc));
            st16(out + row * HD + c0 + 8, pack8(acc + 8));
        } else {
            const size_t prow = (size_t)split * total_q * num_heads + row;
            float4 *dst = reinterpret_cast<float4 *>(part_o + prow * HD + c0);
#pragma unroll
            for (int j = 0; j < 4; ++j) dst[j] = make_float4(acc[4 * j], acc[4 * j + 1], acc[4 * j + 2], acc[4 * j + 3]);
            if ((threadIdx.x & 7) == 0) reinterpret_cast<float2 *>(part_ml)[prow] = make_float2(M, L);
        }
        return;
    } else {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int R = row0 + wrow + g + 8 * h;
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
}

// ============================================================================= kernels
// The entry points: {BF16, INT8 cache} x {rows mode, keys mode}, and the keys mode for blocks of at most
// 8 rows (_h8: HALF, decode steps of a group <= 8). k_scale / v_scale are null for BF16.
// The fused input's arguments (qkv .. eps) matter to the decode _h8 builds only; the others ignore them.
#define ATTENTION_KERNEL(NAME, Q8, KEYS, HALF, BOUNDS)                                                       \
    extern "C" __global__ void BOUNDS NAME(                                                                 \
            const bf16 *__restrict__ q, void *__restrict__ k_pool, void *__restrict__ v_pool,               \
            float *__restrict__ k_scale, float *__restrict__ v_scale, bf16 *__restrict__ out,                \
            float *__restrict__ part_o, float *__restrict__ part_ml, const int *__restrict__ cu_q,           \
            const int *__restrict__ kv_lens, const int *__restrict__ block_tables, int bt_stride,            \
            int num_heads, int num_kv_heads, int page_size, int num_splits, int total_q, float scale_log2,    \
            const bf16 *__restrict__ qkv, const int *__restrict__ positions, const int *__restrict__ slots,  \
            const bf16 *__restrict__ q_norm_w, const bf16 *__restrict__ k_norm_w,                           \
            const float *__restrict__ inv_freq, const float *__restrict__ smooth, float eps) {              \
        if (!KEYS) pdl_start();  /* the decode shape waits inside, after its first loads */                \
        const FusedInput fin{qkv, positions, slots, q_norm_w, k_norm_w, inv_freq, smooth,                   \
                             k_pool, v_pool, k_scale, v_scale, eps};                                        \
        attention_body<Q8, KEYS, HALF>(q, k_pool, v_pool, k_scale, v_scale, out, part_o, part_ml, cu_q, kv_lens,  \
                                 block_tables, bt_stride, num_heads, num_kv_heads, page_size, num_splits,   \
                                 total_q, scale_log2, fin);                                                 \
    }

// The INT8 _h8 build must fit 4 blocks an SM (<= 128 registers), as the engine's decode splits count on
// (tileinfer/kernels/attention.py int8_decode_blocks). (A minimum of 1 block on the others is not neutral:
// it changes their register allocation, for the worse.)
#define BOUNDS_1 __launch_bounds__(THREADS)
#define BOUNDS_4 __launch_bounds__(THREADS, 4)
ATTENTION_KERNEL(attention, false, false, false, BOUNDS_1)
ATTENTION_KERNEL(attention_decode, false, true, false, BOUNDS_1)
ATTENTION_KERNEL(attention_int8, true, false, false, BOUNDS_1)
ATTENTION_KERNEL(attention_int8_decode, true, true, false, BOUNDS_1)
ATTENTION_KERNEL(attention_decode_h8, false, true, true, BOUNDS_1)
ATTENTION_KERNEL(attention_int8_decode_h8, true, true, true, BOUNDS_4)

// grid (total_q, num_heads), block (COMBINE_THREADS = 512: tileinfer/kernels/attention.py), num_splits <= 128.
// Merges the splits' partial outputs of one (token, head): the weights 2^(m_s - M) of the splits in parallel
// (one thread each), then the weighted sum of their outputs, warp w taking splits w, w + 16, ... and lane l
// columns 4l..4l+3. The sum waits on its loads, which the compiler issues only a little ahead of their use
// (a load, then the sum of the one before): so a warp takes few splits, at most 8 of 128, where 4 warps
// would take up to 32 and wait on their loads one after the other.
#define COMBINE_WARPS 16
#define COMBINE_MAX_SPLITS 128  // tileinfer/kernels/attention.py MAX_SPLITS
extern "C" __global__ void __launch_bounds__(COMBINE_WARPS * 32) attention_combine(
        const float *__restrict__ part_o, const float *__restrict__ part_ml, bf16 *__restrict__ out,
        int num_splits, int total_q, int num_heads) {
    pdl_start();
    __shared__ float scratch[32], weight[COMBINE_MAX_SPLITS];
    __shared__ float4 partial[COMBINE_WARPS][32];
    const size_t row = (size_t)blockIdx.x * num_heads + blockIdx.y;
    const size_t stride = (size_t)total_q * num_heads;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;

    float m = -TI_INF, l = 0.f;
    if (tid < num_splits) {
        const float2 v = reinterpret_cast<const float2 *>(part_ml)[tid * stride + row];
        if (v.y > 0.f) { m = v.x; l = v.y; }  // an empty split (no keys in its range) weighs nothing
    }
    const float M = block_max(m, scratch);
    const float w = (l > 0.f) ? exp2f(m - M) : 0.f;
    const float L = block_sum(w * l, scratch);
    if (tid < COMBINE_MAX_SPLITS) weight[tid] = w;
    __syncthreads();

    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int j = 0; j < COMBINE_MAX_SPLITS / COMBINE_WARPS; ++j) {
        const int s = warp + COMBINE_WARPS * j;
        if (s >= num_splits) break;
        const float ws = weight[s];
        if (ws == 0.f) continue;  // never written (an empty split): not even 0 * its contents
        const float4 p = reinterpret_cast<const float4 *>(part_o + (s * stride + row) * HD)[lane];
        acc.x += ws * p.x; acc.y += ws * p.y; acc.z += ws * p.z; acc.w += ws * p.w;
    }
    partial[warp][lane] = acc;
    __syncthreads();
    if (warp) return;
    float4 sum = partial[0][lane];
#pragma unroll
    for (int i = 1; i < COMBINE_WARPS; ++i) {
        const float4 p = partial[i][lane];
        sum.x += p.x; sum.y += p.y; sum.z += p.z; sum.w += p.w;
    }
    const float inv = L > 0.f ? 1.f / L : 0.f;
    uint2 packed;
    packed.x = pack_bf16x2(sum.x * inv, sum.y * inv);
    packed.y = pack_bf16x2(sum.z * inv, sum.w * inv);
    reinterpret_cast<uint2 *>(out + row * HD)[lane] = packed;
}
