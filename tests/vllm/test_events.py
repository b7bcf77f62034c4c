"""KV events (``kvtier/vllm/events.py``) over a real store, without an engine.

The store is real (host pool + a write-through file tier, a ManualClock); requests are
vLLM's own ``Request`` with vLLM's block hasher, so the hashes are the ones vLLM puts in
its GPU events. Chunks are stored the way the scheduler side does (``store.put`` of its
metas); the events are what ``take_events`` would hand vLLM.
"""

from __future__ import annotations

import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from vllm.distributed.kv_events import BlockRemoved, BlockStored
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import (
    get_request_block_hasher,
    init_none_hash,
    maybe_convert_block_hash,
)
from vllm.v1.request import Request

from kvtier.build import build_store
from kvtier.clock import ManualClock
from kvtier.config import KVTierConfig
from kvtier.keys import ChunkKey, Namespace
from kvtier.tiers.file import FileTier
from kvtier.vllm import events as events_mod
from kvtier.vllm import eventsetup
from kvtier.vllm.events import KVEvents
from kvtier.vllm.eventsetup import events_for
from kvtier.vllm.geometry import Geometry, GroupShape
from kvtier.vllm.heldblocks import HeldBlocks
from kvtier.vllm.scheduler_side import SchedulerSide
from tests.vllm.hooks import ask

BS = 16  # vLLM's block size
CT = 64  # kvtier's chunk: 4 blocks
BPC = CT // BS
GEOM = Geometry(2, 2, 8, BS, 2 * 2 * 8 * BS * 4, "float32")
NS = Namespace(model="m", model_fingerprint="0" * 16, kv_dtype="float32", kv_layout="NHD",
               num_layers=2, num_kv_heads=2, head_size=8, chunk_tokens=CT, block_size=BS)
LEASE = 100.0

init_none_hash(sha256)
HASHER = get_request_block_hasher(BS, sha256)


def request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=1), None, block_hasher=HASHER)


def prompt(n_chunks: int, seed: int) -> list[int]:
    return [int(x) for x in np.random.default_rng(seed).integers(3, 500, n_chunks * CT + 5)]


@pytest.fixture
def env(tmp_path: Path) -> Iterator[tuple[SchedulerSide, KVEvents, ManualClock, Path]]:
    cfg = KVTierConfig.model_validate({
        "chunk_tokens": CT,
        "tiers": [{"host": {"capacity": 4 * GEOM.chunk_bytes(CT), "pinned": "no"}},
                  {"file": {"path": str(tmp_path), "capacity": "1GiB", "write": "through",
                            "touch_interval": 0}}],
        "retention": {"lease_seconds": LEASE},
        "events": {"max_chunks": 1000},
    })
    clock = ManualClock()
    sched = SchedulerSide(cfg, GEOM, NS, None,
                          store=build_store(cfg, GEOM.chunk_bytes(CT), clock=clock), clock=clock)
    ev = events_for(sched, None)
    assert ev is not None
    yield sched, ev, clock, tmp_path
    sched.close()


def save(sched: SchedulerSide, ev: KVEvents, req: Request) -> list[ChunkKey]:
    """What the connector and the scheduler side do for a finished request: note it,
    then store its chunks (host, then written through)."""
    keys = sched.chunk_keys(req)
    assert ev.note(req, keys) == len(keys)
    ns = sched.identities.of(req).namespace  # type: ignore[union-attr]
    for c in range(len(keys)):
        sched.store.put(sched._meta(ns, keys, c), np.zeros(sched.slot_bytes, np.uint8))
    assert sched.store.flush(10)
    return keys


def gpu_hashes(req: Request) -> list[Any]:
    return [maybe_convert_block_hash(h) for h in req.block_hashes]


def by_medium(events: list[Any], cls: type[Any], medium: str) -> list[Any]:
    return [e for e in events if isinstance(e, cls) and e.medium == medium]


