"""A clean stop keeps the cache: dirty host chunks are flushed below, most recent first,
within a budget that a hung tier cannot stretch; ``reset_cache`` empties the host tier."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvtier.clock import ManualClock
from kvtier.flusher import IdleFlusher
from kvtier.iopool import IOPool
from kvtier.keys import ChunkKey
from kvtier.objformat import ChunkMeta
from kvtier.store import LowerTier, TieredStore, WritePolicy
from kvtier.tiers.base import PutStatus, WriteMode
from kvtier.tiers.file import FileTier
from kvtier.tiers.host import HostTier
from tests.tiers.harness import PAYLOAD, make_key, meta_for, payload_for


class RecordingTier(FileTier):
    """A file tier that records the order of puts and can hang them on a gate."""

    def __init__(self, root: Path, gate: threading.Event | None = None,
                 fail: bool = False) -> None:
        super().__init__(root, 1 << 30, clock=ManualClock())
        self.order: list[ChunkKey] = []
        self.gate = gate
        self.fail = fail

    def put(self, meta: ChunkMeta, payload: Any, mode: WriteMode = WriteMode.CREATE) -> PutStatus:
        if self.gate is not None:
            self.gate.wait(30)  # a hung NFS server: released by the test's cleanup
        self.order.append(meta.key)
        return PutStatus.FAILED if self.fail else super().put(meta, payload, mode)


def _store(tier: FileTier, slots: int = 10) -> TieredStore:
    host = HostTier(slots * PAYLOAD, PAYLOAD)
    return TieredStore(host, [LowerTier(tier, WritePolicy.BACK)], IOPool(2, 64))


def _fill(store: TieredStore, n: int) -> list[ChunkKey]:
    keys = [make_key(i) for i in range(n)]
    for k in keys:
        assert store.put(meta_for(k), payload_for(k))
    return keys


def test_shutdown_writes_dirty_chunks_most_recently_used_first(tmp_path: Path) -> None:
    tier = RecordingTier(tmp_path / "t")
    store = _store(tier)
    keys = _fill(store, 5)
    store.load(store.lookup([keys[1]])).result().release()  # a hit: now the most recently used
    report = store.shutdown(budget_s=30)
    assert (report.flushed, report.left) == (5, 0)
    assert tier.order == [keys[1], keys[4], keys[3], keys[2], keys[0]]
    again = FileTier(tmp_path / "t", 1 << 30, clock=ManualClock())  # the restarted node
    assert again.contains_prefix(keys) == 5


def test_shutdown_never_waits_past_its_budget_on_a_hung_tier(tmp_path: Path) -> None:
    gate = threading.Event()
    store = _store(RecordingTier(tmp_path / "t", gate))
    try:
        _fill(store, 5)
        t0 = time.monotonic()
        report = store.shutdown(budget_s=0.3)
        assert time.monotonic() - t0 < 5
        assert report.flushed == 0 and report.left == 5
    finally:
        gate.set()


def test_a_zero_budget_closes_at_once(tmp_path: Path) -> None:
    tier = RecordingTier(tmp_path / "t")
    store = _store(tier)
    _fill(store, 3)
    report = store.shutdown(budget_s=0)
    assert (report.flushed, report.left) == (0, 3)
    assert tier.order == []


def test_reset_drops_dirty_chunks_without_writing_them(tmp_path: Path) -> None:
    # reset_cache after a weight sync: what the host holds may be the old weights' KV
    tier = RecordingTier(tmp_path / "t")
    store = _store(tier)
    try:
        keys = _fill(store, 4)
        held = store.load(store.lookup([keys[0]])).result()  # being copied: kept
        assert store.drop_host() == 3
        held.release()
        assert store.host.contains_prefix(keys) == 1
        store.flush(5)
        assert tier.order == []  # nothing was written below
    finally:
        store.close()


def test_reset_returns_at_once_even_with_a_hung_tier(tmp_path: Path) -> None:
    gate = threading.Event()
    store = _store(RecordingTier(tmp_path / "t", gate), slots=10)
    try:
        # the pool is full: the coldest 5 (the low-water mark, half the pool) spill into
        # the hung tier
        keys = _fill(store, 10)
        t0 = time.monotonic()
        assert store.drop_host() == 5  # the 5 being spilled are held: kept
        assert time.monotonic() - t0 < 1.0
        assert store.host.contains_prefix(keys) == 5
    finally:
        gate.set()
        store.close()


def test_reset_host_queues_dirty_chunks_and_empties_the_host_tier_once_written(
    tmp_path: Path,
) -> None:
    """``reset_cache: host`` never waits: each call drops what is clean and queues what is
    dirty, and answers "empty" only once everything is written and dropped."""
    gate = threading.Event()
    tier = RecordingTier(tmp_path / "t", gate)
    store = _store(tier)
    try:
        keys = _fill(store, 4)
        held = store.load(store.lookup([keys[0]])).result()  # being copied: kept, still dirty
        t0 = time.monotonic()
        assert store.empty_host() == (0, False)  # the writes hang: nothing clean to drop yet
        assert time.monotonic() - t0 < 1.0, "memory only: never waits for the tier"
        assert store.host.contains_prefix(keys) == 4, "nothing stored is lost"
        gate.set()
        store.flush(30)  # (the test waits for the queued writes; the reset never does)
        held.release()
        dropped, empty = store.empty_host()  # keys[0] was held: queued now
        assert dropped == 3 and not empty
        store.flush(30)
        assert store.empty_host() == (1, True)
        assert tier.contains_prefix(keys) == 4  # every chunk is below, none in the host
        assert store.lookup(keys).hits == 4
    finally:
        gate.set()
        store.close()


def test_reset_host_keeps_dirty_chunks_a_failing_tier_cannot_take(tmp_path: Path) -> None:
    store = _store(RecordingTier(tmp_path / "t", fail=True))
    try:
        keys = _fill(store, 3)
        assert store.empty_host() == (0, False)
        store.flush(30)
        assert store.empty_host() == (0, False)
        assert store.host.contains_prefix(keys) == 3
    finally:
        store.close()


def _aging_store(tier: FileTier, clock: ManualClock, slots: int = 10) -> TieredStore:
    host = HostTier(slots * PAYLOAD, PAYLOAD, clock=clock)
    return TieredStore(host, [LowerTier(tier, WritePolicy.BACK)], IOPool(2, 64))


def test_chunks_dirty_longer_than_max_dirty_are_written_on_a_busy_engine(
    tmp_path: Path,
) -> None:
    clock = ManualClock()
    tier = RecordingTier(tmp_path / "t")
    store = _aging_store(tier, clock)
    flusher = IdleFlusher(store, 2.0, max_dirty_s=10.0, clock=clock)
    try:
        old = _fill(store, 3)
        clock.advance(6)
        new = [make_key(i) for i in range(10, 12)]
        for k in new:
            store.put(meta_for(k), payload_for(k))
        flusher.busy()
        assert flusher.tick() == 0  # nothing is 10 s old yet, and the engine is busy
        clock.advance(4.5)
        flusher.busy()
        assert flusher.tick() == 3  # busy, but the first three are 10.5 s dirty
        store.flush(5)
        assert sorted(tier.order) == sorted(old)
        assert store.host.index.dirty_keys() == set(new)
        clock.advance(6)
        flusher.busy()
        assert flusher.tick() == 2
        store.flush(5)
        assert store.host.index.dirty_keys() == set()
        assert flusher.aged == 5
    finally:
        flusher.close()
        store.close()


def test_max_dirty_leaves_the_store_queue_room_for_spills(tmp_path: Path) -> None:
    clock = ManualClock()
    gate = threading.Event()
    tier = RecordingTier(tmp_path / "t", gate)
    host = HostTier(40 * PAYLOAD, PAYLOAD, clock=clock)
    # a low-water mark of 4 slots: 30 dirty chunks of 40 spill nothing by themselves
    store = TieredStore(host, [LowerTier(tier, WritePolicy.BACK)], IOPool(1, 8),
                        clean_reserve=0.1)
    flusher = IdleFlusher(store, 0.0, max_dirty_s=1.0, clock=clock)
    try:
        _fill(store, 30)
        clock.advance(2)
        queued = flusher.tick()
        assert 0 < queued <= 1 + 8 // 2  # one running, at most half the queue's room
        assert store.io.free_store_slots() >= 3
    finally:
        gate.set()
        flusher.close()
        store.close()


@pytest.fixture
def pool() -> Iterator[IOPool]:
    p = IOPool(1, 8)
    yield p
    p.close(timeout=0)


def test_iopool_close_with_timeout_cancels_queued_work_and_abandons_a_stuck_task(
    pool: IOPool,
) -> None:
    gate, started = threading.Event(), threading.Event()

    def stuck() -> None:
        started.set()
        gate.wait(30)

    pool.submit_load(stuck)
    assert started.wait(10)
    queued = pool.submit_store(lambda: None)
    assert queued is not None
    t0 = time.monotonic()
    pool.close(timeout=0.2)
    assert time.monotonic() - t0 < 5
    assert queued.cancelled()
    gate.set()


def test_the_idle_flusher_writes_only_after_the_engine_is_idle(tmp_path: Path) -> None:
    tier = RecordingTier(tmp_path / "t")
    store = _store(tier)
    clock = ManualClock()
    flusher = IdleFlusher(store, idle_s=2.0, batch=2, clock=clock)
    try:
        keys = _fill(store, 3)
        flusher.busy()
        clock.advance(1.0)
        assert flusher.tick() == 0, "the engine stepped 1 s ago"
        clock.advance(1.5)
        assert flusher.tick() == 2  # the two most recent first
        store.flush()
        assert flusher.tick() == 1
        store.flush()
        assert flusher.tick() == 0
        assert tier.order == [keys[2], keys[1], keys[0]]
        assert not store.host.index.dirty_keys()
        assert store.shutdown(budget_s=30).flushed == 0  # nothing left to do
    finally:
        flusher.close()


def test_a_failed_idle_write_leaves_the_chunk_dirty(tmp_path: Path) -> None:
    store = _store(RecordingTier(tmp_path / "t", fail=True))  # e.g. the disk is full
    try:
        _fill(store, 1)
        assert store.write_back_some(4) == 1
        store.flush()
        assert len(store.host.index.dirty_keys()) == 1
    finally:
        store.close()


def test_a_stop_request_flushes_everything_and_keeps_the_loop_up_until_done(
    tmp_path: Path,
) -> None:
    clock = ManualClock()
    tier = RecordingTier(tmp_path / "t")
    store = _aging_store(tier, clock)
    flusher = IdleFlusher(store, 0.0, max_dirty_s=0.0, stop_budget_s=20.0, clock=clock)
    try:
        keys = _fill(store, 4)
        assert not flusher.stop_flush_pending()
        flusher.request_stop()  # what the signal handler does: one store, no lock
        assert flusher.stop_flush_pending()  # vLLM's loop keeps stepping
        report = flusher.stop_flush()
        assert (report.flushed, report.left) == (4, 0)
        assert not flusher.stop_flush_pending()
        assert sorted(tier.order) == sorted(keys)
    finally:
        flusher.close()
        store.close()


def test_a_stop_flush_that_runs_out_of_time_stops_holding_the_loop(tmp_path: Path) -> None:
    clock = ManualClock()
    store = _aging_store(RecordingTier(tmp_path / "t"), clock)
    flusher = IdleFlusher(store, 0.0, stop_budget_s=5.0, clock=clock)
    try:
        flusher.request_stop()
        flusher._stop_started = clock.monotonic()  # the flush began on its thread
        assert flusher.stop_flush_pending()
        clock.advance(5.0)
        assert not flusher.stop_flush_pending()
    finally:
        flusher.close()
        store.close()


def test_stop_signals_are_chained_in_front_of_the_installed_handler() -> None:
    import signal

    from kvtier.vllm.stopsignal import chain_stop_signals

    calls: list[str] = []
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        signal.signal(signal.SIGTERM, lambda *_: calls.append("vllm"))
        signal.signal(signal.SIGINT, signal.SIG_DFL)  # nothing to chain to: left alone
        assert chain_stop_signals(lambda: calls.append("kvtier"))
        assert signal.getsignal(signal.SIGINT) is signal.SIG_DFL
        signal.raise_signal(signal.SIGTERM)
        assert calls == ["kvtier", "vllm"]
        done: list[bool] = []
        t = threading.Thread(target=lambda: done.append(chain_stop_signals(lambda: None)))
        t.start()
        t.join()
        assert done == [False]  # only the main thread may install handlers
    finally:
        for s, h in saved.items():
            signal.signal(s, h)


def test_a_failed_aged_write_is_tried_again_only_a_full_age_later(tmp_path: Path) -> None:
    clock = ManualClock()
    tier = RecordingTier(tmp_path / "t", fail=True)  # answers FAILED
    store = _aging_store(tier, clock)
    flusher = IdleFlusher(store, 0.0, max_dirty_s=10.0, clock=clock)
    try:
        _fill(store, 2)
        clock.advance(11)
        assert flusher.tick() == 2
        store.flush(5)
        assert len(tier.order) == 2 and len(store.host.index.dirty_keys()) == 2
        clock.advance(5)
        assert flusher.tick() == 0  # no retry storm: the age restarted at the failure
        clock.advance(6)
        assert flusher.tick() == 2
    finally:
        flusher.close()
        store.close()
