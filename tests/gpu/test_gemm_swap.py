"""cuda_src/gemm_swap.cu (linear's "swap" path: the swap-AB wgmma weight-streaming GEMM of batches of
9-64 rows) against the float64 numpy reference, with test_gemm_small.py's harness (linear(force="swap")):
bf16 inputs from fixed per-case seeds, outputs poisoned first (NaN) with guard rows past M that the kernel
does not get (a view of the first M rows) and that must come back byte for byte."""
from __future__ import annotations

from functools import lru_cache

import pytest

from tileinfer.kernels.linear import SWAP_SPLITS

from gpu_helpers import linear_weight  # noqa: E402
from test_gemm_small import EPILOGUES, check_small, run_small  # noqa: E402

pytestmark = pytest.mark.gpu

_weight = lru_cache(maxsize=2)(linear_weight)  # consecutive cases share W (the largest is 311 MB)


def check_swap(buf, stream, M, N, K, epilogue, ksplit=None) -> None:
    check_small(buf, stream, M, N, K, epilogue, ksplit, w=_weight(N, K), path="swap")


# Awkward shapes: N a multiple of 8 but not of 64 (N = 8: one partial tile; 136 and 264: a tile of 8 rows;
# silu_mul halves of 4, 68, 132 outputs), K not a multiple of 64 (1000, 4104, 9736, 72: a chunk of 8) and
# shorter than the splits (K = 8, 64: one chunk, seven idle ranks at ksplit 8); M = 1 (padded to 16).
AWKWARD = [(1, 136, 1000), (9, 136, 1000), (16, 520, 4104), (17, 1000, 9736), (33, 2056, 1032), (64, 8, 64),
           (64, 264, 72), (48, 24, 8)]


@pytest.mark.parametrize("ksplit", [None, 1, 2, 8])
@pytest.mark.parametrize("epilogue", EPILOGUES)
@pytest.mark.parametrize("M, N, K", AWKWARD, ids=lambda v: str(v))
def test_swap_awkward(M, N, K, epilogue, ksplit, buf, stream):
    check_swap(buf, stream, M, N, K, epilogue, ksplit=ksplit)


# Qwen3-0.6B and Qwen3-4B layer matrices with their epilogues (hidden 1024 / 2560, intermediate 3072 / 9728, QKV
# 4096 / 6144), at every batch-rows variant (B = 16, 32, 64) with partial and full batches, as swap_config picks.
REAL = [(4096, 1024, "bf16"), (1024, 2048, "residual"), (6144, 1024, "silu_mul"), (1024, 3072, "residual"),
        (6144, 2560, "bf16"), (2560, 4096, "residual"), (19456, 2560, "silu_mul"), (2560, 9728, "residual")]


@pytest.mark.parametrize("M", [9, 16, 17, 33, 64])
@pytest.mark.parametrize("N, K, epilogue", REAL, ids=lambda v: str(v))
def test_swap_qwen3(M, N, K, epilogue, buf, stream):
    check_swap(buf, stream, M, N, K, epilogue)


# Every split on the 0.6B matrices at M = 64 and on 4B's down_proj at M = 33.
@pytest.mark.parametrize("ksplit", SWAP_SPLITS)
@pytest.mark.parametrize("M, N, K, epilogue", [(64, *r) for r in REAL[:4]] + [(33, *REAL[7])], ids=lambda v: str(v))
def test_swap_qwen3_splits(M, N, K, epilogue, ksplit, buf, stream):
    check_swap(buf, stream, M, N, K, epilogue, ksplit=ksplit)


@pytest.mark.parametrize("M", [9, 64])
def test_swap_lm_head(M, buf, stream):
    # Qwen3's LM head, N = 151936, float32 logits (the default path at 9-64 rows).
    check_swap(buf, stream, M, 151936, 1024, "f32")


@pytest.mark.parametrize("ksplit", [1, 8])
@pytest.mark.parametrize("epilogue", ["residual", "silu_mul"])
def test_swap_is_deterministic(epilogue, ksplit, buf, stream):
    # Cluster partials meet in rank order: the same inputs give the same bits, run after run.
    N, K = (1024, 3072) if epilogue == "residual" else (6144, 1024)
    outs, _, label, _, _ = run_small(buf, stream, 64, N, K, epilogue, ksplit=ksplit, w=_weight(N, K), repeats=3,
                                     path="swap")
    for i, other in enumerate(outs[1:], 1):
        assert other.tobytes() == outs[0].tobytes(), f"{label}: run {i} differs from run 0"
