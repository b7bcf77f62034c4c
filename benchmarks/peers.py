"""kvtier's store against LMCache 0.5.6's storage layer, on the same chunks, on this machine.

Paths compared (kvtier side | LMCache side):

* cpu put/get       HostTier.put / get_into            | LocalCPUBackend via StorageManager:
                                                         allocate + copy_ + batched_put /
                                                         batched_get + copy_ out
* disk write        FileTier(fsync=False) "visible",   | LocalDiskBackend.batched_submit_put_task;
                    FileTier(fsync=True) "durable"     |  "durable" adds an fsync of each file,
                                                         added here from outside, on LMCache's
                                                         own I/O threads, as soon as LMCache
                                                         reports the file written
* disk cold read    FileTier.get_into (checksummed)    | StorageManager.batched_get from the disk
                                                         (into LMCache's MemoryObjs)
* fs:// write/read  the same FileTier numbers, again   | RemoteBackend + FSConnector at
                    measured side by side              |  fs://localhost:1/<dir>
* cephfs            FileTier on CephFS (ceph-fuse)     | the same fs:// backend on CephFS
  write/read        (``--paths cephfs``: a throwaway single-node cluster, memstore OSD)

On CephFS a cold read is a read by a second client ("node 2", its own ``ceph-fuse`` mount)
of objects that node 1 has just written (rewritten untimed before every read, so node 2
holds no cache of them): ``posix_fadvise`` drops only the kernel's page cache, not
ceph-fuse's own object cache. kvtier's node 2 is a second FileTier on the node-2 mount;
LMCache's fs:// directory is a symlink that is repointed from node 1's mount to node 2's
for its reads.

LMCache runs in its own venv (created here on first use: ``.venv-lmcache`` next to the
repo's ``.venv``, torch 2.13.0+cpu only). ``benchmarks/peers_lmcache.py`` runs there as a
worker and answers one JSON line per request; kvtier runs in this process.

Fairness: both sides read the same bytes (one file in /dev/shm, mapped by both), use the
same number of threads (``--threads``: kvtier's thread pool; LMCache's disk I/O threads,
asyncio executor and a pool copying whole chunks), write from and read into pre-touched
buffers, and run one repetition each in turn, first one side then the other, swapping the
order every repetition. Disk writes start from chunks already in each side's memory (for
LMCache: MemoryObjs filled untimed), like a write-through from the host tier. The first
repetition is dropped, the median of the rest is kept. Cold reads follow
``posix_fadvise(DONTNEED)`` on every file of both sides; every write starts after the
previous objects are deleted and ``sync`` has returned.

    .venv/bin/python benchmarks/peers.py                     # 3 MiB chunks, 512 MiB
    .venv/bin/python benchmarks/peers.py --quick --skip-lmcache --out /tmp/p.json
    .venv/bin/python benchmarks/peers.py --paths cephfs --total 256MiB --reps 3 \
        --out benchmarks/results/peers_cephfs.json

Targets: kvtier >= LMCache on every path, and >= 1.3x on the durable write paths.
"""

from __future__ import annotations

import os
import sys

# Run as a script, this file's folder heads sys.path, where a benchmark module could shadow
# a standard one: drop the folder, add the repo root (this side imports `benchmarks` and
# `kvtier`; the LMCache worker, benchmarks/peers_lmcache.py, imports neither).
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
sys.path.insert(0, os.path.dirname(_HERE))

import argparse  # noqa: E402
import contextlib  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import secrets  # noqa: E402
import select  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable, Iterator  # noqa: E402
from concurrent.futures import ThreadPoolExecutor  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import IO, TYPE_CHECKING, Any  # noqa: E402

# The model geometry, defined once in the worker module (standard library only at import);
# TOKEN_BYTES is re-exported: it is part of this module's interface (--chunk, tests).
from benchmarks.peers_lmcache import HEAD_DIM, KV_HEADS, LAYERS  # noqa: E402
from benchmarks.peers_lmcache import TOKEN_BYTES as TOKEN_BYTES  # noqa: E402

