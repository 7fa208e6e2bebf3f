"""What the kernel test files share: fixed per-case seeds and device buffers freed after each test."""
from __future__ import annotations

import math
import zlib
from functools import lru_cache

import ml_dtypes
import numpy as np

from tileinfer.cuda import DeviceArray

POISON = 0xFF  # byte pattern: bf16 0xFFFF and float32 0xFFFFFFFF are NaN, int32 is -1
BF16 = np.dtype(ml_dtypes.bfloat16)


def seed_of(*parts) -> int:
    """A fixed seed per test case (stable across runs, unlike hash())."""
    return zlib.crc32(repr(parts).encode())


class Buffers:
    """Device arrays of one test, all on the test's stream; freed when the test ends (fixture `buf`)."""

    def __init__(self, stream):
        self.stream = stream
        self._owned: list[DeviceArray] = []

    def upload(self, host: np.ndarray) -> DeviceArray:
        array = DeviceArray.from_host(np.ascontiguousarray(host), self.stream)
        self._owned.append(array)
        return array

    def poisoned(self, shape, dtype) -> DeviceArray:
        array = DeviceArray.empty(shape, dtype)
        self._owned.append(array)
        array.fill_bytes(POISON, self.stream)
        return array

    def free(self) -> None:
        for array in reversed(self._owned):
            array.free()
        self._owned.clear()


def rand_bf16(rng: np.random.Generator, shape, scale: float = 1.0, mean: float = 0.0) -> np.ndarray:
    """Normal(mean, scale) samples rounded to bf16."""
    return (rng.standard_normal(shape, dtype=np.float32) * np.float32(scale) + np.float32(mean)).astype(BF16)


def to_f32(a) -> np.ndarray:
    """Exact float32 copy (bf16 widened by a bit shift: fast on big weights)."""
    a = np.asarray(a)
    if a.dtype == BF16:
        return (np.ascontiguousarray(a).view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    return a.astype(np.float32)


def to_f64(a) -> np.ndarray:
    return to_f32(a).astype(np.float64)


def rms(a) -> float:
    """Root mean square, in float64, a chunk at a time (weights can be 155M entries)."""
    flat = np.asarray(a).reshape(-1)
    total = 0.0
    for i in range(0, flat.size, 1 << 24):
        chunk = to_f64(flat[i:i + (1 << 24)])
        total += float(np.dot(chunk, chunk))
    return math.sqrt(total / max(flat.size, 1))


@lru_cache(maxsize=3)
def attn_input_tensors(rng: np.random.Generator, n: int, H: int, KV: int, hd: int = 128):
    """Inputs of the attention-input kernels: qkv [n, (H + 2 KV) hd] and the q/k norm weights, the
    key norm with a few huge channels, as Qwen3's k_norm has."""
    qkv = rand_bf16(rng, (n, (H + 2 * KV) * hd), scale=2.0)
    q_norm = rand_bf16(rng, (hd,), scale=0.1, mean=1.0)
    k_norm = rand_bf16(rng, (hd,), scale=0.1, mean=1.0)
    k_norm[5], k_norm[70] = BF16.type(100.0), BF16.type(-90.0)
    return qkv, q_norm, k_norm


def linear_weight(N: int, K: int) -> np.ndarray:
    """W [N, K] bf16 with std 1/sqrt(K) (so x @ W.T is O(1)); drawn once per shape, read-only."""
    w = rand_bf16(np.random.default_rng(seed_of("weight", N, K)), (N, K), scale=1 / math.sqrt(K))
    w.flags.writeable = False
    return w


def matmul_ref(x: np.ndarray, w: np.ndarray, chunk: int = 16384) -> np.ndarray:
    """x @ w.T in float64 from bf16 x [M, K] and w [N, K], w widened a chunk of rows at a time. # [M, N]"""
    x64 = to_f64(x)
    out = np.empty((x.shape[0], w.shape[0]))
    for i in range(0, w.shape[0], chunk):
        out[:, i:i + chunk] = x64 @ to_f64(w[i:i + chunk]).T
    return out
