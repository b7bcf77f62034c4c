"""``FileTransport``: the object store of a ``FileTier`` (``kvtier.tiers.file``), files in a
local directory or an NFS mount shared by many nodes.

Layout: ``<root>/kv/<k[0:2]>/<k[2:4]>/<key-hex>.kv``, one self-describing object per file
(``kvtier.objformat``). Names are hex only, so no key can escape ``root``. The index,
recency, capacity, leases and the walk are ``kvtier.tiers.objtier``'s; the sweep of stale
temp files is ``FileTier``'s. This module moves the bytes of one object at a time and lists
one page of the walk.

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
  No operation on an object goes through a symlinked directory either: each reaches the
  object's leaf one level at a time (``kv``, ``xx``, ``yy``: ``O_DIRECTORY | O_NOFOLLOW``
  relative to the last) and works there by ``dir_fd``; a symlinked level is counted,
  removed, and the key is a miss (``root`` itself may be reached through symlinks).
* No ``flock``, no ``atime``: recency is the file's mtime, set explicitly with ``utime`` on
  a hit (at most once per ``touch_interval``). Every node sees it, so LRU collection is
  correct for the shared directory. Leases: the mtime is also the lease start.
* A page of the walk is one leaf directory ``kv/xx/yy`` (then the files directly in
  ``kv/``: probes), so a page costs about objects / 65,536 ``stat`` calls; the leaves of
  a top-level directory are read once per pass, when the walk enters it, and carried in
  the cursor (such a page is not ``fresh``: the walk spares what was recorded since that
  read). A page lists objects with their mtimes (exact) and refreshes what the tier
  knows of the temp files in the leaves it covers. ``check_listing`` reads one entry of
  ``kv/``: all the constructor lists.
* A delete of a version (collection, expiry, a corrupt object) is conditional on what
  its stat saw, without a conditional unlink (NFS has none): the object is renamed to a
  graveyard name in its own directory (atomic; from then on nobody can renew it under its
  name), re-stated there, and unlinked only if it is still that inode and mtime; else it
  is linked back under its name (never over an object published there meanwhile, which
  wins) and kept. A renewal (``utime``) that returned before the rename is seen by the
  re-stat and survives; one that comes after it finds no file and says so (``renew`` is
  False). The re-stat is as fresh as the client's attributes after a lookup of a new
  name (NFS close-to-open revalidates them). A collector killed between the rename and
  the unlink leaves a ``.del.tmp`` file that the temp sweep removes.
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
from collections.abc import Iterator, Sequence
from pathlib import Path

from kvtier.clock import SYSTEM_CLOCK, Clock
from kvtier.keys import ChunkKey, key_from_hex
from kvtier.metrics import TierMetrics
from kvtier.tiers import fsutil
from kvtier.tiers.temps import TempIndex
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
#: A victim between its rename and its unlink: a temp name (listings skip it; the temp
#: sweep removes one a dead collector left behind, by its old mtime).
_GRAVE_SUFFIX = ".del" + _TMP_SUFFIX
_LEAVES = 256 * 256  # leaf directories xx/yy; the page after them: files in kv/ (probes)
_LEAF_SHIFT = 112  # a leaf's keys, as numbers: [leaf << 112, (leaf + 1) << 112)
_HEX2 = frozenset(f"{i:02x}" for i in range(256))
#: The walk's cursor: the next leaf, and the leaves of its top-level directory still to
#: list (None: not read yet).
_Cursor = tuple[int, tuple[str, ...] | None]


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

    @contextlib.contextmanager
    def _leaf(self, key: ChunkKey, *, create: bool = False) -> Iterator[tuple[int, str]]:
        """The object's leaf directory, opened one level at a time (``kv``, ``xx``, ``yy``)
        relative to the last and never through a symlink, and the object's name in it.
        Raises ``FileNotFoundError`` if a level is missing (``create``: made, exact mode)
        or is a symlink (counted, logged and removed, so the key can be stored again: a
        symlinked directory is never kvtier's), ``OSError`` on faults (``NotRegular`` if
        ``kv`` itself is a symlink: counted and logged, never removed). ``root`` itself
        may be reached through symlinks: it is the configured path."""
        h = key.hex()
        fd = self._open_level(None, str(self.dir), create)
        try:
            for name in (h[0:2], h[2:4]):
                nxt = self._open_level(fd, name, create)
                os.close(fd)
                fd = nxt
            yield fd, f"{h}{_SUFFIX}"
        finally:
            os.close(fd)

    def _open_level(self, parent: int | None, name: str, create: bool) -> int:
        try:
            return fsutil.open_dir(name, dir_fd=parent)
        except FileNotFoundError:
            if not create:
                raise
            fsutil.make_dir(name, self.dir_mode, dir_fd=parent)
            return fsutil.open_dir(name, dir_fd=parent)
        except fsutil.NotRegular:
            self._metrics.corrupt()
            if parent is None:  # ``kv`` itself: the operator's to fix, never removed
                log.warning("%s is not a directory (a symlink?): never followed", name)
                raise
            log.warning("%s/.../%s is not a directory (a symlink?): never followed, "
                        "removing it", self.dir, name)
            with contextlib.suppress(OSError):
                if stat.S_ISLNK(os.lstat(name, dir_fd=parent).st_mode):
                    os.unlink(name, dir_fd=parent)
            if not create:
                raise FileNotFoundError(errno.ENOENT, "not a directory of this tier",
                                        name) from None
            fsutil.make_dir(name, self.dir_mode, dir_fd=parent)
            return fsutil.open_dir(name, dir_fd=parent)

    def _delete_foreign(self, key: ChunkKey) -> None:
        """Something not a regular file (symlink, FIFO, device) is named like an object:
        never kvtier's and never read. Count it and remove it (unless it is a directory
        or has become a regular file), so the key can be stored again."""
        self._metrics.corrupt()
        log.warning("%s is not a regular file: a miss, removing it", self.path_of(key))
        with contextlib.suppress(OSError), self._leaf(key) as (d, name):
            st = os.lstat(name, dir_fd=d)
            if not fsutil.is_regular(st) and not stat.S_ISDIR(st.st_mode):
                os.unlink(name, dir_fd=d)

    def head(self, key: ChunkKey) -> Stat | None:
        try:
            with self._leaf(key) as (d, name):
                st = os.lstat(name, dir_fd=d)
        except FileNotFoundError:
            return None
        if not fsutil.is_regular(st):
            self._delete_foreign(key)
            return None
        return Stat(st.st_size, st.st_mtime, (st.st_ino, st.st_mtime_ns))

    def heads(self, keys: Sequence[ChunkKey]) -> list[Stat | None]:
        return [self.head(key) for key in keys]

    def _open(self, key: ChunkKey) -> int:
        """A descriptor of the object's regular file (``open_regular`` in its leaf)."""
        with self._leaf(key) as (d, name):
            return fsutil.open_regular(name, dir_fd=d)

    def read(self, key: ChunkKey, head: memoryview, body: memoryview,
             plan: int) -> tuple[int, Version]:
        try:
            fd = self._open(key)
        except FileNotFoundError:
            raise Missing from None
        except fsutil.NotRegular:
            self._delete_foreign(key)
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
            fd = self._open(key)
        except OSError:
            return None
        try:
            size = os.fstat(fd).st_size
            fsutil.read_exact(fd, head)
        finally:
            os.close(fd)
        return size

    def delete_if(self, key: ChunkKey, version: Version) -> Outcome | Exception:
        try:
            return self._delete_if(key, version)
        except OSError as e:
            return e

    def _delete_if(self, key: ChunkKey, version: Version) -> Outcome:
        """Unlink the object only while it is still ``version`` (inode, mtime in ns):
        rename it to a graveyard name in its directory, re-stat it there, then unlink it
        or link it back (see the module invariants). Raises ``OSError`` on faults; a fault
        after the rename puts the object back first where it can."""
        try:
            with self._leaf(key) as (d, name):
                return self._delete_in(d, name, version)
        except FileNotFoundError:
            return Outcome.GONE  # another node's collector was first

    def _delete_in(self, d: int, name: str, version: Version) -> Outcome:
        grave = f".{name}.{self.tag}.{secrets.token_hex(4)}{_GRAVE_SUFFIX}"
        os.rename(name, grave, src_dir_fd=d, dst_dir_fd=d)
        try:
            st = os.lstat(grave, dir_fd=d)
        except OSError:
            with contextlib.suppress(OSError):
                os.link(grave, name, src_dir_fd=d, dst_dir_fd=d, follow_symlinks=False)
            with contextlib.suppress(OSError):
                os.unlink(grave, dir_fd=d)
            raise
        changed = (st.st_ino, st.st_mtime_ns) != version
        if changed:  # renewed or replaced since its stat: back under its name
            with contextlib.suppress(FileExistsError):  # published again meanwhile: it wins
                os.link(grave, name, src_dir_fd=d, dst_dir_fd=d, follow_symlinks=False)
        os.unlink(grave, dir_fd=d)
        return Outcome.KEPT if changed else Outcome.DELETED

    def write(self, key: ChunkKey, header: memoryview, body: memoryview, *, create: bool,
              now: float) -> float:
        with self._leaf(key, create=True) as (d, name):
            tmp = f".{name}.{self.tag}.{secrets.token_hex(4)}{_TMP_SUFFIX}"
            try:
                fd = os.open(tmp, fsutil.CREATE_FLAGS, self.mode, dir_fd=d)
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
                        os.link(tmp, name, src_dir_fd=d, dst_dir_fd=d, follow_symlinks=False)
                    except FileExistsError:
                        raise Exists from None
                else:
                    os.replace(tmp, name, src_dir_fd=d, dst_dir_fd=d)
            finally:
                with contextlib.suppress(OSError):
                    os.unlink(tmp, dir_fd=d)
        return now

    def stamp_quietly(self, key: ChunkKey, now: float) -> None:
        """``stamp`` after a hit, without its stat: a fault or a missing file is ignored."""
        with contextlib.suppress(OSError), self._leaf(key) as (d, name):
            # deleted meanwhile: the next lookup notices
            os.utime(name, (now, now), dir_fd=d, follow_symlinks=False)

    def stamp(self, key: ChunkKey, now: float) -> Stat | None:
        try:
            with self._leaf(key) as (d, name):
                st = os.lstat(name, dir_fd=d)
                if not fsutil.is_regular(st):
                    return None
                os.utime(name, (now, now), dir_fd=d, follow_symlinks=False)
        except FileNotFoundError:
            return None
        return Stat(st.st_size, now, (st.st_ino, int(now * 1e9)))

    def delete(self, victims: Sequence[tuple[ChunkKey, Stat | None]]
               ) -> tuple[dict[ChunkKey, Outcome], Exception | None]:
        outcomes: dict[ChunkKey, Outcome] = {}
        fault: Exception | None = None
        for key, st in victims:
            try:
                if st is not None:
                    outcomes[key] = self._delete_if(key, st.version)
                    continue
                with self._leaf(key) as (d, name):
                    os.unlink(name, dir_fd=d)
                outcomes[key] = Outcome.DELETED
            except FileNotFoundError:  # another node's collector was first
                outcomes[key] = Outcome.GONE
            except OSError as e:
                log.warning("%s not removed: %s", self.path_of(key), e.strerror)
                fault = fault or e
        return outcomes, fault

    def check_listing(self) -> None:
        with os.scandir(self.dir) as entries:
            next(entries, None)

    def slices(self) -> list[object | None]:
        """One slice per top-level directory, then the files in ``kv/``: the cursor of a
        top-level directory's first leaf is the ``next`` of the page of the one before."""
        firsts: list[_Cursor] = [(shard << 8, None) for shard in range(1, 256)]
        return [None, *firsts, (_LEAVES, None)]

    def page(self, cursor: object | None) -> Page:
        """One leaf directory: the next one that exists from the cursor's leaf on. The
        page's key range runs from the cursor's leaf to that leaf (to the end of its
        top-level directory if it is the last there), so missing leaves are covered."""
        leaf, subs = cursor if isinstance(cursor, tuple) else (0, None)
        if leaf >= _LEAVES:
            self._top_files()
            return Page([], 1, 0, None)
        shard = leaf >> 8
        fresh = subs is None
        if subs is None:
            subs = self._leaves_of(shard, leaf & 0xFF)
        found: list[Listed] = []
        temps: list[tuple[int, str, int, float]] = []
        if subs:
            name = f"{shard:02x}{subs[0]}"
            here = (shard << 8) | int(subs[0], 16)
            try:
                with os.scandir(self.dir / name[:2] / name[2:]) as entries:
                    for entry in entries:
                        self._listed(entry, name, here, found, temps)
            except FileNotFoundError:
                pass
        rest = subs[1:]
        last = ((shard << 8) | int(rest[0], 16)) - 1 if rest else (shard << 8) | 0xFF
        self.temps.reset(leaf, last, temps)
        nxt: _Cursor = (last + 1, rest or None)
        return Page(found, leaf << _LEAF_SHIFT, ((last + 1) << _LEAF_SHIFT) - 1, nxt, fresh)

    def _leaves_of(self, shard: int, first: int) -> tuple[str, ...]:
        """The leaf directories of top-level directory ``shard``, from ``first`` on."""
        top = self.dir / f"{shard:02x}"
        try:
            if not stat.S_ISDIR(os.lstat(top).st_mode):  # a symlink: never followed
                return ()
            with os.scandir(top) as entries:
                names = [d.name for d in entries
                         if d.name in _HEX2 and d.is_dir(follow_symlinks=False)]
        except FileNotFoundError:
            return ()
        return tuple(n for n in sorted(names) if int(n, 16) >= first)

    def _listed(self, entry: os.DirEntry[str], where: str, leaf: int, found: list[Listed],
                temps: list[tuple[int, str, int, float]]) -> None:
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
            temps.append((leaf, entry.path, st.st_size, st.st_mtime))
        elif name.startswith(where):  # not misplaced: readers find it
            found.append(Listed(key, st.st_size, st.st_mtime))

    def _top_files(self) -> None:
        temps = []
        with contextlib.suppress(FileNotFoundError):
            for entry in os.scandir(self.dir):
                if entry.name.endswith(_TMP_SUFFIX) and entry.is_file(follow_symlinks=False):
                    with contextlib.suppress(FileNotFoundError):
                        st = entry.stat(follow_symlinks=False)
                        temps.append((_LEAVES, entry.path, st.st_size, st.st_mtime))
        self.temps.reset(_LEAVES, _LEAVES, temps)

    def close(self) -> None:
        pass
