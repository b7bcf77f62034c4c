"""LMCache's multi-round QA workload against an ideal server and kvtier, with and without
partial tails, in one run.

The workload is LMCache's ``multi-round-qa`` benchmark with the parameters of issue 22:
``--users`` users share a ``--system-tokens`` system prompt; each has its own
``--history-tokens`` history; every round a user sends a ``--question-tokens`` question
and gets a ``--answer-tokens`` answer, which the next round's prompt resends. It is
reproduced here with token-id prompts (``/v1/completions``, streamed), so that every
server sees exactly the same tokens and the cache's behaviour is exact. Rounds go round
robin over the users, one request at a time, so between two rounds of one user every
other user passes through the GPU KV cache.

Three servers, one after the other, the same model and workload:

* ``ideal``: vLLM alone with a KV cache that holds every conversation (``--ideal-blocks``):
  a returning round pays only for its new tokens and the unfilled tail of its last block.
* ``tails``: vLLM with kvtier (host pool + a write-back file tier, ``partial_tails: true``)
  and a KV cache of ``--small-blocks`` blocks (about two conversations): returning rounds
  are evicted and restored from kvtier down to their last full block.
* ``no_tails``: the same with ``partial_tails: false``: whole chunks only, so a return also
  recomputes up to ``chunk_tokens - 1`` tokens of its own history.

Question lengths are drawn per round, uniformly within +-50 % of ``--question-tokens``
(LMCache's questions are text of varying length), so a conversation's end falls anywhere
within a chunk: with fixed lengths every conversation would end at the same few offsets.

Reported per server: the median and p90 TTFT of returning rounds (round >= 2) and their
ratio to the ideal's, turn-1 TTFT, the bytes kvtier wrote to the file tier per round
(scraped from ``/metrics`` after an idle flush), and the objects the file tier holds at
the end (whole chunks and tails, read from their headers). Targets (issue 22): ``tails`` within
1.2x of the ideal at the median and 1.3x at p90.

Writes ``multiround_qa.json`` (summary + machine), ``multiround_qa.jsonl`` (every round)
and ``multiround_qa.md`` (the table) under ``--out-dir``.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.machine import describe
from benchmarks.multiturn_pd import Reply, stream_completion
from kvtier.objformat import HEADER_SPAN, CorruptObject, decode_header
from kvtier.testing.models import preset_model
from kvtier.testing.servers import APIServer
from kvtier.vllm.settings import kv_transfer_config

RESULTS = Path(__file__).resolve().parent / "results"
RUNS = ("ideal", "tails", "no_tails")
TOKEN_LOW, TOKEN_HIGH = 10, 4000
TARGET_MEDIAN, TARGET_P90 = 1.2, 1.3


@dataclass(frozen=True)
class Round:
    run: str
    user: int
    round: int
    prompt_tokens: int
    ttft_ms: float
    total_ms: float


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(TOKEN_LOW, TOKEN_HIGH) for _ in range(n)]


def stream(client: httpx.Client, url: str, prompt: list[int], max_tokens: int) -> Reply:
    """One streamed, greedy completion of ``prompt`` (TTFT: the first SSE data event)."""
    body = {"model": "model", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "return_token_ids": True}
    return stream_completion(client, url, body)


def metric(text: str, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``."""
    total = 0.0
    for m in re.finditer(rf"^{re.escape(name)}(\{{[^}}]*\}})? ([0-9.e+-]+)$", text, re.M):
        tags = m.group(1) or ""
        if all(f'{k}="{v}"' in tags for k, v in labels.items()):
            total += float(m.group(2))
    return total


def workload(args: argparse.Namespace) -> tuple[list[int], list[list[int]], list[list[list[int]]]]:
    """(system prompt, per-user history, per-user per-round questions): the same for
    every server."""
    rng = random.Random(f"{args.seed}:system")
    system = _tokens(rng, args.system_tokens)
    histories = [_tokens(random.Random(f"{args.seed}:history:{u}"), args.history_tokens)
                 for u in range(args.users)]
    questions = []
    for u in range(args.users):
        rng = random.Random(f"{args.seed}:q:{u}")
        lo, hi = args.question_tokens // 2, args.question_tokens * 3 // 2
        questions.append([_tokens(rng, rng.randint(lo, hi)) for _ in range(args.rounds)])
    return system, histories, questions


def objects(store: Path) -> dict[str, int]:
    """What the file tier holds: whole chunks and partial tails (by the header's token
    count), and their bytes."""
    out = {"chunks": 0, "tails": 0, "chunk_bytes": 0, "tail_bytes": 0}
    full = 0
    metas = []
    for path in store.rglob("*.kv"):
        with path.open("rb") as f:
            try:
                meta, _ = decode_header(f.read(HEADER_SPAN))
            except CorruptObject:
                continue
        metas.append(meta)
        full = max(full, meta.num_tokens)
    for meta in metas:
        kind = "chunk" if meta.num_tokens == full else "tail"
        out[kind + "s"] += 1
        out[kind + "_bytes"] += meta.payload_len
    return out


def kvtier_config(path: Path, store: Path, tails: bool, chunk_tokens: int) -> Path:
    path.write_text(json.dumps({
        "chunk_tokens": chunk_tokens,
        "tiers": [{"host": {"capacity": "1GiB"}},
                  {"file": {"path": str(store), "capacity": "16GiB", "write": "back"}}],
        "restore": {"recompute_threshold_tokens": 64},
        "partial_tails": tails,
    }))  # JSON is YAML
    return path


