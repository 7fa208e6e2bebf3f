"""Every kernel family against a float64/float32 numpy reference, at awkward sizes.

Conventions (STYLE.md habit 12, METHOD.md "Correct first"):
  * Inputs are fresh random data from np.random.default_rng(<seed fixed per test case>), rounded to
    bf16 where the kernel reads bf16; references are computed from those same rounded values.
    (Linear weights are drawn once per shape and shared by that shape's cases; x is fresh per case.)
  * Every output is poisoned first (0xFF bytes: NaN for bf16/f32, -1 for int32) and must hold no
    NaN afterwards wherever the kernel writes all of it.
  * Tolerances are stated next to each assertion. On failure (and with -s always) a line reports
    the shape, max |err|, the worst element and its values, and ||err|| / ||ref||.
"""
from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
from cuda.bindings import driver

from tileinfer.cuda import DeviceArray, PinnedBuffer, get_device, kernel
from tileinfer.runner import sampler
from tileinfer.kernels import (FusedInput, argmax, attention, attn_input, attn_input_int8, embedding, fetch_step,
                               fuses_input, linear, norm_linear, rmsnorm, sample)
from tileinfer.kernels import routing
from tileinfer.kernels.routing import head_key_count
from tileinfer.kv import BlockManager, Sequence
from tileinfer.kv.int8 import attention_int8, dequantize, quantize, smoothing_factors
from tileinfer.model import reference

from gpu_helpers import POISON, Buffers, attn_input_tensors, linear_weight, matmul_ref, rand_bf16, rms, seed_of, to_f32, to_f64  # noqa: E402

pytestmark = pytest.mark.gpu

BF16 = np.dtype(ml_dtypes.bfloat16)
F32 = np.dtype(np.float32)
I32 = np.dtype(np.int32)
HD = 128            # head_dim of every Qwen3 model (the attention kernels' HD)
BF16_POISON = 0xFFFF


# ============================================================================= helpers


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def assert_close(got, ref, *, atol, rtol: float, label: str, rel_norm: float | None = None) -> float:
    """|got - ref| <= atol + rtol * |ref| everywhere (atol may be an array broadcasting against ref),
    nothing non-finite in got, and ||got - ref|| / ||ref|| <= rel_norm when given. Returns that norm ratio."""
    got64, ref64 = to_f64(got), to_f64(ref)
    assert got64.shape == ref64.shape, f"{label}: shape {got64.shape} != reference shape {ref64.shape}"
    assert np.isfinite(ref64).all(), f"{label}: the reference itself is not finite (test bug)"
    bad = ~np.isfinite(got64)
    if bad.any():
        where = np.argwhere(bad)
        raise AssertionError(
            f"{label}: {int(bad.sum())} of {bad.size} elements are NaN/inf (poisoned output never written?); "
            f"shape {got64.shape}, first at {tuple(int(i) for i in where[0])}, "
            f"last at {tuple(int(i) for i in where[-1])}")
    err = np.abs(got64 - ref64)
    bound = np.broadcast_to(atol + rtol * np.abs(ref64), ref64.shape)
    ratio = err / bound
    worst = tuple(int(i) for i in np.unravel_index(int(np.argmax(ratio)), ratio.shape))
    worst_abs = tuple(int(i) for i in np.unravel_index(int(np.argmax(err)), err.shape))
    rel = float(np.linalg.norm(err) / max(float(np.linalg.norm(ref64)), 1e-300))
    n_bad = int((err > bound).sum())
    summary = (f"{label}: shape {got64.shape}; max|err| {err.max():.3e} at {worst_abs} "
               f"(got {got64[worst_abs]:.6g}, ref {ref64[worst_abs]:.6g}); worst err/allowed {ratio.max():.3f} at "
               f"{worst} (got {got64[worst]:.6g}, ref {ref64[worst]:.6g}, allowed {bound[worst]:.3e}); "
               f"||err||/||ref|| {rel:.2e}; "
               f"{n_bad} of {err.size} outside atol + {rtol:g}|ref|")
    print(summary)
    assert n_bad == 0, summary
    if rel_norm is not None:
        assert rel <= rel_norm, f"{summary}; ||err||/||ref|| limit {rel_norm:g}"
    return rel


def assert_exact(got, ref, label: str) -> None:
    """Bit-exact equality (bf16 compared as bit patterns; NaN in got never matches)."""
    got, ref = np.asarray(got), np.asarray(ref)
    assert got.shape == ref.shape, f"{label}: shape {got.shape} != reference shape {ref.shape}"
    if got.dtype == BF16:
        got, ref = got.view(np.uint16), np.asarray(ref, BF16).view(np.uint16)
    diff = got != ref
    if diff.any():
        where = np.argwhere(diff)
        first = tuple(int(i) for i in where[0])
        raise AssertionError(f"{label}: {int(diff.sum())} of {diff.size} elements differ; shape {got.shape}; "
                             f"first at {first}: got {got[first]!r}, expected {ref[first]!r}; "
                             f"last at {tuple(int(i) for i in where[-1])}")


def kv_lens_positive(v) -> bool:
    """Whether a sequence's cached keys or values (an array, or INT8 (codes, scales)) hold any position."""
    return (v[0] if isinstance(v, tuple) else v).size > 0


def shuffled_manager(num_pages: int, page_size: int, rng: np.random.Generator) -> BlockManager:
    """A BlockManager that hands its pages out in a random order (public API only: take every page
    with a one-position sequence, then release them in a random order onto the free stack)."""
    bm = BlockManager(num_pages, page_size)
    holders = [Sequence() for _ in range(num_pages)]
    for holder in holders:
        bm.reserve(holder, 1)
    for i in rng.permutation(num_pages):
        bm.release(holders[i])
    assert bm.num_free_pages == num_pages
    return bm


