"""Hybrid models (vLLM's hybrid KV-cache manager on) without an engine: the geometry
accepts full and sliding-window groups and refuses the rest by name; a finished request
stores each group as objects of its own (the full group's chunks and tail, the window
group's window); a returning one restores every group through asynchronous loads; the
worker copies each group's layers with that group's block ids and reports a failed
load per request.

Requests are plain records with the attributes of vLLM's ``Request`` that the scheduler
side reads; block tables are what vLLM gives per group (the window group's null block
below its window). The store is real. Bytes and tokens are checked in real vLLM in
``test_shapes_e2e.py``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.config import KVTierConfig
from kvtier.keys import (
    ChunkKey,
    Namespace,
    chunk_keys,
    group_key,
    key_from_hex,
    tail_key,
    window_key,
)
from kvtier.tiers.base import TierError
from kvtier.vllm.geometry import Geometry, GroupShape, geometry_from_kv_cache_config
from kvtier.vllm.hybrid import prefix_pieces
from kvtier.vllm.protocol import CopyOp, KVTierMetadata
from kvtier.vllm.scheduler_side import SchedulerSide
from kvtier.vllm.worker_side import WorkerSide
from tests.vllm.hooks import ask, request_record, through_sched

BS, BPC = 16, 4
CT = BS * BPC
W = 40  # the window group keeps the blocks from (c - 39) // 16: a hit needs 3 blocks
SW, FULL = 0, 1  # vLLM's group order in the Gemma-2 e2e: the window group first
GEOM = Geometry(2, 2, 8, BS, 1024, "float32",
                groups=(GroupShape(2, W), GroupShape(2, 0)), group_layers="x")
NS = Namespace(model="m", model_fingerprint="0" * 16, kv_dtype="float32", kv_layout="NHD",
               num_layers=2, num_kv_heads=2, head_size=8, chunk_tokens=CT, block_size=BS,
               attention=GEOM.attention)
BASE = list(range(1, 2 * CT + 3 * BS + 1))  # 2 chunks and 3 blocks: 11 blocks


class GroupBlocks:
    """vLLM's ``KVCacheBlocks`` with one block table per group."""

    def __init__(self, *ids: list[int]) -> None:
        self.ids = ids

    def get_block_ids(self) -> tuple[list[int], ...]:
        return self.ids


def _sched(tmp_path: Path, **extra: Any) -> SchedulerSide:
    return through_sched(tmp_path, GEOM, NS, CT, **extra)


@pytest.fixture
def sched(tmp_path: Path) -> Iterator[SchedulerSide]:
    s = _sched(tmp_path)
    yield s
    s.close()


_req = request_record


def _tables(computed: int, total_blocks: int, base: int = 100) -> tuple[list[int], list[int]]:
    """A finished request's block tables: the window group's null (0) below the window
    of its computed tokens, the full group's every block (other ids)."""
    skipped = max(0, computed - W + 1) // BS
    sw = [0 if i < skipped else base + i for i in range(total_blocks)]
    return sw, [base + 50 + i for i in range(total_blocks)]


def _finish(sched: SchedulerSide, req: SimpleNamespace, base: int = 100) -> dict[str, Any]:
    tables = _tables(req.num_computed_tokens, -(-req.num_tokens // BS), base)
    delay, params = sched.request_finished_groups(req, tables)
    assert delay
    kv: dict[str, Any] = params["kvtier"]
    return kv


def _settle(sched: SchedulerSide, *rids: str) -> None:
    sched.build_meta()
    sched.on_worker_output(set(rids), None)


# -- geometry ---------------------------------------------------------------------------
def _config(*specs: Any) -> Any:
    from vllm.v1.kv_cache_interface import KVCacheGroupSpec

    return SimpleNamespace(kv_cache_groups=[
        KVCacheGroupSpec([f"model.layers.{g}.attn"], s) for g, s in enumerate(specs)])


def test_full_and_sliding_window_groups_make_a_hybrid_geometry() -> None:
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    full = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=64, dtype=torch.float32)
    sw = SlidingWindowSpec(block_size=16, num_kv_heads=1, head_size=64, dtype=torch.float32,
                           sliding_window=128)
    g = geometry_from_kv_cache_config(_config(sw, full, sw), tp_world=2)
    assert g.groups == (GroupShape(1, 128), GroupShape(1, 0), GroupShape(1, 128))
    assert g.chunk_bytes(32) == 2 * 2 * full.page_size_bytes  # one group's chunk per slot
    assert g.attention.startswith("hybrid:sliding_window:128x1,fullx1,sliding_window:128x1;")
    other = geometry_from_kv_cache_config(_config(full, sw, sw), tp_world=2)
    assert other.attention != g.attention  # which layers are in which group is keyed


def test_groups_kvtier_cannot_store_are_refused_naming_the_model_and_the_kind() -> None:
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

    full = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=64, dtype=torch.float32)
    mamba = MambaSpec(block_size=16, shapes=((4, 8),), dtypes=(torch.float32,))
    with pytest.raises(TierError, match=r"Qwen/Qwen3-Next.*group 1 is MambaSpec.*state"):
        geometry_from_kv_cache_config(_config(full, mamba), model="Qwen/Qwen3-Next")
    wide = FullAttentionSpec(block_size=32, num_kv_heads=1, head_size=64, dtype=torch.float32)
    with pytest.raises(TierError, match="differ in block_size"):
        geometry_from_kv_cache_config(_config(full, wide))


