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

from collections.abc import Callable, Iterator
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
from prometheus_client.core import CounterMetricFamily, Metric

from kvtier.router.protocol import Endpoint, PromptUsage

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_LOOKUP_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
_TOKEN_BUCKETS = (0, 16, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 131072)


class _ReadCounters:
    """Counters whose value another object keeps (read at scrape time)."""

    def __init__(self) -> None:
        self._counters: list[tuple[str, str, Callable[[], int]]] = []

    def add(self, name: str, doc: str, read: Callable[[], int]) -> None:
        self._counters.append((name, doc, read))

    def collect(self) -> Iterator[Metric]:
        for name, doc, read in self._counters:
            yield CounterMetricFamily(name, doc, value=float(read()))


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
    ttft_s: float | None = None  # to the first byte (non-streamed: to the whole answer)
    streamed: bool = False  # ttft_s is a first byte (the cost fit learns only from these)
    status: int = 0
    stream_broken: bool = False
    path: str | None = None  # "prefill_decode" or "decode_only", once decided
    reason: str | None = None  # why (``kvtier.router.selective``)
    uncached_tokens: int | None = None  # the estimate the decision used
    tenant: str | None = None
    prompt_bytes: int = 0  # of the prompt text (``ProxyRequest.prompt_bytes``)
    prompt_tokens: int | None = None  # exact or estimated, as the decision used it
    prefill_tokens: int | None = None  # the tokens the prefill call's params hold
    prefill_usage: PromptUsage | None = None  # what the prefill call's ``usage`` said
    held_tokens: int | None = None  # of the prompt, in the shared tier (None: unknown)
    lookup_s: float | None = None  # the router's own added time: tokenize + tier lookup
    tokenize_s: float | None = None  # of which vLLM's /tokenize (None: not called)
    probe_heads: int = 0  # store lookups the held-prefix probe made

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

    def __init__(self, conversations: Callable[[], int], in_flight: Callable[[], int],
                 evicted: Callable[[], int], threshold: Callable[[], float]) -> None:
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
        self.renew_deferred = Counter(
            "kvtier_router_renew_deferred_total",
            "Conversations a heartbeat left for the next one (its renewal budget ran out)",
            registry=r)
        self.lapsed = Counter("kvtier_router_leases_lapsed_total",
                              "Live conversations whose chain went a whole lease unrenewed",
                              registry=r)
        self.shortfalls = Counter(
            "kvtier_router_pricing_shortfalls_total",
            "Decode-only turns whose decode node restored under 95% of the tokens priced "
            "as held (their identity is then checked chunk by chunk for a minute)",
            registry=r)
        self.heartbeat = Histogram("kvtier_router_heartbeat_renew_seconds",
                                   "Wall time of one heartbeat's lease renewal",
                                   buckets=_LATENCY_BUCKETS, registry=r)
        self.decisions = Counter("kvtier_router_pd_decisions_total",
                                 "Selective P/D decisions by path and reason",
                                 ["path", "reason"], registry=r)
        self.uncached = Histogram("kvtier_router_uncached_tokens",
                                  "Estimated uncached prompt tokens per turn, by path",
                                  ["path"], buckets=_TOKEN_BUCKETS, registry=r)
        self.path_ttft = Histogram("kvtier_router_path_ttft_seconds",
                                   "Request arrival to first decode byte, by path",
                                   ["path"], buckets=_LATENCY_BUCKETS, registry=r)
        self.lookup = Histogram("kvtier_router_prefix_lookup_seconds",
                                "Time the router spent finding a prompt's held prefix "
                                "(tokenize, keys, tier index and probe)",
                                buckets=_LOOKUP_BUCKETS, registry=r)
        self.tenant_reloads = Counter("kvtier_router_tenant_reloads_total",
                                      "Tenants file loads by result (ok, error)", ["result"],
                                      registry=r)
        threshold_gauge = Gauge("kvtier_router_pd_threshold_tokens",
                                "Uncached tokens up to which an unloaded turn goes decode-only",
                                registry=r)
        threshold_gauge.set_function(threshold)
        read = _ReadCounters()
        read.add("kvtier_router_conversations_evicted",
                 "Conversations dropped because the map was full (--max-conversations)",
                 evicted)
        r.register(read)  # type: ignore[arg-type]
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
            if turn.path is not None:
                self.path_ttft.labels(turn.path).observe(turn.ttft_s)
        if turn.lookup_s is not None:
            self.lookup.observe(turn.lookup_s)
        if turn.path is not None and turn.reason is not None:
            self.decisions.labels(turn.path, turn.reason).inc()
            if turn.uncached_tokens is not None:
                self.uncached.labels(turn.path).observe(turn.uncached_tokens)

    def render(self) -> web.Response:
        return web.Response(body=generate_latest(self.registry),
                            headers={"Content-Type": CONTENT_TYPE_LATEST})
