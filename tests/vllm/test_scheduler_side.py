"""The scheduler side's P/D decisions, without an engine: what a decode node waits for.

A request here is a plain record with the attributes of vLLM's ``Request`` that the
scheduler side reads. The store is real (host pool + a shared file tier); the "prefill
node" writes into the same directory through its own ``FileTier``. Time is a ManualClock.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from kvtier.build import build_store
from kvtier.clock import ManualClock
from kvtier.config import KVTierConfig
from kvtier.keys import ChunkKey, Namespace, chunk_keys
from kvtier.tiers.file import FileTier
from kvtier.tiers.pool import HostPool
from kvtier.vllm.geometry import Geometry
from kvtier.vllm.scheduler_side import SchedulerSide
from tests.vllm.hooks import Blocks, ask

CT = 128
WAIT = 5.0
GEOM = Geometry(2, 2, 64, CT, 4096, "float32")
NS = Namespace(model="m", model_fingerprint="0" * 16, kv_dtype="float32", kv_layout="NHD",
               num_layers=2, num_kv_heads=2, head_size=64, chunk_tokens=CT, block_size=CT)
TOKENS = list(range(1, 4 * CT + 40))  # 4 full chunks and a partial one


@pytest.fixture
def env(tmp_path: Path) -> Iterator[tuple[SchedulerSide, FileTier, ManualClock]]:
    cfg = KVTierConfig.model_validate({
        "chunk_tokens": CT,
        "tiers": [{"host": {"capacity": "1MiB", "pinned": "no"}},
                  {"file": {"path": str(tmp_path), "capacity": "1GiB", "write": "through"}}],
        "restore": {"recompute_threshold_tokens": 64, "wait_seconds": WAIT},
    })
    clock = ManualClock()
    slot = GEOM.chunk_bytes(CT)
    sched = SchedulerSide(cfg, GEOM, NS, None, store=build_store(cfg, slot), role="decode",
                          clock=clock)
    prefill_node = FileTier(tmp_path, 1 << 30)
    yield sched, prefill_node, clock
    sched.close()


def _request(rid: str, expect: dict[str, Any] | None = None, **kvtier: Any) -> SimpleNamespace:
    params = {"kvtier": {**kvtier, **({"expect": expect} if expect else {})}}
    return SimpleNamespace(request_id=rid, num_tokens=len(TOKENS), all_token_ids=TOKENS,
                           kv_transfer_params=params, cache_salt=None)


def _keys() -> list[ChunkKey]:
    return chunk_keys(NS.digest(), TOKENS, CT)


def _prefill_writes(sched: SchedulerSide, tier: FileTier, n: int) -> None:
    keys = _keys()
    for c in range(n):
        tier.put(sched._meta(NS.digest(), keys, c), np.zeros(sched.slot_bytes, np.uint8).data)


def test_decode_waits_for_announced_chunks_then_loads_them(env: Any) -> None:
    sched, prefill_node, _ = env
    req = _request("r1", {"tokens": 4 * CT, "last_key": _keys()[3].hex()})
    assert ask(sched, req) is None  # nothing visible yet: ask again
    _prefill_writes(sched, prefill_node, 2)
    assert ask(sched, req) is None  # half of it: still waiting
    _prefill_writes(sched, prefill_node, 4)
    assert ask(sched, req) == 4 * CT


def test_decode_stops_waiting_at_the_deadline_and_takes_what_is_there(env: Any) -> None:
    sched, prefill_node, clock = env
    req = _request("r2", {"tokens": 4 * CT, "last_key": _keys()[3].hex()})
    _prefill_writes(sched, prefill_node, 2)
    assert ask(sched, req) is None
    clock.advance(WAIT + 1)
    assert ask(sched, req) == 2 * CT


def test_an_announcement_for_another_prompt_is_not_waited_for(env: Any) -> None:
    sched, _, _ = env
    req = _request("r3", {"tokens": 4 * CT, "last_key": "ab" * 16})
    assert ask(sched, req) == 0


def test_load_false_never_restores(env: Any) -> None:
    sched, prefill_node, _ = env
    _prefill_writes(sched, prefill_node, 4)
    assert ask(sched, _request("r4", load=False)) == 0
    assert ask(sched, _request("r5")) == 4 * CT


def test_a_finished_request_offers_host_chunks_the_shared_tier_lost(env: Any) -> None:
    sched, other_node, clock = env
    sched.store.host.clock = clock  # when chunks were last written or offered
    keys = _keys()
    for c in range(4):
        sched.store.put(sched._meta(NS.digest(), keys, c), np.zeros(sched.slot_bytes, np.uint8))
    sched.store.flush()
    clock.advance(sched.lease_s)  # the lease passes ...
    assert other_node.delete(keys[:4]) == 4  # ... and its collector removes them
    req = _request("r6")
    req.num_computed_tokens = 4 * CT
    delay, params = sched.request_finished(req, list(range(4)))
    assert not delay  # all four are in the host tier: nothing to copy from vLLM's blocks
    assert params["kvtier"]["tokens"] == 4 * CT
    sched.store.flush()
    assert other_node.contains_prefix(keys[:4]) == 4  # written through again from host


def test_the_scheduler_indexes_the_pool_the_worker_created(tmp_path: Path) -> None:
    """Both sides cut one shared file into the same slots: what the worker saves into a
    slot the scheduler reserved by key is what a later request's load order points at."""
    cfg = KVTierConfig.model_validate({
        "chunk_tokens": CT, "tiers": [{"host": {"capacity": "1MiB", "pinned": "no"}}],
        "restore": {"recompute_threshold_tokens": 64},
    })
    slot = GEOM.chunk_bytes(CT)
    path = tmp_path / "pool"
    worker = HostPool.create_shm(path, slot, HostPool.slots_for(cfg.host.capacity, slot),
                                 pinned="no")
    sched = SchedulerSide(cfg, GEOM, NS, path)
    try:
        assert not path.exists(), "the scheduler unlinked the name once mapped"
        assert sched.store.host.pool.num_slots == worker.num_slots
        first = _request("first")
        first.num_computed_tokens = len(TOKENS)
        delay, params = sched.request_finished(first, list(range(5)))
        assert delay and params["kvtier"]["tokens"] == 4 * CT
        saves = sched.build_meta().saves
        for op in saves:  # the worker's gather into the reserved slots
            worker.view(op.slot)[:] = op.block_ids[0] + 1
        sched.on_worker_output({"first"}, None)  # committed with each chunk's real meta
        again = _request("again")
        assert ask(sched, again) == 4 * CT
        sched.update_state_after_alloc(again, Blocks(list(range(10, 15))), 4 * CT)
        loads = sched.build_meta().loads
        assert [op.slot for op in loads] == [op.slot for op in saves]
        for c, op in enumerate(loads):  # the bytes the worker wrote, seen by the scheduler
            assert np.all(sched.store.host.view(op.slot) == c + 1)
    finally:
        sched.close()
