"""Scheduler side of the connector: keys, lookups, load and save decisions. No bytes.

Runs in vLLM's engine-core process, next to the scheduler. It owns the ``TieredStore``
(index, lower tiers, IO threads); the host pool's bytes are shared with the worker.

Request life cycle:

1. ``get_num_new_matched_tokens``: hash the request's tokens into chunk keys, look up
   the stored prefix beyond vLLM's own hit, and start ``store.load`` on that lookup
   (lower-tier hits are promoted into host slots on IO threads, from the tier the lookup
   named). Until that finishes it answers ``None`` ("ask again"), so the scheduler loop
   never waits on storage. When it is done the chunks are *held* (never evicted while
   held) and it answers the exact token count (or 0 below the threshold).
2. ``update_state_after_alloc``: turn the held chunks into per-chunk ``CopyOp``s onto
   the request's new blocks; they go out with this step's metadata and the worker
   copies them before the forward pass.
3. The worker reports the step done (worker metadata); the holds are released.
4. ``request_finished`` (the eviction hook): the chunks of prompt *and* output not yet
   stored get host slots reserved by key; the request's blocks stay allocated
   (delay-free) until the worker reports the copies done (``finished_sending``), then
   the slots are committed with the chunks' metas and cascade to the lower tiers.

P/D roles (``role: prefill | decode``): the KV moves through a write-through shared tier.
A decode request's ``kv_transfer_params["kvtier"]["expect"]`` names what the prefill node
announced (``tokens``, ``last_key``); step 1 then answers ``None`` until those chunks are
visible, or ``restore.wait_seconds`` pass (then it takes what is there and computes the
rest). An announcement whose last key does not match this prompt's own chunk key is
ignored: keys are content hashes, so a mismatch means a different prompt, never a wait.

Invariants: a chunk is never saved twice (lookup before reserve); a load covers only
chunks whose bytes are held in host memory; whatever fails, vLLM recomputes.

Threads: every hook runs on vLLM's scheduler thread and does no I/O; store futures
complete on IO threads and are only polled here (``release_when_done`` may run on an IO
thread: releasing a ``Held`` is thread-safe).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from kvtier.build import build_store
from kvtier.clock import SYSTEM_CLOCK, Clock
from kvtier.config import KVTierConfig
from kvtier.costmodel import CostModel, Decision
from kvtier.flusher import IdleFlusher
from kvtier.keys import ChunkKey, Namespace, chunk_keys, group_key, tail_key, window_key
from kvtier.metrics import (
    record_drop,
    record_failed_loads,
    record_restore,
    record_restore_stages,
    record_spill,
)
from kvtier.objformat import ChunkMeta, ChunkSpec
from kvtier.store import Held, LoadProgress, Lookup, TieredStore, WritePolicy
from kvtier.tiers.host import HostTier
from kvtier.tiers.pool import HostPool
from kvtier.vllm.geometry import Geometry
from kvtier.vllm.hybrid import Piece, full_groups, prefix_pieces, saveable_groups
from kvtier.vllm.identity import PENDING, Pending, RequestIdentities, RequestIdentity, Unsupported
from kvtier.vllm.protocol import CopyOp, KVTierMetadata, KVTierWorkerMetadata
from kvtier.vllm.shm import attach_host_pool
from kvtier.vllm.stopsignal import chain_stop_signals
from kvtier.vllm.stream import (
    STREAM_WINDOW_MAX,
    Advance,
    ChunkCopy,
    StreamedLoad,
    release_when_done,
)
from kvtier.vllm.threshold import StepTimer, threshold_policy
from kvtier.vllm.waitbound import WaitBound
from kvtier.vllm.window import saveable, window_parts

log = logging.getLogger("kvtier.vllm")

def _request_params(request: Any) -> dict[str, Any]:
    """The request's ``kv_transfer_params["kvtier"]`` (empty if absent or malformed).

    Keys read: ``expect`` (P/D announcement), ``load: false`` (never restore: a
    recompute reference, or D->P reuse switched off), ``save: false`` (store nothing),
    ``recompute_threshold_tokens`` (this request's own fixed threshold; see
    ``_request_threshold``).
    """
    params = getattr(request, "kv_transfer_params", None)
    mine = params.get("kvtier") if isinstance(params, dict) else None
    return mine if isinstance(mine, dict) else {}


def _request_threshold(params: dict[str, Any]) -> tuple[int | None, bool]:
    """A request's ``recompute_threshold_tokens`` and whether it was malformed: a
    non-negative integer overrides the configured threshold (fixed or ``auto``) for that
    request only, e.g. to compare always-restore with ``auto`` on one engine."""
    value = params.get("recompute_threshold_tokens")
    if value is None:
        return None, False
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value, False
    return None, True


def _saveable_tokens(request: Any) -> int:
    """The tokens of a finished request whose KV is known to be computed: at most
    ``num_tokens - 1`` (the last token is sampled, never computed), however far
    ``num_computed_tokens`` ran ahead (speculative drafts not verified, async scheduling's
    in-flight step)."""
    return max(0, min(int(request.num_computed_tokens), int(request.num_tokens) - 1))


@dataclass(frozen=True)
class _Tail:
    """A partial tail: the first ``blocks`` blocks of chunk ``chunk`` (``keys.tail_key``);
    ``tier`` is where a lookup found it."""

    chunk: int
    blocks: int
    key: ChunkKey
    tier: int = 0


@dataclass(frozen=True)
class _Piece:
    """One thing a finishing request saves: a whole chunk (``span`` 0) or its tail."""

    key: ChunkKey
    meta: ChunkMeta
    block_ids: list[int]
    span: int = 0
    group: int = 0  # a hybrid model's KV-cache group


@dataclass
class _Lookup:
    """A request between its lookup and its block allocation. It stages ``full`` whole
    chunks from ``first_chunk`` on, then, if ``tail_blocks``, the next chunk's tail."""

    keys: list[ChunkKey]
    first_chunk: int = 0
    full: int = 0
    tail_blocks: int = 0
    future: Future[Held] | None = None
    held: Held | None = None
    start_tokens: int = 0
    t0: float = field(default_factory=time.perf_counter)
    threshold: int | None = None  # the request's own fixed threshold, if it set one
    progress: LoadProgress | None = None  # of ``future``: abandoned when it stalls
    chunks: int = 0  # staged (or being staged) host chunks
    staged_step: int | None = None  # the engine step its chunks were all held in
    #: a sliding-window model's restore: it ends at token ``end``, and ``parts`` (first
    #: block, blocks) are the window's parts, staged in this order (``window.py``)
    end: int = 0
    parts: list[tuple[int, int]] = field(default_factory=list)
    #: a hybrid model's restore: it ends at token ``end``; these are staged, in order
    pieces: list[Piece] = field(default_factory=list)
    #: vLLM's own hit when this lookup started: a window or hybrid prefix staged for it
    #: holds nothing below it, so a smaller hit later needs a new lookup
    asked_at: int = 0
    #: a restore longer than the staging cap (``stream.py``): every entry (chunks, then
    #: the tail) and its spec; ``future`` stages only the first of them
    stream: tuple[Lookup, list[ChunkSpec]] | None = None


#: ``_probes`` key suffix of a request's probe for its tail (after the chunks' probe).
TAIL_PROBE = "\x00tail"
#: A P/D decode waiting for announced chunks asks the shared tier at most this often.
PROBE_INTERVAL_S = 0.05
#: Staged chunks of requests vLLM has not admitted yet may hold at most this fraction of
#: the host pool (a None answer costs vLLM no token budget, so one schedule() could
#: otherwise stage the whole waiting queue and leave no slot for saves).
STAGED_FRACTION = 0.5
#: A staged lookup not admitted within this many engine steps is released.
STAGED_STEPS = 64
#: A sliding-window model's lookup tries the ends of tails in this many chunks, from the
#: last one down (at most ``blocks_per_chunk - 1`` tail keys hashed per chunk); below
#: them only chunk boundaries (no hashing).
WINDOW_TAIL_CHUNKS = 8


@dataclass
class _Probe:
    """A request's question to the lower tiers, asked on an IO thread. Kept until the
    request finishes: a request vLLM reconsiders (its allocation failed) is not probed
    again, except by a P/D decode waiting for announced chunks."""

    future: Future[int]
    started: float
    progress: LoadProgress
    answered: float | None = None  # when its answer (or its deadline) was taken
    limit_s: float = 0.0  # its deadline: the recompute it may save, at most configured


