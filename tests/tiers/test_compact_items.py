"""``CompactIndex.items`` is linear in the entries (``kvtier ls`` over millions of
objects): each batch resumes where the previous one stopped unless the recency list
changed meanwhile (issue 32 review item 10)."""

from __future__ import annotations

import time

from kvtier.tiers.compact import CompactIndex
from tests.tiers.harness import make_key


def test_items_in_small_batches_are_every_entry_coldest_first_and_linear() -> None:
    index = CompactIndex()
    n = 20_000
    for i in range(n):
        index.remember(make_key(i), 1, float(i))
    t0 = time.perf_counter()
    got = [k for k, _ in index.items(batch=4)]
    took = time.perf_counter() - t0
    assert got == [make_key(i) for i in range(n)]
    assert took < 2.0, f"{took:.1f} s: each batch walks the list from its start again"



def test_placed_entries_are_linked_by_recency_not_at_the_hot_end() -> None:
    """``remember_placed`` entries wait unlinked, then ``link_placed`` appends those newer
    than the hot end and re-sorts the list when one is older (issue 32 review item 8)."""
    index = CompactIndex()
    for i in (10, 20, 30):
        index.remember(make_key(i), 1, float(i))
    assert index.remember_placed(make_key(40), 1, 40.0)
    assert not index.remember_placed(make_key(10), 1, 5.0)  # known: this node's record wins
    assert [k for k, _ in index.coldest(9)] == [make_key(i) for i in (10, 20, 30)]
    assert make_key(40) in index and len(list(index.items())) == 4
    assert index.link_placed() == 1  # newer than the hot end: appended
    assert [k for k, _ in index.coldest(9)] == [make_key(i) for i in (10, 20, 30, 40)]
    seen = index.get(make_key(30))
    assert seen is not None
    assert index.remember_placed(make_key(30), 1, 35.0, seen)  # a newer stamp
    assert index.remember_placed(make_key(15), 1, 15.0)
    assert index.remember_placed(make_key(1), 1, 1.0)
    index.forget(make_key(15))  # dropped while waiting
    assert index.link_placed() == 2
    assert [k for k, _ in index.coldest(9)] == [make_key(i) for i in (1, 10, 20, 30, 40)]
    assert [k for k, _ in index.items()] == [make_key(i) for i in (1, 10, 20, 30, 40)]
    assert index.link_placed() == 0
    index.remember(make_key(50), 1, 50.0)  # the list stays a list after the re-sort
    assert [k for k, _ in index.coldest(9)][-2:] == [make_key(40), make_key(50)]
