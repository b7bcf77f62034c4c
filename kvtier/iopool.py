"""``IOPool``: the async writer. A few threads, two queues, loads before stores.

Invariants:

* ``submit_load`` is never refused; loads always run before any queued store.
* ``submit_store`` never blocks: when ``max_queued_stores`` are waiting it returns ``None``
  and the caller drops the store (and counts the drop). Memory stays bounded.
* ``close()`` stops accepting work, runs everything already queued, joins the threads;
  ``close(timeout)`` cancels what has not started and never waits past ``timeout``.
* A task's exception is captured in its ``Future``; it never kills a worker thread.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

from kvtier.metrics import set_queue_depth

T = TypeVar("T")

_Task = tuple[Future[Any], Callable[[], Any]]


class IOPoolClosed(RuntimeError):
    pass


class IOPool:
    def __init__(self, threads: int = 2, max_queued_stores: int = 256, name: str = "io") -> None:
        if threads <= 0 or max_queued_stores <= 0:
            raise ValueError("IOPool needs threads > 0 and max_queued_stores > 0")
        self._loads: deque[_Task] = deque()
        self._stores: deque[_Task] = deque()
        self._max_stores = max_queued_stores
        self._cv = threading.Condition()
        self._closed = False
        self._name = name
        self._threads = [
            threading.Thread(target=self._run, name=f"kvtier-{name}-{i}", daemon=True)
            for i in range(threads)
        ]
        for t in self._threads:
            t.start()

    def submit_load(self, fn: Callable[[], T]) -> Future[T]:
        fut: Future[T] = Future()
        with self._cv:
            if self._closed:
                raise IOPoolClosed("IOPool is closed")
            self._loads.append((fut, fn))
            self._publish()
            self._cv.notify()
        return fut

    def submit_store(self, fn: Callable[[], T]) -> Future[T] | None:
        fut: Future[T] = Future()
        with self._cv:
            if self._closed:
                raise IOPoolClosed("IOPool is closed")
            if len(self._stores) >= self._max_stores:
                return None
            self._stores.append((fut, fn))
            self._publish()
            self._cv.notify()
        return fut

    def pending(self) -> tuple[int, int]:
        """(queued loads, queued stores)."""
        with self._cv:
            return len(self._loads), len(self._stores)

    def free_store_slots(self) -> int:
        """How many more stores the queue takes now before it drops."""
        with self._cv:
            return max(0, self._max_stores - len(self._stores))

    def _publish(self) -> None:
        set_queue_depth(f"{self._name}-load", len(self._loads))
        set_queue_depth(f"{self._name}-store", len(self._stores))

    def _run(self) -> None:
        while True:
            with self._cv:
                while not (self._loads or self._stores or self._closed):
                    self._cv.wait()
                if self._loads:
                    fut, fn = self._loads.popleft()
                elif self._stores:
                    fut, fn = self._stores.popleft()
                else:
                    return  # closed and drained
                self._publish()
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn())
            except BaseException as e:  # delivered to whoever waits on the future
                fut.set_exception(e)

    @property
    def num_threads(self) -> int:
        return len(self._threads)

    def close(self, timeout: float | None = None) -> None:
        """Stop accepting work. Without ``timeout``: run everything queued, join the threads.

        With ``timeout``: tasks not started yet are cancelled, and threads still running a
        task after ``timeout`` seconds are abandoned (they are daemons: a task stuck in a
        hung tier cannot hold up the process's exit).
        """
        with self._cv:
            self._closed = True
            if timeout is not None:
                for fut, _ in (*self._loads, *self._stores):
                    fut.cancel()
                self._loads.clear()
                self._stores.clear()
                self._publish()
            self._cv.notify_all()
        deadline = None if timeout is None else time.monotonic() + timeout
        for t in self._threads:
            t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))

    def __enter__(self) -> IOPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
