"""Tensor parallel without an engine: two ranks' workers, one shared host pool, and vLLM's
own ``KVOutputAggregator`` between them and the scheduler side.

Each rank registers its own KV caches (its share of the heads) and copies only its part
of every slot; a slot holds rank 0's bytes, then rank 1's. vLLM folds the ranks' outputs
into one per step; nothing may be committed or released before both ranks have reported.
Copies complete when the test opens them (``Gated``); no sleeps.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

from kvtier import metrics
from kvtier.config import KVTierConfig
from kvtier.keys import Namespace
from kvtier.ops import resolve_copy_backend
from kvtier.tiers.base import TierError
from kvtier.vllm.geometry import Geometry
from kvtier.vllm.scheduler_side import SchedulerSide
from kvtier.vllm.worker_side import WorkerSide
from tests.vllm.hooks import Blocks, ask
from tests.vllm.test_worker_async import (
    BS,
    CT,
    HEAD,
    HEADS,
    LAYERS,
    NB,
    Gated,
    GatedBatch,
    step,
)

WORLD = 2
GEOM = Geometry(len(LAYERS), HEADS, HEAD, BS, HEADS * BS * 2 * HEAD * 4, "float32",
                tp_world=WORLD)
CFG = KVTierConfig.model_validate({
    "chunk_tokens": CT, "tiers": [{"host": {"capacity": "64KiB", "pinned": "no"}}],
    "restore": {"recompute_threshold_tokens": 1},
})
NS = Namespace(model="m", model_fingerprint="0" * 16, kv_dtype="float32", kv_layout="NHD",
               num_layers=len(LAYERS), num_kv_heads=HEADS, head_size=HEAD, chunk_tokens=CT,
               block_size=BS, tp_world_size=WORLD)
TOKENS = list(range(3, 3 + 2 * CT + 5))  # two full chunks and a partial one
SAVED_BLOCKS = list(range(8))  # chunk 0 in blocks 0-3, chunk 1 in blocks 4-7
LOAD_BLOCKS = list(range(10, 18))


class FailingBatch(GatedBatch):
    def gather(self, layers: Any, ids: torch.Tensor, dst: torch.Tensor) -> None:
        raise RuntimeError("rank 1's copy engine failed")


class FailingGated(Gated):
    def batch(self, device: torch.device) -> GatedBatch:
        return FailingBatch(self, self.real.batch(device))


@dataclass
class Rank:
    worker: WorkerSide
    gated: Gated
    kv: dict[str, torch.Tensor]


class Engine:
    """A scheduler side and two ranks' workers over one pool, joined by vLLM's aggregator."""

    def __init__(self, tmp_path: Path, *, failing_rank: int | None = None) -> None:
        pool = tmp_path / "pool"
        self.ranks: list[Rank] = []
        for r in range(WORLD):  # rank 0 creates the pool before rank 1 attaches
            gated = FailingGated(resolve_copy_backend("torch")) if r == failing_rank \
                else Gated(resolve_copy_backend("torch"))
            w = WorkerSide(CFG, GEOM, list(LAYERS), pool, batches=gated)
            gen = torch.Generator().manual_seed(100 + r)  # each rank: other heads, other KV
            kv = {n: torch.randn(NB, HEADS, BS, 2 * HEAD, generator=gen) for n in LAYERS}
            w.register(kv, CPUAttentionBackend, KVCacheLayout.LBHNC, NB, tp_rank=r)
            self.ranks.append(Rank(w, gated, kv))
        assert pool.exists(), "the scheduler attaches last and unlinks the name"
        self.sched = SchedulerSide(CFG, GEOM, NS, pool)
        assert not pool.exists()
        self.agg = KVOutputAggregator(WORLD)
        self.invalid: set[int] = set()

    def run_step(self, finished: set[str]) -> None:
        """One engine step on every rank, their outputs folded and given back."""
        meta = self.sched.build_meta()
        outs: list[ModelRunnerOutput | None] = []
        for rank in self.ranks:
            step(rank.worker, meta)
            self.report(rank, finished, outs)
        self.give_back(outs)

    def report(self, rank: Rank, finished: set[str],
               outs: list[ModelRunnerOutput | None]) -> None:
        sending, _ = rank.worker.get_finished(finished)
        kv_out = KVConnectorOutput(finished_sending=sending,
                                   kv_connector_worker_meta=rank.worker.worker_meta(),
                                   invalid_block_ids=rank.worker.load_errors())
        outs.append(ModelRunnerOutput(req_ids=[], req_id_to_index={},
                                      kv_connector_output=kv_out))

    def give_back(self, outs: list[ModelRunnerOutput | None]) -> None:
        out = self.agg.aggregate(outs)
        assert out is not None and out.kv_connector_output is not None
        kv = out.kv_connector_output
        self.invalid = kv.invalid_block_ids  # vLLM's union over ranks: it recomputes them
        self.sched.on_worker_output(kv.finished_sending, kv.kv_connector_worker_meta,
                                    failed_load_blocks=len(kv.invalid_block_ids))

    def poll(self) -> None:
        """An engine step with no new work: each rank reports what completed since."""
        self.run_step(set())

    def close(self) -> None:
        self.sched.close()
        for rank in self.ranks:
            rank.worker.close()


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[Engine]:
    e = Engine(tmp_path)
    yield e
    e.close()


def _request(rid: str) -> SimpleNamespace:
    return SimpleNamespace(request_id=rid, all_token_ids=TOKENS, num_tokens=len(TOKENS),
                           cache_salt=None, kv_transfer_params=None, lora_request=None,
                           mm_features=None, prompt_embeds=None,
                           num_computed_tokens=len(TOKENS))


def _save(e: Engine) -> None:
    """Request ``a`` finishes; its two chunks are saved; rank 1 completes later."""
    delay, _ = e.sched.request_finished(_request("a"), SAVED_BLOCKS)
    assert delay
    e.run_step({"a"})
    assert e.sched.has_pending_saves()  # both still copying
    e.ranks[0].gated.open_all()
    e.poll()
    assert e.sched.has_pending_saves(), "rank 1 is still copying: not committed"
    assert len(e.sched.store.host.index) == 0
    e.ranks[1].gated.open_all()
    e.poll()
    assert not e.sched.has_pending_saves()


def test_a_slot_holds_every_ranks_part_and_commits_only_after_both(engine: Engine) -> None:
    _save(engine)
    entries = engine.sched.store.host.index.entries()
    assert len(entries) == 2
    pool = engine.ranks[0].worker.host_pool
    assert pool is not None
    rank_bytes = engine.ranks[0].worker.rank_bytes
    for slot, meta in entries:
        assert meta.payload_len == WORLD * rank_bytes
        whole = pool.view(slot)
        parts = [whole[r * rank_bytes : (r + 1) * rank_bytes] for r in range(WORLD)]
        assert not np.array_equal(parts[0], parts[1]), "each rank wrote its own heads"
        for r, part in enumerate(parts):
            mine = engine.ranks[r].worker.copier.slot(slot)  # what rank r copies
            assert np.array_equal(part, mine.numpy())


def test_a_restore_loads_each_ranks_part_and_releases_after_both(engine: Engine) -> None:
    _save(engine)
    for rank in engine.ranks:
        rank.gated.handles.clear()
    req = _request("b")
    req.num_computed_tokens = 0
    assert ask(engine.sched, req) == 2 * CT
    engine.sched.update_state_after_alloc(req, Blocks(LOAD_BLOCKS), 2 * CT)
    engine.run_step(set())
    host = engine.sched.store.host.index
    held = host.num_held()
    assert held > 0, "the step's slots are held while ranks copy"
    engine.ranks[0].gated.open_all()
    engine.poll()
    assert host.num_held() == held, "rank 0 is done, rank 1 still reads the slots"
    engine.ranks[1].gated.open_all()
    engine.poll()
    assert host.num_held() == 0
    for rank in engine.ranks:
        for name in LAYERS:
            got = rank.kv[name][LOAD_BLOCKS]
            assert torch.equal(got, rank.kv[name][SAVED_BLOCKS]), "its own part, exactly"


def test_a_save_one_rank_failed_is_never_committed(tmp_path: Path) -> None:
    e = Engine(tmp_path, failing_rank=1)
    try:
        delay, _ = e.sched.request_finished(_request("a"), SAVED_BLOCKS)
        assert delay
        meta = e.sched.build_meta()
        outs: list[ModelRunnerOutput | None] = []
        for rank in e.ranks:
            step(rank.worker, meta)
        # rank 1 failed at once and reports it (with the id) in this step; rank 0 is
        # still copying, so vLLM reports the save finished only steps later
        e.report(e.ranks[0], {"a"}, outs)
        e.report(e.ranks[1], {"a"}, outs)
        e.give_back(outs)
        assert e.sched.has_pending_saves()
        e.ranks[0].gated.open_all()
        e.poll()
        assert not e.sched.has_pending_saves()
        assert len(e.sched.store.host.index) == 0, "nothing committed"
        assert e.sched.store.host.index.clean_or_free() == e.sched.store.host.index.num_slots
    finally:
        e.close()


def test_a_rank_outside_the_world_is_refused(tmp_path: Path) -> None:
    w = WorkerSide(CFG, GEOM, list(LAYERS), tmp_path / "pool")
    kv = {n: torch.zeros(NB, HEADS, BS, 2 * HEAD) for n in LAYERS}
    with pytest.raises(TierError, match="TP rank 2 outside a world of 2"):
        w.register(kv, CPUAttentionBackend, KVCacheLayout.LBHNC, NB, tp_rank=2)



# -- model shapes: what the geometry accepts ----------------------------------------------
def _config(spec: Any, groups: int = 1) -> Any:
    from vllm.v1.kv_cache_interface import KVCacheGroupSpec

    return SimpleNamespace(kv_cache_groups=[
        KVCacheGroupSpec([f"model.layers.{g}.attn"], spec) for g in range(groups)])


def test_full_attention_is_accepted_with_its_tp_world() -> None:
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from kvtier.vllm.geometry import geometry_from_kv_cache_config

    spec = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=64,
                             dtype=torch.float32, sliding_window=128)  # compute-only window
    g = geometry_from_kv_cache_config(_config(spec), tp_world=2)
    assert g.tp_world == 2
    assert g.chunk_bytes(32) == 2 * g.rank_chunk_bytes(32) == 2 * 2 * spec.page_size_bytes


def test_a_sliding_window_group_is_accepted_with_its_window() -> None:
    """All-sliding-window models store window objects (``window.py``): the geometry
    carries the window vLLM keeps, and the namespace says so (full attention's digest is
    unchanged)."""
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    from kvtier.vllm.geometry import geometry_from_kv_cache_config

    spec = SlidingWindowSpec(block_size=16, num_kv_heads=1, head_size=64,
                             dtype=torch.float32, sliding_window=64)
    g = geometry_from_kv_cache_config(_config(spec))
    assert g.window == 64 and g.window_blocks == 4  # cdiv(63, 16)


@pytest.mark.parametrize(("kind", "hint"), [
    ("chunked", "chunked-local"),
    ("sparse-mla", "sparse or padded"),
])
def test_other_kv_cache_specs_are_refused_with_what_to_do(kind: str, hint: str) -> None:
    from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec, MLAAttentionSpec

    from kvtier.vllm.geometry import geometry_from_kv_cache_config

    common: dict[str, Any] = {"block_size": 16, "num_kv_heads": 1, "head_size": 64,
                              "dtype": torch.float32}
    spec: Any
    if kind == "chunked":
        spec = ChunkedLocalAttentionSpec(**common, attention_chunk_size=64)
    else:
        spec = MLAAttentionSpec(**common, model_version="deepseek_v4")
    with pytest.raises(TierError, match=hint):
        geometry_from_kv_cache_config(_config(spec))


def test_dense_mla_is_one_copy_for_every_tp_size() -> None:
    """MLA's latent is the same on every rank: a chunk is one rank's bytes (rank 0 writes
    it, every rank reads it), and the namespace does not depend on the TP size, so engines
    of any TP size share the objects."""
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    from kvtier.vllm.geometry import PhysicalKV, geometry_from_kv_cache_config, namespace_for

    spec = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype=torch.float32)
    g1 = geometry_from_kv_cache_config(_config(spec), tp_world=1)
    g2 = geometry_from_kv_cache_config(_config(spec), tp_world=2)
    assert g2.replicated and g2.tp_world == 2 and g2.slot_ranks == 1
    assert g2.head_size_v == 0
    assert g2.chunk_bytes(32) == g2.rank_chunk_bytes(32) == g1.chunk_bytes(32)
    assert g1.chunk_bytes(32) == 2 * spec.page_size_bytes
    phys = PhysicalKV("CPU_MLA;shape=*,16,576", "auto", "none")

    def ns(tp: int, g: Any) -> bytes:
        cfg = SimpleNamespace(
            model_config=SimpleNamespace(model="m", quantization=None, dtype=torch.float32),
            parallel_config=SimpleNamespace(tensor_parallel_size=tp, rank=tp - 1))
        return namespace_for(cfg, g, 32, physical=phys, fingerprint="f").digest()

    assert ns(1, g1) == ns(2, g2)


def test_pipeline_and_context_parallel_are_refused_naming_the_flag() -> None:
    from kvtier.vllm.connector import check_parallel_config

    check_parallel_config(SimpleNamespace(tensor_parallel_size=4, pipeline_parallel_size=1))
    with pytest.raises(TierError, match="--pipeline-parallel-size 1"):
        check_parallel_config(SimpleNamespace(pipeline_parallel_size=2))
    with pytest.raises(TierError, match="--decode-context-parallel-size 1"):
        check_parallel_config(SimpleNamespace(decode_context_parallel_size=2))


class FailingScatterBatch(GatedBatch):
    def scatter(self, src: torch.Tensor, layers: Any, ids: torch.Tensor) -> None:
        raise RuntimeError("rank 1's load failed")


def test_a_load_one_rank_failed_is_reported_and_its_slots_released_once(
    tmp_path: Path,
) -> None:
    e = Engine(tmp_path)
    try:
        _save(e)
        e.ranks[1].gated.batch = (  # type: ignore[method-assign]
            lambda device: FailingScatterBatch(e.ranks[1].gated,
                                               e.ranks[1].gated.real.batch(device)))
        req = _request("b")
        req.num_computed_tokens = 0
        assert ask(e.sched, req) == 2 * CT
        e.sched.update_state_after_alloc(req, Blocks(LOAD_BLOCKS), 2 * CT)
        export = metrics.enable_export()
        export.drain()
        try:
            e.run_step(set())
            assert e.invalid == set(LOAD_BLOCKS), "rank 1's errors reach vLLM: recomputed"
            assert metrics.drain_export()["kvtier_worker_failed_load_blocks_total"] == {
                "": len(LOAD_BLOCKS)}, "counted once, whichever rank failed"
        finally:
            metrics.disable_export()
        e.ranks[1].gated.open_all()  # rank 1 is done (failed); rank 0 is still copying
        e.poll()
        assert e.sched.store.host.index.num_held() > 0
        e.ranks[0].gated.open_all()
        e.poll()
        e.poll()  # nothing is released twice
        assert e.sched.store.host.index.num_held() == 0
    finally:
        e.close()
