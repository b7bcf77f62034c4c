"""``FileTier``: chunks as files in a local directory or an NFS mount shared by many nodes.

Layout: ``<root>/kv/<k[0:2]>/<k[2:4]>/<key-hex>.kv``, one self-describing object per file
(``kvtier.objformat``). Names are hex only, so no key can escape ``root``. The index,
recency, capacity, leases and the walk are ``kvtier.tiers.objtier``'s; this module is the
directory's transport (``FileTransport``) and its temp files.

Invariants, chosen to hold on NFS with several writers:

* Writes go to a unique temp file in the object's own directory, are fsynced, then
  published with ``link`` (CREATE: fails if present) or ``rename`` (OVERWRITE), both within
  that directory. Readers never see a partial object; a writer killed mid-write leaves
  only a ``.tmp`` file that readers ignore. Temp files count against capacity while they
  exist; one not written to for ``temp_grace`` seconds (its mtime, so any node's) is
  removed by the start scan and the collector. A write that outlives the grace period
  fails; it never publishes.
* Files get exactly ``mode`` before they are published, directories kvtier creates the
  same plus x where r is set (0600 -> 0700), whatever the umask. Reads never follow a
  symlink nor block on a FIFO or device: anything but a regular file named like an object
  is a miss, counted as corrupt and removed; scans skip such entries and symlinked dirs.
* No ``flock``, no ``atime``: recency is the file's mtime, set explicitly with ``utime`` on
  a hit (at most once per ``touch_interval``). Every node sees it, so LRU collection is
  correct for the shared directory. Leases: the mtime is also the lease start.
* A page of the walk is one of the 256 top-level directories (then the files directly in
  ``kv/``: probes); it lists objects with their mtimes (exact) and refreshes what the tier
  knows of that directory's temp files. ``check_listing`` reads one entry of ``kv/``:
  all the constructor lists.
* A victim is re-stated before its unlink (``heads``), but the unlink itself is
  unconditional: NFS has no conditional unlink. A corrupt object is removed only if it is
  still the inode (and mtime) that was read.
* Any thread may call any method; the data-path methods never raise on I/O faults.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import socket
import stat
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvtier.clock import SYSTEM_CLOCK, Clock
from kvtier.keys import ChunkKey, key_from_hex
from kvtier.metrics import TierMetrics
from kvtier.tiers import fsutil
from kvtier.tiers.base import TierError
from kvtier.tiers.objtier import TICK_OBJECTS, ObjectTier
from kvtier.tiers.transport import (
    Exists,
    Listed,
    Missing,
    Outcome,
    Page,
    Stat,
    Version,
)

log = logging.getLogger("kvtier.file")

_SUFFIX = ".kv"
_TMP_SUFFIX = ".tmp"
_TOP = 256  # the page after the 256 shards: files directly in kv/ (probes)


@dataclass(frozen=True)
class TempEntry:
    size: int
    mtime: float  # the last write to it, as the file system reports it


class TempIndex:
    """Temp files seen in a shared directory, any node's. They hold disk space, so the
    tier counts their bytes against capacity until they are published or removed. Any
    thread; no I/O under its lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[str, TempEntry] = {}
        self.bytes = 0

    def reset_under(self, prefix: str, found: Iterable[tuple[str, int, float]]) -> None:
        """Replace the temps whose path starts with ``prefix`` by ``(path, size, mtime)``."""
        with self._lock:
            for path in [p for p in self._entries if p.startswith(prefix)]:
                self.bytes -= self._entries.pop(path).size
            for path, size, mtime in found:
                self._entries[path] = TempEntry(size, mtime)
                self.bytes += size

    def remember(self, path: str, size: int, mtime: float) -> None:
        with self._lock:
            old = self._entries.get(path)
            self.bytes += size - (old.size if old is not None else 0)
            self._entries[path] = TempEntry(size, mtime)

    def forget(self, path: str) -> None:
        with self._lock:
            old = self._entries.pop(path, None)
            if old is not None:
                self.bytes -= old.size

    def items(self) -> list[tuple[str, TempEntry]]:
        with self._lock:
            return list(self._entries.items())

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)


