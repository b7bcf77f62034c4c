"""Multi-turn P/D disaggregation benchmark (seed 000): D->P KV reuse on vs off, on 1P1D.

Topology, all on 127.0.0.1 and started here: a prefill vLLM API server (prefix caching
off, to emulate eviction as the seed does), a decode vLLM API server (prefix caching on),
both with the kvtier connector (roles ``prefill`` / ``decode``) sharing a host + file tier
(``write: through``) in a temp dir, and two ``python -m kvtier router`` processes in front
of the same pair:

* ``dp_on``:  the normal router; on a returning turn the prefill node restores the
  conversation's KV (written by the decode node) from the tier store and computes only
  the new suffix.
* ``dp_off``: ``--no-dp-reuse``; the router sends ``kvtier.load=false`` to the prefill
  node, which recomputes the whole history (the seed's "without reuse" baseline).

Sweep: for every prompt length L, ``--conversations`` conversations of ``--turns`` turns
per mode. Turn 1 is L pseudo-random token ids; each next turn resends the previous prompt
+ the model's output ids (from the stream) + ``--new-tokens`` new ids. Token ids come from
``random.Random("<seed>:<mode>:<L>:<conversation>")``, so no run can be served from KV
another run stored (keys are content hashes). The two modes' conversations are
interleaved, so a noisy neighbour slows both alike. Requests run one at a time.

Per turn (``multiturn_pd.jsonl``): mode, length, conversation, turn, prompt tokens, TTFT
(client side: first SSE data event), prefill ms / restored tokens / restore ms (the
router's ``X-KVTier-*`` headers for the prefill phase), output tokens, total time.
"KV transfer" is the connector's ``restore_ms``: lookup to staged in the prefill node's
host pool (file reads included); the copy into vLLM's paged KV runs inside the forward
pass and so counts as compute (prefill ms - restore ms).
Also ``multiturn_pd.json`` (summary + machine), ``multiturn_pd_ttft.png`` (median TTFT of
returning turns vs length, on / off), ``multiturn_pd_prefill.png`` (prefill duration as
KV transfer + compute, paired bars per length) and ``multiturn_pd.md`` (the tables).

Target: at the longest prompt, D->P on median TTFT of returning turns >= 2x better than off.

Presets: ``bench`` (default: the ~90M bf16 Llama, lengths 1K-4K) and ``smoke`` (the tiny
fp32 Llama, lengths 256/512, 1 conversation of 2 turns, 4 output tokens: a test run).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.machine import describe
from kvtier.testing.models import preset_model
from kvtier.testing.servers import APIServer, router_process, servers_started, split_cpus
from kvtier.vllm.settings import kv_transfer_config

RESULTS = Path(__file__).resolve().parent / "results"
MODES = ("dp_on", "dp_off")
LABELS = {"dp_on": "D->P reuse on", "dp_off": "D->P reuse off (recompute)"}
CHUNK_TOKENS = 128  # = vLLM's CPU block size
TOKEN_LOW = 10  # skip the tokenizer's special ids
TARGET_RATIO = 2.0


@dataclass(frozen=True)
class Preset:
    """Defaults of one ``--preset``; every field can be overridden by its flag."""

    lengths: str
    conversations: int
    turns: int
    output_tokens: int
    new_tokens: int


PRESETS = {
    # 128 output tokens: each turn's answer completes a chunk on the decode node, so the
    # next prefill reads decode-written KV from the shared tier, not only its own.
    "bench": Preset("1024,2048,4096", conversations=2, turns=4, output_tokens=128,
                    new_tokens=64),
    "smoke": Preset("256,512", conversations=1, turns=2, output_tokens=4, new_tokens=64),
}


@dataclass(frozen=True)
class TurnRecord:
    """One request through the router, as written to the JSONL."""

    mode: str
    length: int
    conversation: int
    turn: int
    prompt_tokens: int
    ttft_ms: float
    prefill_ms: float
    restored_tokens: int
    restored_shared: int  # of those, read from the shared tier (written by the decode node)
    restore_ms: float
    compute_ms: float
    kv_bytes: int
    output_tokens: int
    total_ms: float
    stored: bool  # the decode node's chunks were all in the shared tier before the next turn


@dataclass(frozen=True)
class Reply:
    """What one streamed completion returned."""

    ttft_s: float
    total_s: float
    token_ids: list[int]
    headers: dict[str, str]


# -- topology ---------------------------------------------------------------------------


def tier_config(path: Path, shared: Path) -> Path:
    """The kvtier config both servers share: host pool, then the shared file tier."""
    path.write_text(json.dumps({
        "chunk_tokens": CHUNK_TOKENS,
        "tiers": [{"host": {"capacity": "512MiB"}},
                  {"file": {"path": str(shared), "capacity": "16GiB", "write": "through"}}],
    }))  # JSON is YAML
    return path


@contextmanager
def router(tmp: Path, name: str, prefill: str, decode: str, tiers: Path, *,
           dp_reuse: bool, timeout_s: float) -> Iterator[str]:
    """Run ``python -m kvtier router`` until the block exits; yields its URL."""
    args = ["--tiers", str(tiers), "--request-timeout", str(timeout_s),
            "--pd-mode", "always"]  # D->P reuse is measured on the prefill node
    with router_process(tmp, prefill, decode, name=name,
                        args=args + ([] if dp_reuse else ["--no-dp-reuse"])) as url:
        yield url


def count_objects(shared: Path) -> int:
    """Objects in the shared file tier (one per chunk: keys are content hashes)."""
    return sum(1 for _ in shared.rglob("*.kv")) if shared.exists() else 0


def wait_stored(shared: Path, target: int, timeout_s: float) -> bool:
    """Wait until the shared tier holds ``target`` objects; False on timeout.

    The decode node writes a turn's KV after it answers, and streamed answers carry no
    ``last_key`` to wait on, so the next turn waits for the expected object count (requests
    run one at a time, so nothing else adds objects meanwhile).
    """
    deadline = time.monotonic() + timeout_s
    while count_objects(shared) < target:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)  # polling another process
    return True


# -- one conversation -------------------------------------------------------------------


def stream_completion(client: httpx.Client, url: str, body: dict[str, Any]) -> Reply:
    """POST a streamed completion; TTFT is the first SSE data event."""
    t0 = time.perf_counter()
    ttft: float | None = None
    ids: list[int] = []
    with client.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{url} answered {r.status_code}: {r.read()[:500]!r}")
        headers = dict(r.headers)
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            if ttft is None:
                ttft = time.perf_counter() - t0
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(f"stream error: {event['error']}")
            for choice in event.get("choices", []):
                ids += choice.get("token_ids") or []
    total = time.perf_counter() - t0
    return Reply(ttft if ttft is not None else total, total, ids, headers)


def conversation(client: httpx.Client, url: str, shared: Path, *, mode: str, length: int,
                 index: int, args: argparse.Namespace, vocab: int,
                 kv_bytes_per_token: int) -> list[TurnRecord]:
    """Run one multi-turn conversation through ``url``; one record per turn."""
    rng = random.Random(f"{args.seed}:{mode}:{length}:{index}")
    prompt = [rng.randrange(TOKEN_LOW, vocab) for _ in range(length)]
    cid = f"{mode}-L{length}-c{index}"
    records = []
    stored = 0  # this conversation's chunks in the shared tier
    for turn in range(1, args.turns + 1):
        before = count_objects(shared)
        body = {"model": "model", "prompt": prompt, "max_tokens": args.output_tokens,
                "temperature": 0, "ignore_eos": True, "return_token_ids": True,
                "stream": True, "conversation_id": cid}
        reply = stream_completion(client, url, body)
        # Decode keeps prompt + output in full chunks (the prefill node wrote the prompt's);
        # the last output token's KV is never computed, so it cannot complete a chunk.
        chunks = (len(prompt) + len(reply.token_ids) - 1) // CHUNK_TOKENS
        settled = wait_stored(shared, before + chunks - stored, args.store_timeout)
        stored = chunks
        prefill_ms = float(reply.headers.get("x-kvtier-prefill-ms", "nan"))
        restore_ms = float(reply.headers.get("x-kvtier-restore-ms", "0"))
        restored = int(reply.headers.get("x-kvtier-restored-tokens", "0"))
        by_tier = dict(
            part.split("=", 1) for part in reply.headers.get("x-kvtier-restored-by-tier", "")
            .split(",") if "=" in part
        )
        shared_tokens = sum(int(n) for tier, n in by_tier.items() if tier != "host")
        records.append(TurnRecord(
            mode=mode, length=length, conversation=index, turn=turn,
            prompt_tokens=len(prompt), ttft_ms=reply.ttft_s * 1e3, prefill_ms=prefill_ms,
            restored_tokens=restored, restored_shared=shared_tokens, restore_ms=restore_ms,
            compute_ms=max(prefill_ms - restore_ms, 0.0),
            kv_bytes=restored * kv_bytes_per_token, output_tokens=len(reply.token_ids),
            total_ms=reply.total_s * 1e3, stored=settled))
        prompt = prompt + reply.token_ids + [
            rng.randrange(TOKEN_LOW, vocab) for _ in range(args.new_tokens)]
    return records


# -- summary, tables, plots -------------------------------------------------------------


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def summarize(rows: list[TurnRecord], lengths: list[int]) -> dict[str, Any]:
    """Medians per mode and length (returning turns = turn >= 2) and the target check."""
    per: dict[str, dict[str, dict[str, Any]]] = {m: {} for m in MODES}
    for m in MODES:
        for n in lengths:
            mine = [r for r in rows if r.mode == m and r.length == n]
            back = [r for r in mine if r.turn >= 2]
            turns = sorted({r.turn for r in mine})
            per[m][str(n)] = {
                "ttft_ms_turn1": _median([r.ttft_ms for r in mine if r.turn == 1]),
                "ttft_ms_returning": _median([r.ttft_ms for r in back]),
                "prefill_ms_returning": _median([r.prefill_ms for r in back]),
                "restore_ms_returning": _median([r.restore_ms for r in back]),
                "compute_ms_returning": _median([r.compute_ms for r in back]),
                "restored_tokens_returning": _median([float(r.restored_tokens) for r in back]),
                "kv_bytes_returning": _median([float(r.kv_bytes) for r in back]),
                "ttft_ms_by_turn": {t: _median([r.ttft_ms for r in mine if r.turn == t])
                                    for t in turns},
            }
    longest = str(max(lengths))
    on = per["dp_on"][longest]["ttft_ms_returning"]
    off = per["dp_off"][longest]["ttft_ms_returning"]
    ratio = off / on if on > 0 else float("nan")
    return {"by_mode": per, "target": {
        "length": int(longest), "ttft_ms_on": on, "ttft_ms_off": off, "ratio": ratio,
        "required": TARGET_RATIO, "pass": bool(ratio >= TARGET_RATIO)}}


def main_table(summary: dict[str, Any], lengths: list[int]) -> str:
    """Median TTFT and prefill split of returning turns, per length, on vs off."""
    on, off = summary["by_mode"]["dp_on"], summary["by_mode"]["dp_off"]
    head = (f"| {'prompt':>6} | {'TTFT on ms':>10} | {'TTFT off ms':>11} | {'off/on':>6} | "
            f"{'prefill on ms':>13} | {'xfer on ms':>10} | {'prefill off ms':>14} | "
            f"{'restored':>8} |")
    lines = [head, "|" + "|".join("-" * (len(c)) for c in head.split("|")[1:-1]) + "|"]
    for n in lengths:
        a, b = on[str(n)], off[str(n)]
        ratio = b["ttft_ms_returning"] / a["ttft_ms_returning"]
        lines.append(
            f"| {n:>6} | {a['ttft_ms_returning']:>10.1f} | {b['ttft_ms_returning']:>11.1f} | "
            f"{ratio:>5.2f}x | {a['prefill_ms_returning']:>13.1f} | "
            f"{a['restore_ms_returning']:>10.1f} | {b['prefill_ms_returning']:>14.1f} | "
            f"{a['restored_tokens_returning']:>8.0f} |")
    return "\n".join(lines)


def turn_table(rows: list[TurnRecord], length: int, turns: int) -> str:
    """Median TTFT per turn at one length (prompt tokens from the first conversation)."""
    head = f"| {'turn':>4} | {'prompt':>6} | {'TTFT on ms':>10} | {'TTFT off ms':>11} | " \
           f"{'off/on':>6} | {'restored on':>11} | {'from shared tier':>16} |"
    lines = [f"L = {length}", head,
             "|" + "|".join("-" * len(c) for c in head.split("|")[1:-1]) + "|"]
    for t in range(1, turns + 1):
        def pick(m: str, t: int = t) -> list[TurnRecord]:
            return [r for r in rows if r.mode == m and r.length == length and r.turn == t]
        a, b = pick("dp_on"), pick("dp_off")
        if not a or not b:
            continue
        on, off = _median([r.ttft_ms for r in a]), _median([r.ttft_ms for r in b])
        restored = _median([float(r.restored_tokens) for r in a])
        shared = _median([float(r.restored_shared) for r in a])
        lines.append(f"| {t:>4} | {a[0].prompt_tokens:>6} | {on:>10.1f} | {off:>11.1f} | "
                     f"{off / on:>5.2f}x | {restored:>11.0f} | {shared:>16.0f} |")
    return "\n".join(lines)


def plot(summary: dict[str, Any], lengths: list[int], out: Path) -> None:
    """TTFT vs prompt length (two lines) and prefill split (paired stacked bars)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    per = summary["by_mode"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for m in MODES:
        ax.plot(lengths, [per[m][str(n)]["ttft_ms_returning"] for n in lengths], marker="o",
                label=LABELS[m])
    ax.set_xscale("log", base=2)
    ax.set_xticks(lengths, [str(n) for n in lengths])
    ax.set_xlabel("turn-1 prompt tokens")
    ax.set_ylabel("median TTFT of returning turns (ms)")
    ax.set_title("1P1D multi-turn: TTFT, D->P reuse on vs off")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "multiturn_pd_ttft.png", dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(8, 4.5))
    width = 0.38
    xs = list(range(len(lengths)))
    for k, m in enumerate(MODES):
        pos = [x + (k - 0.5) * width for x in xs]
        xfer = [per[m][str(n)]["restore_ms_returning"] for n in lengths]
        comp = [per[m][str(n)]["compute_ms_returning"] for n in lengths]
        hatch = "" if m == "dp_on" else "//"
        ax.bar(pos, xfer, width, color="tab:orange", hatch=hatch, edgecolor="black",
               label=f"KV transfer ({LABELS[m]})")
        ax.bar(pos, comp, width, bottom=xfer, color="tab:blue", hatch=hatch, edgecolor="black",
               label=f"compute ({LABELS[m]})")
    ax.set_xticks(xs, [str(n) for n in lengths])
    ax.set_xlabel("turn-1 prompt tokens (left bar: on, right bar: off)")
    ax.set_ylabel("median prefill duration, returning turns (ms)")
    ax.set_title("Prefill duration: KV transfer + compute")
    ax.legend(fontsize=8)
    ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "multiturn_pd_prefill.png", dpi=110)
    plt.close(fig)


