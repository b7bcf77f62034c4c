"""A FUSE passthrough mount that can be made to hang: ``bindfs`` in the foreground.

``BindMount(src, mnt)`` mirrors directory ``src`` at ``mnt`` through a ``bindfs`` daemon
this process owns. ``pause()`` stops the daemon (SIGSTOP): from then on every call into
the mount that reaches the daemon (``open``, ``stat``, ``read``, ``readdir``, ...) blocks
in the kernel until ``resume()``, as on a hard-mounted NFS whose server is gone. This is
how the tests and ``benchmarks/hang_inflight.py`` hang a file tier mid-run; Ceph's
``pause("mds", "osd")`` does the same for CephFS, at the cost of a whole cluster.

Needs ``bindfs`` (``make ceph`` installs it with Ceph: the Debian package) and ``/dev/fuse``;
``unavailable_reason()`` says what is missing. ``close()`` resumes, unmounts (lazily
when a caller still blocks in the mount), and ends the daemon; idempotent, and a
context manager's exit calls it. Any thread may call ``pause``/``resume``/``close``.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path
from types import TracebackType

APT_PACKAGE = "bindfs"

#: How long ``mount()`` waits for the daemon to serve the mount.
MOUNT_TIMEOUT_S = 20.0


def unavailable_reason() -> str | None:
    """Why no FUSE passthrough can be mounted here, as a message telling what to run."""
    if shutil.which("bindfs") is None:
        return f"bindfs is not installed: run `make ceph` or `apt-get install {APT_PACKAGE}`"
    if not os.path.exists("/dev/fuse"):
        return "/dev/fuse is missing: this machine (or container) has no FUSE"
    return None


def _mounted(mnt: Path) -> bool:
    target = str(mnt.resolve())
    with open("/proc/self/mounts", encoding="utf-8") as f:
        return any(line.split()[1] == target for line in f if len(line.split()) > 1)


class BindMount:
    """``src`` mirrored at ``mnt`` by a foreground ``bindfs`` daemon (see the module)."""

    def __init__(self, src: Path, mnt: Path) -> None:
        self.src, self.mnt = Path(src), Path(mnt)
        self._proc: subprocess.Popen[bytes] | None = None
        self._paused = False
        self._lock = threading.Lock()

    def mount(self) -> BindMount:
        reason = unavailable_reason()
        if reason is not None:
            raise RuntimeError(reason)
        self.src.mkdir(parents=True, exist_ok=True)
        self.mnt.mkdir(parents=True, exist_ok=True)
        self._proc = subprocess.Popen(
            ["bindfs", "-f", "--no-allow-other", str(self.src), str(self.mnt)],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        )
        deadline = time.monotonic() + MOUNT_TIMEOUT_S
        while not _mounted(self.mnt):
            if self._proc.poll() is not None:
                err = self._proc.stderr.read().decode(errors="replace") if self._proc.stderr else ""
                raise RuntimeError(f"bindfs {self.src} {self.mnt} exited: {err.strip()}")
            if time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"bindfs did not mount {self.mnt} in {MOUNT_TIMEOUT_S} s")
            time.sleep(0.02)  # waiting for another process's mount
        return self

    @property
    def pid(self) -> int:
        assert self._proc is not None, "not mounted"
        return self._proc.pid

    def pause(self) -> None:
        """Stop the daemon: calls into the mount block until ``resume``."""
        with self._lock:
            assert self._proc is not None, "not mounted"
            self._proc.send_signal(signal.SIGSTOP)
            self._paused = True

    def resume(self) -> None:
        with self._lock:
            if self._proc is not None and self._paused:
                self._proc.send_signal(signal.SIGCONT)
            self._paused = False

    def close(self) -> None:
        """Resume, unmount, end the daemon. Idempotent."""
        self.resume()
        with self._lock:
            proc, self._proc = self._proc, None
        if proc is None:
            return
        if _mounted(self.mnt):
            done = subprocess.run(["fusermount", "-u", str(self.mnt)], capture_output=True,
                                  check=False)
            if done.returncode != 0 and _mounted(self.mnt):
                # busy (a caller still inside): detach now, the kernel finishes later
                subprocess.run(["umount", "-l", str(self.mnt)], capture_output=True,
                               check=False)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        if proc.stderr is not None:
            proc.stderr.close()

    def __enter__(self) -> BindMount:
        return self.mount() if self._proc is None else self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
