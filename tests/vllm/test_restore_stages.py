"""Where a restore waited: ``kvtier_restore_stage_seconds{stage}`` from the scheduler side.

Requests are plain records with the attributes of vLLM's ``Request`` that the scheduler
side reads; the store is real (a small host pool and a write-back file tier); the worker's
part is the ``finished_sending`` report. Time in the stages is wall time (perf_counter),
so the tests check which stages a restore passed through, not how long each took.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtier import metrics as m
from kvtier.keys import Namespace
from kvtier.vllm.geometry import Geometry
from kvtier.vllm.scheduler_side import SchedulerSide
from tests.vllm.hooks import Blocks, ask, request_record, small_pool_sched

BS, BPC = 16, 4
CT = BS * BPC
GEOM = Geometry(2, 2, 8, BS, 1024, "float32")
NS = Namespace(model="m", model_fingerprint="0" * 16, kv_dtype="float32", kv_layout="NHD",
               num_layers=2, num_kv_heads=2, head_size=8, chunk_tokens=CT, block_size=BS)
SLOTS = 8  # the staging cap is half: 4 chunks



@pytest.fixture
def sched(tmp_path: Path) -> Iterator[SchedulerSide]:
    s = small_pool_sched(tmp_path, GEOM, NS, CT, SLOTS)
    yield s
    s.close()


def _conversation(seed: int, chunks: int = 3) -> list[int]:
    return [3 + (seed * 131 + i * 7) % 400 for i in range(chunks * CT + 5)]


def _saved_below(sched: SchedulerSide, tokens: list[int], rid: str) -> None:
    """``tokens`` finish as request ``rid``; their chunks are written to the file tier and
    dropped from the host pool, so a return restores them from the file tier."""
    req = request_record(rid, tokens)
    sched.request_finished(req, list(range(-(-len(tokens) // BS))))
    sched.build_meta()
    sched.on_worker_output({rid}, None)
    assert sched.store.flush_dirty(10.0).left == 0 and sched.store.flush(10.0)
    sched.store.host.delete([meta.key for _, meta in sched.store.host.index.entries()])


def _stages(batch: m.StatsBatch) -> dict[str, list[float]]:
    out: dict[str, list[float]] = batch.drain().get(m.RESTORE_STAGE_SECONDS.name, {})
    return out


def test_a_restore_from_the_file_tier_reports_its_queue_read_and_staged_time(
        sched: SchedulerSide, export: m.StatsBatch) -> None:
    tokens = _conversation(1)
    _saved_below(sched, tokens, "a")
    export.drain()
    assert ask(sched, request_record("a2", [*tokens, 9, 9], computed=0)) == 3 * CT
    stages = _stages(export)
    assert set(stages) == {"queue", "read", "staged"}  # nobody else wrote its slots
    assert all(len(v) == 1 and v[0] >= 0 for v in stages.values())
    assert stages["read"][0] <= stages["staged"][0]


def test_a_restore_that_waited_for_the_staging_cap_reports_it(
        sched: SchedulerSide, export: m.StatsBatch) -> None:
    first, second = _conversation(1, chunks=4), _conversation(2)
    _saved_below(sched, first, "a")
    _saved_below(sched, second, "b")
    a = request_record("a2", [*first, 9], computed=0)
    b = request_record("b2", [*second, 9], computed=0)
    assert ask(sched, a) == 4 * CT  # staged: the cap's 4 chunks, not admitted yet
    export.drain()
    assert ask(sched, b) is None  # no room (not even to stream) until a is admitted
    sched.update_state_after_alloc(a, Blocks(list(range(5))), 4 * CT)
    assert ask(sched, b) == 3 * CT
    stages = _stages(export)
    assert len(stages["cap"]) == 1 and stages["cap"][0] > 0


def test_stages_are_named_and_the_worker_copy_is_one() -> None:
    batch = m.enable_export()
    batch.drain()
    try:
        m.record_restore_stages({"read": 0.01, "queue": 0.0})
        m.record_worker_step(4, 0, 0.002)  # a step that loaded: a restore's copy
        m.record_worker_step(0, 4, 0.003)  # saves only: not a restore
        with pytest.raises(ValueError, match="unknown restore stage"):
            m.record_restore_stages({"nap": 1.0})
        assert batch.drain()[m.RESTORE_STAGE_SECONDS.name] == {
            "read": [0.01], "queue": [0.0], "copy": [0.002]}
    finally:
        m.disable_export()

