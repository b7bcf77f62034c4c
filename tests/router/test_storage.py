"""Nothing a shared tier does can stall the router (``kvtier.router.storage``, issue 44):
bounded executors of its own, a breaker per tier, a start that never waits on storage.
The hang is real where it matters: a FUSE passthrough (``bindfs``) whose daemon is
stopped, and an S3 endpoint nobody listens on."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvtier.clock import ManualClock
from kvtier.keys import ChunkKey
from kvtier.router import storage
from kvtier.router.app import ROUTER_KEY
from kvtier.router.leases import LeaseKeeper
from kvtier.router.protocol import RouterError
from kvtier.router.storage import BoundedExecutor, GuardedTier, RouterTiers
from kvtier.testing.fuse import BindMount, unavailable_reason
from kvtier.tiers.file import FileTier
from kvtier.tiers.late import LateTier
from tests.router.fakes import Backend, KVStore, harness, post, run

pytestmark = pytest.mark.timeout(60)

LONG = "a long first question about tiered caches " * 12  # ~500 tokens of the fake


def test_a_busy_executor_refuses_work_instead_of_queueing_it() -> None:
    ex = BoundedExecutor(2, "t")
    gate = threading.Event()
    try:
        a, b = ex.submit(gate.wait, 10), ex.submit(gate.wait, 10)
        assert a is not None and b is not None and ex.busy == 2
        assert ex.submit(lambda: 1) is None and ex.refused == 1  # never queued behind them
        gate.set()
        assert a.result(5) and b.result(5)
        deadline = time.monotonic() + 5
        while ex.busy and time.monotonic() < deadline:
            time.sleep(0.001)  # the done bookkeeping runs on the worker threads
        c = ex.submit(lambda: 7)
        assert c is not None and c.result(5) == 7
        failing = ex.submit(lambda: 1 // 0)
        assert failing is not None
        with pytest.raises(ZeroDivisionError):
            failing.result(5)
    finally:
        gate.set()
        ex.shutdown()
    assert ex.submit(lambda: 1) is None  # shut down


class _HangingTier(FileTier):
    def __init__(self, root: Path) -> None:
        super().__init__(root, 1 << 30)
        self.gate, self.entered = threading.Event(), threading.Event()
        self.calls = 0

    def present(self, key: ChunkKey) -> bool:
        self.calls += 1
        self.entered.set()
        self.gate.wait(20)
        return False


def test_a_tier_with_a_call_overdue_is_not_asked_again(tmp_path: Path) -> None:
    """Once a call has run ``stuck_s`` past its allowance, the next lookups answer "not
    stored" without calling the tier: a hang holds one thread, not one per turn."""
    clock = ManualClock()
    tier = _HangingTier(tmp_path / "t")
    (g,) = storage.guarded([tier], clock)
    key = ChunkKey(bytes(16))
    try:
        t = threading.Thread(target=g.stored, args=(key,), daemon=True)
        t.start()
        assert tier.entered.wait(10)
        assert g.usable() and g.state() == "up"  # in flight, not yet overdue
        clock.advance(g.breaker.stuck_s + 0.01)
        assert not g.usable() and g.state() == "down"
        assert g.stored(key) is False and g.renew(key) is False and g.read_meta(key) is None
        assert g.expire(60) == 0
        assert tier.calls == 1
    finally:
        tier.gate.set()
        tier.close()


