"""A stopped API server keeps its write-back cache: a restarted one restores conversations.

Host tier + a *write-back* file tier: while the server runs, a conversation's chunks live
only in the host pool (dirty). The ways a server is stopped, shown here with a real
SIGTERM and a restart that restores the conversation with tokens identical to
a recompute, wherever the design promises it (README, "What survives a stop"):

* SIGTERM to the API server only (Kubernetes, ``docker stop``, systemd ``KillMode=mixed``)
  or to the whole process group (systemd's default ``control-group``), each
* with vLLM's default ``--shutdown-timeout 0``: the API server SIGKILLs the engine core
  milliseconds after its SIGTERM, so no flush can run then. What is promised is what
  ``max_dirty_seconds`` wrote: the test stops the server once that bound has passed;
* with ``--shutdown-timeout 30``: the stop signal starts a flush at once (kvtier chains
  vLLM's engine-core handler), the engine loop stays up until it is done, and the
  connector's ``shutdown()`` finishes it. The test stops the server right after the
  request, with ``max_dirty_seconds`` and the idle flush out of the way.

Two paths cover both signal targets and both timeouts (each server start costs about
45 s here): SIGTERM to the API server with ``--shutdown-timeout 30``, and to the process
group with the default 0. One server is started per path; each restart checks the
previous path, then is stopped the next way.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvtier.testing.engines import tokens
from kvtier.testing.servers import APIServer
from kvtier.vllm.settings import kv_transfer_config
from tests.vllm.conftest import write_config

pytestmark = pytest.mark.vllm

PROMPTS = {path: tokens(900, seed=1300 + i) for i, path in enumerate(
    ["api-30", "group-0"])}  # three full 256-token chunks and a tail
DRAIN = ["--shutdown-timeout", "30"]


def complete(url: str, prompt: list[int], **extra: Any) -> dict[str, Any]:
    body = {"model": "model", "prompt": prompt, "max_tokens": 16, "temperature": 0,
            "ignore_eos": True, **extra}
    r = httpx.post(url + "/v1/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def reference(url: str, prompt: list[int]) -> str:
    """A full recompute: kvtier bypassed, and a salt no cached block shares."""
    r = complete(url, prompt, cache_salt="reference",
                 kv_transfer_params={"kvtier": {"load": False, "save": False}})
    text: str = r["choices"][0]["text"]
    return text


def restored(resp: dict[str, Any]) -> dict[str, int]:
    by_tier: dict[str, int] = resp["kv_transfer_params"]["kvtier"]["restored_by_tier"]
    return by_tier


def objects(store: Path) -> int:
    return len(list(store.rglob("*.kv")))


def _wait_objects(store: Path, n: int, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while objects(store) < n:
        assert time.monotonic() < deadline, f"{n} objects never reached the write-back tier"
        time.sleep(0.2)  # polling another process, not driving test time


def test_every_stop_path_keeps_what_the_design_promises(
    tiny_fp32: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    tmp = tmp_path_factory.mktemp("rs")  # vLLM's IPC socket paths must stay short
    store = tmp / "store"
    tier = [{"file": {"path": str(store), "capacity": "1GiB", "write": "back"}}]
    # timeout 0: only max_dirty_seconds writes (no idle flush), and the test waits for it
    aged = kv_transfer_config(write_config(tmp / "aged.yaml", tier, idle_flush_seconds=0,
                                           max_dirty_seconds=1))
    # timeout 30: nothing is written before the stop signal
    held = kv_transfer_config(write_config(tmp / "held.yaml", tier, idle_flush_seconds=0,
                                           max_dirty_seconds=0, shutdown_flush_seconds=20))
    plan = [("api-30", held, DRAIN), ("group-0", aged, [])]
    previous: tuple[str, str] | None = None  # (path, its reference text)
    for i, (path, cfg, args) in enumerate([*plan, ("check", held, [])]):
        with APIServer(tmp, model=tiny_fp32, name=f"s{i}", kv_transfer_config=cfg,
                       extra_args=args) as srv:
            if previous is not None:
                r = complete(srv.url, PROMPTS[previous[0]])
                assert restored(r).get("file1", 0) >= 768, f"after {previous[0]}"
                assert r["choices"][0]["text"] == previous[1], f"after {previous[0]}"
            if path == "check":
                break
            ref = reference(srv.url, PROMPTS[path])
            before = objects(store)
            assert not restored(complete(srv.url, PROMPTS[path]))
            if args:  # stopped right after the request: the stop signal's flush
                assert objects(store) == before, "nothing below before the stop"
            else:  # stopped once max_dirty_seconds has written the chunks
                _wait_objects(store, before + 3)
            code = srv.terminate_main() if path.startswith("api") else srv.terminate_group()
            assert code is not None, f"{path}: the server did not stop"
            srv.proc = None  # stopped: nothing left for __exit__
        assert objects(store) >= before + 3, f"{path}: the chunks are below"
        previous = (path, ref)
