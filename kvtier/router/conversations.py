"""Which conversations the router has seen, and the kvtier params of their last turn.

Invariants:

* Metadata only: an entry holds the small ``kvtier`` params dict of a turn (namespace, token
  count, last chunk key, lease expiry) and a few numbers, never KV bytes. The KV itself is
  found again by content hash on the next turn whether or not the conversation is tracked.
* An entry is live while ``now() - updated < ttl``; an expired entry is never returned and
  is dropped on the next access. ``ttl`` is below the storage lease (0.9x by default) so a
  live entry always names chunks that are still leased.
* The map holds at most ``capacity`` entries: recording one more drops the least recently
  updated (a turn or a renew request updates; a heartbeat's renewal does not), counted in
  ``evictions``. Its chain is then no longer renewed by this router; its KV stays correct.
  A tenant's entries (keys ``tenant NUL id``) are also capped at ``tenant_capacity``: a
  tenant past it drops its own least recently updated entry, so one tenant flooding new
  conversations cannot push the others' out (issue 44).
* Entries are replaced, never mutated: a ``ConversationState`` is frozen and owns a private
  copy of its params, so concurrent turns of different conversations cannot mix params.
* Time comes only from the injected ``now`` callable; tests drive it explicitly.
* The map belongs to one event loop and is used from that loop's thread only, so it needs
  no lock (the lease heartbeat reads a snapshot from ``live()`` before going to a thread).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

DEFAULT_MAX_CONVERSATIONS = 100_000


@dataclass(frozen=True)
class TokenAnchor:
    """A prompt size whose token count is known (or best estimated): the next turn of the
    conversation estimates only the tokens of the bytes it adds."""

    prompt_bytes: int
    prompt_tokens: int


@dataclass(frozen=True)
class ConversationState:
    params: dict[str, Any]
    updated: float  # last turn or renew request (the TTL and the LRU order)
    turns: int
    renewed: float  # last time its chain's leases were known fresh (written or renewed)
    anchor: TokenAnchor | None = None

    @property
    def last_key(self) -> str | None:
        key = self.params.get("last_key")
        return key if isinstance(key, str) and key else None


class ConversationMap:
    """``conversation_id -> ConversationState`` with a time-to-live and a size cap.

    Kept in order of ``updated`` (oldest first), so pruning stops at the first live entry
    and the capacity evicts the least recently updated one.
    """

    def __init__(self, ttl_seconds: float, now: Callable[[], float],
                 capacity: int = DEFAULT_MAX_CONVERSATIONS,
                 tenant_capacity: int | None = None) -> None:
        if ttl_seconds <= 0:
            raise ValueError(f"conversation ttl must be > 0 seconds, got {ttl_seconds}")
        if capacity < 1 or (tenant_capacity is not None and tenant_capacity < 1):
            raise ValueError(f"max_conversations must be >= 1, got {capacity} "
                             f"(per tenant {tenant_capacity})")
        self.ttl_seconds = ttl_seconds
        self.capacity = capacity
        self.tenant_capacity = tenant_capacity
        self.evictions = 0  # entries dropped for capacity (not for their TTL)
        self._now = now
        self._entries: OrderedDict[str, ConversationState] = OrderedDict()
        #: a tenant's keys (``tenant NUL id``) in the same order, for its own cap
        self._of_tenant: dict[str, OrderedDict[str, None]] = {}

    def _expired(self, state: ConversationState, now: float) -> bool:
        return now - state.updated >= self.ttl_seconds

    def prune(self) -> int:
        """Drop every expired entry; returns how many were dropped."""
        now, dropped = self._now(), 0
        while self._entries:
            oldest = next(iter(self._entries.values()))
            if not self._expired(oldest, now):
                break
            self._drop(next(iter(self._entries)))
            dropped += 1
        return dropped

    def get(self, conversation_id: str) -> ConversationState | None:
        """The live state of ``conversation_id``, or ``None`` if unknown or expired."""
        self.prune()
        return self._entries.get(conversation_id)

    def record(self, conversation_id: str, params: Mapping[str, Any],
               anchor: TokenAnchor | None = None) -> ConversationState:
        """Store the params of a completed turn; counts turns while the entry stays live.
        A new entry's chain counts as
        just written (``renewed = now``); a known one keeps its renewal time (a turn need
        not read every chunk of its chain)."""
        previous = self.get(conversation_id)
        now = self._now()
        if previous is None:
            state = ConversationState(dict(params), now, 1, now, anchor)
        else:
            state = ConversationState(dict(params), now, previous.turns + 1, previous.renewed,
                                      anchor or previous.anchor)
        return self._put(conversation_id, state)

    def touch(self, conversation_id: str) -> ConversationState | None:
        """Restart the TTL of a live entry (params unchanged); ``None`` if unknown or expired."""
        previous = self.get(conversation_id)
        if previous is None:
            return None
        return self._put(conversation_id, replace(previous, updated=self._now()))

    def mark_renewed(self, conversation_id: str, at: float) -> None:
        """Its chain's leases were renewed at ``at`` (no effect if it is gone, and no
        change to its TTL or LRU position)."""
        state = self._entries.get(conversation_id)
        if state is not None and at > state.renewed:
            self._entries[conversation_id] = replace(state, renewed=at)

    def live(self) -> list[tuple[str, ConversationState]]:
        """A snapshot of the live entries, least recently updated first."""
        self.prune()
        return list(self._entries.items())

    def __len__(self) -> int:
        self.prune()
        return len(self._entries)

    def _put(self, conversation_id: str, state: ConversationState) -> ConversationState:
        self._entries[conversation_id] = state
        self._entries.move_to_end(conversation_id)
        tenant, sep, _ = conversation_id.partition("\x00")
        if sep and self.tenant_capacity is not None:
            own = self._of_tenant.setdefault(tenant, OrderedDict())
            own[conversation_id] = None
            own.move_to_end(conversation_id)
            while len(own) > self.tenant_capacity:  # a tenant past its share drops its own
                self._drop(next(iter(own)))
                self.evictions += 1
        while len(self._entries) > self.capacity:
            self._drop(next(iter(self._entries)))
            self.evictions += 1
        return state

    def _drop(self, conversation_id: str) -> None:
        del self._entries[conversation_id]
        tenant, sep, _ = conversation_id.partition("\x00")
        own = self._of_tenant.get(tenant) if sep else None
        if own is not None:
            own.pop(conversation_id, None)
            if not own:
                del self._of_tenant[tenant]
