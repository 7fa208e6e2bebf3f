// Shared device helpers: bf16 <-> f32, 16-byte vectors, warp reductions, PTX wrappers.
//
// No CUDA header is included anywhere in cuda_src/: bf16 values travel as raw 16-bit
// patterns (`bf16`), converted with single PTX instructions. That keeps NVRTC compiles
// fast and identical across NVRTC versions (13.0 on the GPU machine, newer from pip).
#pragma once

typedef unsigned short bf16;
typedef unsigned int u32;
typedef unsigned long long u64;

#define TI_INF __int_as_float(0x7f800000)

// A file whose kernels take long to compile says `#define KERNEL_PARTS n` and puts its entry points under
// `#if IN_PART(p)`, p = 0 .. n - 1: the compiler (tileinfer/cuda/compiler.py) builds part p alone with
// -DKERNEL_PART=p, the n parts at once. Without KERNEL_PART (the tests, the tools) the file holds them all.
#ifdef KERNEL_PART
#define IN_PART(p) (KERNEL_PART == (p))
#else
#define IN_PART(p) 1
#endif

struct __align__(16) vec16 { u32 w[4]; };   // 16 bytes: 8 bf16, or 4 f32/i32

// ----------------------------------------------------------------------------- conversions
__device__ __forceinline__ float bf16_to_f32(bf16 x) { return __uint_as_float(((u32)x) << 16); }

__device__ __forceinline__ bf16 f32_to_bf16(float x) {
    unsigned short r;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(x));
    return r;
}

// Two floats -> one u32 holding two bf16: `lo` in the low half (the lower address).
__device__ __forceinline__ u32 pack_bf16x2(float lo, float hi) {
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

__device__ __forceinline__ float bf16lo(u32 w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf16hi(u32 w) { return __uint_as_float(w & 0xffff0000u); }

// Four int8 (one u32, lowest byte first) -> four bf16, exactly (|x| <= 128 fits bf16's 8-bit
// significand): bias each byte to unsigned, place it as the low byte of the float 2^23 (one byte
// permute), subtract 2^23 + 128, and keep the upper halves (the low 16 bits of those floats are
// zero). lo = values 0, 1; hi = 2, 3. Eleven integer/FP32 instructions, no conversion unit.
__device__ __forceinline__ void i8x4_to_bf16x4(u32 w, u32 &lo, u32 &hi) {
    const u32 u = w ^ 0x80808080u;
    const u32 magic = 0x4B000000u;  // 2^23: bytes 4..7 of the permute are 0, 0, 0, 0x4B
    const float f0 = __uint_as_float(__byte_perm(u, magic, 0x7540)) - 8388736.f;
    const float f1 = __uint_as_float(__byte_perm(u, magic, 0x7541)) - 8388736.f;
    const float f2 = __uint_as_float(__byte_perm(u, magic, 0x7542)) - 8388736.f;
    const float f3 = __uint_as_float(__byte_perm(u, magic, 0x7543)) - 8388736.f;
    lo = __byte_perm(__float_as_uint(f0), __float_as_uint(f1), 0x7632);
    hi = __byte_perm(__float_as_uint(f2), __float_as_uint(f3), 0x7632);
}

// Unpack 8 bf16 from a 16-byte vector.
__device__ __forceinline__ void unpack8(const vec16 &v, float f[8]) {
#pragma unroll
    for (int i = 0; i < 4; ++i) { f[2 * i] = bf16lo(v.w[i]); f[2 * i + 1] = bf16hi(v.w[i]); }
}

__device__ __forceinline__ vec16 pack8(const float f[8]) {
    vec16 v;
#pragma unroll
    for (int i = 0; i < 4; ++i) v.w[i] = pack_bf16x2(f[2 * i], f[2 * i + 1]);
    return v;
}

// ----------------------------------------------------------------------------- loads
__device__ __forceinline__ vec16 ld16(const void *p) { return *reinterpret_cast<const vec16 *>(p); }
__device__ __forceinline__ void st16(void *p, const vec16 &v) { *reinterpret_cast<vec16 *>(p) = v; }

// Streaming load for weights read once per step: bypass L1, do not keep in L1.
__device__ __forceinline__ vec16 ld16_stream(const void *p) {
    vec16 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.w[0]), "=r"(v.w[1]), "=r"(v.w[2]), "=r"(v.w[3]) : "l"(p));
    return v;
}

