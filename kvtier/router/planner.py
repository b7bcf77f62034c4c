"""The router's per-turn planning: what a turn's prompt costs, which path it takes, and what
a finished turn teaches (``selective`` holds the pure rule and models; this holds the state).

Invariants:

* One ``Planner`` per router, used from the event loop's thread only (no locks).
* ``queued`` counts the estimated uncached tokens of the router's own calls in flight per
  path; ``queue`` adds them for exactly as long as its block runs, however it ends.
* Only turns that succeeded (status 200, stream not broken, a first byte seen) teach the
  costs, so a failing backend's fast errors never look like a cheap path.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from kvtier.router import RouterSettings
from kvtier.router.conversations import ConversationMap, ConversationState, TokenAnchor
from kvtier.router.metrics import Turn
from kvtier.router.protocol import ProxyRequest, kvtier_params
from kvtier.router.selective import Estimator, Loads, PathCosts, PathDecision, decide


class Planner:
    """Path costs, the token estimate, and in-flight tokens (see the module invariants)."""

    def __init__(self, settings: RouterSettings, conversations: ConversationMap) -> None:
        self.settings, self.conversations = settings, conversations
        self.costs = PathCosts(settings.pd_default_threshold, settings.pd_max_direct_tokens)
        self.estimator = Estimator()
        self.queued = {"prefill_decode": 0.0, "decode_only": 0.0}
        self._backends = {"prefill_decode": max(1, len(settings.prefill)),
                          "decode_only": max(1, len(settings.decode))}

    def plan(self, req: ProxyRequest, state: ConversationState | None,
             turn: Turn) -> PathDecision:
        """Estimate the prompt's tokens and decide the turn's path; fills in ``turn``."""
        turn.prompt_bytes = req.prompt_bytes
        turn.prompt_tokens = self._prompt_tokens(req, state)
        held = state.held_tokens if state is not None else 0
        loads = Loads(self.queued["prefill_decode"] / self._backends["prefill_decode"],
                      self.queued["decode_only"] / self._backends["decode_only"])
        d = decide(self.settings.pd_mode, turn.prompt_tokens - held,
                   self.costs.threshold().tokens, loads, self.settings.pd_max_direct_tokens)
        turn.path, turn.reason, turn.uncached_tokens = d.path, d.reason, d.uncached_tokens
        return d

    def _prompt_tokens(self, req: ProxyRequest, state: ConversationState | None) -> int:
        if req.prompt_tokens is not None:
            return req.prompt_tokens
        anchor = state.anchor if state is not None else None
        if anchor is None:
            return self.estimator.tokens(req.prompt_bytes)
        return self.estimator.tokens(req.prompt_bytes, anchor.prompt_bytes,
                                     anchor.prompt_tokens)

    @contextmanager
    def queue(self, turn: Turn) -> Iterator[None]:
        """Count ``turn``'s uncached tokens as in flight on its path while the block runs."""
        path, tokens = turn.path or "prefill_decode", float(turn.uncached_tokens or 0)
        self.queued[path] += tokens
        try:
            yield
        finally:
            self.queued[path] -= tokens

    def remember(self, key: str | None, req: ProxyRequest, turn: Turn,
                 handoff: Mapping[str, Any] | None, doc: object) -> None:
        """Record a completed turn: its params (for renewal), what the tier now holds of
        it, and the best known token count of its prompt (the next turn's anchor)."""
        if key is None:
            return
        usage = doc.get("usage") if isinstance(doc, dict) else None
        exact = usage.get("prompt_tokens") if isinstance(usage, dict) else None
        prompt_tokens = (exact if isinstance(exact, int) and exact > 0
                         else turn.prefill_tokens or turn.prompt_tokens)
        anchor = TokenAnchor(req.prompt_bytes, prompt_tokens) if prompt_tokens else None
        params = kvtier_params(doc) or handoff
        held: int | None = None
        if params is None:  # decode-only and streamed: the decode node stored the prompt
            previous = self.conversations.get(key)
            params = previous.params if previous is not None else {}
            held = prompt_tokens or 0
        self.conversations.record(key, params, anchor, held)

    def learn(self, turn: Turn) -> None:
        """Feed a successful turn's measurements to the path costs and the estimator."""
        if turn.status != 200 or turn.stream_broken or turn.ttft_s is None:
            return
        if turn.path == "prefill_decode" and turn.prefill_s is not None:
            computed = computed_tokens(turn)
            if computed is not None:
                self.costs.observe_prefill_decode(computed, turn.prefill_s, turn.ttft_s)
            usage = turn.prefill_usage
            prompt = usage.prompt_tokens if usage is not None else turn.prefill_tokens
            if prompt and turn.prompt_bytes:
                self.estimator.observe(turn.prompt_bytes, prompt)
        elif turn.path == "decode_only" and turn.uncached_tokens is not None:
            self.costs.observe_decode_only(turn.uncached_tokens, turn.ttft_s)


def computed_tokens(turn: Turn) -> int | None:
    """The prompt tokens a prefill call computed, for the per-token cost; None if unknown.

    Exact where the prefill server reports ``usage.prompt_tokens_details.cached_tokens``
    (vLLM's ``--enable-prompt-tokens-details``): the prompt less what vLLM served without
    computing, from its own prefix cache or kvtier. Otherwise the prompt less what kvtier
    restored counts the prefill node's own prefix-cache hits as computed (a returning
    turn's whole history, on a node with prefix caching on), so it is capped by the
    turn's uncached estimate (the prompt less what the tier holds of the conversation),
    which errs the other way only when that node skipped a restore.
    """
    usage = turn.prefill_usage
    if usage is not None and usage.cached_tokens is not None:
        return max(0, usage.prompt_tokens - usage.cached_tokens)
    prompt = usage.prompt_tokens if usage is not None else turn.prefill_tokens
    if prompt is None:
        return None
    upper = max(0, prompt - turn.restored_tokens)
    return upper if turn.uncached_tokens is None else min(upper, turn.uncached_tokens)
