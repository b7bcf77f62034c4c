"""How long the engine takes to compute tokens, learnt from kvtier's timing of its steps.

One engine step computes ``n_i`` new tokens for each scheduled request ``i`` whose context
(tokens already in the KV cache) was ``ctx_i``. Its time is modelled as a non-negative sum:

    t = c_step                                      (per-step overhead)
      + c_tok  * sum n_i                            (prefill: MLP and projections, linear)
      + c_attn * sum n_i * (ctx_i + n_i / 2)        (prefill: attention, grows with context)
      + c_dreq * (decode requests)                  (n_i == 1: decode, its own regime)
      + c_dctx * sum (ctx_i + 1/2) over decodes     (decode: reading the KV cache)
      + c_load * bytes loaded by the connector      (the synchronous restore copy)

Decode requests get coefficients of their own because a decode step is bound by memory,
not compute, on a GPU: fitted together with prefill tokens they would drag the per-token
prefill cost toward zero. The connector's load copy runs inside the step, so its bytes are
a regressor too; otherwise steps that restore would look like slow prefills.

The attention term is additive over any split of a span: computing tokens ``[s, e)`` with
``[0, s)`` cached costs ``c_tok * (e - s) + c_attn * (e^2 - s^2) / 2`` however the engine
chunks it. ``recompute_seconds`` is that marginal cost; it leaves out ``c_step`` (the step
happens anyway: vLLM always computes at least one token of a request).

Fit: least squares on exponentially forgotten normal equations (a window of about
``1 / (1 - forget)`` prefill steps), a small ridge toward zero so that a direction the data
never excites cannot wind up, and an exact non-negative solve (no coefficient is ever
negative). Forgetting is applied only on steps that carry prefill work: decode-only steps
inform the decode terms and never push prefill evidence out of the window. Once warm, a
step far from the prediction (a GC pause, a compile) is clipped to ``outlier_sigmas``
residual standard deviations before it enters the fit.

Threads: every method takes one lock; ``observe`` is meant for vLLM's scheduler thread
(once per step), the readers for any thread.
"""

from __future__ import annotations

import itertools
import math
import threading
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

#: Feature names, in order, and the unit each coefficient is fitted in (conditioning).
FEATURES = ("step", "prefill_tokens", "prefill_attention", "decode_requests",
            "decode_context", "loaded_bytes")
_UNITS = np.array([1.0, 1e3, 1e6, 1e2, 1e5, 1e9])
_DIM = len(FEATURES)


def step_features(requests: Iterable[tuple[int, int]], loaded_bytes: int = 0) -> np.ndarray:
    """Raw features of one step; ``requests`` holds ``(new_tokens, context_before)`` pairs."""
    tok = attn = dreq = dctx = 0.0
    for n, ctx in requests:
        if n <= 0:
            continue
        if n == 1:
            dreq += 1.0
            dctx += ctx + 0.5
        else:
            tok += n
            attn += n * (ctx + n / 2)
    return np.array([1.0, tok, attn, dreq, dctx, float(loaded_bytes)])


@dataclass(frozen=True)
class StepCoefficients:
    """Seconds per unit of each raw feature (per step, token, token*context, ...)."""

    step: float
    prefill_tokens: float
    prefill_attention: float
    decode_requests: float
    decode_context: float
    loaded_bytes: float


def _nnls(m: np.ndarray, c: np.ndarray) -> np.ndarray:
    """argmin of ``x'Mx - 2c'x`` over ``x >= 0`` (M symmetric positive definite).

    The optimum solves the unconstrained problem restricted to its own support, so it is
    the best feasible one among the restricted solutions of every support set. Tried
    from the full set down; the full set alone is enough whenever its solution is >= 0.
    """
    full = np.linalg.solve(m, c)
    if (full >= 0).all():
        return full
    best, best_q = np.zeros_like(c), 0.0
    for size in range(len(c) - 1, 0, -1):
        for support in itertools.combinations(range(len(c)), size):
            idx = list(support)
            x_s = np.linalg.solve(m[np.ix_(idx, idx)], c[idx])
            if (x_s < 0).any():
                continue
            q = float(x_s @ m[np.ix_(idx, idx)] @ x_s - 2 * c[idx] @ x_s)
            if q < best_q:
                best = np.zeros_like(c)
                best[idx] = x_s
                best_q = q
    return best


