"""Pages and block tables of the paged KV cache, on the host (pure Python, no device).

A sequence's cached positions live in fixed-size pages of a device pool. Position p lives in
page `block_table[p // page_size]` at offset `p % page_size`; its flat slot in the pool is
`page * page_size + offset`. The BlockManager hands pages out from a stack of free page ids, so
growing, rolling back (speculative decoding) and releasing a sequence are list operations:
nothing on the device is copied or cleared, later steps simply overwrite stale slots.

Page ids are 0-based indices into the device pool.
"""
from __future__ import annotations

from collections.abc import Iterable

import numpy as np

_INT32_MAX = 2**31 - 1


class OutOfPagesError(RuntimeError):
    """The pool has fewer free pages than a reservation needs. Nothing was changed."""

    def __init__(self, needed: int, free: int, page_size: int | None = None):
        self.needed = needed
        self.free = free
        per_page = f" of {page_size} positions" if page_size else ""
        super().__init__(
            f"KV cache is out of pages: need {needed} more page(s){per_page} but only {free} are free. "
            f"Create the cache with a larger max_tokens, or release finished sequences first.")


class Sequence:
    """The cached positions of one sequence: how many, and the pages that hold them, in order.

    Only a BlockManager changes these fields; read them, do not assign them.
    """

    def __init__(self) -> None:
        self.num_positions = 0
        self.block_table: list[int] = []
        self._manager: BlockManager | None = None  # set on first reservation; one manager per sequence

    def __repr__(self) -> str:
        return f"Sequence(num_positions={self.num_positions}, block_table={self.block_table})"


class BlockManager:
    """Hands out pages of one pool to sequences. O(1) per page; check before commit."""

    def __init__(self, num_pages: int, page_size: int = 64):
        _check_count("num_pages", num_pages, minimum=1)
        _check_count("page_size", page_size, minimum=1)
        if num_pages * page_size > _INT32_MAX:
            raise ValueError(
                f"num_pages * page_size = {num_pages * page_size} slots does not fit the int32 slot "
                f"indices the kernels use; use fewer pages (at most {_INT32_MAX // page_size}).")
        self.num_pages = num_pages
        self.page_size = page_size
        # Stack of free page ids, top at the end: page 0 is handed out first.
        self._free: list[int] = list(range(num_pages - 1, -1, -1))

    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    def pages_for(self, num_positions: int) -> int:
        """Pages needed to hold `num_positions` positions (a ceil-div)."""
        return -(-num_positions // self.page_size)

    # ------------------------------------------------------------------ growing and shrinking

    def can_reserve(self, seq: Sequence, n: int) -> bool:
        """Whether `reserve(seq, n)` would succeed now."""
        self._check_owner(seq)
        _check_count("n", n)
        return self._new_pages_needed(seq, n) <= len(self._free)

    def reserve(self, seq: Sequence, n: int) -> None:
        """Extend `seq` by n positions, taking pages as needed. On failure nothing changes."""
        self._check_owner(seq)
        _check_count("n", n)
        needed = self._new_pages_needed(seq, n)
        if needed > len(self._free):
            raise OutOfPagesError(needed, len(self._free), self.page_size)
        # Commit only after the check above: nothing below can fail.
        for _ in range(needed):
            seq.block_table.append(self._free.pop())
        seq.num_positions += int(n)
        seq._manager = self

    def truncate(self, seq: Sequence, n: int) -> None:
        """Keep the first n positions of `seq`; return pages no longer needed. Copies nothing."""
        self._check_owner(seq)
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or not 0 <= n <= seq.num_positions:
            raise ValueError(
                f"cannot truncate a sequence of {seq.num_positions} positions to {n!r}: "
                f"n must be an integer in 0..{seq.num_positions}")
        keep = self.pages_for(int(n))
        dropped = seq.block_table[keep:]
        del seq.block_table[keep:]
        # Push in reverse so a following reserve gets the same pages back in the same order.
        self._free.extend(reversed(dropped))
        seq.num_positions = int(n)

    def release(self, seq: Sequence) -> None:
        """Return all of `seq`'s pages; it is left empty and may be used with any manager."""
        self.truncate(seq, 0)
        seq._manager = None

    # ------------------------------------------------------------------ what the step buffers need

    def slots(self, seq: Sequence, start: int, n: int) -> np.ndarray:
        """Flat pool slots (page * page_size + offset) of positions start..start+n-1. # [n] int32"""
        self._check_owner(seq)
        _check_count("start", start)
        _check_count("n", n)
        if start + n > seq.num_positions:
            raise ValueError(
                f"positions {start}..{start + n - 1} are outside the sequence, which has "
                f"{seq.num_positions} reserved positions; reserve them first")
        positions = np.arange(start, start + n, dtype=np.int64)
        table = np.asarray(seq.block_table, dtype=np.int64)
        pages = table[positions // self.page_size]
        return (pages * self.page_size + positions % self.page_size).astype(np.int32)

    def block_table_array(self, seqs: Iterable[Sequence], width: int) -> np.ndarray:
        """Block tables of `seqs`, zero-padded to `width` pages. # [len(seqs), width] int32"""
        _check_count("width", width)
        seqs = list(seqs)
        out = np.zeros((len(seqs), width), dtype=np.int32)
        for row, seq in enumerate(seqs):
            self._check_owner(seq)
            table = seq.block_table
            if len(table) > width:
                raise ValueError(
                    f"sequence {row} has {len(table)} pages, more than the block table width {width}; "
                    f"size the table for the whole pool")
            out[row, :len(table)] = table
        return out

    # ------------------------------------------------------------------ helpers

    def _new_pages_needed(self, seq: Sequence, n: int) -> int:
        return self.pages_for(seq.num_positions + n) - len(seq.block_table)

    def _check_owner(self, seq: Sequence) -> None:
        if not isinstance(seq, Sequence):
            raise TypeError(f"expected a tileinfer.kv.Sequence, got {type(seq).__name__}")
        if seq._manager is not None and seq._manager is not self:
            raise ValueError(
                "this sequence holds pages of another BlockManager (another cache); "
                "use one manager per sequence, or release it from its manager first")

    def __repr__(self) -> str:
        return (f"BlockManager(num_pages={self.num_pages}, page_size={self.page_size}, "
                f"free={self.num_free_pages})")


def _check_count(name: str, value: object, minimum: int = 0) -> None:
    """Raise a ValueError naming `name` unless value is an integer >= minimum."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
