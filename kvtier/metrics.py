"""What kvtier counts, and how the counts leave the process that made them.

Two destinations, never a Prometheus collector of kvtier's own:

* **Local mirrors.** ``TierMetrics.counts`` (a ``TierCounters``) belongs to one tier instance,
  so several stores in one process (tests, benchmarks) never see each other's counts.
* **The export batch.** In a process where the vLLM connector runs, ``enable_export()`` turns
  on one process-wide ``StatsBatch``; every record also lands there, and the connector
  ``drain_export()``\\ s it once per engine step into vLLM's connector stats
  (``kvtier.vllm.stats``). vLLM carries those to the API server, whose ``/metrics`` shows the
  ``SERIES`` below. Where export is off (the default: tests, CLI, the API server), nothing
  accumulates.

Invariants:

* Importing this module registers nothing anywhere: a process that never receives engine
  stats (vLLM's API server imports kvtier to build the metrics) shows no kvtier series
  that stay at zero.
* A batch is plain data, ``{series name: {label key: value}}``: a number for counters
  and gauges, a list of observations for histograms. It survives pickle and msgpack.
  The label key is the label values joined by ``|``, so label values never contain ``|``.
* Merging adds counters, keeps the newer gauge value and concatenates observations (at
  most ``MAX_OBSERVATIONS`` per series and label key per batch; later ones are counted in
  ``kvtier_observations_dropped_total``). Every record lands in exactly one drained batch.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, fields
from enum import Enum
from typing import Any

#: One batch's data: series name -> label key -> number (counter, gauge) or list (histogram).
BatchData = dict[str, dict[str, Any]]

LABEL_SEP = "|"
MAX_OBSERVATIONS = 4096


class Kind(Enum):
    COUNTER = "counter"
    GAUGE = "gauge"
    HISTOGRAM = "histogram"


@dataclass(frozen=True)
class Series:
    name: str
    kind: Kind
    doc: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] = ()


_C, _G, _H = Kind.COUNTER, Kind.GAUGE, Kind.HISTOGRAM
_SECONDS = (1e-4, 3e-4, 1e-3, 3e-3, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0)

HITS = Series("kvtier_tier_hits_total", _C, "Chunks found by get", ("tier",))
MISSES = Series("kvtier_tier_misses_total", _C, "Chunks not found by get", ("tier",))
BYTES_WRITTEN = Series("kvtier_tier_bytes_written_total", _C, "Payload bytes stored", ("tier",))
BYTES_READ = Series("kvtier_tier_bytes_read_total", _C, "Payload bytes read", ("tier",))
ERRORS = Series("kvtier_tier_errors_total", _C, "Backing-store faults", ("tier", "op"))
CORRUPTIONS = Series(
    "kvtier_tier_corruptions_total", _C, "Objects failing verification (each a miss)", ("tier",)
)
EVICTIONS = Series("kvtier_tier_evictions_total", _C, "Chunks evicted for capacity", ("tier",))
USED = Series("kvtier_tier_used_bytes", _G, "Bytes held by the tier", ("tier",))
FULL = Series(
    "kvtier_tier_full_total", _C,
    "Writes the store refused for space (ENOSPC, EDQUOT, an S3 quota); each lowers the "
    "capacity the tier collects to", ("tier",),
)
CAPACITY = Series(
    "kvtier_tier_capacity_bytes", _G,
    "The capacity the tier collects to: the configured one, or less after the store "
    "refused a write for space", ("tier",),
)
INDEX_READY = Series(
    "kvtier_tier_index_ready", _G,
    "1 once the tier's start scan has filled its index, 0 while it runs (lookups probe)",
    ("tier",),
)
INDEX_SCANNED = Series(
    "kvtier_tier_index_scanned_objects", _G, "Objects the tier's start scan has indexed so far",
    ("tier",),
)
OP_SECONDS = Series(
    "kvtier_tier_op_seconds", _H, "Latency of one tier get or put", ("tier", "op"), _SECONDS
)
DROPS = Series("kvtier_drops_total", _C, "Stores dropped instead of blocking", ("reason",))
STORE_ERRORS = Series(
    "kvtier_store_errors_total", _C,
    "Store jobs (write-through, spill, write-back, re-offer) that raised, by tier and kind",
    ("tier", "kind"),
)
QUEUE_DEPTH = Series("kvtier_io_queue_depth", _G, "Queued I/O operations", ("queue",))
TIER_UP = Series("kvtier_tier_up", _G, "1 while the tier is used, 0 while its breaker is open",
                 ("tier",))
THRESHOLD_DECISIONS = Series(
    "kvtier_threshold_decisions_total", _C, "Restore-or-recompute decisions, by outcome",
    ("outcome",),
)
RESTORED_TOKENS = Series(
    "kvtier_restored_tokens_total", _C, "Tokens restored into vLLM's KV cache, by source tier",
    ("tier",),
)
RESTORED_REQUESTS = Series("kvtier_restored_requests_total", _C, "Requests served a restore")
SPILLED = Series(
    "kvtier_spilled_bytes_total", _C, "Bytes copied out of vLLM's KV cache by the eviction hook"
)
WT_BASELINE = Series(
    "kvtier_write_through_baseline_bytes_total", _C,
    "Bytes a write-through of every completed chunk would have copied",
)
WORKER_BLOCKS = Series(
    "kvtier_worker_blocks_total", _C, "KV blocks the worker copied, by direction",
    ("direction",),
)
WORKER_FAILED_BLOCKS = Series(
    "kvtier_worker_failed_load_blocks_total", _C,
    "KV blocks whose load failed in the worker (vLLM recomputes them)",
)
WORKER_STEP_SECONDS = Series(
    "kvtier_worker_copy_seconds", _H, "Worker time copying KV in one engine step", (), _SECONDS
)
#: Stages of a restore (``kvtier_restore_stage_seconds{stage}``), where a slow one waited.
RESTORE_STAGES = ("cap", "queue", "settle", "slot", "read", "staged", "copy")
RESTORE_STAGE_SECONDS = Series(
    "kvtier_restore_stage_seconds", _H,
    "Seconds one restore spent per stage: cap (waiting for room under the staging cap), "
    "queue (waiting for an IO thread), settle (waiting for another writer of a chunk's "
    "host slot), slot (writing a dirty chunk below to free a host slot), read (lower-tier "
    "reads), staged (lookup to every chunk held, all of the above), copy (the worker's copy of a "
    "step's loads)",
    ("stage",), _SECONDS,
)
DROPPED_OBSERVATIONS = Series(
    "kvtier_observations_dropped_total", _C,
    f"Histogram observations over {MAX_OBSERVATIONS} per series in one engine step, not exported",
)

SERIES: dict[str, Series] = {
    s.name: s
    for s in (
        HITS, MISSES, BYTES_WRITTEN, BYTES_READ, ERRORS, CORRUPTIONS, EVICTIONS, USED,
        FULL, CAPACITY, INDEX_READY, INDEX_SCANNED,
        OP_SECONDS, DROPS, STORE_ERRORS, QUEUE_DEPTH, TIER_UP, THRESHOLD_DECISIONS, RESTORED_TOKENS,
        RESTORED_REQUESTS, SPILLED,
        WT_BASELINE, WORKER_BLOCKS, WORKER_FAILED_BLOCKS, WORKER_STEP_SECONDS,
        RESTORE_STAGE_SECONDS, DROPPED_OBSERVATIONS,
    )
}


def label_key(series: Series, values: tuple[str, ...]) -> str:
    if len(values) != len(series.labels):
        raise ValueError(f"{series.name}: labels {series.labels}, got values {values}")
    for v in values:
        if LABEL_SEP in v:
            raise ValueError(f"{series.name}: label value {v!r} contains {LABEL_SEP!r}")
    return LABEL_SEP.join(values)


def label_values(series: Series, key: str) -> tuple[str, ...]:
    return tuple(key.split(LABEL_SEP)) if series.labels else ()


def merge(into: BatchData, other: BatchData) -> BatchData:
    """Fold ``other`` into ``into`` (see the module invariants); returns ``into``."""
    for name, values in other.items():
        series = SERIES.get(name)
        if series is None:
            raise ValueError(f"unknown kvtier series {name!r} in connector stats")
        mine = into.setdefault(name, {})
        for key, value in values.items():
            if series.kind is Kind.COUNTER:
                mine[key] = mine.get(key, 0) + value
            elif series.kind is Kind.GAUGE:
                mine[key] = value
            else:
                _extend(into, mine.setdefault(key, []), value)
    return into


def _extend(data: BatchData, obs: list[float], new: list[float]) -> None:
    room = MAX_OBSERVATIONS - len(obs)
    obs.extend(new[: max(room, 0)])
    if len(new) > room:
        dropped = data.setdefault(DROPPED_OBSERVATIONS.name, {})
        dropped[""] = dropped.get("", 0) + len(new) - max(room, 0)


class StatsBatch:
    """Records since the last ``drain``. Thread-safe (IO threads record into it)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._data: BatchData = {}

    def add(self, series: Series, n: float, *labels: str) -> None:
        assert series.kind is Kind.COUNTER, series.name
        key = label_key(series, labels)
        with self._lock:
            values = self._data.setdefault(series.name, {})
            values[key] = values.get(key, 0) + n

    def set(self, series: Series, value: float, *labels: str) -> None:
        assert series.kind is Kind.GAUGE, series.name
        key = label_key(series, labels)
        with self._lock:
            self._data.setdefault(series.name, {})[key] = value

    def observe(self, series: Series, value: float, *labels: str) -> None:
        assert series.kind is Kind.HISTOGRAM, series.name
        key = label_key(series, labels)
        with self._lock:
            _extend(self._data, self._data.setdefault(series.name, {}).setdefault(key, []),
                    [value])

    def drain(self) -> BatchData:
        """Everything recorded since the last drain (``{}`` if nothing), and start afresh."""
        with self._lock:
            data, self._data = self._data, {}
        return data


