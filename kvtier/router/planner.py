"""The router's per-turn planning: what a turn's prompt costs, which path it takes, and what
a finished turn teaches (``selective`` holds the pure rule and models; this holds the state).

Invariants:

* One ``Planner`` per router, used from the event loop's thread only (no locks).
* ``queued`` counts the uncached tokens of the router's own calls per path from when the
  call starts until its first byte (``dequeue``; a non-streamed call's whole answer) or
  its end, however it ends: once a decode call streams, its prompt is computed and it no
  longer delays what comes after it.
* The held prefix comes from the shared tier (``prefix``), never from a conversation id:
  a turn whose held prefix is unknown takes the prefill hop (auto mode), with the reason.
* Only turns that succeeded (status 200, stream not broken) teach the costs, so a failing
  backend's fast errors never look like a cheap path; and only measurements that mean
  what they claim: a prefill call's duration, and time to first byte of *streamed* turns
  (a non-streamed answer arrives whole, its time includes the whole generation).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from kvtier.router import RouterSettings
from kvtier.router.conversations import ConversationMap, ConversationState, TokenAnchor
from kvtier.router.metrics import Turn
from kvtier.router.prefix import Held, Unkeyed
from kvtier.router.protocol import ProxyRequest, kvtier_params
from kvtier.router.selective import (
    Estimator,
    Loads,
    PathCosts,
    PathDecision,
    PathName,
    decide,
)


class Planner:
    """Path costs, the token estimate, and in-flight tokens (see the module invariants)."""

    def __init__(self, settings: RouterSettings, conversations: ConversationMap) -> None:
        self.settings, self.conversations = settings, conversations
        self.costs = PathCosts(settings.pd_default_threshold, settings.pd_max_direct_tokens)
        self.estimator = Estimator()
        self.queued = {"prefill_decode": 0.0, "decode_only": 0.0}
        self._in_queue: dict[int, tuple[PathName, float]] = {}  # id(turn) -> its tokens
        self._backends = {"prefill_decode": max(1, len(settings.prefill)),
                          "decode_only": max(1, len(settings.decode))}

    def plan(self, req: ProxyRequest, state: ConversationState | None,
             held: Held | Unkeyed | None, turn: Turn) -> PathDecision:
        """Decide the turn's path from what the tier holds of its prompt (``held``; None
        when the mode forces the path); fills in ``turn``. ``state`` only anchors the
        token estimate of a prompt whose held prefix is unknown."""
        turn.prompt_bytes = req.prompt_bytes
        if isinstance(held, Held):
            turn.prompt_tokens, turn.held_tokens = held.prompt_tokens, held.tokens
            uncached = held.prompt_tokens - held.tokens
        else:
            turn.prompt_tokens = uncached = self._prompt_tokens(req, state)
        loads = Loads(self.queued["prefill_decode"] / self._backends["prefill_decode"],
                      self.queued["decode_only"] / self._backends["decode_only"])
        if isinstance(held, str) and self.settings.pd_mode == "auto":
            d = PathDecision("prefill_decode", held, max(0, uncached), 0)
        else:
            d = decide(self.settings.pd_mode, uncached, self.costs.threshold().tokens, loads,
                       self.settings.pd_max_direct_tokens)
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
        path: PathName = "decode_only" if turn.path == "decode_only" else "prefill_decode"
        tokens = float(turn.uncached_tokens or 0)
        self.queued[path] += tokens
        self._in_queue[id(turn)] = (path, tokens)
        try:
            yield
        finally:
            self.dequeue(turn)

    def dequeue(self, turn: Turn) -> None:
        """``turn``'s call answered its first byte: its tokens leave the queue (once)."""
        got = self._in_queue.pop(id(turn), None)
        if got is not None:
            self.queued[got[0]] -= got[1]

    def remember(self, key: str | None, req: ProxyRequest, turn: Turn,
                 handoff: Mapping[str, Any] | None, doc: object) -> None:
        """Record a completed turn: its params (for lease renewal) and the best known token
        count of its prompt (the next turn's anchor for the estimate, used only where the
        held prefix is unknown). Nothing here is used for the held count."""
        if key is None:
            return
        usage = doc.get("usage") if isinstance(doc, dict) else None
        exact = usage.get("prompt_tokens") if isinstance(usage, dict) else None
        prompt_tokens = (exact if isinstance(exact, int) and exact > 0
                         else turn.prefill_tokens or turn.prompt_tokens)
        anchor = TokenAnchor(req.prompt_bytes, prompt_tokens) if prompt_tokens else None
        params = kvtier_params(doc) or handoff
        if params is None:  # decode-only and streamed: renew the chain the last turn named
            previous = self.conversations.get(key)
            params = previous.params if previous is not None else {}
        self.conversations.record(key, params, anchor)

    def learn(self, turn: Turn) -> None:
        """Feed a successful turn's measurements to the path costs and the estimator."""
        if turn.status != 200 or turn.stream_broken:
            return
        first_byte = turn.ttft_s if turn.streamed else None
        if turn.path == "prefill_decode" and turn.prefill_s is not None:
            computed = computed_tokens(turn)
            if computed is not None:
                self.costs.observe_prefill_decode(computed, turn.prefill_s, first_byte)
            usage = turn.prefill_usage
            prompt = usage.prompt_tokens if usage is not None else turn.prefill_tokens
            if prompt and turn.prompt_bytes:
                self.estimator.observe(turn.prompt_bytes, prompt)
        elif (turn.path == "decode_only" and turn.uncached_tokens is not None
              and first_byte is not None):
            self.costs.observe_decode_only(turn.uncached_tokens, first_byte)


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