# -- main -------------------------------------------------------------------------------


def kv_bytes_per_token(config: dict[str, Any]) -> int:
    """2 x layers x kv_heads x head_dim x dtype bytes, from a HF ``config.json``."""
    heads = int(config["num_attention_heads"])
    head_dim = int(config.get("head_dim") or config["hidden_size"] // heads)
    kv_heads = int(config.get("num_key_value_heads") or heads)
    dtype = str(config.get("torch_dtype") or config.get("dtype") or "float32")
    itemsize = 4 if "32" in dtype else 2
    return 2 * int(config["num_hidden_layers"]) * kv_heads * head_dim * itemsize


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="bench")
    ap.add_argument("--model", default=None, help="model path (default: build the preset's)")
    ap.add_argument("--lengths", default=None, help="turn-1 prompt lengths, comma separated")
    ap.add_argument("--conversations", type=int, default=None, help="per length and mode")
    ap.add_argument("--turns", type=int, default=None)
    ap.add_argument("--output-tokens", type=int, default=None)
    ap.add_argument("--new-tokens", type=int, default=None, help="new ids appended per turn")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--store-timeout", type=float, default=30.0, metavar="S",
                    help="wait this long for a turn's KV to reach the shared tier")
    ap.add_argument("--request-timeout", type=float, default=300.0, metavar="S")
    ap.add_argument("--out-dir", default=str(RESULTS))
    ap.add_argument("--cache-dir", default=str(Path.home() / ".cache" / "kvtier-models"))
    args = ap.parse_args(argv)
    preset = PRESETS[args.preset]
    for name, value in asdict(preset).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.turns < 2 or args.conversations < 1:
        ap.error("--turns must be >= 2 and --conversations >= 1")
    return args


