"""Restore or recompute? The per-request decision behind ``recompute_threshold_tokens: auto``.

Restoring chunk ``i`` from tier ``T`` costs a read into a host slot (on an IO thread, one
chunk after another: ``TieredStore._read_entries`` reads a request's chunks sequentially) plus
the host-to-KV copy in the next step; a host hit costs only the copy. So the estimate is
per chunk, ``read_T(chunk_bytes) + copy(chunk_bytes)``, where each tier's read time is
``scale * (latency + nbytes / bandwidth)``: ``latency`` and ``bandwidth`` come from a startup
probe (``seed``; ``kvtier.probe.probe_tier`` measures them) and ``scale`` is an EWMA of
observed / predicted over real reads (``observe_read``), so the estimate converges to what
reads cost now. The copy is the host tier's estimate (a memcpy; ``host_bandwidth`` until
the host tier is probed). Recomputing comes from ``kvtier.stepfit.StepModel``.

Restoring ``k`` chunks still leaves the rest to compute, so the options are compared by
total time ``restore(k) + recompute(start + span_k, end)``. Recompute cost is additive over
any split of a span, so that total minus ``recompute(start, end)`` is ``restore(k) -
recompute(span_k)``: the end of the prompt does not change the choice and is not needed.

Invariants of ``CostModel.decide``:

* it never returns more chunks than offered, nor a chunk that adds no token;
* warm, it restores ``k > 0`` chunks only if ``restore(k) <= (1 - margin) * recompute(span_k)``
  and, among those ``k``, picks the largest saving (the smallest ``k`` on ties); so the
  chosen total is within ``margin * recompute(start, end)`` of the cheapest option;
* cold (the step model is not warm) or with a tier that has no read estimate, it restores
  everything: the behaviour before this model existed. The reason says which.

Threads: ``seed``/``observe_read`` may be called from any thread (IO threads); ``decide``,
``observe_step`` and ``ThresholdPolicy.chunks_to_restore`` from vLLM's scheduler thread.
No I/O and no clock: time only enters through the observations.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields
from enum import StrEnum

from kvtier.config import RestoreConfig
from kvtier.metrics import record_threshold_decision
from kvtier.stepfit import StepModel, recompute_seconds

#: Host-to-KV copy rate assumed until the host tier is probed (a conservative memcpy).
DEFAULT_HOST_BANDWIDTH = 5e9
#: One observation moves the read estimate by at most this factor (a stalled read, a
#: page-cache hit) before the EWMA weight applies.
_MAX_RATIO = 100.0


class Outcome(StrEnum):
    RESTORE_ALL = "restore_all"
    RESTORE_PARTIAL = "restore_partial"
    RECOMPUTE = "recompute"


@dataclass(frozen=True)
class Decision:
    """How many of the offered chunks to restore, and why (for debug logs)."""

    chunks: int
    tokens: int  # new tokens those chunks cover (past start, before the limit)
    outcome: Outcome
    reason: str
    restore_s: float | None = None  # estimated restore of the chosen chunks
    recompute_s: float | None = None  # estimated recompute of the same tokens
    cold: bool = False  # the step model was not warm: restored as a fixed threshold would

    def __str__(self) -> str:
        est = ""
        if self.restore_s is not None and self.recompute_s is not None:
            est = f" (restore {self.restore_s * 1e3:.2f} ms vs recompute " \
                  f"{self.recompute_s * 1e3:.2f} ms)"
        return f"{self.outcome.value} {self.chunks} chunks / {self.tokens} tokens: " \
               f"{self.reason}{est}"


@dataclass
class DecisionCounts:
    """Decisions by outcome; written on the scheduler thread, read from any."""

    restore_all: int = 0
    restore_partial: int = 0
    recompute: int = 0
    cold: int = 0  # of the restore_all ones: taken because the model was not warm yet

    def add(self, d: Decision) -> None:
        setattr(self, d.outcome.value, getattr(self, d.outcome.value) + 1)
        self.cold += d.cold

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass
class _ReadEstimate:
    latency_s: float
    bandwidth_Bps: float
    scale: float = 1.0
    observations: int = 0

    def seconds(self, nbytes: int) -> float:
        return self.scale * (self.latency_s + nbytes / self.bandwidth_Bps)


class ReadModels:
    """Per-tier read time estimates. Thread-safe (IO threads observe, the scheduler reads)."""

    def __init__(self, alpha: float = 0.2) -> None:
        if not 0 < alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        self._alpha = alpha
        self._lock = threading.Lock()
        self._tiers: dict[str, _ReadEstimate] = {}

    def seed(self, tier: str, latency_s: float, bandwidth_Bps: float) -> None:
        """Start (or restart) ``tier``'s estimate from a probe; forgets its observations."""
        if not (latency_s >= 0 and bandwidth_Bps > 0 and math.isfinite(latency_s)):
            raise ValueError(f"{tier}: need latency >= 0 and bandwidth > 0, "
                             f"got {latency_s}, {bandwidth_Bps}")
        with self._lock:
            self._tiers[tier] = _ReadEstimate(latency_s, bandwidth_Bps)

    def observe(self, tier: str, nbytes: int, seconds: float) -> None:
        """A read of ``nbytes`` from ``tier`` took ``seconds`` (only verified hits count)."""
        if nbytes <= 0 or not (seconds > 0 and math.isfinite(seconds)):
            return
        with self._lock:
            est = self._tiers.get(tier)
            if est is None:  # never probed: the first read is the whole estimate
                self._tiers[tier] = _ReadEstimate(0.0, nbytes / seconds, observations=1)
                return
            ratio = seconds / est.seconds(nbytes) * est.scale
            ratio = min(max(ratio, est.scale / _MAX_RATIO), est.scale * _MAX_RATIO)
            est.scale += self._alpha * (ratio - est.scale)
            est.observations += 1

    def seconds(self, tier: str, nbytes: int) -> float | None:
        """Estimated time of one read, or None if ``tier`` was never seeded nor observed."""
        with self._lock:
            est = self._tiers.get(tier)
            return None if est is None else est.seconds(nbytes)

    def observations(self, tier: str) -> int:
        with self._lock:
            est = self._tiers.get(tier)
            return 0 if est is None else est.observations