_export: StatsBatch | None = None
_export_lock = threading.Lock()


def enable_export() -> StatsBatch:
    """Start collecting this process's records for vLLM's connector stats (idempotent)."""
    global _export
    with _export_lock:
        if _export is None:
            _export = StatsBatch()
        return _export


def disable_export() -> None:
    """Stop collecting (what was not drained is dropped); for tests."""
    global _export
    with _export_lock:
        _export = None


def export_enabled() -> bool:
    return _export is not None


def drain_export() -> BatchData:
    """The records since the last drain; ``{}`` if there are none or export is off."""
    batch = _export
    return batch.drain() if batch is not None else {}


def _add(series: Series, n: float, *labels: str) -> None:
    batch = _export
    if batch is not None:
        batch.add(series, n, *labels)


def _set(series: Series, value: float, *labels: str) -> None:
    batch = _export
    if batch is not None:
        batch.set(series, value, *labels)


def _observe(series: Series, value: float, *labels: str) -> None:
    batch = _export
    if batch is not None:
        batch.observe(series, value, *labels)


@dataclass
class TierCounters:
    hits: int = 0
    misses: int = 0
    bytes_written: int = 0
    bytes_read: int = 0
    errors: int = 0
    corruptions: int = 0
    evictions: int = 0
    full: int = 0

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


