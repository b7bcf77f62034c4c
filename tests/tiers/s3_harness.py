"""The S3 entries of the contract suite: one moto server per test session (``s3``) or the
session's Ceph RGW (``rgw``), a fresh prefix (so a fresh, empty tier) for every ``make``,
and a corruptor that rewrites raw objects."""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator
from typing import Any

import boto3
import pytest

from kvtier.clock import ManualClock
from kvtier.keys import ChunkKey
from kvtier.testing.s3server import MotoServer, dummy_credentials
from kvtier.tiers.base import Tier
from kvtier.tiers.s3 import S3Tier
from tests.tiers.harness import TierHarness

BUCKET = "kvtier-tests"


def moto_honours() -> tuple[bool, ...]:
    """What the installed moto honours, as kvtier's probe finds it: (put If-None-Match,
    complete If-None-Match, DeleteObject If-Match, DeleteObjects ETag, CopyObject
    CopySourceIfMatch). moto 5.2.6 began checking DeleteObjects' per-object ETag; the
    project pins moto (constraints/dev.txt), and this follows the pin when it moves."""
    from importlib.metadata import version

    release = tuple(int(p) for p in version("moto").split(".")[:3] if p.isdigit())
    return (True, True, True, release >= (5, 2, 6), False)
_shared: dict[str, str] = {}
_prefixes = itertools.count()


def shared_endpoint(config: pytest.Config) -> str:
    """The session's moto server (started on first use, stopped at session end), with
    dummy credentials in the environment and ``BUCKET`` created."""
    if "url" not in _shared:
        stack = contextlib.ExitStack()
        config.add_cleanup(stack.close)
        stack.enter_context(dummy_credentials())
        server = MotoServer()
        stack.callback(server.stop)
        url = server.start()
        raw_client(url).create_bucket(Bucket=BUCKET)
        stack.callback(_shared.clear)
        _shared["url"] = url
    return _shared["url"]


def raw_client(endpoint: str) -> Any:
    """A plain boto3 client, to look at or damage objects behind a tier's back."""
    return boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")


def fresh_prefix() -> str:
    return f"t{next(_prefixes)}/"


def rgw_endpoint(request: pytest.FixtureRequest) -> str:
    """The session's RGW endpoint (``tests/conftest.py``'s ``ceph``), ``BUCKET`` created."""
    cluster = request.getfixturevalue("ceph")
    return str(cluster.s3_endpoint)


def s3_harness(
    request: pytest.FixtureRequest, clock: ManualClock, *, server: str = "moto"
) -> Iterator[TierHarness]:
    """A harness on moto (``server="moto"``) or on the session's RGW (``"rgw"``)."""
    endpoint = rgw_endpoint(request) if server == "rgw" else shared_endpoint(request.config)
    raw = raw_client(endpoint)
    made: list[S3Tier] = []

    def make(capacity: int) -> Tier:
        tier = S3Tier(
            bucket=BUCKET,
            prefix=fresh_prefix(),
            endpoint_url=endpoint,
            capacity_bytes=capacity,
            max_attempts=2,
            touch_interval=0.0,
            clock=clock,
        )
        made.append(tier)
        return tier

    def corrupt(tier: Tier, key: ChunkKey, how: str) -> None:
        assert isinstance(tier, S3Tier)
        name = tier.object_name(key)
        data = raw.get_object(Bucket=BUCKET, Key=name)["Body"].read()
        if how == "flip":
            data = data[:-1] + bytes([data[-1] ^ 0xFF])
        elif how == "truncate":
            data = data[: len(data) // 2]
        elif how == "empty":
            data = b""
        elif how == "foreign":
            listed = raw.list_objects_v2(Bucket=BUCKET, Prefix=f"{tier.prefix}kv/")["Contents"]
            other = next(o["Key"] for o in listed if o["Key"] != name)
            data = raw.get_object(Bucket=BUCKET, Key=other)["Body"].read()
        raw.put_object(Bucket=BUCKET, Key=name, Body=data)

    yield TierHarness("s3" if server == "moto" else server, make, clock, corrupt)
    for tier in made:
        tier.close()
    raw.close()
