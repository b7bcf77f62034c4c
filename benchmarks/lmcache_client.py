"""LMCache's own multi-round QA client against an ideal engine and kvtier with small host pools.

This is the check of issue 36 as a user runs it: LMCache's client, unmodified
(``benchmarks/multi_round_qa/multi-round-qa.py`` and its ``utils.py`` from LMCache's
repository; pass their directory as ``--client-dir``), sends chat completions through the
OpenAI SDK, concurrently, users joining over time (``--qps``). It is not part of kvtier and
is not vendored here: fetch it from LMCache's repository. It needs ``openai`` and ``pandas``
in the interpreter given as ``--client-python``.

Servers, one after the other, the same model (``--preset``'s):

* ``ideal``: vLLM alone, a KV cache of ``--ideal-blocks`` blocks that holds every
  conversation;
* ``host=<size>`` for each ``--host-capacities`` entry: vLLM with ``--small-blocks`` blocks
  and kvtier configured by ``configs/local.yaml`` as shipped, except the host pool's
  capacity and the file tier's directory (a fresh temporary one), so returns come from the
  host pool or, when it is too small, from the file tier.
* ``host=<size>+s3`` for each ``--s3-capacities`` entry: the same, with the file tier
  replaced by an S3 tier (``configs/s3.yaml``'s settings) on a throwaway Ceph cluster's
  RGW (``kvtier.testing.ceph``; ``make ceph`` installs it), so returns that miss the host
  pool come from S3.

Reported per server, from the client's CSV: the median and p90 TTFT of returning rounds
(``question_id >= 2``) and their ratios to the ideal's; from ``/metrics``: the prompt tokens
vLLM computed and those kvtier restored (vLLM's ``prompt_tokens_by_source``), kvtier's drops,
and the mean time a restore spent in each stage (``kvtier_restore_stage_seconds``).
Targets (issue 36): at 48 MiB median <= 1.2x and p90 <= 1.5x; at 16 MiB median <= 1.5x.
Files: ``lmcache_client.json`` (summary + machine) and ``.md`` (the table).

Example::

    .venv/bin/python benchmarks/lmcache_client.py \\
        --client-dir ~/LMCache/benchmarks/multi_round_qa \\
        --client-python /path/to/venv-with-openai-and-pandas/bin/python
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import csv
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.machine import describe
from benchmarks.multiround_qa import DROP_REASONS, metric, stage_means
from kvtier.testing.models import preset_model
from kvtier.testing.servers import APIServer, split_cpus
from kvtier.vllm.settings import kv_transfer_config

RESULTS = Path(__file__).resolve().parent / "results"
LOCAL_YAML = Path(__file__).resolve().parent.parent / "configs" / "local.yaml"
S3_YAML = LOCAL_YAML.with_name("s3.yaml")
S3_BUCKET = "kvtier-lmcc"
TARGETS = {"48MiB": (1.2, 1.5), "16MiB": (1.5, None)}


def local_config(path: Path, store: Path, host_capacity: str) -> Path:
    """``configs/local.yaml`` with the host pool's capacity and the file tier's path
    replaced; everything else as shipped."""
    cfg = yaml.safe_load(LOCAL_YAML.read_text())
    for tier in cfg["tiers"]:
        if "host" in tier:
            tier["host"]["capacity"] = host_capacity
        if "file" in tier:
            tier["file"]["path"] = str(store)
    path.write_text(yaml.safe_dump(cfg))
    return path


def s3_config(path: Path, host_capacity: str, endpoint: str, prefix: str) -> Path:
    """``configs/local.yaml``'s settings with the host pool's capacity replaced and the
    file tier replaced by ``configs/s3.yaml``'s S3 tier at ``endpoint`` (bucket
    ``S3_BUCKET``, its own ``prefix``, path-style addressing as self-hosted endpoints
    need)."""
    cfg = yaml.safe_load(LOCAL_YAML.read_text())
    s3 = next(t["s3"] for t in yaml.safe_load(S3_YAML.read_text())["tiers"] if "s3" in t)
    s3.update(bucket=S3_BUCKET, prefix=prefix, endpoint_url=endpoint, path_style=True,
              capacity="20GiB")
    tiers = []
    for tier in cfg["tiers"]:
        if "host" in tier:
            tier["host"]["capacity"] = host_capacity
            tiers.append(tier)
    cfg["tiers"] = [*tiers, {"s3": s3}]
    path.write_text(yaml.safe_dump(cfg))
    return path


@contextlib.contextmanager
def rgw(work: Path) -> Iterator[str]:
    """A throwaway Ceph cluster's RGW endpoint with ``S3_BUCKET`` created; the test
    credentials are in ``os.environ`` (the servers inherit them) while it runs."""
    import boto3

    from kvtier.testing.ceph import ceph_cluster
    from kvtier.testing.s3server import dummy_credentials

    with dummy_credentials(), ceph_cluster(work / "ceph") as cluster:
        client = boto3.client("s3", endpoint_url=cluster.s3_endpoint, region_name="us-east-1")
        client.create_bucket(Bucket=S3_BUCKET)
        client.close()
        yield cluster.s3_endpoint


def run_client(args: argparse.Namespace, url: str, out_csv: Path,
               log: Path) -> list[dict[str, str]]:
    """LMCache's client against ``url`` for ``--time`` seconds; its CSV rows."""
    cmd = [args.client_python, "multi-round-qa.py",
           "--num-users", str(args.users), "--shared-system-prompt", str(args.system_tokens),
           "--user-history-prompt", str(args.history_tokens),
           "--answer-len", str(args.answer_len), "--num-rounds", str(args.rounds),
           "--qps", str(args.qps), "--model", "model", "--base-url", url + "/v1",
           "--time", str(args.time), "--output", str(out_csv)]
    with log.open("w") as f:
        subprocess.run(cmd, cwd=args.client_dir, stdout=f, stderr=subprocess.STDOUT,
                       check=True, timeout=args.time + 900)
    with out_csv.open() as f:
        return list(csv.DictReader(f))