@dataclass
class _Keys:
    """A request's identity and the keys of its full chunks computed so far."""

    identity: RequestIdentity
    epoch: int  # the weights epoch its identity was made in
    keys: list[ChunkKey] = field(default_factory=list)
    #: the request's multimodal inputs when the identity was made: a streaming-input
    #: session appends tokens *and* inputs to the same request, and the keys of chunks
    #: with new inputs' placeholders must mix those inputs in
    mm_inputs: int = 0


@dataclass
class _Save:
    slots: list[tuple[int, ChunkMeta]]
    #: shorter tails this save's longer piece supersedes: dropped from the host tier
    #: once the save commits (a save that fails leaves them: they are still the best
    #: copy of that chunk's start)
    supersedes: list[ChunkKey] = field(default_factory=list)


class SchedulerSide:
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
    ) -> None:
        self.cfg = cfg
        self.geom = geometry
        self.ns = namespace
        self.ct = cfg.chunk_tokens
        self.bs = geometry.block_size
        self.bpc = geometry.blocks_per_chunk(self.ct)
        self.slot_bytes = geometry.chunk_bytes(self.ct)
        #: store and restore partial tails (block granularity); a one-block chunk has none
        self.tails = cfg.partial_tails and self.bpc > 1
        self.store = store or self._build_store(pool_path)
        self.policy = threshold_policy(cfg.restore, self.store, self.slot_bytes,
                                       probe=store is None)
        self._bad_threshold_logged = False
        #: the engine's prefill speed, measured whatever the threshold policy: it bounds
        #: every wait on storage by the recompute it would save (``waitbound``)
        steps_model = self.policy.model or CostModel(warmup_steps=cfg.restore.auto_warmup_steps)
        self.step_timer: StepTimer | None = StepTimer(steps_model, self.slot_bytes // self.bpc)
        self.waits = WaitBound(steps_model.steps)
        self._lookups: dict[str, _Lookup] = {}
        self._saves: dict[str, _Save] = {}
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
        #: req -> blocks its asynchronous load copies (a hybrid model's), until finished
        self._async_blocks: dict[str, int] = {}
        #: requests whose asynchronous load is issued and not reported received yet: vLLM
        #: frees such a request's blocks itself when the load is reported, so kvtier
        #: must not also delay their free with a save
        self._recving: set[str] = set()
        #: requests whose load failed: not restored again (until they finish)
        self._load_failed: set[str] = set()
        #: req -> when the staging cap first refused it room (stage ``cap``)
        self._capped: dict[str, float] = {}
        self.lookup_timeout_s = cfg.restore.lookup_timeout_seconds
        self._staged_cap = max(1, int(self.store.host.pool.num_slots * STAGED_FRACTION))
        #: a restore of more entries than the staging cap is streamed through this many
        #: host slots (``stream.py``)
        self._stream_window = max(1, min(STREAM_WINDOW_MAX, self._staged_cap))
        self._streams: dict[str, StreamedLoad] = {}  # req -> its streamed restore
        self._async_reqs: list[str] = []  # streamed requests with loads this step
        #: a load that read no chunk for this long is abandoned (the request recomputes)
        self.load_stall_s = (cfg.restore.load_timeout_seconds
                             + self.slot_bytes / (cfg.health.min_mib_per_second * 2**20))
        self._key_cache: dict[str, _Keys] = {}  # req -> identity, keys of its full chunks
        #: req -> the weights epoch it was first seen in: KV computed across a weights
        #: reset is stored under neither epoch
        self._epoch_of: dict[str, int] = {}
        self.identities = RequestIdentities(namespace, self.ct)
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

    def _build_store(self, pool_path: Any) -> TieredStore:
        """The store over the worker's pool (it created, touched and page-locked it)."""
        num_slots = HostPool.slots_for(self.cfg.host.capacity, self.slot_bytes)
        host = HostTier.over(attach_host_pool(pool_path, self.slot_bytes, num_slots))
        return build_store(self.cfg, self.slot_bytes, host=host)

    # -- helpers -------------------------------------------------------------------------
    def _keys(self, request: Any, num_tokens: int) -> tuple[bytes, list[ChunkKey]] | Pending:
        """Keys of the full chunks of the request's first ``num_tokens`` tokens.

        Cached per request and extended incrementally (a request's tokens are only ever
        appended to), because vLLM asks again every step while a request waits. The keys
        cover the request's whole identity (``identity.py``): ``PENDING`` while it is
        being established, ``Unsupported`` if it cannot be.
        """
        rid = request.request_id
        cached = self._key_cache.get(rid)
        mm_inputs = len(getattr(request, "mm_features", None) or ())
        if cached is not None and (cached.epoch != self.identities.epoch
                                   or cached.mm_inputs != mm_inputs):
            # made before a weights reset (its keys are the old epoch's), or before the
            # request's inputs grew (a streaming-input session's update)
            cached = None
        if cached is None:
            ident = self.identities.of(request)
            if ident is PENDING:
                return PENDING
            cached = self._key_cache[rid] = _Keys(ident, self.identities.epoch,
                                                  mm_inputs=mm_inputs)
        n = num_tokens // self.ct
        have = cached.keys
        if len(have) < n:
            tokens = request.all_token_ids[: n * self.ct]
            extra = cached.identity.chunk_extra or b""
            have.extend(chunk_keys(
                cached.identity.namespace, tokens, self.ct, extra=extra,
                start_chunk=len(have), parent=have[-1] if have else None,
            ))
        return cached.identity.namespace, have[:n]

    def chunk_keys(self, request: Any) -> list[ChunkKey]:
        """Keys of the request's full chunks over all its tokens so far (``[]`` while its
        identity is pending or if it cannot be stored): the KV events' ``note``
        (``kvtier.vllm.events``). Scheduler thread; cached as ``_keys`` is."""
        try:
            got = self._keys(request, request.num_tokens)
        except Unsupported:
            return []
        return [] if got is PENDING else list(got[1])

    def _group_spec(self, ns: bytes, group: int, blocks: int) -> ChunkSpec:
        """What a piece of ``blocks`` blocks of KV-cache group ``group`` (0 with one group)
        of a request with namespace digest ``ns`` must be, exactly: every TP rank's first
        ``blocks`` blocks of that group's layers, rank after rank, packed
        (``StepCopier.slot``), and nothing else. One rank: the pre-TP shape, so objects
        stored before TP support stay readable."""
        layers = self.geom.group_layer_count(group)
        shape: tuple[int, ...] = (layers, blocks, self.geom.page_bytes)
        if self.geom.slot_ranks > 1:
            shape = (self.geom.slot_ranks, *shape)
        return ChunkSpec(ns, blocks * self.bs, self.geom.kv_dtype, shape,
                         self.geom.slot_ranks * layers * blocks * self.geom.page_bytes)

    def _spec(self, ns: bytes) -> ChunkSpec:
        """What every whole chunk of a single-group model must be."""
        return self._group_spec(ns, 0, self.bpc)

    def _tail_spec(self, ns: bytes, blocks: int) -> ChunkSpec:
        """What a tail (or a window part) of ``blocks`` blocks must be: a chunk's shape
        over its first ``blocks`` blocks (a whole chunk's spec when ``blocks`` is all)."""
        return self._group_spec(ns, 0, blocks)

    def _meta(self, ns: bytes, keys: Sequence[ChunkKey], c: int) -> ChunkMeta:
        return self._spec(ns).meta(keys[c], keys[c - 1] if c else None)

    def _tail_key(self, request: Any, keys: Sequence[ChunkKey], chunk: int,
                  blocks: int) -> ChunkKey:
        """The key of the request's tail of ``blocks`` blocks in chunk ``chunk`` (its
        keys up to ``chunk`` are in ``keys``; its identity is cached by ``_keys``)."""
        ident = self._key_cache[request.request_id].identity
        lo = chunk * self.ct
        extra = ident.chunk_extra(chunk) if ident.chunk_extra is not None else b""
        return tail_key(keys[chunk - 1] if chunk else ident.namespace,
                        request.all_token_ids[lo : lo + blocks * self.bs], extra)

    def _tail_candidates(self, request: Any, keys: Sequence[ChunkKey], chunk: int,
                         num_computed: int, limit: int) -> list[tuple[int, ChunkKey]]:
        """``(blocks, key)`` of every tail of chunk ``chunk`` that would restore something
        past ``num_computed`` below ``limit``, longest first (at most ``blocks_per_chunk
        - 1`` keys hashed)."""
        lo = chunk * self.ct
        if not self.tails or lo >= limit or chunk > len(keys):
            return []
        most = min(self.bpc - 1, (request.num_tokens - lo) // self.bs)
        return [(k, self._tail_key(request, keys, chunk, k)) for k in range(most, 0, -1)
                if lo + k * self.bs > num_computed]

    def _find_tail(self, request: Any, keys: Sequence[ChunkKey], chunk: int,
                   num_computed: int, limit: int) -> _Tail | None:
        """The longest stored tail of chunk ``chunk`` (the first one not stored whole)
        that would restore something past ``num_computed`` below ``limit``. Memory only:
        the candidates looked up in the indexes."""
        for k, key in self._tail_candidates(request, keys, chunk, num_computed, limit):
            found = self.store.lookup_indexed([key])
            if found.hits:
                return _Tail(chunk, k, key, found.tiers[0])
        return None

    def _own_threshold(self, request: Any) -> int | None:
        """The request's own fixed threshold (``kvtier.recompute_threshold_tokens``), if
        it set a valid one; an invalid one is ignored, with one warning per engine."""
        own, bad = _request_threshold(_request_params(request))
        if bad and not self._bad_threshold_logged:
            self._bad_threshold_logged = True
            log.warning("kvtier: ignoring kv_transfer_params.kvtier."
                        "recompute_threshold_tokens (not a non-negative integer)")
        return own

    def _chunk_start(self, request: Any, ns: bytes, keys: list[ChunkKey],
                     num_computed: int, limit: int) -> _Lookup | tuple[int | None, bool]:
        """Start staging the stored chunks (and tail) past vLLM's own hit: its
        ``_Lookup``, or the hook's answer when there is nothing to stage (0) or it must
        ask again (None: a probe or an announced chain pending, or no room now)."""
        rid = request.request_id
        first = num_computed // self.ct
        wanted = keys[: -(-limit // self.ct)]
        hit = self.store.lookup_indexed(wanted[first:])
        announced, ann_tail = self._announced(request, keys, limit)

        def missing() -> bool:  # announced by the prefill node, not visible here yet
            return announced > first + hit.hits or (
                ann_tail is not None and not self.store.lookup_indexed([ann_tail]).hits)

        beyond = wanted[first + hit.hits :]
        if ann_tail is not None:  # the announced chain: its chunks, then its tail
            beyond = wanted[first + hit.hits : announced]
            if not self.store.lookup_indexed([ann_tail]).hits:
                beyond.append(ann_tail)
        if self._probing(rid, beyond, missing()):
            return None, False
        if beyond:
            hit = self.store.lookup_indexed(wanted[first:])  # what a probe found
        if missing() and self.store.shared_up(every=False) and self._keep_waiting(rid):
            return None, False  # (no shared tier can answer: stop waiting now)
        waited = self.clock.monotonic() - self._waiting.pop(rid, self.clock.monotonic())
        t0 = time.perf_counter() - waited
        tail = self._find_tail(request, keys, first + hit.hits, num_computed, limit)
        if tail is None and self.tails and self.store.indexes_filling():
            # A lower tier's index is still filling (a restart): the tail may be stored
            # and not indexed yet. Its candidates are asked once, like the chunks were.
            cands = self._tail_candidates(request, keys, first + hit.hits, num_computed,
                                          limit)
            if self._probing(rid + TAIL_PROBE, [k for _, k in cands], False,
                             alternatives=True):
                return None, False
            tail = self._find_tail(request, keys, first + hit.hits, num_computed, limit)
        if hit.hits == 0 and tail is None:
            return 0, False
        own = self._own_threshold(request)
        tiers, lim = list(hit.tiers), limit
        if tail is not None:  # an entry of its own, ending the restore where it ends
            tiers.append(tail.tier)
            lim = min(limit, tail.chunk * self.ct + tail.blocks * self.bs)
        d = self.policy.chunks_to_restore(
            num_computed, self.ct, self.slot_bytes,
            [self.store.tiers[i].name for i in tiers], limit_tokens=lim,
            fixed_tokens=own,
        )
        log.debug("kvtier: %s: %s", rid, d)
        self._decisions[rid] = d
        if d.chunks == 0:
            return 0, False
        staged = self._staged_chunks()
        if staged and staged + d.chunks > self._staged_cap:
            self._capped.setdefault(rid, time.perf_counter())
            return None, False  # staged KV is waiting for admission: ask again
        full = min(d.chunks, hit.hits)
        found, specs = hit.head(full), [self._spec(ns)] * full
        tail_blocks = 0
        if tail is not None and d.chunks > hit.hits:
            found = Lookup((*found.keys, tail.key), (*found.tiers, tail.tier))
            specs.append(self._tail_spec(ns, tail.blocks))
            tail_blocks = tail.blocks
        lk = _Lookup(keys, first, full=full, tail_blocks=tail_blocks,
                     t0=t0, threshold=own, progress=self._progress(rid),
                     chunks=len(specs))
        if found.hits > self._staged_cap:
            # more than the staging cap holds: stream it; its first entries are staged
            # now, and prove the store answers before the whole prefix is claimed
            lk.stream = (found, specs)
            lk.chunks = max(1, self._stream_window // 2)
            found, specs = found.head(lk.chunks), specs[: lk.chunks]
        lk.future = self.store.load(found, specs, lk.progress)
        return lk

    # -- sliding-window models (``window.py``) -----------------------------------------------
    def _window_keys(self, end_key: ChunkKey, end: int) -> tuple[list[tuple[int, int]],
                                                                 list[ChunkKey]]:
        """The parts of the window of a hit of ``end`` tokens, and their keys."""
        parts = window_parts(end // self.bs, self.geom.window_blocks, self.bpc)
        return parts, [window_key(end_key, i, len(parts)) for i in range(len(parts))]

    def _save_ends(self, top: int, num_computed: int, limit: int) -> Iterator[int]:
        """Where a saved prefix may end, past ``num_computed`` and at most ``limit`` tokens,
        longest first, from chunk ``top`` down: chunk boundaries (each costs hashing one
        key of 16 bytes) and, with tails, block boundaries inside a chunk (each costs
        hashing up to a chunk's tokens), those in the ``WINDOW_TAIL_CHUNKS`` highest
        chunks only."""
        tail_chunks = WINDOW_TAIL_CHUNKS if self.tails else 0
        for n in range(top, -1, -1):
            ends: list[int] = []
            if tail_chunks > 0:
                tail_chunks -= 1
                ends += [n * self.ct + k * self.bs for k in range(self.bpc - 1, 0, -1)]
            if n:
                ends.append(n * self.ct)
            for end in ends:
                if end > limit:
                    continue
                if end <= num_computed:
                    return
                yield end

    def _end_key(self, request: Any, keys: Sequence[ChunkKey], end: int) -> ChunkKey:
        """The chain key of the chunk or tail that ends at token ``end``."""
        n, rest = divmod(end, self.ct)
        return self._tail_key(request, keys, n, rest // self.bs) if rest else keys[n - 1]

    def _find_window(self, request: Any, keys: Sequence[ChunkKey], num_computed: int,
                     limit: int) -> tuple[int, list[tuple[int, int]], Lookup] | None:
        """The longest prefix past ``num_computed``, at most ``limit`` tokens, whose window
        is stored whole (ends as ``_save_ends`` tries them): its end, the window's parts
        and where they are. Memory only."""
        for end in self._save_ends(min(limit // self.ct, len(keys)), num_computed, limit):
            parts, part_keys = self._window_keys(self._end_key(request, keys, end), end)
            hit = self.store.lookup_indexed(part_keys)
            if hit.hits == len(part_keys):
                return end, parts, hit
        return None

    def _stage_whole(self, request: Any, keys: list[ChunkKey], first: int,
                     num_computed: int, end: int, found: Lookup, specs: list[ChunkSpec],
                     **staged: Any) -> _Lookup | tuple[int | None, bool]:
        """Start staging ``found`` (a prefix restored whole or not at all: a window, a
        hybrid prefix) ending at token ``end``: its ``_Lookup`` (with ``staged``'s
        fields), or the hook's answer when it restores less than the fixed threshold (0)
        or staged KV is waiting for admission (None)."""
        own = self._own_threshold(request)
        fixed = own if own is not None else self.policy.fixed_tokens
        if end - num_computed < max(1, fixed or 1):
            return 0, False
        held = self._staged_chunks()
        if held and held + len(specs) > self._staged_cap:
            self._capped.setdefault(request.request_id, time.perf_counter())
            return None, False
        lk = _Lookup(keys, first, threshold=own, progress=self._progress(request.request_id),
                     chunks=len(specs), end=end, asked_at=num_computed, **staged)
        lk.future = self.store.load(found, specs, lk.progress)
        return lk

    def _window_start(self, request: Any, ns: bytes, keys: list[ChunkKey],
                      num_computed: int, limit: int) -> _Lookup | tuple[int | None, bool]:
        """Start staging the window of the longest stored prefix of a sliding-window
        model's request: its ``_Lookup``, or the hook's answer when there is nothing to
        stage (0) or no room now (None). Lower tiers are not probed: a window stored by
        another node is found once the tier's index has it."""
        found = self._find_window(request, keys, num_computed, limit)
        if found is None:
            return 0, False
        end, parts, hit = found
        return self._stage_whole(request, keys, 0, num_computed, end, hit,
                                 [self._tail_spec(ns, b) for _, b in parts], parts=parts)

    def _window_loads(self, rid: str, lk: _Lookup, block_ids: Sequence[int],
                      num_external: int) -> None:
        """Copy ops for a staged window: the window's blocks past vLLM's own hit (those
        before the window are vLLM's null block, and nothing is copied into them)."""
        assert lk.held is not None
        lo = lk.start_tokens // self.bs
        hi = (lk.start_tokens + num_external) // self.bs
        if lk.start_tokens + num_external != lk.end:  # vLLM took another length: the
            # staged window is not the one it needs; fail its blocks (it recomputes them)
            log.error("kvtier: %s: vLLM took %d tokens of a %d-token window restore; "
                      "failing the load", rid, num_external, lk.end - lk.start_tokens)
            self._loads.append(CopyOp(rid, -1, [b for b in block_ids[lo:hi] if b], 0, 0))
            return
        for idx, (first, n) in enumerate(lk.parts):
            a, b = max(lo, first), min(hi, first + n)
            if a < b:
                self._loads.append(CopyOp(rid, lk.held.slots[idx][0],
                                          list(block_ids[a:b]), a - first,
                                          n if n < self.bpc else 0))

    # -- hybrid models (``hybrid.py``) ------------------------------------------------------
    def _hybrid_pieces(self, request: Any, keys: Sequence[ChunkKey], end: int,
                       lo_block: int) -> list[Piece]:
        """The pieces of the prefix of ``end`` tokens that hold blocks past ``lo_block``
        (vLLM's own hit), in chain order."""
        n, rest = divmod(end, self.ct)
        tail = (rest // self.bs, self._end_key(request, keys, end)) if rest else None
        pieces = prefix_pieces(self.geom, self.bpc, keys[:n], tail,
                               start_chunk=lo_block // self.bpc)
        return [p for p in pieces if p.first + p.blocks > lo_block]

    def _hybrid_start(self, request: Any, ns: bytes, keys: list[ChunkKey],
                      num_computed: int, limit: int) -> _Lookup | tuple[int | None, bool]:
        """Start staging the longest stored prefix of a hybrid model's request past
        vLLM's own hit: every full-attention group's chunks (and tail) from that hit on,
        and every sliding-window group's window at its end (``hybrid.py``). Ends are
        tried as ``_save_ends`` lists them. Memory only; lower tiers are not probed (a
        prefix another node stored is found once the index has it)."""
        lo = num_computed // self.bs
        c0 = num_computed // self.ct
        full = full_groups(self.geom)
        top = min(limit // self.ct, len(keys))
        if full:  # chunks from c0 on that every full group holds
            flat = [group_key(keys[c], g) for c in range(c0, top) for g in full]
            top = c0 + self.store.lookup_indexed(flat).hits // len(full)
        for end in self._save_ends(top, num_computed, limit):
            pieces = self._hybrid_pieces(request, keys, end, lo)
            hit = self.store.lookup_indexed([p.key for p in pieces])
            if pieces and hit.hits == len(pieces):
                return self._stage_whole(
                    request, keys, c0, num_computed, end, hit,
                    [self._group_spec(ns, p.group, p.blocks) for p in pieces], pieces=pieces)
        return 0, False

    def _hybrid_loads(self, rid: str, lk: _Lookup, block_ids: Sequence[Sequence[int]],
                      num_external: int) -> None:
        """Copy ops for a staged hybrid prefix: each piece's blocks past vLLM's own hit,
        into its group's blocks. The loads are asynchronous: vLLM holds the request until
        the worker reports them received, or failed (then it recomputes)."""
        assert lk.held is not None
        lo = lk.start_tokens // self.bs
        hi = (lk.start_tokens + num_external) // self.bs
        self._load_holds.append(lk.held)
        if lk.start_tokens + num_external != lk.end:  # not the prefix that was staged
            log.error("kvtier: %s: vLLM took %d tokens of a %d-token restore; failing the "
                      "load", rid, num_external, lk.end - lk.start_tokens)
            self._loads.append(CopyOp(rid, -1, [], 0, 0))  # reported failed: recomputed
            self._recving.add(rid)
            return
        nblocks = 0
        # tokens by tier: a full group's chunk or tail names its blocks' tier; blocks no
        # full group restores (a window-only model) count under the window's tier
        first_full = next((p.group for p in lk.pieces if not self.geom.groups[p.group].local),
                          None)
        by_tier: dict[str, int] = {}
        for idx, p in enumerate(lk.pieces):
            a, b = max(lo, p.first), min(hi, p.first + p.blocks)
            if a >= b:
                continue
            self._loads.append(CopyOp(rid, lk.held.slots[idx][0],
                                      list(block_ids[p.group][a:b]), a - p.first,
                                      p.span, p.group))
            nblocks += b - a
            if p.group == first_full or (first_full is None and p.group == lk.pieces[-1].group):
                tier = self.store.tiers[lk.held.from_tier[idx]].name
                by_tier[tier] = by_tier.get(tier, 0) + (b - a) * self.bs
        if first_full is None:  # a window-only model: its window restores the whole prefix
            tier = self.store.tiers[max(lk.held.from_tier)].name
            by_tier = {tier: num_external}
        self._async_blocks[rid] = nblocks
        self._recving.add(rid)
        record_restore(by_tier)
        staged_ms = (time.perf_counter() - lk.t0) * 1e3
        self._restored[rid] = (by_tier, staged_ms)
        log.info("kvtier: restoring %d tokens for %s from %d pieces of %d KV-cache groups "
                 "(%s), staged in %.1f ms", num_external, rid, len(lk.pieces),
                 len(self.geom.groups), ", ".join(f"{t} {n}" for t, n in by_tier.items()),
                 staged_ms)

    def request_finished_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any]]:
        """``request_finished_all_groups``: one group goes to ``request_finished``; a
        hybrid model saves the pieces of the prefix the request ends (``hybrid.py``)."""
        if not self.geom.groups:
            return self.request_finished(request, block_ids[0])
        rid = request.request_id
        recving = rid in self._recving
        restored, restore_ms, seen_epoch = self._end_request(rid)
        if recving:
            # finished (aborted) while its asynchronous load is in flight: vLLM frees its
            # blocks when the load is reported; a save would free them a second time
            # (and they hold nothing computed yet)
            self._key_cache.pop(rid, None)
            return False, self._params(rid, b"", 0, None, restored, restore_ms, 0, 0)
        full = full_groups(self.geom)
        held_blocks = min(len(block_ids[g]) for g in (full or range(len(block_ids))))
        n_blocks = min(_saveable_tokens(request) // self.bs, held_blocks)
        n_chunks, tail_blocks = divmod(n_blocks, self.bpc)
        if not self.tails:
            tail_blocks = 0
        try:
            got = self._keys(request, n_chunks * self.ct)
        except Unsupported:
            got = PENDING
        end = n_chunks * self.ct + tail_blocks * self.bs
        if seen_epoch != self.identities.epoch or got is PENDING or not end or \
                _request_params(request).get("save") is False:
            self._key_cache.pop(rid, None)
            ns = b"" if got is PENDING else got[0]
            return False, self._params(rid, ns, 0, None, restored, restore_ms, 0, 0)
        ns, keys = got
        pieces = self._hybrid_pieces(request, keys, end, 0)
        windows = [p for p in pieces if self.geom.groups[p.group].local]
        if not saveable_groups(self.geom, block_ids, windows):
            # a window group freed the window's first block (the corner): the chunks are
            # still worth keeping for longer prefixes; this end is not restorable
            record_drop("window_freed")
            pieces = [p for p in pieces if not self.geom.groups[p.group].local]
            complete = False
        else:
            complete = True
        if not saveable_groups(self.geom, block_ids, pieces):
            log.error("kvtier: %s: a full-attention group's blocks are vLLM's null block; "
                      "storing nothing", rid)
            self._key_cache.pop(rid, None)
            return False, self._params(rid, ns, 0, None, restored, restore_ms, 0, 0)
        saves = [_Piece(p.key, self._group_spec(ns, p.group, p.blocks).meta(p.key, p.parent),
                        list(block_ids[p.group][p.first : p.first + p.blocks]), p.span,
                        p.group) for p in pieces]
        stored = self.store.lookup_indexed([p.key for p in saves]).hits
        whole = sum(p.meta.payload_len for p in saves)
        saved, held = self._save_pieces(rid, request, keys, saves[stored:], stored, stored,
                                        supersede=False, baseline=whole)
        self._key_cache.pop(rid, None)
        tokens, last = (end, saves[-1].key) if complete and held == len(saves) else (0, None)
        return saved > 0, self._params(rid, ns, tokens, last, restored, restore_ms, saved,
                                       whole)

    def _forget(self, req_id: str) -> None:
        lk = self._lookups.pop(req_id, None)
        if lk is None:
            return
        if lk.held is not None:
            lk.held.release()
        if lk.future is not None:
            lk.future.add_done_callback(release_when_done)

    # -- 1. lookup -------------------------------------------------------------------------
    def get_num_new_matched_tokens(
        self, request: Any, num_computed: int
    ) -> tuple[int | None, bool]:
        rid = request.request_id
        self._epoch_of.setdefault(rid, self.identities.epoch)
        limit = ((request.num_tokens - 1) // self.bs) * self.bs  # vLLM must compute >= 1 token
        lk = self._lookups.get(rid)
        if lk is not None and lk.held is None and lk.future is None:
            lk = None
        if lk is not None and (num_computed < lk.first_chunk * self.ct or (
                (lk.parts or lk.pieces) and num_computed < lk.asked_at)):
            # vLLM's own hit shrank below what we started from (its cache evicted blocks
            # while the request waited): what was staged misses the blocks in between
            self._forget(rid)
            lk = None
        if lk is None:
            if _request_params(request).get("load") is False or rid in self._load_failed \
                    or getattr(request, "skip_reading_prefix_cache", False):
                # load: false; a load of this request failed already (vLLM asks again
                # after a failed asynchronous load: the same load would fail the same
                # way); or vLLM reads no prefix cache for it (prompt_logprobs) and would
                # take 0 tokens whatever kvtier staged
                return 0, False
            try:
                got = self._keys(request, request.num_tokens)
            except Unsupported:
                return 0, False
            if got is PENDING:
                return None, False
            ns, keys = got
            start = (self._hybrid_start if self.geom.groups else
                     self._window_start if self.geom.window else self._chunk_start)
            started = start(request, ns, keys, num_computed, limit)
            if not isinstance(started, _Lookup):
                return started
            lk = started
            self._lookups[rid] = lk
        if lk.future is not None:
            if not lk.future.done():
                # the wait never outlasts the recompute of what it restores (waitbound)
                # (a P/D decode restoring what its prefill node announced keeps the
                # configured allowance: that restore is the point of the hand-off)
                stall_s = self.load_stall_s if _request_params(request).get("expect") \
                    else self.waits.seconds(self.load_stall_s, lk.first_chunk * self.ct,
                                            lk.end or (lk.first_chunk + max(1, lk.full))
                                            * self.ct + lk.tail_blocks * self.bs,
                                            self.clock.monotonic())
                if lk.progress is None or lk.progress.idle_for() < stall_s:
                    return None, False
                # A read made no progress for too long (a hung filesystem blocks in the
                # kernel): recompute now; the read's slots are released when it returns.
                lk.progress.cancel()
                self.waits.missed(self.clock.monotonic())
                record_restore_stages({**lk.progress.stages,
                                       "staged": time.perf_counter() - lk.t0})
                self._forget(rid)
                record_drop("load_timeout")
                log.warning("kvtier: restore for %s made no progress for %.2f s; "
                            "recomputing", rid, stall_s)
                return 0, False
            fut, lk.future = lk.future, None
            if lk.progress is not None:
                record_restore_stages({**lk.progress.stages,
                                       "staged": time.perf_counter() - lk.t0})
            try:
                lk.held = fut.result()
                lk.chunks, lk.staged_step = len(lk.held), self._step
            except Exception:
                log.exception("kvtier: staging KV for %s failed; recomputing", rid)
                self._lookups.pop(rid, None)
                return 0, False
        assert lk.held is not None
        if lk.stream is not None and len(lk.held) < lk.chunks:
            lk.stream = None  # its first entries did not all read: restore what did
        held = lk.stream[0].hits if lk.stream is not None else len(lk.held)
        tokens = (lk.first_chunk + min(held, lk.full)) * self.ct
        if held > lk.full:  # the tail was read too
            tokens += lk.tail_blocks * self.bs
        if lk.parts or lk.pieces:  # a window or a hybrid prefix: all of it, or nothing
            tokens = lk.end if len(lk.held) == len(lk.parts or lk.pieces) else 0
        tokens = min(tokens, limit)
        ext = tokens - num_computed
        # A fixed threshold applies to what was staged (a failed read shrinks it); under
        # ``auto`` the reads are paid for, so what is held is claimed.
        threshold = lk.threshold if lk.threshold is not None else self.policy.fixed_tokens
        if ext < max(1, threshold or 1):
            self._forget(rid)
            return 0, False
        lk.start_tokens = num_computed
        # a hybrid model's loads are asynchronous: a failed one must be reported per
        # request (vLLM cannot map block-level errors to requests across groups); so is
        # a streamed restore (its chunks arrive over several steps)
        return ext, bool(self.geom.groups) or lk.stream is not None

    def _probing(self, rid: str, beyond: list[ChunkKey], waiting: bool, *,
                 alternatives: bool = False) -> bool:
        """Ask the lower tiers about ``beyond`` (the chunks past what the indexes know) on
        an IO thread; True while the answer is pending: the hook then answers "ask again".

        One probe per request, given up after ``restore.lookup_timeout_seconds`` (then the
        indexes' answer stands: a recompute, never a wait on storage). A P/D decode that
        waits for announced chunks probes again, at most every ``PROBE_INTERVAL_S``.
        """
        if not beyond:
            return False
        now = self.clock.monotonic()
        p = self._probes.get(rid)
        if p is None or (waiting and p.answered is not None
                         and now - p.answered >= PROBE_INTERVAL_S):
            if not self.store.can_probe():
                return False  # every lower tier is down or busy: the indexes answer
            progress = LoadProgress(self.clock)
            fut = self.store.probe(beyond, progress=progress, fresh=waiting,
                                   alternatives=alternatives)
            if fut is None:
                log.debug("kvtier: probe queue full; %s answered from the indexes", rid)
                return False
            at_stake = len(beyond) * self.ct
            limit = self.lookup_timeout_s if waiting else self.waits.seconds(
                self.lookup_timeout_s, 0, at_stake, now)
            self._probes[rid] = _Probe(fut, now, progress, limit_s=limit)
            return True
        if p.answered is not None:
            return False
        if p.future.done():
            p.answered = now
            return False
        if now - p.started < p.limit_s:
            return True
        p.answered = now
        self.waits.missed(now)
        p.progress.cancel()  # it asks nothing more once its tier answers
        p.future.cancel()  # not started yet: never runs
        log.info("kvtier: lower tiers did not answer for %s within %.2f s; not waiting",
                 rid, p.limit_s)
        return False

    def _announced(self, request: Any, keys: list[ChunkKey],
                   limit: int) -> tuple[int, ChunkKey | None]:
        """What the prefill node announced for this request and we may use (P/D), below
        ``limit`` tokens: its whole chunks, and the key of its tail when it announced one
        (``tokens`` not a multiple of ``chunk_tokens``; ``last_key`` then names the
        tail)."""
        usable = min(len(keys), -(-limit // self.ct))
        expect = _request_params(request).get("expect")
        if not isinstance(expect, dict):
            return 0, None
        tokens, last = expect.get("tokens"), expect.get("last_key")
        if not isinstance(tokens, int) or not isinstance(last, str) or tokens < self.bs:
            return 0, None
        n, k = divmod(tokens, self.ct)
        k //= self.bs
        ok = n <= len(keys) and tokens <= request.num_tokens
        if ok and k:
            tail = self._tail_key(request, keys, n, k)
            if tail.hex() == last:
                # usable if it restores a block below the limit; with tails off here,
                # wait for the whole chunks only
                use = self.tails and n * self.ct < limit
                return min(n, usable), tail if use else None
            ok = False
        if not ok or (not k and keys[n - 1].hex() != last):
            log.warning(
                "kvtier: %s announces %d tokens ending in %s, which is not this prompt's "
                "chunk; not waiting for it", request.request_id, tokens, last[:16],
            )
            return 0, None
        return min(n, usable), None

    def _keep_waiting(self, rid: str) -> bool:
        now = self.clock.monotonic()
        t0 = self._waiting.setdefault(rid, now)
        if now - t0 < self.wait_s:
            return True
        log.warning(
            "kvtier: announced KV for %s not visible after %.1f s; computing the rest",
            rid, now - t0,
        )
        return False

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

    def _release_stale_staging(self) -> None:
        """Release staged lookups vLLM did not admit within ``STAGED_STEPS`` steps (their
        request waits for GPU blocks); the request stages again when asked next."""
        for rid, lk in list(self._lookups.items()):
            if lk.staged_step is not None and self._step - lk.staged_step > STAGED_STEPS:
                log.debug("kvtier: %s not admitted in %d steps; releasing its staged KV",
                          rid, STAGED_STEPS)
                self._forget(rid)

    # -- 2. allocation -> copy ops ----------------------------------------------------------
    def update_state_after_alloc(self, request: Any, blocks: Any, num_external: int) -> None:
        rid = request.request_id
        lk = self._lookups.get(rid)
        if lk is None:
            return
        if lk.held is None or num_external <= 0:
            # vLLM took another answer than ours (0 tokens, or it allocated while our
            # staging was still pending: a request it reads no prefix cache for): the
            # staging is released now, not when the request finishes
            self._forget(rid)
            return
        del self._lookups[rid]
        if lk.pieces:
            self._hybrid_loads(rid, lk, blocks.get_block_ids(), num_external)
            return
        block_ids = blocks.get_block_ids()[0]
        if lk.parts:
            self._window_loads(rid, lk, block_ids, num_external)
            self._load_holds.append(lk.held)
            tier = self.store.tiers[lk.held.from_tier[0]].name
            record_restore({tier: num_external})
            staged_ms = (time.perf_counter() - lk.t0) * 1e3
            self._restored[rid] = ({tier: num_external}, staged_ms)
            log.info("kvtier: restoring %d tokens for %s from a %d-block window (%s), "
                     "staged in %.1f ms", num_external, rid,
                     sum(n for _, n in lk.parts), tier, staged_ms)
            return
        lo_blk = lk.start_tokens // self.bs
        hi_blk = (lk.start_tokens + num_external) // self.bs
        if lk.stream is not None:
            self._start_stream(rid, lk, block_ids, lo_blk, hi_blk)
            return
        by_tier: dict[str, int] = {}
        for c in range(lo_blk // self.bpc, -(-hi_blk // self.bpc)):
            lo, hi = max(lo_blk, c * self.bpc), min(hi_blk, (c + 1) * self.bpc)
            idx = c - lk.first_chunk
            slot = lk.held.slots[idx][0]
            span = lk.tail_blocks if idx == lk.full else 0
            self._loads.append(CopyOp(rid, slot, list(block_ids[lo:hi]), lo - c * self.bpc,
                                      span))
            tier = self.store.tiers[lk.held.from_tier[idx]].name
            by_tier[tier] = by_tier.get(tier, 0) + (hi - lo) * self.bs
        self._load_holds.append(lk.held)
        record_restore(by_tier)
        staged_ms = (time.perf_counter() - lk.t0) * 1e3
        self._restored[rid] = (by_tier, staged_ms)
        log.info(
            "kvtier: restoring %d tokens for %s (%s), %.1f MiB, staged in %.1f ms",
            num_external, rid, ", ".join(f"{t} {n}" for t, n in by_tier.items()),
            num_external / self.ct * self.slot_bytes / 2**20, staged_ms,
        )

    def _start_stream(self, rid: str, lk: _Lookup, block_ids: Sequence[int], lo_blk: int,
                      hi_blk: int) -> None:
        """A streamed restore admitted: its first entries' copy ops go out with this step,
        the rest follow as ``_advance_streams`` reads them (``stream.py``)."""
        assert lk.held is not None and lk.stream is not None
        found, specs = lk.stream
        copies: list[ChunkCopy | None] = []
        for idx in range(found.hits):
            c = lk.first_chunk + idx
            lo, hi = max(lo_blk, c * self.bpc), min(hi_blk, (c + 1) * self.bpc)
            span = lk.tail_blocks if idx == lk.full else 0
            copies.append(ChunkCopy(list(block_ids[lo:hi]), lo - c * self.bpc, span)
                          if lo < hi else None)
        st = StreamedLoad(rid, found, specs, copies, self._stream_window, self.bs,
                          lambda: LoadProgress(self.clock))
        st.span_tokens = (lk.start_tokens, hi_blk * self.bs)
        out = Advance()
        st.hand_out(lk.held, out)
        self._streams[rid] = st
        self._take(rid, out)
        self._recving.add(rid)
        self._async_blocks[rid] = hi_blk - lo_blk
        by_tier: dict[str, int] = {}
        for idx, tier in enumerate(found.tiers):
            copy = copies[idx]
            if copy is not None:
                name = self.store.tiers[tier].name
                by_tier[name] = by_tier.get(name, 0) + len(copy.block_ids) * self.bs
        record_restore(by_tier)
        staged_ms = (time.perf_counter() - lk.t0) * 1e3
        self._restored[rid] = (by_tier, staged_ms)
        log.info("kvtier: streaming %d tokens for %s (%s) through %d host slots; first "
                 "%d chunks staged in %.1f ms", (hi_blk - lo_blk) * self.bs, rid,
                 ", ".join(f"{t} {n}" for t, n in by_tier.items()), st.window,
                 len(lk.held), staged_ms)

    def _take(self, rid: str, out: Advance) -> None:
        """A stream's step: its ops and holds go out with the next metadata."""
        if out.ops:
            self._loads.extend(out.ops)
            self._async_reqs.append(rid)
        self._load_holds.extend(out.holds)

    def _advance_streams(self) -> None:
        """Every streamed restore moves on (``StreamedLoad.advance``); one whose read
        failed or stalled ends with a load that fails on purpose (vLLM recomputes it)."""
        now = self.clock.monotonic()
        for rid, st in list(self._streams.items()):
            lo, hi = st.span_tokens
            stall_s = self.waits.seconds(self.load_stall_s, lo, hi, now)
            out = st.advance(self.store, stall_s)
            self._take(rid, out)
            if out.failed:
                self.waits.missed(now)
                record_drop("load_timeout")
                log.warning("kvtier: streamed restore of %s could not read chunk %d of %d; "
                            "vLLM recomputes it", rid, st.next, st.found.hits)
            if out.ended:
                del self._streams[rid]

    # -- 4. the eviction hook ---------------------------------------------------------------
    def request_finished(
        self, request: Any, block_ids: Sequence[int]
    ) -> tuple[bool, dict[str, Any]]:
        """Reserve slots for the request's unsaved full chunks and, with ``partial_tails``,
        its tail: the full blocks of its last, partial chunk.

        Returns (delay freeing the blocks, ``kv_transfer_params`` for the response):
        the params say what kvtier restored for this request and what it now holds:
        ``namespace``, ``tokens`` (the prefix, prompt and output, that is stored or being
        stored: whole chunks, then possibly a tail's blocks; what a P/D decode node may
        wait for), ``last_key`` (names the whole chain: the tail's key when ``tokens``
        ends in one) and ``expires_at`` (wall clock, end of the shared-tier lease unless
        renewed), plus restore statistics.
        """
        rid = request.request_id
        recving = rid in self._recving
        restored, restore_ms, seen_epoch = self._end_request(rid)
        if recving:
            # finished (aborted) while its streamed restore is in flight: its blocks hold
            # nothing computed yet, and vLLM frees them when the load is reported
            self._key_cache.pop(rid, None)
            return False, self._params(rid, b"", 0, None, restored, restore_ms, 0, 0)
        n_blocks = min(_saveable_tokens(request) // self.bs, len(block_ids))
        n_chunks, tail_blocks = divmod(n_blocks, self.bpc)
        if not self.tails:
            tail_blocks = 0
        if self.geom.window:
            return self._window_finished(request, n_chunks, tail_blocks, block_ids,
                                         seen_epoch, restored, restore_ms)
        try:
            got = self._keys(request, n_chunks * self.ct)
        except Unsupported:
            got = PENDING
        if seen_epoch != self.identities.epoch:
            got = PENDING  # it ran across a weights reset: its KV may mix both weights
        if got is PENDING:  # identity unknown (or refused): store nothing
            n_chunks, tail_blocks, got = 0, 0, (b"", [])
        ns, keys = got
        tail = None
        if tail_blocks:
            key = self._tail_key(request, keys, n_chunks, tail_blocks)
            meta = self._tail_spec(ns, tail_blocks).meta(
                key, keys[n_chunks - 1] if n_chunks else None)
            lo = n_chunks * self.bpc
            tail = _Piece(key, meta, list(block_ids[lo : lo + tail_blocks]), tail_blocks)
        wanted = (n_chunks or tail) and _request_params(request).get("save") is not False
        saved, held = (self._save(rid, request, ns, keys, block_ids, tail) if wanted
                       else (0, 0))
        self._key_cache.pop(rid, None)
        tokens = min(held, n_chunks) * self.ct
        last = keys[held - 1] if 0 < held <= n_chunks else None
        if held > n_chunks:
            assert tail is not None
            tokens, last = tokens + tail.span * self.bs, tail.key
        whole = n_chunks * self.slot_bytes + (tail.meta.payload_len if tail else 0)
        return saved > 0, self._params(rid, ns, tokens, last, restored, restore_ms,
                                       saved, whole)

    def _end_request(self, rid: str) -> tuple[dict[str, int], float, int]:
        """A finished (or aborted) request's per-request state is dropped: returns what it
        restored (by tier), its staging time and the weights epoch it was first seen in."""
        self._forget(rid)
        st = self._streams.pop(rid, None)
        if st is not None:
            st.cancel()  # the worker reports it received once its copies are done
        self._waiting.pop(rid, None)
        self._probes.pop(rid, None)
        self._probes.pop(rid + TAIL_PROBE, None)
        self._async_blocks.pop(rid, None)
        self._recving.discard(rid)
        self._load_failed.discard(rid)
        self._capped.pop(rid, None)
        restored, restore_ms = self._restored.pop(rid, ({}, 0.0))
        return restored, restore_ms, self._epoch_of.pop(rid, self.identities.epoch)

    def _params(self, rid: str, ns: bytes, tokens: int, last: ChunkKey | None,
                restored: dict[str, int], restore_ms: float, saved: int,
                whole: int) -> dict[str, Any]:
        """A finished request's ``kv_transfer_params`` (``request_finished``)."""
        params = {
            "namespace": ns.hex(),
            "tokens": tokens,
            "last_key": None if last is None else last.hex(),
            "restored_tokens": sum(restored.values()),
            "restored_by_tier": restored,
            "restore_ms": round(restore_ms, 3),
            "decision": self._decision(rid),
            "expires_at": time.time() + self.lease_s,
            "role": self.role,
            "spilled_bytes": saved,
            "write_through_bytes": whole,
        }
        return {"kvtier": params}

    def _window_finished(
        self, request: Any, n_chunks: int, tail_blocks: int, block_ids: Sequence[int],
        seen_epoch: int, restored: dict[str, int], restore_ms: float,
    ) -> tuple[bool, dict[str, Any]]:
        """``request_finished`` of a sliding-window model: save the window of the
        request's prefix down to its last block (down to its last chunk without tails),
        if vLLM still holds all of it. ``tokens`` announces that prefix once its window
        is stored or being stored; ``last_key`` is the key of the window's last part."""
        rid = request.request_id
        try:
            got = self._keys(request, n_chunks * self.ct)
        except Unsupported:
            got = PENDING
        if seen_epoch != self.identities.epoch or got is PENDING:
            self._key_cache.pop(rid, None)
            return False, self._params(rid, b"", 0, None, restored, restore_ms, 0, 0)
        ns, keys = got
        end = n_chunks * self.ct + tail_blocks * self.bs
        saved = whole = tokens = 0
        last: ChunkKey | None = None
        if end and _request_params(request).get("save") is not False:
            last = self._end_key(request, keys, end)
            parts, part_keys = self._window_keys(last, end)
            if not saveable(list(block_ids), parts):
                record_drop("window_freed")
                last = None
            else:
                # part i's parent is part i - 1, part 0's the piece ending the prefix:
                # ``last_key`` names the last part, and a lease renewal walks the window
                prevs = [last, *part_keys[:-1]]
                pieces = [_Piece(k, self._tail_spec(ns, n).meta(k, prev),
                                 list(block_ids[b : b + n]), n if n < self.bpc else 0)
                          for k, prev, (b, n) in zip(part_keys, prevs, parts, strict=True)]
                stored = self.store.lookup_indexed(part_keys).hits
                whole = sum(p.meta.payload_len for p in pieces)
                saved, held = self._save_pieces(rid, request, keys, pieces[stored:],
                                                stored, stored, supersede=False,
                                                baseline=whole)
                tokens, last = (end, part_keys[-1]) if held == len(pieces) else (0, None)
        self._key_cache.pop(rid, None)
        return saved > 0, self._params(rid, ns, tokens, last, restored, restore_ms,
                                       saved, whole)

    def _decision(self, rid: str) -> dict[str, str] | None:
        """The restore-or-recompute decision for ``rid``, for its response (why kvtier
        restored what it did): ``{"outcome": ..., "detail": ...}``."""
        d = self._decisions.pop(rid, None)
        return None if d is None else {"outcome": d.outcome.value, "detail": str(d)}

    def _superseded(self, request: Any, keys: Sequence[ChunkKey], chunk: int,
                    blocks: int) -> list[ChunkKey]:
        """The keys of the tails of chunk ``chunk`` shorter than ``blocks`` blocks
        (``blocks_per_chunk``: the whole chunk), which the host tier drops once the save
        that covers them commits: it holds their bytes too (a save that fails drops
        nothing). A return that agrees with the longer save restores it; one that
        branches inside the chunk recomputes at most that chunk, as without tails. Lower
        tiers keep what they were given (write-through tails of a P/D node; spilled ones)
        until their collection: a shared tier may serve another node's request. Memory
        only: at most ``blocks_per_chunk - 1`` keys hashed."""
        return [self._tail_key(request, keys, chunk, k) for k in range(1, blocks)]

    def _save(
        self, rid: str, request: Any, ns: bytes, keys: list[ChunkKey],
        block_ids: Sequence[int], tail: _Piece | None,
    ) -> tuple[int, int]:
        """Queue copies of the chunks not stored yet, then of the ``tail`` (if any).
        Returns (bytes to copy, length of the stored prefix in pieces: whole chunks, and
        ``len(keys) + 1`` if the tail is stored or will be): what the response announces.

        Concurrent saves of one prefix (requests that share a new system prompt and finish
        in the same step): a chunk another request is saving counts as held, and this
        request goes on to its own chunks. The announcement never names a chunk that will
        not exist (a P/D decode node would wait ``wait_seconds`` for it):

        * a chunk that gets no host slot ends it (and the chunks after it are not copied:
          a prefix with a hole is not reusable);
        * for a node that hands KV to another node (``role`` prefill or decode), a chunk
          another request is still saving is copied again into a *backup* slot
          (``store.reserve(backup=True)``), so this request's chain never depends on the
          other save succeeding; the first commit is published and the other slot is
          freed. One backup per chunk: a chunk that already has two saves in flight is
          announced without a third copy (both would have to fail). Without a backup
          slot such a chunk ends the announcement (the other save usually lands);
        * for such a node, so does a write-through that the store queue cannot take now.

        A node that serves its own requests (``both``) makes no backups: the worst a
        failed save of a shared chunk costs it is a recompute of the chunks after it.
        The tail is one more piece after the whole chunks, under the same rules; the first
        piece this request saves itself supersedes the shorter tails of its chunk
        (``_superseded``), once the save commits.
        """
        n_chunks = len(keys)
        stored = self.store.lookup_indexed(keys).hits  # memory only: scheduler thread
        held = stored
        shared = self.role != "both" and any(
            lt.write is WritePolicy.THROUGH for lt in self.store.lower)
        # A re-offer costs one existence check per chunk per tier: at most once per
        # quarter lease per chunk (a renewal or write within that keeps it alive).
        if shared and stored and self.store.rewrite_through(
                keys[:stored], min_age_s=self.lease_s / 4) == 0:
            # Our host copy may have outlived the shared one (collected past its lease),
            # and the job that offers them again was dropped: announce what the shared
            # tier's index knows.
            held = next((i for i, k in enumerate(keys[:stored]) if not any(
                lt.tier.indexed(k) for lt in self.store.lower)), stored)
        pieces = [_Piece(keys[c], self._meta(ns, keys, c),
                         list(block_ids[c * self.bpc : (c + 1) * self.bpc]))
                  for c in range(stored, n_chunks)]
        if tail is not None:
            pieces.append(tail)
        return self._save_pieces(rid, request, keys, pieces, stored, held,
                                 supersede=self.tails, baseline=n_chunks * self.slot_bytes)

    def _save_pieces(self, rid: str, request: Any, keys: Sequence[ChunkKey],
                     pieces: list[_Piece], stored: int, held: int, *,
                     supersede: bool, baseline: int) -> tuple[int, int]:
        """Reserve and queue ``pieces`` (the chain's pieces from number ``stored`` on;
        ``held`` of the chain are known stored), under ``_save``'s rules; ``baseline``:
        the bytes a save of everything would write (a metric). Returns (bytes to copy,
        pieces of the chain announced)."""
        shared = self.role != "both" and any(
            lt.write is WritePolicy.THROUGH for lt in self.store.lower)
        room = (self.store.free_store_slots(WritePolicy.THROUGH) if shared
                else len(pieces) + 1)
        if shared and not self.store.shared_up(every=True):
            room = 0  # a down shared tier drops writes: announce nothing new
        announce = held  # grows only while the chain from chunk 0 stays whole
        saves: list[tuple[int, ChunkMeta]] = []
        later: list[ChunkKey] = []  # superseded once this save commits
        nbytes = 0
        for c, piece in enumerate(pieces, start=stored):
            slot = self.store.reserve(piece.key)
            if slot is None and shared and self.store.saving(piece.key):
                slot = self.store.reserve(piece.key, backup=True)
            if slot is None:
                if not self.store.holds(piece.key):
                    record_drop("host_full")
                    break
                if c == stored and supersede:  # another request's copy is (being) stored
                    self.store.discard(self._superseded(request, keys, c,
                                                        piece.span or self.bpc))
                # stored meanwhile, or being saved by another request: held. Announced
                # if published, or (P/D) if two saves of it are in flight already (one
                # request's and a backup: both would have to fail)
                if announce == c and not (shared and self.store.saving(piece.key) == 1):
                    announce = c + 1
                continue
            if c == stored and supersede:
                later = self._superseded(request, keys, c, piece.span or self.bpc)
            saves.append((slot, piece.meta))
            nbytes += piece.meta.payload_len
            self._to_save.append(CopyOp(rid, slot, piece.block_ids, 0, piece.span,
                                        piece.group))
            if announce == c and len(saves) <= room:
                announce = c + 1
        record_spill(nbytes, baseline)
        if saves:
            self._saves[rid] = _Save(saves, later)
        return nbytes, announce

    # -- per step ---------------------------------------------------------------------------
    def build_meta(self, scheduler_output: Any = None) -> KVTierMetadata:
        self._step += 1
        if self._lookups:
            self._release_stale_staging()
        if self.flusher is not None:
            self.flusher.busy()
        if self.step_timer is not None and scheduler_output is not None:
            self.step_timer.built(self._step, scheduler_output, self._loads)
        if self._streams:
            self._advance_streams()
        meta = KVTierMetadata(self._step, self._loads, self._to_save,
                              async_loads=bool(self.geom.groups),
                              async_reqs=self._async_reqs, more=sorted(self._streams))
        if self._load_holds:
            self._holds_by_step[self._step] = self._load_holds
        self._loads, self._to_save, self._load_holds, self._async_reqs = [], [], [], []
        return meta

    def on_worker_output(self, finished_sending: set[str] | None, worker_meta: Any, *,
                         failed_load_blocks: int = 0, failed_loads: set[str] | None = None,
                         finished_recving: set[str] | None = None) -> None:
        """A step's output, folded over every rank by vLLM: saves finished on every rank,
        our worker metadata, how many blocks failed to load on any rank (vLLM's union,
        counted here once, not per rank), and the requests whose asynchronous loads
        failed (a hybrid model's: vLLM recomputes them)."""
        if failed_load_blocks:
            record_failed_loads(failed_load_blocks)
        self._recving.difference_update(finished_recving or ())
        for rid in failed_loads or ():
            log.warning("kvtier: restore of %s failed; vLLM recomputes it", rid)
            st = self._streams.pop(rid, None)
            if st is not None:
                st.cancel()
            record_failed_loads(self._async_blocks.pop(rid, 0))
            self._recving.discard(rid)
            self._load_failed.add(rid)  # vLLM asks again: the answer is 0 from now on
        if isinstance(worker_meta, KVTierWorkerMetadata):
            if self.step_timer is not None:
                self.step_timer.done(worker_meta.step)
            for step in worker_meta.loaded_steps:
                # every rank reads the step's slots: release them after the last one
                acks = self._load_acks.get(step, 0) + 1
                if acks < self.geom.tp_world:
                    self._load_acks[step] = acks
                    continue
                self._load_acks.pop(step, None)
                for held in self._holds_by_step.pop(step, []):
                    held.release()
            if self._streams:  # slots came back: the next reads start now
                self._advance_streams()
            # a rank's failure comes with its own report; the save is finished (below)
            # only once every rank has reported it, possibly steps later
            self._failed_saves.update(r for r in worker_meta.failed_saves if r in self._saves)
        for rid in finished_sending or ():
            save = self._saves.pop(rid, None)
            failed = rid in self._failed_saves
            self._failed_saves.discard(rid)
            if save is None:
                continue
            lost: list[ChunkKey] = []
            for slot, meta in save.slots:
                if failed:
                    self.store.abort(slot)
                elif not self.store.commit(slot, meta):
                    lost.append(meta.key)  # a backup another save beat to it
            if save.supersedes and not failed:
                self.store.discard(save.supersedes)
            if lost and self.role != "both":
                # this request announced them: offer the published copies to the shared
                # tiers again, in case the winner's write-through was dropped (a CREATE
                # that finds the object costs one existence check)
                self.store.rewrite_through(lost)

    def has_pending_saves(self) -> bool:
        return bool(self._saves)

    def reset(self) -> bool:
        """``reset_cache`` (vLLM's ``reset_prefix_cache(reset_connector=True)``).

        ``reset_cache: weights`` (default; RL trainers reset after a weight sync): from
        now on this engine never serves KV it stored before. The weights epoch is bumped
        (``RequestIdentities.bump_epoch``: every namespace digest made from now on
        differs), cached keys and staged lookups of waiting requests are dropped, and the
        host tier is emptied, dirty chunks included: they may have been computed with the
        old weights, so they are dropped, never written below. Lower tiers keep what they
        hold (other nodes and restarts share them; this engine never asks for the old
        epoch's keys again, and after a restart epoch 0 means the weights on disk again).
        Memory only: returns at once.

        ``reset_cache: host``: only the host tier is emptied; what the lower tiers hold is
        still served. Dirty chunks are queued to the write-back tiers, never waited for:
        the reset answers False (vLLM's "not done, ask again", as while a save is in
        flight) until they are written and dropped. Memory only: returns at once.
        """
        for rid in list(self._lookups):
            self._forget(rid)
        self._probes.clear()
        self._waiting.clear()
        if self.cfg.reset_cache == "host":
            n, empty = self.store.empty_host()
            log.info("kvtier: reset dropped %d host chunks%s", n,
                     "" if empty else "; dirty or busy chunks remain (written, then dropped)")
            return empty
        self.identities.bump_epoch()  # cached keys are rebuilt (_Keys.epoch)
        if self.role != "both":
            log.warning("kvtier: %s node: after this weights reset it shares KV with no "
                        "node that has not reset with it (the epoch is this engine's "
                        "own); P/D hand-offs recompute until both restart",
                        self.role)
        n = self.store.drop_host()
        log.info("kvtier: reset: new weights epoch, dropped %d host chunks", n)
        return True

    def stop_flush_pending(self) -> bool:
        """A stop signal started a flush that is still running (within its budget): vLLM's
        engine loop keeps stepping (``has_pending_push_work``), so its own signal handler
        stays installed and a second SIGTERM cannot kill the flush. Memory only."""
        return self.flusher is not None and self.flusher.stop_flush_pending()

    def close(self) -> None:
        """Engine shutdown: flush dirty host chunks below, most recent first, and finish
        queued writes, all within ``shutdown_flush_seconds`` (including a flush a stop
        signal already started), so a restarted engine restores them."""
        budget = self.cfg.shutdown_flush_seconds
        if self.flusher is not None:  # one budget, counted from the stop signal's flush
            budget = self.flusher.stop_deadline_left(budget)
        t0 = time.monotonic()
        for rid in list(self._lookups):
            self._forget(rid)
        for st in self._streams.values():
            st.cancel()
        if self.flusher is not None:
            self.flusher.close(timeout=budget)
        self.store.shutdown(max(0.0, budget - (time.monotonic() - t0)))
        self.identities.close()
