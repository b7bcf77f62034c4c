"""No wait outlasts the recompute it would save (issue 32): once the engine's prefill
speed is measured, a probe of a hung tier and a stuck load are given up after the
recompute of the tokens at stake, not after the configured seconds (which stay the upper
bound). Driven as vLLM drives the scheduler side; time is a ManualClock.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.clock import ManualClock
from kvtier.health import Breaker
from kvtier.stepfit import StepModel
from kvtier.vllm.waitbound import FLOOR_S, WaitBound
from tests.test_bounded_waits import CT, SLOT, _request, _sched, _store_below

PER_TOKEN_S = 2e-4  # a tiny model: 3 chunks of 128 tokens recompute in ~0.08 s


def _warm(steps: StepModel) -> None:
    for i in range(steps.warmup_steps + 8):
        n = 64 + 37 * i
        steps.observe([(n, 0)], 1e-3 + PER_TOKEN_S * n)
    assert steps.warm


def test_the_bound_is_the_recompute_within_floor_and_configured() -> None:
    steps = StepModel(warmup_steps=8)
    bound = WaitBound(steps)
    assert bound.limit(1.0, 0, 384) == 1.0  # no prefill step yet: the configured seconds
    _warm(steps)
    assert bound.limit(1.0, 0, 3000) == pytest.approx(PER_TOKEN_S * 3000, rel=0.2)
    assert bound.limit(1.0, 0, 384) == FLOOR_S  # ~0.08 s of recompute: the floor
    assert bound.limit(1.0, 0, 1) == FLOOR_S
    assert bound.limit(0.05, 0, 384) == 0.05  # never above the configured seconds


def test_before_the_fit_is_warm_the_prefill_steps_so_far_bound_it() -> None:
    """An engine that has run a few prefill steps (fewer than the fit's warm-up) bounds
    waits by their seconds per token (issue 43: a server a few requests old made every
    prompt in flight on a hung mount wait the configured 1 s)."""
    steps = StepModel(warmup_steps=20)
    bound = WaitBound(steps)
    steps.observe([(900, 0)], 0.09)  # one prefill step: 0.1 ms per token, overhead included
    assert not steps.warm
    assert bound.limit(2.0, 0, 900) == FLOOR_S
    assert bound.limit(2.0, 0, 9000) == pytest.approx(0.9)
    assert bound.limit(0.5, 0, 9000) == 0.5
    steps.observe([(1, 100)], 0.5)  # a decode-only step says nothing of prefill speed
    assert bound.limit(2.0, 0, 9000) == pytest.approx(0.9)


def test_the_bound_applies_once_a_read_stalls() -> None:
    """A wait idle behind healthy IO (queued behind other loads or a write) may run to
    the configured seconds, also in the minute after another wait ran out; once a read
    it waits on has itself run for the floor past its allowance, it is cut to the
    bound. A save waits for a slot no longer than the bound while storage is suspect."""
    steps = StepModel(warmup_steps=8)
    _warm(steps)
    bound = WaitBound(steps, suspect_s=60.0)
    asked: list[float] = []

    def stalled(seconds: float) -> bool:
        asked.append(seconds)
        return False

    assert bound.seconds(1.0, 0, 384, 100.0, stalled) == 1.0  # healthy, queued
    assert asked == [FLOOR_S]  # asked whether a read has stalled
    assert bound.seconds(1.0, 0, 384, 100.0, lambda s: True) == FLOOR_S
    bound.missed(100.0)
    # a wait that ran out does not cut the next by itself: its read must stall too
    assert bound.seconds(1.0, 0, 384, 130.0, stalled) == 1.0
    assert bound.seconds(1.0, 0, 384, 130.0, lambda s: True) == FLOOR_S
    assert bound.save_seconds(1.0, 384, 130.0) == FLOOR_S  # suspect: saves wait less
    assert bound.save_seconds(1.0, 384, 161.0) == 1.0  # a minute later: healthy again
    bound.missed(200.0)
    assert bound.save_seconds(1.0, 384, 201.0) == FLOOR_S


def test_a_breaker_counts_a_call_overdue_after_the_seconds_plus_its_bytes() -> None:
    clock = ManualClock()
    b = Breaker("t", slow_s=5.0, min_bytes_per_s=1e6, clock=clock)
    assert not b.overdue(0.0)  # nothing in flight
    with b.call(read=True, nbytes=500_000):  # allowance 0.5 s
        clock.advance(0.6)
        assert b.overdue(0.05) and not b.overdue(0.25)
        clock.advance(0.2)
        assert b.overdue(0.25)
    assert not b.overdue(0.0)


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
        assert tier.entered.acquire(timeout=10)  # the probe's call is in the hung tier
        clock.advance(FLOOR_S + 0.01)
        assert sched.lookup_timeout_s >= 1.0
        assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    finally:
        tier.gate.set()
        sched.close()


@pytest.mark.parametrize("suspect", [True, False], ids=["after-a-timeout", "first-load"])
def test_a_stuck_load_waits_no_longer_than_the_recompute(
    tmp_path: Path, clock: ManualClock, suspect: bool,
) -> None:
    """A load whose read sits in a hung tier is given up at the recompute of what it
    restores, also when it is the first wait on that tier since it hung (issue 43: the
    return in flight when a mount hung waited the configured 2 s)."""
    sched, tier = _sched(tmp_path, clock)
    try:
        _warm(sched.waits.steps)
        if suspect:
            sched.waits.missed(clock.monotonic())
        req = _request("r", 1)
        _store_below(sched, tier, req, 3)
        tier.hang.set()
        assert sched.get_num_new_matched_tokens(req, 0) == (None, False)  # loading
        assert tier.entered.acquire(timeout=10)
        allowance = sched.store.breakers[0].allowance(SLOT)
        clock.advance(FLOOR_S + allowance + 0.01)
        assert sched.load_stall_s >= 2.0
        assert sched.get_num_new_matched_tokens(req, 0) == (0, False)  # recompute now
    finally:
        tier.gate.set()
        sched.close()


def test_a_load_queued_behind_a_healthy_write_keeps_the_configured_wait(
    tmp_path: Path, clock: ManualClock,
) -> None:
    """A load idle because its tier's pool is busy with a write (however slow: a busy
    shared filesystem's fsync) or a read still within its time is not hung: it waits for
    the configured seconds, not the recompute bound, so a loaded node does not turn its
    restores into recomputes."""
    sched, tier = _sched(tmp_path, clock)
    try:
        _warm(sched.waits.steps)
        req = _request("r", 1)
        _store_below(sched, tier, req, 3)
        lk = sched._progress("r")
        lk.tiers = frozenset({1})
        assert sched._idle_bound(2.0, lk, 0, 3 * CT) == 2.0  # nothing in flight
        breaker = sched.store.breakers[0]
        with breaker.call(read=False, nbytes=SLOT):  # a slow write (a busy fsync) running
            clock.advance(FLOOR_S + breaker.allowance(SLOT) + 1.0)
            assert sched._idle_bound(2.0, lk, 0, 3 * CT) == 2.0  # writes are no evidence
        with breaker.call(read=True, nbytes=SLOT):  # a read running
            clock.advance(FLOOR_S / 2)
            assert sched._idle_bound(2.0, lk, 0, 3 * CT) == 2.0
            clock.advance(FLOOR_S + breaker.allowance(SLOT))
            assert sched._idle_bound(2.0, lk, 0, 3 * CT) == FLOOR_S  # the read is overdue
        other = sched._progress("o")  # a load from the host only waits on no tier
        assert sched._idle_bound(2.0, other, 0, 3 * CT) == 2.0
    finally:
        sched.close()


def test_a_new_prompt_does_not_probe_a_tier_whose_call_has_stalled(
    tmp_path: Path, clock: ManualClock,
) -> None:
    """Once a call to a tier is overdue (a return's read sits in a hung mount), a new
    prompt's lookup does not queue a probe behind it: the indexes answer at once (issue
    43: two new prompts sent 0.3 s after a return on a hung mount each waited a probe's
    bound). A healthy tier is asked again as soon as its call returns."""
    sched, tier = _sched(tmp_path, clock)
    try:
        _warm(sched.waits.steps)
        ret = _request("r", 1)
        _store_below(sched, tier, ret, 3)
        tier.hang.set()
        assert sched.get_num_new_matched_tokens(ret, 0) == (None, False)  # loading
        assert tier.entered.acquire(timeout=10)
        clock.advance(sched.waits.evidence_s + sched.store.breakers[0].allowance(SLOT) + 0.01)
        new = _request("n", 2)
        assert sched.get_num_new_matched_tokens(new, 0) == (0, False)  # not probed
        assert "n" not in sched._probes
        tier.hang.clear()
        tier.gate.set()  # the hung read returns
        loading = sched._lookups["r"].future
        assert loading is not None
        loading.result(timeout=10)  # its call has left the breaker
        assert sched.store.can_probe(sched.waits.evidence_s)
        fresh = _request("f", 3)
        assert sched.get_num_new_matched_tokens(fresh, 0) == (None, False)  # probed again
        assert "f" in sched._probes
    finally:
        tier.gate.set()
        sched.close()
