"""Tiers of many objects: how fast a file (or S3) tier serves after it opens, how long its
index takes to fill, what the index costs per object, lookup and insert latency (and the
longest a lookup waits while the index fills), and the cost of one collection tick and of
a full pass of the walk.

Objects are empty ``.kv`` files (or empty S3 objects) under the tier's layout, with random
keys, created directly (not through ``put``; ``kvtier.testing.fill`` says how and how
fast): the index, the scan and the walk never read payloads.

    python -m benchmarks.scale --sizes 100000 1000000 [--root /tmp/kvscale]
        [--cephfs 100000 1000000] [--index-threads 4] [--s3 2000]
        [--out benchmarks/results/scale.jsonl]

Each size builds its tree, measures, and removes it (a CephFS tree goes with its
throwaway cluster). A CephFS tree is created through libcephfs by the system Python
(``benchmarks/cephfs_fill.py``: far faster than file by file through ``ceph-fuse``) and
the tier opens it through a ``ceph-fuse`` mount, as a node would. ``--index-threads``
sets the start scan's threads (``file.index_threads``) on CephFS; a local disk scans
with 1 (the default, and the fastest there).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import secrets
import shutil
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from benchmarks.machine import describe
from kvtier.keys import ChunkKey
from kvtier.testing.fill import Filled, fill_file_tier
from kvtier.tiers.objtier import DEFAULT_TICK, ObjectTier

SAMPLE = 20_000  # keys kept for lookups (the rest exist only as files)
S3_PUT_THREADS = 8


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


def _estimated_pass(tier: ObjectTier, n: int) -> float:
    """A whole pass's seconds from one more default tick's listing rate (a pass too long
    to time: the walk lists with one thread, about 1,000 objects/s through ceph-fuse).
    The benchmark is the tier's only user, so it may tick the walk itself."""
    s = time.perf_counter()
    listed = sum(len(page.objects) for page in tier.walk.tick(DEFAULT_TICK, "estimate"))
    return n / max(1, listed) * (time.perf_counter() - s)


def measure(open_tier: Callable[[], ObjectTier], n: int, keys: list[ChunkKey], *,
            time_pass: bool = True) -> dict[str, float]:
    """``time_pass``: time a whole pass of the walk (else estimate it from one tick)."""
    probe = keys[len(keys) // 2]
    t0 = time.perf_counter()
    tier = open_tier()
    opened = time.perf_counter() - t0
    served = tier.contains_prefix([probe]) == 1  # the index or, before it is full, the store
    first = time.perf_counter() - t0
    assert served, "the probe key was not found"
    watch = LookupWatch(tier, probe)
    while not tier.wait_indexed(30):
        print(f"  index: {tier.metrics.index_scanned} objects in "
              f"{time.perf_counter() - t0:.0f} s", flush=True)
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
    if time_pass:
        s = time.perf_counter()
        tier.rescan()  # a whole pass
        full = time.perf_counter() - s
    else:
        full = _estimated_pass(tier, n)
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
        "tick_s": tick, "full_pass_s": full, "full_pass_estimated": float(not time_pass),
        # A pass of default ticks: each lists at most 20,000 objects and about 1 s.
        "ticks_per_pass": max(math.ceil(n / DEFAULT_TICK.objects),
                              math.ceil(full / DEFAULT_TICK.seconds)),
    }
    tier.close()
    return out


def _progress(done: int, seconds: float) -> None:
    print(f"  {done} files, {done / seconds:.0f}/s", flush=True)


def run_file(root: Path, n: int, *, remove: bool = True, index_threads: int = 1,
             fill: Callable[[Path, int], Filled] | None = None,
             time_pass: bool = True) -> dict[str, float]:
    """Fill ``root`` with ``n`` objects (``fill``; default ``fill_file_tier``), measure a
    tier opened on it, then remove the tree (``remove``)."""
    from kvtier.tiers.file import FileTier

    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    if fill is None:
        filled = fill_file_tier(root, n, sample=SAMPLE, progress=_progress)
    else:
        filled = fill(root, n)
    print(f"  {n} files in {filled.seconds:.1f} s ({filled.per_second:.0f}/s)", flush=True)
    try:
        out = measure(lambda: FileTier(root, 1 << 50, background_index=True,
                                       index_threads=index_threads), n, filled.sample,
                      time_pass=time_pass)
    finally:
        if remove:
            t0 = time.perf_counter()
            shutil.rmtree(root, ignore_errors=True)
            print(f"  removed in {time.perf_counter() - t0:.1f} s", flush=True)
    return {**out, "build_s": filled.seconds, "created_per_s": filled.per_second,
            "index_threads": index_threads}


