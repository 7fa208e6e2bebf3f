// Decode-time matrix products y[m, n] = sum_k x[m, k] * W[n, k] for one or two rows of x (M = 1 or 2;
// from 3 rows on, `linear` runs the swap-AB GEMM, gemm_swap.cu).
//
// Bandwidth-bound: every weight byte is read exactly once per step, with 16-byte streaming
// loads, coalesced across the warp (a warp reads 512 contiguous bytes of a row per step).
// Each warp owns two output rows, so twice the loads are in flight per lane. x is small and
// re-read from L1. The epilogue is fused: plain bf16 store, residual add into the float32
// stream, SiLU(gate) * up, float32 logits, or bf16 xIELU(y) with the layer's parameters `act` (common.cuh;
// Apertus' up projection).
//
// Matrices with few rows (o_proj and down_proj have N = hidden size) would leave most SMs
// idle with one warp per row pair, so `ksplit` warps (1, 2, 4 or 8) share a row pair, each
// reading every ksplit-th 512-byte segment of the rows; their partial sums meet in shared
// memory before the epilogue.
//
// PIPE (o_proj, down_proj and the LM head at batch 1, when a warp streams at least 4 segments of
// its rows): software-pipelined, two batches of PIPE_UNROLL loads per row in flight, the next issued
// before the current one's products, instead of one batch of UNROLL loaded and then used.
//
// W is [N, K] bf16 row-major (Hugging Face's [out, in]); x is [M, K] bf16; K % 8 == 0.
#include "common.cuh"

enum Epilogue { EPI_BF16 = 0, EPI_RESIDUAL = 1, EPI_SILU_MUL = 2, EPI_F32 = 3, EPI_XIELU = 4 };

#define WARPS 8
#define UNROLL 4
#define PIPE_UNROLL 2
// Norm-weight chunks (4 elements) a thread loads before the PDL wait (rows of up to 2,048 fully), in rows
// longer than NORM_EARLY_MIN_K; shorter rows load them after the row's reduction, which was faster there.
#define NORM_CHUNKS 2
#define NORM_EARLY_MIN_K 1024

// One batch of a warp's weight loads: U 16-byte pieces of each of its two rows, `step` elements
// apart, from k0.
template <int U>
__device__ __forceinline__ void load_weights(vec16 (&a)[U], vec16 (&b)[U], const bf16 *__restrict__ w0,
                                             const bf16 *__restrict__ w1, int k0, int step, int K) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
        const int k = k0 + u * step;
        if (k < K) { a[u] = ld16_stream(w0 + k); b[u] = ld16_stream(w1 + k); }
    }
}

// acc += that batch times the M rows of x.
template <int M, int U>
__device__ __forceinline__ void fma_weights(const vec16 (&a)[U], const vec16 (&b)[U], const bf16 *x,
                                            int k0, int step, int K, float (&acc0)[M], float (&acc1)[M]) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
        const int k = k0 + u * step;
        if (k < K) {
            float wa[8], wb[8];
            unpack8(a[u], wa);
            unpack8(b[u], wb);
#pragma unroll
            for (int m = 0; m < M; ++m) {
                float xv[8];
                unpack8(ld16(x + (size_t)m * K + k), xv);
#pragma unroll
                for (int i = 0; i < 8; ++i) { acc0[m] += wa[i] * xv[i]; acc1[m] += wb[i] * xv[i]; }
            }
        }
    }
}

// ARGMAX (the LM head at batch 1, EPI_F32): besides the logits, each block writes the key of its
// largest logit to best[blockIdx.x], so that greedy decoding reduces one key per block instead of
// scanning the vocabulary again (sampling.cu, sample_rows). key = (order of the value) << 32 |
// ~index: the largest value wins, on a tie the lowest index, exactly as argmax_rows; -0 counts as
// +0 (they compare equal there) and a NaN never wins.
__device__ __forceinline__ unsigned long long logit_key(float v, int index) {
    if (v != v) return 0ull;
    const u32 b = __float_as_uint(v == 0.f ? 0.f : v);
    const u32 order = (b & 0x80000000u) ? ~b : (b | 0x80000000u);
    return ((unsigned long long)order << 32) | (u32)~(u32)index;
}

