"""``FileTier``: chunks as files in a local directory or an NFS mount shared by many nodes.

Layout: ``<root>/kv/<k[0:2]>/<k[2:4]>/<key-hex>.kv``, one self-describing object per file
(``kvtier.objformat``). The index, recency, capacity, leases and the walk are
``kvtier.tiers.objtier``'s; the directory's transport, and the invariants that make it
safe on NFS with several writers, are ``kvtier.tiers.filetransport``'s (``FileTransport``,
re-exported here). This module builds the tier and owns its temp files.

Invariants:

* The constructor creates ``root`` (never its parents: a missing shared mount must not
  become a local directory) and ``root/kv``, and writes and removes a probe file there:
  a directory that cannot be written fails the start with a message naming the setting.
* Temp files count against capacity while they exist; one not written to for
  ``temp_grace`` seconds (its mtime, so any node's) is removed by the start scan and the
  collector (``_sweep_temps``); ``delete_stale_temps`` is the tools' whole-pass sweep.
* A hit writes the shared stamp (the file's mtime) inline (``FileTransport.stamp_quietly``).
* Any thread may call any method; the data-path methods never raise on I/O faults.
"""

from __future__ import annotations

import logging
import os
import secrets
from pathlib import Path

from kvtier.clock import SYSTEM_CLOCK, Clock
from kvtier.keys import ChunkKey
from kvtier.metrics import TierMetrics
from kvtier.tiers import fsutil
from kvtier.tiers.base import TierError
from kvtier.tiers.filetransport import _TMP_SUFFIX, FileTransport
from kvtier.tiers.objtier import DEFAULT_TICK, ObjectTier
from kvtier.tiers.transport import Version
from kvtier.tiers.walk import TickBudget

__all__ = ["FileTier", "FileTransport"]

log = logging.getLogger("kvtier.file")


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
        tick: TickBudget = DEFAULT_TICK,
        scan_rate: float = 0.0,
        index_threads: int = 1,
    ) -> None:
        """``background_index``: return at once and fill the index on a thread (an engine
        start); else the constructor scans the whole directory (tools, tests).
        ``scan_rate``: objects per second the start scan lists at most (0: no limit).
        ``index_threads``: threads that list the top-level directories during the start
        scan (more pays on NFS/CephFS, where each ``stat`` is a round trip; on a local
        disk one is fastest)."""
        metrics = TierMetrics(name)
        transport = FileTransport(Path(root), fsync=fsync, mode=mode, clock=clock,
                                  metrics=metrics)
        super().__init__(transport, capacity_bytes, name=name, clock=clock,
                         touch_interval=touch_interval, low_watermark=low_watermark,
                         tick=tick, scan_rate=scan_rate, index_threads=index_threads,
                         metrics=metrics)
        self.files = transport
        self.root = transport.root
        self._temp_grace = temp_grace
        self.deleted_temps = 0  # stale temp files this instance deleted (start scan included)
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

    def _after_hit(self, key: ChunkKey, now: float, version: Version) -> bool:
        self.files.stamp_quietly(key, now)
        return True

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
                    temps.update(path, st.st_size, st.st_mtime)
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
            self.deleted_temps += removed
        self._report_used()
        return removed

    def delete_stale_temps(self, older_than: float | None = None) -> int:
        """Walk a whole pass and delete temp files not written to for ``older_than``
        seconds (default the grace period): their writers died, on this node or another."""
        self.rescan()
        with self._collecting:
            return self._sweep_temps(self._temp_grace if older_than is None else older_than)
