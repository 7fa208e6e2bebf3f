"""The "xielu" epilogue (Apertus' up projection: out = bf16(xIELU(x W^T)) with the layer's four parameters,
cuda_src/common.cuh) on every matrix-product path, against float64 numpy: the GEMV (1-8 rows, every warp
split), the swap-AB GEMM (3-64 rows, plain and as the consumer of the norm statistics), the TMA GEMM (65+
rows, both tile widths, every split), the GEMV that normalizes its own input, and apertus-8b's up
projection (21,504 x 4,096) at the batch sizes the engine runs. Conventions as in test_kernels.py: fresh
random inputs per case, poisoned outputs, tolerances stated at the assertion."""
from __future__ import annotations

import math

import numpy as np
import pytest

from tileinfer.kernels import linear, norm_linear, rmsnorm
from tileinfer.kernels.linear import gemm
from tileinfer.kernels.routing import TMA_SPLITS

from gpu_helpers import BF16, linear_weight, matmul_ref, rand_bf16, rms, seed_of, to_f32  # noqa: E402
from test_kernels import assert_close  # noqa: E402

pytestmark = pytest.mark.gpu


def xielu_params(rng) -> np.ndarray:
    """[a_p, a_n, beta, eps] as the kernels take them: gains through softplus already (around
    transformers' initial 0.8, 0.8 + 0.5), eps its -1e-6."""
    beta = 0.5
    return np.array([rng.uniform(0.3, 1.5), beta + rng.uniform(0.2, 1.2), beta, -1e-6], np.float32)


def xielu_ref(v: np.ndarray, p: np.ndarray) -> np.ndarray:
    a_p, a_n, beta, eps = (float(t) for t in p)
    return np.where(v > 0, a_p * v * v + beta * v, (np.expm1(np.minimum(v, eps)) - v) * a_n + beta * v)


def check_xielu(buf, stream, M: int, N: int, K: int, launch, label: str) -> None:
    """launch(x, w, out, act) on random inputs against xIELU of the float64 product."""
    rng = np.random.default_rng(seed_of("xielu", label, M, N, K))
    w, x, p = linear_weight(N, K), rand_bf16(rng, (M, K)), xielu_params(rng)
    ref = xielu_ref(matmul_ref(x, w), p)
    out = buf.poisoned((M, N), BF16)
    launch(buf.upload(x), buf.upload(w), out, buf.upload(p))
    # bf16 output: rounding <= 2^-8 relative (rtol 1e-2); the float32 product's error, doubled by x^2, stays
    # far below atol = 2e-3 * rms(ref); ||err|| / ||ref|| < 1e-2 (bf16 rounding alone ~1.5e-3).
    assert_close(out.to_host(stream), ref, atol=2e-3 * rms(ref), rtol=1e-2, rel_norm=1e-2, label=label)


def forced(path: str, stream, **kw):
    return lambda x, w, out, act: linear(x, w, out, "xielu", stream, force=path, act=act, **kw)


@pytest.mark.parametrize("ksplit", [None, 1, 8])
@pytest.mark.parametrize("M", [1, 2])
@pytest.mark.parametrize("N, K", [(8, 64), (136, 4104), (1024, 2560)])
def test_xielu_gemv(M, N, K, ksplit, buf, stream):
    check_xielu(buf, stream, M, N, K, forced("gemv", stream, ksplit=ksplit),
                f"gemv xielu M={M} N={N} K={K} ksplit={ksplit}")


@pytest.mark.parametrize("M", [3, 7, 16, 33, 64])
@pytest.mark.parametrize("N, K", [(8, 72), (264, 1000), (2056, 4096)])
def test_xielu_swap(M, N, K, buf, stream):
    check_xielu(buf, stream, M, N, K, forced("swap", stream), f"swap xielu M={M} N={N} K={K}")


@pytest.mark.parametrize("M, N, K", [(65, 8, 8), (129, 264, 136), (300, 1024, 2560), (1000, 520, 4104)])
def test_xielu_gemm(M, N, K, buf, stream):
    for width in (256, 128):
        check_xielu(buf, stream, M, N, K, lambda x, w, out, act: gemm(x, w, out, "xielu", stream, width=width, split=1,
                                                                       act=act),
                    f"gemm_tma xielu M={M} N={N} K={K} width={width}")


@pytest.mark.parametrize("width", [128, 256])
@pytest.mark.parametrize("split", TMA_SPLITS)
def test_xielu_gemm_splits(split, width, buf, stream):
    M, N, K = 200, 264, 456
    check_xielu(buf, stream, M, N, K, lambda x, w, out, act: gemm(x, w, out, "xielu", stream, width=width, split=split,
                                                                   act=act),
                f"gemm_tma xielu M={M} N={N} K={K} split={split} width={width}")


