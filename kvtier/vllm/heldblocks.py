"""Per-block reference counts behind kvtier's KV events: a block is published held in a
medium when its first copy there arrives and removed when its last copy goes.

Several stored objects may hold one vLLM block in one medium: a conversation's tails
and the whole chunk that later covers them, the window parts of nearby ends of a
sliding-window model, one object in two tiers of one medium (two ``STORAGE`` tiers),
the same blocks under two kvtier namespaces (across a weights reset). A router keeps,
per node, a set of ``(block hash, medium)`` (llm-d's index; Dynamo's radix tree): a
``BlockRemoved`` for a block another object still holds would make it forget a held
block. So every copy counts, and only the transitions 0 -> 1 (``BlockStored``) and
1 -> 0 (``BlockRemoved``) are published.

Counts are per ``(medium, KV-cache group)``: block hash -> copies. Keyed by the block's
own hash (a block hash names its whole prefix, so two conversations that branch inside
a chunk never share a count past the branch).

**Cost.** One held block (vLLM's 64-bit event hashes): the hash (an ``int``, 36 bytes)
and its dict slot (counts are small ints, shared): 68 bytes measured at 320k blocks, at
most about 85 at the table's fullest (``block_bytes``; measured in
``tests/vllm/test_events.py``), per medium that holds it. At 1M held 16-block chunks
held in both media: about 2.2 GB (2.7 GB at most), on top of ``KVEvents.held``'s
records (about 250 MB); ``events.max_chunks`` caps both.

Threads: none of its own; ``KVEvents`` calls it on vLLM's scheduler thread only.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

Hash = int | bytes


class HeldBlocks:
    """Reference counts of held blocks, per medium and KV-cache group."""

    def __init__(self) -> None:
        self._counts: dict[tuple[int, int], dict[Hash, int]] = {}

    def add(self, medium: int, group: int, hashes: Sequence[Hash]) -> list[int]:
        """One more copy in ``medium`` of the blocks ``hashes`` (of ``group``). Returns
        the indices into ``hashes`` not held in ``medium`` before (0 -> 1), ascending."""
        table = self._counts.setdefault((medium, group), {})
        new: list[int] = []
        for j, h in enumerate(hashes):
            n = table.get(h, 0)
            table[h] = n + 1
            if not n:
                new.append(j)
        return new

    def remove(self, medium: int, group: int, hashes: Sequence[Hash]) -> list[int]:
        """One copy fewer: the indices into ``hashes`` now held by no copy in ``medium``
        (1 -> 0), ascending. A block not counted is left alone."""
        table = self._counts.get((medium, group))
        if table is None:
            return []
        gone: list[int] = []
        for j, h in enumerate(hashes):
            n = table.get(h, 0)
            if n > 1:
                table[h] = n - 1
            elif n == 1:
                del table[h]
                gone.append(j)
        if not table:
            del self._counts[(medium, group)]
        return gone

    def held(self, medium: int, group: int) -> int:
        """Blocks held in ``medium`` for ``group``."""
        return len(self._counts.get((medium, group), ()))

    def blocks(self) -> int:
        """Counted blocks, every medium and group together."""
        return sum(len(t) for t in self._counts.values())

    def clear(self) -> None:
        self._counts.clear()

    @staticmethod
    def block_bytes(h: Hash) -> int:
        """Bytes one counted block costs: its hash and its dict slot (three words) plus
        its share of the table (about three more at the table's load)."""
        return sys.getsizeof(h) + 6 * 8
