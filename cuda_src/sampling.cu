// Next-token selection from float32 logits: greedy argmax, seeded sampling with temperature,
// min-p, top-k and top-p, after a request's logit bias and vLLM's repetition/presence/frequency penalties (in
// place, before).
//
// Sampling is the Gumbel-max trick over the kept tokens: argmax_i (z_i + g_i) with
// z = logits / T and g_i = -log(-log(u_i)), u_i a counter-based hash of (seed, counter, i).
// It needs no prefix sum, is exact, and is reproducible: a request's sample depends only on
// its logits, its seed and the counter (the position being sampled), never on the batch.
//
// Min-p, then top-k, then top-p (as vLLM applies them) choose a threshold t on z; the kept set is
// {i : z_i >= t}. Min-p's cut is z_max + log(min_p) (probability >= min_p * max probability).
// Within it, top-k and top-p thresholds are found by bisection over the 32-bit order-preserving
// keys of the float values, so they land exactly on a logit value (ties at t are all kept).
#include "common.cuh"

#define THREADS 1024

// Float -> u32 key with the same order (negative floats reversed, positives shifted up).
__device__ __forceinline__ u32 order_key(float f) {
    const u32 b = __float_as_uint(f);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}
__device__ __forceinline__ float key_value(u32 k) {
    return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

__device__ __forceinline__ u64 splitmix64(u64 x) {
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

// Uniform in (0, 1) from (seed, counter, index); mirrored exactly by tileinfer.engine.sampler.
// 23 random bits: (k + 0.5) / 2^23 is exact in float32, so u is never 0 or 1.
__device__ __forceinline__ float uniform01(u64 seed, u32 counter, u32 index) {
    const u64 h = splitmix64(seed ^ splitmix64(((u64)counter << 32) | index));
    return ((float)(h >> 41) + 0.5f) * (1.0f / 8388608.0f);
}

struct ArgMax { float v; int i; };

__device__ __forceinline__ ArgMax better(ArgMax a, ArgMax b) {
    // Larger value wins; on a tie the smaller index (deterministic, like numpy.argmax).
    return (b.v > a.v || (b.v == a.v && b.i < a.i)) ? b : a;
}

__device__ ArgMax block_argmax(ArgMax m, float *sv, int *si) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        ArgMax other{__shfl_xor_sync(0xffffffffu, m.v, o), __shfl_xor_sync(0xffffffffu, m.i, o)};
        m = better(m, other);
    }
    __syncthreads();
    if (lane == 0) { sv[warp] = m.v; si[warp] = m.i; }
    __syncthreads();
    if (warp == 0) {
        m = lane < (int)(blockDim.x >> 5) ? ArgMax{sv[lane], si[lane]} : ArgMax{-TI_INF, 0x7fffffff};
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            ArgMax other{__shfl_xor_sync(0xffffffffu, m.v, o), __shfl_xor_sync(0xffffffffu, m.i, o)};
            m = better(m, other);
        }
        if (lane == 0) { sv[0] = m.v; si[0] = m.i; }
    }
    __syncthreads();
    ArgMax r{sv[0], si[0]};
    __syncthreads();
    return r;
}

// This thread's share of a row's argmax. With vocab % 4 == 0 (every Qwen3 vocabulary) a row starts
// 16-byte aligned: float4 loads, four of them in flight per thread (64 KB per 1024-thread block),
// since a block streams a whole 600 KB row of logits on one SM. `better` is order-independent, so
// the result is the same as an element-by-element scan.
// MASKED: only over the tokens the mask (in shared memory) allows, in the same pass setting every other logit
// to -inf in place (a structured output's grammar allows only the set bits), so that the sampling passes
// after it and the logprobs the host reads see the masked row: the same result as writing the -inf first and
// then taking the plain argmax, a masked token being -inf either way. Z is float (MASKED) or const float.
template <bool MASKED, typename Z>
__device__ __forceinline__ ArgMax thread_argmax(Z *__restrict__ z, int vocab, const u32 *smask = nullptr) {
    ArgMax m{-TI_INF, 0x7fffffff};
    if ((vocab & 3) == 0) {
#pragma unroll 4
        for (int i = threadIdx.x; i < (vocab >> 2); i += blockDim.x) {
            float4 v = reinterpret_cast<const float4 *>(z)[i];
            if constexpr (MASKED) {
                const u32 bits = smask[i >> 3] >> (4 * (i & 7));  // tokens 4i .. 4i + 3
                if ((bits & 0xFu) != 0xFu) {
                    if (!(bits & 1u)) v.x = -TI_INF;
                    if (!(bits & 2u)) v.y = -TI_INF;
                    if (!(bits & 4u)) v.z = -TI_INF;
                    if (!(bits & 8u)) v.w = -TI_INF;
                    reinterpret_cast<float4 *>(z)[i] = v;
                }
            }
            m = better(m, ArgMax{v.x, 4 * i});
            m = better(m, ArgMax{v.y, 4 * i + 1});
            m = better(m, ArgMax{v.z, 4 * i + 2});
            m = better(m, ArgMax{v.w, 4 * i + 3});
        }
    } else {
        for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
            float v = z[i];
            if constexpr (MASKED)
                if (!((smask[i >> 5] >> (i & 31)) & 1u)) { v = -TI_INF; z[i] = v; }
            m = better(m, ArgMax{v, i});
        }
    }
    return m;
}

