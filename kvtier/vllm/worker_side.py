"""Worker side of the connector: the bytes. Owns the KV cache views and the host pool.

It creates the shared host pool (``HostPool.create_shm``; see ``shm.py``) and maps
vLLM's worker hooks onto the copy engine, ``kvtier.ops.stepcopy.StepCopier``
(``copy_backend``: native ops or the torch reference). Every method runs on vLLM's model
thread, in this order each step:

* ``run`` (``start_load_kv``): issues the step's loads (host slot -> KV blocks, layer by
  layer) and saves (KV blocks -> host slot, of finished requests whose blocks vLLM keeps
  allocated until we report them); waits for neither.
* ``wait_for_layer`` (``wait_for_layer_load``): that layer's loads are ordered before the
  attention vLLM enqueues next (CUDA: the compute stream waits for the layer's event;
  CPU: the layer is copied now).
* ``end_forward`` (``wait_for_save``): loads of layers no wait came for are completed.
* ``get_finished``, ``load_errors``, ``worker_meta``: what is done, reported once.

The saves in flight and their reports are ``WorkerSaves``' (``worker_saves.py``).

Invariants: the layout comes from the attention backend's declaration
(``kvtier.ops.layout_from_backend``), never from probing; the chunk size it implies must
equal the scheduler's, or start-up fails. No work enqueued after ``end_forward`` (and no
attention after its layer's wait) reads a block whose load is pending. A request is
reported finished only when its save's copies are complete, and a step's loads only when
theirs are (the scheduler then frees blocks, commits slots, releases holds). A copy that
raises is reported (load errors make vLLM recompute those blocks; failed saves are never
committed). State held: saves not yet reported and steps still copying, nothing else.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch
from vllm.config import CUDAGraphMode

from kvtier.config import KVTierConfig
from kvtier.ops import CopyBackend, KVLayout, layout_from_backend, resolve_copy_backend
from kvtier.ops.stepcopy import Batches, Issue, LayerLoads, StepCopier, default_issue
from kvtier.tiers.base import TierError
from kvtier.tiers.pool import HostPool
from kvtier.vllm.geometry import Geometry
from kvtier.vllm.protocol import CopyOp, KVTierMetadata, KVTierWorkerMetadata
from kvtier.vllm.shm import remove_pool, remove_published
from kvtier.vllm.worker_saves import WorkerSaves, by_group

log = logging.getLogger("kvtier.vllm")


class WorkerSide:
    def __init__(
        self, cfg: KVTierConfig, geometry: Geometry, layer_names: list[str] | list[list[str]],
        pool_path: Any, *, batches: Batches | None = None, issue: Issue | None = None,
    ) -> None:
        """``layer_names``: the KV layers, or a hybrid model's layers per KV-cache group
        (vLLM's group order; a ``CopyOp``'s ``group`` indexes it). ``batches`` replaces
        the copy backend's batches (tests: controllable handles); ``issue`` how loads are
        issued (default ``default_issue``: per layer, all at once, on CUDA; whole chunks
        on the CPU; see ``kvtier.ops.stepcopy``)."""
        self.cfg = cfg
        self.geom = geometry
        groups: list[list[str]] = (
            [list(g) for g in layer_names] if layer_names and isinstance(layer_names[0], list)
            else [list(layer_names)])  # type: ignore[arg-type]
        self.groups = groups
        self.layer_names = [n for g in groups for n in g]
        self.pool_path = pool_path
        self.bpc = geometry.blocks_per_chunk(cfg.chunk_tokens)
        self.backend: CopyBackend = resolve_copy_backend(cfg.copy_backend)
        self._batches: Batches = batches if batches is not None else self.backend
        self._issue = issue
        self.views: list[torch.Tensor] = []  # every layer's, in ``layer_names`` order
        self.layout: KVLayout | None = None  # as resolved by register()
        self.slot_bytes = 0  # a whole slot: every TP rank's part
        self.rank_bytes = 0  # this rank's part of a slot
        self.tp_rank, self.tp_world = 0, geometry.tp_world
        self.host_pool: HostPool | None = None
        self._created = False  # this worker created the pool (and removes its name)
        self.pool: torch.Tensor | None = None
        self._copiers: list[StepCopier] = []  # one per group
        #: layer name -> (group, layer within the group, index in ``layer_names``)
        self._layer_index = {name: (g, i, flat) for flat, (g, i, name) in enumerate(
            (g, i, name) for g, names in enumerate(groups) for i, name in enumerate(names))}
        # Loads: this step's per group (until wait_for_save), then copying until done.
        self._loads: dict[int, LayerLoads] | None = None
        self._loads_step = 0
        # Asynchronous loads (a hybrid model's): request -> its loads, until reported
        self._recving: dict[str, list[tuple[LayerLoads, CopyOp]]] = {}
        self._recv_failed: set[str] = set()  # failed, not reported received yet
        #: streamed requests whose loads continue in a later step (``KVTierMetadata.more``)
        self._more: set[str] = set()
        self._failed_now: set[str] = set()  # failed, reported received by get_finished
        self._ran_step = 0  # the step run() last ran, until worker_meta reports it
        #: steps with loads that failed to start on this rank (acknowledged as loaded
        #: once the step's other loads on this rank are done)
        self._failed_steps: set[int] = set()
        self._loading: list[tuple[int, LayerLoads]] = []
        self._load_errors: set[int] = set()
        self._waited = [False] * len(self.layer_names)  # layers vLLM waited for this step
        self._per_layer_seen = False  # a forward waited for every layer: go layer-wise
        self._per_layer_broken = False  # a layer-wise step missed a wait: never again
        self._said_layer_wise = False
        self._copy_s = 0.0
        self.saves = WorkerSaves(self._copier_of)

    def register(
        self,
        kv_caches: dict[str, torch.Tensor],
        backend_cls: Any,
        kv_cache_layout: Any,
        num_blocks: int,
        *,
        tp_rank: int = 0,
        barrier: Any = None,
    ) -> None:
        """Resolve the KV layout and map the host pool. At TP > 1 (``geometry.tp_world``)
        rank 0 creates the pool, ``barrier()`` (the TP group's, on every rank) orders
        that before the other ranks attach, and this rank copies only its part of each
        slot (``rank_bytes`` at offset ``tp_rank * rank_bytes``). A ``replicated`` cache
        (MLA) has one part: every rank loads it, and only rank 0 saves it (the other
        ranks report their saves done at once, so a save still commits on every rank's
        ack)."""
        missing = [n for n in self.layer_names if n not in kv_caches]
        if missing:
            raise TierError(f"kvtier: KV caches missing for layers {missing[:3]}")
        first = kv_caches[self.layer_names[0]]
        layout: KVLayout = layout_from_backend(
            backend_cls,
            num_blocks=num_blocks,
            block_size=self.geom.block_size,
            num_kv_heads=self.geom.num_kv_heads,
            head_size=self.geom.head_size,
            head_size_v=self.geom.head_size_v,
            dtype=first.dtype,
            kv_cache_layout=kv_cache_layout,
        )
        self.layout = layout
        self.views = [layout.block_view(kv_caches[n]) for n in self.layer_names]
        group_bytes = [layout.chunk_bytes(len(g), self.bpc) for g in self.groups]
        self.rank_bytes = max(group_bytes)
        expected = self.geom.rank_chunk_bytes(self.cfg.chunk_tokens)
        if self.rank_bytes != expected:
            raise TierError(
                f"kvtier: the KV tensors give {self.rank_bytes}-byte chunks but the KV cache "
                f"spec says {expected}; this attention backend's layout is not supported"
            )
        if not 0 <= tp_rank < self.tp_world:
            raise TierError(f"kvtier: TP rank {tp_rank} outside a world of {self.tp_world}")
        self.tp_rank = tp_rank
        parts = self.geom.slot_ranks
        self.slot_bytes = self.rank_bytes * parts
        num_slots = HostPool.slots_for(self.cfg.host.capacity, self.slot_bytes)
        # Sized, faulted in and page-locked as configured (`pinned: yes` fails here); the
        # scheduler side maps the same file with HostPool.attach_shm and the same count.
        if tp_rank == 0:
            self.host_pool = HostPool.create_shm(
                self.pool_path, self.slot_bytes, num_slots, pinned=self.cfg.host.pinned
            )
            self._created = True
        if barrier is not None:
            barrier()  # every rank: rank 0's pool exists before the others attach
        if tp_rank != 0:
            self.host_pool = HostPool.attach_shm(
                self.pool_path, self.slot_bytes, num_slots, unlink=False,
                pinned=self.cfg.host.pinned,
            )
        assert self.host_pool is not None
        # the same mapping, no copy; the copier finds this rank's part of each slot
        self.pool = torch.from_numpy(self.host_pool.array)
        pinned = self.host_pool.pinned
        issue = self._issue
        at = 0
        for names, nbytes in zip(self.groups, group_bytes, strict=True):
            views = self.views[at : at + len(names)]
            at += len(names)
            group_issue = issue if issue is not None else default_issue(views[0].device,
                                                                        len(views))
            # one copier per KV-cache group: its layers, its part of every slot (a
            # smaller group's chunk fills the front of a slot sized for the largest)
            self._copiers.append(StepCopier(self._batches, views, self.pool, nbytes,
                                            self.bpc, group_issue,
                                            tp_rank if parts > 1 else 0, parts,
                                            stride=self.slot_bytes))
        log.info(
            "kvtier worker: %d layers, %d slots of %.1f MiB (TP rank %d of %d), %s, copy "
            "backend %s (%s)",
            len(self.views), num_slots, self.slot_bytes / 2**20, tp_rank, self.tp_world,
            "pinned" if pinned else "pageable", self.backend.name, self.backend.reason,
        )

    @property
    def copier(self) -> StepCopier:
        """The copier of the first (with one group, the only) KV-cache group."""
        assert self._copiers, "register() first"
        return self._copiers[0]

    # -- per step: vLLM's model thread ------------------------------------------------
    def run(self, meta: KVTierMetadata, *, layer_by_layer: bool) -> None:
        """``start_load_kv``: issue this step's loads and saves; returns without waiting.

        Loads go layer by layer (``StepCopier``) when ``layer_by_layer`` (the forward
        runs attention eagerly, so vLLM will call ``wait_for_layer_load``) and this
        worker has seen a forward in which vLLM called it for every KV layer; otherwise
        every load is ordered before the forward here. Asynchronous loads
        (``meta.async_loads``: their requests are not in this forward) are issued whole
        and reported per request by ``get_finished`` once complete.
        """
        t0 = time.perf_counter()
        self._ran_step = meta.step
        if self._loads is not None:  # no wait_for_save since the last step: be safe
            self.end_forward()
        self._more = set(meta.more)
        async_reqs = set(meta.async_reqs)
        sync_ops: list[CopyOp] = []
        async_ops: list[CopyOp] = []
        for op in meta.loads:
            (async_ops if meta.async_loads or op.req_id in async_reqs else sync_ops).append(op)
        for loads in self._start_loads(meta.step, async_ops, asynchronous=True).values():
            # their requests are not in this forward: issued whole now, and nothing waits
            # for them (they are reported once done, ``get_finished``)
            loads.issue_all()
            self._loading.append((meta.step, loads))
        started = self._start_loads(meta.step, sync_ops, asynchronous=False)
        if started:
            self._loads, self._loads_step = started, meta.step
            if not (layer_by_layer and self._per_layer_seen):
                for loads in started.values():
                    loads.finish()
            elif not self._said_layer_wise:
                self._said_layer_wise = True
                log.info("kvtier worker: loads are waited for layer by layer (issue %s, %d "
                         "layers)", self.copier.issue, len(self.layer_names))
        self.saves.start(meta.saves, meta.step, set(meta.saves_acked), set(meta.saves_more),
                         copies=not (self.geom.replicated and self.tp_rank != 0))
        self._copy_s += time.perf_counter() - t0

    def _start_loads(self, step: int, ops: list[CopyOp], *,
                     asynchronous: bool) -> dict[int, LayerLoads]:
        """Start ``ops`` (one batch per KV-cache group): the batches that copy anything.
        An asynchronous op is remembered under its request until ``get_finished``
        reports it. A group whose batch cannot start fails its ops: asynchronous ones per
        request (vLLM recomputes them), synchronous ones per block, as a copy that failed
        would be; the step is acknowledged anyway (this rank reads none of those slots,
        and the ack counts every rank)."""
        started: dict[int, LayerLoads] = {}
        for group, group_ops in by_group(ops).items():
            try:
                loads = self._copier_of(group).start_loads(group_ops)
            except TierError:
                log.exception("kvtier: loads of %s failed",
                              sorted({o.req_id for o in group_ops}))
                if asynchronous:
                    self._recv_failed.update(op.req_id for op in group_ops)
                else:
                    self._load_errors.update(b for op in group_ops for b in op.block_ids)
                self._failed_steps.add(step)
                continue
            if not loads.empty:
                started[group] = loads
            if asynchronous:
                for op in group_ops:
                    self._recving.setdefault(op.req_id, []).append((loads, op))
        return started

    def _copier_of(self, group: int) -> StepCopier:
        if not 0 <= group < len(self._copiers):
            raise TierError(f"kvtier: a copy names KV-cache group {group} of "
                            f"{len(self._copiers)}")
        return self._copiers[group]

    def wait_for_layer(self, layer_name: str) -> None:
        """``wait_for_layer_load``: the layer's loaded blocks are in place before the
        attention vLLM enqueues next. A name outside the KV cache groups completes every
        load (correct, not pipelined)."""
        where = self._layer_index.get(layer_name)
        if where is not None:
            self._waited[where[2]] = True
        if self._loads is None:
            return
        t0 = time.perf_counter()
        if where is None:
            for loads in self._loads.values():
                loads.finish()
        elif where[0] in self._loads:
            self._loads[where[0]].wait_layer(where[1])
        self._copy_s += time.perf_counter() - t0

    def end_forward(self) -> float:
        """``wait_for_save``: completes (orders) loads of layers no wait came for, and
        returns the seconds this thread spent on the step's copies."""
        t0 = time.perf_counter()
        seen_all = all(self._waited)
        if self._loads is not None:
            for group, loads in self._loads.items():
                skipped = loads.finish()
                if skipped:
                    # The forward's attention for those layers ran before their KV was
                    # in place: every block loaded this step is reported as a load error,
                    # so vLLM recomputes it instead of keeping what was computed on it.
                    self._load_errors |= loads.block_ids()
                    if not self._per_layer_broken:
                        self._per_layer_broken = True
                        log.error(
                            "kvtier: vLLM ran a forward without wait_for_layer_load for "
                            "layers %s; their loads were completed after it and the step's "
                            "loaded blocks are reported as load errors (recomputed). Loads "
                            "now complete before the forward (not layer by layer)",
                            [self.groups[group][j] for j in skipped])
                self._load_errors |= loads.failed_blocks()
                self._loading.append((self._loads_step, loads))
            self._loads = None
        self._per_layer_seen = (self._per_layer_seen or seen_all) and not self._per_layer_broken
        self._waited = [False] * len(self.layer_names)
        seconds = self._copy_s + time.perf_counter() - t0
        self._copy_s = 0.0
        return seconds

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Requests whose blocks vLLM may free now (finished, and their saves complete),
        and requests whose asynchronous loads are complete (received, or failed: those
        are also in ``load_failures``).

        vLLM hands a finished request's id to the workers in the same step as the
        metadata carrying its saves (``Scheduler.schedule`` builds both from one
        ``_free_request``), and ``run`` issues those saves before this is called. A
        finished id with no save by now never gets one and is not remembered. A save
        still copying (CUDA) keeps its id until its handle is done: vLLM keeps the blocks
        allocated until then (delayed free), and the scheduler commits the slot only when
        the id is reported here. A failed save is reported like a done one (its blocks are
        free to go), in the same step as its id in ``worker_meta().failed_saves``, so the
        scheduler aborts it. State held: only saves and loads not yet reported.
        """
        ready = self.saves.finished(finished_req_ids)
        # a streamed request's steps that are copied are folded into its failure flag:
        # its loads of every step are not kept until the stream ends
        for rid in self._more & self._recving.keys():
            loads = self._recving[rid]
            if any(ld.done() for ld, _ in loads):
                if any(ld.done() and any(f is op for f in ld.failed_ops()) for ld, op in loads):
                    self._recv_failed.add(rid)
                loads[:] = [(ld, op) for ld, op in loads if not ld.done()]
        # a streamed request is reported once its last loads came (not in ``more``)
        received = {rid for rid, loads in self._recving.items()
                    if rid not in self._more and all(ld.done() for ld, _ in loads)}
        for rid in received:
            loads = self._recving.pop(rid)
            if any(any(f is op for f in ld.failed_ops()) for ld, op in loads):
                self._recv_failed.add(rid)
        # a group failed to start (or a folded step of a stream failed)
        received |= self._recv_failed - self._recving.keys() - self._more
        self._failed_now = self._recv_failed & received
        self._recv_failed -= received
        return (ready or None), (received or None)

    def load_failures(self) -> set[str]:
        """Requests whose asynchronous loads failed, reported once, with their ids in
        ``get_finished``'s received set of the same call."""
        failed, self._failed_now = self._failed_now, set()
        return failed

    def load_errors(self) -> set[int]:
        errs, self._load_errors = self._load_errors, set()
        return errs

    def worker_meta(self) -> KVTierWorkerMetadata | None:
        """Steps whose loads are complete (their host slots may be released) and saves
        that failed, reported with their ids in this step's ``get_finished``; and the
        step just run, so that every step's output (a 0-token one included) reaches the
        scheduler side paired with its step."""
        pending = {step for step, loads in self._loading if not loads.done()}
        if self._loads is not None:
            pending.add(self._loads_step)
        loaded = sorted(({step for step, _ in self._loading} | self._failed_steps) - pending)
        if loaded:
            self._loading = [(s, ld) for s, ld in self._loading if s in pending]
            self._failed_steps -= set(loaded)
        step, self._ran_step = self._ran_step, 0
        saved, failed = self.saves.steps()
        failed_saves = self.saves.take_failed()
        if not loaded and not failed_saves and not step and not saved and not failed:
            return None
        return KVTierWorkerMetadata(loaded, failed_saves, step, saved, failed)

    def held(self) -> dict[str, int]:
        """How much per-request and per-step state is held (tests, debugging)."""
        return {**self.saves.held(),
                "loads_copying": len(self._loading) + (self._loads is not None),
                "loads_unreported": len(self._recving), "load_errors": len(self._load_errors)}

    def close(self) -> None:
        """Remove the shared pool's name, only if this worker created it (a worker whose
        create failed, e.g. another engine with the same ``engine_id`` holds the name,
        must not remove that engine's pool). Every rank removes its own published file
        (the scheduler removes it once read)."""
        if self._created:
            remove_pool(self.pool_path)
        if self.host_pool is not None:
            remove_published(self.pool_path, self.tp_rank)


def forward_runs_layer_by_layer(forward_context: Any) -> bool:
    """Whether vLLM will call ``wait_for_layer_load`` in this step's forward.

    Not when there is no forward (no attention metadata: a step that only moves KV) or
    when the forward replays a full CUDA graph (attention is inside the graph, so the
    per-layer hooks do not run; vLLM 0.32's ``maybe_transfer_kv_layer``).
    """
    if forward_context is None or getattr(forward_context, "attn_metadata", None) is None:
        return False
    mode = getattr(forward_context, "cudagraph_runtime_mode", CUDAGraphMode.NONE)
    return bool(mode != CUDAGraphMode.FULL)
