"""KV events for what a single-group model stores besides whole chunks: partial tails and
a sliding-window model's window parts, through the scheduler side's real finish path
(``request_finished``: note, reserve, the worker's copies reported done, committed and
written through), with vLLM's own ``Request`` and block hasher.

A conversation that grows stores a tail, then the whole chunk over it (the tail is
superseded: dropped from the host): the blocks the two share are published once and
never removed while one of them holds them. A window model's windows of nearby ends
overlap likewise.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from vllm.distributed.kv_events import BlockRemoved, BlockStored
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import (
    get_request_block_hasher,
    init_none_hash,
    maybe_convert_block_hash,
)
from vllm.v1.request import Request

from kvtier.build import build_store
from kvtier.clock import ManualClock
from kvtier.config import KVTierConfig
from kvtier.keys import Namespace
from kvtier.vllm.events import KVEvents
from kvtier.vllm.eventsetup import engine_waker, events_for
from kvtier.vllm.geometry import Geometry
from kvtier.vllm.scheduler_side import SchedulerSide

BS, BPC = 16, 4
CT = BS * BPC
W = 40  # a window model's hit needs its last cdiv(39, 16) = 3 blocks
LEASE = 100.0
init_none_hash(sha256)
HASHER = get_request_block_hasher(BS, sha256)


def _geom(window: int) -> Geometry:
    return Geometry(2, 2, 8, BS, 1024, "float32", window=window)


def _ns(window: int) -> Namespace:
    ns = Namespace(model="m", model_fingerprint="0" * 16, kv_dtype="float32",
                   kv_layout="NHD", num_layers=2, num_kv_heads=2, head_size=8,
                   chunk_tokens=CT, block_size=BS)
    return replace(ns, attention=f"sliding_window:{window}") if window else ns


def _env(tmp_path: Path, window: int) -> tuple[SchedulerSide, KVEvents, ManualClock]:
    cfg = KVTierConfig.model_validate({
        "chunk_tokens": CT,
        "tiers": [{"host": {"capacity": "1MiB", "pinned": "no"}},
                  {"file": {"path": str(tmp_path), "capacity": "1GiB", "write": "through",
                            "touch_interval": 0}}],
        "retention": {"lease_seconds": LEASE},
        "restore": {"recompute_threshold_tokens": 1},
    })
    clock = ManualClock()
    geom = _geom(window)
    sched = SchedulerSide(cfg, geom, _ns(window), None,
                          store=build_store(cfg, geom.chunk_bytes(CT), clock=clock),
                          clock=clock)
    ev = events_for(sched, None)
    sched.on_pieces = ev.note_pieces  # as the connector does
    return sched, ev, clock


@pytest.fixture
def env(tmp_path: Path) -> Iterator[tuple[SchedulerSide, KVEvents, ManualClock]]:
    sched, ev, clock = _env(tmp_path, 0)
    yield sched, ev, clock
    sched.close()


@pytest.fixture
def wenv(tmp_path: Path) -> Iterator[tuple[SchedulerSide, KVEvents, ManualClock]]:
    sched, ev, clock = _env(tmp_path, W)
    yield sched, ev, clock
    sched.close()


BASE = [int(x) for x in np.random.default_rng(3535).integers(3, 500, 4 * CT)]


def request(rid: str, n_tokens: int) -> Request:
    return Request(rid, BASE[:n_tokens], SamplingParams(max_tokens=1), None,
                   block_hasher=HASHER)


def finish(sched: SchedulerSide, ev: KVEvents, req: Request, window: int = 0) -> None:
    """What vLLM and the connector do when ``req`` finishes (every token but the last
    computed): note its chunks, ``request_finished`` with its block table (a window
    model's: the null block below its window), the worker's copies done, written
    through."""
    req.num_computed_tokens = req.num_tokens - 1
    ev.note(req, sched.chunk_keys(req))
    total = -(-req.num_tokens // BS)
    skipped = max(0, req.num_computed_tokens - window + 1) // BS if window else 0
    delay, _ = sched.request_finished(req, [0 if i < skipped else 100 + i
                                            for i in range(total)])
    assert delay
    sched.build_meta()
    sched.on_worker_output({req.request_id}, None)
    assert sched.store.flush(10)


def hashes(req: Request, lo: int, hi: int) -> list[Any]:
    return [maybe_convert_block_hash(h) for h in req.block_hashes[lo:hi]]


def named(events: list[Any], cls: type[Any], medium: str) -> list[Any]:
    """Every block hash ``cls`` events of ``medium`` name, in order."""
    return [h for e in events if isinstance(e, cls) and e.medium == medium
            for h in e.block_hashes]


def test_a_tail_is_published_and_the_chunk_over_it_adds_only_its_new_blocks(env: Any) -> None:
    sched, ev, clock = env
    first = request("a", CT + 2 * BS + 1)  # a chunk and a 2-block tail (blocks 4, 5)
    finish(sched, ev, first)
    out = ev.take()
    assert named(out, BlockStored, "CPU") == hashes(first, 0, 6)
    assert sorted(named(out, BlockStored, "STORAGE")) == sorted(hashes(first, 0, 6))
    tail = [e for e in out if isinstance(e, BlockStored) and e.medium == "CPU"][-1]
    assert tail.block_hashes == hashes(first, 4, 6)
    assert tail.parent_block_hash == hashes(first, 3, 4)[0]
    assert tail.token_ids == BASE[CT : CT + 2 * BS]

    # the next turn stores chunk 1 whole (superseding the tail: dropped from the host)
    # and a 3-block tail of chunk 2: only blocks 6.. are new; blocks 4, 5 stay held
    turn = request("b", 2 * CT + 3 * BS + 1)
    finish(sched, ev, turn)
    out = ev.take()
    assert named(out, BlockStored, "CPU") == hashes(turn, 6, 11)
    assert sorted(named(out, BlockStored, "STORAGE")) == sorted(hashes(turn, 6, 11))
    chunk = next(e for e in out if isinstance(e, BlockStored) and e.medium == "CPU")
    assert chunk.parent_block_hash == hashes(turn, 5, 6)[0]  # self-contained
    assert chunk.token_ids == BASE[6 * BS : 2 * CT]
    assert not named(out, BlockRemoved, "CPU")  # the dropped tail's blocks are chunk 1's

    # the lease passes: every object expires; each block is removed exactly once
    clock.advance(LEASE + 120)
    assert sched.store.lower[0].tier.expire(LEASE, whole_pass=True) == 4
    gone = named(ev.take(), BlockRemoved, "STORAGE")
    assert sorted(gone) == sorted(hashes(turn, 0, 11))


def test_a_window_models_overlapping_windows_are_published_once(wenv: Any) -> None:
    sched, ev, _ = wenv
    first = request("a", 2 * CT + 3 * BS + 1)  # 11 blocks: the window is blocks 8..10
    finish(sched, ev, first, W)
    out = ev.take()
    assert named(out, BlockStored, "CPU") == hashes(first, 8, 11)
    (window,) = [e for e in out if isinstance(e, BlockStored) and e.medium == "CPU"]
    assert window.parent_block_hash == hashes(first, 7, 8)[0]
    assert window.token_ids == BASE[8 * BS : 11 * BS]
    # one block more: its window (blocks 9..11) shares two blocks with the first
    turn = request("b", 3 * CT + 1)
    finish(sched, ev, turn, W)
    out = ev.take()
    assert named(out, BlockStored, "CPU") == hashes(turn, 11, 12)
    assert not named(out, BlockRemoved, "CPU")
    # the host drops both windows: each block is removed once, when its last copy goes
    assert sched.store.drop_host() == 2
    assert sorted(named(ev.take(), BlockRemoved, "CPU")) == sorted(hashes(turn, 8, 12))


# -- an idle engine is woken when an event is observed --------------------------------------
class EngineCoreStandIn:
    """Where vLLM's ``EngineCoreProc.__init__`` builds its scheduler (and with it the
    connector): ``input_queue`` is set, and the connector is built below it."""

    def __init__(self, events: KVEvents) -> None:
        import queue

        self.input_queue: queue.Queue[Any] = queue.Queue()
        self.waker = engine_waker()
        events.wake = self.waker


def test_an_observation_wakes_an_idle_engine_once_until_taken(env: Any) -> None:
    from vllm.v1.engine import EngineCoreRequestType

    sched, ev, _ = env
    assert engine_waker() is None  # no engine core on the stack: nothing to wake
    engine = EngineCoreStandIn(ev)
    assert engine.waker is not None
    req = request("i", CT + 1)
    finish(sched, ev, req)  # the host commit, then the write below (an IO thread)
    # vLLM's no-op request, once: the loop wakes, steps, and ``take`` drains the queue
    assert engine.input_queue.get_nowait() == (EngineCoreRequestType.WAKEUP, None)
    assert engine.input_queue.empty() and ev.pending()
    assert named(ev.take(), BlockStored, "STORAGE") == hashes(req, 0, BPC)
    # an expiry noticed later (another thread's walk) wakes it again
    assert sched.store.lower[0].tier.expire(-1.0, whole_pass=True) == 1
    assert engine.input_queue.get_nowait() == (EngineCoreRequestType.WAKEUP, None)
    assert named(ev.take(), BlockRemoved, "STORAGE") == hashes(req, 0, BPC)
