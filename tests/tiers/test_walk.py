"""The walk's ticks are bounded in time and resume where they stopped, within a top-level
directory; a pass has a known number of ticks; the sweep that drops vanished objects
never drops what this node recorded while the tick listed. Time is a ``ManualClock``
that a slow store advances as it lists (no sleeps)."""

from __future__ import annotations

import math
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from kvtier.clock import ManualClock
from kvtier.keys import ChunkKey
from kvtier.tiers.file import FileTier, FileTransport
from kvtier.tiers.transport import Page
from kvtier.tiers.walk import TickBudget
from tests.tiers.harness import meta_for, payload_for

LISTING_S = 0.4  # what one page costs the slow store below


def leaf_key(top: int, leaf: int, i: int = 0) -> ChunkKey:
    """A key in leaf directory ``kv/<top>/<leaf>/``."""
    return ChunkKey(bytes([top, leaf]) + i.to_bytes(14, "big"))


class SlowListing:
    """Every page the tier lists advances ``clock`` by ``LISTING_S`` (a slow metadata
    server) and is recorded; ``during(fn)`` runs ``fn`` after the next page is listed."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, clock: ManualClock) -> None:
        self.pages: list[Page] = []
        self._after: list[Callable[[], None]] = []
        real = FileTransport.page

        def page(transport: FileTransport, cursor: object | None) -> Page:
            got = real(transport, cursor)
            clock.advance(LISTING_S)
            self.pages.append(got)
            due, self._after = self._after, []
            for fn in due:
                fn()
            return got

        monkeypatch.setattr(FileTransport, "page", page)

    def during(self, fn: Callable[[], None]) -> None:
        self._after.append(fn)


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


def _put(tier: FileTier, key: ChunkKey) -> None:
    assert tier.put(meta_for(key, 64), payload_for(key, 64).data).value == "stored"


def test_a_tick_stops_at_its_time_budget_and_the_next_resumes_within_the_shard(
    tmp_path: Path, clock: ManualClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    writer = FileTier(tmp_path, 1 << 40, clock=clock)
    keys = [leaf_key(7, leaf) for leaf in range(30)]  # 30 leaves of one top directory
    for key in keys:
        _put(writer, key)
    tier = FileTier(tmp_path, 1 << 40, clock=clock, tick=TickBudget(1 << 30, 1.0))
    clock.advance(1000)
    slow = SlowListing(monkeypatch, clock)
    per_tick: list[list[Page]] = []
    removed = 0
    while tier.passes == 0:
        before = len(slow.pages)
        removed += tier.expire(500)
        per_tick.append(slow.pages[before:])
    # 1 s at 0.4 s a page: the third page ends each tick (the pass's end may end one
    # sooner). A pass is 255 empty top directories, 30 leaves and the files in kv/.
    pages = 255 + 30 + 1
    assert all(len(p) == 3 for p in per_tick[:-1]) and 1 <= len(per_tick[-1]) <= 3
    assert len(per_tick) == math.ceil(pages / 3)
    assert tier.walk.last_pass is not None
    assert tier.walk.last_pass.ticks == len(per_tick)
    assert tier.walk.last_pass.seconds == pytest.approx(pages * LISTING_S)
    assert tier.walk.last_pass.objects == len(keys)
    # The top directory's leaves spread over ticks (after 7 empty top directories: two
    # ticks, and one page of the third): ticks resumed inside it.
    shard7 = [i for i, p in enumerate(per_tick) if any(o.key[0] == 7 for pg in p
                                                        for o in pg.objects)]
    assert shard7 == list(range(2, 2 + math.ceil((1 + 30) / 3)))
    assert removed == len(keys) and tier.usage().objects == 0


def test_a_tick_lists_at_most_its_objects_in_whole_pages(
    tmp_path: Path, clock: ManualClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    writer = FileTier(tmp_path, 1 << 40, clock=clock)
    for leaf in range(4):
        for i in range(3):
            _put(writer, leaf_key(9, leaf, i))
    tier = FileTier(tmp_path, 1 << 40, clock=clock, tick=TickBudget(5, 3600.0))
    slow = SlowListing(monkeypatch, clock)
    tier.expire(1e9)  # nothing that old: a walk only
    listed = [len(p.objects) for p in slow.pages if p.objects]
    assert listed == [3, 3]  # 6 >= 5 after the second leaf: the tick ends there


def test_what_this_node_records_while_a_tick_lists_is_not_swept(
    tmp_path: Path, clock: ManualClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A put into a leaf the tick has listed already is not in that listing, and the
    sweep runs at the tick's end: the entry must survive it (recorded after the mark)."""
    tier = FileTier(tmp_path, 1 << 40, clock=clock, tick=TickBudget(1 << 30, 3600.0))
    old = leaf_key(3, 1)
    _put(tier, old)
    _put(tier, leaf_key(3, 2))
    slow = SlowListing(monkeypatch, clock)
    late = leaf_key(3, 1, 99)

    def put_into_leaf_1() -> None:
        if any(o.key == old for o in slow.pages[-1].objects):
            _put(tier, late)  # the leaf was listed a moment ago, without it
        else:
            slow.during(put_into_leaf_1)

    slow.during(put_into_leaf_1)
    tier.expire(1e9)
    assert tier.passes == 1 and tier.indexed(late) and tier.indexed(old)


