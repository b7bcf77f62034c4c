"""Move ``--total`` bytes in chunk-sized objects through each tier, against the raw limit
of the same path measured in the same run on the same data.

* host put/get     vs numpy copy of the same chunks (memcpy)
* file write       vs plain write + fsync + rename of the same bytes
* file cold read   vs plain open + readinto, both after posix_fadvise(DONTNEED)
* s3 put/get       vs raw boto3 put_object / get_object against the same endpoint (moto)
* cephfs write     the file rows on a CephFS ``ceph-fuse`` mount ("node 1")
* cephfs cold read read through a second ``ceph-fuse`` mount ("node 2") right after node 1
                   rewrote every object (untimed): new inodes that node 2 never cached.
                   ``posix_fadvise`` drops only the kernel's page cache, not ceph-fuse's
                   own object cache, so a re-read on node 1 would not be cold. The raw
                   side's rewrite publishes like kvtier (``link``, then ``unlink`` of the
                   temp name): on node 2, a file node 1 published with ``rename`` read
                   at 0.02-0.2 GB/s here against 0.35-0.39 for ``link`` + ``unlink``, a
                   difference of the publishing step, not of the read.
* rgw put/get      the s3 rows against Ceph's RADOS Gateway (a real S3 server)

``cephfs`` and ``rgw`` start one throwaway single-node Ceph cluster (``kvtier.testing.ceph``,
memstore OSD: data in RAM) and move ``--ceph-total`` bytes, since RGW reclaims deleted
objects only after 60 s. Every row names the server it ran against.

Buffers are pre-touched; each measurement is repeated ``--reps`` times, the first dropped,
the median kept. Prints GB/s and the ratio to the raw limit; writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import subprocess
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

TARGETS = {"host": 0.8, "file": 0.8, "s3": 0.9, "sealed": 0.85}
TIERS = ("host", "file", "s3", "sealed", "cephfs", "rgw")
#: Leaves room in the memstore OSD for RGW's deleted-but-not-yet-reclaimed objects.
CEPH_MEMSTORE_BYTES = 6 << 30


def _meta(key: ChunkKey, n: int) -> ChunkMeta:
    return ChunkMeta(bytes(16), key, None, 0, "uint8", (n,), n)


def _nothing(side: str) -> None:
    del side


def _paired(
    raw: Callable[[], None],
    ours: Callable[[], None],
    reps: int,
    nbytes: int,
    before: Callable[[str], None] = _nothing,
) -> tuple[float, float]:
    """Median GB/s of (ours, raw), alternating the two so drift hits both alike.

    ``before(side)`` (side: "raw" or "ours") runs untimed ahead of every measurement
    (e.g. dropping the page cache). The first repetition of each is dropped.
    """
    rates: dict[str, list[float]] = {"raw": [], "ours": []}
    for _ in range(reps + 1):
        for name, fn in (("raw", raw), ("ours", ours)):
            before(name)
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
        self.n = count  # chunks moved by the rows being measured (see ``limit``)
        self.rows: list[dict[str, Any]] = []

    def limit(self, nbytes: int) -> None:
        """Measure the following rows on the first ``nbytes`` (whole chunks, at least one)."""
        self.n = max(1, min(self.count, nbytes // self.chunk))

    @property
    def nbytes(self) -> int:
        return self.n * self.chunk

    def _put_all(self, tier: Any) -> Callable[[], None]:
        """Store every source chunk in ``tier`` (after deleting the previous repetition's)."""

        def put() -> None:
            tier.delete(self.keys[: self.n])
            for k, s in zip(self.keys[: self.n], self.src[: self.n], strict=True):
                tier.put(_meta(k, self.chunk), s.data)

        return put

    def _get_all(self, tier: Any) -> Callable[[], None]:
        """Read every chunk back from ``tier`` into the pre-touched destinations."""

        def get() -> None:
            for k, d in zip(self.keys[: self.n], self.dst[: self.n], strict=True):
                tier.get_into(k, d.data)

        return get

    def row(self, tier: str, server: str, op: str, kvtier: float, raw: float,
            raw_name: str) -> None:
        """One result: ``tier`` (host, file, s3) on ``server`` (what served the bytes)."""
        ratio, target = round(kvtier / raw, 3), TARGETS[tier]
        self.rows.append({"path": tier, "server": server, "op": op,
                          "kvtier_gbps": round(kvtier, 3), "raw_gbps": round(raw, 3),
                          "raw": raw_name, "ratio": ratio, "target": target,
                          "total_bytes": self.nbytes})
        ok = "ok" if ratio >= target else "MISS"
        label = f"{tier} ({server})"
        print(f"{label:<30} {op:<10} {kvtier:8.2f} {raw:8.2f}  {ratio:5.2f}  "
              f">= {target:.2f} {ok}   (raw: {raw_name})", flush=True)

    def host(self) -> None:
        tier = HostTier(self.nbytes, self.chunk)
        src = self.src[: self.n]
        raw_dst = [np.ones(self.chunk, dtype=np.uint8) for _ in range(self.n)]

        def raw_copy() -> None:
            for s, d in zip(src, raw_dst, strict=True):
                np.copyto(d, s)

        put, get = self._put_all(tier), self._get_all(tier)

        for op, fn in (("put", put), ("get", get)):
            self.row("host", "host memory", op, *_paired(raw_copy, fn, self.reps, self.nbytes),
                     "numpy copy")

    def file(self, where: Path, server: str, reader: Path | None = None) -> None:
        """The file rows under ``where``. With ``reader`` (the same directory seen from a
        second node), cold reads go through ``reader`` right after this node rewrote the
        objects; without it, they follow ``posix_fadvise(DONTNEED)``."""
        tier = FileTier(where / "file", 1 << 50)
        raw_dir = where / "raw"
        raw_dir.mkdir()
        raw_paths = [raw_dir / f"{i}.bin" for i in range(self.n)]
        src = self.src[: self.n]

        def raw_write(publish: Callable[[Path, Path], None] = os.replace) -> None:
            for p, s in zip(raw_paths, src, strict=True):
                tmp = p.with_suffix(".tmp")
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                os.write(fd, s.data)
                os.fsync(fd)
                os.close(fd)
                publish(tmp, p)

        put = self._put_all(tier)
        self.row("file", server, "write", *_paired(raw_write, put, self.reps, self.nbytes),
                 "write+fsync+rename")
        if reader is None:
            read_tier, read_paths = tier, raw_paths
            paths = raw_paths + [tier.path_of(k) for k in self.keys[: self.n]]

            def before(side: str) -> None:
                del side
                _drop_cache(paths)

            how = "readinto after DONTNEED"
        else:
            read_tier = FileTier(reader / "file", 1 << 50)
            read_paths = [reader / "raw" / p.name for p in raw_paths]
            rewrite = {"raw": lambda: raw_write(_link_publish), "ours": put}

            def before(side: str) -> None:
                rewrite[side]()  # node 1 writes new inodes; node 2 has none of them cached

            how = "readinto on node 2 after node 1 rewrote (link-published)"

        def raw_read() -> None:
            for p, d in zip(read_paths, self.dst, strict=False):
                with open(p, "rb", buffering=0) as f:
                    f.readinto(d.data)

        get = self._get_all(read_tier)
        self.row("file", server, "cold read",
                 *_paired(raw_read, get, self.reps, self.nbytes, before), how)

    def sealed(self, where: Path) -> None:
        """Encryption at rest (``kvtier.crypt``, issue 47): the file tier sealing every
        object against the same tier in plaintext, side by side; writes, and reads with the
        page cache warm (the CPU cost a restore pays; a cold read waits for the disk
        either way). Target: at most 15 % slower. Also the cipher alone, GB/s on one core."""
        from kvtier.crypt import ChunkCipher

        cipher = ChunkCipher([secrets.token_bytes(32)])
        plain, sealed = FileTier(where / "plain", 1 << 50), FileTier(where / "sealed", 1 << 50)
        sealed.cipher = cipher
        for op, ref, ours in (("write", self._put_all(plain), self._put_all(sealed)),
                              ("warm read", self._get_all(plain), self._get_all(sealed))):
            self.row("sealed", "local disk", op, *_paired(ref, ours, self.reps, self.nbytes),
                     "the same tier in plaintext")
        meta = _meta(self.keys[0], self.chunk)
        t0 = time.perf_counter()
        for s in self.src[: self.n]:
            ct, seal = cipher.seal(meta, s.data)
        seal_gbps = self.nbytes / (time.perf_counter() - t0) / 1e9
        out = memoryview(bytearray(self.chunk))
        t0 = time.perf_counter()
        for _ in range(self.n):
            cipher.open_into(meta, seal, memoryview(ct), out)
        open_gbps = self.nbytes / (time.perf_counter() - t0) / 1e9
        print(f"{'aes-256-gcm, one core':<30} seal {seal_gbps:.2f} GB/s, open "
              f"{open_gbps:.2f} GB/s", flush=True)
        self.rows.append({"path": "sealed", "server": "cpu", "op": "cipher",
                          "seal_gbps": round(seal_gbps, 3), "open_gbps": round(open_gbps, 3)})
        plain.close()
        sealed.close()

    def s3(self, endpoint: str, server: str) -> None:
        import boto3

        from kvtier.tiers.s3 import S3Tier

        bucket = "bench-" + secrets.token_hex(4)
        client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
        client.create_bucket(Bucket=bucket)
        tier = S3Tier(bucket=bucket, prefix="t/", endpoint_url=endpoint, region="us-east-1",
                      path_style=True, capacity_bytes=1 << 50)
        names = [f"raw/{i}" for i in range(self.n)]
        src = self.src[: self.n]

        def raw_put() -> None:
            for n, s in zip(names, src, strict=True):
                client.put_object(Bucket=bucket, Key=n, Body=s.tobytes())

        def raw_get() -> None:
            for n, d in zip(names, self.dst, strict=False):
                body = client.get_object(Bucket=bucket, Key=n)["Body"].read()
                d[:] = np.frombuffer(body, dtype=np.uint8)

        put, get = self._put_all(tier), self._get_all(tier)
        self.row("s3", server, "put", *_paired(raw_put, put, self.reps, self.nbytes),
                 "boto3 put_object")
        self.row("s3", server, "get", *_paired(raw_get, get, self.reps, self.nbytes),
                 "boto3 get_object")
        tier.close()


def _link_publish(tmp: Path, path: Path) -> None:
    """Publish ``tmp`` as ``path`` the way FileTier does: ``link``, then drop the temp."""
    path.unlink(missing_ok=True)
    os.link(tmp, path)
    tmp.unlink()


def ceph_version() -> str:
    """``16.2.15`` for ``ceph version 16.2.15 (...) pacific (stable)``."""
    out = subprocess.run(["ceph", "--version"], capture_output=True, text=True, check=True)
    return out.stdout.split()[2]


def run_ceph(b: Bench, tiers: set[str], nbytes: int, tmp: Path) -> dict[str, str]:
    """The ``cephfs`` and ``rgw`` rows, on one throwaway cluster; returns its description."""
    from kvtier.testing.ceph import ceph_cluster
    from kvtier.testing.s3server import dummy_credentials

    version = ceph_version()
    major_minor = ".".join(version.split(".")[:2])
    b.limit(nbytes)
    with ceph_cluster(tmp / "ceph", memstore_bytes=CEPH_MEMSTORE_BYTES) as cluster:
        if "cephfs" in tiers:
            node1, node2 = cluster.mount("node1"), cluster.mount("node2")
            (node1 / "bench").mkdir()
            b.file(node1 / "bench", f"CephFS {major_minor} ceph-fuse", reader=node2 / "bench")
        if "rgw" in tiers:
            with dummy_credentials():
                b.s3(cluster.s3_endpoint, f"Ceph RGW {major_minor}")
    return {"ceph": version, "osd": "memstore (RAM), 1 OSD, pool size 1, 127.0.0.1",
            "cephfs_client": "ceph-fuse, two mounts (node1 writes, node2 reads cold)",
            "rgw_frontend": "beast"}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--total", default="1GiB", help="bytes moved per measurement")
    ap.add_argument("--ceph-total", default="256MiB",
                    help="bytes moved per measurement by the cephfs and rgw rows")
    ap.add_argument("--chunk", default="4MiB", help="object size")
    ap.add_argument("--reps", type=int, default=3, help="repetitions kept (one more is dropped)")
    ap.add_argument("--tiers", default="host,file,s3,sealed",
                    help=f"subset of {','.join(TIERS)}")
    ap.add_argument("--s3-endpoint", default=None, help="default: start a local moto server")
    ap.add_argument("--workdir", default=None, help="directory for the file tier (default: tmp)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "tiers.json"))
    args = ap.parse_args(argv)
    chunk, total = parse_size(args.chunk), parse_size(args.total)
    tiers = set(args.tiers.split(","))
    if unknown := tiers - set(TIERS):
        ap.error(f"--tiers: unknown {', '.join(sorted(unknown))}; choose from {', '.join(TIERS)}")
    print(f"{'path':<30} {'op':<10} {'kvtier':>8} {'raw':>8}  ratio  target   (GB/s)")
    servers: dict[str, str] = {}
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        b = Bench(chunk, max(1, total // chunk), args.reps, Path(tmp))
        if "host" in tiers:
            b.host()
        if "file" in tiers:
            (Path(tmp) / "local").mkdir()
            b.file(Path(tmp) / "local", "local disk")
        if "sealed" in tiers:
            (Path(tmp) / "sealed").mkdir()
            b.sealed(Path(tmp) / "sealed")
        if "s3" in tiers:
            if args.s3_endpoint:
                b.s3(args.s3_endpoint, args.s3_endpoint)
            else:
                from kvtier.testing.s3server import dummy_credentials, moto_server

                with dummy_credentials(), moto_server() as endpoint:
                    b.s3(endpoint, "moto")
        if tiers & {"cephfs", "rgw"}:
            servers = run_ceph(b, tiers, parse_size(args.ceph_total), Path(tmp))
    out = {"benchmark": "tiers", "chunk_bytes": chunk, "total_bytes": b.total,
           "reps": args.reps, "machine": describe(), "servers": servers, "rows": b.rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
