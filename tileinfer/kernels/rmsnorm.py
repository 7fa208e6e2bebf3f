"""Launcher for cuda_src/rmsnorm.cu."""
from ..cuda import F32, I32, DeviceArray, kernel
from ._check import BF16, FLOAT32, INT32, expect


def rmsnorm(x: DeviceArray, weight: DeviceArray, out: DeviceArray, eps: float, stream,
            rows: DeviceArray | None = None) -> None:
    """out[i] = rmsnorm(x[rows[i]]) * weight (rows=None: row i). x is the float32 residual stream."""
    dim = x.shape[1]
    n = out.shape[0]
    expect("x", x, (None, dim), FLOAT32)
    expect("weight", weight, (dim,), BF16)
    expect("out", out, (n, dim), BF16)
    if rows is None:
        if n > x.shape[0]:
            raise ValueError(f"rmsnorm: {n} output rows from {x.shape[0]} input rows")
    else:
        expect("rows", rows, (n,), INT32)
    if dim % 4:
        raise ValueError(f"rmsnorm: dim must be a multiple of 4, got {dim}")
    k = kernel("rmsnorm.cu", "rmsnorm")
    # It runs between the batched steps' tensor-core GEMMs: in their shared-memory configuration (it holds its
    # row in registers and needs no L1; docs/benchmarks.md has the measurement).
    k.prefer_shared_memory()
    k.launch((n,), (256,), [x, rows, weight, out, I32(dim), F32(eps)], stream)
