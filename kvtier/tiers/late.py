"""``LateTier``: a lower tier whose opening did not answer in time (issue 32).

Opening a file or S3 tier does I/O (``mkdir``, a probe write, a listing). On a hung hard
NFS mount or a frozen S3 endpoint that I/O blocks for ever, and vLLM's engine start
waited on it: a node rebooted while its storage was down never served, although kvtier is
only a cache. ``build_store`` therefore opens each lower tier on a thread of its own and
waits for it at most a short bound; a tier that has not answered by then is replaced by a
``LateTier`` that stands in for it, and its breaker starts down (counted, logged with the
path). The engine serves from the start, recomputing what it cannot restore.

Until the real tier exists a ``LateTier`` knows nothing (``indexed`` is False), and every
call that would ask the tier is a counted fault (``get_into`` a miss, ``put`` FAILED,
``contains_prefix`` 0): so the breaker's trial calls fail and it stays down. Once the
opening thread returns, every call goes to the real tier, and the next trial after the
breaker's cooldown brings it up: the tier joins when it answers. If the opening fails
late, the error is logged and the tier stays down.

Threads: any. The real tier is published with one attribute store.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future

from kvtier.keys import ChunkKey
from kvtier.metrics import TierMetrics
from kvtier.objformat import ChunkMeta, ChunkSpec
from kvtier.tiers.base import ObjectInfo, PutStatus, SharedTier, TierUsage, WriteMode

log = logging.getLogger("kvtier.build")

#: The fault op a call to a tier that is still opening is counted as.
OPENING = "open"


def open_in_background(open_tier: Callable[[], SharedTier], name: str) -> Future[SharedTier]:
    """Run ``open_tier`` on a daemon thread of its own; its future gets the tier."""
    fut: Future[SharedTier] = Future()
    fut.set_running_or_notify_cancel()

    def run() -> None:
        try:
            fut.set_result(open_tier())
        except BaseException as e:  # delivered to whoever waits on the future
            fut.set_exception(e)

    threading.Thread(target=run, name=f"kvtier-open-{name}", daemon=True).start()
    return fut


class LateTier:
    """Stands in for a lower tier still opening (see the module docstring)."""

    def __init__(self, name: str, opening: Future[SharedTier], where: str) -> None:
        self._name = name
        self.where = where
        self._own_metrics = TierMetrics(name)
        self._inner: SharedTier | None = None
        self._closed = False
        self._collect_on_put: bool | None = None
        opening.add_done_callback(self._opened)

    def _opened(self, fut: Future[SharedTier]) -> None:
        e = fut.exception()
        if e is not None:
            log.error("kvtier: tier %s (%s) failed to open after the start: %s; it stays "
                      "down", self._name, self.where, e)
            return
        tier = fut.result()
        if self._closed:
            tier.close()
            return
        if self._collect_on_put is not None and hasattr(tier, "collect_on_put"):
            setattr(tier, "collect_on_put", self._collect_on_put)  # noqa: B010
        self._inner = tier
        log.warning("kvtier: tier %s (%s) answered and is open; it joins after its "
                    "breaker's next trial", self._name, self.where)

    @property
    def ready(self) -> bool:
        """The real tier is open (every call now goes to it)."""
        return self._inner is not None

    @property
    def inner(self) -> SharedTier | None:
        return self._inner

    @property
    def collect_on_put(self) -> bool:
        inner = self._inner
        return bool(getattr(inner, "collect_on_put", True)) if inner is not None else \
            self._collect_on_put is not False

    @collect_on_put.setter
    def collect_on_put(self, value: bool) -> None:
        self._collect_on_put = value
        inner = self._inner
        if inner is not None and hasattr(inner, "collect_on_put"):
            setattr(inner, "collect_on_put", value)  # noqa: B010

    @property
    def metrics(self) -> TierMetrics:
        inner = self._inner
        return inner.metrics if inner is not None else self._own_metrics

    @metrics.setter
    def metrics(self, value: TierMetrics) -> None:
        self._own_metrics = value

    @property
    def name(self) -> str:
        return self._name

    @property
    def index_ready(self) -> bool:
        """Nothing to wait for while the tier is still opening (its breaker is down)."""
        inner = self._inner
        return bool(getattr(inner, "index_ready", True)) if inner is not None else True

    def _fault(self) -> None:
        self._own_metrics.error(OPENING)

    def indexed(self, key: ChunkKey) -> bool:
        inner = self._inner
        return inner is not None and inner.indexed(key)

    def contains_prefix(self, keys: Sequence[ChunkKey]) -> int:
        inner = self._inner
        if inner is None:
            self._fault()
            return 0
        return inner.contains_prefix(keys)

    def get_into(
        self, key: ChunkKey, dst: memoryview, *, expect: ChunkSpec | None = None
    ) -> ChunkMeta | None:
        inner = self._inner
        if inner is None:
            self._fault()
            return None
        return inner.get_into(key, dst, expect=expect)

    def put(
        self, meta: ChunkMeta, payload: memoryview, mode: WriteMode = WriteMode.CREATE
    ) -> PutStatus:
        inner = self._inner
        if inner is None:
            self._fault()
            return PutStatus.FAILED
        return inner.put(meta, payload, mode)

    def delete(self, keys: Iterable[ChunkKey]) -> int:
        inner = self._inner
        return 0 if inner is None else inner.delete(keys)

    def scan(self) -> Iterator[ObjectInfo]:
        inner = self._inner
        return iter(()) if inner is None else inner.scan()

    def usage(self) -> TierUsage:
        inner = self._inner
        return TierUsage(0, 0, 0) if inner is None else inner.usage()

    def collect(self) -> int:
        inner = self._inner
        return 0 if inner is None else inner.collect()

    def read_meta(self, key: ChunkKey) -> ChunkMeta | None:
        inner = self._inner
        if inner is None:
            self._fault()
            return None
        return inner.read_meta(key)

    def present(self, key: ChunkKey) -> bool:
        inner = self._inner
        return inner is not None and inner.present(key)

    def renew(self, key: ChunkKey) -> bool:
        inner = self._inner
        return inner is not None and inner.renew(key)

    def expire(self, lease_seconds: float) -> int:
        inner = self._inner
        return 0 if inner is None else inner.expire(lease_seconds)

    def close(self) -> None:
        self._closed = True
        inner = self._inner
        if inner is not None:
            inner.close()
