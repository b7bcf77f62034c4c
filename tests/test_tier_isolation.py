"""One tier's trouble costs only that tier (issue 32): a write-back tier that refuses
writes or hangs never keeps host slots dirty, a load that spans a healthy and a hung tier
reads each chunk on its own tier's pool, and a breaker blames a call only for its own
faults. Tiers hang on gates (a dead hard NFS mount) or on a SIGSTOPped moto server; time
that the breakers see is a ManualClock.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvtier.clock import ManualClock
from kvtier.config import HealthConfig
from kvtier.health import Breaker, breakers_for
from kvtier.iopool import IOPool
from kvtier.keys import ChunkKey
from kvtier.objformat import ChunkMeta
from kvtier.store import LoadProgress, Lookup, LowerTier, TieredStore, WritePolicy
from kvtier.tiers.base import PutStatus, WriteMode
from kvtier.tiers.file import FileTier
from kvtier.tiers.host import HostTier
from tests.test_bounded_waits import HangingTier
from tests.tiers.harness import PAYLOAD, make_key, meta_for, payload_for, spec_for


class RefusingTier(FileTier):
    """A file tier that refuses every write (AccessDenied, quota, no space): counted."""

    def __init__(self, root: Path, clock: ManualClock, name: str) -> None:
        super().__init__(root, 1 << 30, clock=clock, name=name)
        self.refused = 0

    def put(self, meta: ChunkMeta, payload: Any, mode: WriteMode = WriteMode.CREATE) -> PutStatus:
        self.refused += 1
        self.metrics.error("put")
        return PutStatus.FAILED


def _store(lower: list[LowerTier], clock: ManualClock, slots: int = 8,
           breakers: list[Breaker] | None = None) -> TieredStore:
    host = HostTier(slots * PAYLOAD, PAYLOAD, clock=clock)
    pools = [IOPool(2, 16, name=f"io-{lt.tier.name}") for lt in lower]
    if breakers is None:
        breakers = breakers_for([lt.tier.name for lt in lower], HealthConfig(), 2, clock)
    return TieredStore(host, lower, pools[0], breakers=breakers, tier_io=pools)


def _until(pred: Callable[[], bool], timeout: float = 20.0) -> bool:
    """Poll ``pred`` (work on IO threads finishing) until it holds or ``timeout``."""
    end = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > end:
            return False
        threading.Event().wait(0.005)
    return True


def _puts_keep_caching(store: TieredStore, first: FileTier, n: int) -> None:
    """Put ``n`` chunks into a host pool of far fewer slots; each must be cached (the
    healthy write-back tier takes the spills) and end up on ``first``."""
    keys = [make_key(100 + i) for i in range(n)]
    for k in keys:  # a save finding every slot busy (spills in flight) is tried again
        def save(k: ChunkKey = k) -> bool:
            return store.put(meta_for(k), payload_for(k))

        assert _until(save), \
            f"save of {k.hex()[:8]} dropped: host slots stayed dirty behind the failing tier"
    store.write_back_some(n)
    assert _until(lambda: all(first.indexed(k) for k in keys))


def test_a_tier_refusing_writes_never_keeps_host_slots_dirty(tmp_path: Path) -> None:
    clock = ManualClock()
    good = FileTier(tmp_path / "good", 1 << 30, clock=clock, name="good")
    bad = RefusingTier(tmp_path / "bad", clock, "bad")
    store = _store([LowerTier(good, WritePolicy.BACK), LowerTier(bad, WritePolicy.BACK)],
                   clock)
    try:
        _puts_keep_caching(store, good, 40)
        assert store.flush(10)
        # each chunk is offered to the refusing tier at most once (no re-spill loop), and
        # once its breaker is open, not at all
        assert bad.refused <= 40
        assert not store.breakers[1].up and store.breakers[0].up
        assert store.host.index.num_held() == 0
    finally:
        store.close(timeout=5)


@pytest.fixture
def moto() -> Iterator[Any]:
    from kvtier.testing.s3server import MotoServer, dummy_credentials

    with dummy_credentials():
        server = MotoServer()
        url = server.start()
        try:
            import boto3

            boto3.client("s3", endpoint_url=url, region_name="us-east-1").create_bucket(
                Bucket="iso")
            yield server
        finally:
            server.stop()


@pytest.mark.s3
def test_a_hung_s3_write_back_tier_leaves_the_file_tier_caching(tmp_path: Path,
                                                                moto: Any) -> None:
    from kvtier.tiers.s3 import S3Tier

    clock = ManualClock()
    good = FileTier(tmp_path / "good", 1 << 30, clock=clock, name="file1")
    s3 = S3Tier(bucket="iso", capacity_bytes=1 << 30, endpoint_url=moto.endpoint_url,
                connect_timeout=1.0, read_timeout=2.0, max_attempts=1, clock=clock,
                name="s32")
    store = _store([LowerTier(good, WritePolicy.BACK), LowerTier(s3, WritePolicy.BACK)],
                   clock)
    moto.pause()  # hung for the whole run: accepts connections, never answers
    try:
        _puts_keep_caching(store, good, 40)
        # what S3 is stuck on holds at most its own pool's threads' slots
        assert store.host.index.num_held() <= 2
    finally:
        moto.resume()
        store.close(timeout=5)


@pytest.fixture
def hung_second(tmp_path: Path) -> Iterator[tuple[TieredStore, HangingTier, HangingTier]]:
    clock = ManualClock()
    a = HangingTier(tmp_path / "a", clock, "a")
    b = HangingTier(tmp_path / "b", clock, "b")
    store = _store([LowerTier(a, WritePolicy.THROUGH), LowerTier(b, WritePolicy.THROUGH)],
                   clock, slots=16)
    yield store, a, b
    a.gate.set()
    b.gate.set()
    store.close(timeout=5)


def test_a_load_spanning_a_healthy_and_a_hung_tier_leaves_the_healthy_pool_free(
    hung_second: tuple[TieredStore, HangingTier, HangingTier],
) -> None:
    store, a, b = hung_second
    heads = [make_key(i) for i in range(2)]
    tails = [make_key(10 + i) for i in range(2)]
    other = make_key(30)
    for k in (*heads, other):
        a.put(meta_for(k), payload_for(k))
    for k in tails:
        b.put(meta_for(k), payload_for(k))
    b.hang.set()
    # two prefixes that start on a and go on on b: as many loads as a's pool has threads
    stuck = [store.load(Lookup((h, t), (1, 2)), spec_for()) for h, t in zip(heads, tails,
                                                                             strict=True)]
    for _ in stuck:
        assert b.entered.acquire(timeout=10)
    got = store.load(store.lookup_indexed([other]), spec_for()).result(timeout=10)
    assert len(got) == 1, "a load from the healthy tier queued behind the hung one"
    got.release()
    assert not any(f.done() for f in stuck)
    b.gate.set()
    for f in stuck:
        held = f.result(timeout=10)
        assert len(held) == 2 and held.from_tier == [1, 2]
        held.release()
    assert store.host.index.num_held() == 0


def test_a_breaker_blames_a_call_only_for_its_own_faults(
    hung_second: tuple[TieredStore, HangingTier, HangingTier],
) -> None:
    store, a, _ = hung_second
    strict = Breaker("a", failures=1, clock=ManualClock())
    store.breakers[0] = strict
    store._breaker_of[id(a)] = strict
    k = make_key(1)
    a.put(meta_for(k), payload_for(k))
    a.hang.set()
    fut = store.load(store.lookup_indexed([k]), spec_for())
    assert a.entered.acquire(timeout=10)

    def background() -> None:  # the restamp thread, the walk, expiry, another read
        for op in ("touch", "collect", "get"):
            a.metrics.error(op)

    t = threading.Thread(target=background)
    t.start()
    t.join()
    a.gate.set()
    held = fut.result(timeout=10)
    assert len(held) == 1
    held.release()
    assert strict.up, "the read was blamed for errors counted by other threads"


class _CancelAfterFirstCheck(LoadProgress):
    """Not cancelled when the load starts, cancelled from then on (the scheduler's
    deadline passing while the load waits)."""

    def __init__(self) -> None:
        super().__init__()
        self._checks = 0

    @property  # type: ignore[override]
    def cancelled(self) -> bool:
        self._checks += 1
        return self._checks > 1

    @cancelled.setter
    def cancelled(self, value: bool) -> None:
        pass


def test_the_load_fallback_stops_waiting_once_cancelled(tmp_path: Path) -> None:
    clock = ManualClock()
    a = FileTier(tmp_path / "a", 1 << 30, clock=clock, name="a")
    b = FileTier(tmp_path / "b", 1 << 30, clock=clock, name="b")
    host = HostTier(4 * PAYLOAD, PAYLOAD, clock=clock)
    io = IOPool(2, 16)
    store = TieredStore(host, [LowerTier(a, WritePolicy.THROUGH),
                               LowerTier(b, WritePolicy.THROUGH)], io)
    k = make_key(7)
    b.put(meta_for(k), payload_for(k).data)
    r = host.reserve(k)  # another request's save of k: in flight and never finished
    assert r is not None
    try:
        t0 = time.monotonic()
        held = store.load(Lookup((k,), (1,)), spec_for(), _CancelAfterFirstCheck()).result(
            timeout=20)
        assert len(held) == 0
        assert time.monotonic() - t0 < 5, "the fallback read ignored the cancellation"
    finally:
        host.abort(r.slot)
        store.close(timeout=5)


@pytest.mark.s3
def test_a_restamp_dropped_at_the_stamp_queue_is_not_recorded_as_done(
    tmp_path: Path, moto: Any,
) -> None:
    from kvtier.tiers.s3 import STAMP_QUEUE, S3Tier

    clock = ManualClock()
    s3 = S3Tier(bucket="iso", capacity_bytes=1 << 30, endpoint_url=moto.endpoint_url,
                max_attempts=1, clock=clock, name="s3", touch_interval=60.0)
    try:
        k = make_key(1)
        assert s3.put(meta_for(k), payload_for(k).data) is PutStatus.STORED
        before = s3.index.get(k)
        assert before is not None
        with s3._stamp_lock:  # the stamp queue is full (a burst of hits elsewhere)
            s3._stamp_keys.update(make_key(1000 + i) for i in range(STAMP_QUEUE))
        clock.advance(120)
        dst = memoryview(bytearray(PAYLOAD))
        assert s3.get_into(k, dst, expect=spec_for()) is not None
        after = s3.index.get(k)
        assert after is not None and after.touched == before.touched, \
            "a restamp that was dropped is recorded as done"
        with s3._stamp_lock:
            s3._stamp_keys.clear()
        assert s3.get_into(k, dst, expect=spec_for()) is not None  # the next hit stamps
        assert s3.stamps_pending() <= 1
    finally:
        s3.close()
