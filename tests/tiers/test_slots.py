"""SlotIndex: slots reserved by key, metas set at commit, holds, dirty bits, eviction."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvtier.policy import LRUPolicy
from kvtier.tiers.slots import SlotIndex, SlotStateError
from tests.tiers.harness import make_key, meta_for


def _index(n: int = 2) -> SlotIndex:
    return SlotIndex(n, LRUPolicy())


def _ready(index: SlotIndex, i: int, *, dirty: bool = False) -> int:
    r = index.reserve(make_key(i))
    assert r is not None
    index.commit(r.slot, meta_for(make_key(i)), dirty=dirty)
    return r.slot


def test_reserve_takes_a_key_and_commit_publishes_the_real_meta() -> None:
    index = _index()
    key = make_key(1)
    r = index.reserve(key)
    assert r is not None and r.evicted == ()
    # WRITING: invisible to every reader, and a second writer of the key is refused.
    assert not index.contains(key) and index.hold(key) is None
    assert index.entries() == [] and index.take_dirty(8) == []
    assert index.reserve(key) is None
    index.commit(r.slot, meta_for(key, 100), dirty=False)
    got = index.hold(key)
    assert got == (r.slot, meta_for(key, 100))
    index.release(r.slot)
    assert index.entries() == [(r.slot, meta_for(key, 100))]


def test_commit_of_another_key_is_refused_and_changes_nothing() -> None:
    index = _index()
    r = index.reserve(make_key(1))
    assert r is not None
    with pytest.raises(SlotStateError, match="reserved for another key"):
        index.commit(r.slot, meta_for(make_key(2)), dirty=False)
    assert not index.contains(make_key(1)) and not index.contains(make_key(2))
    index.commit(r.slot, meta_for(make_key(1)), dirty=False)  # still WRITING: the right one
    assert index.contains(make_key(1))


def test_bad_transitions_name_the_current_state() -> None:
    index = _index()
    slot = _ready(index, 1)
    with pytest.raises(SlotStateError, match=f"slot {slot} is ready, expected writing"):
        index.commit(slot, meta_for(make_key(1)), dirty=False)
    with pytest.raises(SlotStateError, match="is ready, expected writing"):
        index.abort(slot)
    with pytest.raises(SlotStateError, match="released more times than held"):
        index.release(slot)
    r = index.reserve(make_key(2))
    assert r is not None
    index.abort(r.slot)
    with pytest.raises(SlotStateError, match="is free, expected writing"):
        index.abort(r.slot)


def test_abort_frees_the_slot_and_the_key() -> None:
    index = _index(1)
    r = index.reserve(make_key(1))
    assert r is not None and index.clean_or_free() == 0
    index.abort(r.slot)
    assert index.clean_or_free() == 1 and len(index) == 0
    assert index.reserve(make_key(1)) is not None


def test_held_and_dirty_slots_are_never_evicted() -> None:
    index = _index(2)
    held = _ready(index, 1)
    _ready(index, 2, dirty=True)
    assert index.hold(make_key(1)) == (held, meta_for(make_key(1)))
    assert index.reserve(make_key(3)) is None  # one held, one dirty: nothing to evict
    assert not index.delete(make_key(1))
    index.release(held)
    r = index.reserve(make_key(3))
    assert r is not None and r.evicted == (make_key(1),) and r.slot == held


def test_take_dirty_holds_until_release_then_mark_clean_makes_evictable() -> None:
    index = _index(1)
    slot = _ready(index, 1, dirty=True)
    assert index.take_dirty(4) == [(slot, meta_for(make_key(1)))]
    assert index.take_dirty(4) == []  # already held by the spill
    assert index.num_held() == 1
    index.mark_clean(slot, make_key(2))  # another key: not this slot's chunk, ignored
    assert index.dirty_keys() == {make_key(1)}
    index.mark_clean(slot, make_key(1))
    index.release(slot)
    assert index.num_held() == 0 and index.dirty_keys() == set()
    r = index.reserve(make_key(2))
    assert r is not None and r.evicted == (make_key(1),)


def test_a_meta_with_the_same_key_may_differ_in_everything_else() -> None:
    """The meta is the tier's, learned at commit: e.g. a promotion's real payload length."""
    index = _index()
    r = index.reserve(make_key(1))
    assert r is not None
    meta = replace(meta_for(make_key(1)), dtype="float16", num_tokens=7)
    index.commit(r.slot, meta, dirty=False)
    assert index.entries() == [(r.slot, meta)]


class _CountingLRU(LRUPolicy):
    """Counts the keys an eviction looks at, and full-order walks."""

    def __init__(self) -> None:
        super().__init__()
        self.looked = 0
        self.walks = 0

    def evict(self, n, can_evict):  # type: ignore[no-untyped-def]
        def counted(key):  # type: ignore[no-untyped-def]
            self.looked += 1
            return can_evict(key)
        return super().evict(n, counted)

    def coldest(self):  # type: ignore[no-untyped-def]
        self.walks += 1
        return super().coldest()


def test_eviction_and_spill_never_walk_the_whole_lru() -> None:
    """A pool of many dirty chunks and one clean one: ``reserve`` finds the clean victim
    at once, and a spill picks the coldest dirty chunk without walking the clean ones."""
    policy = _CountingLRU()
    n = 2000
    index = SlotIndex(n, policy)
    for i in range(n - 1):
        _ready(index, i, dirty=True)
    clean = _ready(index, n - 1)
    r = index.reserve(make_key(10_000))
    assert r is not None and r.slot == clean and r.evicted == (make_key(n - 1),)
    assert policy.looked == 1, "only clean keys are candidates"
    index.abort(r.slot)
    spill = index.take_dirty(2)
    assert [m.key for _, m in spill] == [make_key(0), make_key(1)]
    hot = index.take_dirty(1, hottest_first=True)
    assert [m.key for _, m in hot] == [make_key(n - 2)]
    assert policy.walks == 0
    assert len(index.dirty_keys()) == n - 1


def test_a_spilled_chunk_is_the_next_victim_and_a_hot_clean_one_is_not() -> None:
    index = _index(4)
    cold_dirty = _ready(index, 1, dirty=True)
    _ready(index, 2)  # clean, used after chunk 1
    hot_dirty = _ready(index, 3, dirty=True)
    _ready(index, 4)  # clean, newest
    held = index.hold(make_key(3))  # chunk 3 used again: hottest
    assert held is not None
    index.release(held[0])
    index.mark_clean(cold_dirty)  # spilled: colder than every clean chunk
    index.mark_clean(hot_dirty)  # written through: the hottest chunk
    order = []
    for k in range(10, 14):
        r = index.reserve(make_key(k))
        assert r is not None
        order += list(r.evicted)
        index.commit(r.slot, meta_for(make_key(k)), dirty=True)  # dirty: never evicted
    assert order == [make_key(1), make_key(2), make_key(4), make_key(3)]
