"""Defects a review of the connector against vLLM 0.32 found (its N1-N13), one
regression test each, on both of vLLM's schedulers where the scenario runs through one:
``Scheduler`` and ``AsyncScheduler`` (the GPU default), driven by the simulation
(``kvtier/testing/sim.py``). Each failed on the code before its fix."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvtier.ops import resolve_copy_backend
from kvtier.testing.sim import SHAPES, SimWorld
from kvtier.testing.simdrive import check_quiescent, check_step, kvtier_doc
from kvtier.vllm.protocol import CopyOp, KVTierMetadata
from tests.vllm.test_worker_async import LAYERS, LOADS, Gated, make_worker, save_two_chunks_gated

CT = 64  # the sim's chunk tokens (``kvtier_doc``)
#: nine whole chunks and a bit: more than the staging cap of a 10-slot pool (5) holds
PROMPT = [3 + (i * 11) % 490 for i in range(9 * CT + 20)]
SCHEDULERS = ["sync", "async"]


@pytest.fixture(params=SCHEDULERS)
def world(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[SimWorld]:
    """A 10-slot host pool (160 KiB of 16 KiB chunks): a 9-chunk restore streams through
    a window of 5 with a head of 2."""
    w = SimWorld(tmp_path / "w", SHAPES["full"],
                 kvtier_doc(tmp_path, host="160KiB", write="through"), num_blocks=96,
                 async_scheduling=request.param == "async")
    yield w
    w.close()


def _step(world: SimWorld) -> None:
    world.step()
    world.check_blocks()
    check_step(world)


def _run(world: SimWorld, limit: int = 300) -> None:
    for _ in range(limit):
        if world.idle and not world.connector.scheduler_side.has_pending_saves():
            return
        _step(world)
    raise AssertionError("the world did not go idle")


def _stored_then_forgotten(world: SimWorld) -> None:
    """The conversation is stored (written through to the file tier), then vLLM's own
    prefix cache and kvtier's host tier forget it: its return reads the file tier."""
    world.add("a", PROMPT, max_tokens=2)
    _run(world)
    assert world.scheduler.reset_prefix_cache()
    side = world.connector.scheduler_side
    assert side.store.flush(10.0)  # its write-throughs landed
    side.store.drop_host()
    assert side._stream_window == 5


def _chunk_files(world: SimWorld) -> list[Path]:
    """The file tier's objects of ``PROMPT``'s whole chunks, in chain order."""
    from vllm import SamplingParams
    from vllm.v1.request import Request

    side = world.connector.scheduler_side
    probe = Request("probe", PROMPT, SamplingParams(max_tokens=1), None, arrival_time=0.0,
                    block_hasher=world._hasher)
    got = side._keys(probe, len(PROMPT))
    side._key_cache.pop("probe")
    assert isinstance(got, tuple)
    transport: Any = getattr(side.store.lower[0].tier, "transport")  # noqa: B009
    return [transport.path_of(k) for k in got[1]]


# N2 ---------------------------------------------------------------------------------
def test_n2_a_short_head_restores_what_was_read(world: SimWorld) -> None:
    """The second chunk of a streamed restore's two-chunk head is gone: the first is
    restored (synchronously) and the rest computed. Before, the lookup claimed the whole
    stored prefix, the stream failed at the missing chunk, and vLLM recomputed all of
    it, the chunk it had read included."""
    _stored_then_forgotten(world)
    files = _chunk_files(world)
    assert len(files) == 9 and all(f.exists() for f in files), [f.exists() for f in files]
    files[1].unlink()  # chunk 1 of the head
    world.add("b", [*PROMPT, 7], max_tokens=2)
    _run(world)
    assert world.restored["b"] == CT
    assert "b" not in world.connector.scheduler_side._load_failed
    assert world.check_outputs() >= 1
    check_quiescent(world)


# N1, N7 -----------------------------------------------------------------------------
def test_n1_an_aborted_stream_the_worker_never_saw_frees_its_request(
        world: SimWorld) -> None:
    """vLLM's own hit grows past a streamed restore's head while the head is read
    (another request computed those chunks), so the head fills no block and no copy op
    goes out; the request is then aborted. The worker must still report it received:
    vLLM frees an aborted request in WAITING_FOR_REMOTE_KVS only then. Before, it held
    the request and its blocks for the engine's life. The head's entries are never read
    again (N7)."""
    side = world.connector.scheduler_side
    _stored_then_forgotten(world)
    world.hang_reads()
    world.add("b", [*PROMPT, 7], max_tokens=2)
    _step(world)
    assert "b" in side._lookups  # its head read hangs
    # a request that reads nothing from kvtier computes the first two chunks meanwhile
    world.add("c", PROMPT[: 2 * CT + 5], max_tokens=1,
              kv_params={"kvtier": {"load": False}})
    for _ in range(4):
        _step(world)
    assert "c" in world.finished
    world.unhang()
    for _ in range(20):
        _step(world)
        if "b" in side._streams:
            break
    assert "b" in side._streams and not world.connector.scheduler_side._loads
    world.abort("b")
    _run(world)
    assert "b" not in world.scheduler.requests
    check_quiescent(world)


