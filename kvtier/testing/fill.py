"""Fill a file tier's directory with many object files fast (tests and benchmarks).

The files are empty and named like objects (``<root>/kv/<k[0:2]>/<k[2:4]>/<key-hex>.kv``)
with random keys: what a tier's start scan, index and walk see (they never read a
payload). A read of one would be a counted corrupt miss, so they stand in only for the
*number* of objects a tier holds.

Speed (why it looks like this): keys are drawn per top-level directory and created in
name order, each file with one ``mknod(S_IFREG)`` relative to its directory's
descriptor: one system call per file (an empty regular file, as ``open``/``close``
would leave it, without the file descriptor), no path resolved per file, each
directory opened once. On this repository's 2-core machine, busy with other work,
that made 14,600 files a second against 5,300 with ``open``/``close`` and about 4,000
with a path per file.

Directories already there (a live tier) are used as they are; files are never replaced
(``mknod`` fails on a name that exists). Each of the 256 top-level directories gets
``n // 256`` keys (one more for the first ``n % 256``), random within it.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kvtier.keys import ChunkKey
from kvtier.tiers import fsutil

SHARDS = 256


@dataclass(frozen=True)
class Filled:
    objects: int
    seconds: float
    sample: list[ChunkKey]  # about ``sample`` of the keys, spread over every directory

    @property
    def per_second(self) -> float:
        return self.objects / self.seconds if self.seconds > 0 else float("inf")


def fill_file_tier(root: Path, n: int, *, sample: int = 0, mode: int = 0o600,
                   progress: Callable[[int, float], None] | None = None) -> Filled:
    """Create ``n`` empty object files under the file tier rooted at ``root``; keep about
    ``sample`` of their keys. ``progress(created, seconds)`` after every 32 directories."""
    kv = root / "kv"
    kv.mkdir(parents=True, exist_ok=True)
    dir_mode = fsutil.dir_mode(mode)
    kept: list[ChunkKey] = []
    t0 = time.perf_counter()
    top = os.open(kv, os.O_RDONLY | os.O_DIRECTORY)
    created = 0
    try:
        for shard in range(SHARDS):
            m = n // SHARDS + (shard < n % SHARDS)
            raw = secrets.token_bytes(15 * m)
            names = sorted(f"{shard:02x}{raw[i * 15 : (i + 1) * 15].hex()}" for i in range(m))
            if sample and names:
                step = max(1, n // sample)
                kept += [ChunkKey(bytes.fromhex(h)) for h in names[shard % step :: step]]
            _make_shard(top, f"{shard:02x}", names, mode, dir_mode)
            created += m
            if progress is not None and shard % 32 == 31:
                progress(created, time.perf_counter() - t0)
    finally:
        os.close(top)
    return Filled(created, time.perf_counter() - t0, kept)


def _mkdir(name: str, mode: int, top: int) -> None:
    with contextlib.suppress(FileExistsError):
        os.mkdir(name, mode, dir_fd=top)


def _make_shard(top: int, shard: str, names: list[str], mode: int, dir_mode: int) -> None:
    _mkdir(shard, dir_mode, top)
    where, fd = "", -1
    try:
        for h in names:
            if h[:4] != where:
                if fd >= 0:
                    os.close(fd)
                where = h[:4]
                sub = f"{h[:2]}/{h[2:4]}"
                _mkdir(sub, dir_mode, top)
                fd = os.open(sub, os.O_RDONLY | os.O_DIRECTORY, dir_fd=top)
            os.mknod(f"{h}.kv", stat.S_IFREG | mode, dir_fd=fd)
    finally:
        if fd >= 0:
            os.close(fd)
