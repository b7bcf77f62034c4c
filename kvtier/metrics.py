"""Prometheus metrics per tier, plus plain counters tests and ``kvtier stats`` can read.

Every counter is labelled by tier name. ``TierMetrics`` keeps a local ``TierCounters``
mirror because Prometheus children are process-global: several stores in one process
(tests, benchmarks) must not see each other's counts.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, fields

from prometheus_client import Counter, Gauge, Histogram

_HITS = Counter("kvtier_tier_hits_total", "Chunks found by get", ["tier"])
_MISSES = Counter("kvtier_tier_misses_total", "Chunks not found by get", ["tier"])
_BYTES_IN = Counter("kvtier_tier_bytes_written_total", "Payload bytes stored", ["tier"])
_BYTES_OUT = Counter("kvtier_tier_bytes_read_total", "Payload bytes read", ["tier"])
_ERRORS = Counter("kvtier_tier_errors_total", "Backing-store faults", ["tier", "op"])
_CORRUPT = Counter("kvtier_tier_corruptions_total", "Objects failing verification", ["tier"])
_EVICTIONS = Counter("kvtier_tier_evictions_total", "Chunks evicted for capacity", ["tier"])
_DROPS = Counter("kvtier_drops_total", "Stores dropped instead of blocking", ["reason"])
_QUEUE = Gauge("kvtier_io_queue_depth", "Queued I/O operations", ["queue"])
_USED = Gauge("kvtier_tier_used_bytes", "Bytes held by the tier", ["tier"])
_LATENCY = Histogram(
    "kvtier_tier_op_seconds",
    "Latency of one tier operation",
    ["tier", "op"],
    buckets=(1e-4, 3e-4, 1e-3, 3e-3, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0),
)


@dataclass
class TierCounters:
    hits: int = 0
    misses: int = 0
    bytes_written: int = 0
    bytes_read: int = 0
    errors: int = 0
    corruptions: int = 0
    evictions: int = 0

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


class TierMetrics:
    """Counters of one tier instance. Thread-safe."""

    def __init__(self, tier: str) -> None:
        self.tier = tier
        self.counts = TierCounters()
        self._lock = threading.Lock()

    def _add(self, field: str, n: int) -> None:
        with self._lock:
            setattr(self.counts, field, getattr(self.counts, field) + n)

    def hit(self, nbytes: int) -> None:
        self._add("hits", 1)
        self._add("bytes_read", nbytes)
        _HITS.labels(self.tier).inc()
        _BYTES_OUT.labels(self.tier).inc(nbytes)

    def miss(self) -> None:
        self._add("misses", 1)
        _MISSES.labels(self.tier).inc()

    def wrote(self, nbytes: int) -> None:
        self._add("bytes_written", nbytes)
        _BYTES_IN.labels(self.tier).inc(nbytes)

    def error(self, op: str) -> None:
        self._add("errors", 1)
        _ERRORS.labels(self.tier, op).inc()

    def corrupt(self) -> None:
        self._add("corruptions", 1)
        _CORRUPT.labels(self.tier).inc()

    def evicted(self, n: int = 1) -> None:
        self._add("evictions", n)
        _EVICTIONS.labels(self.tier).inc(n)

    def used(self, nbytes: int) -> None:
        _USED.labels(self.tier).set(nbytes)

    def observe(self, op: str, seconds: float) -> None:
        _LATENCY.labels(self.tier, op).observe(seconds)


def record_drop(reason: str) -> None:
    _DROPS.labels(reason).inc()


def set_queue_depth(queue: str, depth: int) -> None:
    _QUEUE.labels(queue).set(depth)


_RESTORED = Counter(
    "kvtier_restored_tokens_total", "Tokens restored into vLLM's KV cache", ["tier"]
)
_RESTORES = Counter("kvtier_restored_requests_total", "Requests served a restore")
_SPILLED = Counter("kvtier_spilled_bytes_total", "Bytes copied out of vLLM by the eviction hook")
_WT_BASELINE = Counter(
    "kvtier_write_through_baseline_bytes_total",
    "Bytes a write-through of every completed chunk would have copied",
)


def record_restore(tokens_by_tier: dict[str, int]) -> None:
    _RESTORES.inc()
    for tier, n in tokens_by_tier.items():
        _RESTORED.labels(tier).inc(n)


def record_spill(spilled: int, baseline: int) -> None:
    _SPILLED.inc(spilled)
    _WT_BASELINE.inc(baseline)