// Row 0's argmax from the LM head's per-block keys (gemv.cu, ARGMAX: (order_key(value) << 32) | ~index,
// the largest value and on a tie the lowest index): the same result as thread_argmax + block_argmax
// over the logits, from 8 bytes per 16 vocabulary entries.
__device__ ArgMax keyed_argmax(const u64 *__restrict__ keys, int num_keys, u64 *scratch) {
    u64 k = 0;
    for (int i = threadIdx.x; i < num_keys; i += blockDim.x) k = keys[i] > k ? keys[i] : k;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const u64 other = __shfl_xor_sync(0xffffffffu, k, o);
        k = other > k ? other : k;
    }
    if (lane == 0) scratch[warp] = k;
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < (int)(blockDim.x >> 5); ++w) k = scratch[w] > k ? scratch[w] : k;
        scratch[0] = k;
    }
    __syncthreads();
    k = scratch[0];
    __syncthreads();
    return ArgMax{key_value((u32)(k >> 32)), (int)~(u32)k};
}

// Key of min-p's cut z_max + log(min_p); 0 (keep everything) when min_p <= 0, z_max's own when
// min_p >= 1. log is taken in double and rounded to float, and the add is not fused with the
// product that made z_max, so the cut is bit-identical to the numpy mirror's float32 arithmetic.
__device__ __forceinline__ u32 min_p_key(float zmax, float min_p) {
    if (!(min_p > 0.f)) return 0;
    float cut = __fadd_rn(zmax, (float)log(fmin((double)min_p, 1.0)));
    if (cut == 0.f) cut = -0.f;  // -0 and +0 compare equal but have different keys: keep both
    return order_key(cut);
}

// Count and softmax mass (relative to zmax) of the tokens whose key is >= `threshold`.
__device__ void count_and_mass(const float *z, int vocab, float inv_t, float zmax, u32 threshold,
                               float *scratch, float *count, float *mass) {
    float c = 0.f, m = 0.f;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
        const float v = z[i] * inv_t;
        if (order_key(v) >= threshold) { c += 1.f; m += expf(v - zmax); }
    }
    *count = block_sum(c, scratch);
    *mass = block_sum(m, scratch);
}

// Largest key k such that pred(count(>= k), mass(>= k)) holds; pred is monotone (true at 0).
template <typename Pred>
__device__ u32 bisect_threshold(const float *z, int vocab, float inv_t, float zmax, float *scratch, Pred pred) {
    u32 lo = 0, hi = 0xffffffffu;  // invariant: pred(lo) true; answer in [lo, hi]
    while (lo < hi) {
        const u32 mid = lo + (u32)(((u64)hi - lo + 1) >> 1);
        float c, m;
        count_and_mass(z, vocab, inv_t, zmax, mid, scratch, &c, &m);
        if (pred(c, m)) lo = mid; else hi = mid - 1;
    }
    return lo;
}