# -- saves ------------------------------------------------------------------------------
def test_a_finished_request_stores_each_group_as_objects_of_its_own(
        sched: SchedulerSide) -> None:
    req = _req("a", [*BASE, 7])  # 176 tokens computed: 2 chunks and a 3-block tail
    kv = _finish(sched, req)
    saves = sched.build_meta().saves
    keys = chunk_keys(NS.digest(), BASE, CT)
    end = tail_key(keys[1], BASE[2 * CT:])
    # the full group: chunks 0 and 1, then the tail; the window group: blocks 8..10
    assert [(op.group, op.block_ids, op.span) for op in saves] == [
        (FULL, [150, 151, 152, 153], 0), (FULL, [154, 155, 156, 157], 0),
        (FULL, [158, 159, 160], 3), (SW, [108, 109, 110], 3)]
    assert kv["tokens"] == 2 * CT + 3 * BS
    assert kv["last_key"] == group_key(window_key(end, 0, 1), SW).hex()
    sched.on_worker_output({"a"}, None)
    # one chain from the last piece down to chunk 0 (a lease renewal walks all of it)
    metas = {m.key: m for _, m in sched.store.host.index.entries()}
    chain: list[ChunkKey] = []
    key: ChunkKey | None = key_from_hex(kv["last_key"])
    while key is not None and key in metas:
        chain.append(key)
        key = metas[key].parent
    assert len(chain) == 4 and key is None


def test_a_returning_turn_restores_every_group_asynchronously(sched: SchedulerSide) -> None:
    _finish(sched, _req("a", [*BASE, 7]))
    _settle(sched, "a")
    turn2 = _req("b", [*BASE, 7, 8, 9], computed=0)
    assert ask(sched, turn2) == 2 * CT + 3 * BS  # the whole prefix
    assert sched.get_num_new_matched_tokens(turn2, 0) == (2 * CT + 3 * BS, True)
    sw = [0] * 8 + [8, 9, 10, 11]  # vLLM pads below the window with its null block
    full = list(range(50, 62))
    sched.update_state_after_alloc(turn2, GroupBlocks(sw, full), 2 * CT + 3 * BS)
    meta = sched.build_meta()
    assert meta.async_loads
    assert [(op.group, op.block_ids, op.first, op.span) for op in meta.loads] == [
        (FULL, [50, 51, 52, 53], 0, 0), (FULL, [54, 55, 56, 57], 0, 0),
        (FULL, [58, 59, 60], 0, 3), (SW, [8, 9, 10], 0, 3)]


def test_vllm_s_own_hit_loads_only_the_rest_of_each_group(sched: SchedulerSide) -> None:
    _finish(sched, _req("a", [*BASE, 7]))
    _settle(sched, "a")
    turn2 = _req("b", [*BASE, 7, 8])
    n = ask(sched, turn2, 9 * BS)
    assert n == 2 * BS
    sched.update_state_after_alloc(turn2, GroupBlocks([0] * 6 + list(range(6, 12)),
                                                      list(range(50, 62))), n)
    loads = sched.build_meta().loads
    # the full group's blocks 9 and 10 (of its tail); the window's blocks 9 and 10
    assert [(op.group, op.block_ids, op.first, op.span) for op in loads] == [
        (FULL, [59, 60], 1, 3), (SW, [9, 10], 1, 3)]