if TYPE_CHECKING:
    import numpy as np

ROOT = Path(_HERE).parent
LMCACHE_VERSION = "0.5.6"
TORCH_VERSION = "2.13.0"
DEFAULT_VENV = ROOT / ".venv-lmcache"
INSTALL_MARKER = "kvtier-peers-install.json"
WORKER_SCRIPT = Path(_HERE) / "peers_lmcache.py"  # run with the LMCache venv's python

DURABLE_TARGET = 1.3
TARGET = 1.0
GB = 1e9


# =========================================================================================
# The LMCache venv (kvtier side, standard library only).
# =========================================================================================


def _pip_env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    if not env.get("PIP_FIND_LINKS") and Path("/opt/wheels").is_dir():
        env["PIP_FIND_LINKS"] = "/opt/wheels"
    return env


def _venv_versions(python: Path) -> dict[str, str]:
    code = ("import importlib.metadata as m, json; print(json.dumps("
            "{p: m.version(p) for p in ('torch', 'lmcache')}))")
    r = subprocess.run([str(python), "-c", code], capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        raise SystemExit(f"cannot read package versions in {python}:\n{r.stderr[-2000:]}")
    versions: dict[str, str] = json.loads(r.stdout)
    return versions


def _venv_torch(python: Path) -> str:
    code = "import importlib.metadata as m; print(m.version('torch'))"
    r = subprocess.run([str(python), "-c", code], capture_output=True, text=True, timeout=120)
    return r.stdout.strip() if r.returncode == 0 else "unknown"


def _check_versions(python: Path) -> dict[str, str]:
    v = _venv_versions(python)
    if not v["torch"].endswith("+cpu"):
        raise SystemExit(
            f"{python}: torch is {v['torch']}, not a +cpu build. Refusing to run; delete "
            "the venv and make a local torch-2.13.0+cpu wheel reachable via PIP_FIND_LINKS.")
    if v["lmcache"] != LMCACHE_VERSION:
        raise SystemExit(f"{python}: lmcache is {v['lmcache']}, expected {LMCACHE_VERSION}; "
                         "delete the venv to reinstall")
    return v


def ensure_lmcache_venv(venv: Path) -> dict[str, Any]:
    """Create ``venv`` with LMCache and a CPU torch unless it is there; check it either way."""
    python = venv / "bin" / "python"
    marker = venv / INSTALL_MARKER
    if not python.exists():
        log = Path(tempfile.gettempdir()) / f"kvtier-peers-pip-{os.getpid()}.log"
        print(f"creating {venv} with lmcache=={LMCACHE_VERSION} and torch=={TORCH_VERSION} "
              f"(CPU); pip log: {log}", flush=True)
        t0 = time.monotonic()
        existed = venv.exists()
        env = _pip_env()
        pip = [str(python), "-m", "pip", "install", "--disable-pip-version-check"]
        steps = [
            ["python3", "-m", "venv", str(venv)],
            # torch alone first, from local wheels only: an index would serve the CUDA
            # build. Its dependencies come with lmcache's in the next step, which keeps
            # the installed torch because it already satisfies ==2.13.0.
            [*pip, "--no-index", "--no-deps", f"torch=={TORCH_VERSION}"],
            [*pip, f"lmcache=={LMCACHE_VERSION}", f"torch=={TORCH_VERSION}"],
        ]
        try:
            with log.open("w") as f:
                for i, cmd in enumerate(steps):
                    r = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
                    if r.returncode != 0:
                        f.flush()
                        tail = log.read_text()[-3000:]
                        hint = (" (no torch 2.13.0+cpu wheel in PIP_FIND_LINKS; refusing to "
                                "fetch torch from an index, which would be the CUDA build)"
                                if i == 1 else "")
                        raise SystemExit(f"{' '.join(cmd)} failed{hint}:\n{tail}")
                    if i == 1 and not (torch := _venv_torch(python)).endswith("+cpu"):
                        raise SystemExit(f"installed torch {torch} is not a +cpu build; abort")
            versions = _check_versions(python)
        except BaseException:
            if not existed:
                shutil.rmtree(venv, ignore_errors=True)  # never leave a half-made venv
            raise
        seconds = round(time.monotonic() - t0, 1)
        marker.write_text(json.dumps({"install_seconds": seconds, **versions}) + "\n")
        print(f"installed in {seconds:.0f} s: {versions}", flush=True)
        return {"venv": str(venv), "installed_now": True, "install_seconds": seconds,
                **versions}
    versions = _check_versions(python)
    info: dict[str, Any] = {"venv": str(venv), "installed_now": False,
                            "install_seconds": None, **versions}
    with contextlib.suppress(OSError, ValueError):
        info["install_seconds"] = json.loads(marker.read_text())["install_seconds"]
    return info


class WorkerClient:
    """The LMCache worker process, one JSON line per request and per reply."""

    def __init__(self, python: Path, log_path: Path) -> None:
        env = dict(os.environ, LMCACHE_LOG_LEVEL="WARNING", PYTHONUNBUFFERED="1")
        env.pop("PYTHONPATH", None)
        env.pop("VIRTUAL_ENV", None)
        self.log_path = log_path
        self._log: IO[bytes] = log_path.open("wb")
        self.proc = subprocess.Popen(
            [str(python), str(WORKER_SCRIPT)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, env=env,
            cwd=str(ROOT))

    def _tail(self) -> str:
        self._log.flush()
        with contextlib.suppress(OSError):
            return self.log_path.read_text(errors="replace")[-4000:]
        return ""

    def call(self, cmd: str, timeout: float = 900, **kw: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        try:
            self.proc.stdin.write((json.dumps({"cmd": cmd, **kw}) + "\n").encode())
            self.proc.stdin.flush()
        except BrokenPipeError:
            raise RuntimeError(f"LMCache worker died:\n{self._tail()}") from None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            raise RuntimeError(f"LMCache worker: no reply to {cmd} in {timeout} s\n"
                               f"{self._tail()}")
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"LMCache worker exited during {cmd}:\n{self._tail()}")
        resp: dict[str, Any] = json.loads(line)
        if "error" in resp:
            raise RuntimeError(f"LMCache worker failed on {cmd}:\n{resp['error']}")
        return resp

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.call("quit", timeout=60)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


# =========================================================================================
# kvtier side (the repo's venv).
# =========================================================================================


class KvtierSide:
    def __init__(self, chunk: int, count: int, threads: int, src: np.ndarray,
                 workdir: Path) -> None:
        import numpy as np

        from benchmarks.tiers import _meta
        from kvtier.keys import ChunkKey

        self.chunk, self.count, self.workdir = chunk, count, workdir
        self.src = [src[i * chunk : (i + 1) * chunk] for i in range(count)]
        self.dst = [np.ones(chunk, dtype=np.uint8) for _ in range(count)]  # pre-touched
        self.keys = [ChunkKey(secrets.token_bytes(16)) for _ in range(count)]
        self.metas = [_meta(k, chunk) for k in self.keys]
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="peers-kvtier")
        self.host: Any = None
        self.files: dict[bool, Any] = {}
        self.reader: Any = None  # cephfs: the durable tier's directory seen from node 2
        self.cephfs: tuple[Path, Path] | None = None  # (node 1 dir, node 2 dir)

    def _each(self, fn: Callable[[int], Any]) -> list[Any]:
        return list(self.pool.map(fn, range(self.count)))

    def setup(self, kind: str) -> None:
        from kvtier.tiers.file import FileTier
        from kvtier.tiers.host import HostTier

        if kind == "cpu":
            self.host = HostTier(self.chunk * self.count, self.chunk)
            return
        base = self.workdir
        if kind == "cephfs":
            assert self.cephfs is not None
            base = self.cephfs[0]
        self.files = {
            d: FileTier(base / f"kvtier-{kind}-{'durable' if d else 'visible'}",
                        1 << 50, fsync=d)
            for d in (False, True)
        }
        if self.cephfs is not None and kind == "cephfs":
            self.reader = FileTier(self.cephfs[1] / "kvtier-cephfs-durable", 1 << 50)

    def teardown(self) -> None:
        self.host = self.reader = None
        for tier in self.files.values():
            tier.delete(self.keys)
        self.files = {}
        gc.collect()

    def clear(self) -> None:
        if self.host is not None:
            self.host.delete(self.keys)
        for tier in self.files.values():
            tier.delete(self.keys)

    def paths(self) -> list[Path]:
        return [self.files[True].path_of(k) for k in self.keys]

    def _stored(self, statuses: list[Any]) -> None:
        from kvtier.tiers.base import PutStatus

        bad = [s for s in statuses if s is not PutStatus.STORED]
        if bad:
            raise RuntimeError(f"kvtier stored {self.count - len(bad)} of {self.count}: {bad[0]}")

    def _hits(self, metas: list[Any]) -> None:
        misses = sum(m is None for m in metas)
        if misses:
            raise RuntimeError(f"kvtier missed {misses} of {self.count} chunks")

    def run(self, op: str) -> float:
        t0 = time.perf_counter()
        if op == "put":
            host = self.host
            out = self._each(lambda i: host.put(self.metas[i], self.src[i].data))
        elif op == "get":
            host = self.host
            out = self._each(lambda i: host.get_into(self.keys[i], self.dst[i].data))
        elif op in ("write", "write_durable"):
            tier = self.files[op == "write_durable"]
            out = self._each(lambda i: tier.put(self.metas[i], self.src[i].data))
        elif op == "read":
            tier = self.reader if self.reader is not None else self.files[True]
            out = self._each(lambda i: tier.get_into(self.keys[i], self.dst[i].data))
        else:
            raise ValueError(op)
        dt = time.perf_counter() - t0
        (self._hits if op in ("get", "read") else self._stored)(out)
        return dt

    def verify(self) -> bool:
        import numpy as np

        return all(np.array_equal(d, s) for d, s in zip(self.dst, self.src, strict=True))


# =========================================================================================
# Measurement and report.
# =========================================================================================


def _alternate(sides: dict[str, tuple[Callable[[], None], Callable[[], float]]],
               reps: int, nbytes: int) -> dict[str, list[float]]:
    """GB/s of each side per repetition; sides take turns, the order swaps every rep.

    Each side is ``(before, run)``: ``before`` is untimed, ``run`` returns seconds.
    The first repetition is returned too (callers drop it).
    """
    names = list(sides)
    rates: dict[str, list[float]] = {n: [] for n in names}
    for rep in range(reps + 1):
        for name in names if rep % 2 == 0 else names[::-1]:
            before, run = sides[name]
            before()
            rates[name].append(nbytes / run() / GB)
    return rates


class Report:
    def __init__(self, with_lmcache: bool) -> None:
        self.rows: list[dict[str, Any]] = []
        self.with_lmcache = with_lmcache
        print(f"{'path':<34} {'LMCache':>8} {'kvtier':>8} {'kvtier/LMCache':>15}  "
              f"{'target':>7}  result   (GB/s, median)", flush=True)

    def add(self, path: str, op: str, lmcache: str, kvtier: str, rates: dict[str, list[float]],
            target: float) -> None:
        # Every number shown is rounded once, here, so table, JSON and text agree.
        kv = round(statistics.median(rates["kvtier"][1:]), 3)
        lm = round(statistics.median(rates["lmcache"][1:]), 3) if "lmcache" in rates else None
        row: dict[str, Any] = {
            "path": path, "op": op, "lmcache": lmcache, "kvtier": kvtier,
            "lmcache_gbps": lm, "kvtier_gbps": kv,
            "ratio": None, "target": target, "ok": None, "short_pct": None, "miss": None,
            "kvtier_reps_gbps": [round(r, 3) for r in rates["kvtier"]],
            "lmcache_reps_gbps": [round(r, 3) for r in rates.get("lmcache", [])],
        }
        name = f"{path} {op}"
        if lm is None:
            self.rows.append(row)
            print(f"{name:<34} {'-':>8} {kv:8.2f} {'-':>15}  >={target:<5.2f}  skipped",
                  flush=True)
            return
        ratio = round(kv / lm, 3)
        row["ratio"], row["ok"] = ratio, ratio >= target
        if not row["ok"]:
            short = (1 - ratio / target) * 100
            row["short_pct"] = round(short, 1)
            row["miss"] = (f"kvtier/LMCache {ratio:.2f} < {target:.2f}, {short:.0f}% short: "
                           f"kvtier {kv:.2f} GB/s, needs {lm * target:.2f} "
                           f"(+{(target / ratio - 1) * 100:.0f}%)")
        self.rows.append(row)
        res = "ok" if row["ok"] else f"MISS, {row['short_pct']:.0f}% short"
        print(f"{name:<34} {lm:8.2f} {kv:8.2f} {ratio:15.2f}  >={target:<5.2f}  {res}",
              flush=True)

    def summary(self) -> list[str]:
        return [f"MISS {r['path']} {r['op']}: {r['miss']}" for r in self.rows if r["miss"]]

    def markdown(self) -> str:
        lines = ["| Path | LMCache GB/s | kvtier GB/s | kvtier/LMCache | Target | Result |",
                 "|---|---:|---:|---:|---:|---|"]
        for r in self.rows:
            lm = "-" if r["lmcache_gbps"] is None else f"{r['lmcache_gbps']:.2f}"
            ratio = "-" if r["ratio"] is None else f"{r['ratio']:.2f}"
            res = "skipped" if r["ok"] is None else ("ok" if r["ok"] else f"MISS: {r['miss']}")
            lines.append(f"| {r['path']} {r['op']} | {lm} | {r['kvtier_gbps']:.2f} | {ratio} "
                         f"| >= {r['target']:.2f} | {res} |")
        return "\n".join(lines) + "\n"


@contextlib.contextmanager
def _shared_source(total: int, workdir: Path) -> Iterator[tuple[Path, np.ndarray]]:
    """``total`` random bytes in a file both processes map: the same chunks for both."""
    import mmap

    import numpy as np

    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else workdir
    path = base / f"kvtier-peers-{os.getpid()}-{secrets.token_hex(4)}.src"
    rng = np.random.default_rng(0)
    try:
        with path.open("wb") as f:
            left = total
            while left:
                n = min(left, 64 << 20)
                f.write(rng.bytes(n))
                left -= n
        with path.open("rb") as f:
            mm = mmap.mmap(f.fileno(), total, access=mmap.ACCESS_READ)
        arr = np.frombuffer(mm, dtype=np.uint8)
        int(arr[:: mmap.PAGESIZE].sum())  # map every page now
        yield path, arr
    finally:
        with contextlib.suppress(OSError):
            path.unlink()


def _sync() -> None:
    os.sync()


def run(args: argparse.Namespace, chunk: int, total: int) -> dict[str, Any]:
    from benchmarks.machine import describe
    from benchmarks.tiers import _drop_cache

    tokens = chunk // TOKEN_BYTES
    count = max(1, total // chunk)
    nbytes = chunk * count
    lm_info: dict[str, Any] | None = None
    if not args.skip_lmcache:
        lm_info = ensure_lmcache_venv(Path(args.lmcache_venv))
    load_before = os.getloadavg()
    print(f"{count} chunks of {chunk / 2**20:.2f} MiB ({tokens} tokens), "
          f"{nbytes / 2**20:.0f} MiB per measurement, {args.threads} threads, "
          f"{args.reps} reps (+1 dropped)", flush=True)
    with tempfile.TemporaryDirectory(prefix="kvtier-peers-", dir=args.workdir) as tmp, \
            _shared_source(nbytes, Path(tmp)) as (src_path, src):
        work = Path(tmp)
        kv = KvtierSide(chunk, count, args.threads, src, work)
        lm: WorkerClient | None = None
        report = Report(lm_info is not None)
        notes: dict[str, Any] = {}
        servers: dict[str, str] = {}
        stack = contextlib.ExitStack()
        try:
            if lm_info is not None:
                lm = WorkerClient(Path(args.lmcache_venv) / "bin" / "python",
                                  work / "lmcache-worker.log")
                lm_info.update(lm.call("init", chunk=chunk, count=count, tokens=tokens,
                                       threads=args.threads, src=str(src_path),
                                       workdir=str(work)))
            kinds = [k for k in KINDS if k in args.paths.split(",")]
            for kind in kinds:
                if kind == "fs" and lm is None:
                    continue  # without LMCache, fs:// would only repeat the disk numbers
                link = None
                if kind == "cephfs":
                    node1, node2 = _cephfs(stack, work)
                    kv.cephfs = (node1, node2)
                    link = (work / "lmcache-cephfs", node1 / "lmcache-fs", node2 / "lmcache-fs")
                    link[1].mkdir()
                    _point(link[0], link[1])
                    notes["cephfs"] = servers = _ceph_description()
                kv.setup(kind)
                if lm is not None:
                    root = None if link is None else str(link[0])
                    notes[f"lmcache_{kind}_setup"] = lm.call("setup", kind=_lm_kind(kind),
                                                             root=root)
                _measure_kind(kind, kv, lm, report, args.reps, nbytes, _drop_cache, link)
                if lm is not None:
                    lm.call("teardown")
                kv.teardown()
        finally:
            if lm is not None:
                lm.close()
            stack.close()
    out: dict[str, Any] = {
        "benchmark": "peers",
        "chunk_bytes": chunk, "chunk_tokens": tokens, "total_bytes": nbytes, "count": count,
        "threads": args.threads, "reps": args.reps, "quick": args.quick,
        "model_geometry": {"layers": LAYERS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM,
                           "dtype": "bfloat16", "token_bytes": TOKEN_BYTES},
        "machine": {**describe(), "loadavg_before": [round(x, 2) for x in load_before],
                    "loadavg_after": [round(x, 2) for x in os.getloadavg()]},
        "lmcache_venv": lm_info,
        "targets": {"every_path": TARGET, "durable_write": DURABLE_TARGET},
        "method": {
            "alternation": "one repetition per side in turn, order swapped every repetition",
            "dropped": "first repetition", "statistic": "median",
            "cold_read": "fsync + posix_fadvise(DONTNEED) on every file of both sides",
            "write_prep": "previous objects deleted, then sync, untimed",
            "lmcache_durable": "fsync of each file from LMCache's per-chunk completion "
                               "callback, on LMCache's own I/O threads: inline in the "
                               "LocalDiskBackend writer thread; on the event loop's "
                               "executor (FSConnector's aiofiles threads) for fs://",
            "lmcache_disk_write_source": "chunks already in LMCache MemoryObjs (allocation "
                                         "and copy untimed), like kvtier writing from memory",
            "lmcache_threads": "disk_io_threads and the asyncio default executor (fs://) "
                               "set to --threads; CPU copies by a pool of --threads Python "
                               "threads, one chunk each, torch intra-op threads 1",
            "kvtier_threads": "a ThreadPoolExecutor of --threads calling the tier per chunk",
        },
        "setup": notes,
        "servers": servers,
        "rows": report.rows,
        "misses": report.summary(),
    }
    for line in report.summary():
        print(line)
    out["markdown"] = report.markdown()
    return out


KINDS = ("cpu", "disk", "fs", "cephfs")


def _lm_kind(kind: str) -> str:
    """LMCache's side of a path: CephFS is its fs:// backend in a CephFS directory."""
    return "fs" if kind == "cephfs" else kind


def _point(link: Path, target: Path) -> None:
    """Atomically make ``link`` a symlink to ``target``."""
    tmp = link.with_name(link.name + ".new")
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(target)
    os.replace(tmp, link)


def _cephfs(stack: contextlib.ExitStack, work: Path) -> tuple[Path, Path]:
    """A throwaway Ceph cluster (stopped by ``stack``): the same new directory as seen
    from two ``ceph-fuse`` mounts, node 1 and node 2."""
    from benchmarks.tiers import CEPH_MEMSTORE_BYTES
    from kvtier.testing.ceph import ceph_cluster

    cluster = stack.enter_context(ceph_cluster(work / "ceph",
                                               memstore_bytes=CEPH_MEMSTORE_BYTES))
    node1, node2 = cluster.mount("node1"), cluster.mount("node2")
    (node1 / "peers").mkdir()
    return node1 / "peers", node2 / "peers"


def _ceph_description() -> dict[str, str]:
    from benchmarks.tiers import ceph_version

    return {"server": f"CephFS {ceph_version()}, memstore OSD (RAM), 127.0.0.1",
            "client": "ceph-fuse; writes on node 1, cold reads on node 2 (a second mount)"}


def _measure_kind(kind: str, kv: KvtierSide, lm: WorkerClient | None, report: Report,
                  reps: int, nbytes: int, drop_cache: Callable[[list[Path]], None],
                  link: tuple[Path, Path, Path] | None = None) -> None:
    """``link``, for cephfs: (LMCache's fs:// directory, a symlink; node 1's; node 2's)."""
    def kv_clear() -> None:
        kv.clear()
        if kind != "cpu":
            _sync()

    def lm_clear() -> None:
        assert lm is not None
        lm.call("clear")
        if kind != "cpu":
            _sync()

    def lm_run(op: str) -> Callable[[], float]:
        def go() -> float:
            assert lm is not None
            return float(lm.call("run", op=op)["seconds"])
        return go

    def kv_run(op: str) -> Callable[[], float]:
        return lambda: kv.run(op)

    def measure(op: str, kv_before: Callable[[], None],
                lm_before: Callable[[], None]) -> dict[str, list[float]]:
        sides = {"kvtier": (kv_before, kv_run(op))}
        if lm is not None:
            sides["lmcache"] = (lm_before, lm_run(op))
        rates = _alternate(sides, reps, nbytes)
        if op in ("get", "read"):
            _verify(kv, lm)
        return rates

    def nothing() -> None:
        pass

    if kind == "cpu":
        lm_name = "LocalCPUBackend (StorageManager)"
        report.add("cpu", "put", lm_name + ": allocate+copy_+batched_put", "HostTier.put",
                   measure("put", kv_clear, lm_clear), TARGET)
        report.add("cpu", "get", lm_name + ": batched_get+copy_ out", "HostTier.get_into",
                   measure("get", nothing, nothing), TARGET)
        return
    lm_name = ("LocalDiskBackend" if kind == "disk" else "RemoteBackend fs://localhost:1/dir")
    label = {"disk": "disk", "fs": "fs://", "cephfs": "CephFS (ceph-fuse)"}[kind]
    if kind == "cephfs":
        lm_name = "RemoteBackend fs:// on CephFS"
    report.add(label, "write visible", lm_name + " (no fsync)", "FileTier(fsync=False)",
               measure("write", kv_clear, lm_clear), TARGET)
    report.add(label, "write durable", lm_name + " + fsync from outside",
               "FileTier(fsync=True)", measure("write_durable", kv_clear, lm_clear),
               DURABLE_TARGET)
    if link is not None:
        report.add(label, "cold read", lm_name + ": StorageManager.batched_get on node 2",
                   "FileTier.get_into on node 2", measure("read", *_rewrite(kv, lm, link)),
                   TARGET)
        return
    lm_paths = [Path(p) for p in lm.call("paths")["paths"]] if lm is not None else []
    report.add(label, "cold read", lm_name + ": StorageManager.batched_get",
               "FileTier.get_into",
               measure("read", lambda: drop_cache(kv.paths()), lambda: drop_cache(lm_paths)),
               TARGET)


def _rewrite(kv: KvtierSide, lm: WorkerClient | None,
             link: tuple[Path, Path, Path]) -> tuple[Callable[[], None], Callable[[], None]]:
    """Untimed steps ahead of a cold read on node 2: node 1 deletes and writes every
    object again (durably), so node 2 has none of the new files cached."""

    def kv_before() -> None:
        kv.clear()
        kv.run("write_durable")
        _sync()

    def lm_before() -> None:
        assert lm is not None
        _point(link[0], link[1])
        lm.call("clear")
        lm.call("run", op="write_durable")
        _sync()
        _point(link[0], link[2])

    return kv_before, lm_before


def _verify(kv: KvtierSide, lm: WorkerClient | None) -> None:
    if not kv.verify():
        raise RuntimeError("kvtier returned bytes that differ from what was stored")
    if lm is not None and not lm.call("verify")["ok"]:
        raise RuntimeError("LMCache returned bytes that differ from what was stored")


def write_results(out: dict[str, Any], path: Path) -> None:
    """``path`` (JSON) and the same table as Markdown next to it (``.md``)."""
    md = out.pop("markdown")
    m = out["machine"]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2) + "\n")
    path.with_suffix(".md").write_text(
        f"kvtier vs LMCache {LMCACHE_VERSION}: {out['count']} chunks of "
        f"{out['chunk_bytes'] / 2**20:.2f} MiB ({out['chunk_tokens']} tokens), "
        f"{out['threads']} threads, median of {out['reps']} repetitions (GB/s), "
        f"{m['cores']} cores, load average {m['loadavg_before'][0]} before and "
        f"{m['loadavg_after'][0]} after.\n\n{md}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chunk", default="3MiB",
                    help=f"chunk size, a multiple of {TOKEN_BYTES} bytes (one token of the "
                         "default 12-layer model); default 3MiB = 256 tokens")
    ap.add_argument("--total", default="512MiB", help="bytes moved per measurement")
    ap.add_argument("--threads", type=int, default=2, help="threads on each side")
    ap.add_argument("--reps", type=int, default=5, help="repetitions kept (one more is dropped)")
    ap.add_argument("--paths", default="cpu,disk,fs",
                    help=f"subset of {','.join(KINDS)} (cephfs starts a Ceph cluster)")
    ap.add_argument("--quick", action="store_true",
                    help="tiny sizes and few repetitions, for a smoke test")
    ap.add_argument("--skip-lmcache", action="store_true",
                    help="measure kvtier only; never creates the LMCache venv")
    ap.add_argument("--lmcache-venv", default=str(DEFAULT_VENV))
    ap.add_argument("--workdir", default=None, help="directory for files (default: tmp)")
    ap.add_argument("--out", default=str(Path(_HERE) / "results" / "peers.json"))
    args = ap.parse_args(argv)

    from kvtier.sizes import parse_size

    if args.quick:
        args.chunk, args.total, args.reps = str(64 * TOKEN_BYTES), "12MiB", 2
    chunk, total = parse_size(args.chunk), parse_size(args.total)
    if chunk <= 0 or chunk % TOKEN_BYTES:
        ap.error(f"--chunk must be a positive multiple of {TOKEN_BYTES} bytes, got {chunk}")
    if args.threads < 1 or args.reps < 1:
        ap.error("--threads and --reps must be >= 1")
    out = run(args, chunk, total)
    path = Path(args.out)
    write_results(out, path)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
