"""LMCache's multi-round QA workload, in two modes, each comparing servers in one run.

The workload is LMCache's ``multi-round-qa`` benchmark: ``--users`` users share a
``--system-tokens`` system prompt; each has its own ``--history-tokens`` history; every round
a user sends a ``--question-tokens`` question and gets a ``--answer-tokens`` answer, which the
next round's prompt resends. It is reproduced here with token-id prompts
(``/v1/completions``, streamed), so that every server sees exactly the same tokens and the
cache's behaviour is exact. Question lengths are drawn per round, uniformly within +-50 %
of ``--question-tokens`` (LMCache's questions are text of varying length), so a
conversation's end falls anywhere within a chunk: with fixed lengths every conversation
would end at the same few offsets.

``--mode cache`` (issue 22): rounds go round robin over the users, one request at a time,
so between two rounds of one user every other user passes through the GPU KV cache. Three
servers, one after the other, the same model and workload:

* ``ideal``: vLLM alone with a KV cache that holds every conversation (``--ideal-blocks``):
  a returning round pays only for its new tokens and the unfilled tail of its last block.
* ``tails``: vLLM with kvtier (host pool + a write-back file tier, ``partial_tails: true``)
  and a KV cache of ``--small-blocks`` blocks (about two conversations): returning rounds
  are evicted and restored from kvtier down to their last full block.
* ``no_tails``: the same with ``partial_tails: false``: whole chunks only, so a return also
  recomputes up to ``chunk_tokens - 1`` tokens of its own history.

Reported per server: the median and p90 TTFT of returning rounds (round >= 2) and their
ratio to the ideal's, turn-1 TTFT, the bytes kvtier wrote to the file tier per round
(scraped from ``/metrics`` after an idle flush), and the objects the file tier holds at
the end (whole chunks and tails, read from their headers). Targets (issue 22): ``tails``
within 1.2x of the ideal at the median and 1.3x at p90. Files: ``multiround_qa.json``
(summary + machine), ``.jsonl`` (every round), ``.md`` (the table).

``--mode pd`` (issue 20) is in ``benchmarks/multiround_pd.py``; see its docstring. Its
files are ``multiround_pd.*``.
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
from kvtier.metrics import RESTORE_STAGES
from kvtier.objformat import HEADER_SPAN, CorruptObject, decode_header
from kvtier.testing.models import preset_model
from kvtier.testing.servers import APIServer
from kvtier.vllm.settings import kv_transfer_config

RESULTS = Path(__file__).resolve().parent / "results"
RUNS = ("ideal", "tails", "no_tails")
#: --mode pd (benchmarks/multiround_pd.py)
PD_RUNS = ("one_engine", "pd_auto", "pd_auto_noid", "pd_always")
TOKEN_LOW, TOKEN_HIGH = 10, 4000
TARGET_MEDIAN, TARGET_P90 = 1.2, 1.3


@dataclass(frozen=True)
class Preset:
    """Defaults of one ``--preset``; every field can be overridden by its flag."""

    model: str  # ``preset_model``'s name
    dtype: str
    users: int
    rounds: int
    system_tokens: int
    history_tokens: int
    question_tokens: int
    answer_tokens: int


PRESETS = {
    "bench90m": Preset("bench90m", "bfloat16", users=6, rounds=6, system_tokens=100,
                       history_tokens=1400, question_tokens=60, answer_tokens=16),
    "tiny": Preset("tiny", "bfloat16", users=6, rounds=6, system_tokens=100,
                   history_tokens=1400, question_tokens=60, answer_tokens=16),
    # a test run: the tiny fp32 model, 3 users of 2 short rounds
    "smoke": Preset("tiny", "float32", users=3, rounds=2, system_tokens=32,
                    history_tokens=300, question_tokens=30, answer_tokens=4),
}


@dataclass(frozen=True)
class Round:
    run: str
    user: int
    round: int
    prompt_tokens: int
    ttft_ms: float
    total_ms: float
    path: str = ""  # mode pd, through a router: its X-KVTier-Path


@dataclass(frozen=True)
class Workload:
    """The token ids every server of a run gets: system prompt, per-user history, per-user
    per-round questions."""

    system: list[int]
    histories: list[list[int]]
    questions: list[list[list[int]]]

    def conversations(self) -> list[list[int]]:
        """Each user's first prompt before its question: system prompt + its history."""
        return [self.system + h for h in self.histories]


