"""Sliding-window models on the scheduler side, without an engine: a finished request
stores only the window of its prefix, a returning one restores the whole prefix by
copying that window, and nothing is copied into vLLM's null blocks.

Requests are plain records with the attributes of vLLM's ``Request`` that the scheduler
side reads, and block tables are what vLLM gives for one ``SlidingWindowSpec`` group:
block 0 (the null block) wherever a block fell out of the window. The store is real.
Bytes and tokens are checked in real vLLM in ``test_shapes_e2e.py``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvtier.keys import Namespace, chunk_keys, tail_key, window_key
from kvtier.lease import renew_chain
from kvtier.vllm.geometry import Geometry
from kvtier.vllm.scheduler_side import SchedulerSide
from kvtier.vllm.window import saveable, window_parts
from tests.vllm.hooks import Blocks, ask, request_record, through_sched

BS, BPC = 16, 4
CT = BS * BPC
W = 40  # vLLM keeps the blocks from (c - 39) // 16: a hit needs cdiv(39, 16) = 3 blocks
GEOM = Geometry(2, 2, 8, BS, 1024, "float32", window=W)
NS = Namespace(model="m", model_fingerprint="0" * 16, kv_dtype="float32", kv_layout="NHD",
               num_layers=2, num_kv_heads=2, head_size=8, chunk_tokens=CT, block_size=BS,
               attention=f"sliding_window:{W}")
BASE = list(range(1, 2 * CT + 3 * BS + 1))  # 2 chunks and 3 blocks: 11 blocks


def _sched(tmp_path: Path, **extra: Any) -> SchedulerSide:
    return through_sched(tmp_path, GEOM, NS, CT, **extra)


@pytest.fixture
def sched(tmp_path: Path) -> Iterator[SchedulerSide]:
    s = _sched(tmp_path)
    yield s
    s.close()


_req = request_record


def _vllm_blocks(computed: int, total_blocks: int, base: int = 100) -> list[int]:
    """A finished request's block table as vLLM hands it over: null (0) below the
    window of its computed tokens."""
    skipped = max(0, computed - W + 1) // BS
    return [0 if i < skipped else base + i for i in range(total_blocks)]


def _finish(sched: SchedulerSide, req: SimpleNamespace) -> tuple[bool, dict[str, Any]]:
    blocks = _vllm_blocks(req.num_computed_tokens, -(-req.num_tokens // BS))
    delay, params = sched.request_finished(req, blocks)
    return delay, params["kvtier"]


def test_a_finished_request_stores_only_its_window(sched: SchedulerSide) -> None:
    req = _req("a", [*BASE, 7])  # 176 tokens computed: 11 blocks
    delay, kv = _finish(sched, req)
    saves = sched.build_meta().saves
    assert delay
    # the window of a hit of 176 tokens: blocks 8, 9, 10 (one part: fewer than a chunk)
    assert [(op.block_ids, op.span) for op in saves] == [([108, 109, 110], 3)]
    end_key = tail_key(chunk_keys(NS.digest(), BASE, CT)[1], BASE[2 * CT:])
    assert kv["tokens"] == 2 * CT + 3 * BS
    assert kv["last_key"] == window_key(end_key, 0, 1).hex()
    assert kv["spilled_bytes"] == 3 * GEOM.chunk_bytes(CT) // BPC
    sched.on_worker_output({"a"}, None)
    metas = [m for _, m in sched.store.host.index.entries()]
    assert [(m.key, m.parent) for m in metas] == [(window_key(end_key, 0, 1), end_key)]


def test_a_returning_turn_restores_its_prefix_by_copying_the_window(
        sched: SchedulerSide) -> None:
    req = _req("a", [*BASE, 7])
    _finish(sched, req)
    sched.build_meta()
    sched.on_worker_output({"a"}, None)
    turn2 = _req("b", [*BASE, 7, 8, 9], computed=0)
    n = ask(sched, turn2)
    assert n == 2 * CT + 3 * BS  # the whole prefix
    # vLLM pads the blocks below the window with its null block
    sched.update_state_after_alloc(turn2, Blocks([0] * 8 + [8, 9, 10, 11]), n)
    loads = sched.build_meta().loads
    assert [(op.block_ids, op.first, op.span) for op in loads] == [([8, 9, 10], 0, 3)]


def test_vllm_s_own_hit_inside_the_window_loads_only_the_rest(sched: SchedulerSide) -> None:
    _finish(sched, _req("a", [*BASE, 7]))
    sched.build_meta()
    sched.on_worker_output({"a"}, None)
    turn2 = _req("b", [*BASE, 7, 8])
    n = ask(sched, turn2, 9 * BS)
    assert n == 2 * BS
    sched.update_state_after_alloc(turn2, Blocks([0] * 7 + [7, 8, 9, 10, 11]), n)
    assert [(op.block_ids, op.first) for op in sched.build_meta().loads] == [([9, 10], 1)]


def test_the_window_freed_corner_stores_nothing(sched: SchedulerSide) -> None:
    # 9 blocks + 15 tokens computed: the window of the hit at 9 blocks starts at block 6,
    # which vLLM freed already (it keeps blocks from (159 - 39) // 16 = 7)
    toks = list(range(1, 10 * BS + 1))
    req = _req("c", toks, computed=9 * BS + 15)
    delay, kv = _finish(sched, req)
    assert not delay and kv["tokens"] == 0 and kv["last_key"] is None
    assert sched.build_meta().saves == []


def test_a_long_window_is_stored_in_parts_of_a_chunk(tmp_path: Path) -> None:
    s = _sched(tmp_path)
    try:
        geom = Geometry(2, 2, 8, BS, 1024, "float32", window=6 * BS + 1)  # 6 blocks
        s.geom = geom
        toks = list(range(1, 3 * CT + 2))  # 12 blocks computed, and the sampled token
        req = _req("d", toks, computed=3 * CT)
        blocks = [0] * 6 + list(range(106, 112))
        _, params = s.request_finished(req, blocks)
        assert [(op.block_ids, op.span) for op in s.build_meta().saves] == [
            ([106, 107, 108, 109], 0), ([110, 111], 2)]
        assert params["kvtier"]["tokens"] == 3 * CT
        s.on_worker_output({"d"}, None)
        end = chunk_keys(NS.digest(), toks, CT)[2]
        parts = [window_key(end, 0, 2), window_key(end, 1, 2)]
        assert params["kvtier"]["last_key"] == parts[1].hex()
        # the parts chain back to the prefix: a lease renewal from last_key walks them
        metas = {m.key: m.parent for _, m in s.store.host.index.entries()}
        assert metas == {parts[0]: end, parts[1]: parts[0]}
        s.store.flush()  # written through to the file tier: the router's renewal finds both
        assert renew_chain([lt.tier for lt in s.store.lower], parts[1].hex()) == 2
    finally:
        s.close()


def test_a_branch_without_a_window_at_its_boundary_recomputes(sched: SchedulerSide) -> None:
    _finish(sched, _req("a", [*BASE, 7]))
    sched.build_meta()
    sched.on_worker_output({"a"}, None)
    other = _req("e", [*BASE[: CT + 5], 999, 998])  # shares 1 chunk and 5 tokens
    assert ask(sched, other) == 0


@given(end=st.integers(1, 200), wb=st.integers(1, 20), bpc=st.integers(1, 8))
def test_window_parts_cover_exactly_the_window(end: int, wb: int, bpc: int) -> None:
    parts = window_parts(end, wb, bpc)
    blocks = [b for first, n in parts for b in range(first, first + n)]
    assert blocks == list(range(max(0, end - wb), end))
    assert all(1 <= n <= bpc for _, n in parts)
    assert saveable(list(range(1, end + 1)), parts)
    assert not saveable([0] * end, parts)
