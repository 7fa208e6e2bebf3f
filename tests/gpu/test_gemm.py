"""cuda_src/gemm_tma.cu (linear's "gemm" path: prefill and batches of 65 rows or more; TMA-fed,
warp-specialized wgmma) against the float64 numpy reference: the persistent kernel at every tile width (128 and 256,
and the round widths 96 and 160) and with a capped grid, and the split-K kernels (2, 3, 4 blocks of a cluster per
tile, partial tiles summed in rank order) at both widths, the persistent kernel's last round as a split launch, its
multicast build (2-block clusters sharing W tiles), all four epilogues, awkward shapes and the qwen3-0.6b / qwen3-4b
matrices as tma_plan launches them; determinism of the splits. tests/gpu/test_kernels.py covers the
`linear(force="gemm")` route at more shapes (M = 1 and 7 included: the batch-invariant mode puts every product on
this path)."""
from __future__ import annotations

import functools

import numpy as np
import pytest

import test_kernels
from tileinfer.cuda import get_device
from tileinfer.kernels.linear import cluster_slots, gemm, tile_rows
from tileinfer.kernels.routing import TMA_ROUND_SPLITS, TMA_SPLITS, TMA_TALL, TMA_TALL_SPLITS, default_path, tma_plan

from gpu_helpers import linear_weight, rand_bf16  # noqa: E402
from test_kernels import BF16, EPILOGUES, F32, check_linear  # noqa: E402

pytestmark = pytest.mark.gpu

# check_linear draws a shape's (read-only) weights anew for every case, ~1 s for qwen3-4b's gate/up: keep
# the last two (the cases of one shape run one after another).
if not hasattr(test_kernels.linear_weight, "cache_info"):
    test_kernels.linear_weight = functools.lru_cache(maxsize=2)(test_kernels.linear_weight)

# Partial tiles in every dimension (M not a multiple of 128; N not a multiple of 128 or 256, gate/up
# halves not multiples of 64 or 128; K not a multiple of the 64-wide k-step), one k-step, many, a W box
# wholly past N (N = 8; N = 264 at 256 wide), and qwen3-4b's QKV, gate/up, o_proj and down_proj.
SHAPES = [(128, 128, 64), (33, 8, 8), (129, 264, 136), (1000, 136, 1000), (77, 520, 4104), (300, 1024, 2560),
          (256, 2560, 9728), (640, 2560, 4096), (512, 19456, 2560), (4096, 6144, 2560)]
# (tile width, cap on the persistent grid): every width on a full grid, and a few blocks each walking
# many tiles (the stage ring's barrier phases carry across tiles). The round widths (96, 160, 64: 12, 20 and 8
# column blocks, W boxes of 48, 80 and 32 rows; 6, 5 and 8 stages) leave partial tiles where 128 and 256 do not.
VARIANTS = [(256, None), (128, None), (256, 3), (128, 5), (160, None), (96, None), (160, 3), (96, 5), (64, None),
            (64, 5)]
WIDTHS = [128, 256]
# Every split build: each split at both widths, and the round widths' (96 wide, 2 ways).
SPLIT_BUILDS = [(w, ks) for w in WIDTHS for ks in TMA_SPLITS] + [(w, ks) for w, splits in TMA_ROUND_SPLITS.items()
                                                                  for ks in splits]
# Split-K shapes: partial tiles everywhere, a single k-step (K = 8: splits leave ranks with no k-step,
# whose partial tile is zero), a W box wholly past N, uneven k-step counts (K = 136: 3 k-steps; 4104: 65),
# and one M past 512.
SPLIT_SHAPES = [(65, 8, 8), (100, 264, 136), (128, 520, 4104), (256, 1032, 1000), (300, 136, 2056),
                (512, 776, 520), (1000, 392, 328)]
# The layer matrices (N, K, the model's epilogue) of qwen3-0.6b and qwen3-4b.
MODEL = {"0.6b-qkv": (4096, 1024, "bf16"), "0.6b-o": (1024, 2048, "residual"),
         "0.6b-gu": (6144, 1024, "silu_mul"), "0.6b-down": (1024, 3072, "residual"),
         "4b-qkv": (6144, 2560, "bf16"), "4b-o": (2560, 4096, "residual"),
         "4b-gu": (19456, 2560, "silu_mul"), "4b-down": (2560, 9728, "residual")}


