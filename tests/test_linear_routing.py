"""Which kernel linear() runs for each decode and prefill shape (tileinfer.kernels.linear.default_path).
The choices come from H200 measurements (scripts/bench_gemm_small.py, quoted in the module docstring);
this pins them so a change to the routing is deliberate."""
import pytest

from tileinfer.kernels.linear import default_path, gemv_ksplit, norm_kernel_name, tma_tiles, tma_width
from tileinfer.model.config import preset


def layer_matrices(name: str) -> dict[str, int]:
    c = preset(name)
    return {"qkv": c.qkv_size, "o": c.hidden_size, "gate_up": 2 * c.intermediate_size, "down": c.hidden_size,
            "lm_head": c.vocab_size}


@pytest.mark.parametrize("M", [1, 2])
def test_one_or_two_rows_take_the_gemv(M):
    for n in layer_matrices("qwen3-8b").values():
        assert default_path(M, n) == "gemv"


def test_verify_sized_batches_split_between_tensor_core_gemv_and_small_gemm():
    # M = 5 (a k = 4 verify step): layer matrices 4096-20480 wide on the tensor-core GEMV; narrower and
    # wider ones (qwen3-8b's gate/up) and the LM head on the small GEMM.
    want = {"qwen3-8b": {"qkv": "tc", "o": "tc", "gate_up": "small", "down": "tc", "lm_head": "small"},
            "qwen3-4b": {"qkv": "tc", "o": "small", "gate_up": "tc", "down": "small", "lm_head": "small"},
            "qwen3-0.6b": {"qkv": "tc", "o": "small", "gate_up": "tc", "down": "small", "lm_head": "small"}}
    for model, paths in want.items():
        got = {m: default_path(5, n) for m, n in layer_matrices(model).items()}
        assert got == paths, model


@pytest.mark.parametrize("M", [9, 16, 64])
def test_batches_take_the_small_gemm_except_the_lm_head_at_64(M):
    got = {m: default_path(M, n) for m, n in layer_matrices("qwen3-0.6b").items()}
    assert got == {"qkv": "small", "o": "small", "gate_up": "small", "down": "small",
                   "lm_head": "gemm" if M == 64 else "small"}


def test_prefill_takes_the_128x128_gemm():
    assert default_path(4096, 6144) == "gemm"
    assert default_path(512, 151936) == "gemm"


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
