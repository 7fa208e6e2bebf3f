"""Tensor parallelism's arithmetic (tileinfer/model/sharding.py) on the CPU: the float32 reference run shard by
shard over 2 and 4 ranks, the partial sums added where the all-reduces stand, equals the unsharded forward, for
both families; each rank's slices have its local shapes; a split the model cannot take is refused by name."""
from __future__ import annotations

import numpy as np
import pytest

from tileinfer.model.checkpoint import expected_tensors
from tileinfer.model.config import ApertusConfig, ConfigError, Qwen3Config, preset
from tileinfer.model.reference import ReferenceModel
from tileinfer.model.sharding import TensorParallelReference, check_world, local_config, shard, vocab_range

# 8 query heads and 4 KV heads of 128 (splittable 2 and 4 ways), an odd vocabulary (the last rank's range short)
QWEN3 = Qwen3Config(vocab_size=1003, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                    num_attention_heads=8, num_key_value_heads=4, head_dim=128, tie_word_embeddings=False)
APERTUS = ApertusConfig(vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                        num_attention_heads=8, num_key_value_heads=4, head_dim=128, max_position_embeddings=4096)


def random_weights(config, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in expected_tensors(config).items():
        if name.endswith("norm.weight"):
            out[name] = (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        elif ".act_fn." in name:  # xIELU's scalars: transformers' initial values, nudged
            base = {"alpha_p": 0.55, "alpha_n": 0.17, "beta": 0.5, "eps": -1e-6}[name.rsplit(".", 1)[1]]
            out[name] = np.full(shape, base + (0.05 * rng.standard_normal() if "alpha" in name else 0), np.float32)
        else:
            out[name] = (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)
    return out


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("config", [QWEN3, APERTUS], ids=["qwen3", "apertus"])
def test_the_sharded_reference_equals_the_unsharded_forward(config, world):
    weights = random_weights(config, seed=world)
    ids = np.random.default_rng(7).integers(0, config.vocab_size, 37)
    whole = ReferenceModel(config, weights).forward(ids)
    sharded = TensorParallelReference(config, weights, world).forward(ids)
    assert sharded.shape == whole.shape
    # the same products in another summation order: float32 rounding, ~1e-6 of the logits' spread
    err = np.abs(sharded - whole).max() / whole.std()
    assert err < 1e-4, f"{world} ranks: max |sharded - whole| = {err:.2e} of the logits' spread"
    assert (sharded.argmax(1) == whole.argmax(1)).all()


def test_tied_embeddings_shard_as_the_lm_head():
    config = preset("tiny")  # tied, 4 heads, 2 KV heads
    weights = random_weights(config, seed=3)
    ids = np.arange(0, config.vocab_size, 4099)
    whole = ReferenceModel(config, weights).forward(ids)
    np.testing.assert_allclose(TensorParallelReference(config, weights, 2).forward(ids), whole,
                               rtol=0, atol=1e-4 * whole.std())


@pytest.mark.parametrize("world", [1, 2, 4])
def test_each_rank_holds_its_local_shapes(world):
    weights = random_weights(QWEN3, seed=0)
    ranges = [vocab_range(QWEN3.vocab_size, r, world) for r in range(world)]
    assert ranges[0][0] == 0 and ranges[-1][1] == QWEN3.vocab_size
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    for rank in range(world):
        local, mine = shard(QWEN3, weights, rank, world)
        assert local == local_config(QWEN3, rank, world)
        assert (local.num_attention_heads, local.num_key_value_heads) == (8 // world, 4 // world)
        assert {name: w.shape for name, w in mine.items()} == expected_tensors(local)
        p = "model.layers.1."
        heads = slice(rank * 1024 // world, (rank + 1) * 1024 // world)
        np.testing.assert_array_equal(mine[p + "self_attn.q_proj.weight"], weights[p + "self_attn.q_proj.weight"][heads])
        np.testing.assert_array_equal(mine[p + "self_attn.o_proj.weight"], weights[p + "self_attn.o_proj.weight"][:, heads])
        np.testing.assert_array_equal(mine[p + "post_attention_layernorm.weight"],
                                      weights[p + "post_attention_layernorm.weight"])


@pytest.mark.parametrize("world, message", [(3, "does not divide the model's 4 KV heads"), (8, "choose one of 1, 2, 4"),
                                            (0, "positive integer"), (True, "positive integer")])
def test_a_split_the_model_cannot_take_is_refused(world, message):
    with pytest.raises(ConfigError, match=message):
        check_world(QWEN3, world)


def test_the_real_shapes_split_as_published():
    for name in ("qwen3-8b", "qwen3-32b", "apertus-8b", "apertus-70b"):
        for world in (2, 4, 8):
            check_world(preset(name), world)  # 8 KV heads: 2, 4 and 8 ways
    assert local_config(preset("apertus-70b"), 0, 2).intermediate_size == 21504
