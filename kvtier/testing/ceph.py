"""A throwaway single-node Ceph cluster for tests and benchmarks: RGW (a real S3 server)
and CephFS (a real shared POSIX filesystem, mounted with ``ceph-fuse``).

Test support only. It needs Debian's Ceph packages (``make ceph`` installs them; see
``APT_PACKAGES``). Invariants:

* Everything lives under one root directory and binds to 127.0.0.1 only: one mon (on a
  free port, msgr v2), one mgr, one OSD on ``memstore`` (RAM, at most
  ``memstore_bytes``), radosgw (beast, on a free port, ``tcp_nodelay``) and one MDS.
  Authentication is off (``auth none``); radosgw then needs ``ms_mon_client_mode = crc
  secure`` to reach the mon at all.
* Every daemon runs in the foreground (``-f``) in its own session (``setsid``) with its
  PID recorded, so ``stop()`` tears down exactly what ``start()`` made: mounts first
  (lazy unmount, so a busy or dead mount never blocks), then SIGKILL to every recorded
  process, then the root. ``stop()`` is idempotent and also runs at interpreter exit.
* Start-up is fast on purpose: ``paxos_propose_interval = 0.1``, RGW's seven pools are
  created up front in one ``ceph`` session (each lazily created pool costs about 2 s on
  first use), pools have size 1 and 8 PGs, and deleted RGW data is reclaimed after
  ``rgw_gc_obj_min_wait = 60`` s (memstore keeps everything in RAM). Two clients that
  write one directory wait on capability revocation, which the MDS and the clients do
  on their ticks: ``mds_tick_interval = 0.2``, ``client_tick_interval = 0.1`` (defaults
  5 s and 1 s) make a two-node write+unlink loop 8x faster.
* The S3 user's keys are ``S3_ACCESS_KEY``/``S3_SECRET_KEY``: the same dummy keys as
  ``kvtier.testing.s3server.DUMMY_ENV``, so one credential environment serves moto and
  RGW alike.
* ``mount(name)`` adds a ``ceph-fuse`` client with its own client id: two mounts are two
  "nodes" with their own caches, talking to the MDS like separate machines.
* ``pause``/``resume`` SIGSTOP/SIGCONT daemons: radosgw becomes an S3 endpoint that accepts
  connections but never answers; the MDS and OSD, a shared filesystem that hangs.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import IO

#: The Debian packages that provide every binary this module runs.
APT_PACKAGES = ("ceph-mon", "ceph-osd", "ceph-mgr", "ceph-mds", "radosgw", "ceph-fuse")
BINARIES = (
    "ceph", "ceph-mon", "ceph-mgr", "ceph-osd", "ceph-mds", "radosgw", "radosgw-admin",
    "ceph-fuse", "monmaptool",
)  # fmt: skip
S3_ACCESS_KEY = "testing"
S3_SECRET_KEY = "testing"
RGW_POOLS = (
    ".rgw.root",
    "default.rgw.control",
    "default.rgw.meta",
    "default.rgw.log",
    "default.rgw.buckets.index",
    "default.rgw.buckets.data",
    "default.rgw.buckets.non-ec",
)
_START_TIMEOUT = 60.0
#: The environment variable that turns "Ceph is not installed" from a skip into a failure
#: (``make test`` sets it: CI must run the real servers, never skip them).
REQUIRE_ENV = "KVTIER_REQUIRE_CEPH"


class CephError(RuntimeError):
    """The cluster could not be started; the message names the step and its log."""


def missing_binaries() -> list[str]:
    """Ceph binaries not on ``PATH`` (empty: a cluster can be started)."""
    return [b for b in BINARIES if shutil.which(b) is None]


def unavailable_reason() -> str | None:
    """Why no cluster can be started here, as a message telling what to run; or None."""
    missing = missing_binaries()
    if not missing:
        return None
    return (
        f"Ceph is not installed (missing {', '.join(missing)}); run `make ceph` or "
        f"`apt-get install {' '.join(APT_PACKAGES)}`"
    )


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _ceph_env() -> dict[str, str]:
    """The environment for Ceph's tools: the system Python, never a virtualenv's path."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env.pop("VIRTUAL_ENV", None)
    return env


