"""Injectable clocks. Production code takes a ``Clock``; tests drive a ``ManualClock``.

Two readings are offered: ``monotonic()`` for durations and ``wall()`` for times that are
shared with other nodes (file mtimes, lease expiries). Nothing in kvtier calls
``time.time()`` directly, so every time-dependent behaviour can be tested without sleeping.
"""

from __future__ import annotations

import threading
import time
from typing import Protocol


class Clock(Protocol):
    def monotonic(self) -> float: ...

    def wall(self) -> float: ...


class SystemClock:
    def monotonic(self) -> float:
        return time.monotonic()

    def wall(self) -> float:
        return time.time()


class ManualClock:
    """A clock that only moves when ``advance`` is called. Thread-safe."""

    def __init__(self, start: float = 1_000_000.0) -> None:
        self._now = start
        self._lock = threading.Lock()

    def monotonic(self) -> float:
        with self._lock:
            return self._now

    def wall(self) -> float:
        with self._lock:
            return self._now

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError(f"a clock cannot go backwards (advance({seconds}))")
        with self._lock:
            self._now += seconds


SYSTEM_CLOCK = SystemClock()
