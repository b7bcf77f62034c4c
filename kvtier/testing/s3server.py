"""A real S3 endpoint on 127.0.0.1 for tests: a ``moto`` server in its own process.

Test support only. Invariants:

* The server is a child process (``python -m moto.server``) bound to 127.0.0.1 on a free
  port, so clients talk real HTTP to it exactly as they would to S3, and stopping it really
  takes the endpoint away (connections are refused afterwards).
* ``MotoServer.stop`` always reaps the child (terminate, then kill after a grace period);
  ``moto_server()`` stops it on every exit path. ``pause``/``resume`` (SIGSTOP/SIGCONT)
  turn it into an endpoint that accepts connections but never answers: a slow S3.
* ``dummy_credentials()`` points the standard boto3 credential chain at fixed test keys
  and away from the developer's own AWS config, and restores the environment on exit.
* ``validate_credentials=True`` starts a server that authenticates every request
  (moto's ``INITIAL_NO_AUTH_ACTION_COUNT=0``), so unknown access keys get HTTP 403.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import IO

DUMMY_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",  # no 1-second IMDS probes when keys are missing
    "AWS_CONFIG_FILE": os.devnull,
    "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
}
_UNSET = ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN")
_START_TIMEOUT = 30.0


@contextlib.contextmanager
def dummy_credentials() -> Iterator[None]:
    """Set fixed test credentials in ``os.environ`` for the duration of the block."""
    saved = {k: os.environ.get(k) for k in (*DUMMY_ENV, *_UNSET)}
    os.environ.update(DUMMY_ENV)
    for k in _UNSET:
        os.environ.pop(k, None)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class MotoServer:
    """One moto server process. ``start()`` returns once it answers HTTP."""

    def __init__(self, *, validate_credentials: bool = False) -> None:
        self._validate = validate_credentials
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None
        self.endpoint_url = ""

    def start(self) -> str:
        if self._proc is not None:
            raise RuntimeError(f"moto server already running at {self.endpoint_url}")
        last = ""
        for _ in range(3):  # the free port can be taken between probe and bind
            port = _free_port()
            if self._spawn(port):
                return self.endpoint_url
            last = self._log_tail()
            self.stop()
        raise RuntimeError(f"moto server did not start: {last}")

    def _spawn(self, port: int) -> bool:
        env = {**os.environ, "MOTO_PORT": str(port)}
        if self._validate:
            env["INITIAL_NO_AUTH_ACTION_COUNT"] = "0"
        self._log = tempfile.TemporaryFile()  # noqa: SIM115 (closed by stop())
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
        )
        self.endpoint_url = f"http://127.0.0.1:{port}"
        return self._wait_ready()

    def _wait_ready(self) -> bool:
        assert self._proc is not None
        deadline = time.monotonic() + _START_TIMEOUT
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                return False
            try:
                with urllib.request.urlopen(f"{self.endpoint_url}/moto-api/", timeout=5):
                    return True
            except urllib.error.HTTPError:
                return True  # it answered HTTP, so it is serving
            except OSError:
                time.sleep(0.05)  # not listening yet: readiness poll, not test timing
        return False

    def _log_tail(self) -> str:
        if self._log is None:
            return ""
        self._log.seek(0)
        return self._log.read()[-2000:].decode("utf-8", "replace")

    def pause(self) -> None:
        """Freeze the server: it keeps accepting TCP connections but never answers."""
        assert self._proc is not None
        self._proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self._proc is not None
        self._proc.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        """Stop and reap the server process. Idempotent."""
        proc, self._proc = self._proc, None
        if proc is not None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGCONT)  # a paused process cannot exit
                proc.terminate()
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self._log is not None:
            self._log.close()
            self._log = None


@contextlib.contextmanager
def moto_server(*, validate_credentials: bool = False) -> Iterator[str]:
    """A running moto server and dummy credentials; yields its endpoint URL."""
    server = MotoServer(validate_credentials=validate_credentials)
    with dummy_credentials():
        try:
            yield server.start()
        finally:
            server.stop()