// In place on row r of logits [rows, vocab], the logit bias and vLLM's penalties: row r's entries e in
// [offsets[r], offsets[r + 1]) name distinct token ids tokens[e], each with a bias biases[e] (the request's
// logit_bias; 0: none) added first, and counts[e]: its occurrences in the output if it is one of the prompt's or
// output's tokens (0: prompt only), -1 if it is banned (its logit becomes -inf: min_tokens keeps EOS out this
// way), -2 if it is only biased. Repetition then scales the logit of every prompt or output token (divides a
// positive one, multiplies the rest); presence and frequency subtract for output tokens only. Ids outside
// [0, vocab) are skipped; a row without entries is left alone. Each operation is rounded on its own (no fma),
// exactly as the numpy mirror (runner/sampler.py) computes it. The block's threads share the entries.
__device__ __forceinline__ void penalize_row(float *row, int vocab, int r, const int *__restrict__ offsets,
                                             const int *__restrict__ tokens, const int *__restrict__ counts,
                                             const float *__restrict__ biases, const float *__restrict__ repetition,
                                             const float *__restrict__ presence, const float *__restrict__ frequency) {
    const int begin = offsets[r], end = offsets[r + 1];
    if (begin >= end) return;
    const float rep = repetition[r], pres = presence[r], freq = frequency[r];
    for (int e = begin + threadIdx.x; e < end; e += blockDim.x) {
        const int tok = tokens[e];
        if (tok < 0 || tok >= vocab) continue;
        const int n = counts[e];
        if (n == -1) {
            row[tok] = -TI_INF;
            continue;
        }
        float l = row[tok];
        const float bias = biases[e];
        if (bias != 0.f) l = __fadd_rn(l, bias);  // (not 0: -0 + 0 would turn a -0 logit into +0)
        if (n < 0) {
            row[tok] = l;
            continue;
        }
        if (rep != 1.f) l = l > 0.f ? __fdiv_rn(l, rep) : __fmul_rn(l, rep);
        const float penalty = __fadd_rn(__fmul_rn(freq, (float)n), n > 0 ? pres : 0.f);
        row[tok] = __fsub_rn(l, penalty);
    }
}

// A row's bitmask (int32 words, bit t % 32 of word t / 32 for token t) into shared memory, 16 bytes a load where
// the row is 16-byte aligned: a scan that read its words from global memory as it went would wait on one
// load's latency every iteration.
__device__ __forceinline__ void load_mask(const int *__restrict__ mask, int words, u32 *smask) {
    if ((words & 3) == 0 && (reinterpret_cast<size_t>(mask) & 15) == 0) {
        const int4 *m4 = reinterpret_cast<const int4 *>(mask);
        int4 *s4 = reinterpret_cast<int4 *>(smask);
        for (int i = threadIdx.x; i < (words >> 2); i += blockDim.x) s4[i] = m4[i];
    } else {
        for (int i = threadIdx.x; i < words; i += blockDim.x) smask[i] = (u32)mask[i];
    }
    __syncthreads();
}

// ============================================================================= kernels
// grid (rows), block (1024). out[r] = argmax of logits row r (lowest index on ties).
extern "C" __global__ void __launch_bounds__(THREADS) argmax_rows(const float *__restrict__ logits, int vocab,
                                                                  int *__restrict__ out) {
    pdl_start();
    __shared__ float sv[32];
    __shared__ int si[32];
    const ArgMax m = block_argmax(thread_argmax<false>(logits + (size_t)blockIdx.x * vocab, vocab), sv, si);
    if (threadIdx.x == 0) out[blockIdx.x] = m.i;
}

// Row r's token: out[r], and, with host_out (mapped page-locked memory, stride host_stride), also
// host_out[*host_slot * host_stride + r], so the host reads it once the step's event has fired and no copy
// runs after the step (a copy is one more operation in the stream, which at batch 1 costs far more than its bytes).
__device__ __forceinline__ void emit(int *out, int *host_out, const int *host_slot, int host_stride, int r, int token) {
    out[r] = token;
    if (host_out) host_out[*host_slot * host_stride + r] = token;
}

