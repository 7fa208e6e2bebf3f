"""cuda_src/gemm_tma.cu (the prefill GEMM fed by TMA, warp-specialized, persistent; linear's "gemm" path
with TILEINFER_TMA_GEMM=1) at both tile widths and with a capped grid, against the float64 numpy
reference, and against gemm.cu. tests/gpu/test_kernels.py covers the `linear(force="gemm")`
route at more shapes (M = 1 and 7 included: the batch-invariant mode puts every product on this path)."""
from __future__ import annotations

import numpy as np
import pytest

from tileinfer.kernels.linear import gemm

from gpu_helpers import linear_weight, rand_bf16  # noqa: E402
from test_kernels import EPILOGUES, F32, check_linear  # noqa: E402

pytestmark = pytest.mark.gpu

# Partial tiles in every dimension (M not a multiple of 128; N not a multiple of 128 or 256, gate/up
# halves not multiples of 64 or 128; K not a multiple of the 64-wide k-step), one k-step, many, a W box
# wholly past N (N = 8; N = 264 at 256 wide), and qwen3-4b's QKV, gate/up, o_proj and down_proj.
SHAPES = [(128, 128, 64), (33, 8, 8), (129, 264, 136), (1000, 136, 1000), (77, 520, 4104), (300, 1024, 2560),
          (256, 2560, 9728), (640, 2560, 4096), (512, 19456, 2560), (4096, 6144, 2560)]
# (tile width, cap on the persistent grid): both kernels on a full grid, and a few blocks each walking
# many tiles (the stage ring's barrier phases carry across tiles).
VARIANTS = [(256, None), (128, None), (256, 3), (128, 5)]


@pytest.mark.parametrize("epilogue", EPILOGUES)
@pytest.mark.parametrize("M, N, K", SHAPES)
def test_gemm_tma(M, N, K, epilogue, buf, stream):
    # The big shapes take the launcher's own tile width (as the model does), the rest every variant.
    for width, blocks in (VARIANTS if M * N * K <= 2 ** 33 else [(None, None)]):
        check_linear(buf, stream, M, N, K, epilogue, "gemm",
                     launch=lambda x, w, out: gemm(x, w, out, epilogue, stream, tma=True, width=width, blocks=blocks),
                     label=f"gemm_tma {epilogue} M={M} N={N} K={K} width={width} blocks={blocks}")


def test_gemm_tma_equals_gemm_up_to_summation_order(buf, stream):
    rng = np.random.default_rng(7)
    M, N, K = 640, 2048, 2560
    x, w = buf.upload(rand_bf16(rng, (M, K))), buf.upload(linear_weight(N, K))
    outs = [buf.poisoned((M, N), F32) for _ in range(3)]
    gemm(x, w, outs[0], "f32", stream, tma=False)
    gemm(x, w, outs[1], "f32", stream, tma=True, width=256)
    gemm(x, w, outs[2], "f32", stream, tma=True, width=128, blocks=7)
    ref, wide, narrow = (o.to_host(stream) for o in outs)
    for got in (wide, narrow):
        assert np.abs(got - ref).max() <= 1e-4 * np.abs(ref).max()
