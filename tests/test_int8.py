"""The INT8 cache's host arithmetic (tileinfer/kv/int8.py) and the reference model's INT8 cache."""
from __future__ import annotations

import numpy as np
import pytest

from tileinfer.kv.int8 import attention_int8, dequantize, quantize, smoothing_factors
from tileinfer.model import reference as R


def test_quantize_is_symmetric_per_vector_and_round_trips_within_half_a_step():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((50, 3, 128)).astype(np.float32) * rng.uniform(0.01, 10, (50, 3, 1)).astype(np.float32)
    q, s = quantize(x)
    assert q.dtype == np.int8 and s.dtype == np.float32 and q.shape == x.shape and s.shape == (50, 3)
    assert np.allclose(s, np.abs(x).max(-1) / 127)
    assert (np.abs(q).max(-1) == 127).all()                  # the largest entry uses the full range
    err = np.abs(dequantize(q, s) - x)
    assert (err <= s[..., None] * (0.5 + 1e-6)).all()
    zq, zs = quantize(np.zeros((2, 128), np.float32))
    assert (zq == 0).all() and (zs == 0).all()


def test_quantize_rounds_half_to_even_like_the_kernels():
    x = np.array([[127.0, 0.5, 1.5, 2.5, -0.5, -1.5]], np.float32)  # scale 1
    q, s = quantize(x)
    assert s[0] == 1 and q.tolist() == [[127, 0, 2, 2, 0, -2]]


def test_smoothing_factors_pair_channels_as_rope_does():
    w = np.ones(128, np.float32)
    w[5], w[64 + 9] = 100.0, -50.0
    c = smoothing_factors(w)
    assert c[5] == c[64 + 5] == 100 and c[9] == c[64 + 9] == 50
    assert (np.delete(c, [5, 69, 9, 73]) == 1).all()
    with pytest.raises(ValueError, match="even length"):
        smoothing_factors(np.ones(7))
    with pytest.raises(ValueError, match="non-zero"):
        smoothing_factors(np.zeros(8))


def test_smoothing_commutes_with_rope():
    rng = np.random.default_rng(1)
    w = rng.uniform(0.5, 2, 128).astype(np.float32)
    w[3] = 80
    c = smoothing_factors(w)
    x = rng.standard_normal((7, 2, 128)).astype(np.float32)
    pos = np.arange(100, 107)
    inv = R.rope_inv_freq(128, 1e6)
    assert np.allclose(R.apply_rope(x / c, pos, inv), R.apply_rope(x, pos, inv) / c, rtol=1e-5, atol=1e-6)


def test_int8_attention_oracle_matches_attention_over_the_dequantized_cache():
    rng = np.random.default_rng(2)
    n, m, H, KV, hd = 5, 77, 4, 2, 128
    q = rng.standard_normal((n, H, hd)).astype(np.float32)
    k = rng.standard_normal((m, KV, hd)).astype(np.float32)
    v = rng.standard_normal((m, KV, hd)).astype(np.float32)
    c = smoothing_factors(rng.uniform(0.5, 3, hd).astype(np.float32))
    kq, ks = quantize(k / c)
    vq, vs = quantize(v)
    qpos, kpos = np.arange(m - n, m), np.arange(m)
    got = attention_int8(q, kq, ks, vq, vs, qpos, kpos, smoothing=c)
    want = R.attention(q * c, dequantize(kq, ks), dequantize(vq, vs), qpos, kpos)
    assert np.allclose(got, want, rtol=1e-4, atol=1e-5)
    # and the scores equal the unsmoothed ones up to INT8 rounding
    exact = R.attention(q, k, v, qpos, kpos)
    assert np.abs(got - exact).max() < 0.05


def test_reference_int8_cache_with_smoothing_on_the_tiny_checkpoint(tiny_checkpoint):
    """The synthetic checkpoints' first layer has key channels ~100x the others; smoothing must cut
    the KL divergence to the exact cache by far more than the issue's 3x."""
    from tileinfer.model.checkpoint import Checkpoint
    ref = R.ReferenceModel.from_checkpoint(Checkpoint.open(tiny_checkpoint))
    ids = np.random.default_rng(0).integers(0, 151643, 300)

    def log_probs(cache):  # [positions, vocab] float64, computed in place (the arrays are ~360 MB)
        logits = ref.forward(ids, cache).astype(np.float64)
        logits -= logits.max(1, keepdims=True)
        logits -= np.log(np.exp(logits).sum(1, keepdims=True))
        return logits

    exact = log_probs(ref.new_cache())
    p_exact = np.exp(exact)
    kl = {}
    for smoothing in (False, True):
        lp = log_probs(ref.new_cache(int8=True, smoothing=smoothing))
        np.subtract(exact, lp, out=lp)
        kl[smoothing] = float(np.einsum("ij,ij->", p_exact, lp) / len(ids))  # mean over positions of sum p log(p/q)
    print(f"mean KL to the exact cache: int8 {kl[False]:.2e}, int8 + smoothing {kl[True]:.2e}")
    assert kl[True] * 3 <= kl[False]
    assert kl[True] <= 0.005


