"""The float32 numpy Qwen3 reference: its pieces against direct float64 formulas, and the forward's
cache semantics (chunked prefill + decode == one pass, truncate + recompute, causality)."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from tileinfer.model.config import Qwen3Config
from tileinfer.model.reference import (
    ReferenceModel, apply_rope, attention, rms_norm, rope_inv_freq, weight_shapes,
)

SMALL = Qwen3Config(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=10_000.0,
                    max_position_embeddings=512, tie_word_embeddings=False)


def random_weights(config: Qwen3Config, seed: int = 0) -> dict[str, np.ndarray]:
    """Random weights scaled so activations stay O(1); norms near 1 but not equal to it."""
    rng = np.random.default_rng(seed)
    weights = {}
    for name, shape in weight_shapes(config).items():
        if len(shape) == 1:
            weights[name] = (1.0 + 0.2 * rng.standard_normal(shape)).astype(np.float32)
        else:
            weights[name] = (rng.standard_normal(shape) / np.sqrt(shape[1])).astype(np.float32)
    return weights


@pytest.fixture(scope="module")
def model() -> ReferenceModel:
    return ReferenceModel(SMALL, random_weights(SMALL))


@pytest.fixture(scope="module")
def tokens() -> np.ndarray:
    return np.random.default_rng(1).integers(0, SMALL.vocab_size, size=20)


def assert_close(actual, expected, tol=1e-5):
    np.testing.assert_allclose(actual, expected, rtol=tol, atol=tol)


# ------------------------------------------------------------------------------------------- pieces


def test_rms_norm_matches_float64_formula():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((7, 33)).astype(np.float32) * 3
    w = rng.standard_normal(33).astype(np.float32)
    x64 = x.astype(np.float64)
    expected = x64 / np.sqrt((x64 ** 2).mean(-1, keepdims=True) + 1e-6) * w
    out = rms_norm(x, w, 1e-6)
    assert out.dtype == np.float32
    assert_close(out, expected)


def test_rope_inv_freq_values():
    inv = rope_inv_freq(8, 10_000.0)
    assert inv.dtype == np.float32
    assert_close(inv, [1.0, 10_000 ** -0.25, 10_000 ** -0.5, 10_000 ** -0.75], tol=1e-7)


def rope_float64_complex(x: np.ndarray, positions: np.ndarray, theta: float) -> np.ndarray:
    """Rotate-half RoPE as complex multiplication: channel pair (i, i + hd/2) is one complex number."""
    hd = x.shape[-1]
    freq = 1.0 / theta ** (np.arange(0, hd, 2) / hd)
    z = x[..., :hd // 2].astype(np.float64) + 1j * x[..., hd // 2:]
    z = z * np.exp(1j * positions[:, None, None] * freq)
    return np.concatenate([z.real, z.imag], axis=-1)


def test_rope_matches_complex_rotation():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((9, 3, 16)).astype(np.float32)
    positions = np.array([0, 1, 2, 5, 17, 63, 64, 200, 1000])
    out = apply_rope(x, positions, rope_inv_freq(16, 10_000.0))
    # Angles are float32 (as in transformers), so large positions carry ~position * 6e-8 of phase error.
    assert_close(out, rope_float64_complex(x, positions, 10_000.0), tol=2e-4)


def test_rope_preserves_norms():
    rng = np.random.default_rng(4)
    x = rng.standard_normal((50, 4, 16)).astype(np.float32)
    positions = rng.integers(0, 4096, size=50)
    out = apply_rope(x, positions, rope_inv_freq(16, 1e6))
    assert_close(np.linalg.norm(out, axis=-1), np.linalg.norm(x, axis=-1))


def test_rope_dot_product_depends_only_on_position_difference():
    rng = np.random.default_rng(5)
    q = rng.standard_normal((1, 1, 16)).astype(np.float32)
    k = rng.standard_normal((1, 1, 16)).astype(np.float32)
    inv = rope_inv_freq(16, 10_000.0)

    def score(pq, pk):
        return float(np.sum(apply_rope(q, np.array([pq]), inv) * apply_rope(k, np.array([pk]), inv)))

    base = score(7, 3)
    for shift in (1, 10, 57):
        assert score(7 + shift, 3 + shift) == pytest.approx(base, rel=1e-4, abs=1e-4)
    assert score(9, 3) != pytest.approx(base, rel=1e-3)  # and it does depend on the difference


def naive_attention(q, k, v, q_positions, k_positions):
    """Per-head, per-query float64 loops: the plainest statement of causal GQA."""
    n, H, hd = q.shape
    group = H // k.shape[1]
    out = np.zeros((n, H, hd))
    for i in range(n):
        for h in range(H):
            keep = k_positions <= q_positions[i]
            s = k[keep, h // group].astype(np.float64) @ q[i, h] / np.sqrt(hd)
            p = np.exp(s - s.max())
            out[i, h] = (p / p.sum()) @ v[keep, h // group]
    return out


def test_attention_matches_naive_loops():
    rng = np.random.default_rng(6)
    q = rng.standard_normal((5, 4, 16)).astype(np.float32)
    k = rng.standard_normal((9, 2, 16)).astype(np.float32)
    v = rng.standard_normal((9, 2, 16)).astype(np.float32)
    q_pos, k_pos = np.arange(4, 9), np.arange(9)
    assert_close(attention(q, k, v, q_pos, k_pos), naive_attention(q, k, v, q_pos, k_pos))


def test_gqa_equals_explicitly_repeated_kv_heads():
    rng = np.random.default_rng(7)
    q = rng.standard_normal((6, 8, 16)).astype(np.float32)
    k = rng.standard_normal((6, 2, 16)).astype(np.float32)
    v = rng.standard_normal((6, 2, 16)).astype(np.float32)
    pos = np.arange(6)
    grouped = attention(q, k, v, pos, pos)
    # Query head h reads KV head h // 4: repeat each KV head 4 times in place.
    repeated = attention(q, np.repeat(k, 4, axis=1), np.repeat(v, 4, axis=1), pos, pos)
    assert_close(grouped, repeated, tol=1e-6)
    assert not np.allclose(grouped, attention(q, np.tile(k, (1, 4, 1)), np.tile(v, (1, 4, 1)), pos, pos))


def test_attention_single_key_returns_its_value():
    rng = np.random.default_rng(8)
    q = rng.standard_normal((1, 4, 16)).astype(np.float32)
    k = rng.standard_normal((1, 2, 16)).astype(np.float32)
    v = rng.standard_normal((1, 2, 16)).astype(np.float32)
    out = attention(q, k, v, np.array([0]), np.array([0]))
    np.testing.assert_allclose(out[0], v[0, [0, 0, 1, 1]], rtol=1e-6)


def test_attention_is_causal_by_positions():
    rng = np.random.default_rng(9)
    q = rng.standard_normal((1, 2, 16)).astype(np.float32)
    k = rng.standard_normal((3, 2, 16)).astype(np.float32)
    v = rng.standard_normal((3, 2, 16)).astype(np.float32)
    # A query at position 0 sees only the key at position 0, whatever else is cached.
    out = attention(q, k, v, np.array([0]), np.array([0, 1, 2]))
    np.testing.assert_allclose(out[0], v[0], rtol=1e-6)
    with pytest.raises(ValueError, match="sees no key"):
        attention(q, k[1:], v[1:], np.array([0]), np.array([1, 2]))


# ------------------------------------------------------------------------------------------- model


def test_one_layer_one_token_by_hand():
    """With one token, attention returns v: the layer is embed -> v_proj -> o_proj -> MLP, no q/k."""
    config = Qwen3Config(vocab_size=11, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16, tie_word_embeddings=True)
    w = {k: v.astype(np.float64) for k, v in random_weights(config, seed=10).items()}
    p = "model.layers.0."
    eps = config.rms_norm_eps

    def norm(x, weight):
        return x / np.sqrt((x ** 2).mean() + eps) * weight

    h = w["model.embed_tokens.weight"][3]
    v = w[p + "self_attn.v_proj.weight"] @ norm(h, w[p + "input_layernorm.weight"])  # one KV head
    h = h + w[p + "self_attn.o_proj.weight"] @ np.concatenate([v, v])               # both heads read it
    x = norm(h, w[p + "post_attention_layernorm.weight"])
    gate, up = w[p + "mlp.gate_proj.weight"] @ x, w[p + "mlp.up_proj.weight"] @ x
    h = h + w[p + "mlp.down_proj.weight"] @ (gate / (1 + np.exp(-gate)) * up)
    expected = w["model.embed_tokens.weight"] @ norm(h, w["model.norm.weight"])  # tied head

    logits = ReferenceModel(config, w).forward([3])
    assert logits.shape == (1, 11) and logits.dtype == np.float32
    assert_close(logits[0], expected)


def naive_forward(config: Qwen3Config, w: dict[str, np.ndarray], ids) -> np.ndarray:
    """The whole model in float64 with per-head loops, written independently of the module."""
    H, KV, hd, eps = config.num_attention_heads, config.num_key_value_heads, config.head_dim, config.rms_norm_eps
    w = {k: v.astype(np.float64) for k, v in w.items()}
    pos = np.arange(len(ids))

    def norm(x, weight):
        return x / np.sqrt((x ** 2).mean(-1, keepdims=True) + eps) * weight

    h = w["model.embed_tokens.weight"][ids]
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        x = norm(h, w[p + "input_layernorm.weight"])
        q = norm((x @ w[p + "self_attn.q_proj.weight"].T).reshape(-1, H, hd), w[p + "self_attn.q_norm.weight"])
        k = norm((x @ w[p + "self_attn.k_proj.weight"].T).reshape(-1, KV, hd), w[p + "self_attn.k_norm.weight"])
        v = (x @ w[p + "self_attn.v_proj.weight"].T).reshape(-1, KV, hd)
        q = rope_float64_complex(q, pos, config.rope_theta)
        k = rope_float64_complex(k, pos, config.rope_theta)
        attn = naive_attention(q, k, v, pos, pos).reshape(len(ids), -1)
        h = h + attn @ w[p + "self_attn.o_proj.weight"].T
        x = norm(h, w[p + "post_attention_layernorm.weight"])
        gate, up = x @ w[p + "mlp.gate_proj.weight"].T, x @ w[p + "mlp.up_proj.weight"].T
        h = h + (gate / (1 + np.exp(-gate)) * up) @ w[p + "mlp.down_proj.weight"].T
    return norm(h, w["model.norm.weight"]) @ w["lm_head.weight"].T


def test_forward_matches_naive_float64_model(model, tokens):
    expected = naive_forward(SMALL, random_weights(SMALL), tokens[:9])
    assert_close(model.forward(tokens[:9]), expected, tol=1e-4)


def test_chunked_prefill_then_decode_equals_one_pass(model, tokens):
    full = model.forward(tokens)
    cache = model.new_cache()
    parts = [model.forward(tokens[:5], cache), model.forward(tokens[5:12], cache)]
    parts += [model.forward(tokens[i:i + 1], cache) for i in range(12, len(tokens))]
    assert len(cache) == len(tokens)
    assert_close(np.concatenate(parts), full)


def test_truncate_then_recompute(model, tokens):
    cache = model.new_cache()
    first = model.forward(tokens, cache)
    cache.truncate(7)
    assert_close(model.forward(tokens[7:], cache), first[7:])
    # A different continuation after the rollback equals a fresh pass over the new sequence.
    cache.truncate(7)
    other = np.concatenate([tokens[:7], (tokens[7:12] + 1) % SMALL.vocab_size])
    assert_close(model.forward(other[7:], cache), model.forward(other)[7:])
    with pytest.raises(ValueError, match="12 positions to 13"):
        cache.truncate(13)


def test_later_tokens_do_not_change_earlier_logits(model, tokens):
    changed = tokens.copy()
    changed[9] = (changed[9] + 5) % SMALL.vocab_size
    a, b = model.forward(tokens), model.forward(changed)
    assert_close(a[:9], b[:9], tol=1e-6)
    assert not np.allclose(a[9:], b[9:], atol=1e-3)


def test_cache_holds_keys_after_norm_and_rope(model, tokens):
    cache = model.new_cache()
    model.forward(tokens[:6], cache)
    assert len(cache.keys) == SMALL.num_hidden_layers
    assert cache.keys[0].shape == (6, SMALL.num_key_value_heads, SMALL.head_dim)
    assert cache.values[1].shape == (6, SMALL.num_key_value_heads, SMALL.head_dim)
    np.testing.assert_array_equal(cache.positions, np.arange(6))
    # Position 0 is not rotated, so layer 0's first key is just k_norm(k_proj(input_norm(embed))).
    layer, eps = model.layers[0], SMALL.rms_norm_eps
    x = rms_norm(model.embed[tokens[0]], layer.input_norm, eps)
    k = (layer.k_proj @ x).reshape(SMALL.num_key_value_heads, SMALL.head_dim)
    assert_close(cache.keys[0][0], rms_norm(k, layer.k_norm, eps))
    assert_close(cache.values[0][0], (layer.v_proj @ x).reshape(SMALL.num_key_value_heads, SMALL.head_dim))


def test_bfloat16_weights_match_their_float32_values():
    w = random_weights(SMALL, seed=11)
    w_bf16 = {k: v.astype(ml_dtypes.bfloat16) for k, v in w.items()}
    w_rounded = {k: v.astype(np.float32) for k, v in w_bf16.items()}
    ids = [1, 2, 3, 50]
    np.testing.assert_array_equal(ReferenceModel(SMALL, w_bf16).forward(ids),
                                  ReferenceModel(SMALL, w_rounded).forward(ids))


def test_from_checkpoint_reads_every_tensor_by_name():
    w = random_weights(SMALL, seed=12)

    class FakeCheckpoint:
        config = SMALL

        def __init__(self):
            self.names_read = []

        def read(self, name):
            self.names_read.append(name)
            return w[name].astype(ml_dtypes.bfloat16)

    ckpt = FakeCheckpoint()
    model = ReferenceModel.from_checkpoint(ckpt)
    assert sorted(ckpt.names_read) == sorted(weight_shapes(SMALL))
    assert model.embed.dtype == np.float32
    rounded = {k: v.astype(ml_dtypes.bfloat16).astype(np.float32) for k, v in w.items()}
    assert_close(model.forward([4, 5]), ReferenceModel(SMALL, rounded).forward([4, 5]), tol=0)


def test_tied_model_uses_the_embedding_as_lm_head():
    config = Qwen3Config(**{**{f: getattr(SMALL, f) for f in SMALL.__dataclass_fields__},
                            "tie_word_embeddings": True})
    w = random_weights(config, seed=13)
    assert "lm_head.weight" not in w
    model = ReferenceModel(config, w)
    assert model.lm_head is model.embed


def test_greedy_matches_repeated_full_passes(model, tokens):
    prompt = list(tokens[:4])
    out = model.greedy(prompt, 6)
    seq = list(prompt)
    for _ in range(6):
        seq.append(int(np.argmax(model.forward(seq)[-1])))
    assert out == seq[4:]
    assert model.greedy(prompt, 0) == []


def test_bad_inputs_have_actionable_errors(model):
    with pytest.raises(ValueError, match="outside the vocabulary"):
        model.forward([0, 97])
    with pytest.raises(ValueError, match="non-empty"):
        model.forward([])
    w = random_weights(SMALL)
    del w["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(ValueError, match="model.layers.1.mlp.up_proj.weight"):
        ReferenceModel(SMALL, w)
    w = random_weights(SMALL)
    w["model.norm.weight"] = np.ones(63, np.float32)
    with pytest.raises(ValueError, match=r"\(63,\).*\(64,\)"):
        ReferenceModel(SMALL, w)


def test_failed_forward_leaves_cache_unchanged(model, tokens):
    cache = model.new_cache()
    model.forward(tokens[:3], cache)
    with pytest.raises(ValueError):
        model.forward(tokens[3:5], cache, positions=[3])  # one position for two tokens
    assert len(cache) == 3


def test_bf16_activations_round_only_the_activations(model, tokens):
    # The ideal-bf16 forward differs from float32 by the activations' rounding alone: close (a few
    # thousandths of the logits' spread) but not equal.
    exact, bf16 = model.forward(tokens), model.forward_bf16_activations(tokens)
    err = np.abs(bf16 - exact) / exact.std(axis=1, keepdims=True)
    assert 0 < err.max() < 0.1 and err.mean() < 0.01, (err.max(), err.mean())
    with pytest.raises(ValueError):
        model.forward_bf16_activations([])
