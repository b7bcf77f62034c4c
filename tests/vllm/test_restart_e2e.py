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

The last restart opens a tier of more than 100,000 objects (issue 21): ``FILLER`` empty
files named like objects (``kvtier.testing.fill``; the start scan never reads a payload)
join the conversation's real ones, and the tier's start scan is held to
``SCAN_RATE`` objects a second (``index_objects_per_second``), so it lasts hours. That
server serves before its index is complete and restores the conversation with the
recompute's tokens. The engine's own ``/metrics`` after that request show the index
incomplete (``kvtier_tier_index_ready`` 0) and fewer objects scanned than the top-level
directories up to the last of the conversation's chunks hold: the scan lists them in
order, so that chunk was not in the index and came through the probe path.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvtier.keys import chunk_keys
from kvtier.testing.engines import tokens
from kvtier.testing.fill import fill_file_tier
from kvtier.testing.servers import APIServer
from kvtier.vllm.settings import kv_transfer_config
from tests.vllm.conftest import write_config

pytestmark = pytest.mark.vllm

PROMPTS = {path: tokens(900, seed=1300 + i) for i, path in enumerate(
    ["api-30", "group-0"])}  # three full 256-token chunks and a tail
DRAIN = ["--shutdown-timeout", "30"]
FILLER = 100_000  # objects added before the last restart
SCAN_RATE = 10  # objects/s: the start scan lists a page or two while the test runs


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


def index_state(url: str, tier: str) -> tuple[float, float]:
    """``(kvtier_tier_index_ready, kvtier_tier_index_scanned_objects)`` of ``tier`` on the
    server's ``/metrics``: what the engine last reported (it reports every step)."""
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for sample in family.samples:
            if sample.labels.get("tier") == tier:
                found[sample.name] = sample.value
    return found["kvtier_tier_index_ready"], found["kvtier_tier_index_scanned_objects"]


def objects_through(store: Path, shard: int) -> int:
    """Objects in the top-level directories ``00`` to ``shard`` (what a start scan has
    listed once it has listed that one)."""
    return sum(len(list(d.glob("*/*.kv"))) for d in (store / "kv").iterdir()
               if len(d.name) == 2 and int(d.name, 16) <= shard)


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
    # the last restart: a tier of FILLER more objects, scanned at SCAN_RATE objects/s
    paced = [{"file": {**tier[0]["file"], "index_objects_per_second": SCAN_RATE}}]
    big = kv_transfer_config(write_config(tmp / "big.yaml", paced, idle_flush_seconds=0,
                                          max_dirty_seconds=0))
    plan = [("api-30", held, DRAIN), ("group-0", aged, [])]
    previous: tuple[str, str] | None = None  # (path, its reference text)
    for i, (path, cfg, args) in enumerate([*plan, ("check", big, [])]):
        if path == "check":
            assert fill_file_tier(store, FILLER).objects == FILLER
        with APIServer(tmp, model=tiny_fp32, name=f"s{i}", kv_transfer_config=cfg,
                       extra_args=args) as srv:
            if previous is not None:
                r = complete(srv.url, PROMPTS[previous[0]])
                assert restored(r).get("file1", 0) >= 768, f"after {previous[0]}"
                assert set(restored(r)) == {"file1"}, f"after {previous[0]}: only from disk"
                assert r["choices"][0]["text"] == previous[1], f"after {previous[0]}"
            if path == "check":
                assert previous is not None
                ready, scanned = index_state(srv.url, "file1")
                assert ready == 0, "the index was complete: the restore proves nothing"
                ns = bytes.fromhex(r["kv_transfer_params"]["kvtier"]["namespace"])
                keys = chunk_keys(ns, PROMPTS[previous[0]], 256)
                assert all((store / "kv" / k.hex()[:2] / k.hex()[2:4] / f"{k.hex()}.kv")
                           .is_file() for k in keys), "not the conversation's keys"
                last = max(k[0] for k in keys)
                assert scanned < objects_through(store, last), \
                    "every chunk was scanned before the restore: not a probe"
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