def test_a_renewal_of_a_hung_tier_answers_in_bounded_time_and_busy_threads_refuse() -> None:
    gate = threading.Event()
    started = threading.Event()

    def hung_renewer(_last_key: str) -> int:
        started.set()
        gate.wait(20)
        return 1

    def hung_collector() -> int:
        gate.wait(20)
        return 0

    async def scenario() -> None:
        from kvtier.router.conversations import ConversationMap
        from kvtier.router.metrics import RouterMetrics

        convs = ConversationMap(60.0, ManualClock().monotonic, 10)
        keeper = LeaseKeeper(convs, RouterMetrics(lambda: 0, lambda: 0, lambda: 0,
                                                  lambda: 0.0),
                             1.0, hung_renewer, hung_collector, clock=ManualClock(),
                             lease_seconds=60.0, concurrency=1, call_timeout=0.05,
                             executor=BoundedExecutor(1, "lease"))
        with pytest.raises(RouterError) as e:
            await keeper.renew_chain("c", "ab" * 16)
        assert e.value.status == 504 and started.is_set()
        with pytest.raises(RouterError) as e:  # its thread is still stuck: refused
            await keeper.renew_chain("c", "ab" * 16)
        assert e.value.status == 503
        # the collector: one run at most, never a second behind a hung first
        keeper.executor = BoundedExecutor(2, "lease")
        keeper.interval = 0.05
        assert await keeper.collect() == 0  # still running after the beat
        busy = keeper.executor.busy
        assert await keeper.collect() == 0 and keeper.executor.busy == busy

    try:
        asyncio.run(scenario())
    finally:
        gate.set()


def _config(tmp_path: Path, tier_path: Path, extra: str = "") -> Path:
    config = tmp_path / "kvtier.yaml"
    config.write_text(
        "chunk_tokens: 16\ntiers:\n  - host: {capacity: 64MiB}\n"
        f"  - file: {{path: {tier_path}, capacity: 1GiB}}\n"
        "health: {cooldown_seconds: 0}\n" + extra)
    return config


@pytest.fixture
def mount(tmp_path: Path) -> Iterator[BindMount]:
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    with BindMount(tmp_path / "src", tmp_path / "mnt") as m:
        yield m


async def _health(h: Any) -> tuple[int, Any]:
    async with h.client.get("/health") as resp:
        return resp.status, await resp.json()


def test_a_hung_tier_mid_run_stalls_no_request_and_not_the_default_executor(
        tmp_path: Path, mount: BindMount) -> None:
    """The router's tier is a FUSE mount whose daemon is stopped after a first turn:
    twenty returning turns in flight together (each needing a probe of the tier), a
    renewal, ``/health`` and work on asyncio's default executor (where aiohttp resolves
    backend hostnames) all answer; at most the probe threads are held by the hang."""
    writer = FileTier(mount.src, 1 << 30)
    kv = KVStore(writer)
    prefill, decode = Backend(), Backend()
    prefill.kv = decode.kv = kv

    async def scenario() -> None:
        async with harness(prefill, decode, real_tiers=True,
                           tiers=_config(tmp_path, mount.mnt), pd_mode="auto",
                           request_timeout=10) as h:
            router = h.client.app[ROUTER_KEY]
            status, _, headers = await post(h, {"prompt": LONG, "conversation_id": "c0"})
            assert status == 200 and headers["X-KVTier-Path"] == "prefill_decode"
            mount.pause()
            try:
                t0 = time.monotonic()
                turns = [post(h, {"prompt": LONG + f" and then {i}?",
                                  "conversation_id": f"c{i}"}) for i in range(20)]
                answers = await asyncio.gather(*turns)
                turns_s = time.monotonic() - t0
                assert all(a[0] == 200 for a in answers)
                print(f"twenty turns on a hung tier: {turns_s:.3f} s")
                assert turns_s < 5, turns_s  # each probe is cut at --probe-timeout
                assert router.prefix.lookup is not None
                assert router.prefix.lookup.executor.busy <= storage.PROBE_THREADS
                assert router.prefix.skipped > 0  # the rest priced from the index
                t0 = time.monotonic()
                assert await asyncio.to_thread(lambda: 42) == 42
                assert time.monotonic() - t0 < 1
                status, body = await _health(h)
                assert status == 200 and body["tiers"] == {"file1": "up"}  # not overdue yet
                h.clock.advance(1.0)  # the hung calls pass the breaker's stuck_s (0.4 s)
                status, body = await _health(h)
                assert status == 200 and body["tiers"] == {"file1": "down"}
                async with h.client.post("/v1/kvtier/renew",
                                         json={"conversation_id": "c0"}) as resp:
                    assert resp.status in (200, 503, 504)  # answered, not hung
            finally:
                mount.resume()

    try:
        run(scenario)
    finally:
        writer.close()


