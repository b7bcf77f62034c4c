"""A swarm: requests that share a new prefix and finish in the same step (issue 17).

Each must store its own chunks, whatever the others' saves do, and a P/D announcement
must name only chunks that will exist even if another request's save of the shared
prefix fails. No engine: the scheduler side with a real store, the worker's reports
driven by hand (``on_worker_output``) in any order.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from kvtier.build import build_store
from kvtier.config import KVTierConfig
from kvtier.keys import ChunkKey, Namespace, chunk_keys
from kvtier.vllm.geometry import Geometry
from kvtier.vllm.protocol import KVTierWorkerMetadata
from kvtier.vllm.scheduler_side import SchedulerSide

CT = 128
GEOM = Geometry(2, 2, 64, CT, 4096, "float32")
NS = Namespace(model="m", model_fingerprint="0" * 16, kv_dtype="float32", kv_layout="NHD",
               num_layers=2, num_kv_heads=2, head_size=64, chunk_tokens=CT, block_size=CT)
SLOT = GEOM.chunk_bytes(CT)
SHARED = list(range(1, 2 * CT + 1))  # a new 2-chunk system prompt


def _sched(tmp: Path, role: str, host_slots: int = 64) -> SchedulerSide:
    tiers: list[dict[str, Any]] = [{"host": {"capacity": host_slots * SLOT, "pinned": "no"}}]
    if role != "both":
        tiers.append({"file": {"path": str(tmp), "capacity": "1GiB", "write": "through"}})
    cfg = KVTierConfig.model_validate({"chunk_tokens": CT, "tiers": tiers})
    return SchedulerSide(cfg, GEOM, NS, None, store=build_store(cfg, SLOT), role=role)


@pytest.fixture(params=["both", "prefill"])
def sched(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[SchedulerSide]:
    s = _sched(tmp_path, request.param)
    yield s
    s.close()


def _request(i: int) -> SimpleNamespace:
    own = [10_000 * (i + 1) + t for t in range(2 * CT + 40)]  # 2 own chunks + a tail
    toks = SHARED + own
    return SimpleNamespace(request_id=f"r{i}", all_token_ids=toks, num_tokens=len(toks),
                           num_computed_tokens=len(toks), kv_transfer_params=None,
                           cache_salt=None, lora_request=None, mm_features=None,
                           prompt_embeds=None)


def _keys(req: SimpleNamespace) -> list[ChunkKey]:
    return chunk_keys(NS.digest(), req.all_token_ids, CT)


def _finish_all(sched: SchedulerSide, n: int) -> tuple[list[SimpleNamespace], list[dict[str, Any]]]:
    reqs = [_request(i) for i in range(n)]
    params = []
    for i, r in enumerate(reqs):
        delay, p = sched.request_finished(r, list(range(100 * i, 100 * i + 5)))
        assert delay  # every request copies at least its own chunks
        params.append(p["kvtier"])
    return reqs, params


def test_every_request_of_a_swarm_stores_its_own_chunks(sched: SchedulerSide) -> None:
    reqs, params = _finish_all(sched, 4)
    meta = sched.build_meta()
    for r in reqs:  # each request copies its own chunks
        ops = [op for op in meta.saves if op.req_id == r.request_id]
        assert len(ops) >= 2
    order = [r.request_id for r in reqs]
    random.Random(3).shuffle(order)
    for rid in order:  # the worker reports them in any order, one per step
        sched.on_worker_output({rid}, None)
    for r, p in zip(reqs, params, strict=True):
        keys = _keys(r)
        assert sched.store.lookup_indexed(keys).hits == 4, r.request_id
        assert p["tokens"] == 4 * CT and p["last_key"] == keys[3].hex()
    assert not sched.has_pending_saves()
    assert sched.store.flush(10)  # write-throughs hold their slots while they run
    assert sched.store.host.index.num_held() == 0


def test_a_failed_save_of_the_shared_prefix_costs_only_that_request(
    sched: SchedulerSide,
) -> None:
    reqs, params = _finish_all(sched, 4)
    sched.build_meta()
    # r0 reserved the shared chunks; its copy fails and is reported first.
    sched.on_worker_output({"r0"}, KVTierWorkerMetadata([], ["r0"]))
    for r in reqs[1:]:
        sched.on_worker_output({r.request_id}, None)
    shared_stored = sched.store.lookup_indexed(_keys(reqs[1])[:2]).hits
    if sched.role == "both":
        # no backups: the shared chunks are gone with r0's save, the others' own chunks
        # are stored (a hole costs a recompute, never a wrong chunk)
        assert shared_stored == 0
        for r in reqs[1:]:
            assert all(sched.store.holds(k) for k in _keys(r)[2:4])
    else:
        # P/D: r1 saved a backup of the shared chunks, so what it announced exists
        assert shared_stored == 2
        for r, p in zip(reqs[1:], params[1:], strict=True):
            assert sched.store.lookup_indexed(_keys(r)).hits * CT >= p["tokens"] == 4 * CT
    assert sched.store.flush(10)  # write-throughs hold their slots while they run
    assert sched.store.host.index.num_held() == 0
    assert sched.store.host.index.clean_or_free() > 0


def test_announcements_never_outrun_the_chain_when_backups_find_no_slot(tmp_path: Path) -> None:
    # 5 slots: r0 takes 4 (2 shared + 2 own); r1 finds the shared chunks pending and
    # one slot left: it backs up the first, cannot back up the second, so its
    # announcement ends after the first.
    sched = _sched(tmp_path, "prefill", host_slots=5)
    try:
        _, params = _finish_all(sched, 2)
        assert params[0]["tokens"] == 4 * CT
        assert params[1]["tokens"] == CT
    finally:
        sched.close()
