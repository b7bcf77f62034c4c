"""The agent simulator: its plan is deterministic, and it runs end to end against vLLM + kvtier.

The end-to-end test starts one API server (tiny fp32 model, kvtier host + file tiers) and
plays 2 agents x 3 turns; it checks the shape of the output, not the numbers.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from itertools import pairwise
from pathlib import Path

import pytest

from benchmarks import agents
from benchmarks.agentsim.plan import PRESETS, Workload, make_plan
from benchmarks.agentsim.report import overflow_time
from kvtier.testing.servers import APIServer
from kvtier.vllm.settings import kv_transfer_config

SMOKE = ["--preset", "cpu", "--agents", "2", "--turns", "3", "--arrival-s", "0.5",
         "--think-mean", "0.3", "--think-sd", "0.1", "--docs", "2", "--doc-tokens", "100,150",
         "--message-tokens", "10,20", "--output-tokens", "4", "--vocab", "512",
         "--duration-s", "150", "--telemetry-s", "0.5", "--kv-capacity-tokens", "512"]


def test_plan_is_deterministic_and_seeded() -> None:
    w, _ = PRESETS["cpu"]
    a, b = make_plan(w), make_plan(w)
    assert a == b
    assert make_plan(Workload(**{**w.__dict__, "seed": 1})) != a
    assert [p.start_s for p in a] == [i * w.arrival_s for i in range(w.agents)]
    for p in a:
        assert len(p.messages) == len(p.thinks) == w.turns - 1
        assert all(t >= 0 for t in p.thinks)
        assert all(4 <= t < w.vocab for t in p.docs)
        assert w.docs * w.doc_tokens[0] <= len(p.docs) <= w.docs * w.doc_tokens[1]


def test_overflow_rule_takes_the_earliest_sign() -> None:
    telemetry = [{"t_s": 0.0, "kv_usage": 0.1, "preemptions": 0.0},
                 {"t_s": 3.0, "kv_usage": 0.5, "preemptions": 1.0},
                 {"t_s": 6.0, "kv_usage": 0.96, "preemptions": 1.0}]
    assert overflow_time(telemetry, [], None) == (3.0, "preemption")
    assert overflow_time(telemetry, [(1.0, 3), (2.0, 9)], 8) == (2.0, "working_set>capacity")
    assert overflow_time([], [(1.0, 3)], 8) == (None, None)


@pytest.fixture(scope="module")
def kvtier_server(tmp_path_factory: pytest.TempPathFactory,
                  tiny_fp32: Path) -> Iterator[APIServer]:
    tmp = tmp_path_factory.mktemp("agents")
    model = tiny_fp32
    cfg = agents.tier_config(tmp / "kvtier.yaml", tmp / "store", "64MiB")
    srv = APIServer(tmp, model=model, name="agents", dtype="float32", max_model_len=1024,
                    kv_transfer_config=kv_transfer_config(cfg), num_gpu_blocks_override=16)
    with srv:
        yield srv


@pytest.mark.vllm
def test_agents_smoke_against_kvtier(kvtier_server: APIServer, tmp_path: Path) -> None:
    assert agents.main(["--url", kvtier_server.url, "--out-dir", str(tmp_path),
                        "--tag", "smoke", "--run-name", "kvtier", *SMOKE]) == 0
    rows = [json.loads(line) for line in (tmp_path / "agents_smoke.jsonl").open()]
    assert sorted((r["agent"], r["turn"]) for r in rows) == [(a, t) for a in (0, 1)
                                                             for t in (1, 2, 3)]
    assert [r["error"] for r in rows] == [None] * 6
    for a in (0, 1):
        turns = sorted((r for r in rows if r["agent"] == a), key=lambda r: r["turn"])
        assert [r["returning"] for r in turns] == [False, True, True]
        for prev, nxt in pairwise(turns):
            # The next prompt is the previous prompt + its 4 output ids + a 10-20-id message.
            grown = nxt["tokens_in"] - prev["tokens_in"] - prev["tokens_out"]
            assert 10 <= grown <= 20
            assert nxt["send_s"] > prev["send_s"] + prev["total_s"] - 1e-3  # closed loop
        for r in turns:
            assert r["tokens_out"] == 4
            assert 0 < r["headers_s"] <= r["ttft_s"] <= r["total_s"]
    telemetry = [json.loads(line) for line in (tmp_path / "agents_smoke.telemetry.jsonl").open()]
    assert telemetry and telemetry[-1]["prefix_cache_queries"] is not None
    summary = json.loads((tmp_path / "agents_smoke.json").read_text())
    run = summary["runs"]["kvtier"]
    assert (run["turns"], run["errors"], run["returning"]) == (6, 0, 4)
    assert summary["workload"]["agents"] == 2 and summary["machine"]["cores"]
    assert (tmp_path / "agents_smoke.png").stat().st_size > 0
    assert (tmp_path / "agents_smoke.md").read_text().count("| kvtier |") == 1


def test_ideal_run_holds_every_agent_and_is_compared() -> None:
    from benchmarks.agentsim.plan import BLOCK_SIZE
    from benchmarks.agentsim.report import compare

    w, launch = PRESETS["cpu"]
    n = agents.ideal_kv_blocks(w)
    assert n * BLOCK_SIZE >= w.agents * (w.max_context() + 64) > launch.kv_blocks * BLOCK_SIZE
    row = {"turns": 1, "errors": 0, "returning_before": 1, "returning_after": 1,
           "median_ttft_returning_before_s": 0.1, "median_ttft_first_turn_s": 1.0}
    checks, table = compare({"no_tier": {**row, "median_ttft_returning_after_s": 5.0},
                             "kvtier": {**row, "median_ttft_returning_after_s": 0.3},
                             "ideal": {**row, "median_ttft_returning_after_s": 0.2}})
    name, ratio, ok = checks[-1]
    assert name == "kvtier after / ideal after <= 1.2x" and ratio == pytest.approx(1.5)
    assert not ok
    assert "| ideal |" in table
