"""The twelve defects a review of the connector against vLLM 0.32's scheduler found
(issue 31), one regression test each. Where the scenario needs vLLM's own scheduler the
test drives it through the simulation (``kvtier/testing/sim.py``); where it is one hook's
answer, through the hooks as the scheduler calls them (``tests/vllm/hooks.py``)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from kvtier.testing.sim import SHAPES, SimWorld
from kvtier.testing.simdrive import check_step, kvtier_doc
from kvtier.tiers.base import TierError
from kvtier.vllm.protocol import CopyOp, KVTierMetadata
from tests.vllm import test_hybrid as hy
from tests.vllm import test_tails as tl
from tests.vllm.hooks import ask


@pytest.fixture
def full_world(tmp_path: Path) -> Iterator[SimWorld]:
    world = SimWorld(tmp_path / "w", SHAPES["full"],
                     kvtier_doc(tmp_path, host="512KiB", write="through"), num_blocks=48)
    yield world
    world.close()


def _run(world: SimWorld, limit: int = 200) -> None:
    for _ in range(limit):
        if world.idle and not world.connector.scheduler_side.has_pending_saves():
            return
        world.step()
        world.check_blocks()
        check_step(world)
    raise AssertionError("the world did not go idle")


PROMPT = [3 + (i * 7) % 480 for i in range(200)]


# 1 ----------------------------------------------------------------------------------
def test_1_a_shrinking_local_hit_restarts_a_hybrid_lookup(tmp_path: Path) -> None:
    """vLLM's own hit shrinks (its cache evicted tail blocks while the request waited for
    a lower-tier read): a window or hybrid prefix staged for the larger hit holds nothing
    below it, so the lookup starts again from the smaller hit."""
    sched = hy._sched(tmp_path)
    try:
        hy._finish(sched, hy._req("a", [*hy.BASE, 7]))
        hy._settle(sched, "a")
        turn2 = hy._req("b", [*hy.BASE, 7, 8])
        assert ask(sched, turn2, 10 * hy.BS) == hy.BS
        first = sched._lookups["b"]
        assert first.asked_at == 10 * hy.BS
        n = ask(sched, turn2, 9 * hy.BS)  # the hit shrank by a block
        assert sched._lookups["b"] is not first and sched._lookups["b"].asked_at == 9 * hy.BS
        assert n == 2 * hy.BS
        sched.update_state_after_alloc(
            turn2, hy.GroupBlocks([0] * 6 + list(range(6, 12)), list(range(50, 62))), n)
        assert [(op.group, op.block_ids, op.first) for op in sched.build_meta().loads] == [
            (hy.FULL, [59, 60], 1), (hy.SW, [9, 10], 1)]
    finally:
        sched.close()


# 2 ----------------------------------------------------------------------------------
def test_2_a_request_aborted_during_its_async_load_saves_nothing(tmp_path: Path) -> None:
    """vLLM frees such a request's blocks when its load is reported; a save would make
    ``finished_sending`` free them again (vLLM asserts: the engine dies)."""
    sched = hy._sched(tmp_path)
    try:
        hy._finish(sched, hy._req("a", [*hy.BASE, 7]))
        hy._settle(sched, "a")
        turn2 = hy._req("b", [*hy.BASE, *range(300, 300 + 40)], computed=0)
        n = ask(sched, turn2)
        assert n == 2 * hy.CT + 3 * hy.BS
        tables = hy._tables(12 * hy.BS, 14)
        sched.update_state_after_alloc(turn2, hy.GroupBlocks(*tables), n)
        sched.build_meta()
        turn2.num_computed_tokens = 12 * hy.BS  # as vLLM counts it: more than is stored
        delay, params = sched.request_finished_groups(turn2, tables)  # aborted
        assert not delay and params["kvtier"]["tokens"] == 0
        assert sched.build_meta().saves == []
        sched.on_worker_output(None, None, finished_recving={"b"})
    finally:
        sched.close()


# 3 ----------------------------------------------------------------------------------
def test_3_vllms_fail_policy_is_refused_naming_the_fix() -> None:
    from vllm.config import KVTransferConfig

    from kvtier.vllm.connector import check_load_failure_policy

    ktc = KVTransferConfig(kv_connector="KVTierConnector", kv_role="kv_both")
    assert ktc.kv_load_failure_policy == "fail"  # vLLM's default
    with pytest.raises(TierError, match='"kv_load_failure_policy": "recompute"'):
        check_load_failure_policy(ktc)
    check_load_failure_policy(KVTransferConfig(
        kv_connector="KVTierConnector", kv_role="kv_both", kv_load_failure_policy="recompute"))


# 4 ----------------------------------------------------------------------------------
def test_4_a_load_failed_on_purpose_is_reported_failed(tmp_path: Path) -> None:
    """The hybrid "fail this load" op names no block: it must still fail the request,
    or vLLM computes on blocks nothing wrote."""
    w, _ = hy._worker(tmp_path)
    try:
        w.run(KVTierMetadata(1, loads=[CopyOp("r", -1, [], 0, 0)], async_loads=True),
              layer_by_layer=False)
        w.end_forward()
        assert w.get_finished(set()) == (None, {"r"})
        assert w.load_failures() == {"r"}
    finally:
        w.close()


# 5 ----------------------------------------------------------------------------------
def test_5_prompt_logprobs_requests_hold_no_staging(full_world: SimWorld) -> None:
    """vLLM reads no prefix cache for a ``prompt_logprobs`` request and overrides
    kvtier's answer (even "ask again") with 0: nothing may stay staged for it."""
    world = full_world
    world.add("a", PROMPT, max_tokens=2)
    _run(world)
    world.scheduler.reset_prefix_cache()
    side = world.connector.scheduler_side
    side.store.flush()
    side.store.drop_host()  # restored from the file tier: staging takes a read
    world.add("b", [*PROMPT, 9, 9], max_tokens=2, prompt_logprobs=1)
    for _ in range(3):
        world.step()
        check_step(world)
        assert "b" not in world.connector.scheduler_side._lookups
    _run(world)
    assert "b" not in world.restored