def test_a_leaf_another_node_emptied_and_removed_is_swept(
    tmp_path: Path, clock: ManualClock
) -> None:
    a = FileTier(tmp_path, 1 << 40, clock=clock)
    gone = [leaf_key(5, 8, i) for i in range(3)]
    kept = leaf_key(5, 9)
    for key in [*gone, kept]:
        _put(a, key)
    shutil.rmtree(tmp_path / "kv" / "05" / "08")  # another node: every object, the leaf too
    shutil.rmtree(tmp_path / "kv" / "05" / "09")
    _put(FileTier(tmp_path, 1 << 40, clock=clock), kept)  # ... and one written again
    assert all(a.indexed(k) for k in gone)
    a.expire(1e9)  # one whole pass (nothing that old)
    assert not any(a.indexed(k) for k in gone) and a.indexed(kept)
    assert a.usage().objects == 1


def test_tick_budgets_are_validated() -> None:
    with pytest.raises(ValueError, match="tick objects"):
        TickBudget(0, 1.0)
    with pytest.raises(ValueError, match="tick seconds"):
        TickBudget(1, 0.0)


def test_a_put_into_a_leaf_created_after_its_top_directory_was_read_survives_the_sweep(
    tmp_path: Path, clock: ManualClock
) -> None:
    """A top-level directory's leaves are read once, by the tick that enters it, and
    carried to later ticks: a leaf created after that read lies in a later page's range
    without being listed. What this node recorded there since the read must not be swept
    (issue 32 review item 9)."""
    tier = FileTier(tmp_path, 1 << 40, clock=clock, tick=TickBudget(1, 3600.0))
    first, second = leaf_key(7, 1), leaf_key(7, 5)
    for key in (first, second):
        _put(tier, key)
    tier.expire(1e9)  # empty top directories, then leaf 07/01: its one object ends the tick
    assert tier.passes == 0 and tier.indexed(first)
    late = leaf_key(7, 8)  # a new leaf, after the one the cursor carries (07/05)
    _put(tier, late)
    while tier.passes == 0:
        tier.expire(1e9)  # leaf 07/05's page covers 07/05..07/ff, listing only 07/05
    assert tier.indexed(late) and tier.indexed(first) and tier.indexed(second)
    tier.expire(1e9)
    assert tier.indexed(late)  # the next pass lists the new leaf itself


def test_objects_the_walk_finds_take_their_place_by_mtime_in_the_eviction_order(
    tmp_path: Path, clock: ManualClock
) -> None:
    """On a shared directory, another node's object that the walk finds goes where its
    mtime puts it, not at the hot end: this node's own, newer, unused object is not
    evicted before it (issue 32 review item 8)."""
    a = FileTier(tmp_path, 1 << 40, clock=clock, touch_interval=0.0)
    b = FileTier(tmp_path, 1 << 40, clock=clock, touch_interval=0.0)
    other, own, newest = leaf_key(1, 1), leaf_key(2, 2), leaf_key(3, 3)
    _put(b, other)  # another node's, at t=0
    clock.advance(1000)
    _put(a, own)  # this node's, never read again
    clock.advance(1000)
    a.rescan()  # finds the other node's object
    assert a.indexed(other)
    assert [k for k, _ in a.index.coldest(2)] == [other, own]
    size = a.usage().bytes // 2
    a.capacity = int(2.5 * size)  # a third object is one too many
    _put(a, newest)
    assert not a.indexed(other) and a.indexed(own) and a.indexed(newest)
    assert not (tmp_path / "kv" / "01" / "01").exists() or \
        not any((tmp_path / "kv" / "01" / "01").iterdir())
