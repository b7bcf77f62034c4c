"""TieredStore: lookup across tiers, write-through, write-back spill, promotion, drops."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvtier.clock import ManualClock
from kvtier.iopool import IOPool
from kvtier.keys import ChunkKey
from kvtier.objformat import ChunkMeta, ChunkSpec, checksum
from kvtier.store import HOST, LoadProgress, LowerTier, TieredStore, WritePolicy
from kvtier.tiers.base import PutStatus
from kvtier.tiers.file import FileTier
from kvtier.tiers.host import HostTier
from tests.tiers.harness import (
    PAYLOAD,
    SPEC,
    drain_host,
    make_key,
    meta_for,
    payload_for,
    raw_object,
    spec_for,
)


def _store(tmp: Path, host_slots: int, write: WritePolicy, *, queue: int = 64) -> TieredStore:
    host = HostTier(host_slots * PAYLOAD, PAYLOAD)
    file = FileTier(tmp / "file", 1 << 30, clock=ManualClock())
    return TieredStore(host, [LowerTier(file, write)], IOPool(2, queue))


@pytest.fixture
def through(tmp_path: Path) -> Iterator[TieredStore]:
    s = _store(tmp_path, 4, WritePolicy.THROUGH)
    yield s
    s.close()


@pytest.fixture
def back(tmp_path: Path) -> Iterator[TieredStore]:
    s = _store(tmp_path, 10, WritePolicy.BACK)
    yield s
    s.close()


def _put(store: TieredStore, i: int) -> bool:
    key = make_key(i)
    return store.put(meta_for(key), payload_for(key))


def test_write_through_reaches_lower_tier_at_once(through: TieredStore) -> None:
    keys = [make_key(i) for i in range(3)]
    for i in range(3):
        assert _put(through, i)
    through.flush()
    assert through.lower[0].tier.contains_prefix(keys) == 3
    assert through.lookup(keys).tiers == (HOST, HOST, HOST)


def test_rewrite_through_restores_what_another_node_removed(
    through: TieredStore, tmp_path: Path
) -> None:
    kept, gone = make_key(0), make_key(1)
    for i in range(2):
        assert _put(through, i)
    through.flush()
    other = FileTier(tmp_path / "file", 1 << 30, clock=ManualClock())  # another node
    inode = os.stat(other.path_of(kept)).st_ino
    assert other.delete([gone]) == 1
    assert through.lower[0].tier.contains_prefix([gone]) == 1  # our index cannot tell
    assert through.rewrite_through([kept, gone, make_key(2)]) == 2  # host-resident only
    through.flush()
    assert other.contains_prefix([kept, gone]) == 2
    assert os.stat(other.path_of(kept)).st_ino == inode  # present: checked, not rewritten
    buf = np.empty(PAYLOAD, np.uint8)
    assert other.get_into(gone, buf.data) is not None
    assert bytes(buf) == bytes(payload_for(gone))


def test_lookup_reports_prefix_and_location(through: TieredStore) -> None:
    for i in range(6):  # host holds 4: the first two are evicted to the file tier only
        _put(through, i)
        through.flush()
    lk = through.lookup([make_key(i) for i in range(8)])
    assert lk.hits == 6
    assert lk.tiers == (1, 1, HOST, HOST, HOST, HOST)


def test_load_promotes_and_holds(through: TieredStore) -> None:
    for i in range(6):
        _put(through, i)
        through.flush()
    keys = [make_key(i) for i in (0, 1)]
    held = through.load(through.lookup(keys)).result(timeout=30)
    try:
        assert held.from_tier == [1, 1]
        for j, key in enumerate(keys):
            np.testing.assert_array_equal(held.view(j), payload_for(key))
        assert through.lookup(keys).tiers == (HOST, HOST)
    finally:
        held.release()


def test_held_chunks_are_not_evicted(through: TieredStore) -> None:
    for i in range(4):
        _put(through, i)
    through.flush()
    held = through.load(through.lookup([make_key(i) for i in range(4)])).result(timeout=30)
    assert not _put(through, 9)  # every slot held: dropped, not blocking
    assert through.drops == 1
    held.release()
    assert _put(through, 9)


def test_write_back_spills_before_evicting(back: TieredStore) -> None:
    for i in range(30):  # 3x the host pool
        assert _put(back, i)
        back.flush()
    keys = [make_key(i) for i in range(30)]
    lk = back.lookup(keys)
    assert lk.hits == 30, "every chunk is in host or spilled below"
    buf = np.zeros(PAYLOAD, dtype=np.uint8)
    for key in keys:
        assert back.get_into(key, buf.data) is not None
        np.testing.assert_array_equal(buf, payload_for(key))


def test_load_stops_at_first_missing_chunk(through: TieredStore) -> None:
    _put(through, 0)
    _put(through, 2)
    held = through.load(through.lookup([make_key(i) for i in range(3)])).result(timeout=30)
    assert len(held) == 1
    held.release()


@contextmanager
def _workers_held(s: TieredStore) -> Iterator[None]:
    """Occupy both IO workers until the block exits, so store jobs can only queue."""
    gate = threading.Event()
    started = [threading.Event(), threading.Event()]

    def hold(ev: threading.Event) -> None:
        ev.set()
        gate.wait()

    for ev in started:
        s.io.submit_load(partial(hold, ev))
    try:
        assert all(ev.wait(timeout=10) for ev in started)
        yield
    finally:
        gate.set()


def test_full_store_queue_drops_and_counts(tmp_path: Path) -> None:
    s = _store(tmp_path, 8, WritePolicy.THROUGH, queue=1)
    try:
        with _workers_held(s):
            for i in range(4):
                _put(s, i)
            assert s.drops == 3
    finally:
        s.close()


def test_rewrite_through_is_one_queued_job_however_long_the_prompt(tmp_path: Path) -> None:
    s = _store(tmp_path, 8, WritePolicy.THROUGH, queue=1)
    try:
        for i in range(6):
            assert _put(s, i)
        s.flush()
        before = s.drops  # a 1-job queue dropped some of the puts' own write-throughs
        with _workers_held(s):
            assert s.rewrite_through([make_key(i) for i in range(6)]) == 6  # one job fits
            assert s.drops == before
            assert s.rewrite_through([make_key(0)]) == 0  # the queue is full: counted drop
            assert s.drops == before + 1
    finally:
        s.close()


# -- validate before bytes reach the KV cache ----------------------------------------------
def _file_of(store: TieredStore) -> FileTier:
    tier = store.lower[0].tier
    assert isinstance(tier, FileTier)
    return tier


def _wire_of(i: int, **changes: Any) -> dict[str, Any]:
    key = make_key(i)
    wire = meta_for(key).to_wire(checksum(payload_for(key)))
    wire.update(changes)
    return wire


_BIG = payload_for(make_key(1), 2 * PAYLOAD)


@pytest.mark.parametrize(
    ("wire", "payload"),
    [
        (_wire_of(1, ns=2**63), bytes(payload_for(make_key(1)))),  # OverflowError
        (_wire_of(1, ntok=float("inf")), bytes(payload_for(make_key(1)))),  # OverflowError
        # A valid object whose payload is bigger than a host slot ("buffer too small").
        (_wire_of(1, plen=2 * PAYLOAD, shape=[2 * PAYLOAD], csum=checksum(_BIG)), bytes(_BIG)),
    ],
    ids=["huge-ns", "infinite-ntok", "payload-bigger-than-slot"],
)
def test_hostile_object_below_is_a_counted_miss_and_leaks_no_hold(
    through: TieredStore, wire: dict[str, Any], payload: bytes
) -> None:
    file = _file_of(through)
    assert _put(through, 0)  # a host hit, held before the promotion starts
    file.path_of(make_key(1)).parent.mkdir(parents=True, exist_ok=True)
    file.path_of(make_key(1)).write_bytes(raw_object(wire, payload))
    file.put(meta_for(make_key(2)), payload_for(make_key(2)).data)
    through.flush()
    held = through.load(through.lookup([make_key(i) for i in range(3)])).result(timeout=30)
    assert held.from_tier == [HOST]  # the bad chunk ends the prefix
    held.release()
    assert file.metrics.counts.corruptions == 1
    assert not file.path_of(make_key(1)).exists()  # removed, not served again
    drain_host(through.host)


@pytest.mark.parametrize(
    "changes",
    [
        {"namespace": b"", "payload_len": 0, "shape": (0,)},  # short: stale bytes would follow
        {"dtype": "made-up"},
        {"num_tokens": 7},
        {"shape": (2, PAYLOAD // 2)},
        {"namespace": b"\x01" * 16},
        {"payload_len": PAYLOAD - 1, "shape": (PAYLOAD - 1,)},
    ],
    ids=repr,
)
def test_object_not_matching_spec_is_not_promoted(
    through: TieredStore, changes: dict[str, Any]
) -> None:
    file = _file_of(through)
    key = make_key(1)
    meta = replace(meta_for(key), **changes)
    assert file.put(meta, payload_for(key, meta.payload_len).data) is PutStatus.STORED
    held = through.load(through.lookup([key]), SPEC).result(timeout=30)
    assert len(held) == 0
    assert file.metrics.counts.corruptions == 1
    assert not file.path_of(key).exists()
    assert not through.host.index.contains(key)
    drain_host(through.host)


def test_host_slot_not_matching_spec_is_dropped_and_promoted_again(
    through: TieredStore,
) -> None:
    key = make_key(0)
    _file_of(through).put(meta_for(key), payload_for(key).data)  # a good copy below
    assert through.host.put(replace(meta_for(key), dtype="float16"), payload_for(key).data)
    held = through.load(through.lookup([key]), SPEC).result(timeout=30)
    try:
        assert held.from_tier == [1]
        assert held.slots[0][1] == meta_for(key)
        np.testing.assert_array_equal(held.view(0), payload_for(key))
    finally:
        held.release()
    assert through.host.metrics.counts.corruptions == 1
    drain_host(through.host)


def test_matching_spec_serves_host_and_lower_hits(through: TieredStore) -> None:
    for i in range(6):  # the first two are evicted from the 4-slot host, kept below
        _put(through, i)
        through.flush()
    keys = [make_key(i) for i in (4, 5, 0, 1)]
    held = through.load(through.lookup(keys), SPEC).result(timeout=30)
    try:
        assert held.from_tier == [HOST, HOST, 1, 1]
        for j, key in enumerate(keys):
            np.testing.assert_array_equal(held.view(j), payload_for(key))
    finally:
        held.release()
    drain_host(through.host)


class _BrokenReads(FileTier):
    def get_into(
        self, key: ChunkKey, dst: memoryview, *, expect: ChunkSpec | None = None
    ) -> ChunkMeta | None:
        raise RuntimeError("a bug in a tier")


def test_unexpected_error_while_promoting_releases_every_hold(tmp_path: Path) -> None:
    host = HostTier(4 * PAYLOAD, PAYLOAD)
    file = _BrokenReads(tmp_path / "file", 1 << 30, clock=ManualClock())
    s = TieredStore(host, [LowerTier(file, WritePolicy.THROUGH)], IOPool(2, 64))
    try:
        assert _put(s, 0)
        file.put(meta_for(make_key(1)), payload_for(make_key(1)).data)
        s.flush()
        fut = s.load(s.lookup([make_key(0), make_key(1)]))
        with pytest.raises(RuntimeError, match="a bug in a tier"):
            fut.result(timeout=30)
        drain_host(host)  # the host hit's hold was released, the staging slot aborted
    finally:
        s.close()


def test_spec_bigger_than_a_slot_is_refused_at_once(through: TieredStore) -> None:
    with pytest.raises(ValueError, match="do not fit"):
        through.load(through.lookup([make_key(0)]), spec_for(PAYLOAD + 1))


class _CountingFile(FileTier):
    """A file tier that counts how often it is asked whether it holds a chunk."""

    asked = 0

    def contains_prefix(self, keys: Any) -> int:
        self.asked += 1
        return super().contains_prefix(keys)


def _two_file_tiers(tmp_path: Path) -> tuple[TieredStore, _CountingFile, _CountingFile]:
    """A store of host + two write-through directory tiers (upper, then lower)."""
    host = HostTier(4 * PAYLOAD, PAYLOAD)
    upper = _CountingFile(tmp_path / "f1", 1 << 30, clock=ManualClock())
    lower = _CountingFile(tmp_path / "f2", 1 << 30, clock=ManualClock())
    s = TieredStore(host, [LowerTier(upper, WritePolicy.THROUGH),
                           LowerTier(lower, WritePolicy.THROUGH)], IOPool(2, 64))
    return s, upper, lower


def test_load_reads_from_the_tier_the_lookup_named_and_asks_none(tmp_path: Path) -> None:
    s, upper, lower = _two_file_tiers(tmp_path)
    host = s.host
    try:
        key = make_key(1)
        lower.put(meta_for(key), payload_for(key).data)
        found = s.lookup_indexed([key])
        assert found.tiers == (2,)
        held = s.load(found, SPEC).result(timeout=30)
        try:
            assert held.from_tier == [2] and held.slots[0][1] == meta_for(key)
            np.testing.assert_array_equal(held.view(0), payload_for(key))
        finally:
            held.release()
        assert upper.asked == lower.asked == 0, "the lookup already said where it is"
        drain_host(host)
    finally:
        s.close()


def test_host_entry_evicted_since_the_lookup_is_read_below(through: TieredStore) -> None:
    assert _put(through, 0)
    through.flush()  # written through: the file tier's index knows it too
    found = through.lookup_indexed([make_key(0)])
    assert found.tiers == (HOST,)
    assert through.host.delete([make_key(0)]) == 1  # evicted between lookup and load
    misses = through.host.metrics.counts.misses
    held = through.load(found, SPEC).result(timeout=30)
    try:
        assert held.from_tier == [1]
        np.testing.assert_array_equal(held.view(0), payload_for(make_key(0)))
    finally:
        held.release()
    assert through.host.metrics.counts.misses == misses + 1
    drain_host(through.host)


def test_object_gone_since_the_lookup_is_read_from_the_next_tier_down(tmp_path: Path) -> None:
    """Another node's collector removed the chunks from the shared directory; the S3-like
    tier below still has them: the load reads them there instead of recomputing."""
    s, upper, lower = _two_file_tiers(tmp_path)
    host = s.host
    try:
        keys = [make_key(i) for i in range(3)]
        for key in keys:
            upper.put(meta_for(key), payload_for(key).data)
            lower.put(meta_for(key), payload_for(key).data)
        found = s.lookup_indexed(keys)
        assert found.tiers == (1, 1, 1)
        for key in keys[1:]:
            upper.path_of(key).unlink()  # removed by another node meanwhile
        held = s.load(found, SPEC).result(timeout=30)
        try:
            assert held.from_tier == [1, 2, 2]
            for i, key in enumerate(keys):
                np.testing.assert_array_equal(held.view(i), payload_for(key))
        finally:
            held.release()
        assert upper.metrics.counts.misses == 2
        drain_host(host)
    finally:
        s.close()


def test_object_gone_since_the_lookup_is_a_counted_miss_that_ends_the_prefix(
    through: TieredStore,
) -> None:
    file = _file_of(through)
    keys = [make_key(i) for i in range(3)]
    for key in keys:
        file.put(meta_for(key), payload_for(key).data)
    found = through.lookup_indexed(keys)
    assert found.tiers == (1, 1, 1)
    file.path_of(keys[1]).unlink()  # another node's collector removed it meanwhile
    held = through.load(found, SPEC).result(timeout=30)
    try:
        assert held.from_tier == [1]
    finally:
        held.release()
    assert file.metrics.counts.misses >= 1
    assert not through.host.indexed(keys[1]) and not through.host.indexed(keys[2])
    drain_host(through.host)


def test_load_of_a_head_holds_only_that_many(through: TieredStore) -> None:
    for i in range(3):
        assert _put(through, i)
    found = through.lookup_indexed([make_key(i) for i in range(3)])
    held = through.load(found.head(2)).result(timeout=30)
    assert len(held) == 2 and found.head(2).keys == found.keys[:2]
    held.release()
    through.flush()  # the write-through jobs hold their slots until written
    drain_host(through.host)


class _GatedFile(FileTier):
    """A file tier whose reads block until ``gate`` is set (``reading`` says one has
    started)."""

    def __init__(self, root: Path) -> None:
        super().__init__(root, 1 << 30, clock=ManualClock())
        self.gate, self.reading = threading.Event(), threading.Event()

    def get_into(self, key: ChunkKey, dst: Any, expect: ChunkSpec | None = None) -> Any:
        self.reading.set()
        assert self.gate.wait(30)
        return super().get_into(key, dst, expect=expect)


def test_concurrent_restores_of_one_prefix_share_a_read_in_flight(tmp_path: Path) -> None:
    """Two requests on one prefix return together: the second one's read finds the first
    one filling the host slot of a shared chunk. It waits for that fill and holds the
    chunk, instead of ending its prefix there (a restore lost to a race)."""
    file = _GatedFile(tmp_path / "file")
    store = TieredStore(HostTier(8 * PAYLOAD, PAYLOAD), [LowerTier(file, WritePolicy.THROUGH)],
                        IOPool(2, 64))
    try:
        keys = [make_key(i) for i in range(3)]
        file.gate.set()
        for k in keys:
            assert store.put(meta_for(k), payload_for(k))
        store.flush()
        store.drop_host()
        file.gate.clear()
        waiting = threading.Event()
        settle = store.host.wait_settled

        def observed(key: ChunkKey, timeout: float) -> bool:
            waiting.set()
            return settle(key, timeout)

        store.host.wait_settled = observed  # type: ignore[method-assign]
        first = store.load(store.lookup(keys))
        assert file.reading.wait(30)  # the first read is filling chunk 0's slot
        second = store.load(store.lookup(keys))
        assert waiting.wait(30)  # the second waits for that fill instead of giving up
        file.gate.set()
        a, b = first.result(timeout=30), second.result(timeout=30)
        try:
            assert len(a.slots) == len(b.slots) == 3
            for j, key in enumerate(keys):
                np.testing.assert_array_equal(b.view(j), payload_for(key))
        finally:
            a.release()
            b.release()
    finally:
        store.close()


def test_write_back_spills_ahead_to_a_low_water_mark_of_clean_slots(tmp_path: Path) -> None:
    """Issue 36: a pool under pressure spills before it is full, so a save that reserves
    its chunks all at once (the eviction hook) finds clean slots to take."""
    store = _store(tmp_path, 8, WritePolicy.BACK)  # the mark: half the pool, 4 slots
    try:
        for i in range(6):
            assert _put(store, i)
        assert store.flush(10.0)  # the tier kept up
        assert store.host.index.clean_or_free() == 4
        slots = [store.reserve(make_key(100 + i)) for i in range(4)]
        assert None not in slots, "a save found every slot dirty"
        for slot in slots:
            assert slot is not None
            store.abort(slot)
        assert store.lookup([make_key(i) for i in range(6)]).hits == 6  # nothing lost
    finally:
        store.close()


def test_a_promotion_into_an_all_dirty_pool_writes_a_dirty_chunk_below_for_its_slot(
    tmp_path: Path,
) -> None:
    """Issue 36: a restore that finds every host slot dirty (nothing spilled yet) does not
    end there: its IO thread writes the coldest dirty chunk below, takes the slot, and
    reports the time as the ``slot`` stage. Nothing dirty is lost."""
    store = _store(tmp_path, 4, WritePolicy.BACK)
    try:
        dirty = [make_key(i) for i in range(4)]
        for key in dirty:  # straight into the host tier: no spill was triggered
            r = store.host.reserve(key)
            assert r is not None
            store.host.view(r.slot, PAYLOAD)[:] = payload_for(key)
            store.host.commit(r.slot, meta_for(key), dirty=True)
        wanted = make_key(99)
        below = store.lower[0].tier
        assert below.put(meta_for(wanted), payload_for(wanted).data) is PutStatus.STORED
        progress = LoadProgress()
        held = store.load(store.lookup_indexed([wanted]), SPEC, progress).result()
        try:
            assert len(held) == 1 and held.from_tier == [1]
            assert np.array_equal(held.view(0), payload_for(wanted))
        finally:
            held.release()
        assert set(progress.stages) == {"queue", "slot", "read"}
        assert below.contains_prefix([dirty[0]]) == 1, "the coldest dirty chunk went below"
        assert store.lookup(dirty).hits == 4  # in the host or below: nothing lost
    finally:
        store.close()


def _all_slots_held(store: TieredStore) -> Any:
    """Fill the host pool with clean chunks and hold every one (other requests' staged
    restores); the holds are returned."""
    keys = [make_key(100 + i) for i in range(store.host.pool.num_slots)]
    for key in keys:
        assert store.put(meta_for(key), payload_for(key))
    store.flush()
    return store.load(store.lookup(keys)).result(timeout=30)


def _waiting_for_a_slot(store: TieredStore, monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Set once a load's IO thread looks for a reservable slot (it is waiting for one)."""
    asked = threading.Event()
    real = store.host.index.reservable

    def reservable() -> bool:
        asked.set()
        return real()

    monkeypatch.setattr(store.host.index, "reservable", reservable)
    return asked


