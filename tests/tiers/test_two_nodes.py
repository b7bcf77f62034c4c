"""Two nodes on one shared tier at once: each writes, reads and collects the same directory
(two CephFS mounts, or one local directory) or bucket prefix (two S3 clients).

What must hold whatever the interleaving: every object either node can still read has
exactly the bytes that were written for its key, no node ever raises, no temp file or
multipart upload is left behind, and afterwards a node that lists the tier afresh brings
it under capacity by collecting, and every node then sees the same objects.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvtier.clock import ManualClock
from kvtier.tiers.base import PutStatus, SharedTier, WriteMode
from kvtier.tiers.file import FileTier
from kvtier.tiers.s3 import S3Tier
from tests.tiers.conftest import SHARED_KINDS, make_harness
from tests.tiers.harness import PAYLOAD, TierHarness, make_key, meta_for, payload_for

KEYS = 24  # both nodes write all of them, in opposite orders
CAPACITY_OBJECTS = 10  # so both nodes keep collecting while the other writes


@pytest.fixture(params=SHARED_KINDS)
def harness(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[TierHarness]:
    yield from make_harness(request, ManualClock(start=time.time() - 30), tmp_path)


def _second_node(tier: SharedTier, h: TierHarness) -> SharedTier:
    if isinstance(tier, FileTier):
        return FileTier(h.other_node(tier.root), tier.capacity, clock=h.clock,
                        touch_interval=0.0)  # fmt: skip
    assert isinstance(tier, S3Tier)
    return S3Tier(bucket=tier.bucket, prefix=tier.prefix, endpoint_url=tier.endpoint_url,
                  capacity_bytes=tier.capacity, clock=h.clock, touch_interval=0.0,
                  max_attempts=2)  # fmt: skip


def _read(tier: SharedTier, i: int) -> np.ndarray | None:
    buf = np.full(PAYLOAD, 0xAB, dtype=np.uint8)
    return None if tier.get_into(make_key(i), buf.data) is None else buf


def test_two_nodes_write_read_and_collect_one_tier_at_once(harness: TierHarness) -> None:
    a = harness.make(CAPACITY_OBJECTS * harness.object_bytes())
    assert isinstance(a, SharedTier)
    b = _second_node(a, harness)
    errors: list[str] = []

    def node(tier: SharedTier, order: list[int], name: str) -> None:
        try:
            for rnd in range(2):
                for i in order:
                    mode = WriteMode.CREATE if rnd == 0 else WriteMode.OVERWRITE
                    status = tier.put(meta_for(make_key(i)), payload_for(make_key(i)).data, mode)
                    if status not in (PutStatus.STORED, PutStatus.EXISTS):
                        errors.append(f"{name}: put {i} -> {status}")
                    got = _read(tier, order[-1 - i % len(order)])
                    want = payload_for(make_key(order[-1 - i % len(order)]))
                    if got is not None and not np.array_equal(got, want):
                        errors.append(f"{name}: read mixed or foreign bytes")
                    tier.collect()
        except Exception as e:  # surfaced below: a node must never raise
            errors.append(f"{name}: {type(e).__name__}: {e}")

    keys = list(range(KEYS))
    threads = [
        threading.Thread(target=node, args=(a, keys, "a")),
        threading.Thread(target=node, args=(b, keys[::-1], "b")),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []

    for tier in (a, b):
        for i in keys:
            got = _read(tier, i)
            assert got is None or np.array_equal(got, payload_for(make_key(i))), i
    # A node started now lists what is really there; its collection brings the tier
    # under capacity, and every node then sees the same objects.
    fresh = _second_node(a, harness)
    fresh.collect()
    survivors = sorted(info.key for info in _second_node(b, harness).scan())
    assert 0 < len(survivors) <= CAPACITY_OBJECTS
    assert sorted(info.key for info in _second_node(a, harness).scan()) == survivors
    if isinstance(a, FileTier):
        leftovers = [p.name for p in a.root.rglob("*") if p.is_file() and p.suffix != ".kv"]
        assert leftovers == []
    else:
        assert isinstance(a, S3Tier)
        uploads = a.io.client.list_multipart_uploads(Bucket=a.bucket, Prefix=a.prefix)
        assert uploads.get("Uploads", []) == []
    b.close()
