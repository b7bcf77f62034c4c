"""Which conversations the router has seen, and the kvtier params of their last turn.

Invariants:

* Metadata only: an entry holds the small ``kvtier`` params dict of a turn (namespace, token
  count, last chunk key, lease expiry), never KV bytes. The KV itself is found again by
  content hash on the next turn whether or not the conversation is tracked here.
* An entry is live while ``now() - updated < ttl``; an expired entry is never returned and
  is dropped on the next access. ``ttl`` is below the storage lease (0.9x by default) so a
  live entry always names chunks that are still leased.
* Entries are replaced, never mutated: a ``ConversationState`` is frozen and owns a private
  copy of its params, so concurrent turns of different conversations cannot mix params.
* Time comes only from the injected ``now`` callable; tests drive it explicitly.
* The map belongs to one event loop and is used from that loop's thread only, so it needs
  no lock (the lease heartbeat reads a snapshot from ``live()`` before going to a thread).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ConversationState:
    params: dict[str, Any]
    updated: float
    turns: int

    @property
    def last_key(self) -> str | None:
        key = self.params.get("last_key")
        return key if isinstance(key, str) and key else None


class ConversationMap:
    """``conversation_id -> ConversationState`` with a time-to-live.

    Kept in order of ``updated`` (oldest first), so pruning stops at the first live entry.
    """

    def __init__(self, ttl_seconds: float, now: Callable[[], float]) -> None:
        if ttl_seconds <= 0:
            raise ValueError(f"conversation ttl must be > 0 seconds, got {ttl_seconds}")
        self.ttl_seconds = ttl_seconds
        self._now = now
        self._entries: OrderedDict[str, ConversationState] = OrderedDict()

    def _expired(self, state: ConversationState, now: float) -> bool:
        return now - state.updated >= self.ttl_seconds

    def prune(self) -> int:
        """Drop every expired entry; returns how many were dropped."""
        now, dropped = self._now(), 0
        while self._entries:
            oldest = next(iter(self._entries.values()))
            if not self._expired(oldest, now):
                break
            self._entries.popitem(last=False)
            dropped += 1
        return dropped

    def get(self, conversation_id: str) -> ConversationState | None:
        """The live state of ``conversation_id``, or ``None`` if unknown or expired."""
        self.prune()
        return self._entries.get(conversation_id)

    def record(self, conversation_id: str, params: Mapping[str, Any]) -> ConversationState:
        """Store the params of a completed turn; counts turns while the entry stays live."""
        previous = self.get(conversation_id)
        turns = previous.turns + 1 if previous is not None else 1
        return self._put(conversation_id, ConversationState(dict(params), self._now(), turns))

    def touch(self, conversation_id: str) -> ConversationState | None:
        """Restart the TTL of a live entry (params unchanged); ``None`` if unknown or expired."""
        previous = self.get(conversation_id)
        if previous is None:
            return None
        state = ConversationState(previous.params, self._now(), previous.turns)
        return self._put(conversation_id, state)

    def live(self) -> list[tuple[str, ConversationState]]:
        """A snapshot of the live entries, oldest first."""
        self.prune()
        return list(self._entries.items())

    def __len__(self) -> int:
        self.prune()
        return len(self._entries)

    def _put(self, conversation_id: str, state: ConversationState) -> ConversationState:
        self._entries[conversation_id] = state
        self._entries.move_to_end(conversation_id)
        return state
