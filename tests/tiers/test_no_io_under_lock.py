"""No I/O under the recency lock: a collection or an expiry blocked on the file system or
the endpoint must not hold up the scheduler thread's lookups, nor this node's reads and
writes; and what this node did to a victim meanwhile is honoured.

Each test blocks one call of the collector (a ``stat``/``unlink`` of a victim file, an S3
HEAD or DELETE) on an event, then asks the tier from another thread and requires the
answer while the collector is still blocked. Futures are awaited with a timeout only as a
safety net against a deadlock: nothing here waits on time passing.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal

import pytest

from kvtier.clock import ManualClock
from kvtier.tiers.base import PutStatus, WriteMode
from kvtier.tiers.file import FileTier
from kvtier.tiers.s3 import S3Tier
from tests.tiers.harness import PAYLOAD, SPEC, make_key, meta_for, payload_for

SAFETY_S = 60.0  # only a deadlock gets there
PROMPT_S = 10.0  # far more than any answer needs; a caller stuck behind the collector fails
COLLECTOR = "collector"
KEYS = [make_key(i) for i in range(4)]  # written 1 s apart: KEYS[0] is the coldest
NEW = make_key(99)
LEASE = 2.5  # KEYS[0] and KEYS[1] are past it once written


class Gate:
    """Holds the calls ``match`` selects until ``open()``, before the real call or after
    it returned (``when``)."""

    def __init__(
        self, match: Callable[..., bool], when: Literal["before", "after"] = "before"
    ) -> None:
        self.match = match
        self.when = when
        self.entered = threading.Event()
        self._opened = threading.Event()

    def open(self) -> None:
        self._opened.set()

    def wait_entered(self) -> None:
        assert self.entered.wait(SAFETY_S), "the collector never reached the gated call"

    def _hold(self) -> None:
        self.entered.set()
        if not self._opened.wait(SAFETY_S):
            raise TimeoutError("the gate never opened")

    def wrap(self, real: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            held = self.match(*args, **kwargs)
            if held and self.when == "before":
                self._hold()
            out = real(*args, **kwargs)
            if held and self.when == "after":
                self._hold()
            return out

        return call


def collector_on(target: str | os.PathLike[str]) -> Callable[..., bool]:
    """Selects calls on ``target`` (a path, an object name) made by the collector's thread.
    The file tier works relative to the object's directory (``dir_fd``): its name there
    counts too, and so does its graveyard name (a conditional delete renames the victim,
    re-stats it and unlinks it under that name)."""
    want = os.fspath(target)
    base = os.path.basename(want)

    def match(first: Any = None, *_: Any, **__: Any) -> bool:
        if threading.current_thread().name != COLLECTOR or \
                not isinstance(first, (str, os.PathLike)):
            return False
        got = os.fspath(first)
        return got in (want, base) or (got.startswith(f".{base}.") and got.endswith(".del.tmp"))

    return match


def in_collector(fn: Callable[[], int]) -> Future[int]:
    """Run ``fn`` on a new thread named ``COLLECTOR``; its result as a future."""
    fut: Future[int] = Future()

    def run() -> None:
        try:
            fut.set_result(fn())
        except BaseException as e:  # handed to the test through the future
            fut.set_exception(e)

    threading.Thread(target=run, name=COLLECTOR, daemon=True).start()
    return fut


@pytest.fixture
def pool() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(1, thread_name_prefix="caller") as p:
        yield p


def prompt(pool: ThreadPoolExecutor, fn: Callable[[], Any]) -> Any:
    """``fn()`` on another thread; the caller checks that the collector is still blocked."""
    return pool.submit(fn).result(timeout=PROMPT_S)


def run_collector(tier: FileTier | S3Tier, action: str) -> Future[int]:
    return in_collector(tier.collect if action == "collect" else lambda: tier.expire(LEASE))


def answers_while_blocked(pool: ThreadPoolExecutor, tier: FileTier | S3Tier) -> None:
    """A lookup of indexed keys, a read and a new write all finish."""
    assert prompt(pool, lambda: tier.contains_prefix(KEYS[2:])) == 2
    dst = memoryview(bytearray(PAYLOAD))
    assert prompt(pool, lambda: tier.get_into(KEYS[3], dst, expect=SPEC)) is not None
    put = prompt(pool, lambda: tier.put(meta_for(NEW), payload_for(NEW).data))
    assert put is PutStatus.STORED


# -- file tier -------------------------------------------------------------------------------
@pytest.fixture
def clock() -> ManualClock:
    # Near the real clock: S3 listings carry the endpoint's real LastModified.
    return ManualClock(start=time.time() - 30)


def _write_keys(tier: FileTier | S3Tier, clock: ManualClock) -> int:
    """Write KEYS 1 s apart (as another node); returns the bytes of one object."""
    for key in KEYS:
        clock.advance(1.0)
        assert tier.put(meta_for(key), payload_for(key).data) is PutStatus.STORED
    clock.advance(1.0)
    return tier.usage().bytes // len(KEYS)


@pytest.fixture
def file_tier(tmp_path: Path, clock: ManualClock) -> FileTier:
    """A node that finds KEYS (another node's) in a directory that holds 2.5 of them: a
    collection removes the two coldest, KEYS[0] first; so does ``expire(LEASE)``."""
    size = _write_keys(FileTier(tmp_path, 1 << 30, clock=clock), clock)
    tier = FileTier(tmp_path, size * 5 // 2, clock=clock, touch_interval=0.0)
    assert tier.usage().objects == len(KEYS)
    return tier


@pytest.mark.parametrize("action", ["collect", "expire"])
@pytest.mark.parametrize("call", ["lstat", "unlink"])
def test_a_blocked_file_collector_holds_up_no_lookup_read_or_write(
    file_tier: FileTier, monkeypatch: pytest.MonkeyPatch, pool: ThreadPoolExecutor,
    action: str, call: str,
) -> None:
    gate = Gate(collector_on(file_tier.path_of(KEYS[0])))
    monkeypatch.setattr(os, call, gate.wrap(getattr(os, call)))
    done = run_collector(file_tier, action)
    try:
        gate.wait_entered()
        answers_while_blocked(pool, file_tier)
        assert not done.done()
    finally:
        gate.open()
    assert done.result(timeout=SAFETY_S) > 0
    assert not file_tier.path_of(KEYS[0]).exists()
    assert file_tier.contains_prefix([NEW, KEYS[3]]) == 2


@pytest.mark.parametrize("action", ["collect", "expire"])
@pytest.mark.parametrize("how", ["renew", "overwrite"])
def test_a_victim_this_node_renews_or_rewrites_during_its_restat_is_kept(
    file_tier: FileTier, monkeypatch: pytest.MonkeyPatch, pool: ThreadPoolExecutor,
    clock: ManualClock, action: str, how: str,
) -> None:
    """The collector's re-stat saw the old mtime; before its unlink, this node renewed or
    rewrote the object. The index says so, and the object is kept."""
    victim = KEYS[0]
    gate = Gate(collector_on(file_tier.path_of(victim)), when="after")
    monkeypatch.setattr(os, "lstat", gate.wrap(os.lstat))
    done = run_collector(file_tier, action)
    try:
        gate.wait_entered()
        clock.advance(1.0)
        if how == "renew":
            assert prompt(pool, lambda: file_tier.renew(victim)) is True
        else:
            again = prompt(pool, lambda: file_tier.put(
                meta_for(victim), payload_for(victim).data, WriteMode.OVERWRITE))
            assert again is PutStatus.STORED
        assert not done.done()
    finally:
        gate.open()
    done.result(timeout=SAFETY_S)
    dst = memoryview(bytearray(PAYLOAD))
    assert file_tier.get_into(victim, dst, expect=SPEC) is not None
    assert not file_tier.path_of(KEYS[1]).exists()  # the next coldest went instead


# -- S3 tier (the moto endpoint of tests/tiers) ------------------------------------------------
@pytest.fixture
def s3_tier(request: pytest.FixtureRequest, clock: ManualClock) -> Iterator[S3Tier]:
    from tests.tiers.s3_harness import BUCKET, fresh_prefix, shared_endpoint

    endpoint, prefix = shared_endpoint(request.config), fresh_prefix()

    def make(capacity: int) -> S3Tier:
        return S3Tier(bucket=BUCKET, prefix=prefix, endpoint_url=endpoint, clock=clock,
                      capacity_bytes=capacity, max_attempts=2, touch_interval=0.0)

    writer = make(1 << 30)
    size = _write_keys(writer, clock)
    writer.close()
    tier = make(size * 5 // 2)
    assert tier.usage().objects == len(KEYS)
    yield tier
    tier.close()


def _by_collector(*_: Any, **__: Any) -> bool:
    return threading.current_thread().name == COLLECTOR


def _gate_s3(tier: S3Tier, call: str, monkeypatch: pytest.MonkeyPatch) -> Gate:
    """Block the collector's HEAD of KEYS[0] (the first HEAD of a batch runs on the calling
    thread) or its DELETE (a batch, or one per object where the endpoint ignores the
    batch's per-object ETag, as moto does: ``S3Tier.conditionals``)."""
    if call == "head":
        gate = Gate(collector_on(tier.object_name(KEYS[0])))
        monkeypatch.setattr(tier.io, "head", gate.wrap(tier.io.head))
    else:
        gate = Gate(_by_collector)
        client = tier.io.client
        op = "delete_objects" if tier.conditionals.batch_delete_etag else "delete_object"
        monkeypatch.setattr(client, op, gate.wrap(getattr(client, op)))
    return gate


@pytest.mark.parametrize("action", ["collect", "expire"])
@pytest.mark.parametrize("call", ["head", "delete"])
def test_a_blocked_s3_collector_holds_up_no_lookup_read_or_write(
    s3_tier: S3Tier, monkeypatch: pytest.MonkeyPatch, pool: ThreadPoolExecutor,
    action: str, call: str,
) -> None:
    gate = _gate_s3(s3_tier, call, monkeypatch)
    done = run_collector(s3_tier, action)
    try:
        gate.wait_entered()
        answers_while_blocked(pool, s3_tier)
        assert not done.done()
    finally:
        gate.open()
    assert done.result(timeout=SAFETY_S) > 0
    assert s3_tier.contains_prefix([KEYS[0]]) == 0
    assert s3_tier.contains_prefix([NEW, KEYS[3]]) == 2


@pytest.mark.parametrize("action", ["collect", "expire"])
def test_an_s3_victim_this_node_reads_during_its_head_is_kept(
    s3_tier: S3Tier, monkeypatch: pytest.MonkeyPatch, pool: ThreadPoolExecutor,
    clock: ManualClock, action: str,
) -> None:
    """The collector's HEAD saw the old stamp; this node then read the object (a hit
    restamps it): the object is kept, and so is its index entry."""
    victim = KEYS[0]
    gate = Gate(collector_on(s3_tier.object_name(victim)), when="after")
    monkeypatch.setattr(s3_tier.io, "head", gate.wrap(s3_tier.io.head))
    done = run_collector(s3_tier, action)
    try:
        gate.wait_entered()
        clock.advance(1.0)
        dst = memoryview(bytearray(PAYLOAD))
        assert prompt(pool, lambda: s3_tier.get_into(victim, dst, expect=SPEC)) is not None
        assert not done.done()
    finally:
        gate.open()
    done.result(timeout=SAFETY_S)
    assert victim in {info.key for info in s3_tier.scan()}
    dst = memoryview(bytearray(PAYLOAD))
    assert s3_tier.get_into(victim, dst, expect=SPEC) is not None
