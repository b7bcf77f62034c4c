"""The LMCache half of ``benchmarks/peers.py``: a worker that drives LMCache 0.5.6's storage.

It runs in the LMCache venv (``.venv-lmcache``, made by peers.py), never in the repo's own
venv: ``benchmarks/peers.py`` starts it as ``<venv>/bin/python benchmarks/peers_lmcache.py``
and keeps the kvtier half in its own process. Run by hand, it serves stdin until ``quit``.

Protocol: one JSON object per line on stdin, one JSON reply per line on stdout, in order.

    {"cmd": "init", "chunk": bytes, "count": n, "tokens": t, "threads": n,
     "src": shared source file, "workdir": dir}       -> {"torch", "lmcache", "python"}
    {"cmd": "setup", "kind": "cpu" | "disk" | "fs",   -> {"pool_pretouched", "shape"}
     "root": fs:// directory (optional; default <workdir>/lmcache-<kind>)}
    {"cmd": "run", "op": "put" | "get" | "write" | "write_durable" | "read"}
                                                      -> {"seconds": float}
    {"cmd": "clear"} / {"cmd": "teardown"}            -> {}
    {"cmd": "paths"}                                  -> {"paths": [file of each chunk]}
    {"cmd": "verify"}                                 -> {"ok": bool}
    {"cmd": "quit"}                                   -> {}, then the worker exits

A request that fails answers ``{"error": traceback}`` and the worker keeps serving.

Invariants:

* Standard library only at import time; torch and lmcache are imported lazily, inside
  ``LMCacheSide``. peers.py imports this module from the repo's venv for the shared
  geometry (``LAYERS`` ... ``TOKEN_BYTES``), which is defined here and nowhere else.
* Never imports ``kvtier`` or ``benchmarks``: the LMCache venv has neither.
* stdout carries replies only: the worker keeps a copy of fd 1 for them and points fd 1
  at stderr, where LMCache's own logging to stdout ends up.
* ``seconds`` is timed inside the worker around the LMCache calls alone; the pipe, the
  JSON and the untimed preparation (``setup``, ``clear``) are never part of it.
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":
    # Run as a script, this file's folder heads sys.path, where a benchmark module could
    # shadow a standard one: drop it. Nothing is added; the worker needs no repo module.
    _HERE = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]

import gc
import json
import threading
import time
import traceback
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

# The default model of the restore ladder: 12 layers, 4 KV heads of 64, bf16.
LAYERS, KV_HEADS, HEAD_DIM, DTYPE_BYTES = 12, 4, 64, 2
TOKEN_BYTES = 2 * LAYERS * KV_HEADS * HEAD_DIM * DTYPE_BYTES  # 12 KiB of K and V


def _fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class LMCacheSide:
    """Drives LMCache's StorageManager and backends on the chunks it is told about."""

    def __init__(self, req: dict[str, Any]) -> None:
        import torch
        from lmcache.utils import CacheEngineKey

        self.torch = torch
        self.chunk: int = req["chunk"]
        self.count: int = req["count"]
        self.tokens: int = req["tokens"]
        self.threads: int = req["threads"]
        self.workdir = Path(req["workdir"])
        # Whole chunks are copied by a pool of `threads` Python threads, one chunk per
        # thread, as on the kvtier side; torch's own OpenMP threads stay at 1 (with 2 of
        # them, a barrier on this shared 2-core machine can stall a 3 MiB copy_ for a
        # whole scheduler tick).
        torch.set_num_threads(1)
        self.pool = ThreadPoolExecutor(self.threads, thread_name_prefix="peers-copy")
        total = self.chunk * self.count
        src = torch.from_file(req["src"], shared=True, size=total, dtype=torch.uint8)
        int(src[:: 4096].sum())  # map every page of the shared source now
        self.src = [src[i * self.chunk : (i + 1) * self.chunk] for i in range(self.count)]
        self.dst = [torch.ones(self.chunk, dtype=torch.uint8) for _ in range(self.count)]
        self.keys = [
            CacheEngineKey("kvtier-peers", 1, 0, i + 1, torch.bfloat16) for i in range(self.count)
        ]
        self.kind: str | None = None
        self.sm: Any = None
        self.backend: Any = None
        self.backend_name = ""
        self.objs: list[Any] = []  # disk/fs: the chunks, already in LMCache's memory
        self.shape: Any = None
        self.executor: ThreadPoolExecutor | None = None

    def info(self) -> dict[str, Any]:
        from importlib import metadata

        return {"torch": metadata.version("torch"), "lmcache": metadata.version("lmcache"),
                "python": sys.version.split()[0]}

    def _u8(self, obj: Any) -> Any:
        return obj.tensor.view(self.torch.uint8).view(-1)

    # -- setup -----------------------------------------------------------------------
    def setup(self, kind: str, root: str | None = None) -> dict[str, Any]:
        import asyncio

        from lmcache.v1.config import LMCacheEngineConfig
        from lmcache.v1.event_manager import EventManager
        from lmcache.v1.metadata import LMCacheMetadata
        from lmcache.v1.storage_backend.storage_manager import StorageManager

        torch = self.torch
        total = self.chunk * self.count
        # Room for every chunk (cpu), or for the chunks plus one read of all of them.
        pool = (total if kind == "cpu" else 2 * total) * 1.1 + (64 << 20)
        path = Path(root) if root else self.workdir / f"lmcache-{kind}"
        path.mkdir(parents=True, exist_ok=True)
        cfg = LMCacheEngineConfig.from_defaults(
            chunk_size=self.tokens,
            local_cpu=kind == "cpu",
            max_local_cpu_size=pool / 2**30,
            local_disk=str(path) if kind == "disk" else None,
            # LocalDiskBackend.remove() never gives the bytes back to its size
            # accounting, so a small limit would refuse writes after a few repetitions.
            max_local_disk_size=1e6 if kind == "disk" else 0.0,
            # fs:///path parses without a host and silently leaves the backend
            # disconnected; the host:port part is required and ignored.
            remote_url=f"fs://localhost:1{path}" if kind == "fs" else None,
            remote_serde="naive",
            extra_config={"disk_io_threads": self.threads},
        )
        md = LMCacheMetadata(
            model_name="kvtier-peers", world_size=1, local_world_size=1, worker_id=0,
            local_worker_id=0, kv_dtype=torch.bfloat16,
            kv_shape=(LAYERS, 2, self.tokens, KV_HEADS, HEAD_DIM), role="worker",
            chunk_size=self.tokens,
        )
        self.sm = StorageManager(cfg, md, EventManager())
        self.kind = kind
        self.shape = md.get_shapes()[0]
        cpu = self.sm.storage_backends["LocalCPUBackend"]
        buf = getattr(cpu.memory_allocator, "buffer", None)
        touched = buf is not None
        if buf is not None:
            buf.fill_(1)  # pre-touch LMCache's whole pool, as kvtier's HostPool does
        if kind == "cpu":
            self.backend_name = "LocalCPUBackend"
        elif kind == "disk":
            self.backend_name = "LocalDiskBackend"
        else:
            self.backend_name = "RemoteBackend"
        self.backend = self.sm.storage_backends[self.backend_name]
        if kind == "fs":
            if self.backend.connection is None:
                raise RuntimeError("LMCache's fs:// backend did not connect")
            # FSConnector does its file I/O through aiofiles, i.e. the event loop's
            # default executor: give it the same number of threads as everyone else.
            self.executor = ThreadPoolExecutor(self.threads, thread_name_prefix="peers-aio")

            async def _set_executor() -> None:
                assert self.executor is not None
                asyncio.get_running_loop().set_default_executor(self.executor)

            asyncio.run_coroutine_threadsafe(_set_executor(), self.sm.loop).result(30)
        if kind != "cpu":
            self.objs = []
            for s in self.src:
                obj = self.sm.allocate(self.shape, torch.bfloat16)
                if obj is None:
                    raise RuntimeError("LMCache could not allocate the source chunks")
                self._u8(obj).copy_(s)
                self.objs.append(obj)
        return {"pool_pretouched": touched, "shape": list(self.shape)}

    def teardown(self) -> dict[str, Any]:
        if self.kind != "cpu":
            self.clear()
        for obj in self.objs:
            obj.ref_count_down()
        self.objs = []
        if self.sm is not None:
            self.sm.close()
        self.sm = self.backend = None
        if self.executor is not None:
            self.executor.shutdown()
            self.executor = None
        gc.collect()
        return {}

    # -- paths -----------------------------------------------------------------------
    def path_of(self, key: Any) -> str:
        if self.kind == "disk":
            return str(self.backend._key_to_path(key))
        return str(self.backend.connection.getWrappedConnector()._get_file_path(key))

    def paths(self) -> dict[str, Any]:
        return {"paths": [self.path_of(k) for k in self.keys]}

    def clear(self) -> dict[str, Any]:
        if self.kind == "cpu":
            self.sm.batched_remove(self.keys, locations=["LocalCPUBackend"])
        else:
            for k in self.keys:
                if os.path.exists(self.path_of(k)) or self.backend.contains(k):
                    self.backend.remove(k)
        return {}

    # -- operations ------------------------------------------------------------------
    def cpu_put(self) -> float:
        torch = self.torch

        def one(i: int) -> Any:
            obj = self.sm.allocate(self.shape, torch.bfloat16)
            if obj is None:
                raise RuntimeError("LMCache CPU pool is full")
            self._u8(obj).copy_(self.src[i])
            return obj

        t0 = time.perf_counter()
        objs = list(self.pool.map(one, range(self.count)))
        self.sm.batched_put(self.keys, objs)
        return time.perf_counter() - t0

    def cpu_get(self) -> float:
        t0 = time.perf_counter()
        objs = self.sm.batched_get(self.keys, location="LocalCPUBackend")
        if any(o is None for o in objs):
            raise RuntimeError("LMCache CPU backend missed a chunk")

        def one(i: int) -> None:
            self.dst[i].copy_(self._u8(objs[i]))
            objs[i].ref_count_down()

        list(self.pool.map(one, range(self.count)))
        return time.perf_counter() - t0

    def write(self, durable: bool) -> float:
        """Write every chunk; ``durable`` adds an fsync of each file as soon as LMCache
        reports it written, on LMCache's own I/O threads (so both sides use the same
        number): inline in the disk backend's writer thread, and on the event loop's
        executor (where FSConnector's aiofiles writes run) for fs://."""
        import asyncio

        n = len(self.keys)
        done = threading.Event()
        lock = threading.Lock()
        left = [n]
        errors: list[BaseException] = []
        failed_before = getattr(self.backend, "put_failed_count", 0)
        loop = self.sm.loop

        def one_done(fut: Future[None] | None = None) -> None:
            if fut is not None and fut.exception() is not None:
                errors.append(fut.exception())  # type: ignore[arg-type]
            with lock:
                left[0] -= 1
                if left[0] == 0:
                    done.set()

        async def fsync_on_executor(path: str) -> None:
            await asyncio.get_running_loop().run_in_executor(None, _fsync_path, path)

        def written(key: Any) -> None:
            if not durable:
                one_done()
            elif self.kind == "disk":  # called in LocalDiskBackend's writer thread
                try:
                    _fsync_path(self.path_of(key))
                except BaseException as e:
                    errors.append(e)
                one_done()
            else:  # called on the event loop thread: do not block it
                fut = asyncio.run_coroutine_threadsafe(
                    fsync_on_executor(self.path_of(key)), loop)
                fut.add_done_callback(one_done)

        t0 = time.perf_counter()
        self.backend.batched_submit_put_task(self.keys, self.objs, on_complete_callback=written)
        if not done.wait(600):
            raise RuntimeError(f"LMCache wrote only {n - left[0]} of {n} chunks in 600 s")
        dt = time.perf_counter() - t0
        if errors:
            raise RuntimeError(f"fsync failed: {errors[0]!r}")
        if getattr(self.backend, "put_failed_count", 0) != failed_before:
            raise RuntimeError("LMCache reported failed puts")
        missing = [k for k in self.keys if not os.path.exists(self.path_of(k))]
        if missing:
            raise RuntimeError(f"{len(missing)} chunks missing after LMCache's put")
        return dt

    def read(self) -> float:
        t0 = time.perf_counter()
        objs = self.sm.batched_get(self.keys, location=self.backend_name)
        dt = time.perf_counter() - t0
        bad = sum(o is None for o in objs)
        for obj in objs:
            if obj is not None:
                obj.ref_count_down()
        if bad:
            raise RuntimeError(f"LMCache missed {bad} of {len(objs)} chunks")
        return dt

    def verify(self) -> dict[str, Any]:
        """Untimed: the bytes that come back are the bytes that went in."""
        torch = self.torch
        if self.kind == "cpu":
            ok = all(torch.equal(d, s) for d, s in zip(self.dst, self.src, strict=True))
        else:
            objs = self.sm.batched_get(self.keys, location=self.backend_name)
            ok = all(o is not None and torch.equal(self._u8(o), s)
                     for o, s in zip(objs, self.src, strict=True))
            for o in objs:
                if o is not None:
                    o.ref_count_down()
        return {"ok": bool(ok)}

    def handle(self, req: dict[str, Any]) -> dict[str, Any]:
        cmd = req["cmd"]
        if cmd == "setup":
            return self.setup(req["kind"], req.get("root"))
        if cmd == "teardown":
            return self.teardown()
        if cmd == "clear":
            return self.clear()
        if cmd == "paths":
            return self.paths()
        if cmd == "verify":
            return self.verify()
        if cmd == "run":
            op = req["op"]
            if op == "put":
                return {"seconds": self.cpu_put()}
            if op == "get":
                return {"seconds": self.cpu_get()}
            if op in ("write", "write_durable"):
                return {"seconds": self.write(op == "write_durable")}
            if op == "read":
                return {"seconds": self.read()}
        raise ValueError(f"unknown request {req!r}")


def worker_main() -> int:
    """Serve requests on stdin; replies go to the original stdout, everything else to
    stderr (LMCache logs to stdout)."""
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    side: LMCacheSide | None = None
    for line in sys.stdin:
        req = json.loads(line)
        try:
            if req["cmd"] == "quit":
                proto.write("{}\n")
                break
            if req["cmd"] == "init":
                side = LMCacheSide(req)
                resp = side.info()
            else:
                assert side is not None, "init first"
                resp = side.handle(req)
        except Exception:
            resp = {"error": traceback.format_exc()}
        proto.write(json.dumps(resp) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(worker_main())
