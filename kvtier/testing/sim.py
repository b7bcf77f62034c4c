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
from collections.abc import Sequence
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


class SimWorld:
    """vLLM's scheduler with kvtier attached, over simulated paged KV caches."""

    def __init__(self, root: Path, shape: Shape, kvtier_doc: dict[str, Any], *,
                 tp: int = 1, num_blocks: int = 96, block_size: int = 16,
                 max_num_seqs: int = 8, max_batched_tokens: int = 256,
                 max_model_len: int = 2048) -> None:
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
                                        engine_id=self.engine_id)
        self.kv_cache_config = kv_cache_config_for(shape, num_blocks, block_size, tp)
        self.group_names = [list(g.layer_names) for g in self.kv_cache_config.kv_cache_groups]
        self.width = [HEADS * tp * 2 * HEAD_SIZE if g != "mla" else HEAD_SIZE * 2
                      for g in shape.groups]
        #: every rank's KV caches (what its worker connector registered), by rank
        self.caches: list[dict[str, torch.Tensor]] = []
        from kvtier.metrics import export_enabled

        # the connectors turn the process's metric export on; the world turns it back
        # off when it closes if it was off (tests share the process)
        self._export_was_on = export_enabled()
        # Workers first: vLLM registers their KV caches before building the scheduler.
        self.workers = [self._worker(rank) for rank in range(tp)]
        self.scheduler = Scheduler(
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
        #: simulated time of one engine step (kvtier's deadlines run on it)
        self.step_seconds = 0.02
        #: tokens kvtier told vLLM it restores, by request (observed at allocation)
        self.restored: dict[str, int] = {}
        side = self.connector.scheduler_side
        alloc = side.update_state_after_alloc

        def observed(request: Any, blocks: Any, num_external: int) -> None:
            if num_external > 0:
                self.restored[request.request_id] = num_external
            alloc(request, blocks, num_external)

        side.update_state_after_alloc = observed  # type: ignore[method-assign]

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
        self.requests[rid] = SimRequest(rid, salt)
        self.scheduler.add_request(req)

    def abort(self, rid: str) -> None:
        from vllm.v1.request import RequestStatus

        if rid in self.scheduler.requests:
            self.scheduler.finish_requests([rid], RequestStatus.FINISHED_ABORTED)

    @property
    def idle(self) -> bool:
        return not self.scheduler.has_unfinished_requests() and not self.scheduler.requests

    # -- one engine step ------------------------------------------------------------
    def step(self) -> None:
        from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        self.steps += 1
        self._settle()
        out = self.scheduler.schedule()
        outputs = []
        for conn in self.workers:
            conn.bind_connector_metadata(out.kv_connector_metadata)
            fwd = SimpleNamespace(attn_metadata=None)
            if out.has_sync_kv_loads:
                conn.start_load_kv(fwd)
            self._compute(conn, out)
            if not out.has_sync_kv_loads:
                conn.start_load_kv(fwd)
            conn.wait_for_save()
            results = conn.get_transfer_results(out.finished_req_ids)
            kvo = KVConnectorOutput(
                finished_sending=results.finished_sending or None,
                finished_recving=results.finished_recving or None,
                failed_recving=set(results.failed_recving or ()),
                invalid_block_ids=conn.get_block_ids_with_load_errors(),
                kv_connector_worker_meta=conn.build_connector_worker_meta())
            conn.clear_connector_metadata()
            outputs.append(kvo)
        if self.tp > 1:
            merged = KVOutputAggregator(expected_finished_count=self.tp).aggregate(
                [ModelRunnerOutput(req_ids=[], req_id_to_index={}, kv_connector_output=o)
                 for o in outputs])
            assert merged is not None and merged.kv_connector_output is not None
            kvo = merged.kv_connector_output
        else:
            kvo = outputs[0]
        req_ids = list(out.num_scheduled_tokens)
        sampled = [self._sample(rid) for rid in req_ids]
        mro = ModelRunnerOutput(req_ids=req_ids,
                                req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                sampled_token_ids=sampled, kv_connector_output=kvo)
        eco = self.scheduler.update_from_output(out, mro)
        for outs in eco.values():
            for o in outs.outputs:
                self.outputs.setdefault(o.request_id, []).extend(o.new_token_ids)
                if o.finish_reason is not None:
                    self.finished.add(o.request_id)
        self.clock.advance(self.step_seconds)

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

    def _compute(self, conn: Any, out: Any) -> None:
        """The forward: the KV of every token scheduled this step, written into the
        request's blocks of every group (positions ``[computed - scheduled, computed)``:
        vLLM advanced ``num_computed_tokens`` when it scheduled)."""
        sched = self.scheduler
        for rid, n in out.num_scheduled_tokens.items():
            req = sched.requests[rid]
            hi = req.num_computed_tokens
            lo = hi - n
            toks = req.all_token_ids
            hashes = self.requests[rid].hashes_for(toks[:hi])
            ids = sched.kv_cache_manager.get_block_ids(rid)
            self._write(conn, ids, hashes, lo, hi)

    def _write(self, conn: Any, ids: Sequence[Sequence[int]], hashes: np.ndarray,
               lo: int, hi: int) -> None:
        rank = self.workers.index(conn)
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

    def _sample(self, rid: str) -> list[int]:
        req = self.scheduler.requests[rid]
        if req.num_computed_tokens < req.num_tokens:
            return []  # a chunk of a prefill: nothing sampled
        h = self.requests[rid].hashes_for(req.all_token_ids)[req.num_tokens - 1]
        return [int(h % np.uint64(400)) + 3]

    # -- invariants ------------------------------------------------------------------
    def check_blocks(self) -> int:
        """Every running request's blocks that vLLM counts as computed (all positions
        below its ``num_computed_tokens``, in every group, except vLLM's null blocks of
        window groups) hold exactly the bytes of their prefix, on every rank. Returns the
        number of blocks checked; raises ``Violation``."""
        from vllm.v1.request import RequestStatus

        checked = 0
        sched = self.scheduler
        for req in sched.running:
            if req.status != RequestStatus.RUNNING:
                continue
            rid = req.request_id
            hi = req.num_computed_tokens
            if hi == 0:
                continue
            hashes = self.requests[rid].hashes_for(req.all_token_ids[:hi])
            ids = sched.kv_cache_manager.get_block_ids(rid)
            for rank in range(self.tp):
                flat = 0
                for g, names in enumerate(self.group_names):
                    table = ids[g]
                    for name in names:
                        want = self._rank_rows(expected_rows(hashes[:hi], flat,
                                                             self.width[g]), g, rank)
                        cache = self.caches[rank][name]
                        for bi in range(-(-hi // self.bs)):
                            b = table[bi]
                            if b == 0:
                                continue  # vLLM's null block: outside a window
                            p0, p1 = bi * self.bs, min(hi, (bi + 1) * self.bs)
                            got = (cache[b, 0, : p1 - p0] if self.shape.groups[g] == "mla"
                                   else cache[b, :, : p1 - p0].transpose(0, 1))
                            if not torch.equal(got, want[p0:p1]):
                                raise Violation(
                                    f"step {self.steps}: request {rid} block {bi} (id {b}, "
                                    f"group {g} {self.shape.groups[g]}, layer {name}, rank "
                                    f"{rank}) does not hold the KV of its prefix "
                                    f"(positions {p0}..{p1} of {hi} computed)")
                            checked += 1
                        flat += 1
        return checked

    def close(self) -> None:
        from kvtier.vllm.shm import remove_published

        self.unhang()
        try:
            self.connector.shutdown()
        finally:
            for rank, conn in enumerate(self.workers):
                conn.shutdown()
                remove_published(conn.worker_side.pool_path, rank)
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


def _no_barrier() -> None:
    """The TP group's barrier, for ranks registered one after the other."""


