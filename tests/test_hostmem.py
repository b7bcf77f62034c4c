"""kvtier.hostmem is a leaf, and the ops and host-pool modules import in any order."""

from __future__ import annotations

import json
import mmap
import subprocess
import sys

import numpy as np
import pytest

from kvtier import hostmem


def _modules_after(*imports: str) -> list[str]:
    """The kvtier modules (and whether torch) a fresh interpreter has after ``imports``."""
    code = "".join(f"import {m}\n" for m in imports) + (
        "import json, sys\n"
        "print(json.dumps(sorted(m for m in sys.modules"
        " if m == 'torch' or m.split('.')[0] == 'kvtier')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                         text=True, timeout=120)
    return list(json.loads(out.stdout))


def test_hostmem_imports_nothing_of_kvtier_but_sizes_and_not_torch() -> None:
    assert _modules_after("kvtier.hostmem") == ["kvtier", "kvtier.hostmem", "kvtier.sizes"]


@pytest.mark.parametrize("order", [
    ("kvtier.ops", "kvtier.tiers.pool"),
    ("kvtier.tiers.pool", "kvtier.ops"),
    ("kvtier.ops.backend",),
    ("kvtier.vllm.shm",),
], ids=" then ".join)
def test_ops_and_the_host_pool_import_in_any_order(order: tuple[str, ...]) -> None:
    loaded = _modules_after(*order)
    assert set(order) <= set(loaded) and "kvtier.hostmem" in loaded


def test_ops_do_not_import_the_host_tier() -> None:
    """The old cycle: ops.backend took ``mem_available`` from ``kvtier.tiers.pool``."""
    loaded = _modules_after("kvtier.ops")
    assert not any(m.startswith("kvtier.tiers") for m in loaded), loaded


def test_anonymous_memory_is_page_aligned_and_writable() -> None:
    buf = hostmem.anonymous(3 * mmap.PAGESIZE + 1)
    arr = np.frombuffer(buf, dtype=np.uint8)
    assert arr.ctypes.data % mmap.PAGESIZE == 0 and arr.nbytes == 3 * mmap.PAGESIZE + 1
    arr[:] = 5
    assert int(arr.sum()) == 5 * arr.nbytes
    with pytest.raises(ValueError, match="must be > 0"):
        hostmem.anonymous(0)


def test_mem_available_reads_meminfo() -> None:
    avail = hostmem.mem_available()
    assert avail is None or avail > 0


def test_old_import_paths_still_work() -> None:
    from kvtier.ops.reference import register_pinned
    from kvtier.tiers.pool import PINNED_UNAVAILABLE, mem_available, mmap_allocator

    assert register_pinned is hostmem.register_pinned
    assert mem_available is hostmem.mem_available
    assert mmap_allocator is hostmem.mmap_allocator
    assert PINNED_UNAVAILABLE is hostmem.PINNED_UNAVAILABLE
