"""Pages and block tables of the paged KV cache, on the host (pure Python, no device).

A sequence's cached positions live in fixed-size pages of a device pool. Position p lives in
page `block_table[p // page_size]` at offset `p % page_size`; its flat slot in the pool is
`page * page_size + offset`. The BlockManager hands pages out from a stack of free page ids, so
growing, rolling back (speculative decoding) and releasing a sequence are list operations:
nothing on the device is copied or cleared, later steps simply overwrite stale slots.

Page ids are 0-based indices into the device pool.

Prefix caching (`enable_prefix_caching=True`; off by default, and then nothing below happens)
---------------------------------------------------------------------------------------------
Sequences whose tokens start alike share the pages that hold the common prefix. Only FULL pages
are ever hashed or shared. A page is named by a chained hash over everything before it, because
the keys and values at a position depend on the whole prefix, not just the page's own tokens:

    hash_i = sha256(hash_{i-1} || tokens of page i as int64)        hash_{-1} = b""

The index maps a hash to one registered page and keeps that page's tokens and which entry its
parent page was. A lookup is a hit only if the tokens are equal and the parent is the very entry
matched one page earlier, so a hash collision can never hand out another prefix's data.

Every page is exactly one of:
  free         on the free stack, no hash;
  cached-free  held by no sequence but still registered, so a later prompt with the same prefix
               takes it back without recomputing. Kept in least-recently-released order and
               evicted (unregistered) oldest first, only when the free stack is empty and a
               reservation needs a page;
  used         held by ref_count >= 1 sequences (registered or not).
`num_free_pages` counts free + cached-free pages: both can serve a reservation.

What the engine calls, and when:
  1. Admit a prompt with `cached = allocate_prompt(seq, prompt)` (`can_allocate_prompt` first, to
     check before committing). Positions 0..cached-1 are already in the cache; prefill
     prompt[cached:] only. `cached` is at most len(prompt) - 1 rounded down to a page, so the
     last prompt token is always computed (its logits exist) and its page is never shared.
  2. Before every step (of any sequence): run `take_pending_copies()`, each (src, dst) a copy of
     the whole page, keys and values of every layer, in the order given.
  3. After every step: `cache_full_pages(seq, tokens)`, tokens = the ids whose keys and values
     the steps have now written at positions 0..len(tokens)-1 (not a sampled token that has not
     been fed yet). It names the pages that became full; they can be shared from then on.
  4. `release(seq)` when done: its registered pages stay cached-free for later prompts.

Copy-on-write. Shared pages are full and a sequence writes only positions >= num_positions, so
sharing never lets one sequence write into another's page, except after `truncate(seq, n)` cuts
into a full page (n % page_size != 0): later steps rewrite that page from offset n % page_size.
  - If other sequences hold the page too (ref_count > 1), the sequence gets a new page and a
    pending copy (old, new) is recorded; the old page is left untouched for its other holders.
  - If only this sequence holds it but it is registered, its hash is dropped (its contents are
    about to change) and the sequence keeps the page.
When the new page cannot be had, truncate raises OutOfPagesError and changes nothing.
"""
from __future__ import annotations

import hashlib
import itertools
import struct
from collections import OrderedDict
from collections.abc import Iterable, Sequence as _TokenList

import numpy as np

_INT32_MAX = 2**31 - 1
_ROOT = b""  # the "parent hash" of a sequence's first page


class OutOfPagesError(RuntimeError):
    """The pool has fewer free pages than a reservation needs. Nothing was changed."""

    def __init__(self, needed: int, free: int, page_size: int | None = None):
        self.needed = needed
        self.free = free
        per_page = f" of {page_size} positions" if page_size else ""
        super().__init__(
            f"KV cache is out of pages: need {needed} more page(s){per_page} but only {free} are free. "
            f"Create the cache with a larger max_tokens, or release finished sequences first.")


def hash_page(parent_hash: bytes, tokens: tuple[int, ...]) -> bytes:
    """Chained name of a full page: sha256 of the parent page's hash and this page's tokens (int64 LE)."""
    return hashlib.sha256(parent_hash + struct.pack(f"<{len(tokens)}q", *tokens)).digest()


class _PageEntry:
    """One registered full page: its hash, its tokens, its page, and its parent entry's serial."""

    __slots__ = ("hash", "tokens", "page", "serial", "parent_serial")

    def __init__(self, hash_: bytes, tokens: tuple[int, ...], page: int, serial: int, parent_serial: int):
        self.hash, self.tokens, self.page = hash_, tokens, page
        self.serial, self.parent_serial = serial, parent_serial

    def follows(self, parent: _PageEntry | None, tokens: tuple[int, ...]) -> bool:
        """Whether this entry holds `tokens` right after `parent` (None: at the start). The check
        a hash hit must pass: serials are never reused, so this also rules out parent collisions."""
        return self.parent_serial == (parent.serial if parent else 0) and self.tokens == tokens


