"""Tiers of many objects: how fast a file (or S3) tier serves after it opens, how long its
index takes to fill, what the index costs per object, lookup and insert latency (and the
longest a lookup waits while the index fills), and the cost of one collection tick and of
a full pass of the walk.

Objects are empty ``.kv`` files (or empty S3 objects) under the tier's layout, with random
keys, created directly (not through ``put``; ``kvtier.testing.fill`` says how and how
fast): the index, the scan and the walk never read payloads.

    python -m benchmarks.scale --sizes 100000 1000000 [--root /tmp/kvscale]
        [--cephfs 100000 1000000] [--s3 2000] [--out benchmarks/results/scale.json]

Each size builds its tree, measures, and removes it (a CephFS tree goes with its
throwaway cluster).
"""

from __future__ import annotations

import argparse
import json
import math
import secrets
import shutil
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.machine import describe
from kvtier.keys import ChunkKey
from kvtier.testing.fill import fill_file_tier
from kvtier.tiers.objtier import DEFAULT_TICK, ObjectTier

SAMPLE = 20_000  # keys kept for lookups (the rest exist only as files)


def _pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * len(xs)))]


class LookupWatch:
    """Asks the tier's index (``indexed``, what vLLM's scheduler thread asks) every
    millisecond on a thread of its own while the index fills; records each wait."""

    def __init__(self, tier: ObjectTier, key: ChunkKey) -> None:
        self.waits: list[float] = []
        self._tier, self._key = tier, key
        self._thread = threading.Thread(target=self._run, name="lookup-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._tier.index_ready:
            s = time.perf_counter()
            self._tier.indexed(self._key)
            self.waits.append(time.perf_counter() - s)
            time.sleep(0.001)  # a benchmark's pace, not a test's clock

    def join(self) -> None:
        self._thread.join()


def measure(open_tier: Callable[[], ObjectTier], n: int, keys: list[ChunkKey]
            ) -> dict[str, float]:
    probe = keys[len(keys) // 2]
    t0 = time.perf_counter()
    tier = open_tier()
    opened = time.perf_counter() - t0
    served = tier.contains_prefix([probe]) == 1  # the index or, before it is full, the store
    first = time.perf_counter() - t0
    assert served, "the probe key was not found"
    watch = LookupWatch(tier, probe)
    tier.wait_indexed()
    ready = time.perf_counter() - t0
    watch.join()
    assert len(tier.index) == n, (len(tier.index), n)
    lookups = []
    for key in keys:
        s = time.perf_counter()
        tier.indexed(key)
        lookups.append(time.perf_counter() - s)
    inserts = []
    for _ in range(20000):
        key = ChunkKey(secrets.token_bytes(16))
        s = time.perf_counter()
        tier.index.remember(key, 1, 1.0)
        inserts.append(time.perf_counter() - s)
        tier.index.forget(key)
    s = time.perf_counter()
    tier.expire(1e12)  # one tick (DEFAULT_TICK: 1 s or 20,000 objects); nothing that old
    tick = time.perf_counter() - s
    s = time.perf_counter()
    tier.rescan()  # a whole pass
    full = time.perf_counter() - s
    waits = watch.waits or [0.0]
    out = {
        "objects": n, "open_s": opened, "first_request_s": first,
        "index_ready_s": ready, "index_bytes_per_object": tier.index.nbytes() / n,
        "lookup_p50_us": 1e6 * statistics.median(lookups),
        "lookup_p99_us": 1e6 * _pct(lookups, 0.99),
        "lookup_during_scan_p99_us": 1e6 * _pct(waits, 0.99),
        "lookup_during_scan_max_ms": 1e3 * max(waits),
        "lookups_during_scan": len(watch.waits),
        "insert_p50_us": 1e6 * statistics.median(inserts),
        "insert_p99_us": 1e6 * _pct(inserts, 0.99),
        "tick_s": tick, "full_pass_s": full,
        # A pass of default ticks: each lists at most 20,000 objects and about 1 s.
        "ticks_per_pass": max(math.ceil(n / DEFAULT_TICK.objects),
                              math.ceil(full / DEFAULT_TICK.seconds)),
    }
    tier.close()
    return out


def run_file(root: Path, n: int, *, remove: bool = True) -> dict[str, float]:
    from kvtier.tiers.file import FileTier

    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    filled = fill_file_tier(root, n, sample=SAMPLE, progress=lambda done, s: print(
        f"  {done} files, {done / s:.0f}/s", flush=True))
    print(f"  {n} files in {filled.seconds:.1f} s ({filled.per_second:.0f}/s)", flush=True)
    try:
        out = measure(lambda: FileTier(root, 1 << 50, background_index=True), n,
                      filled.sample)
    finally:
        if remove:
            t0 = time.perf_counter()
            shutil.rmtree(root, ignore_errors=True)
            print(f"  removed in {time.perf_counter() - t0:.1f} s", flush=True)
    return {**out, "build_s": filled.seconds, "created_per_s": filled.per_second}


def run_cephfs(sizes: list[int], tmp: Path) -> list[dict[str, float]]:
    """Each size on a fresh throwaway cluster (its tree goes with it), one ceph-fuse mount."""
    from kvtier.testing.ceph import ceph_cluster

    rows = []
    for n in sizes:
        with ceph_cluster(tmp / f"ceph-{n}", memstore_bytes=6 << 30) as cluster:
            mnt = cluster.mount("node1")
            rows.append(run_file(mnt / "kvscale", n, remove=False))
    return rows


def run_s3(n: int) -> dict[str, float]:
    import boto3

    from kvtier.testing.s3server import MotoServer, dummy_credentials
    from kvtier.tiers.s3 import S3Tier

    with dummy_credentials():
        server = MotoServer()
        url = server.start()
        try:
            raw = boto3.client("s3", endpoint_url=url, region_name="us-east-1")
            raw.create_bucket(Bucket="scale")
            keys = [ChunkKey(secrets.token_bytes(16)) for _ in range(n)]
            t0 = time.perf_counter()
            for key in keys:
                h = key.hex()
                raw.put_object(Bucket="scale", Key=f"kv/{h[0:2]}/{h}.kv", Body=b"")
            built = time.perf_counter() - t0
            out = measure(lambda: S3Tier(bucket="scale", endpoint_url=url,
                                         capacity_bytes=1 << 50, background_index=True,
                                         conditionals="untrusted"), n, keys)
            return {**out, "build_s": built, "created_per_s": n / built}
        finally:
            server.stop()


COLS = ["objects", "build_s", "open_s", "first_request_s", "index_ready_s",
        "index_bytes_per_object", "lookup_p50_us", "lookup_p99_us",
        "lookup_during_scan_p99_us", "lookup_during_scan_max_ms", "insert_p50_us",
        "insert_p99_us", "tick_s", "full_pass_s", "ticks_per_pass"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--sizes", type=int, nargs="*", default=[100_000, 1_000_000])
    p.add_argument("--root", type=Path, default=Path("/tmp/kvscale"))
    p.add_argument("--cephfs", type=int, nargs="*", default=[],
                   help="sizes on a throwaway CephFS (ceph-fuse)")
    p.add_argument("--s3", type=int, default=0, help="objects on a local moto endpoint")
    p.add_argument("--out", type=Path, default=None, help="append the rows (JSON lines)")
    args = p.parse_args()
    rows: list[tuple[str, dict[str, float]]] = []
    for n in args.sizes:
        print(f"file (local disk), {n} objects", flush=True)
        rows.append(("file (local disk)", run_file(args.root, n)))
    if args.cephfs:
        print(f"cephfs, {args.cephfs} objects", flush=True)
        rows += [("cephfs (ceph-fuse)", r) for r in run_cephfs(args.cephfs, args.root)]
    if args.s3:
        print(f"s3 (moto), {args.s3} objects", flush=True)
        rows.append(("s3 (moto)", run_s3(args.s3)))
    if args.out is not None:
        machine: dict[str, Any] = describe()
        with args.out.open("a") as f:
            for kind, r in rows:
                f.write(json.dumps({"tier": kind, **r, "machine": machine,
                                    "when": time.strftime("%Y-%m-%d %H:%M")}) + "\n")
    print("| tier | " + " | ".join(COLS) + " |")
    print("|---" * (len(COLS) + 1) + "|")
    for kind, r in rows:
        print(f"| {kind} | " + " | ".join(
            f"{r[c]:.0f}" if c == "objects" else f"{r.get(c, float('nan')):.3g}"
            for c in COLS) + " |")


if __name__ == "__main__":
    main()
