"""The paged KV cache: host-side page bookkeeping (block_manager) and the device pools (paged_cache)."""
from tileinfer.kv.block_manager import BlockManager, OutOfPagesError, Sequence
from tileinfer.kv.paged_cache import CacheLayout, PagedKVCache

__all__ = [
    "BlockManager",
    "CacheLayout",
    "OutOfPagesError",
    "PagedKVCache",
    "Sequence",
]