# 6 ----------------------------------------------------------------------------------
def test_6_a_streaming_update_with_new_inputs_rekeys_the_request(tmp_path: Path) -> None:
    from tests.vllm.test_identity import _mm

    sched = tl._sched(tl._cfg(tmp_path))
    try:
        toks = list(range(1, 2 * tl.CT + 1))
        req = tl._req("s", toks)
        req.mm_features = [_mm("img-0", 4, 8)]
        got = sched._keys(req, len(toks))
        assert isinstance(got, tuple)
        before = list(got[1])
        req.all_token_ids = toks = [*toks, *range(600, 600 + tl.CT)]
        req.num_tokens = len(toks)
        req.mm_features.append(_mm("img-1", 2 * tl.CT + 4, 8))  # the session's update
        got = sched._keys(req, len(toks))
        assert isinstance(got, tuple)
        assert got[1][:2] == before  # earlier chunks keep their keys
        fresh = tl._sched(tl._cfg(tmp_path / "fresh"))
        try:
            again = fresh._keys(req, len(toks))
            assert isinstance(again, tuple)
            assert got[1] == again[1], "the third chunk must mix in the new image"
        finally:
            fresh.close()
    finally:
        sched.close()


# 7 ----------------------------------------------------------------------------------
def test_7_an_in_place_adapter_reload_is_a_new_identity(tmp_path: Path) -> None:
    from kvtier.vllm.identity import PENDING, Unsupported
    sched = tl._sched(tl._cfg(tmp_path))
    try:
        ids = sched.identities
        adapter = tmp_path / "lora"
        adapter.mkdir()
        (adapter / "adapter_model.safetensors").write_bytes(b"v1" * 64)
        (adapter / "adapter_config.json").write_text("{}")
        lora = SimpleNamespace(lora_name="a", lora_int_id=1, lora_path=str(adapter))
        req = tl._req("x", list(range(1, 70)))
        req.lora_request = lora
        for _ in range(200):  # the fingerprint is made on a background thread
            if ids.of(req) is not PENDING:
                break
            ids.adapters._executor.submit(lambda: None).result()
        assert ids.of(req) is not PENDING
        reload = tl._req("y", list(range(1, 70)))
        reload.lora_request = SimpleNamespace(lora_name="a", lora_int_id=1,
                                              lora_path=str(adapter), load_inplace=True)
        with pytest.raises(Unsupported, match="load_inplace"):
            ids.of(reload)
        assert ids.of(req) is PENDING, "the reloaded adapter is fingerprinted again"
    finally:
        sched.close()


# 8 ----------------------------------------------------------------------------------
def test_8_a_failed_load_is_not_retried(tmp_path: Path) -> None:
    """With ``recompute`` vLLM asks again after a failed asynchronous load: the same load
    would fail the same way, so the answer is 0 from then on."""
    sched = hy._sched(tmp_path)
    try:
        hy._finish(sched, hy._req("a", [*hy.BASE, 7]))
        hy._settle(sched, "a")
        turn2 = hy._req("b", [*hy.BASE, 7, 8, 9], computed=0)
        n = ask(sched, turn2)
        assert n
        sched.update_state_after_alloc(turn2, hy.GroupBlocks(*hy._tables(n, 12)), n)
        sched.build_meta()
        sched.on_worker_output(None, None, failed_loads={"b"}, finished_recving={"b"})
        assert ask(sched, turn2) == 0
        assert sched._lookups == {}
    finally:
        sched.close()


