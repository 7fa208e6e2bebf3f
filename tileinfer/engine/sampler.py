"""The sampling rule of cuda_src/sampling.cu, in numpy: the specification and the tests' oracle.

Greedy (temperature <= 0) is the argmax, lowest index on ties. Otherwise z = logits / T;
top-k keeps the tokens with z >= the k-th largest z; top-p then keeps the smallest top set
(by threshold) whose softmax mass within the top-k set reaches p. The sample is
argmax over kept i of z_i + g_i, g_i = -log(-log(u_i)), u_i = uniform01(seed, counter, i):
the Gumbel-max trick, which draws exactly from softmax over the kept set.
"""
from __future__ import annotations

import numpy as np

_M64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        x = x + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def uniform01(seed: int, counter: int, index: np.ndarray) -> np.ndarray:
    """Uniform floats in (0, 1), bit-identical to the kernel's uniform01. # [len(index)] float32"""
    key = (np.uint64(counter & 0xFFFFFFFF) << np.uint64(32)) | index.astype(np.uint64)
    h = _splitmix64(np.uint64(seed & 0xFFFFFFFFFFFFFFFF) ^ _splitmix64(key))
    return ((h >> np.uint64(41)).astype(np.float32) + np.float32(0.5)) * np.float32(1.0 / 8388608.0)


def scaled(logits: np.ndarray, temperature: float) -> np.ndarray:
    """z = logits * (1 / T) in float32, rounded as the kernel rounds it."""
    return logits.astype(np.float32) * (np.float32(1.0) / np.float32(temperature))


def kept_mask(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """Which tokens survive top-k then top-p. # [vocab] bool"""
    z = scaled(logits, temperature)
    keep = np.ones(z.shape, bool)
    if 0 < top_k < z.size:
        keep &= z >= np.sort(z)[::-1][top_k - 1]
    if top_p < 1.0:
        candidates = z[keep]
        order = np.argsort(-candidates, kind="stable")
        sorted_z = candidates[order]
        cum = np.cumsum(np.exp((sorted_z - sorted_z[0]).astype(np.float64)))
        idx = int(np.searchsorted(cum, top_p * cum[-1]))  # first prefix whose mass reaches p
        keep &= z >= sorted_z[min(idx, sorted_z.size - 1)]
    return keep


def sample(logits: np.ndarray, *, temperature: float, top_k: int = 0, top_p: float = 1.0,
           seed: int = 0, counter: int = 0) -> int:
    """The token the kernel picks for one row of logits."""
    if not temperature > 0:
        return int(np.argmax(logits))
    z = scaled(logits, temperature)
    keep = kept_mask(logits, temperature, top_k, top_p)
    idx = np.nonzero(keep)[0]
    u = uniform01(seed, counter, idx.astype(np.uint64))
    g = -np.log(-np.log(u))
    return int(idx[np.argmax(z[idx] + g)])
