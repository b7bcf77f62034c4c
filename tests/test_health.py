"""The per-tier circuit breaker, on a ManualClock."""

from __future__ import annotations

import pytest

from kvtier.clock import ManualClock
from kvtier.health import Breaker, TierState, TierUnavailable


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


def _breaker(clock: ManualClock, **kw: float) -> Breaker:
    args: dict[str, float] = {"failures": 3, "slow_s": 5.0, "cooldown_s": 10.0,
                              "max_in_flight": 1}
    args.update(kw)
    return Breaker("s31", failures=int(args["failures"]), slow_s=args["slow_s"],
                   cooldown_s=args["cooldown_s"], max_in_flight=int(args["max_in_flight"]),
                   clock=clock)


def _fail(b: Breaker) -> None:
    with b.call(read=False) as c:
        c.fail()


def test_consecutive_failures_open_it_and_a_success_in_between_resets(clock: ManualClock) -> None:
    b = _breaker(clock)
    _fail(b)
    _fail(b)
    with b.call(read=False):
        pass
    _fail(b)
    _fail(b)
    assert b.up
    _fail(b)
    assert b.state is TierState.DOWN and not b.available()
    with pytest.raises(TierUnavailable), b.call(read=False):
        pass


def test_a_slow_call_is_a_failure(clock: ManualClock) -> None:
    b = _breaker(clock, failures=1)
    with b.call(read=True):
        clock.advance(6)
    assert b.state is TierState.DOWN


def test_a_hung_call_opens_it_without_returning(clock: ManualClock) -> None:
    b = _breaker(clock)
    cm = b.call(read=False)
    cm.__enter__()  # a call that hangs in the tier
    clock.advance(4.9)
    assert b.up
    clock.advance(0.2)
    assert not b.available() and b.state is TierState.DOWN
    cm.__exit__(None, None, None)  # it returns at last: too late to change anything
    assert b.state is TierState.DOWN


def test_after_the_cooldown_one_trial_decides(clock: ManualClock) -> None:
    b = _breaker(clock, failures=1)
    _fail(b)
    clock.advance(9)
    assert not b.available()
    clock.advance(1)
    assert b.available()
    trial = b.call(read=True)
    trial.__enter__()
    assert b.state is TierState.TRIAL
    with pytest.raises(TierUnavailable), b.call(read=False):
        pass  # only the trial goes through
    trial.__exit__(None, None, None)
    assert b.up


def test_a_failed_trial_starts_another_cooldown(clock: ManualClock) -> None:
    b = _breaker(clock, failures=1)
    _fail(b)
    clock.advance(10)
    _fail(b)
    assert b.state is TierState.DOWN
    clock.advance(5)
    assert not b.available()
    clock.advance(5)
    assert b.available()


def test_stuck_reads_are_bounded_busy_ones_and_writes_are_not(clock: ManualClock) -> None:
    b = _breaker(clock, max_in_flight=1)
    with b.call(read=True):
        with b.call(read=True):
            pass  # a read in flight for milliseconds: a busy tier, not a stuck one
        clock.advance(1.0)  # stuck_s = slow_s / 5
        assert not b.available()
        with pytest.raises(TierUnavailable), b.call(read=True):
            pass
        with b.call(read=False):
            pass  # a busy tier is not a failing one: writes go on
    assert b.state is TierState.UP and b.available() and b.refused == 1
