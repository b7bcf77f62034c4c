"""Selective P/D: per turn, decode-only or prefill-then-decode, from costs the router measures.

A *decode-only* turn goes straight to the decode node, which restores the conversation's
tier-held prefix itself (host, then shared tier) and prefills only the uncached suffix.
A *prefill-then-decode* turn pays a second hop: the prefill call, the publish of its
chunks to the shared tier, and the decode node's restore of the whole prompt. Skipping it
saves that fixed cost and spends the suffix's prefill on the decode node instead (which
stalls that node's running decodes for as long). So decode-only wins while

    uncached_tokens * per_token  <=  saved_seconds

and the threshold is ``saved_seconds / per_token`` tokens, measured from the router's own
turns (``PathCosts``):

* ``per_token`` and the prefill hop: a line ``prefill_seconds = hop + per_token * u`` fitted
  over prefill calls, with ``u`` the tokens that call computed (``planner.computed_tokens``:
  exact from ``usage.prompt_tokens_details.cached_tokens`` where the prefill server reports
  it, else bounded by what kvtier restored and by the turn's uncached estimate): the kvtier
  cost model's prefill-per-token, with restore time and the HTTP/scheduling hop in the
  intercept;
* the P/D decode leg: ``ttft - prefill_seconds`` of prefill-then-decode turns (hop,
  publish wait, the decode node's restore, its first step);
* the decode-only fixed cost: the intercept of ``ttft = fixed + slope * u`` over
  decode-only turns (until measured, taken equal to the P/D decode leg: both are one
  decode call that restores the prefix).

``saved_seconds = hop + decode_leg - fixed``. Until ``MIN_OBSERVATIONS`` prefill calls
are seen whose sizes spread by ``MIN_SPREAD`` of their mean (or if the fit is degenerate),
the threshold is ``DEFAULT_THRESHOLD_TOKENS``. It is always capped at
``max_direct_tokens``: a long suffix on the decode node stalls its streams however cheap
the hop.

Load enters in the same unit: uncached tokens already queued on each role (the router's
own in-flight calls, per backend) delay that path by as many tokens' time, so the turn's
limit is ``threshold + queued_prefill - queued_decode_only`` (capped alike).

Invariants: ``decide`` is pure given its inputs; ``PathCosts`` and ``Estimator`` learn only
from numbers they are given (no I/O, no clock). Event loop thread only (no locks).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

PDMode = Literal["auto", "always", "never"]
PD_MODES: tuple[PDMode, ...] = ("auto", "always", "never")
PathName = Literal["prefill_decode", "decode_only"]
#: ``forced`` .. ``long``: ``decide``'s; the rest (``prefix.Unkeyed``): the prompt's held
#: prefix is unknown, so the turn takes the prefill hop.
Reason = Literal["forced", "short", "prefill_busy", "decode_busy", "long", "no_tier",
                 "multimodal", "unsupported_prompt", "no_namespace", "tokenizer",
                 "too_long"]

#: Used until the router has measured its prefill calls: a few hundred tokens of prefill
#: (tens of ms on a GPU) is about what one extra HTTP hop plus a publish/restore round
#: trip through a shared tier costs.
DEFAULT_THRESHOLD_TOKENS = 512
#: Dynamo's bound for local prefill; a longer suffix stalls the decode node's streams.
DEFAULT_MAX_DIRECT_TOKENS = 2048
#: Bytes of prompt text per token until measured (English text, BPE tokenizers).
DEFAULT_BYTES_PER_TOKEN = 4.0
MIN_OBSERVATIONS = 8
#: The fit needs x values whose standard deviation is at least this fraction of their mean.
MIN_SPREAD = 0.25


class LineFit:
    """Online least squares ``y = a + b * x`` with exponential forgetting (a window of
    about ``1 / (1 - forget)`` observations)."""

    def __init__(self, forget: float = 0.98) -> None:
        if not 0 < forget <= 1:
            raise ValueError(f"forget must be in (0, 1], got {forget}")
        self._forget = forget
        self.n = 0
        self._w = self._sx = self._sy = self._sxx = self._sxy = 0.0

    def observe(self, x: float, y: float) -> None:
        if not (math.isfinite(x) and math.isfinite(y)):
            return
        f = self._forget
        self._w = f * self._w + 1.0
        self._sx = f * self._sx + x
        self._sy = f * self._sy + y
        self._sxx = f * self._sxx + x * x
        self._sxy = f * self._sxy + x * y
        self.n += 1

    def mean_y(self) -> float | None:
        return self._sy / self._w if self.n else None

    def line(self, min_n: int = MIN_OBSERVATIONS,
             min_spread: float = MIN_SPREAD) -> tuple[float, float] | None:
        """``(a, b)``, or ``None`` before ``min_n`` observations or while the x values'
        standard deviation is under ``min_spread`` times their mean (sizes that close
        leave the slope to noise: first turns of one workload all alike, for example)."""
        if self.n < min_n:
            return None
        mx, my = self._sx / self._w, self._sy / self._w
        var = self._sxx / self._w - mx * mx
        if var <= 1e-9 * max(1.0, mx * mx) or var < (min_spread * mx) ** 2:
            return None
        b = (self._sxy / self._w - mx * my) / var
        return my - b * mx, b


class Ewma:
    def __init__(self, alpha: float = 0.1) -> None:
        self._alpha = alpha
        self.value: float | None = None

    def observe(self, x: float) -> None:
        if math.isfinite(x):
            self.value = x if self.value is None else self.value + self._alpha * (x - self.value)


@dataclass(frozen=True)
class Threshold:
    tokens: int
    measured: bool
    why: str


class PathCosts:
    """What the router measured of its two paths (see the module docstring)."""

    def __init__(self, default_tokens: int = DEFAULT_THRESHOLD_TOKENS,
                 max_direct_tokens: int = DEFAULT_MAX_DIRECT_TOKENS) -> None:
        if default_tokens < 0 or max_direct_tokens < 0:
            raise ValueError("P/D thresholds must be >= 0 tokens")
        self.default_tokens = min(default_tokens, max_direct_tokens)
        self.max_direct_tokens = max_direct_tokens
        self.prefill = LineFit()  # prefill call seconds vs tokens it computed
        self.decode_leg = Ewma()  # P/D: ttft - prefill seconds
        self.direct = LineFit()  # decode-only: ttft vs estimated uncached tokens

    def observe_prefill_decode(self, computed_tokens: int, prefill_s: float,
                               ttft_s: float | None) -> None:
        self.prefill.observe(computed_tokens, prefill_s)
        if ttft_s is not None:
            self.decode_leg.observe(ttft_s - prefill_s)

    def observe_decode_only(self, uncached_tokens: int, ttft_s: float) -> None:
        self.direct.observe(uncached_tokens, ttft_s)

    def threshold(self) -> Threshold:
        fit = self.prefill.line()
        if fit is None or fit[1] <= 0:
            seen = self.prefill.n
            return Threshold(self.default_tokens, False,
                             f"default: {seen} prefill calls measured, need "
                             f"{MIN_OBSERVATIONS} of different sizes")
        hop, per_token = fit
        leg = self.decode_leg.value or 0.0
        direct = self.direct.line()
        fixed = direct[0] if direct is not None else leg
        saved = max(0.0, hop + leg - fixed)
        tokens = min(self.max_direct_tokens, int(saved / per_token))
        return Threshold(tokens, True, f"saved {saved * 1e3:.1f} ms (hop {hop * 1e3:.1f} + "
                         f"leg {leg * 1e3:.1f} - fixed {fixed * 1e3:.1f}) / "
                         f"{per_token * 1e6:.2f} us per token")


@dataclass(frozen=True)
class Loads:
    """Uncached tokens in flight on each role, per backend (the router's own calls)."""

    prefill_tokens: float = 0.0
    decode_only_tokens: float = 0.0


@dataclass(frozen=True)
class PathDecision:
    path: PathName
    reason: Reason
    uncached_tokens: int
    limit_tokens: int  # decode-only up to this many uncached tokens, for this turn


def decide(mode: PDMode, uncached_tokens: int, threshold: int, loads: Loads,
           max_direct_tokens: int) -> PathDecision:
    """The path of one turn (see the module docstring). Reasons: ``forced`` (the mode),
    ``short`` / ``long`` (below / above the threshold, and load agrees), ``prefill_busy``
    (above the threshold, but the prefill queue makes decode-only cheaper), ``decode_busy``
    (below it, but turns already prefilling on the decode node make P/D cheaper)."""
    u = max(0, uncached_tokens)
    if mode != "auto":
        path: PathName = "decode_only" if mode == "never" else "prefill_decode"
        return PathDecision(path, "forced", u, max_direct_tokens if mode == "never" else 0)
    loaded = threshold + loads.prefill_tokens - loads.decode_only_tokens
    limit = int(max(0.0, min(float(max_direct_tokens), loaded)))
    if u <= limit:
        return PathDecision("decode_only", "short" if u <= threshold else "prefill_busy",
                            u, limit)
    return PathDecision("prefill_decode", "decode_busy" if u <= threshold else "long", u, limit)


class Estimator:
    """Prompt tokens from prompt bytes: a bytes-per-token ratio learnt from the exact
    counts prefill calls report (EWMA), used only for the bytes a conversation added since
    its last known count (``TokenAnchor``), so the error stays that of the suffix."""

    def __init__(self, bytes_per_token: float = DEFAULT_BYTES_PER_TOKEN) -> None:
        self._ratio = Ewma(0.1)
        self._default = bytes_per_token

    @property
    def bytes_per_token(self) -> float:
        return self._ratio.value or self._default

    def observe(self, prompt_bytes: int, prompt_tokens: int) -> None:
        if prompt_bytes > 0 and prompt_tokens > 0:
            self._ratio.observe(prompt_bytes / prompt_tokens)

    def tokens(self, prompt_bytes: int, anchor_bytes: int = 0, anchor_tokens: int = 0) -> int:
        """Estimated tokens of a prompt of ``prompt_bytes`` whose first ``anchor_bytes``
        are ``anchor_tokens`` tokens."""
        if anchor_bytes > prompt_bytes:  # a changed history: start over
            anchor_bytes = anchor_tokens = 0
        return anchor_tokens + math.ceil((prompt_bytes - anchor_bytes) / self.bytes_per_token)