def test_conversations_on_one_new_prefix_each_store_and_restore_their_own(
        sched: SchedulerSide) -> None:
    """Four conversations share a new two-chunk prefix and finish in the same step: the
    shared chunks are saved once, and each keeps its own tail and window."""
    convs = [_req(f"c{i}", [*BASE[: 2 * CT], *range(600 + 10 * i, 600 + 10 * i + BS + 5)])
             for i in range(4)]
    for i, c in enumerate(convs):
        assert _finish(sched, c, base=100 + 100 * i)["tokens"] == 2 * CT + BS
    saves = sched.build_meta().saves
    assert sum(op.group == FULL and op.span == 0 for op in saves) == 2  # the shared chunks
    sched.on_worker_output({c.request_id for c in convs}, None)
    for i, c in enumerate(convs):
        back = _req(f"r{i}", [*c.all_token_ids, 1, 2, 3], computed=0)
        assert ask(sched, back) == 2 * CT + BS, i


def test_a_freed_window_stores_the_chunks_and_announces_nothing(
        sched: SchedulerSide) -> None:
    req = _req("a", [*BASE, 7])
    tables = list(_tables(req.num_computed_tokens, 12))
    tables[SW][8] = 0  # the window group freed the window's first block (the corner)
    _, params = sched.request_finished_groups(req, tuple(tables))
    assert params["kvtier"]["tokens"] == 0
    assert {op.group for op in sched.build_meta().saves} == {FULL}


@settings(max_examples=60, deadline=None)
@given(chunks=st.integers(1, 5), tail=st.integers(0, BPC - 1), start=st.integers(0, 5))
def test_prefix_pieces_cover_each_group_once(chunks: int, tail: int, start: int) -> None:
    keys = chunk_keys(NS.digest(), list(range(1, chunks * CT + 1)), CT)
    t = (tail, tail_key(keys[-1], list(range(tail * BS)))) if tail else None
    pieces = prefix_pieces(GEOM, BPC, keys, t, start_chunk=min(start, chunks))
    end = chunks * BPC + tail
    full = sorted(b for p in pieces if p.group == FULL for b in range(p.first, p.first + p.blocks))
    assert full == list(range(min(start, chunks) * BPC, end))
    sw = sorted(b for p in pieces if p.group == SW for b in range(p.first, p.first + p.blocks))
    assert sw == list(range(max(0, end - GEOM.blocks_for_window(W)), end))
    assert len({p.key for p in pieces}) == len(pieces)
    assert all(p.blocks <= BPC and (p.span == 0) == (p.blocks == BPC) for p in pieces)


# -- worker -----------------------------------------------------------------------------
LAYERS = [["l0", "l2"], ["l1", "l3"]]  # group 0 and group 1 (equal layers per group)
HEADS, HEAD, NB = 2, 8, 24


def _worker(tmp_path: Path) -> tuple[WorkerSide, dict[str, torch.Tensor]]:
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
    from vllm.v1.kv_cache_layout import KVCacheLayout

    geom = Geometry(2, HEADS, HEAD, 4, HEADS * 4 * 2 * HEAD * 4, "float32",
                    groups=(GroupShape(2, W), GroupShape(2, 0)))
    cfg = KVTierConfig.model_validate({"chunk_tokens": 16, "copy_backend": "torch", "tiers": [
        {"host": {"capacity": "64KiB", "pinned": "no"}}]})
    w = WorkerSide(cfg, geom, LAYERS, tmp_path / "pool")
    gen = torch.Generator().manual_seed(3)
    kv = {n: torch.randn(NB, HEADS, 4, 2 * HEAD, generator=gen) for g in LAYERS for n in g}
    w.register(kv, CPUAttentionBackend, KVCacheLayout.LBHNC, NB)
    return w, kv


