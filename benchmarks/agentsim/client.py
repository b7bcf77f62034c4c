"""Replaying a plan against an OpenAI-compatible endpoint, closed loop, with telemetry.

``run_plan`` starts one task per agent and one ``/metrics`` poller on a single event loop
(``RunState`` is shared without locks) and cancels whatever is still running at
``duration_s``.

Invariants:

* Every sent turn leaves exactly one record; errors, timeouts and turns cut at the time
  limit are recorded (``error``), never fatal.
* Turn ``t + 1``'s prompt is turn ``t``'s prompt + its streamed output ids + the plan's next
  message, so it strictly extends the previous prompt.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from benchmarks.agentsim.plan import BLOCK_SIZE, AgentPlan, Workload


@dataclass
class RunState:
    """Shared, mutable state of one run (single event loop: no locks needed)."""

    t0: float
    in_flight: int = 0
    live: dict[int, int] = field(default_factory=dict)  # agent -> context tokens
    records: list[dict[str, Any]] = field(default_factory=list)
    live_blocks_at_send: list[tuple[float, int]] = field(default_factory=list)

    def now(self) -> float:
        return time.monotonic() - self.t0


@dataclass
class TurnResult:
    headers_s: float | None = None
    ttft_s: float | None = None
    output: list[int] = field(default_factory=list)
    tokens_in: int | None = None
    error: str | None = None


async def stream_turn(client: httpx.AsyncClient, url: str, model: str, prompt: list[int],
                      w: Workload, res: TurnResult, t_send: float) -> None:
    """Send one streaming completion; fill ``res`` as chunks arrive (so a cut keeps them)."""
    body = {"model": model, "prompt": prompt, "max_tokens": w.output_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
            "return_token_ids": True}
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        res.headers_s = time.monotonic() - t_send
        if r.status_code != 200:
            text = (await r.aread()).decode(errors="replace")
            res.error = f"HTTP {r.status_code}: {text[:300]}"
            return
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices") or []:
                got = choice.get("token_ids") or []
                if got and res.ttft_s is None:
                    res.ttft_s = time.monotonic() - t_send
                res.output.extend(int(t) for t in got)
            usage = chunk.get("usage")
            if usage:
                res.tokens_in = int(usage["prompt_tokens"])


def blocks(tokens: int) -> int:
    return -(-tokens // BLOCK_SIZE)


async def run_agent(client: httpx.AsyncClient, url: str, model: str, plan: AgentPlan,
                    w: Workload, st: RunState, run: str,
                    done: Callable[[], object]) -> None:
    """Play one agent's turns, closed loop; every sent turn leaves exactly one record."""
    history = list(plan.docs)
    await asyncio.sleep(max(0.0, plan.start_s - st.now()))
    try:
        for turn in range(1, w.turns + 1):
            if turn > 1:
                await asyncio.sleep(plan.thinks[turn - 2])
            if st.now() >= w.duration_s:
                return
            st.live[plan.agent] = len(history) + w.output_tokens
            st.live_blocks_at_send.append((st.now(), sum(blocks(n) for n in st.live.values())))
            rec: dict[str, Any] = {"run": run, "agent": plan.agent, "turn": turn,
                                   "send_s": round(st.now(), 4), "in_flight": st.in_flight,
                                   "returning": turn > 1, "prompt_tokens": len(history)}
            res = TurnResult()
            t_send = time.monotonic()
            st.in_flight += 1
            try:
                await asyncio.wait_for(stream_turn(client, url, model, history, w, res, t_send),
                                       timeout=w.request_timeout_s)
            except asyncio.CancelledError:
                res.error = "stopped at the time limit"
                raise
            except (httpx.HTTPError, TimeoutError, ValueError, KeyError) as e:
                res.error = f"{type(e).__name__}: {e}"[:300]
            finally:
                st.in_flight -= 1
                rec.update(headers_s=res.headers_s, ttft_s=res.ttft_s,
                           total_s=time.monotonic() - t_send,
                           tokens_in=res.tokens_in if res.tokens_in is not None else len(history),
                           tokens_out=len(res.output), error=res.error)
                if res.error is None and len(res.output) != w.output_tokens:
                    rec["error"] = f"got {len(res.output)} output ids, wanted {w.output_tokens}"
                st.records.append(rec)
                done()
            if turn < w.turns:
                history = history + res.output + list(plan.messages[turn - 1])
    finally:
        st.live.pop(plan.agent, None)


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {sample name: value summed over label sets}; ``_created`` dropped."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name.endswith("_created"):
            continue
        try:
            value = float(line.rsplit(" ", 1)[1])
        except (IndexError, ValueError):
            continue
        out[name] = out.get(name, 0.0) + value
    return out


