"""Selective P/D on real vLLM servers for clients that send no conversation id (issue 33).

A prefill and a decode server (tiny fp32 Llama, kvtier roles ``prefill``/``decode``, one
shared write-through file tier in a local directory) behind ``kvtier router`` in its
default mode. Chat requests with text messages: the router tokenizes them with vLLM's own
``/tokenize`` (the server's chat template), keys them as the engines do, and asks the
shared tier what it holds. Checked: returning turns of a client that sends no id go
decode-only with a recompute's output; a history compacted under the same id takes the
prefill hop; a non-streamed workload leaves the threshold at a sane value; the router's
own time per turn (tokenize + lookup, ``lookup_ms`` in its log) is printed as p50/p99.
"""

from __future__ import annotations

import json
import re
import statistics
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvtier.testing.servers import APIServer, router_process, servers_started, split_cpus
from kvtier.vllm.settings import kv_transfer_config

pytestmark = pytest.mark.vllm

CT = 128  # chunk tokens = vLLM's CPU block size
BASE = {"model": "model", "temperature": 0, "max_tokens": 12, "ignore_eos": True}
REFERENCE = {"kvtier": {"load": False, "save": False}}
WORDS = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india",
         "juliet", "kilo", "lima", "mike", "november", "oscar", "papa", "quebec", "romeo",
         "sierra", "tango", "uniform", "victor", "whiskey"]


def text(n_words: int, seed: int) -> str:
    return " ".join(WORDS[(i * 7 + seed * 13 + i * i * seed) % len(WORDS)]
                    for i in range(n_words))


@dataclass
class Setup:
    prefill: APIServer
    decode: APIServer
    router: str
    router_log: Path
    client: httpx.Client

    def chat(self, messages: list[dict[str, str]], cid: str | None = None,
             stream: bool = False) -> tuple[str, str]:
        """(path, answer text) of one turn through the router."""
        body: dict[str, Any] = {**BASE, "messages": messages, "stream": stream}
        if cid is not None:
            body["conversation_id"] = cid
        if not stream:
            r = self.client.post(self.router + "/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            return r.headers["X-KVTier-Path"], str(r.json()["choices"][0]["message"]["content"])
        out = ""
        with self.client.stream("POST", self.router + "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    for c in json.loads(line[6:]).get("choices", []):
                        out += c.get("delta", {}).get("content") or ""
            return r.headers["X-KVTier-Path"], out

    def reference(self, messages: list[dict[str, str]]) -> str:
        body = {**BASE, "messages": messages, "kv_transfer_params": REFERENCE}
        r = self.client.post(self.prefill.url + "/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        return str(r.json()["choices"][0]["message"]["content"])

    def metric(self, name: str) -> str:
        page = self.client.get(self.router + "/metrics").text
        return "\n".join(line for line in page.splitlines() if line.startswith(name))


@pytest.fixture(scope="module")
def setup(tiny_fp32: Path) -> Iterator[Setup]:
    with tempfile.TemporaryDirectory(prefix="kvt-noid-") as d:
        tmp = Path(d)
        cfg = tmp / "pd.yaml"
        cfg.write_text(json.dumps({
            "chunk_tokens": CT,
            "tiers": [{"host": {"capacity": "64MiB"}},
                      {"file": {"path": str(tmp / "shared"), "capacity": "1GiB",
                                "write": "through"}}],
            "restore": {"recompute_threshold_tokens": 64, "wait_seconds": 30},
        }))
        p_cpus, d_cpus = split_cpus(2)
        with servers_started(
                APIServer(tmp, model=tiny_fp32, name="prefill", cpus=p_cpus,
                          kv_transfer_config=kv_transfer_config(cfg, role="prefill")),
                APIServer(tmp, model=tiny_fp32, name="decode", cpus=d_cpus,
                          kv_transfer_config=kv_transfer_config(cfg, role="decode"))
             ) as (p, dec), \
             router_process(tmp, p.url, dec.url, args=["--tiers", str(cfg)]) as url, \
             httpx.Client(timeout=120) as client:
            yield Setup(p, dec, url, tmp / "router.log", client)


def test_returning_turns_without_an_id_go_decode_only_and_a_compacted_history_does_not(
        setup: Setup) -> None:
    history = [{"role": "user", "content": text(140, 1)}]  # ~620 tokens
    path, answer = setup.chat(history)
    assert path == "prefill_decode"  # the first turn: nothing held (and no namespace yet)
    history += [{"role": "assistant", "content": answer},
                {"role": "user", "content": text(8, 2)}]
    ref = setup.reference(history)
    path, answer = setup.chat(history)  # no conversation id
    assert (path, answer) == ("decode_only", ref)

    agent = [{"role": "user", "content": text(140, 3)}]
    assert setup.chat(agent, "agent")[0] == "prefill_decode"
    agent += [{"role": "assistant", "content": "ok"}, {"role": "user", "content": text(8, 4)}]
    assert setup.chat(agent, "agent")[0] == "decode_only"
    compacted = [{"role": "user", "content": "Summary: " + text(130, 5)}]  # ~580
    ref = setup.reference(compacted)
    path, answer = setup.chat(compacted, "agent")
    assert (path, answer) == ("prefill_decode", ref)  # all of it new: the prefill hop
    decided = setup.metric("kvtier_router_pd_decisions_total")
    assert 'path="prefill_decode",reason="long"' in decided, decided
    assert 'path="prefill_decode",reason="no_namespace"} 1.0' in decided, decided


def test_streamed_and_non_streamed_returns_and_the_routers_own_time(setup: Setup) -> None:
    convs = [[{"role": "user", "content": text(60 + 10 * i, 10 + i)}] for i in range(3)]
    paths: list[str] = []
    for rnd in range(6):
        for i, conv in enumerate(convs):
            path, answer = setup.chat(conv, stream=rnd % 2 == 0)
            if rnd:
                paths.append(path)
            conv += [{"role": "assistant", "content": answer},
                     {"role": "user", "content": text(4 + rnd, 100 * i + rnd)}]
    assert paths.count("decode_only") >= len(paths) - 2, paths
    threshold = float(setup.metric("kvtier_router_pd_threshold_tokens ").split()[-1])
    assert 64 <= threshold <= 2048, threshold  # non-streamed turns did not swing it
    log = setup.router_log.read_text(errors="replace")
    for name in ("lookup_ms", "tokenize_ms"):
        ms = [float(m) for m in re.findall(rf"{name}=([0-9.]+)", log)]
        assert len(ms) >= len(paths)
        q = statistics.quantiles(ms, n=100, method="inclusive")
        print(f"router {name} over {len(ms)} turns: p50 {q[49]:.2f} ms, p99 {q[98]:.2f} ms, "
              f"max {max(ms):.2f} ms")
