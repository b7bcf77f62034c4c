"""S3-specific faults and paths, against real moto servers on 127.0.0.1.

The shared session server covers set-up errors and the large-object paths; tests that take
an endpoint away (stop it, freeze it, make it check credentials) get a server of their own.
Durations are asserted with the wall clock only as an upper bound ("no hang"); nothing
sleeps.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from kvtier.clock import ManualClock
from kvtier.testing.s3server import MotoServer, dummy_credentials
from kvtier.tiers.base import PutStatus, TierError, WriteMode
from kvtier.tiers.s3 import S3Tier
from kvtier.tiers.s3io import BadAnswer, MiB, parse_size
from tests.tiers.harness import make_key, meta_for, payload_for
from tests.tiers.s3_harness import (
    BUCKET,
    fresh_prefix,
    raw_client,
    rgw_endpoint,
    shared_endpoint,
)

pytestmark = pytest.mark.s3
SETTING = "tiers[2].s3"
RX = re.escape(SETTING)
BIG = 12 * MiB + 123  # three 5 MiB parts/ranges, the last one short and odd-sized


@pytest.fixture(params=["moto", pytest.param("rgw", marks=pytest.mark.ceph)])
def endpoint(request: pytest.FixtureRequest) -> str:
    """The session's shared S3 server: moto, or Ceph RGW (a real S3 implementation)."""
    if request.param == "rgw":
        return rgw_endpoint(request)
    return shared_endpoint(request.config)


@pytest.fixture
def own_server() -> Iterator[MotoServer]:
    """A server only this test uses, so it can stop or freeze it."""
    server = MotoServer()
    with dummy_credentials():
        server.start()
        try:
            raw = raw_client(server.endpoint_url)
            raw.create_bucket(Bucket=BUCKET)
            raw.close()
            yield server
        finally:
            server.stop()


def _tier(endpoint: str, **kw: Any) -> S3Tier:
    args: dict[str, Any] = {
        "bucket": BUCKET,
        "prefix": fresh_prefix(),
        "endpoint_url": endpoint,
        "capacity_bytes": 1 << 30,
        "clock": ManualClock(),
        "touch_interval": 0.0,
        "setting": SETTING,
        **kw,
    }
    return S3Tier(**args)


def _put(tier: S3Tier, i: int, n: int, mode: WriteMode = WriteMode.CREATE) -> PutStatus:
    key = make_key(i)
    return tier.put(meta_for(key, n), payload_for(key, n).data, mode)


def _get(tier: S3Tier, i: int, n: int) -> np.ndarray | None:
    buf = np.full(n, 0xAB, dtype=np.uint8)
    return None if tier.get_into(make_key(i), buf.data) is None else buf


# -- set-up errors -----------------------------------------------------------------------
def test_missing_bucket_is_a_clear_error_naming_the_field(endpoint: str) -> None:
    with pytest.raises(TierError) as err:
        _tier(endpoint, bucket="no-such-bucket")
    assert str(err.value).startswith(f"{SETTING}.bucket: bucket 'no-such-bucket' does not exist")
    assert endpoint in str(err.value) and "create it or fix the name" in str(err.value)


def test_unreachable_endpoint_is_a_clear_error_quickly(own_server: MotoServer) -> None:
    url = own_server.endpoint_url
    own_server.stop()  # nothing listens on that port any more
    t0 = time.monotonic()
    with pytest.raises(TierError, match=rf"^{RX}\.endpoint_url: cannot reach {url}"):
        _tier(url)
    assert time.monotonic() - t0 < 10


def test_wrong_credentials_are_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    # This server authenticates requests, so keys it never issued get HTTP 403.
    # The wrong keys are undone when the block ends (before dummy_credentials restores its
    # own), so no later test runs with them: moto accepts any key, RGW does not.
    server = MotoServer(validate_credentials=True)
    with dummy_credentials():
        url = server.start()
        try:
            with monkeypatch.context() as wrong:
                wrong.setenv("AWS_ACCESS_KEY_ID", "AKIAWRONGWRONGWRONG0")
                wrong.setenv("AWS_SECRET_ACCESS_KEY", "wrong-secret-do-not-print")
                with pytest.raises(TierError, match=rf"^{RX}\.bucket: access .* denied") as e:
                    _tier(url)
        finally:
            server.stop()
    assert "wrong-secret" not in str(e.value) and "AKIAWRONG" not in str(e.value)
    assert os.environ.get("AWS_ACCESS_KEY_ID") != "AKIAWRONGWRONGWRONG0"


