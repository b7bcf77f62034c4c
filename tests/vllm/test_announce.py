"""P/D: a prefill node announces only chunks that are stored or will be (issue 10).

A decode node waits ``wait_seconds`` for every announced chunk, so a chunk that gets no
host slot, or whose write-through the store queue cannot take, must not be announced.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from kvtier.build import build_store
from kvtier.config import KVTierConfig
from kvtier.keys import Namespace
from kvtier.vllm.geometry import Geometry
from kvtier.vllm.scheduler_side import SchedulerSide

CT = 128
GEOM = Geometry(2, 2, 64, CT, 4096, "float32")
NS = Namespace(model="m", model_fingerprint="0" * 16, kv_dtype="float32", kv_layout="NHD",
               num_layers=2, num_kv_heads=2, head_size=64, chunk_tokens=CT, block_size=CT)
SLOT = GEOM.chunk_bytes(CT)


def _sched(tmp: Path, host_slots: int, queue: int) -> SchedulerSide:
    cfg = KVTierConfig.model_validate({
        "chunk_tokens": CT,
        "tiers": [{"host": {"capacity": host_slots * SLOT, "pinned": "no"}},
                  {"file": {"path": str(tmp), "capacity": "1GiB", "write": "through"}}],
        "io": {"threads": 1, "max_queued_stores": queue},
    })
    return SchedulerSide(cfg, GEOM, NS, None, store=build_store(cfg, SLOT), role="prefill")


@pytest.fixture
def held_io() -> Iterator[list[threading.Event]]:
    gates: list[threading.Event] = []
    yield gates
    for g in gates:
        g.set()


def _finish(sched: SchedulerSide, rid: str, n_chunks: int) -> dict[str, Any]:
    toks = list(range(1, n_chunks * CT + 11))
    req = SimpleNamespace(request_id=rid, all_token_ids=toks, num_tokens=len(toks),
                          num_computed_tokens=len(toks), kv_transfer_params=None,
                          cache_salt=None, lora_request=None, mm_features=None,
                          prompt_embeds=None)
    _, params = sched.request_finished(req, list(range(n_chunks)))
    out: dict[str, Any] = params["kvtier"]
    return out


def test_chunks_without_a_host_slot_are_not_announced(tmp_path: Path) -> None:
    sched = _sched(tmp_path, host_slots=2, queue=64)
    try:
        params = _finish(sched, "r", 4)
        assert params["tokens"] == 2 * CT
        assert len(sched.build_meta().saves) == 2, "no copy past the first missing chunk"
    finally:
        sched.close()


def test_write_throughs_the_store_queue_cannot_take_are_not_announced(
    tmp_path: Path, held_io: list[threading.Event]
) -> None:
    sched = _sched(tmp_path, host_slots=8, queue=2)
    try:
        gate, started = threading.Event(), threading.Event()
        held_io.append(gate)

        def hold() -> None:
            started.set()
            gate.wait(30)

        sched.store.io.submit_load(hold)  # the only IO thread is busy: stores queue up
        assert started.wait(10)
        sched.store.io.submit_store(lambda: None)  # one queue slot of two is taken
        params = _finish(sched, "r", 4)
        assert params["tokens"] == 1 * CT
    finally:
        held_io[0].set()
        sched.close()


def test_role_both_announces_every_chunk_it_copies(tmp_path: Path) -> None:
    cfg = KVTierConfig.model_validate({
        "chunk_tokens": CT, "tiers": [{"host": {"capacity": 8 * SLOT, "pinned": "no"}}]})
    sched = SchedulerSide(cfg, GEOM, NS, None, store=build_store(cfg, SLOT))
    try:
        assert _finish(sched, "r", 4)["tokens"] == 4 * CT
    finally:
        sched.close()
