"""The worker's copy protocol: layer-wise loads and saves that never block a step.

``WorkerSide`` is driven as vLLM's model thread drives the connector each step
(``start_load_kv`` -> ``wait_for_layer_load`` per attention layer -> ``wait_for_save`` ->
``get_finished`` -> ``build_connector_worker_meta``), over small CPU KV caches in vLLM's
CPU layout (``CPUAttentionBackend``, ``LBHNC``). Where a test needs a copy that is still
running (what a CUDA copy stream gives), ``Gated`` batches move the bytes at once but
hand out handles that complete only when the test opens them; their ``wait`` fails, so a
hook that blocked on one would fail the test instead of hanging it. No sleeps.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from vllm.config import CUDAGraphMode
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
from vllm.v1.kv_cache_layout import KVCacheLayout

from kvtier.build import build_store
from kvtier.config import KVTierConfig
from kvtier.keys import Namespace
from kvtier.ops import CopyBackend, native_status, resolve_copy_backend
from kvtier.ops.stepcopy import Batch, Issue
from kvtier.vllm.geometry import Geometry
from kvtier.vllm.protocol import CopyOp, KVTierMetadata, KVTierWorkerMetadata
from kvtier.vllm.scheduler_side import SchedulerSide
from kvtier.vllm.worker_side import WorkerSide, forward_runs_layer_by_layer

LAYERS = ["model.layers.0.attn", "model.layers.1.attn", "model.layers.2.attn"]
HEADS, HEAD, BS, CT, NB = 2, 8, 4, 16, 24  # 4 blocks per chunk, 24 blocks per layer
GEOM = Geometry(len(LAYERS), HEADS, HEAD, BS, HEADS * BS * 2 * HEAD * 4, "float32")
CFG = {"chunk_tokens": CT, "tiers": [{"host": {"capacity": "64KiB", "pinned": "no"}}]}


class GatedHandle:
    """A copy that completes when the test opens it."""

    def __init__(self) -> None:
        self.is_open = False
        self.stream_waits = 0  # how often later work was ordered after it

    def done(self) -> bool:
        return self.is_open

    def wait(self) -> None:
        raise AssertionError("a hook blocked on a copy")

    def stream_wait(self) -> None:
        self.stream_waits += 1


class GatedBatch:
    def __init__(self, owner: Gated, real: Batch) -> None:
        self.owner, self.real = owner, real

    def gather(self, layers: Sequence[torch.Tensor], ids: torch.Tensor,
               dst: torch.Tensor) -> None:
        self.real.gather(layers, ids, dst)

    def scatter(self, src: torch.Tensor, layers: Sequence[torch.Tensor],
                ids: torch.Tensor) -> None:
        self.real.scatter(src, layers, ids)

    def mark(self) -> GatedHandle:
        handle = GatedHandle()
        self.owner.handles.append(handle)
        return handle


class Gated:
    """Batches over a real backend whose handles the test completes."""

    def __init__(self, real: CopyBackend) -> None:
        self.real = real
        self.handles: list[GatedHandle] = []

    def batch(self, device: torch.device) -> GatedBatch:
        return GatedBatch(self, self.real.batch(device))

    def open_all(self) -> None:
        for h in self.handles:
            h.is_open = True


def _backends() -> list[str]:
    return ["torch", "native"] if native_status().available else ["torch"]


@pytest.fixture(params=_backends())
def backend_name(request: pytest.FixtureRequest) -> str:
    return str(request.param)


#: Each worker's KV caches (the tensors vLLM registered), by worker.
KV: dict[int, dict[str, torch.Tensor]] = {}


def make_worker(tmp_path: Path, backend: str = "torch", *, batches: Gated | None = None,
                issue: Issue | None = None) -> WorkerSide:
    cfg = KVTierConfig.model_validate({**CFG, "copy_backend": backend})
    pool = tmp_path / f"pool-{len(list(tmp_path.iterdir()))}"
    w = WorkerSide(cfg, GEOM, list(LAYERS), pool, batches=batches, issue=issue)
    gen = torch.Generator().manual_seed(7)
    kv = {n: torch.randn(NB, HEADS, BS, 2 * HEAD, generator=gen) for n in LAYERS}
    w.register(kv, CPUAttentionBackend, KVCacheLayout.LBHNC, NB)
    KV[id(w)] = kv
    return w


def caches(w: WorkerSide) -> dict[str, torch.Tensor]:
    return KV[id(w)]


@pytest.fixture(autouse=True)
def _forget_caches() -> Iterator[None]:
    yield
    KV.clear()


@pytest.fixture(params=["whole", 0, len(LAYERS)], ids=["whole", "ahead0", "ahead-all"])
def worker(
    tmp_path: Path, backend_name: str, request: pytest.FixtureRequest
) -> Iterator[WorkerSide]:
    w = make_worker(tmp_path, backend_name, issue=request.param)
    yield w
    w.close()


def forward(w: WorkerSide, layers: Sequence[str] = LAYERS) -> None:
    for name in layers:
        w.wait_for_layer(name)


def step(w: WorkerSide, meta: KVTierMetadata, *, waits: Sequence[str] = LAYERS,
         layer_by_layer: bool = True) -> None:
    """One engine step: start_load_kv, the forward's per-layer waits, wait_for_save."""
    w.run(meta, layer_by_layer=layer_by_layer)
    forward(w, waits)
    w.end_forward()


