// Token embedding lookup: out[i, :] = table[tokens[i] - first, :] as float32 (the residual stream); and the
// rows a DFlash drafter's context pass starts from, gathered from its target's captured hidden states.
//
// `first` is the vocabulary id of the table's row 0: 0 for a whole table; under tensor parallelism a rank's
// slice of the vocabulary (tileinfer/model/sharding.py), whose rows for the tokens outside it are zeros and
// whose all-reduce over the ranks adds up to the whole table's embedding.
#include "common.cuh"

// out[row, :] = table[token - first, :] as float32 (zeros for a token outside [first, first + vocab)), by
// one block. Compared before subtracting, so that no id overflows.
__device__ __forceinline__ void embed_row(int token, const bf16 *__restrict__ table, float *__restrict__ out,
                                          int row, int dim, int vocab, int first) {
    const bool valid = token >= first && token - first < vocab;
    const bf16 *src = table + (size_t)(valid ? token - first : 0) * dim;
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

// ============================================================================= kernels
// grid (n), block (128). dim % 8 == 0, first >= 0. Tokens outside [first, first + vocab) (padding rows, or
// another rank's part of the vocabulary) give zeros.
extern "C" __global__ void embedding(const int *__restrict__ tokens, const bf16 *__restrict__ table,
                                     float *__restrict__ out, int dim, int vocab, int first) {
    pdl_start();
    embed_row(tokens[blockIdx.x], table, out, blockIdx.x, dim, vocab, first);
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
// requested at once. The first kernel of a decode step (runner/gpu.py), in place of a host-to-device
// copy before the step: a copy is one more operation in the stream, and at batch 1 it costs far more than
// the bytes it moves. It also does resolve_tokens' work: the ntok token ids from piece tok0 on are replaced by
// sampled[token_src[i]] where token_src[i] >= 0, token_src being the field src_delta pieces after them.
// With a table, embedding's work too (one launch less a step): blocks past the copy's, one a row for
// embed_rows rows, read their row's token id and source from the mirror themselves, resolve it the same
// way and write the row's embedding to out (table's row 0 being token `first`, as embedding's).
// grid (ceil(n16 / 256) + embed_rows), block (256).
extern "C" __global__ void fetch_step(const uint4 *__restrict__ src, uint4 *__restrict__ dst, int n16, int tok0,
                                      int ntok, int src_delta, const int *__restrict__ sampled,
                                      const bf16 *__restrict__ table, float *__restrict__ out, int dim, int vocab,
                                      int first) {
    pdl_start();
    const int copy_blocks = (n16 + 255) >> 8;
    if ((int)blockIdx.x >= copy_blocks) {
        const int row = blockIdx.x - copy_blocks;
        const int *ids = reinterpret_cast<const int *>(src + tok0);
        const int token = (int)resolved((u32)ids[row], (u32)ids[row + 4 * src_delta], row, ntok, sampled);
        embed_row(token, table, out, row, dim, vocab, first);
        return;
    }
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

// A DFlash drafter's context rows from the target's captured hidden states (tileinfer/model/forward.py
// Capture), without a trip through the host: out[i, :] = states[src[i], :] rounded to bf16 (round to nearest
// even, as the host would), except columns last_col..last_col + hidden - 1, which are last[src[i], :] when
// `last` is given (the target's final-normed last layer, bf16 already); zeros where src[i] < 0 (padding).
// grid (n), block (128). width, hidden and last_col multiples of 8.
extern "C" __global__ void gather_states(const int *__restrict__ src, const float *__restrict__ states,
                                         const bf16 *__restrict__ last, int last_col, int hidden,
                                         bf16 *__restrict__ out, int width) {
    pdl_start();
    const int s = src[blockIdx.x];
    bf16 *dst = out + (size_t)blockIdx.x * width;
    for (int c = threadIdx.x * 8; c < width; c += blockDim.x * 8) {
        vec16 v{};
        if (s >= 0 && last != nullptr && c >= last_col && c < last_col + hidden) {
            v = ld16(last + (size_t)s * hidden + (c - last_col));
        } else if (s >= 0) {
            const float4 a = *reinterpret_cast<const float4 *>(states + (size_t)s * width + c);
            const float4 b = *reinterpret_cast<const float4 *>(states + (size_t)s * width + c + 4);
            const float f[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
            v = pack8(f);
        }
        st16(dst + c, v);
    }
}

// A DFlash block pass's inputs, decided on the device from the verify step before it, so that the pass can be
// launched before the host has read that step (runner/gpu_dflash.py draft_ahead). rows [R, 7 + W] int32, one a
// request: (src, m, first, start, entry, count, out, then its block table of W pages). The request's verify row
// computed its last committed token and m drafts at token rows src..src + m of the step, at target positions
// start.. and drafter context entries entry..; its drafts are drafted[first + 1 .. first + m]. acc, the drafts
// the target accepts greedily, is the longest run with drafted[first + 1 + i] == argmax[src + i]; the round then
// commits argmax[src + acc] at position start + acc + 1, and the context keeps entry .. entry + acc. The next
// block, `count` tokens at pass rows out.., is that token then count - 1 mask tokens at positions
// start + acc + 1 + t and entries e + t (e = entry + acc + 1); each is a sequence of its own (cu_q, last_rows)
// with the request's block table, attending to entries [0, e + count). The last row also closes cu_q.
// grid (R), block (128).
extern "C" __global__ void next_block_inputs(const int *__restrict__ rows, int table_width,
                                             const int *__restrict__ argmax, const int *__restrict__ drafted,
                                             int mask_token, int page_size, int *__restrict__ tokens,
                                             int *__restrict__ positions, int *__restrict__ slots,
                                             int *__restrict__ kv_lens, int *__restrict__ cu_q,
                                             int *__restrict__ last_rows, int *__restrict__ block_tables) {
    pdl_start();
    const int *r = rows + (size_t)(7 + table_width) * blockIdx.x;
    const int src = r[0], m = r[1], first = r[2], start = r[3], entry = r[4], count = r[5], out = r[6];
    const int *table = r + 7;
    int acc = 0;
    while (acc < m && drafted[first + 1 + acc] == argmax[src + acc]) ++acc;
    const int token = argmax[src + acc], e = entry + acc + 1, s = start + acc + 1;
    for (int t = threadIdx.x; t < count; t += blockDim.x) {
        const int row = out + t, at = e + t;
        tokens[row] = t == 0 ? token : mask_token;
        positions[row] = s + t;
        slots[row] = table[at / page_size] * page_size + at % page_size;
        kv_lens[row] = e + count;
        cu_q[row] = row;
        last_rows[row] = row;
    }
    for (int i = threadIdx.x; i < count * table_width; i += blockDim.x)
        block_tables[(size_t)out * table_width + i] = table[i % table_width];
    if (blockIdx.x == gridDim.x - 1 && threadIdx.x == 0) cu_q[out + count] = out + count;
}
