"""A deterministic simulation of kvtier under vLLM's own scheduler.

vLLM's real v1 ``Scheduler`` (its ``KVCacheManager``, prefix cache, preemption, aborts,
asynchronous loads, ``KVOutputAggregator`` at TP > 1) drives kvtier's real connector on
both sides: the scheduler side the scheduler constructs through vLLM's connector factory,
and one worker-side connector per TP rank, registered over CPU tensors in vLLM's CPU
layout. No model runs: ``SimWorld.step`` plays the model runner, in vLLM's order
(bind metadata, start loads before the forward when the step has synchronous loads,
"compute", start them after otherwise, ``wait_for_save``, transfer results), and writes,
for every token it computes, KV bytes that are a pure function of the token prefix that
token ends (``expected_rows``). So after every step the world can check that **every
block vLLM treats as computed holds exactly the bytes of its own prefix**, however it got
there: computed, from vLLM's prefix cache, or restored by kvtier (``check_blocks``).

The simulated model (its shapes, vLLM configs and KV bytes) is ``kvtier.testing.simmodel``.

Everything runs on the calling thread except kvtier's own IO threads; time is a
``ManualClock`` the caller advances. Which thread may call what: a ``SimWorld`` is used
from one thread.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from kvtier.testing.simmodel import (
    HEAD_SIZE,
    HEADS,
    LAYERS_PER_GROUP,
    SHAPES,
    Shape,
    SimRequest,
    expected_rows,
    kv_cache_config_for,
    mla_backend,
    token_hashes,
    vllm_config_for,
)

__all__ = [
    "HEADS",
    "HEAD_SIZE",
    "LAYERS_PER_GROUP",
    "SHAPES",
    "Shape",
    "SimRequest",
    "SimWorld",
    "Violation",
    "expected_rows",
    "token_hashes",
]

class Violation(AssertionError):
    """An invariant the simulation checks was broken; the message says which and where."""


@dataclass
class _Work:
    """One request's part of a scheduled step, as the model runner takes it from the
    scheduler's output: positions ``[lo, hi)``, the block table, whether it samples."""

    rid: str
    lo: int
    hi: int
    ids: list[list[int]]
    samples: bool


@dataclass
class _Plan:
    """A scheduled step: vLLM's ``SchedulerOutput``, the model runner's work, and the
    model runner's output once it ran the step."""

    out: Any
    work: list[_Work]
    output: Any = None