def save_two_chunks(w: WorkerSide, waits: Sequence[str] = LAYERS) -> dict[str, torch.Tensor]:
    """Blocks 0-3 -> slot 0 and 4-7 -> slot 1; returns the caches as they were."""
    step(w, KVTierMetadata(1, saves=[CopyOp("a", 0, [0, 1, 2, 3]), CopyOp("a", 1, [4, 5, 6, 7])]),
         waits=waits)
    assert w.get_finished({"a"}) == ({"a"}, None)
    return {n: t.clone() for n, t in caches(w).items()}


LOADS = [CopyOp("r", 0, [8, 9, 10, 11]),  # a whole chunk
         CopyOp("r", 1, [12, 13], first=1),  # chunk blocks 1-2 (vLLM's hit ends mid-chunk)
         CopyOp("r", 0, [14, 15, 16])]  # chunk blocks 0-2 (the prompt's last chunk)
#: Destination block -> the original block whose bytes it must hold after LOADS.
EXPECTED = {8: 0, 9: 1, 10: 2, 11: 3, 12: 5, 13: 6, 14: 0, 15: 1, 16: 2}


def loaded(w: WorkerSide, orig: dict[str, torch.Tensor], layer: str) -> bool:
    t = caches(w)[layer]
    return all(torch.equal(t[d], orig[layer][s]) for d, s in EXPECTED.items())


def wipe_destinations(w: WorkerSide) -> None:
    for t in caches(w).values():
        t[8:17] = 0


# -- (a) loads: layer by layer, exact, partial chunks -----------------------------------
def test_loads_round_trip_exactly_including_partial_chunks(worker: WorkerSide) -> None:
    orig = save_two_chunks(worker)
    wipe_destinations(worker)
    step(worker, KVTierMetadata(2))  # a forward that waits for every layer: layer-wise on
    step(worker, KVTierMetadata(3, loads=LOADS))
    for name in LAYERS:
        assert loaded(worker, orig, name)
        untouched = [b for b in range(NB) if b not in EXPECTED]
        assert torch.equal(caches(worker)[name][untouched], orig[name][untouched])
    assert worker.load_errors() == set()
    meta = worker.worker_meta()
    assert meta is not None and meta.loaded_steps == [3]


def test_with_issue_0_each_layer_is_copied_by_its_own_wait(tmp_path: Path) -> None:
    w = make_worker(tmp_path, issue=0)
    orig = save_two_chunks(w)
    wipe_destinations(w)
    step(w, KVTierMetadata(2))
    w.run(KVTierMetadata(3, loads=LOADS), layer_by_layer=True)
    assert not any(loaded(w, orig, n) for n in LAYERS)  # nothing before the forward
    for i, name in enumerate(LAYERS):
        w.wait_for_layer(name)
        assert [loaded(w, orig, n) for n in LAYERS] == [j <= i for j in range(3)]
    w.end_forward()
    w.close()


def test_on_the_cpu_whole_chunks_are_copied_when_the_step_starts(tmp_path: Path) -> None:
    w = make_worker(tmp_path)  # the default on the CPU: "whole"
    orig = save_two_chunks(w)
    wipe_destinations(w)
    step(w, KVTierMetadata(2))
    w.run(KVTierMetadata(3, loads=LOADS), layer_by_layer=True)
    assert all(loaded(w, orig, n) for n in LAYERS)  # complete before the forward
    forward(w)
    w.end_forward()
    meta = w.worker_meta()
    assert meta is not None and meta.loaded_steps == [3]
    w.close()