def run_server(run: str, args: argparse.Namespace, model: Path, tmp: Path,
               rows: list[Round]) -> dict[str, Any]:
    system, histories, questions = workload(args)
    kvt = None
    blocks = args.ideal_blocks
    store = tmp / f"store-{run}"
    if run != "ideal":
        kvt = kv_transfer_config(kvtier_config(tmp / f"{run}.yaml", store, run == "tails",
                                                args.chunk_tokens))
        blocks = args.small_blocks
    server = APIServer(tmp / run, model=model, name=run, dtype=args.dtype,
                       max_model_len=args.max_model_len, kv_transfer_config=kvt,
                       num_gpu_blocks_override=blocks)
    convs = [system + h for h in histories]
    mine: list[Round] = []
    with server, httpx.Client(timeout=args.request_timeout) as client:
        stream(client, server.url, _tokens(random.Random("warmup"), 64), 2)  # warm up
        for r in range(args.rounds):
            for u in range(args.users):
                prompt = convs[u] + questions[u][r]
                reply = stream(client, server.url, prompt, args.answer_tokens)
                mine.append(Round(run, u, r + 1, len(prompt), reply.ttft_s * 1e3,
                                  reply.total_s * 1e3))
                convs[u] = prompt + reply.token_ids
        time.sleep(args.flush_wait)  # the idle flush writes what is dirty: count it
        text = client.get(server.url + "/metrics").text
    rows += mine
    back = [x.ttft_ms for x in mine if x.round > 1]
    first = [x.ttft_ms for x in mine if x.round == 1]
    written = metric(text, "kvtier_tier_bytes_written_total", tier="file1")
    restored = metric(text, "kvtier_restored_tokens_total")
    return {
        "gpu_blocks": blocks,
        "file_objects": objects(store),
        "returning_median_ms": statistics.median(back),
        "returning_p90_ms": statistics.quantiles(back, n=10)[-1],
        "round1_median_ms": statistics.median(first),
        "file_bytes_written": written,
        "file_bytes_per_round": written / len(mine),
        "restored_tokens": restored,
        "local_compute_tokens": metric(text, "vllm:prompt_tokens_by_source_total",
                                       source="local_compute"),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", choices=("bench90m", "tiny"), default="bench90m")
    ap.add_argument("--model", default=None, help="model path (default: build the preset's)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--users", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--system-tokens", type=int, default=100)
    ap.add_argument("--history-tokens", type=int, default=1400)
    ap.add_argument("--question-tokens", type=int, default=60)
    ap.add_argument("--answer-tokens", type=int, default=16)
    ap.add_argument("--small-blocks", type=int, default=30,
                    help="GPU KV blocks of the kvtier servers (about two conversations)")
    ap.add_argument("--ideal-blocks", type=int, default=160,
                    help="GPU KV blocks of the ideal server (every conversation)")
    ap.add_argument("--chunk-tokens", type=int, default=256)
    ap.add_argument("--max-model-len", type=int, default=3072)
    ap.add_argument("--flush-wait", type=float, default=4.0, metavar="S")
    ap.add_argument("--runs", default=",".join(RUNS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--request-timeout", type=float, default=300.0)
    ap.add_argument("--out-dir", default=str(RESULTS))
    ap.add_argument("--cache-dir", default=str(Path.home() / ".cache" / "kvtier-models"))
    args = ap.parse_args()
    model = preset_model(args.preset, args.cache_dir, model=args.model,
                         tiny_dtype=args.dtype)
    rows: list[Round] = []
    summary: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="kvt-mrqa-") as d:
        for run in args.runs.split(","):
            summary[run] = run_server(run, args, model, Path(d), rows)
            print(run, json.dumps(summary[run]), flush=True)
    ideal = summary.get("ideal")
    if ideal:
        for s in summary.values():
            s["median_ratio"] = s["returning_median_ms"] / ideal["returning_median_ms"]
            s["p90_ratio"] = s["returning_p90_ms"] / ideal["returning_p90_ms"]
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    params = {k: v for k, v in vars(args).items() if k not in ("out_dir", "cache_dir")}
    (out / "multiround_qa.json").write_text(json.dumps(
        {"params": params, "machine": describe(), "summary": summary}, indent=2))
    with (out / "multiround_qa.jsonl").open("w") as f:
        for row in rows:
            f.write(json.dumps(asdict(row)) + "\n")
    lines = ["| server | GPU blocks | returning median | ratio | returning p90 | ratio "
             "| round 1 median | file bytes / round |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for run, s in summary.items():
        lines.append(
            f"| {run} | {s['gpu_blocks']} | {s['returning_median_ms'] / 1e3:.3f} s "
            f"| {s.get('median_ratio', float('nan')):.2f}x "
            f"| {s['returning_p90_ms'] / 1e3:.3f} s | {s.get('p90_ratio', float('nan')):.2f}x "
            f"| {s['round1_median_ms'] / 1e3:.3f} s "
            f"| {s['file_bytes_per_round'] / 2**20:.2f} MiB |")
    table = "\n".join(lines)
    (out / "multiround_qa.md").write_text(table + "\n")
    print(table)
    tails = summary.get("tails")
    if ideal and tails:
        ok = tails["median_ratio"] <= TARGET_MEDIAN and tails["p90_ratio"] <= TARGET_P90
        print(f"target (tails within {TARGET_MEDIAN}x median, {TARGET_P90}x p90): "
              f"{'met' if ok else 'MISSED'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
