"""Concurrent saves of one chunk: reservations of a key from several requests, backups,
and any interleaving of their commits and aborts (issue 17).

A model of what must hold is checked after every operation: a key is READY at most once,
it is READY iff one of its reservations committed (nothing is evicted here: the index
has a slot per reservation), slots are conserved, and ``pending`` is true exactly while
a reservation of the key is open.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.policy import LRUPolicy
from kvtier.tiers.slots import SlotIndex
from tests.tiers.harness import make_key, meta_for


def test_a_second_writer_gets_a_backup_and_the_first_commit_wins() -> None:
    index = SlotIndex(4, LRUPolicy())
    key = make_key(7)
    first = index.reserve(key)
    assert first is not None and index.pending(key) and not index.contains(key)
    assert index.reserve(key) is None  # a plain second writer is refused
    backup = index.reserve(key, backup=True)
    assert backup is not None and backup.slot != first.slot
    assert index.clean_or_free() == 2  # both WRITING slots are taken
    assert index.commit(backup.slot, meta_for(key), dirty=True)  # the backup lands first
    assert index.contains(key) and index.pending(key)
    assert not index.commit(first.slot, meta_for(key), dirty=True)  # duplicate: freed
    assert not index.pending(key)
    assert index.entries() == [(backup.slot, meta_for(key))]
    assert index.clean_or_free() == 3  # one dirty READY slot, the duplicate is free again
    assert index.reserve(key, backup=True) is None  # READY: nothing to back up


def test_one_backup_per_key_is_enough() -> None:
    index = SlotIndex(4, LRUPolicy())
    key = make_key(9)
    assert index.reserve(key) is not None
    assert index.reserve(key, backup=True) is not None
    assert index.reserve(key, backup=True) is None  # a third copy would only cost a slot


def test_the_backup_publishes_when_the_first_writer_aborts() -> None:
    index = SlotIndex(4, LRUPolicy())
    key = make_key(8)
    first = index.reserve(key)
    backup = index.reserve(key, backup=True)
    assert first is not None and backup is not None
    index.abort(first.slot)
    assert index.pending(key) and not index.contains(key)
    assert index.commit(backup.slot, meta_for(key), dirty=False)
    assert index.contains(key) and not index.pending(key)


# An operation: (kind, key number, which open reservation of it)
_ops = st.lists(
    st.tuples(st.sampled_from(["reserve", "backup", "commit", "abort"]),
              st.integers(0, 3), st.integers(0, 3)),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(_ops)
def test_any_interleaving_keeps_one_ready_copy_per_key(ops: list[tuple[str, int, int]]) -> None:
    slots = 64
    index = SlotIndex(slots, LRUPolicy())
    open_: dict[int, list[int]] = {k: [] for k in range(4)}  # key -> open reservations
    committed: set[int] = set()
    for kind, k, which in ops:
        key = make_key(k)
        if kind in ("reserve", "backup"):
            r = index.reserve(key, backup=kind == "backup")
            if k in committed:
                assert r is None  # READY keys are never reserved again
            elif open_[k] and kind == "reserve":
                assert r is None  # a plain reservation of a pending key is refused
            elif len(open_[k]) >= 2:
                assert r is None  # one backup per key at most
            else:
                assert r is not None
                open_[k].append(r.slot)
        elif open_[k]:
            slot = open_[k].pop(which % len(open_[k]))
            if kind == "commit":
                published = index.commit(slot, meta_for(key), dirty=False)
                assert published == (k not in committed)
                committed.add(k)
            else:
                index.abort(slot)
        # the model
        for j in range(4):
            assert index.contains(make_key(j)) == (j in committed)
            assert index.pending(make_key(j)) == bool(open_[j])
        writing = sum(len(v) for v in open_.values())
        assert len(index) == len(committed)
        assert index.clean_or_free() == slots - writing
        ready_slots = [s for s, _ in index.entries()]
        assert len(set(ready_slots)) == len(ready_slots)
        assert not set(ready_slots) & {s for v in open_.values() for s in v}