def test_cuda_like_copies_are_issued_at_start_and_fenced_per_layer(tmp_path: Path) -> None:
    gated = Gated(resolve_copy_backend("torch"))
    w = make_worker(tmp_path, batches=gated, issue=len(LAYERS))
    orig = save_two_chunks_gated(w, gated)
    wipe_destinations(w)
    step(w, KVTierMetadata(2))
    gated.handles.clear()
    w.run(KVTierMetadata(3, loads=LOADS), layer_by_layer=True)
    assert len(gated.handles) == len(LAYERS)  # every layer issued, one handle each
    assert all(loaded(w, orig, n) for n in LAYERS)  # (the bytes of this fake move at once)
    for i, name in enumerate(LAYERS):
        w.wait_for_layer(name)
        # The compute stream waits for this layer's copies and no later ones.
        assert [h.stream_waits for h in gated.handles] == [1 if j <= i else 0 for j in range(3)]
    w.end_forward()
    first = w.worker_meta()  # the step it ran, for the step timer
    assert first is not None and first.step == 3
    assert first.loaded_steps == []  # still copying: the host slots stay held
    assert nothing_done(w.worker_meta())
    gated.open_all()
    meta = w.worker_meta()
    assert meta is not None and meta.loaded_steps == [3]
    assert nothing_done(w.worker_meta())
    w.close()


def nothing_done(meta: KVTierWorkerMetadata | None) -> bool:
    """No loads completed and no saves failed (the meta may still name the step run)."""
    return meta is None or (not meta.loaded_steps and not meta.failed_saves)


def save_two_chunks_gated(w: WorkerSide, gated: Gated) -> dict[str, torch.Tensor]:
    w.run(KVTierMetadata(1, saves=[CopyOp("a", 0, [0, 1, 2, 3]), CopyOp("a", 1, [4, 5, 6, 7])]),
          layer_by_layer=True)
    w.end_forward()
    gated.open_all()
    assert w.get_finished({"a"}) == ({"a"}, None)
    return {n: t.clone() for n, t in caches(w).items()}


def test_loads_complete_before_the_forward_until_a_forward_waited_for_every_layer(
    worker: WorkerSide,
) -> None:
    orig = save_two_chunks(worker, waits=[])  # a step without a forward
    wipe_destinations(worker)
    step(worker, KVTierMetadata(2), waits=LAYERS[:2])  # vLLM skipped a layer's wait
    worker.run(KVTierMetadata(3, loads=LOADS), layer_by_layer=True)
    assert all(loaded(worker, orig, n) for n in LAYERS)  # complete before the forward
    worker.end_forward()


@pytest.mark.parametrize("ctx", [
    None,
    SimpleNamespace(attn_metadata=None, cudagraph_runtime_mode=CUDAGraphMode.NONE),
    SimpleNamespace(attn_metadata={}, cudagraph_runtime_mode=CUDAGraphMode.FULL),
], ids=["no-context", "no-forward", "full-cuda-graph"])
def test_no_per_layer_hooks_this_step_means_loads_complete_in_start_load_kv(
    worker: WorkerSide, ctx: object,
) -> None:
    assert not forward_runs_layer_by_layer(ctx)
    orig = save_two_chunks(worker)
    wipe_destinations(worker)
    step(worker, KVTierMetadata(2))
    worker.run(KVTierMetadata(3, loads=LOADS), layer_by_layer=forward_runs_layer_by_layer(ctx))
    assert all(loaded(worker, orig, n) for n in LAYERS)
    worker.end_forward()


def test_eager_and_piecewise_forwards_are_layer_by_layer() -> None:
    for mode in (CUDAGraphMode.NONE, CUDAGraphMode.PIECEWISE):
        assert forward_runs_layer_by_layer(SimpleNamespace(attn_metadata={},
                                                           cudagraph_runtime_mode=mode))


def test_a_layer_never_waited_for_is_completed_and_layer_wise_loading_stops(
    worker: WorkerSide, caplog: pytest.LogCaptureFixture,
) -> None:
    orig = save_two_chunks(worker)
    wipe_destinations(worker)
    step(worker, KVTierMetadata(2))
    with caplog.at_level(logging.ERROR, logger="kvtier"):
        step(worker, KVTierMetadata(3, loads=LOADS), waits=LAYERS[:2])
    assert all(loaded(worker, orig, n) for n in LAYERS)
    assert LAYERS[2] in caplog.text and "wait_for_layer_load" in caplog.text
    # the forward computed layer 2 before its KV was in place: vLLM must recompute
    assert worker.load_errors() == set(EXPECTED)
    wipe_destinations(worker)
    step(worker, KVTierMetadata(4))  # a full forward again: layer-wise stays off
    worker.run(KVTierMetadata(5, loads=LOADS), layer_by_layer=True)
    assert all(loaded(worker, orig, n) for n in LAYERS)
    worker.end_forward()