def test_missing_credentials_are_a_clear_error(
    endpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    with pytest.raises(TierError, match=rf"^{RX}: no AWS credentials found"):
        _tier(endpoint)


def test_bad_part_size_is_rejected_before_any_request() -> None:
    with pytest.raises(TierError, match=rf"^{RX}\.part_size: .* 5 MiB"):
        _tier("http://127.0.0.1:9", part_size=MiB)


# -- endpoint faults after start -----------------------------------------------------------
def test_endpoint_down_after_start_means_failed_puts_and_counted_misses(
    own_server: MotoServer,
) -> None:
    tier = _tier(own_server.endpoint_url, max_attempts=2, connect_timeout=1.0)
    n = 4096
    assert _put(tier, 1, n) is PutStatus.STORED
    own_server.stop()
    t0 = time.monotonic()
    assert _put(tier, 2, n) is PutStatus.FAILED
    assert _put(tier, 3, n, WriteMode.OVERWRITE) is PutStatus.FAILED
    assert _get(tier, 1, n) is None
    assert tier.contains_prefix([make_key(9)]) == 0
    assert time.monotonic() - t0 < 30
    counts = tier.metrics.counts
    assert counts.errors >= 4 and counts.misses == 1 and counts.hits == 0
    assert tier.usage().objects == 1  # the index still remembers the chunk stored earlier
    tier.close()


def test_frozen_endpoint_times_out_instead_of_hanging(own_server: MotoServer) -> None:
    tier = _tier(own_server.endpoint_url, max_attempts=1, read_timeout=1.0)
    assert _put(tier, 1, 4096) is PutStatus.STORED
    own_server.pause()  # accepts connections, never answers
    t0 = time.monotonic()
    assert _put(tier, 2, 4096) is PutStatus.FAILED
    assert _get(tier, 1, 4096) is None
    assert time.monotonic() - t0 < 10
    assert tier.metrics.counts.errors == 2
    tier.close()
    own_server.resume()  # the earlier chunk is intact (read with ordinary timeouts)
    again = _tier(own_server.endpoint_url, prefix=tier.prefix)
    np.testing.assert_array_equal(_get(again, 1, 4096), payload_for(make_key(1), 4096))
    again.close()


# -- large objects ---------------------------------------------------------------------------
def test_multipart_upload_round_trips_exactly(endpoint: str) -> None:
    tier = _tier(endpoint, multipart_threshold=5 * MiB, part_size=5 * MiB)
    other = _tier(endpoint, prefix=tier.prefix, multipart_threshold=5 * MiB, part_size=5 * MiB)
    assert _put(tier, 1, BIG) is PutStatus.STORED
    raw = raw_client(endpoint)
    etag = raw.head_object(Bucket=BUCKET, Key=tier.object_name(make_key(1)))["ETag"]
    assert etag.endswith('-3"')  # uploaded as three parts
    np.testing.assert_array_equal(_get(tier, 1, BIG), payload_for(make_key(1), BIG))
    # A node that has not seen the object yet still cannot replace it with CREATE, and
    # its refused upload is aborted, not left behind.
    assert _put(other, 1, BIG) is PutStatus.EXISTS
    assert raw.list_multipart_uploads(Bucket=BUCKET).get("Uploads", []) == []
    raw.close()
    tier.close()
    other.close()


def test_ranged_gets_fill_the_buffer_in_parallel(endpoint: str) -> None:
    tier = _tier(endpoint, part_size=5 * MiB)
    ranges: list[str] = []
    tier.io.client.meta.events.register(
        "before-call.s3.GetObject", lambda params, **_: ranges.append(params["headers"]["Range"])
    )
    assert _put(tier, 1, BIG) is PutStatus.STORED
    np.testing.assert_array_equal(_get(tier, 1, BIG), payload_for(make_key(1), BIG))
    assert sorted(ranges) == [
        "bytes=0-5242879",
        "bytes=10485760-12587130",
        "bytes=5242880-10485759",
    ]
    tier.close()


def test_object_smaller_or_larger_than_expected_is_read_whole(endpoint: str) -> None:
    writer = _tier(endpoint, part_size=5 * MiB)
    blind = _tier(endpoint, prefix=writer.prefix, part_size=5 * MiB)  # listed before the put
    small = 6 * MiB
    assert _put(writer, 1, small) is PutStatus.STORED
    reader = _tier(endpoint, prefix=writer.prefix, part_size=5 * MiB)  # lists it at 6 MiB
    # Size unknown, buffer larger than the object: ranges past its end come back empty.
    buf = np.zeros(BIG, dtype=np.uint8)
    assert blind.get_into(make_key(1), buf.data) == meta_for(make_key(1), small)
    np.testing.assert_array_equal(buf[:small], payload_for(make_key(1), small))
    # Rewritten larger since the reader listed it: the tail is fetched in a second round.
    assert _put(writer, 1, BIG, WriteMode.OVERWRITE) is PutStatus.STORED
    np.testing.assert_array_equal(_get(reader, 1, BIG), payload_for(make_key(1), BIG))
    for t in (writer, blind, reader):
        t.close()


# -- sharing between nodes -------------------------------------------------------------------
def test_collection_spares_objects_another_node_used(endpoint: str) -> None:
    clock = ManualClock()
    n = 4096
    obj = n + 4096
    a = _tier(endpoint, capacity_bytes=3 * obj, clock=clock)
    for i in range(3):
        assert _put(a, i, n) is PutStatus.STORED
        clock.advance(10)
    b = _tier(endpoint, prefix=a.prefix, clock=clock)  # another node on the same prefix
    assert _get(b, 0, n) is not None  # b's hit refreshes 0's shared recency
    clock.advance(10)
    assert _put(a, 3, n) is PutStatus.STORED  # a thinks 0 is its coldest, but b used it
    assert b.contains_prefix([make_key(0)]) == 1
    assert _get(a, 0, n) is not None and _get(a, 3, n) is not None
    assert _get(a, 1, n) is None and _get(a, 2, n) is None
    assert a.metrics.counts.evictions == 2
    a.close()
    b.close()


@pytest.mark.parametrize("answer", ["*", "-1", "", "None", "\u00b2", "1e3", None])
def test_a_size_that_is_not_a_byte_count_is_a_fault_not_a_crash(answer: object) -> None:
    with pytest.raises(BadAnswer):
        parse_size(answer)
    assert parse_size("1234") == parse_size(1234) == 1234


# -- restamps are off the read path -------------------------------------------------------
def test_a_hit_returns_before_its_restamp_and_one_restamp_per_key_is_queued(
    endpoint: str,
) -> None:
    """A hit's recency restamp (a server-side self-copy) is queued, never part of the
    read the breaker times: the read returns while the restamp is held up."""
    import threading

    tier = _tier(endpoint)
    try:
        assert _put(tier, 1, 4096) is PutStatus.STORED
        gate, done = threading.Event(), threading.Event()
        real = tier._stamp
        calls: list[str] = []

        def held_stamp(name: str, now: float, etag: str = "") -> bool:
            calls.append(name)
            assert gate.wait(30)
            try:
                return real(name, now, etag)
            finally:
                done.set()

        tier._stamp = held_stamp  # type: ignore[method-assign]
        tier._clock.advance(5.0)  # type: ignore[attr-defined]
        np.testing.assert_array_equal(_get(tier, 1, 4096), payload_for(make_key(1), 4096))
        assert tier.stamps_pending() == 1  # queued; the read did not wait for it
        assert _get(tier, 1, 4096) is not None
        assert tier.stamps_pending() == 1, "one restamp per key is queued, not one per hit"
        gate.set()
        assert done.wait(30)
        head = raw_client(endpoint).head_object(Bucket=BUCKET, Key=tier.object_name(make_key(1)))
        assert float(head["Metadata"]["kvtier-used"]) == tier._clock.wall()
    finally:
        tier.close()


def test_a_multipart_object_restamped_mid_read_is_read_again(endpoint: str) -> None:
    """Another node's restamp of a multipart object gives it a new ETag (a copy is one
    part), so ranges of one read can come from two versions. The read starts again
    instead of missing; the bytes are the same chunk."""
    import threading

    tier = _tier(endpoint, multipart_threshold=5 * MiB, part_size=5 * MiB)
    try:
        assert _put(tier, 1, BIG) is PutStatus.STORED
        name = tier.object_name(make_key(1))
        raw = raw_client(endpoint)
        before = raw.head_object(Bucket=BUCKET, Key=name)["ETag"]
        first_done = threading.Event()
        restamped = threading.Lock()
        state = {"round": 0, "restamped": False}
        real = tier.io._get_range

        def racing(name_: str, head: memoryview, body: memoryview, start: int, end: int,
                   etag: str | None) -> Any:
            if state["round"] == 0:
                if start == 0:
                    try:
                        return real(name_, head, body, start, end, etag)
                    finally:
                        first_done.set()
                assert first_done.wait(30)
                with restamped:
                    if not state["restamped"]:  # another node's restamp, between ranges
                        state["restamped"] = True
                        raw.copy_object(Bucket=BUCKET, Key=name, MetadataDirective="REPLACE",
                                        CopySource={"Bucket": BUCKET, "Key": name},
                                        Metadata={"kvtier-used": "1.0"})
            return real(name_, head, body, start, end, etag)

        real_read = tier.io.read

        def counted(*a: Any) -> Any:
            try:
                return real_read(*a)
            finally:
                state["round"] += 1

        tier.io._get_range = racing  # type: ignore[method-assign,assignment]
        tier.io.read = counted  # type: ignore[method-assign,assignment]
        got = _get(tier, 1, BIG)
        assert state["restamped"]
        changed = raw.head_object(Bucket=BUCKET, Key=name)["ETag"] != before
        # moto (like AWS) gives the copy a new ETag; RGW keeps a multipart copy's ETag
        assert state["round"] == (2 if changed else 1), "read again iff the version changed"
        np.testing.assert_array_equal(got, payload_for(make_key(1), BIG))
        raw.close()
    finally:
        tier.close()


def test_transfer_threads_are_daemons(endpoint: str) -> None:
    """A part transfer stuck in a hung endpoint must not hold the interpreter's exit."""
    import threading

    tier = _tier(endpoint, multipart_threshold=5 * MiB, part_size=5 * MiB)
    try:
        assert _put(tier, 1, BIG) is PutStatus.STORED
        parts = [t for t in threading.enumerate() if t.name.startswith("kvtier-s3-parts")]
        assert parts and all(t.daemon for t in parts)
    finally:
        tier.close()


def test_a_ranged_read_does_not_queue_behind_background_heads(endpoint: str) -> None:
    """Collection's HEADs of a batch (here held at the endpoint's door by a botocore
    event hook, as a slow endpoint would) fill every background thread and queue more;
    a restore's ranged GETs meanwhile run on threads of their own and finish (issue 32
    review item 6: they queued in the one ``s3-parts`` pool behind the HEADs)."""
    import threading

    tier = _tier(endpoint, part_size=5 * MiB, max_concurrency=2)
    release, held = threading.Event(), threading.Semaphore(0)

    def hold_head(**_: Any) -> None:
        if not release.is_set():
            held.release()
            release.wait(60)

    heads: threading.Thread | None = None
    try:
        assert _put(tier, 1, BIG) is PutStatus.STORED
        keys = [make_key(100 + i) for i in range(12)]
        tier.io.client.meta.events.register("before-send.s3.HeadObject", hold_head)
        heads = threading.Thread(target=tier.objects.heads, args=(keys,), daemon=True)
        heads.start()
        for _ in range(3):  # the collector's own thread and both background threads
            assert held.acquire(timeout=30)
        got: list[np.ndarray | None] = []
        reader = threading.Thread(target=lambda: got.append(_get(tier, 1, BIG)), daemon=True)
        t0 = time.perf_counter()
        reader.start()
        reader.join(timeout=20)
        took = time.perf_counter() - t0
        assert got, f"the read waited {took:.1f} s behind the held HEADs"
        assert got[0] is not None
        np.testing.assert_array_equal(got[0], payload_for(make_key(1), BIG))
    finally:
        release.set()
        if heads is not None:
            heads.join(timeout=30)
        tier.close()