def test_a_router_started_while_its_tier_hangs_comes_up_serves_and_attaches_later(
        tmp_path: Path, mount: BindMount, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(storage, "OPEN_BOUND_S", 0.3)
    writer = FileTier(mount.src, 1 << 30)  # the engines write beside the hung mount
    prefill, decode = Backend(), Backend()
    prefill.kv = decode.kv = KVStore(writer)
    mount.pause()

    async def scenario() -> None:
        t0 = time.monotonic()
        async with harness(prefill, decode, real_tiers=True,
                           tiers=_config(tmp_path, mount.mnt), pd_mode="auto") as h:
            assert time.monotonic() - t0 < 10
            status, body = await _health(h)
            assert status == 200 and body["tiers"] == {"file1": "opening"}
            status, _, headers = await post(h, {"prompt": LONG, "conversation_id": "c"})
            assert status == 200 and headers["X-KVTier-Path"] == "prefill_decode"
            mount.resume()
            tiers = h.client.app[ROUTER_KEY].tiers
            assert tiers is not None
            late = tiers.tiers[0].tier
            assert isinstance(late, LateTier)
            deadline = time.monotonic() + 20
            while not late.ready and time.monotonic() < deadline:
                await asyncio.sleep(0.05)  # the tier's opening, on its own thread
            assert late.ready
            assert (await _health(h))[1]["tiers"] == {"file1": "down"}  # until a trial
            async with h.client.post("/v1/kvtier/renew", json={"conversation_id": "c"}) as r:
                assert r.status == 200 and (await r.json())["renewed_chunks"] > 0  # the trial
            assert (await _health(h))[1]["tiers"] == {"file1": "up"}

    try:
        run(scenario)
    finally:
        writer.close()


def test_a_router_whose_s3_endpoint_is_down_starts_and_keeps_trying(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Nobody listens on the endpoint: the router does not exit; the tier stays
    ``opening`` and its opening is tried again, logged each time."""
    monkeypatch.setattr(storage, "OPEN_BOUND_S", 0.3)
    monkeypatch.setattr(storage, "REOPEN_MIN_S", 0.01)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "x")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "y")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: connections are refused
    config = tmp_path / "s3.yaml"
    config.write_text(
        "chunk_tokens: 16\ntiers:\n  - host: {capacity: 64MiB}\n"
        f"  - s3: {{bucket: kvt-down, endpoint_url: 'http://127.0.0.1:{port}', "
        "region: us-east-1, path_style: true, capacity: 1GiB, max_attempts: 1, "
        "connect_timeout: 0.2, read_timeout: 0.2}\n")
    tried = threading.Event()
    calls = 0

    def counting(spec: Any, index: int, clock: Any) -> Any:
        nonlocal calls
        from kvtier.build import build_lower

        calls += 1
        if calls >= 2:
            tried.set()
        return build_lower(spec, index, clock)

    t0 = time.monotonic()
    tiers = RouterTiers(config, ManualClock(), opener=counting)
    try:
        assert time.monotonic() - t0 < 5
        assert tiers.states() == {"s31": "opening"}
        assert tried.wait(20)  # a failed opening is tried again, not fatal
        assert tiers.states() == {"s31": "opening"}
        assert tiers.renew_chain("ab" * 16) == 0 and tiers.expire(60) == 0
    finally:
        tiers.close()


def test_a_guarded_tier_that_raises_answers_not_stored(tmp_path: Path) -> None:
    class Broken(FileTier):
        def present(self, key: ChunkKey) -> bool:
            raise OSError("EIO")

    tier = Broken(tmp_path / "b", 1 << 30)
    g = GuardedTier(tier, storage.guarded([tier], ManualClock())[0].breaker)
    try:
        assert g.stored(ChunkKey(bytes(16))) is False
    finally:
        tier.close()