def chi2_sf(x: float, dof: int) -> float:
    """P(chi-square with `dof` degrees of freedom > x), closed forms for integer dof (no scipy)."""
    if dof % 2 == 0:
        term, total = 1.0, 1.0
        for i in range(1, dof // 2):
            term *= (x / 2) / i
            total += term
        return math.exp(-x / 2) * total
    total, term = 0.0, 0.0
    for j in range(1, (dof - 1) // 2 + 1):
        term = 1.0 if j == 1 else term * x / (2 * j - 1)
        total += term
    return math.erfc(math.sqrt(x / 2)) + math.sqrt(2 * x / math.pi) * math.exp(-x / 2) * total


# ============================================================================= embedding


@pytest.mark.parametrize("embed", [False, True], ids=["copy", "embed"])
@pytest.mark.parametrize("ntok, at", [(1, (0, 16)), (7, (32, 64)), (130, (1040, 2080))],
                         ids=["tok1", "tok7", "tok130"])
def test_fetch_step_copies_the_mapped_mirror(ntok, at, embed, buf, stream):
    # fetch_step: a decode step's first kernel reads the step buffers' mapped host mirror into the device
    # buffers (every byte, nothing past the end: the guard bytes after dst stay poisoned), and replaces
    # the token ids whose token_src entry is >= 0 with the sampled id that entry names. With embed, the
    # same launch writes the embeddings of the first rows resolved ids (some past the vocabulary: zeros).
    rng = np.random.default_rng(seed_of("fetch_step", ntok, embed))
    tok_at, src_at = at
    nbytes = src_at + 16 * -(-ntok // 4) + 16 * int(rng.integers(1, 40))
    host = PinnedBuffer(nbytes, mapped=True)
    try:
        data = rng.integers(0, 256, nbytes, dtype=np.uint8)
        host.bytes[:] = data
        tokens = host.array((ntok,), np.int32, tok_at)
        src = host.array((ntok,), np.int32, src_at)
        tokens[:] = rng.integers(0, 1000, ntok)
        src[:] = np.where(rng.random(ntok) < 0.5, rng.integers(0, 9, ntok), -1)
        sampled = rng.integers(5000, 6000, 9).astype(np.int32)
        want = host.bytes.copy()
        want_tokens = want[tok_at: tok_at + 4 * ntok].view(np.int32)
        want_tokens[:] = np.where(src >= 0, sampled[np.maximum(src, 0)], tokens)
        out = buf.poisoned((nbytes + 16,), np.uint8)
        dst = out.rows(0, nbytes)
        dst_tokens = DeviceArray((ntok,), np.int32, ptr=dst.ptr + tok_at)
        dst_src = DeviceArray((ntok,), np.int32, ptr=dst.ptr + src_at)
        rows, vocab, dim = max(1, ntok - 1), 5500, 2568
        table = rand_bf16(rng, (vocab, dim))
        emb = buf.poisoned((rows + 1, dim), np.float32)
        fetch_step(host.device_array((nbytes,), np.uint8), dst, dst_tokens, dst_src, buf.upload(sampled), stream,
                   embed=(buf.upload(table), emb.rows(0, rows)) if embed else None)
        got = out.to_host(stream)
        np.testing.assert_array_equal(got[:nbytes], want)
        assert (got[nbytes:] == POISON).all(), got[nbytes:]
        got_emb = emb.to_host(stream)
        if embed:
            ids = want_tokens[:rows]
            valid = (ids >= 0) & (ids < vocab)
            if rows >= 100:
                assert not valid.all(), "test setup: some resolved ids should fall past the vocabulary"
            want_emb = np.zeros((rows, dim), np.float32)
            want_emb[valid] = to_f32(table)[ids[valid]]
            np.testing.assert_array_equal(got_emb[:rows], want_emb)  # exact: bf16 -> f32 widening
        assert (got_emb[rows if embed else 0:].view(np.uint8) == POISON).all()  # nothing past the rows
        with pytest.raises(ValueError, match="multiples of 16"):
            fetch_step(host.device_array((8,), np.uint8), out.rows(0, 8), dst_tokens, dst_src, buf.upload(sampled),
                       stream)
        with pytest.raises(ValueError, match="aligned field of dst"):
            fetch_step(host.device_array((nbytes,), np.uint8), dst, DeviceArray((ntok,), np.int32, ptr=dst.ptr + 4),
                       dst_src, buf.upload(sampled), stream)
        with pytest.raises(ValueError, match="embedding rows"):
            fetch_step(host.device_array((nbytes,), np.uint8), dst, dst_tokens, dst_src, buf.upload(sampled), stream,
                       embed=(buf.upload(table), buf.poisoned((ntok + 1, dim), np.float32)))
    finally:
        host.free()


@pytest.mark.parametrize("dim", [8, 1024, 2568], ids=lambda d: f"dim{d}")
@pytest.mark.parametrize("n", [1, 7, 65], ids=lambda n: f"n{n}")
def test_embedding(n, dim, buf, stream):
    vocab = 1000
    rng = np.random.default_rng(seed_of("embedding", n, dim))
    table = rand_bf16(rng, (vocab, dim))
    tokens = rng.integers(0, vocab, n).astype(np.int32)
    if n > 1:
        tokens[0], tokens[-1] = -1, vocab  # padding ids outside the vocabulary: zero rows
    if n > 2:
        tokens[1] = vocab - 1              # the last valid row
    valid = (tokens >= 0) & (tokens < vocab)
    ref = np.zeros((n, dim), np.float32)
    ref[valid] = to_f32(table)[tokens[valid]]

    out = buf.poisoned((n, dim), F32)
    embedding(buf.upload(tokens), buf.upload(table), out, stream)
    got = out.to_host(stream)
    # Exact: a bf16 -> f32 widening is exact; invalid ids give +0 rows.
    assert_exact(got, ref, f"embedding n={n} dim={dim} tokens={tokens[:4].tolist()}...")


# ============================================================================= rmsnorm


@pytest.mark.parametrize("gather", [False, True], ids=["all-rows", "gather-rows"])
@pytest.mark.parametrize("dim", [128, 1024, 2560, 4096, 5128], ids=lambda d: f"dim{d}")
@pytest.mark.parametrize("n", [1, 7, 63, 65, 1000], ids=lambda n: f"n{n}")
def test_rmsnorm(n, dim, gather, buf, stream):
    eps = 1e-6
    rng = np.random.default_rng(seed_of("rmsnorm", n, dim, gather))
    row_scale = np.exp(rng.uniform(-3, 3, (n, 1)))  # rows of very different magnitude
    x = (rng.standard_normal((n, dim)) * row_scale).astype(np.float32)
    w = rand_bf16(rng, (dim,), scale=0.5, mean=1.0)
    rows = None
    if gather:  # the final norm picks each sequence's last token: any rows, in any order, repeats allowed
        rows = np.concatenate([[n - 1, 0, min(3, n - 1)], rng.integers(0, n, 5)]).astype(np.int32)
    src = to_f64(x if rows is None else x[rows])
    ref = src / np.sqrt(np.mean(src * src, axis=1, keepdims=True) + eps) * to_f64(w)

    out = buf.poisoned(ref.shape, BF16)
    rmsnorm(buf.upload(x), buf.upload(w), out, eps, stream, rows=None if rows is None else buf.upload(rows))
    got = out.to_host(stream)
    # bf16 output: rounding <= 2^-8 relative (rtol 1e-2); atol 1e-2 * rms(ref) for entries near zero.
    assert_close(got, ref, atol=1e-2 * rms(ref), rtol=1e-2, rel_norm=1e-2,
                 label=f"rmsnorm n={n} dim={dim} rows={None if rows is None else rows.tolist()}")


def test_rmsnorm_runs_in_the_shared_memory_configuration(buf, stream):
    # Its launches ask for the SM configuration with the most shared memory, the GEMMs' around it.
    x, w = np.ones((2, 128), np.float32), np.ones(128, ml_dtypes.bfloat16)
    rmsnorm(buf.upload(x), buf.upload(w), buf.poisoned((2, 128), BF16), 1e-6, stream)
    attr = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT
    most_shared = int(driver.CUshared_carveout.CU_SHAREDMEM_CARVEOUT_MAX_SHARED)
    assert kernel("rmsnorm.cu", "rmsnorm").attribute(attr) == most_shared


# ============================================================================= linear (GEMM / GEMV)

EPILOGUES = ("bf16", "residual", "silu_mul", "f32")
GEMM_SHAPES = [(1, 128, 64), (7, 136, 128), (63, 264, 352), (65, 1024, 1024), (130, 2560, 2568),
               (1000, 512, 4096), (257, 6144, 2560), (33, 8, 8), (77, 520, 4104), (4096, 6144, 2560)]
GEMV_NK = [(8, 64), (136, 352), (1024, 2560), (6144, 4096), (2560, 9728)]
LM_HEAD_N, LM_HEAD_K = 151936, 1024

# Cases grouped by weight shape (so the per-shape weight cache below stays small).
GEMM_CASES = [pytest.param(M, N, K, e, id=f"M{M}-N{N}-K{K}-{e}") for M, N, K in GEMM_SHAPES for e in EPILOGUES]
GEMV_CASES = [pytest.param(M, N, K, e, id=f"M{M}-N{N}-K{K}-{e}")
              for N, K in GEMV_NK for M in (1, 2) for e in EPILOGUES]

def check_linear(buf, stream, M: int, N: int, K: int, epilogue: str, path: str, w: np.ndarray | None = None,
                 ksplit: int | None = None, pipe: bool | None = None, launch=None, label: str = "") -> np.ndarray:
    """linear(force=path) on random inputs against the float64 reference; `launch(x, w, out)` (device
    arrays) replaces the linear call (a kernel's own launcher: tests/gpu/test_gemm.py)."""
    rng = np.random.default_rng(seed_of("linear", path, M, N, K, epilogue))
    w = linear_weight(N, K) if w is None else w
    x = rand_bf16(rng, (M, K))
    acc = matmul_ref(x, w)  # [M, N] float64
    # Scale of one dot product of K terms: errors of float32 accumulation are relative to it.
    dot_scale = math.sqrt(K) * rms(x) * rms(w)
    if epilogue == "silu_mul":
        gate, up = acc[:, :N // 2], acc[:, N // 2:]  # W = [gate; up]
        ref = gate / (1.0 + np.exp(-gate)) * up
        out = buf.poisoned((M, N // 2), BF16)
    elif epilogue == "residual":
        old = (rng.standard_normal((M, N), dtype=np.float32) * np.float32(dot_scale))
        ref = old.astype(np.float64) + acc
        out = buf.upload(old)  # out += x @ W.T: no poison possible; an unwritten element keeps `old` and fails
    else:
        ref = acc
        out = buf.poisoned((M, N), BF16 if epilogue == "bf16" else F32)

    if launch is None:
        linear(buf.upload(x), buf.upload(w), out, epilogue, stream, force=path, ksplit=ksplit, pipe=pipe)
    else:
        launch(buf.upload(x), buf.upload(w), out)
    got = out.to_host(stream)
    label = label or f"linear {path} {epilogue} M={M} N={N} K={K} ksplit={ksplit} pipe={pipe}"
    if epilogue in ("bf16", "silu_mul"):
        # bf16 output: rounding <= 2^-8 relative (rtol 1e-2); float32 accumulation error is far below
        # atol = 2e-3 * rms(ref); ||err|| / ||ref|| < 1e-2 (bf16 rounding gives ~1.5e-3).
        assert_close(got, ref, atol=2e-3 * rms(ref), rtol=1e-2, rel_norm=1e-2, label=label)
    else:
        # float32 output: float32 (tensor-core) accumulation over K, error ~1e-5 of the dot-product
        # scale sqrt(K)*rms(x)*rms(w): atol 3e-4 of it, rtol 1e-5 (the residual add), ||err||/||ref|| < 1e-4.
        assert_close(got, ref, atol=3e-4 * dot_scale, rtol=1e-5, rel_norm=1e-4, label=label)
    return got


@pytest.mark.parametrize("M, N, K, epilogue", GEMM_CASES)
def test_linear_gemm(M, N, K, epilogue, buf, stream):
    check_linear(buf, stream, M, N, K, epilogue, "gemm")


@pytest.mark.parametrize("M, N, K, epilogue", GEMV_CASES)
def test_linear_gemv(M, N, K, epilogue, buf, stream):
    check_linear(buf, stream, M, N, K, epilogue, "gemv")


# Every split of the rows' K range across warps, on row counts that leave partial blocks.
@pytest.mark.parametrize("ksplit", [1, 2, 4, 8])
@pytest.mark.parametrize("M, N, K, epilogue", [(1, 1000, 2560, "residual"), (2, 136, 4104, "silu_mul"),
                                               (1, 24, 9728, "bf16"), (2, 1024, 352, "f32")])
def test_linear_gemv_ksplit(M, N, K, epilogue, ksplit, buf, stream):
    check_linear(buf, stream, M, N, K, epilogue, "gemv", ksplit=ksplit)


# SiLU(gate) * up at gates far past exp's range (common.cuh, silu_mul: the approximate 2^x and reciprocal):
# gate rows scaled so that the gates spread to |g| ~ 400, where 2^(-g log2 e) is 0 or inf (check_linear also
# rejects a non-finite output). Every path: the GEMV, the swap-AB GEMM (3-64 rows), the TMA GEMM (65 rows on).
@pytest.mark.parametrize("M, path", [(1, "gemv"), (2, "gemv"), (7, "swap"), (48, "swap"), (200, "gemm"),
                                     (1100, "gemm")])
def test_silu_mul_at_extreme_gates(M, path, buf, stream):
    N, K = 2 * 264, 1000
    w = np.array(linear_weight(N, K), copy=True)
    w[:N // 2] = (w[:N // 2].astype(np.float32) * 100).astype(BF16)  # gates ~ N(0, 100)
    check_linear(buf, stream, M, N, K, "silu_mul", path, w=w)


# The batch-1 GEMV's pipelined loop (gemv_pipe_m1_*: residual and f32 epilogues) at every split, on rows
# whose length is not a multiple of a warp's 256-element segment or of its two-batch stride, and rows
# shorter than one batch: against the float64 reference, and bitwise equal to the one-batch loop (the
# same k order of the sums).
@pytest.mark.parametrize("ksplit", [1, 2, 4, 8])
@pytest.mark.parametrize("N, K, epilogue", [(1000, 2568, "residual"), (136, 9736, "f32"), (24, 200, "residual"),
                                            (2056, 4096, "f32")])
def test_linear_gemv_pipelined(N, K, epilogue, ksplit, buf, stream):
    w = linear_weight(N, K)
    piped = check_linear(buf, stream, 1, N, K, epilogue, "gemv", w=w, ksplit=ksplit, pipe=True)
    plain = check_linear(buf, stream, 1, N, K, epilogue, "gemv", w=w, ksplit=ksplit, pipe=False)
    np.testing.assert_array_equal(piped, plain)


def test_linear_pipelined_gemv_is_batch_one_without_a_norm(buf, stream):
    x, w = buf.upload(np.zeros((2, 256), np.float32).astype(BF16)), buf.upload(linear_weight(16, 256))
    with pytest.raises(ValueError, match="pipelined GEMV takes M = 1"):
        linear(x, w, buf.poisoned((2, 16), BF16), "bf16", stream, force="gemv", pipe=True)


# The GEMV that normalizes its own input (gemv_norm_*) against the rmsnorm kernel then the GEMV:
# bitwise equal (same helpers, same block size), and x is not written.
# (1, 4096, 1024) and (1, 136, 1000) take the 64-register QKV build (gemv_norm_m1_e0_b4).
@pytest.mark.parametrize("M, N, K, epilogue", [(1, 6144, 2560, "bf16"), (2, 4096, 1024, "bf16"), (1, 136, 4104, "bf16"),
                                               (1, 4096, 1024, "bf16"), (1, 136, 1000, "bf16"),
                                               (1, 19456, 2560, "silu_mul"), (2, 2048, 1000, "silu_mul"),
                                               (2, 24, 4096, "silu_mul")])
def test_norm_linear_fused_equals_rmsnorm_then_gemv(M, N, K, epilogue, buf, stream):
    rng = np.random.default_rng(seed_of("norm_linear", M, N, K, epilogue))
    resid = (rng.standard_normal((M, K)) * np.exp(rng.uniform(-3, 3, (M, 1)))).astype(np.float32)
    norm_w = rand_bf16(rng, (K,), scale=0.5, mean=1.0)
    w = linear_weight(N, K)
    out_shape = (M, N // 2) if epilogue == "silu_mul" else (M, N)
    d_resid, d_norm, d_w = buf.upload(resid), buf.upload(norm_w), buf.upload(w)
    x_fused, out_fused = buf.poisoned((M, K), BF16), buf.poisoned(out_shape, BF16)
    norm_linear(d_resid, d_norm, 1e-6, x_fused, d_w, out_fused, epilogue, stream)
    x_plain, out_plain = buf.poisoned((M, K), BF16), buf.poisoned(out_shape, BF16)
    rmsnorm(d_resid, d_norm, x_plain, 1e-6, stream)
    linear(x_plain, d_w, out_plain, epilogue, stream, force="gemv")
    poison = buf.poisoned((M, K), BF16).to_host(stream)
    np.testing.assert_array_equal(x_fused.to_host(stream).view(np.uint16), poison.view(np.uint16))
    np.testing.assert_array_equal(out_fused.to_host(stream).view(np.uint16), out_plain.to_host(stream).view(np.uint16))


@pytest.mark.parametrize("path, M", [("gemv", 1), ("gemm", 64)], ids=["gemv-M1", "gemm-M64"])
def test_linear_lm_head(path, M, buf, stream):
    # The LM head: N = 151936 (Qwen3's vocabulary), float32 logits.
    check_linear(buf, stream, M, LM_HEAD_N, LM_HEAD_K, "f32", path, w=linear_weight(LM_HEAD_N, LM_HEAD_K))


# ============================================================================= attn_input

ATTN_INPUT_CASES = [
    pytest.param(1, 16, 8, 64, 5000, id="n1-H16-KV8-page64"),
    pytest.param(7, 16, 8, 64, 5000, id="n7-H16-KV8-page64"),
    pytest.param(65, 16, 8, 64, 5000, id="n65-H16-KV8-page64"),
    pytest.param(65, 16, 8, 16, 5000, id="n65-H16-KV8-page16"),
    pytest.param(7, 4, 2, 16, 5000, id="n7-H4-KV2-page16"),
    pytest.param(65, 4, 2, 64, 40000, id="n65-H4-KV2-page64-pos40000"),
    pytest.param(65, 16, 8, 16, 40000, id="n65-H16-KV8-page16-pos40000"),
]


@pytest.mark.parametrize("n, H, KV, page_size, max_pos", ATTN_INPUT_CASES)
def test_attn_input(n, H, KV, page_size, max_pos, buf, stream):
    eps = 1e-6
    rng = np.random.default_rng(seed_of("attn_input", n, H, KV, page_size, max_pos))
    qkv, q_norm, k_norm = attn_input_tensors(rng, n, H, KV, HD)
    positions = rng.choice(max_pos, n, replace=False).astype(np.int32)
    inv_freq = reference.rope_inv_freq(HD, 1e6)

    # The tokens' slots: one sequence of max_pos positions in shuffled pages, after a dummy's pages.
    num_pages = cdiv(max_pos, page_size) + 5
    bm = shuffled_manager(num_pages, page_size, rng)
    dummy, seq = Sequence(), Sequence()
    bm.reserve(dummy, 3 * page_size)
    bm.reserve(seq, max_pos)
    slots = np.array([bm.slots(seq, int(p), 1)[0] for p in positions], np.int32)
    pad = n // 2 if n > 1 else None
    if pad is not None:
        slots[pad] = -1  # a padding token: its K/V must not be stored, its queries are still written

    # Pools [pages, KV, page_size, HD] are views between two poisoned guard pages.
    k_store = buf.poisoned((num_pages + 2, KV, page_size, HD), BF16)
    v_store = buf.poisoned((num_pages + 2, KV, page_size, HD), BF16)
    q_out = buf.poisoned((n, H, HD), BF16)
    attn_input(buf.upload(qkv), buf.upload(positions), buf.upload(slots), buf.upload(q_norm), buf.upload(k_norm),
               buf.upload(inv_freq), q_out, k_store.rows(1, num_pages + 1), v_store.rows(1, num_pages + 1),
               H, KV, eps, stream)
    got_q = q_out.to_host(stream)
    k_all, v_all = k_store.to_host(stream), v_store.to_host(stream)

    x = to_f32(qkv)
    q = x[:, :H * HD].reshape(n, H, HD)
    k = x[:, H * HD:(H + KV) * HD].reshape(n, KV, HD)
    v = qkv[:, (H + KV) * HD:].reshape(n, KV, HD)
    q_ref = reference.apply_rope(reference.rms_norm(q, to_f32(q_norm), eps), positions, inv_freq)
    k_ref = reference.apply_rope(reference.rms_norm(k, to_f32(k_norm), eps), positions, inv_freq)
    label = f"attn_input n={n} H={H} KV={KV} page={page_size} max_pos={max_pos}"

    # bf16 outputs: rtol 1e-2 (rounding <= 2^-8); atol 1e-2 * the channel's rms over the reference
    # (per channel, because the k_norm channels 5 and 70 are ~100x the others).
    def channel_atol(ref):
        return 1e-2 * np.sqrt(np.mean(np.square(ref.astype(np.float64)), axis=(0, 1)))

    assert_close(got_q, q_ref, atol=channel_atol(q_ref), rtol=1e-2, rel_norm=1e-2, label=f"{label} q_out")

    written = slots >= 0
    page = slots[written] // page_size + 1  # +1: the guard page in front
    offset = slots[written] % page_size
    assert_close(k_all[page, :, offset, :], k_ref[written], atol=channel_atol(k_ref), rtol=1e-2, rel_norm=1e-2,
                 label=f"{label} keys at their slots")
    assert_exact(v_all[page, :, offset, :], v[written], f"{label} values at their slots (copied unchanged)")

    # Nothing else was touched: every other slot, the padding token's and both guard pages stay poisoned.
    untouched = np.ones((num_pages + 2, page_size), bool)
    untouched[page, offset] = False
    for name, pool in (("k_pool", k_all), ("v_pool", v_all)):
        rest = pool.view(np.uint16).transpose(0, 2, 1, 3)[untouched]  # [untouched slots, KV, HD]
        changed = np.any(rest != BF16_POISON, axis=(1, 2))
        if changed.any():
            where = [tuple(int(i) for i in w) for w in np.argwhere(untouched)[changed]]
            raise AssertionError(f"{label}: {name} has {int(changed.sum())} slots written that no token owns; "
                                 f"first (storage page, offset) {where[0]} (storage page 0 and "
                                 f"{num_pages + 1} are guards); padding token slot -1 at index {pad}")


# ============================================================================= attention


class PagedBatch:
    """One attention launch's inputs: sequences (q_len, kv_len) whose cached positions hold random K/V
    in shuffled pages of a pool that is poisoned everywhere else (other pages, page tails, a dummy's
    pages), their queries, cu_q / kv_lens / block tables, and the numpy reference."""

    def __init__(self, rng: np.random.Generator, spec: list[tuple[int, int]], H: int, KV: int, page_size: int,
                 int8: bool = False, v_scale: float | str = 1.0, k_growth: float = 0.0, k_jump: float = 1.0):
        """int8: an INT8 cache (codes + float32 scales, quantized as tileinfer/kv/int8.py does; the
        scales of unowned slots are NaN, so reading one shows). v_scale: the values' magnitude, or
        "rising": position p of kv_len scaled by 10^(-3 + 5 p / kv_len) (1e-3 to 1e2 along the sequence).
        k_growth: key p scaled by 1 + k_growth p / kv_len (each query's largest score climbs along the sequence).
        k_jump: the keys from position kv_len // 2 on scaled by k_jump (a query's scores jump there)."""
        self.spec, self.H, self.KV, self.page_size, self.int8 = spec, H, KV, page_size, int8
        num_pages = sum(cdiv(kv_len, page_size) for _, kv_len in spec) + 3 + 2  # + dummy's 3 + 2 spare
        bm = shuffled_manager(num_pages, page_size, rng)
        dummy = Sequence()
        bm.reserve(dummy, 2 * page_size + 1)  # 3 pages no sequence owns (they stay poisoned)
        seqs = [Sequence() for _ in spec]
        for s, (_, kv_len) in zip(seqs, spec):
            bm.reserve(s, kv_len)
        self.block_tables = bm.block_table_array(seqs, cdiv(num_pages, 16) * 16)

        shape = (num_pages, KV, page_size, HD)
        if int8:
            self.k_pool = np.full(shape, -1, np.int8)
            self.v_pool = np.full(shape, -1, np.int8)
            self.k_scale = np.full(shape[:3], np.nan, np.float32)
            self.v_scale = np.full(shape[:3], np.nan, np.float32)
        else:
            self.k_pool = np.full(shape, BF16_POISON, np.uint16).view(BF16)
            self.v_pool = np.full(shape, BF16_POISON, np.uint16).view(BF16)
        # Per sequence [kv_len, KV, HD]: bf16 values, or (codes, scales) for INT8.
        self.keys, self.values = [], []
        for s, (_, kv_len) in zip(seqs, spec):
            k, v = rand_bf16(rng, (kv_len, KV, HD)), rand_bf16(rng, (kv_len, KV, HD))
            if k_growth:
                k = (to_f32(k) * (1 + k_growth * np.arange(kv_len) / max(kv_len, 1))[:, None, None]
                     .astype(np.float32)).astype(BF16)
            if k_jump != 1.0:
                k = to_f32(k)
                k[kv_len // 2:] *= np.float32(k_jump)
                k = k.astype(BF16)
            if v_scale == "rising":
                v = (to_f32(v) * (10.0 ** (-3 + 5 * np.arange(kv_len) / max(kv_len, 1)))[:, None, None]
                     .astype(np.float32)).astype(BF16)
            elif v_scale != 1.0:
                v = (to_f32(v) * np.float32(v_scale)).astype(BF16)
            slots = bm.slots(s, 0, kv_len)
            page, off = slots // page_size, slots % page_size
            if int8:
                k, v = quantize(to_f32(k)), quantize(to_f32(v))
                self.k_pool[page, :, off, :], self.k_scale[page, :, off] = k
                self.v_pool[page, :, off, :], self.v_scale[page, :, off] = v
            else:
                self.k_pool[page, :, off, :] = k
                self.v_pool[page, :, off, :] = v
            self.keys.append(k)
            self.values.append(v)

        q_lens = np.array([q for q, _ in spec], np.int32)
        self.cu_q = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
        self.kv_lens = np.array([kv for _, kv in spec], np.int32)
        self.T = int(self.cu_q[-1])
        self.max_q_len = int(q_lens.max())
        self.q = rand_bf16(rng, (self.T, H, HD), scale=2.0)  # scores q.k/sqrt(128) with std ~2: peaked softmax
        self.vmax = max(float(np.abs(dequantize(*v) if int8 else to_f32(v)).max()) for v in self.values
                        if kv_lens_positive(v))
        self._device = None

    def run(self, buf: Buffers, stream, num_splits: int) -> np.ndarray:
        """Launch attention (inputs uploaded once, output and partials poisoned per run). # [T, H, HD] bf16"""
        if self._device is None:
            arrays = (self.q, self.k_pool, self.v_pool, self.cu_q, self.kv_lens, self.block_tables)
            if self.int8:
                arrays += (self.k_scale, self.v_scale)
            self._device = [buf.upload(a) for a in arrays]
        q, k_pool, v_pool, cu_q, kv_lens, tables = self._device[:6]
        scales = tuple(self._device[6:]) or None
        out = buf.poisoned((self.T, self.H, HD), BF16)
        partials = None
        if num_splits > 1:
            partials = (buf.poisoned((num_splits, self.T, self.H, HD), F32),
                        buf.poisoned((num_splits, self.T, self.H, 2), F32))
        attention(q, k_pool, v_pool, out, cu_q, kv_lens, tables, max_q_len=self.max_q_len,
                  num_splits=num_splits, partials=partials, scales=scales, stream=stream)
        return out.to_host(stream)

    def reference(self) -> np.ndarray:
        """Causal GQA attention per sequence: its first query sits at position kv_len - q_len. # [T, H, HD] f32"""
        ref = np.full((self.T, self.H, HD), np.nan, np.float32)
        for b, (q_len, kv_len) in enumerate(self.spec):
            if q_len == 0:
                continue
            c0 = int(self.cu_q[b])
            q_pos, k_pos = np.arange(kv_len - q_len, kv_len), np.arange(kv_len)
            if self.int8:
                (kq, ks), (vq, vs) = self.keys[b], self.values[b]
                ref[c0:c0 + q_len] = attention_int8(to_f32(self.q[c0:c0 + q_len]), kq, ks, vq, vs, q_pos, k_pos)
            else:
                ref[c0:c0 + q_len] = reference.attention(
                    to_f32(self.q[c0:c0 + q_len]), to_f32(self.keys[b]), to_f32(self.values[b]), q_pos, k_pos)
        return ref

    def label(self, num_splits: int) -> str:
        return (f"attention{' int8' if self.int8 else ''} seqs(q_len, kv_len)={self.spec} H={self.H} KV={self.KV} "
                f"page={self.page_size} splits={num_splits}")


def check_attention(got: np.ndarray, ref: np.ndarray, vmax: float, label: str) -> None:
    # bf16 output, and P rounded to bf16 before P.V: each ~2^-9 relative. Elementwise rtol 2e-2 with
    # atol 2e-2 * max|v|, and ||err|| / ||ref|| < 1e-2 (expected ~2e-3), which catches a wrong mask.
    assert_close(got, ref, atol=2e-2 * vmax, rtol=2e-2, rel_norm=1e-2, label=label)


def check_splits_agree(got_1: np.ndarray, got_s: np.ndarray, vmax: float, label: str) -> None:
    # Both bf16 and within ~2^-8 of the reference: rtol 1e-2, atol 1e-2 * max|v|, ||diff|| / ||out|| < 1e-2.
    assert_close(got_s, got_1, atol=1e-2 * vmax, rtol=1e-2, rel_norm=1e-2, label=label + " vs splits=1")


PREFILL_CASES = [pytest.param(kv, 16, 8, 64, id=f"kv{kv}-H16-KV8-page64") for kv in (1, 7, 63, 64, 65, 200, 1000)] + [
    pytest.param(65, 32, 8, 64, id="kv65-H32-KV8-page64"),
    pytest.param(200, 32, 8, 16, id="kv200-H32-KV8-page16"),
    pytest.param(1000, 16, 8, 16, id="kv1000-H16-KV8-page16"),
]


@pytest.mark.parametrize("kv_len, H, KV, page_size", PREFILL_CASES)
def test_attention_prefill(kv_len, H, KV, page_size, buf, stream):
    rng = np.random.default_rng(seed_of("prefill", kv_len, H, KV, page_size))
    batch = PagedBatch(rng, [(kv_len, kv_len)], H, KV, page_size)
    check_attention(batch.run(buf, stream, 1), batch.reference(), batch.vmax, batch.label(1))


@pytest.mark.parametrize("H, page_size", [(16, 64), (16, 16), (32, 64)], ids=["H16-page64", "H16-page16", "H32-page64"])
def test_attention_chunk_after_cached_pages(H, page_size, buf, stream):
    # 37 new queries at positions 100..136 attend to 100 positions earlier steps cached, across pages.
    rng = np.random.default_rng(seed_of("chunk", H, page_size))
    batch = PagedBatch(rng, [(37, 137)], H, 8, page_size)
    check_attention(batch.run(buf, stream, 1), batch.reference(), batch.vmax, batch.label(1))


DECODE_CASES = [pytest.param(kv, s, 16, 64, id=f"kv{kv}-splits{s}") for kv in (1, 63, 64, 65, 4097) for s in (1, 4, 16)]
DECODE_CASES += [pytest.param(4097, 4, 32, 16, id="kv4097-splits4-H32-page16"),
                 pytest.param(65, 16, 32, 64, id="kv65-splits16-H32-page64"),
                 # page sizes that are not a multiple of a thread's 8-row stride through a key tile
                 pytest.param(1000, 4, 16, 24, id="kv1000-splits4-H16-page24"),
                 pytest.param(300, 1, 16, 8, id="kv300-splits1-H16-page8"),
                 pytest.param(300, 1, 16, 5, id="kv300-splits1-H16-page5")]


@pytest.mark.parametrize("kv_len, num_splits, H, page_size", DECODE_CASES)
def test_attention_decode(kv_len, num_splits, H, page_size, buf, stream):
    rng = np.random.default_rng(seed_of("decode", kv_len, num_splits, H, page_size))
    batch = PagedBatch(rng, [(1, kv_len)], H, 8, page_size)
    check_attention(batch.run(buf, stream, num_splits), batch.reference(), batch.vmax, batch.label(num_splits))


@pytest.mark.parametrize("kv_len", [1, 65, 4097], ids=lambda kv: f"kv{kv}")
def test_attention_decode_splits_agree(kv_len, buf, stream):
    rng = np.random.default_rng(seed_of("splits-agree", kv_len))
    batch = PagedBatch(rng, [(1, kv_len), (1, max(1, kv_len // 3))], 16, 8, 64)
    got_1, got_16 = batch.run(buf, stream, 1), batch.run(buf, stream, 16)
    check_splits_agree(got_1, got_16, batch.vmax, batch.label(16))


ITEMS_CASES = [  # (H, page_size, num_splits): decode steps of more blocks than a wave holds
    pytest.param(16, 64, 1, id="G2-page64-splits1"),
    pytest.param(32, 16, 3, id="G4-page16-splits3"),   # short sequences leave splits with no key tile
    pytest.param(64, 64, 2, id="G8-page64-splits2"),
    pytest.param(16, 24, 5, id="G2-page24-splits5"),
]


@pytest.mark.parametrize("H, page_size, num_splits", ITEMS_CASES)
def test_attention_decode_items(H, page_size, num_splits, buf, stream, monkeypatch):
    # The persistent BF16 _h8 build (attention_decode_h8_items) takes a decode step whose (sequence, split, KV
    # head) blocks exceed a wave: its blocks take items in turn, the key-tile pipeline running from one item into
    # the next. Sequences of 1 to ~1,100 positions (one key tile and many; short ones leave some splits empty) and
    # padding sequences with no query. Against the reference, and bit for bit the plain grid's build (the same
    # arithmetic an item), which runs when the wave is made too large to exceed.
    rng = np.random.default_rng(seed_of("items", H, page_size, num_splits))
    lens = [1, 2, 63, 64, 65, 127, 129, 700, 1100] + [int(x) for x in rng.integers(1, 400, 60)]
    spec = [(1, n) for n in lens]
    spec[5] = spec[40] = (0, 0)
    batch = PagedBatch(rng, spec, H, 8, page_size)
    assert routing.decode_items_blocks("attention_decode_h8", len(spec) * 8 * num_splits,
                                       get_device().info.num_sms) > 0, "the case must take the persistent build"
    got = batch.run(buf, stream, num_splits)
    check_attention(got, batch.reference(), batch.vmax, batch.label(num_splits) + " items")
    monkeypatch.setattr(routing, "DECODE_ITEMS_BLOCKS", 1 << 20)  # no launch exceeds such a wave: the plain grid
    plain = batch.run(buf, stream, num_splits)
    assert np.array_equal(got.view(np.uint16), plain.view(np.uint16)), \
        f"{batch.label(num_splits)}: the persistent build differs from the plain grid's"


@pytest.mark.parametrize("num_splits", [1, 4], ids=lambda s: f"splits{s}")
@pytest.mark.parametrize("page_size", [64, 16], ids=lambda p: f"page{p}")
def test_attention_mixed_batch(page_size, num_splits, buf, stream):
    # One launch: a decode, an empty padding sequence (q_len 0, kv_len 0: a no-op), a chunk after
    # cached pages, a fresh prefill and a decode at the very first position.
    rng = np.random.default_rng(seed_of("batch", page_size, num_splits))
    batch = PagedBatch(rng, [(1, 300), (0, 0), (37, 137), (70, 70), (1, 1)], 16, 8, page_size)
    check_attention(batch.run(buf, stream, num_splits), batch.reference(), batch.vmax, batch.label(num_splits))


def test_attention_long_decode(buf, stream):
    # 32768 cached positions (512 pages of 64): splits=16 against the reference and against splits=1.
    rng = np.random.default_rng(seed_of("long-decode"))
    batch = PagedBatch(rng, [(1, 32768)], 16, 8, 64)
    ref = batch.reference()
    got_16 = batch.run(buf, stream, 16)
    check_attention(got_16, ref, batch.vmax, batch.label(16))
    got_1 = batch.run(buf, stream, 1)
    check_attention(got_1, ref, batch.vmax, batch.label(1))
    check_splits_agree(got_1, got_16, batch.vmax, batch.label(16))


SMALL_CHUNK_CASES = [  # query rows per KV head <= 16: the kernels' decode ("keys") shape, with causal masks
    pytest.param([(4, 100), (2, 2), (1, 65)], 32, id="G4-qlen4"),
    pytest.param([(8, 8), (3, 130), (0, 0)], 16, id="G2-qlen8"),
]


@pytest.mark.parametrize("num_splits", [1, 3], ids=lambda s: f"splits{s}")
@pytest.mark.parametrize("spec, H", SMALL_CHUNK_CASES)
def test_attention_small_chunks(spec, H, num_splits, buf, stream):
    rng = np.random.default_rng(seed_of("small-chunks", spec, H, num_splits))
    batch = PagedBatch(rng, spec, H, 8, 16)
    check_attention(batch.run(buf, stream, num_splits), batch.reference(), batch.vmax, batch.label(num_splits))


KEYS_ROWS_CASES = [
    pytest.param([(5, 512)], 32, 64, 1, False, id="verify-kv512-G4-splits1"),      # 20 rows: 2 row tiles
    pytest.param([(5, 512)], 32, 64, 32, False, id="verify-kv512-G4-splits32"),
    pytest.param([(9, 1000), (5, 70)], 32, 16, 16, False, id="batch-q9-q5-page16-splits16"),  # 36 rows
    pytest.param([(16, 300), (1, 1)], 32, 24, 4, False, id="q16-G4-page24-splits4"),  # 64 rows: 4 tiles
    pytest.param([(5, 4097)], 32, 64, 16, True, id="int8-verify-kv4097-splits16"),
    pytest.param([(8, 200), (3, 3)], 32, 16, 1, True, id="int8-q8-q3-page16"),
]


@pytest.mark.parametrize("spec, H, page_size, num_splits, int8", KEYS_ROWS_CASES)
def test_attention_keys_mode_row_tiles(spec, H, page_size, num_splits, int8, buf, stream):
    # The decode shape (keys mode) over 2-4 row tiles of 16 (attention.KEYS_MAX_ROWS = 64), causal within
    # each sequence's new tokens, against the oracle.
    rng = np.random.default_rng(seed_of("keys-row-tiles", spec, H, page_size, num_splits, int8))
    batch = PagedBatch(rng, spec, H, 8, page_size, int8=int8)
    check_attention(batch.run(buf, stream, num_splits), batch.reference(), batch.vmax,
                    batch.label(num_splits) + " keys mode, row tiles")


# INT8 cache: the same kernels' INT8 variants against the oracle that quantizes the same way
# (tileinfer/kv/int8.py: scores times the key's scale, probabilities times the value's scale).
INT8_CASES = [
    pytest.param([(1, 1)], 16, 64, 1, id="decode-kv1"),
    pytest.param([(1, 65)], 32, 64, 1, id="decode-kv65-H32"),
    pytest.param([(1, 4097)], 32, 16, 4, id="decode-kv4097-page16-splits4"),
    pytest.param([(1, 300), (1, 63), (1, 1000)], 32, 64, 16, id="decode-batch-splits16"),
    pytest.param([(4, 100), (2, 2)], 32, 16, 1, id="small-chunks-G4"),
    pytest.param([(200, 200)], 16, 64, 1, id="prefill-kv200"),
    pytest.param([(37, 137)], 32, 16, 1, id="chunk-after-cached-page16"),
    pytest.param([(1, 300), (0, 0), (37, 137), (70, 70), (1, 1)], 16, 64, 4, id="mixed-splits4"),
    pytest.param([(1, 1000), (37, 137)], 32, 24, 4, id="decode-and-chunk-page24"),  # 16-row strides cross pages
    pytest.param([(1, 300)], 16, 5, 1, id="decode-kv300-page5"),
]


# The INT8 decode shape's P V product runs in fp16 in units of the largest value scale seen so far
# (attention.cuh, direct_pv): values of any magnitude, and magnitudes rising along the sequence (the
# units change tile by tile), against the oracle.
@pytest.mark.parametrize("v_scale", [1e-4, 1e3, "rising"], ids=lambda v: f"v{v}")
@pytest.mark.parametrize("spec, num_splits", [([(1, 4097)], 4), ([(1, 700), (5, 300)], 1), ([(1, 2000)], 32)],
                         ids=["kv4097-splits4", "decode-verify", "kv2000-splits32"])
def test_attention_int8_value_magnitudes(spec, num_splits, v_scale, buf, stream):
    rng = np.random.default_rng(seed_of("int8 values", spec, num_splits, v_scale))
    batch = PagedBatch(rng, spec, 32, 8, 64, int8=True, v_scale=v_scale)
    check_attention(batch.run(buf, stream, num_splits), batch.reference(), batch.vmax,
                    batch.label(num_splits) + f" values x {v_scale}")


@pytest.mark.parametrize("spec, H, page_size, num_splits", INT8_CASES)
def test_attention_int8(spec, H, page_size, num_splits, buf, stream):
    rng = np.random.default_rng(seed_of("int8", spec, H, page_size, num_splits))
    batch = PagedBatch(rng, spec, H, 8, page_size, int8=True)
    check_attention(batch.run(buf, stream, num_splits), batch.reference(), batch.vmax, batch.label(num_splits))


def test_attention_int8_long_decode(buf, stream):
    # 32768 cached positions in INT8: splits=16 against the oracle and against splits=1.
    rng = np.random.default_rng(seed_of("int8-long-decode"))
    batch = PagedBatch(rng, [(1, 32768)], 32, 8, 64, int8=True)
    ref = batch.reference()
    got_16, got_1 = batch.run(buf, stream, 16), batch.run(buf, stream, 1)
    check_attention(got_16, ref, batch.vmax, batch.label(16))
    check_attention(got_1, ref, batch.vmax, batch.label(1))
    check_splits_agree(got_1, got_16, batch.vmax, batch.label(16))


# Fused input: a decode step (one token a sequence) on the _h8 builds does attn_input's work inside the
# attention launch (attention.cuh, "fused input"). Against attn_input then attention on the same inputs: the
# same output and the same cache, bit for bit (both run attn_input.cuh's arithmetic), for BF16 and INT8
# caches, smoothing on and off, groups of 2, 4 and 8, awkward lengths, pages and splits, a padding token.
FUSED_CASES = [
    pytest.param([(1, 1)], 16, 64, 1, id="kv1-G2"),
    pytest.param([(1, 65)], 32, 64, 1, id="kv65-G4"),
    pytest.param([(1, 4097)], 32, 16, 4, id="kv4097-page16-splits4"),
    pytest.param([(1, 300), (1, 63), (1, 64), (1, 1000)], 32, 64, 16, id="batch-splits16-padding"),
    pytest.param([(1, 130), (0, 0), (1, 7)], 64, 24, 3, id="G8-page24-splits3"),
    # The new position at a tile's first row, on a page of 16, and in a tile past the first STAGES - 1 its block
    # requests (so requested in the main loop, well after the block stored it).
    pytest.param([(1, 129)], 32, 64, 2, id="kv129-row0-splits2"),
    pytest.param([(1, 100)], 16, 16, 1, id="kv100-page16"),
    pytest.param([(1, 200), (1, 3)], 32, 64, 1, id="kv200-past-the-prologue"),
]


@pytest.mark.parametrize("int8, smooth", [(False, False), (True, False), (True, True)], ids=["bf16", "int8", "int8-smooth"])
@pytest.mark.parametrize("spec, H, page_size, num_splits", FUSED_CASES)
def test_attention_fused_input(spec, H, page_size, num_splits, int8, smooth, buf, stream):
    KV, eps = 8, 1e-6
    rng = np.random.default_rng(seed_of("fused-input", spec, H, page_size, num_splits, int8, smooth))
    batch = PagedBatch(rng, spec, H, KV, page_size, int8=int8)
    assert fuses_input(max_q_len=batch.max_q_len, num_heads=H, num_kv_heads=KV)
    T = batch.T
    qkv, q_norm, k_norm = attn_input_tensors(rng, T, H, KV, HD)
    # Token t is its sequence's new position kv_len - 1, stored at that position's slot.
    kv_of_token = np.array([kv for q, kv in spec for _ in range(q)], np.int32)
    seq_of_token = np.array([b for b, (q, _) in enumerate(spec) for _ in range(q)])
    positions = kv_of_token - 1
    slots = (batch.block_tables[seq_of_token, positions // page_size] * page_size + positions % page_size).astype(np.int32)
    if T > 2:
        slots[1] = -1  # a padding token: nothing stored, its queries still attend
    inv_freq = reference.rope_inv_freq(HD, 1e6)
    c = smoothing_factors(to_f32(k_norm)) if smooth else None
    d_qkv, d_pos, d_slots, d_qn, d_kn, d_freq = (buf.upload(a) for a in (qkv, positions, slots, q_norm, k_norm, inv_freq))
    d_c = buf.upload(c) if smooth else None
    cu_q, kv_lens, tables = (buf.upload(a) for a in (batch.cu_q, batch.kv_lens, batch.block_tables))

    def run(fused: bool):
        pools = [buf.upload(a) for a in ((batch.k_pool, batch.v_pool, batch.k_scale, batch.v_scale) if int8
                                          else (batch.k_pool, batch.v_pool))]
        q = buf.poisoned((T, H, HD), BF16)
        out = buf.poisoned((T, H, HD), BF16)
        partials = None
        if num_splits > 1:
            partials = (buf.poisoned((num_splits, T, H, HD), F32), buf.poisoned((num_splits, T, H, 2), F32))
        scales = tuple(pools[2:]) or None
        fin = None
        if fused:
            fin = FusedInput(d_qkv, d_pos, d_slots, d_qn, d_kn, d_freq, d_c, eps)
        elif int8:
            attn_input_int8(d_qkv, d_pos, d_slots, d_qn, d_kn, d_freq, d_c, q, *pools, H, KV, eps, stream)
        else:
            attn_input(d_qkv, d_pos, d_slots, d_qn, d_kn, d_freq, q, *pools, H, KV, eps, stream)
        attention(q, pools[0], pools[1], out, cu_q, kv_lens, tables, max_q_len=1, num_splits=num_splits,
                  partials=partials, scales=scales, fused=fin, stream=stream)
        return out.to_host(stream), [p.to_host(stream) for p in pools]

    want_out, want_pools = run(False)
    got_out, got_pools = run(True)
    label = batch.label(num_splits) + (" int8" if int8 else " bf16") + (" smoothed" if smooth else "")
    assert_exact(got_out.view(np.uint16), want_out.view(np.uint16), f"fused input output, {label}")
    for name, got, want in zip(("k_pool", "v_pool", "k_scale", "v_scale"), got_pools, want_pools):
        assert_exact(got.view(np.uint8), want.view(np.uint8), f"fused input {name}, {label}")


def test_attention_fused_input_refuses_other_shapes(buf, stream):
    # Two tokens a sequence, or a group over 8 (the 16-row build), cannot take the fused input.
    assert not fuses_input(max_q_len=2, num_heads=32, num_kv_heads=8)
    assert not fuses_input(max_q_len=1, num_heads=64, num_kv_heads=4)
    assert not fuses_input(max_q_len=1, num_heads=32, num_kv_heads=8, decode_shape=False)
    rng = np.random.default_rng(seed_of("fused-refuse"))
    batch = PagedBatch(rng, [(2, 70)], 32, 8, 64)
    arrays = [buf.upload(a) for a in (batch.q, batch.k_pool, batch.v_pool, batch.cu_q, batch.kv_lens, batch.block_tables)]
    qkv, q_norm, k_norm = attn_input_tensors(rng, 2, 32, 8, HD)
    fin = FusedInput(buf.upload(qkv), buf.upload(np.array([68, 69], np.int32)), buf.upload(np.array([0, 1], np.int32)),
                     buf.upload(q_norm), buf.upload(k_norm), buf.upload(reference.rope_inv_freq(HD, 1e6)), None, 1e-6)
    with pytest.raises(ValueError, match="one token a sequence"):
        attention(arrays[0], arrays[1], arrays[2], buf.poisoned((2, 32, HD), BF16), *arrays[3:], max_q_len=2,
                  fused=fin, stream=stream)


# ============================================================================= argmax


@pytest.mark.parametrize("vocab", [7, 1000, 151936], ids=lambda v: f"vocab{v}")
@pytest.mark.parametrize("rows", [1, 3], ids=lambda r: f"rows{r}")
def test_argmax(rows, vocab, buf, stream):
    rng = np.random.default_rng(seed_of("argmax", rows, vocab))
    logits = rng.standard_normal((rows, vocab), dtype=np.float32) * np.float32(3)
    # Row 0: two equal maxima; the lower index must win. Past 1024 entries, put the lower index in a
    # higher thread (i % 1024 > j % 1024) so a reduction that prefers thread order would fail.
    if vocab > 1024:
        i, j = int(rng.integers(900, 1024)), 1024 + int(rng.integers(0, 100))
    else:
        i, j = sorted(int(a) for a in rng.choice(vocab, 2, replace=False))
    logits[0, [i, j]] = logits[0].max() + 1
    if rows > 1:
        logits[1] -= 100                            # every logit negative
    if rows > 2:
        logits[2, -1] = logits[2].max() + 0.5       # the maximum is the last entry
    expected = np.argmax(logits, axis=1).astype(np.int32)
    assert expected[0] == i

    out = buf.poisoned((rows,), I32)
    argmax(buf.upload(logits), out, stream)
    # Exact: an index.
    assert_exact(out.to_host(stream), expected, f"argmax rows={rows} vocab={vocab} (tie at {i}, {j})")


# ============================================================================= the LM head's keys
# linear(head_keys=) (batch 1, f32): each block's largest logit as (order << 32 | ~index); sample() reads
# row 0's argmax from them. Decoded here as the kernel does.

def decode_key(key: int) -> tuple[float, int]:
    order, index = key >> 32, (~key) & 0xFFFFFFFF
    bits = (order & 0x7FFFFFFF) if order & 0x80000000 else (~order & 0xFFFFFFFF)
    return float(np.array([bits], np.uint32).view(np.float32)[0]), index


@pytest.mark.parametrize("N, K", [(151936, 1024), (1000, 2568), (24, 200), (2056, 4104)])
def test_lm_head_keys_give_the_argmax_lowest_index_on_ties(N, K, buf, stream):
    rng = np.random.default_rng(seed_of("head_keys", N, K))
    x = buf.upload(rand_bf16(rng, (1, K)))
    w = linear_weight(N, K).copy()
    blocks = head_key_count(N, K)
    for tie in (False, True):
        logits, keys = buf.poisoned((1, N), F32), buf.poisoned((blocks,), np.dtype(np.uint64))
        linear(x, buf.upload(w), logits, "f32", stream, head_keys=keys)
        got = logits.to_host(stream)[0]
        want = int(np.argmax(got))
        # The logits are the plain GEMV's, bitwise; the keys' maximum is their argmax.
        plain = buf.poisoned((1, N), F32)
        linear(x, buf.upload(w), plain, "f32", stream)
        np.testing.assert_array_equal(got, plain.to_host(stream)[0])
        value, index = decode_key(int(keys.to_host(stream).max()))
        assert (index, value) == (want, float(got[want])), f"tie={tie}"
        if not tie and want > 0:  # the same row again at a lower index: equal logits, the lower one wins
            w[want // 2] = w[want]
            assert want // 2 < want


def test_sample_reads_the_lm_head_keys_unless_penalties_changed_the_row(buf, stream):
    rng = np.random.default_rng(seed_of("sample_keys"))
    N, K = 151936, 1024
    x, w = buf.upload(rand_bf16(rng, (1, K))), buf.upload(linear_weight(N, K))
    logits, keys = buf.poisoned((1, N), F32), buf.poisoned((head_key_count(N, K),), np.dtype(np.uint64))
    linear(x, w, logits, "f32", stream, head_keys=keys)
    host = logits.to_host(stream)

    def run(logits, temperature, entries=(), with_keys=True, presence=0.0):
        """Row 0's token; entries: penalty token ids (each counted once in the output), applied first."""
        out = buf.poisoned((1,), I32)
        ids = np.asarray(entries, np.int32)
        penalties = (buf.upload(np.array([0, ids.size], np.int32)), buf.upload(np.append(ids, np.int32(0))),
                     buf.upload(np.ones(ids.size + 1, np.int32)), buf.upload(np.zeros(ids.size + 1, np.float32)),
                     buf.upload(np.ones(1, np.float32)), buf.upload(np.array([presence], np.float32)),
                     buf.upload(np.zeros(1, np.float32)))
        sample(logits, buf.upload(np.array([temperature], np.float32)), buf.upload(np.array([0], np.int32)),
               buf.upload(np.array([1.0], np.float32)), buf.upload(np.zeros(1, np.float32)),
               buf.upload(np.array([7], np.uint64)), buf.upload(np.array([3], np.int32)), out, stream,
               penalties=penalties, head_keys=keys if with_keys else None)
        return int(out.to_host(stream)[0])

    assert run(logits, 0.0) == int(np.argmax(host))
    assert run(logits, 0.8) == run(logits, 0.8, with_keys=False)  # the same maximum, the same sample
    # A penalty on the best token rewrites the row after the keys were made: the keys are stale, the
    # (penalized) logits are scanned.
    best = int(np.argmax(host))
    penalised = host.copy()
    penalised[0, best] -= np.float32(host.max() - host.min() + 1.0)
    assert int(np.argmax(penalised)) != best
    got = run(logits, 0.0, entries=[best], presence=float(host.max() - host.min() + 1.0))
    assert got == int(np.argmax(penalised))
    assert_exact(logits.to_host(stream), penalised, "the penalized row, in place")


# ============================================================================= sampling

# (temperature, top_k, top_p) per row, cycled: greedy, top-k, top-p, and both.
SAMPLE_PARAMS = [(0.0, 0, 1.0), (0.7, 50, 1.0), (1.0, 0, 0.9), (1.3, 20, 0.8)]


def launch_sample(buf, stream, logits, temperature, top_k, top_p, seeds, counters) -> np.ndarray:
    rows = logits.shape[0]
    out = buf.poisoned((rows,), I32)
    sample(buf.upload(logits), buf.upload(np.asarray(temperature, np.float32)), buf.upload(np.asarray(top_k, np.int32)),
           buf.upload(np.asarray(top_p, np.float32)), buf.upload(np.zeros(rows, np.float32)),  # min_p off
           buf.upload(np.asarray(seeds, np.uint64)), buf.upload(np.asarray(counters, np.int32)), out, stream)
    got = out.to_host(stream)
    bad = (got < 0) | (got >= logits.shape[1])
    assert not bad.any(), (f"sample: {int(bad.sum())} of {rows} rows out of [0, {logits.shape[1]}) "
                           f"(-1 = never written); first row {int(np.argmax(bad))}: {got[bad][0]}")
    return got


def test_sample_writes_the_mapped_host_row(buf, stream):
    # host_out: the sampling kernel also writes each row's token into row host_slot[0] of mapped page-locked
    # memory (what the engine reads instead of copying the ids back); the other row and the columns past
    # the step's rows stay as they were.
    rng = np.random.default_rng(seed_of("sample mapped"))
    rows, vocab, stride = 5, 1003, 8
    logits = rng.standard_normal((rows, vocab), dtype=np.float32) * np.float32(3)
    temperature = np.array([0.0, 0.7, 0.0, 1.3, 0.9], np.float32)
    host = PinnedBuffer(2 * stride * 4, mapped=True)
    try:
        view = host.array((2, stride), np.int32)
        view[:] = -7
        out = buf.poisoned((rows,), I32)
        sample(buf.upload(logits), buf.upload(temperature), buf.upload(np.zeros(rows, np.int32)),
               buf.upload(np.ones(rows, np.float32)), buf.upload(np.zeros(rows, np.float32)),
               buf.upload(rng.integers(0, 2**64, rows, dtype=np.uint64)), buf.upload(np.arange(rows, dtype=np.int32)),
               out, stream, host_out=host.device_array((2, stride), np.int32),
               host_slot=buf.upload(np.array([1], np.int32)))
        got = out.to_host(stream)  # synchronizes the stream
        assert ((got >= 0) & (got < vocab)).all(), got
        assert got[0] == np.argmax(logits[0]) and got[2] == np.argmax(logits[2])
        np.testing.assert_array_equal(view[1, :rows], got)
        assert (view[1, rows:] == -7).all() and (view[0] == -7).all(), view
        with pytest.raises(ValueError, match="host_out rows hold 4 tokens"):
            sample(buf.upload(logits), buf.upload(temperature), buf.upload(np.zeros(rows, np.int32)),
                   buf.upload(np.ones(rows, np.float32)), buf.upload(np.zeros(rows, np.float32)),
                   buf.upload(np.zeros(rows, np.uint64)), buf.upload(np.zeros(rows, np.int32)), out, stream,
                   host_out=host.device_array((2, 4), np.int32), host_slot=buf.upload(np.array([0], np.int32)))
    finally:
        host.free()


def top_p_boundary_excuse(logits: np.ndarray, temperature: float, top_k: int, top_p: float, choice: int):
    """Why a kernel choice outside numpy's kept set may still be right, or None.

    Only the top-p boundary is fuzzy: the kernel sums the softmax mass in float32 (with __expf), numpy
    in float64. Accepted: the choice is the next value below numpy's threshold, and the float64 mass
    kept at that threshold exceeds the target by at most 1e-4 of the total (float32 sums may say "short").
    """
    if top_p >= 1.0:
        return None
    z = sampler.scaled(logits, temperature)
    keep = np.ones(z.shape, bool)
    if 0 < top_k < z.size:
        keep &= z >= np.sort(z)[::-1][top_k - 1]
    cand = np.sort(z[keep])[::-1]
    cum = np.cumsum(np.exp((cand - cand[0]).astype(np.float64)))
    target = top_p * cum[-1]
    idx = int(np.searchsorted(cum, target))
    threshold = cand[min(idx, cand.size - 1)]
    below = cand[cand < threshold]
    if not keep[choice] or below.size == 0 or z[choice] != below[0]:
        return None
    kept_mass = cum[np.nonzero(cand >= threshold)[0][-1]]
    gap = (kept_mass - target) / cum[-1]
    return f"next below the top-p threshold, mass margin {gap:.2e} of the total" if gap <= 1e-4 else None


@pytest.mark.parametrize("vocab, pairs", [(1000, 200), (151936, 40)], ids=["vocab1000", "vocab151936"])
def test_sample_matches_numpy_sampler(vocab, pairs, buf, stream):
    rng = np.random.default_rng(seed_of("sample", vocab))
    rows = len(SAMPLE_PARAMS) * pairs
    params = [SAMPLE_PARAMS[r % len(SAMPLE_PARAMS)] for r in range(rows)]
    logits = rng.standard_normal((rows, vocab), dtype=np.float32) * np.float32(3)
    seeds = rng.integers(0, 2**64, rows, dtype=np.uint64)
    counters = rng.integers(0, 2**31 - 1, rows).astype(np.int32)
    got = launch_sample(buf, stream, logits, [p[0] for p in params], [p[1] for p in params],
                        [p[2] for p in params], seeds, counters)

    agree, outside, excused = {p: 0 for p in SAMPLE_PARAMS}, [], []
    for r, (temperature, top_k, top_p) in enumerate(params):
        want = sampler.sample(logits[r], temperature=temperature, top_k=top_k, top_p=top_p,
                              seed=int(seeds[r]), counter=int(counters[r]))
        if int(got[r]) == want:
            agree[params[r]] += 1
            continue
        if temperature <= 0:
            raise AssertionError(f"greedy row {r}: kernel chose {got[r]}, argmax is {want} "
                                 f"(logits {logits[r, got[r]]} vs {logits[r, want]})")
        keep = sampler.kept_mask(logits[r], temperature, top_k, top_p)
        if not keep[got[r]]:
            why = top_p_boundary_excuse(logits[r], temperature, top_k, top_p, int(got[r]))
            (excused if why else outside).append((r, params[r], int(got[r]), want, int(keep.sum()), why))
    summary = (f"sample vocab={vocab}: agreement per (T, top_k, top_p) "
               f"{ {p: f'{n}/{pairs}' for p, n in agree.items()} }; outside numpy's kept set: {outside}; "
               f"excused at the top-p boundary: {excused}")
    print(summary)
    # (a) every choice is in numpy's kept set (or the single boundary token, within float32 mass rounding)
    assert not outside, summary
    # (b) >= 99% equal to the numpy sampler exactly (same uniforms; the kernel's __logf differs in rounding)
    sampled = sum(n for p, n in agree.items() if p[0] > 0)
    total = pairs * sum(1 for p in SAMPLE_PARAMS if p[0] > 0)
    assert sampled >= 0.99 * total, summary
    assert agree[SAMPLE_PARAMS[0]] == pairs, summary  # greedy rows: all exact


def test_sample_distribution_small_vocab(buf, stream):
    # 20,000 draws from one row of 8 logits (T = 1), each with its own seed and counter: the counts
    # must fit softmax(logits) (chi-square, 7 dof, p > 1e-3); with top_k = 3 only the top three may
    # appear, in proportion to their renormalized softmax (2 dof, p > 1e-3).
    n = 20000
    rng = np.random.default_rng(seed_of("sample-distribution"))
    logits = np.array([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.2], np.float32)
    grid = np.tile(logits, (n, 1))
    seeds = rng.integers(0, 2**64, n, dtype=np.uint64)
    counters = rng.integers(0, 2**31 - 1, n).astype(np.int32)
    probs = np.exp(logits.astype(np.float64) - logits.max())
    probs /= probs.sum()

    for top_k in (0, 3):
        got = launch_sample(buf, stream, grid, np.ones(n), np.full(n, top_k), np.ones(n), seeds, counters)
        counts = np.bincount(got, minlength=logits.size)
        support = np.argsort(-logits)[:top_k] if top_k else np.arange(logits.size)
        outside = np.setdiff1d(np.nonzero(counts)[0], support)
        assert outside.size == 0, f"top_k={top_k}: tokens {outside.tolist()} outside the top {top_k} drawn: {counts}"
        expected = n * probs[support] / probs[support].sum()
        chi2 = float(np.sum((counts[support] - expected) ** 2 / expected))
        p_value = chi2_sf(chi2, support.size - 1)
        print(f"sample top_k={top_k}: counts {counts[support].tolist()} expected {np.round(expected, 1).tolist()} "
              f"chi2 {chi2:.2f} ({support.size - 1} dof) p {p_value:.3g}")
        # p > 1e-3: a correct sampler fails this one time in a thousand (the seeds are fixed, so never twice).
        assert p_value > 1e-3, (f"top_k={top_k}: counts {counts.tolist()} do not fit softmax: "
                                f"chi2 {chi2:.2f}, p {p_value:.2e}")


# ============================================================================= argument checks

LAUNCHER_ERRORS = {
    # linear
    "linear unknown epilogue": lambda B, s: linear(B((4, 64), BF16), B((128, 64), BF16), B((4, 128), BF16), "gelu", s),
    "linear x float32": lambda B, s: linear(B((4, 64), F32), B((128, 64), BF16), B((4, 128), BF16), "bf16", s),
    "linear K of w differs": lambda B, s: linear(B((4, 64), BF16), B((128, 72), BF16), B((4, 128), BF16), "bf16", s),
    "linear out width": lambda B, s: linear(B((4, 64), BF16), B((128, 64), BF16), B((4, 120), BF16), "bf16", s),
    "linear out rows": lambda B, s: linear(B((4, 64), BF16), B((128, 64), BF16), B((5, 128), BF16), "bf16", s),
    "linear bf16 into float32": lambda B, s: linear(B((4, 64), BF16), B((128, 64), BF16), B((4, 128), F32), "bf16", s),
    "linear residual into bf16": lambda B, s: linear(B((4, 64), BF16), B((128, 64), BF16), B((4, 128), BF16),
                                                     "residual", s),
    "linear silu_mul out not [M, N/2]": lambda B, s: linear(B((4, 64), BF16), B((128, 64), BF16), B((4, 128), BF16),
                                                            "silu_mul", s),
    "linear silu_mul odd N": lambda B, s: linear(B((4, 64), BF16), B((9, 64), BF16), B((4, 4), BF16), "silu_mul", s),
    "linear K not a multiple of 8": lambda B, s: linear(B((4, 60), BF16), B((128, 60), BF16), B((4, 128), BF16),
                                                        "bf16", s),
    "linear N not a multiple of 8": lambda B, s: linear(B((4, 64), BF16), B((100, 64), BF16), B((4, 100), BF16),
                                                        "bf16", s),
    "linear gemv with M=3": lambda B, s: linear(B((3, 64), BF16), B((128, 64), BF16), B((3, 128), BF16), "bf16", s,
                                                force="gemv"),
    "linear swap with M=65": lambda B, s: linear(B((65, 64), BF16), B((128, 64), BF16), B((65, 128), BF16), "bf16", s,
                                                 force="swap"),
    "linear unknown path": lambda B, s: linear(B((4, 64), BF16), B((128, 64), BF16), B((4, 128), BF16), "bf16", s,
                                               force="tensor"),
    # the other launchers
    "embedding dim not a multiple of 8": lambda B, s: embedding(B((3,), I32), B((10, 12), BF16), B((3, 12), F32), s),
    "embedding int64 tokens": lambda B, s: embedding(B((3,), np.int64), B((10, 16), BF16), B((3, 16), F32), s),
    "rmsnorm weight length": lambda B, s: rmsnorm(B((3, 128), F32), B((64,), BF16), B((3, 128), BF16), 1e-6, s),
    "rmsnorm more rows out than in": lambda B, s: rmsnorm(B((3, 128), F32), B((128,), BF16), B((4, 128), BF16),
                                                          1e-6, s),
    "rmsnorm rows int64": lambda B, s: rmsnorm(B((3, 128), F32), B((128,), BF16), B((2, 128), BF16), 1e-6, s,
                                               rows=B((2,), np.int64)),
    "attn_input inv_freq length": lambda B, s: attn_input(
        B((2, 8 * HD), BF16), B((2,), I32), B((2,), I32), B((HD,), BF16), B((HD,), BF16), B((HD,), F32),
        B((2, 4, HD), BF16), B((3, 2, 16, HD), BF16), B((3, 2, 16, HD), BF16), 4, 2, 1e-6, s),
    "attn_input qkv width": lambda B, s: attn_input(
        B((2, 7 * HD), BF16), B((2,), I32), B((2,), I32), B((HD,), BF16), B((HD,), BF16), B((HD // 2,), F32),
        B((2, 4, HD), BF16), B((3, 2, 16, HD), BF16), B((3, 2, 16, HD), BF16), 4, 2, 1e-6, s),
    "attention head_dim 64": lambda B, s: attention(
        B((2, 4, 64), BF16), B((3, 2, 16, 64), BF16), B((3, 2, 16, 64), BF16), B((2, 4, 64), BF16), B((2,), I32),
        B((1,), I32), B((1, 16), I32), max_q_len=2, stream=s),
    "attention heads not a multiple of KV heads": lambda B, s: attention(
        B((2, 6, HD), BF16), B((3, 4, 16, HD), BF16), B((3, 4, 16, HD), BF16), B((2, 6, HD), BF16), B((2,), I32),
        B((1,), I32), B((1, 16), I32), max_q_len=2, stream=s),
    "attention splits without partials": lambda B, s: attention(
        B((2, 4, HD), BF16), B((3, 2, 16, HD), BF16), B((3, 2, 16, HD), BF16), B((2, 4, HD), BF16), B((2,), I32),
        B((1,), I32), B((1, 16), I32), max_q_len=2, num_splits=4, stream=s),
    "attention partials of the wrong split count": lambda B, s: attention(
        B((2, 4, HD), BF16), B((3, 2, 16, HD), BF16), B((3, 2, 16, HD), BF16), B((2, 4, HD), BF16), B((2,), I32),
        B((1,), I32), B((1, 16), I32), max_q_len=2, num_splits=4,
        partials=(B((2, 2, 4, HD), F32), B((2, 2, 4, 2), F32)), stream=s),
    "attention cu_q length": lambda B, s: attention(
        B((2, 4, HD), BF16), B((3, 2, 16, HD), BF16), B((3, 2, 16, HD), BF16), B((2, 4, HD), BF16), B((3,), I32),
        B((1,), I32), B((1, 16), I32), max_q_len=2, stream=s),
    "attention int8 cache without scales": lambda B, s: attention(
        B((2, 4, HD), BF16), B((3, 2, 16, HD), np.int8), B((3, 2, 16, HD), np.int8), B((2, 4, HD), BF16),
        B((2,), I32), B((1,), I32), B((1, 16), I32), max_q_len=2, stream=s),
    "attention int8 scales of the wrong shape": lambda B, s: attention(
        B((2, 4, HD), BF16), B((3, 2, 16, HD), np.int8), B((3, 2, 16, HD), np.int8), B((2, 4, HD), BF16),
        B((2,), I32), B((1,), I32), B((1, 16), I32), max_q_len=2, scales=(B((3, 2, 16), F32), B((3, 2), F32)),
        stream=s),
    "argmax out float32": lambda B, s: argmax(B((2, 10), F32), B((2,), F32), s),
    "sample seeds int64": lambda B, s: sample(B((2, 10), F32), B((2,), F32), B((2,), I32), B((2,), F32),
                                              B((2,), F32), B((2,), np.int64), B((2,), I32), B((2,), I32), s),
    "sample top_k rows": lambda B, s: sample(B((2, 10), F32), B((2,), F32), B((3,), I32), B((2,), F32),
                                             B((2,), F32), B((2,), np.uint64), B((2,), I32), B((2,), I32), s),
}


@pytest.mark.parametrize("case", list(LAUNCHER_ERRORS))
def test_launcher_rejects_bad_arguments(case, buf, stream):
    # Every case must raise ValueError in the launcher, before anything is launched.
    with pytest.raises(ValueError) as info:
        LAUNCHER_ERRORS[case](buf.poisoned, stream)
    print(f"{case}: {info.value}")