def test_a_saved_conversation_appears_as_cpu_then_storage_with_vllms_hashes(env: Any) -> None:
    sched, ev, _, _ = env
    req = request("a", prompt(2, seed=1))
    save(sched, ev, req)
    out = ev.take()
    cpu = by_medium(out, BlockStored, "CPU")
    storage = by_medium(out, BlockStored, "STORAGE")
    hashes = gpu_hashes(req)
    assert [e.block_hashes for e in cpu] == [hashes[:BPC], hashes[BPC : 2 * BPC]]
    # two IO threads write: storage events come in either order (each is self-contained)
    assert sorted(e.block_hashes for e in storage) == sorted(e.block_hashes for e in cpu)
    first, second = cpu
    assert first.parent_block_hash is None and second.parent_block_hash == hashes[BPC - 1]
    assert first.token_ids == list(req.all_token_ids[:CT])
    assert first.block_size == BS and first.group_idx == 0
    assert first.extra_keys == [None] * BPC  # as vLLM's GPU events carry a plain request
    assert (first.locality, first.ownership) == ("LOCAL", None)
    assert {(e.locality, e.ownership) for e in storage} == {("REMOTE", "file1")}
    # CPU before STORAGE for each chunk (the host commit comes first)
    for c in cpu:
        assert out.index(c) < next(i for i, e in enumerate(out)
                                   if e in storage and e.block_hashes == c.block_hashes)
    assert ev.take() == []  # nothing twice


def test_host_eviction_and_expiry_are_removals(env: Any) -> None:
    sched, ev, clock, _ = env
    old = request("old", prompt(2, seed=2))
    save(sched, ev, old)
    ev.take()
    clock.advance(1.0)
    save(sched, ev, request("new", prompt(3, seed=3)))  # 4 host slots: evicts one of old
    out = ev.take()
    gone = by_medium(out, BlockRemoved, "CPU")
    assert gone and set(gone[0].block_hashes) <= set(gpu_hashes(old))
    assert not by_medium(out, BlockRemoved, "STORAGE")
    # the lease passes: expiry removes every object; each is a STORAGE removal
    clock.advance(LEASE + 120)
    tier = sched.store.lower[0].tier
    assert tier.expire(LEASE, whole_pass=True) == 5
    removed = [h for e in by_medium(ev.take(), BlockRemoved, "STORAGE") for h in e.block_hashes]
    assert set(gpu_hashes(old)) <= set(removed) and len(removed) == 5 * BPC


def test_a_shared_object_is_published_by_its_writer_only(env: Any) -> None:
    sched, ev, _, store_dir = env
    req = request("w", prompt(1, seed=4))
    keys = save(sched, ev, req)
    assert len(by_medium(ev.take(), BlockStored, "STORAGE")) == 1
    # another node's write of the same object is EXISTS: not its store to publish; a
    # second node with its own events publishes nothing for it
    other = FileTier(store_dir, 1 << 30)
    other_ev = KVEvents(eventsetup.tier_media(["host", "file"]), block_size=BS,
                        blocks_per_chunk=BPC, chunk_tokens=CT)
    other.on_stored = events_mod.partial_observe(other_ev, 1, True)
    other.index.on_forget = events_mod.partial_observe(other_ev, 1, False)
    other_ev.note(req, keys)
    ns = sched.identities.of(req).namespace  # type: ignore[union-attr]
    assert other.put(sched._meta(ns, keys, 0), np.zeros(sched.slot_bytes, np.uint8).data) \
        .value == "exists"
    assert other_ev.take() == []
    # the other node removes it (its collector): the writer publishes the removal once
    # its own index drops the key (its walk; here a rescan)
    assert other.delete(keys) == 1
    assert other_ev.take() == []
    sched.store.lower[0].tier.rescan()
    removed = by_medium(ev.take(), BlockRemoved, "STORAGE")
    assert [e.block_hashes for e in removed] == [gpu_hashes(req)[:BPC]]


def test_reset_host_removes_cpu_and_a_weights_reset_withdraws_everything(env: Any) -> None:
    sched, ev, _, _ = env
    req = request("r", prompt(2, seed=5))
    save(sched, ev, req)
    ev.take()
    assert sched.store.drop_host() == 2
    out = ev.take()
    assert [h for e in by_medium(out, BlockRemoved, "CPU") for h in e.block_hashes] == \
        gpu_hashes(req)[: 2 * BPC]
    assert len(out) == 1  # adjacent removals of one medium are one event
    assert ev.withdraw_all() == 2
    out = ev.take()
    assert [h for e in by_medium(out, BlockRemoved, "STORAGE") for h in e.block_hashes] == \
        gpu_hashes(req)[: 2 * BPC]
    assert not ev.held and not ev.pending()


