"""INT8 cache kernels against the numpy oracle of tileinfer/kv/int8.py, and key smoothing end to end
(the INT8 attention kernels against the oracle: tests/gpu/test_kernels.py)."""
from __future__ import annotations

import importlib

import numpy as np
import pytest

from gpu_helpers import BF16, attn_input_tensors, rand_bf16, seed_of, to_f32  # noqa: E402
from tileinfer.kernels import attention, attn_input_int8
from tileinfer.kv.int8 import quantize, smoothing_factors
from tileinfer.model import reference

pytestmark = pytest.mark.gpu

HD = 128


def write_int8(buf, stream, qkv, positions, slots, q_norm, k_norm, inv_freq, smoothing, H, KV, num_pages, page_size,
               eps):
    """attn_input_int8 into freshly poisoned outputs; returns (q_out, k_pool, v_pool, k_scale, v_scale)."""
    n = qkv.shape[0]
    q_out = buf.poisoned((n, H, HD), BF16)
    k_pool = buf.poisoned((num_pages, KV, page_size, HD), np.int8)
    v_pool = buf.poisoned((num_pages, KV, page_size, HD), np.int8)
    k_scale = buf.poisoned((num_pages, KV, page_size), np.float32)
    v_scale = buf.poisoned((num_pages, KV, page_size), np.float32)
    attn_input_int8(buf.upload(qkv), buf.upload(positions), buf.upload(slots), buf.upload(q_norm),
                    buf.upload(k_norm), buf.upload(inv_freq), buf.upload(smoothing) if smoothing is not None else None,
                    q_out, k_pool, v_pool, k_scale, v_scale, H, KV, eps, stream)
    return q_out, k_pool, v_pool, k_scale, v_scale


@pytest.mark.parametrize("n, H, KV, page_size, smooth", [(1, 16, 8, 64, True), (37, 32, 8, 16, True),
                                                         (37, 32, 8, 16, False), (130, 4, 2, 64, True)])