class SimWorld:
    """vLLM's scheduler with kvtier attached, over simulated paged KV caches."""

    def __init__(self, root: Path, shape: Shape, kvtier_doc: dict[str, Any], *,
                 tp: int = 1, num_blocks: int = 96, block_size: int = 16,
                 max_num_seqs: int = 8, max_batched_tokens: int = 256,
                 max_model_len: int = 2048, async_scheduling: bool = False,
                 tp_skew: bool = False, seed: int = 0,
                 configure: Callable[[Any, Any], None] | None = None) -> None:
        """``async_scheduling``: vLLM's ``AsyncScheduler`` (the GPU default) with two
        steps in flight, instead of its synchronous ``Scheduler``; ``tp_skew``: TP ranks
        report finished transfers in different steps (``_skewed``); ``seed`` drives
        both (when the model runner runs a step, which rank reports late); ``configure``
        is called with the ``VllmConfig`` and the ``KVCacheConfig`` before anything is
        built from them (a test's vLLM settings)."""
        import collections
        import random

        from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.structured_output import StructuredOutputManager

        from kvtier.clock import ManualClock

        self.root = root
        self.shape = shape
        self.tp = tp
        self.bs = block_size
        self.clock = ManualClock()
        root.mkdir(parents=True, exist_ok=True)
        cfg_path = root / "kvtier.json"
        cfg_path.write_text(json.dumps(kvtier_doc))
        self.engine_id = f"sim-{os.getpid()}-{id(self):x}"
        self.vllm_config = vllm_config_for(root, cfg_path, shape, tp=tp, num_blocks=num_blocks,
                                        block_size=block_size, max_num_seqs=max_num_seqs,
                                        max_batched_tokens=max_batched_tokens,
                                        max_model_len=max_model_len,
                                        engine_id=self.engine_id,
                                        async_scheduling=async_scheduling)
        self.async_scheduling = async_scheduling
        self.tp_skew = tp_skew and tp > 1
        self._rng = random.Random(seed ^ 0x5EED)
        #: steps scheduled and not processed yet, newest first (async scheduling)
        self._queue: collections.deque[_Plan] = collections.deque()
        #: request -> tokens scheduled in steps the model runner has not run yet
        self._unrun: dict[str, int] = {}
        #: rank -> its outputs not reported yet (``_skewed``)
        self._held_back: dict[int, list[Any]] = {}
        #: blocks a load failed into, until a forward writes them from their start
        self._failed_blocks: set[int] = set()
        #: (request, rank) whose next forward checks what it attends to (a restore)
        self._attend_check: set[tuple[str, int]] = set()
        #: injected faults: rates, counts, and their own draws (``fail_copies``,
        #: ``fail_writes``; writes draw on IO threads)
        import threading

        self.copy_fault_rate = 0.0
        self.write_fault_rate = 0.0
        self.copy_faults = 0
        self.write_faults = 0
        self._fault_rng = random.Random(seed ^ 0xFA17)
        self._fault_lock = threading.Lock()
        self._writes_of: dict[Any, int] = {}
        self.seed = seed
        #: one aggregator for the engine's life, as vLLM's executor keeps
        self._aggregator = KVOutputAggregator(expected_finished_count=tp)
        self.kv_cache_config = kv_cache_config_for(shape, num_blocks, block_size, tp)
        if configure is not None:
            configure(self.vllm_config, self.kv_cache_config)
        self.group_names = [list(g.layer_names) for g in self.kv_cache_config.kv_cache_groups]
        self.width = [HEADS * tp * 2 * HEAD_SIZE if g != "mla" else HEAD_SIZE * 2
                      for g in shape.groups]
        #: every rank's KV caches (what its worker connector registered), by rank
        self.caches: list[dict[str, torch.Tensor]] = []
        # A read that finds no host slot free waits for one in real time
        # (``reads.SLOT_WAIT_MAX_S``), and only a step frees one: here, where steps wait
        # for reads (``_settle``), it gives up at once instead, so a run stays a function
        # of its seed (restored when the world closes)
        import kvtier.store.reads as reads
        from kvtier.metrics import export_enabled

        self._slot_wait_was = reads.SLOT_WAIT_MAX_S
        reads.SLOT_WAIT_MAX_S = 0.0
        # the connectors turn the process's metric export on; the world turns it back
        # off when it closes if it was off (tests share the process)
        self._export_was_on = export_enabled()
        # Workers first: vLLM registers their KV caches before building the scheduler.
        self.workers = [self._worker(rank) for rank in range(tp)]
        self.scheduler = (AsyncScheduler if async_scheduling else Scheduler)(
            vllm_config=self.vllm_config, kv_cache_config=self.kv_cache_config,
            structured_output_manager=StructuredOutputManager(self.vllm_config),
            block_size=block_size, log_stats=False)
        from kvtier.vllm.connector import KVTierConnector

        assert isinstance(self.scheduler.connector, KVTierConnector)
        self.connector: KVTierConnector = self.scheduler.connector
        self.preemptions = 0
        preempt = self.scheduler._preempt_request

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.preemptions += 1
            return preempt(*args, **kwargs)

        self.scheduler._preempt_request = counted  # type: ignore[method-assign]
        sched_side = self.connector.scheduler_side
        sched_side.clock = self.clock
        for breaker in sched_side.store.breakers:  # a slow or failed call is judged on
            breaker.clock = self.clock  # the world's time, not on how busy the host is
        if sched_side.flusher is not None:
            sched_side.flusher.clock = self.clock
        from vllm.utils.hashing import sha256_cbor  # type: ignore[import-not-found]
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

        init_none_hash(sha256_cbor)
        self._hasher = get_request_block_hasher(block_size, sha256_cbor)
        self.requests: dict[str, SimRequest] = {}
        self.steps = 0
        self.finished: set[str] = set()
        #: reads the world holds on purpose (a hung tier): not settled
        self.hung = False
        self._gate: Any = None  # threading.Event: set while lower tiers answer
        #: tokens each request produced (from vLLM's outputs)
        self.outputs: dict[str, list[int]] = {}
        self.finish_reasons: dict[str, str] = {}
        #: each finished request's ``kv_transfer_params`` (what its response carried)
        self.kv_params: dict[str, dict[str, Any]] = {}
        #: simulated time of one engine step (kvtier's deadlines run on it)
        self.step_seconds = 0.02
        #: tokens kvtier told vLLM it restores, by request (observed at allocation)
        self.restored: dict[str, int] = {}
        side = self.connector.scheduler_side
        alloc = side.update_state_after_alloc

        def observed(request: Any, blocks: Any, num_external: int) -> None:
            if num_external > 0:
                self.restored[request.request_id] = num_external
                self._attend_check.update((request.request_id, r) for r in range(tp))
            alloc(request, blocks, num_external)

        side.update_state_after_alloc = observed  # type: ignore[method-assign]
        # the lower tiers' start scans run on their own threads: a run starts once they
        # are done, so that its first lookups do not depend on how fast they were
        import time

        ends = time.monotonic() + 30.0
        while side.store.indexes_filling() and time.monotonic() < ends:
            time.sleep(0.005)  # another thread's scan: polled in real time, bounded

    # -- construction ---------------------------------------------------------------
    def _worker(self, rank: int) -> Any:
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        from kvtier.vllm.connector import KVTierConnector

        cfg = self.vllm_config
        cfg.parallel_config.rank = rank
        conn = KVTierConnector(cfg, KVConnectorRole.WORKER, self.kv_cache_config)
        cfg.parallel_config.rank = 0
        caches: dict[str, torch.Tensor] = {}
        ctx: dict[str, Any] = {}
        backend = mla_backend() if "mla" in self.shape.groups else CPUAttentionBackend
        for g, names in enumerate(self.group_names):
            for name in names:
                if self.shape.groups[g] == "mla":
                    caches[name] = torch.zeros(self.kv_cache_config.num_blocks, 1, self.bs,
                                               HEAD_SIZE * 2)
                else:
                    caches[name] = torch.zeros(self.kv_cache_config.num_blocks, HEADS,
                                               self.bs, 2 * HEAD_SIZE)
                ctx[name] = SimpleNamespace(get_attn_backend=lambda b=backend: b)
        cfg.compilation_config.static_forward_context = ctx
        conn._tp_rank = rank
        from unittest import mock

        import kvtier.vllm.connector as connector_module

        # One thread registers every rank, rank 0 (which creates the pool) first: no
        # process group, and no barrier to wait at.
        with mock.patch.object(connector_module, "_tp_barrier", lambda: _no_barrier):
            conn.register_kv_caches(caches)
        self.caches.append(caches)
        return conn

    # -- faults ---------------------------------------------------------------------
    def hang_reads(self) -> None:
        """Every lower tier stops answering reads and existence checks (a hard-mounted
        NFS server that died, a SIGSTOPped endpoint): calls block on IO threads until
        ``unhang``. kvtier's deadlines run on the world's clock, one step at a time."""
        import threading

        self.hung = True
        if self._gate is None:
            self._gate = threading.Event()
            for lt in self.connector.scheduler_side.store.lower:
                for name in ("get_into", "contains_prefix"):
                    setattr(lt.tier, name, _gated(getattr(lt.tier, name), self))
        self._gate.clear()

    def fail_copies(self, rate: float) -> None:
        """From now on each worker copy (a load's scatter, a save's gather) fails with
        probability ``rate`` (seeded), on any rank: a GPU copy that raised."""
        import dataclasses

        self.copy_fault_rate = rate
        for conn in self.workers:
            ws = conn.worker_side
            ws._copiers = [
                c if isinstance(c.backend, _FaultyBatches)
                else dataclasses.replace(c, backend=_FaultyBatches(c.backend, self))
                for c in ws._copiers]

    def fail_writes(self, rate: float) -> None:
        """From now on each lower-tier write fails with probability ``rate`` (an I/O
        error: a full or failing disk, an endpoint refusing)."""
        self.write_fault_rate = rate
        for lt in self.connector.scheduler_side.store.lower:
            transport: Any = getattr(lt.tier, "transport")  # noqa: B009 (file and S3 tiers)
            if not getattr(transport, "_sim_faulty", False):
                transport.write = _faulty_write(transport.write, self)
                transport._sim_faulty = True

    def unhang(self) -> None:
        """The tiers answer again; blocked calls go on."""
        self.hung = False
        if self._gate is not None:
            self._gate.set()

    # -- requests -------------------------------------------------------------------
    def add(self, rid: str, prompt: Sequence[int], *, max_tokens: int = 4,
            cache_salt: str | None = None, prompt_logprobs: int | None = None,
            kv_params: dict[str, Any] | None = None) -> None:
        from vllm import SamplingParams
        from vllm.v1.request import Request

        sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                            prompt_logprobs=prompt_logprobs)
        req = Request(rid, [int(t) for t in prompt], sp, None, arrival_time=float(self.steps),
                      cache_salt=cache_salt, block_hasher=self._hasher)
        if kv_params is not None:
            req.kv_transfer_params = kv_params
        salt = (cache_salt or "").encode()
        self.requests[rid] = SimRequest(rid, salt, [int(t) for t in prompt], max_tokens)
        self.scheduler.add_request(req)

    def abort(self, rid: str) -> None:
        from vllm.v1.request import RequestStatus

        if rid in self.scheduler.requests:
            self.scheduler.finish_requests([rid], RequestStatus.FINISHED_ABORTED)

    @property
    def idle(self) -> bool:
        """vLLM holds no request and no step is in flight (a rank's late reports may
        still be held: ``deliver_reports``)."""
        return (not self.scheduler.has_unfinished_requests() and not self.scheduler.requests
                and not self._queue)

    def deliver_reports(self) -> None:
        """Reports a rank held back (``_skewed``) reach the scheduler: an idle engine
        runs no step, so they wait for the next one, which this is (an empty step)."""
        skew, self.tp_skew = self.tp_skew, False
        try:
            while any(self._held_back.values()):
                self.steps += 1
                self._step_sync()
        finally:
            self.tp_skew = skew

    # -- one engine step ------------------------------------------------------------
    def step(self) -> None:
        """One call of vLLM's engine-core step. Synchronous scheduling: schedule, run
        the model, process its output. Asynchronous scheduling (vLLM 0.32's GPU
        default, ``EngineCore.step_with_batch_queue`` with two batches in flight): the
        next step is scheduled before the last one's output is processed, and the model
        runner executes a step at any point between its scheduling and the processing
        of its output (``_late``: after the next one was scheduled, the order that
        keeps a step's copies in flight longest)."""
        self.steps += 1
        self._settle()
        if not self.async_scheduling:
            self._step_sync()
        else:
            self._step_async()
        self.clock.advance(self.step_seconds)

    def _step_sync(self) -> None:
        """Schedule, run the model, process its output: one step, nothing in flight."""
        plan = self._schedule()
        self._process(plan, self._execute(plan))

    def _step_async(self) -> None:
        queue = self._queue
        if self.scheduler.has_requests():
            plan = self._schedule()
            queue.appendleft(plan)
            if not self._late():
                for p in reversed(queue):  # the model runs its steps in order
                    if p.output is None:
                        p.output = self._execute(p)
            if len(queue) < 2 and (plan.out.total_num_scheduled_tokens > 0
                                   or self.scheduler.has_requests()):
                return
        elif not queue:
            return
        plan = queue.pop()
        if plan.output is None:
            plan.output = self._execute(plan)
        self._process(plan, plan.output)

    def _late(self) -> bool:
        """Whether the model runner is still busy with earlier steps (seeded)."""
        return self._rng.random() < 0.5

    def _schedule(self) -> _Plan:
        """``Scheduler.schedule``, and what the model runner takes from its output: per
        scheduled request the positions it computes, its block table, and whether it
        samples (the last chunk of a prefill, or a decode)."""
        out = self.scheduler.schedule()
        sched = self.scheduler
        work = []
        for rid, n in out.num_scheduled_tokens.items():
            req = sched.requests[rid]
            hi = req.num_computed_tokens
            ids = [list(t) for t in sched.kv_cache_manager.get_block_ids(rid)]
            work.append(_Work(rid, hi - n, hi, ids, not req.is_prefill_chunk))
            self._unrun[rid] = self._unrun.get(rid, 0) + n
        return _Plan(out, work)

    def _execute(self, plan: _Plan) -> Any:
        """The model runner's step ``plan``, on every rank: the connector's hooks in
        vLLM's order around the forward, its report, and the sampled tokens."""
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        out = plan.out
        outputs = []
        for rank, conn in enumerate(self.workers):
            conn.bind_connector_metadata(out.kv_connector_metadata)
            fwd = SimpleNamespace(attn_metadata=None)
            if out.has_sync_kv_loads:
                conn.start_load_kv(fwd)
            self._forward(conn, plan)
            if not out.has_sync_kv_loads:
                conn.start_load_kv(fwd)
            conn.wait_for_save()
            results = conn.get_transfer_results(out.finished_req_ids)
            invalid = conn.get_block_ids_with_load_errors()
            self._failed_blocks |= invalid
            self._check_attended(plan, rank, invalid)
            kvo = KVConnectorOutput(
                finished_sending=results.finished_sending or None,
                finished_recving=results.finished_recving or None,
                failed_recving=set(results.failed_recving or ()),
                invalid_block_ids=invalid,
                kv_connector_worker_meta=conn.build_connector_worker_meta())
            conn.clear_connector_metadata()
            outputs.append(self._skewed(rank, kvo))
        for w in plan.work:
            self._unrun[w.rid] -= w.hi - w.lo
            if not self._unrun[w.rid]:
                del self._unrun[w.rid]
        req_ids = [w.rid for w in plan.work]
        sampled = [[self.requests[w.rid].sequence(w.hi + 1)[w.hi]] if w.samples else []
                   for w in plan.work]
        if self.tp > 1:
            merged = self._aggregator.aggregate(
                [ModelRunnerOutput(req_ids=[], req_id_to_index={}, kv_connector_output=o)
                 for o in outputs])
            assert merged is not None and merged.kv_connector_output is not None
            kvo = merged.kv_connector_output
        else:
            kvo = outputs[0]
        return ModelRunnerOutput(req_ids=req_ids,
                                 req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                 sampled_token_ids=sampled, kv_connector_output=kvo)

    def _skewed(self, rank: int, kvo: Any) -> Any:
        """``kvo`` as vLLM receives it from ``rank``: at TP > 1 a rank other than the
        first reports, now and then, its finished transfers and worker metadata a step
        or two late (its copies ran longer), as TP ranks do on GPUs. Load errors stay in
        their step (a synchronous load's forward ran on them)."""
        from vllm.v1.outputs import KVConnectorOutput

        held = self._held_back.setdefault(rank, [])
        if rank == 0 or (not self.tp_skew and not held):
            return kvo
        held.append(kvo)
        if self.tp_skew and self._rng.random() < 0.4 and len(held) < 3:
            return KVConnectorOutput(invalid_block_ids=kvo.invalid_block_ids)
        self._held_back[rank] = []
        sending: set[str] = set()
        recving: set[str] = set()
        failed: set[str] = set()
        meta: Any = None
        for o in held:
            sending |= o.finished_sending or set()
            recving |= o.finished_recving or set()
            failed |= o.failed_recving or set()
            m = o.kv_connector_worker_meta
            meta = m if meta is None else (meta if m is None else meta.aggregate(m))
        return KVConnectorOutput(finished_sending=sending or None,
                                 finished_recving=recving or None, failed_recving=failed,
                                 invalid_block_ids=kvo.invalid_block_ids,
                                 kv_connector_worker_meta=meta)

    def _process(self, plan: _Plan, mro: Any) -> None:
        eco = self.scheduler.update_from_output(plan.out, mro)
        for outs in eco.values():
            for o in outs.outputs:
                self.outputs.setdefault(o.request_id, []).extend(o.new_token_ids)
                if o.finish_reason is not None:
                    self.finished.add(o.request_id)
                    self.finish_reasons[o.request_id] = str(o.finish_reason)
                    self.kv_params[o.request_id] = o.kv_transfer_params or {}

    def _settle(self, timeout: float = 10.0) -> None:
        """Let kvtier's IO threads finish what the scheduler side is waiting for (its
        probes and stagings) before the next step, so that a run is a function of its
        seed and not of thread timing. Work the world holds on purpose (``hung``) is not
        waited for."""
        import concurrent.futures as cf

        side = self.connector.scheduler_side
        futs: list[cf.Future[Any]] = [p.future for p in side._probes.values()]
        futs += [p.future for p in side._tail_probes.values()]
        futs += [lk.future for lk in side._lookups.values() if lk.future is not None]
        futs += [st.future for st in side._streams.values() if st.future is not None]
        pending = [f for f in futs if not f.done()]
        if pending and not self.hung:
            cf.wait(pending, timeout=timeout)
        if not self.hung:
            side.store.flush(timeout)  # lower-tier writes finish between two steps

    def _forward(self, conn: Any, plan: _Plan) -> None:
        """The forward of one rank: the KV of every token each scheduled request computes
        is written into its blocks of every group (what it attends to is checked once
        the step's load errors are known: ``_check_attended``)."""
        rank = self.workers.index(conn)
        for w in plan.work:  # every layer writes its KV before its attention reads
            seq = self.requests[w.rid].sequence(w.hi)
            self._write(rank, w.ids, self.requests[w.rid].hashes_for(seq), w.lo, w.hi)

    def _check_attended(self, plan: _Plan, rank: int, invalid: set[int]) -> None:
        """What each request restored by kvtier attended to in its first forward after
        the restore was its prefix's KV (the bytes are as the forward left them: a
        synchronous load ran before it, an asynchronous one was reported done before
        its request was scheduled). A request with a block whose load failed this step
        is skipped: vLLM discards that step's output and recomputes from the block."""
        for w in plan.work:
            if (w.rid, rank) not in self._attend_check or w.lo == 0:
                continue
            self._attend_check.discard((w.rid, rank))
            if any(b in self._failed_blocks for t in w.ids for b in t):
                continue
            self._check_request(w.rid, w.lo, w.ids, rank, "its forward read")

    def _write(self, rank: int, ids: Sequence[Sequence[int]], hashes: np.ndarray,
               lo: int, hi: int) -> None:
        for table in ids:  # a block whose load failed is good again once recomputed
            self._failed_blocks.difference_update(
                table[p // self.bs] for p in range(lo, hi) if p % self.bs == 0)
        flat = 0
        for g, names in enumerate(self.group_names):
            table = ids[g]
            for name in names:
                rows = self._rank_rows(expected_rows(hashes[lo:hi], flat, self.width[g]),
                                       g, rank)
                cache = self.caches[rank][name]
                for p in range(lo, hi):
                    b = table[p // self.bs]
                    assert b != 0, "computing into vLLM's null block"
                    self._row(cache, g, b, p % self.bs)[...] = rows[p - lo]
                flat += 1

    def _rank_rows(self, rows: np.ndarray, g: int, rank: int) -> torch.Tensor:
        """This rank's part of each row: its heads (MLA: all of it)."""
        t = torch.from_numpy(rows)
        if self.shape.groups[g] == "mla":
            return t
        t = t.view(-1, HEADS * self.tp, 2 * HEAD_SIZE)
        return t[:, rank * HEADS : (rank + 1) * HEADS]

    def _row(self, cache: torch.Tensor, g: int, block: int, off: int) -> torch.Tensor:
        if self.shape.groups[g] == "mla":
            return cache[block, 0, off]
        return cache[block, :, off]

    # -- invariants ------------------------------------------------------------------
    def check_blocks(self) -> int:
        """Every running request's blocks that vLLM counts as computed (all positions
        below its ``num_computed_tokens``, less the tokens of steps the model runner has
        not run yet, in every group, except vLLM's null blocks of window groups) hold
        exactly the bytes of their prefix, on every rank. Returns the number of blocks
        checked; raises ``Violation``."""
        from vllm.v1.request import RequestStatus

        checked = 0
        sched = self.scheduler
        # blocks that steps not run yet write (another request's prefix-cache hit on a
        # block being computed in the same step included): checked once they ran
        unrun = {(g, b) for p in self._queue if p.output is None for w in p.work
                 for g, t in enumerate(w.ids) for b in t}
        # and blocks whose load failed, until a forward writes them again: vLLM
        # recomputes them, but 0.32 lets a request that shares such a block with the one
        # that recomputes it keep counting it as computed meanwhile (its
        # ``_update_requests_with_invalid_blocks``: only the first sharer recomputes)
        unrun |= {(g, b) for g in range(len(self.group_names)) for b in self._failed_blocks}
        for req in sched.running:
            if req.status != RequestStatus.RUNNING:
                continue
            rid = req.request_id
            hi = req.num_computed_tokens - self._unrun.get(rid, 0)
            if hi <= 0:
                continue
            ids = sched.kv_cache_manager.get_block_ids(rid)
            for rank in range(self.tp):
                checked += self._check_request(rid, hi, ids, rank, "computed", whole=True,
                                               skip=unrun)
        return checked

    def _check_request(self, rid: str, hi: int, ids: Sequence[Sequence[int]], rank: int,
                       what: str, *, whole: bool = False,
                       skip: set[tuple[int, int]] | None = None) -> int:
        """Positions ``[0, hi)`` of ``rid`` in blocks ``ids`` on ``rank`` hold the KV of
        their prefix (``whole``: every non-null block; else, for window and chunked
        groups, only the blocks a forward at ``hi`` attends to), except blocks ``(group,
        id)`` in ``skip``. Returns the blocks checked; raises ``Violation``."""
        hashes = self.requests[rid].hashes_for(self.requests[rid].sequence(hi))
        checked = 0
        flat = 0
        for g, names in enumerate(self.group_names):
            table = ids[g]
            kind = self.shape.groups[g]
            lo = 0
            if not whole and kind.startswith("window:"):
                lo = max(0, hi - int(kind.split(":")[1]))
            elif not whole and kind.startswith("chunked:"):
                span = int(kind.split(":")[1])
                lo = (hi - 1) // span * span
            for name in names:
                want = self._rank_rows(expected_rows(hashes[:hi], flat, self.width[g]),
                                       g, rank)
                cache = self.caches[rank][name]
                for bi in range(lo // self.bs, -(-hi // self.bs)):
                    b = table[bi]
                    if b == 0 or (skip and (g, b) in skip):
                        continue  # vLLM's null block: outside a window
                    p0, p1 = bi * self.bs, min(hi, (bi + 1) * self.bs)
                    got = (cache[b, 0, : p1 - p0] if kind == "mla"
                           else cache[b, :, : p1 - p0].transpose(0, 1))
                    if not torch.equal(got, want[p0:p1]):
                        raise Violation(
                            f"step {self.steps}: request {rid} block {bi} (id {b}, group {g} "
                            f"{kind}, layer {name}, rank {rank}) does not hold the KV of its "
                            f"prefix (positions {p0}..{p1} of {hi} {what})")
                    checked += 1
                flat += 1
        return checked

    def check_outputs(self) -> int:
        """Every request that finished by length produced exactly what a recompute
        would (its reference: the greedy continuation of its prompt). Returns how many
        were compared; raises ``Violation``."""
        n = 0
        for rid in sorted(self.finished):
            if self.finish_reasons.get(rid) != "length":
                continue
            got, want = self.outputs.get(rid, []), self.requests[rid].reference_output()
            if got != want:
                raise Violation(f"request {rid} produced {got[:8]}... ({len(got)} tokens), "
                                f"a recompute {want[:8]}... ({len(want)} tokens)")
            n += 1
        return n

    def close(self) -> None:
        from kvtier.vllm.shm import remove_published

        self.unhang()
        try:
            self.connector.shutdown()
        finally:
            for rank, conn in enumerate(self.workers):
                conn.shutdown()
                remove_published(conn.worker_side.pool_path, rank)
            import kvtier.store.reads as reads

            reads.SLOT_WAIT_MAX_S = self._slot_wait_was
            if not self._export_was_on:
                from kvtier.metrics import disable_export

                disable_export()


def _gated(call: Any, world: SimWorld) -> Any:
    """``call``, blocking while ``world``'s lower tiers hang (at most a minute: a world
    that never unhangs must not leave threads behind forever)."""

    def gated(*args: Any, **kwargs: Any) -> Any:
        gate = world._gate
        if gate is not None:
            gate.wait(60.0)
        return call(*args, **kwargs)

    return gated


class _FaultyBatches:
    """A copy backend whose copies fail at the world's ``copy_fault_rate``."""

    def __init__(self, inner: Any, world: SimWorld) -> None:
        self.inner = inner
        self.world = world

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def batch(self, device: Any) -> Any:
        return _FaultyBatch(self.inner.batch(device), self.world)


class _FaultyBatch:
    def __init__(self, inner: Any, world: SimWorld) -> None:
        self.inner = inner
        self.world = world

    def _maybe_fail(self, what: str) -> None:
        if self.world._fault_rng.random() < self.world.copy_fault_rate:
            self.world.copy_faults += 1  # the model thread: the world's own
            raise RuntimeError(f"simulated {what} copy failure")

    def gather(self, *args: Any, **kwargs: Any) -> Any:
        self._maybe_fail("save")
        return self.inner.gather(*args, **kwargs)

    def scatter(self, *args: Any, **kwargs: Any) -> Any:
        self._maybe_fail("load")
        return self.inner.scatter(*args, **kwargs)

    def mark(self) -> Any:
        return self.inner.mark()


def _faulty_write(call: Any, world: SimWorld) -> Any:
    """``call`` (a transport's write), raising an I/O error at the world's
    ``write_fault_rate``. IO threads call it, in any order: whether a write fails is a
    function of the seed, its key and how often that key was written, not of the
    order (the count is locked)."""
    import errno
    import hashlib

    def write(key: Any, *args: Any, **kwargs: Any) -> Any:
        with world._fault_lock:
            n = world._writes_of[key] = world._writes_of.get(key, 0) + 1
        draw = hashlib.blake2b(f"{world.seed}:{key.hex()}:{n}".encode(),
                               digest_size=4).digest()
        if int.from_bytes(draw, "little") / 2**32 < world.write_fault_rate:
            with world._fault_lock:
                world.write_faults += 1
            raise OSError(errno.EIO, "simulated write failure")
        return call(key, *args, **kwargs)

    return write


def _no_barrier() -> None:
    """The TP group's barrier, for ranks registered one after the other."""