def test_unknown_chunks_are_never_claimed(env: Any) -> None:
    sched, ev, _, _ = env
    req = request("u", prompt(1, seed=6))
    keys = sched.chunk_keys(req)  # never noted
    ns = sched.identities.of(req).namespace  # type: ignore[union-attr]
    sched.store.put(sched._meta(ns, keys, 0), np.zeros(sched.slot_bytes, np.uint8))
    assert sched.store.flush(10)
    assert ev.take() == [] and not ev.held


def test_the_cap_withdraws_the_oldest_claims() -> None:
    ev = KVEvents(eventsetup.tier_media(["host"]), block_size=BS, blocks_per_chunk=BPC,
                  chunk_tokens=CT, max_chunks=16)
    reqs = [request(f"c{i}", prompt(1, seed=100 + i)) for i in range(17)]
    for i, r in enumerate(reqs):
        key = ChunkKey(bytes([i]) * 16)
        ev.note(r, [key])
        ev.observe(0, True, key)
    out = ev.take()
    assert len(by_medium(out, BlockStored, "CPU")) == 17
    withdrawn = by_medium(out, BlockRemoved, "CPU")
    # the oldest claims go, in a batch of 1/16 of the cap beyond it: two here
    assert [e.block_hashes for e in withdrawn] == \
        [gpu_hashes(reqs[0])[:BPC] + gpu_hashes(reqs[1])[:BPC]]
    assert len(ev.held) == 15


def test_an_overflowing_queue_withdraws_every_claim(monkeypatch: pytest.MonkeyPatch) -> None:
    ev = KVEvents(eventsetup.tier_media(["host"]), block_size=BS, blocks_per_chunk=BPC,
                  chunk_tokens=CT)
    r = request("o", prompt(1, seed=7))
    key = ChunkKey(b"k" * 16)
    ev.note(r, [key])
    ev.observe(0, True, key)
    assert len(ev.take()) == 1
    monkeypatch.setattr(events_mod, "MAX_RAW", 2)
    for _ in range(3):
        ev.observe(0, True, ChunkKey(b"x" * 16))
    out = ev.take()
    assert [type(e) for e in out] == [BlockRemoved] and out[0].block_hashes == \
        gpu_hashes(r)[:BPC]
    assert not ev.held


def test_take_does_a_bounded_slice_a_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """A walk that drops many objects at once is published over several steps, in order,
    each ``take`` doing at most ``TAKE_BUDGET`` observations (review N10)."""
    monkeypatch.setattr(events_mod, "TAKE_BUDGET", 4)
    ev = KVEvents(eventsetup.tier_media(["host"]), block_size=BS, blocks_per_chunk=BPC,
                  chunk_tokens=CT)
    reqs = [request(f"b{i}", prompt(1, seed=300 + i)) for i in range(10)]
    keys = [ChunkKey(bytes([i]) * 16) for i in range(10)]
    for r, k in zip(reqs, keys, strict=True):
        ev.note(r, [k])
        ev.observe(0, True, k)
    batches = []
    while ev.pending():
        batches.append(ev.take())
    assert [len(b) for b in batches] == [4, 4, 2]
    assert [e.block_hashes for b in batches for e in b] == \
        [gpu_hashes(r)[:BPC] for r in reqs]


