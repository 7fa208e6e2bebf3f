"""cuda_src/gemm_swap.cu (linear's "swap" path: the swap-AB wgmma weight-streaming GEMM of batches and
verify steps of 3-64 rows) against float64 numpy.

Self-contained; conventions as in test_kernels.py (STYLE.md habit 12):
  * Inputs are fresh random data from np.random.default_rng(<seed fixed per case via zlib.crc32>), rounded to
    bf16; the reference is computed in float64 from those same bf16 values. Weights are drawn once per shape.
  * Outputs are poisoned first (0xFF bytes: NaN in bf16 and float32) and must hold no NaN afterwards. Each
    output has GUARD extra rows past M that the kernel is not given (it gets a view of the first M rows):
    they must come back byte for byte as they went in (poison, or the old residual stream).
  * Tolerances are stated at the assertion; a line reports max |err|, the worst element and ||err|| / ||ref||.
"""
from __future__ import annotations

import math
from functools import lru_cache

import ml_dtypes
import numpy as np
import pytest

from tileinfer.cuda import get_device
from tileinfer.kernels import linear
from tileinfer.kernels.routing import SWAP_SPLITS, swap_config

from gpu_helpers import POISON, linear_weight, matmul_ref, rand_bf16, rms, seed_of, to_f32, to_f64  # noqa: E402

pytestmark = pytest.mark.gpu

BF16 = np.dtype(ml_dtypes.bfloat16)
F32 = np.dtype(np.float32)
GUARD = 3       # rows past M in every output buffer, outside the view the kernel gets
EPILOGUES = ("bf16", "residual", "silu_mul", "f32")
_weight = lru_cache(maxsize=2)(linear_weight)  # consecutive cases share W (the largest is 311 MB)

# ============================================================================= helpers


def assert_close(got, ref, *, atol: float, rtol: float, rel_norm: float, label: str) -> None:
    """|got - ref| <= atol + rtol |ref| everywhere, nothing non-finite, ||got - ref|| / ||ref|| <= rel_norm."""
    got64, ref64 = to_f64(got), np.asarray(ref, np.float64)
    assert got64.shape == ref64.shape, f"{label}: shape {got64.shape} != reference shape {ref64.shape}"
    assert np.isfinite(ref64).all(), f"{label}: the reference itself is not finite (test bug)"
    bad = ~np.isfinite(got64)
    if bad.any():
        where = np.argwhere(bad)
        raise AssertionError(f"{label}: {int(bad.sum())} of {bad.size} elements are NaN/inf (never written?); "
                             f"first at {tuple(int(i) for i in where[0])}, last at {tuple(int(i) for i in where[-1])}")
    err = np.abs(got64 - ref64)
    bound = atol + rtol * np.abs(ref64)
    ratio = err / bound
    worst = tuple(int(i) for i in np.unravel_index(int(np.argmax(ratio)), ratio.shape))
    rel = float(np.linalg.norm(err) / max(float(np.linalg.norm(ref64)), 1e-300))
    n_bad = int((err > bound).sum())
    summary = (f"{label}: max|err| {err.max():.3e}; worst err/allowed {ratio.max():.3f} at {worst} "
               f"(got {got64[worst]:.6g}, ref {ref64[worst]:.6g}); ||err||/||ref|| {rel:.2e}; "
               f"{n_bad} of {err.size} outside atol {atol:.3e} + {rtol:g}|ref|")
    print(summary)
    assert n_bad == 0, summary
    assert rel <= rel_norm, f"{summary}; ||err||/||ref|| limit {rel_norm:g}"


