"""kvtier.vllm.stats against vLLM's own stats machinery, without an engine.

The Prometheus collectors are built on a registry each test owns, through the
``metric_types`` hook vLLM passes to ``build_prom_metrics``.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorLogging
from vllm.v1.engine import EngineCoreOutputs
from vllm.v1.metrics.stats import SchedulerStats
from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

import kvtier.metrics as m
from kvtier.vllm.connector import KVTierConnector
from kvtier.vllm.stats import KVTierStats

LABELNAMES = ["model_name", "engine"]
ENGINES: dict[int, list[object]] = {0: ["model", "0"], 1: ["model", "1"]}

STEP: m.BatchData = {
    "kvtier_restored_tokens_total": {"file1": 256},
    "kvtier_restored_requests_total": {"": 1},
    "kvtier_tier_hits_total": {"file1": 2},
    "kvtier_tier_errors_total": {"s30|get": 1},
    "kvtier_io_queue_depth": {"io-store": 3},
    "kvtier_tier_op_seconds": {"file1|get": [0.002, 0.004]},
}


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


@pytest.fixture
def export() -> Iterator[None]:
    m.enable_export().drain()
    try:
        yield
    finally:
        m.disable_export()


def prom(registry: CollectorRegistry) -> Any:
    types: dict[Any, Any] = {
        cls: functools.partial(cls, registry=registry) for cls in (Counter, Gauge, Histogram)
    }
    vllm_config = SimpleNamespace(kv_transfer_config=None)
    return KVTierConnector.build_prom_metrics(vllm_config, types, LABELNAMES, ENGINES)


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    value = registry.get_sample_value(name, {"model_name": "model", "engine": "0", **labels})
    return value


def test_no_series_before_the_engine_reports_one(registry: CollectorRegistry) -> None:
    prom(registry)
    page = generate_latest(registry).decode()
    assert "# TYPE kvtier_restored_tokens_total counter" in page
    assert not [ln for ln in page.splitlines() if ln.startswith("kvtier_")], page


def test_observe_feeds_counters_gauges_and_histograms(registry: CollectorRegistry) -> None:
    p = prom(registry)
    p.observe(STEP, 0)
    p.observe({"kvtier_restored_tokens_total": {"file1": 128, "host": 128},
               "kvtier_io_queue_depth": {"io-store": 0}}, 0)
    assert sample(registry, "kvtier_restored_tokens_total", tier="file1") == 384
    assert sample(registry, "kvtier_restored_tokens_total", tier="host") == 128
    assert sample(registry, "kvtier_restored_requests_total") == 1
    assert sample(registry, "kvtier_tier_errors_total", tier="s30", op="get") == 1
    assert sample(registry, "kvtier_io_queue_depth", queue="io-store") == 0
    assert sample(registry, "kvtier_tier_op_seconds_count", tier="file1", op="get") == 2
    assert sample(registry, "kvtier_tier_op_seconds_bucket", tier="file1", op="get",
                  le="0.003") == 1
    assert sample(registry, "kvtier_tier_misses_total", tier="file1") is None


def test_engines_are_labelled_apart(registry: CollectorRegistry) -> None:
    p = prom(registry)
    p.observe({"kvtier_tier_hits_total": {"host": 1}}, 1)
    assert sample(registry, "kvtier_tier_hits_total", tier="host") is None
    assert registry.get_sample_value(
        "kvtier_tier_hits_total", {"model_name": "model", "engine": "1", "tier": "host"}
    ) == 1


def test_an_unknown_series_is_an_error(registry: CollectorRegistry) -> None:
    with pytest.raises(ValueError, match="kvtier_nope"):
        prom(registry).observe({"kvtier_nope": {"": 1}}, 0)


def test_building_twice_on_the_default_registry_replaces_the_collectors() -> None:
    try:
        for _ in range(2):  # a duplicate name would raise here
            KVTierConnector.build_prom_metrics(
                SimpleNamespace(kv_transfer_config=None),
                {Counter: Counter, Gauge: Gauge, Histogram: Histogram}, LABELNAMES, ENGINES,
            )
    finally:
        prom(CollectorRegistry())  # unregisters those: the default registry is as it was
    assert "kvtier_" not in generate_latest().decode()


def test_stats_semantics() -> None:
    vllm_owned = {"kvtier_tier_hits_total": {"host": 1}}
    s = KVTierConnector.build_kv_connector_stats(vllm_owned)
    assert isinstance(s, KVTierStats) and not s.is_empty()
    s.aggregate(KVTierStats.build({"kvtier_tier_hits_total": {"host": 2}}))
    assert s.to_dict() == {"kvtier_tier_hits_total": {"host": 3}}
    assert vllm_owned == {"kvtier_tier_hits_total": {"host": 1}}, "vLLM's dict is untouched"
    s.reset()
    assert s.is_empty() and KVTierConnector.build_kv_connector_stats(None).is_empty()
    with pytest.raises(TypeError):
        s.aggregate(object())  # type: ignore[arg-type]


def test_reduce_gives_one_number_per_series_and_label() -> None:
    assert KVTierStats.build(STEP).reduce() == {
        "io_queue_depth[io-store]": 3,
        "restored_requests": 1,
        "restored_tokens[file1]": 256,
        "tier_errors[s30|get]": 1,
        "tier_hits[file1]": 2,
        "tier_op_seconds[file1|get]_count": 2,
        "tier_op_seconds[file1|get]_mean": pytest.approx(0.003),
    }


def test_the_scheduler_payload_survives_vllms_engine_to_api_serialiser() -> None:
    outputs = EngineCoreOutputs(scheduler_stats=SchedulerStats(kv_connector_stats=STEP))
    back = MsgpackDecoder(EngineCoreOutputs).decode(MsgpackEncoder().encode(outputs))
    assert back.scheduler_stats is not None
    assert back.scheduler_stats.kv_connector_stats == STEP


def test_vllms_log_line_aggregates_the_interval() -> None:
    stats_log = KVConnectorLogging(KVTransferConfig(
        kv_connector="KVTierConnector", kv_connector_module_path="kvtier.vllm",
        kv_role="kv_both",
    ))
    stats_log.observe({"kvtier_restored_tokens_total": {"host": 128}})
    stats_log.observe({"kvtier_restored_tokens_total": {"host": 256}})
    lines: list[str] = []
    stats_log.log(lambda fmt, *args: lines.append(fmt % args))  # type: ignore[no-untyped-call]
    assert lines == ["KV Transfer metrics: restored_tokens[host]=384"]


def test_the_connector_drains_what_this_process_recorded(export: None) -> None:
    m.record_restore({"host": 128})
    connector = object.__new__(KVTierConnector)  # the stats hooks use no engine state
    stats = connector.get_kv_connector_stats()
    assert stats is not None
    assert stats.data["kvtier_restored_tokens_total"] == {"host": 128}
    assert connector.get_kv_connector_stats() is None, "nothing new since"
