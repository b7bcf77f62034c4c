"""Move ``--total`` bytes in chunk-sized objects through each tier, against the raw limit
of the same path measured in the same run on the same data.

* host put/get   vs numpy copy of the same chunks (memcpy)
* file write     vs plain write + fsync + rename of the same bytes
* file cold read vs plain open + readinto, both after posix_fadvise(DONTNEED)
* s3 put/get     vs raw boto3 put_object / get_object against the same endpoint

Buffers are pre-touched; each measurement is repeated ``--reps`` times, the first dropped,
the median kept. Prints GB/s and the ratio to the raw limit; writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.machine import describe
from kvtier.keys import ChunkKey
from kvtier.objformat import ChunkMeta
from kvtier.sizes import parse_size
from kvtier.tiers.file import FileTier
from kvtier.tiers.host import HostTier

TARGETS = {"host": 0.8, "file": 0.8, "s3": 0.9}


def _meta(key: ChunkKey, n: int) -> ChunkMeta:
    return ChunkMeta(bytes(16), key, None, 0, "uint8", (n,), n)


def _paired(
    raw: Callable[[], None],
    ours: Callable[[], None],
    reps: int,
    nbytes: int,
    before: Callable[[], None] = lambda: None,
) -> tuple[float, float]:
    """Median GB/s of (ours, raw), alternating the two so drift hits both alike.

    ``before`` runs untimed ahead of every measurement (e.g. dropping the page cache).
    The first repetition of each is dropped.
    """
    rates: dict[str, list[float]] = {"raw": [], "ours": []}
    for _ in range(reps + 1):
        for name, fn in (("raw", raw), ("ours", ours)):
            before()
            t0 = time.perf_counter()
            fn()
            rates[name].append(nbytes / (time.perf_counter() - t0) / 1e9)
    return statistics.median(rates["ours"][1:]), statistics.median(rates["raw"][1:])


def _drop_cache(paths: list[Path]) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


class Bench:
    def __init__(self, chunk: int, count: int, reps: int, workdir: Path) -> None:
        self.chunk, self.count, self.reps, self.workdir = chunk, count, reps, workdir
        rng = np.random.default_rng(0)
        self.src = [rng.integers(0, 256, chunk, dtype=np.uint8) for _ in range(count)]
        self.dst = [np.ones(chunk, dtype=np.uint8) for _ in range(count)]  # pre-touched
        self.keys = [ChunkKey(secrets.token_bytes(16)) for _ in range(count)]
        self.total = chunk * count
        self.rows: list[dict[str, Any]] = []

    def _put_all(self, tier: Any) -> Callable[[], None]:
        """Store every source chunk in ``tier`` (after deleting the previous repetition's)."""

        def put() -> None:
            tier.delete(self.keys)
            for k, s in zip(self.keys, self.src, strict=True):
                tier.put(_meta(k, self.chunk), s.data)

        return put

    def _get_all(self, tier: Any) -> Callable[[], None]:
        """Read every chunk back from ``tier`` into the pre-touched destinations."""

        def get() -> None:
            for k, d in zip(self.keys, self.dst, strict=True):
                tier.get_into(k, d.data)

        return get

    def row(self, path: str, op: str, kvtier: float, raw: float, raw_name: str) -> None:
        tier = path.split()[0]
        ratio, target = round(kvtier / raw, 3), TARGETS[tier]
        self.rows.append({"path": path, "op": op, "kvtier_gbps": round(kvtier, 3),
                          "raw_gbps": round(raw, 3), "raw": raw_name, "ratio": ratio,
                          "target": target})
        ok = "ok" if ratio >= target else "MISS"
        print(f"{path:<6} {op:<10} {kvtier:8.2f} {raw:8.2f}  {ratio:5.2f}  "
              f">= {target:.2f} {ok}   (raw: {raw_name})", flush=True)

    def host(self) -> None:
        tier = HostTier(self.total, self.chunk)
        raw_dst = [np.ones(self.chunk, dtype=np.uint8) for _ in range(self.count)]

        def raw_copy() -> None:
            for s, d in zip(self.src, raw_dst, strict=True):
                np.copyto(d, s)

        put, get = self._put_all(tier), self._get_all(tier)

        self.row("host", "put", *_paired(raw_copy, put, self.reps, self.total), "numpy copy")
        self.row("host", "get", *_paired(raw_copy, get, self.reps, self.total), "numpy copy")

    def file(self) -> None:
        root = self.workdir / "file"
        tier = FileTier(root, 1 << 50)
        raw_dir = self.workdir / "raw"
        raw_dir.mkdir()
        raw_paths = [raw_dir / f"{i}.bin" for i in range(self.count)]

        def raw_write() -> None:
            for p, s in zip(raw_paths, self.src, strict=True):
                tmp = p.with_suffix(".tmp")
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                os.write(fd, s.data)
                os.fsync(fd)
                os.close(fd)
                os.replace(tmp, p)

        put = self._put_all(tier)

        def raw_read() -> None:
            for p, d in zip(raw_paths, self.dst, strict=True):
                with open(p, "rb", buffering=0) as f:
                    f.readinto(d.data)

        get = self._get_all(tier)

        self.row("file", "write", *_paired(raw_write, put, self.reps, self.total),
                 "write+fsync+rename")
        paths = raw_paths + [tier.path_of(k) for k in self.keys]
        self.row("file", "cold read",
                 *_paired(raw_read, get, self.reps, self.total, lambda: _drop_cache(paths)),
                 "readinto after DONTNEED")

    def s3(self, endpoint: str) -> None:
        import boto3

        from kvtier.tiers.s3 import S3Tier

        bucket = "bench-" + secrets.token_hex(4)
        client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
        client.create_bucket(Bucket=bucket)
        tier = S3Tier(bucket=bucket, prefix="t/", endpoint_url=endpoint, region="us-east-1",
                      path_style=True, capacity_bytes=1 << 50)
        names = [f"raw/{i}" for i in range(self.count)]

        def raw_put() -> None:
            for n, s in zip(names, self.src, strict=True):
                client.put_object(Bucket=bucket, Key=n, Body=s.tobytes())

        def raw_get() -> None:
            for n, d in zip(names, self.dst, strict=True):
                body = client.get_object(Bucket=bucket, Key=n)["Body"].read()
                d[:] = np.frombuffer(body, dtype=np.uint8)

        put, get = self._put_all(tier), self._get_all(tier)

        self.row("s3", "put", *_paired(raw_put, put, self.reps, self.total), "boto3 put_object")
        self.row("s3", "get", *_paired(raw_get, get, self.reps, self.total), "boto3 get_object")
        tier.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--total", default="1GiB", help="bytes moved per measurement")
    ap.add_argument("--chunk", default="4MiB", help="object size")
    ap.add_argument("--reps", type=int, default=3, help="repetitions kept (one more is dropped)")
    ap.add_argument("--tiers", default="host,file,s3")
    ap.add_argument("--s3-endpoint", default=None, help="default: start a local moto server")
    ap.add_argument("--workdir", default=None, help="directory for the file tier (default: tmp)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "tiers.json"))
    args = ap.parse_args(argv)
    chunk, total = parse_size(args.chunk), parse_size(args.total)
    tiers = set(args.tiers.split(","))
    print(f"{'path':<6} {'op':<10} {'kvtier':>8} {'raw':>8}  ratio  target   (GB/s)")
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        b = Bench(chunk, max(1, total // chunk), args.reps, Path(tmp))
        if "host" in tiers:
            b.host()
        if "file" in tiers:
            b.file()
        if "s3" in tiers:
            if args.s3_endpoint:
                b.s3(args.s3_endpoint)
            else:
                from kvtier.testing.s3server import dummy_credentials, moto_server

                with dummy_credentials(), moto_server() as endpoint:
                    b.s3(endpoint)
    out = {"benchmark": "tiers", "chunk_bytes": chunk, "total_bytes": b.total,
           "reps": args.reps, "machine": describe(), "rows": b.rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