#: The filler's interpreter: Debian's ``python3-cephfs`` exists for the system Python only.
SYSTEM_PYTHON = "/usr/bin/python3"
CEPHFS_FILL = Path(__file__).with_name("cephfs_fill.py")


def fill_cephfs(conf: Path, inside: str, mounted: Path, n: int) -> Filled:
    """``n`` objects under ``inside`` (a path in CephFS; ``mounted`` where a client sees
    it), created through libcephfs by the system Python (``benchmarks/cephfs_fill.py``)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    done = subprocess.run(
        [SYSTEM_PYTHON, str(CEPHFS_FILL), "--conf", str(conf), "--root", inside,
         "--objects", str(n), "--sample", str(SAMPLE)],
        stdout=subprocess.PIPE, stderr=sys.stderr, env=env, check=True, text=True)
    out = json.loads(done.stdout)
    return Filled(out["objects"], out["seconds"],
                  [ChunkKey(bytes.fromhex(h)) for h in out["sample"]])


def run_cephfs(sizes: list[int], tmp: Path, index_threads: int, pass_max: int
               ) -> list[dict[str, float]]:
    """Each size on a fresh throwaway cluster (its tree goes with it), filled through
    libcephfs, measured through one ``ceph-fuse`` mount; a whole pass is timed up to
    ``pass_max`` objects, estimated above."""
    from kvtier.testing.ceph import ceph_cluster

    rows = []
    for n in sizes:
        with ceph_cluster(tmp / f"ceph-{n}", memstore_bytes=6 << 30) as cluster:
            mnt = cluster.mount("node1")
            fill = functools.partial(fill_cephfs, cluster.conf, "/kvscale")
            rows.append(run_file(mnt / "kvscale", n, remove=False,
                                 index_threads=index_threads, fill=fill,
                                 time_pass=n <= pass_max))
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

            def put(key: ChunkKey) -> None:
                h = key.hex()
                raw.put_object(Bucket="scale", Key=f"kv/{h[0:2]}/{h}.kv", Body=b"")

            t0 = time.perf_counter()
            with ThreadPoolExecutor(S3_PUT_THREADS) as pool:  # boto3 clients are thread-safe
                for done, _ in enumerate(pool.map(put, keys), 1):
                    if done % 5000 == 0:
                        _progress(done, time.perf_counter() - t0)
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
        "insert_p99_us", "tick_s", "full_pass_s", "ticks_per_pass", "index_threads"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--sizes", type=int, nargs="*", default=[100_000, 1_000_000])
    p.add_argument("--root", type=Path, default=Path("/tmp/kvscale"))
    p.add_argument("--cephfs", type=int, nargs="*", default=[],
                   help="sizes on a throwaway CephFS (ceph-fuse)")
    p.add_argument("--index-threads", type=int, default=4,
                   help="start-scan threads on CephFS (file.index_threads)")
    p.add_argument("--time-pass-max", type=int, default=200_000,
                   help="CephFS: time a whole pass up to this many objects, estimate above")
    p.add_argument("--s3", type=int, default=0, help="objects on a local moto endpoint")
    p.add_argument("--out", type=Path, default=None, help="append the rows (JSON lines)")
    args = p.parse_args()
    rows: list[tuple[str, dict[str, float]]] = []
    for n in args.sizes:
        print(f"file (local disk), {n} objects", flush=True)
        rows.append(("file (local disk)", run_file(args.root, n)))
    if args.cephfs:
        print(f"cephfs, {args.cephfs} objects", flush=True)
        cephfs = run_cephfs(args.cephfs, args.root, args.index_threads, args.time_pass_max)
        rows += [("cephfs (ceph-fuse)", r) for r in cephfs]
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
