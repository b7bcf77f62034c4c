"""The compact index against a reference model (hypothesis), and the object tier's start
scan in the background, its bounded expiry ticks and the walk that finds other nodes'
writes and removals. Time is a ``ManualClock``; the start scan is held on an event."""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.clock import ManualClock
from kvtier.keys import ChunkKey
from kvtier.testing.fill import fill_file_tier
from kvtier.tiers.compact import CompactIndex, key_int
from kvtier.tiers.file import FileTier, FileTransport
from kvtier.tiers.scan import scan_delay
from kvtier.tiers.transport import Page
from kvtier.tiers.walk import TickBudget
from tests.tiers.harness import make_key, meta_for, payload_for

SAFETY_S = 30.0  # only a deadlock gets there

_keys = st.integers(0, 40).map(lambda i: ChunkKey(bytes([i % 7]) + i.to_bytes(15, "big")))
_ops = st.lists(st.tuples(st.sampled_from(["remember", "forget", "use", "scan"]), _keys,
                          st.integers(0, 10_000)), max_size=200)


@settings(max_examples=60, deadline=None)
@given(_ops)
def test_the_compact_index_behaves_like_an_ordered_dict(ops: list[tuple[str, ChunkKey, int]]
                                                        ) -> None:
    index = CompactIndex(initial=16)
    model: dict[ChunkKey, tuple[int, float]] = {}  # key -> (size, used), in order
    scanned: dict[ChunkKey, tuple[int, float]] = {}
    for t, (op, key, size) in enumerate(ops):
        if op == "remember":
            model.pop(key, None)
            scanned.pop(key, None)
            model[key] = (size, float(t))
            index.remember(key, size, float(t))
        elif op == "forget":
            model.pop(key, None)
            scanned.pop(key, None)
            index.forget(key)
        elif op == "use" and key in model:
            model[key] = (model.pop(key)[0], float(t))
            index.touch(key, float(t))
        elif op == "scan" and key not in model and key not in scanned:
            scanned[key] = (size, float(-t))  # older than anything recorded
            index.add_scanned([(key, size, float(-t))])
    assert index.finish_scan() == len(scanned)
    ordered = sorted(scanned.items(), key=lambda kv: kv[1][1]) + list(model.items())
    assert [(k, e.size, e.last_used) for k, e in index.items()] == \
        [(k, s, u) for k, (s, u) in ordered]
    assert index.bytes == sum(s for _, (s, _) in ordered) and len(index) == len(ordered)
    assert [k for k, _ in index.coldest(3)] == [k for k, _ in ordered[:3]]
    lo, hi = 2 << 120, (4 << 120) - 1
    assert sorted(k for k, _ in index.in_range(lo, hi)) == \
        sorted(k for k, _ in ordered if lo <= key_int(k) <= hi)


def test_a_changed_entry_is_not_forgotten_by_a_stale_version() -> None:
    index = CompactIndex()
    key = make_key(1)
    index.remember(key, 10, 1.0)
    seen = index.get(key)
    assert seen is not None
    mark = index.mark()
    index.touch(key, 2.0)
    now = index.get(key)
    assert now is not None and CompactIndex.changed_since(now, mark)
    assert not index.forget_if(key, seen) and key in index
    assert index.forget_if(key, now) and key not in index


def test_a_lookup_never_waits_for_a_bulk_insert_holding_the_index_lock() -> None:
    """vLLM's scheduler thread asks ``key in index``; a start scan's batch holds the index
    lock (here: indefinitely, inside the batch it is adding). The lookup must answer."""
    index = CompactIndex()
    old = make_key(1)
    index.remember(old, 10, 1.0)
    inside, go = threading.Event(), threading.Event()
    released: list[bool] = []

    def batch() -> Iterator[tuple[ChunkKey, int, float]]:
        yield make_key(2), 10, 1.0
        inside.set()  # add_scanned holds the lock while it consumes this generator
        go.wait(SAFETY_S)
        released.append(True)
        yield make_key(3), 10, 1.0

    writer = threading.Thread(target=index.add_scanned, args=(batch(),))
    writer.start()
    assert inside.wait(SAFETY_S)
    found, absent = old in index, make_key(4) in index
    assert not released, "the lookup waited for the bulk insert to let go of the lock"
    assert found and not absent
    go.set()
    writer.join(SAFETY_S)
    assert make_key(3) in index and len(index) == 3


