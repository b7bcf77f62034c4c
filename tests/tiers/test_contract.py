"""The behaviour every tier must have. Written once; run for host, file and S3."""

from __future__ import annotations

import threading
from dataclasses import replace
from typing import Any

import numpy as np
import pytest

from kvtier.keys import ChunkKey
from kvtier.tiers.base import PutStatus, Tier, WriteMode
from tests.tiers.harness import (
    PAYLOAD,
    SPEC,
    TierHarness,
    make_key,
    meta_for,
    payload_for,
)


def _get(tier: Tier, key: ChunkKey, n: int = PAYLOAD) -> np.ndarray | None:
    buf = np.full(n, 0xAB, dtype=np.uint8)  # poisoned
    meta = tier.get_into(key, buf.data)
    return None if meta is None else buf


def _put(tier: Tier, i: int, mode: WriteMode = WriteMode.CREATE) -> PutStatus:
    key = make_key(i)
    return tier.put(meta_for(key), payload_for(key).data, mode)


def test_put_then_get_returns_exact_bytes(harness: TierHarness) -> None:
    tier = harness.make(10 * harness.object_bytes())
    key = make_key(1)
    assert _put(tier, 1) is PutStatus.STORED
    buf = np.zeros(PAYLOAD, dtype=np.uint8)
    meta = tier.get_into(key, buf.data)
    assert meta == meta_for(key)
    np.testing.assert_array_equal(buf, payload_for(key))
    assert tier.metrics.counts.hits == 1  # type: ignore[attr-defined]


def test_missing_key_is_a_counted_miss(harness: TierHarness) -> None:
    tier = harness.make(10 * harness.object_bytes())
    assert _get(tier, make_key(7)) is None
    assert tier.metrics.counts.misses == 1  # type: ignore[attr-defined]


def test_contains_prefix_stops_at_first_gap(harness: TierHarness) -> None:
    tier = harness.make(10 * harness.object_bytes())
    for i in (0, 1, 3):
        _put(tier, i)
    keys = [make_key(i) for i in range(5)]
    assert tier.contains_prefix(keys) == 2
    assert tier.contains_prefix(keys[3:4]) == 1
    assert tier.contains_prefix([]) == 0


def test_delete_removes_and_counts(harness: TierHarness) -> None:
    tier = harness.make(10 * harness.object_bytes())
    _put(tier, 1)
    _put(tier, 2)
    assert tier.delete([make_key(1), make_key(9)]) == 1
    assert _get(tier, make_key(1)) is None
    assert _get(tier, make_key(2)) is not None
    assert tier.usage().objects == 1


def test_create_never_replaces_overwrite_always_does(harness: TierHarness) -> None:
    tier = harness.make(10 * harness.object_bytes())
    key = make_key(1)
    other = payload_for(make_key(2))
    assert _put(tier, 1) is PutStatus.STORED
    assert tier.put(meta_for(key), other.data, WriteMode.CREATE) is PutStatus.EXISTS
    np.testing.assert_array_equal(_get(tier, key), payload_for(key))
    assert tier.put(meta_for(key), other.data, WriteMode.OVERWRITE) is PutStatus.STORED
    np.testing.assert_array_equal(_get(tier, key), other)
    assert tier.usage().objects == 1


def test_usage_counts_objects(harness: TierHarness) -> None:
    tier = harness.make(10 * harness.object_bytes())
    for i in range(3):
        _put(tier, i)
    u = tier.usage()
    assert u.objects == 3
    assert u.bytes >= 3 * PAYLOAD
    assert {o.key for o in tier.scan()} == {make_key(i) for i in range(3)}


@pytest.mark.parametrize("how", ["flip", "truncate", "empty", "foreign"])
def test_damaged_object_is_a_counted_miss_and_is_removed(harness: TierHarness, how: str) -> None:
    if harness.corrupt is None:
        pytest.skip(f"{harness.kind} holds no bytes outside this process to damage")
    tier = harness.make(10 * harness.object_bytes())
    _put(tier, 1)
    _put(tier, 2)
    harness.corrupt(tier, make_key(1), how)
    assert _get(tier, make_key(1)) is None
    assert tier.metrics.counts.corruptions == 1  # type: ignore[attr-defined]
    assert tier.contains_prefix([make_key(1)]) == 0  # quarantined, not served again
    np.testing.assert_array_equal(_get(tier, make_key(2)), payload_for(make_key(2)))


