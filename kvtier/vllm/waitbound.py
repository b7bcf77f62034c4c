"""``WaitBound``: no wait outlasts the recompute it would save (issue 32).

A request waits on storage twice: for a lookup's probe ("is it on a lower tier?") and for
a load (restoring what was found). Either wait exists to save a recompute, so neither may
last longer than that recompute: the bound is the measured time to compute the tokens at
stake (the engine's prefill speed, ``kvtier.stepfit.StepModel``, the same fit the
``auto`` threshold policy uses), never less than ``floor_s`` and never more than the
configured seconds (``restore.lookup_timeout_seconds``, the load's stall allowance),
which stay the upper bound. Until the step model is warm (its first prefill steps) the
configured seconds apply.

Why: on a tiny model a recompute costs 0.08 s, and with the configured 1 s probe and 2 s
load deadlines a hung tier made each new prompt wait 14 times what it could save.

Probes (``probe_seconds``) are bounded by the recompute always; loads (``seconds``) get
the configured seconds while the storage is healthy and the recompute once a wait ran
out (a healthy read of a long prefix on a loaded node can sit idle behind other IO for
longer than a small model's recompute; abandoning it would turn a restore into a
recompute, so the first load on a tier that stops answering pays its deadline once).

Threads: ``seconds`` reads the step model (its own lock); any thread.
"""

from __future__ import annotations

from kvtier.stepfit import StepModel

#: A wait is never bounded below this. A healthy local tier answers in milliseconds, but
#: a shared filesystem or an endpoint on a loaded node takes tens to a few hundred (one
#: CephFS chunk read under load): a tighter bound abandoned healthy restores (the P/D
#: end-to-end tests restored nothing). It stays within the +0.3 s a new prompt may pay.
FLOOR_S = 0.25


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

    def probe_seconds(self, configured_s: float, at_stake: int) -> float:
        """How long a lookup's probe ("is it on a lower tier?") of ``at_stake`` tokens
        may wait: their measured recompute within ``[floor_s, configured_s]``, healthy
        storage or not. A probe is what every new prompt with nothing indexed pays
        (most prompts of a busy node); on a tier that has just stopped answering, the
        first prompts after the hang started are no exception (the breaker and the
        suspect window only learn of the hang from the first wait that runs out)."""
        return self.seconds(configured_s, 0, at_stake)  # no ``now``: suspect or not

    def seconds(self, configured_s: float, start_tokens: int, end_tokens: int,
                now: float | None = None) -> float:
        """How long to wait for tokens ``[start_tokens, end_tokens)`` (those the wait
        may save, with ``[0, start_tokens)`` already cached): the measured recompute of
        them, within ``[floor_s, configured_s]``; ``configured_s`` while unmeasured, and
        (given ``now``) while no wait ran out in the last ``suspect_s``: healthy storage
        on a loaded node may take longer than a small model's recompute, and the first
        wait on a tier that stops answering pays the configured deadline once."""
        if not self.steps.warm:
            return configured_s
        if now is not None and not self.suspect(now):
            return configured_s
        recompute = self.steps.recompute_seconds(start_tokens, end_tokens)
        return min(configured_s, max(self.floor_s, recompute))
