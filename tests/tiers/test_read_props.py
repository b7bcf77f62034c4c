"""Property tests of every read path that feeds the KV cache: the file tier, the S3 tier
(over the real local endpoint) and the host tier through ``TieredStore.load``.

Whatever bytes an object holds, a read yields a verified chunk that matches the reader's
``ChunkSpec`` (and the bytes that were written), or a counted miss that removes the object;
no exception escapes, and every host slot's reader count is back at zero afterwards.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

from kvtier.clock import ManualClock
from kvtier.iopool import IOPool
from kvtier.keys import ChunkKey
from kvtier.objformat import checksum, encode_header
from kvtier.store import LowerTier, TieredStore, WritePolicy
from kvtier.tiers.file import FileTier
from kvtier.tiers.host import HostTier
from kvtier.tiers.s3 import S3Tier
from tests.tiers.damage import damaged_object
from tests.tiers.harness import PAYLOAD, SPEC, drain_host, make_key, meta_for, payload_for

KEY = make_key(9)
GOOD = bytes(payload_for(KEY))
WIRE = meta_for(KEY).to_wire(checksum(GOOD))
OBJECT = encode_header(meta_for(KEY), GOOD) + GOOD
DAMAGED = damaged_object(OBJECT, WIRE, GOOD)

_FIXTURES = [HealthCheck.function_scoped_fixture]  # each example rewrites what it reads
FILE = settings(max_examples=60, deadline=None, database=None, suppress_health_check=_FIXTURES)
S3 = settings(max_examples=30, deadline=None, database=None, suppress_health_check=_FIXTURES)

WriteRaw = Callable[[ChunkKey, bytes], None]


def _file_writer(tier: FileTier) -> WriteRaw:
    def write(key: ChunkKey, data: bytes) -> None:
        path = tier.path_of(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)

    return write


@pytest.fixture
def file_tier(tmp_path: Path) -> FileTier:
    return FileTier(tmp_path / "file", 1 << 30, clock=ManualClock(), touch_interval=0.0)


@pytest.fixture
def s3_tier(request: pytest.FixtureRequest) -> Iterator[tuple[S3Tier, WriteRaw]]:
    from tests.tiers.s3_harness import BUCKET, fresh_prefix, raw_client, shared_endpoint

    endpoint = shared_endpoint(request.config)
    with contextlib.ExitStack() as stack:
        raw = raw_client(endpoint)
        stack.callback(raw.close)
        tier = S3Tier(
            bucket=BUCKET,
            prefix=fresh_prefix(),
            endpoint_url=endpoint,
            capacity_bytes=1 << 30,
            max_attempts=2,
            touch_interval=0.0,
            clock=ManualClock(),
        )
        stack.callback(tier.close)

        def write(key: ChunkKey, data: bytes) -> None:
            raw.put_object(Bucket=BUCKET, Key=tier.object_name(key), Body=data)

        yield tier, write


def _read_is_verified_or_a_counted_miss(tier: FileTier | S3Tier) -> None:
    before = replace(tier.metrics.counts)
    buf = np.zeros(PAYLOAD, dtype=np.uint8)  # exactly a slot, as the store reads
    meta = tier.get_into(KEY, buf.data, expect=SPEC)
    after = tier.metrics.counts
    if meta is None:
        assert (after.misses, after.corruptions) == (before.misses + 1, before.corruptions + 1)
        assert tier.contains_prefix([KEY]) == 0  # removed: never served later
    else:
        SPEC.check(meta)
        assert meta.key == KEY
        assert bytes(buf) == GOOD
        assert after.hits == before.hits + 1


@FILE
@given(obj=DAMAGED)
def test_file_tier_reads_verified_chunks_or_counted_misses(file_tier: FileTier, obj: bytes) -> None:
    _file_writer(file_tier)(KEY, obj)
    _read_is_verified_or_a_counted_miss(file_tier)


@pytest.mark.s3
@S3
@given(obj=DAMAGED)
def test_s3_tier_reads_verified_chunks_or_counted_misses(
    s3_tier: tuple[S3Tier, WriteRaw], obj: bytes
) -> None:
    tier, write = s3_tier
    write(KEY, obj)
    _read_is_verified_or_a_counted_miss(tier)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[TieredStore]:
    host = HostTier(4 * PAYLOAD, PAYLOAD)
    file = FileTier(tmp_path / "file", 1 << 30, clock=ManualClock(), touch_interval=0.0)
    s = TieredStore(host, [LowerTier(file, WritePolicy.THROUGH)], IOPool(2, 64))
    yield s
    s.close()


@FILE
@given(obj=DAMAGED)
def test_store_load_holds_verified_chunks_and_leaks_no_hold(store: TieredStore, obj: bytes) -> None:
    file = store.lower[0].tier
    assert isinstance(file, FileTier)
    first, last = make_key(8), make_key(10)  # a host hit before KEY, a good object after
    keys = [first, KEY, last]
    store.put(meta_for(first), payload_for(first))
    file.put(meta_for(last), payload_for(last).data)
    _file_writer(file)(KEY, obj)
    corrupt = file.metrics.counts.corruptions
    held = store.load(store.lookup(keys), SPEC).result(timeout=30)
    try:
        assert len(held) in (1, 3)  # KEY is served, or ends the prefix
        for j in range(len(held)):
            SPEC.check(held.slots[j][1])
            np.testing.assert_array_equal(held.view(j), payload_for(keys[j]))
    finally:
        held.release()
    if len(held) == 1:
        assert file.metrics.counts.corruptions == corrupt + 1
        assert not file.path_of(KEY).exists()
    store.flush()
    drain_host(store.host)