class FileTransport:
    """Objects as files under ``<root>/kv`` (see the module invariants)."""

    faults: tuple[type[Exception], ...] = (OSError,)
    cheap_head = True
    exact_listing = True

    def __init__(self, root: Path, *, fsync: bool, mode: int, clock: Clock,
                 metrics: TierMetrics) -> None:
        self.root = root
        self.dir = root / "kv"
        self._fsync = fsync
        self.mode, self.dir_mode = mode, fsutil.dir_mode(mode)
        self._clock = clock
        self._metrics = metrics
        self.tag = f"{socket.gethostname()}-{os.getpid()}"
        self.temps = TempIndex()

    def path_of(self, key: ChunkKey) -> Path:
        h = key.hex()
        return self.dir / h[0:2] / h[2:4] / f"{h}{_SUFFIX}"

    def describe(self, key: ChunkKey) -> str:
        return str(self.path_of(key))

    def _remove_foreign(self, path: Path) -> None:
        """Something not a regular file (symlink, FIFO, device) is named like an object:
        never kvtier's and never read. Count it and remove it (unless it is a directory
        or has become a regular file), so the key can be stored again."""
        self._metrics.corrupt()
        log.warning("%s is not a regular file: a miss, removing it", path)
        with contextlib.suppress(OSError):
            st = os.lstat(path)
            if not fsutil.is_regular(st) and not stat.S_ISDIR(st.st_mode):
                os.unlink(path)

    def head(self, key: ChunkKey) -> Stat | None:
        path = self.path_of(key)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return None
        if not fsutil.is_regular(st):
            self._remove_foreign(path)
            return None
        return Stat(st.st_size, st.st_mtime, (st.st_ino, st.st_mtime_ns))

    def heads(self, keys: Sequence[ChunkKey]) -> list[Stat | None]:
        return [self.head(key) for key in keys]

    def read(self, key: ChunkKey, head: memoryview, body: memoryview,
             plan: int) -> tuple[int, Version]:
        path = self.path_of(key)
        try:
            fd = fsutil.open_regular(path)
        except FileNotFoundError:
            raise Missing from None
        except fsutil.NotRegular:
            self._remove_foreign(path)
            raise Missing from None
        try:
            st = os.fstat(fd)
            n = fsutil.read_exact(fd, head)
            if n == head.nbytes and st.st_size > n:
                fsutil.read_exact(fd, body[: min(body.nbytes, st.st_size - n)])
        finally:
            os.close(fd)
        return st.st_size, (st.st_ino, st.st_mtime_ns)

    def read_header(self, key: ChunkKey, head: memoryview) -> int | None:
        try:
            fd = fsutil.open_regular(self.path_of(key))
        except OSError:
            return None
        try:
            size = os.fstat(fd).st_size
            fsutil.read_exact(fd, head)
        finally:
            os.close(fd)
        return size

    def discard(self, key: ChunkKey, version: Version) -> Outcome | Exception:
        path = self.path_of(key)
        try:
            st = os.lstat(path)
            if (st.st_ino, st.st_mtime_ns) != version:
                return Outcome.KEPT  # replaced since it was read
            os.unlink(path)
        except FileNotFoundError:
            return Outcome.GONE
        except OSError as e:
            return e
        return Outcome.DELETED

    def write(self, key: ChunkKey, header: memoryview, body: memoryview, *, create: bool,
              now: float) -> float:
        path = self.path_of(key)
        tmp = path.with_name(f".{path.name}.{self.tag}.{secrets.token_hex(4)}{_TMP_SUFFIX}")
        try:
            fd = self._create_temp(tmp)
            try:
                fsutil.write_all(fd, [header, body])
                st = os.fstat(fd)
                fsutil.set_mode(fd, st, self.mode)  # before it is published: umask aside
                if self._clock is SYSTEM_CLOCK:  # the write itself set the mtime
                    now = st.st_mtime
                else:  # an injected clock: recency must follow it
                    os.utime(fd, (now, now))
                if self._fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            if create:
                try:
                    os.link(tmp, path)
                except FileExistsError:
                    raise Exists from None
            else:
                os.replace(tmp, path)
        finally:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        return now

    def _create_temp(self, tmp: Path) -> int:
        """Open a new temp file; its directories are created (each level, exact mode)
        only when missing, so a put costs no extra metadata call otherwise."""
        try:
            return os.open(tmp, fsutil.CREATE_FLAGS, self.mode)
        except FileNotFoundError:
            for d in (self.dir, tmp.parent.parent, tmp.parent):
                fsutil.make_dir(d, self.dir_mode)
            return os.open(tmp, fsutil.CREATE_FLAGS, self.mode)

    def touch(self, key: ChunkKey, now: float) -> None:
        with contextlib.suppress(OSError):  # deleted meanwhile: the next lookup notices
            os.utime(self.path_of(key), (now, now), follow_symlinks=False)

    def stamp(self, key: ChunkKey, now: float) -> Stat | None:
        path = self.path_of(key)
        try:
            st = os.lstat(path)
            if not fsutil.is_regular(st):
                return None
            os.utime(path, (now, now), follow_symlinks=False)
        except FileNotFoundError:
            return None
        return Stat(st.st_size, now, (st.st_ino, int(now * 1e9)))

    def remove(self, victims: Sequence[tuple[ChunkKey, Stat | None]]
               ) -> tuple[dict[ChunkKey, Outcome], Exception | None]:
        outcomes: dict[ChunkKey, Outcome] = {}
        fault: Exception | None = None
        for key, _ in victims:
            path = self.path_of(key)
            try:
                os.unlink(path)
                outcomes[key] = Outcome.DELETED
            except FileNotFoundError:  # another node's collector was first
                outcomes[key] = Outcome.GONE
            except OSError as e:
                log.warning("%s not removed: %s", path, e.strerror)
                fault = fault or e
        return outcomes, fault

    def check_listing(self) -> None:
        with os.scandir(self.dir) as entries:
            next(entries, None)

    def page(self, cursor: object | None) -> Page:
        shard = 0 if cursor is None else int(cursor)  # type: ignore[call-overload]
        if shard == _TOP:
            self._top_files()
            return Page([], 1, 0, None)
        found: list[Listed] = []
        temps: list[tuple[str, int, float]] = []
        prefix = f"{shard:02x}"
        top = self.dir / prefix
        try:
            subdirs = [d for d in os.scandir(top)
                       if len(d.name) == 2 and d.is_dir(follow_symlinks=False)]
        except FileNotFoundError:
            subdirs = []
        for d2 in subdirs:
            for entry in os.scandir(d2.path):
                self._listed(entry, prefix + d2.name, found, temps)
        self.temps.reset_under(str(top) + os.sep, temps)
        return Page(found, shard << 120, ((shard + 1) << 120) - 1, shard + 1)

    def _listed(self, entry: os.DirEntry[str], where: str, found: list[Listed],
                temps: list[tuple[str, int, float]]) -> None:
        name = entry.name
        temp = name.endswith(_TMP_SUFFIX)
        if not temp and not name.endswith(_SUFFIX):
            return
        try:
            st = entry.stat(follow_symlinks=False)
            key = None if temp else key_from_hex(name[: -len(_SUFFIX)])
        except (ValueError, FileNotFoundError):
            return
        if not fsutil.is_regular(st):  # FIFOs, symlinks...: never read, never counted
            return
        if key is None:
            temps.append((entry.path, st.st_size, st.st_mtime))
        elif name.startswith(where):  # not misplaced: readers find it
            found.append(Listed(key, st.st_size, st.st_mtime))

    def _top_files(self) -> None:
        temps = []
        with contextlib.suppress(FileNotFoundError):
            for entry in os.scandir(self.dir):
                if entry.name.endswith(_TMP_SUFFIX) and entry.is_file(follow_symlinks=False):
                    with contextlib.suppress(FileNotFoundError):
                        st = entry.stat(follow_symlinks=False)
                        temps.append((entry.path, st.st_size, st.st_mtime))
        self._reset_top(temps)

    def _reset_top(self, temps: list[tuple[str, int, float]]) -> None:
        top, seen = str(self.dir) + os.sep, {t[0] for t in temps}
        for path, _ in self.temps.items():
            if path.startswith(top) and os.sep not in path[len(top):] and path not in seen:
                self.temps.forget(path)
        for path, size, mtime in temps:
            self.temps.remember(path, size, mtime)

    def close(self) -> None:
        pass


