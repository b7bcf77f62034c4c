"""Leases on the shared tiers (file, S3): renew, read_meta, expire, and chain renewal.

Time is driven by a ``ManualClock`` that starts near the real wall clock, because S3
listings carry the endpoint's real LastModified next to kvtier's own stamp.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvtier.clock import ManualClock
from kvtier.keys import ChunkKey
from kvtier.lease import expire_all, renew_chain
from kvtier.tiers.base import PutStatus, SharedTier
from kvtier.tiers.file import FileTier
from kvtier.tiers.s3 import S3Tier
from tests.tiers.conftest import SHARED_KINDS, make_harness
from tests.tiers.harness import PAYLOAD, TierHarness, make_key, meta_for, payload_for

LEASE = 480.0


@pytest.fixture(params=SHARED_KINDS)
def harness(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[TierHarness]:
    # 30 s behind the real clock: the S3 endpoint's LastModified (real time) runs ahead of
    # kvtier's stamp, as with a node whose clock is skewed, or a slow test.
    yield from make_harness(request, ManualClock(start=time.time() - 30), tmp_path)


def _chain(tier: SharedTier, first: int, n: int) -> list[ChunkKey]:
    keys = [make_key(first + i) for i in range(n)]
    for i, key in enumerate(keys):
        meta = dataclasses.replace(meta_for(key), parent=keys[i - 1] if i else None)
        tier.put(meta, payload_for(key).data)
    return keys


def _shared(h: TierHarness) -> SharedTier:
    tier = h.make(64 * h.object_bytes())
    assert isinstance(tier, SharedTier)
    return tier


def _second_node(tier: SharedTier, h: TierHarness) -> SharedTier:
    """Another node's view of the same directory (on CephFS: through the other mount) or
    bucket prefix (another client)."""
    clock = h.clock
    if isinstance(tier, FileTier):
        return FileTier(h.other_node(tier.root), tier.capacity, clock=clock)
    assert isinstance(tier, S3Tier)
    return S3Tier(bucket=tier.bucket, prefix=tier.prefix, endpoint_url=tier.endpoint_url,
                  capacity_bytes=tier.capacity, clock=clock)


def test_read_meta_is_the_header_and_none_when_absent(harness: TierHarness) -> None:
    tier = _shared(harness)
    keys = _chain(tier, 0, 2)
    meta = tier.read_meta(keys[1])
    assert meta is not None and meta.key == keys[1] and meta.parent == keys[0]
    assert meta.payload_len == PAYLOAD
    assert tier.read_meta(make_key(999)) is None


def test_expire_removes_only_objects_past_their_lease(harness: TierHarness) -> None:
    tier = _shared(harness)
    old = _chain(tier, 0, 2)
    harness.clock.advance(LEASE / 2)
    young = _chain(tier, 10, 2)
    harness.clock.advance(LEASE / 2 + 1)
    assert tier.expire(LEASE) == 2
    assert tier.contains_prefix(old) == 0
    assert tier.contains_prefix(young) == 2
    buf = np.empty(PAYLOAD, np.uint8)
    assert tier.get_into(young[0], buf.data) is not None


def test_renewal_keeps_a_chain_past_its_original_expiry(harness: TierHarness) -> None:
    tier = _shared(harness)
    kept = _chain(tier, 0, 3)
    dropped = _chain(tier, 10, 3)
    harness.clock.advance(LEASE - 10)
    assert renew_chain([tier], kept[-1].hex()) == 3  # walks parents from the last key
    harness.clock.advance(20)  # past the original expiry of both chains
    assert expire_all([tier], LEASE) == 3
    assert tier.contains_prefix(kept) == 3
    assert tier.contains_prefix(dropped) == 0


def test_expire_honours_a_renewal_by_another_node(harness: TierHarness) -> None:
    tier = _shared(harness)
    keys = _chain(tier, 0, 1)
    harness.clock.advance(LEASE + 1)
    # The index of `tier` still has the old stamp; another node renews behind its back.
    other = _second_node(tier, harness)
    assert other.renew(keys[0])
    assert tier.expire(LEASE) == 0
    assert tier.contains_prefix(keys) == 1


def test_renew_chain_stops_at_a_missing_chunk(harness: TierHarness) -> None:
    tier = _shared(harness)
    keys = _chain(tier, 0, 3)
    tier.delete([keys[1]])
    assert renew_chain([tier], keys[2].hex()) == 1  # the last one; its parent is gone
    assert not tier.renew(keys[1])


def test_a_write_after_another_node_collected_the_object_stores_it_again(
    harness: TierHarness,
) -> None:
    tier = _shared(harness)
    keys = _chain(tier, 0, 1)
    other = _second_node(tier, harness)
    harness.clock.advance(LEASE + 1)
    assert other.expire(LEASE) == 1  # the other node's collector
    # `tier`'s index still lists the key; a CREATE must ask the store, not the index.
    status = tier.put(meta_for(keys[0]), payload_for(keys[0]).data)
    assert status is PutStatus.STORED
    assert other.read_meta(keys[0]) is not None
    assert tier.put(meta_for(keys[0]), payload_for(keys[0]).data) is PutStatus.EXISTS