def run(epilogue, stream, **kw):
    return lambda x, w, out: gemm(x, w, out, epilogue, stream, **kw)


@pytest.mark.parametrize("epilogue", EPILOGUES)
@pytest.mark.parametrize("M, N, K", SHAPES)
def test_gemm_tma(M, N, K, epilogue, buf, stream):
    # The big shapes take the launcher's own choice (as the model does), the rest every variant.
    for width, blocks in (VARIANTS if M * N * K <= 2 ** 33 else [(None, None)]):
        check_linear(buf, stream, M, N, K, epilogue, "gemm",
                     launch=run(epilogue, stream, width=width, split=1 if width else None, blocks=blocks),
                     label=f"gemm_tma {epilogue} M={M} N={N} K={K} width={width} blocks={blocks}")


# The persistent kernel over the whole rounds of a capped grid (7 blocks: 35 of the 40 tiles), the 5 tiles of its
# last round a split launch after it, 2-4 blocks a tile, at both widths and every epilogue.
@pytest.mark.parametrize("tail", TMA_SPLITS)
@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("epilogue", EPILOGUES)
def test_gemm_tma_split_last_round(epilogue, width, tail, buf, stream):
    M, N, K = 1000, 1032 if width == 256 else 520, 1000
    check_linear(buf, stream, M, N, K, epilogue, "gemm",
                 launch=run(epilogue, stream, width=width, blocks=7, tail=tail),
                 label=f"gemm_tma {epilogue} M={M} N={N} K={K} width={width} blocks=7 tail={tail}")


# The multicast build (2-block clusters on pairs of row tiles, each block loading half of their shared W tile
# into both): against the reference, and bit for bit the plain persistent kernel's (the same products in the
# same order). Both widths; a full grid, a capped one (clusters walking many tiles: the ring's phases and the
# other block's arrivals carry across tiles) and one with a split last round after it; a last column tile whose
# second W box lies past N (264 at 256 wide); partial row tiles; one k-step and many.
MC_SHAPES = [(256, 264, 64), (1000, 520, 4104), (512, 1032, 1000), (2048, 2560, 2560)]


@pytest.mark.parametrize("epilogue", EPILOGUES)
@pytest.mark.parametrize("M, N, K", MC_SHAPES)
def test_gemm_tma_multicast(M, N, K, epilogue, buf, stream):
    for width, blocks, tail in ((256, None, None), (128, None, None), (256, 4, None), (128, 6, 2)):
        kw = dict(width=width, blocks=blocks, tail=tail)
        label = f"gemm_tma multicast {epilogue} M={M} N={N} K={K} {kw}"
        got = check_linear(buf, stream, M, N, K, epilogue, "gemm", launch=run(epilogue, stream, multicast=True, **kw),
                           label=label)
        plain = check_linear(buf, stream, M, N, K, epilogue, "gemm", launch=run(epilogue, stream, **kw), label=label)
        assert got.tobytes() == plain.tobytes(), f"{label}: differs from the plain persistent kernel"


# Smoke (first, under a short timeout in a device call: a hang means a cluster-barrier deadlock): every
# split and width, every epilogue, one small shape of two row tiles and uneven k-step counts.
@pytest.mark.parametrize("width, split", SPLIT_BUILDS)
@pytest.mark.parametrize("epilogue", EPILOGUES)
def test_gemm_tma_split_smoke(epilogue, split, width, buf, stream):
    M, N, K = 200, 264, 456
    check_linear(buf, stream, M, N, K, epilogue, "gemm", launch=run(epilogue, stream, split=split, width=width),
                 label=f"gemm_tma split smoke {epilogue} M={M} N={N} K={K} split={split} width={width}")