# N4 ---------------------------------------------------------------------------------
def test_n4_a_save_stream_waiting_for_slots_lets_vllm_preempt(tmp_path: Path) -> None:
    """A finished request's save streams through a 3-slot pool: while pieces wait for
    host slots (seconds, at worst), vLLM must not stop preempting (it breaks out of its
    running loop while ``has_pending_block_frees``); once every piece has a slot the
    frees are due within a step and it may wait."""
    world = SimWorld(tmp_path / "w", SHAPES["full"],
                     kvtier_doc(tmp_path, host="48KiB", write="through"), num_blocks=96)
    try:
        side = world.connector.scheduler_side
        world.add("a", PROMPT, max_tokens=2)
        saw_pending = False
        for _ in range(300):
            if world.idle and not side.has_pending_saves():
                break
            _step(world)
            st = side._save_streams.get("a")
            if st is not None and st.pending:
                saw_pending = True
                assert side.has_pending_saves()
                assert not world.connector.has_pending_block_frees()
        assert saw_pending
    finally:
        world.close()


# N8 ---------------------------------------------------------------------------------
def test_n8_a_weights_reset_ends_streamed_restores(world: SimWorld) -> None:
    """A restore streaming KV of the old weights when the weights are reset ends with a
    failed load (vLLM recomputes the request), instead of delivering old-epoch KV."""
    side = world.connector.scheduler_side
    side.cfg = side.cfg.model_copy(update={"reset_cache": "weights"})
    _stored_then_forgotten(world)
    world.add("b", [*PROMPT, 7], max_tokens=2)
    for _ in range(20):
        _step(world)
        if "b" in side._streams:
            break
    assert "b" in side._streams
    assert world.connector.reset_cache()
    assert not side._streams
    _run(world)
    assert "b" in world.finished and world.check_outputs() >= 1
    check_quiescent(world)


# N12 --------------------------------------------------------------------------------
def test_n12_a_stream_that_fails_reports_nothing_restored(world: SimWorld) -> None:
    """Restored tokens count once the worker has every copy; a streamed restore whose
    copy fails reports none (before: the tokens handed out were reported restored)."""
    _stored_then_forgotten(world)
    world.fail_copies(1.0)  # every worker copy fails from now on
    world.add("b", [*PROMPT, 7], max_tokens=2)
    for _ in range(200):
        _step(world)
        if "b" in world.finished:
            break
    world.fail_copies(0.0)
    assert "b" in world.finished
    assert world.kv_params["b"]["kvtier"]["restored_tokens"] == 0
    _run(world)
    check_quiescent(world)


# N3 ---------------------------------------------------------------------------------
def test_n3_async_loads_never_make_the_compute_stream_wait(tmp_path: Path) -> None:
    """An asynchronous load (a streamed restore's, a hybrid model's) is issued whole and
    nothing waits for it: its request is not in this forward, and the step's logits and
    sampling must not wait behind its copies. Synchronous loads still order the forward
    layer by layer."""
    gated = Gated(resolve_copy_backend("torch"))
    w = make_worker(tmp_path, batches=gated, issue=len(LAYERS))
    try:
        save_two_chunks_gated(w, gated)
        gated.handles.clear()
        w.run(KVTierMetadata(2, loads=[CopyOp("r", 0, [8, 9, 10, 11])], async_reqs=["r"]),
              layer_by_layer=True)
        for name in LAYERS:
            w.wait_for_layer(name)
        w.end_forward()
        assert gated.handles and all(h.stream_waits == 0 for h in gated.handles)
        gated.open_all()
        assert w.get_finished(set()) == (None, {"r"})
        gated.handles.clear()
        w.run(KVTierMetadata(3, loads=LOADS), layer_by_layer=True)
        for name in LAYERS:
            w.wait_for_layer(name)
        w.end_forward()
        assert all(h.stream_waits == 1 for h in gated.handles)
    finally:
        w.close()