class CostModel:
    """Read estimates per tier + the engine's step model, and the decision built on them."""

    def __init__(
        self,
        *,
        margin: float = 0.1,
        warmup_steps: int = 20,
        host_tier: str = "host",
        host_bandwidth: float = DEFAULT_HOST_BANDWIDTH,
        read_alpha: float = 0.2,
        steps: StepModel | None = None,
    ) -> None:
        if not 0 <= margin < 1:
            raise ValueError(f"margin must be in [0, 1), got {margin}")
        self.margin = margin
        self.host_tier = host_tier
        self.reads = ReadModels(read_alpha)
        self.reads.seed(host_tier, 0.0, host_bandwidth)
        self.steps = steps or StepModel(warmup_steps=warmup_steps)

    # -- observations ---------------------------------------------------------------------
    def seed(self, tier: str, latency_s: float, bandwidth_Bps: float) -> None:
        """Any thread. Typically from ``probe_tier`` at start."""
        self.reads.seed(tier, latency_s, bandwidth_Bps)

    def observe_read(self, tier: str, nbytes: int, seconds: float) -> None:
        """Any thread (IO threads): one chunk read from ``tier`` into a host slot."""
        self.reads.observe(tier, nbytes, seconds)

    def observe_step(
        self, requests: Iterable[tuple[int, int]], seconds: float, *, loaded_bytes: int = 0
    ) -> None:
        """Scheduler thread, once per engine step: ``(new_tokens, context_before)`` per
        scheduled request, the step's wall time, and the bytes the connector loaded in it."""
        self.steps.observe(requests, seconds, loaded_bytes=loaded_bytes)

    # -- estimates ------------------------------------------------------------------------
    def chunk_restore_seconds(self, tier: str, chunk_bytes: int) -> float | None:
        """Read (unless a host hit) plus host-to-KV copy of one chunk; None if unmeasured."""
        copy = self.reads.seconds(self.host_tier, chunk_bytes)
        if copy is None or tier == self.host_tier:
            return copy
        read = self.reads.seconds(tier, chunk_bytes)
        return None if read is None else read + copy

    def recompute_seconds(self, start_tokens: int, end_tokens: int) -> float:
        return self.steps.recompute_seconds(start_tokens, end_tokens)

    def prefix_costs(
        self,
        start_tokens: int,
        chunk_tokens: int,
        chunk_bytes: int,
        tiers_of_chunks: Sequence[str],
        limit_tokens: int | None = None,
    ) -> list[tuple[int, float | None, float]]:
        """For each useful prefix of ``k = 1..`` chunks: (new tokens, restore s, recompute s).

        Chunk ``i`` spans ``[base + i * ct, base + (i + 1) * ct)`` with ``base`` the chunk
        boundary at or below ``start_tokens``; it adds the tokens of that span at or past
        ``start_tokens`` and below ``limit_tokens``. The list stops at the first chunk that
        adds none. Restore is None from the first chunk on a tier with no estimate.
        """
        base = start_tokens // chunk_tokens * chunk_tokens
        limit = math.inf if limit_tokens is None else limit_tokens
        c = self.steps.coefficients()  # once: decide runs on the scheduler thread
        per_tier: dict[str, float | None] = {}
        out: list[tuple[int, float | None, float]] = []
        restore: float | None = 0.0
        for i, tier in enumerate(tiers_of_chunks):
            end = min(base + (i + 1) * chunk_tokens, limit)
            if end <= max(start_tokens, base + i * chunk_tokens):
                break
            if tier not in per_tier:
                per_tier[tier] = self.chunk_restore_seconds(tier, chunk_bytes)
            one = per_tier[tier]
            restore = None if restore is None or one is None else restore + one
            out.append((int(end) - start_tokens, restore,
                        recompute_seconds(c, start_tokens, int(end))))
        return out

    def decide(
        self,
        start_tokens: int,
        chunk_tokens: int,
        chunk_bytes: int,
        tiers_of_chunks: Sequence[str],
        *,
        limit_tokens: int | None = None,
    ) -> Decision:
        """How many leading chunks of ``tiers_of_chunks`` to restore (see the invariants)."""
        costs = self.prefix_costs(start_tokens, chunk_tokens, chunk_bytes, tiers_of_chunks,
                                  limit_tokens)
        if not costs:
            return Decision(0, 0, Outcome.RECOMPUTE, "no stored chunk adds a token")
        n = len(costs)
        tokens, restore, recompute = costs[-1]
        if not self.steps.warm:
            seen = f"{self.steps.prefill_steps}/{self.steps.warmup_steps} prefill steps observed"
            return Decision(n, tokens, Outcome.RESTORE_ALL, f"cold: {seen}", restore, None,
                            cold=True)
        if restore is None:
            missing = next(t for t in tiers_of_chunks
                           if self.chunk_restore_seconds(t, chunk_bytes) is None)
            return Decision(n, tokens, Outcome.RESTORE_ALL,
                            f"tier {missing} has no read estimate yet", None, recompute)
        best_k, best_saving = 0, 0.0
        for k, (_, r, c) in enumerate(costs, start=1):
            assert r is not None
            if r <= (1 - self.margin) * c and c - r > best_saving:
                best_k, best_saving = k, c - r
        if best_k == 0:
            return Decision(0, 0, Outcome.RECOMPUTE,
                            f"no prefix restores {self.margin:.0%} cheaper", restore, recompute)
        tokens, restore, recompute = costs[best_k - 1]
        if best_k == n:
            return Decision(n, tokens, Outcome.RESTORE_ALL, "restore is cheaper",
                            restore, recompute)
        return Decision(best_k, tokens, Outcome.RESTORE_PARTIAL,
                        f"the first {best_k} of {n} chunks save the most", restore, recompute)


