"""BlockManager: pages and block tables on the host. Unit tests for each rule, then a hypothesis
state machine over several sequences checking the pool's invariants after every operation."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tileinfer.kv import BlockManager, OutOfPagesError, Sequence


def test_new_sequence_is_empty():
    seq = Sequence()
    assert seq.num_positions == 0 and seq.block_table == []


@pytest.mark.parametrize("kwargs, message", [
    (dict(num_pages=0), "num_pages"),
    (dict(num_pages=-3), "num_pages"),
    (dict(num_pages=2.5), "num_pages"),
    (dict(num_pages=4, page_size=0), "page_size"),
    (dict(num_pages=True), "num_pages"),
    (dict(num_pages=2**26, page_size=64), "int32"),
])
def test_constructor_rejects_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        BlockManager(**kwargs)


def test_constructor_defaults():
    bm = BlockManager(10)
    assert (bm.num_pages, bm.page_size, bm.num_free_pages) == (10, 64, 10)


def test_reserve_takes_pages_only_at_page_boundaries():
    bm, seq = BlockManager(8, page_size=4), Sequence()
    bm.reserve(seq, 0)
    assert seq.block_table == [] and bm.num_free_pages == 8
    bm.reserve(seq, 3)
    assert (seq.num_positions, len(seq.block_table), bm.num_free_pages) == (3, 1, 7)
    bm.reserve(seq, 1)  # fills page 0 exactly
    assert (seq.num_positions, len(seq.block_table)) == (4, 1)
    bm.reserve(seq, 1)
    assert (seq.num_positions, len(seq.block_table), bm.num_free_pages) == (5, 2, 6)
    bm.reserve(seq, 11)  # 16 positions: 4 pages
    assert (seq.num_positions, len(seq.block_table), bm.num_free_pages) == (16, 4, 4)
    assert seq.block_table == [0, 1, 2, 3]  # the free stack hands out page 0 first
    assert len(set(seq.block_table)) == 4


def test_reserve_negative_is_a_value_error():
    bm, seq = BlockManager(2), Sequence()
    with pytest.raises(ValueError, match="n must be"):
        bm.reserve(seq, -1)
    with pytest.raises(ValueError, match="n must be"):
        bm.can_reserve(seq, -1)


def test_out_of_pages_changes_nothing():
    bm, a, b = BlockManager(3, page_size=4), Sequence(), Sequence()
    bm.reserve(a, 6)  # 2 pages
    bm.reserve(b, 1)  # 1 page, pool now empty
    before = (bm.num_free_pages, a.num_positions, list(a.block_table), b.num_positions, list(b.block_table))
    assert bm.can_reserve(a, 2)  # still fits page a's second page
    assert not bm.can_reserve(a, 3)
    with pytest.raises(OutOfPagesError) as info:
        bm.reserve(a, 7)  # 13 positions: 4 pages, 2 more than a has, 0 free
    assert (info.value.needed, info.value.free) == (2, 0)
    assert "need 2" in str(info.value) and "0 are free" in str(info.value)
    assert "max_tokens" in str(info.value) and "release" in str(info.value)
    assert isinstance(info.value, RuntimeError)
    assert (bm.num_free_pages, a.num_positions, a.block_table, b.num_positions, b.block_table) == before


def test_try_reserve_reserves_what_fits_and_changes_nothing_otherwise():
    bm, a, b, other = BlockManager(3, page_size=4), Sequence(), Sequence(), BlockManager(3, page_size=4)
    assert bm.try_reserve(a, 3) and bm.try_reserve(b, 4)
    version = a.table_version
    assert bm.try_reserve(a, 1)  # the rest of its last page: no page taken, the table unchanged
    assert (a.num_positions, len(a.block_table), bm.num_free_pages, a.table_version) == (4, 1, 1, version)
    assert bm.try_reserve(a, 4)  # a new page: the last free one
    assert (a.num_positions, len(a.block_table), bm.num_free_pages) == (8, 2, 0)
    before = (a.num_positions, list(a.block_table), b.num_positions)
    assert not bm.try_reserve(a, 1) and not bm.try_reserve(b, 1)  # each would need a page
    assert (a.num_positions, a.block_table, b.num_positions) == before
    with pytest.raises(ValueError, match="n must be"):
        bm.try_reserve(a, -1)
    with pytest.raises(ValueError, match="another BlockManager"):
        other.try_reserve(a, 0)


def test_out_of_pages_on_partial_fit_takes_no_pages():
    bm, seq = BlockManager(4, page_size=2), Sequence()
    with pytest.raises(OutOfPagesError) as info:
        bm.reserve(seq, 9)  # 5 pages, 4 exist: must not take the 4 that do
    assert (info.value.needed, info.value.free) == (5, 4)
    assert (bm.num_free_pages, seq.num_positions, seq.block_table) == (4, 0, [])
    bm.reserve(seq, 8)  # exactly the pool
    assert bm.num_free_pages == 0


def test_truncate_returns_unneeded_pages():
    bm, seq = BlockManager(8, page_size=4), Sequence()
    bm.reserve(seq, 14)  # 4 pages
    table = list(seq.block_table)
    bm.truncate(seq, 9)  # 3 pages still needed
    assert (seq.num_positions, seq.block_table, bm.num_free_pages) == (9, table[:3], 5)
    bm.truncate(seq, 8)  # page boundary: 2 pages
    assert (seq.num_positions, seq.block_table, bm.num_free_pages) == (8, table[:2], 6)
    bm.truncate(seq, 8)  # no-op
    assert (seq.num_positions, bm.num_free_pages) == (8, 6)
    bm.truncate(seq, 0)
    assert (seq.num_positions, seq.block_table, bm.num_free_pages) == (0, [], 8)


def test_truncate_then_reserve_gets_the_same_pages_back():
    bm, seq = BlockManager(8, page_size=4), Sequence()
    bm.reserve(seq, 16)
    table = list(seq.block_table)
    bm.truncate(seq, 5)
    bm.reserve(seq, 11)
    assert seq.block_table == table  # LIFO: rollback + regrow reuses the same slots


@pytest.mark.parametrize("n", [-1, 11])
def test_truncate_out_of_range_names_both_numbers(n):
    bm, seq = BlockManager(4, page_size=4), Sequence()
    bm.reserve(seq, 10)
    with pytest.raises(ValueError, match=rf"10 positions to {n}\b"):
        bm.truncate(seq, n)
    assert (seq.num_positions, bm.num_free_pages) == (10, 1)


def test_release_returns_everything_and_empties_the_sequence():
    bm, a, b = BlockManager(6, page_size=4), Sequence(), Sequence()
    bm.reserve(a, 9)
    bm.reserve(b, 4)
    bm.release(a)
    assert (a.num_positions, a.block_table, bm.num_free_pages) == (0, [], 5)
    bm.release(a)  # releasing an empty sequence is harmless
    assert bm.num_free_pages == 5
    bm.reserve(a, 20)  # the released pages are usable again
    assert bm.num_free_pages == 0


def test_sequence_cannot_mix_managers():
    one, two, seq = BlockManager(4), BlockManager(4), Sequence()
    one.reserve(seq, 3)
    for call in (lambda: two.reserve(seq, 1), lambda: two.truncate(seq, 0), lambda: two.release(seq),
                 lambda: two.slots(seq, 0, 1), lambda: two.can_reserve(seq, 1),
                 lambda: two.block_table_array([seq], 4)):
        with pytest.raises(ValueError, match="another BlockManager"):
            call()
    assert (one.num_free_pages, two.num_free_pages, seq.num_positions) == (3, 4, 3)
    one.release(seq)
    two.reserve(seq, 1)  # after release it may move to another manager
    assert two.num_free_pages == 3


def test_slots_across_page_boundaries():
    bm, other, seq = BlockManager(8, page_size=4), Sequence(), Sequence()
    bm.reserve(other, 4)  # take page 0 so seq's pages are not the identity
    bm.reserve(seq, 10)
    assert seq.block_table == [1, 2, 3]
    slots = bm.slots(seq, 2, 7)
    assert slots.dtype == np.int32
    np.testing.assert_array_equal(slots, [6, 7, 8, 9, 10, 11, 12])
    np.testing.assert_array_equal(bm.slots(seq, 9, 1), [13])
    within = bm.slots(seq, 4, 4)  # a whole page: one run of slots
    assert within.dtype == np.int32
    np.testing.assert_array_equal(within, [8, 9, 10, 11])
    assert bm.slots(seq, 10, 0).shape == (0,)
    # Non-contiguous pages: after a rollback and another sequence's growth, slots follow the table.
    bm.truncate(seq, 4)
    bm.reserve(other, 4)
    bm.reserve(seq, 2)
    page = seq.block_table[1]
    np.testing.assert_array_equal(bm.slots(seq, 3, 3), [1 * 4 + 3, page * 4, page * 4 + 1])


@pytest.mark.parametrize("start, n", [(0, 11), (10, 1), (-1, 2), (3, -1)])
def test_slots_outside_the_sequence(start, n):
    bm, seq = BlockManager(4, page_size=4), Sequence()
    bm.reserve(seq, 10)
    with pytest.raises(ValueError):
        bm.slots(seq, start, n)


def test_block_table_array_pads_with_zeros():
    bm, a, b, c = BlockManager(8, page_size=2), Sequence(), Sequence(), Sequence()
    bm.reserve(a, 5)  # pages 0, 1, 2
    bm.reserve(b, 1)  # page 3
    out = bm.block_table_array([a, b, c], 4)
    assert out.dtype == np.int32 and out.shape == (3, 4)
    np.testing.assert_array_equal(out, [[0, 1, 2, 0], [3, 0, 0, 0], [0, 0, 0, 0]])
    assert bm.block_table_array([], 16).shape == (0, 16)
    with pytest.raises(ValueError, match="3 pages.*width 2"):
        bm.block_table_array([a], 2)


# ------------------------------------------------------------------------------------------- state machine

NUM_SEQS = 4


class PoolMachine(RuleBasedStateMachine):
    """Random reserve/truncate/release over several sequences sharing one small pool."""

    def __init__(self):
        super().__init__()
        self.bm = BlockManager(num_pages=12, page_size=3)
        self.seqs = [Sequence() for _ in range(NUM_SEQS)]

    @rule(i=st.integers(0, NUM_SEQS - 1), n=st.integers(0, 20))
    def reserve(self, i, n):
        seq = self.seqs[i]
        before = (self.bm.num_free_pages, seq.num_positions, list(seq.block_table))
        fits = self.bm.can_reserve(seq, n)
        try:
            self.bm.reserve(seq, n)
        except OutOfPagesError as e:
            assert not fits and e.free == before[0] and e.needed > e.free
            assert (self.bm.num_free_pages, seq.num_positions, seq.block_table) == before
        else:
            assert fits and seq.num_positions == before[1] + n
            assert seq.block_table[:len(before[2])] == before[2]  # existing pages never move

    @precondition(lambda self: any(s.num_positions for s in self.seqs))
    @rule(data=st.data())
    def truncate(self, data):
        seq = data.draw(st.sampled_from([s for s in self.seqs if s.num_positions]))
        n = data.draw(st.integers(0, seq.num_positions))
        kept = seq.block_table[:self.bm.pages_for(n)]
        self.bm.truncate(seq, n)
        assert seq.num_positions == n and seq.block_table == kept

    @rule(i=st.integers(0, NUM_SEQS - 1))
    def release(self, i):
        self.bm.release(self.seqs[i])
        assert self.seqs[i].num_positions == 0 and self.seqs[i].block_table == []

    @invariant()
    def no_page_is_owned_twice(self):
        owned = [p for s in self.seqs for p in s.block_table]
        assert len(owned) == len(set(owned))
        assert all(0 <= p < self.bm.num_pages for p in owned)

    @invariant()
    def free_plus_owned_is_the_pool(self):
        owned = sum(len(s.block_table) for s in self.seqs)
        assert self.bm.num_free_pages + owned == self.bm.num_pages

    @invariant()
    def tables_are_exactly_as_long_as_needed(self):
        for s in self.seqs:
            assert len(s.block_table) == -(-s.num_positions // self.bm.page_size)

    @invariant()
    def slots_are_unique_across_sequences(self):
        slots = np.concatenate([self.bm.slots(s, 0, s.num_positions) for s in self.seqs])
        assert len(np.unique(slots)) == len(slots)
        assert ((slots >= 0) & (slots < self.bm.num_pages * self.bm.page_size)).all()


PoolMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestPoolMachine = PoolMachine.TestCase
