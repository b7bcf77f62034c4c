"""``benchmarks/multiround_qa.py --mode pd`` (issue 20): LMCache's multi-round QA through the
kvtier router, selective P/D against always-P/D against one engine, in one run.

The workload is ``multiround_qa``'s (a long first turn: system prompt + history + question;
short follow-ups: the previous answer + a question), played the way LMCache's client
plays it: ``--concurrency`` users are in flight at once, each sending its rounds back to
back (the next as soon as the previous answer has ended), and when a user has sent its
last round the next user starts. So first turns of new users overlap returning turns of
others, as in a serving system.

Three configurations, one after the other, each with a workload of the same lengths
(each run's token ids are the workload's shifted by a per-run offset modulo the id range,
a permutation, so runs on the same servers never share KV):

* ``one_engine``: one vLLM server with kvtier (host pool + a write-back file tier, partial
  tails), pinned to one core, and **no router**: the client talks to vLLM directly, so the
  router's hop is part of what P/D is charged for.
* ``pd_auto``: a prefill and a decode server (kvtier roles ``prefill`` / ``decode``, a
  host pool each, one shared write-through file tier), each pinned to its own core, behind
  ``kvtier router --pd-mode auto`` (selective P/D, as shipped).
* ``pd_auto_noid``: the same, through a router of its own, with a client that sends no
  conversation id (as LMCache's client, the OpenAI SDK): the router prices each turn by
  what the shared tier holds of the prompt itself, as it does for ``pd_auto`` (issue 33).
* ``pd_always``: the same two servers behind another router with ``--pd-mode always``
  (every turn prefill, then decode).

Every server has the same model, ``--pd-blocks`` GPU KV blocks and prefix caching on (the
prefill server also ``--enable-prompt-tokens-details``, as the README advises). The
three servers are started at once; the one engine shares the decode server's core, which
is idle while the one engine runs (a decode server without requests does not step).

Reported per configuration: the median and p90 TTFT of returning rounds (round >= 2), the
first-round median, the decisions the router took (``kvtier_router_pd_decisions_total``
by path and reason, scraped before and after the run, so warm-up requests are not
counted) and the paths of returning rounds (``X-KVTier-Path``), the prompt tokens the
servers computed and the tokens kvtier restored. Checks: selective P/D's returning median
<= 1.3x the one engine's (issue 20) and its first rounds against always-P/D's. Files:
``multiround_pd.json`` (summary, params, machine), ``.jsonl`` (every round), ``.md``.
"""

from __future__ import annotations

import argparse
import json
import queue
import random
import re
import shutil
import statistics
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx

from benchmarks.machine import describe
from benchmarks.multiround_qa import (
    PD_RUNS,
    TOKEN_LOW,
    Round,
    Workload,
    _tokens,
    kvtier_config,
    metric,
    params_of,
    stream,
    workload,
    write_rows,
)
from kvtier.testing.servers import APIServer, router_process, split_cpus
from kvtier.vllm.settings import kv_transfer_config

TARGET_RATIO = 1.3  # selective P/D's returning median over the one engine's
#: run -> the router's --pd-mode
MODES = {"pd_auto": "auto", "pd_auto_noid": "auto", "pd_always": "always"}
NO_ID_RUNS = ("pd_auto_noid",)  # their client sends no conversation id
LOOKUP = re.compile(r"lookup_ms=([0-9.]+)")
THRESHOLD_GAUGE = "kvtier_router_pd_threshold_tokens"
DECISION = re.compile(r'^kvtier_router_pd_decisions_total\{([^}]*)\} ([0-9.e+-]+)$', re.M)


