"""The device side of the paged KV cache: one key pool and one value pool per layer.

Layout (row-major, the seed's column-major (head_dim, page_size, kv_heads, num_pages)):

    pools[layer, 0] = keys    [num_pages, kv_heads, page_size, head_dim]  bf16, or int8 codes
    pools[layer, 1] = values  [num_pages, kv_heads, page_size, head_dim]  bf16, or int8 codes
    scales[layer, 0 / 1]      [num_pages, kv_heads, page_size]            float32, INT8 only

The INT8 cache (kv_quantize="int8", tileinfer/kv/int8.py) stores each vector (one KV head at one
position) as int8 codes plus one float32 scale, written once by the attention-input kernel. With
key smoothing (the default) the keys are stored divided by per-channel factors c derived from
each layer's key-norm weight, and the queries multiplied by them: `smoothing` [layers, head_dim].

A position's slot is page * page_size + offset; one (page, kv_head) is a contiguous
[page_size, head_dim] tile, which is what the attention kernels load. Every layer's pools
share the sequences' block tables (the BlockManager's pages index all layers at once).

The block table the kernels see has a fixed width: the pages of the longest sequence the cache
serves (`max_seq_len`, default: the whole pool), rounded up to a multiple of 16, so a captured
graph stays valid however long a sequence grows.
"""
from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np

from cuda.bindings import driver

from ..cuda import DeviceArray, call
from .block_manager import BlockManager

KV_QUANTIZE = (None, "bf16", "int8")


