"""``FileTier``: chunks as files in a local directory or an NFS mount shared by many nodes.

Layout: ``<root>/kv/<k[0:2]>/<k[2:4]>/<key-hex>.kv``, one self-describing object per file
(``kvtier.objformat``). Names are hex only, so no key can escape ``root``.

Invariants, chosen to hold on NFS with several writers:

* Writes go to a unique temp file in the object's own directory, are fsynced, then
  published with ``link`` (CREATE: fails if present) or ``rename`` (OVERWRITE). Readers never
  see a partial object; a writer killed mid-write leaves only a ``.tmp`` file that readers
  ignore. Temp files count against capacity while they exist; one not written to for
  ``temp_grace`` seconds (its mtime, so any node's) is removed by the start scan and the
  collector. A write that outlives the grace period fails; it never publishes.
* Files get exactly ``mode`` before they are published, directories kvtier creates the
  same plus x where r is set (0600 -> 0700), whatever the umask. Reads never follow a
  symlink nor block on a FIFO or device: anything but a regular file named like an object
  is a miss, counted as corrupt and removed; scans skip such entries and symlinked dirs.
* No ``flock``, no ``atime``: recency is the file's mtime, set explicitly with ``utime`` on
  a hit (at most once per ``touch_interval``). Every node sees it, so LRU collection is
  correct for the shared directory.
* The in-memory index is rebuilt by scanning at start. Objects written by other nodes later
  are found by a ``stat`` on an index miss. Collection re-stats a victim before deleting it,
  so a chunk another node just used is kept.
* Leases (``kvtier.lease``): the mtime is also the lease start. ``renew`` sets it to now
  unconditionally; ``expire`` rescans the directory (other nodes' objects included) and
  removes objects whose mtime is older than the lease, re-stating each one first so a
  lease another node renewed meanwhile is honoured.
* No I/O under the index lock (``RecencyIndex``), so ``contains_prefix`` of an indexed key
  (vLLM's scheduler thread) never waits for a ``stat`` or ``unlink`` (5 ms each on NFS).
  The collector and ``expire`` pick victims from a snapshot of the index, stat and unlink
  unlocked, skip a victim this node read, wrote or renewed since the snapshot, and drop
  only the entry they picked. A use in the window between that check (or the re-stat, for
  other nodes) and the unlink costs a recompute, never wrong KV: that window exists for
  any collector on NFS without locks. One collection at a time: ``collect`` returns at
  once while one runs, ``expire`` and ``remove_stale_temps`` wait for it.
* Any thread may call any method; the data-path methods never raise on I/O faults.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import secrets
import socket
import stat
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

from kvtier.clock import SYSTEM_CLOCK, Clock
from kvtier.keys import ChunkKey, key_from_hex
from kvtier.metrics import TierMetrics
from kvtier.objformat import (
    HEADER_SPAN,
    ChunkMeta,
    ChunkSpec,
    CorruptObject,
    decode_header,
    encode_header,
    verify_payload,
)
from kvtier.tiers import fsutil
from kvtier.tiers.base import ObjectInfo, PutStatus, TierError, TierUsage, WriteMode
from kvtier.tiers.recency import Entry, RecencyIndex, TempIndex

log = logging.getLogger("kvtier.file")

_SUFFIX = ".kv"
_TMP_SUFFIX = ".tmp"


class FileTier:
    #: ``put`` collects (capacity) itself; a ``TieredStore`` turns this off and queues
    #: collection as a job of its own, outside the breaker-timed write.
    collect_on_put = True

    def __init__(
        self,
        root: str | os.PathLike[str],
        capacity_bytes: int,
        *,
        name: str = "file",
        fsync: bool = True,
        touch_interval: float = 60.0,
        low_watermark: float = 0.9,
        mode: int = 0o600,
        temp_grace: float = 600.0,
        clock: Clock = SYSTEM_CLOCK,
        setting: str = "file",
    ) -> None:
        self._name = name
        self.root = Path(root)
        self._dir = self.root / "kv"
        self.capacity = capacity_bytes
        self._fsync = fsync
        self._touch_interval = touch_interval
        self._low_watermark = low_watermark
        self._mode, self._dir_mode = mode, fsutil.dir_mode(mode)
        self._temp_grace = temp_grace
        self._clock = clock
        self._tag = f"{socket.gethostname()}-{os.getpid()}"
        self.metrics = TierMetrics(name)
        self._recency = RecencyIndex()
        self._temps = TempIndex()
        self._collecting = threading.Lock()  # one collection at a time; held across I/O
        self.removed_temps = 0  # stale temp files this instance removed (start scan included)
        self._check_writable(setting)
        self.rescan()

    @property
    def name(self) -> str:
        return self._name

    def _check_writable(self, setting: str) -> None:
        """Create ``root`` (not its parents: a missing shared mount must not silently
        become a local directory) and ``root/kv``, then write and remove a probe file."""
        try:
            fsutil.make_dir(self.root, self._dir_mode)
            fsutil.make_dir(self._dir, self._dir_mode)
            probe = self._dir / f".probe.{self._tag}.{secrets.token_hex(4)}{_TMP_SUFFIX}"
            os.close(os.open(probe, fsutil.CREATE_FLAGS, self._mode))
            probe.unlink()
        except FileNotFoundError as e:
            raise TierError(
                f"{setting}.path: {self.root} does not exist and neither does its parent; "
                "mount the shared directory (or create it) first"
            ) from e
        except OSError as e:
            raise TierError(
                f"{setting}.path: {self.root} is not a writable directory ({e.strerror}); "
                "create it or fix its permissions"
            ) from e

    def path_of(self, key: ChunkKey) -> Path:
        h = key.hex()
        return self._dir / h[0:2] / h[2:4] / f"{h}{_SUFFIX}"

    # -- index ---------------------------------------------------------------------------
    def rescan(self) -> None:
        """Rebuild the index from what is on disk (other nodes' writes included), and
        remove temp files past the grace period."""
        self._scan()
        self._sweep_temps(self._temp_grace)

    def _scan(self) -> None:
        found: list[tuple[float, ChunkKey, int]] = []
        temps: list[tuple[str, int, float]] = []
        for entry in fsutil.walk_leaves(self._dir):
            temp = entry.name.endswith(_TMP_SUFFIX)
            if not temp and not entry.name.endswith(_SUFFIX):
                continue
            try:
                st = entry.stat(follow_symlinks=False)
                key = None if temp else key_from_hex(entry.name[: -len(_SUFFIX)])
            except (ValueError, FileNotFoundError):
                continue
            if not fsutil.is_regular(st):  # FIFOs, symlinks...: never read, never counted
                continue
            if key is None:
                temps.append((entry.path, st.st_size, st.st_mtime))
            elif entry.path == str(self.path_of(key)):  # not misplaced: readers find it
                found.append((st.st_mtime, key, st.st_size))
        self._recency.reset(found)
        self._temps.reset(temps)
        self._report_used()

    def _used(self) -> int:
        return self._recency.bytes + self._temps.bytes

    def _report_used(self) -> None:
        self.metrics.used(self._used())

    def _known(self, key: ChunkKey) -> bool:
        """Indexed, or on disk (written by another node). The index may be stale: another
        node's collector can delete what we remember; a read then misses and recomputes."""
        if key in self._recency:
            return True
        return self._on_disk(key)

    def _on_disk(self, key: ChunkKey) -> bool:
        """Ask the directory, never the index; refresh the index either way."""
        path = self.path_of(key)
        try:
            st = os.lstat(path)
        except OSError:
            self._recency.forget(key)
            return False
        if not fsutil.is_regular(st):
            self._remove_foreign(key, path)
            return False
        self._recency.remember(key, st.st_size, st.st_mtime)
        return True

    def _remove_foreign(self, key: ChunkKey, path: Path) -> None:
        """Something not a regular file (symlink, FIFO, device) is named like an object:
        never kvtier's and never read. Count it and remove it (unless it is a directory
        or has become a regular file), so the key can be stored again."""
        self.metrics.corrupt()
        self._recency.forget(key)
        log.warning("%s is not a regular file: a miss, removing it", path)
        with contextlib.suppress(OSError):
            st = os.lstat(path)
            if not fsutil.is_regular(st) and not stat.S_ISDIR(st.st_mode):
                os.unlink(path)

    # -- Tier protocol -------------------------------------------------------------------
    def indexed(self, key: ChunkKey) -> bool:
        """In this node's index (memory only; may be stale, see ``contains_prefix``)."""
        return key in self._recency

    def contains_prefix(self, keys: Sequence[ChunkKey]) -> int:
        for i, key in enumerate(keys):
            if not self._known(key):
                return i
        return len(keys)

    def get_into(
        self, key: ChunkKey, dst: memoryview, *, expect: ChunkSpec | None = None
    ) -> ChunkMeta | None:
        t0 = time.perf_counter()
        path = self.path_of(key)
        try:
            fd = fsutil.open_regular(path)
        except FileNotFoundError:
            self._recency.forget(key)
            self.metrics.miss()
            return None
        except fsutil.NotRegular:
            self._remove_foreign(key, path)
            self.metrics.miss()
            return None
        except OSError:
            self.metrics.error("get")
            self.metrics.miss()
            return None
        try:
            size = os.fstat(fd).st_size
            head = memoryview(bytearray(HEADER_SPAN))
            n = fsutil.read_exact(fd, head)
            meta, csum = decode_header(
                head[:n], expect_key=key, expect=expect, object_len=size, max_payload=dst.nbytes
            )
            body = dst[: meta.payload_len]
            if fsutil.read_exact(fd, body) != meta.payload_len:
                raise CorruptObject("truncated payload")
            verify_payload(meta, csum, body)
        except CorruptObject as e:
            self._quarantine(key, path, fd, str(e))
            self.metrics.miss()
            return None
        except OSError:
            self.metrics.error("get")
            self.metrics.miss()
            return None
        finally:
            os.close(fd)
        self._touch(key, path, size)
        self.metrics.hit(meta.payload_len)
        self.metrics.observe("get", time.perf_counter() - t0)
        return meta

    def _touch(self, key: ChunkKey, path: Path, size: int) -> None:
        now = self._clock.wall()
        entry = self._recency.get(key)
        if entry is not None and now - entry.last_used < self._touch_interval:
            self._recency.refresh(key)
            return
        with contextlib.suppress(OSError):  # deleted meanwhile: the next lookup notices
            os.utime(path, (now, now), follow_symlinks=False)
        self._recency.remember(key, size, now)

    def _quarantine(self, key: ChunkKey, path: Path, fd: int, why: str) -> None:
        """Remove a corrupt object, unless someone replaced it since we opened it."""
        self.metrics.corrupt()
        log.warning("corrupt object %s removed: %s", path, why)
        try:
            if os.lstat(path).st_ino == os.fstat(fd).st_ino:
                os.unlink(path)
        except OSError:
            pass
        self._recency.forget(key)

    def put(
        self, meta: ChunkMeta, payload: memoryview, mode: WriteMode = WriteMode.CREATE
    ) -> PutStatus:
        t0 = time.perf_counter()
        path = self.path_of(meta.key)
        # Ask the directory, not the index: a stale entry (another node's collector removed
        # the object) must not turn a write-through into a silent no-op.
        if mode is WriteMode.CREATE and self._on_disk(meta.key):
            return PutStatus.EXISTS
        if meta.object_len > self.capacity:
            return PutStatus.NO_SPACE
        tmp = path.with_name(f".{path.name}.{self._tag}.{secrets.token_hex(4)}{_TMP_SUFFIX}")
        try:
            header = encode_header(meta, payload)
            fd = self._create_temp(tmp)
            try:
                fsutil.write_all(fd, [memoryview(header), memoryview(payload).cast("B")])
                st = os.fstat(fd)
                fsutil.set_mode(fd, st, self._mode)  # before it is published: umask aside
                if self._clock is SYSTEM_CLOCK:  # the write itself set the mtime
                    now = st.st_mtime
                else:  # an injected clock: recency must follow it
                    now = self._clock.wall()
                    os.utime(fd, (now, now))
                if self._fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            if mode is WriteMode.CREATE:
                try:
                    os.link(tmp, path)
                except FileExistsError:
                    return PutStatus.EXISTS
            else:
                os.replace(tmp, path)
        except OSError as e:
            self.metrics.error("put")
            if e.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
                log.warning("put %s failed: %s", path, e)
            return PutStatus.FAILED
        finally:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        self._recency.remember(meta.key, meta.object_len, now)
        self.metrics.wrote(meta.payload_len)
        self.metrics.observe("put", time.perf_counter() - t0)
        if self.collect_on_put:  # else whoever owns the tier collects (TieredStore)
            self.collect()
        self._report_used()
        return PutStatus.STORED

    def _create_temp(self, tmp: Path) -> int:
        """Open a new temp file; its directories are created (each level, exact mode)
        only when missing, so a put costs no extra metadata call otherwise."""
        try:
            return os.open(tmp, fsutil.CREATE_FLAGS, self._mode)
        except FileNotFoundError:
            for d in (self._dir, tmp.parent.parent, tmp.parent):
                fsutil.make_dir(d, self._dir_mode)
            return os.open(tmp, fsutil.CREATE_FLAGS, self._mode)

    def delete(self, keys: Iterable[ChunkKey]) -> int:
        n = 0
        for key in keys:
            try:
                os.unlink(self.path_of(key))
                n += 1
            except FileNotFoundError:
                pass
            self._recency.forget(key)
        self._report_used()
        return n

    def scan(self) -> Iterator[ObjectInfo]:
        for key, e in self._recency.items():
            yield ObjectInfo(key, e.size, e.last_used)

    def usage(self) -> TierUsage:
        """Objects indexed; bytes include temp files (writes in flight or abandoned)."""
        return TierUsage(len(self._recency), self._used(), self.capacity)

    def collect(self) -> int:
        """Remove stale temp files, then delete least recently used objects until usage
        (temp files included) is under the low watermark. Returns 0 at once if another
        thread is collecting."""
        if not self._collecting.acquire(blocking=False):
            return 0
        try:
            if len(self._temps):
                self._sweep_temps(self._temp_grace, recheck=self._used() > self.capacity)
            return self._evict_coldest()
        finally:
            self._collecting.release()

    def _sweep_temps(self, grace: float, *, recheck: bool = True) -> int:
        """Forget known temp files that are gone; remove those not written to for
        ``grace`` seconds (writer dead, on any node). Young ones are re-stated only if
        ``recheck`` (over capacity: a finished write must stop counting)."""
        now, removed = self._clock.wall(), 0
        for path, t in self._temps.items():
            if not recheck and now - t.mtime < grace:
                continue
            try:
                st = os.lstat(path)
                if now - st.st_mtime < grace:  # still being written (or just published)
                    self._temps.remember(path, st.st_size, st.st_mtime)
                    continue
                os.unlink(path)
                removed += 1
            except FileNotFoundError:
                pass
            except OSError as e:
                log.warning("stale temp file %s not removed: %s", path, e.strerror)
                continue
            self._temps.forget(path)
        if removed:
            log.info("%s: removed %d stale temp files", self._name, removed)
            self.removed_temps += removed
        self._report_used()
        return removed

    def _evict_coldest(self) -> int:
        if self._used() <= self.capacity:
            return 0
        target = int(self.capacity * self._low_watermark)
        freed = 0
        for key, seen in self._recency.items():
            if self._used() <= target:
                break
            if self._remove_unused(key, seen, keep_from=seen.last_used + 1e-3):
                freed += seen.size
        self._report_used()
        return freed

    def _remove_unused(self, key: ChunkKey, seen: Entry, *, keep_from: float) -> bool:
        """Unlink the object of ``key`` unless its mtime (any node's use) is at or after
        ``keep_from``, or this node recorded anything for it since ``seen``; True if this
        call removed it. Takes no lock around the stat and the unlink."""
        path = self.path_of(key)
        try:
            st = os.lstat(path)
            if st.st_mtime >= keep_from:  # another node used it since
                self._recency.replace_if(key, seen, st.st_size, st.st_mtime)
                return False
            if self._recency.get(key) is not seen:  # this node used it since
                return False
            os.unlink(path)
        except FileNotFoundError:  # another node's collector was first
            self._recency.forget_if(key, seen)
            return False
        except OSError as e:
            self.metrics.error("collect")
            log.warning("%s not collected: %s", path, e.strerror)
            return False
        self._recency.forget_if(key, seen)
        self.metrics.evicted()
        return True

    # -- leases --------------------------------------------------------------------------
    def read_meta(self, key: ChunkKey) -> ChunkMeta | None:
        """The object's verified header (not its payload), or ``None`` if absent or bad."""
        head = memoryview(bytearray(HEADER_SPAN))
        try:
            fd = fsutil.open_regular(self.path_of(key))
        except OSError:
            return None
        try:
            size = os.fstat(fd).st_size
            head = head[: fsutil.read_exact(fd, head)]
        except OSError:
            return None
        finally:
            os.close(fd)
        try:
            return decode_header(head, expect_key=key, object_len=size)[0]
        except CorruptObject:
            return None

    def renew(self, key: ChunkKey) -> bool:
        """Restart the object's lease now; ``False`` if it is not there."""
        now = self._clock.wall()
        path = self.path_of(key)
        size = -1  # stays so unless a regular file is there and its mtime was set
        with contextlib.suppress(OSError):
            st = os.lstat(path)
            if fsutil.is_regular(st):
                os.utime(path, (now, now), follow_symlinks=False)
                size = st.st_size
        if size < 0:
            self._recency.forget(key)
            return False
        self._recency.remember(key, size, now)
        return True

    def expire(self, lease_seconds: float) -> int:
        """Remove every object not used or renewed for ``lease_seconds``; returns count."""
        with self._collecting:
            self.rescan()
            cutoff, n = self._clock.wall() - lease_seconds, 0
            for key, seen in self._recency.items():
                if seen.last_used < cutoff and self._remove_unused(key, seen, keep_from=cutoff):
                    n += 1
            self._report_used()
        return n

    def remove_stale_temps(self, older_than: float | None = None) -> int:
        """Rescan and delete temp files not written to for ``older_than`` seconds (default
        the grace period): their writers died, on this node or another."""
        with self._collecting:
            self._scan()
            return self._sweep_temps(self._temp_grace if older_than is None else older_than)

    def close(self) -> None:
        pass
