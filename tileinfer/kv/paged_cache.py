"""The device side of the paged KV cache: one key pool and one value pool per layer.

Layout (row-major, the seed's column-major (head_dim, page_size, kv_heads, num_pages)):

    pools[layer, 0] = keys    [num_pages, kv_heads, page_size, head_dim]  bf16
    pools[layer, 1] = values  [num_pages, kv_heads, page_size, head_dim]  bf16

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

    @property
    def pool_shape(self) -> tuple[int, int, int, int]:
        return (self.num_pages, self.num_kv_heads, self.page_size, self.head_dim)

    @property
    def bytes_per_position(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * 2  # K and V, bf16

    @property
    def nbytes(self) -> int:
        return self.bytes_per_position * self.num_pages * self.page_size

    @property
    def block_table_width(self) -> int:
        return cdiv(min(self.max_seq_pages or self.num_pages, self.num_pages), 16) * 16


class PagedKVCache:
    """Pools for every layer plus the BlockManager that hands out their pages."""

    def __init__(self, config, *, max_tokens: int | None = None, num_pages: int | None = None, page_size: int = 64,
                 max_seq_len: int | None = None, enable_prefix_caching: bool = False):
        if (max_tokens is None) == (num_pages is None):
            raise ValueError("PagedKVCache: give exactly one of max_tokens or num_pages")
        if max_tokens is not None:
            if max_tokens < 1:
                raise ValueError(f"PagedKVCache: max_tokens must be >= 1, got {max_tokens}")
            num_pages = cdiv(max_tokens, page_size)
        if num_pages < 1:
            raise ValueError(f"PagedKVCache: num_pages must be >= 1, got {num_pages}")
        self.layout = CacheLayout(config.num_hidden_layers, num_pages, config.num_key_value_heads,
                                  page_size, config.head_dim, cdiv(max_seq_len, page_size) if max_seq_len else 0)
        self.manager = BlockManager(num_pages, page_size, enable_prefix_caching=enable_prefix_caching)
        L = self.layout
        self.pools = DeviceArray((L.num_layers, 2, *L.pool_shape), ml_dtypes.bfloat16)
        self._views = [(self.pools_view(i, 0), self.pools_view(i, 1)) for i in range(L.num_layers)]

    def pools_view(self, layer: int, kv: int) -> DeviceArray:
        L = self.layout
        per_pool = L.num_pages * L.num_kv_heads * L.page_size * L.head_dim * 2
        return DeviceArray(L.pool_shape, ml_dtypes.bfloat16, ptr=self.pools.ptr + (2 * layer + kv) * per_pool,
                           base=self.pools)

    def k_pool(self, layer: int) -> DeviceArray:
        return self._views[layer][0]

    def v_pool(self, layer: int) -> DeviceArray:
        return self._views[layer][1]

    @property
    def page_size(self) -> int:
        return self.layout.page_size

    @property
    def capacity(self) -> int:
        """Positions the pool holds."""
        return self.layout.num_pages * self.layout.page_size

    def copy_pages(self, copies: list[tuple[int, int]], stream) -> None:
        """Copy whole pages (src, dst), keys and values of every layer, in order (copy-on-write)."""
        L = self.layout
        page_bytes = L.num_kv_heads * L.page_size * L.head_dim * 2
        for src, dst in copies:
            for layer in range(L.num_layers):
                for kv in (0, 1):
                    base = self.pools_view(layer, kv).ptr
                    call(driver.cuMemcpyDtoDAsync, base + dst * page_bytes, base + src * page_bytes, page_bytes,
                         stream.handle)

    def to_host(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """(keys, values) of one layer as numpy arrays [num_pages, kv_heads, page_size, head_dim] (tests)."""
        return self.k_pool(layer).to_host(), self.v_pool(layer).to_host()

    def free(self) -> None:
        self.pools.free()
