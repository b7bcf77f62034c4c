"""``WaitBound``: no wait outlasts the recompute it would save (issues 32, 43).

A request waits on storage twice: for a lookup's probe ("is it on a lower tier?") and for
a load (restoring what was found). Either wait exists to save a recompute, so neither may
last longer than that recompute once the storage is not answering: the bound is the
measured time to compute the tokens at stake (the engine's prefill speed,
``kvtier.stepfit.StepModel``, the same fit the ``auto`` threshold policy uses; before it
is warm, the prefill steps' seconds per token so far), never less than ``floor_s`` and
never more than the configured seconds (``restore.lookup_timeout_seconds``, the load's
stall allowance), which stay the upper bound. Before the engine's first prefill step
nothing is measured and the configured seconds apply.

When the bound applies (``seconds``): a wait idle for the bound is given up if the storage
is *stalled* (a read of a tier the wait may be waiting on has itself been running for the
floor past its bytes' allowance: ``TieredStore.stalled``). Otherwise it may run to the
configured seconds: a load idle behind healthy IO (queued behind other loads or a write
on its tier's pool) is not hung, and abandoning it would turn a restore into a
recompute. After a wait ran out, the storage is *suspect* for ``suspect_s``: lookups then
take no read grace and saves wait for a slot no longer than the bound. The floor is
``restore.min_wait_seconds``.

Why: on a tiny model a recompute costs 0.02 to 0.09 s. With the configured 1 s probe and
2 s load deadlines, a FUSE mount hung mid-run made each new prompt in flight wait 1 s and
a returning one 2 s (issue 43; ``benchmarks/hang_inflight.py``): the first waits on a
tier that had just stopped answering paid the configured seconds because nothing had run
out yet, and an engine that had run fewer than 20 prefill steps was unmeasured.

Threads: ``seconds`` reads the step model (its own lock) and calls ``stalled`` (memory
only); any thread.
"""

from __future__ import annotations

from collections.abc import Callable

from kvtier.stepfit import StepModel

#: A wait is never bounded below this. A healthy local tier answers in milliseconds, but
#: a shared filesystem or an endpoint on a loaded node takes tens to a few hundred (one
#: CephFS chunk read under load): a much tighter bound (0.02 s) abandoned healthy
#: restores (the P/D end-to-end tests restored nothing). It leaves room within the
#: +0.3 s a hang may add to a request for a step's granularity (0.25 s left 7 ms).
FLOOR_S = 0.2


#: Per engine step, the scheduler thread waits at most this long in all for the reads that
#: its lookups start (``grace``). A read from a healthy local or shared directory takes
#: a few milliseconds; without this wait the request sat out the whole engine step
#: (seconds while others prefill) before it was asked again, and returns from the file
#: tier trailed returns from the host pool by that step.
READ_GRACE_S = 0.02


#: After a wait ran out (a probe or load abandoned at its deadline), waits stay bounded
#: by the recompute for this long after the last one; the storage is suspect.
SUSPECT_S = 60.0


class WaitBound:
    def __init__(self, steps: StepModel, floor_s: float = FLOOR_S,
                 suspect_s: float = SUSPECT_S) -> None:
        self.steps = steps
        self.floor_s = floor_s
        self.suspect_s = suspect_s
        self._missed_at: float | None = None

    def missed(self, now: float) -> None:
        """A wait ran out at ``now`` (the caller's clock): the storage is suspect."""
        self._missed_at = now

    def suspect(self, now: float) -> bool:
        """A wait ran out in the last ``suspect_s`` before ``now``."""
        return self._missed_at is not None and now - self._missed_at <= self.suspect_s

    def grace(self, start_tokens: int, end_tokens: int, left_s: float, now: float) -> float:
        """How long the scheduler thread may wait, in the hook, for a read it just started
        of tokens ``[start_tokens, end_tokens)`` (``read_grace``): ``left_s`` (what the
        step has left of ``READ_GRACE_S``), no more than their measured recompute, and 0
        while the storage is suspect."""
        if left_s <= 0 or self.suspect(now):
            return 0.0
        if not self.steps.warm:
            return left_s
        return max(0.0, min(left_s, self.steps.recompute_seconds(start_tokens, end_tokens)))

    def limit(self, configured_s: float, start_tokens: int, end_tokens: int) -> float:
        """The recompute of tokens ``[start_tokens, end_tokens)`` (those the wait may
        save, with ``[0, start_tokens)`` already cached) within ``[floor_s,
        configured_s]``; ``configured_s`` before anything is measured."""
        recompute = self.steps.estimate_recompute(start_tokens, end_tokens)
        if recompute is None:
            return configured_s
        return min(configured_s, max(self.floor_s, recompute))

    def seconds(self, configured_s: float, start_tokens: int, end_tokens: int, now: float,
                stalled: Callable[[float], bool] | None = None) -> float:
        """How long a wait for tokens ``[start_tokens, end_tokens)`` may stay idle, asked
        at ``now`` (the caller's clock) as it waits: ``limit`` while ``stalled(evidence_s)``
        (a read it may wait on has run that long past its bytes' allowance), else the
        configured seconds. Asked again each step, so a read that stalls later cuts the
        wait then. An earlier wait that ran out (``suspect``) does not cut it by itself:
        a tier that hangs keeps its hung reads in flight, so the evidence stays while the
        hang does, and on a loaded node one slow read must not turn a minute of queued
        restores into recomputes (the P/D tests did, with both cores busy)."""
        bound = self.limit(configured_s, start_tokens, end_tokens)
        if bound >= configured_s or (stalled is not None and stalled(self.evidence_s)):
            return bound
        return configured_s

    @property
    def evidence_s(self) -> float:
        """A read this much past its bytes' allowance is not answering now (``stalled``):
        the floor, so that a wait whose own read hangs is given up about when its bound
        runs out, while healthy reads (milliseconds, tens under load) rarely qualify."""
        return self.floor_s

    def save_seconds(self, configured_s: float, tokens: int, now: float) -> float:
        """How long a save of ``tokens`` may wait for a host slot: the configured seconds,
        or ``limit`` while the storage is suspect (a slot comes free as the lower tiers
        take writes; their calls say nothing of a wait for a slot)."""
        if self.suspect(now):
            return self.limit(configured_s, 0, tokens)
        return configured_s