def run_swap(buf, stream, M: int, N: int, K: int, epilogue: str, ksplit: int | None = None, repeats: int = 1):
    """Launch linear(force="swap") `repeats` times from the same inputs; returns (outputs, reference, label,
    dot_scale, the bytes of the guard rows as they went in). Each output is the [M + GUARD, cols] buffer read
    back."""
    rng = np.random.default_rng(seed_of("gemm_swap", M, N, K, epilogue, ksplit))
    w = _weight(N, K)
    x = rand_bf16(rng, (M, K))
    acc = matmul_ref(x, w)  # [M, N] float64
    dot_scale = math.sqrt(K) * rms(x) * rms(w)  # scale of one dot product: float32 accumulation errors scale with it
    cols = N // 2 if epilogue == "silu_mul" else N
    dtype = F32 if epilogue in ("residual", "f32") else BF16
    old = None
    if epilogue == "silu_mul":
        gate, up = acc[:, :N // 2], acc[:, N // 2:]  # W = [gate; up]
        ref = gate / (1.0 + np.exp(-gate)) * up
    elif epilogue == "residual":
        old = rng.standard_normal((M + GUARD, N), dtype=np.float32) * np.float32(max(dot_scale, 1e-3))
        ref = old[:M].astype(np.float64) + acc
    else:
        ref = acc
    xd, wd = buf.upload(x), buf.upload(w)
    outs = []
    for _ in range(repeats):
        # out += x W^T cannot be poisoned: an unwritten element keeps `old` and fails the comparison.
        out = buf.upload(old) if old is not None else buf.poisoned((M + GUARD, cols), dtype)
        linear(xd, wd, out.rows(0, M), epilogue, stream, force="swap", ksplit=ksplit)
        outs.append(out.to_host(stream))
    guard = old[M:].tobytes() if old is not None else bytes([POISON]) * (GUARD * cols * dtype.itemsize)
    sms = get_device().info.num_sms  # the launch as linear() picks it
    cfg = swap_config(M, N, K, epilogue, ksplit=ksplit, sms=sms)
    label = f"gemm_swap {epilogue} M={M} N={N} K={K} ({cfg.kernel_name}, grid {cfg.grid})"
    return outs, ref, label, dot_scale, guard


def check_swap(buf, stream, M: int, N: int, K: int, epilogue: str, ksplit: int | None = None) -> None:
    (got,), ref, label, dot_scale, guard = run_swap(buf, stream, M, N, K, epilogue, ksplit)
    assert got[M:].tobytes() == guard, f"{label}: the kernel wrote past row M into the guard rows"
    got = got[:M]
    if epilogue in ("bf16", "silu_mul"):
        # bf16 output: rounding <= 2^-8 relative (rtol 1e-2); float32 accumulation error is far below
        # atol = 2e-3 * rms(ref); ||err|| / ||ref|| < 1e-2 (bf16 rounding alone gives ~1.5e-3).
        assert_close(got, ref, atol=2e-3 * max(rms(ref), 1e-6), rtol=1e-2, rel_norm=1e-2, label=label)
    else:
        # float32 output: float32 (tensor-core) accumulation over K, error ~1e-5 of the dot-product scale
        # sqrt(K) * rms(x) * rms(w): atol 3e-4 of it, rtol 1e-5 (the residual add), ||err|| / ||ref|| < 1e-4.
        assert_close(got, ref, atol=3e-4 * dot_scale, rtol=1e-5, rel_norm=1e-4, label=label)


# ============================================================================= cases

# Awkward shapes: N a multiple of 8 but not of 64 (N = 8: one partial tile; 136 and 264: a tile of 8 rows;
# silu_mul halves of 4, 68, 132 outputs), K not a multiple of 64 (1000, 4104, 9736, 72: a chunk of 8) and
# shorter than the splits (K = 8, 64: one chunk, seven idle ranks at ksplit 8); M = 1, 3, 5 and 8 (padded
# to 16: the verify steps' and small batches' row counts).
AWKWARD = [(1, 136, 1000), (3, 264, 72), (5, 136, 1000), (8, 520, 4104), (9, 136, 1000), (16, 520, 4104), (17, 1000, 9736), (33, 2056, 1032), (64, 8, 64),
           (64, 264, 72), (48, 24, 8)]


@pytest.mark.parametrize("ksplit", [None, 1, 2, 8])
@pytest.mark.parametrize("epilogue", EPILOGUES)
@pytest.mark.parametrize("M, N, K", AWKWARD, ids=lambda v: str(v))
def test_swap_awkward(M, N, K, epilogue, ksplit, buf, stream):
    check_swap(buf, stream, M, N, K, epilogue, ksplit=ksplit)


# Qwen3-0.6B and Qwen3-4B layer matrices with their epilogues (hidden 1024 / 2560, intermediate 3072 / 9728, QKV
# 4096 / 6144), at every batch-rows variant (B = 16, 32, 64) with partial and full batches, as swap_config picks;
# M = 5 is a k = 4 verify step.
REAL = [(4096, 1024, "bf16"), (1024, 2048, "residual"), (6144, 1024, "silu_mul"), (1024, 3072, "residual"),
        (6144, 2560, "bf16"), (2560, 4096, "residual"), (19456, 2560, "silu_mul"), (2560, 9728, "residual")]


@pytest.mark.parametrize("M", [3, 5, 9, 16, 17, 33, 64])
@pytest.mark.parametrize("N, K, epilogue", REAL, ids=lambda v: str(v))
def test_swap_qwen3(M, N, K, epilogue, buf, stream):
    check_swap(buf, stream, M, N, K, epilogue)


# Every split on the 0.6B matrices at M = 64 and on 4B's down_proj at M = 33.
@pytest.mark.parametrize("ksplit", SWAP_SPLITS)
@pytest.mark.parametrize("M, N, K, epilogue", [(64, *r) for r in REAL[:4]] + [(33, *REAL[7])], ids=lambda v: str(v))
def test_swap_qwen3_splits(M, N, K, epilogue, ksplit, buf, stream):
    check_swap(buf, stream, M, N, K, epilogue, ksplit=ksplit)


# Qwen3-8B's layer matrices (QKV, o_proj, gate/up, down_proj) in its k = 4 verify step: 5 rows.
REAL_8B = [(6144, 4096, "bf16"), (4096, 4096, "residual"), (24576, 4096, "silu_mul"), (4096, 12288, "residual")]


@pytest.mark.parametrize("N, K, epilogue", REAL_8B, ids=lambda v: str(v))
def test_swap_qwen3_8b_verify(N, K, epilogue, buf, stream):
    check_swap(buf, stream, 5, N, K, epilogue)


@pytest.mark.parametrize("M", [5, 9, 64])
def test_swap_lm_head(M, buf, stream):
    # Qwen3's LM head, N = 151936, float32 logits (the default path at 3-64 rows).
    check_swap(buf, stream, M, 151936, 1024, "f32")


@pytest.mark.parametrize("ksplit", [1, 8])
@pytest.mark.parametrize("epilogue", ["residual", "silu_mul"])
def test_swap_is_deterministic(epilogue, ksplit, buf, stream):
    # Cluster partials meet in rank order: the same inputs give the same bits, run after run.
    N, K = (1024, 3072) if epilogue == "residual" else (6144, 1024)
    outs, _, label, _, _ = run_swap(buf, stream, 64, N, K, epilogue, ksplit=ksplit, repeats=3)
    for i, other in enumerate(outs[1:], 1):
        assert other.tobytes() == outs[0].tobytes(), f"{label}: run {i} differs from run 0"


# ============================================================================= norm statistics (EPI_NORM)
# linear(norm_out=) on the residual epilogue: the residual stream as without it (bitwise), next_x =
# bf16(r * next_w) (bitwise: one float32 product, rounded to nearest even), and each row's sum of r^2 per
# 64-column tile. linear(row_norm=) on x = such a next_x: each row scaled by 1 / sqrt(sum / K + eps).

def norm_weight(rng, n: int) -> np.ndarray:
    """RMSNorm weights around 1, a few channels large (as Qwen3's norms have)."""
    w = rand_bf16(rng, (n,), scale=0.1, mean=1.0)
    w[::97] = BF16.type(8.0)
    return w


def tile_sums(r: np.ndarray) -> np.ndarray:
    """[M, N] float32 -> [M, ceil(N / 64)]: float64 sums of r^2 over each 64-column tile."""
    M, N = r.shape
    r64 = np.zeros((M, -(-N // 64) * 64))
    r64[:, :N] = r.astype(np.float64) ** 2
    return r64.reshape(M, -1, 64).sum(axis=2)


@pytest.mark.parametrize("M, N, K, ksplit", [(5, 4096, 4096, None), (5, 4096, 12288, None), (3, 136, 72, 8),
                                             (17, 520, 1000, 2), (64, 2560, 9728, None), (33, 1024, 3072, 1)],
                         ids=lambda v: str(v))
def test_swap_norm_out(M, N, K, ksplit, buf, stream):
    rng = np.random.default_rng(seed_of("swap norm_out", M, N, K, ksplit))
    w, x, next_w = _weight(N, K), rand_bf16(rng, (M, K)), norm_weight(rng, N)
    old = rng.standard_normal((M + GUARD, N), dtype=np.float32) * np.float32(3.0)
    tiles = -(-N // 64)
    xd, wd = buf.upload(x), buf.upload(w)
    plain = buf.upload(old)
    linear(xd, wd, plain.rows(0, M), "residual", stream, force="swap", ksplit=ksplit)
    resid, next_x, ss = buf.upload(old), buf.poisoned((M + GUARD, N), BF16), buf.poisoned((M + GUARD, tiles), F32)
    linear(xd, wd, resid.rows(0, M), "residual", stream, force="swap", ksplit=ksplit,
           norm_out=(buf.upload(next_w), next_x.rows(0, M), ss.rows(0, M)))
    label = f"gemm_swap residual + norm_out M={M} N={N} K={K} ksplit={ksplit}"
    r = resid.to_host(stream)
    assert r.tobytes() == plain.to_host(stream).tobytes(), f"{label}: the residual stream differs from plain linear"
    nx = next_x.to_host(stream)
    assert nx[M:].tobytes() == bytes([POISON]) * (GUARD * N * 2), f"{label}: next_x written past row M"
    want = (r[:M] * to_f32(next_w)).astype(BF16)
    assert nx[:M].tobytes() == want.tobytes(), f"{label}: next_x is not bf16(resid * next_w)"
    got_ss = ss.to_host(stream)
    assert got_ss[M:].tobytes() == bytes([POISON]) * (GUARD * tiles * 4), f"{label}: ss written past row M"
    # 64 float32 squares summed in a fixed tree: relative error ~1e-7 each, 1e-5 allowed.
    np.testing.assert_allclose(got_ss[:M].astype(np.float64), tile_sums(r[:M]), rtol=1e-5, atol=0, err_msg=label)


@pytest.mark.parametrize("M, N, K, epilogue, ksplit", [
    (5, 6144, 4096, "bf16", None), (5, 24576, 4096, "silu_mul", None), (5, 1024, 4096, "f32", None),
    (3, 136, 1000, "bf16", 8), (9, 4096, 1024, "bf16", 2), (33, 6144, 1024, "silu_mul", None),
    (64, 19456, 2560, "silu_mul", None), (17, 264, 72, "f32", 1)], ids=lambda v: str(v))
def test_swap_row_norm(M, N, K, epilogue, ksplit, buf, stream):
    rng = np.random.default_rng(seed_of("swap row_norm", M, N, K, epilogue, ksplit))
    eps = 1e-6
    w, norm_w = _weight(N, K), norm_weight(rng, K)
    r = rng.standard_normal((M, K), dtype=np.float32) * np.float32(3.0)
    r[:, 7] *= np.float32(40.0)  # one large channel, as Qwen3's residual stream has
    x = (r * to_f32(norm_w)).astype(BF16)  # what norm_out writes
    ss = tile_sums(r).astype(np.float32)  # what norm_out writes (up to its summation order)
    inv = 1.0 / np.sqrt(ss.astype(np.float64).sum(axis=1, keepdims=True) / K + eps)  # [M, 1]
    cols = N // 2 if epilogue == "silu_mul" else N
    dtype = F32 if epilogue == "f32" else BF16
    out = buf.poisoned((M + GUARD, cols), dtype)
    linear(buf.upload(x), buf.upload(w), out.rows(0, M), epilogue, stream, force="swap", ksplit=ksplit,
           row_norm=(buf.upload(ss), eps))
    got = out.to_host(stream)
    label = f"gemm_swap {epilogue} + row_norm M={M} N={N} K={K} ksplit={ksplit}"
    assert got[M:].tobytes() == bytes([POISON]) * (GUARD * cols * dtype.itemsize), f"{label}: wrote past row M"

    def finish(acc):
        if epilogue == "silu_mul":
            gate, up = acc[:, :N // 2], acc[:, N // 2:]
            return gate / (1.0 + np.exp(-gate)) * up
        return acc

    # The kernel's arithmetic: the product of the bf16 x it was given, scaled by each row's 1 / rms.
    ref = finish(matmul_ref(x, w) * inv)
    dot_scale = math.sqrt(K) * rms(x) * rms(w) * float(inv.max())
    if epilogue == "f32":
        assert_close(got[:M], ref, atol=3e-4 * dot_scale, rtol=1e-5, rel_norm=1e-4, label=label)
    else:
        assert_close(got[:M], ref, atol=2e-3 * max(rms(ref), 1e-6), rtol=1e-2, rel_norm=1e-2, label=label)
    # Against the norm as the rmsnorm kernel defines it (x rounded after the 1 / rms, not before): the
    # difference is bf16 rounding of x, ||err|| / ||ref|| ~ 2e-3.
    exact = finish(matmul_ref((r.astype(np.float64) * inv * to_f64(norm_w)), w))
    err = np.linalg.norm(to_f64(got[:M]) - exact) / np.linalg.norm(exact)
    print(f"{label}: against rmsnorm(r) W^T, ||err|| / ||ref|| {err:.2e}")
    assert err <= 1e-2, f"{label}: {err:.2e} from rmsnorm(r) W^T"
