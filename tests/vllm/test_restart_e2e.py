"""A stopped API server keeps its write-back cache: a restarted one restores conversations.

Host tier + a *write-back* file tier: while the server runs, a conversation's chunks live
only in the host pool (dirty). Before issue 12 a restart restored nothing. Two paths
write them below, and each is shown here with a real SIGTERM (as systemd and Kubernetes
stop a server) and a restart that restores the next turn with tokens identical to a
recompute:

* the idle flush: vLLM's default ``--shutdown-timeout 0`` kills the engine core at once
  after SIGTERM, so what an idle engine wrote in the background is what survives;
* the shutdown flush: with a drain window (``--shutdown-timeout 30``), the connector's
  ``shutdown()`` writes what is dirty, most recently used first. The signal goes to the
  API server process only, as Kubernetes and ``docker stop`` send it (see
  ``APIServer.terminate_main``).
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

P_IDLE = tokens(900, seed=1301)  # three full 256-token chunks and a tail
P_SHUTDOWN = tokens(900, seed=1302)


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


def test_a_restarted_server_restores_what_the_idle_and_the_shutdown_flush_wrote(
    tiny_fp32: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    tmp = tmp_path_factory.mktemp("rs")  # vLLM's IPC socket paths must stay short
    store = tmp / "store"
    tier = [{"file": {"path": str(store), "capacity": "1GiB", "write": "back"}}]
    idle = kv_transfer_config(write_config(tmp / "idle.yaml", tier, idle_flush_seconds=1))
    no_idle = kv_transfer_config(write_config(tmp / "shutdown.yaml", tier,
                                              idle_flush_seconds=0, shutdown_flush_seconds=20))
    drain = ["--shutdown-timeout", "30"]

    with APIServer(tmp, model=tiny_fp32, name="first", kv_transfer_config=idle) as srv:
        ref_idle = reference(srv.url, P_IDLE)
        assert not restored(complete(srv.url, P_IDLE))
        deadline = time.monotonic() + 60
        while objects(store) < 3:  # the engine is idle now: the flusher writes
            assert time.monotonic() < deadline, "the idle flush wrote nothing"
            time.sleep(0.2)  # polling another process, not driving test time
    # SIGTERM with vLLM's default --shutdown-timeout 0: the engine core is killed at once.

    with APIServer(tmp, model=tiny_fp32, name="second", kv_transfer_config=no_idle,
                   extra_args=drain) as srv:
        r = complete(srv.url, P_IDLE)
        assert restored(r).get("file1", 0) >= 768
        assert r["choices"][0]["text"] == ref_idle
        before = objects(store)
        ref_shutdown = reference(srv.url, P_SHUTDOWN)
        assert not restored(complete(srv.url, P_SHUTDOWN))
        assert objects(store) == before, "no idle flush: the new chunks are only in host"
        assert srv.terminate_main() == 0
    assert objects(store) >= before + 3, "SIGTERM with a drain window flushed them"

    with APIServer(tmp, model=tiny_fp32, name="third", kv_transfer_config=no_idle) as srv:
        r = complete(srv.url, P_SHUTDOWN)
    assert restored(r).get("file1", 0) >= 768
    assert r["choices"][0]["text"] == ref_shutdown