class FileTier(ObjectTier):
    """The object tier over a directory (see the module invariants)."""

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
        background_index: bool = False,
        tick_objects: int = TICK_OBJECTS,
        scan_rate: float = 0.0,
    ) -> None:
        """``background_index``: return at once and fill the index on a thread (an engine
        start); else the constructor scans the whole directory (tools, tests).
        ``scan_rate``: objects per second the start scan lists at most (0: no limit)."""
        metrics = TierMetrics(name)
        transport = FileTransport(Path(root), fsync=fsync, mode=mode, clock=clock,
                                  metrics=metrics)
        super().__init__(transport, capacity_bytes, name=name, clock=clock,
                         touch_interval=touch_interval, low_watermark=low_watermark,
                         tick_objects=tick_objects, scan_rate=scan_rate)
        self.metrics = metrics
        self.files = transport
        self.root = transport.root
        self._temp_grace = temp_grace
        self.removed_temps = 0  # stale temp files this instance removed (start scan included)
        self._check_writable(setting)
        try:
            self._open(background_index)
        except OSError as e:
            raise TierError(
                f"{setting}.path: {transport.dir} cannot be listed ({e.strerror}); "
                "give this user read and search permission on it"
            ) from e

    def _check_writable(self, setting: str) -> None:
        """Create ``root`` (not its parents: a missing shared mount must not silently
        become a local directory) and ``root/kv``, then write and remove a probe file."""
        t = self.files
        try:
            fsutil.make_dir(t.root, t.dir_mode)
            fsutil.make_dir(t.dir, t.dir_mode)
            probe = t.dir / f".probe.{t.tag}.{secrets.token_hex(4)}{_TMP_SUFFIX}"
            os.close(os.open(probe, fsutil.CREATE_FLAGS, t.mode))
            probe.unlink()
        except FileNotFoundError as e:
            raise TierError(
                f"{setting}.path: {t.root} does not exist and neither does its parent; "
                "mount the shared directory (or create it) first"
            ) from e
        except OSError as e:
            raise TierError(
                f"{setting}.path: {t.root} is not a writable directory ({e.strerror}); "
                "create it or fix its permissions"
            ) from e

    def path_of(self, key: ChunkKey) -> Path:
        return self.files.path_of(key)

    # -- hooks ---------------------------------------------------------------------------
    def _after_fill(self) -> None:
        self._sweep_temps(self._temp_grace)

    def _extra_bytes(self) -> int:
        return self.files.temps.bytes

    def _before_collect(self) -> None:
        if len(self.files.temps):
            self._sweep_temps(self._temp_grace, recheck=self._used() > self.capacity)

    def _after_hit(self, key: ChunkKey, now: float, version: Version) -> None:
        self.files.touch(key, now)

    # -- temp files ----------------------------------------------------------------------
    def _sweep_temps(self, grace: float, *, recheck: bool = True) -> int:
        """Forget known temp files that are gone; remove those not written to for
        ``grace`` seconds (writer dead, on any node). Young ones are re-stated only if
        ``recheck`` (over capacity: a finished write must stop counting)."""
        temps = self.files.temps
        now, removed = self._clock.wall(), 0
        for path, t in temps.items():
            if not recheck and now - t.mtime < grace:
                continue
            try:
                st = os.lstat(path)
                if now - st.st_mtime < grace:  # still being written (or just published)
                    temps.remember(path, st.st_size, st.st_mtime)
                    continue
                os.unlink(path)
                removed += 1
            except FileNotFoundError:
                pass
            except OSError as e:
                log.warning("stale temp file %s not removed: %s", path, e.strerror)
                continue
            temps.forget(path)
        if removed:
            log.info("%s: removed %d stale temp files", self._name, removed)
            self.removed_temps += removed
        self._report_used()
        return removed

    def remove_stale_temps(self, older_than: float | None = None) -> int:
        """Walk a whole pass and delete temp files not written to for ``older_than``
        seconds (default the grace period): their writers died, on this node or another."""
        self.rescan()
        with self._collecting:
            return self._sweep_temps(self._temp_grace if older_than is None else older_than)
