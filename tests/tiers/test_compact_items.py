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

