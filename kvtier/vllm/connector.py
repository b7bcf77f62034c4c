"""``KVTierConnector``: kvtier as a vLLM v1 KV connector.

Load it with::

    --kv-transfer-config '{"kv_connector": "KVTierConnector",
                           "kv_connector_module_path": "kvtier.vllm",
                           "kv_role": "kv_both",
                           "kv_load_failure_policy": "recompute",
                           "kv_connector_extra_config": {"config": "configs/local.yaml"}}'

``kv_load_failure_policy`` must be ``recompute`` (vLLM's default, ``fail``, turns every
restore kvtier cannot complete into an error returned to the user; a cache recomputes
instead): the connector refuses to start otherwise, naming the setting. ``kv_role``
sets what the engine does by default (``settings``): ``kv_both`` loads and saves, a
``kv_producer`` never loads, a ``kv_consumer`` never saves.

vLLM constructs one instance per process: role SCHEDULER in the engine core (bookkeeping,
``scheduler_side.SchedulerSide``) and role WORKER in each worker (bytes,
``worker_side.WorkerSide``). This class only routes vLLM's hooks to the side that owns
them; bad settings fail here, at engine start, naming the field. Both sides hand their
process's counts to vLLM's connector stats every step (``kvtier/vllm/stats.py``), which
shows them on the API server's ``/metrics``.

Start-up order (vLLM's ``EngineCore.__init__``): every worker's connector is built and
its ``register_kv_caches`` runs (inside ``_initialize_kv_caches``) before the scheduler,
and with it the scheduler-side connector, is constructed. The worker creates the shared
host pool and publishes what only it sees of the KV bytes next to it (``PhysicalKV``:
the layout of the tensors it registered, the fp8 k/v scales of its attention layers;
``shm.publish_physical``); the scheduler-side constructor reads that
(``shm.read_all_physical``) and only then builds the engine's namespace, from which every
key is made. The worker never builds a namespace (nor hashes the weights).

Tensor parallel: every rank's worker connector registers its own KV caches (its share of
the heads). One host pool serves the engine; a slot holds every rank's part of a chunk,
rank after rank, and each worker copies only its own (``WorkerSide.register``). vLLM's
``KVOutputAggregator`` reports a request's save finished only once every rank has; a
step's loads complete when every rank says so (``KVTierWorkerMetadata.loaded_steps``
counts ranks), and a save any rank failed is never committed. Pipeline and context
parallel are refused.

Hybrid models (``SupportsHMA``): vLLM keeps its hybrid KV-cache manager on and calls
``request_finished_all_groups`` with every group's blocks. Each group is stored as objects
of its own (``hybrid.py``); restores are asynchronous and a failed one is reported per
request (``get_transfer_results``' ``failed_recving``), because vLLM cannot map a
block-level error to a request when block ids repeat across groups.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

from kvtier.metrics import drain_export, enable_export, record_worker_step
from kvtier.tiers.base import TierError
from kvtier.vllm.events import KVEvents
from kvtier.vllm.eventsetup import engine_waker, events_for
from kvtier.vllm.geometry import geometry_from_kv_cache_config, namespace_for, tp_placement
from kvtier.vllm.physical import (
    PhysicalKV,
    check_kv_scales_config,
    describe_layout,
    kv_scales_digest,
)
from kvtier.vllm.protocol import KVTierMetadata, KVTierWorkerMetadata
from kvtier.vllm.scheduler_side import SchedulerSide
from kvtier.vllm.settings import parse_extra_config
from kvtier.vllm.shm import pool_path, publish_physical, read_all_physical
from kvtier.vllm.stats import KVTierPromMetrics, KVTierStats
from kvtier.vllm.worker_side import WorkerSide, forward_runs_layer_by_layer

#: After a request finishes, the engine keeps stepping this long at most while
#: lower-tier writes are in flight (with KV events on and no engine waker found:
#: ``eventsetup.engine_waker``), so their STORAGE events go out.
EVENT_WRITES_WATCH_S = 5.0

if TYPE_CHECKING:
    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorPromMetrics,
        KVConnectorStats,
    )
    from vllm.forward_context import ForwardContext
    from vllm.v1.outputs import KVConnectorOutput


def _share_vllm_logging() -> None:
    """Send kvtier's log records through vLLM's handlers (once per process)."""
    ours = logging.getLogger("kvtier")
    if not ours.handlers:
        theirs = logging.getLogger("vllm")
        for h in theirs.handlers:
            ours.addHandler(h)
        ours.setLevel(theirs.level or logging.INFO)
        ours.propagate = False


def overlapped_steps(vllm_config: Any) -> bool:
    """Whether vLLM runs more than one step at a time: async scheduling (vLLM 0.32's
    default on GPUs) or pipeline parallelism (``VllmConfig.max_concurrent_batches``)."""
    try:
        return int(vllm_config.max_concurrent_batches) > 1
    except (AttributeError, TypeError, ValueError):
        sc = getattr(vllm_config, "scheduler_config", None)
        return bool(getattr(sc, "async_scheduling", False))


def check_parallel_config(pc: Any) -> None:
    """Tensor parallel is supported; the other ways of splitting a model are refused, with
    the setting to change (``TierError``)."""
    for name, flag in (("pipeline_parallel_size", "--pipeline-parallel-size"),
                       ("decode_context_parallel_size", "--decode-context-parallel-size"),
                       ("prefill_context_parallel_size", "--prefill-context-parallel-size")):
        n = int(getattr(pc, name, 1) or 1)
        if n != 1:
            raise TierError(
                f"kvtier supports tensor parallel only: {name} is {n} (each rank would hold "
                f"another part of the layers or tokens, which kvtier's slots do not "
                f"describe). Use {flag} 1, or run without kvtier"
            )


def check_load_failure_policy(ktc: Any) -> None:
    """kvtier is a cache: a restore it cannot complete (a tier that fails or hangs, an
    object that no longer matches) is recomputed. vLLM does that only under
    ``kv_load_failure_policy: recompute``; its default, ``fail``, ends the request with an
    error instead. Refused at start (``TierError``) naming the fix."""
    policy = getattr(ktc, "kv_load_failure_policy", "recompute")
    if policy != "recompute":
        raise TierError(
            f'kvtier: kv_transfer_config.kv_load_failure_policy is "{policy}": a restore '
            "kvtier cannot complete would fail the user's request instead of being "
            'recomputed. Add "kv_load_failure_policy": "recompute" to '
            "--kv-transfer-config (kvtier.vllm.settings.kv_transfer_config sets it)")


def _tp_barrier() -> Any:
    """The TP group's barrier (every rank's worker calls it once, in register_kv_caches)."""
    from vllm.distributed.parallel_state import get_tp_group

    return get_tp_group().barrier


class KVTierConnector(KVConnectorBase_V1, SupportsHMA):
    """Declares ``SupportsHMA``: vLLM keeps its hybrid KV-cache manager on with kvtier
    loaded. A hybrid model (full and sliding-window groups) is stored per group
    (``kvtier/vllm/hybrid.py``); a model whose groups kvtier cannot store (Mamba state,
    chunked-local attention) is refused at start, naming the model and the group."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None):
        super().__init__(vllm_config, role, kv_cache_config)
        _share_vllm_logging()
        if kv_cache_config is None:
            raise ValueError("KVTierConnector needs vLLM >= 0.11 (kv_cache_config argument)")
        check_load_failure_policy(self._kv_transfer_config)
        settings = parse_extra_config(self._kv_transfer_config.kv_connector_extra_config,
                                      getattr(self._kv_transfer_config, "kv_role", None))
        cfg = settings.config
        check_parallel_config(vllm_config.parallel_config)
        self._tp_rank, tp_world = tp_placement(vllm_config)
        geometry = geometry_from_kv_cache_config(
            kv_cache_config, tp_world, model=str(vllm_config.model_config.model))
        geometry.blocks_per_chunk(cfg.chunk_tokens)  # fail early on a bad chunk size
        check_kv_scales_config(vllm_config.cache_config)
        self._engine_id = str(self._kv_transfer_config.engine_id)
        self._pool_path = path = pool_path(self._engine_id)
        self._sched: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        self._step_blocks: tuple[int, int] | None = None  # worker: (loaded, saved) this step
        #: KV events (``events.py``): on with vLLM's ``--kv-events-config`` only
        self._events: KVEvents | None = None
        self._noted: dict[str, int] = {}  # live request -> its chunks noted for events
        self._writes_watched_until = 0.0  # monotonic: keep stepping for writes' events
        enable_export()  # this process's records go out through get_kv_connector_stats
        if role == KVConnectorRole.SCHEDULER:
            # The worker registered its KV caches (and published this) before vLLM
            # constructs the scheduler; see the module docstring.
            physical = read_all_physical(path, engine_id=self._engine_id, tp_world=tp_world,
                                         slot_bytes=geometry.chunk_bytes(cfg.chunk_tokens),
                                         replicated=geometry.replicated)
            ns = namespace_for(vllm_config, geometry, cfg.chunk_tokens, physical=physical,
                               fingerprint=settings.model_fingerprint)
            self._sched = SchedulerSide(cfg, geometry, ns, path, role=settings.role,
                                        overlapped_steps=overlapped_steps(vllm_config),
                                        loads=settings.load, saves=settings.save)
            kv_events = getattr(vllm_config, "kv_events_config", None)
            hashed_by = getattr(kv_cache_config, "hash_block_size", None) or geometry.block_size
            events_on = kv_events is not None and kv_events.enable_kv_cache_events
            if events_on and hashed_by != geometry.block_size:
                # vLLM's block hashes (its events name them) then cover hash_block_size
                # tokens each, not one block: kvtier's events would name the wrong ones
                logging.getLogger("kvtier.vllm.events").warning(
                    "kvtier: KV events off: vLLM hashes every %d tokens (hash_block_size, "
                    "e.g. --prefix-match-unit) but blocks are %d tokens; kvtier's events "
                    "name one hash per block. vLLM's own GPU events are unaffected; to "
                    "publish kvtier's tiers too, leave the prefix match unit at the block "
                    "size", hashed_by, geometry.block_size)
            elif events_on:
                self._events = events_for(self._sched, kv_cache_config)
                # a finishing request's tails, windows and hybrid pieces, as saved
                self._sched.on_pieces = self._events.note_pieces
                # an idle engine is woken when an event is observed (else: watched)
                self._events.wake = engine_waker()
                log = logging.getLogger("kvtier.vllm.events")
                if self._events.wake is None:
                    log.warning("kvtier: KV events: no engine core to wake found; events "
                                "observed while the engine is idle wait for its next step")
                else:
                    log.info("kvtier: KV events: an idle engine is woken to publish")
        else:
            groups = [list(g.layer_names) for g in kv_cache_config.kv_cache_groups]
            self._worker = WorkerSide(cfg, geometry, groups, path)

    @property
    def requires_kv_delivery(self) -> bool:
        """False: kvtier is a best-effort cache. A preempted request keeps its in-flight
        output (vLLM's default, True for any producer, drops and resamples it); a save
        that does not happen costs a later recompute, never a wrong token."""
        return False

    # -- scheduler side ------------------------------------------------------------------
    @property
    def scheduler_side(self) -> SchedulerSide:
        assert self._sched is not None, "called on the worker side"
        return self._sched

    @property
    def worker_side(self) -> WorkerSide:
        assert self._worker is not None, "called on the scheduler side"
        return self._worker

    def _note(self, request: Any) -> None:
        """Tell the KV events how the request's chunks map to vLLM's block hashes (new
        chunks only), before anything of them can be stored or promoted."""
        if self._events is None:
            return
        keys = self.scheduler_side.chunk_keys(request)
        rid = request.request_id
        if len(keys) > self._noted.get(rid, 0):
            self._events.note(request, keys, self._noted.get(rid, 0))
            self._noted[rid] = len(keys)

    def _finish_noting(self, request: Any) -> None:
        """At the finish every chunk is noted again (the events keep payloads of the
        most recently noted pieces only: a request's early chunks may have been dropped
        since its lookup, and its save is about to store them)."""
        if self._events is None:
            return
        keys = self.scheduler_side.chunk_keys(request)
        self._events.note(request, keys, 0)
        self._noted.pop(request.request_id, None)
        if self._events.wake is None:  # nothing wakes an idle engine: keep it stepping
            self._writes_watched_until = time.monotonic() + EVENT_WRITES_WATCH_S

    def take_events(self) -> list[Any]:
        """vLLM's scheduler merges these into its KV event stream, once a step."""
        return self._events.take() if self._events is not None else []

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        self._note(request)
        return self.scheduler_side.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self.scheduler_side.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return self.scheduler_side.build_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self.scheduler_side.on_worker_output(
            connector_output.finished_sending, connector_output.kv_connector_worker_meta,
            failed_load_blocks=len(connector_output.invalid_block_ids or ()),
            failed_loads=set(getattr(connector_output, "failed_recving", None) or ()),
            finished_recving=set(connector_output.finished_recving or ()),
        )

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        self._finish_noting(request)
        delay, params = self.scheduler_side.request_finished(request, block_ids)
        return delay, self.scheduler_side.pd_answer(request, params)

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's hook with the hybrid manager on: every group's blocks (one group: the
        same as ``request_finished``)."""
        self._finish_noting(request)
        delay, params = self.scheduler_side.request_finished_groups(request, block_ids)
        return delay, self.scheduler_side.pd_answer(request, params)

    def has_pending_block_frees(self) -> bool:
        """Only frees due within a step (``Steps.has_frees_due``): vLLM waits for them
        instead of preempting."""
        return self._sched is not None and self._sched.has_frees_due()

    def has_pending_push_work(self) -> bool:
        """True while a flush started by a stop signal runs: vLLM's engine loop (and with
        it vLLM's signal handler) stays up until it is done or out of time. With KV
        events on, also while events wait; and, where no engine waker was found, while
        lower-tier writes are in flight up to ``EVENT_WRITES_WATCH_S`` after a request
        finished, so what it stored is published without waiting for the next request
        (bounded: a hung tier cannot keep the engine busy, nor hold up a pause). An idle
        engine blocks on its input queue and asks this only before it blocks: the
        events' waker (``eventsetup.engine_waker``) wakes it when something is observed
        meanwhile (a write finishing, an idle flush, a walk)."""
        if self._sched is None:
            return False
        if self._events is not None and (
                self._events.pending()
                or (time.monotonic() < self._writes_watched_until
                    and not self._sched.store.flush(0.0))):
            return True  # events to publish, or a finished request's writes in flight
        return self._sched.stop_flush_pending()

    def reset_cache(self) -> bool | None:
        if self._sched is None:
            return None
        done = self._sched.reset()
        if self._events is not None and self._sched.cfg.reset_cache == "weights":
            self._events.withdraw_all()  # nothing stored before is served again
        return done

    # -- worker side ---------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.v1.kv_cache_layout import KVCacheLayout

        w = self.worker_side
        ctx = self._vllm_config.compilation_config.static_forward_context
        backend_cls = _layout_backend(ctx[w.layer_names[0]].get_attn_backend())
        others = {b.__name__ for b in (_layout_backend(ctx[n].get_attn_backend())
                                       for n in w.layer_names) if b is not backend_cls}
        if others:  # one layout for every layer: the slots and the namespace assume it
            raise TierError(f"kvtier: the KV layers use several attention backends "
                            f"({backend_cls.__name__}, {', '.join(sorted(others))}); "
                            "run this model without kvtier")
        name = getattr(self._kv_cache_config, "kv_cache_layout", None)
        layout = KVCacheLayout[name] if name else None
        num_blocks = int(self._kv_cache_config.num_blocks)
        cache_dtype = str(self._vllm_config.cache_config.cache_dtype)
        # Before the pool exists: a refused scale setting leaves nothing behind.
        scales = kv_scales_digest([(n, ctx[n]) for n in w.layer_names], cache_dtype)
        w.register(kv_caches, backend_cls, layout, num_blocks, tp_rank=self._tp_rank,
                   barrier=_tp_barrier() if w.tp_world > 1 else None)
        assert w.layout is not None  # resolved by register()
        physical = PhysicalKV(describe_layout(backend_cls, name, w.layout), cache_dtype, scales)
        publish_physical(self._pool_path, physical, engine_id=self._engine_id,
                         tp_rank=self._tp_rank, slot_bytes=w.slot_bytes)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Issues this step's loads (layer by layer) and saves; waits for neither.

        vLLM calls it on the model thread before the forward when the step has loads
        (``has_sync_kv_loads``), after it otherwise. See ``WorkerSide.run``.
        """
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVTierMetadata)
        self.worker_side.run(meta, layer_by_layer=forward_runs_layer_by_layer(forward_context))
        if meta.loads or meta.saves:
            self._step_blocks = (sum(len(op.block_ids) for op in meta.loads),
                                 sum(len(op.block_ids) for op in meta.saves))

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Model thread, before each attention layer: its loads are ordered before it."""
        self.worker_side.wait_for_layer(layer_name)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return None  # saves are of finished requests, issued whole in start_load_kv

    def wait_for_save(self) -> None:
        """Model thread, end of the step: loads no layer wait came for are completed.
        Saves are not waited for: ``get_finished`` reports each once it is done."""
        seconds = self.worker_side.end_forward()
        if self._step_blocks is not None:
            if self._tp_rank == 0:  # every rank copies the same blocks: count them once
                record_worker_step(*self._step_blocks, seconds)
            self._step_blocks = None

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self.worker_side.get_finished(finished_req_ids)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Saves finished, asynchronous loads received, and those of them that failed
        (vLLM then recomputes the request: with several KV-cache groups a block-level
        load error cannot be mapped back to a request)."""
        sending, recving = self.worker_side.get_finished(finished_req_ids)
        return KVConnectorTransferResults(
            finished_sending=set(sending or ()), finished_recving=set(recving or ()),
            failed_recving=self.worker_side.load_failures())

    def get_block_ids_with_load_errors(self) -> set[int]:
        # counted by the scheduler side, from vLLM's union over every rank's errors
        return self.worker_side.load_errors() if self._worker is not None else set()

    def build_connector_worker_meta(self) -> KVTierWorkerMetadata | None:
        return self._worker.worker_meta() if self._worker is not None else None

    # -- metrics (both sides; see kvtier/vllm/stats.py) ------------------------------------
    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """What this process recorded since the last call (vLLM calls it every step)."""
        data = drain_export()
        return KVTierStats(data=data) if data else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats:
        return KVTierStats.build(data)

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics:
        return KVTierPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self._sched is not None:
            self._sched.close()
        if self._worker is not None:
            self._worker.close()  # removes the pool's names only if it created the pool


def _layout_backend(backend: Any) -> Any:
    """The attention backend class that lays out ``backend``'s KV tensors. vLLM wraps a
    backend for chunked-local attention in a subclass that overrides only
    ``get_builder_cls`` (``subclass_attention_backend``: other metadata, the same
    cache), so such subclasses are walked up to the class they wrap."""
    cls = backend if isinstance(backend, type) else type(backend)
    while len(cls.__bases__) == 1 and \
            {k for k in vars(cls) if not k.startswith("_")} <= {"get_builder_cls"}:
        cls = cls.__bases__[0]
    return cls
