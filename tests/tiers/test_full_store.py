"""A store that is full while this node's view is within ``capacity`` (review N4): on a
real size-limited filesystem (a 1 MiB tmpfs) under a tier configured for 64 MiB, a write
that gets ENOSPC lowers the room the tier collects to, collection frees room at once,
and writing goes on; nothing served is wrong. The same through a ``TieredStore`` with a
write-through tier, where collection is a job of its own.

Before: collection was queued only after a stored write and freed nothing while the
node's view was within ``capacity``, so every write after the first ENOSPC failed for
good.
"""

from __future__ import annotations

import errno
from pathlib import Path

import numpy as np

from kvtier.clock import ManualClock
from kvtier.config import HealthConfig
from kvtier.health import breakers_for
from kvtier.iopool import IOPool
from kvtier.store import LowerTier, TieredStore, WritePolicy
from kvtier.tiers.base import PutStatus
from kvtier.tiers.file import FileTier
from kvtier.tiers.host import HostTier
from kvtier.tiers.objtier import is_full
from tests.tiers.harness import PAYLOAD, make_key, meta_for, payload_for

MiB = 1 << 20


def _read(tier: FileTier, key: bytes) -> np.ndarray | None:
    buf = np.zeros(PAYLOAD, np.uint8)
    return None if tier.get_into(key, buf.data) is None else buf  # type: ignore[arg-type]


def test_a_full_filesystem_is_collected_and_writing_goes_on(tiny_fs: Path) -> None:
    clock = ManualClock(start=1_700_000_000.0)
    tier = FileTier(tiny_fs / "kv", 64 * MiB, clock=clock, fsync=False)
    try:
        statuses = []
        for i in range(60):  # ~64 KiB each: about 15 fit
            key = make_key(i)
            clock.advance(1.0)
            statuses.append(tier.put(meta_for(key), payload_for(key).data))
        assert PutStatus.NO_SPACE in statuses  # the disk filled up
        assert tier.metrics.counts.full >= 1 and tier.room < tier.capacity
        assert tier.metrics.counts.errors == 0  # a full store is not a failing one
        assert statuses[-10:].count(PutStatus.STORED) >= 8  # collection made room
        for i in range(60):  # nothing served wrong: each object present is its own
            got = _read(tier, make_key(i))
            if got is not None:
                np.testing.assert_array_equal(got, payload_for(make_key(i)))
        assert _read(tier, make_key(59)) is not None
        assert tier.usage().bytes <= 1 * MiB
    finally:
        tier.close()


def test_a_full_write_through_tier_behind_a_store_keeps_taking_new_chunks(
    tiny_fs: Path,
) -> None:
    clock = ManualClock(start=1_700_000_000.0)
    tier = FileTier(tiny_fs / "kv", 64 * MiB, clock=clock, fsync=False, name="file1")
    host = HostTier(8 * PAYLOAD, PAYLOAD, clock=clock)
    pool = IOPool(1, 64, name="io-file1")
    store = TieredStore(host, [LowerTier(tier, WritePolicy.THROUGH)], pool,
                        breakers=breakers_for(["file1"], HealthConfig(), 1, clock),
                        tier_io=[pool])
    try:
        keys = [make_key(1000 + i) for i in range(60)]
        for key in keys:
            clock.advance(1.0)
            assert store.put(meta_for(key), payload_for(key).data)
            assert store.flush(10)  # each write (and the collection it queues) done
        assert tier.metrics.counts.full >= 1
        assert store.breakers[0].up  # full is not a fault: the tier stays in use
        assert sum(tier.contains_prefix([k]) for k in keys[-10:]) >= 8
    finally:
        store.close(timeout=5)
        tier.close()


def test_what_counts_as_full() -> None:
    assert is_full(OSError(errno.ENOSPC, "No space left on device"))
    assert is_full(OSError(errno.EDQUOT, "Disk quota exceeded"))
    assert not is_full(OSError(errno.EIO, "I/O error"))

    class Answer(Exception):
        def __init__(self, code: str) -> None:
            self.response = {"Error": {"Code": code}}

    assert is_full(Answer("QuotaExceeded"))
    assert not is_full(Answer("AccessDenied"))