template <int M>
__device__ __forceinline__ void argmax_tail(float acc0, float acc1, int r0, int r1, bool has_r1, bool active, int lane,
                                            int warp, int kpart, int ksplit, float (*partial)[M][2],
                                            void *__restrict__ out, unsigned long long *__restrict__ best,
                                            unsigned long long *keys) {
    bool owner = active;  // this warp writes the row pair (no early return: the block meets below)
    if (ksplit > 1) {
        if (lane == 0) { partial[warp][0][0] = acc0; partial[warp][0][1] = acc1; }
        __syncthreads();
        owner = owner && kpart == 0;
        if (owner)
            for (int w = warp + 1; w < warp + ksplit; ++w) { acc0 += partial[w][0][0]; acc1 += partial[w][0][1]; }
    }
    unsigned long long key = 0ull;
    if (owner && lane == 0) {
        float *o = reinterpret_cast<float *>(out);
        o[r0] = acc0;
        key = logit_key(acc0, r0);
        if (has_r1) {
            o[r1] = acc1;
            const unsigned long long k1 = logit_key(acc1, r1);
            key = k1 > key ? k1 : key;
        }
    }
    if (lane == 0) keys[warp] = key;
    __syncthreads();
    if (threadIdx.x == 0) {
        unsigned long long k = keys[0];
        for (int w = 1; w < WARPS; ++w) k = keys[w] > k ? keys[w] : k;
        best[blockIdx.x] = k;
    }
}

// Row pair `pair`: for SILU_MUL the gate row j and the up row j + N/2 (W is [gate; up]),
// otherwise rows 2 pair and 2 pair + 1. This warp reads segments kpart, kpart + ksplit, ...
//
// NORM: x is not given; the block first computes x = rmsnorm(resid) * norm_w into shared memory
// `xs` ([M, K] bf16), exactly as the rmsnorm kernel would (same helpers, same block size), while
// its first weight loads are in flight. Every warp of the block takes part, active or not.
template <int M, int EPI, bool NORM, bool PIPE, bool ARGMAX = false>
__device__ __forceinline__ void gemv_rows(const bf16 *x, const float *__restrict__ resid,
                                          const bf16 *__restrict__ norm_w, float eps, bf16 *xs, float *scratch,
                                          const bf16 *__restrict__ W, void *__restrict__ out, int N, int K,
                                          int pair, int kpart, int ksplit, float (*partial)[M][2],
                                          const float *__restrict__ act,
                                          unsigned long long *__restrict__ best = nullptr,
                                          unsigned long long *keys = nullptr, float *__restrict__ cap = nullptr,
                                          int cap_stride = 0) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int n_out = EPI == EPI_SILU_MUL ? N / 2 : N;
    int r0, r1;
    if (EPI == EPI_SILU_MUL) { r0 = pair; r1 = pair + N / 2; }
    else { r0 = 2 * pair; r1 = 2 * pair + 1; }
    const bool active = EPI == EPI_SILU_MUL ? pair < n_out : r0 < N;
    const bool has_r1 = r1 < N;

    float acc0[M], acc1[M];