def test_the_worker_copies_each_group_with_its_own_blocks_and_reports_per_request(
        tmp_path: Path) -> None:
    w, kv = _worker(tmp_path)
    try:
        saves = [CopyOp("s", 0, [1, 2, 3, 4], group=0), CopyOp("s", 1, [5, 6, 7, 8], group=1)]
        w.run(KVTierMetadata(1, saves=saves), layer_by_layer=False)
        w.end_forward()
        assert w.get_finished({"s"}) == ({"s"}, None)
        loads = [CopyOp("r", 0, [11, 12, 13, 14], group=0),
                 CopyOp("r", 1, [15, 16, 17, 18], group=1),
                 CopyOp("bad", 99, [20], group=1)]  # a slot outside the pool: fails
        w.run(KVTierMetadata(2, loads=loads, async_loads=True), layer_by_layer=True)
        w.end_forward()
        assert w.load_errors() == set()  # never block-level: vLLM would raise
        assert w.get_finished(set()) == (None, {"r", "bad"})
        assert w.load_failures() == {"bad"}
        for name in LAYERS[0]:  # group 0's layers from group 0's blocks, and only those
            assert torch.equal(kv[name][11:15], kv[name][1:5])
        for name in LAYERS[1]:
            assert torch.equal(kv[name][15:19], kv[name][5:9])
            assert not torch.equal(kv[name][11:15], kv[name][1:5])
        meta = w.worker_meta()
        assert meta is not None and meta.loaded_steps == [2]
    finally:
        w.close()


def test_a_piece_that_fails_mid_read_makes_the_turn_recompute(
        sched: SchedulerSide, tmp_path: Path) -> None:
    """A file object the index knows turns out bad when read (a torn write on a shared
    tier, a bad disk): the pieces before it are read, it is not, and the turn recomputes
    everything instead of restoring a prefix that some group lacks."""
    _finish(sched, _req("a", [*BASE, 7]))
    _settle(sched, "a")
    sched.store.flush()
    sched.store.drop_host()
    turn2 = _req("b", [*BASE, 7, 8, 9], computed=0)
    objects = sorted(tmp_path.rglob("*.kv"), key=lambda p: p.stat().st_size)
    assert len(objects) == 4  # 2 chunks, the tail and the window (3 blocks each)
    objects[0].write_bytes(objects[0].read_bytes()[:100])  # a 3-block piece, cut short
    assert ask(sched, turn2) == 0
    assert sched.build_meta().loads == []


# -- chunked-local attention (Llama-4) --------------------------------------------------
A = 96  # the attention chunk: 6 blocks, not a multiple of kvtier's 64-token chunk
CL_GEOM = Geometry(2, 2, 8, BS, 1024, "float32",
                   groups=(GroupShape(2, chunk=A), GroupShape(2, 0)), group_layers="y")
CL_NS = dataclasses.replace(NS, attention=CL_GEOM.attention)
CL, CL_FULL = 0, 1


def test_chunked_local_and_full_groups_make_a_hybrid_geometry() -> None:
    from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec, FullAttentionSpec

    common: dict[str, Any] = {"block_size": 16, "num_kv_heads": 1, "head_size": 64,
                              "dtype": torch.float32}
    g = geometry_from_kv_cache_config(_config(
        ChunkedLocalAttentionSpec(**common, attention_chunk_size=8192),
        FullAttentionSpec(**common)), tp_world=2)
    assert g.groups == (GroupShape(1, chunk=8192), GroupShape(1, 0))
    assert g.attention.startswith("hybrid:chunked_local:8192x1,fullx1;")
    # the blocks of the attention chunk holding the next token, as vLLM keeps them
    assert [g.local_blocks(0, e) for e in (1, 511, 512, 513, 1024)] == [1, 511, 0, 1, 0]
    assert g.local_blocks(1, 513) == 513


@settings(max_examples=80, deadline=None)
@given(end_block=st.integers(1, 400), chunk_blocks=st.integers(1, 40),
       block=st.sampled_from([1, 16, 128]))
def test_local_blocks_are_what_vllm_keeps_of_a_chunked_local_group(
        end_block: int, chunk_blocks: int, block: int) -> None:
    """kvtier's blocks for a chunked-local group at an end are exactly those vLLM's own
    ``ChunkedLocalAttentionManager`` does not pad with its null block there."""
    from vllm.v1.core.single_type_kv_cache_manager import ChunkedLocalAttentionManager

    chunk = chunk_blocks * block
    g = Geometry(1, 1, 8, block, 64, "float32", groups=(GroupShape(1, chunk=chunk),))
    skipped = ChunkedLocalAttentionManager.get_num_skipped_tokens(
        SimpleNamespace(attention_chunk_size=chunk),  # type: ignore[arg-type]
        end_block * block)
    assert g.local_blocks(0, end_block) == end_block - skipped // block


