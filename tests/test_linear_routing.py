"""Which kernel linear() runs for each decode and prefill shape (its routing, in
tileinfer.kernels.routing), and that the launcher's sizes and kernel names are the kernels' own. The
choices come from H200 measurements (scripts/bench_gemm_small.py, docs/benchmarks.md); this pins them so
a change to the routing is deliberate. CPU only."""
import importlib
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tileinfer.cuda.compiler import compile_source, cuda_src_dir
from tileinfer.kernels.linear import forced_plan
from tileinfer.kernels.routing import (SWAP_BATCHES, SWAP_DEEP_STAGES, SWAP_SPLITS, SWAP_STAGES, SWAP_TILE,
                                      TMA_MULTICAST_ROWS, TMA_RESIDUAL_PLAN_ROWS, TMA_RESIDUAL_ROUND_MAX_MACS,
                                      TMA_RESIDUAL_SPLIT_ROWS, TMA_ROUND_WIDTHS, TMA_TAIL_SPLIT_ROWS, TMA_TALL,
                                      TMA_TALL_MAX_ROWS, TMA_WIDTHS, TmaPlan, default_path, fuses_norm, gemv_ksplit,
                                      norm_kernel_name, swap_config, tma_kernel_name, tma_multicast, tma_plan,
                                      tma_split_built, tma_tail_split, tma_tall_rows, tma_tiles, tma_width)
from tileinfer.model.config import preset

# The routing module, its sizes and kernel names.
L = importlib.import_module("tileinfer.kernels.routing")


def default_paths(name: str, M: int) -> dict[str, str]:
    """default_path of each of a model's matrices at M rows (N, K and the epilogue each its own; Apertus' up
    product under the key gate_up)."""
    c = preset(name)
    up = (2 * c.intermediate_size, c.hidden_size, "silu_mul") if c.mlp == "gated_silu" else \
        (c.intermediate_size, c.hidden_size, "xielu")
    products = {"qkv": (c.qkv_size, c.hidden_size, "bf16"), "o": (c.hidden_size, c.q_size, "residual"), "gate_up": up,
                "down": (c.hidden_size, c.intermediate_size, "residual"),
                "lm_head": (c.vocab_size, c.hidden_size, "f32")}
    return {matrix: default_path(M, N, K, epilogue) for matrix, (N, K, epilogue) in products.items()}


@pytest.mark.parametrize("M", [1, 2])
def test_one_or_two_rows_take_the_gemv(M):
    assert set(default_paths("qwen3-8b", M).values()) == {"gemv"}


@pytest.mark.parametrize("M", [3, 5, 8, 9, 16, 32])
def test_batches_and_verify_steps_of_3_to_32_rows_take_the_swap_gemm(M):
    # M = 5 is a k = 4 verify step; every matrix, the LM head included.
    for model in ("qwen3-0.6b", "qwen3-4b", "qwen3-8b", "apertus-8b"):
        assert set(default_paths(model, M).values()) == {"swap"}, model


@pytest.mark.parametrize("M", [33, 48, 64])
def test_at_33_to_64_rows_a_gate_up_product_beyond_a_wave_of_swap_blocks_takes_the_tma_gemm(M):
    # qwen3-4b's and qwen3-8b's gate/up (304 and 384 swap-AB blocks for 264 slots); qwen3-0.6b's (192) keeps the
    # swap-AB GEMM, as does Apertus' up product (xIELU, no TMA_GATE_UP_ROWS rule). The other matrices stay.
    for model in ("qwen3-4b", "qwen3-8b"):
        paths = default_paths(model, M)
        assert paths.pop("gate_up") == "gemm" and set(paths.values()) == {"swap"}, model
    for model in ("qwen3-0.6b", "apertus-8b"):
        assert set(default_paths(model, M).values()) == {"swap"}, model
    c = preset("qwen3-4b")  # on a GPU of 200 SMs its 304 swap-AB blocks fit in a wave: the swap-AB GEMM
    assert default_path(M, 2 * c.intermediate_size, c.hidden_size, "silu_mul", sms=200) == "swap"


@pytest.mark.parametrize("M", [0, 65, 128, 256, 4096])
def test_batches_past_64_and_prefill_take_the_tma_gemm(M):
    for model in ("qwen3-0.6b", "qwen3-4b"):
        assert set(default_paths(model, M).values()) == {"gemm"}, model