def telemetry_row(m: dict[str, float], prev: dict[str, float] | None) -> dict[str, Any]:
    def get(name: str) -> float | None:
        return m.get(name)

    def rate(hits: str, queries: str) -> float | None:
        if prev is None or queries not in m or queries not in prev or hits not in m:
            return None
        dq = m[queries] - prev[queries]
        return (m[hits] - prev.get(hits, 0.0)) / dq if dq > 0 else None

    kvtier = {k: v for k, v in m.items() if k.startswith("kvtier_") and "_bucket" not in k}
    return {
        "prefix_cache_hits": get("vllm:prefix_cache_hits_total"),
        "prefix_cache_queries": get("vllm:prefix_cache_queries_total"),
        "prefix_hit_rate": rate("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"),
        "external_hits": get("vllm:external_prefix_cache_hits_total"),
        "external_queries": get("vllm:external_prefix_cache_queries_total"),
        "external_hit_rate": rate("vllm:external_prefix_cache_hits_total",
                                  "vllm:external_prefix_cache_queries_total"),
        "kv_usage": get("vllm:kv_cache_usage_perc"),
        "preemptions": get("vllm:num_preemptions_total"),
        "mean_queue_wait_s": rate("vllm:request_queue_time_seconds_sum",
                                  "vllm:request_queue_time_seconds_count"),
        "running": get("vllm:num_requests_running"),
        "waiting": get("vllm:num_requests_waiting"),
        "kvtier": kvtier or None,
    }


async def poll_telemetry(client: httpx.AsyncClient, url: str, every_s: float, st: RunState,
                         rows: list[dict[str, Any]], run: str) -> None:
    prev: dict[str, float] | None = None
    while True:
        t = st.now()
        try:
            r = await client.get(url + "/metrics", timeout=max(1.0, every_s))
            m = parse_metrics(r.text)
            row: dict[str, Any] = {"run": run, "t_s": round(t, 3), **telemetry_row(m, prev)}
            prev = m
        except httpx.HTTPError as e:
            row = {"run": run, "t_s": round(t, 3), "error": f"{type(e).__name__}: {e}"[:200]}
        rows.append(row)
        await asyncio.sleep(max(0.0, every_s - (st.now() - t)))


async def run_plan(url: str, model: str, plans: list[AgentPlan], w: Workload, run: str,
                   telemetry_s: float) -> tuple[RunState, list[dict[str, Any]]]:
    """Play ``plans`` against ``url``; returns per-turn state and telemetry rows."""
    from tqdm import tqdm

    limits = httpx.Limits(max_connections=w.agents + 4, max_keepalive_connections=w.agents + 4)
    timeout = httpx.Timeout(w.request_timeout_s, connect=30.0)
    telemetry: list[dict[str, Any]] = []
    bar = tqdm(total=w.agents * w.turns, desc=run, unit="turn", file=sys.stderr)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        st = RunState(t0=time.monotonic())
        poller = asyncio.create_task(poll_telemetry(client, url, telemetry_s, st, telemetry, run))
        tasks = [asyncio.create_task(run_agent(client, url, model, p, w, st, run,
                                               lambda: bar.update(1))) for p in plans]
        _, pending = await asyncio.wait(tasks, timeout=w.duration_s)
        for t in pending:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        poller.cancel()
        await asyncio.gather(poller, return_exceptions=True)
    bar.close()
    st.records.sort(key=lambda r: (r["send_s"], r["agent"]))
    return st, telemetry
