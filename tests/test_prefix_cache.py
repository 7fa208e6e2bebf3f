"""Prefix caching in the BlockManager: sharing full pages between sequences with reference counts,
cached-free pages and LRU eviction, copy-on-write on truncate. Unit tests for each rule, then
hypothesis state machines that drive the manager the way an engine would, keeping a shadow of the
device pool, and check after every step that every sequence reads exactly its own keys and values."""
from __future__ import annotations

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tileinfer.kv import BlockManager, OutOfPagesError, Sequence
from tileinfer.kv import block_manager as bm_module

PS = 4  # page size of the unit tests


def caching(num_pages: int, page_size: int = PS) -> BlockManager:
    return BlockManager(num_pages, page_size=page_size, enable_prefix_caching=True)


def run_prompt(bm: BlockManager, prompt: list[int]) -> tuple[Sequence, int]:
    """Admit a prompt and "prefill" it: allocate, then name the pages the step wrote."""
    seq = Sequence()
    cached = bm.allocate_prompt(seq, prompt)
    bm.cache_full_pages(seq, prompt)
    return seq, cached


def snapshot(bm: BlockManager, *seqs: Sequence):
    pages = range(bm.num_pages)
    return ([bm.page_state(p) for p in pages], [bm.ref_count(p) for p in pages],
            [bm.registered_tokens(p) for p in pages], bm.num_free_pages, bm.num_cached_pages,
            [(s.num_positions, list(s.block_table)) for s in seqs])


PREFIX = list(range(100, 112))  # three full pages


def test_shared_prefix_shares_pages_with_reference_counts():
    bm = caching(16)
    a, cached_a = run_prompt(bm, PREFIX + [1, 2])
    assert cached_a == 0 and len(a.block_table) == 4
    assert [bm.registered_tokens(p) for p in a.block_table] == [
        tuple(PREFIX[0:4]), tuple(PREFIX[4:8]), tuple(PREFIX[8:12]), None]  # the partial page is not named

    b = Sequence()
    assert bm.match_prefix(PREFIX + [7, 7, 7]) == (a.block_table[:3], 12)
    assert bm.allocate_prompt(b, PREFIX + [7, 7, 7]) == 12
    assert b.block_table[:3] == a.block_table[:3] and b.block_table[3] != a.block_table[3]
    assert [bm.ref_count(p) for p in a.block_table] == [2, 2, 2, 1]
    assert (b.num_positions, bm.num_free_pages) == (15, 16 - 5)

    # A different token inside page 1 stops the match at page 0.
    c_prompt = PREFIX[:6] + [0] + PREFIX[7:] + [1]
    c = Sequence()
    assert bm.allocate_prompt(c, c_prompt) == 4
    assert c.block_table[0] == a.block_table[0] and c.block_table[1] not in a.block_table
    assert bm.ref_count(a.block_table[0]) == 3
    # Different first token: nothing is shared.
    assert bm.match_prefix([0] + PREFIX[1:] + [1]) == ([], 0)


def test_full_prompt_hit_recomputes_the_last_token():
    bm = caching(16)
    a, _ = run_prompt(bm, PREFIX)  # exactly three full pages, all named
    assert all(bm.registered_tokens(p) for p in a.block_table)
    b = Sequence()
    # The same 12 tokens: (12 - 1) // 4 = 2 pages; the last token's page is recomputed, unshared.
    assert bm.match_prefix(PREFIX) == (a.block_table[:2], 8)
    assert bm.allocate_prompt(b, PREFIX) == 8
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] != a.block_table[2]
    assert bm.ref_count(a.block_table[2]) == 1 and bm.ref_count(b.block_table[2]) == 1
    # One more token and all three pages are shared.
    assert bm.match_prefix(PREFIX + [5]) == (a.block_table, 12)
    # Shorter than a page plus one: nothing to share.
    assert bm.match_prefix(PREFIX[:4]) == ([], 0) and bm.match_prefix([]) == ([], 0)


