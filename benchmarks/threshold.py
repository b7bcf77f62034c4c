"""Adaptive recompute threshold (``recompute_threshold_tokens: auto``) against fixed ones.

For each prompt length of a ladder and each tier the stored prefix is restored from,
the TTFT (a one-token generate) of three policies, all on one real vLLM engine configured
with ``auto`` and warmed up first with ``--warmup`` prefills of varied lengths (so its step
model is past cold), request by request:

* ``recompute``  ``kv_transfer_params {"kvtier": {"load": false}}``: the reference
* ``restore``    ``{"kvtier": {"recompute_threshold_tokens": 1}}``: always restore (a
                 request's own fixed threshold overrides ``auto`` for that request)
* ``auto``       no parameter: the engine's cost model decides

The three run back to back on the same stored prefix, in an order that rotates with each
repetition, so the engine, its caches and the machine's drift are shared by all three
(two engines differed by more than the ms-scale differences at short prompts). Each TTFT
is divided by the recompute reference, and ``auto`` by the best of the other two
("oracle": 1.0 means auto chose as well as hindsight).
Tiers: ``host`` (vLLM's prefix cache reset), ``file`` (kvtier's host tier dropped, page
cache dropped), ``s3`` (on a host + S3 engine; a local moto server unless
``--s3-endpoint``). Writes ``<out>/threshold.json`` and ``threshold.png``.
``--smoke``: the tiny model, two short prompts, host and file, to check the script end to
end.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.machine import describe
from benchmarks.restore_vs_recompute import drop_page_cache, restored
from kvtier.testing.engines import CompletionResult, LLMWorker, tokens
from kvtier.testing.models import preset_model
from kvtier.vllm.settings import kv_transfer_config

RESULTS = Path(__file__).resolve().parent / "results"
TIERS = ("host", "file", "s3")
NO_LOAD = {"kvtier": {"load": False}}
#: What each policy sends with a request (None: nothing, the engine's ``auto`` decides).
POLICY_PARAMS: dict[str, dict[str, Any] | None] = {
    "recompute": NO_LOAD,
    "restore": {"kvtier": {"recompute_threshold_tokens": 1}},
    "auto": None,
}
NO_CACHE = {"kvtier": {"load": False, "save": False}}


def engine_yaml(path: Path, store: Path, s3: tuple[str, str] | None, prefix: str,
                threshold: int | str, warmup_steps: int) -> Path:
    """Host + a file tier, or host + S3 when ``s3`` is given: a prefix "in S3" is then in
    no tier this engine would look at first (deleting a file tier's objects behind its
    back would leave its index listing them, and the cost model would price a file read)."""
    tiers: list[dict[str, Any]] = [{"host": {"capacity": "2GiB"}}]
    if s3 is None:
        tiers.append({"file": {"path": str(store), "capacity": "20GiB", "write": "through"}})
    else:
        tiers.append({"s3": {"bucket": s3[1], "prefix": prefix, "endpoint_url": s3[0],
                             "region": "us-east-1", "path_style": True, "capacity": "20GiB",
                             "write": "through"}})
    restore: dict[str, Any] = {"recompute_threshold_tokens": threshold}
    if threshold == "auto":
        restore["auto_warmup_steps"] = warmup_steps
    path.write_text(json.dumps({"chunk_tokens": 256, "tiers": tiers, "restore": restore,
                                # resets leave the prompt on the lower tiers only
                                "reset_cache": "host"}))
    return path


class Runner:
    """One engine, one policy: measures the recompute reference and each tier's restore."""

    def __init__(self, engine: LLMWorker, store: Path, vocab: int) -> None:
        self.engine, self.store, self.vocab = engine, store, vocab

    def ttft(self, prompt: list[int], *, reset: bool,
             params: dict[str, Any] | None = None) -> tuple[float, CompletionResult]:
        t0 = time.perf_counter()
        out = self.engine.generate([prompt], max_tokens=1, reset_prefix_cache=reset,
                                   kv_transfer_params=[params]).outputs[0]
        return time.perf_counter() - t0, out

    def reset_all(self) -> None:
        self.engine.reset_until_done()  # "not yet" while saves or host writes are in flight

    def warm_up(self, n: int, max_len: int) -> None:
        """Prefills of varied lengths that neither load nor store: the step model's data."""
        rng = random.Random(7)
        for i in range(n):
            length = rng.randrange(64, max_len)
            self.ttft(tokens(length, seed=10_000 + i, vocab=self.vocab), reset=False,
                      params=NO_CACHE)

    def prepare(self, tier: str) -> None:
        """Make ``tier`` the highest place the stored prefix is (vLLM's cache is reset by
        the request itself)."""
        if tier in ("file", "s3"):
            self.reset_all()
        if tier == "file":
            drop_page_cache(self.store)

    def measure(self, prompt: list[int], tiers: list[str], policies: list[str],
                rep: int) -> dict[str, dict[str, Any]]:
        """Per policy, the recompute reference and a restore from each of ``tiers`` (in
        host, file, s3 order), the policies back to back in an order rotated by ``rep``."""
        self.ttft(prompt, reset=False)  # compute and store
        self.ttft(prompt, reset=False)  # a vLLM hit: lets the delayed-free save finish
        order = ["recompute", *policies]
        order = order[rep % len(order):] + order[: rep % len(order)]
        rows: dict[str, dict[str, Any]] = {p: {} for p in policies}
        for tier in tiers:
            ttfts: dict[str, float] = {}
            for policy in order:
                self.prepare(tier)
                ttfts[policy], out = self.ttft(prompt, reset=True,
                                               params=POLICY_PARAMS[policy])
                if policy == "recompute":
                    continue
                row = rows[policy]
                params = (out.kv_transfer_params or {}).get("kvtier", {})
                row[f"{tier}_restored"] = sum(restored(out).values())
                if "decision" in params:
                    row[f"{tier}_decision"] = params["decision"]
            for policy in policies:
                rows[policy][f"{tier}_ref"] = ttfts["recompute"]
                rows[policy][tier] = ttfts[policy]
        return rows