class StepModel:
    """Online non-negative fit of step time; see the module docstring for the model."""

    def __init__(
        self,
        *,
        forget: float = 0.995,
        warmup_steps: int = 20,
        refit_every: int = 8,
        ridge: float = 1e-6,
        outlier_sigmas: float = 4.0,
    ) -> None:
        if not 0 < forget <= 1:
            raise ValueError(f"forget must be in (0, 1], got {forget}")
        self._forget = forget
        self.warmup_steps = warmup_steps
        self._refit_every = max(1, refit_every)
        self._ridge = ridge
        self._sigmas = outlier_sigmas
        self._lock = threading.Lock()
        self._xx = np.zeros((_DIM, _DIM))
        self._xy = np.zeros(_DIM)
        self._yy = 0.0
        self._weight = 0.0
        self._theta = np.zeros(_DIM)  # in scaled units
        self._since_fit = 0
        self.prefill_steps = 0
        self.steps = 0
        self.clipped = 0
        self._cold_seconds = 0.0  # prefill steps' seconds and new tokens, unforgotten
        self._cold_tokens = 0.0

    # -- observations (scheduler thread) ----------------------------------------------
    def observe(
        self, requests: Iterable[tuple[int, int]], seconds: float, *, loaded_bytes: int = 0
    ) -> None:
        """One engine step took ``seconds``. Non-finite or negative times are ignored."""
        if not math.isfinite(seconds) or seconds < 0:
            return
        x = step_features(requests, loaded_bytes) / _UNITS
        with self._lock:
            y = self._clip(x, seconds)
            if x[1] > 0:
                self._cold_seconds += seconds
                self._cold_tokens += x[1] * _UNITS[1]
                self._xx *= self._forget
                self._xy *= self._forget
                self._yy *= self._forget
                self._weight *= self._forget
                self.prefill_steps += 1
            self._xx += np.outer(x, x)
            self._xy += x * y
            self._yy += y * y
            self._weight += 1.0
            self.steps += 1
            self._since_fit += 1
            if self._since_fit >= self._refit_every or self.prefill_steps == self.warmup_steps:
                self._fit()

    def _clip(self, x: np.ndarray, y: float) -> float:
        if self.prefill_steps < self.warmup_steps or self._weight <= 0:
            return y
        pred = float(x @ self._theta)
        rss = self._yy - 2 * float(self._theta @ self._xy) + float(
            self._theta @ self._xx @ self._theta)
        limit = self._sigmas * math.sqrt(max(rss, 0.0) / self._weight)
        if limit > 0 and abs(y - pred) > limit:
            self.clipped += 1
            return pred + math.copysign(limit, y - pred)
        return y

    def _fit(self) -> None:
        scale = self._ridge * max(float(np.trace(self._xx)) / _DIM, 1.0)
        self._theta = np.maximum(_nnls(self._xx + scale * np.eye(_DIM), self._xy), 0.0)
        self._since_fit = 0

    # -- estimates (any thread) ---------------------------------------------------------
    @property
    def warm(self) -> bool:
        """Enough prefill steps seen, and prefill work was found to cost something."""
        with self._lock:
            return self.prefill_steps >= self.warmup_steps and bool(self._theta[1:3].any())

    def coefficients(self) -> StepCoefficients:
        with self._lock:
            raw = self._theta / _UNITS
        return StepCoefficients(*(float(v) for v in raw))

    def predict(self, requests: Iterable[tuple[int, int]], *, loaded_bytes: int = 0) -> float:
        """Estimated seconds of a step that computes ``requests``."""
        x = step_features(requests, loaded_bytes) / _UNITS
        with self._lock:
            return float(x @ self._theta)

    def recompute_seconds(self, start_tokens: int, end_tokens: int) -> float:
        """Marginal time to compute tokens ``[start, end)`` with ``[0, start)`` cached."""
        return recompute_seconds(self.coefficients(), start_tokens, end_tokens)

    def estimate_recompute(self, start_tokens: int, end_tokens: int) -> float | None:
        """``recompute_seconds`` once warm; before, a rough estimate from the prefill
        steps seen so far (their seconds per new token, the whole step's time charged to
        its prefill tokens: an overestimate, as a wait bound should be while the fit is
        untrained); None before the first prefill step."""
        if self.warm:
            return self.recompute_seconds(start_tokens, end_tokens)
        with self._lock:
            if self._cold_tokens <= 0:
                return None
            rate = self._cold_seconds / self._cold_tokens
        return rate * max(0, end_tokens - start_tokens)


def recompute_seconds(c: StepCoefficients, start_tokens: int, end_tokens: int) -> float:
    """``c_tok * n + c_attn * n * (start + end) / 2`` for ``n = end - start`` (0 if empty)."""
    if end_tokens <= start_tokens:
        return 0.0
    n = end_tokens - start_tokens
    return c.prefill_tokens * n + c.prefill_attention * n * (start_tokens + end_tokens) / 2
