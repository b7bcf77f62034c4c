"""The scheduler side's per-engine state: one object, every room of ``scheduler/``
is a mixin over it.

Threads: every hook of every room runs on vLLM's scheduler thread, in vLLM's
engine-core process, and does memory work only (no I/O, no waiting). Store futures
(stagings, probes, streamed reads) complete on the store's IO threads and are only
polled here (``done()``) or handed a callback that releases what they hold
(``release_when_done`` may run on an IO thread: releasing a ``Held`` is thread-safe).
Nothing here is locked: only the scheduler thread touches this state.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from kvtier.build import build_store
from kvtier.clock import SYSTEM_CLOCK, Clock
from kvtier.config import KVTierConfig
from kvtier.costmodel import CostModel, Decision
from kvtier.flusher import IdleFlusher
from kvtier.keys import ChunkKey, Namespace
from kvtier.store import Held, LoadProgress, TieredStore, WritePolicy
from kvtier.tiers.host import HostTier
from kvtier.tiers.pool import HostPool
from kvtier.vllm.geometry import Geometry
from kvtier.vllm.identity import RequestIdentities
from kvtier.vllm.protocol import CopyOp
from kvtier.vllm.scheduler.records import (
    STAGED_FRACTION,
    _Keys,
    _Probe,
    _request_params,
    _request_threshold,
    _Save,
    _SaveStream,
    _Staging,
)
from kvtier.vllm.scheduler.shapes import Shape
from kvtier.vllm.shm import attach_host_pool
from kvtier.vllm.stopsignal import chain_stop_signals
from kvtier.vllm.stream import (
    STREAM_WINDOW_MAX,
    StreamedLoad,
    release_when_done,
)
from kvtier.vllm.threshold import StepTimer, threshold_policy
from kvtier.vllm.waitbound import WaitBound

log = logging.getLogger("kvtier.vllm")


class SchedulerState:
    """The scheduler side's state (thread rules: the module's docstring) and the small
    helpers every room uses."""

    def __init__(
        self,
        cfg: KVTierConfig,
        geometry: Geometry,
        namespace: Namespace,
        pool_path: Any,
        *,
        store: TieredStore | None = None,
        role: str = "both",
        clock: Clock = SYSTEM_CLOCK,
        overlapped_steps: bool = False,
        loads: bool = True,
        saves: bool = True,
    ) -> None:
        """``overlapped_steps``: vLLM runs more than one step at a time (its async
        scheduling, vLLM 0.32's GPU default, or pipeline parallelism): every restore is
        then an asynchronous load (``_loaded``). ``loads`` / ``saves``: whether this
        engine restores from kvtier and stores into it at all (``settings``: vLLM's
        ``kv_role`` by default)."""
        self.cfg = cfg
        self.loads = loads
        self.saves = saves
        #: vLLM schedules a step before the last one's output is processed. A
        #: synchronous load that fails is reported with its step's output, after the
        #: next step already ran on the blocks (and sampled from them): vLLM 0.32 then
        #: rolls the request back but keeps that next step's token. An asynchronous load
        #: holds its request until the worker reports it, failed or not: no forward ever
        #: reads a block whose load failed.
        self.async_restores = overlapped_steps
        self.geom = geometry
        #: the model's shape: its start, loads and finish, picked once (``shapes.py``)
        self.shape: Shape = self._shape()
        self.ns = namespace
        self.ct = cfg.chunk_tokens
        self.bs = geometry.block_size
        self.bpc = geometry.blocks_per_chunk(self.ct)
        self.slot_bytes = geometry.chunk_bytes(self.ct)
        #: store and restore partial tails (block granularity); a one-block chunk has none
        self.tails = cfg.partial_tails and self.bpc > 1
        #: KV events (``kvtier.vllm.events``): told ``(key, group, first block, blocks)``
        #: of the tails, window parts and hybrid pieces a finishing request is about to
        #: save, so their stores and removals can be published; None without events
        self.on_pieces: Callable[[Any, Sequence[tuple[ChunkKey, int, int, int]]], int] \
            | None = None
        self.store = store or self._build_store(pool_path)
        self.policy = threshold_policy(cfg.restore, self.store, self.slot_bytes,
                                       probe=store is None)
        self._bad_threshold_logged = False
        #: the engine's prefill speed, measured whatever the threshold policy: it bounds
        #: every wait on storage by the recompute it would save (``waitbound``)
        steps_model = self.policy.model or CostModel(warmup_steps=cfg.restore.auto_warmup_steps)
        self.step_timer: StepTimer | None = StepTimer(steps_model, self.slot_bytes // self.bpc)
        self.waits = WaitBound(steps_model.steps, floor_s=cfg.restore.min_wait_seconds)
        self._lookups: dict[str, _Staging] = {}
        self._saves: dict[str, _Save] = {}
        #: req -> its save streamed through the host pool (``Saves._save_pieces``)
        self._save_streams: dict[str, _SaveStream] = {}
        #: step -> (ranks that acknowledged its streamed saves, whether one failed)
        self._save_acks: dict[int, tuple[int, bool]] = {}
        self._loads: list[CopyOp] = []
        self._load_holds: list[Held] = []
        self._to_save: list[CopyOp] = []
        self._holds_by_step: dict[int, list[Held]] = {}
        self._load_acks: dict[int, int] = {}  # step -> ranks that reported its loads done
        self._failed_saves: set[str] = set()  # a rank failed the save; not finished yet
        self._restored: dict[str, tuple[dict[str, int], float]] = {}
        self._waiting: dict[str, float] = {}  # decode: req -> when it started waiting
        self._decisions: dict[str, Decision] = {}  # req -> restore-or-recompute decision
        self._probes: dict[str, _Probe] = {}  # req -> its question to the lower tiers
        #: req -> its question about its tail, asked after its chunks' (``_probing``)
        self._tail_probes: dict[str, _Probe] = {}
        #: req -> blocks its asynchronous load copies (a hybrid model's), until finished
        self._async_blocks: dict[str, int] = {}
        #: requests whose asynchronous load is issued and not reported received yet: vLLM
        #: frees such a request's blocks itself when the load is reported, so kvtier
        #: must not also delay their free with a save
        self._recving: set[str] = set()
        #: requests whose load failed: not restored again (until they finish)
        self._load_failed: set[str] = set()
        #: req -> (tokens by tier, staging ms) of its asynchronous load (hybrid, streamed)
        #: whose copies the worker has not reported received yet: counted as restored
        #: (metrics, ``kv_transfer_params``) only once they are, never if they fail
        self._unconfirmed: dict[str, tuple[dict[str, int], float]] = {}
        #: req -> when the staging cap first refused it room (stage ``cap``)
        self._capped: dict[str, float] = {}
        #: req -> when (``clock``) the staging cap first refused it: its wait's deadline
        self._cap_since: dict[str, float] = {}
        #: the engine step ``_grace_left`` is for, and the seconds of ``READ_GRACE_S``
        #: that step has left for the lookups' reads (``Lookups._read_grace``)
        self._grace_step = -1
        self._grace_left = 0.0
        self.lookup_timeout_s = cfg.restore.lookup_timeout_seconds
        self._staged_cap = max(1, int(self.store.host.pool.num_slots * STAGED_FRACTION))
        #: a restore of more entries than the staging cap is streamed through this many
        #: host slots (``stream.py``)
        self._stream_window = max(1, min(STREAM_WINDOW_MAX, self._staged_cap))
        #: save streams together hold at most this many uncommitted slots: the rest of
        #: the pool stays for restores (the staging cap) and for written chunks
        self._save_room = max(1, self.store.host.pool.num_slots - self._staged_cap)
        self._streams: dict[str, StreamedLoad] = {}  # req -> its streamed restore
        self._async_reqs: list[str] = []  # streamed requests with loads this step
        #: a load that read no chunk for this long is abandoned (the request recomputes)
        self.load_stall_s = (cfg.restore.load_timeout_seconds
                             + self.slot_bytes / (cfg.health.min_mib_per_second * 2**20))
        self._key_cache: dict[str, _Keys] = {}  # req -> identity, keys of its full chunks
        #: req -> the weights epoch it was first seen in: KV computed across a weights
        #: reset is stored under neither epoch
        self._epoch_of: dict[str, int] = {}
        self.identities = RequestIdentities(namespace, self.ct,
                                            salt_check=_salt_check(cfg))
        self._step = 0
        self.role = role
        self.clock = clock  # the decode wait deadline; latencies use perf_counter
        self.wait_s = cfg.restore.wait_seconds
        self.lease_s = cfg.retention.lease_seconds
        self.flusher: IdleFlusher | None = None
        if self.store.lower:
            back = any(lt.write is WritePolicy.BACK for lt in self.store.lower)
            self.flusher = IdleFlusher(
                self.store, cfg.idle_flush_seconds if back else 0.0,
                max_dirty_s=cfg.max_dirty_seconds if back else 0.0,
                stop_budget_s=cfg.shutdown_flush_seconds, clock=clock)
            if store is None:  # the engine's own store: run in the background, and
                self.flusher.start()  # start flushing at the first stop signal
                chain_stop_signals(self.flusher.request_stop)

    def _shape(self) -> Shape:
        """The model's shape (``shapes.shape_of``), answered by ``SchedulerSide``: it
        names methods of every room."""
        raise NotImplementedError

    def _build_store(self, pool_path: Any) -> TieredStore:
        """The store over the worker's pool (it created, touched and page-locked it)."""
        num_slots = HostPool.slots_for(self.cfg.host.capacity, self.slot_bytes)
        host = HostTier.over(attach_host_pool(pool_path, self.slot_bytes, num_slots))
        return build_store(self.cfg, self.slot_bytes, host=host)

    def _forget(self, req_id: str) -> None:
        lk = self._lookups.pop(req_id, None)
        if lk is None:
            return
        if lk.held is not None:
            lk.held.release()
        if lk.future is not None:
            lk.future.add_done_callback(release_when_done)

    def _tell_ended(self, rid: str) -> None:
        """End the asynchronous load of ``rid`` (in ``_recving``) with an op that fails
        on purpose: the worker reports the request received, and failed (vLLM recomputes
        it, or frees it if it was aborted). A stream cancelled before the worker was sent
        any op of it needs this, or vLLM waits for the report for the engine's life (a
        request aborted in ``WAITING_FOR_REMOTE_KVS`` is freed only then); so does one
        whose KV must not be delivered (a weights reset)."""
        self._loads.append(CopyOp(rid, -1, [], 0, 0))
        self._async_reqs.append(rid)

    def _may_load(self, request: Any) -> bool:
        """Whether kvtier may restore KV for ``request``: the engine loads, and the
        request did not say ``load: false``."""
        return self.loads and _request_params(request).get("load") is not False

    def _may_save(self, request: Any) -> bool:
        """Whether kvtier may store ``request``'s KV: the engine saves, and the request
        did not say ``save: false``."""
        return self.saves and _request_params(request).get("save") is not False

    def _own_threshold(self, request: Any) -> int | None:
        """The request's own fixed threshold (``kvtier.recompute_threshold_tokens``), if
        it set a valid one; an invalid one is ignored, with one warning per engine."""
        own, bad = _request_threshold(_request_params(request))
        if bad and not self._bad_threshold_logged:
            self._bad_threshold_logged = True
            log.warning("kvtier: ignoring kv_transfer_params.kvtier."
                        "recompute_threshold_tokens (not a non-negative integer)")
        return own

    def _idle_bound(self, configured_s: float, progress: LoadProgress | None,
                    start_tokens: int, end_tokens: int) -> float:
        """How long a load or probe (``progress``) of tokens ``[start_tokens,
        end_tokens)`` may stay idle, asked now as it waits (``WaitBound.seconds``: the
        recompute of those tokens once a call it waits on has run that long, or the
        storage is suspect; else ``configured_s``). Memory only."""
        store = self.store
        stalled = None if progress is None else (
            lambda seconds: store.stalled(progress, seconds))
        return self.waits.seconds(configured_s, start_tokens, end_tokens,
                                  self.clock.monotonic(), stalled)

    def _progress(self, rid: str) -> LoadProgress:
        """A new load's progress, charged with the time its request waited for room
        under the staging cap (stage ``cap``)."""
        progress = LoadProgress(self.clock)
        capped = self._capped.pop(rid, None)
        if capped is not None:
            progress.waited("cap", time.perf_counter() - capped)
        return progress

    def _staged_chunks(self) -> int:
        """Host chunks held or being read for requests vLLM has not admitted yet, and
        for streamed restores."""
        return (sum(lk.chunks for lk in self._lookups.values())
                + sum(st.in_flight() for st in self._streams.values()))


def _salt_check(cfg: KVTierConfig) -> Callable[[object], bool] | None:
    """``tenancy.require_router_salt``'s check, with the secrets it names."""
    if not cfg.tenancy.require_router_salt:
        return None
    from kvtier.tenancy import SaltCheck, load_secrets

    return SaltCheck(load_secrets(cfg.tenancy.secret_file))
