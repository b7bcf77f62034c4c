"""Block gather/scatter bandwidth against one contiguous copy of the same bytes.

For each block size (bytes per block per layer) the script gathers N random,
non-adjacent blocks of L layers into a chunk and scatters them back, with the native ops
(each CUDA strategy on --device cuda) and the torch reference, and copies the same
number of bytes as one contiguous tensor (torch ``copy_``: memcpy on the CPU, one
pinned-memory cudaMemcpy on CUDA). Every buffer is touched before timing, the first
repetition is dropped, the median of the rest is reported.

    python benchmarks/copy_blocks.py                # CPU: benchmarks/results/copy_cpu.json
    python benchmarks/copy_blocks.py --device cuda  # benchmarks/results/copy_cuda.json
    python benchmarks/copy_blocks.py --quick --out /tmp/x.json  # seconds: a smoke test

Targets: CPU native >= 0.8x contiguous memcpy for blocks >= 64 KiB and >= 2x the torch
reference for small blocks; CUDA native >= 0.85x the pinned cudaMemcpy.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse
import json
import platform
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from kvtier.ops import CopyBackend, KVLayout, native_status, resolve_copy_backend

KIB = 1024
SIZES = [16 * KIB, 64 * KIB, 256 * KIB, 2048 * KIB]
QUICK_SIZES = [16 * KIB, 256 * KIB]
LAYERS = 32  # a typical decoder; the reference pays its per-layer overhead 32 times


def machine(device: str) -> dict[str, Any]:
    info: dict[str, Any] = {
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "loadavg_1m_before": round(os.getloadavg()[0], 2),  # others' work on a shared host
    }
    try:
        with open("/proc/meminfo") as f:
            info["mem_total_gib"] = round(int(f.readline().split()[1]) / 2**20, 1)
        with open("/proc/cpuinfo") as f:
            info["cpu"] = next((ln.split(":", 1)[1].strip() for ln in f
                                if ln.startswith("model name")), None)
    except OSError:
        pass
    status = native_status()
    info["native"] = status.detail
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name()
        info["cuda"] = torch.version.cuda
    return info


def timed(fns: dict[str, Callable[[], None]], reps: int,
          sync: Callable[[], None]) -> dict[str, float]:
    """Median seconds of each function over ``reps`` runs after one dropped warm-up run.

    The functions take turns (round robin), so load from other processes on a shared
    machine hits every method alike and the ratios stay meaningful.
    """
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(reps + 1):
        for name, fn in fns.items():
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t[1:]) for name, t in times.items()}


def backends(device: str) -> dict[str, CopyBackend]:
    out = {"torch": resolve_copy_backend("torch")}
    if native_status().available:
        if device == "cuda":
            for s in ("memcpy", "kernel"):
                out[f"native-{s}"] = resolve_copy_backend("native", cuda_strategy=s)
        else:
            out["native"] = resolve_copy_backend("native")
    return out


def run_size(block: int, total: int, device: str, reps: int) -> dict[str, Any]:
    n = max(1, total // (LAYERS * block))
    nb = 2 * n
    layout = KVLayout((nb, block), (0, 1), 0, torch.uint8)
    caches = [torch.randint(0, 256, (nb, block), dtype=torch.uint8, device=device)
              for _ in range(LAYERS)]
    views = [layout.block_view(c) for c in caches]
    ids = torch.tensor(random.Random(block).sample(range(0, nb, 2), n), dtype=torch.int64)
    nbytes = layout.chunk_bytes(LAYERS, n)
    host = resolve_copy_backend("torch").alloc_pinned(nbytes).tensor
    contig = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    cuda = device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def to_chunk() -> None:
        host.copy_(contig, non_blocking=cuda)

    def from_chunk() -> None:
        contig.copy_(host, non_blocking=cuda)

    def gather_with(be: CopyBackend) -> Callable[[], None]:
        return lambda: be.gather(views, ids, host).wait()

    def scatter_with(be: CopyBackend) -> Callable[[], None]:
        return lambda: be.scatter(host, views, ids).wait()

    fns: dict[str, Callable[[], None]] = {"contig gather": to_chunk, "contig scatter": from_chunk}
    names = backends(device)
    for name, be in names.items():
        fns[f"{name} gather"] = gather_with(be)
        fns[f"{name} scatter"] = scatter_with(be)
    secs = timed(fns, reps, sync)
    gbps = {k: nbytes / v / 1e9 for k, v in secs.items()}
    return {
        "block_bytes": block, "blocks": n, "layers": LAYERS, "bytes": nbytes,
        "contiguous_gbps": {d: gbps[f"contig {d}"] for d in ("gather", "scatter")},
        "gbps": {name: {d: gbps[f"{name} {d}"] for d in ("gather", "scatter")}
                 for name in names},
    }


def verdict(rows: list[dict[str, Any]], device: str) -> dict[str, Any]:
    checks: dict[str, Any] = {}
    for row in rows:
        kib = row["block_bytes"] // KIB
        for name, g in row["gbps"].items():
            if not name.startswith("native"):
                continue
            for d in ("gather", "scatter"):
                vs_copy = g[d] / row["contiguous_gbps"][d]
                vs_torch = g[d] / row["gbps"]["torch"][d]
                if device == "cuda":
                    checks[f"{name} {d} {kib}KiB >= 0.85x memcpy"] = vs_copy >= 0.85
                elif kib >= 64:
                    checks[f"{d} {kib}KiB >= 0.8x memcpy"] = vs_copy >= 0.8
                else:
                    checks[f"{d} {kib}KiB >= 2x torch"] = vs_torch >= 2.0
    out: dict[str, Any] = {"checks": checks, "met": all(checks.values()) if checks else None}
    if device == "cuda" and "native-memcpy" in rows[0]["gbps"]:
        # The strategy with the higher geometric-mean bandwidth over the block sizes.
        out["recommended_default"] = {
            d: max(("memcpy", "kernel"), key=lambda s: statistics.geometric_mean(
                r["gbps"][f"native-{s}"][d] for r in rows))
            for d in ("gather", "scatter")
        }
    return out


def print_table(rows: list[dict[str, Any]]) -> None:
    names = list(rows[0]["gbps"])
    for d in ("gather", "scatter"):
        head = f"{d:8s} {'block':>8s} {'blocks':>7s} {'contig':>8s}"
        head += "".join(f" {n:>14s}" for n in names)
        head += "".join(f" {n + '/copy':>18s} {n + '/torch':>18s}" for n in names
                        if n != "torch")
        print(head)
        for r in rows:
            c = r["contiguous_gbps"][d]
            line = f"{'':8s} {r['block_bytes'] // KIB:>6d}K {r['blocks']:>7d} {c:>8.2f}"
            line += "".join(f" {r['gbps'][n][d]:>14.2f}" for n in names)
            for n in names:
                if n != "torch":
                    g = r["gbps"][n][d]
                    line += f" {g / c:>18.2f} {g / r['gbps']['torch'][d]:>18.2f}"
            print(line)
        print()
    print("GB/s = 1e9 bytes/s; contig = one contiguous copy_ of the same bytes")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--quick", action="store_true", help="small sizes, few reps (smoke test)")
    p.add_argument("--reps", type=int, default=None, help="timed repetitions (default 7)")
    p.add_argument("--total-mib", type=int, default=None,
                   help="bytes per copy in MiB (default 64 on cpu, 256 on cuda)")
    p.add_argument("--out", type=Path, default=None, help="JSON results path")
    a = p.parse_args(argv)
    if a.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device")
    reps = a.reps or (3 if a.quick else 7)
    total = (a.total_mib or (4 if a.quick else 64 if a.device == "cpu" else 256)) * 2**20
    sizes = QUICK_SIZES if a.quick else SIZES
    info = machine(a.device)  # before the runs: the load average is other processes'
    rows = [run_size(b, total, a.device, reps) for b in sizes]
    print_table(rows)
    result = {"machine": info, "device": a.device, "reps": reps,
              "quick": a.quick, "results": rows, "targets": verdict(rows, a.device)}
    for name, ok in result["targets"]["checks"].items():
        print(f"{'PASS' if ok else 'MISS'}  {name}")
    if "recommended_default" in result["targets"]:
        print(f"DEFAULT_CUDA_STRATEGY should be {result['targets']['recommended_default']}")
    out = a.out or Path(__file__).parent / "results" / f"copy_{a.device}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=2) + "\n")
    os.replace(tmp, out)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