def test_a_promotion_into_an_all_held_pool_waits_for_a_slot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 36: every host slot held by other requests' staged chunks (none dirty to
    write below) is a wait of the next engine step or two, not the end of the restore:
    the read waits for a slot (stage ``slot``) and gets its chunk once one is released.
    Before, it ended the prefix there, and a streamed restore then failed whole."""
    store = _store(tmp_path, 4, WritePolicy.THROUGH)
    try:
        holds = _all_slots_held(store)
        wanted = make_key(7)
        assert store.lower[0].tier.put(meta_for(wanted), payload_for(wanted).data) \
            is PutStatus.STORED
        asked = _waiting_for_a_slot(store, monkeypatch)
        progress = LoadProgress()
        fut = store.load(store.lookup_indexed([wanted]), SPEC, progress)
        assert asked.wait(timeout=30), "the read never waited for a slot"
        assert not fut.done()
        holds.release()  # the other requests' chunks were copied: their slots come free
        held = fut.result(timeout=30)
        try:
            assert len(held) == 1 and np.array_equal(held.view(0), payload_for(wanted))
        finally:
            held.release()
        assert "slot" in progress.stages
    finally:
        store.close()


def test_a_wait_for_a_slot_ends_when_the_load_is_cancelled(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    store = _store(tmp_path, 4, WritePolicy.THROUGH)
    try:
        holds = _all_slots_held(store)
        wanted = make_key(7)
        store.lower[0].tier.put(meta_for(wanted), payload_for(wanted).data)
        asked = _waiting_for_a_slot(store, monkeypatch)
        progress = LoadProgress()
        fut = store.load(store.lookup_indexed([wanted]), SPEC, progress)
        assert asked.wait(timeout=30)
        progress.cancel()  # the scheduler gave the restore up (its wait bound)
        assert len(fut.result(timeout=30)) == 0
        holds.release()
        assert store.host.index.num_held() == 0
    finally:
        store.close()


def test_a_chunk_hot_in_the_host_pool_keeps_its_lower_copy_fresh(tmp_path: Path) -> None:
    """Review N9: a host hit never restamped the chunk's shared copy, and a save that
    found the object there (EXISTS) renewed nothing, so its lease ran out (the router's
    expiry, 480 s) under a chunk hot in memory. Now each restamps the copy, at most once
    per ``touch_interval``."""
    from kvtier.config import HealthConfig
    from kvtier.health import breakers_for

    clock = ManualClock(start=1_700_000_000.0)
    tier = FileTier(tmp_path / "t", 1 << 30, clock=clock, touch_interval=60.0, name="file1")
    host = HostTier(8 * PAYLOAD, PAYLOAD, clock=clock)
    pool = IOPool(1, 64, name="io-file1")
    store = TieredStore(host, [LowerTier(tier, WritePolicy.THROUGH)], pool,
                        breakers=breakers_for(["file1"], HealthConfig(), 1, clock),
                        tier_io=[pool])

    def stamp(key: ChunkKey) -> float:
        (path,) = (tmp_path / "t").rglob(key.hex() + "*")
        return os.stat(path).st_mtime

    try:
        key = make_key(5)
        assert store.put(meta_for(key), payload_for(key))
        assert store.flush(10)
        written = stamp(key)
        clock.advance(100.0)
        store.load(store.lookup_indexed([key])).result(timeout=10).release()  # a host hit
        assert store.flush(10)
        assert stamp(key) == pytest.approx(written + 100.0)
        clock.advance(10.0)  # within touch_interval: not stamped again
        store.load(store.lookup_indexed([key])).result(timeout=10).release()
        assert store.flush(10)
        assert stamp(key) == pytest.approx(written + 100.0)
        clock.advance(100.0)  # a save of the same chunk finds it there: a use too
        assert tier.put(meta_for(key), payload_for(key).data) is PutStatus.EXISTS
        assert stamp(key) == pytest.approx(written + 210.0)
    finally:
        store.close(timeout=5)
        tier.close()