#pragma unroll
    for (int m = 0; m < M; ++m) acc0[m] = acc1[m] = 0.f;
    // EPI_RESIDUAL: the lane that writes out[r0], out[r1] reads their old values right after the
    // wait (start()), so that read's latency is not on the kernel's tail.
    float old0[M], old1[M];
    const bool writer = EPI == EPI_RESIDUAL && active && lane == 0 && kpart == 0;
    auto start = [&]() {
        pdl_start();
        if (writer)
#pragma unroll
            for (int m = 0; m < M; ++m) {
                const float *o = reinterpret_cast<const float *>(out) + (size_t)m * N;
                old0[m] = o[r0];
                old1[m] = has_r1 ? o[r1] : 0.f;
            }
    };

    // The first weight loads are issued before waiting for the kernel before this one (weights
    // depend on nothing), so their latency overlaps its tail; x is read only after the wait.
    if (PIPE) {
        static_assert(!(PIPE && NORM), "the pipelined loop has no norm prologue");
        // Two batches in flight; the sums run over k in the same order as the loop below.
        const bf16 *w0 = W + (size_t)r0 * K;
        const bf16 *w1 = W + (size_t)(has_r1 ? r1 : r0) * K;
        const int step = 256 * ksplit, stride = step * PIPE_UNROLL;
        int k0 = kpart * 256 + lane * 8;
        vec16 a0[PIPE_UNROLL], b0[PIPE_UNROLL], a1[PIPE_UNROLL], b1[PIPE_UNROLL];
        if (active) load_weights(a0, b0, w0, w1, k0, step, K);
        start();
        if (active)
            for (;;) {
                if (k0 + stride < K) load_weights(a1, b1, w0, w1, k0 + stride, step, K);
                fma_weights<M>(a0, b0, x, k0, step, K, acc0, acc1);
                k0 += stride;
                if (k0 >= K) break;
                if (k0 + stride < K) load_weights(a0, b0, w0, w1, k0 + stride, step, K);
                fma_weights<M>(a1, b1, x, k0, step, K, acc0, acc1);
                k0 += stride;
                if (k0 >= K) break;
            }
    } else {
        bool started = false;
        if (NORM) {  // the first batch of loads, the norm, and that batch's products
            const bf16 *w0 = W + (size_t)r0 * K;
            const bf16 *w1 = W + (size_t)(has_r1 ? r1 : r0) * K;
            const int step = 256 * ksplit, k0 = kpart * 256 + lane * 8;
            vec16 a[UNROLL], b[UNROLL];
            if (active) load_weights(a, b, w0, w1, k0, step, K);
            // The norm weights too (no kernel writes them), for rows longer than NORM_EARLY_MIN_K.
            const bool early = K > NORM_EARLY_MIN_K;
            u32 nwa[NORM_CHUNKS], nwb[NORM_CHUNKS];
            if (early) load_norm_weights(norm_w, K, nwa, nwb);
            start();
            started = true;
            for (int m = 0; m < M; ++m) {
                const float *row = resid + (size_t)m * K;
                const float r = row_inv_rms(row, K, eps, scratch);
                if (early) store_normed_row(row, r, nwa, nwb, norm_w, xs + (size_t)m * K, K);
                else store_normed_row(row, r, norm_w, xs + (size_t)m * K, K);
            }
            __syncthreads();
            x = xs;
            if (active) fma_weights<M>(a, b, x, k0, step, K, acc0, acc1);
        }
        if (active) {
            const bf16 *w0 = W + (size_t)r0 * K;
            const bf16 *w1 = W + (size_t)(has_r1 ? r1 : r0) * K;
            const int step = 256 * ksplit;  // elements between this warp's segments
            for (int k0 = kpart * 256 + lane * 8 + (NORM ? step * UNROLL : 0); k0 < K; k0 += step * UNROLL) {
                vec16 a[UNROLL], b[UNROLL];
                load_weights(a, b, w0, w1, k0, step, K);
                if (!started) { start(); started = true; }
                fma_weights<M>(a, b, x, k0, step, K, acc0, acc1);
            }
        }
        if (!started) start();
    }
#pragma unroll
    for (int m = 0; m < M; ++m) { acc0[m] = warp_sum(acc0[m]); acc1[m] = warp_sum(acc1[m]); }
    if constexpr (ARGMAX) {
        argmax_tail(acc0[0], acc1[0], r0, r1, has_r1, active, lane, warp, kpart, ksplit, partial, out, best, keys);
        return;
    }
    if (ksplit > 1) {  // the ksplit warps of a row pair are consecutive: sum their partials
        if (lane == 0)
#pragma unroll
            for (int m = 0; m < M; ++m) { partial[warp][m][0] = acc0[m]; partial[warp][m][1] = acc1[m]; }
        __syncthreads();
        if (kpart != 0) return;
        for (int w = warp + 1; w < warp + ksplit; ++w)
#pragma unroll
            for (int m = 0; m < M; ++m) { acc0[m] += partial[w][m][0]; acc1[m] += partial[w][m][1]; }
    }
    if (lane != 0 || !active) return;
    float4 a;
    if (EPI == EPI_XIELU) a = load_act(act);