#: Fault ops that are never the foreground call's own: a restamp after a hit, the start
#: scan, collection, expiry and the walk run on threads of their own or as jobs outside
#: any timed call; ``TierMetrics.errors_here`` leaves them out.
BACKGROUND_OPS = frozenset({"touch", "scan", "collect", "expire", "walk", "delete"})


class TierMetrics:
    """Counters of one tier instance. Thread-safe.

    ``errors_here`` counts the errors recorded on the calling thread only (not for
    ``BACKGROUND_OPS``): a breaker compares it before and after one call, so a call is
    blamed only for its own faults, never for those of a background thread of the same
    tier (issue 32)."""

    def __init__(self, tier: str) -> None:
        self.tier = tier
        self.counts = TierCounters()
        self._lock = threading.Lock()
        self._local = threading.local()
        #: The start scan (persistent tiers): objects indexed so far, and done yet.
        self.index_scanned = 0
        self.index_ready = True

    def _count(self, field: str, n: int) -> None:
        with self._lock:
            setattr(self.counts, field, getattr(self.counts, field) + n)

    def hit(self, nbytes: int) -> None:
        self._count("hits", 1)
        self._count("bytes_read", nbytes)
        _add(HITS, 1, self.tier)
        _add(BYTES_READ, nbytes, self.tier)

    def miss(self) -> None:
        self._count("misses", 1)
        _add(MISSES, 1, self.tier)

    def wrote(self, nbytes: int) -> None:
        self._count("bytes_written", nbytes)
        _add(BYTES_WRITTEN, nbytes, self.tier)

    def error(self, op: str) -> None:
        self._count("errors", 1)
        if op not in BACKGROUND_OPS:
            self._local.errors = self.errors_here() + 1
        _add(ERRORS, 1, self.tier, op)

    def errors_here(self) -> int:
        """Foreground errors this tier recorded on the calling thread (see the class)."""
        n: int = getattr(self._local, "errors", 0)
        return n

    def corrupt(self) -> None:
        self._count("corruptions", 1)
        _add(CORRUPTIONS, 1, self.tier)

    def evicted(self, n: int = 1) -> None:
        self._count("evictions", n)
        _add(EVICTIONS, n, self.tier)

    def used(self, nbytes: int) -> None:
        _set(USED, nbytes, self.tier)

    def full(self, room: int) -> None:
        """The store refused a write for space; the tier now collects to ``room``."""
        self._count("full", 1)
        _add(FULL, 1, self.tier)
        _set(CAPACITY, room, self.tier)

    def capacity(self, nbytes: int) -> None:
        _set(CAPACITY, nbytes, self.tier)

    def index_scan(self, scanned: int, *, ready: bool) -> None:
        """The start scan's progress: objects indexed so far, and whether it is done."""
        self.index_scanned, self.index_ready = scanned, ready
        _set(INDEX_SCANNED, scanned, self.tier)
        _set(INDEX_READY, 1 if ready else 0, self.tier)

    def observe(self, op: str, seconds: float) -> None:
        _observe(OP_SECONDS, seconds, self.tier, op)


