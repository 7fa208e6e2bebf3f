// The split-K combine of paged attention (flash-decoding): merges the partial outputs that the attention
// kernels (attention_prefill.cu, attention_decode.cu) wrote per key-range split, part_o [splits, total_q, H,
// HD] unnormalized and part_ml [splits, total_q, H, 2] their (max, sum) in base 2, into bf16 out [total_q, H, HD].
#include "attn_input.cuh"  // HD, common.cuh

// grid (total_q, num_heads), block (COMBINE_THREADS = 512: tileinfer/kernels/attention.py), num_splits <= 128.
// Merges the splits' partial outputs of one (token, head): the weights 2^(m_s - M) of the splits in parallel
// (one thread each), then the weighted sum of their outputs, warp w taking splits w, w + 16, ... and lane l
// columns 4l..4l+3. A warp takes few splits, at most 8 of 128, and loads them into registers before the
// weights' reductions, so the partial outputs' latency overlaps that of the (max, sum) pairs.
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

    constexpr int PER_WARP = COMBINE_MAX_SPLITS / COMBINE_WARPS;
    float4 p[PER_WARP];
#pragma unroll
    for (int j = 0; j < PER_WARP; ++j) {
        const int s = warp + COMBINE_WARPS * j;
        if (s < num_splits) p[j] = reinterpret_cast<const float4 *>(part_o + (s * stride + row) * HD)[lane];
    }
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
    for (int j = 0; j < PER_WARP; ++j) {
        const int s = warp + COMBINE_WARPS * j;
        if (s >= num_splits) break;
        const float ws = weight[s];
        if (ws == 0.f) continue;  // never written (an empty split): not even 0 * its contents
        acc.x += ws * p[j].x; acc.y += ws * p[j].y; acc.z += ws * p[j].z; acc.w += ws * p[j].w;
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
