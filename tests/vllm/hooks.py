"""Driving the scheduler side's lookup hook as vLLM does, without an engine."""

from __future__ import annotations

from concurrent.futures import Future
from types import SimpleNamespace
from typing import Any

from kvtier.clock import ManualClock
from kvtier.vllm.scheduler_side import PROBE_INTERVAL_S, SchedulerSide


def ask(sched: SchedulerSide, req: SimpleNamespace, num_computed: int = 0) -> int | None:
    """One scheduler step's question, once the IO work it started (a probe of the lower
    tiers, then staging) has finished. With a ManualClock a step is ``PROBE_INTERVAL_S``."""
    if isinstance(sched.clock, ManualClock):
        sched.clock.advance(PROBE_INTERVAL_S)
    n: int | None = None
    for _ in range(4):
        n, _ = sched.get_num_new_matched_tokens(req, num_computed)
        probe = sched._probes.get(req.request_id)
        lk = sched._lookups.get(req.request_id)
        futures: list[Future[Any] | None] = [probe.future if probe else None,
                                             lk.future if lk else None]
        pending = [f for f in futures if f is not None and not f.done()]
        if n is not None or not pending:
            return n
        for f in pending:
            f.exception()  # IO threads: let them finish, then ask again
    return n