def test_hash_collision_is_refused_by_the_token_check(monkeypatch):
    monkeypatch.setattr(bm_module, "hash_page", lambda parent, tokens: b"every page collides")
    bm = caching(16)
    a, _ = run_prompt(bm, [1, 2, 3, 4, 9])
    page_a = a.block_table[0]
    assert bm.registered_tokens(page_a) == (1, 2, 3, 4)
    # Same hash, other tokens: a miss, and b's page is not registered over a's.
    b, cached_b = run_prompt(bm, [5, 6, 7, 8, 9])
    assert cached_b == 0 and b.block_table[0] != page_a
    assert bm.ref_count(page_a) == 1 and bm.registered_tokens(b.block_table[0]) is None
    # Page 1 has a's page-0 tokens and the same (constant) hash, but the wrong parent: only page 0 hits.
    c, cached_c = run_prompt(bm, [1, 2, 3, 4, 1, 2, 3, 4, 9])
    assert cached_c == 4 and c.block_table[0] == page_a and c.block_table[1] != page_a
    assert bm.ref_count(page_a) == 2


def test_released_pages_stay_cached_and_a_later_prompt_hits_them():
    bm = caching(8)
    a, _ = run_prompt(bm, PREFIX + [1])
    table = list(a.block_table)
    bm.release(a)
    assert bm.num_free_pages == 8 and bm.num_cached_pages == 3
    assert [bm.page_state(p) for p in table] == ["cached", "cached", "cached", "free"]
    b, cached = run_prompt(bm, PREFIX + [2, 3])
    assert cached == 12 and b.block_table[:3] == table[:3]
    assert bm.num_cached_pages == 0 and [bm.page_state(p) for p in table[:3]] == ["used"] * 3
    bm.release(b)
    assert bm.num_free_pages == 8


def test_eviction_is_lru_and_only_when_needed():
    bm = caching(6)
    x, _ = run_prompt(bm, [1] * 8 + [0])  # pages x0, x1 named, one partial page
    y, _ = run_prompt(bm, [2] * 4 + [0])  # page y0 named, one partial page
    x_pages, y_page = x.block_table[:2], y.block_table[0]
    bm.release(x)  # cached-free, oldest first: x1, x0
    bm.release(y)  # then y0
    assert (bm.num_free_pages, bm.num_cached_pages) == (6, 3)
    # Refresh x0 with a hit, then release it again: now x1, y0, x0.
    z, cached = run_prompt(bm, [1] * 4 + [0])
    assert cached == 4 and z.block_table[0] == x_pages[0]
    bm.release(z)
    # Three free pages serve a reservation without touching the cache.
    w = Sequence()
    bm.reserve(w, 12)
    assert bm.num_cached_pages == 3 and all(bm.registered_tokens(p) for p in x_pages + [y_page])
    # The fourth page evicts the least recently used: x1 (the tail of x, released first).
    bm.reserve(w, 1)
    assert w.block_table[-1] == x_pages[1] and bm.registered_tokens(x_pages[1]) is None
    assert bm.num_cached_pages == 2
    bm.reserve(w, 4)  # then y0
    assert w.block_table[-1] == y_page and bm.match_prefix([2] * 4 + [0]) == ([], 0)
    assert bm.match_prefix([1] * 8 + [0]) == ([x_pages[0]], 4)  # x0 survives, x1 is gone


def test_truncate_into_a_shared_page_copies_on_write():
    bm = caching(16)
    a, _ = run_prompt(bm, PREFIX + [1])
    b, cached = run_prompt(bm, PREFIX + [2])
    assert cached == 12
    shared = b.block_table[:3]
    bm.truncate(b, 8)  # at a page boundary: b keeps two whole pages and writes a new one next
    assert b.block_table == shared[:2] and bm.take_pending_copies() == []
    assert bm.ref_count(shared[2]) == 1
    bm.truncate(b, 6)  # inside shared page 1: b would rewrite offsets 2..3 of a's page
    new = b.block_table[1]
    assert b.block_table[0] == shared[0] and new not in a.block_table
    assert (bm.ref_count(shared[1]), bm.ref_count(new)) == (1, 1)
    assert bm.registered_tokens(shared[1]) == tuple(PREFIX[4:8])  # a's page is untouched, still named
    assert bm.registered_tokens(new) is None
    assert bm.take_pending_copies() == [(shared[1], new)]
    assert bm.take_pending_copies() == []  # taking them clears them


