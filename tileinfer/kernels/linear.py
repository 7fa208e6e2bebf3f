"""Launchers for cuda_src/gemm.cu (tensor cores, prefill) and cuda_src/gemv.cu (decode).

`linear` computes y = x W^T for x [M, K] bf16 and W [N, K] bf16 with a fused epilogue:
  "bf16"      out [M, N] bf16
  "residual"  out [M, N] float32, out += x W^T (the residual stream)
  "silu_mul"  W is [gate; up] ([2I, K]); out [M, I] bf16 = silu(x gate^T) * (x up^T)
  "f32"       out [M, N] float32 (logits)
Decode-sized M (1, 2, 4, 8) takes the bandwidth-bound GEMV; everything else the GEMM.
"""
from ..cuda import I32, DeviceArray, kernel
from ._check import BF16, FLOAT32, cdiv, expect

EPILOGUES = {"bf16": 0, "residual": 1, "silu_mul": 2, "f32": 3}
GEMV_ROWS = (1, 2, 4, 8)
GEMM_TILE = 128
GEMM_SMEM = 3 * (128 + 128) * 64 * 2  # STAGES * (BM + BN) * BK * sizeof(bf16), as in gemm.cu
GEMV_WARPS = 8


def _out_spec(epilogue: str, M: int, N: int):
    if epilogue == "silu_mul":
        if N % 2:
            raise ValueError(f"linear silu_mul: W must stack [gate; up], got an odd N={N}")
        return (M, N // 2), BF16
    return (M, N), (BF16 if epilogue == "bf16" else FLOAT32)


def gemv_ksplit(pairs: int, K: int, target_warps: int = 4 * 132 * GEMV_WARPS) -> int:
    """Warps per row pair: enough warps to fill the GPU (~4 blocks per SM on an H200), while
    each warp still streams at least two 512-byte segments of its rows."""
    ksplit = 1
    while ksplit < 8 and pairs * ksplit < target_warps and K >= 512 * ksplit * 2:
        ksplit *= 2
    return ksplit


def linear(x: DeviceArray, w: DeviceArray, out: DeviceArray, epilogue: str, stream, *, force: str | None = None,
           ksplit: int | None = None) -> None:
    """out <- epilogue(x @ w.T). `force` ("gemm" or "gemv") and `ksplit` override the choices, for tests."""
    if epilogue not in EPILOGUES:
        raise ValueError(f"linear: unknown epilogue {epilogue!r}; choose one of {', '.join(EPILOGUES)}")
    M, K = x.shape
    N = w.shape[0]
    expect("x", x, (M, K), BF16)
    expect("w", w, (N, K), BF16)
    shape, dtype = _out_spec(epilogue, M, N)
    expect("out", out, shape, dtype)
    if K % 8 or N % 8:
        raise ValueError(f"linear: K and N must be multiples of 8 (16-byte rows), got K={K}, N={N}")
    path = force or ("gemv" if M in GEMV_ROWS else "gemm")
    epi = EPILOGUES[epilogue]
    if path == "gemv":
        if M not in GEMV_ROWS:
            raise ValueError(f"linear: the GEMV handles M in {GEMV_ROWS}, got M={M}")
        pairs = N // 2 if epilogue == "silu_mul" else cdiv(N, 2)
        ksplit = ksplit or gemv_ksplit(pairs, K)
        if ksplit not in (1, 2, 4, 8):
            raise ValueError(f"linear: ksplit must be 1, 2, 4 or 8, got {ksplit}")
        kernel("gemv.cu", f"gemv_m{M}_e{epi}").launch(
            (cdiv(pairs * ksplit, GEMV_WARPS),), (GEMV_WARPS * 32,), [x, w, out, I32(N), I32(K), I32(ksplit)], stream)
    elif path == "gemm":
        grid = (cdiv(N, GEMM_TILE), cdiv(M, GEMM_TILE))
        kernel("gemm.cu", f"gemm_e{epi}").launch(grid, (256,), [x, w, out, I32(M), I32(N), I32(K)], stream,
                                                smem=GEMM_SMEM)
    else:
        raise ValueError(f"linear: force must be 'gemm' or 'gemv', got {force!r}")