# N13 --------------------------------------------------------------------------------
def test_n13_a_streams_copied_steps_are_not_kept(tmp_path: Path) -> None:
    """The worker folds each copied step of a streamed restore into the request's
    failure flag: what it keeps does not grow with the stream's length."""
    gated = Gated(resolve_copy_backend("torch"))
    w = make_worker(tmp_path, batches=gated, issue=len(LAYERS))
    try:
        save_two_chunks_gated(w, gated)
        for step in range(2, 12):
            w.run(KVTierMetadata(step, loads=[CopyOp("r", step % 2, [8, 9, 10, 11])],
                                 async_reqs=["r"], more=["r"]), layer_by_layer=True)
            w.end_forward()
            gated.open_all()
            assert w.get_finished(set()) == (None, None)
            assert len(w._recving["r"]) <= 1
        w.run(KVTierMetadata(12), layer_by_layer=True)
        w.end_forward()
        assert w.get_finished(set()) == (None, {"r"})
        assert w.load_failures() == set()
    finally:
        w.close()


# async scheduling -------------------------------------------------------------------
def test_under_async_scheduling_a_failed_restore_never_reaches_an_output(
        tmp_path: Path) -> None:
    """With vLLM's steps overlapped, every restore is an asynchronous load: a copy that
    fails holds its request until it is reported, and vLLM recomputes it before any
    forward reads the block. A synchronous load's failure is reported after the next
    step already ran on the block: vLLM 0.32 rolled the request back but kept that
    step's token, and the output differed from a recompute."""
    world = SimWorld(tmp_path / "w", SHAPES["full"],
                     kvtier_doc(tmp_path, host="160KiB", write="through"), num_blocks=96,
                     async_scheduling=True)
    try:
        side = world.connector.scheduler_side
        assert side.async_restores
        prompt = PROMPT[: 3 * CT + 9]
        world.add("a", prompt, max_tokens=2)
        _run(world)
        assert world.scheduler.reset_prefix_cache()
        assert side.store.flush(10.0)
        world.fail_copies(1.0)
        world.add("b", [*prompt, 5], max_tokens=6)
        _run(world)
        assert world.copy_faults > 0 and "b" in world.restored
        assert world.check_outputs() == 2
        assert world.kv_params["b"]["kvtier"]["restored_tokens"] == 0
        world.fail_copies(0.0)
        check_quiescent(world)
    finally:
        world.close()


# N11 --------------------------------------------------------------------------------
@pytest.mark.parametrize("hash_block_size", [16, 8])
def test_n11_events_are_off_when_vllm_hashes_other_than_blocks(
        tmp_path: Path, hash_block_size: int, caplog: pytest.LogCaptureFixture) -> None:
    """vLLM names blocks by hashes of ``hash_block_size`` tokens (``--prefix-match-unit``
    below the block size); kvtier's events name one hash per block, so they would name
    the wrong ones: kvtier publishes none then, and says why."""
    from vllm.config import KVEventsConfig

    def events_on(vllm_config: Any, kv_cache_config: Any) -> None:
        vllm_config.kv_events_config = KVEventsConfig(enable_kv_cache_events=True,
                                                      publisher="null")
        kv_cache_config.hash_block_size = hash_block_size

    world = SimWorld(tmp_path / "w", SHAPES["full"], kvtier_doc(tmp_path), num_blocks=48,
                     configure=events_on)
    try:
        if hash_block_size == world.bs:
            assert world.connector._events is not None
        else:
            assert world.connector._events is None
            assert "KV events off: vLLM hashes every 8 tokens" in caplog.text
    finally:
        world.close()


# P/D: vLLM's proxy protocol -------------------------------------------------------------
def test_vllms_pd_protocol_hands_the_prefill_nodes_kv_to_the_decode(
        world: SimWorld) -> None:
    """vLLM's own P/D proxy (and llm-d's sidecar) send the prefill node ``max_tokens: 1``
    with ``kv_transfer_params: {do_remote_decode: true, ...}`` and hand its response's
    ``kv_transfer_params`` to the decode node: the answer says ``do_remote_prefill`` and
    names what was stored (``kvtier.expect``), and the decode request restores all of it
    (here one engine plays both nodes: vLLM's own cache and the host pool are emptied in
    between, so only the file tier holds it)."""
    side = world.connector.scheduler_side
    prompt = PROMPT[: 4 * CT + 37]
    nixl_style = {"do_remote_decode": True, "do_remote_prefill": False,
                  "remote_engine_id": None, "remote_block_ids": None, "remote_host": None,
                  "remote_port": None}
    world.add("p", prompt, max_tokens=1, kv_params=nixl_style)
    _run(world)
    answer = world.kv_params["p"]
    assert answer["do_remote_prefill"] is True and answer["do_remote_decode"] is False
    expect = answer["kvtier"]["expect"]
    assert expect["tokens"] == len(prompt) // world.bs * world.bs  # chunks and a tail
    assert world.scheduler.reset_prefix_cache()
    assert side.store.flush(10.0)
    side.store.drop_host()
    world.add("d", prompt, max_tokens=8, kv_params=answer)
    _run(world)
    assert world.restored["d"] == expect["tokens"] >= 0.95 * len(prompt)
    assert world.check_outputs() == 2
    check_quiescent(world)