def make_server(name: str, args: argparse.Namespace, model: Path, tmp: Path,
                cpus: str | None = None) -> APIServer:
    """``ideal`` or ``host=<size>``'s server (not started)."""
    kvt = None
    blocks = args.ideal_blocks
    if name.endswith("+s3"):
        host = name.split("=", 1)[1].removesuffix("+s3")
        kvt = kv_transfer_config(s3_config(tmp / f"{host}-s3.yaml", host, args.s3_endpoint,
                                           f"lmcc-{host}/"))
        blocks = args.small_blocks
    elif name != "ideal":
        host = name.split("=", 1)[1]
        kvt = kv_transfer_config(local_config(tmp / f"{host}.yaml", tmp / f"store-{host}", host))
        blocks = args.small_blocks
    return APIServer(tmp / name.replace("=", "-"), model=model, name=name.replace("=", "-"),
                     dtype=args.dtype, max_model_len=args.max_model_len,
                     kv_transfer_config=kvt, num_gpu_blocks_override=blocks, cpus=cpus)


def safe(name: str) -> str:
    """A server's name as a file name."""
    return name.replace("=", "-").replace("+", "-")


def run_server(name: str, args: argparse.Namespace, model: Path, tmp: Path) -> dict[str, Any]:
    with make_server(name, args, model, tmp) as server:
        return measure(name, args, server, tmp)


def measure(name: str, args: argparse.Namespace, server: APIServer,
            tmp: Path) -> dict[str, Any]:
    """Run the client against a started ``server``; its summary."""
    blocks = args.ideal_blocks if name == "ideal" else args.small_blocks
    rows = run_client(args, server.url, tmp / f"{name}.csv", tmp / f"{name}.client.log")
    time.sleep(1.0)
    text = httpx.get(server.url + "/metrics", timeout=30).text
    back = [float(r["ttft"]) for r in rows if int(r["question_id"]) >= 2]
    if not back:
        raise RuntimeError(f"{name}: no returning round finished in {args.time} s; "
                           f"see {tmp / (name + '.client.log')} (--keep-dir keeps it)")
    first = [float(r["ttft"]) for r in rows if int(r["question_id"]) == 1]
    return {
        "gpu_blocks": blocks,
        "requests": len(rows),
        "returning": len(back),
        "returning_median_s": statistics.median(back),
        "returning_p90_s": (statistics.quantiles(back, n=10)[-1] if len(back) > 1
                            else max(back)),
        "returning_max_s": max(back),
        "round1_median_s": statistics.median(first) if first else None,
        "prompt_tokens": sum(int(float(r["prompt_tokens"])) for r in rows),
        "computed_tokens": metric(text, "vllm:prompt_tokens_by_source_total",
                                  source="local_compute"),
        "restored_tokens": metric(text, "vllm:prompt_tokens_by_source_total",
                                  source="external_kv_transfer"),
        "gpu_hit_tokens": metric(text, "vllm:prompt_tokens_by_source_total",
                                 source="local_cache_hit"),
        "drops": {r: metric(text, "kvtier_drops_total", reason=r) for r in DROP_REASONS},
        "restore_stage_ms": stage_means(text),
    }


def run_parallel(names: list[str], args: argparse.Namespace, model: Path,
                 tmp: Path) -> dict[str, dict[str, Any]]:
    """Every server at once, each bound to its own cores (``split_cpus``), and one client
    per server at once: on a shared machine, whatever else loads it loads every server
    alike, so the ratios compare."""
    servers = [make_server(n, args, model, tmp, cpus)
               for n, cpus in zip(names, split_cpus(len(names)), strict=True)]
    with contextlib.ExitStack() as stack:
        for server in servers:
            stack.enter_context(server)
        with concurrent.futures.ThreadPoolExecutor(len(servers)) as pool:
            futs = {n: pool.submit(measure, n, args, s, tmp)
                    for n, s in zip(names, servers, strict=True)}
            out = {n: f.result() for n, f in futs.items()}
    for n, s in out.items():
        print(n, json.dumps(s), flush=True)
    return out