def test_capacity_evicts_least_recently_used(harness: TierHarness) -> None:
    tier = harness.make(3 * harness.object_bytes())
    for i in range(3):
        _put(tier, i)
        harness.clock.advance(10)
    assert _get(tier, make_key(0)) is not None  # 0 is now the most recently used
    harness.clock.advance(10)
    assert _put(tier, 3) is PutStatus.STORED
    u = tier.usage()
    assert u.bytes <= u.capacity
    assert _get(tier, make_key(1)) is None  # the coldest went first
    for i in (0, 3):
        np.testing.assert_array_equal(_get(tier, make_key(i)), payload_for(make_key(i)))


def test_concurrent_readers_and_writers_never_see_mixed_bytes(harness: TierHarness) -> None:
    tier = harness.make(64 * harness.object_bytes())
    errors: list[str] = []
    keys = list(range(8))

    def writer(tid: int) -> None:
        for rnd in range(3):
            for i in keys:
                _put(tier, i, WriteMode.OVERWRITE if (rnd + tid) % 2 else WriteMode.CREATE)

    def reader() -> None:
        for _ in range(4):
            for i in keys:
                got = _get(tier, make_key(i))
                if got is not None and not np.array_equal(got, payload_for(make_key(i))):
                    errors.append(f"key {i}: mixed bytes")

    threads = [threading.Thread(target=writer, args=(t,)) for t in range(2)]
    threads += [threading.Thread(target=reader) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    for i in keys:
        np.testing.assert_array_equal(_get(tier, make_key(i)), payload_for(make_key(i)))


def test_chunk_matching_the_readers_spec_is_served(harness: TierHarness) -> None:
    tier = harness.make(10 * harness.object_bytes())
    key = make_key(1)
    _put(tier, 1)
    buf = np.zeros(PAYLOAD, dtype=np.uint8)
    assert tier.get_into(key, buf.data, expect=SPEC) == meta_for(key)
    np.testing.assert_array_equal(buf, payload_for(key))


@pytest.mark.parametrize(
    "changes",
    [{"dtype": "float16"}, {"num_tokens": 1}, {"namespace": b""}, {"shape": (1, PAYLOAD)}],
    ids=repr,
)
def test_chunk_not_matching_the_readers_spec_is_a_counted_miss_and_is_removed(
    harness: TierHarness, changes: dict[str, Any]
) -> None:
    tier = harness.make(10 * harness.object_bytes())
    key = make_key(1)
    _put(tier, 1)
    buf = np.zeros(PAYLOAD, dtype=np.uint8)
    assert tier.get_into(key, buf.data, expect=replace(SPEC, **changes)) is None
    counts = tier.metrics.counts  # type: ignore[attr-defined]
    assert (counts.corruptions, counts.misses, counts.hits) == (1, 1, 0)
    assert tier.contains_prefix([key]) == 0


def test_payload_bigger_than_the_buffer_is_a_miss_not_an_error(harness: TierHarness) -> None:
    tier = harness.make(10 * harness.object_bytes())
    _put(tier, 1)
    assert _get(tier, make_key(1), PAYLOAD - 1) is None
    assert tier.metrics.counts.misses == 1  # type: ignore[attr-defined]


def test_a_shared_tier_says_whether_the_store_holds_a_key(harness: TierHarness) -> None:
    """``SharedTier.present`` asks the store (the router confirms its index with it)."""
    tier = harness.make(10 * harness.object_bytes())
    present = getattr(tier, "present", None)
    if present is None:
        pytest.skip(f"the {harness.kind} tier is not shared")
    assert _put(tier, 1) is PutStatus.STORED
    assert present(make_key(1)) is True
    assert present(make_key(2)) is False
    assert tier.delete([make_key(1)]) == 1
    assert present(make_key(1)) is False
