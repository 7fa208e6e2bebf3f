// Hopper warpgroup MMA (wgmma, sm_90a) helpers shared by the kernels that use it: shared-memory matrix
// descriptors, the fence / commit / wait protocol, and the m64n{96,128,160,256}k16 bf16 products
// (f32 accumulators in registers, both operands read from shared memory through descriptors; the
// accumulator fragment of warp w of the warpgroup: rows 16 (w % 4) + g and + 8, d[4j + e] is column
// 8j + 2t + (e & 1) of row g + 8 (e >> 1), g = lane / 4, t = lane % 4). Only sm_90a has these
// instructions: callers keep their use behind `#if defined(__CUDA_ARCH_FEAT_SM90_ALL)`.
#pragma once
#include "common.cuh"

// A shared-memory matrix descriptor: K-major rows of 128 bytes in 128-byte-swizzled 8-row atoms
// (1024 bytes apart: the stride byte offset), start address in 16-byte units.
__device__ __forceinline__ unsigned long long smem_desc(u32 addr) {
    unsigned long long d = 0;
    d |= (unsigned long long)((addr & 0x3FFFF) >> 4);      // bits 0-13: start address >> 4
    d |= (unsigned long long)(16 >> 4) << 16;                // bits 16-29: leading byte offset >> 4 (unused here)
    d |= (unsigned long long)(1024 >> 4) << 32;              // bits 32-45: stride byte offset >> 4
    d |= (unsigned long long)1 << 62;                        // bits 62-63: 128-byte swizzle
    return d;
}

// Makes this thread's generic-proxy writes to shared memory (cp.async, plain stores) visible to the
// tensor cores' async proxy; a barrier after it covers the other threads.
__device__ __forceinline__ void fence_async_smem() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

// ----------------------------------------------------------------------------- wgmma
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N> __device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}
// Pins the accumulators after a wgmma wait: no read of them moves above it.
template <int R> __device__ __forceinline__ void fence_regs(float (&d)[R]) {
#pragma unroll
    for (int i = 0; i < R; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// The accumulator operands d[B .. B + 15] of a wgmma asm statement.
#define WGMMA_D16(B)                                                                                      \
    "+f"(d[B + 0]), "+f"(d[B + 1]), "+f"(d[B + 2]), "+f"(d[B + 3]), "+f"(d[B + 4]), "+f"(d[B + 5]),       \
        "+f"(d[B + 6]), "+f"(d[B + 7]), "+f"(d[B + 8]), "+f"(d[B + 9]), "+f"(d[B + 10]), "+f"(d[B + 11]), \
        "+f"(d[B + 12]), "+f"(d[B + 13]), "+f"(d[B + 14]), "+f"(d[B + 15])

// The same, write-only (a product that overwrites d without reading it).
#define WGMMA_W16(B)                                                                                      \
    "=f"(d[B + 0]), "=f"(d[B + 1]), "=f"(d[B + 2]), "=f"(d[B + 3]), "=f"(d[B + 4]), "=f"(d[B + 5]),       \
        "=f"(d[B + 6]), "=f"(d[B + 7]), "=f"(d[B + 8]), "=f"(d[B + 9]), "=f"(d[B + 10]), "=f"(d[B + 11]), \
        "=f"(d[B + 12]), "=f"(d[B + 13]), "=f"(d[B + 14]), "=f"(d[B + 15])

// d (64 x 128 per warpgroup, 64 floats a thread) += A (64 x 16) * B (16 x 128), or = when !accumulate.
__device__ __forceinline__ void wgmma_m64n128k16(float (&d)[64], unsigned long long da, unsigned long long db,
                                                 int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
        "}, %64, %65, p, 1, 1, 0, 0;\n}\n"
        : WGMMA_D16(0), WGMMA_D16(16), WGMMA_D16(32), WGMMA_D16(48)
        : "l"(da), "l"(db), "r"(accumulate));
}

// d (64 x 256 per warpgroup, 128 floats a thread) += A (64 x 16) * B (16 x 256), or = when !accumulate.
__device__ __forceinline__ void wgmma_m64n256k16(float (&d)[128], unsigned long long da, unsigned long long db,
                                                 int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "
        "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "
        "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "
        "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "
        "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
        "}, %128, %129, p, 1, 1, 0, 0;\n}\n"
        : WGMMA_D16(0), WGMMA_D16(16), WGMMA_D16(32), WGMMA_D16(48),
          WGMMA_D16(64), WGMMA_D16(80), WGMMA_D16(96), WGMMA_D16(112)
        : "l"(da), "l"(db), "r"(accumulate));
}

// d (64 x 64 per warpgroup, 32 floats a thread) += A (64 x 16) * B (16 x 64), or = when !accumulate.
__device__ __forceinline__ void wgmma_m64n64k16(float (&d)[32], unsigned long long da, unsigned long long db,
                                                int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
        "}, %32, %33, p, 1, 1, 0, 0;\n}\n"
        : WGMMA_D16(0), WGMMA_D16(16)
        : "l"(da), "l"(db), "r"(accumulate));
}

// d (64 x 96 per warpgroup, 48 floats a thread) += A (64 x 16) * B (16 x 96), or = when !accumulate.
__device__ __forceinline__ void wgmma_m64n96k16(float (&d)[48], unsigned long long da, unsigned long long db,
                                                int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %50, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n96k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47"
        "}, %48, %49, p, 1, 1, 0, 0;\n}\n"
        : WGMMA_D16(0), WGMMA_D16(16), WGMMA_D16(32)
        : "l"(da), "l"(db), "r"(accumulate));
}

// d (64 x 160 per warpgroup, 80 floats a thread) += A (64 x 16) * B (16 x 160), or = when !accumulate.
__device__ __forceinline__ void wgmma_m64n160k16(float (&d)[80], unsigned long long da, unsigned long long db,
                                                 int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %82, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n160k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "
        "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79"
        "}, %80, %81, p, 1, 1, 0, 0;\n}\n"
        : WGMMA_D16(0), WGMMA_D16(16), WGMMA_D16(32), WGMMA_D16(48), WGMMA_D16(64)
        : "l"(da), "l"(db), "r"(accumulate));
}
