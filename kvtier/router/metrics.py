"""What the router measures: one ``Turn`` record per request, and the Prometheus metrics.

Invariants:

* A ``Turn`` is filled in by the one request it belongs to and observed exactly once, when
  that request ends (also when the client went away: status 0, counted as "aborted").
* Latencies (prefill, time to first token) are measured with ``time.perf_counter`` by the
  caller; behaviour over time never depends on them.
* The metrics live in a registry each ``RouterMetrics`` owns: several routers per process
  (as in tests) never share counts, and the process-global registry is left alone.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from aiohttp import web
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from kvtier.router.protocol import Endpoint

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


@dataclass
class Turn:
    """What one request measured; filled in as it goes, logged once at the end."""

    endpoint: Endpoint
    started: float
    conversation: str | None = None
    prefill_s: float | None = None
    restored_tokens: int = 0
    restore_ms: float = 0.0
    restored_by_tier: dict[str, int] = field(default_factory=dict)
    ttft_s: float | None = None
    status: int = 0
    stream_broken: bool = False

    def prefill_headers(self) -> dict[str, str]:
        """What the prefill phase did, for clients and benchmarks (known before decode)."""
        return {
            "X-KVTier-Prefill-Ms": f"{(self.prefill_s or 0.0) * 1e3:.1f}",
            "X-KVTier-Restored-Tokens": str(self.restored_tokens),
            "X-KVTier-Restore-Ms": f"{self.restore_ms:.1f}",
            "X-KVTier-Restored-By-Tier": ",".join(
                f"{tier}={n}" for tier, n in sorted(self.restored_by_tier.items())
            ),
        }


class RouterMetrics:
    """Prometheus metrics in a registry the router owns (see the module invariants)."""

    def __init__(self, conversations: Callable[[], int], in_flight: Callable[[], int]) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("kvtier_router_requests_total", "Requests by endpoint and status",
                                ["endpoint", "status"], registry=r)
        self.prefill = Histogram("kvtier_router_prefill_seconds", "Wall time of the prefill call",
                                 buckets=_LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("kvtier_router_ttft_seconds", "Request arrival to first decode byte",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.kv_load = Histogram("kvtier_router_kv_load_seconds",
                                 "KV restore time the prefill server reported",
                                 buckets=_LATENCY_BUCKETS, registry=r)
        self.kv_tokens = Counter("kvtier_router_kv_load_tokens_total",
                                 "Tokens whose KV prefill restored instead of computing",
                                 registry=r)
        self.renewed = Counter("kvtier_router_renewed_chunks_total", "Chunk leases renewed",
                               registry=r)
        self.expired = Counter("kvtier_router_expired_objects_total",
                               "Objects past their lease the heartbeat's collector removed",
                               registry=r)
        self.rejected = Counter("kvtier_router_rejected_total",
                                "Requests refused before any work, by reason "
                                "(unauthorized, overloaded)", ["reason"], registry=r)
        gauge = Gauge("kvtier_router_conversations", "Tracked (unexpired) conversations",
                      registry=r)
        gauge.set_function(lambda: float(conversations()))
        busy = Gauge("kvtier_router_in_flight", "Requests being served (of --max-concurrency)",
                     registry=r)
        busy.set_function(lambda: float(in_flight()))

    def reject(self, reason: str) -> None:
        self.rejected.labels(reason).inc()

    def observe(self, turn: Turn) -> None:
        self.requests.labels(turn.endpoint, str(turn.status or "aborted")).inc()
        if turn.prefill_s is not None:
            self.prefill.observe(turn.prefill_s)
        if turn.restored_tokens > 0:  # a load happened; turns without one would skew it to 0
            self.kv_load.observe(turn.restore_ms / 1e3)
            self.kv_tokens.inc(turn.restored_tokens)
        if turn.ttft_s is not None:
            self.ttft.observe(turn.ttft_s)

    def render(self) -> web.Response:
        return web.Response(body=generate_latest(self.registry),
                            headers={"Content-Type": CONTENT_TYPE_LATEST})
