"""Every wait a request can incur has a deadline, and one tier's trouble costs only that
tier's work (issue 18). No engine, no sleeps: tiers hang on gates (a hard-mounted NFS
server that is gone), time is a ManualClock, and the scheduler side is driven as vLLM
drives it.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from kvtier.clock import ManualClock
from kvtier.config import HealthConfig, KVTierConfig
from kvtier.health import Breaker, breakers_for
from kvtier.iopool import IOPool
from kvtier.keys import ChunkKey, Namespace, chunk_keys
from kvtier.objformat import ChunkMeta
from kvtier.store import LowerTier, TieredStore, WritePolicy
from kvtier.tiers.base import PutStatus, WriteMode
from kvtier.tiers.file import FileTier
from kvtier.tiers.host import HostTier
from kvtier.vllm.geometry import Geometry
from kvtier.vllm.scheduler_side import STAGED_STEPS, SchedulerSide
from tests.tiers.harness import PAYLOAD, make_key, meta_for, payload_for

CT = 128
GEOM = Geometry(2, 2, 64, CT, 4096, "float32")
NS = Namespace(model="m", model_fingerprint="0" * 16, kv_dtype="float32", kv_layout="NHD",
               num_layers=2, num_kv_heads=2, head_size=64, chunk_tokens=CT, block_size=CT)
SLOT = GEOM.chunk_bytes(CT)


class HangingTier(FileTier):
    """A file tier whose reads, writes, existence checks or collection block on a gate
    (released by the test's cleanup), as calls into a dead hard NFS mount do."""

    def __init__(self, root: Path, clock: ManualClock, name: str) -> None:
        super().__init__(root, 1 << 30, clock=clock, name=name)
        self.hang = threading.Event()  # set: calls block
        self.gate = threading.Event()  # set: blocked calls return
        self.entered = threading.Semaphore(0)
        self.hang_collect = False

    def _block(self) -> None:
        if self.hang.is_set():
            self.entered.release()
            self.gate.wait(30)

    def get_into(self, key: ChunkKey, dst: Any, *, expect: Any = None) -> ChunkMeta | None:
        self._block()
        return super().get_into(key, dst, expect=expect)

    def put(self, meta: ChunkMeta, payload: Any, mode: WriteMode = WriteMode.CREATE) -> PutStatus:
        self._block()
        return super().put(meta, payload, mode)

    def contains_prefix(self, keys: Any) -> int:
        self._block()
        return super().contains_prefix(keys)

    def collect(self) -> int:
        if self.hang_collect:
            self.entered.release()
            self.gate.wait(30)
        return super().collect()


def _two_tier_store(tmp: Path, clock: ManualClock, write: WritePolicy,
                    slot: int = PAYLOAD, slots: int = 16) -> tuple[TieredStore, HangingTier,
                                                                     HangingTier]:
    a = HangingTier(tmp / "a", clock, "a")
    b = HangingTier(tmp / "b", clock, "b")
    host = HostTier(slots * slot, slot, clock=clock)
    lower = [LowerTier(a, write), LowerTier(b, write)]
    pools = [IOPool(2, 16, name="io-a"), IOPool(2, 16, name="io-b")]
    breakers = breakers_for(["a", "b"], HealthConfig(), 2, clock)
    return TieredStore(host, lower, pools[0], breakers=breakers, tier_io=pools), a, b


@pytest.fixture
def two(tmp_path: Path) -> Iterator[tuple[TieredStore, HangingTier, HangingTier,
                                          ManualClock]]:
    clock = ManualClock()
    store, a, b = _two_tier_store(tmp_path, clock, WritePolicy.THROUGH)
    yield store, a, b, clock
    a.gate.set()
    b.gate.set()
    store.close(timeout=5)


def test_a_hung_tier_leaves_the_other_tiers_loads_and_writes_alone(two: Any) -> None:
    store, a, b, _ = two
    ka, kb = make_key(1), make_key(2)
    others = [make_key(20 + i) for i in range(3)]
    for k in (ka, *others):
        a.put(meta_for(k), payload_for(k))
    b.put(meta_for(kb), payload_for(kb))
    a.hang.set()
    stuck = store.load(store.lookup_indexed([ka]))  # blocks in tier a's read
    assert a.entered.acquire(timeout=10)
    more = [store.load(store.lookup_indexed([k])) for k in others]  # a's other thread
    got = store.load(store.lookup_indexed([kb])).result(timeout=10)  # b: unaffected
    assert len(got) == 1
    got.release()
    k3 = make_key(3)  # a new chunk: tier b's write lands, tier a's waits in a's pool
    assert store.put(meta_for(k3), payload_for(k3))
    deadline_ok = threading.Event()

    def written() -> None:
        while not b.indexed(k3):
            pass
        deadline_ok.set()

    t = threading.Thread(target=written, daemon=True)
    t.start()
    assert deadline_ok.wait(10), "tier b's write waited behind tier a"
    assert not stuck.done() and not any(f.done() for f in more)
    a.gate.set()
    for f in (stuck, *more):
        f.result(timeout=10).release()
    assert store.flush(10)
    assert store.host.index.num_held() == 0


def test_collection_is_its_own_job_and_never_times_a_write(two: Any) -> None:
    store, a, _, _ = two
    a.hang_collect = True
    k = make_key(5)
    fut = store._queue_write(*_host_slot(store, k), [a], kind="write_through")
    assert fut is not None and fut.result(timeout=10) is True  # the put is done
    assert a.entered.acquire(timeout=10)  # collection runs after it, in its own job
    assert store.breakers[0].up
    a.gate.set()


def _host_slot(store: TieredStore, key: ChunkKey) -> tuple[int, ChunkMeta]:
    store.host.put(meta_for(key), payload_for(key).data)
    got = store.host.index.hold(key)
    assert got is not None
    return got


def test_large_healthy_reads_are_neither_slow_nor_stuck() -> None:
    clock = ManualClock()
    b = Breaker("t", slow_s=2.0, max_in_flight=1, min_bytes_per_s=20 * 2**20, clock=clock)
    calls = [b.call(read=True, nbytes=64 << 20) for _ in range(3)]
    for c in calls:
        c.__enter__()
    clock.advance(3.0)  # 64 MiB at 20 MiB/s may take 2 + 3.2 s
    assert b.available() and b.up  # none of them is stuck: a fourth read is allowed
    with b.call(read=True, nbytes=64 << 20):
        pass
    for c in calls:
        c.__exit__(None, None, None)
    assert b.up and b.refused == 0
    small = b.call(read=True, nbytes=4096)
    small.__enter__()
    clock.advance(2.5)  # a small read hung past slow_s: that is a fault
    assert not b.up
    small.__exit__(None, None, None)


def test_64_mib_objects_read_concurrently_keep_the_breaker_closed(tmp_path: Path) -> None:
    clock = ManualClock()
    size = 64 << 20
    store, a, _ = _two_tier_store(tmp_path, clock, WritePolicy.BACK, slot=size, slots=4)
    try:
        keys = [make_key(10 + i) for i in range(3)]
        for k in keys:
            a.put(meta_for(k, size), np.full(size, k[3], np.uint8).data)
        a.hang.set()  # each read now waits until the test lets them all go
        loads = [store.load(store.lookup_indexed([k])) for k in keys]
        assert a.entered.acquire(timeout=10) and a.entered.acquire(timeout=10)
        clock.advance(1.5)  # two 64 MiB reads in flight for 1.5 s: healthy, not stuck
        assert store.breakers[0].up and store.breakers[0].available()
        a.hang.clear()
        a.gate.set()
        for f, k in zip(loads, keys, strict=True):
            held = f.result(timeout=30)
            assert len(held) == 1 and int(held.view(0)[size - 1]) == k[3]
            held.release()
        assert store.breakers[0].refused == 0 and store.breakers[0].up
    finally:
        a.gate.set()
        store.close(timeout=5)


# -- the scheduler side ------------------------------------------------------------------


def _sched(tmp: Path, clock: ManualClock, *, role: str = "both", host_slots: int = 64,
           write: str = "back", **restore: Any) -> tuple[SchedulerSide, HangingTier]:
    cfg = KVTierConfig.model_validate({
        "chunk_tokens": CT,
        "tiers": [{"host": {"capacity": host_slots * SLOT, "pinned": "no"}},
                  {"file": {"path": str(tmp / "t"), "capacity": "1GiB", "write": write}}],
        "restore": {"recompute_threshold_tokens": 64, "wait_seconds": 30, **restore},
    })
    tier = HangingTier(tmp / "t", clock, "file1")
    host = HostTier(host_slots * SLOT, SLOT, clock=clock)
    store = TieredStore(host, [LowerTier(tier, WritePolicy(write))], IOPool(2, 16),
                        breakers=breakers_for(["file1"], cfg.health, 2, clock))
    return SchedulerSide(cfg, GEOM, NS, None, store=store, role=role, clock=clock), tier


def _request(rid: str, seed: int, chunks: int = 3, **kvtier: Any) -> SimpleNamespace:
    toks = [(seed * 7919 + i) % 50_000 + 1 for i in range(chunks * CT + 10)]
    return SimpleNamespace(request_id=rid, all_token_ids=toks, num_tokens=len(toks),
                           num_computed_tokens=len(toks), cache_salt=None, lora_request=None,
                           mm_features=None, prompt_embeds=None,
                           kv_transfer_params={"kvtier": kvtier} if kvtier else None)


def _store_below(sched: SchedulerSide, tier: FileTier, req: SimpleNamespace, n: int) -> None:
    keys = chunk_keys(NS.digest(), req.all_token_ids, CT)
    for c in range(n):
        tier.put(sched._meta(NS.digest(), keys, c), np.zeros(SLOT, np.uint8).data)


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


def test_a_load_stuck_in_a_hung_tier_is_abandoned_and_its_slots_come_back(
    tmp_path: Path, clock: ManualClock,
) -> None:
    sched, tier = _sched(tmp_path, clock)
    try:
        req = _request("r", 1)
        _store_below(sched, tier, req, 3)
        tier.hang.set()
        assert sched.get_num_new_matched_tokens(req, 0) == (None, False)  # loading
        assert tier.entered.acquire(timeout=10)  # stuck in the kernel, as it were
        clock.advance(sched.load_stall_s - 0.1)
        assert sched.get_num_new_matched_tokens(req, 0) == (None, False)
        clock.advance(0.2)
        assert sched.get_num_new_matched_tokens(req, 0) == (0, False)  # recompute now
        assert "r" not in sched._lookups
        assert not sched.store.breakers[0].up  # the stuck read tripped the breaker
        tier.gate.set()  # the read returns: what it held is released, nothing leaks
        sched.store.io.close(timeout=10)  # joins the IO threads (and their callbacks)
        assert sched.store.host.index.num_held() == 0
        assert sched.store.host.index.clean_or_free() == sched.store.host.index.num_slots
    finally:
        tier.gate.set()
        sched.close()


def test_a_probe_is_asked_once_per_request_and_cancelled_at_its_deadline(
    tmp_path: Path, clock: ManualClock,
) -> None:
    sched, tier = _sched(tmp_path, clock)
    try:
        req = _request("p", 2)
        tier.hang.set()
        assert sched.get_num_new_matched_tokens(req, 0) == (None, False)  # probing
        probe = sched._probes["p"]
        clock.advance(sched.lookup_timeout_s + 0.01)
        assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
        assert probe.progress.cancelled
        # vLLM reconsiders the request (its allocation failed): no second probe
        assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
        assert sched._probes["p"] is probe
    finally:
        tier.gate.set()
        sched.close()


def test_a_full_probe_queue_answers_from_the_index(tmp_path: Path, clock: ManualClock,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    sched, _ = _sched(tmp_path, clock)
    try:
        monkeypatch.setattr(sched.store, "probe", lambda *a, **k: None)  # queue full
        assert sched.get_num_new_matched_tokens(_request("q", 3), 0) == (0, False)
    finally:
        sched.close()


def test_a_missed_key_is_not_probed_again_within_its_ttl(
    tmp_path: Path, clock: ManualClock,
) -> None:
    sched, tier = _sched(tmp_path, clock)
    try:
        keys = chunk_keys(NS.digest(), _request("m", 4).all_token_ids, CT)
        asked: list[int] = []
        orig = tier.contains_prefix
        tier.contains_prefix = lambda ks: asked.append(1) or orig(ks)  # type: ignore
        fut = sched.store.probe(keys)
        assert fut is not None and fut.result(timeout=10) == 0 and len(asked) == 1
        fut = sched.store.probe(keys)
        assert fut is not None and fut.result(timeout=10) == 0 and len(asked) == 1
        fut = sched.store.probe(keys, fresh=True)  # a P/D decode waiting asks anyway
        assert fut is not None and fut.result(timeout=10) == 0 and len(asked) == 2
    finally:
        sched.close()


def test_staged_kv_is_capped_and_released_when_not_admitted(
    tmp_path: Path, clock: ManualClock,
) -> None:
    sched, tier = _sched(tmp_path, clock, host_slots=12)  # cap: 6 staged chunks
    try:
        reqs = [_request(f"s{i}", 10 + i) for i in range(3)]
        for r in reqs:
            _store_below(sched, tier, r, 3)
        answers = []
        for r in reqs:  # one schedule(): vLLM asks for every waiting request
            n, _ = sched.get_num_new_matched_tokens(r, 0)
            for _ in range(100):
                if n is not None:
                    break
                lk = sched._lookups.get(r.request_id)
                if lk is None or lk.future is None:
                    break
                lk.future.result(timeout=10)
                n, _ = sched.get_num_new_matched_tokens(r, 0)
            answers.append(n)
        assert answers[:2] == [3 * CT, 3 * CT] and answers[2] is None  # over the cap
        assert sched._staged_chunks() == 6
        for _ in range(STAGED_STEPS + 1):  # never admitted (no GPU blocks)
            sched.build_meta()
        assert sched._staged_chunks() == 0
        assert sched.store.host.index.num_held() == 0
    finally:
        sched.close()


def test_pd_announces_nothing_new_while_the_shared_tier_is_down(
    tmp_path: Path, clock: ManualClock,
) -> None:
    sched, _ = _sched(tmp_path, clock, role="prefill", write="through")
    try:
        sched.store.breakers[0]._go_down("test")
        _, params = sched.request_finished(_request("a", 20), list(range(3)))
        assert params["kvtier"]["tokens"] == 0
    finally:
        sched.close()


def test_a_decode_stops_waiting_as_soon_as_no_shared_tier_can_answer(
    tmp_path: Path, clock: ManualClock,
) -> None:
    sched, _ = _sched(tmp_path, clock, role="decode", write="through")
    try:
        base = _request("d", 30)
        keys = chunk_keys(NS.digest(), base.all_token_ids, CT)
        req = _request("d", 30, expect={"tokens": 3 * CT, "last_key": keys[2].hex()})
        sched.store.breakers[0]._go_down("test")
        assert sched.get_num_new_matched_tokens(req, 0) == (0, False)  # no 30 s wait
    finally:
        sched.close()


def test_re_offers_are_rate_limited_per_chunk(tmp_path: Path, clock: ManualClock) -> None:
    sched, tier = _sched(tmp_path, clock, role="prefill", write="through")
    try:
        req = _request("o", 40)
        sched.request_finished(req, list(range(3)))
        sched.build_meta()
        sched.on_worker_output({"o"}, None)
        assert sched.store.flush(10)
        keys = chunk_keys(NS.digest(), req.all_token_ids, CT)
        asked: list[int] = []
        orig = tier.put
        tier.put = lambda *a, **k: asked.append(1) or orig(*a, **k)  # type: ignore
        sched.request_finished(_request("o2", 40), list(range(3)))  # same prompt again
        assert sched.store.flush(10) and asked == []  # offered within lease/4: skipped
        clock.advance(sched.lease_s / 4 + 1)
        sched.request_finished(_request("o3", 40), list(range(3)))
        assert sched.store.flush(10) and len(asked) == len(keys)
    finally:
        sched.close()


def test_a_read_started_by_the_lookup_is_answered_in_the_same_step(
    tmp_path: Path, clock: ManualClock, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The hook waits for the read it has just started (``read_grace``), so a healthy
    tier's chunks are restored without sitting out an engine step; a long grace here
    makes that deterministic (the wait ends as soon as the read does)."""
    monkeypatch.setattr("kvtier.vllm.scheduler.lookup.READ_GRACE_S", 30.0)
    sched, tier = _sched(tmp_path, clock)
    try:
        req = _request("r", 2)
        _store_below(sched, tier, req, 3)
        assert sched.get_num_new_matched_tokens(req, 0) == (3 * CT, False)
    finally:
        sched.close()


def test_no_grace_while_storage_is_suspect_and_one_budget_per_step(
    tmp_path: Path, clock: ManualClock, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A hung tier costs the scheduler thread at most ``READ_GRACE_S`` per engine step
    however many requests start reads in it, and nothing once a wait has run out."""
    monkeypatch.setattr("kvtier.vllm.scheduler.lookup.READ_GRACE_S", 0.05)
    sched, tier = _sched(tmp_path, clock)
    try:
        reqs = [_request(f"r{i}", 10 + i) for i in range(3)]
        for req in reqs:
            _store_below(sched, tier, req, 3)
        tier.hang.set()
        assert sched.get_num_new_matched_tokens(reqs[0], 0) == (None, False)
        assert sched._grace_left <= 0  # the step's grace went to the first read
        assert sched.get_num_new_matched_tokens(reqs[1], 0) == (None, False)
        assert sched._grace_left <= 0
        sched.waits.missed(clock.monotonic())  # a wait ran out: storage is suspect
        sched._step += 1  # a new engine step would have a fresh grace ...
        assert sched.get_num_new_matched_tokens(reqs[2], 0) == (None, False)
        assert sched._grace_left == pytest.approx(0.05)  # ... but none of it was spent
    finally:
        tier.gate.set()
        sched.close()


def test_a_hung_write_through_tier_pins_at_most_its_share_of_the_host_pool(
    tmp_path: Path,
) -> None:
    """Review N3: every commit queued a write-through job that held its host slot until
    the job ran, so a hung tier behind its pool's two blocked threads pinned one slot
    per queued job (up to ``max_queued_stores``): the host pool filled with pinned slots
    and every new save was dropped. Now a job holds its slot from the commit only while
    its tier answers and its pool's held jobs are within half the pool; past that it
    takes its hold when it starts, and a chunk evicted meanwhile is a copy given up."""
    clock = ManualClock()
    a = HangingTier(tmp_path / "a", clock, "a")
    slots = 8
    host = HostTier(slots * PAYLOAD, PAYLOAD, clock=clock)
    pool = IOPool(2, 256, name="io-a")
    store = TieredStore(host, [LowerTier(a, WritePolicy.THROUGH)], pool,
                        breakers=breakers_for(["a"], HealthConfig(), 2, clock), tier_io=[pool])
    try:
        a.hang.set()
        first = [make_key(100 + i) for i in range(2)]
        for k in first:  # both of the pool's threads block in the hung tier
            assert store.put(meta_for(k), payload_for(k))
        for _ in first:
            assert a.entered.acquire(timeout=10)
        clock.advance(store.breakers[0].stuck_s + 0.01)  # their calls are overdue now
        assert store.breakers[0].up  # not tripped yet (slow_s): only overdue
        later = [make_key(200 + i) for i in range(4 * slots)]
        stored = sum(store.put(meta_for(k), payload_for(k)) for k in later)
        assert stored == len(later)  # every save found a slot: nothing pinned them
        assert store.host.index.num_held() == len(first)  # only the two running jobs
        a.gate.set()
        assert store.flush(10)
        assert store.host.index.num_held() == 0
        assert a.indexed(first[0]) and a.indexed(first[1])
    finally:
        a.gate.set()
        store.close(timeout=5)


def test_a_healthy_write_through_keeps_its_chunk_until_written(tmp_path: Path) -> None:
    """A write-through job queued while its tier answers holds the chunk from the
    commit, so a small host pool under pressure still writes every chunk through."""
    clock = ManualClock()
    a = HangingTier(tmp_path / "a", clock, "a")
    slots = 8
    host = HostTier(slots * PAYLOAD, PAYLOAD, clock=clock)
    pool = IOPool(1, 256, name="io-a")
    store = TieredStore(host, [LowerTier(a, WritePolicy.THROUGH)], pool,
                        breakers=breakers_for(["a"], HealthConfig(), 2, clock), tier_io=[pool])
    try:
        a.hang.set()  # the thread is busy (not overdue: the clock stands still)
        keys = [make_key(300 + i) for i in range(slots // 2 + 1)]
        for k in keys:
            assert store.put(meta_for(k), payload_for(k))
        assert a.entered.acquire(timeout=10)
        # a pool whose jobs are not kept waiting holds every chunk, past the cap too
        assert store.host.index.num_held() == len(keys)
        # jobs held past the cap that have waited their patience: the next one does not
        # hold (a hang not yet overdue pins about half the pool, not all of it)
        from kvtier.store.writes import THROUGH_PATIENCE_S
        clock.advance(THROUGH_PATIENCE_S + 0.01)
        extra = make_key(399)
        assert store.put(meta_for(extra), payload_for(extra))
        assert store.host.index.num_held() == len(keys)
        a.hang.clear()
        a.gate.set()
        assert store.flush(10)
        assert all(a.indexed(k) for k in keys)  # (``extra`` only if it was not evicted)
    finally:
        a.gate.set()
        store.close(timeout=5)


def test_an_abandoned_load_queued_behind_a_hung_tier_gives_its_host_slots_back(
    two: Any,
) -> None:
    """Review N3: a load whose lower-tier part waits in a hung tier's pool held the host
    slots of its leading chunks until that part ran (after the hang). Cancelling its
    progress (the scheduler abandons it) now unqueues that part and releases them."""
    from kvtier.store import LoadProgress

    store, a, _, clock = two
    blockers = [make_key(40 + i) for i in range(2)]
    k_host, k_low = make_key(50), make_key(51)
    for k in (*blockers, k_low):
        a.put(meta_for(k), payload_for(k))
    assert store.put(meta_for(k_host), payload_for(k_host))  # on the host (and a, b)
    assert store.flush(10)
    a.hang.set()
    stuck = [store.load(store.lookup_indexed([k])) for k in blockers]
    for _ in blockers:
        assert a.entered.acquire(timeout=10)  # both of a's threads block
    held_before = store.host.index.num_held()
    progress = LoadProgress(clock)
    found = store.lookup_indexed([k_host, k_low])
    assert found.tiers[0] == 0 and found.hits == 2
    fut = store.load(found, progress=progress)
    assert store.host.index.num_held() == held_before + 1  # its host chunk is held
    progress.cancel()
    with pytest.raises(Exception, match="cancelled before it ran"):
        fut.result(timeout=10)
    assert store.host.index.num_held() == held_before
    a.gate.set()
    for f in stuck:
        f.result(timeout=10).release()


def test_a_load_cleans_a_dirty_slot_only_through_its_own_pools_tier(
    tmp_path: Path,
) -> None:
    """Review N12: a promotion that found every host slot dirty wrote one below through
    the first write-back tier whose breaker was up, whichever pool it ran on: with that
    tier just hung, a healthy tier's load thread hung with it. Now it writes only to a
    tier its own pool serves."""
    clock = ManualClock()
    b = HangingTier(tmp_path / "b", clock, "b")  # first in order, hung
    a = HangingTier(tmp_path / "a", clock, "a")
    host = HostTier(4 * PAYLOAD, PAYLOAD, clock=clock)
    pools = [IOPool(1, 16, name="io-b"), IOPool(1, 16, name="io-a")]
    store = TieredStore(host, [LowerTier(b, WritePolicy.BACK), LowerTier(a, WritePolicy.BACK)],
                        pools[0], breakers=breakers_for(["b", "a"], HealthConfig(), 1, clock),
                        tier_io=pools)
    try:
        key = make_key(77)
        r = host.reserve(key)
        assert r is not None
        host.view(r.slot, PAYLOAD)[:] = payload_for(key)
        host.commit(r.slot, meta_for(key), dirty=True)  # dirty, no spill queued
        b.hang.set()
        assert store._clean_one(None, pools[1])  # a's pool: written to a, at once
        assert a.indexed(key) and not b.entered.acquire(timeout=0)
        assert not store._clean_one(None, pools[0])  # b's pool: nothing dirty left
    finally:
        b.gate.set()
        store.close(timeout=5)