def _tokens(rng: random.Random, n: int, high: int = TOKEN_HIGH) -> list[int]:
    return [rng.randrange(TOKEN_LOW, high) for _ in range(n)]


def stream(client: httpx.Client, url: str, prompt: list[int], max_tokens: int,
           extra: dict[str, Any] | None = None) -> Reply:
    """One streamed, greedy completion of ``prompt`` (TTFT: the first SSE data event);
    ``extra``: more body fields (a router's ``conversation_id``)."""
    body = {"model": "model", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "return_token_ids": True, **(extra or {})}
    return stream_completion(client, url, body)


def metric(text: str, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``."""
    total = 0.0
    for m in re.finditer(rf"^{re.escape(name)}(\{{[^}}]*\}})? ([0-9.e+-]+)$", text, re.M):
        tags = m.group(1) or ""
        if all(f'{k}="{v}"' in tags for k, v in labels.items()):
            total += float(m.group(2))
    return total


def workload(args: argparse.Namespace, high: int = TOKEN_HIGH) -> Workload:
    """The seeded workload, token ids in ``[TOKEN_LOW, high)`` (``high``: at most the
    model's vocabulary); the same for every server of a run."""
    rng = random.Random(f"{args.seed}:system")
    system = _tokens(rng, args.system_tokens, high)
    histories = [_tokens(random.Random(f"{args.seed}:history:{u}"), args.history_tokens, high)
                 for u in range(args.users)]
    questions = []
    for u in range(args.users):
        rng = random.Random(f"{args.seed}:q:{u}")
        lo, hi = args.question_tokens // 2, args.question_tokens * 3 // 2
        questions.append([_tokens(rng, rng.randint(lo, hi), high) for _ in range(args.rounds)])
    return Workload(system, histories, questions)


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


def kvtier_config(path: Path, store: Path, tails: bool, chunk_tokens: int,
                  host_capacity: str = "1GiB") -> Path:
    path.write_text(json.dumps({
        "chunk_tokens": chunk_tokens,
        "tiers": [{"host": {"capacity": host_capacity}},
                  {"file": {"path": str(store), "capacity": "16GiB", "write": "back"}}],
        "restore": {"recompute_threshold_tokens": 64},
        "partial_tails": tails,
    }))  # JSON is YAML
    return path


def run_server(run: str, args: argparse.Namespace, model: Path, tmp: Path,
               rows: list[Round]) -> dict[str, Any]:
    work = workload(args, args.token_high)
    kvt = None
    blocks = args.ideal_blocks
    store = tmp / f"store-{run}"
    if run != "ideal":
        kvt = kv_transfer_config(kvtier_config(tmp / f"{run}.yaml", store, run == "tails",
                                                args.chunk_tokens, args.host_capacity))
        blocks = args.small_blocks
    server = APIServer(tmp / run, model=model, name=run, dtype=args.dtype,
                       max_model_len=args.max_model_len, kv_transfer_config=kvt,
                       num_gpu_blocks_override=blocks)
    convs = work.conversations()
    mine: list[Round] = []
    with server, httpx.Client(timeout=args.request_timeout) as client:
        warmup = _tokens(random.Random("warmup"), 64, args.token_high)
        stream(client, server.url, warmup, 2)
        for r in range(args.rounds):
            for u in range(args.users):
                prompt = convs[u] + work.questions[u][r]
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
        "restore_stage_ms": stage_means(text),
        "drops": {r: metric(text, "kvtier_drops_total", reason=r) for r in DROP_REASONS},
    }


#: ``kvtier_drops_total`` reasons a small host pool shows.
DROP_REASONS = ("host_full", "load_timeout", "restore_no_slot", "store_queue_full")


def stage_means(text: str) -> dict[str, dict[str, float]]:
    """Per restore stage (``kvtier_restore_stage_seconds``): restores that passed through
    it, and their mean and total milliseconds in it."""
    out = {}
    for stage in RESTORE_STAGES:
        n = metric(text, "kvtier_restore_stage_seconds_count", stage=stage)
        total = metric(text, "kvtier_restore_stage_seconds_sum", stage=stage) * 1e3
        if n:
            out[stage] = {"n": n, "mean_ms": round(total / n, 2), "total_ms": round(total, 1)}
    return out


def write_rows(path: Path, rows: list[Round]) -> None:
    with path.open("w") as f:
        for row in rows:
            f.write(json.dumps(asdict(row)) + "\n")


def run_cache_mode(args: argparse.Namespace, model: Path, out: Path) -> None:
    """``--mode cache``: ideal, tails, no_tails, one server after the other."""
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
    (out / "multiround_qa.json").write_text(json.dumps(
        {"params": params_of(args), "machine": describe(), "summary": summary}, indent=2))
    write_rows(out / "multiround_qa.jsonl", rows)
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


def params_of(args: argparse.Namespace) -> dict[str, Any]:
    """The run's parameters, as recorded next to its results."""
    skip = ("out_dir", "cache_dir", "keep_logs")
    return {k: v for k, v in vars(args).items() if k not in skip}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", choices=("cache", "pd"), default="cache",
                    help="cache: ideal vs kvtier (issue 22); pd: one engine vs selective "
                         "and always P/D through the router (issue 20)")
    ap.add_argument("--preset", choices=sorted(PRESETS), default="bench90m")
    ap.add_argument("--model", default=None, help="model path (default: build the preset's)")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--users", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--system-tokens", type=int, default=None)
    ap.add_argument("--history-tokens", type=int, default=None)
    ap.add_argument("--question-tokens", type=int, default=None)
    ap.add_argument("--answer-tokens", type=int, default=None)
    ap.add_argument("--small-blocks", type=int, default=30,
                    help="cache: GPU KV blocks of the kvtier servers (about two conversations)")
    ap.add_argument("--ideal-blocks", type=int, default=160,
                    help="cache: GPU KV blocks of the ideal server (every conversation)")
    ap.add_argument("--concurrency", type=int, default=3,
                    help="pd: users in flight at once (each sends its rounds back to back)")
    ap.add_argument("--pd-blocks", type=int, default=64,
                    help="pd: GPU KV blocks of every server (the users in flight fit)")
    ap.add_argument("--keep-logs", default=None, metavar="DIR",
                    help="pd: copy the servers' and routers' logs here at the end")
    ap.add_argument("--chunk-tokens", type=int, default=256)
    ap.add_argument("--host-capacity", default="1GiB",
                    help="cache: the kvtier servers' host pool (e.g. 48MiB: smaller than the "
                         "users' histories, so returns come from the file tier)")
    ap.add_argument("--max-model-len", type=int, default=3072)
    ap.add_argument("--flush-wait", type=float, default=4.0, metavar="S")
    ap.add_argument("--runs", default=None,
                    help=f"comma separated; cache: {','.join(RUNS)}, pd: "
                         f"{','.join(PD_RUNS)} (the default: all of the mode's)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--request-timeout", type=float, default=300.0)
    ap.add_argument("--out-dir", default=str(RESULTS))
    ap.add_argument("--cache-dir", default=str(Path.home() / ".cache" / "kvtier-models"))
    args = ap.parse_args(argv)
    preset = PRESETS[args.preset]
    for name, value in asdict(preset).items():
        if name != "model" and getattr(args, name) is None:
            setattr(args, name, value)
    known = RUNS if args.mode == "cache" else PD_RUNS
    args.runs = args.runs or ",".join(known)
    unknown = set(args.runs.split(",")) - set(known)
    if unknown:
        ap.error(f"--runs {','.join(sorted(unknown))}: not a run of --mode {args.mode} "
                 f"({','.join(known)})")
    if args.users < 1 or args.rounds < 2 or args.concurrency < 1:
        ap.error("--users and --concurrency must be >= 1 and --rounds >= 2")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model = preset_model(PRESETS[args.preset].model, args.cache_dir, model=args.model,
                         tiny_dtype=args.dtype)
    vocab = int(json.loads((model / "config.json").read_text())["vocab_size"])
    args.token_high = min(TOKEN_HIGH, vocab)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if args.mode == "cache":
        run_cache_mode(args, model, out)
    else:
        from benchmarks.multiround_pd import run_pd_mode

        run_pd_mode(args, model, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
