"""INT8 cache kernels against the numpy oracle of tileinfer/kv/int8.py (written before a GPU run)."""
from __future__ import annotations

import numpy as np
import pytest

from gpu_helpers import BF16, rand_bf16, seed_of, to_f32  # noqa: E402
from tileinfer.kernels import attn_input_int8
from tileinfer.kv.int8 import quantize, smoothing_factors
from tileinfer.model import reference

pytestmark = pytest.mark.gpu

HD = 128


@pytest.mark.parametrize("n, H, KV, page_size, smooth", [(1, 16, 8, 64, True), (37, 32, 8, 16, True),
                                                         (37, 32, 8, 16, False), (130, 4, 2, 64, True)])
def test_attn_input_int8(n, H, KV, page_size, smooth, buf, stream):
    eps = 1e-6
    rng = np.random.default_rng(seed_of("attn_input_int8", n, H, KV, page_size, smooth))
    qkv = rand_bf16(rng, (n, (H + 2 * KV) * HD), scale=2.0)
    q_norm = rand_bf16(rng, (HD,), scale=0.1, mean=1.0)
    k_norm = rand_bf16(rng, (HD,), scale=0.1, mean=1.0)
    k_norm[5], k_norm[70] = 100.0, -90.0  # a few huge channels, as in Qwen3's first layer
    positions = rng.choice(4 * n + 7, n, replace=False).astype(np.int32)
    inv_freq = reference.rope_inv_freq(HD, 1e6)
    num_pages = (n + page_size - 1) // page_size + 2
    slots = rng.choice(num_pages * page_size, n, replace=False).astype(np.int32)
    if n > 2:
        slots[n // 2] = -1  # padding: nothing stored
    c = smoothing_factors(to_f32(k_norm)) if smooth else None

    q_out = buf.poisoned((n, H, HD), BF16)
    k_pool = buf.poisoned((num_pages, KV, page_size, HD), np.int8)
    v_pool = buf.poisoned((num_pages, KV, page_size, HD), np.int8)
    k_scale = buf.poisoned((num_pages, KV, page_size), np.float32)
    v_scale = buf.poisoned((num_pages, KV, page_size), np.float32)
    attn_input_int8(buf.upload(qkv), buf.upload(positions), buf.upload(slots), buf.upload(q_norm),
                    buf.upload(k_norm), buf.upload(inv_freq), buf.upload(c) if smooth else None, q_out,
                    k_pool, v_pool, k_scale, v_scale, H, KV, eps, stream)

    x = to_f32(qkv)
    q = x[:, :H * HD].reshape(n, H, HD)
    k = x[:, H * HD:(H + KV) * HD].reshape(n, KV, HD)
    v = x[:, (H + KV) * HD:].reshape(n, KV, HD)
    q_ref = reference.apply_rope(reference.rms_norm(q, to_f32(q_norm), eps), positions, inv_freq)
    k_ref = reference.apply_rope(reference.rms_norm(k, to_f32(k_norm), eps), positions, inv_freq)
    if smooth:
        q_ref, k_ref = q_ref * c, k_ref / c
    got_q = to_f32(q_out.to_host(stream))
    assert np.allclose(got_q, q_ref, rtol=1e-2, atol=1e-2 * np.abs(q_ref).max(axis=(0, 1))), "queries"

    written = slots >= 0
    page, off = slots[written] // page_size, slots[written] % page_size
    kq_ref, ks_ref = quantize(k_ref[written])
    vq_ref, vs_ref = quantize(v[written])
    kq, ks = k_pool.to_host(stream)[page, :, off], k_scale.to_host(stream)[page, :, off]
    vq, vs = v_pool.to_host(stream)[page, :, off], v_scale.to_host(stream)[page, :, off]
    # Values are bf16 inputs quantized exactly as the oracle does: bit-exact.
    assert np.array_equal(vs, vs_ref) and np.array_equal(vq, vq_ref), "values"
    # Keys go through RMSNorm and RoPE in float32 on both sides, with different rounding: scales to
    # 1e-5 relative, codes within one step.
    assert np.allclose(ks, ks_ref, rtol=1e-5), "key scales"
    assert np.abs(kq.astype(np.int32) - kq_ref.astype(np.int32)).max() <= 1, "key codes"
    # Nothing else was written.
    untouched = np.ones((num_pages, page_size), bool)
    untouched[page, off] = False
    assert (k_scale.to_host(stream).transpose(0, 2, 1)[untouched].view(np.uint32) == 0xFFFFFFFF).all()
