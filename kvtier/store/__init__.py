"""The tiered store: host memory first, then lower tiers (files, S3), as one cache.

Start at ``tiered.py`` (``TieredStore`` and its data flows). The rest, by job:
``state.py`` (the shared fields and their lock rules), ``reads.py`` (lookup, probe, load),
``writes.py`` (reserve, commit, write-through), ``writeback.py`` (spills, write-back),
``upkeep.py`` (resets, flushes, shutdown), ``types.py`` (the small value types).
"""

from kvtier.store.state import PROBE_QUEUE, StoreState
from kvtier.store.tiered import TieredStore
from kvtier.store.types import (
    HOST,
    FlushReport,
    Held,
    Hit,
    LoadProgress,
    Lookup,
    LowerTier,
    WritePolicy,
)

__all__ = [
    "HOST",
    "PROBE_QUEUE",
    "FlushReport",
    "Held",
    "Hit",
    "LoadProgress",
    "Lookup",
    "LowerTier",
    "StoreState",
    "TieredStore",
    "WritePolicy",
]