@pytest.mark.parametrize("width, split", SPLIT_BUILDS)
@pytest.mark.parametrize("epilogue", EPILOGUES)
@pytest.mark.parametrize("M, N, K", SPLIT_SHAPES)
def test_gemm_tma_every_split(M, N, K, epilogue, split, width, buf, stream):
    check_linear(buf, stream, M, N, K, epilogue, "gemm", launch=run(epilogue, stream, split=split, width=width),
                 label=f"gemm_tma {epilogue} M={M} N={N} K={K} split={split} width={width}")


@pytest.mark.parametrize("M", [65, 128, 144, 256, 300, 512, 768, 1000, 1100, 1500, 2000, 2100])
@pytest.mark.parametrize("matrix", list(MODEL))
def test_gemm_tma_model_shapes_as_planned(matrix, M, buf, stream):
    # The launcher's own choice (what the engine runs), at the model's epilogue.
    N, K, epilogue = MODEL[matrix]
    plan = tma_plan(M, N, K, epilogue, get_device().info.num_sms, cluster_slots())
    check_linear(buf, stream, M, N, K, epilogue, "gemm", launch=run(epilogue, stream),
                 label=f"gemm_tma {matrix} {epilogue} M={M} planned {plan}")


@pytest.mark.parametrize("M", [33, 48, 64])
@pytest.mark.parametrize("N, K", [MODEL["4b-gu"][:2], (24576, 4096)])
def test_gemm_tma_gate_up_of_33_to_64_rows_as_planned(N, K, M, buf, stream):
    # qwen3-4b's and qwen3-8b's gate/up, which default_path puts on the TMA GEMM at 33-64 rows (TMA_GATE_UP_ROWS):
    # one partial row tile.
    assert default_path(M, N, K, "silu_mul", get_device().info.num_sms) == "gemm"
    plan = tma_plan(M, N, K, "silu_mul", get_device().info.num_sms, cluster_slots())
    check_linear(buf, stream, M, N, K, "silu_mul", "gemm", launch=run("silu_mul", stream),
                 label=f"gemm_tma gate/up M={M} N={N} K={K} planned {plan}")


@pytest.mark.parametrize("split", TMA_SPLITS)
@pytest.mark.parametrize("matrix", list(MODEL))
def test_gemm_tma_model_shapes_every_split(matrix, split, buf, stream):
    N, K, epilogue = MODEL[matrix]
    check_linear(buf, stream, 256, N, K, epilogue, "gemm", launch=run(epilogue, stream, split=split),
                 label=f"gemm_tma {matrix} {epilogue} M=256 split={split}")


