"""kvtier.metrics: local mirrors, the export batch and how batches merge. No vLLM here."""

from __future__ import annotations

import json
import pickle
import re
from pathlib import Path

import prometheus_client
import pytest

import kvtier.metrics as m


def test_importing_registers_no_prometheus_collector() -> None:
    page = prometheus_client.generate_latest().decode()  # what /metrics would render
    assert "kvtier_" not in page


def test_with_export_off_only_the_tier_mirror_counts() -> None:
    assert not m.export_enabled()
    t = m.TierMetrics("host")
    t.hit(100)
    t.miss()
    m.record_restore({"host": 256})
    assert t.counts.as_dict() == {"hits": 1, "misses": 1, "bytes_written": 0,
                                  "bytes_read": 100, "errors": 0, "corruptions": 0,
                                  "evictions": 0, "full": 0}
    assert m.drain_export() == {}


def test_records_land_in_the_batch_by_label(export: m.StatsBatch) -> None:
    t = m.TierMetrics("file1")
    t.hit(4096)
    t.hit(4096)
    t.miss()
    t.wrote(10)
    t.error("put")
    t.corrupt()
    t.evicted(3)
    t.used(123)
    t.observe("get", 0.002)
    m.record_restore({"host": 256, "file1": 512})
    m.record_spill(1024, 4096)
    m.record_drop("host_full")
    m.set_queue_depth("io-store", 2)
    m.set_queue_depth("io-store", 1)
    assert m.drain_export() == {
        "kvtier_tier_hits_total": {"file1": 2},
        "kvtier_tier_bytes_read_total": {"file1": 8192},
        "kvtier_tier_misses_total": {"file1": 1},
        "kvtier_tier_bytes_written_total": {"file1": 10},
        "kvtier_tier_errors_total": {"file1|put": 1},
        "kvtier_tier_corruptions_total": {"file1": 1},
        "kvtier_tier_evictions_total": {"file1": 3},
        "kvtier_tier_used_bytes": {"file1": 123},
        "kvtier_tier_op_seconds": {"file1|get": [0.002]},
        "kvtier_restored_requests_total": {"": 1},
        "kvtier_restored_tokens_total": {"host": 256, "file1": 512},
        "kvtier_spilled_bytes_total": {"": 1024},
        "kvtier_write_through_baseline_bytes_total": {"": 4096},
        "kvtier_drops_total": {"host_full": 1},
        "kvtier_io_queue_depth": {"io-store": 1},
    }
    assert m.drain_export() == {}, "a drain starts afresh"


def test_worker_records(export: m.StatsBatch) -> None:
    m.record_worker_step(loaded_blocks=4, saved_blocks=0, seconds=0.01)
    m.record_failed_loads(2)
    assert m.drain_export() == {
        "kvtier_worker_blocks_total": {"load": 4},
        "kvtier_worker_copy_seconds": {"": [0.01]},
        "kvtier_restore_stage_seconds": {"copy": [0.01]},  # the step loaded: a restore's
        "kvtier_worker_failed_load_blocks_total": {"": 2},
    }


def test_merge_adds_counters_keeps_newer_gauges_and_concatenates() -> None:
    a: m.BatchData = {"kvtier_tier_hits_total": {"host": 1},
                      "kvtier_io_queue_depth": {"q": 5},
                      "kvtier_tier_op_seconds": {"host|get": [0.1]}}
    b: m.BatchData = {"kvtier_tier_hits_total": {"host": 2, "file1": 1},
                      "kvtier_io_queue_depth": {"q": 0},
                      "kvtier_tier_op_seconds": {"host|get": [0.2]}}
    assert m.merge(a, b) == {"kvtier_tier_hits_total": {"host": 3, "file1": 1},
                             "kvtier_io_queue_depth": {"q": 0},
                             "kvtier_tier_op_seconds": {"host|get": [0.1, 0.2]}}
    assert b["kvtier_tier_op_seconds"]["host|get"] == [0.2], "other is not changed"


def test_merge_rejects_an_unknown_series() -> None:
    with pytest.raises(ValueError, match="kvtier_nope"):
        m.merge({}, {"kvtier_nope": {"": 1}})


def test_observations_are_capped_per_batch_and_the_excess_counted() -> None:
    batch = m.StatsBatch()
    for _ in range(m.MAX_OBSERVATIONS + 3):
        batch.observe(m.OP_SECONDS, 0.001, "host", "get")
    data = batch.drain()
    assert len(data["kvtier_tier_op_seconds"]["host|get"]) == m.MAX_OBSERVATIONS
    assert data["kvtier_observations_dropped_total"] == {"": 3}
    merged = m.merge(data, {"kvtier_tier_op_seconds": {"host|get": [0.5, 0.5]}})
    assert merged["kvtier_observations_dropped_total"] == {"": 5}


def test_label_values_must_match_the_series() -> None:
    batch = m.StatsBatch()
    with pytest.raises(ValueError, match="labels"):
        batch.add(m.HITS, 1)
    with pytest.raises(ValueError, match="contains"):
        batch.add(m.HITS, 1, "a|b")
    assert m.label_values(m.ERRORS, m.label_key(m.ERRORS, ("s30", "get"))) == ("s30", "get")
    assert m.label_values(m.SPILLED, "") == ()


def test_a_batch_survives_pickle(export: m.StatsBatch) -> None:
    m.TierMetrics("host").observe("put", 0.25)
    m.record_restore({"host": 128})
    data = m.drain_export()
    assert pickle.loads(pickle.dumps(data)) == data


def test_enable_export_is_idempotent(export: m.StatsBatch) -> None:
    assert m.enable_export() is export


def test_the_grafana_dashboard_reads_only_series_kvtier_exports() -> None:
    path = Path(__file__).resolve().parents[1] / "configs" / "grafana-kvtier.json"
    exprs = [t["expr"] for p in json.loads(path.read_text())["panels"] for t in p["targets"]]
    used = {re.sub(r"_(bucket|count|sum)$", "", n)
            for e in exprs for n in re.findall(r"\bkvtier_\w+", e)}
    assert used and used <= set(m.SERIES), used - set(m.SERIES)
    for e in exprs:
        assert 'model_name="$model_name"' in e, e