def test_gemv_split_keeps_the_grid_within_one_wave():
    # Batch 1 on qwen3-4b: QKV (3,072 row pairs of 2,560) gets 1 warp per pair, o_proj (1,280 pairs of
    # 4,096) 2, down_proj (1,280 pairs of 9,728) 2: a third of a wave more would start a second one.
    target = 4 * 132 * 8
    c = preset("qwen3-4b")
    assert gemv_ksplit(c.qkv_size // 2, c.hidden_size) == 1
    assert gemv_ksplit(c.hidden_size // 2, c.num_attention_heads * c.head_dim) == 2
    assert gemv_ksplit(c.hidden_size // 2, c.intermediate_size) == 2
    for pairs in (1, 64, 500, 1024, 2048, 4096, 151936 // 2):
        for K in (256, 1024, 4096, 12288):
            ks = gemv_ksplit(pairs, K)
            assert ks in (1, 2, 4, 8)
            assert ks == 1 or (pairs * ks <= target and K >= 512 * ks)
            # the next split would pass one wave, a short row or the largest split
            assert ks == 8 or pairs * ks * 2 > target or K < 512 * ks * 2


def test_only_short_batch_1_qkv_rows_take_the_64_register_norm_gemv():
    # qwen3-0.6b's QKV (K = 1,024) takes gemv_norm_m1_e0_b4; 4b's and 8b's (2,560, 4,096), gate/up and
    # batch 2 keep their own builds.
    assert norm_kernel_name(1, preset("qwen3-0.6b").hidden_size, "bf16") == "gemv_norm_m1_e0_b4"
    assert norm_kernel_name(1, preset("qwen3-4b").hidden_size, "bf16") == "gemv_norm_m1_e0"
    assert norm_kernel_name(1, preset("qwen3-8b").hidden_size, "bf16") == "gemv_norm_m1_e0"
    assert norm_kernel_name(1, 1024, "silu_mul") == "gemv_norm_m1_e2"
    assert norm_kernel_name(2, 1024, "bf16") == "gemv_norm_m2_e0"


def test_tma_tma_width():
    # qwen3-4b at 4,096 tokens: QKV and gate/up on 128 x 256 tiles, o_proj and down_proj (N = 2560) on
    # 128 x 128 (320 wide tiles are 2.4 rounds of 132 SMs, 640 narrow ones 4.85).
    c = preset("qwen3-4b")
    assert tma_width(4096, c.qkv_size, False) == 256
    assert tma_width(4096, 2 * c.intermediate_size, True) == 256
    assert tma_width(4096, c.hidden_size, False) == 128
    assert tma_tiles(4096, c.hidden_size, False, 256) == 32 * 10
    assert tma_tiles(4096, 2 * c.intermediate_size, True, 256) == 32 * 76
    assert tma_tiles(1, 8, False, 128) == 1


H200_SLOTS = {2: 132, 3: 117, 4: 120}  # cluster_slots() on the H200


def test_tma_plan_splits_only_within_one_wave():
    # qwen3-4b at 256 rows: down_proj (152 k-steps) and o_proj on 4 blocks a 256-row tile 96 wide (108 blocks;
    # down_proj's 20 wide tiles on 4 a tile were slower); at 512 rows down_proj's 80 narrow tiles would
    # need 3 waves of 4-block clusters (measured slower) and stay unsplit (in 108 tiles 96 wide: one round still).
    # At 96 rows its gate/up takes one round of wide tiles (two of narrow ones were faster alone, slower in the
    # engine), now 160 wide (122 tiles, one round, each 1.25 narrow k-steps against 1.84). Prefill-sized products
    # split only when they are residual ones (below).
    c = preset("qwen3-4b")
    # o_proj and down_proj: 27 tiles of 256 x 96, 4 ways (108 blocks), not 40 narrow ones of 128 rows (80 blocks)
    assert tma_plan(256, c.hidden_size, c.intermediate_size, "residual", 132, H200_SLOTS) == TmaPlan(96, 4, rows=256)
    assert tma_plan(96, 2 * c.intermediate_size, c.hidden_size, "silu_mul", 132, H200_SLOTS) == TmaPlan(160, 1)
    o_k = c.num_attention_heads * c.head_dim
    assert tma_plan(256, c.hidden_size, o_k, "residual", 132, H200_SLOTS) == TmaPlan(96, 4, rows=256)
    assert tma_plan(512, c.hidden_size, c.intermediate_size, "residual", 132, H200_SLOTS) == TmaPlan(96, 1)
    assert tma_plan(4096, c.qkv_size, c.hidden_size, "bf16", 132, H200_SLOTS) == TmaPlan(256, 1, 1, True)
    assert tma_plan(4096, 2 * c.intermediate_size, c.hidden_size, "silu_mul", 132, H200_SLOTS) == \
        TmaPlan(256, 1, 2, True)
    for M in (65, 128, 256, 300, 512, 1000):
        for n, k, epilogue in ((c.qkv_size, c.hidden_size, "bf16"), (2 * c.intermediate_size, c.hidden_size, "silu_mul"),
                               (c.hidden_size, c.intermediate_size, "residual"), (1024, 8, "bf16")):
            silu = epilogue == "silu_mul"
            plan = tma_plan(M, n, k, epilogue, 132, H200_SLOTS)
            width, split, rows = plan.width, plan.split, plan.rows
            assert width in TMA_WIDTHS + TMA_ROUND_WIDTHS and plan.tail == 1  # no split last round below
            assert split == 1 or tma_split_built(width, split, rows)          # TMA_TAIL_SPLIT_ROWS
            assert split == 1 or tma_tiles(M, n, silu, width, rows) * split <= H200_SLOTS[split]
            assert split == 1 or -(-k // 64) >= 2 * split


def test_short_k_products_stay_unsplit_where_a_split_costs_more_than_it_shares():
    # A split's fixed cost (its cluster and reduction) outweighs half of qwen3-0.6b's 16 k-steps: its QKV at 65-256 rows
    # and gate/up at 65-128 run unsplit 64 wide (TMA_ROUND_WIDTHS; QKV at 96 rows, alone on an H100: 6.7 us, 7.3 unsplit
    # 96 wide, 8.8 split 2 ways), its gate/up at 129-256 96 wide; its o_proj (32 k-steps) and down_proj (48) split 4
    # ways 96 wide (88 blocks: at 144 rows, alone on an H100, 7.9 / 9.4 us against 8.5 split 2 ways 96 wide / 11.2 split
    # 4 ways 128 wide); qwen3-4b's products of 40-152 k-steps split as before, its o_proj and down_proj up to 128 rows 4
    # ways 96 wide (108 blocks: at 96 rows 12.2 / 23.5 us against 14.0 / 26.4 128 wide), from 129 rows 2 ways (the 4-way
    # split's 216 blocks would not fit at once; from 129 rows the 256-row tiles split 4 ways:
    # test_tall_tiles_where_the_cost_model_...).
    c = preset("qwen3-0.6b")
    o_k = c.num_attention_heads * c.head_dim
    for M in (65, 96, 128, 144, 256):
        assert tma_plan(M, c.qkv_size, c.hidden_size, "bf16", 132, H200_SLOTS) == TmaPlan(64, 1)
        assert tma_plan(M, c.hidden_size, o_k, "residual", 132, H200_SLOTS) == TmaPlan(96, 4)
        assert tma_plan(M, c.hidden_size, c.intermediate_size, "residual", 132, H200_SLOTS) == TmaPlan(96, 4)
    for M in (65, 96, 128):
        assert tma_plan(M, 2 * c.intermediate_size, c.hidden_size, "silu_mul", 132, H200_SLOTS) == TmaPlan(64, 1)
    for M in (129, 144, 256):
        assert tma_plan(M, 2 * c.intermediate_size, c.hidden_size, "silu_mul", 132, H200_SLOTS) == TmaPlan(96, 1)
    big = preset("qwen3-4b")
    big_o_k = big.num_attention_heads * big.head_dim
    for M in (65, 96, 128):
        assert tma_plan(M, big.hidden_size, big.intermediate_size, "residual", 132, H200_SLOTS) == TmaPlan(96, 4)
        assert tma_plan(M, big.hidden_size, big_o_k, "residual", 132, H200_SLOTS) == TmaPlan(96, 4)
    assert tma_plan(129, big.hidden_size, big.intermediate_size, "residual", 132, H200_SLOTS) == \
        TmaPlan(96, 4, rows=256)
    assert tma_plan(96, big.qkv_size, big.hidden_size, "bf16", 132, H200_SLOTS) == TmaPlan(96, 2)
    eight = preset("qwen3-8b")  # N = 4,096: 43 tiles 96 wide, 172 blocks split 4 ways, more than fit at once
    assert tma_plan(96, eight.hidden_size, eight.intermediate_size, "residual", 132, H200_SLOTS) == TmaPlan(128, 3)


@settings(max_examples=400, deadline=None)
@given(M=st.integers(65, 8192), n8=st.integers(1, 20000), k8=st.integers(1, 2048),
       epilogue=st.sampled_from(sorted(L.EPILOGUES)), slots=st.sampled_from([H200_SLOTS, {2: 120, 3: 117, 4: 120},
                                                                            {3: 117}, {}]))
def test_tma_plan_asks_only_for_builds_that_exist(M, n8, k8, epilogue, slots):
    # Any product shape: the plan's kernels are gemm_tma.cu builds, a round width only for the persistent kernel
    # (no split, tail or multicast) below TMA_TAIL_SPLIT_ROWS rows or for a prefill-sized residual product, a split
    # only as a whole resident wave (but the residual products' from TMA_RESIDUAL_PLAN_ROWS rows, which take as many
    # waves as they need).
    N, K = 8 * n8 * (2 if epilogue == "silu_mul" else 1), 8 * k8
    plan = tma_plan(M, N, K, epilogue, 132, slots)
    builds = every_kernel_name()["gemm_tma.cu"]
    assert tma_kernel_name(plan.width, plan.split, epilogue, plan.multicast, plan.rows) in builds
    assert plan.rows == 128 or (tma_tall_rows(M) and plan.tail == 1 and not plan.multicast)
    if plan.tail > 1:
        assert tma_kernel_name(plan.width, plan.tail, epilogue) in builds
    if plan.width in TMA_ROUND_WIDTHS:
        assert plan.tail == 1 and not plan.multicast
        prefill_residual = epilogue == "residual" and M >= TMA_RESIDUAL_PLAN_ROWS
        assert (plan.split == 1 and (M < TMA_TAIL_SPLIT_ROWS or prefill_residual or plan.rows == TMA_TALL)) or \
            tma_split_built(plan.width, plan.split)
    tiles = tma_tiles(M, N, epilogue == "silu_mul", plan.width, plan.rows)
    assert tiles >= 1
    if plan.split > 1 and not (epilogue == "residual" and M >= TMA_RESIDUAL_PLAN_ROWS):
        assert tiles * plan.split <= slots[plan.split]


def test_tall_tiles_where_the_cost_model_finds_them_cheaper():
    # 129-256 rows: one row tile of 256 where the cost model finds it cheaper (TMA_TALL_COST, fitted on an H100):
    # qwen3-4b's gate/up in 122 tiles 160 wide (one round, against the 128-row tiles' two), its o_proj and down_proj
    # split 4 ways 96 wide; qwen3-8b's gate/up in 256 tiles 96 wide (two rounds, against three of 128-row tiles 128
    # wide). qwen3-0.6b's products (16-48 k-steps) and the QKV products keep their 128-row tiles there.
    four, eight, small = preset("qwen3-4b"), preset("qwen3-8b"), preset("qwen3-0.6b")
    for M in (129, 144, 200, 256):
        assert tma_plan(M, 2 * four.intermediate_size, four.hidden_size, "silu_mul", 132, H200_SLOTS) == \
            TmaPlan(160, 1, rows=256)
        assert tma_plan(M, four.hidden_size, four.intermediate_size, "residual", 132, H200_SLOTS) == \
            TmaPlan(96, 4, rows=256)
        assert tma_plan(M, 2 * eight.intermediate_size, eight.hidden_size, "silu_mul", 132, H200_SLOTS) == \
            TmaPlan(96, 1, rows=256)
        for c in (four, eight, small):
            assert tma_plan(M, c.qkv_size, c.hidden_size, "bf16", 132, H200_SLOTS).rows == 128
        for n, k, epilogue in ((small.qkv_size, small.hidden_size, "bf16"),
                               (2 * small.intermediate_size, small.hidden_size, "silu_mul"),
                               (small.hidden_size, small.intermediate_size, "residual")):
            assert tma_plan(M, n, k, epilogue, 132, H200_SLOTS).rows == 128
    # 385-512 rows (two 256-row tiles, the last more than half full): qwen3-4b's and qwen3-8b's QKV in 128 tiles 96
    # wide (one round, against two of 128-row tiles), qwen3-4b's gate/up in 244 tiles 160 wide.
    for M in (385, 448, 512):
        assert tma_plan(M, 2 * four.intermediate_size, four.hidden_size, "silu_mul", 132, H200_SLOTS) == \
            TmaPlan(160, 1, rows=256)
        for c in (four, eight):
            assert tma_plan(M, c.qkv_size, c.hidden_size, "bf16", 132, H200_SLOTS) == TmaPlan(96, 1, rows=256)
    assert [M for M in range(1, 4096) if tma_tall_rows(M)] == [M for M in range(129, TMA_TALL_MAX_ROWS + 1)
                                                                if -M % 256 < 128]
    for M in (65, 128, 257, 320, 384, 513, 640, 896, 1025, 1537, 1792, 2048, 4096):
        for c in (four, eight):
            for n, k, epilogue in ((2 * c.intermediate_size, c.hidden_size, "silu_mul"),
                                   (c.qkv_size, c.hidden_size, "bf16")):
                assert tma_plan(M, n, k, epilogue, 132, H200_SLOTS).rows == 128
    assert tma_kernel_name(96, 4, "residual", rows=256) == "gemm_tma_m256_n96_s4_e1"
    assert tma_kernel_name(160, 1, "silu_mul", rows=256) == "gemm_tma_m256_n160_e2"
    for width, split in ((96, 2), (128, 1), (160, 2)):
        with pytest.raises(ValueError, match="256-row build"):
            tma_kernel_name(width, split, "bf16", rows=256)


def test_tma_round_widths_fill_the_rounds_of_batched_decode():
    # qwen3-4b at 256 rows: gate/up in 244 tiles of 160 (2 rounds of 132 SMs x 1.25) against 304 of 128 (3 x 1)
    # or 152 of 256 (2 x 1.84); QKV in 128 tiles of 96 (one round x 0.8) against 96 of 128 (one round x 1).
    c = preset("qwen3-4b")
    gate_up = (2 * c.intermediate_size, c.hidden_size, "silu_mul")
    qkv = (c.qkv_size, c.hidden_size, "bf16")
    assert tma_plan(257, *gate_up, 132, H200_SLOTS) == TmaPlan(256, 1)   # 129-256 rows: test_tall_tiles_...
    assert tma_tiles(256, gate_up[0], True, 160) == 2 * 122
    assert tma_plan(256, *qkv, 132, H200_SLOTS) == TmaPlan(96, 1)
    assert tma_tiles(256, qkv[0], False, 96) == 2 * 64
    # Past TMA_TAIL_SPLIT_ROWS rows only the widths every build kind has (the tail split, multicast), but for
    # the residual products (tma_residual_plan, below) and the 256-row tiles (tma_tall_rows).
    for M in (TMA_TAIL_SPLIT_ROWS + 1, TMA_TALL_MAX_ROWS + 1, 2048, 4096):
        for n, k, epilogue in (gate_up, qkv):
            assert tma_width(M, n, epilogue == "silu_mul") in TMA_WIDTHS
            assert tma_plan(M, n, k, epilogue, 132, H200_SLOTS).width in TMA_WIDTHS
    # A split launch without a width asks for one every build kind has.
    assert tma_width(256, gate_up[0], True, persistent=False) == 128
    assert tma_width(256, qkv[0], False, persistent=False) == 128
    # Their builds: the persistent kernel's, and 96 wide a 2-way split.
    assert tma_kernel_name(96, 1, "bf16") == "gemm_tma_n96_e0"
    assert tma_kernel_name(160, 1, "silu_mul") == "gemm_tma_n160_e2"
    assert tma_kernel_name(96, 2, "residual") == "gemm_tma_n96_s2_e1"
    for width, split, multicast, what in ((160, 2, False, "2-way split"), (96, 3, False, "3-way split"),
                                          (160, 1, True, "multicast"), (96, 1, True, "multicast")):
        with pytest.raises(ValueError, match=f"no {what} build {width} wide"):
            tma_kernel_name(width, split, "bf16", multicast)


def test_tma_plan_splits_prefill_residual_products_two_ways_or_runs_them_160_wide():
    # From TMA_RESIDUAL_SPLIT_ROWS rows on, o_proj and down_proj split 2 ways over as many waves as it takes
    # (qwen3-8b at 4,096 rows in wide tiles: 1,024 blocks, 8 waves; qwen3-0.6b at 1,024 rows in narrow ones, 128
    # blocks, one wave), unless the persistent kernel 160 wide costs less: qwen3-4b, whose N = 2,560 is 16 such
    # tiles (at 1,024 rows one round of 128 tiles, against 3 waves of the narrow split's 320 blocks).
    for model, plans in (("qwen3-4b", {1024: TmaPlan(160, 1), 2048: TmaPlan(160, 1), 4096: TmaPlan(160, 1)}),
                         ("qwen3-8b", {1024: TmaPlan(256, 2), 2048: TmaPlan(256, 2), 4096: TmaPlan(256, 2)}),
                         ("qwen3-0.6b", {1024: TmaPlan(128, 2), 2048: TmaPlan(256, 2), 4096: TmaPlan(256, 2)})):
        c = preset(model)
        for n, k in ((c.hidden_size, c.num_attention_heads * c.head_dim), (c.hidden_size, c.intermediate_size)):
            for M, plan in plans.items():
                assert tma_plan(M, n, k, "residual", 132, H200_SLOTS) == plan, (model, n, k, M)
    # Past TMA_RESIDUAL_ROUND_MAX_MACS multiply-adds a product splits whatever its rounds: qwen3-32b's down_proj
    # (N = 5,120, 32 tiles of 160) runs 160 wide at 1,024 rows, split from 2,048.
    c = preset("qwen3-32b")
    assert c.hidden_size * c.intermediate_size * 1024 <= TMA_RESIDUAL_ROUND_MAX_MACS
    assert tma_plan(1024, c.hidden_size, c.intermediate_size, "residual", 132, H200_SLOTS) == TmaPlan(160, 1)
    assert tma_plan(2048, c.hidden_size, c.intermediate_size, "residual", 132, H200_SLOTS) == TmaPlan(256, 2)
    c = preset("qwen3-4b")
    for n, k in ((c.hidden_size, c.num_attention_heads * c.head_dim), (c.hidden_size, c.intermediate_size)):
        below = TMA_RESIDUAL_SPLIT_ROWS - 1  # the one-wave rule again
        plan = tma_plan(below, n, k, "residual", 132, H200_SLOTS)
        width, split = plan.width, plan.split
        assert split == 1 or tma_tiles(below, n, False, width) * split <= H200_SLOTS[split]
    # From TMA_RESIDUAL_PLAN_ROWS rows, where no one-wave split is cheaper in the cost model, the same plan instead of
    # the persistent kernel at tma_width: qwen3-4b at 640 and 768 rows split 2 ways 256 wide (100 and 120 blocks,
    # not 128 wide unsplit), at 896 rows 160 wide; qwen3-8b at 512 rows split; qwen3-0.6b keeps its one-wave
    # split 96 wide at 640 rows; below TMA_RESIDUAL_PLAN_ROWS the general rule alone.
    for M, plan in ((640, TmaPlan(256, 2)), (768, TmaPlan(256, 2)), (896, TmaPlan(160, 1))):
        for n, k in ((c.hidden_size, c.num_attention_heads * c.head_dim), (c.hidden_size, c.intermediate_size)):
            assert tma_plan(M, n, k, "residual", 132, H200_SLOTS) == plan, (M, n, k)
    c8 = preset("qwen3-8b")
    assert tma_plan(512, c8.hidden_size, c8.intermediate_size, "residual", 132, H200_SLOTS) == TmaPlan(256, 2)
    c06 = preset("qwen3-0.6b")
    assert tma_plan(640, c06.hidden_size, c06.intermediate_size, "residual", 132, H200_SLOTS) == TmaPlan(96, 2)
    assert tma_plan(TMA_RESIDUAL_PLAN_ROWS - 1, c8.hidden_size, c8.intermediate_size, "residual", 132,
                    H200_SLOTS).split == 1
    # Too few k-steps for two ranks of two each: no split.
    assert tma_plan(4096, 1024, 192, "residual", 132, H200_SLOTS).split == 1


def test_tma_multicast_pairs_even_row_tiles_from_2048_rows():
    # The persistent kernel's multicast build needs its tiles 2q, 2q + 1 under one column tile (an even number of
    # row tiles) and a whole grid of 2-block clusters resident; split plans never take it.
    c = preset("qwen3-4b")
    qkv = (c.qkv_size, c.hidden_size, "bf16")
    assert tma_plan(TMA_MULTICAST_ROWS, *qkv, 132, H200_SLOTS).multicast
    assert not tma_plan(TMA_MULTICAST_ROWS - 128, *qkv, 132, H200_SLOTS).multicast
    assert not tma_plan(TMA_MULTICAST_ROWS + 1, *qkv, 132, H200_SLOTS).multicast     # 17 row tiles
    assert tma_plan(TMA_MULTICAST_ROWS + 129, *qkv, 132, H200_SLOTS).multicast       # 18
    assert not tma_plan(4096, *qkv, 132, {3: 117, 4: 120}).multicast                 # no 2-block clusters
    assert not tma_plan(4096, *qkv, 132, {2: 120, 3: 117, 4: 120}).multicast         # 60 clusters, not 66
    assert tma_multicast(4096, 131, {2: 130})                                        # the grid's 130 blocks
    assert not tma_plan(4096, c.hidden_size, c.intermediate_size, "residual", 132, H200_SLOTS).multicast
    assert tma_kernel_name(256, 1, "silu_mul", multicast=True) == "gemm_tma_mc_e2"
    assert tma_kernel_name(128, 1, "bf16", multicast=True) == "gemm_tma_n128_mc_e0"


def test_tma_tail_split_takes_the_idle_sms_of_the_last_round():
    # qwen3-4b at 4,096 rows: gate/up's 2,432 wide tiles are 18 rounds and 56 tiles, the 56 split 2 ways (3 ways
    # would need 168 blocks at once); QKV's 768 are 5 rounds and 108 tiles, which no split fits in one wave.
    c = preset("qwen3-4b")
    up_tiles = tma_tiles(4096, 2 * c.intermediate_size, True, 256)
    assert up_tiles % 132 == 56 and tma_tail_split(up_tiles, c.hidden_size, 256, 132, H200_SLOTS) == 2
    assert tma_tail_split(tma_tiles(4096, c.qkv_size, False, 256), c.hidden_size, 256, 132, H200_SLOTS) == 1
    # Whole rounds, or fewer tiles than SMs: nothing to split.
    assert tma_tail_split(264, 4096, 256, 132, H200_SLOTS) == 1
    assert tma_tail_split(100, 4096, 256, 132, H200_SLOTS) == 1
    # A few tiles left over: the widest split that fits, if it beats the unsplit round.
    assert tma_tail_split(132 + 30, 4096, 128, 132, H200_SLOTS) == 4
    # Too few k-steps for any split's ranks: none.
    assert tma_tail_split(132 + 30, 64, 128, 132, H200_SLOTS) == 1
    # Below TMA_TAIL_SPLIT_ROWS the plan has no split last round.
    assert tma_plan(TMA_TAIL_SPLIT_ROWS - 128, 2 * c.intermediate_size, c.hidden_size, "silu_mul", 132,
                    H200_SLOTS).tail == 1


def test_swap_config_matches_the_kernels():
    """Launch arithmetic against gemm_swap.cu: STAGES per batch width, the kernels built, grids that cover N."""
    src = (cuda_src_dir() / "gemm_swap.cu").read_text()
    m = re.search(r"STAGES = WG == 1 \? \(B == 16 \? (\d+) : B == 32 \? (\d+) : (\d+)\)", src)
    assert m, "Cfg::STAGES not found in gemm_swap.cu"
    assert dict(zip(SWAP_BATCHES, map(int, m.groups()))) == SWAP_STAGES
    for tag, B, deep in [*((f"b{B}", B, "false") for B in SWAP_BATCHES), ("b16d", 16, "true")]:
        for half in ("1_2", "4_8"):  # each width's splits KS = 1, 2 and KS = 4, 8 (SWAP_SPLITS)
            assert f"SWAP_SPLITS_{half}({tag}, {B}, 1, {deep})" in src, f"{tag}'s KS = {half} builds"
    assert f"#define DEEP_STAGES {SWAP_DEEP_STAGES}\n" in src
    c4, c06 = preset("qwen3-4b"), preset("qwen3-0.6b")
    for N, K, epilogue in [(c4.qkv_size, 2560, "bf16"), (2560, 9728, "residual"), (19456, 2560, "silu_mul"),
                           (151936, 1024, "f32"), (8, 8, "silu_mul"), (136, 1000, "bf16"), (c06.hidden_size, 2048, "residual")]:
        for M in (0, 1, 9, 16, 17, 32, 33, 64):
            cfg = swap_config(M, N, K, epilogue)
            ks, tiles = cfg.grid
            assert cfg.B >= M and cfg.B in SWAP_BATCHES and ks in SWAP_SPLITS and cfg.smem <= 227 * 1024
            assert ks == 1 or -(-K // 64) >= 2 * ks
            assert not cfg.deep or (cfg.B == 16 and ks * tiles <= 132)
            if epilogue == "silu_mul":
                assert tiles * SWAP_TILE // 2 >= N // 2 > (tiles - 1) * SWAP_TILE // 2
            else:
                assert tiles * SWAP_TILE >= N > (tiles - 1) * SWAP_TILE
    with pytest.raises(ValueError, match="0 <= M <= 64"):
        swap_config(65, 1024, 1024, "bf16")
    with pytest.raises(ValueError, match="ksplit"):
        swap_config(16, 1024, 1024, "bf16", ksplit=3)


def test_swap_split_is_the_fewest_that_fill_the_gpu():
    # The H200 sweep's best splits: qwen3-4b at M = 16: QKV (96 tiles) 2, o_proj and down_proj
    # (40 tiles) 4, gate/up (304 tiles) 1; qwen3-0.6b's o_proj and down_proj (16 tiles) 8.
    assert swap_config(16, 6144, 2560, "bf16").ksplit == 2
    assert swap_config(16, 2560, 4096, "residual").ksplit == 4
    assert swap_config(16, 2560, 9728, "residual").ksplit == 4
    assert swap_config(16, 19456, 2560, "silu_mul").ksplit == 1
    assert swap_config(64, 1024, 3072, "residual").ksplit == 8
    assert swap_config(64, 1024, 8, "residual").ksplit == 1  # one k-chunk: nothing to split


def test_deep_swap_builds_take_long_rows_on_one_block_an_sm():
    # qwen3-8b's o_proj at a k = 4 verify step (5 rows): 64 tiles x 2 blocks, 64 k-chunks: the deep build.
    # qwen3-0.6b's o_proj (16 tiles x 8 blocks, 32 k-chunks: 4 a block) and any batch past 16 rows keep
    # the ordinary builds.
    deep = swap_config(5, 4096, 4096, "residual")
    assert deep.deep and deep.kernel_name == "gemm_swap_b16d_w1_c2" and deep.smem == L.swap_smem(16, True)
    assert not swap_config(5, 1024, 2048, "residual").deep
    assert not swap_config(17, 4096, 4096, "residual").deep


def test_norm_linear_fuses_only_the_gemv_after_a_norm():
    for M in (1, 2):
        assert fuses_norm("gemv", M, "bf16") and fuses_norm("gemv", M, "silu_mul")
        assert not fuses_norm("gemv", M, "residual") and not fuses_norm("gemm", M, "bf16")  # batch-invariant
    assert not fuses_norm("gemv", 4, "bf16")  # the GEMV takes 1 or 2 rows
    assert not fuses_norm("swap", 5, "bf16")


def every_kernel_name() -> dict[str, set[str]]:
    """Every build the launchers can ask for, by file."""
    gemv = {L.gemv_kernel_name(M, e, False, False) for M in L.GEMV_ROWS for e in L.EPILOGUES}
    gemv |= {L.gemv_kernel_name(1, e, True, False) for e in L.PIPE_EPILOGUES}
    gemv |= {L.gemv_kernel_name(1, "f32", pipe, True) for pipe in (False, True)}
    gemv |= {norm_kernel_name(M, K, e) for M in L.GEMV_ROWS for e in L.NORM_EPILOGUES
             for K in (L.NORM_SHORT_K, L.NORM_SHORT_K + 8)}
    swap = {L.SwapConfig(B, ks, (ks, 1), 0, deep).kernel_name + suffix
            for B in SWAP_BATCHES for deep in ((False, True) if B == 16 else (False,))
            for ks in SWAP_SPLITS for suffix in ("", "_np", "_nc")}
    # The MLP's flow (mlp_flow): the up product never on a deep build; with the norm statistics at B = 16 and 32.
    flow = {"_fp": [(64, False)], "_fc": [(16, False), (32, False), (64, False), (16, True)],
            "_nc_fp": [(16, False), (32, False)], "_np_fc": [(16, False), (32, False), (16, True)]}
    swap |= {L.SwapConfig(B, ks, (ks, 1), 0, deep).kernel_name + suffix
             for suffix, builds in flow.items() for B, deep in builds for ks in SWAP_SPLITS}
    tma = {L.tma_kernel_name(w, s, e) for w in L.TMA_WIDTHS for s in (1,) + L.TMA_SPLITS for e in L.EPILOGUES}
    tma |= {L.tma_kernel_name(w, 1, e) for w in L.TMA_ROUND_WIDTHS for e in L.EPILOGUES}
    tma |= {L.tma_kernel_name(w, s, e) for w, splits in L.TMA_ROUND_SPLITS.items() for s in splits for e in L.EPILOGUES}
    tma |= {L.tma_kernel_name(w, 1, e, multicast=True) for w in L.TMA_WIDTHS for e in L.EPILOGUES}
    tma |= {L.tma_kernel_name(w, s, e, rows=L.TMA_TALL) for w, splits in L.TMA_TALL_SPLITS.items() for s in splits
            for e in L.EPILOGUES}
    return {"gemv.cu": gemv, "gemm_swap.cu": swap, "gemm_tma.cu": tma}


def launch_constants() -> dict[str, list[str]]:
    """static_asserts that the launcher's sizes are the kernels' own, by file."""
    epilogues = " && ".join(f"EPI_{e.upper()} == {v}" for e, v in L.EPILOGUES.items())
    swap = [f"BK == {L.SWAP_BK} && SS_LOADS * 32 == {L.NORM_MAX_TILES} && DEEP_STAGES == {SWAP_DEEP_STAGES}",
            f"Cfg<16, 1>::THREADS == {L.SWAP_THREADS} && Cfg<16, 1>::TR == {SWAP_TILE}",
            f"Cfg<16, 1, true>::STAGES == {SWAP_DEEP_STAGES} && Cfg<16, 1, true>::SMEM == {L.swap_smem(16, True)}"]
    swap += [f"Cfg<{B}, 1>::STAGES == {SWAP_STAGES[B]} && Cfg<{B}, 1>::SMEM == {L.swap_smem(B, False)}"
             for B in SWAP_BATCHES]
    tma = [f"BM == {L.TMA_BM} && BK == {L.TMA_BK} && THREADS == {L.TMA_THREADS} && SMEM_BYTES == {L.TMA_SMEM}"
           f" && SMEM_BYTES_TALL == {L.TMA_TALL_SMEM}"]
    return {"gemv.cu": [f"WARPS == {L.GEMV_WARPS}", epilogues], "gemm_swap.cu": swap + [epilogues],
            "gemm_tma.cu": tma + [epilogues]}


@pytest.mark.parametrize("filename", ["gemv.cu", "gemm_swap.cu", "gemm_tma.cu"])
def test_launcher_sizes_and_names_match_the_kernels(filename, tmp_path, monkeypatch):
    # Compiled for plain sm_90 (its wgmma kernels trap, so the compile is quick); the sizes and names are
    # the same on sm_90a.
    monkeypatch.setenv("TILEINFER_CACHE", str(tmp_path))
    asserts = "".join(f'static_assert({cond}, "{cond}");\n' for cond in launch_constants()[filename])
    cubin = compile_source(f"{filename[:-3]}_constants.cu", f'#include "{filename}"\n{asserts}', "sm_90", None,
                           cuda_src_dir())
    missing = sorted(name for name in every_kernel_name()[filename] if name.encode() + b"\0" not in cubin)
    assert not missing, f"{filename} lacks the builds {missing}"


def test_gemv_segment_is_the_kernels():
    # A warp's load covers 32 lanes x 8 bf16 of a row; its segments lie GEMV_SEGMENT * ksplit apart.
    src = (cuda_src_dir() / "gemv.cu").read_text()
    assert f"step = {L.GEMV_SEGMENT} * ksplit" in src and f"kpart * {L.GEMV_SEGMENT} + lane * 8" in src
    assert L.GEMV_SEGMENT == 32 * 8


def test_the_tma_maps_of_x_cover_whole_tiles_where_its_allocation_continues():
    # gemm's tensor map of x: M rounded up to 128-row tiles within the array x is a view of (addresses only:
    # arrays made with ptr= allocate nothing).
    import numpy as np

    from tileinfer.cuda import DeviceArray
    from tileinfer.kernels.linear import tile_rows

    root = DeviceArray((300, 64), np.uint16, ptr=1 << 20)
    assert tile_rows(root.rows(0, 144), 128) == 256
    assert tile_rows(root.rows(0, 256), 128) == 256
    assert tile_rows(root.rows(0, 1), 128) == 128
    assert tile_rows(root.rows(100, 244), 128) == 200      # the allocation ends 200 rows on
    assert tile_rows(root.rows(200, 290).rows(0, 50), 128) == 100  # a view of a view: the root's end
    assert tile_rows(root, 128) == 300                      # an array of its own: its rows
    assert tile_rows(DeviceArray((144, 64), np.uint16, ptr=1 << 20), 128) == 144


def test_forced_gemm_options_are_checked_and_the_rest_default_to_the_persistent_kernel():
    sms = 132
    assert forced_plan(512, 4096, False, sms, None, 2, None, None, None) == TmaPlan(tma_width(512, 4096, False, sms,
                                                                                               persistent=False), 2)
    assert forced_plan(512, 4096, False, sms, 128, None, None, None, 64) == TmaPlan(128, 1)
    assert forced_plan(4096, 4096, False, sms, None, 1, 2, True, None).multicast is True
    bad = [((None, 5, None, None, None), "split must be 1 or one of"),
           ((None, None, 7, None, None), "tail must be 1 or one of"),
           ((200, None, None, None, None), "width must be one of"),
           ((None, 2, None, None, 64), "for the persistent \\(unsplit\\) kernel only"),
           ((160, 2, None, None, None), "is the persistent kernel's"),
           ((96, 3, None, None, None), "is the persistent kernel's"),
           ((96, None, 2, None, None), "is the persistent kernel's"),
           ((None, None, None, True, 3), "multicast pairs row tiles and blocks")]
    for (width, split, tail, multicast, blocks), message in bad:
        with pytest.raises(ValueError, match=message):
            forced_plan(4096, 4096, False, sms, width, split, tail, multicast, blocks)


def test_the_mlp_flow_runs_where_the_up_product_takes_more_than_one_wave_of_blocks():
    from tileinfer.kernels.routing import uses_mlp_flow

    def rows(name):
        c = preset(name)
        epilogue = "silu_mul" if c.mlp == "gated_silu" else "xielu"
        return [M for M in range(1, 80) if uses_mlp_flow(M, epilogue, c.hidden_size, c.intermediate_size)]
    assert rows("qwen3-4b") == rows("qwen3-8b") == list(range(3, 33))  # 304, 384 blocks; 33-64: the TMA GEMM
    assert rows("apertus-8b") == list(range(3, 65))  # 336 blocks, xIELU
    assert rows("qwen3-0.6b") == [] and rows("tiny") == []  # one wave (192 blocks at 2 an SM of 132)
    assert not uses_mlp_flow(64, "bf16", 2560, 9728)
    c8 = preset("qwen3-8b")  # its down product at 3-16 rows runs a deep build, which has flow builds too
    assert swap_config(16, c8.hidden_size, c8.intermediate_size, "residual").deep


@pytest.mark.parametrize("sms", [78, 114, 132])
def test_every_flow_the_engine_runs_has_its_builds(sms):
    # The engine's steps of 3-32 rows give the up product the norm statistics (and the down product the next layer's,
    # but after the last layer), of 33-64 rows neither: mlp_flow's kernel names for each model wherever the flow runs,
    # on GPUs of several sizes, all among gemm_swap.cu's builds, and the up product never on a deep one.
    from tileinfer.kernels.routing import uses_mlp_flow
    from tileinfer.model.config import PRESETS
    builds = every_kernel_name()["gemm_swap.cu"]
    ran = 0
    for name, c in PRESETS.items():
        epilogue = "silu_mul" if c.mlp == "gated_silu" else "xielu"
        N_up = 2 * c.intermediate_size if epilogue == "silu_mul" else c.intermediate_size
        for M in range(1, 80):
            if not uses_mlp_flow(M, epilogue, c.hidden_size, c.intermediate_size, sms):
                continue
            ran += 1
            up = swap_config(M, N_up, c.hidden_size, epilogue, sms=sms)
            down = swap_config(M, c.hidden_size, c.intermediate_size, "residual", sms=sms)
            assert not up.deep, f"{name} at {M} rows on {sms} SMs: the up product on a deep build"
            up_role, down_roles = ("_nc", ("_np", "")) if M <= SWAP_BATCHES[1] else ("", ("",))
            wanted = [up.kernel_name + up_role + "_fp"] + [down.kernel_name + r + "_fc" for r in down_roles]
            missing = [k for k in wanted if k not in builds]
            assert not missing, f"{name} at {M} rows on {sms} SMs launches {missing}, which gemm_swap.cu lacks"
    assert ran


@pytest.mark.parametrize("epilogue", ["silu_mul", "xielu"])
@pytest.mark.parametrize("intermediate", [9728, 21504, 1000, 24])
def test_the_flow_consumers_count_of_each_chunk_is_what_the_producer_adds(epilogue, intermediate):
    # gemm_swap.cu: producer block (rank, tile) adds 1 to flags[tile * outputs_a_tile / BK] after its outputs; the
    # consumer waits, for chunk c, until min(tiles_per_chunk, up_tiles - c * tiles_per_chunk) * up_ks.
    from tileinfer.kernels.routing import SWAP_BK, flow_tiles_per_chunk, swap_config
    N_up = 2 * intermediate if epilogue == "silu_mul" else intermediate
    cfg = swap_config(64, N_up, 2560, epilogue)
    up_ks, up_tiles = cfg.ksplit, cfg.grid[1]
    outputs = SWAP_TILE // 2 if epilogue == "silu_mul" else SWAP_TILE
    chunks = -(-intermediate // SWAP_BK)
    added = [0] * chunks
    for tile in range(up_tiles):
        added[tile * outputs // SWAP_BK] += up_ks
    tpc = flow_tiles_per_chunk(epilogue)
    assert added == [min(tpc, up_tiles - c * tpc) * up_ks for c in range(chunks)]


def test_the_mlp_flow_names_bad_arguments():
    # Arrays made with ptr= allocate nothing: the checks come before any launch.
    import ml_dtypes
    import numpy as np

    from tileinfer.cuda import DeviceArray
    from tileinfer.kernels.linear import mlp_flow

    def a(*shape, dtype=np.dtype(ml_dtypes.bfloat16)):
        return DeviceArray(shape, dtype, ptr=1 << 20)

    w_up, w_down, flags = a(2 * 96, 256), a(256, 96), a(3, dtype=np.int32)  # I = 96: 2 chunks of 64, then the count
    with pytest.raises(ValueError, match="flow builds take 3-64 rows"):
        mlp_flow(a(2, 256), w_up, a(2, 96), w_down, a(2, 256, dtype=np.float32), "silu_mul", flags, None)
    with pytest.raises(ValueError, match="flow builds take 3-64 rows and the silu_mul or xielu epilogue"):
        mlp_flow(a(48, 256), a(96, 256), a(48, 96), w_down, a(48, 256, dtype=np.float32), "bf16", flags, None)
    with pytest.raises(ValueError, match="at 3-32 rows the flow builds take the up product's norm statistics"):
        mlp_flow(a(16, 256), w_up, a(16, 96), w_down, a(16, 256, dtype=np.float32), "silu_mul", flags, None)
    with pytest.raises(ValueError, match="flags"):
        mlp_flow(a(48, 256), w_up, a(48, 96), w_down, a(48, 256, dtype=np.float32), "silu_mul",
                 a(2, dtype=np.int32), None)
    with pytest.raises(ValueError, match="w"):
        mlp_flow(a(48, 256), w_up, a(48, 96), a(256, 64), a(48, 256, dtype=np.float32), "silu_mul", flags, None)