def test_truncate_into_an_exclusive_registered_page_unregisters_it():
    bm = caching(8)
    a, _ = run_prompt(bm, PREFIX + [1])
    page = a.block_table[1]
    bm.truncate(a, 6)
    assert a.block_table[1] == page and bm.registered_tokens(page) is None
    assert bm.take_pending_copies() == []
    assert bm.match_prefix(PREFIX + [1]) == (a.block_table[:1], 4)  # page 0 is still named
    # Re-naming after the rewrite uses the new tokens.
    bm.reserve(a, 2)
    tokens = PREFIX[:6] + [50, 51]
    bm.cache_full_pages(a, tokens)
    assert bm.registered_tokens(page) == (104, 105, 50, 51)
    assert bm.match_prefix(tokens + [0]) == (a.block_table[:2], 8)
    assert bm.match_prefix(PREFIX + [0]) == (a.block_table[:1], 4)


def test_allocate_prompt_out_of_pages_changes_nothing():
    bm = caching(5)
    a, _ = run_prompt(bm, PREFIX + [1])  # 4 pages used, 3 named
    bm.release(a)  # 3 cached-free, 2 free
    other = Sequence()
    bm.reserve(other, 4)  # 1 free left
    b = Sequence()
    before = snapshot(bm, other, b)
    # Hits 3 cached pages and needs 2 more; only 1 is available once the hits are taken.
    assert not bm.can_allocate_prompt(b, PREFIX + [1] * 5)
    with pytest.raises(OutOfPagesError) as info:
        bm.allocate_prompt(b, PREFIX + [1] * 5)
    assert (info.value.needed, info.value.free) == (2, 1)
    assert snapshot(bm, other, b) == before and b._manager is None
    # Fits exactly: one new page.
    assert bm.can_allocate_prompt(b, PREFIX + [1]) and bm.allocate_prompt(b, PREFIX + [1]) == 12
    assert bm.num_free_pages == 0


def test_truncate_out_of_pages_changes_nothing():
    bm = caching(4)
    a, _ = run_prompt(bm, PREFIX[:8] + [1])  # pages s0, s1 named + a2
    b, cached = run_prompt(bm, PREFIX[:8] + [2])  # shares s0, s1 + b2: the pool is full
    assert cached == 8 and bm.num_free_pages == 0
    bm.truncate(b, 8)  # drop b2 (no copy needed at a page boundary)...
    c = Sequence()
    bm.reserve(c, 1)  # ...and let c take it
    before = snapshot(bm, a, b, c)
    with pytest.raises(OutOfPagesError) as info:
        bm.truncate(b, 6)  # inside shared page s1: needs a page for the copy, none is free
    assert (info.value.needed, info.value.free) == (1, 0)
    assert snapshot(bm, a, b, c) == before and bm.take_pending_copies() == []
    # A page freed by the truncate itself can serve the copy: b drops b2' and copies s1 into it.
    bm.release(c)
    bm.reserve(b, 4)  # b2' = c's old page; the pool is full again
    assert bm.num_free_pages == 0
    dropped = b.block_table[2]
    bm.truncate(b, 6)
    assert b.block_table == [a.block_table[0], dropped]
    assert bm.take_pending_copies() == [(a.block_table[1], dropped)]
    assert bm.ref_count(a.block_table[1]) == 1


# ------------------------------------------------------------------------------------------- caching off

def test_prefix_caching_off_shares_nothing():
    bm = BlockManager(8, page_size=PS)
    assert not bm.enable_prefix_caching
    a, cached_a = run_prompt(bm, PREFIX + [1])
    b, cached_b = run_prompt(bm, PREFIX + [1])
    assert (cached_a, cached_b) == (0, 0) and a.block_table == [0, 1, 2, 3] and b.block_table == [4, 5, 6, 7]
    assert bm.match_prefix(PREFIX + [1]) == ([], 0)
    assert all(bm.registered_tokens(p) is None for p in range(8))
    bm.truncate(a, 6)
    assert a.block_table == [0, 1] and bm.take_pending_copies() == []
    bm.release(a)
    bm.release(b)
    assert (bm.num_free_pages, bm.num_cached_pages) == (8, 0)
    assert bm._free == [3, 2, 1, 0, 7, 6, 5, 4]  # plain LIFO stack, exactly as before prefix caching