// grid (rows), block (1024). Per row r: temperature[r] <= 0 means greedy (min-p, top-k, top-p
// ignored); min_p[r] <= 0 disables min-p; top_k[r] <= 0 or >= vocab disables top-k; top_p[r] >= 1
// disables top-p. counters[r] is the position being sampled. With pen_offsets (and the penalty
// tokens, counts, biases and factors) the block first applies row r's bias and penalties in place (penalize_row; in
// the same launch, not one of its own before it: one kernel less a step). num_keys > 0: the LM head
// wrote row 0's per-block keys to head_keys (batch 1); unless row 0 has penalty entries or a mask, its
// argmax comes from those keys. mask_rows[r] >= 0: row r keeps only the tokens its bitmask in `masks`
// allows (thread_argmax<true>, after the penalties; the launch gives mask_words * 4 bytes of dynamic shared
// memory for it). The token goes out as emit() writes it.
extern "C" __global__ void __launch_bounds__(THREADS) sample_rows(
        float *logits, int vocab, const float *__restrict__ temperature,
        const int *__restrict__ top_k, const float *__restrict__ top_p, const float *__restrict__ min_p,
        const u64 *__restrict__ seeds, const int *__restrict__ counters, int *__restrict__ out,
        const u64 *__restrict__ head_keys, int num_keys, const int *__restrict__ pen_offsets,
        const int *__restrict__ pen_tokens, const int *__restrict__ pen_counts, const float *__restrict__ pen_biases,
        const float *__restrict__ repetition, const float *__restrict__ presence, const float *__restrict__ frequency,
        const int *__restrict__ mask_rows,
        const int *__restrict__ masks, int mask_words, int *__restrict__ host_out, const int *__restrict__ host_slot,
        int host_stride) {
    pdl_start();
    __shared__ float sv[32];
    __shared__ int si[32];
    __shared__ u64 sk[32];
    const int r = blockIdx.x;
    float *z = logits + (size_t)r * vocab;  // not const: penalties are written in place, then read (no .nc loads)
    const float temp = temperature[r];

    const bool penalized = pen_offsets != nullptr && pen_offsets[r + 1] > pen_offsets[r];
    if (penalized) {
        penalize_row(z, vocab, r, pen_offsets, pen_tokens, pen_counts, pen_biases, repetition, presence, frequency);
        __syncthreads();  // the block's writes are visible to its own later reads
    }
    const int mask_row = mask_rows != nullptr ? mask_rows[r] : -1;
    extern __shared__ __align__(16) u32 smask[];  // mask_words: row r's bitmask
    if (mask_row >= 0) load_mask(masks + (size_t)mask_row * mask_words, mask_words, smask);
    const bool keyed = r == 0 && num_keys > 0 && !penalized && mask_row < 0;
    // (block_argmax's barriers make the -inf visible to the block)
    const ArgMax m = keyed ? keyed_argmax(head_keys, num_keys, sk)
                           : block_argmax(mask_row >= 0 ? thread_argmax<true>(z, vocab, smask)
                                                        : thread_argmax<false>(z, vocab),
                                          sv, si);
    if (!(temp > 0.f)) {
        if (threadIdx.x == 0) emit(out, host_out, host_slot, host_stride, r, m.i);
        return;
    }
    const float inv_t = 1.f / temp, zmax = __fmul_rn(m.v, inv_t);
    u32 threshold = min_p_key(zmax, min_p[r]);  // 0: keep everything
    const int k = top_k[r];
    if (k > 0 && k < vocab) {
        // Top-k within min-p's set: the k-th largest key, unless that set holds k tokens or fewer.
        float kept = (float)vocab, unused;
        if (threshold != 0) count_and_mass(z, vocab, inv_t, zmax, threshold, sv, &kept, &unused);
        if (kept > (float)k) {
            threshold = bisect_threshold(z, vocab, inv_t, zmax, sv, [k](float c, float) { return c >= (float)k; });
        }
    }
    const float p = top_p[r];
    if (!(p > 0.f)) {
        threshold = order_key(zmax);  // top_p <= 0 (rejected by the API): keep the most likely token only
    } else if (p < 1.f) {
        float c, kept_mass;
        count_and_mass(z, vocab, inv_t, zmax, threshold, sv, &c, &kept_mass);
        const float target = p * kept_mass;
        threshold = bisect_threshold(z, vocab, inv_t, zmax, sv, [target](float, float mass) { return mass >= target; });
    }
    const u64 seed = seeds[r];
    const u32 counter = (u32)counters[r];
    ArgMax best{-TI_INF, 0x7fffffff};
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
        const float v = z[i] * inv_t;
        if (order_key(v) >= threshold) {
            const float g = -logf(-logf(uniform01(seed, counter, (u32)i)));
            best = better(best, ArgMax{__fadd_rn(v, g), i});  // unfused, as numpy rounds z + g
        }
    }
    best = block_argmax(best, sv, si);
    if (threadIdx.x == 0) emit(out, host_out, host_slot, host_stride, r, best.i);
}