class Sequence:
    """The cached positions of one sequence: how many, and the pages that hold them, in order.

    Only a BlockManager changes these fields; read them, do not assign them.
    """

    def __init__(self) -> None:
        self.num_positions = 0
        self.block_table: list[int] = []
        self.table_version = 0  # bumped on every change of block_table (step buffers skip unchanged rows)
        self._manager: BlockManager | None = None  # set on first reservation; one manager per sequence
        # Prefix caching: for each leading full page already named, the index entry with the same
        # contents (this page's own, or an identical page's); None after a hash collision, which
        # leaves this sequence's later pages unnamed.
        self._page_entries: list[_PageEntry | None] = []

    def __repr__(self) -> str:
        return f"Sequence(num_positions={self.num_positions}, block_table={self.block_table})"


class BlockManager:
    """Hands out pages of one pool to sequences. O(1) per page touched; check before commit."""

    def __init__(self, num_pages: int, page_size: int = 64, enable_prefix_caching: bool = False):
        _check_count("num_pages", num_pages, minimum=1)
        _check_count("page_size", page_size, minimum=1)
        if num_pages * page_size > _INT32_MAX:
            raise ValueError(
                f"num_pages * page_size = {num_pages * page_size} slots does not fit the int32 slot "
                f"indices the kernels use; use fewer pages (at most {_INT32_MAX // page_size}).")
        self.num_pages = num_pages
        self.page_size = page_size
        self.enable_prefix_caching = bool(enable_prefix_caching)
        # Stack of free page ids, top at the end: page 0 is handed out first.
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self._refs: dict[int, int] = {}  # used page -> number of sequences holding it (absent: 0)
        # Prefix caching (all empty when it is off).
        self._cached_free: OrderedDict[int, None] = OrderedDict()  # oldest release first
        self._index: dict[bytes, _PageEntry] = {}  # hash -> the one registered page with it
        self._registered: dict[int, _PageEntry] = {}  # page -> its entry in _index
        self._serials = itertools.count(1)  # 0 is the root's
        self._pending_copies: list[tuple[int, int]] = []

    @property
    def num_free_pages(self) -> int:
        """Pages a reservation can take: free ones and cached-free ones (evicted when needed)."""
        return len(self._free) + len(self._cached_free)

    @property
    def num_cached_pages(self) -> int:
        """Cached-free pages: held by no sequence, still registered for prefix hits."""
        return len(self._cached_free)

    def pages_for(self, num_positions: int) -> int:
        """Pages needed to hold `num_positions` positions (a ceil-div)."""
        return -(-num_positions // self.page_size)

    # ------------------------------------------------------------------ growing and shrinking

    def can_reserve(self, seq: Sequence, n: int) -> bool:
        """Whether `reserve(seq, n)` would succeed now."""
        self._check_owner(seq)
        _check_count("n", n)
        return self._new_pages_needed(seq, n) <= self.num_free_pages

    def try_reserve(self, seq: Sequence, n: int) -> bool:
        """`reserve(seq, n)` if the pool has the pages it needs; whether it did. A decode step's usual case,
        positions that fit the sequence's last page, takes no page and only counts them."""
        if seq._manager is self and type(n) is int and n >= 0 \
                and seq.num_positions + n <= len(seq.block_table) * self.page_size:
            seq.num_positions += n
            return True
        if not self.can_reserve(seq, n):
            return False
        self.reserve(seq, n)
        return True

    def reserve(self, seq: Sequence, n: int) -> None:
        """Extend `seq` by n positions, taking pages as needed. On failure nothing changes."""
        self._check_owner(seq)
        _check_count("n", n)
        needed = self._new_pages_needed(seq, n)
        if needed > self.num_free_pages:
            raise OutOfPagesError(needed, self.num_free_pages, self.page_size)
        # Commit only after the check above: nothing below can fail.
        self._take_pages(seq, needed)
        seq.num_positions += int(n)
        seq._manager = self

    def truncate(self, seq: Sequence, n: int) -> None:
        """Keep the first n positions of `seq`; return pages no longer needed. Copies nothing,
        except when n cuts into a page other sequences share (see the module docstring)."""
        self._check_owner(seq)
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or not 0 <= n <= seq.num_positions:
            raise ValueError(
                f"cannot truncate a sequence of {seq.num_positions} positions to {n!r}: "
                f"n must be an integer in 0..{seq.num_positions}")
        n = int(n)
        keep = self.pages_for(n)
        dropped = seq.block_table[keep:]
        # The page holding position n, if the sequence keeps part of it and will rewrite the rest.
        cut = keep - 1 if n % self.page_size and n < seq.num_positions else None
        copy_on_write = cut is not None and self._refs[seq.block_table[cut]] > 1
        if copy_on_write:
            available = self.num_free_pages + sum(1 for page in dropped if self._refs[page] == 1)
            if available < 1:
                raise OutOfPagesError(1, available, self.page_size)
        # Commit.
        seq.table_version += 1
        del seq.block_table[keep:]
        del seq._page_entries[n // self.page_size:]
        # Reversed: a following reserve gets the same pages back in the same order, and of a
        # released prefix the last page is evicted first.
        for page in reversed(dropped):
            self._drop(page)
        if copy_on_write:
            old = seq.block_table[cut]
            self._refs[old] -= 1
            new = self._take_page()
            seq.block_table[cut] = new
            self._pending_copies.append((old, new))
        elif cut is not None and seq.block_table[cut] in self._registered:
            self._unregister(seq.block_table[cut])
        seq.num_positions = n

    def release(self, seq: Sequence) -> None:
        """Return all of `seq`'s pages; it is left empty and may be used with any manager."""
        self.truncate(seq, 0)
        seq._manager = None

    # ------------------------------------------------------------------ prefix caching

    def match_prefix(self, token_ids: _TokenList[int]) -> tuple[list[int], int]:
        """The cached pages holding the longest prefix of `token_ids`, and how many positions they
        hold. Read-only. Leaves at least the last token to compute: at most
        (len(token_ids) - 1) // page_size pages. ([], 0) when prefix caching is off."""
        hits = self._match(token_ids)
        return [entry.page for entry in hits], len(hits) * self.page_size

    def can_allocate_prompt(self, seq: Sequence, token_ids: _TokenList[int]) -> bool:
        """Whether `allocate_prompt(seq, token_ids)` would succeed now."""
        self._check_empty(seq)
        needed, available = self._prompt_pages(self._match(token_ids), len(token_ids))
        return needed <= available

    def allocate_prompt(self, seq: Sequence, token_ids: _TokenList[int]) -> int:
        """Give an empty `seq` the positions of a whole prompt, sharing cached pages of its prefix.

        Returns how many leading positions are already in the cache (a multiple of page_size,
        at most len - 1): the engine prefills only token_ids[returned:]. With prefix caching off
        this is `reserve(seq, len(token_ids))` and returns 0. On failure nothing changes.
        """
        self._check_empty(seq)
        hits = self._match(token_ids)
        needed, available = self._prompt_pages(hits, len(token_ids))
        if needed > available:
            raise OutOfPagesError(needed, available, self.page_size)
        # Commit: take the hits out of the cached-free list before any eviction can see them.
        for entry in hits:
            if entry.page in self._refs:
                self._refs[entry.page] += 1
            else:
                del self._cached_free[entry.page]
                self._refs[entry.page] = 1
            seq.block_table.append(entry.page)
        seq.table_version += 1
        seq._page_entries.extend(hits)
        self._take_pages(seq, needed)
        seq.num_positions = len(token_ids)
        seq._manager = self
        return len(hits) * self.page_size

    def cache_full_pages(self, seq: Sequence, token_ids: _TokenList[int]) -> None:
        """Name (register) `seq`'s pages that are now full, so later prompts can share them.

        token_ids[:k] must be the tokens whose keys and values completed steps wrote at positions
        0..k-1 (k <= num_positions). Only pages not named before are hashed. A page whose hash
        another page already holds with the same contents stays unregistered (one entry per
        hash). A no-op when prefix caching is off.
        """
        self._check_owner(seq)
        if not self.enable_prefix_caching:
            return
        if len(token_ids) > seq.num_positions:
            raise ValueError(
                f"cache_full_pages: {len(token_ids)} tokens given but the sequence has only "
                f"{seq.num_positions} positions; pass the tokens whose keys and values are written")
        entries = seq._page_entries
        if entries and entries[-1] is None:
            return  # a collision ended this sequence's chain; its later pages stay unshared
        for i in range(len(entries), len(token_ids) // self.page_size):
            parent = entries[-1] if entries else None
            tokens = self._page_tokens(token_ids, i)
            page_hash = hash_page(parent.hash if parent else _ROOT, tokens)
            entry = self._index.get(page_hash)
            if entry is None:
                page = seq.block_table[i]
                entry = _PageEntry(page_hash, tokens, page, next(self._serials),
                                   parent.serial if parent else 0)
                self._index[page_hash] = entry
                self._registered[page] = entry
            elif not entry.follows(parent, tokens):
                entries.append(None)
                return
            entries.append(entry)

    def take_pending_copies(self) -> list[tuple[int, int]]:
        """Page copies (src, dst) that truncate's copy-on-write recorded; run them, in order, before
        the next step. Returns them and forgets them."""
        copies, self._pending_copies = self._pending_copies, []
        return copies

    # ------------------------------------------------------------------ introspection (tests, stats)

    def ref_count(self, page: int) -> int:
        """How many sequences hold `page`."""
        self._check_page(page)
        return self._refs.get(page, 0)

    def page_state(self, page: int) -> str:
        """One of "used" (held by a sequence), "cached" (cached-free) or "free"."""
        self._check_page(page)
        if page in self._refs:
            return "used"
        return "cached" if page in self._cached_free else "free"

    def registered_tokens(self, page: int) -> tuple[int, ...] | None:
        """The tokens `page` is registered with for prefix hits, or None if it is not registered."""
        self._check_page(page)
        entry = self._registered.get(page)
        return entry.tokens if entry else None

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
        ps = self.page_size
        if n and start // ps == (start + n - 1) // ps:  # within one page (a decode row, most verify rows)
            first = seq.block_table[start // ps] * ps + start % ps
            return np.arange(first, first + n, dtype=np.int32)
        positions = np.arange(start, start + n, dtype=np.int64)
        table = np.asarray(seq.block_table, dtype=np.int64)
        pages = table[positions // ps]
        return (pages * ps + positions % ps).astype(np.int32)

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

    def _take_pages(self, seq: Sequence, count: int) -> None:
        seq.table_version += 1
        for _ in range(count):
            seq.block_table.append(self._take_page())

    def _take_page(self) -> int:
        """A page for one holder: from the free stack, else evict the least recently released
        cached-free page. The caller has checked that one exists."""
        if self._free:
            page = self._free.pop()
        else:
            page, _ = self._cached_free.popitem(last=False)
            self._unregister(page)
        self._refs[page] = 1
        return page

    def _drop(self, page: int) -> None:
        """One holder lets go of `page`; with none left it becomes cached-free if registered."""
        refs = self._refs[page] - 1
        if refs:
            self._refs[page] = refs
            return
        del self._refs[page]
        if page in self._registered:
            self._cached_free[page] = None  # most recently released: evicted last
        else:
            self._free.append(page)

    def _unregister(self, page: int) -> None:
        entry = self._registered.pop(page)
        del self._index[entry.hash]

    def _match(self, token_ids: _TokenList[int]) -> list[_PageEntry]:
        if not self.enable_prefix_caching:
            return []
        hits: list[_PageEntry] = []
        parent = None
        for i in range((len(token_ids) - 1) // self.page_size):  # never the last token's page
            tokens = self._page_tokens(token_ids, i)
            entry = self._index.get(hash_page(parent.hash if parent else _ROOT, tokens))
            if entry is None or not entry.follows(parent, tokens):
                break
            hits.append(entry)
            parent = entry
        return hits

    def _prompt_pages(self, hits: list[_PageEntry], num_tokens: int) -> tuple[int, int]:
        """(new pages a prompt needs beyond its hits, pages available once the hits are taken)."""
        hits_cached_free = sum(1 for entry in hits if entry.page not in self._refs)
        return self.pages_for(num_tokens) - len(hits), self.num_free_pages - hits_cached_free

    def _page_tokens(self, token_ids: _TokenList[int], i: int) -> tuple[int, ...]:
        return tuple(int(t) for t in token_ids[i * self.page_size:(i + 1) * self.page_size])

    def _check_empty(self, seq: Sequence) -> None:
        self._check_owner(seq)
        if seq.num_positions:
            raise ValueError(
                f"allocate_prompt needs an empty sequence, this one has {seq.num_positions} positions; "
                f"release it first, or use reserve to extend it")

    def _check_page(self, page: int) -> None:
        if isinstance(page, bool) or not isinstance(page, (int, np.integer)) or not 0 <= page < self.num_pages:
            raise ValueError(f"page must be an integer in 0..{self.num_pages - 1}, got {page!r}")

    def _check_owner(self, seq: Sequence) -> None:
        if not isinstance(seq, Sequence):
            raise TypeError(f"expected a tileinfer.kv.Sequence, got {type(seq).__name__}")
        if seq._manager is not None and seq._manager is not self:
            raise ValueError(
                "this sequence holds pages of another BlockManager (another cache); "
                "use one manager per sequence, or release it from its manager first")

    def __repr__(self) -> str:
        cached = f", cached={self.num_cached_pages}" if self.enable_prefix_caching else ""
        return (f"BlockManager(num_pages={self.num_pages}, page_size={self.page_size}, "
                f"free={self.num_free_pages}{cached})")


def _check_count(name: str, value: object, minimum: int = 0) -> None:
    """Raise a ValueError naming `name` unless value is an integer >= minimum."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
