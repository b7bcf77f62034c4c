"""What a shared tier's index costs the router process (issue 33 item 5).

The router opens the lower tiers with their ``CompactIndex`` (``kvtier.router.storage.
RouterTiers``). This fills one index with ``N`` random 16-byte keys the way a start scan
does (``add_scanned`` in batches, then ``finish_scan``) and prints the process's RSS
growth, bytes per object and the peak RSS (``VmHWM``: a growing slab or table is copied).

    python -m benchmarks.router_index 1000000 3000000

Run each size in a fresh process (the peak is per process). Linux only (``/proc``).
"""

from __future__ import annotations

import gc
import os
import sys
import time

from kvtier.keys import ChunkKey
from kvtier.tiers.compact import CompactIndex

BATCH = 100_000


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM"):
                return int(line.split()[1]) * 1024
    return 0


def measure(n: int) -> str:
    gc.collect()
    base = rss()
    t0 = time.perf_counter()
    index = CompactIndex()
    for lo in range(0, n, BATCH):
        index.add_scanned((ChunkKey(os.urandom(16)), 1 << 20, 1.7e9 + i)
                          for i in range(lo, min(n, lo + BATCH)))
    index.finish_scan()
    gc.collect()
    grown = rss() - base
    return (f"objects={len(index)} rss_growth={grown / 2**20:.1f}MiB "
            f"per_object={grown / n:.1f}B peak_rss={peak_rss() / 2**20:.1f}MiB "
            f"build={time.perf_counter() - t0:.1f}s")


def main(argv: list[str]) -> None:
    if len(argv) == 1:
        print(measure(int(argv[0])))
        return
    import subprocess

    for n in argv or ["1000000"]:
        subprocess.run([sys.executable, "-m", "benchmarks.router_index", n], check=True)


if __name__ == "__main__":
    main(sys.argv[1:])