def test_a_finishing_request_is_noted_again_so_its_save_is_published(
        env: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The events keep payloads of the most recently noted pieces only: a request noted
    at its lookup whose payloads were dropped since (many requests noted in between) is
    noted again when it finishes, and its save is published (review N9)."""
    from kvtier.vllm.connector import KVTierConnector

    sched, ev, _, _ = env
    req = request("n9", prompt(2, seed=9))
    keys = sched.chunk_keys(req)
    assert ev.note(req, keys) == 2
    ev.payloads.clear()  # dropped FIFO beyond max_payloads by other requests' notes
    conn = KVTierConnector.__new__(KVTierConnector)  # only its noting (no engine here)
    conn._events, conn._sched, conn._noted = ev, sched, {req.request_id: 2}
    conn._finish_noting(req)
    ns = sched.identities.of(req).namespace  # type: ignore[union-attr]
    for c in range(len(keys)):
        sched.store.put(sched._meta(ns, keys, c), np.zeros(sched.slot_bytes, np.uint8))
    assert sched.store.flush(10)
    cpu = by_medium(ev.take(), BlockStored, "CPU")
    assert [e.block_hashes for e in cpu] == [gpu_hashes(req)[:BPC],
                                             gpu_hashes(req)[BPC : 2 * BPC]]


def test_a_held_chunk_costs_a_bounded_number_of_bytes() -> None:
    """16 blocks a chunk, vLLM's default 64-bit event hashes: what 20k claims cost, key
    objects included (the held map keeps them alive), and what their per-block counts
    cost in one medium (``HeldBlocks``)."""
    bpc, n = 16, 20_000
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    held: dict[ChunkKey, bytes] = {}
    for i in range(n):
        key = ChunkKey(i.to_bytes(16, "big"))
        held[key] = bytes([3, 0, 1]) + i.to_bytes(8, "big") + bytes(8 * bpc)
    per_chunk = (tracemalloc.get_traced_memory()[0] - before) / n
    counts = HeldBlocks()
    before = tracemalloc.get_traced_memory()[0]
    rng = np.random.default_rng(0)
    for _ in range(n):
        counts.add(0, 0, [int(h) for h in rng.integers(1 << 62, 1 << 63, bpc,
                                                       dtype=np.int64) * 2])
    per_block = (tracemalloc.get_traced_memory()[0] - before) / (n * bpc)
    tracemalloc.stop()
    key, rec = next(iter(held.items()))
    assert len(rec) == 3 + 8 + 8 * bpc
    assert per_chunk <= KVEvents.held_bytes(rec, key) + 16, per_chunk
    assert per_chunk < 300  # about 250 MB at 1M held chunks
    assert per_block <= HeldBlocks.block_bytes(1 << 63) + 16, per_block
    assert per_block < 100  # about 1.4 GB a medium at 1M held 16-block chunks
    print(f"held map: {per_chunk:.0f} B/chunk measured, "
          f"{KVEvents.held_bytes(rec, key)} estimated; counts: {per_block:.0f} B/block "
          f"measured, {HeldBlocks.block_bytes(1 << 63)} estimated")


# -- hybrid models (several KV-cache groups) ----------------------------------------------
W = 40  # the window group keeps a request's last 40 tokens: a hit needs 3 blocks
SW, FULL = 0, 1  # vLLM's group order for Gemma-2: the window group first
HGEOM = Geometry(2, 2, 8, BS, 1024, "float32",
                 groups=(GroupShape(2, W), GroupShape(2, 0)), group_layers="x")
HNS = Namespace(model="m", model_fingerprint="0" * 16, kv_dtype="float32",
                kv_layout="NHD", num_layers=2, num_kv_heads=2, head_size=8, chunk_tokens=CT,
                block_size=BS, attention=HGEOM.attention)


def hybrid_config() -> Any:
    """The kv_cache_config vLLM gives a model with a 40-token window group and a full
    group (what ``events_for`` reads the groups' kinds from)."""
    import torch
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheGroupSpec,
        SlidingWindowSpec,
    )

    sw = SlidingWindowSpec(block_size=BS, num_kv_heads=2, head_size=8, dtype=torch.float32,
                           sliding_window=W)
    full = FullAttentionSpec(block_size=BS, num_kv_heads=2, head_size=8, dtype=torch.float32)
    return SimpleNamespace(kv_cache_groups=[KVCacheGroupSpec(["l0"], sw),
                                            KVCacheGroupSpec(["l1"], full)])


@pytest.fixture
def henv(tmp_path: Path) -> Iterator[tuple[SchedulerSide, KVEvents, ManualClock]]:
    cfg = KVTierConfig.model_validate({
        "chunk_tokens": CT,
        "tiers": [{"host": {"capacity": "1MiB", "pinned": "no"}},
                  {"file": {"path": str(tmp_path), "capacity": "1GiB", "write": "through",
                            "touch_interval": 0}}],
        "retention": {"lease_seconds": LEASE},
        "restore": {"recompute_threshold_tokens": 1},
    })
    clock = ManualClock()
    sched = SchedulerSide(cfg, HGEOM, HNS, None,
                          store=build_store(cfg, HGEOM.chunk_bytes(CT), clock=clock),
                          clock=clock)
    ev = events_for(sched, hybrid_config())
    sched.on_pieces = ev.note_pieces  # as the connector does
    yield sched, ev, clock
    sched.close()


def hybrid_tables(req: Request) -> tuple[list[int], list[int]]:
    """A finished request's block tables: the window group's null block (0) below the
    window of its computed tokens, the full group's every block."""
    total = -(-req.num_tokens // BS)
    skipped = max(0, req.num_computed_tokens - W + 1) // BS
    return ([0 if i < skipped else 100 + i for i in range(total)],
            [200 + i for i in range(total)])


def hybrid_save(sched: SchedulerSide, ev: KVEvents, req: Request) -> None:
    """What the connector and the scheduler side do for a hybrid model's finished
    request: note its chunks and the pieces of its end, store them, commit them."""
    req.num_computed_tokens = req.num_tokens - 1
    tables = hybrid_tables(req)
    ev.note(req, sched.chunk_keys(req))
    delay, _ = sched.request_finished_groups(req, tables)
    assert delay
    sched.build_meta()
    sched.on_worker_output({req.request_id}, None)
    assert sched.store.flush(10)


def vllm_gpu_event(req: Request, group: int, first: int, blocks: int) -> Any:
    """The ``BlockStored`` vLLM itself publishes on GPU for blocks ``first..`` of group
    ``group`` of ``req``: its block pool caching them, then its ``KVCacheManager``'s
    annotation with the group's kind and window."""
    from vllm.v1.kv_cache_interface import (
        get_kv_cache_spec_kind,
        get_kv_cache_spec_sliding_window,
    )

    pool = BlockPool(64, True, BS, enable_kv_cache_events=True)
    pool.cache_full_blocks(req, pool.get_new_blocks(first + blocks), first, first + blocks,
                           BS, group)
    (event,) = pool.take_events()
    assert isinstance(event, BlockStored)
    spec = hybrid_config().kv_cache_groups[group].kv_cache_spec
    event.kv_cache_spec_kind = get_kv_cache_spec_kind(spec).value
    event.kv_cache_spec_sliding_window = get_kv_cache_spec_sliding_window(spec)
    return event


FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
          "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind",
          "kv_cache_spec_sliding_window", "session_id")


def test_a_hybrid_models_pieces_are_published_per_group_as_vllm_publishes_them(
        henv: Any) -> None:
    sched, ev, _ = henv
    req = request("h", prompt(3, seed=11)[: 2 * CT + 3 * BS + 1])  # 2 chunks, 3-block tail
    hybrid_save(sched, ev, req)
    out = ev.take()
    cpu = by_medium(out, BlockStored, "CPU")
    # the full group's chunks and tail, the window group's window (blocks 8..10)
    want = [(FULL, 0, BPC), (FULL, BPC, BPC), (FULL, 2 * BPC, 3), (SW, 2 * BPC, 3)]
    assert sorted((e.group_idx, e.block_hashes) for e in cpu) == sorted(
        (g, gpu_hashes(req)[lo : lo + n]) for g, lo, n in want)
    for group, lo, n in want:
        (mine,) = [e for e in cpu if (e.group_idx, e.block_hashes[0]) ==
                   (group, gpu_hashes(req)[lo])]
        gpu = vllm_gpu_event(req, group, lo, n)
        assert {f: getattr(mine, f) for f in FIELDS} == {f: getattr(gpu, f) for f in FIELDS}
    window = next(e for e in cpu if e.group_idx == SW)
    assert (window.kv_cache_spec_kind, window.kv_cache_spec_sliding_window) == \
        ("sliding_window", W)
    storage = by_medium(out, BlockStored, "STORAGE")
    assert sorted((e.group_idx, e.block_hashes) for e in storage) == \
        sorted((e.group_idx, e.block_hashes) for e in cpu)
    assert {(e.locality, e.ownership) for e in storage} == {("REMOTE", "file1")}


def test_a_hybrid_models_removals_name_each_group(henv: Any) -> None:
    sched, ev, clock = henv
    req = request("r", prompt(3, seed=12)[: 2 * CT + 3 * BS + 1])
    hybrid_save(sched, ev, req)
    ev.take()
    hashes = gpu_hashes(req)
    assert sched.store.drop_host() == 4
    gone = by_medium(ev.take(), BlockRemoved, "CPU")
    assert sorted((e.group_idx, h) for e in gone for h in e.block_hashes) == sorted(
        [(FULL, h) for h in hashes[: 2 * BPC + 3]] + [(SW, h) for h in hashes[2 * BPC :]])
    clock.advance(LEASE + 120)
    assert sched.store.lower[0].tier.expire(LEASE, whole_pass=True) == 4
    gone = by_medium(ev.take(), BlockRemoved, "STORAGE")
    assert sorted((e.group_idx, h) for e in gone for h in e.block_hashes) == sorted(
        [(FULL, h) for h in hashes[: 2 * BPC + 3]] + [(SW, h) for h in hashes[2 * BPC :]])
    assert not ev.held


def test_a_hybrid_piece_restored_by_another_request_is_published_from_its_payload(
        henv: Any) -> None:
    sched, ev, _ = henv
    tokens = prompt(3, seed=13)[: 2 * CT + 3 * BS + 1]
    first = request("a", tokens)
    hybrid_save(sched, ev, first)
    ev.take()
    assert sched.store.drop_host() == 4
    ev.take()
    # the next turn restores every piece from the file tier into the host: each is
    # published as CPU again, by group, though this request noted only its chunks
    turn = request("b", [*tokens, 5, 6, 7])
    ev.note(turn, sched.chunk_keys(turn))
    assert ask(sched, turn) == 2 * CT + 3 * BS  # type: ignore[arg-type]
    cpu = by_medium(ev.take(), BlockStored, "CPU")
    hashes = gpu_hashes(first)
    assert sorted((e.group_idx, e.block_hashes) for e in cpu) == sorted(
        [(FULL, hashes[:BPC]), (FULL, hashes[BPC : 2 * BPC]), (FULL, hashes[2 * BPC :]),
         (SW, hashes[2 * BPC :])])


def test_a_hybrid_prefix_shorter_than_a_chunk_publishes_its_tail_and_window(
        henv: Any) -> None:
    sched, ev, _ = henv
    req = request("s", prompt(1, seed=14)[: 3 * BS + 1])  # no whole chunk: a 3-block tail
    hybrid_save(sched, ev, req)
    cpu = by_medium(ev.take(), BlockStored, "CPU")
    assert sorted((e.group_idx, e.block_hashes, e.parent_block_hash) for e in cpu) == [
        (SW, gpu_hashes(req)[:3], None), (FULL, gpu_hashes(req)[:3], None)]


def test_group_meta_is_what_vllm_sets_per_group() -> None:
    import torch
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        FullAttentionSpec,
        KVCacheGroupSpec,
    )

    cl = ChunkedLocalAttentionSpec(block_size=BS, num_kv_heads=2, head_size=8,
                                   dtype=torch.float32, attention_chunk_size=4 * BS)
    full = FullAttentionSpec(block_size=BS, num_kv_heads=2, head_size=8, dtype=torch.float32)
    config = SimpleNamespace(kv_cache_groups=[KVCacheGroupSpec(["a"], cl),
                                              KVCacheGroupSpec(["b"], full)])
    assert eventsetup.group_meta(config) == [
        events_mod.GroupMeta("chunked_local_attention", None),
        events_mod.GroupMeta("full_attention", None)]
    assert eventsetup.group_meta(hybrid_config())[SW] == \
        events_mod.GroupMeta("sliding_window", W)
    assert eventsetup.group_meta(None) == []
