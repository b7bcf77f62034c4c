"""Tiers of many objects: how fast a file (or S3) tier serves after it opens, how long its
index takes to fill, what the index costs per object, lookup and insert latency, and the
cost of one collection tick and of a full pass of the walk.

Objects are empty ``.kv`` files (or empty S3 objects) under the tier's layout, created
directly (not through ``put``): the index, the scan and the walk never read payloads.

    python -m benchmarks.scale --sizes 100000 1000000 [--root /tmp/kvscale] [--s3 2000]

Each size builds its tree, measures, and removes it.
"""

from __future__ import annotations

import argparse
import os
import secrets
import shutil
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from kvtier.keys import ChunkKey
from kvtier.tiers.objtier import ObjectTier


def _pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * len(xs)))]


def make_tree(root: Path, n: int) -> list[ChunkKey]:
    """``n`` empty object files with random keys under ``root/kv``."""
    keys = [ChunkKey(secrets.token_bytes(16)) for _ in range(n)]
    made: set[str] = set()
    for key in keys:
        h = key.hex()
        d = root / "kv" / h[0:2] / h[2:4]
        if str(d) not in made:
            d.mkdir(parents=True, exist_ok=True)
            made.add(str(d))
        os.close(os.open(d / f"{h}.kv", os.O_CREAT | os.O_WRONLY, 0o600))
    return keys


def measure(open_tier: Callable[[], ObjectTier], keys: list[ChunkKey]) -> dict[str, float]:
    probe = keys[len(keys) // 2]
    t0 = time.perf_counter()
    tier = open_tier()
    opened = time.perf_counter() - t0
    served = tier.contains_prefix([probe]) == 1  # the index or, before it is full, the store
    first = time.perf_counter() - t0
    assert served, "the probe key was not found"
    tier.wait_indexed()
    ready = time.perf_counter() - t0
    assert len(tier.index) == len(keys), (len(tier.index), len(keys))
    sample = [keys[i] for i in range(0, len(keys), max(1, len(keys) // 20000))]
    lookups = []
    for key in sample:
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
    tier.expire(1e12)  # one tick (tick_objects listed objects); nothing is that old
    tick = time.perf_counter() - s
    s = time.perf_counter()
    tier.rescan()  # a whole pass
    full = time.perf_counter() - s
    out = {
        "objects": len(keys), "open_s": opened, "first_request_s": first,
        "index_ready_s": ready, "index_bytes_per_object": tier.index.nbytes() / len(keys),
        "lookup_p50_us": 1e6 * statistics.median(lookups),
        "lookup_p99_us": 1e6 * _pct(lookups, 0.99),
        "insert_p50_us": 1e6 * statistics.median(inserts),
        "insert_p99_us": 1e6 * _pct(inserts, 0.99),
        "tick_s": tick, "full_pass_s": full,
    }
    tier.close()
    return out


def run_file(root: Path, n: int) -> dict[str, float]:
    from kvtier.tiers.file import FileTier

    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    t0 = time.perf_counter()
    keys = make_tree(root, n)
    built = time.perf_counter() - t0
    try:
        out = measure(lambda: FileTier(root, 1 << 50, background_index=True), keys)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return {**out, "build_s": built}


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
            for key in keys:
                h = key.hex()
                raw.put_object(Bucket="scale", Key=f"kv/{h[0:2]}/{h}.kv", Body=b"")
            return measure(lambda: S3Tier(bucket="scale", endpoint_url=url,
                                          capacity_bytes=1 << 50, background_index=True,
                                          conditionals="untrusted"), keys)
        finally:
            server.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--sizes", type=int, nargs="*", default=[100_000, 1_000_000])
    p.add_argument("--root", type=Path, default=Path("/tmp/kvscale"))
    p.add_argument("--s3", type=int, default=0, help="objects on a local moto endpoint")
    args = p.parse_args()
    rows = [("file", run_file(args.root, n)) for n in args.sizes]
    if args.s3:
        rows.append(("s3 (moto)", run_s3(args.s3)))
    cols = ["objects", "build_s", "open_s", "first_request_s", "index_ready_s",
            "index_bytes_per_object", "lookup_p50_us", "lookup_p99_us", "insert_p50_us",
            "insert_p99_us", "tick_s", "full_pass_s"]
    print("| tier | " + " | ".join(cols) + " |")
    print("|---" * (len(cols) + 1) + "|")
    for kind, r in rows:
        print(f"| {kind} | " + " | ".join(
            f"{r[c]:.0f}" if c == "objects" else f"{r.get(c, float('nan')):.3g}"
            for c in cols) + " |")


if __name__ == "__main__":
    main()