def run_policies(args: argparse.Namespace, model: Path, work: Path,
                 s3: tuple[str, str] | None, lengths: list[int], tiers: list[str],
                 policies: list[str], vocab: int
                 ) -> dict[str, dict[tuple[int, int], dict[str, Any]]]:
    """One ``auto`` engine per lower tier: host + file measures the host and file rows,
    host + S3 the S3 rows."""
    out: dict[str, dict[tuple[int, int], dict[str, Any]]] = {p: {} for p in policies}
    setups = [([t for t in tiers if t != "s3"], None), (["s3"] if "s3" in tiers else [], s3)]
    for measured, endpoint in setups:
        if not measured:
            continue
        got = run_engine(args, model, work, endpoint, lengths, measured, policies, vocab)
        for policy, by_prompt in got.items():
            for key, row in by_prompt.items():
                out[policy].setdefault(key, {}).update(row)
    return out


def run_engine(args: argparse.Namespace, model: Path, work: Path,
               s3: tuple[str, str] | None, lengths: list[int], tiers: list[str],
               policies: list[str], vocab: int
               ) -> dict[str, dict[tuple[int, int], dict[str, Any]]]:
    name = f"auto-{'s3' if s3 else 'file'}"
    store = work / f"store-{name}"
    cfg = engine_yaml(work / f"{name}.yaml", store, s3, f"{name}/", "auto", args.warmup_steps)
    print(f"[{name}] starting vLLM ...", flush=True)
    with LLMWorker(work / f"engine-{name}", model=str(model), kv_cache_gib=2,
                   max_model_len=max(lengths) + 64, enable_prefix_caching=True,
                   kv_transfer_config=kv_transfer_config(cfg)) as engine:
        print(f"[{name}] engine up in {engine.startup_s:.0f} s", flush=True)
        runner = Runner(engine, store, vocab)
        runner.warm_up(args.warmup, max(lengths))
        out: dict[str, dict[tuple[int, int], dict[str, Any]]] = {p: {} for p in policies}
        for n in lengths:
            for rep in range(args.reps):
                rows = runner.measure(tokens(n, seed=n * 100 + rep, vocab=vocab), tiers,
                                      policies, rep)
                for policy, row in rows.items():
                    out[policy][n, rep] = row
        return out


def summarise(results: dict[str, dict[tuple[int, int], dict[str, Any]]],
              lengths: list[int], tiers: list[str]) -> list[dict[str, Any]]:
    """One row per (length, tier): median TTFTs, ratios to the same engine's reference."""
    rows = []
    for n in lengths:
        for tier in tiers:
            row: dict[str, Any] = {"tokens": n, "tier": tier}
            for policy, by_prompt in results.items():
                runs = [r for (length, _), r in by_prompt.items() if length == n]
                ref = statistics.median(r[f"{tier}_ref"] for r in runs)
                ttft = statistics.median(r[tier] for r in runs)
                row[f"{policy}_recompute_s"] = round(ref, 4)
                row[f"{policy}_s"] = round(ttft, 4)
                row[f"{policy}_vs_recompute"] = round(ttft / ref, 3)
                row[f"{policy}_restored"] = [r[f"{tier}_restored"] for r in runs]
                decisions = [r[f"{tier}_decision"] for r in runs if f"{tier}_decision" in r]
                if decisions:
                    row[f"{policy}_decisions"] = decisions
            if "auto" in results and "restore" in results:
                best = min(1.0, row["restore_vs_recompute"])
                row["auto_vs_oracle"] = round(row["auto_vs_recompute"] / best, 3)
            rows.append(row)
    return rows


