"""Restore-vs-recompute ladder (seed 004, appendix A.1), on a real vLLM engine.

For each prompt of a deterministic ladder of growing lengths (token ids from a fixed,
seeded generator), measured in one engine, in this order:

1. ``cold``      first prefill: nothing cached anywhere (TTFT = one-token generate)
2. ``vllm_hit``  the same prompt again: vLLM's own prefix-cache hit, the floor
3. ``host``      vLLM's prefix cache reset; kvtier restores from its host pool
4. ``file``      kvtier's host tier dropped too, page cache dropped (posix_fadvise):
                 kvtier restores from the file tier, cold
5. ``s3``        host dropped and the file objects deleted: restore from S3 (local moto)

Writes ``<out>/restore_vs_recompute.jsonl`` (one line per prompt), a table with the
ratio of each path to cold prefill, and ``restore_vs_recompute.png`` (TTFT vs length).
Defaults fit a 2-core CPU: the ~90M random-weight Llama (bf16), lengths 1K-8K.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.machine import describe
from kvtier.testing.engines import CompletionResult, LLMWorker, tokens
from kvtier.testing.models import preset_model
from kvtier.vllm.settings import kv_transfer_config

PATHS = ("cold", "vllm_hit", "host", "file", "s3")
RESULTS = Path(__file__).resolve().parent / "results"


def drop_page_cache(root: Path) -> None:
    for p in root.rglob("*.kv"):
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def restored(r: CompletionResult) -> dict[str, int]:
    params: dict[str, Any] = r.kv_transfer_params or {}
    return dict(params.get("kvtier", {}).get("restored_by_tier", {}))


def tier_yaml(path: Path, store: Path, s3: tuple[str, str] | None) -> Path:
    tiers: list[dict[str, Any]] = [
        {"host": {"capacity": "2GiB"}},
        {"file": {"path": str(store), "capacity": "20GiB", "write": "through"}},
    ]
    if s3 is not None:
        tiers.append({"s3": {"bucket": s3[1], "prefix": "ladder/", "endpoint_url": s3[0],
                             "region": "us-east-1", "path_style": True, "capacity": "20GiB",
                             "write": "through", "part_size": "64MiB",
                             "multipart_threshold": "256MiB"}})
    path.write_text(json.dumps({"chunk_tokens": 256, "tiers": tiers}))
    return path


def measure(engine: LLMWorker, prompt: list[int], store: Path,
            paths: list[str]) -> dict[str, Any]:
    row: dict[str, Any] = {"tokens": len(prompt)}

    def run(name: str, reset: bool) -> None:
        t0 = time.perf_counter()
        r = engine.generate([prompt], max_tokens=1, reset_prefix_cache=reset).outputs[0]
        row[name] = time.perf_counter() - t0
        row[f"{name}_restored"] = restored(r)
        row[f"{name}_cached"] = r.num_cached_tokens

    def reset_all() -> None:
        for _ in range(50):  # False while a delayed-free save is still in flight
            if engine.reset_prefix_cache(reset_connector=True):
                return
            time.sleep(0.05)
        raise RuntimeError("reset_prefix_cache kept failing")

    run("cold", False)
    run("vllm_hit", False)
    if "host" in paths:
        run("host", True)
    if "file" in paths:
        reset_all()
        drop_page_cache(store)
        run("file", True)
    if "s3" in paths:
        reset_all()
        shutil.rmtree(store / "kv", ignore_errors=True)
        run("s3", True)
    return row


def table(rows: list[dict[str, Any]], paths: list[str]) -> str:
    head = f"{'tokens':>7} {'cold s':>8} " + " ".join(f"{p + ' s':>10}" for p in paths[1:])
    head += "   " + " ".join(f"{'cold/' + p:>11}" for p in paths[2:])
    lines = [head]
    for r in rows:
        cells = f"{r['tokens']:>7} {r['cold']:>8.2f} "
        cells += " ".join(f"{r[p]:>10.3f}" for p in paths[1:])
        cells += "   " + " ".join(f"{r['cold'] / r[p]:>10.1f}x" for p in paths[2:])
        lines.append(cells)
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], paths: list[str], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    xs = [r["tokens"] for r in rows]
    labels = {"cold": "cold prefill (recompute)", "vllm_hit": "vLLM prefix-cache hit (floor)",
              "host": "kvtier restore: host", "file": "kvtier restore: file (cold)",
              "s3": "kvtier restore: S3 (local moto)"}
    for p in paths:
        ax.plot(xs, [r[p] for r in rows], marker="o", label=labels[p])
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("TTFT (s)")
    ax.set_title("Restore vs recompute")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=None, help="model path (default: build the preset)")
    ap.add_argument("--preset", choices=["bench90m", "tiny"], default="bench90m")
    ap.add_argument("--lengths", default="1024,2048,4096,8192")
    ap.add_argument("--tiers", default="host,file,s3", help="restore paths to measure")
    ap.add_argument("--s3-endpoint", default=None, help="default: start a local moto server")
    ap.add_argument("--out-dir", default=str(RESULTS))
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--cache-dir", default=str(Path.home() / ".cache" / "kvtier-models"))
    args = ap.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",")]
    paths = ["cold", "vllm_hit", *[p for p in ("host", "file", "s3") if p in args.tiers]]
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)

    with ExitStack() as stack:
        tmp = tempfile.TemporaryDirectory(prefix="kvb-", dir=args.workdir)  # short: unix sockets
        work = Path(stack.enter_context(tmp))
        model = preset_model(args.preset, args.cache_dir, model=args.model)
        s3 = None
        if "s3" in paths:
            from kvtier.testing.s3server import moto_server

            endpoint = args.s3_endpoint or stack.enter_context(moto_server())
            import boto3

            boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(
                Bucket="kvtier-ladder")
            s3 = (endpoint, "kvtier-ladder")
        store = work / "store"
        cfg = tier_yaml(work / "kvtier.yaml", store, s3)
        print(f"model {model}; starting vLLM ...", flush=True)
        engine = stack.enter_context(LLMWorker(
            work / "engine", model=str(model), max_model_len=max(lengths) + 64,
            enable_prefix_caching=True, kv_cache_gib=2,
            kv_transfer_config=kv_transfer_config(cfg)))
        print(f"engine up in {engine.startup_s:.0f} s", flush=True)
        engine.generate([tokens(300, seed=1)], max_tokens=1)  # warm-up, not measured
        vocab = int(json.loads((model / "config.json").read_text())["vocab_size"])
        rows = []
        from tqdm import tqdm

        for n in tqdm(lengths, desc="ladder", unit="prompt"):
            rows.append(measure(engine, tokens(n, seed=n, vocab=vocab), store, paths))
    jsonl = out / "restore_vs_recompute.jsonl"
    with open(jsonl, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    (out / "restore_vs_recompute.machine.json").write_text(
        json.dumps({"machine": describe(), "model": str(model), "preset": args.preset}, indent=2))
    plot(rows, paths, out / "restore_vs_recompute.png")
    print(table(rows, paths))
    last = rows[-1]
    print(f"\nat {last['tokens']} tokens:")
    checks = [("host <= cold/20", "host", last["cold"] / 20),
              ("file <= cold/10", "file", last["cold"] / 10),
              ("host <= 1.3 x vLLM hit", "host", 1.3 * last["vllm_hit"])]
    for name, p, bound in checks:
        if p in last:
            ok = "ok" if last[p] <= bound else "MISSED"
            print(f"  {name:<24} {last[p]:.3f} s vs {bound:.3f} s  {ok}")
    print(f"wrote {jsonl} and {out / 'restore_vs_recompute.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