// ----------------------------------------------------------------------------- kernel chaining
// Programmatic dependent launch (sm_90): the launcher lets each kernel start while the one before
// it is still running (tileinfer/cuda/module.py), so every kernel calls pdl_start() before it
// reads anything an earlier kernel wrote or writes anything at all. Before that call a kernel may
// only read what no kernel writes (weights). pdl_start waits until the kernels before this one
// have finished and their writes are visible, then lets the next kernel begin launching (its
// blocks wait in their own pdl_start). Without that launch attribute both are no-ops.
__device__ __forceinline__ void pdl_start() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// The next kernel may begin launching, without this kernel's wait for the ones before it (a kernel that orders
// its reads after another's writes itself: gemm_swap.cu's flow consumer).
__device__ __forceinline__ void pdl_launch_dependents() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// ----------------------------------------------------------------------------- reductions
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sum over the whole block; `scratch` holds >= 32 floats. Every thread gets the result.
__device__ __forceinline__ float block_sum(float v, float *scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = (blockDim.x + 31) >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < nwarps ? scratch[lane] : 0.f;
    return warp_sum(v);
}

__device__ __forceinline__ float block_max(float v, float *scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = (blockDim.x + 31) >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < nwarps ? scratch[lane] : -TI_INF;
    return warp_max(v);
}

// ----------------------------------------------------------------------------- GEMM tiles
// The row of W that row r of a tile of W rows starting at n0 loads (gn); false past the end. With
// silu (W = [gate; up], N = 2 I), tile rows 2q and 2q + 1 hold gate row j and up row j, j = n0/2 + q,
// so one thread's accumulators hold both halves of SiLU(gate) * up.
__device__ __forceinline__ bool tile_weight_row(int r, int n0, int N, bool silu, int &gn) {
    if (silu) {
        const int j = n0 / 2 + (r >> 1), half = N / 2;
        gn = (r & 1) ? half + j : j;
        return j < half;
    }
    gn = n0 + r;
    return gn < N;
}

// ----------------------------------------------------------------------------- RMSNorm pieces
// Shared by the rmsnorm kernel and the GEMV that normalizes its own input (gemv.cu), so both round
// identically: with the same block size the thread-to-element mapping, hence every sum, is the same.

// A chunk's part of the sum of squares.
__device__ __forceinline__ float sum_squares4(float4 v) { return v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w; }

// 1 / sqrt(mean(x^2) + eps) of one float32 row (dim % 4 == 0), by the whole block.
__device__ __forceinline__ float row_inv_rms(const float *__restrict__ x, int dim, float eps, float *scratch) {
    const float4 *xr = reinterpret_cast<const float4 *>(x);
    float ss = 0.f;
    for (int c = threadIdx.x; c < dim / 4; c += blockDim.x) ss += sum_squares4(xr[c]);
    return rsqrtf(block_sum(ss, scratch) / dim + eps);
}

// The norm weights' pieces this thread will multiply in store_normed_row (chunk c = tid + i * blockDim.x
// of 4 elements: wa = elements 4c, 4c+1, wb = 4c+2, 4c+3), for the first C chunks a thread takes. No
// kernel writes weights, so a kernel loads them before its PDL wait and the store does not wait for them
// after the row's reduction.
template <int C>
__device__ __forceinline__ void load_norm_weights(const bf16 *__restrict__ w, int dim, u32 (&wa)[C], u32 (&wb)[C]) {
    const u32 *w2 = reinterpret_cast<const u32 *>(w);
#pragma unroll
    for (int i = 0; i < C; ++i) {
        const int c = threadIdx.x + i * blockDim.x;
        if (c < dim / 4) { wa[i] = w2[2 * c]; wb[i] = w2[2 * c + 1]; }
    }
}

// Chunk c (4 elements) of a normed row: out[4c .. 4c+3] = bf16(x * r * w), with the weights' pieces
// wa = w[4c], w[4c+1] and wb = w[4c+2], w[4c+3].
// store_normed4 is the same with the chunk's values v already loaded.
__device__ __forceinline__ void store_normed4(float4 v, float r, u32 wa, u32 wb, bf16 *out, int c) {
    u32 *o = reinterpret_cast<u32 *>(out);
    o[2 * c] = pack_bf16x2(v.x * r * bf16lo(wa), v.y * r * bf16hi(wa));
    o[2 * c + 1] = pack_bf16x2(v.z * r * bf16lo(wb), v.w * r * bf16hi(wb));
}
__device__ __forceinline__ void store_normed_chunk(const float *__restrict__ x, float r, u32 wa, u32 wb, bf16 *out,
                                                   int c) {
    store_normed4(reinterpret_cast<const float4 *>(x)[c], r, wa, wb, out, c);
}

// out = bf16(x * r * w) for one row, by the whole block (out: 4-byte aligned), chunks from c0 on
// (the weights read from memory).
__device__ __forceinline__ void store_normed_row(const float *__restrict__ x, float r, const bf16 *__restrict__ w,
                                                 bf16 *out, int dim, int c0 = threadIdx.x) {
    const u32 *w2 = reinterpret_cast<const u32 *>(w);
    for (int c = c0; c < dim / 4; c += blockDim.x) store_normed_chunk(x, r, w2[2 * c], w2[2 * c + 1], out, c);
}

