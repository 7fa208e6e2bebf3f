"""The small-M tensor-core GEMM (cuda_src/gemm_small.cu, linear(force="small")) against float64 numpy.

Self-contained; conventions as in test_kernels.py (STYLE.md habit 12):
  * Inputs are fresh random data from np.random.default_rng(<seed fixed per case via zlib.crc32>), rounded to
    bf16; the reference is computed in float64 from those same bf16 values. Weights are drawn once per shape.
  * Outputs are poisoned first (0xFF bytes: NaN in bf16 and float32) and must hold no NaN afterwards. Each
    output has GUARD extra rows past M that the kernel is not given (it gets a view of the first M rows):
    they must come back byte for byte as they went in (poison, or the old residual stream).
  * Tolerances are stated at the assertion; a line reports max |err|, the worst element and ||err|| / ||ref||.
The GPU tests are marked `gpu`. The tests of the launch configuration and of the entry points need no GPU
(NVRTC only), but conftest skips everything under tests/gpu/ on a machine without one.
"""
from __future__ import annotations

import math
import re

import ml_dtypes
import numpy as np
import pytest

from tileinfer.cuda import get_device
from tileinfer.cuda.compiler import compile_file, cuda_src_dir
from tileinfer.kernels import linear
from tileinfer.kernels.linear import (SMALL_BK, SMALL_BN, SMALL_GEMM_SMEM, SMALL_ROWS, SMALL_SPLITS, SMALL_WARPS,
                                      small_gemm_config, swap_config)

from gpu_helpers import POISON, linear_weight, matmul_ref, rand_bf16, rms, seed_of, to_f64  # noqa: E402

gpu = pytest.mark.gpu

BF16 = np.dtype(ml_dtypes.bfloat16)
F32 = np.dtype(np.float32)
GUARD = 3       # rows past M in every output buffer, outside the view the kernel gets
EPILOGUES = ("bf16", "residual", "silu_mul", "f32")

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


def run_small(buf, stream, M: int, N: int, K: int, epilogue: str, ksplit: int | None = None,
              w: np.ndarray | None = None, repeats: int = 1, path: str = "small"):
    """Launch linear(force=path) `repeats` times from the same inputs; returns (outputs, reference, label,
    dot_scale, the bytes of the guard rows as they went in). Each output is the [M + GUARD, cols] buffer read
    back. `path`: "small" (gemm_small.cu) or "swap" (gemm_swap.cu, tests/gpu/test_gemm_swap.py)."""
    rng = np.random.default_rng(seed_of(f"gemm_{path}", M, N, K, epilogue, ksplit))
    w = linear_weight(N, K) if w is None else w
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
        linear(xd, wd, out.rows(0, M), epilogue, stream, force=path, ksplit=ksplit)
        outs.append(out.to_host(stream))
    guard = old[M:].tobytes() if old is not None else bytes([POISON]) * (GUARD * cols * dtype.itemsize)
    sms = get_device().info.num_sms  # the launch as linear() picks it
    cfg = (small_gemm_config(M, N, K, ksplit=ksplit, sms=sms) if path == "small"
           else swap_config(M, N, K, epilogue, ksplit=ksplit, sms=sms))
    label = f"gemm_{path} {epilogue} M={M} N={N} K={K} ({cfg.kernel_name}, grid {cfg.grid})"
    return outs, ref, label, dot_scale, guard


def check_small(buf, stream, M: int, N: int, K: int, epilogue: str, ksplit: int | None = None,
                w: np.ndarray | None = None, path: str = "small") -> None:
    (got,), ref, label, dot_scale, guard = run_small(buf, stream, M, N, K, epilogue, ksplit, w, path=path)
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


# ============================================================================= GPU: shapes and epilogues

M_VALUES = (1, 9, 16, 17, 33, 48, 64, 65, 100, 128, 200, 256)
# Qwen3 shapes (N x K) and awkward ones: N = 136 leaves a column block with 8 of 64 rows, K = 72 one
# full k-chunk and one of 8 columns.
SHAPES = [
    (1024, 3072, "residual"),   # 0.6B down_proj: 16 column blocks, split across clusters
    (1024, 3072, "bf16"),
    (1024, 2048, "f32"),        # 0.6B o_proj shape, float32 out
    (4096, 1024, "bf16"),       # 0.6B qkv
    (6144, 1024, "silu_mul"),   # 0.6B [gate; up]
    (2560, 9728, "residual"),   # 4B down_proj
    *[(136, 72, e) for e in EPILOGUES],
]
SHAPE_CASES = [pytest.param(M, N, K, e, id=f"M{M}-N{N}-K{K}-{e}") for N, K, e in SHAPES for M in M_VALUES]
TINY_CASES = [pytest.param(M, 8, 8, e, id=f"M{M}-N8-K8-{e}") for e in EPILOGUES for M in (1, 17, 65)]


@gpu
@pytest.mark.parametrize("M, N, K, epilogue", SHAPE_CASES + TINY_CASES)
def test_gemm_small(M, N, K, epilogue, buf, stream):
    check_small(buf, stream, M, N, K, epilogue)


@gpu
@pytest.mark.parametrize("M", [9, 64, 100])
def test_gemm_small_lm_head(M, buf, stream):
    # The LM head: N = 151936 (Qwen3's vocabulary, 2374 column blocks), float32 logits.
    check_small(buf, stream, M, 151936, 1024, "f32")


