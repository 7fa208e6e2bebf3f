"""linear(capture=): the residual epilogue of every product path also writes the new residual rows into a
column block of a wider capture buffer (a layer's hidden states for a DFlash drafter, model/forward.py).

On each path (the GEMV at 1-2 rows, plain and pipelined; the swap-AB GEMM at 3-64 rows, plain and as the norm
statistics' producer, with and without a K split; the TMA GEMM, unsplit at both tile widths and split by 2-4):
the residual stream comes back byte for byte as without the capture, the capture's column block holds exactly
those rows, and nothing else of the buffer (its other columns, rows past M) is written. Inputs are fresh random
bf16 (seeded per case); the buffer starts poisoned (0xFF bytes).
"""
from __future__ import annotations

import numpy as np
import pytest

from tileinfer.kernels import linear
from tileinfer.kernels._check import BF16
from tileinfer.kernels.linear import gemm

from gpu_helpers import POISON, linear_weight, rand_bf16, seed_of  # noqa: E402

pytestmark = pytest.mark.gpu

GUARD = 3  # rows past M in the buffers, outside the views the kernel gets


def poisoned_host(shape, dtype) -> np.ndarray:
    return np.frombuffer(bytes([POISON]) * (int(np.prod(shape)) * np.dtype(dtype).itemsize), dtype).reshape(shape)


@pytest.mark.parametrize("M, N, K, options", [
    (1, 1024, 3072, {"force": "gemv"}), (2, 520, 1000, {"force": "gemv"}),
    (1, 2560, 9728, {"force": "gemv", "pipe": True}), (1, 1000, 2568, {"force": "gemv", "pipe": False}),
    (5, 1024, 3072, {"force": "swap"}), (16, 4096, 12288, {"force": "swap"}), (17, 520, 1000, {"force": "swap", "ksplit": 2}),
    (64, 2560, 9728, {"force": "swap", "ksplit": 8}), (16, 4096, 4096, {"force": "swap", "norm_out": True}),
    (33, 1024, 3072, {"force": "swap", "ksplit": 1, "norm_out": True}),
    (65, 1024, 3072, {}), (200, 2560, 4096, {}), (300, 4096, 12288, {}), (16, 1024, 3072, {"force": "gemm"}),
    (130, 1024, 2048, {"width": 128, "split": 1}), (130, 1024, 2048, {"width": 256, "split": 1}),
    (1000, 1024, 1024, {"width": 256, "split": 1}),
    (96, 1032, 3072, {"split": 2}), (128, 2560, 4096, {"split": 3}), (256, 1024, 9728, {"split": 4}),
], ids=lambda v: str(v))
def test_the_residual_epilogue_writes_the_capture(M, N, K, options, buf, stream):
    rng = np.random.default_rng(seed_of("linear capture", M, N, K, sorted(options.items())))
    layers, column = 3, N  # the captured layer is the middle one of three
    w, x = linear_weight(N, K), rand_bf16(rng, (M, K))
    old = rng.standard_normal((M + GUARD, N), dtype=np.float32)
    xd, wd = buf.upload(x), buf.upload(w)
    next_w = buf.upload(rand_bf16(rng, (N,), scale=0.1, mean=1.0))

    def product(out, capture=None):
        if "split" in options:  # the TMA GEMM's builds, by name
            gemm(xd, wd, out, "residual", stream, width=options.get("width"), split=options["split"],
                 capture=capture)
            return
        kw = {k: options[k] for k in ("force", "ksplit", "pipe") if k in options}
        if options.get("norm_out"):
            kw["norm_out"] = (next_w, buf.poisoned((M, N), BF16), buf.poisoned((M, -(-N // 64)), np.float32))
        linear(xd, wd, out, "residual", stream, capture=capture, **kw)

    label = f"M={M} N={N} K={K} {options}"
    plain = buf.upload(old)
    product(plain.rows(0, M))
    resid = buf.upload(old)
    states = buf.poisoned((M + GUARD, layers * N), np.float32)
    product(resid.rows(0, M), capture=(states.rows(0, M), column))
    want = plain.to_host(stream)
    assert resid.to_host(stream).tobytes() == want.tobytes(), f"{label}: the residual stream differs with the capture"
    cap = states.to_host(stream)
    assert cap[:M, column:column + N].tobytes() == want[:M].tobytes(), f"{label}: the capture is not the new rows"
    untouched = poisoned_host((M + GUARD, layers * N), np.float32).copy()
    untouched[:M, column:column + N] = want[:M]
    assert cap.tobytes() == untouched.tobytes(), f"{label}: the capture wrote outside its rows and columns"


def test_capture_is_refused_where_it_cannot_be(buf, stream):
    x, w = buf.upload(rand_bf16(np.random.default_rng(0), (4, 64))), buf.upload(linear_weight(128, 64))
    states = buf.poisoned((4, 256), np.float32)
    with pytest.raises(ValueError, match="residual epilogue"):
        linear(x, w, buf.poisoned((4, 128), np.float32), "f32", stream, capture=(states, 0))
    with pytest.raises(ValueError, match="does not fit"):
        linear(x, w, buf.poisoned((4, 128), np.float32), "residual", stream, capture=(states, 192))
    with pytest.raises(ValueError, match="does not fit"):
        linear(x, w, buf.poisoned((4, 128), np.float32), "residual", stream, capture=(states, 2))
