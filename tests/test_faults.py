"""Faults of the backing store: killed writers, full disks, damaged objects."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvtier.objformat import HEADER_SPAN
from kvtier.tiers.base import PutStatus
from kvtier.tiers.file import FileTier
from tests.tiers.harness import make_key, meta_for, payload_for

ROOT = Path(__file__).resolve().parent.parent
CHUNK = 256 * 1024


def _spawn(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "tests._writer_proc", *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )


@pytest.fixture(params=["local", pytest.param("cephfs", marks=pytest.mark.ceph)])
def store_dirs(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    """(where the writer writes, where the restarted node reads): one local directory, or
    one CephFS directory through two mounts (the writer's node dies, another reads)."""
    if request.param == "local":
        yield tmp_path, tmp_path
        return
    from tests.conftest import cephfs_dir, other_node

    cluster = request.getfixturevalue("ceph")
    written = cephfs_dir(cluster, f"kill9-{uuid.uuid4().hex[:12]}")
    yield written, other_node(cluster, written)
    shutil.rmtree(written, ignore_errors=True)


def test_kill_9_mid_write_leaves_no_partial_object(store_dirs: tuple[Path, Path]) -> None:
    written, read_from = store_dirs
    proc = _spawn(str(written))
    assert proc.stdout is not None
    stored: list[int] = []
    for line in proc.stdout:
        index, status, _ = line.split()
        if status == PutStatus.STORED.value:
            stored.append(int(index))
        if len(stored) >= 40:
            break
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)

    tier = FileTier(read_from, 1 << 40)  # a restart: the index is rebuilt from disk
    buf = np.empty(CHUNK, dtype=np.uint8)
    for i in stored:
        key = make_key(i)
        assert tier.get_into(key, buf.data) is not None, f"chunk {i} lost"
        np.testing.assert_array_equal(buf, payload_for(key, CHUNK))
    for info in list(tier.scan()):  # whatever else is visible is whole, never partial
        assert info.size == HEADER_SPAN + CHUNK
        assert tier.get_into(info.key, buf.data) is not None
    assert tier.metrics.counts.corruptions == 0
    assert tier.delete_stale_temps(older_than=-1) >= 0
    assert not list(read_from.rglob("*.tmp"))


def test_disk_full_is_counted_collected_and_keeps_answering(tiny_fs: Path) -> None:
    """A full disk under a tier that believes in space it lacks: each refused write is
    counted as full (not as an error: the breaker stays closed), leaves no temp file,
    and makes the tier collect, so later writes land; every object read back is its
    own (``tests/tiers/test_full_store.py`` has the store's side)."""
    tier = FileTier(tiny_fs, 1 << 40)
    statuses = []
    for i in range(8):
        key = make_key(i)
        statuses.append(tier.put(meta_for(key, CHUNK), payload_for(key, CHUNK).data))
    assert PutStatus.NO_SPACE in statuses
    assert tier.metrics.counts.full == statuses.count(PutStatus.NO_SPACE)
    assert tier.metrics.counts.errors == 0
    assert statuses[-1] is PutStatus.STORED  # collection made room
    assert not list(tiny_fs.rglob("*.tmp")), "failed writes clean up their temp files"
    buf = np.empty(CHUNK, dtype=np.uint8)
    for i, status in enumerate(statuses):
        got = tier.get_into(make_key(i), buf.data)
        if status is not PutStatus.STORED:
            assert got is None
        elif got is not None:
            np.testing.assert_array_equal(buf, payload_for(make_key(i), CHUNK))
    assert tier.get_into(make_key(7), buf.data) is not None


def test_file_size_limit_fails_puts_cleanly(tmp_path: Path) -> None:
    """RLIMIT_FSIZE makes the kernel refuse writes (EFBIG): no crash, counted, no debris."""
    proc = _spawn(str(tmp_path), str(CHUNK // 2))  # no object fits under the limit
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0
    lines = [ln.split() for ln in out.splitlines()]
    assert len(lines) == 8
    assert all(ln[1] == PutStatus.FAILED.value for ln in lines)
    assert int(lines[-1][2]) == 8, "every failure is counted"
    assert not list(tmp_path.rglob("*.tmp"))
    assert FileTier(tmp_path, 1 << 40).usage().objects == 0


def test_unwritable_directory_is_a_clear_error_at_start(tmp_path: Path) -> None:
    from kvtier.tiers.base import TierError

    target = tmp_path / "file-not-dir"
    target.write_text("x")
    with pytest.raises(TierError, match=r"path: .* not a writable directory"):
        FileTier(target, 1 << 30, setting="tiers[1].file")
    if os.geteuid() != 0:  # root ignores permissions
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o500)
        with pytest.raises(TierError, match="not a writable directory"):
            FileTier(ro, 1 << 30)


def test_host_pool_too_big_fails_at_start_with_numbers() -> None:
    from kvtier.tiers.base import TierError
    from kvtier.tiers.host import HostTier

    with pytest.raises(TierError, match=r"cannot allocate .*TiB host pool, only .* available"):
        HostTier(64 * 2**40, 2**20)
    with pytest.raises(TierError, match="holds no chunk"):
        HostTier(1024, 2**20)