class CephCluster:
    """One single-node cluster under ``root`` (created empty; removed by ``stop``)."""

    def __init__(self, root: Path, *, memstore_bytes: int = 3 << 30) -> None:
        self.root = Path(root)
        self.memstore_bytes = memstore_bytes
        self.conf = self.root / "ceph.conf"
        self.s3_endpoint = ""
        self.mounts: list[Path] = []
        self._procs: dict[str, subprocess.Popen[bytes]] = {}
        self._logs: list[IO[bytes]] = []
        self._started = False

    # -- start ----------------------------------------------------------------------------
    def start(self) -> CephCluster:
        """Start mon, mgr, OSD, pools, radosgw (with the S3 user) and the MDS. Raises
        ``CephError`` naming the failed step; everything started so far is stopped."""
        reason = unavailable_reason()
        if reason is not None:
            raise CephError(reason)
        if self._started:
            raise CephError(f"Ceph cluster under {self.root} already started")
        self._started = True
        atexit.register(self.stop)
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self) -> None:
        for sub in ("mon", "osd", "mgr", "mds", "run", "log", "mnt"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        fsid = str(uuid.uuid4())
        mon_port, rgw_port = _free_port(), _free_port()
        self._write_conf(fsid, mon_port, rgw_port)
        self._run("monmaptool", "--create", "--fsid", fsid, "--addv", "a",
                  f"[v2:127.0.0.1:{mon_port}]", str(self.root / "monmap"))  # fmt: skip
        self._run("ceph-mon", "-c", str(self.conf), "--mkfs", "-i", "a",
                  "--monmap", str(self.root / "monmap"))  # fmt: skip
        self._daemon("mon", "ceph-mon", "-i", "a")
        self._daemon("mgr", "ceph-mgr", "-i", "x")
        osd_id = self._run("ceph", "-c", str(self.conf), "--connect-timeout", "30",
                           "osd", "create").strip()  # fmt: skip
        (self.root / "osd" / f"osd.{osd_id}").mkdir(exist_ok=True)
        self._run("ceph-osd", "-c", str(self.conf), "-i", osd_id, "--mkfs")
        self._daemon("osd", "ceph-osd", "-i", osd_id)
        commands = []
        for pool in RGW_POOLS:
            commands += [f"osd pool create {pool} 8 8", f"osd pool application enable {pool} rgw"]
        commands += [
            "osd pool create cephfs_meta 8 8",
            "osd pool create cephfs_data 8 8",
            "fs new cephfs cephfs_meta cephfs_data",
        ]
        # One mon session for all of them: the CLI reads commands from stdin.
        self._run("ceph", "-c", str(self.conf), stdin="\n".join(commands) + "\n")
        self._daemon("rgw", "radosgw", "-n", "client.rgw")
        self._daemon("mds", "ceph-mds", "-i", "a")
        self._run("radosgw-admin", "-c", str(self.conf), "user", "create", "--uid=kvtier",
                  "--display-name=kvtier", f"--access-key={S3_ACCESS_KEY}",
                  f"--secret={S3_SECRET_KEY}")  # fmt: skip
        self.s3_endpoint = f"http://127.0.0.1:{rgw_port}"
        self._wait_http(self.s3_endpoint)
        self._wait_mds()

    def _wait_mds(self) -> None:
        """Until the MDS is active: a ``ceph-fuse`` mount before that fails outright."""
        deadline = time.monotonic() + _START_TIMEOUT
        while "up:active" not in self._run("ceph", "-c", str(self.conf), "mds", "stat"):
            self._check_alive("mds")
            if time.monotonic() > deadline:
                raise CephError(f"the MDS did not become active: {self.log_tail('mds')}")
            time.sleep(0.1)  # readiness poll

    def _write_conf(self, fsid: str, mon_port: int, rgw_port: int) -> None:
        r = self.root
        self.conf.write_text(
            f"""[global]
fsid = {fsid}
mon_host = v2:127.0.0.1:{mon_port}
public_addr = 127.0.0.1
ms_bind_ipv6 = false
auth_cluster_required = none
auth_service_required = none
auth_client_required = none
ms_mon_client_mode = crc secure
mon_allow_pool_size_one = true
mon_warn_on_pool_no_redundancy = false
mon_data_avail_warn = 2
mon_data_avail_crit = 1
mon_max_pg_per_osd = 1000
osd_pool_default_size = 1
osd_pool_default_min_size = 1
osd_pool_default_pg_num = 8
osd_pool_default_pgp_num = 8
osd_pool_default_pg_autoscale_mode = off
paxos_propose_interval = 0.1
run_dir = {r}/run
admin_socket = {r}/run/$name.asok
log_file = {r}/log/$name.log
pid_file = {r}/run/$name.pid
mon_data = {r}/mon/$name
osd_data = {r}/osd/$name
mgr_data = {r}/mgr/$name
mds_data = {r}/mds/$name
osd_objectstore = memstore
memstore_device_bytes = {self.memstore_bytes}
debug_ms = 0
# Two clients writing one directory wait for the MDS to revoke capabilities, which it
# does on its tick (default 5 s, clients 1 s): 24x slower two-node tests without these.
mds_tick_interval = 0.2
client_tick_interval = 0.1

[client.rgw]
rgw_frontends = beast endpoint=127.0.0.1:{rgw_port} tcp_nodelay=1
rgw_gc_obj_min_wait = 60
rgw_gc_processor_period = 60
"""
        )

    def _run(self, *argv: str, stdin: str | None = None) -> str:
        """Run one Ceph tool to completion; its output, or ``CephError`` with its text."""
        try:
            done = subprocess.run(
                argv, input=stdin, capture_output=True, text=True, env=_ceph_env(),
                timeout=_START_TIMEOUT, check=False,
            )  # fmt: skip
        except subprocess.TimeoutExpired as e:
            raise CephError(f"`{' '.join(argv[:3])} ...` did not finish in {e.timeout} s") from e
        if done.returncode != 0:
            raise CephError(
                f"`{' '.join(argv[:3])} ...` failed ({done.returncode}): "
                f"{(done.stderr or done.stdout)[-1500:]}"
            )
        return done.stdout

    def _daemon(self, name: str, binary: str, *args: str) -> subprocess.Popen[bytes]:
        log = open(self.root / "log" / f"{name}.out", "wb")  # noqa: SIM115 (closed in stop)
        self._logs.append(log)
        proc = subprocess.Popen(
            [binary, "-f", "-c", str(self.conf), *args],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            env=_ceph_env(), start_new_session=True,
        )  # fmt: skip
        self._procs[name] = proc
        (self.root / "run" / f"{name}.daemon.pid").write_text(str(proc.pid))
        return proc

    def _check_alive(self, name: str) -> None:
        proc = self._procs[name]
        if proc.poll() is not None:
            raise CephError(f"{name} exited with {proc.returncode}: {self.log_tail(name)}")

    def _wait_http(self, url: str) -> None:
        deadline = time.monotonic() + _START_TIMEOUT
        while time.monotonic() < deadline:
            self._check_alive("rgw")
            try:
                with urllib.request.urlopen(url + "/", timeout=5):
                    return
            except urllib.error.HTTPError:
                return  # it answered HTTP, so it is serving
            except OSError:
                time.sleep(0.05)  # readiness poll, not test timing
        raise CephError(f"radosgw did not answer at {url}: {self.log_tail('rgw')}")

    def log_tail(self, name: str) -> str:
        path = self.root / "log" / f"{name}.out"
        try:
            return path.read_bytes()[-1500:].decode("utf-8", "replace")
        except OSError:
            return ""

    # -- clients --------------------------------------------------------------------------
    def mount(self, name: str) -> Path:
        """Mount CephFS's root at ``<root>/mnt/<name>`` with a client of its own."""
        if not self.s3_endpoint:
            raise CephError("start() the cluster before mounting CephFS")
        where = self.root / "mnt" / name
        where.mkdir(parents=True, exist_ok=True)
        proc = self._daemon(f"fuse-{name}", "ceph-fuse", "--id", f"kvtier-{name}", str(where))
        deadline = time.monotonic() + _START_TIMEOUT
        while not os.path.ismount(where):
            self._check_alive(f"fuse-{name}")
            if time.monotonic() > deadline:
                raise CephError(f"ceph-fuse did not mount {where}: {self.log_tail(f'fuse-{name}')}")
            time.sleep(0.05)  # readiness poll
        del proc
        self.mounts.append(where)
        return where

    def pause(self, *daemons: str) -> None:
        """Freeze daemons (``"rgw"``, ``"mds"``, ``"osd"``, ``"mon"``, ``"mgr"``) with
        SIGSTOP. A frozen RGW accepts connections and never answers; with the MDS and the
        OSD frozen, CephFS calls that need them block, as on a hard-mounted NFS whose
        server is gone. Resume soon: the cluster's own timers keep running."""
        for name in daemons:
            self._procs[name].send_signal(signal.SIGSTOP)

    def resume(self, *daemons: str) -> None:
        for name in daemons:
            self._procs[name].send_signal(signal.SIGCONT)

    # -- stop -----------------------------------------------------------------------------
    def stop(self) -> None:
        """Unmount, kill every daemon this cluster started, remove the root. Idempotent."""
        for where in reversed(self.mounts):
            # Lazy: a mount whose client is gone or that a test left busy still detaches.
            subprocess.run(["umount", "-l", str(where)], capture_output=True, check=False)
        self.mounts.clear()
        procs, self._procs = list(self._procs.values()), {}
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                # SIGKILL: a throwaway cluster has nothing to save, and memstore would
                # otherwise write its whole RAM store to disk on a clean stop.
                os.killpg(proc.pid, signal.SIGKILL)
        for proc in procs:
            proc.wait()
        for log in self._logs:
            log.close()
        self._logs.clear()
        if self._started:
            shutil.rmtree(self.root, ignore_errors=True)
        self._started = False
        atexit.unregister(self.stop)


@contextlib.contextmanager
def ceph_cluster(root: Path, **kwargs: int) -> Iterator[CephCluster]:
    """A started cluster under ``root``, stopped on every exit path."""
    cluster = CephCluster(root, **kwargs)
    try:
        yield cluster.start()
    finally:
        cluster.stop()