def table(summary: dict[str, dict[str, Any]]) -> str:
    lines = ["| server | GPU blocks | returning median | ÷ ideal | returning p90 | ÷ ideal "
             "| max | tokens restored | tokens computed | drops |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for name, s in summary.items():
        drops = ", ".join(f"{k} {int(v)}" for k, v in s["drops"].items() if v) or "0"
        lines.append(
            f"| {name} | {s['gpu_blocks']} | {s['returning_median_s']:.3f} s "
            f"| {s.get('median_ratio', 1.0):.2f}x | {s['returning_p90_s']:.3f} s "
            f"| {s.get('p90_ratio', 1.0):.2f}x | {s['returning_max_s']:.2f} s "
            f"| {int(s['restored_tokens']):,} | {int(s['computed_tokens']):,} | {drops} |")
    return "\n".join(lines)


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--client-dir", required=True,
                    help="LMCache's benchmarks/multi_round_qa directory")
    ap.add_argument("--client-python", default=sys.executable,
                    help="an interpreter with openai and pandas")
    ap.add_argument("--preset", default="bench90m")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--users", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--system-tokens", type=int, default=100)
    ap.add_argument("--history-tokens", type=int, default=1400)
    ap.add_argument("--answer-len", type=int, default=16)
    ap.add_argument("--qps", type=float, default=0.5)
    ap.add_argument("--time", type=int, default=180, help="seconds each client runs")
    ap.add_argument("--small-blocks", type=int, default=48)
    ap.add_argument("--ideal-blocks", type=int, default=600)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--host-capacities", default="2GiB,48MiB,16MiB")
    ap.add_argument("--s3-capacities", default="",
                    help="host pool sizes to run with an S3 tier (Ceph RGW) below instead of "
                         "the file tier, e.g. 48MiB")
    ap.add_argument("--runs", default=None, help="comma list of servers (default: all)")
    ap.add_argument("--parallel", action="store_true",
                    help="run the servers at once, each on its own cores (a shared machine)")
    ap.add_argument("--out-dir", default=str(RESULTS))
    ap.add_argument("--keep-dir", default=None,
                    help="run here and keep servers' and client's logs (default: a temp dir)")
    ap.add_argument("--cache-dir", default=str(Path.home() / ".cache" / "kvtier-models"))
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if not (Path(args.client_dir) / "multi-round-qa.py").is_file():
        print(f"--client-dir {args.client_dir}: no multi-round-qa.py there; get LMCache's "
              "benchmarks/multi_round_qa directory", file=sys.stderr)
        return 2
    model = preset_model(args.preset, Path(args.cache_dir))
    names = (["ideal"] + [f"host={c}" for c in args.host_capacities.split(",") if c]
             + [f"host={c}+s3" for c in args.s3_capacities.split(",") if c])
    if args.runs:
        names = [n for n in names if n in args.runs.split(",")]
    summary: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="kvt-lmcc-") as d, contextlib.ExitStack() as stack:
        work = Path(args.keep_dir) if args.keep_dir else Path(d)
        work.mkdir(parents=True, exist_ok=True)
        args.s3_endpoint = (stack.enter_context(rgw(work)) if any(
            n.endswith("+s3") for n in names) else "")
        if args.parallel:
            summary = run_parallel(names, args, model, work)
        else:
            for name in names:
                summary[name] = run_server(name, args, model, work)
                print(name, json.dumps(summary[name]), flush=True)
    ideal = summary.get("ideal")
    if ideal:
        for s in summary.values():
            s["median_ratio"] = s["returning_median_s"] / ideal["returning_median_s"]
            s["p90_ratio"] = s["returning_p90_s"] / ideal["returning_p90_s"]
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    params = {k: v for k, v in vars(args).items() if k not in ("out_dir", "cache_dir")}
    (out / "lmcache_client.json").write_text(json.dumps(
        {"params": params, "machine": describe(), "summary": summary}, indent=2))
    text = table(summary)
    (out / "lmcache_client.md").write_text(text + "\n")
    print(text)
    for name, s in summary.items():
        host = name.split("=", 1)[-1].removesuffix("+s3")
        if ideal and host in TARGETS:
            med, p90 = TARGETS[host]
            ok = s["median_ratio"] <= med and (p90 is None or s["p90_ratio"] <= p90)
            print(f"{name}: target median <= {med}x" + (f", p90 <= {p90}x" if p90 else "")
                  + f": {'met' if ok else 'MISSED'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