def test_attn_input_int8(n, H, KV, page_size, smooth, buf, stream):
    eps = 1e-6
    rng = np.random.default_rng(seed_of("attn_input_int8", n, H, KV, page_size, smooth))
    qkv, q_norm, k_norm = attn_input_tensors(rng, n, H, KV, HD)
    positions = rng.choice(4 * n + 7, n, replace=False).astype(np.int32)
    inv_freq = reference.rope_inv_freq(HD, 1e6)
    num_pages = (n + page_size - 1) // page_size + 2
    slots = rng.choice(num_pages * page_size, n, replace=False).astype(np.int32)
    if n > 2:
        slots[n // 2] = -1  # padding: nothing stored
    c = smoothing_factors(to_f32(k_norm)) if smooth else None

    q_out, k_pool, v_pool, k_scale, v_scale = write_int8(buf, stream, qkv, positions, slots, q_norm, k_norm, inv_freq,
                                                         c if smooth else None, H, KV, num_pages, page_size, eps)

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


def test_smoothing_changes_stored_keys_not_scores(buf, stream):
    """attn_input_int8 then INT8 attention, smoothing on and off, on keys whose key-norm weight has
    two channels ~100x the rest (as Qwen3's first layer has). With smoothing, the stored codes differ
    from the plain ones, every score the kernels see (q c) . (k_q s_k) is within INT8 rounding of the
    exact q . k, and the attention output is far closer to the exact one than without smoothing."""
    n, H, KV, page_size, eps = 150, 16, 8, 16, 1e-6
    rng = np.random.default_rng(seed_of("smoothing-chain"))
    qkv = rand_bf16(rng, (n, (H + 2 * KV) * HD))
    q_norm = rand_bf16(rng, (HD,), scale=0.1, mean=1.0)
    k_norm = rand_bf16(rng, (HD,), scale=0.1, mean=1.0)
    k_norm[5], k_norm[70] = 100.0, -90.0
    positions = np.arange(n, dtype=np.int32)
    inv_freq = reference.rope_inv_freq(HD, 1e6)
    num_pages = -(-n // page_size)
    slots = positions.copy()  # pages in order: block table 0, 1, 2, ...
    table = np.arange(-(-num_pages // 16) * 16, dtype=np.int32)[None] % num_pages
    c = smoothing_factors(to_f32(k_norm))

    x = to_f32(qkv)
    q = reference.apply_rope(reference.rms_norm(x[:, :H * HD].reshape(n, H, HD), to_f32(q_norm), eps), positions,
                             inv_freq)
    k = reference.apply_rope(reference.rms_norm(x[:, H * HD:(H + KV) * HD].reshape(n, KV, HD), to_f32(k_norm), eps),
                             positions, inv_freq)
    v = x[:, (H + KV) * HD:].reshape(n, KV, HD)
    exact = reference.attention(q, k, v, positions, positions)
    group = H // KV

    codes, errors = {}, {}
    for smooth in (False, True):
        q_out, k_pool, v_pool, k_scale, v_scale = write_int8(buf, stream, qkv, positions, slots, q_norm, k_norm,
                                                             inv_freq, c if smooth else None, H, KV, num_pages,
                                                             page_size, eps)
        out = buf.poisoned((n, H, HD), BF16)
        attention(q_out, k_pool, v_pool, out, buf.upload(np.array([0, n], np.int32)),
                  buf.upload(np.array([n], np.int32)), buf.upload(table), max_q_len=n, scales=(k_scale, v_scale),
                  stream=stream)
        kq = k_pool.to_host(stream).transpose(0, 2, 1, 3).reshape(-1, KV, HD)[:n]   # [n, KV, HD] by position
        ks = k_scale.to_host(stream).transpose(0, 2, 1).reshape(-1, KV)[:n]
        codes[smooth] = kq
        if smooth:
            # Scores as the kernels see them, from the stored codes and the queries as written (q c, bf16).
            qs = to_f32(q_out.to_host(stream)).astype(np.float64)
            for h in range(0, H, 5):
                g = h // group
                seen = qs[:, h] @ (kq[:, g].astype(np.float64) * ks[:, g, None]).T
                true = q[:, h].astype(np.float64) @ k[:, g].astype(np.float64).T
                # INT8 rounding: each stored k_i / c_i is within s_k / 2 of its code times s_k, so the
                # score moves by at most sum_i |q_i c_i| s_k / 2 (with 1e-5 of max |k / c| added per
                # channel for float32 differences between the kernel's keys and the reference's),
                # plus the bf16 rounding of q c (2^-8 relative).
                k_max = np.abs(k[:, g] / c).max(axis=1)
                bound = (np.abs(qs[:, h]).sum(1)[:, None] * (ks[None, :, g] / 2 + 1e-5 * k_max[None, :])
                         + 2.0 ** -8 * np.abs(qs[:, h]) @ np.abs(k[:, g] / c).T)
                assert (np.abs(seen - true) <= bound).all(), f"head {h}: a score moved beyond INT8 rounding"
        got = to_f32(out.to_host(stream))
        errors[smooth] = float(np.linalg.norm(got - exact) / np.linalg.norm(exact))
    print(f"attention vs exact, ||err|| / ||ref||: plain {errors[False]:.4f}, smoothed {errors[True]:.4f}")
    assert not np.array_equal(codes[False], codes[True]), "smoothing did not change the stored keys"
    # Measured on the H200: plain 0.083, smoothed 0.0225 (int8 values and keys; bf16 output).
    assert errors[True] < 0.04, f"smoothed INT8 attention is {errors[True]:.4f} from the exact one"
    assert errors[True] < errors[False] / 2, f"smoothing did not help: {errors}"


def test_decode_builds_fit_the_blocks_an_sm_the_splits_count_on():
    # GPURunner._splits_for sizes decode grids to one wave of these blocks an SM; a build whose registers or
    # shared memory grew past them would run its grid in two waves without any test failing on values.
    from tileinfer.cuda.module import kernel
    att = importlib.import_module("tileinfer.kernels.attention")
    route = importlib.import_module("tileinfer.kernels.routing")
    for name, int8, rows, want in (("attention_decode_h8", False, 4, 2), ("attention_decode", False, 16, 2),
                                   ("attention_int8_decode_h8", True, 4, route.int8_decode_blocks(4)),
                                   ("attention_int8_decode", True, 16, route.int8_decode_blocks(16))):
        assert route.kernel_name(int8=int8, keys_mode=True, num_splits=1, pool_elements=0, arch="sm_90",
                                 rows=rows) == name
        half = name.endswith("_h8")
        got = kernel(route.kernel_file(name), name).max_active_blocks(128, att.smem_bytes(int8, True, half))
        assert got == want, f"{name}: {got} blocks an SM, the decode splits count on {want}"
