"""Shape and dtype checks shared by the launchers (each raises ValueError naming the argument)."""
from __future__ import annotations

import ml_dtypes
import numpy as np

from ..cuda import DeviceArray

BF16 = np.dtype(ml_dtypes.bfloat16)
FLOAT32 = np.dtype(np.float32)
INT32 = np.dtype(np.int32)
UINT64 = np.dtype(np.uint64)
INT8 = np.dtype(np.int8)
UINT8 = np.dtype(np.uint8)


def expect(name: str, array: DeviceArray | None, shape: tuple, dtype) -> None:
    """`array` must have exactly `shape` (None entries match anything) and `dtype`."""
    if array is not None and array.shape == shape and array.dtype == dtype:
        return  # the usual case, first: the launchers check a few arrays a launch
    if array is None:
        raise ValueError(f"{name}: expected a device array of shape {shape}, got None")
    have = array.shape
    ok = len(have) == len(shape) and array.dtype == dtype
    if ok:
        for want, size in zip(shape, have):
            if want is not None and want != size:
                ok = False
                break
    if not ok:
        raise ValueError(f"{name}: expected shape {shape} {np.dtype(dtype)}, got {array.shape} {array.dtype}")


def cdiv(a: int, b: int) -> int:
    return -(-a // b)
