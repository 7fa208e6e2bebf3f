"""Tensor maps (CUtensorMap) for the tensor memory accelerator: what a kernel's TMA copies
(cp.async.bulk.tensor) need to address a 2-D bf16 array in global memory.

A map is 128 bytes, made on the host by cuTensorMapEncodeTiled and passed to the kernel by value (a
`const __grid_constant__ CUtensorMap` parameter; Kernel.launch passes ctypes arrays by value). It holds
the array's address, shape and row stride, the box one copy moves, the shared-memory swizzle, and
what out-of-bounds elements read as (zero here). Maps depend only on those values, so they are cached.
"""
from __future__ import annotations

import ctypes
from functools import lru_cache

from cuda.bindings import driver

from .driver import call

TensorMap = ctypes.c_uint64 * 16  # 128 bytes, 64-byte aligned in the kernel's parameter space


@lru_cache(maxsize=4096)
def bf16_tensor_map(ptr: int, rows: int, cols: int, box_rows: int, box_cols: int = 64) -> TensorMap:
    """The map of a row-major bf16 [rows, cols] array at `ptr` (cols % 8 == 0: rows 16-byte aligned), read
    in boxes of box_rows x box_cols with the 128-byte swizzle (box_cols * 2 must be 128) and zero fill."""
    if cols % 8 or box_cols * 2 != 128 or not 1 <= box_rows <= 256 or rows <= 0:
        raise ValueError(f"bf16_tensor_map: need cols % 8 == 0, 64-column boxes and 1..256 box rows, got "
                         f"[{rows}, {cols}] box {box_rows} x {box_cols}")
    u64, u32 = driver.cuuint64_t, driver.cuuint32_t
    tmap = call(driver.cuTensorMapEncodeTiled,
                driver.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, ptr,
                [u64(cols), u64(rows)],              # dimensions, innermost first
                [u64(cols * 2)],                     # byte stride of the outer dimension
                [u32(box_cols), u32(box_rows)],
                [u32(1), u32(1)],                    # element strides
                driver.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
                driver.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B,
                driver.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                driver.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
                detail=f"tensor map of bf16 [{rows}, {cols}] at {ptr:#x}, box {box_rows} x {box_cols}")
    return TensorMap.from_buffer_copy(ctypes.string_at(tmap.getPtr(), 128))