# 9 ----------------------------------------------------------------------------------
def test_9_a_rank_whose_loads_fail_to_start_still_acknowledges_its_step(
        tmp_path: Path) -> None:
    w, _ = hy._worker(tmp_path)
    try:
        bad = CopyOp("r", 0, [3, 4], 0, 0, group=7)  # no such group: start_loads raises
        w.run(KVTierMetadata(5, loads=[bad]), layer_by_layer=False)
        w.end_forward()
        meta = w.worker_meta()
        assert meta is not None and meta.loaded_steps == [5]
        assert w.load_errors() == {3, 4}  # vLLM recomputes those blocks
    finally:
        w.close()


# 10 ---------------------------------------------------------------------------------
def _with_a_short_tail(tmp_path: Path) -> tuple[Any, list[int], bytes]:
    """A scheduler side holding a request's 1-block tail of chunk 1: the side, that
    request's tokens and the tail's key."""
    sched = tl._sched(tl._cfg(tmp_path))
    one = [*range(900, 900 + tl.CT + tl.BS + 1)]
    tl._finish(sched, tl._req("d", one))
    short = tl._tail(one, 1, 1)
    assert sched.store.host.indexed(short)
    return sched, one, short


def test_10_a_failed_longer_save_keeps_the_shorter_tail(tmp_path: Path) -> None:
    from kvtier.vllm.protocol import KVTierWorkerMetadata

    sched, one, short = _with_a_short_tail(tmp_path)
    try:
        longer = tl._req("e", [*one[: tl.CT + tl.BS], *range(1000, 1000 + tl.BS + 1)])
        sched.request_finished(longer, list(range(100, 100 + 7)))
        assert sched.store.host.indexed(short), "dropped before the longer save commits"
        meta = sched.build_meta()
        sched.on_worker_output({"e"}, KVTierWorkerMetadata([], ["e"], meta.step))
        assert sched.store.host.indexed(short), "the longer save failed: keep the short"
    finally:
        sched.close()


def test_10b_a_piece_another_request_is_saving_leaves_the_shorter_tail(
        tmp_path: Path) -> None:
    """Two requests end with the same longer piece: the second finds the first one's
    save of it in flight and must not drop the shorter tail then (review 2026-12-04,
    old defect 10): if that save fails, the shorter tail is the only copy left."""
    from kvtier.vllm.protocol import KVTierWorkerMetadata

    sched, one, short = _with_a_short_tail(tmp_path)
    try:
        grown = [*one[: tl.CT + tl.BS], *range(1000, 1000 + tl.BS + 1)]
        sched.request_finished(tl._req("e", grown), list(range(100, 100 + 7)))
        sched.request_finished(tl._req("f", grown), list(range(200, 200 + 7)))
        assert sched.store.host.indexed(short), "dropped while the longer save is in flight"
        meta = sched.build_meta()
        sched.on_worker_output({"e", "f"}, KVTierWorkerMetadata([], ["e", "f"], meta.step))
        assert sched.store.host.indexed(short), "both longer saves failed: keep the short"
    finally:
        sched.close()


# 11 ---------------------------------------------------------------------------------
def test_11_a_finished_request_is_saved_up_to_its_last_computed_token(
        tmp_path: Path) -> None:
    """``num_computed_tokens`` can run ahead of the KV that exists (speculative drafts,
    async scheduling's step in flight): a save stops at ``num_tokens - 1``."""
    sched = tl._sched(tl._cfg(tmp_path, partial_tails=False))
    try:
        toks = list(range(1, 2 * tl.CT + 1))
        req = tl._req("a", toks, computed=2 * tl.CT)  # counted all, last one sampled
        _, params = sched.request_finished(req, list(range(100, 108)))
        assert params["kvtier"]["tokens"] == tl.CT
        assert [op.block_ids for op in sched.build_meta().saves] == [[100, 101, 102, 103]]
    finally:
        sched.close()


# 12 ---------------------------------------------------------------------------------
def test_12_preempted_requests_keep_their_output(full_world: SimWorld) -> None:
    """kvtier is a best-effort cache: vLLM must not drop and resample a preempted
    request's in-flight output for it."""
    assert full_world.connector.requires_kv_delivery is False
    assert full_world.scheduler.requires_kv_delivery is False

