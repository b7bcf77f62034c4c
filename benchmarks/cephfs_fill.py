"""Fill a file tier's directory on CephFS with many empty object files, through libcephfs
directly (benchmarks; ``benchmarks.scale --cephfs`` runs it).

Why a script of its own: creating files through a ``ceph-fuse`` mount costs a FUSE round
trip and an MDS round trip per file, a few hundred files a second on this machine; the
libcephfs client of Debian's ``python3-cephfs`` (``make ceph`` installs it) talks to the
MDS directly and, since its calls release the GIL, from several threads at once. The
bindings exist for the system Python only, so this runs as ``/usr/bin/python3
benchmarks/cephfs_fill.py`` and uses the standard library and ``cephfs`` alone (no
kvtier, no virtualenv).

The layout and the keys are ``kvtier.testing.fill``'s: each of the 256 top-level
directories gets ``n // 256`` random keys (one more for the first ``n % 256``), created
in name order under ``<root>/kv/<k[0:2]>/<k[2:4]>/<key-hex>.kv``, empty (a read of one
is a counted corrupt miss: they stand in only for the number of objects). Files are
never replaced. Worker threads take top-level directories from one counter.

Output: progress lines on stderr; on stdout one JSON object ``{"objects", "seconds",
"sample"}`` (``sample``: about ``--sample`` of the keys as hex, spread over every
directory).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import stat
import sys
import threading
import time
from typing import Any

import cephfs

SHARDS = 256


class Filler:
    def __init__(self, fs: Any, root: str, n: int, sample: int, mode: int) -> None:
        self.fs, self.root, self.n, self.mode = fs, root, n, mode
        self.dir_mode = mode | ((mode & 0o444) >> 2)  # x where r is set, as kvtier does
        self.step = max(1, n // sample) if sample else 0
        self.lock = threading.Lock()
        self.next_shard = 0
        self.created = 0
        self.sample: list[str] = []
        self.fault: BaseException | None = None
        self.t0 = time.perf_counter()

    def mkdir(self, path: str) -> None:
        with contextlib.suppress(cephfs.ObjectExists):
            self.fs.mkdir(path, self.dir_mode)

    def create(self, path: str) -> None:
        if hasattr(self.fs, "mknod"):  # one MDS request, no open file handle
            self.fs.mknod(path, stat.S_IFREG | self.mode)
        else:
            self.fs.close(self.fs.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, self.mode))

    def shard(self, shard: int) -> None:
        m = self.n // SHARDS + (shard < self.n % SHARDS)
        raw = secrets.token_bytes(15 * m)
        names = sorted(f"{shard:02x}{raw[i * 15 : (i + 1) * 15].hex()}" for i in range(m))
        top = f"{self.root}/kv/{shard:02x}"
        self.mkdir(top)
        made: set[str] = set()
        for h in names:
            if h[2:4] not in made:
                self.mkdir(f"{top}/{h[2:4]}")
                made.add(h[2:4])
            self.create(f"{top}/{h[2:4]}/{h}.kv")
        with self.lock:
            if self.step:
                self.sample += names[shard % self.step :: self.step]
            self.created += m
            if shard % 32 == 31:
                s = time.perf_counter() - self.t0
                print(f"  {self.created} files, {self.created / s:.0f}/s", file=sys.stderr,
                      flush=True)

    def work(self) -> None:
        try:
            while True:
                with self.lock:
                    shard = self.next_shard
                    self.next_shard += 1
                    if shard >= SHARDS or self.fault is not None:
                        return
                self.shard(shard)
        except BaseException as e:  # reported by main
            with self.lock:
                self.fault = self.fault or e


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--conf", required=True, help="the cluster's ceph.conf")
    p.add_argument("--id", default="kvtier-fill", help="the client id (auth is off)")
    p.add_argument("--root", required=True, help="the tier's root inside CephFS, e.g. /kvscale")
    p.add_argument("--objects", type=int, required=True)
    p.add_argument("--sample", type=int, default=0)
    p.add_argument("--threads", type=int, default=4)
    p.add_argument("--mode", type=lambda s: int(s, 8), default=0o600)
    args = p.parse_args()
    fs = cephfs.LibCephFS(conffile=args.conf, auth_id=args.id)
    fs.mount()
    try:
        filler = Filler(fs, args.root, args.objects, args.sample, args.mode)
        with contextlib.suppress(cephfs.ObjectExists):
            fs.mkdirs(f"{args.root}/kv", filler.dir_mode)
        threads = [threading.Thread(target=filler.work, name=f"fill-{i}")
                   for i in range(max(1, args.threads))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        fs.sync_fs()
        seconds = time.perf_counter() - filler.t0
        if filler.fault is not None:
            raise filler.fault
    finally:
        fs.unmount()
        fs.shutdown()
    json.dump({"objects": filler.created, "seconds": seconds, "sample": filler.sample},
              sys.stdout)


if __name__ == "__main__":
    main()
