"""Partial tails on the scheduler side, without an engine: a finished request's last,
partial chunk is saved down to the block, a returning request restores it, and a
longer save supersedes it.

Requests are plain records with the attributes of vLLM's ``Request`` that the scheduler
side reads; the store is real (host pool, and a file tier where a test needs one); the
worker's part is the ``finished_sending`` report. Bytes are checked end to end in
``test_tails_e2e.py``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from kvtier.build import build_store
from kvtier.clock import ManualClock
from kvtier.config import KVTierConfig
from kvtier.keys import ChunkKey, Namespace, chunk_keys, tail_key
from kvtier.tiers.file import FileTier
from kvtier.vllm.geometry import Geometry
from kvtier.vllm.protocol import CopyOp
from kvtier.vllm.scheduler_side import SchedulerSide
from tests.vllm.hooks import Blocks, ask

BS, BPC = 16, 4
CT = BS * BPC
GEOM = Geometry(2, 2, 8, BS, 1024, "float32")
NS = Namespace(model="m", model_fingerprint="0" * 16, kv_dtype="float32", kv_layout="NHD",
               num_layers=2, num_kv_heads=2, head_size=8, chunk_tokens=CT, block_size=BS)
BASE = list(range(1, 2 * CT + 3 * BS + 1))  # 2 chunks and 3 blocks


def _cfg(tmp_path: Path, **extra: Any) -> KVTierConfig:
    return KVTierConfig.model_validate({
        "chunk_tokens": CT,
        "tiers": [{"host": {"capacity": "1MiB", "pinned": "no"}},
                  {"file": {"path": str(tmp_path), "capacity": "1GiB", "write": "back"}}],
        "restore": {"recompute_threshold_tokens": 1},
        "idle_flush_seconds": 0, "max_dirty_seconds": 0,
        **extra,
    })


def _sched(cfg: KVTierConfig, role: str = "both") -> SchedulerSide:
    return SchedulerSide(cfg, GEOM, NS, None, store=build_store(cfg, GEOM.chunk_bytes(CT)),
                         role=role, clock=ManualClock())


@pytest.fixture
def sched(tmp_path: Path) -> Iterator[SchedulerSide]:
    s = _sched(_cfg(tmp_path))
    yield s
    s.close()


def _req(rid: str, tokens: list[int], computed: int | None = None,
         **kvtier: Any) -> SimpleNamespace:
    return SimpleNamespace(
        request_id=rid, num_tokens=len(tokens), all_token_ids=tokens,
        num_computed_tokens=len(tokens) - 1 if computed is None else computed,
        kv_transfer_params={"kvtier": kvtier}, cache_salt=None, lora_request=None,
        mm_features=None, prompt_embeds=None)


def _tail(tokens: list[int], chunk: int, blocks: int) -> ChunkKey:
    keys = chunk_keys(NS.digest(), tokens[: chunk * CT], CT)
    prev = keys[-1] if chunk else NS.digest()
    return tail_key(prev, tokens[chunk * CT : chunk * CT + blocks * BS])


def _finish(sched: SchedulerSide, req: SimpleNamespace) -> dict[str, Any]:
    """The request finishes with one block per ``BS`` tokens; its copies complete."""
    blocks = list(range(100, 100 + -(-req.num_tokens // BS)))
    _, params = sched.request_finished(req, blocks)
    sched.build_meta()
    sched.on_worker_output({req.request_id}, None)
    out: dict[str, Any] = params["kvtier"]
    return out


def _restore(sched: SchedulerSide, req: SimpleNamespace, computed: int = 0) -> list[CopyOp]:
    n = ask(sched, req, computed)
    assert n is not None
    blocks = Blocks(list(range(-(-req.num_tokens // BS))))
    sched.update_state_after_alloc(req, blocks, n)
    return sched.build_meta().loads


def test_a_finished_request_saves_its_tail_and_announces_it(sched: SchedulerSide) -> None:
    req = _req("a", [*BASE, 7])  # 3 blocks past the chunks are computed; 1 token is not
    blocks = list(range(100, 100 + 12))
    delay, params = sched.request_finished(req, blocks)
    saves = sched.build_meta().saves
    assert delay
    assert [(op.block_ids, op.span) for op in saves] == [
        ([100, 101, 102, 103], 0), ([104, 105, 106, 107], 0), ([108, 109, 110], 3)]
    kv = params["kvtier"]
    assert kv["tokens"] == 2 * CT + 3 * BS
    assert kv["last_key"] == _tail(BASE, 2, 3).hex()
    tail_bytes = GEOM.chunk_bytes(CT) // BPC * 3
    assert kv["spilled_bytes"] == 2 * GEOM.chunk_bytes(CT) + tail_bytes
    sched.on_worker_output({"a"}, None)
    metas = {m.key: m for _, m in sched.store.host.index.entries()}
    meta = metas[_tail(BASE, 2, 3)]
    assert meta.payload_len == tail_bytes
    assert meta.num_tokens == 3 * BS and meta.shape == (2, 3, 1024)
    assert meta.parent == chunk_keys(NS.digest(), BASE, CT)[1]


def test_a_returning_turn_restores_up_to_its_last_full_block(sched: SchedulerSide) -> None:
    _finish(sched, _req("a", [*BASE, 7]))
    turn2 = _req("b", [*BASE, 7, 8, 9])
    loads = _restore(sched, turn2)
    assert [(op.block_ids, op.first, op.span) for op in loads] == [
        ([0, 1, 2, 3], 0, 0), ([4, 5, 6, 7], 0, 0), ([8, 9, 10], 0, 3)]


def test_vllm_s_own_hit_inside_the_tail_chunk_loads_only_the_rest(
        sched: SchedulerSide) -> None:
    _finish(sched, _req("a", [*BASE, 7]))
    loads = _restore(sched, _req("b", [*BASE, 7, 8]), computed=2 * CT + BS)
    assert [(op.block_ids, op.first, op.span) for op in loads] == [([9, 10], 1, 3)]


def test_a_longer_save_supersedes_the_tail(sched: SchedulerSide) -> None:
    _finish(sched, _req("a", [*BASE, 7]))
    short = _tail(BASE, 2, 3)
    assert sched.store.host.indexed(short)
    grown = [*BASE, *range(500, 500 + BS + 5)]  # chunk 2 is whole now, plus 5 tokens
    kv = _finish(sched, _req("b", grown))
    assert kv["tokens"] == 3 * CT  # 5 tokens are not a block: no tail
    assert not sched.store.host.indexed(short), "a whole chunk holds its bytes now"
    # the next turn restores the whole chunk, not the dropped tail
    loads = _restore(sched, _req("c", [*grown, 1, 2]))
    assert [op.span for op in loads] == [0, 0, 0]
    # a tail superseded by a longer tail of the same chunk
    one = [*range(900, 900 + CT + BS + 1)]
    _finish(sched, _req("d", one))
    _finish(sched, _req("e", [*one[: CT + BS], *range(1000, 1000 + BS + 1)]))
    assert not sched.store.host.indexed(_tail(one, 1, 1))
    assert sched.store.host.indexed(_tail([*one[: CT + BS], *range(1000, 1000 + BS)], 1, 2))


def test_requests_sharing_a_prefix_keep_their_own_tails(sched: SchedulerSide) -> None:
    a = [*BASE[: 2 * CT], *range(300, 300 + 2 * BS + 1)]
    b = [*BASE[: 2 * CT], *range(600, 600 + 3 * BS + 1)]
    _finish(sched, _req("a", a))
    _finish(sched, _req("b", b))
    assert sched.store.host.indexed(_tail(a, 2, 2)) and sched.store.host.indexed(_tail(b, 2, 3))
    assert ask(sched, _req("a2", [*a, 5])) == 2 * CT + 2 * BS
    assert ask(sched, _req("b2", [*b, 5])) == 2 * CT + 3 * BS
    # a third one that agrees with a's tail for one block, then branches, finds neither
    # (only a's 2-block tail is stored): it restores the whole chunks
    c = [*BASE[: 2 * CT], *range(300, 300 + BS), *range(50, 50 + 2 * BS)]
    assert ask(sched, _req("c", c)) == 2 * CT


def test_a_tail_of_chunk_0_and_a_prompt_shorter_than_a_chunk(sched: SchedulerSide) -> None:
    short = list(range(40, 40 + 2 * BS + 1))
    kv = _finish(sched, _req("a", short))
    assert kv["tokens"] == 2 * BS and kv["last_key"] == _tail(short, 0, 2).hex()
    loads = _restore(sched, _req("b", [*short, 3]))
    assert [(op.block_ids, op.span) for op in loads] == [([0, 1], 2)]


def test_partial_tails_off_saves_and_restores_whole_chunks_only(tmp_path: Path) -> None:
    sched = _sched(_cfg(tmp_path, partial_tails=False))
    try:
        kv = _finish(sched, _req("a", [*BASE, 7]))
        assert kv["tokens"] == 2 * CT and kv["last_key"] == chunk_keys(
            NS.digest(), BASE, CT)[1].hex()
        assert ask(sched, _req("b", [*BASE, 7, 8])) == 2 * CT
    finally:
        sched.close()


def test_write_back_tiers_get_a_tail_only_if_it_outlives_its_turn(
        sched: SchedulerSide, tmp_path: Path) -> None:
    """A superseded tail is dropped from the host before any flush: the file tier gets
    the chunks and the last tail only."""
    first = [*BASE, 7]
    _finish(sched, _req("a", first))
    grown = [*BASE, *range(500, 500 + BS + 2 * BS + 1)]  # chunk 2 whole, then 2 blocks
    _finish(sched, _req("b", grown))
    assert sched.store.flush_dirty(10.0).left == 0
    assert sched.store.flush(10.0)
    below = FileTier(tmp_path, 1 << 30)
    keys = chunk_keys(NS.digest(), grown, CT)
    assert below.contains_prefix(keys) == 3
    assert below.contains_prefix([_tail(grown, 3, 2)]) == 1
    assert below.contains_prefix([_tail(first, 2, 3)]) == 0, "superseded: never written"
    # a restart finds the tail below and restores it, before its index has it: the
    # restarted tier's start scan lists one directory (a filler's), then waits (0.001
    # objects/s)
    filler = tmp_path / "kv" / "00" / "00" / ("0" * 32 + ".kv")
    filler.parent.mkdir(parents=True, exist_ok=True)
    filler.touch()
    cfg = _cfg(tmp_path).model_dump()
    cfg["tiers"][1]["file"]["index_objects_per_second"] = 0.001
    again = _sched(KVTierConfig.model_validate(cfg))
    try:
        tier = again.store.lower[0].tier
        assert isinstance(tier, FileTier) and not tier.index_ready
        assert not tier.indexed(_tail(grown, 3, 2))
        assert ask(again, _req("c", [*grown, 1])) == 3 * CT + 2 * BS  # chunks and tail
        assert not tier.index_ready
    finally:
        again.close()


@pytest.fixture
def decode(tmp_path: Path) -> Iterator[tuple[SchedulerSide, FileTier]]:
    cfg = KVTierConfig.model_validate({
        "chunk_tokens": CT,
        "tiers": [{"host": {"capacity": "1MiB", "pinned": "no"}},
                  {"file": {"path": str(tmp_path), "capacity": "1GiB", "write": "through"}}],
        "restore": {"recompute_threshold_tokens": 1, "wait_seconds": 5.0},
    })
    s = _sched(cfg, role="decode")
    yield s, FileTier(tmp_path, 1 << 30)
    s.close()


def test_p_d_announces_the_tail_and_the_decode_waits_for_it(
        decode: tuple[SchedulerSide, FileTier], tmp_path: Path) -> None:
    dec, shared = decode
    prompt = BASE  # the prefill ran the whole prompt: 2 chunks and 3 blocks
    keys = chunk_keys(NS.digest(), prompt, CT)
    tail = _tail(prompt, 2, 3)
    expect = {"tokens": 2 * CT + 3 * BS, "last_key": tail.hex()}
    req = _req("d", prompt, expect=expect)
    for c in range(2):
        shared.put(dec._meta(NS.digest(), keys, c),
                   np.zeros(GEOM.chunk_bytes(CT), np.uint8).data)
    assert ask(dec, req) is None, "the announced tail is not visible yet: wait"
    spec = dec._tail_spec(NS.digest(), 3)
    shared.put(spec.meta(tail, keys[1]), np.zeros(spec.payload_len, np.uint8).data)
    # the prompt is a whole number of blocks: vLLM computes its last block itself
    assert ask(dec, req) == 2 * CT + 2 * BS
    # a tail announced for another prompt is not waited for
    other = _req("e", [9, *prompt[1:]], expect=expect)
    assert ask(dec, other) == 0
