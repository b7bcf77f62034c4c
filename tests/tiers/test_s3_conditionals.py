"""Conditional requests on real S3 servers: what moto and Ceph RGW 16.2 honour (probed at
start), and that kvtier's fallbacks keep a create from replacing an object and a delete
from removing a replacement.

Races are driven, not waited for: a botocore event handler on the tier's own client does
the other node's write right before the request under test is built. Nothing sleeps.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from botocore.exceptions import ClientError

from kvtier.clock import ManualClock
from kvtier.keys import ChunkKey
from kvtier.objformat import encode_header
from kvtier.testing.s3server import MotoServer, dummy_credentials
from kvtier.tiers.base import PutStatus, TierError, WriteMode
from kvtier.tiers.s3 import S3Tier
from kvtier.tiers.s3caps import Conditionals, Mode, probe
from kvtier.tiers.s3io import MiB
from tests.tiers.harness import make_key, meta_for, payload_for
from tests.tiers.s3_harness import (
    BUCKET,
    fresh_prefix,
    moto_honours,
    raw_client,
    rgw_endpoint,
    shared_endpoint,
)

pytestmark = pytest.mark.s3
N = 4096
LEASE = 480.0
BIG = 12 * MiB + 123  # three 5 MiB parts

#: What each server honours, as the probe finds it:
#: (put If-None-Match, complete If-None-Match, DeleteObject If-Match, DeleteObjects ETag,
#: CopyObject CopySourceIfMatch).
MOTO = moto_honours()
RGW = (True, False, False, False, False)


@dataclass(frozen=True)
class Server:
    endpoint: str
    mode: Mode  # the tiers' ``conditionals`` setting
    honours: tuple[bool, ...]


@pytest.fixture(
    params=["moto", "moto-untrusted", pytest.param("rgw", marks=pytest.mark.ceph)]
)
def server(request: pytest.FixtureRequest) -> Server:
    """moto as probed, moto with every fallback forced on, and Ceph RGW as probed."""
    if request.param == "rgw":
        return Server(rgw_endpoint(request), "auto", RGW)
    endpoint = shared_endpoint(request.config)
    if request.param == "moto-untrusted":
        return Server(endpoint, "untrusted", (False,) * 5)
    return Server(endpoint, "auto", MOTO)


def _tier(server: Server, prefix: str | None = None, **kw: Any) -> S3Tier:
    args: dict[str, Any] = {
        "bucket": BUCKET,
        "prefix": fresh_prefix() if prefix is None else prefix,
        "endpoint_url": server.endpoint,
        "capacity_bytes": 1 << 30,
        "clock": ManualClock(),
        "touch_interval": 0.0,
        "conditionals": server.mode,
        **kw,
    }
    return S3Tier(**args)


@pytest.fixture
def tiers() -> Iterator[list[S3Tier]]:
    """Tiers a test makes, closed when it ends."""
    made: list[S3Tier] = []
    yield made
    for t in made:
        t.close()


def _honours(c: Conditionals) -> tuple[bool, ...]:
    return (c.put_if_none_match, c.complete_if_none_match, c.delete_if_match,
            c.batch_delete_etag, c.copy_if_match)  # fmt: skip


def _object(key: ChunkKey, n: int) -> bytes:
    """A complete, valid object of ``key`` holding ``payload_for(key, n)``."""
    payload = payload_for(key, n)
    return encode_header(meta_for(key, n), payload.data) + payload.tobytes()


def _read(tier: S3Tier, key: ChunkKey, n: int) -> np.ndarray | None:
    buf = np.full(n, 0xAB, dtype=np.uint8)
    return None if tier.get_into(key, buf.data) is None else buf


def _before(client: Any, op: str, name: str, act: Callable[[], object], *, skip: int = 0) -> None:
    """Run ``act`` once, right before ``client``'s ``skip + 1``-th ``op`` request on object
    ``name`` (or, for DeleteObjects, on a batch that names it) is built (a botocore event:
    the request then sees what ``act`` did)."""
    seen = [0]
    lock = threading.Lock()

    def handler(params: dict[str, Any], **_: Any) -> None:
        batch = params.get("Delete", {}).get("Objects", [])
        if params.get("Key") != name and all(o.get("Key") != name for o in batch):
            return
        with lock:
            seen[0] += 1
            fire = seen[0] == skip + 1
        if fire:
            act()

    client.meta.events.register(f"before-parameter-build.s3.{op}", handler)


# -- the probe -------------------------------------------------------------------------------
def test_the_probe_finds_what_the_server_honours_and_cleans_up(
    server: Server, tiers: list[S3Tier]
) -> None:
    tier = _tier(server)
    tiers.append(tier)
    assert _honours(tier.conditionals) == server.honours
    expected = "probed" if server.mode == "auto" else "untrusted (config)"
    assert tier.conditionals.source == expected
    raw = raw_client(server.endpoint)
    left = raw.list_objects_v2(Bucket=BUCKET, Prefix=f"{tier.prefix}_probe/")
    uploads = raw.list_multipart_uploads(Bucket=BUCKET, Prefix=f"{tier.prefix}_probe/")
    raw.close()
    assert left.get("Contents", []) == [] and uploads.get("Uploads", []) == []


def test_trusted_skips_the_probe_and_a_bad_mode_is_refused(tiers: list[S3Tier],
                                                           request: pytest.FixtureRequest) -> None:
    server = Server(shared_endpoint(request.config), "trusted", (True,) * 5)
    tier = _tier(server)
    tiers.append(tier)
    assert _honours(tier.conditionals) == (True,) * 5
    assert tier.conditionals.source == "trusted (config)"
    with pytest.raises(TierError, match=r"^s3\.conditionals: must be auto, trusted or untrusted"):
        _tier(server, conditionals="sometimes")


def test_a_probe_against_a_frozen_endpoint_answers_not_honoured_quickly() -> None:
    import boto3
    from botocore.config import Config

    server = MotoServer()
    with dummy_credentials():
        url = server.start()
        try:
            raw_client(url).create_bucket(Bucket=BUCKET)
            server.pause()  # accepts connections, never answers
            config = Config(connect_timeout=1, read_timeout=1, retries={"total_max_attempts": 1})
            client = boto3.client("s3", endpoint_url=url, region_name="us-east-1", config=config)
            t0 = time.monotonic()
            caps = probe(client, BUCKET, "p/")
            assert time.monotonic() - t0 < 10  # one fault, one cleanup attempt
            client.close()
        finally:
            server.resume()
            server.stop()
    assert _honours(caps) == (False,) * 5
    assert caps.source == "probe failed: ReadTimeoutError"


# -- creates -----------------------------------------------------------------------------------
def test_a_multipart_create_is_refused_when_another_node_created_the_object_meanwhile(
    server: Server, tiers: list[S3Tier]
) -> None:
    tier = _tier(server, multipart_threshold=5 * MiB, part_size=5 * MiB)
    other = _tier(server, prefix=tier.prefix)
    tiers += [tier, other]
    key = make_key(1)
    name = tier.object_name(key)
    # The other node's create lands while our parts are uploading, after any first HEAD.
    _before(tier.io.client, "UploadPart", name,
            lambda: other.put(meta_for(key, N), payload_for(key, N).data))  # fmt: skip
    assert tier.put(meta_for(key, BIG), payload_for(key, BIG).data) is PutStatus.EXISTS
    np.testing.assert_array_equal(_read(other, key, N), payload_for(key, N))
    raw = raw_client(server.endpoint)
    assert raw.list_multipart_uploads(Bucket=BUCKET, Prefix=tier.prefix).get("Uploads", []) == []
    raw.close()


def test_a_single_put_create_never_replaces_an_object_it_had_not_seen(
    server: Server, tiers: list[S3Tier]
) -> None:
    tier = _tier(server)
    other = _tier(server, prefix=tier.prefix)  # listed before the put: does not know it
    tiers += [tier, other]
    key = make_key(1)
    assert tier.put(meta_for(key, N), payload_for(key, N).data) is PutStatus.STORED
    assert other.put(meta_for(key, 2 * N), payload_for(key, 2 * N).data) is PutStatus.EXISTS
    np.testing.assert_array_equal(_read(other, key, N), payload_for(key, N))


@pytest.mark.ceph
def test_rgw_quirks_on_read_paths(request: pytest.FixtureRequest, tiers: list[S3Tier]) -> None:
    """RGW answers a 416 without ActualObjectSize and completes a multipart upload with an
    empty ETag; neither may break a read."""
    server = Server(rgw_endpoint(request), "auto", RGW)
    tier = _tier(server, multipart_threshold=5 * MiB, part_size=5 * MiB)
    tiers.append(tier)
    raw = raw_client(server.endpoint)
    completed: list[str] = []
    tier.io.client.meta.events.register(
        "after-call.s3.CompleteMultipartUpload",
        lambda parsed, **_: completed.append(parsed.get("ETag", "")),
    )
    big, small, empty = make_key(1), make_key(2), make_key(3)
    assert tier.put(meta_for(big, BIG), payload_for(big, BIG).data) is PutStatus.STORED
    assert completed == [""]  # RGW's quirk: nothing may rely on it
    head = tier.io.head(tier.object_name(big))
    assert head is not None and head.etag.endswith('-3"')
    np.testing.assert_array_equal(_read(tier, big, BIG), payload_for(big, BIG))
    # Ranges past the end (a buffer much larger than the object): 416 without a size.
    assert tier.put(meta_for(small, N), payload_for(small, N).data) is PutStatus.STORED
    with pytest.raises(ClientError) as e:
        raw.get_object(Bucket=BUCKET, Key=tier.object_name(small), Range="bytes=99999999-")
    assert "ActualObjectSize" not in e.value.response["Error"]
    buf = np.zeros(BIG, dtype=np.uint8)
    blind = _tier(server, prefix=tier.prefix, part_size=5 * MiB)
    tiers.append(blind)
    assert blind.get_into(small, buf.data) == meta_for(small, N)
    np.testing.assert_array_equal(buf[:N], payload_for(small, N))
    # An empty object: its range from 0 is a 416 too, a (corrupt) miss, never a crash.
    raw.put_object(Bucket=BUCKET, Key=tier.object_name(empty), Body=b"")
    assert _read(blind, empty, N) is None and blind.metrics.counts.corruptions == 1
    raw.close()


# -- deletes of a version ------------------------------------------------------------------------
def _replace_keeping_stamp(raw: Any, name: str, key: ChunkKey, n: int) -> Callable[[], None]:
    """Another node rewrites ``name`` with a valid object of other bytes (another ETag) but
    the same ``kvtier-used`` stamp, so only the ETag tells the versions apart."""

    def act() -> None:
        stamp = raw.head_object(Bucket=BUCKET, Key=name)["Metadata"]
        raw.put_object(Bucket=BUCKET, Key=name, Body=_object(key, n), Metadata=stamp)

    return act


def test_a_corrupt_object_replaced_right_before_its_delete_is_kept(
    server: Server, tiers: list[S3Tier]
) -> None:
    tier = _tier(server)
    tiers.append(tier)
    raw = raw_client(server.endpoint)
    key = make_key(1)
    name = tier.object_name(key)
    assert tier.put(meta_for(key, N), payload_for(key, N).data) is PutStatus.STORED
    data = bytearray(raw.get_object(Bucket=BUCKET, Key=name)["Body"].read())
    data[-1] ^= 0xFF
    raw.put_object(Bucket=BUCKET, Key=name, Body=bytes(data))
    act = _replace_keeping_stamp(raw, name, key, 2 * N)
    # Right before the request that decides: the conditional DELETE, or the HEAD that
    # stands in for its condition.
    op = "DeleteObject" if server.honours[2] else "HeadObject"
    _before(tier.io.client, op, name, act)
    assert _read(tier, key, N) is None and tier.metrics.counts.corruptions == 1
    np.testing.assert_array_equal(_read(tier, key, 2 * N), payload_for(key, 2 * N))
    raw.close()


def test_an_expired_object_replaced_right_before_its_delete_is_kept(
    server: Server, tiers: list[S3Tier]
) -> None:
    clock = ManualClock(start=time.time() - 30)  # LastModified is the endpoint's real time
    tier = _tier(server, clock=clock)
    tiers.append(tier)
    raw = raw_client(server.endpoint)
    doomed, kept = make_key(1), make_key(2)
    name = tier.object_name(kept)
    for key in (doomed, kept):
        assert tier.put(meta_for(key, N), payload_for(key, N).data) is PutStatus.STORED
    clock.advance(LEASE + 100)
    # HEAD 1 decides (expired); then the conditional batch, the conditional DELETE, or HEAD 2
    # standing in for it.
    op, skip = (("DeleteObjects", 0) if server.honours[3] else
                ("DeleteObject", 0) if server.honours[2] else ("HeadObject", 1))  # fmt: skip
    _before(tier.io.client, op, name, _replace_keeping_stamp(raw, name, kept, 2 * N), skip=skip)
    assert tier.expire(LEASE) == 1
    assert tier.contains_prefix([doomed]) == 0
    np.testing.assert_array_equal(_read(tier, kept, 2 * N), payload_for(kept, 2 * N))
    raw.close()


def test_the_head_fallback_keeps_an_object_renewed_right_before_its_delete(
    server: Server, tiers: list[S3Tier]
) -> None:
    """A restamp keeps the ETag (always on RGW), so only the HEAD fallback, which compares
    the stamp too, sees it; with a conditional DELETE it is the documented lost window."""
    if server.honours[2]:
        pytest.skip("conditional DELETE: a renewal in the window is lost (documented)")
    clock = ManualClock(start=time.time() - 30)
    tier = _tier(server, clock=clock)
    other = _tier(server, prefix=tier.prefix, clock=clock)
    tiers += [tier, other]
    key = make_key(1)
    assert tier.put(meta_for(key, N), payload_for(key, N).data) is PutStatus.STORED
    clock.advance(LEASE + 100)
    name = tier.object_name(key)
    _before(tier.io.client, "HeadObject", name, lambda: other.renew(key), skip=1)
    assert tier.expire(LEASE) == 0
    np.testing.assert_array_equal(_read(tier, key, N), payload_for(key, N))


# -- two nodes at once ---------------------------------------------------------------------------
def test_two_nodes_putting_and_collecting_at_once_leave_only_exact_objects(
    server: Server, tiers: list[S3Tier]
) -> None:
    clock = ManualClock()
    capacity = 12 * (N + 4096)  # about a dozen objects each: both collect all the time
    a = _tier(server, clock=clock, capacity_bytes=capacity)
    b = _tier(server, prefix=a.prefix, clock=clock, capacity_bytes=capacity)
    tiers += [a, b]
    failures: list[BaseException] = []

    def work(tier: S3Tier, first: int) -> None:
        try:
            for i in range(first, first + 40):  # the two key ranges overlap by half
                key = make_key(i)
                mode = WriteMode.OVERWRITE if i % 7 == 0 else WriteMode.CREATE
                assert tier.put(meta_for(key, N), payload_for(key, N).data, mode) in (
                    PutStatus.STORED, PutStatus.EXISTS)  # fmt: skip
                back = make_key(max(i - 3, 0))
                got = _read(tier, back, N)  # a hit restamps (a self-copy)
                if got is not None:
                    np.testing.assert_array_equal(got, payload_for(back, N))
                clock.advance(1)
        except BaseException as e:  # reported by the main thread
            failures.append(e)

    threads = [threading.Thread(target=work, args=(t, f)) for t, f in ((a, 0), (b, 20))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert failures == []
    assert a.metrics.counts.errors == b.metrics.counts.errors == 0
    reader = _tier(server, prefix=a.prefix)  # lists what survived
    tiers.append(reader)
    survivors = [info.key for info in reader.scan()]
    assert survivors
    for key in survivors:
        np.testing.assert_array_equal(_read(reader, key, N), payload_for(key, N))
    assert reader.metrics.counts.corruptions == 0


# -- deletes the credentials may not make --------------------------------------------------
@pytest.mark.ceph
def test_a_delete_the_credentials_may_not_make_is_a_counted_fault_said_once(
    request: pytest.FixtureRequest, tiers: list[S3Tier], caplog: pytest.LogCaptureFixture
) -> None:
    """A bucket policy that denies ``s3:DeleteObject`` (or credentials without it):
    DeleteObjects answers 200 with a per-key ``AccessDenied``. That is a fault, counted
    and logged once with the permission to grant, not a "kept" object (which would let
    collection free nothing in silence while the bucket grows past capacity), and the
    probe does not take it for an honoured ETag condition (only 412 is)."""
    import json

    endpoint = rgw_endpoint(request)
    raw = raw_client(endpoint)
    prefix = fresh_prefix()
    policy = {"Version": "2012-10-17", "Statement": [{
        "Effect": "Deny", "Principal": "*", "Action": "s3:DeleteObject",
        "Resource": f"arn:aws:s3:::{BUCKET}/{prefix}*"}]}
    raw.put_bucket_policy(Bucket=BUCKET, Policy=json.dumps(policy))
    try:
        tier = _tier(Server(endpoint, "auto", RGW), prefix=prefix)
        tiers.append(tier)
        assert not tier.conditionals.batch_delete_etag
        keys = [make_key(i) for i in range(3)]
        for key in keys:
            assert tier.put(meta_for(key, N), payload_for(key, N).data) is PutStatus.STORED
        errors = tier.metrics.counts.errors
        caplog.clear()
        assert tier.delete(keys) == 0
        assert tier.delete(keys[:1]) == 0
        assert tier.metrics.counts.errors == errors + 2
        said = [r.getMessage() for r in caplog.records if "DeleteObjects refused" in r.getMessage()]
        assert len(said) == 1 and "AccessDenied" in said[0] and "s3:DeleteObject" in said[0]
        for key in keys:  # nothing was deleted, and the tier still knows it holds them
            raw.head_object(Bucket=BUCKET, Key=tier.object_name(key))
            assert tier.contains_prefix([key]) == 1
    finally:
        raw.delete_bucket_policy(Bucket=BUCKET)
        raw.close()
