"""The INT8 KV cache's arithmetic on the host: quantization, key smoothing, and the numpy oracle.

One cached vector (one KV head at one position, head_dim values) is stored as int8 values q and
one float32 scale s, symmetric: s = max|x| / 127, q = round(x / s) (half to even, as the
kernels' __float2int_rn), x ~ s * q. A vector of zeros has s = 0 and q = 0. Quantized once, when
the position is written; scales never change afterwards.

Key smoothing: a few key channels can be ~100x the others (Qwen3's first layer; they come from
the key-norm weight w, since k = rope(rmsnorm(k) * w)), leaving one scale per vector few levels
for the rest. The cache stores k / c instead, with c = max(|w_i|, |w_j|) for each rotary pair
(i, j) (rotate-half RoPE pairs channel i with i + head_dim / 2): the same factor on both channels
a rotation mixes, so dividing commutes with RoPE. Queries are multiplied by c, so scores are
unchanged: (c q) . (k / c) = q . k. No calibration is needed.

Attention over the cache never dequantizes it: a key's scale multiplies its row of scores, a
value's scale multiplies its probability before the PV product. `attention_int8` is that
computation in numpy, the oracle for the kernels.
"""
from __future__ import annotations

import numpy as np

QMAX = 127


def smoothing_factors(k_norm_weight: np.ndarray) -> np.ndarray:
    """c[head_dim] = max(|w_i|, |w_{i + head_dim/2}|) on both channels of each rotary pair. # float32"""
    w = np.abs(np.asarray(k_norm_weight, np.float32))
    if w.ndim != 1 or w.size % 2:
        raise ValueError(f"the key-norm weight must be a vector of even length (head_dim), got shape {w.shape}")
    half = w.size // 2
    pair = np.maximum(w[:half], w[half:])
    c = np.concatenate([pair, pair])
    if not (c > 0).all():
        raise ValueError("key smoothing needs non-zero key-norm weights (a rotary pair has both weights zero)")
    return c


def quantize(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric int8 per vector (last axis): (q int8 [..., hd], scale float32 [...])."""
    x = np.asarray(x, np.float32)
    amax = np.max(np.abs(x), axis=-1)
    scale = (amax / np.float32(QMAX)).astype(np.float32)
    safe = np.where(scale > 0, scale, np.float32(1))
    q = np.clip(np.rint(x / safe[..., None]), -QMAX, QMAX).astype(np.int8)
    return q, scale


def dequantize(q: np.ndarray, scale: np.ndarray) -> np.ndarray:
    return np.asarray(q, np.float32) * np.asarray(scale, np.float32)[..., None]


def attention_int8(q: np.ndarray, k_q: np.ndarray, k_scale: np.ndarray, v_q: np.ndarray, v_scale: np.ndarray,
                   q_positions: np.ndarray, k_positions: np.ndarray, smoothing: np.ndarray | None = None) -> np.ndarray:
    """Causal GQA attention over an int8 cache, as the kernels compute it (in float64).

    q [n, H, hd] (float, before smoothing), k_q / v_q [m, KV, hd] int8, k_scale / v_scale [m, KV],
    smoothing c [hd] or None. scores = ((c q) . k_q) * k_scale / sqrt(hd); out = softmax(scores)
    * v_scale @ v_q. # [n, H, hd] float64
    """
    q = np.asarray(q, np.float64)
    if smoothing is not None:
        q = q * np.asarray(smoothing, np.float64)
    n, num_heads, hd = q.shape
    m, num_kv, _ = k_q.shape
    group = num_heads // num_kv
    visible = np.asarray(k_positions)[None, :] <= np.asarray(q_positions)[:, None]  # [n, m]
    out = np.empty((n, num_heads, hd))
    kq, vq = k_q.astype(np.float64), v_q.astype(np.float64)
    for h in range(num_heads):
        g = h // group
        scores = (q[:, h] @ kq[:, g].T) * k_scale[None, :, g] / np.sqrt(hd)   # [n, m]
        scores = np.where(visible, scores, -np.inf)
        p = np.exp(scores - scores.max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)
        out[:, h] = (p * v_scale[None, :, g]) @ vq[:, g]
    return out
