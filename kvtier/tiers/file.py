"""``FileTier``: chunks as files in a local directory or an NFS mount shared by many nodes.

Layout: ``<root>/kv/<k[0:2]>/<k[2:4]>/<key-hex>.kv``, one self-describing object per file
(``kvtier.objformat``). Names are hex only, so no key can escape ``root``.

Invariants, chosen to hold on NFS with several writers:

* Writes go to a unique temp file in the object's own directory, are fsynced, then
  published with ``link`` (CREATE: fails if present) or ``rename`` (OVERWRITE). Readers never
  see a partial object; a writer killed mid-write leaves only a ``.tmp`` file that readers
  ignore and ``gc`` removes.
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
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import secrets
import socket
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

from kvtier.clock import SYSTEM_CLOCK, Clock
from kvtier.keys import ChunkKey, key_from_hex
from kvtier.metrics import TierMetrics
from kvtier.objformat import (
    HEADER_SPAN,
    ChunkMeta,
    CorruptObject,
    decode_header,
    encode_header,
    verify_payload,
)
from kvtier.tiers.base import ObjectInfo, PutStatus, TierError, TierUsage, WriteMode
from kvtier.tiers.recency import RecencyIndex

log = logging.getLogger("kvtier.file")

_SUFFIX = ".kv"
_TMP_SUFFIX = ".tmp"


def _write_all(fd: int, parts: list[memoryview]) -> None:
    """Write every byte of ``parts``; short writes are continued, never ignored."""
    pending = [p for p in parts if p.nbytes]
    while pending:
        n = os.writev(fd, pending)
        while n and pending:
            if n >= pending[0].nbytes:
                n -= pending[0].nbytes
                pending.pop(0)
            else:
                pending[0] = pending[0][n:]
                n = 0


def _read_exact(fd: int, dst: memoryview) -> int:
    got = 0
    while got < dst.nbytes:
        n = os.readv(fd, [dst[got:]])
        if n == 0:
            break
        got += n
    return got


class FileTier:
    def __init__(
        self,
        root: str | os.PathLike[str],
        capacity_bytes: int,
        *,
        name: str = "file",
        fsync: bool = True,
        touch_interval: float = 60.0,
        low_watermark: float = 0.9,
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
        self._clock = clock
        self._tag = f"{socket.gethostname()}-{os.getpid()}"
        self.metrics = TierMetrics(name)
        self._recency = RecencyIndex()
        self._check_writable(setting)
        self.rescan()

    @property
    def name(self) -> str:
        return self._name

    def _check_writable(self, setting: str) -> None:
        try:
            self._dir.mkdir(parents=True, exist_ok=True)
            probe = self._dir / f".probe.{self._tag}.{secrets.token_hex(4)}{_TMP_SUFFIX}"
            probe.write_bytes(b"kvtier")
            probe.unlink()
        except OSError as e:
            raise TierError(
                f"{setting}.path: {self.root} is not a writable directory ({e.strerror}); "
                "create it or fix its permissions"
            ) from e

    def path_of(self, key: ChunkKey) -> Path:
        h = key.hex()
        return self._dir / h[0:2] / h[2:4] / f"{h}{_SUFFIX}"

    # -- index ---------------------------------------------------------------------------
    def _walk(self) -> Iterator[os.DirEntry[str]]:
        for d1 in os.scandir(self._dir):
            if not d1.is_dir() or len(d1.name) != 2:
                continue
            for d2 in os.scandir(d1.path):
                if d2.is_dir() and len(d2.name) == 2:
                    yield from os.scandir(d2.path)

    def rescan(self) -> None:
        """Rebuild the index from what is on disk (other nodes' writes included)."""
        found: list[tuple[float, ChunkKey, int]] = []
        for entry in self._walk():
            if not entry.name.endswith(_SUFFIX):
                continue
            try:
                key = key_from_hex(entry.name[: -len(_SUFFIX)])
                st = entry.stat()
            except (ValueError, FileNotFoundError):
                continue
            found.append((st.st_mtime, key, st.st_size))
        self._recency.reset(found)
        self.metrics.used(self._recency.bytes)

    def _known(self, key: ChunkKey) -> bool:
        """Indexed, or on disk (written by another node). The index may be stale: another
        node's collector can delete what we remember; a read then misses and recomputes."""
        if key in self._recency:
            return True
        return self._on_disk(key)

    def _on_disk(self, key: ChunkKey) -> bool:
        """Ask the directory, never the index; refresh the index either way."""
        try:
            st = os.stat(self.path_of(key))
        except OSError:
            self._recency.forget(key)
            return False
        self._recency.remember(key, st.st_size, st.st_mtime)
        return True

    # -- Tier protocol -------------------------------------------------------------------
    def contains_prefix(self, keys: Sequence[ChunkKey]) -> int:
        for i, key in enumerate(keys):
            if not self._known(key):
                return i
        return len(keys)

    def get_into(self, key: ChunkKey, dst: memoryview) -> ChunkMeta | None:
        t0 = time.perf_counter()
        path = self.path_of(key)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            self._recency.forget(key)
            self.metrics.miss()
            return None
        except OSError:
            self.metrics.error("get")
            self.metrics.miss()
            return None
        try:
            size = os.fstat(fd).st_size
            head = memoryview(bytearray(HEADER_SPAN))
            n = _read_exact(fd, head)
            meta, csum = decode_header(head[:n], expect_key=key, object_len=size)
            if meta.payload_len > dst.nbytes:
                raise ValueError(
                    f"buffer of {dst.nbytes} bytes is too small for a "
                    f"{meta.payload_len}-byte chunk"
                )
            body = dst[: meta.payload_len]
            if _read_exact(fd, body) != meta.payload_len:
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
        with self._recency.lock:
            entry = self._recency.get(key)
            if entry is not None and now - entry.last_used < self._touch_interval:
                self._recency.refresh(key)
                return
        with contextlib.suppress(OSError):  # deleted meanwhile: the next lookup notices
            os.utime(path, (now, now))
        self._recency.remember(key, size, now)

    def _quarantine(self, key: ChunkKey, path: Path, fd: int, why: str) -> None:
        """Remove a corrupt object, unless someone replaced it since we opened it."""
        self.metrics.corrupt()
        log.warning("corrupt object %s removed: %s", path, why)
        try:
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
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
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                _write_all(fd, [memoryview(header), memoryview(payload).cast("B")])
                if self._clock is SYSTEM_CLOCK:  # the write itself set the mtime
                    now = os.fstat(fd).st_mtime
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
        self.collect()
        self.metrics.used(self._recency.bytes)
        return PutStatus.STORED

    def delete(self, keys: Iterable[ChunkKey]) -> int:
        n = 0
        for key in keys:
            try:
                os.unlink(self.path_of(key))
                n += 1
            except FileNotFoundError:
                pass
            self._recency.forget(key)
        self.metrics.used(self._recency.bytes)
        return n

    def scan(self) -> Iterator[ObjectInfo]:
        for key, e in self._recency.items():
            yield ObjectInfo(key, e.size, e.last_used)

    def usage(self) -> TierUsage:
        return self._recency.usage(self.capacity)

    def collect(self) -> int:
        """Delete least recently used objects until usage is under the low watermark."""
        with self._recency.lock:
            return self._collect_locked()

    def _collect_locked(self) -> int:
        if self._recency.bytes <= self.capacity:
            return 0
        target = int(self.capacity * self._low_watermark)
        freed = 0
        for key, entry in self._recency.items():
            if self._recency.bytes <= target:
                break
            path = self.path_of(key)
            try:
                st = os.stat(path)
            except FileNotFoundError:
                self._recency.forget(key)
                continue
            if st.st_mtime > entry.last_used + 1e-3:  # another node used it since
                self._recency.remember(key, st.st_size, st.st_mtime)
                continue
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            freed += entry.size
            self._recency.forget(key)
            self.metrics.evicted()
        self.metrics.used(self._recency.bytes)
        return freed

    # -- leases --------------------------------------------------------------------------
    def read_meta(self, key: ChunkKey) -> ChunkMeta | None:
        """The object's verified header (not its payload), or ``None`` if absent or bad."""
        try:
            with open(self.path_of(key), "rb") as f:
                size = os.fstat(f.fileno()).st_size
                head = f.read(HEADER_SPAN)
        except OSError:
            return None
        try:
            return decode_header(memoryview(head), expect_key=key, object_len=size)[0]
        except CorruptObject:
            return None

    def renew(self, key: ChunkKey) -> bool:
        """Restart the object's lease now; ``False`` if it is not there."""
        now = self._clock.wall()
        path = self.path_of(key)
        try:
            os.utime(path, (now, now))
            size = os.stat(path).st_size
        except OSError:
            self._recency.forget(key)
            return False
        self._recency.remember(key, size, now)
        return True

    def expire(self, lease_seconds: float) -> int:
        """Remove every object not used or renewed for ``lease_seconds``; returns count."""
        self.rescan()
        cutoff, n = self._clock.wall() - lease_seconds, 0
        with self._recency.lock:
            for key, entry in self._recency.items():
                if entry.last_used >= cutoff:
                    continue
                path = self.path_of(key)
                try:
                    st = os.stat(path)
                    if st.st_mtime >= cutoff:  # renewed since the scan
                        self._recency.remember(key, st.st_size, st.st_mtime)
                        continue
                    os.unlink(path)
                except FileNotFoundError:
                    pass
                self._recency.forget(key)
                self.metrics.evicted()
                n += 1
            self.metrics.used(self._recency.bytes)
        return n

    def remove_stale_temps(self, older_than: float = 3600.0) -> int:
        """Delete temp files left by writers that died more than ``older_than`` s ago."""
        now, n = self._clock.wall(), 0
        for entry in self._walk():
            if entry.name.endswith(_TMP_SUFFIX):
                try:
                    if now - entry.stat().st_mtime > older_than:
                        os.unlink(entry.path)
                        n += 1
                except FileNotFoundError:
                    pass
        return n

    def close(self) -> None:
        pass
