"""Restore-vs-recompute ladder (seed 004, appendix A.1), on a real vLLM engine.

For each prompt of a deterministic ladder of growing lengths (token ids from a fixed,
seeded generator), measured in one engine, in this order:

1. ``cold``      first prefill: nothing cached anywhere (TTFT = one-token generate)
2. ``vllm_hit``  the same prompt again: vLLM's own prefix-cache hit, the floor
3. ``host``      vLLM's prefix cache reset; kvtier restores from its host pool
4. ``file``      kvtier's host tier dropped too, page cache dropped (posix_fadvise):
                 kvtier restores from the file tier, cold
5. ``cephfs``    host dropped: restore from the file tier on CephFS (``ceph-fuse``), read
                 cold through a second mount ("node 2"), never the one that wrote
6. ``s3``        host dropped: restore from S3 (local moto)
7. ``rgw``       host dropped: restore from S3 on Ceph's RADOS Gateway

Each lower tier asked for (file, cephfs, s3, rgw) gets an engine of its own, with that
tier as the only one below host, written through: the store reads a chunk from the tier
its index names and never asks another, so a tier emptied behind the engine's back would
be a miss, not a restore from the next tier. Steps 1-3 run in every engine; each lower
tier's ratio is to the cold prefill of its own engine. The JSONL row holds the first
engine's ``cold``/``vllm_hit``/``host`` and, per lower tier ``p``, ``p`` and
``p_cold``/``p_vllm_hit``/``p_host`` from its engine.

``cephfs`` and ``rgw`` share one throwaway single-node Ceph cluster
(``kvtier.testing.ceph``: memstore OSD, i.e. data in RAM). The CephFS tier's path is a
symlink to a directory on mount ``node1``; for the cold read it is repointed at the same
directory on mount ``node2``. ``posix_fadvise`` would drop only the kernel's page cache,
not ceph-fuse's own object cache, so node 2, which never read these objects, is the cold
read; the symlink goes back to node 1 before the next prompt.

Writes ``<out>/<name>.jsonl`` (one line per prompt), a table with the ratio of each path
to cold prefill, and ``<name>.png`` (TTFT vs length), ``<name>`` being ``--name``
(default ``restore_vs_recompute``). Defaults fit a 2-core CPU: the ~90M random-weight
Llama (bf16), lengths 1K-8K.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.machine import describe
from kvtier.testing.engines import CompletionResult, LLMWorker, tokens
from kvtier.testing.models import preset_model
from kvtier.vllm.settings import kv_transfer_config

PATHS = ("cold", "vllm_hit", "host", "file", "cephfs", "s3", "rgw")
LOWER = ("file", "cephfs", "s3", "rgw")  # the chain below host, in order
RESULTS = Path(__file__).resolve().parent / "results"
LABELS = {"cold": "cold prefill (recompute)", "vllm_hit": "vLLM prefix-cache hit (floor)",
          "host": "kvtier restore: host", "file": "kvtier restore: file (local disk, cold)",
          "cephfs": "kvtier restore: file (CephFS ceph-fuse, cold, node 2)",
          "s3": "kvtier restore: S3 (local moto)", "rgw": "kvtier restore: S3 (Ceph RGW)"}


def drop_page_cache(root: Path) -> None:
    for p in root.rglob("*.kv"):
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def point(link: Path, target: Path) -> None:
    """Atomically make ``link`` a symlink to ``target``."""
    tmp = link.with_name(link.name + ".new")
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(target)
    os.replace(tmp, link)


def _nothing() -> None:
    pass


@dataclass(frozen=True)
class Lower:
    """The one tier below host in an engine: its config entry, what makes its next read
    cold (untimed, after the host tier is dropped) and what runs before each prompt."""

    path: str  # one of LOWER
    tier: dict[str, Any]
    make_cold: Callable[[], None] = _nothing
    before_prompt: Callable[[], None] = _nothing


BUCKET = "kvtier-ladder"


def restored(r: CompletionResult) -> dict[str, int]:
    params: dict[str, Any] = r.kv_transfer_params or {}
    return dict(params.get("kvtier", {}).get("restored_by_tier", {}))


def _s3(endpoint: str, prefix: str) -> dict[str, Any]:
    return {"s3": {"bucket": BUCKET, "prefix": prefix, "endpoint_url": endpoint,
                   "region": "us-east-1", "path_style": True, "capacity": "20GiB",
                   "write": "through", "part_size": "64MiB", "multipart_threshold": "256MiB"}}


def tier_yaml(path: Path, lower: Lower | None) -> Path:
    tiers: list[dict[str, Any]] = [{"host": {"capacity": "2GiB"}}]
    if lower is not None:
        tiers.append(lower.tier)
    path.write_text(json.dumps({"chunk_tokens": 256, "tiers": tiers,
                                # resets leave the prompt on the lower tiers only
                                "reset_cache": "host"}))
    return path


def measure(engine: LLMWorker, prompt: list[int], lower: Lower | None) -> dict[str, Any]:
    row: dict[str, Any] = {"tokens": len(prompt)}

    def run(name: str, reset: bool) -> None:
        t0 = time.perf_counter()
        r = engine.generate([prompt], max_tokens=1, reset_prefix_cache=reset).outputs[0]
        row[name] = time.perf_counter() - t0
        row[f"{name}_restored"] = restored(r)
        row[f"{name}_cached"] = r.num_cached_tokens

    def reset_all() -> None:
        engine.reset_until_done()  # "not yet" while saves or host writes are in flight

    if lower is not None:
        lower.before_prompt()
    run("cold", False)
    run("vllm_hit", False)
    run("host", True)
    if lower is not None:
        reset_all()
        lower.make_cold()
        run(lower.path, True)
    return row


def table(rows: list[dict[str, Any]], paths: list[str]) -> str:
    head = f"{'tokens':>7} {'cold s':>8} " + " ".join(f"{p + ' s':>10}" for p in paths[1:])
    head += "   " + " ".join(f"{'cold/' + p:>11}" for p in paths[2:])
    lines = [head]
    for r in rows:
        cells = f"{r['tokens']:>7} {r['cold']:>8.2f} "
        cells += " ".join(f"{r[p]:>10.3f}" for p in paths[1:])
        cells += "   " + " ".join(f"{r.get(p + '_cold', r['cold']) / r[p]:>10.1f}x"
                                 for p in paths[2:])
        lines.append(cells)
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], paths: list[str], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    xs = [r["tokens"] for r in rows]
    for p in paths:
        ax.plot(xs, [r[p] for r in rows], marker="o", label=LABELS[p])
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("TTFT (s)")
    ax.set_title("Restore vs recompute")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def start_servers(stack: ExitStack, work: Path, paths: list[str],
                  s3_endpoint: str | None) -> tuple[list[Lower], dict[str, str]]:
    """Start what the lower tiers in ``paths`` need (moto, one Ceph cluster) and describe
    each lower tier; S3 credentials go into the environment, which engines inherit."""
    import boto3

    from kvtier.testing.s3server import dummy_credentials

    servers: dict[str, str] = {}
    lowers: list[Lower] = []
    if "file" in paths:
        store = work / "store"
        lowers.append(Lower("file", {"file": {"path": str(store), "capacity": "20GiB",
                                              "write": "through"}},
                            make_cold=lambda: drop_page_cache(store)))
    endpoints: list[str] = []
    if {"s3", "rgw"} & set(paths):
        stack.enter_context(dummy_credentials())
    if "s3" in paths:
        from kvtier.testing.s3server import moto_server

        endpoint = s3_endpoint or stack.enter_context(moto_server())
        servers["s3"] = s3_endpoint or "moto (local)"
        endpoints.append(endpoint)
        lowers.append(Lower("s3", _s3(endpoint, "ladder-s3/")))
    if {"cephfs", "rgw"} & set(paths):
        from benchmarks.tiers import CEPH_MEMSTORE_BYTES, ceph_version
        from kvtier.testing.ceph import ceph_cluster

        cluster = stack.enter_context(
            ceph_cluster(work / "ceph", memstore_bytes=CEPH_MEMSTORE_BYTES))
        servers["ceph"] = f"Ceph {ceph_version()}, memstore OSD (RAM), 127.0.0.1"
        if "cephfs" in paths:
            node1, node2 = cluster.mount("node1"), cluster.mount("node2")
            (node1 / "ladder").mkdir()
            link = work / "cephfs-tier"
            point(link, node1 / "ladder")
            lowers.append(Lower(
                "cephfs", {"file": {"path": str(link), "capacity": "20GiB", "write": "through"}},
                make_cold=lambda: point(link, node2 / "ladder"),  # node 2 reads, cold
                before_prompt=lambda: point(link, node1 / "ladder")))  # node 1 writes
            servers["cephfs"] = "ceph-fuse: node1 writes, node2 reads cold"
        if "rgw" in paths:
            servers["rgw"] = "radosgw (beast)"
            endpoints.append(cluster.s3_endpoint)
            lowers.append(Lower("rgw", _s3(cluster.s3_endpoint, "ladder-rgw/")))
    for endpoint in endpoints:
        boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(
            Bucket=BUCKET)
    order = {p: i for i, p in enumerate(LOWER)}
    return sorted(lowers, key=lambda lt: order[lt.path]), servers


def ladder(work: Path, model: Path, lengths: list[int],
           lower: Lower | None, tp: int = 1) -> list[dict[str, Any]]:
    """One engine with host and ``lower`` below it; one row per prompt length. ``tp``
    ranks (``tensor_parallel_size``), each bound to its own core."""
    name = "host" if lower is None else lower.path
    cfg = tier_yaml(work / f"kvtier-{name}.yaml", lower)
    print(f"model {model}; starting vLLM with host + {name} ...", flush=True)
    par: dict[str, Any] = {}
    if tp > 1:
        par = {"tensor_parallel_size": tp,
               "extra_env": {"VLLM_CPU_OMP_THREADS_BIND": "|".join(map(str, range(tp)))}}
    with LLMWorker(work / f"engine-{name}", model=str(model), max_model_len=max(lengths) + 64,
                   enable_prefix_caching=True, kv_cache_gib=2,
                   kv_transfer_config=kv_transfer_config(cfg), **par) as engine:
        print(f"engine up in {engine.startup_s:.0f} s", flush=True)
        engine.generate([tokens(300, seed=1)], max_tokens=1)  # warm-up, not measured
        vocab = int(json.loads((model / "config.json").read_text())["vocab_size"])
        from tqdm import tqdm

        return [measure(engine, tokens(n, seed=n, vocab=vocab), lower)
                for n in tqdm(lengths, desc=f"ladder ({name})", unit="prompt")]


def merge(runs: list[list[dict[str, Any]]], lowers: list[Lower]) -> list[dict[str, Any]]:
    """The first engine's cold/vllm_hit/host, plus each lower tier's row from its engine
    (its own cold/vllm_hit/host as ``<tier>_cold`` ...)."""
    rows = []
    for i, first in enumerate(runs[0]):
        row = {k: v for k, v in first.items() if not k.startswith(tuple(LOWER))}
        for lower, run in zip(lowers, runs, strict=True):
            r = run[i]
            for k, v in r.items():
                if k.startswith(lower.path):
                    row[k] = v
                elif k.startswith(("cold", "vllm_hit", "host")):
                    row[f"{lower.path}_{k}"] = v
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=None, help="model path (default: build the preset)")
    ap.add_argument("--preset", choices=["bench90m", "tiny"], default="bench90m")
    ap.add_argument("--lengths", default="1024,2048,4096,8192")
    ap.add_argument("--tiers", default="host,file,s3",
                    help="restore paths to measure: host,file,cephfs,s3,rgw")
    ap.add_argument("--name", default="restore_vs_recompute", help="output file stem")
    ap.add_argument("--s3-endpoint", default=None, help="default: start a local moto server")
    ap.add_argument("--out-dir", default=str(RESULTS))
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--cache-dir", default=str(Path.home() / ".cache" / "kvtier-models"))
    ap.add_argument("--tp", type=int, default=1,
                    help="tensor_parallel_size (one core per rank: VLLM_CPU_OMP_THREADS_BIND)")
    args = ap.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",")]
    asked = set(args.tiers.split(","))
    if unknown := asked - set(PATHS[2:]):
        ap.error(f"--tiers: unknown {', '.join(sorted(unknown))}; choose from "
                 f"{','.join(PATHS[2:])}")
    paths = ["cold", "vllm_hit", *[p for p in PATHS[2:] if p in asked]]
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)

    with ExitStack() as stack:
        tmp = tempfile.TemporaryDirectory(prefix="kvb-", dir=args.workdir)  # short: unix sockets
        work = Path(stack.enter_context(tmp))
        model = preset_model(args.preset, args.cache_dir, model=args.model)
        lowers, servers = start_servers(stack, work, paths, args.s3_endpoint)
        chain: list[Lower | None] = [*lowers] or [None]
        runs = [ladder(work, model, lengths, lower, args.tp) for lower in chain]
    rows = merge(runs, lowers) if lowers else runs[0]
    jsonl = out / f"{args.name}.jsonl"
    with open(jsonl, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    (out / f"{args.name}.machine.json").write_text(json.dumps(
        {"machine": describe(), "model": str(model), "preset": args.preset, "tp": args.tp,
         "servers": servers, "paths": {p: LABELS[p] for p in paths}}, indent=2) + "\n")
    plot(rows, paths, out / f"{args.name}.png")
    print(table(rows, paths))
    last = rows[-1]
    print(f"\nat {last['tokens']} tokens:")
    checks = [("host <= cold/20", "host", last["cold"] / 20),
              ("file <= cold/10", "file", last.get("file_cold", last["cold"]) / 10),
              ("host <= 1.3 x vLLM hit", "host", 1.3 * last["vllm_hit"])]
    for name, p, bound in checks:
        if p in last:
            ok = "ok" if last[p] <= bound else "MISSED"
            print(f"  {name:<24} {last[p]:.3f} s vs {bound:.3f} s  {ok}")
    print(f"wrote {jsonl} and {out / (args.name + '.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
