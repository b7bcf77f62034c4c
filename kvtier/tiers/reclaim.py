"""Re-checked removal for an object tier: which objects ``collect`` (capacity) and
``expire`` (leases) delete, and deleting only those the store confirms.

``ObjectTier.collect`` and ``ObjectTier.expire`` decide on an index snapshot,
then ask the store for each victim's stamp (``heads``), keep those another node used at
or after the decision's bound, keep those this node recorded anything for since the
snapshot (versions), and delete the rest only while each is still the version its
stat saw (``Transport.delete``); only the entry they picked leaves the index. On a file
tier that condition covers a renewal (the mtime is the version): one between the stat
and the delete survives. On S3 a renewal keeps the ETag, so one in that window is lost
with its object (the HEAD fallback alone compares the stamp): a recompute, never wrong
KV.

Threads: a ``Reclaimer`` is called under its tier's collection lock only (one collection
at a time), so it keeps no lock of its own; it does I/O (``heads``, ``delete``) and never
under the index lock.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvtier.keys import ChunkKey
from kvtier.metrics import TierMetrics
from kvtier.tiers.compact import CompactIndex, Entry
from kvtier.tiers.transport import Outcome, Page, Stat, Transport

#: Leeway between a node's clock and a store's listing times (S3 LastModified).
CLOCK_SKEW_S = 60.0
#: Victims one ``collect`` round considers at most.
COLLECT_MAX = 4096

_Pick = tuple[ChunkKey, Entry | None]
_Doomed = tuple[ChunkKey, Stat, Entry | None]


class Reclaimer:
    """Re-checked deletion over one tier's transport and index."""

    def __init__(self, transport: Transport, index: CompactIndex, metrics: TierMetrics,
                 fault: Callable[[str, Exception], None], used: Callable[[], int]) -> None:
        """``fault(op, error)`` counts a store fault; ``used()`` is the tier's usage."""
        self._transport = transport
        self._index = index
        self._metrics = metrics
        self._fault = fault
        self._used = used

    def evict_coldest(self, capacity: int, low_watermark: float) -> int:
        """Delete least recently used objects until usage is under ``low_watermark`` of
        ``capacity`` (nothing while it is within ``capacity``). Returns bytes freed."""
        target = int(capacity * low_watermark)
        freed = 0
        if self._used() <= capacity:
            return 0
        for _ in range(3):  # victims another node used meanwhile are kept; pick again
            excess = self._used() - target
            if excess <= 0:
                break
            picked: list[_Pick] = list(self._index.coldest(COLLECT_MAX, excess))
            if not picked:
                break
            heads = self._heads(picked, "collect")
            if heads is None:
                break
            freed += self._delete(self._doom(picked, heads, None), evicting=True)[1]
        self._metrics.used(self._used())
        return freed

    def _heads(self, picked: Sequence[_Pick], op: str) -> list[Stat | None] | None:
        try:
            return self._transport.heads([key for key, _ in picked])
        except self._transport.faults as e:
            self._fault(op, e)
            return None

    def _doom(
        self, picked: Sequence[_Pick], heads: Sequence[Stat | None], keep_from: float | None
    ) -> list[_Doomed]:
        """Which of ``picked`` to delete, given their stats: not those gone, used (by any
        node) at or after ``keep_from`` (None: after the entry picked), or recorded by this
        node since the pick. Updates the index for the ones kept."""
        doomed: list[_Doomed] = []
        for (key, seen), st in zip(picked, heads, strict=True):
            if st is None:
                if seen is not None:
                    self._index.forget_if(key, seen)  # already gone
                continue
            bound = keep_from if keep_from is not None else \
                (seen.last_used + 1e-3 if seen is not None else float("inf"))
            if st.used >= bound:
                if seen is not None:
                    self._index.replace_if(key, seen, st.size, st.used)
            elif self._index.get(key) == seen:  # else this node used it since the pick
                doomed.append((key, st, seen))
        return doomed

    def _delete(self, doomed: list[_Doomed], *, evicting: bool) -> tuple[int, int]:
        """Delete ``doomed``, each only while it is still the version its stat saw. A
        deleted key leaves the index only if its entry is still the one picked. Returns
        ``(objects, bytes)`` deleted."""
        if not doomed:
            return 0, 0
        outcomes, fault = self._transport.delete([(k, st) for k, st, _ in doomed])
        if fault is not None:
            self._fault("collect" if evicting else "delete", fault)
        n = freed = 0
        for key, st, seen in doomed:
            outcome = outcomes.get(key)
            if outcome is None or outcome is Outcome.KEPT:  # a fault, or replaced since
                continue
            if seen is not None:
                self._index.forget_if(key, seen)
            if outcome is Outcome.DELETED:
                n, freed = n + 1, freed + (seen.size if seen is not None else st.size)
        if evicting:
            self._metrics.evicted(n)
        self._metrics.used(self._used())
        return n, freed

    def expire_page(self, page: Page, cutoff: float) -> int:
        """Delete the objects of ``page`` not used or renewed since ``cutoff`` (wall
        time), re-checking each first. Returns how many were deleted."""
        # An S3 listing has only LastModified; the stat below decides on kvtier's stamp.
        maybe = cutoff if self._transport.exact_listing else cutoff + CLOCK_SKEW_S
        picked: list[_Pick] = [(obj.key, self._index.get(obj.key))
                               for obj in page.objects if obj.used < maybe]
        if not picked:
            return 0
        heads = self._heads(picked, "expire")
        if heads is None:
            return 0
        return self._delete(self._doom(picked, heads, cutoff), evicting=True)[0]