def _cl_tables(computed: int, total_blocks: int, base: int = 100) -> tuple[list[int], ...]:
    """A finished Llama-4 request's block tables: the chunked-local group's null (0)
    below its current attention chunk, the full group's every block."""
    skipped = computed // A * A // BS
    cl = [0 if i < skipped else base + i for i in range(total_blocks)]
    return cl, [base + 50 + i for i in range(total_blocks)]


@pytest.fixture
def cl_sched(tmp_path: Path) -> Iterator[SchedulerSide]:
    s = through_sched(tmp_path, CL_GEOM, CL_NS, CT)
    yield s
    s.close()


def test_chunked_local_groups_store_and_restore_their_attention_chunk(
        cl_sched: SchedulerSide) -> None:
    """A Llama-4 request ending 176 tokens in stores the full group's chunks and tail and,
    of the chunked-local group, only its current attention chunk (tokens 96..175: blocks
    6..10); a returning turn restores both into vLLM's blocks (nulls below block 6)."""
    req = _req("a", [*BASE, 7])
    _, params = cl_sched.request_finished_groups(req, _cl_tables(176, 12))
    assert params["kvtier"]["tokens"] == 2 * CT + 3 * BS
    saves = cl_sched.build_meta().saves
    assert [(op.group, op.block_ids, op.span) for op in saves] == [
        (CL_FULL, [150, 151, 152, 153], 0), (CL_FULL, [154, 155, 156, 157], 0),
        (CL_FULL, [158, 159, 160], 3), (CL, [106, 107, 108, 109], 0), (CL, [110], 1)]
    cl_sched.on_worker_output({"a"}, None)
    turn2 = _req("b", [*BASE, 7, 8, 9], computed=0)
    assert ask(cl_sched, turn2) == 2 * CT + 3 * BS
    assert cl_sched.get_num_new_matched_tokens(turn2, 0) == (2 * CT + 3 * BS, True)
    cl_sched.update_state_after_alloc(
        turn2, GroupBlocks([0] * 6 + list(range(6, 12)), list(range(50, 62))), 176)
    loads = cl_sched.build_meta().loads
    assert [(op.group, op.block_ids, op.first, op.span) for op in loads] == [
        (CL_FULL, [50, 51, 52, 53], 0, 0), (CL_FULL, [54, 55, 56, 57], 0, 0),
        (CL_FULL, [58, 59, 60], 0, 3), (CL, [6, 7, 8, 9], 0, 0), (CL, [10], 0, 1)]


def test_a_prefix_ending_on_an_attention_chunk_boundary_needs_no_local_blocks(
        cl_sched: SchedulerSide) -> None:
    """At 192 tokens (two attention chunks) the next token attends to nothing before it
    in its chunked-local layers: only the full group is stored, and restores it all."""
    toks = list(range(1, 3 * CT + 1))  # 192 computed at finish
    req = _req("a", [*toks, 5])
    _, params = cl_sched.request_finished_groups(req, _cl_tables(192, 13))
    assert params["kvtier"]["tokens"] == 3 * CT
    assert {op.group for op in cl_sched.build_meta().saves} == {CL_FULL}
    cl_sched.on_worker_output({"a"}, None)
    back = _req("b", [*toks, 5, 6, 7], computed=0)
    assert ask(cl_sched, back) == 3 * CT


def test_the_chunked_local_backend_wrapper_lays_out_the_cache_like_what_it_wraps() -> None:
    """vLLM runs chunked-local layers on a subclass of the platform's backend that only
    builds other metadata; kvtier's one-layout check sees the wrapped class (with the
    hybrid manager off, Llama-4 is one full-attention group over both kinds of layer)."""
    from vllm.model_executor.layers.attention.chunked_local_attention import (
        create_chunked_local_attention_backend,
    )
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    from kvtier.vllm.connector import _layout_backend

    wrapped = create_chunked_local_attention_backend(CPUAttentionBackend, 512)
    assert wrapped is not CPUAttentionBackend
    assert _layout_backend(wrapped) is CPUAttentionBackend
    assert _layout_backend(CPUAttentionBackend) is CPUAttentionBackend

    class OtherLayout(CPUAttentionBackend):  # a backend that changes more than metadata
        @staticmethod
        def get_kv_cache_stride_order(include_num_layers_dimension: bool = False
                                      ) -> tuple[int, ...]:
            return (0, 1, 2, 3, 4)

    assert _layout_backend(OtherLayout) is OtherLayout