#pragma unroll
    for (int m = 0; m < M; ++m) {
        if (EPI == EPI_BF16 || EPI == EPI_XIELU) {
            bf16 *o = reinterpret_cast<bf16 *>(out) + (size_t)m * N;
            o[r0] = f32_to_bf16(EPI == EPI_XIELU ? xielu(acc0[m], a) : acc0[m]);
            if (has_r1) o[r1] = f32_to_bf16(EPI == EPI_XIELU ? xielu(acc1[m], a) : acc1[m]);
        } else if (EPI == EPI_RESIDUAL) {
            float *o = reinterpret_cast<float *>(out) + (size_t)m * N;
            const float v0 = old0[m] + acc0[m], v1 = old1[m] + acc1[m];
            o[r0] = v0;
            if (has_r1) o[r1] = v1;
            if (cap) {  // the new residual also into the capture rows (see the kernels' comment)
                float *h = cap + (size_t)m * cap_stride;
                h[r0] = v0;
                if (has_r1) h[r1] = v1;
            }
        } else if (EPI == EPI_F32) {
            float *o = reinterpret_cast<float *>(out) + (size_t)m * N;
            o[r0] = acc0[m];
            if (has_r1) o[r1] = acc1[m];
        } else {  // SiLU(gate) * up
            const float g = acc0[m], u = acc1[m];
            reinterpret_cast<bf16 *>(out)[(size_t)m * n_out + pair] = f32_to_bf16(silu_mul(g, u));
        }
    }
}

// ============================================================================= kernels
// grid (ceil(pairs * ksplit / 8)), block (256). pairs = N/2 for SILU_MUL (N = 2 * intermediate),
// else ceil(N/2); ksplit in {1, 2, 4, 8} warps per row pair; act: xIELU's parameters (EPI_XIELU; the
// other epilogues ignore it: null).
// gemv_pipe_m1_*: the same with the pipelined loop (PIPE above), at batch 1, for the epilogues
// without a norm before them: residual (o_proj, down_proj) and f32 (the LM head).
// cap, cap_stride (EPI_RESIDUAL; null and 0 otherwise, or for no capture): the new residual row m is also
// written at cap + m * cap_stride (floats), N of them: a layer's hidden states captured for a drafter
// (tileinfer/model/forward.py, Capture) by the kernel that produces them.
#define GEMV_KERNEL(NAME, M, EPI, PIPE)                                                                  \
    extern "C" __global__ void __launch_bounds__(WARPS * 32)                                            \
        NAME(const bf16 *__restrict__ x, const bf16 *__restrict__ W, void *__restrict__ out, int N, int K, \
             int ksplit, const float *__restrict__ act, float *__restrict__ cap, int cap_stride) {      \
        __shared__ float partial[WARPS][M][2];                                                          \
        const int warp = threadIdx.x >> 5;                                                              \
        gemv_rows<M, EPI, false, PIPE>(x, nullptr, nullptr, 0.f, nullptr, nullptr, W, out, N, K,        \
                                       (blockIdx.x * WARPS + warp) / ksplit, warp % ksplit, ksplit, partial, \
                                       act, nullptr, nullptr, cap, cap_stride);                         \
    }