def test_a_wait_for_a_layer_outside_the_kv_group_completes_every_load(
    worker: WorkerSide,
) -> None:
    orig = save_two_chunks(worker)
    wipe_destinations(worker)
    step(worker, KVTierMetadata(2))
    worker.run(KVTierMetadata(3, loads=LOADS), layer_by_layer=True)
    worker.wait_for_layer("model.layers.0.cross_attn")
    assert all(loaded(worker, orig, n) for n in LAYERS)
    forward(worker)
    worker.end_forward()


def test_a_bad_load_is_reported_and_the_others_land(worker: WorkerSide) -> None:
    orig = save_two_chunks(worker)
    wipe_destinations(worker)
    step(worker, KVTierMetadata(2))
    bad = [CopyOp("x", 999, [20, 21, 22, 23]),  # no such slot
           CopyOp("y", 0, [18, 19], first=3)]  # past the chunk's end
    step(worker, KVTierMetadata(3, loads=[*LOADS, *bad]))
    assert worker.load_errors() == {18, 19, 20, 21, 22, 23}  # vLLM recomputes these
    assert all(loaded(worker, orig, n) for n in LAYERS)
    meta = worker.worker_meta()
    assert meta is not None and meta.loaded_steps == [3]  # the holds go all the same
    assert worker.load_errors() == set()


# -- (b) a slow save does not delay the next step ---------------------------------------
def test_a_slow_save_is_reported_only_once_its_copy_is_done(tmp_path: Path) -> None:
    gated = Gated(resolve_copy_backend("torch"))
    w = make_worker(tmp_path, batches=gated)
    step(w, KVTierMetadata(1, saves=[CopyOp("slow", 2, [0, 1, 2, 3])]))  # returns at once
    assert w.get_finished({"slow"}) == (None, None)  # vLLM keeps the blocks
    for s in range(2, 5):  # later steps run; the save is still copying
        step(w, KVTierMetadata(s))
        assert w.get_finished(set()) == (None, None)
        assert nothing_done(w.worker_meta())
    gated.open_all()
    assert w.get_finished(set()) == ({"slow"}, None)
    assert nothing_done(w.worker_meta())  # not a failure
    assert w.get_finished(set()) == (None, None)  # reported once
    w.close()


def test_the_scheduler_commits_a_save_only_when_the_worker_reports_it(
    tmp_path: Path,
) -> None:
    cfg = KVTierConfig.model_validate({**CFG, "restore": {"recompute_threshold_tokens": 1}})
    ns = Namespace(model="m", model_fingerprint="0" * 16, kv_dtype="float32",
                   kv_layout="NHD", num_layers=len(LAYERS), num_kv_heads=HEADS,
                   head_size=HEAD, chunk_tokens=CT, block_size=BS)
    sched = SchedulerSide(cfg, GEOM, ns, None, store=build_store(cfg, GEOM.chunk_bytes(CT)))
    gated = Gated(resolve_copy_backend("torch"))
    w = make_worker(tmp_path, batches=gated)
    tokens = list(range(3, 3 + 2 * CT))
    req = SimpleNamespace(request_id="q", all_token_ids=tokens, num_tokens=len(tokens),
                          cache_salt=None, kv_transfer_params=None, lora_request=None,
                          mm_features=None, prompt_embeds=None, num_computed_tokens=len(tokens))
    delay, _ = sched.request_finished(req, list(range(8)))
    assert delay
    step(w, sched.build_meta())
    sched.on_worker_output(w.get_finished({"q"})[0], w.worker_meta())
    assert sched.has_pending_saves()  # copying: not committed, blocks held
    gated.open_all()
    step(w, sched.build_meta())
    sched.on_worker_output(w.get_finished(set())[0], w.worker_meta())
    assert not sched.has_pending_saves()
    sched.close()
    w.close()


# -- (c) failed saves -------------------------------------------------------------------
def test_a_failed_save_is_reported_with_its_id_and_never_as_saved(tmp_path: Path) -> None:
    gated = Gated(resolve_copy_backend("torch"))
    w = make_worker(tmp_path, batches=gated)
    step(w, KVTierMetadata(1, saves=[CopyOp("bad", 999, [0, 1, 2, 3]),
                                     CopyOp("ok", 1, [4, 5, 6, 7])]))
    assert w.get_finished({"bad", "ok"}) == ({"bad"}, None)
    meta = w.worker_meta()
    assert meta is not None and meta.failed_saves == ["bad"]  # same step: the slot is aborted
    gated.open_all()
    assert w.get_finished(set()) == ({"ok"}, None)
    assert nothing_done(w.worker_meta())