// store_normed_row with the weights' first C chunks from load_norm_weights (the rest from memory).
template <int C>
__device__ __forceinline__ void store_normed_row(const float *__restrict__ x, float r, const u32 (&wa)[C],
                                                 const u32 (&wb)[C], const bf16 *__restrict__ w, bf16 *out, int dim) {
#pragma unroll
    for (int i = 0; i < C; ++i) {
        const int c = threadIdx.x + i * blockDim.x;
        if (c < dim / 4) store_normed_chunk(x, r, wa[i], wb[i], out, c);
    }
    store_normed_row(x, r, w, out, dim, threadIdx.x + C * blockDim.x);
}

// ----------------------------------------------------------------------------- activations
// xIELU, Apertus' MLP activation: the EPI_XIELU epilogue of the matrix products (the bf16 store of xielu(v))
// with the layer's parameters act = [a_p, a_n, beta, eps], float32 in device memory (no kernel writes them:
// they may be read at any time), the gains already through softplus on the host (tileinfer/model/weights.py,
// xielu_params):
//   f(x) = a_p x^2 + beta x                         for x > 0
//          (expm1(min(x, eps)) - x) a_n + beta x    otherwise
// SiLU(g) * u, the SILU_MUL epilogues' product (W = [gate; up]): g * sigmoid(g) * u from the approximate 2^x
// and reciprocal, one MUFU instruction each (relative errors near 2^-22, far below the bf16 rounding of the
// result), and no branch: an IEEE division compiles to a range check and a call per value, and the TMA GEMM's
// epilogue ran its 64 values a thread one after another behind those branches. g -> -inf: 2^x -> inf, its
// reciprocal 0, the product -0.
__device__ __forceinline__ float silu_mul(float g, float u) {
    float e, r;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"(g * -1.44269504f));
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(1.f + e));
    return g * r * u;
}

__device__ __forceinline__ float4 load_act(const float *__restrict__ act) {
    return *reinterpret_cast<const float4 *>(act);
}

// expm1(x) for x <= 0 (xIELU's negative side): a degree-6 Taylor polynomial near 0, where exp(x) - 1 would
// cancel (relative error < 1e-7 for -0.25 < x <= 0), exp(x) - 1 below (error < 1e-6 of a result < -0.22).
// A fraction of expm1f's code, for the GEMM epilogues' register budget.
__device__ __forceinline__ float expm1_neg(float x) {
    if (x > -0.25f)
        return x * (1.f + x * (0.5f + x * (1.f / 6.f + x * (1.f / 24.f + x * (1.f / 120.f + x * (1.f / 720.f))))));
    return __expf(x) - 1.f;
}

__device__ __forceinline__ float xielu(float x, const float4 &a) {
    return x > 0.f ? a.x * x * x + a.z * x : (expm1_neg(fminf(x, a.w)) - x) * a.y + a.z * x;
}

// ----------------------------------------------------------------------------- tensor cores
// Shared-memory address for PTX (32-bit .shared window).
__device__ __forceinline__ u32 smem_addr(const void *p) { return (u32)__cvta_generic_to_shared(p); }

// 16-byte global -> shared copy, zero-filled when `valid` is false (no bytes read then).
__device__ __forceinline__ void cp_async16(u32 dst, const void *src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0));
}
// 4-byte global -> shared copy (through L1), zero-filled when `valid` is false.
__device__ __forceinline__ void cp_async4(u32 dst, const void *src, bool valid) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(dst), "l"(src), "r"(valid ? 4 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }
template <int N> __device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N)); }

// Four 8x8 b16 matrices; lanes 8i..8i+7 give the row addresses of matrix i.
__device__ __forceinline__ void ldmatrix_x4(u32 r[4], u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(u32 r[4], u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

// D = A(16x16, row) * B(16x8, col) + D, bf16 inputs, f32 accumulators.
// Fragment layout (g = lane/4, t = lane%4): a0 (g, 2t..2t+1), a1 (g+8, 2t..), a2 (g, 2t+8..),
// a3 (g+8, 2t+8..); b0 (k=2t..2t+1, n=g), b1 (k=2t+8.., n=g); d0,d1 (g, 2t..2t+1), d2,d3 (g+8, 2t..).
__device__ __forceinline__ void mma_bf16_16816(float d[4], const u32 a[4], const u32 b[2]) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                 "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

__device__ __forceinline__ int ceil_div(int a, int b) { return (a + b - 1) / b; }
