"""kvtier.hostmem is a leaf, and the ops and host-pool modules import in any order."""

from __future__ import annotations

import json
import mmap
import os
import subprocess
import sys
from pathlib import Path

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


def test_a_shared_file_is_created_new_and_attached_once(tmp_path: Path) -> None:
    path = tmp_path / "pool"
    mm = hostmem.create_shared(path, mmap.PAGESIZE, setting="cap")
    assert path.stat().st_mode & 0o777 == 0o600
    other = hostmem.attach_shared(path, mmap.PAGESIZE)
    mm[:3] = b"abc"
    assert other[:3] == b"abc" and not path.exists()


def test_an_existing_shared_file_is_an_error_that_says_what_to_do(tmp_path: Path) -> None:
    path = tmp_path / "pool"
    path.write_bytes(b"someone else's bytes")
    with pytest.raises(hostmem.SharedFileExists) as err:
        hostmem.create_shared(path, mmap.PAGESIZE, setting="cap")
    msg = str(err.value)
    assert str(path) in msg and "engine_id" in msg and f"rm {path}" in msg
    assert path.read_bytes() == b"someone else's bytes", "neither truncated nor removed"


def test_a_pool_left_by_a_dead_creator_is_replaced_a_live_ones_is_not(
    tmp_path: Path,
) -> None:
    path = tmp_path / "pool"
    path.write_bytes(bytes(mmap.PAGESIZE))  # a pool of this size whose creator is gone
    mm = hostmem.create_shared(path, mmap.PAGESIZE, setting="cap")
    mm[:1] = b"x"
    assert path.read_bytes()[:1] == b"x"  # ours now
    with pytest.raises(hostmem.SharedFileExists):  # its creator (we) holds it: live
        hostmem.create_shared(path, mmap.PAGESIZE, setting="cap")
    hostmem.remove_shared(path)
    assert not path.exists()


def test_a_planted_symlink_is_not_followed_on_create(tmp_path: Path) -> None:
    target = tmp_path / "victim"
    target.write_bytes(b"keep me")
    link = tmp_path / "pool"
    link.symlink_to(target)
    with pytest.raises(hostmem.SharedFileExists, match="symbolic link"):
        hostmem.create_shared(link, mmap.PAGESIZE, setting="cap")
    assert target.read_bytes() == b"keep me" and link.is_symlink()
    dangling = tmp_path / "pool2"
    dangling.symlink_to(tmp_path / "would-be-created")
    with pytest.raises(hostmem.SharedFileExists):
        hostmem.create_shared(dangling, mmap.PAGESIZE, setting="cap")
    assert not (tmp_path / "would-be-created").exists()


def test_a_planted_symlink_is_not_followed_on_attach(tmp_path: Path) -> None:
    real = tmp_path / "real"
    hostmem.create_shared(real, mmap.PAGESIZE, setting="cap")
    link = tmp_path / "pool"
    link.symlink_to(real)
    with pytest.raises(hostmem.HostMemoryError, match="symbolic link"):
        hostmem.attach_shared(link, mmap.PAGESIZE)
    assert real.exists() and link.is_symlink()


def test_attach_maps_only_a_regular_file(tmp_path: Path) -> None:
    fifo = tmp_path / "pool"
    os.mkfifo(fifo)
    with pytest.raises(hostmem.HostMemoryError, match="not a regular file"):
        hostmem.attach_shared(fifo, mmap.PAGESIZE)
    assert fifo.exists()