def record_drop(reason: str) -> None:
    _add(DROPS, 1, reason)


def record_store_error(tier: str, kind: str) -> None:
    _add(STORE_ERRORS, 1, tier, kind)


def set_queue_depth(queue: str, depth: int) -> None:
    _set(QUEUE_DEPTH, depth, queue)


def set_tier_up(tier: str, up: bool) -> None:
    _set(TIER_UP, 1 if up else 0, tier)


def record_threshold_decision(outcome: str) -> None:
    _add(THRESHOLD_DECISIONS, 1, outcome)


def record_restore(tokens_by_tier: dict[str, int]) -> None:
    _add(RESTORED_REQUESTS, 1)
    for tier, n in tokens_by_tier.items():
        _add(RESTORED_TOKENS, n, tier)


def record_spill(spilled: int, baseline: int) -> None:
    _add(SPILLED, spilled)
    _add(WT_BASELINE, baseline)


def record_worker_step(loaded_blocks: int, saved_blocks: int, seconds: float) -> None:
    """One worker step that copied KV (called in the worker process)."""
    if loaded_blocks:
        _add(WORKER_BLOCKS, loaded_blocks, "load")
    if saved_blocks:
        _add(WORKER_BLOCKS, saved_blocks, "save")
    _observe(WORKER_STEP_SECONDS, seconds)
    if loaded_blocks:
        _observe(RESTORE_STAGE_SECONDS, seconds, "copy")


def record_restore_stages(seconds_by_stage: dict[str, float]) -> None:
    """One restore's time per stage (``RESTORE_STAGES``); a stage it did not pass
    through is absent, and observed as nothing."""
    for stage, seconds in seconds_by_stage.items():
        if stage not in RESTORE_STAGES:
            raise ValueError(f"unknown restore stage {stage!r}")
        _observe(RESTORE_STAGE_SECONDS, seconds, stage)


def record_failed_loads(blocks: int) -> None:
    _add(WORKER_FAILED_BLOCKS, blocks)
