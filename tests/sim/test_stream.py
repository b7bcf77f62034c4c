"""Restores streamed through a bounded window of host slots (issue 36, ``stream.py``),
driven through vLLM's own scheduler (``kvtier/testing/sim.py``): a host pool smaller
than one conversation still restores it, every block vLLM counts as computed holds its
own prefix's bytes, and an abort or a hung tier mid-stream leaves nothing held."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtier.testing.sim import SHAPES, SimWorld
from kvtier.testing.simdrive import check_quiescent, check_step, kvtier_doc

CT = 64  # the sim's chunk tokens (``kvtier_doc``)
#: 9 whole chunks and a bit: a 3-slot host pool (48 KiB of 16 KiB chunks) cannot stage it
PROMPT = [3 + (i * 11) % 490 for i in range(9 * CT + 20)]


@pytest.fixture
def world(tmp_path: Path) -> Iterator[SimWorld]:
    w = SimWorld(tmp_path / "w", SHAPES["full"],
                 kvtier_doc(tmp_path, host="48KiB", write="through"), num_blocks=96)
    yield w
    w.close()


def _step(world: SimWorld, peak: list[int]) -> None:
    world.step()
    world.check_blocks()
    check_step(world)
    side = world.connector.scheduler_side
    peak[0] = max(peak[0], side.store.host.index.num_held())


def _run(world: SimWorld, peak: list[int], limit: int = 300) -> None:
    for _ in range(limit):
        if world.idle and not world.connector.scheduler_side.has_pending_saves():
            return
        _step(world, peak)
    raise AssertionError("the world did not go idle")


def _until_streaming(world: SimWorld, rid: str, peak: list[int]) -> None:
    """Step until ``rid``'s restore is streaming (its first chunks handed out)."""
    for _ in range(100):
        _step(world, peak)
        if rid in world.connector.scheduler_side._streams:
            return
    raise AssertionError(f"{rid} never streamed")


def _first_turn(world: SimWorld) -> None:
    """The conversation grows over three turns of three chunks each (a save needs a host
    slot per new chunk; written through to the file tier, the slots come back), then
    vLLM's own prefix cache forgets it: the next turn can only restore from kvtier."""
    for turn, end in enumerate((3 * CT + 5, 6 * CT + 5, len(PROMPT))):
        world.add(f"a{turn}", PROMPT[:end], max_tokens=2)
        _run(world, [0])
        assert world.scheduler.reset_prefix_cache()


def test_a_conversation_longer_than_the_host_pool_is_restored_through_a_window(
        world: SimWorld) -> None:
    side = world.connector.scheduler_side
    assert side.store.host.pool.num_slots == 3 and side._stream_window == 1
    _first_turn(world)
    world.add("b", [*PROMPT, 7, 8, 9], max_tokens=2)
    peak, streamed = [0], False
    for _ in range(300):
        if world.idle:
            break
        _step(world, peak)
        streamed = streamed or "b" in side._streams
    assert streamed
    # every whole chunk of the first turn came back (vLLM computes at least one token)
    assert world.restored["b"] >= 9 * CT
    assert peak[0] <= side.store.host.pool.num_slots
    check_quiescent(world)


def test_an_abort_mid_stream_frees_everything(world: SimWorld) -> None:
    side = world.connector.scheduler_side
    _first_turn(world)
    world.add("b", [*PROMPT, 7], max_tokens=2)
    peak = [0]
    _until_streaming(world, "b", peak)
    world.abort("b")
    _run(world, peak)
    assert not side._streams and "b" not in side._recving
    check_quiescent(world)  # no slot held, vLLM has every block back


def test_a_tier_that_hangs_mid_stream_costs_a_recompute_not_the_request(
        world: SimWorld, caplog: pytest.LogCaptureFixture) -> None:
    side = world.connector.scheduler_side
    _first_turn(world)
    assert side.store.drop_host() >= 0  # every chunk must come from the file tier
    world.add("b", [*PROMPT, 7], max_tokens=2)
    peak = [0]
    _until_streaming(world, "b", peak)
    world.hang_reads()
    try:
        for _ in range(200):
            if "b" in world.finished:
                break
            _step(world, peak)
        assert "b" in world.finished  # recomputed: its blocks were checked every step
        assert "streamed restore of b could not" in caplog.text
    finally:
        world.unhang()
    _run(world, peak)
    check_quiescent(world)


def test_one_turn_longer_than_the_host_pool_is_saved_whole(world: SimWorld) -> None:
    """A first turn of 9 chunks through 3 host slots: its save streams (``_SaveStream``:
    each step's copies are committed once acknowledged, written below, and their slots
    reused), so all 9 chunks are stored by one turn; before, it stored the 3 that had a
    slot. vLLM's own cache then forgets it: the return restores every chunk."""
    side = world.connector.scheduler_side
    world.add("a", PROMPT, max_tokens=2)
    peak, streamed = [0], False
    for _ in range(300):
        if world.idle and not side.has_pending_saves():
            break
        _step(world, peak)
        streamed = streamed or "a" in side._save_streams
    assert streamed and not side._save_streams
    assert peak[0] <= side.store.host.pool.num_slots
    assert world.scheduler.reset_prefix_cache()
    world.add("b", [*PROMPT, 7, 8, 9], max_tokens=2)
    _run(world, peak)
    assert world.restored["b"] >= 9 * CT
    check_quiescent(world)
