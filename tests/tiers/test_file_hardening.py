"""The file tier against a hostile or messy directory: FIFOs and symlinks named like
objects, file modes whatever the umask, and temp files of writers that died.

Time is a ``ManualClock``; temp files get their mtime from it with ``os.utime``, as a
writer on another node would give them its own.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import numpy as np
import pytest

from kvtier.clock import ManualClock
from kvtier.keys import ChunkKey
from kvtier.tiers.base import PutStatus
from kvtier.tiers.file import FileTier
from tests.tiers.harness import PAYLOAD, TierHarness, make_key, meta_for, payload_for

GRACE = 600.0
OBJECT = TierHarness.object_bytes()
T = TypeVar("T")


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture(params=["local", pytest.param("cephfs", marks=pytest.mark.ceph)])
def root(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Path]:
    """The store's root: a local directory, or one on CephFS (FIFOs, symlinks, modes and
    temp files behave as a real shared filesystem makes them)."""
    if request.param == "local":
        yield tmp_path / "store"
        return
    from tests.conftest import cephfs_dir

    parent = cephfs_dir(request.getfixturevalue("ceph"), f"hardening-{uuid.uuid4().hex[:12]}")
    yield parent / "store"
    shutil.rmtree(parent, ignore_errors=True)


def _tier(root: Path, clock: ManualClock, capacity: int = 1 << 30, mode: int = 0o600) -> FileTier:
    return FileTier(root, capacity, clock=clock, temp_grace=GRACE, mode=mode)


def _put(tier: FileTier, i: int) -> ChunkKey:
    key = make_key(i)
    assert tier.put(meta_for(key), payload_for(key).data) is PutStatus.STORED
    return key


class FifoGuard:
    """Runs calls on a thread and fails (instead of hanging) if one blocks on a FIFO."""

    def __init__(self) -> None:
        self.fifos: list[Path] = []
        self._threads: list[threading.Thread] = []

    def mkfifo(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        os.mkfifo(path)
        self.fifos.append(path)

    def run(self, fn: Callable[[], T]) -> T:
        out: list[T] = []
        t = threading.Thread(target=lambda: out.append(fn()), daemon=True)
        self._threads.append(t)
        t.start()
        t.join(timeout=10)
        assert out, "the call blocked on a FIFO"
        return out[0]

    def release(self) -> None:
        """Unblock any reader: open each FIFO for writing, then close it (EOF)."""
        for f in self.fifos:
            with contextlib.suppress(OSError):  # no reader waiting, or already removed
                os.close(os.open(f, os.O_WRONLY | os.O_NONBLOCK))
        for t in self._threads:
            t.join(timeout=10)


@pytest.fixture
def guard() -> Iterator[FifoGuard]:
    g = FifoGuard()
    yield g
    g.release()


def _key(first: int, i: int = 0) -> ChunkKey:
    """A key whose object lives in directory ``kv/<first:02x>/00``."""
    return ChunkKey(bytes([first]) + i.to_bytes(4, "big") + bytes(11))


# -- non-regular entries ------------------------------------------------------------------
def test_a_fifo_named_like_an_object_is_a_counted_miss_and_never_blocks(
    root: Path, clock: ManualClock, guard: FifoGuard
) -> None:
    tier = _tier(root, clock)
    key = make_key(1)
    guard.mkfifo(tier.path_of(key))
    buf = np.empty(PAYLOAD, np.uint8)
    assert guard.run(lambda: tier.read_meta(key)) is None
    assert guard.run(lambda: tier.get_into(key, buf.data)) is None
    assert tier.metrics.counts.misses == 1
    assert tier.metrics.counts.corruptions == 1
    assert not tier.path_of(key).exists()  # removed, so the key can be stored again
    assert tier.put(meta_for(key), payload_for(key).data) is PutStatus.STORED
    assert tier.get_into(key, buf.data) is not None
    np.testing.assert_array_equal(buf, payload_for(key))


def test_a_fifo_is_not_found_by_a_lookup_and_does_not_block_a_create(
    root: Path, clock: ManualClock, guard: FifoGuard
) -> None:
    tier = _tier(root, clock)
    key = make_key(2)
    guard.mkfifo(tier.path_of(key))
    assert guard.run(lambda: tier.contains_prefix([key])) == 0
    status = guard.run(lambda: tier.put(meta_for(key), payload_for(key).data))
    assert status is PutStatus.STORED
    assert stat.S_ISREG(os.lstat(tier.path_of(key)).st_mode)


def test_a_symlink_named_like_an_object_is_never_followed(
    tmp_path: Path, root: Path, clock: ManualClock
) -> None:
    elsewhere = _tier(tmp_path / "elsewhere", clock)
    key = _put(elsewhere, 3)
    target = elsewhere.path_of(key)
    before = os.stat(target).st_mtime
    tier = _tier(root, clock)
    link = tier.path_of(key)
    link.parent.mkdir(parents=True)
    link.symlink_to(target)
    clock.advance(100)
    assert not tier.renew(key)  # would otherwise stamp the target's mtime
    assert tier.read_meta(key) is None
    assert tier.get_into(key, np.empty(PAYLOAD, np.uint8).data) is None
    assert tier.metrics.counts.corruptions == 1
    assert not link.is_symlink()
    assert os.stat(target).st_mtime == before  # the target is untouched
    assert elsewhere.get_into(key, np.empty(PAYLOAD, np.uint8).data) is not None


@pytest.mark.parametrize("level", [1, 2])
def test_a_symlinked_directory_on_the_way_to_an_object_is_never_followed(
    tmp_path: Path, root: Path, clock: ManualClock, level: int
) -> None:
    """``kv/xx`` (level 1) or ``kv/xx/yy`` (level 2) is a symlink to another store's
    directory: no read, stamp, delete or write goes through it (issue 32 review item 10:
    ``O_NOFOLLOW`` covered only the last component)."""
    elsewhere = _tier(tmp_path / "elsewhere", clock)
    key = _put(elsewhere, 3)
    target = elsewhere.path_of(key)
    before = os.stat(target).st_mtime
    tier = _tier(root, clock)
    link = tier.path_of(key).parents[2 - level]
    theirs = target.parents[2 - level]
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(theirs, target_is_directory=True)
    their_files = sorted(theirs.rglob("*"))
    assert tier.path_of(key).exists()  # through the link, as any path-based call sees it
    clock.advance(100)
    assert not tier.renew(key)
    assert os.stat(target).st_mtime == before  # not stamped through the link
    assert tier.read_meta(key) is None
    assert tier.get_into(key, np.empty(PAYLOAD, np.uint8).data) is None
    assert tier.contains_prefix([key]) == 0
    assert tier.delete([key]) == 0 and target.exists()
    assert tier.metrics.counts.corruptions >= 1
    assert tier.put(meta_for(key), payload_for(key).data) is PutStatus.STORED
    assert not link.is_symlink() and tier.path_of(key).is_file()  # its own directory now
    assert sorted(theirs.rglob("*")) == their_files  # nothing written into the other store
    assert os.stat(target).st_mtime == before
    assert elsewhere.get_into(key, np.empty(PAYLOAD, np.uint8).data) is not None


def test_the_start_scan_skips_fifos_and_symlinked_directories(
    tmp_path: Path, root: Path, clock: ManualClock, guard: FifoGuard
) -> None:
    elsewhere = _tier(tmp_path / "elsewhere", clock)
    key = _key(0xAB)
    assert elsewhere.put(meta_for(key), payload_for(key).data) is PutStatus.STORED
    tier = _tier(root, clock)
    mine = tier.path_of(key).parent
    mine.parent.mkdir(parents=True)
    mine.symlink_to(elsewhere.path_of(key).parent, target_is_directory=True)
    (root / "kv" / "cd").symlink_to(elsewhere.root / "kv" / "ab", target_is_directory=True)
    fifo = tier.path_of(_key(0x01))
    guard.mkfifo(fifo)
    guard.mkfifo(fifo.with_name(f".{fifo.name}.node-1.0000.tmp"))

    again = guard.run(lambda: _tier(root, clock))
    assert list(again.scan()) == []
    assert again.usage().bytes == 0
    assert guard.run(again.collect) == 0
    clock.advance(2 * GRACE)
    assert guard.run(again.delete_stale_temps) == 0  # a FIFO is not a temp file


# -- modes --------------------------------------------------------------------------------
@pytest.fixture
def umask() -> Iterator[Callable[[int], int]]:
    old = os.umask(0o022)
    yield os.umask
    os.umask(old)


def _mode(path: Path) -> int:
    return os.lstat(path).st_mode & 0o7777


@pytest.mark.parametrize(("mask", "mode", "dmode"), [
    (0o000, 0o600, 0o700),  # the default: owner-only, even with no umask at all
    (0o077, 0o660, 0o770),  # a group-shared mode survives a strict umask
    (0o022, 0o640, 0o750),
])
def test_files_and_directories_get_the_configured_mode_whatever_the_umask(
    root: Path, clock: ManualClock, umask: Callable[[int], int], mask: int, mode: int,
    dmode: int,
) -> None:
    umask(mask)
    tier = _tier(root, clock, mode=mode)
    key = _put(tier, 6)
    path = tier.path_of(key)
    assert _mode(path) == mode
    for d in (root, root / "kv", path.parent.parent, path.parent):
        assert _mode(d) == dmode, d


def test_an_existing_root_keeps_its_mode(
    root: Path, clock: ManualClock, umask: Callable[[int], int]
) -> None:
    umask(0)
    root.mkdir(mode=0o755)
    _tier(root, clock)
    assert _mode(root) == 0o755
    assert _mode(root / "kv") == 0o700


def test_the_parent_of_the_root_is_never_created(tmp_path: Path, clock: ManualClock) -> None:
    from kvtier.tiers.base import TierError

    with pytest.raises(TierError, match=r"tiers\[1\]\.file\.path: .* does not exist"):
        FileTier(tmp_path / "unmounted" / "kvtier", 1 << 30, clock=clock,
                 setting="tiers[1].file")
    assert not (tmp_path / "unmounted").exists()


# -- temp files of dead writers -----------------------------------------------------------
def _temp(tier: FileTier, i: int, size: int, mtime: float) -> Path:
    """A temp file as a writer (on any node) leaves it, last written at ``mtime``."""
    path = tier.path_of(make_key(i))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.other-node-77.{i:08x}.tmp")
    tmp.write_bytes(bytes(size))
    os.utime(tmp, (mtime, mtime))
    return tmp


def test_start_removes_stale_temps_and_counts_the_others(
    root: Path, clock: ManualClock
) -> None:
    tier = _tier(root, clock)
    key = _put(tier, 0)
    now = clock.wall()
    stale = _temp(tier, 1, 1000, now - GRACE - 1)
    young = _temp(tier, 2, 3000, now - 10)  # another node is writing it
    probe = root / "kv" / ".probe.dead-1.abcd.tmp"
    probe.write_bytes(b"kvtier")
    os.utime(probe, (now - GRACE - 1, now - GRACE - 1))

    again = _tier(root, clock)  # a restart
    assert not stale.exists() and not probe.exists()
    assert young.exists()
    assert again.deleted_temps == 2
    assert again.usage().objects == 1
    assert again.usage().bytes == OBJECT + 3000
    assert again.contains_prefix([key]) == 1


def test_the_collector_removes_a_temp_once_its_writer_is_idle_past_the_grace(
    root: Path, clock: ManualClock
) -> None:
    tier = _tier(root, clock)
    tmp = _temp(tier, 1, 2000, clock.wall())
    tier = _tier(root, clock)
    assert tier.usage().bytes == 2000
    clock.advance(GRACE - 10)
    now = clock.wall()
    os.utime(tmp, (now, now))  # the writer is alive: it wrote again
    clock.advance(20)  # past the grace of the first stamp, not of the last
    tier.collect()
    assert tmp.exists() and tier.usage().bytes == 2000
    clock.advance(GRACE)
    tier.collect()
    assert not tmp.exists()
    assert tier.usage().bytes == 0
    assert tier.deleted_temps == 1


def test_temp_files_count_against_capacity(root: Path, clock: ManualClock) -> None:
    tier = _tier(root, clock, capacity=4 * OBJECT)
    _temp(tier, 100, 2 * OBJECT, clock.wall())
    tier = _tier(root, clock, capacity=4 * OBJECT)
    keys = []
    for i in range(3):
        clock.advance(1)
        keys.append(_put(tier, i))
    u = tier.usage()
    assert u.bytes <= u.capacity
    assert u.objects < 3
    assert tier.contains_prefix(keys[-1:]) == 1  # the newest stays, the coldest went
    assert tier.metrics.counts.evictions >= 1


def test_a_finished_write_stops_counting_when_over_capacity(
    root: Path, clock: ManualClock
) -> None:
    tier = _tier(root, clock, capacity=4 * OBJECT)
    tmp = _temp(tier, 100, 3 * OBJECT, clock.wall())
    tier = _tier(root, clock, capacity=4 * OBJECT)
    tmp.unlink()  # its writer published it (link) and removed the temp name
    keys = [_put(tier, i) for i in range(2)]
    assert tier.contains_prefix(keys) == 2  # nothing evicted for a temp that is gone
    assert tier.usage().bytes == 2 * OBJECT