def build_model(args: argparse.Namespace) -> tuple[Path, str]:
    """The model path and the ``--dtype`` to serve it with."""
    preset = "tiny" if args.preset == "smoke" else "bench90m"
    model = preset_model(preset, args.cache_dir, model=args.model, tiny_dtype="float32")
    cfg = json.loads((model / "config.json").read_text())
    dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32")
    return model, dtype


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    lengths = sorted(int(x) for x in args.lengths.split(","))
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model, dtype = build_model(args)
    config_doc = json.loads((model / "config.json").read_text())
    vocab = int(config_doc["vocab_size"])
    per_token = kv_bytes_per_token(config_doc)
    growth = args.turns * (args.output_tokens + args.new_tokens)
    max_len = max(lengths) + growth + 64
    from tqdm import tqdm

    rows: list[TurnRecord] = []
    t_start = time.perf_counter()
    with ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvt-")))
        shared = tmp / "shared"
        cfg = tier_config(tmp / "kvtier.yaml", shared)
        print(f"model {model} ({dtype}); starting prefill + decode servers ...", flush=True)
        common: dict[str, Any] = {"model": model, "dtype": dtype, "max_model_len": max_len,
                                  "kv_cache_gib": 1}
        p_cpus, d_cpus = split_cpus(2)  # one machine: never bind both workers to one core
        prefill, decode = stack.enter_context(servers_started(
            APIServer(tmp, name="prefill", prefix_caching=False, cpus=p_cpus,
                      kv_transfer_config=kv_transfer_config(cfg, role="prefill"), **common),
            APIServer(tmp, name="decode", prefix_caching=True, cpus=d_cpus,
                      kv_transfer_config=kv_transfer_config(cfg, role="decode"), **common)))
        urls = {m: stack.enter_context(router(tmp, f"router-{m}", prefill.url, decode.url, cfg,
                                              dp_reuse=(m == "dp_on"),
                                              timeout_s=args.request_timeout))
                for m in MODES}
        startup_s = time.perf_counter() - t_start
        print(f"servers and routers up in {startup_s:.0f} s", flush=True)
        client = stack.enter_context(httpx.Client(timeout=httpx.Timeout(args.request_timeout)))
        warm = argparse.Namespace(**{**vars(args), "turns": 2, "output_tokens": 2,
                                     "seed": f"warmup-{args.seed}"})
        for m in MODES:  # first requests pay one-off costs: not measured
            conversation(client, urls[m], shared, mode=m, length=min(lengths), index=0,
                         args=warm, vocab=vocab, kv_bytes_per_token=per_token)
        bar = tqdm(total=len(lengths) * args.conversations * len(MODES) * args.turns,
                   desc="turns", unit="turn")
        for n in lengths:
            for c in range(args.conversations):
                for m in MODES:  # interleaved: a noisy neighbour slows both modes alike
                    recs = conversation(client, urls[m], shared, mode=m, length=n, index=c,
                                        args=args, vocab=vocab, kv_bytes_per_token=per_token)
                    rows += recs
                    bar.update(len(recs))
        bar.close()
    elapsed = time.perf_counter() - t_start

    jsonl = out / "multiturn_pd.jsonl"
    with open(jsonl, "w") as f:
        for r in rows:
            f.write(json.dumps(asdict(r)) + "\n")
    summary = summarize(rows, lengths)
    settings = {k: v for k, v in vars(args).items() if k not in ("out_dir", "cache_dir")}
    (out / "multiturn_pd.json").write_text(json.dumps({
        "summary": summary, "settings": settings, "model": str(model), "dtype": dtype,
        "kv_bytes_per_token": per_token, "startup_s": startup_s, "elapsed_s": elapsed,
        "machine": describe()}, indent=2))
    plot(summary, lengths, out)
    t = summary["target"]
    verdict = "PASS" if t["pass"] else "MISS"
    parts = [main_table(summary, lengths), ""]
    parts += [turn_table(rows, n, args.turns) + "\n" for n in lengths]
    parts.append(f"target: D->P on median TTFT (returning turns) at {t['length']} tokens "
                 f">= {TARGET_RATIO:.0f}x better than off: {t['ttft_ms_off']:.1f} / "
                 f"{t['ttft_ms_on']:.1f} ms = {t['ratio']:.2f}x  {verdict}")
    text = "\n".join(parts)
    print(text)
    (out / "multiturn_pd.md").write_text(
        f"# 1P1D multi-turn, D->P reuse on vs off ({args.preset})\n\n"
        f"model {model.name} ({dtype}), {args.conversations} conversation(s) x {args.turns} "
        f"turns per length and mode, {args.output_tokens} output + {args.new_tokens} new "
        f"tokens per turn; {elapsed:.0f} s in all.\n\n{text}\n")
    print(f"wrote {jsonl}, multiturn_pd.json/.md and the two PNGs in {out} ({elapsed:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
