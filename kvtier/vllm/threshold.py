"""The connector's side of ``recompute_threshold_tokens``: build the policy, feed it.

``threshold_policy`` builds a fixed threshold, or ``auto``: a ``kvtier.costmodel.CostModel``
fed by the store's verified reads (``TieredStore.on_read``, IO threads), by a probe of
each lower tier at start (on an IO thread), and by the engine's step times
(``StepTimer``).

Threads: ``StepTimer.built`` and ``done`` run on vLLM's scheduler thread: ``built`` when
a step's connector metadata is built (its scheduler output says what it computes),
``done`` when an output comes back, with the step the worker said it ran. Outputs are
paired with steps by that id, never by arrival order: vLLM reports no output for some
steps and an output for some 0-token steps (a step that only finishes sends), so counting
would pair a step with a neighbour's time. Memory only.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

from kvtier.config import RestoreConfig
from kvtier.costmodel import CostModel, ThresholdPolicy
from kvtier.probe import probe_tier
from kvtier.store import TieredStore
from kvtier.tiers.base import Tier
from kvtier.vllm.protocol import CopyOp

log = logging.getLogger("kvtier.vllm")

#: Steps whose output is awaited; vLLM keeps at most two in flight (async scheduling).
MAX_STEPS_IN_FLIGHT = 4


def threshold_policy(
    cfg: RestoreConfig, store: TieredStore, slot_bytes: int, *, probe: bool
) -> ThresholdPolicy:
    """A fixed threshold, or ``auto``. With ``probe``, each lower tier is probed on an IO
    thread (never on the scheduler thread); until it answers, a tier without an estimate
    is restored in full and its first real reads set the estimate."""
    policy = ThresholdPolicy.from_config(cfg, host_tier=store.host.name)
    model = policy.model
    if model is not None:
        store.on_read = model.observe_read
        if probe:
            for lt in store.lower:
                store.io.submit_store(partial(_seed, model, lt.tier, slot_bytes))
    return policy


def _seed(model: CostModel, tier: Tier, slot_bytes: int) -> None:
    try:
        r = probe_tier(tier, slot_bytes, 2)
    except Exception as e:  # a tier that fails its probe is learned from real reads
        log.warning("kvtier: probing %s for the restore cost model failed: %s", tier.name, e)
        return
    if model.reads.observations(r.tier) == 0:  # real reads beat a probe
        model.seed(r.tier, r.latency_s, r.bandwidth_Bps)
    log.info("kvtier: %s reads ~%.2f ms + %.0f MB/s (probe)", r.tier, r.latency_s * 1e3,
             r.bandwidth_Bps / 1e6)


@dataclass
class _Step:
    step: int
    t_built: float
    requests: list[tuple[int, int]]  # (tokens computed this step, context before it)
    loaded_bytes: int


class StepTimer:
    """Times engine steps for the cost model: from a step's metadata to its output."""

    def __init__(self, model: CostModel, block_bytes: int,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.model = model
        self._clock = clock
        self.block_bytes = block_bytes  # one vLLM block of every layer
        self._steps: deque[_Step] = deque()
        self._last_done = 0.0

    def built(self, step: int, so: Any, loads: Sequence[CopyOp]) -> None:
        """Step ``step`` was scheduled (``so``: vLLM's ``SchedulerOutput``); ``loads`` are
        the connector's copies in it, which its time includes. Steps that compute no
        tokens are not timed."""
        per_req: dict[str, int] = getattr(so, "num_scheduled_tokens", None) or {}
        if not per_req:
            return  # an empty step: vLLM may not report its output
        reqs = [(per_req.get(r.req_id, 0), int(r.num_computed_tokens))
                for r in getattr(so, "scheduled_new_reqs", ())]
        cached = getattr(so, "scheduled_cached_reqs", None)
        if cached is not None:
            reqs += [(per_req.get(rid, 0), int(n)) for rid, n in
                     zip(cached.req_ids, cached.num_computed_tokens, strict=False)]
        if len(self._steps) >= MAX_STEPS_IN_FLIGHT:
            self._steps.popleft()  # an output that never came: never let timings drift
        loaded = sum(len(op.block_ids) for op in loads) * self.block_bytes
        self._steps.append(_Step(step, self._clock(), [r for r in reqs if r[0]],
                                 loaded))

    def done(self, step: int) -> None:
        """The output of step ``step`` arrived (0: a worker that ran no step). Older steps
        still awaited never will be (their outputs were empty) and are dropped untimed."""
        if step <= 0:
            return
        while self._steps and self._steps[0].step < step:
            self._steps.popleft()
        now = self._clock()
        if not self._steps or self._steps[0].step != step:
            self._last_done = now  # an untimed (0-token) step: the next one queued on it
            return
        done = self._steps.popleft()
        seconds = now - max(done.t_built, self._last_done)  # async scheduling: it queued
        self._last_done = now
        self.model.observe_step(done.requests, seconds, loaded_bytes=done.loaded_bytes)