def test_lookups_find_every_present_key_while_the_table_and_slab_grow() -> None:
    index = CompactIndex(initial=16)  # many table rebuilds and slab growths ahead
    present = [make_key(i) for i in range(200)]
    for key in present:
        index.remember(key, 1, 1.0)
    new = [ChunkKey(b"\xff" + i.to_bytes(15, "big")) for i in range(60_000)]
    done = threading.Event()

    def insert() -> None:
        for i in range(0, len(new), 256):
            index.add_scanned((k, 1, 1.0) for k in new[i : i + 256])
        done.set()

    writer = threading.Thread(target=insert)
    writer.start()
    rounds = 0
    while not done.is_set() or rounds == 0:
        assert all(key in index for key in present), "a present key was missed"
        assert make_key(10_000) not in index
        rounds += 1
    writer.join(SAFETY_S)
    assert all(key in index for key in new)


# -- the tier ---------------------------------------------------------------------------------
@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


def _fill(root: Path, clock: ManualClock, n: int) -> list[ChunkKey]:
    """``n`` objects spread over many top-level directories, 1 s apart (oldest first)."""
    tier = FileTier(root, 1 << 40, clock=clock)
    keys = [ChunkKey(bytes([(i * 37) % 256]) + i.to_bytes(15, "big")) for i in range(n)]
    for key in keys:
        clock.advance(1)
        tier.put(meta_for(key, 64), payload_for(key, 64).data)
    tier.close()
    return keys


