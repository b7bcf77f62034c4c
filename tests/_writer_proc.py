"""Run as a child process by the fault tests: writes chunks forever, one line per stored key.

Usage: python -m tests._writer_proc ROOT [FSIZE_LIMIT]
"""

from __future__ import annotations

import resource
import signal
import sys

from kvtier.tiers.file import FileTier
from tests.tiers.harness import make_key, meta_for, payload_for


def main() -> None:
    root = sys.argv[1]
    if len(sys.argv) > 2:  # a real per-process file size limit: writes past it fail EFBIG
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        limit = int(sys.argv[2])
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    tier = FileTier(root, 1 << 40)
    i = 0
    while True:
        key = make_key(i)
        status = tier.put(meta_for(key, 256 * 1024), payload_for(key, 256 * 1024).data)
        print(f"{i} {status.value} {tier.metrics.counts.errors}", flush=True)
        i += 1
        if len(sys.argv) > 2 and i >= 8:
            return


if __name__ == "__main__":
    main()