@pytest.mark.parametrize("M", [1, 2, 5, 64, 256, 4096])
def test_xielu_apertus_8b_up_projection_as_routed(M, buf, stream):
    # The launcher's own choice, as the engine runs it: GEMV, swap-AB, TMA (split at 256, persistent at 4,096).
    check_xielu(buf, stream, M, 21504, 4096, lambda x, w, out, act: linear(x, w, out, "xielu", stream, act=act),
                f"apertus-8b up_proj xielu M={M}")


@pytest.mark.parametrize("M, N, K", [(5, 1032, 4096), (33, 2056, 1000), (17, 21504, 4096)])
def test_xielu_swap_row_norm(M, N, K, buf, stream):
    # The consumer of the norm statistics (steps of 3-32 rows): each row scaled by 1 / rms before xIELU.
    rng = np.random.default_rng(seed_of("xielu row_norm", M, N, K))
    eps = 1e-5
    w, norm_w, p = linear_weight(N, K), rand_bf16(rng, (K,), scale=0.1, mean=1.0), xielu_params(rng)
    r = rng.standard_normal((M, K), dtype=np.float32) * np.float32(3.0)
    x = (r * to_f32(norm_w)).astype(BF16)  # what norm_out writes
    ss = np.zeros((M, -(-K // 64) * 64))
    ss[:, :K] = r.astype(np.float64) ** 2
    ss = ss.reshape(M, -1, 64).sum(axis=2).astype(np.float32)
    inv = 1.0 / np.sqrt(ss.astype(np.float64).sum(axis=1, keepdims=True) / K + eps)
    out = buf.poisoned((M, N), BF16)
    linear(buf.upload(x), buf.upload(w), out, "xielu", stream, force="swap", row_norm=(buf.upload(ss), eps),
           act=buf.upload(p))
    ref = xielu_ref(matmul_ref(x, w) * inv, p)
    assert_close(out.to_host(stream), ref, atol=2e-3 * rms(ref), rtol=1e-2, rel_norm=1e-2,
                 label=f"swap xielu + row_norm M={M} N={N} K={K}")


@pytest.mark.parametrize("M, N, K", [(1, 21504, 4096), (2, 1024, 512), (1, 136, 1000)])
def test_xielu_norm_linear_fused_equals_rmsnorm_then_gemv(M, N, K, buf, stream):
    # The GEMV that normalizes its own input, with the activation: bitwise the rmsnorm kernel then the GEMV.
    rng = np.random.default_rng(seed_of("xielu norm_linear", M, N, K))
    resid = (rng.standard_normal((M, K)) * np.exp(rng.uniform(-3, 3, (M, 1)))).astype(np.float32)
    d_resid, d_norm = buf.upload(resid), buf.upload(rand_bf16(rng, (K,), scale=0.5, mean=1.0))
    d_w, d_act = buf.upload(linear_weight(N, K)), buf.upload(xielu_params(rng))
    x_fused, out_fused = buf.poisoned((M, K), BF16), buf.poisoned((M, N), BF16)
    norm_linear(d_resid, d_norm, 1e-5, x_fused, d_w, out_fused, "xielu", stream, act=d_act)
    x_plain, out_plain = buf.poisoned((M, K), BF16), buf.poisoned((M, N), BF16)
    rmsnorm(d_resid, d_norm, x_plain, 1e-5, stream)
    linear(x_plain, d_w, out_plain, "xielu", stream, force="gemv", act=d_act)
    got = out_fused.to_host(stream)
    assert np.isfinite(got.astype(np.float32)).all()
    np.testing.assert_array_equal(got.view(np.uint16), out_plain.to_host(stream).view(np.uint16))


def test_xielu_needs_its_parameters_and_only_it_takes_them(buf, stream):
    x, w = buf.upload(rand_bf16(np.random.default_rng(0), (3, 64))), buf.upload(linear_weight(16, 64))
    out, act = buf.poisoned((3, 16), BF16), buf.upload(np.zeros(4, np.float32))
    with pytest.raises(ValueError, match="needs its parameters"):
        linear(x, w, out, "xielu", stream)
    with pytest.raises(ValueError, match="act is for the 'xielu' epilogue"):
        linear(x, w, out, "bf16", stream, act=act)
    with pytest.raises(ValueError, match="act"):
        linear(x, w, out, "xielu", stream, act=buf.upload(np.zeros(3, np.float32)))
    assert math.isnan(float(out.to_host(stream).astype(np.float32)[0, 0]))  # nothing was launched
