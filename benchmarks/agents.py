"""Closed-loop agent simulator (seed 004, appendix A.2) against an OpenAI-compatible endpoint.

Agents arrive one every ``arrival_s`` seconds. Turn 1 sends ``docs`` pseudo-random
documents; every later turn resends the whole history: the previous prompt, the model's
output (token ids from the stream) and a new tool/user message. An agent thinks
~N(think_mean, think_sd) seconds (floored at 0) between an answer and its next turn.
The run stops at ``duration_s`` even if agents are mid-turn.

The plan, the client and the report live in ``benchmarks/agentsim/`` (``plan.py``,
``client.py``, ``report.py``); their module docstrings state the invariants (one seeded
plan replayed identically on every server, prompts that strictly extend the previous
turn's, errors recorded and never fatal).

Presets (``--preset``):

* ``seed``: the seed's workload: 40 agents, one every 15 s, 10 documents of 2,180-3,280 tokens
  (21.8K-32.8K, median ~27.5K in all), 64 output tokens, 37-94-token messages,
  think ~N(15, 10), 60 turns, stop at 750 s, seed 51909.
* ``cpu``: scaled to this 2-core CPU: 6 agents, one every 8 s, 10 documents of 200-280
  tokens (~2.4K in all), 20-40-token messages, 8 output tokens, think ~N(6, 2), 12 turns,
  stop at 240 s; ``--launch`` serves ``MID_MODEL`` (~15M parameters, fp32) with 64 KV blocks
  of 128 tokens, which hold about three of the six live conversations, so the cache
  overflows when the fourth agent arrives (the seed's HBM did at about 22 of 40 agents).
  Why these numbers: see the comment on ``PRESETS`` (``agentsim/plan.py``).

Modes:

* ``--url URL``: run the plan once against an existing endpoint.
* ``--launch``: start vLLM without kvtier, run the plan, stop it; start vLLM with kvtier
  (host + file tier in a temp dir), run the same plan, stop it; compare. ``--runs`` may add
  ``ideal``: vLLM alone with a KV cache that holds every agent's whole conversation at once
  (``ideal_kv_blocks``), the bound a tier can at best reach: it never evicts, so every
  returning turn pays only for its new tokens and the unfilled rest of its last block.

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
import sys
import tempfile
import time
from contextlib import ExitStack
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.agentsim.client import RunState, blocks, run_plan
from benchmarks.agentsim.plan import (
    BLOCK_SIZE,
    PRESETS,
    AgentPlan,
    LaunchSettings,
    Workload,
    make_plan,
)
from benchmarks.agentsim.report import compare, overflow_time, plot, summarize, write_jsonl
from benchmarks.machine import describe
from kvtier.vllm.settings import kv_transfer_config

RESULTS = Path(__file__).resolve().parent / "results"


#: A ~15M random-weight Llama (fp32): on this loaded 2-core machine the 90M bench model
#: prefills ~20 s per 1K tokens, too slow for a closed loop of eight agents in minutes.
MID_MODEL: dict[str, Any] = {"dtype": "float32", "hidden": 384, "layers": 6, "heads": 6,
                             "kv_heads": 2, "intermediate": 1024, "vocab": 8192, "max_pos": 8192}


def tier_config(path: Path, store: Path, host_capacity: str,
                max_dirty_s: float | None = None) -> Path:
    doc: dict[str, Any] = {"chunk_tokens": 256, "tiers": [
        {"host": {"capacity": host_capacity}},
        {"file": {"path": str(store), "capacity": "20GiB", "write": "back"}}]}
    if max_dirty_s is not None:
        doc["max_dirty_seconds"] = max_dirty_s
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
    ideal_blocks = ideal_kv_blocks(w)
    max_len = args.max_model_len or int(math.ceil((w.max_context() + 64) / BLOCK_SIZE) * BLOCK_SIZE)
    states: dict[str, RunState] = {}
    telem: dict[str, list[Any]] = {}
    startup: dict[str, float] = {}
    warmup: dict[str, float] = {}
    info: dict[str, Any] = {"model": str(model), "dtype": dtype, "kv_blocks": kv_blocks,
                            "ideal_kv_blocks": ideal_blocks,
                            "block_size": BLOCK_SIZE, "max_model_len": max_len,
                            "startup_s": startup, "warmup_s": warmup}
    for run in args.runs.split(","):
        with ExitStack() as stack:
            work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kva-",
                                                                         dir=args.workdir)))
            kvt = None
            if run == "kvtier":
                kvt = kv_transfer_config(tier_config(work / "kvtier.yaml", work / "store",
                                                   args.host_capacity, args.max_dirty_seconds))
            elif run != "no_tier" and run != "ideal":
                raise SystemExit(f"--runs: unknown run {run!r}; use no_tier, kvtier or ideal")
            n_blocks = ideal_blocks if run == "ideal" else kv_blocks
            srv = APIServer(work, model=model, name=run, dtype=dtype, max_model_len=max_len,
                            kv_transfer_config=kvt, num_gpu_blocks_override=n_blocks,
                            block_size=BLOCK_SIZE)
            t = time.monotonic()
            print(f"[{run}] starting vLLM ({model.name}, {n_blocks} blocks) ...", flush=True)
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


def ideal_kv_blocks(w: Workload) -> int:
    """KV blocks for the ``ideal`` run: every agent's longest context (and its answer) at
    once, in whole blocks, plus a few for the warm-up prompts, so vLLM never evicts a
    conversation it will see again."""
    return w.agents * math.ceil((w.max_context() + 64) / BLOCK_SIZE) + 8


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
    lg.add_argument("--max-dirty-seconds", type=float, default=None,
                    help="kvtier's max_dirty_seconds (default: the config default)")
    lg.add_argument("--runs", default="no_tier,kvtier",
                    help="which servers, in order: no_tier, kvtier, ideal")
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