# Every cluster split, on shapes where some warps get no k-chunk at all (K = 72 and 352 with 8 * 4 warps)
# and on partial M tiles / column blocks.
KSPLIT_SHAPES = [(9, 1000, 2560, "residual"), (33, 136, 4104, "silu_mul"), (64, 24, 9728, "bf16"),
                 (100, 1024, 352, "f32"), (17, 264, 72, "residual"), (256, 1024, 3072, "silu_mul")]


@gpu
@pytest.mark.parametrize("ksplit", SMALL_SPLITS)
@pytest.mark.parametrize("M, N, K, epilogue", KSPLIT_SHAPES)
def test_gemm_small_ksplit(M, N, K, epilogue, ksplit, buf, stream):
    check_small(buf, stream, M, N, K, epilogue, ksplit=ksplit)


@gpu
@pytest.mark.parametrize("ksplit", [1, 8])
def test_gemm_small_is_deterministic(ksplit, buf, stream):
    # Partial sums meet in a fixed order (warps, then cluster ranks): the same inputs give the same bits.
    outs, *_ = run_small(buf, stream, 65, 1024, 3072, "residual", ksplit=ksplit, repeats=3)
    for i, other in enumerate(outs[1:], 1):
        assert other.tobytes() == outs[0].tobytes(), f"run {i} of residual ksplit={ksplit} differs from run 0"


# ============================================================================= everywhere: launch configuration

QWEN3_SHAPES = [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072), (151936, 1024),    # 0.6B
                (6144, 2560), (2560, 4096), (19456, 2560), (2560, 9728),                   # 4B
                (6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288)]                  # 8B


@pytest.mark.parametrize("N, K", QWEN3_SHAPES, ids=lambda v: str(v))
def test_small_gemm_config_covers_the_problem(N, K):
    for M in (0, 1, 9, 16, 17, 32, 33, 64, 65, 128, 200, 256, 1000):
        cfg = small_gemm_config(M, N, K)
        ks, m_tiles, n_blocks = cfg.grid
        where = f"M={M} N={N} K={K}: {cfg}"
        assert cfg.ksplit == ks and ks in SMALL_SPLITS, where
        assert cfg.rows == (16 if M <= 16 else 32), where
        assert m_tiles == -(-M // cfg.rows) and n_blocks == -(-N // SMALL_BN), where
        assert cfg.smem == SMALL_GEMM_SMEM[cfg.rows] <= 227 * 1024, where
        assert cfg.kernel_name == f"gemm_small_m{cfg.rows}_c{ks}", where
        if ks > 1:  # a split is only worth it while every warp of the cluster still has a k-chunk
            assert ks * SMALL_WARPS <= -(-K // SMALL_BK), where


def test_small_gemm_config_spreads_small_n_over_the_gpu():
    # o_proj / down_proj of Qwen3-0.6B: 16 column blocks must become >= 64 blocks via the cluster split.
    for M in (16, 32, 64):
        for K in (2048, 3072):
            cfg = small_gemm_config(M, 1024, K)
            assert math.prod(cfg.grid) >= 64, cfg
    # the LM head already has 2374 column blocks: no split
    assert small_gemm_config(16, 151936, 1024).ksplit == 1
    assert small_gemm_config(64, 1024, 2048, ksplit=2).grid == (2, 2, 16)  # 32-row tiles


@pytest.mark.parametrize("args, kwargs", [((16, 1024, 1024), {"ksplit": 3}), ((16, 1024, 1024), {"ksplit": 16}),
                                          ((-1, 1024, 1024), {}), ((16, 0, 1024), {}),
                                          ((16, 64 * 65536, 1024), {})])
def test_small_gemm_config_rejects(args, kwargs):
    with pytest.raises(ValueError):
        small_gemm_config(*args, **kwargs)


def test_launcher_constants_match_the_kernel_source():
    source = (cuda_src_dir() / "gemm_small.cu").read_text()
    for name, value in (("BN", SMALL_BN), ("BK", SMALL_BK), ("WARPS", SMALL_WARPS)):
        found = re.search(rf"^#define {name} (\d+)", source, re.MULTILINE)
        assert found and int(found.group(1)) == value, f"#define {name} in gemm_small.cu != launcher's {value}"
    stages = re.search(r"STAGES = MT == 4 \? (\d+) : (\d+);", source)
    assert stages, "gemm_small.cu: the STAGES expression changed; update SMALL_STAGES and this test"
    for rows in SMALL_ROWS:
        n = int(stages.group(1)) if rows == 64 else int(stages.group(2))
        assert SMALL_GEMM_SMEM[rows] == SMALL_WARPS * n * (rows + SMALL_BN) * SMALL_BK * 2, rows


def test_every_config_names_an_entry_point():
    cubin = compile_file("gemm_small.cu", "sm_90a")  # NVRTC only: no GPU needed
    names = {small_gemm_config(33, 1024, 1024, ksplit=ks, rows=r).kernel_name
             for r in SMALL_ROWS for ks in SMALL_SPLITS}
    assert len(names) == len(SMALL_ROWS) * len(SMALL_SPLITS)
    missing = sorted(n for n in names if n.encode() + b"\0" not in cubin)
    assert not missing, f"gemm_small.cu lacks entry points {missing}"