def test_a_partly_failed_save_waits_for_the_copies_it_issued(tmp_path: Path) -> None:
    gated = Gated(resolve_copy_backend("torch"))
    w = make_worker(tmp_path, batches=gated)
    step(w, KVTierMetadata(1, saves=[CopyOp("half", 0, [0, 1, 2, 3]),
                                     CopyOp("half", 1, [4, 5], first=2)]))  # not a whole chunk
    # Its first chunk is still being read from the blocks: they must stay allocated.
    assert w.get_finished({"half"}) == (None, None)
    assert nothing_done(w.worker_meta())
    gated.open_all()
    assert w.get_finished(set()) == ({"half"}, None)
    meta = w.worker_meta()
    assert meta is not None and meta.failed_saves == ["half"]


def test_a_streamed_save_is_acknowledged_per_step_and_finished_after_its_last(
        tmp_path: Path) -> None:
    """A streamed save (``saves_more``): each step's copies are acknowledged in
    ``saved_steps`` once done (the scheduler commits them then), and the request is
    reported finished sending only after it left ``saves_more`` and its last copy is
    done; a step whose copy failed is acknowledged in ``failed_save_steps``."""
    gated = Gated(resolve_copy_backend("torch"))
    w = make_worker(tmp_path, batches=gated)
    step(w, KVTierMetadata(1, saves=[CopyOp("s", 0, [0, 1, 2, 3])], saves_acked=["s"],
                           saves_more=["s"]))
    assert w.get_finished({"s"}) == (None, None)
    meta = w.worker_meta()
    assert meta is not None and meta.saved_steps == []  # still copying
    gated.open_all()
    assert w.get_finished(set()) == (None, None)  # copied, but more follows
    meta = w.worker_meta()
    assert meta is not None and meta.saved_steps == [1]
    step(w, KVTierMetadata(2, saves=[CopyOp("s", 999, [4, 5, 6, 7])], saves_acked=["s"],
                           saves_more=["s"]))  # a bad slot: this step fails
    step(w, KVTierMetadata(3, saves=[CopyOp("s", 1, [4, 5, 6, 7])], saves_acked=["s"]))
    assert w.get_finished(set()) == (None, None)  # its last copy is still running
    meta = w.worker_meta()
    assert meta is not None and meta.failed_save_steps == [2] and meta.saved_steps == []
    gated.open_all()
    assert w.get_finished(set()) == ({"s"}, None)
    meta = w.worker_meta()
    assert meta is not None and meta.saved_steps == [3] and meta.failed_saves == ["s"]
    assert w.get_finished(set()) == (None, None)
    assert all(v == 0 for v in w.held().values())
    w.close()


def test_a_streamed_save_without_a_copy_is_still_finished(tmp_path: Path) -> None:
    """Named in ``saves_more`` once (with its finished id), with no copy ever issued (it
    found no host slot): reported finished once it leaves ``saves_more``."""
    w = make_worker(tmp_path)
    step(w, KVTierMetadata(1, saves_acked=["e"], saves_more=["e"]))
    assert w.get_finished({"e"}) == (None, None)
    step(w, KVTierMetadata(2, saves_acked=["e"]))
    assert w.get_finished(set()) == ({"e"}, None)
    assert all(v == 0 for v in w.held().values())
    w.close()


# -- (d) bounded state ------------------------------------------------------------------
def test_state_stays_bounded_over_many_requests(tmp_path: Path) -> None:
    gated = Gated(resolve_copy_backend("torch"))
    w = make_worker(tmp_path, batches=gated, issue=len(LAYERS))
    step(w, KVTierMetadata(0))
    reported: set[str] = set()
    for i in range(1, 2001):
        saves = [CopyOp(f"s{i}", i % 4, [0, 1, 2, 3])]
        if i % 7 == 0:
            saves.append(CopyOp(f"s{i}", 99, [4, 5, 6, 7]))  # fails
        loads = [CopyOp(f"l{i}", 5, [12, 13], first=1)] if i % 3 == 0 else []
        step(w, KVTierMetadata(i, loads=loads, saves=saves))
        done, _ = w.get_finished({f"s{i}", f"no-save-{i}"})
        reported |= done or set()
        w.worker_meta()
        w.load_errors()
        if i % 5 == 0:  # copies complete a few steps late, in bursts
            gated.open_all()
            gated.handles.clear()
        assert all(n <= 6 for n in w.held().values()), w.held()
    gated.open_all()
    done, _ = w.get_finished(set())
    reported |= done or set()
    w.worker_meta()
    assert reported == {f"s{i}" for i in range(1, 2001)}
    assert all(n == 0 for n in w.held().values()), w.held()
    w.close()