def shifted(work: Workload, k: int, high: int) -> Workload:
    """``work`` with every id moved by ``k`` ``len(PD_RUNS)``-ths of the id range
    ``[TOKEN_LOW, high)``, modulo the range: the same lengths, and for each k in
    1..len(PD_RUNS)-1 no id in common position with ``k = 0``'s, so no chunk key in
    common."""
    span = high - TOKEN_LOW
    step = k * (span // len(PD_RUNS))

    def move(ids: list[int]) -> list[int]:
        return [TOKEN_LOW + (t - TOKEN_LOW + step) % span for t in ids]

    return Workload(move(work.system), [move(h) for h in work.histories],
                    [[move(q) for q in qs] for qs in work.questions])


def decisions(metrics_text: str) -> Counter[str]:
    """``path/reason -> count`` from a router's ``/metrics``."""
    out: Counter[str] = Counter()
    for m in DECISION.finditer(metrics_text):
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
        out[f"{labels.get('path', '?')}/{labels.get('reason', '?')}"] += int(float(m.group(2)))
    return out


def sessions(url: str, run: str, work: Workload, args: argparse.Namespace, *,
             routed: bool) -> list[Round]:
    """Play ``work`` against ``url``: ``args.concurrency`` users in flight, each sending its
    rounds back to back, the next user starting when one is done (see the module). With
    ``routed``, each request names its conversation (the router renews its leases), unless
    the run is one of ``NO_ID_RUNS``."""
    waiting: queue.SimpleQueue[int] = queue.SimpleQueue()
    for user in range(len(work.histories)):
        waiting.put(user)
    firsts = work.conversations()

    def lane() -> list[Round]:
        mine: list[Round] = []
        with httpx.Client(timeout=args.request_timeout) as client:
            while True:
                try:
                    user = waiting.get_nowait()
                except queue.Empty:
                    return mine
                conv = firsts[user]
                named = routed and run not in NO_ID_RUNS
                extra = {"conversation_id": f"{run}-{user}"} if named else None
                for r, question in enumerate(work.questions[user]):
                    prompt = conv + question
                    reply = stream(client, url, prompt, args.answer_tokens, extra)
                    mine.append(Round(run, user, r + 1, len(prompt), reply.ttft_s * 1e3,
                                      reply.total_s * 1e3,
                                      reply.headers.get("x-kvtier-path", "")))
                    conv = prompt + reply.token_ids

    with ThreadPoolExecutor(args.concurrency) as pool:
        lanes = [pool.submit(lane) for _ in range(args.concurrency)]
        return [row for f in lanes for row in f.result()]


def _scrape(client: httpx.Client, urls: list[str]) -> str:
    return "\n".join(client.get(u + "/metrics").text for u in urls)


def _counts(text: str) -> dict[str, float]:
    """The server counters a run's summary differences (summed over its servers)."""
    return {"computed_tokens": metric(text, "vllm:prompt_tokens_by_source_total",
                                      source="local_compute"),
            "restored_tokens": metric(text, "kvtier_restored_tokens_total")}


def lookup_ms(router_log: Path) -> dict[str, float]:
    """p50/p99 of the router's own time per turn (tokenize + keys + tier lookup: the
    ``lookup_ms`` of its log lines; auto mode only)."""
    ms = [float(m) for m in LOOKUP.findall(router_log.read_text(errors="replace"))]
    if len(ms) < 2:
        return {}
    return {"lookup_p50_ms": statistics.median(ms),
            "lookup_p99_ms": statistics.quantiles(ms, n=100, method="inclusive")[98],
            "lookup_turns": len(ms)}


def summarize(rows: list[Round], decided: Counter[str], counts: dict[str, float],
              elapsed_s: float) -> dict[str, Any]:
    back = [x.ttft_ms for x in rows if x.round > 1]
    first = [x.ttft_ms for x in rows if x.round == 1]
    return {
        "returning_median_ms": statistics.median(back),
        "returning_p90_ms": statistics.quantiles(back, n=10)[-1],
        "round1_median_ms": statistics.median(first),
        "round1_p90_ms": statistics.quantiles(first, n=10)[-1] if len(first) > 1 else first[0],
        "returning_rounds": len(back),
        "first_rounds": len(first),
        "decisions": dict(sorted(decided.items())),
        "returning_paths": dict(sorted(Counter(x.path for x in rows
                                               if x.round > 1 and x.path).items())),
        **counts,
        "elapsed_s": elapsed_s,
    }


def topology(stack: ExitStack, args: argparse.Namespace, model: Path,
             tmp: Path) -> dict[str, tuple[str, list[str]]]:
    """Start the servers and routers the runs need; ``run -> (URL to send to, URLs of the
    vLLM servers it uses)``. Everything stops when ``stack`` closes."""
    runs = args.runs.split(",")
    p_cpus, d_cpus = split_cpus(2)  # one core each; the one engine shares the decode's
    common: dict[str, Any] = {"model": model, "dtype": args.dtype,
                              "max_model_len": args.max_model_len,
                              "num_gpu_blocks_override": args.pd_blocks}
    servers: dict[str, APIServer] = {}
    if "one_engine" in runs:
        cfg = kvtier_config(tmp / "one.yaml", tmp / "one-store", True, args.chunk_tokens)
        servers["one_engine"] = APIServer(tmp, name="one_engine", cpus=d_cpus,
                                          kv_transfer_config=kv_transfer_config(cfg), **common)
    shared_cfg = tmp / "pd.yaml"
    if any(r in MODES for r in runs):
        shared_cfg.write_text(json.dumps({
            "chunk_tokens": args.chunk_tokens,
            "tiers": [{"host": {"capacity": "1GiB"}},
                      {"file": {"path": str(tmp / "shared"), "capacity": "16GiB",
                                "write": "through"}}],
            "restore": {"recompute_threshold_tokens": 64},
        }))  # JSON is YAML
        for role, cpus in (("prefill", p_cpus), ("decode", d_cpus)):
            servers[role] = APIServer(tmp, name=role, cpus=cpus, kv_transfer_config=(
                kv_transfer_config(shared_cfg, role=role)), **common,
                # the router learns what each prefill call computed from its usage
                extra_args=["--enable-prompt-tokens-details"] if role == "prefill" else None)
    for server in servers.values():
        stack.callback(server.stop)
    with ThreadPoolExecutor(len(servers)) as pool:  # start-up is mostly waiting
        for f in [pool.submit(s.start) for s in servers.values()]:
            f.result()
    out: dict[str, tuple[str, list[str]]] = {}
    for run in runs:
        if run == "one_engine":
            out[run] = (servers[run].url, [servers[run].url])
            continue
        flags = ["--tiers", str(shared_cfg), "--request-timeout", str(args.request_timeout),
                 "--pd-mode", MODES[run]]
        url = stack.enter_context(router_process(
            tmp, servers["prefill"].url, servers["decode"].url, name=f"router-{run}",
            args=flags))
        out[run] = (url, [servers["prefill"].url, servers["decode"].url])
    return out


def run_pd_mode(args: argparse.Namespace, model: Path, out: Path) -> None:
    """Run every configuration of ``args.runs``; write the files and print the table."""
    base = workload(args, args.token_high)
    rows: list[Round] = []
    summary: dict[str, Any] = {}
    t0 = time.perf_counter()
    with ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvt-mrpd-")))
        urls = topology(stack, args, model, tmp)
        startup_s = time.perf_counter() - t0
        print(f"servers and routers up in {startup_s:.0f} s", flush=True)
        client = stack.enter_context(httpx.Client(timeout=args.request_timeout))
        for k, (run, (url, backends)) in enumerate(urls.items()):
            routed = run != "one_engine"
            warm = _tokens(random.Random(f"warmup:{run}"), 64, args.token_high)
            stream(client, url, warm, 2, {"conversation_id": "warmup"} if routed else None)
            before_d = decisions(client.get(url + "/metrics").text) if routed else Counter()
            before = _counts(_scrape(client, backends))
            started = time.perf_counter()
            mine = sessions(url, run, shifted(base, k, args.token_high), args, routed=routed)
            elapsed = time.perf_counter() - started
            after = _counts(_scrape(client, backends))
            page = client.get(url + "/metrics").text if routed else ""
            rows += mine
            summary[run] = summarize(mine, decisions(page) - before_d,
                                     {n: after[n] - before[n] for n in after}, elapsed)
            if routed:  # the auto threshold the router ended with, and its own time
                summary[run]["threshold_tokens"] = metric(page, THRESHOLD_GAUGE)
                summary[run] |= lookup_ms(tmp / f"router-{run}.log")
            print(run, json.dumps(summary[run]), flush=True)
        if args.keep_logs:  # servers' and routers' logs, for a post-mortem
            keep = Path(args.keep_logs)
            keep.mkdir(parents=True, exist_ok=True)
            for log in tmp.glob("*.log"):
                shutil.copy(log, keep / log.name)
    checks = compare(summary)
    (out / "multiround_pd.json").write_text(json.dumps(
        {"params": params_of(args), "machine": describe(), "startup_s": startup_s,
         "summary": summary, "checks": checks}, indent=2))
    write_rows(out / "multiround_pd.jsonl", rows)
    text = "\n".join([table(summary), "", *checks["lines"]])
    (out / "multiround_pd.md").write_text(
        f"# Multi-round QA through the router: selective P/D, always P/D, one engine "
        f"({args.preset})\n\n{args.users} users, {args.concurrency} in flight, "
        f"{args.rounds} rounds, {args.answer_tokens}-token answers, ~{args.question_tokens}"
        f"-token questions, {args.system_tokens + args.history_tokens}-token first "
        f"prompts.\n\n{text}\n")
    print(text)


def compare(summary: dict[str, Any]) -> dict[str, Any]:
    """Ratios to the one engine and the two checks (as numbers and printable lines)."""
    one, auto, always = (summary.get(r) for r in ("one_engine", "pd_auto", "pd_always"))
    checks: dict[str, Any] = {"lines": []}
    if one is not None:
        for s in summary.values():
            s["median_ratio"] = s["returning_median_ms"] / one["returning_median_ms"]
            s["p90_ratio"] = s["returning_p90_ms"] / one["returning_p90_ms"]
    if one is not None and auto is not None:
        ratio = auto["median_ratio"]
        checks["selective_over_one_engine"] = ratio
        checks["lines"].append(
            f"target: selective P/D returning median <= {TARGET_RATIO}x one engine: "
            f"{auto['returning_median_ms']:.0f} / {one['returning_median_ms']:.0f} ms = "
            f"{ratio:.2f}x  {'met' if ratio <= TARGET_RATIO else 'MISSED'}")
    if auto is not None and always is not None:
        first = auto["round1_median_ms"] / always["round1_median_ms"]
        checks["first_selective_over_always"] = first
        checks["lines"].append(
            f"first rounds, selective / always P/D (median): {auto['round1_median_ms']:.0f} "
            f"/ {always['round1_median_ms']:.0f} ms = {first:.2f}x")
    return checks


def _rows(summary: dict[str, Any]) -> Iterator[str]:
    for run, s in summary.items():
        decided = ", ".join(f"{k} {n}" for k, n in s["decisions"].items()) or "-"
        yield (f"| {run} | {s['returning_median_ms'] / 1e3:.3f} s "
               f"| {s.get('median_ratio', float('nan')):.2f}x "
               f"| {s['returning_p90_ms'] / 1e3:.3f} s | {s.get('p90_ratio', float('nan')):.2f}x "
               f"| {s['round1_median_ms'] / 1e3:.3f} s | {decided} "
               f"| {s['computed_tokens']:.0f} | {s['restored_tokens']:.0f} "
               f"| {_lookup(s)} |")


def _lookup(s: dict[str, Any]) -> str:
    if "lookup_p50_ms" not in s:
        return "-"
    return f"{s['lookup_p50_ms']:.2f} / {s['lookup_p99_ms']:.2f} ms"


def table(summary: dict[str, Any]) -> str:
    head = ["| configuration | returning median | / one engine | returning p90 | / one engine "
            "| first-round median | decisions (path/reason) | tokens computed "
            "| tokens restored | router lookup p50 / p99 |",
            "|---|---:|---:|---:|---:|---:|---|---:|---:|---:|"]
    return "\n".join(head + list(_rows(summary)))
