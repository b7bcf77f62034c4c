"""Leases on conversations kept in shared tiers, for P/D serving (decode -> prefill reuse).

A conversation is a chain of chunks: each object's header names its parent, so its last
key identifies all of it. Its lease is the lease of its objects (``SharedTier``): reads
renew them, ``renew_chain`` renews a whole chain at once (the router's heartbeat), and
``expire_all`` is the collector that removes what nobody used for ``lease_seconds``.

Invariant: expiry only ever removes whole objects, each re-checked (stat) as not renewed
since the cutoff shortly before its delete; a chain cut by expiry is a shorter prefix,
which restores correctly and recomputes the rest. On a file tier the delete is
conditional on what the re-check saw (``kvtier.tiers.file``: rename to a graveyard name,
re-stat, unlink or link back), so a renewal that returned before the delete survives it.
What does *not* hold on S3 (issue 32): a renewal is a self-copy that keeps the ETag, and
no endpoint kvtier runs on conditions a delete on the stamp, so a renewal landing between
a batch's HEADs (up to a tick's objects) and its deletes is lost with its object, and a
live chain can be cut there (only the HEAD fallback compares the stamp, right before each
DELETE). Renewing well inside the lease (``touch_interval`` below ``lease_seconds`` is
enforced at config load; the router's heartbeat) keeps live objects far from the cutoff,
which makes that window matter only for objects renewed just as their lease ran out.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Protocol

from kvtier.keys import ChunkKey, key_from_hex
from kvtier.objformat import ChunkMeta
from kvtier.tiers.base import SharedTier

log = logging.getLogger("kvtier.lease")


class ChainTier(Protocol):
    """What ``renew_chain`` asks of a tier (a ``SharedTier``, or the router's guarded
    view of one)."""

    def renew(self, key: ChunkKey) -> bool: ...

    def read_meta(self, key: ChunkKey) -> ChunkMeta | None: ...


def renew_chain(tiers: Sequence[ChainTier], last_key_hex: str, max_chunks: int = 65536) -> int:
    """Renew the chain ending at ``last_key_hex`` in every tier that holds it.

    Walks parent links from the last chunk to the first; returns the number of chunks
    renewed in at least one tier. Stops at the first chunk no tier holds.
    """
    key: ChunkKey | None = key_from_hex(last_key_hex)
    n = 0
    while key is not None and n < max_chunks:
        parent: ChunkKey | None = None
        found = False
        for tier in tiers:
            if not tier.renew(key):
                continue
            found = True
            if parent is None:
                meta = tier.read_meta(key)
                parent = meta.parent if meta is not None else None
        if not found:
            break
        n += 1
        key = parent
    return n


def expire_all(tiers: Sequence[SharedTier], lease_seconds: float) -> int:
    """Run the collector on every tier; returns the number of objects removed."""
    n = 0
    for tier in tiers:
        removed = tier.expire(lease_seconds)
        if removed:
            log.info("%s: %d objects past their %.0f s lease removed", tier.name, removed,
                     lease_seconds)
        n += removed
    return n