def check_kv_quantize(kv_quantize) -> bool:
    """Validate a kv_quantize setting; True for the INT8 cache."""
    if kv_quantize not in KV_QUANTIZE:
        raise ValueError(f"kv_quantize must be None or 'bf16' (a BF16 cache) or 'int8' (int8 values + one float32 "
                         f"scale per vector), got {kv_quantize!r}")
    return kv_quantize == "int8"


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True, slots=True)
class CacheLayout:
    num_layers: int
    num_pages: int
    num_kv_heads: int
    page_size: int
    head_dim: int
    max_seq_pages: int = 0  # pages one sequence may hold (0: the whole pool)
    int8: bool = False       # int8 codes + a float32 scale per vector, instead of bf16

    @property
    def pool_shape(self) -> tuple[int, int, int, int]:
        return (self.num_pages, self.num_kv_heads, self.page_size, self.head_dim)

    @property
    def bytes_per_vector(self) -> int:
        """One KV head at one position: bf16 values, or int8 codes and a float32 scale."""
        return self.head_dim + 4 if self.int8 else 2 * self.head_dim

    @property
    def bytes_per_position(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.bytes_per_vector  # K and V

    @property
    def dtype_name(self) -> str:
        return "int8" if self.int8 else "bf16"

    @property
    def nbytes(self) -> int:
        return self.bytes_per_position * self.num_pages * self.page_size

    @property
    def block_table_width(self) -> int:
        return cdiv(min(self.max_seq_pages or self.num_pages, self.num_pages), 16) * 16


class PagedKVCache:
    """Pools for every layer plus the BlockManager that hands out their pages."""

    def __init__(self, config, *, max_tokens: int | None = None, num_pages: int | None = None, page_size: int = 64,
                 max_seq_len: int | None = None, enable_prefix_caching: bool = False, kv_quantize: str | None = None,
                 smoothing: np.ndarray | None = None):
        """kv_quantize: None / "bf16" or "int8". smoothing (INT8 only): the key-smoothing factors
        [num_layers, head_dim] (tileinfer.kv.int8.smoothing_factors of each layer's key-norm weight),
        or None to store keys unsmoothed."""
        if (max_tokens is None) == (num_pages is None):
            raise ValueError("PagedKVCache: give exactly one of max_tokens or num_pages")
        int8 = check_kv_quantize(kv_quantize)
        if max_tokens is not None:
            if max_tokens < 1:
                raise ValueError(f"PagedKVCache: max_tokens must be >= 1, got {max_tokens}")
            num_pages = cdiv(max_tokens, page_size)
        if num_pages < 1:
            raise ValueError(f"PagedKVCache: num_pages must be >= 1, got {num_pages}")
        self.layout = CacheLayout(config.num_hidden_layers, num_pages, config.num_key_value_heads,
                                  page_size, config.head_dim, cdiv(max_seq_len, page_size) if max_seq_len else 0,
                                  int8=int8)
        L = self.layout
        if smoothing is not None:
            smoothing = np.ascontiguousarray(smoothing, np.float32)
            if not int8:
                raise ValueError("PagedKVCache: key smoothing applies to the INT8 cache only")
            if smoothing.shape != (L.num_layers, L.head_dim) or not (smoothing > 0).all():
                raise ValueError(f"PagedKVCache: smoothing must be positive factors of shape "
                                 f"{(L.num_layers, L.head_dim)}, got {smoothing.shape}")
        self.manager = BlockManager(num_pages, page_size, enable_prefix_caching=enable_prefix_caching)
        self._arrays: list[DeviceArray] = []
        try:
            self.pools = self._alloc((L.num_layers, 2, *L.pool_shape), np.int8 if int8 else ml_dtypes.bfloat16)
            self.scales = self._alloc((L.num_layers, 2, *L.pool_shape[:3]), np.float32) if int8 else None
            self.smoothing = DeviceArray.from_host(smoothing) if smoothing is not None else None
            if self.smoothing is not None:
                self._arrays.append(self.smoothing)
        except BaseException:
            self.free()
            raise
        self._views = [(self._view(self.pools, i, kv), self._view(self.scales, i, kv) if int8 else None)
                       for i in range(L.num_layers) for kv in (0, 1)]

    def _alloc(self, shape, dtype) -> DeviceArray:
        array = DeviceArray(shape, dtype)
        self._arrays.append(array)
        return array

    @staticmethod
    def _view(array: DeviceArray, layer: int, kv: int) -> DeviceArray:
        """array[layer, kv] as its own DeviceArray (no copy)."""
        inner = array.shape[2:]
        nbytes = int(np.prod(inner)) * array.dtype.itemsize
        return DeviceArray(inner, array.dtype, ptr=array.ptr + (2 * layer + kv) * nbytes, base=array)

    @property
    def int8(self) -> bool:
        return self.layout.int8

    def k_pool(self, layer: int) -> DeviceArray:
        return self._views[2 * layer][0]

    def v_pool(self, layer: int) -> DeviceArray:
        return self._views[2 * layer + 1][0]

    def layer_scales(self, layer: int) -> tuple[DeviceArray, DeviceArray] | None:
        """(k_scale, v_scale) [num_pages, kv_heads, page_size] float32 of one layer; None for BF16."""
        if not self.int8:
            return None
        return self._views[2 * layer][1], self._views[2 * layer + 1][1]

    def layer_smoothing(self, layer: int) -> DeviceArray | None:
        """One layer's key-smoothing factors [head_dim] float32, or None (BF16, or smoothing off)."""
        if self.smoothing is None:
            return None
        return self.smoothing.rows(layer, layer + 1).view((self.layout.head_dim,))

    @property
    def page_size(self) -> int:
        return self.layout.page_size

    @property
    def capacity(self) -> int:
        """Positions the pool holds."""
        return self.layout.num_pages * self.layout.page_size

    def copy_pages(self, copies: list[tuple[int, int]], stream) -> None:
        """Copy whole pages (src, dst), keys and values (and INT8 scales) of every layer, in order
        (copy-on-write)."""
        L = self.layout
        for src, dst in copies:
            for layer in range(L.num_layers):
                for kv in (0, 1):
                    pool, scales = self._views[2 * layer + kv]
                    for array in (pool, scales) if scales is not None else (pool,):
                        page_bytes = array.nbytes // L.num_pages
                        call(driver.cuMemcpyDtoDAsync, array.ptr + dst * page_bytes, array.ptr + src * page_bytes,
                             page_bytes, stream.handle)

    def to_host(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """(keys, values) of one layer as numpy arrays [num_pages, kv_heads, page_size, head_dim] (tests):
        bf16 values, or the INT8 cache's codes (see layer_scales for their scales)."""
        return self.k_pool(layer).to_host(), self.v_pool(layer).to_host()

    def free(self) -> None:
        for array in reversed(self._arrays):
            array.free()
        self._arrays.clear()