class ThresholdPolicy:
    """``recompute_threshold_tokens``: a fixed token threshold, or ``auto`` (a ``CostModel``).

    The scheduler calls only ``chunks_to_restore``; ``model`` is None for a fixed
    threshold, so the timing hooks can be skipped. Scheduler thread only (``counts`` may
    be read from any).
    """

    def __init__(self, fixed_tokens: int | None, model: CostModel | None) -> None:
        if (fixed_tokens is None) == (model is None):
            raise ValueError("a ThresholdPolicy is either fixed(tokens) or auto(model)")
        self.fixed_tokens = fixed_tokens
        self.model = model
        self.counts = DecisionCounts()

    @classmethod
    def fixed(cls, tokens: int) -> ThresholdPolicy:
        """Restore all stored chunks if they add >= ``tokens`` tokens (0 acts as 1)."""
        return cls(max(1, tokens), None)

    @classmethod
    def auto(cls, model: CostModel) -> ThresholdPolicy:
        return cls(None, model)

    @classmethod
    def from_config(cls, cfg: RestoreConfig, *, host_tier: str = "host") -> ThresholdPolicy:
        """``restore.recompute_threshold_tokens`` (+ ``auto_margin``, ``auto_warmup_steps``);
        ``host_tier`` names the tier whose hits cost only the copy."""
        t = cfg.recompute_threshold_tokens
        if t == "auto":
            return cls.auto(CostModel(margin=cfg.auto_margin, warmup_steps=cfg.auto_warmup_steps,
                                      host_tier=host_tier))
        return cls.fixed(t)

    def chunks_to_restore(
        self,
        start_tokens: int,
        chunk_tokens: int,
        chunk_bytes: int,
        tiers_of_chunks: Sequence[str],
        *,
        limit_tokens: int | None = None,
        fixed_tokens: int | None = None,
    ) -> Decision:
        """The decision for one request. ``fixed_tokens`` (a request's own threshold)
        overrides the policy for this request: a fixed threshold, whatever the config."""
        if fixed_tokens is not None:
            d = self._fixed(start_tokens, chunk_tokens, tiers_of_chunks, limit_tokens,
                            max(1, fixed_tokens))
        elif self.model is not None:
            d = self.model.decide(start_tokens, chunk_tokens, chunk_bytes, tiers_of_chunks,
                                  limit_tokens=limit_tokens)
        else:
            assert self.fixed_tokens is not None
            d = self._fixed(start_tokens, chunk_tokens, tiers_of_chunks, limit_tokens,
                            self.fixed_tokens)
        self.counts.add(d)
        record_threshold_decision(d.outcome.value)
        return d

    @staticmethod
    def _fixed(
        start: int, ct: int, tiers: Sequence[str], limit: int | None, threshold: int
    ) -> Decision:
        base = start // ct * ct
        n = len(tiers)
        if limit is not None:
            n = max(0, min(n, -(-(limit - base) // ct)))
        end = min(base + n * ct, limit if limit is not None else base + n * ct)
        tokens = max(0, end - start)
        if tokens < threshold:
            return Decision(0, 0, Outcome.RECOMPUTE,
                            f"{tokens} tokens < threshold {threshold}")
        return Decision(n, tokens, Outcome.RESTORE_ALL, f"threshold {threshold}")