def table(rows: list[dict[str, Any]], policies: list[str]) -> str:
    head = f"{'tokens':>7} {'tier':<5} {'recompute s':>11} " + " ".join(
        f"{p + ' s':>10} {p + '/rec':>11}" for p in policies)
    if "auto_vs_oracle" in rows[0]:
        head += f" {'auto/oracle':>11}"
    lines = [head]
    for r in rows:
        ref = r[f"{policies[0]}_recompute_s"]
        cells = f"{r['tokens']:>7} {r['tier']:<5} {ref:>11.3f} " + " ".join(
            f"{r[p + '_s']:>10.3f} {r[p + '_vs_recompute']:>10.2f}x" for p in policies)
        if "auto_vs_oracle" in r:
            cells += f" {r['auto_vs_oracle']:>10.2f}x"
        lines.append(cells)
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], policies: list[str], tiers: list[str], out: Path) -> bool:
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)")
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(tiers), figsize=(4.5 * len(tiers), 4), squeeze=False)
    for ax, tier in zip(axes[0], tiers, strict=True):
        mine = [r for r in rows if r["tier"] == tier]
        xs = [r["tokens"] for r in mine]
        ax.plot(xs, [r[f"{policies[0]}_recompute_s"] for r in mine], marker="o",
                label="recompute (reference)", color="gray")
        for p in policies:
            ax.plot(xs, [r[f"{p}_s"] for r in mine], marker="o", label=p)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"stored prefix in {tier}")
        ax.set_xlabel("prompt tokens")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel("TTFT (s)")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    return True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--smoke", action="store_true",
                    help="tiny model, 2 prompts, host+file")
    ap.add_argument("--model", default=None, help="model path (default: build the preset)")
    ap.add_argument("--preset", choices=["bench90m", "tiny"], default="bench90m")
    ap.add_argument("--lengths", default="512,1024,2048,4096")
    ap.add_argument("--tiers", default="host,file,s3")
    ap.add_argument("--policies", default="restore,auto")
    ap.add_argument("--reps", type=int, default=1, help="prompts per length (medians kept)")
    ap.add_argument("--warmup", type=int, default=32, help="warm-up prefills (auto engine)")
    ap.add_argument("--warmup-steps", type=int, default=20, help="restore.auto_warmup_steps")
    ap.add_argument("--s3-endpoint", default=None, help="default: start a local moto server")
    ap.add_argument("--out-dir", default=str(RESULTS))
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--cache-dir", default=str(Path.home() / ".cache" / "kvtier-models"))
    args = ap.parse_args(argv)
    if args.smoke:
        args.preset, args.lengths, args.tiers, args.warmup = "tiny", "512,1024", "host,file", 4
    lengths = [int(x) for x in args.lengths.split(",")]
    tiers = [t for t in TIERS if t in args.tiers.split(",")]
    policies = [p for p in ("restore", "auto") if p in args.policies.split(",")]
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    results: dict[str, dict[tuple[int, int], dict[str, Any]]] = {}
    with ExitStack() as stack:
        work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvth-",
                                                                    dir=args.workdir)))
        model = preset_model(args.preset, args.cache_dir, model=args.model)
        vocab = int(json.loads((model / "config.json").read_text())["vocab_size"])
        s3 = None
        if "s3" in tiers:
            from kvtier.testing.s3server import dummy_credentials, moto_server

            if args.s3_endpoint is None:
                stack.enter_context(dummy_credentials())
            endpoint = args.s3_endpoint or stack.enter_context(moto_server())
            import boto3

            boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(
                Bucket="kvtier-threshold")
            s3 = (endpoint, "kvtier-threshold")
        results = run_policies(args, model, work, s3, lengths, tiers, policies, vocab)
    rows = summarise(results, lengths, tiers)
    report = {"benchmark": "threshold", "model": str(model), "preset": args.preset,
              "lengths": lengths, "tiers": tiers, "policies": policies, "reps": args.reps,
              "warmup": args.warmup, "machine": describe(), "rows": rows,
              "raw": {p: [{"tokens": n, "rep": rep, **r} for (n, rep), r in by.items()]
                      for p, by in results.items()},
              "wall_s": round(time.perf_counter() - t_start, 1)}
    (out / "threshold.json").write_text(json.dumps(report, indent=2) + "\n")
    print(table(rows, policies))
    if plot(rows, policies, tiers, out / "threshold.png"):
        print(f"wrote {out / 'threshold.json'} and {out / 'threshold.png'}")
    else:
        print(f"wrote {out / 'threshold.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