class HeldScan:
    """Holds a tier's start scan before its first page until ``release()``; records the
    threads that list pages."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.entered, self._go = threading.Event(), threading.Event()
        self.listers: set[str] = set()

        real_page = FileTransport.page

        def page(transport: FileTransport, cursor: object | None) -> Page:
            self.listers.add(threading.current_thread().name)
            if threading.current_thread().name.endswith("-index"):
                self.entered.set()
                assert self._go.wait(SAFETY_S)
            return real_page(transport, cursor)

        monkeypatch.setattr(FileTransport, "page", page)

    def release(self) -> None:
        self._go.set()


@pytest.fixture
def held(monkeypatch: pytest.MonkeyPatch) -> Iterator[HeldScan]:
    h = HeldScan(monkeypatch)
    yield h
    h.release()


def test_a_tier_serves_before_its_index_is_complete(
    tmp_path: Path, clock: ManualClock, held: HeldScan
) -> None:
    keys = _fill(tmp_path, clock, 40)
    held.listers.clear()
    tier = FileTier(tmp_path, 1 << 40, clock=clock, background_index=True)
    assert held.entered.wait(SAFETY_S)
    assert held.listers == {"file-index"}, "the constructor listed a page itself"
    assert not tier.index_ready and not tier.metrics.index_ready
    assert tier.metrics.index_scanned == 0
    unscanned = [k for k in keys if not tier.indexed(k)]
    assert unscanned == keys, "nothing is indexed before the scan's first page"
    assert tier.contains_prefix(unscanned[:1]) == 1  # asked of the directory itself
    assert tier.indexed(unscanned[0])
    assert tier.collect() == 0  # usage is not known yet: nothing is collected
    held.release()
    assert tier.wait_indexed(SAFETY_S)
    assert tier.metrics.index_ready and tier.metrics.index_scanned == len(keys)
    assert tier.contains_prefix(keys) == len(keys)
    # Eviction order is the objects' recency, not the directory order of the scan; the
    # probed key was recorded as this node's latest.
    coldest = [k for k, _ in tier.index.coldest(len(keys))]
    assert coldest == [k for k in keys if k != unscanned[0]] + [unscanned[0]]
    tier.close()


def test_the_scan_pace_lists_at_most_the_rate_counted_from_its_start() -> None:
    assert scan_delay(1000, 0.5, 0) == 0  # no limit
    assert scan_delay(1000, 0.5, 100) == pytest.approx(9.5)  # 1,000 objects: 10 s in all
    assert scan_delay(1000, 12.0, 100) == 0  # behind (a slow listing): no wait
    assert scan_delay(0, 0.0, 100) == 0


def test_a_rate_limited_start_scan_serves_probes_and_stops_at_close(
    tmp_path: Path, clock: ManualClock
) -> None:
    keys = _fill(tmp_path, clock, 40)  # one object in each of 40 top-level directories
    tier = FileTier(tmp_path, 1 << 40, clock=clock, background_index=True, scan_rate=1.0)
    # At most the first page (one object) was listed; the next waits until 1 object/s
    # allows it.
    assert not tier.index_ready and tier.metrics.index_scanned <= 2
    late = keys[-1]
    assert not tier.indexed(late)
    assert tier.contains_prefix([late]) == 1  # asked of the directory itself
    tier.close()  # ends the scan's wait at once: no 40 s scan behind a closed tier
    assert tier.wait_indexed(SAFETY_S)
    assert tier.metrics.index_scanned < len(keys)
    with pytest.raises(ValueError, match="scan_rate"):
        FileTier(tmp_path, 1 << 40, clock=clock, scan_rate=-1)


def test_a_filled_directory_is_a_tier_of_that_many_objects(tmp_path: Path) -> None:
    live = FileTier(tmp_path, 1 << 40)  # a live tier's directories are used as they are
    key = make_key(7)
    live.put(meta_for(key, 64), payload_for(key, 64).data)
    filled = fill_file_tier(tmp_path, 1000, sample=100)
    assert filled.objects == 1000 and 90 <= len(filled.sample) <= 110
    tier = FileTier(tmp_path, 1 << 40)
    assert tier.usage().objects == 1001
    assert all(tier.indexed(k) for k in [key, *filled.sample])
    assert len({k[0] for k in filled.sample}) > 64  # spread over the directories


def test_expiry_walks_a_bounded_slice_per_tick_and_a_pass_in_known_ticks(
    tmp_path: Path, clock: ManualClock
) -> None:
    keys = _fill(tmp_path, clock, 60)
    tier = FileTier(tmp_path, 1 << 40, clock=clock, tick=TickBudget(1, math.inf))
    clock.advance(1000)
    removed, ticks = 0, 0
    while tier.passes == 0:
        removed += tier.expire(500)
        ticks += 1
    # A tick ends once it listed tick.objects (here: at the first non-empty leaf); each
    # key has a top-level directory of its own, and one last tick ends the pass.
    assert ticks == len(keys) + 1
    assert removed == len(keys) and tier.usage().objects == 0


def test_the_walk_finds_another_nodes_writes_and_removals(
    tmp_path: Path, clock: ManualClock
) -> None:
    keys = _fill(tmp_path, clock, 10)
    a = FileTier(tmp_path, 1 << 40, clock=clock)
    b = FileTier(tmp_path, 1 << 40, clock=clock)
    new = make_key(999)
    b.put(meta_for(new, 64), payload_for(new, 64).data)
    assert b.delete(keys[:3]) == 3
    assert not a.indexed(new) and a.indexed(keys[0])
    a.expire(1e9)  # nothing is that old: a walk of one whole pass, no removal
    assert a.indexed(new)
    assert not any(a.indexed(k) for k in keys[:3])
    assert a.usage().objects == 8
