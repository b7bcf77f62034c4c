"""No wait outlasts the recompute it would save (issue 32): once the engine's prefill
speed is measured, a probe of a hung tier and a stuck load are given up after the
recompute of the tokens at stake, not after the configured seconds (which stay the upper
bound). Driven as vLLM drives the scheduler side; time is a ManualClock.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.clock import ManualClock
from kvtier.stepfit import StepModel
from kvtier.vllm.waitbound import FLOOR_S, WaitBound
from tests.test_bounded_waits import _request, _sched, _store_below

PER_TOKEN_S = 2e-4  # a tiny model: 3 chunks of 128 tokens recompute in ~0.08 s


def _warm(steps: StepModel) -> None:
    for i in range(steps.warmup_steps + 8):
        n = 64 + 37 * i
        steps.observe([(n, 0)], 1e-3 + PER_TOKEN_S * n)
    assert steps.warm


def test_the_bound_is_the_recompute_within_floor_and_configured() -> None:
    steps = StepModel(warmup_steps=8)
    bound = WaitBound(steps)
    assert bound.seconds(1.0, 0, 384) == 1.0  # unmeasured: the configured seconds
    _warm(steps)
    assert bound.seconds(1.0, 0, 3000) == pytest.approx(PER_TOKEN_S * 3000, rel=0.2)
    assert bound.seconds(1.0, 0, 384) == FLOOR_S  # ~0.08 s of recompute: the floor
    assert bound.seconds(1.0, 0, 1) == FLOOR_S
    assert bound.seconds(0.05, 0, 384) == 0.05  # never above the configured seconds


def test_healthy_storage_gets_the_configured_wait_until_one_runs_out() -> None:
    """On a loaded node a healthy shared filesystem may answer slower than a small
    model's recompute: the tight bound applies only for a while after a wait ran out."""
    steps = StepModel(warmup_steps=8)
    _warm(steps)
    bound = WaitBound(steps, suspect_s=60.0)
    assert bound.seconds(1.0, 0, 384, now=100.0) == 1.0  # nothing ran out yet
    bound.missed(100.0)
    assert bound.seconds(1.0, 0, 384, now=130.0) == FLOOR_S
    assert bound.seconds(1.0, 0, 384, now=161.0) == 1.0  # a minute later: healthy again


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.mark.parametrize("suspect", [True, False], ids=["after-a-timeout", "first-probe"])
def test_a_probe_of_a_hung_tier_waits_no_longer_than_the_recompute(
    tmp_path: Path, clock: ManualClock, suspect: bool,
) -> None:
    """A new prompt's probe of a hung tier gives up at the recompute of what it asks
    about (the floor here), not at ``lookup_timeout_seconds``: after an earlier wait ran
    out (storage suspect), and also for the first probes after a tier hangs, before
    anything ran out (issue 43: every prompt in flight when a mount hung paid 1 s)."""
    sched, tier = _sched(tmp_path, clock)
    try:
        _warm(sched.waits.steps)
        if suspect:
            sched.waits.missed(clock.monotonic())
        assert sched.waits.suspect(clock.monotonic()) is suspect
        tier.hang.set()
        req = _request("p", 2)
        assert sched.get_num_new_matched_tokens(req, 0) == (None, False)  # probing
        clock.advance(FLOOR_S + 0.01)
        assert sched.lookup_timeout_s >= 1.0
        assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    finally:
        tier.gate.set()
        sched.close()


def test_a_stuck_load_waits_no_longer_than_the_recompute(
    tmp_path: Path, clock: ManualClock,
) -> None:
    sched, tier = _sched(tmp_path, clock)
    try:
        _warm(sched.waits.steps)
        sched.waits.missed(clock.monotonic())  # an earlier wait ran out: suspect
        req = _request("r", 1)
        _store_below(sched, tier, req, 3)
        tier.hang.set()
        assert sched.get_num_new_matched_tokens(req, 0) == (None, False)  # loading
        assert tier.entered.acquire(timeout=10)
        clock.advance(FLOOR_S + 0.01)
        assert sched.load_stall_s >= 2.0
        assert sched.get_num_new_matched_tokens(req, 0) == (0, False)  # recompute now
    finally:
        tier.gate.set()
        sched.close()
