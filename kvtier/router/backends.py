"""The prefill and decode servers: which one to try, and what their answers mean.

Invariants:

* Stickiness: a conversation goes to the server its ``stable_hash`` picks (the same on every
  router process), unless that server is cooling down; requests without a conversation go
  round-robin.
* A server that refused a connection or timed out (the caller decides which failures count
  and calls ``mark_down``) is skipped for ``cooldown`` seconds of the injected ``Clock``; a
  successful health probe clears the mark at once.
* A backend's non-2xx answer maps to: 4xx passed through unchanged (``BackendRejected``),
  anything else a 502 ``RouterError`` carrying the backend's own message; no usable backend
  is a 503.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from typing import Literal

from kvtier.clock import Clock
from kvtier.router.protocol import BackendRejected, RouterError

Role = Literal["prefill", "decode"]


def stable_hash(text: str) -> int:
    """The same on every router process (unlike ``hash``), so stickiness survives restarts."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


class BackendPool:
    """The servers of one role. Picks round-robin, or by conversation hash (sticky); a
    server marked down (refused a connection or timed out) is skipped for ``cooldown``
    seconds."""

    def __init__(self, role: Role, urls: tuple[str, ...], cooldown: float, clock: Clock) -> None:
        self.role = role
        self.urls = tuple(u.rstrip("/") for u in urls)
        self._cooldown, self._clock = cooldown, clock
        self._next = itertools.count()
        self._down_until: dict[str, float] = {}

    def candidates(self, conversation_id: str | None) -> list[str]:
        """Healthy servers in the order to try them; ``RouterError(503)`` if there are none."""
        if not self.urls:
            raise RouterError(503, f"no {self.role} backend configured", "service_unavailable")
        n = len(self.urls)
        start = stable_hash(conversation_id) % n if conversation_id else next(self._next) % n
        now = self._clock.monotonic()
        order = self.urls[start:] + self.urls[:start]
        healthy = [u for u in order if self._down_until.get(u, 0.0) <= now]
        if not healthy:
            raise RouterError(503, f"no healthy {self.role} backend (all refused a connection "
                              f"or timed out in the last {self._cooldown:g}s: "
                              f"{', '.join(self.urls)})",
                              "service_unavailable")
        return healthy

    def mark_down(self, url: str) -> None:
        self._down_until[url] = self._clock.monotonic() + self._cooldown

    def mark_up(self, url: str) -> None:
        self._down_until.pop(url, None)


def _backend_message(body: bytes) -> str:
    try:
        doc = json.loads(body)
    except ValueError:
        return body.decode(errors="replace")[:500]
    err = doc.get("error") if isinstance(doc, dict) else None
    if isinstance(err, dict) and "message" in err:
        return str(err["message"])[:500]
    if isinstance(doc, dict) and "message" in doc:
        return str(doc["message"])[:500]
    return body.decode(errors="replace")[:500]


def check_status(role: Role, url: str, status: int, body: bytes, content_type: str) -> None:
    """Raise for a non-2xx backend answer: 4xx passes through, anything else is a 502."""
    if 200 <= status < 300:
        return
    if 400 <= status < 500:
        raise BackendRejected(status, body, content_type)
    raise RouterError(502, f"{role} backend {url} answered {status}: {_backend_message(body)}",
                      "backend_error")