@pytest.mark.parametrize("split", TMA_SPLITS)
@pytest.mark.parametrize("epilogue", EPILOGUES)
def test_gemm_tma_split_is_deterministic(epilogue, split, buf, stream):
    # The rank-ordered sum: two launches give the same bits (residual: from the same starting values).
    rng = np.random.default_rng(11)
    M, N, K = 300, 1032, 2056
    x, w = buf.upload(rand_bf16(rng, (M, K))), buf.upload(linear_weight(N, K))
    shape = (M, N // 2) if epilogue == "silu_mul" else (M, N)
    dtype = BF16 if epilogue in ("bf16", "silu_mul") else F32
    old = rng.standard_normal(shape, dtype=np.float32)
    outs = []
    for _ in range(2):
        out = buf.upload(old) if epilogue == "residual" else buf.poisoned(shape, dtype)
        gemm(x, w, out, epilogue, stream, split=split, width=128)
        outs.append(out.to_host(stream))
    assert outs[0].tobytes() == outs[1].tobytes(), f"gemm_tma {epilogue} split={split}: two launches differ"


# The 256-row tiles (each consumer warpgroup two m64 wgmmas a k16): every build at every epilogue, on a tile whose
# second A box lies partly past M (200 rows) and wholly past it (100: not loaded), two row tiles with a partial
# second (300), qwen3-4b's o_proj at 256 rows, and the persistent builds with 3 blocks walking many tiles.
TALL_BUILDS = [(w, ks) for w, splits in TMA_TALL_SPLITS.items() for ks in splits]
TALL_SHAPES = [(200, 264, 456), (100, 520, 1000), (300, 1032, 2056), (256, 2560, 4096)]


@pytest.mark.parametrize("width, split", TALL_BUILDS)
@pytest.mark.parametrize("epilogue", EPILOGUES)
@pytest.mark.parametrize("M, N, K", TALL_SHAPES)
def test_gemm_tma_tall_tiles(M, N, K, epilogue, width, split, buf, stream):
    check_linear(buf, stream, M, N, K, epilogue, "gemm",
                 launch=run(epilogue, stream, rows=TMA_TALL, width=width, split=split),
                 label=f"gemm_tma {epilogue} M={M} N={N} K={K} rows={TMA_TALL} width={width} split={split}")
    if split == 1 and M == 300:
        check_linear(buf, stream, 1000, N, K, epilogue, "gemm",
                     launch=run(epilogue, stream, rows=TMA_TALL, width=width, blocks=3),
                     label=f"gemm_tma {epilogue} M=1000 N={N} K={K} rows={TMA_TALL} width={width} blocks=3")


def test_gemm_tma_variants_agree_up_to_summation_order(buf, stream):
    rng = np.random.default_rng(7)
    M, N, K = 256, 2048, 2560
    x, w = buf.upload(rand_bf16(rng, (M, K))), buf.upload(linear_weight(N, K))
    kws = [dict(width=256, split=1), dict(width=128, split=1, blocks=7)] + [dict(width=128, split=s) for s in TMA_SPLITS]
    got = []
    for kw in kws:
        out = buf.poisoned((M, N), F32)
        gemm(x, w, out, "f32", stream, **kw)
        got.append(out.to_host(stream))
    for kw, g in zip(kws[1:], got[1:]):
        assert np.abs(g - got[0]).max() <= 1e-4 * np.abs(got[0]).max(), kw


@pytest.mark.parametrize("epilogue", EPILOGUES)
@pytest.mark.parametrize("M", [65, 144, 300])
def test_gemm_tma_reads_whole_tiles_of_a_larger_buffer(M, epilogue, buf, stream):
    # x the first M rows of a buffer of whole 128-row tiles whose other rows are NaN, out the first M rows of a
    # larger poisoned buffer: the tensor map covers the whole tiles (tile_rows), the rows past M are never
    # stored, and the M rows come out bit for bit as from an x of exactly M rows (the planned launch and a split).
    rng = np.random.default_rng(M)
    N, K = 520, 1000
    rows = -(-M // 128) * 128
    x = rand_bf16(rng, (M, K))
    big = np.full((rows, K), np.nan, dtype=BF16)
    big[:M] = x
    x_view = buf.upload(big).rows(0, M)
    assert tile_rows(x_view, 128) == rows
    w = buf.upload(linear_weight(N, K))
    shape = (rows, N // 2) if epilogue == "silu_mul" else (rows, N)
    dtype = BF16 if epilogue in ("bf16", "silu_mul") else F32
    old = rng.standard_normal(shape, dtype=np.float32)
    for kw in (dict(), dict(split=2, width=128), dict(rows=TMA_TALL, width=96, split=4)):
        exact = buf.upload(old[:M]) if epilogue == "residual" else buf.poisoned((M,) + shape[1:], dtype)
        gemm(buf.upload(x), w, exact, epilogue, stream, **kw)
        whole = buf.upload(old) if epilogue == "residual" else buf.poisoned(shape, dtype)
        gemm(x_view, w, whole.rows(0, M), epilogue, stream, **kw)
        got, want, before = whole.to_host(stream), exact.to_host(stream), buf.poisoned(shape, dtype).to_host(stream)
        if epilogue == "residual":
            before = old
        assert got[:M].tobytes() == want.tobytes(), f"{epilogue} M={M} {kw}: the M rows differ"
        assert got[M:].tobytes() == before[M:].astype(got.dtype).tobytes(), \
            f"{epilogue} M={M} {kw}: rows past M written"


def test_cluster_slots_come_from_the_driver():
    slots = cluster_slots()
    sms = get_device().info.num_sms
    assert set(slots) == set(TMA_SPLITS)
    for split, n in slots.items():
        assert n % split == 0 and 0 < n <= sms, (split, n)