def test_reference_cache_quantizes_only_the_parts_asked(tiny_checkpoint):
    """parts="k" / "v" (kv_fidelity.py --parts): only that half of the cache goes through INT8, the other
    holds exactly what the exact cache holds; "kv" is both."""
    from tileinfer.model.checkpoint import Checkpoint
    ref = R.ReferenceModel.from_checkpoint(Checkpoint.open(tiny_checkpoint))
    ids = np.random.default_rng(1).integers(0, 151643, 40)
    caches = {parts: ref.new_cache(int8=True, parts=parts) for parts in ("kv", "k", "v")}
    exact = ref.new_cache()
    for cache in (exact, *caches.values()):
        ref.forward(ids, cache)
    # Layer 0's inputs are the embeddings in every cache, so its stored keys and values differ from the
    # exact ones by the quantization alone (later layers' inputs already carry it).
    k, v = exact.keys[0], exact.values[0]
    for parts, cache in caches.items():
        assert np.array_equal(cache.keys[0], k) == ("k" not in parts), parts
        assert np.array_equal(cache.values[0], v) == ("v" not in parts), parts
        assert np.abs(cache.keys[0] - k).max() <= np.abs(k).max() / 127
        assert np.abs(cache.values[0] - v).max() <= np.abs(v).max() / 127
    with pytest.raises(ValueError, match="parts"):
        ref.new_cache(int8=True, parts="q")


def test_reference_bf16_cache_holds_the_exact_vectors_rounded_to_bfloat16(tiny_checkpoint):
    """bf16=True (kv_fidelity.py --baseline bf16): the cache the engine's BF16 pools hold."""
    import ml_dtypes

    from tileinfer.model.checkpoint import Checkpoint
    ref = R.ReferenceModel.from_checkpoint(Checkpoint.open(tiny_checkpoint))
    ids = np.random.default_rng(2).integers(0, 151643, 30)
    exact, rounded = ref.new_cache(), ref.new_cache(bf16=True)
    for cache in (exact, rounded):
        ref.forward(ids, cache)
    for got, want in ((rounded.keys[0], exact.keys[0]), (rounded.values[0], exact.values[0])):
        assert np.array_equal(got, want.astype(ml_dtypes.bfloat16).astype(np.float32))
        assert not np.array_equal(got, want)
    with pytest.raises(ValueError, match="INT8 or BF16"):
        ref.new_cache(int8=True, bf16=True)


def test_reference_bf16_activations_feed_the_cache_as_attn_input_does(tiny_checkpoint):
    """forward(bf16_activations=True) (kv_fidelity.py --activations bf16): the q/k/v products are rounded to
    bf16 as the QKV kernel writes them; keys then go through norm and RoPE in float32 and reach the cache
    unrounded (attn_input quantizes them from float32), values as the product wrote them."""
    import ml_dtypes

    from tileinfer.model.checkpoint import Checkpoint
    from tileinfer.model.reference import apply_rope, rms_norm
    ref = R.ReferenceModel.from_checkpoint(Checkpoint.open(tiny_checkpoint))
    ids = np.random.default_rng(3).integers(0, 151643, 20)
    cache = ref.new_cache()
    logits = ref.forward(ids, cache, bf16_activations=True)
    c, layer = ref.config, ref.layers[0]

    def bf16(x):
        return x.astype(ml_dtypes.bfloat16).astype(np.float32)

    x = bf16(rms_norm(ref.embed[ids], layer.input_norm, c.rms_norm_eps))
    k = bf16(x @ layer.k_proj.T).reshape(len(ids), c.num_key_value_heads, c.head_dim)
    v = bf16(x @ layer.v_proj.T).reshape(len(ids), c.num_key_value_heads, c.head_dim)
    k = apply_rope(rms_norm(k, layer.k_norm, c.rms_norm_eps), np.arange(len(ids)), ref.inv_freq)
    np.testing.assert_allclose(cache.keys[0], k, rtol=1e-5, atol=1e-6)
    assert not np.array_equal(cache.keys[0], bf16(cache.keys[0]))  # not rounded
    np.testing.assert_array_equal(cache.values[0], v)
    exact = ref.forward(ids)
    assert not np.array_equal(logits, exact)
    assert np.abs(logits - exact).max() < 0.1 * exact.std()