#define GEMV_ALL_EPI(M)                                                                                  \
    GEMV_KERNEL(gemv_m##M##_e0, M, 0, false) GEMV_KERNEL(gemv_m##M##_e1, M, 1, false)                   \
    GEMV_KERNEL(gemv_m##M##_e2, M, 2, false) GEMV_KERNEL(gemv_m##M##_e3, M, 3, false)                   \
    GEMV_KERNEL(gemv_m##M##_e4, M, 4, false)
// Compiled in two parts, at once: these plain products, and the argmax and norm builds below.
#define KERNEL_PARTS 2
#if IN_PART(0)
GEMV_ALL_EPI(1)
GEMV_ALL_EPI(2)
GEMV_KERNEL(gemv_pipe_m1_e1, 1, 1, true)
GEMV_KERNEL(gemv_pipe_m1_e3, 1, 3, true)
#endif

// The LM head at batch 1 with each block's largest logit (ARGMAX above): best[ceil(pairs * ksplit / 8)].
#define GEMV_ARGMAX_KERNEL(NAME, PIPE)                                                                   \
    extern "C" __global__ void __launch_bounds__(WARPS * 32)                                            \
        NAME(const bf16 *__restrict__ x, const bf16 *__restrict__ W, float *__restrict__ out, int N, int K, \
             int ksplit, unsigned long long *__restrict__ best) {                                       \
        __shared__ float partial[WARPS][1][2];                                                          \
        __shared__ unsigned long long keys[WARPS];                                                      \
        const int warp = threadIdx.x >> 5;                                                              \
        gemv_rows<1, EPI_F32, false, PIPE, true>(x, nullptr, nullptr, 0.f, nullptr, nullptr, W, out, N, K, \
                                                 (blockIdx.x * WARPS + warp) / ksplit, warp % ksplit, ksplit, \
                                                 partial, nullptr, best, keys);                         \
    }
#if IN_PART(1)
GEMV_ARGMAX_KERNEL(gemv_argmax_m1_e3, false)
GEMV_ARGMAX_KERNEL(gemv_pipe_argmax_m1_e3, true)
#endif

// The same with the RMSNorm of the input fused in: y = rmsnorm(resid) * norm_w @ W^T, for the two
// products that follow a norm (QKV: EPI_BF16; gate/up: EPI_SILU_MUL; Apertus' up: EPI_XIELU). resid [M, K] float32;
// dynamic shared memory M * K * 2 bytes; block (256) as the rmsnorm kernel's, K % 8 == 0; act as above
// (Apertus' up projection follows a norm too).
// MIN_BLOCKS 4 caps a kernel at 64 registers (4 blocks an SM, the wave gemv_ksplit plans for; the
// compiler would give gate/up 68, QKV 72). Capped, gate/up was faster or no slower on every Qwen3 size;
// QKV only on short rows, so norm_linear takes the capped QKV build (gemv_norm_m1_e0_b4) for rows of at
// most 1,024 (linear.NORM_SHORT_K). Apertus' up projection (xIELU) takes gate/up's cap.
#define GEMV_NORM_KERNEL(NAME, M, EPI, MIN_BLOCKS)                                                       \
    extern "C" __global__ void __launch_bounds__(WARPS * 32, MIN_BLOCKS)                                \
        NAME(const float *__restrict__ resid, const bf16 *__restrict__ norm_w, float eps, \
                                const bf16 *__restrict__ W, void *__restrict__ out, int N, int K, int ksplit, \
                                const float *__restrict__ act) {                                        \
        __shared__ float partial[WARPS][M][2];                                                          \
        __shared__ float scratch[32];                                                                   \
        extern __shared__ __align__(16) unsigned char xs_bytes[];                                       \
        const int warp = threadIdx.x >> 5;                                                              \
        gemv_rows<M, EPI, true, false>(nullptr, resid, norm_w, eps, reinterpret_cast<bf16 *>(xs_bytes), scratch, \
                                       W, out, N, K, (blockIdx.x * WARPS + warp) / ksplit, warp % ksplit, ksplit,  \
                                       partial, act);                                                           \
    }
#if IN_PART(1)
GEMV_NORM_KERNEL(gemv_norm_m1_e0, 1, 0, 1) GEMV_NORM_KERNEL(gemv_norm_m1_e0_b4, 1, 0, 4)
GEMV_NORM_KERNEL(gemv_norm_m1_e2, 1, 2, 4)
GEMV_NORM_KERNEL(gemv_norm_m2_e0, 2, 0, 1) GEMV_NORM_KERNEL(gemv_norm_m2_e2, 2, 2, 1)
GEMV_NORM_KERNEL(gemv_norm_m1_e4, 1, 4, 4) GEMV_NORM_KERNEL(gemv_norm_m2_e4, 2, 4, 1)
#endif