OPS = st.lists(st.tuples(st.sampled_from(["reserve", "allocate", "cache", "truncate", "release"]),
                         st.integers(0, 2), st.integers(0, 13)), max_size=60)


@settings(max_examples=200, deadline=None)
@given(ops=OPS)
def test_prefix_caching_off_matches_the_plain_free_stack(ops):
    """With caching off every operation does exactly what the plain stack of free pages did."""
    page_size, num_pages = 3, 8
    bm, seqs = BlockManager(num_pages, page_size=page_size), [Sequence() for _ in range(3)]
    free, tables, sizes = list(range(num_pages - 1, -1, -1)), [[], [], []], [0, 0, 0]  # the reference
    for op, i, n in ops:
        seq = seqs[i]
        prompt = [7] * n  # the same tokens everywhere: anything shared would show
        if op == "allocate" and seq.num_positions:
            op = "reserve"
        if op in ("reserve", "allocate"):
            needed = -(-(sizes[i] + n) // page_size) - len(tables[i])
            call = (lambda: bm.reserve(seq, n)) if op == "reserve" else (lambda: bm.allocate_prompt(seq, prompt))
            if needed > len(free):
                with pytest.raises(OutOfPagesError):
                    call()
            else:
                assert call() in (None, 0)
                tables[i] += [free.pop() for _ in range(needed)]
                sizes[i] += n
        elif op == "cache":
            bm.cache_full_pages(seq, prompt[:seq.num_positions])
        else:
            keep = min(n, sizes[i]) if op == "truncate" else 0
            bm.truncate(seq, keep) if op == "truncate" else bm.release(seq)
            kept = -(-keep // page_size)
            free.extend(reversed(tables[i][kept:]))
            del tables[i][kept:]
            sizes[i] = keep
        assert [(s.num_positions, s.block_table) for s in seqs] == list(zip(sizes, tables))
        assert bm.num_free_pages == len(free) and bm._free == free
        assert bm.num_cached_pages == 0 and bm.take_pending_copies() == []
        assert bm.match_prefix([7] * 13) == ([], 0)


# ------------------------------------------------------------------------------------------- state machines

NUM_SEQS = 4
MPS = 3  # page size of the machines: small, so pages fill (and get shared) often
# Prompts are a cut of one of these stems plus a short random tail over a 4-token vocabulary,
# so prefixes collide often; a 10-page pool (30 positions for 4 sequences) makes eviction common.
STEMS = ([1, 2, 3, 1, 2, 3, 1, 2, 3, 0, 1], [1, 2, 3, 1, 2, 0, 0, 1, 2, 3], [2, 2, 2, 2, 2, 2, 2, 2, 2])
TOKENS = st.lists(st.integers(0, 3), max_size=4)
SEQ = st.integers(0, NUM_SEQS - 1)


class PrefixCacheMachine(RuleBasedStateMachine):
    """Drives the manager as an engine would, with a shadow of the device pool.

    The shadow holds, for every slot, the token prefix whose last key/value the slot holds (keys
    and values depend on the whole prefix). A step writes the shadow at the slots of its new
    tokens; pending copies copy shadow pages. After every rule each sequence must read exactly its
    own prefix at each of its written positions: sharing, eviction and copy-on-write are right
    only if that holds.
    """

    NUM_PAGES = 10

    def __init__(self):
        super().__init__()
        self.bm = BlockManager(self.NUM_PAGES, page_size=MPS, enable_prefix_caching=True)
        self.seqs = [Sequence() for _ in range(NUM_SEQS)]
        self.written = [[] for _ in range(NUM_SEQS)]  # tokens whose keys/values steps wrote, per sequence
        self.pending = [[] for _ in range(NUM_SEQS)]  # tokens of reserved positions not yet written
        self.device = {p: [None] * MPS for p in range(self.NUM_PAGES)}
        self.owed: list[tuple[int, int]] = []  # copies the manager must have recorded, not yet taken

    def state(self):
        return snapshot(self.bm, *self.seqs)

    # ---------------------------------------------------------------- rules

    @precondition(lambda self: any(not s.num_positions for s in self.seqs))
    @rule(data=st.data(), stem=st.sampled_from(STEMS), cut=st.integers(1, 11), tail=TOKENS, prefill=st.booleans())
    def allocate_prompt(self, data, stem, cut, tail, prefill):
        """Admit a prompt into an empty sequence; with prefill, also run its step and name its pages."""
        i = data.draw(st.sampled_from([k for k in range(NUM_SEQS) if not self.seqs[k].num_positions]))
        seq, prompt = self.seqs[i], stem[:cut] + tail
        pages, hit = self.bm.match_prefix(prompt)
        fits, before = self.bm.can_allocate_prompt(seq, prompt), self.state()
        try:
            cached = self.bm.allocate_prompt(seq, prompt)
        except OutOfPagesError:
            assert not fits and self.state() == before
            event("allocate_prompt: out of pages")
            return
        assert fits and cached == hit and seq.block_table[:len(pages)] == pages
        assert cached % MPS == 0 and cached <= len(prompt) - 1 and seq.num_positions == len(prompt)
        event(f"allocate_prompt: {cached // MPS} page(s) hit")
        self.written[i], self.pending[i] = prompt[:cached], prompt[cached:]
        if prefill:
            self.run_step(i, cache=True)

    @rule(i=SEQ, tokens=TOKENS)
    def reserve(self, i, tokens):
        """Decode (one token) or a speculative draft (several): reserve, the step writes later."""
        seq = self.seqs[i]
        if self.pending[i]:
            return
        fits, before = self.bm.can_reserve(seq, len(tokens)), self.state()
        try:
            self.bm.reserve(seq, len(tokens))
        except OutOfPagesError:
            assert not fits and self.state() == before
            event("reserve: out of pages")
            return
        assert fits
        self.pending[i] = list(tokens)

    @precondition(lambda self: any(self.pending))
    @rule(data=st.data(), cache=st.booleans())
    def step(self, data, cache):
        """One engine step for one sequence: copies first, then write its new tokens' keys/values."""
        self.run_step(data.draw(st.sampled_from([k for k in range(NUM_SEQS) if self.pending[k]])), cache)

    def run_step(self, i, cache):
        self.take_pending_copies()
        seq, written = self.seqs[i], self.written[i]
        for token in self.pending[i]:
            pos = len(written)
            page = seq.block_table[pos // MPS]
            # Never write into a page another sequence holds, or into a named (shareable) page.
            assert self.bm.ref_count(page) == 1 and self.bm.registered_tokens(page) is None
            written.append(token)
            self.device[page][pos % MPS] = tuple(written)
        self.pending[i] = []
        if cache:
            self.bm.cache_full_pages(seq, written)

    @rule(i=SEQ)
    def cache_full_pages(self, i):
        self.bm.cache_full_pages(self.seqs[i], self.written[i])

    @precondition(lambda self: any(s.num_positions and not p for s, p in zip(self.seqs, self.pending)))
    @rule(data=st.data())
    def truncate(self, data):
        """Roll back (rejected drafts, a chat turn's common prefix); only between steps."""
        i = data.draw(st.sampled_from(
            [k for k in range(NUM_SEQS) if self.seqs[k].num_positions and not self.pending[k]]))
        seq = self.seqs[i]
        n = data.draw(st.integers(0, seq.num_positions))
        k, keep = n // MPS, -(-n // MPS)
        cut = n % MPS != 0 and n < seq.num_positions
        old = seq.block_table[k] if cut else None
        shared = cut and self.bm.ref_count(old) > 1
        freed = sum(1 for p in seq.block_table[keep:] if self.bm.ref_count(p) == 1)
        available, before = self.bm.num_free_pages + freed, self.state()
        try:
            self.bm.truncate(seq, n)
        except OutOfPagesError:
            assert shared and available == 0 and self.state() == before
            event("truncate: out of pages")
            return
        assert not (shared and available == 0)
        assert seq.num_positions == n and len(seq.block_table) == keep
        if shared:
            assert seq.block_table[k] != old
            self.owed.append((old, seq.block_table[k]))
            event("truncate: copy on write")
        elif cut:
            assert seq.block_table[k] == old and self.bm.registered_tokens(old) is None
        del self.written[i][n:]

    @rule(i=SEQ)
    def release(self, i):
        self.bm.release(self.seqs[i])
        self.written[i], self.pending[i] = [], []

    @rule()
    def take_pending_copies(self):
        copies = self.bm.take_pending_copies()
        assert copies == self.owed
        for src, dst in copies:
            self.device[dst] = list(self.device[src])
        self.owed = []

    # ---------------------------------------------------------------- invariants

    def device_after_copies(self):
        device = dict(self.device)
        for src, dst in self.owed:
            device[dst] = list(device[src])
        return device

    @invariant()
    def each_page_is_exactly_one_of_free_cached_used(self):
        bm = self.bm
        free, cached = set(bm._free), set(bm._cached_free)  # the two lists themselves, not derived counts
        used = {p for p in range(bm.num_pages) if bm.ref_count(p)}
        assert len(free) == len(bm._free)
        assert not (free & cached or free & used or cached & used)
        assert free | cached | used == set(range(bm.num_pages))
        for p in range(bm.num_pages):
            state = bm.page_state(p)
            assert state == ("free" if p in free else "cached" if p in cached else "used")
            if state == "cached":
                assert bm.registered_tokens(p) is not None
            if state == "free":
                assert bm.registered_tokens(p) is None
        assert bm.num_free_pages == len(free) + len(cached) and bm.num_cached_pages == len(cached)

    @invariant()
    def reference_counts_are_the_holders(self):
        held = [p for s in self.seqs for p in s.block_table]
        for s in self.seqs:
            assert len(set(s.block_table)) == len(s.block_table)
        for p in range(self.bm.num_pages):
            assert self.bm.ref_count(p) == held.count(p)

    @invariant()
    def tables_are_exactly_as_long_as_needed(self):
        for s, written, pending in zip(self.seqs, self.written, self.pending):
            assert s.num_positions == len(written) + len(pending)
            assert len(s.block_table) == -(-s.num_positions // MPS)

    @invariant()
    def every_sequence_reads_its_own_keys_and_values(self):
        device = self.device_after_copies()
        for s, written in zip(self.seqs, self.written):
            for pos in range(len(written)):
                assert device[s.block_table[pos // MPS]][pos % MPS] == tuple(written[:pos + 1])

    @invariant()
    def named_pages_hold_their_tokens(self):
        device = self.device_after_copies()
        for p in range(self.bm.num_pages):
            tokens = self.bm.registered_tokens(p)
            if tokens is None:
                continue
            assert len(tokens) == MPS and tuple(slot[-1] for slot in device[p]) == tokens
            for s, written in zip(self.seqs, self.written):
                if p in s.block_table:
                    k = s.block_table.index(p)
                    assert tuple(written[k * MPS:(k + 1) * MPS]) == tokens

    def teardown(self):
        for s in self.seqs:
            self.bm.release(s)
        assert self.bm.num_free_pages == self.bm.num_pages
        assert all(self.bm.ref_count(p) == 0 for p in range(self.bm.num_pages))


class CollidingPrefixCacheMachine(PrefixCacheMachine):
    """The same with a 2-bit hash: collisions everywhere, so only the token and parent checks keep
    sequences from sharing wrong pages."""

    def __init__(self):
        self._real_hash_page = bm_module.hash_page
        bm_module.hash_page = lambda parent, tokens: bytes([self._real_hash_page(parent, tokens)[0] % 4])
        super().__init__()

    def teardown(self):
        try:
            super().teardown()
        finally:
            bm_module.hash_page = self._real_hash_page


MACHINE_SETTINGS = settings(max_examples=250, stateful_step_count=50, deadline=None)
PrefixCacheMachine.TestCase.settings = MACHINE_SETTINGS
CollidingPrefixCacheMachine.TestCase.settings = MACHINE_SETTINGS
TestPrefixCacheMachine = PrefixCacheMachine.TestCase
TestCollidingPrefixCacheMachine = CollidingPrefixCacheMachine.TestCase
