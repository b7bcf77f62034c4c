"""``StepTimer`` pairs each output with the step the worker ran, never by arrival order.

vLLM reports no output for some steps (an empty connector output is dropped) and reports
one for 0-token steps that only finish sends; both used to shift every later timing onto
a neighbouring step. Time is driven by hand.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from kvtier.vllm.protocol import CopyOp, KVTierWorkerMetadata
from kvtier.vllm.threshold import MAX_STEPS_IN_FLIGHT, StepTimer


class _Model:
    def __init__(self) -> None:
        self.seen: list[tuple[list[tuple[int, int]], float, int]] = []

    def observe_step(self, requests: list[tuple[int, int]], seconds: float, *,
                     loaded_bytes: int = 0) -> None:
        self.seen.append((requests, seconds, loaded_bytes))


class _Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _so(tokens: int) -> Any:
    per = {"r": tokens} if tokens else {}
    return SimpleNamespace(
        num_scheduled_tokens=per,
        scheduled_new_reqs=[SimpleNamespace(req_id="r", num_computed_tokens=0)] if tokens
        else [],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], num_computed_tokens=[]),
    )


def _timer() -> tuple[StepTimer, _Model, _Clock]:
    model, clock = _Model(), _Clock()
    return StepTimer(model, block_bytes=10, clock=clock), model, clock  # type: ignore[arg-type]


def test_a_0_token_step_output_does_not_take_the_next_steps_time() -> None:
    timer, model, clock = _timer()
    timer.built(1, _so(0), [])  # only finishes sends: not timed
    timer.built(2, _so(64), [CopyOp("r", 0, [1, 2])])
    clock.t += 0.5
    timer.done(1)  # step 1's output (finished_sending) arrives first
    assert model.seen == []
    clock.t += 1.0
    timer.done(2)
    assert model.seen == [([(64, 0)], 1.0, 20)], "step 2 timed from step 1's output"


def test_a_step_without_output_is_dropped_not_paired_with_the_next() -> None:
    timer, model, clock = _timer()
    timer.built(1, _so(32), [])
    timer.built(2, _so(64), [])
    clock.t += 2.0
    timer.done(2)  # step 1's output was empty and never came
    assert model.seen == [([(64, 0)], 2.0, 0)]
    timer.done(1)  # late or duplicate: nothing left to time
    assert len(model.seen) == 1


def test_unknown_steps_are_ignored_and_the_backlog_is_bounded() -> None:
    timer, model, clock = _timer()
    timer.done(0)  # a worker that ran no step
    for i in range(1, 3 * MAX_STEPS_IN_FLIGHT):
        timer.built(i, _so(8), [])
    assert len(timer._steps) == MAX_STEPS_IN_FLIGHT
    clock.t += 1.0
    timer.done(3 * MAX_STEPS_IN_FLIGHT - 1)
    assert len(model.seen) == 1 and not timer._steps


def test_tp_ranks_report_the_same_step_and_aggregate_keeps_it() -> None:
    a = KVTierWorkerMetadata([3], [], step=7)
    b = KVTierWorkerMetadata([], ["x"], step=7)
    agg = a.aggregate(b)
    assert isinstance(agg, KVTierWorkerMetadata)
    assert agg.step == 7
