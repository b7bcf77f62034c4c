"""Fixtures that build each tier kind for the shared contract suite."""

from __future__ import annotations

import dataclasses
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtier.clock import ManualClock
from kvtier.keys import ChunkKey
from kvtier.tiers.base import Tier
from kvtier.tiers.file import FileTier
from kvtier.tiers.host import HostTier
from tests.tiers.harness import PAYLOAD, TierHarness


def _corrupt_file(tier: Tier, key: ChunkKey, how: str) -> None:
    assert isinstance(tier, FileTier)
    path = tier.path_of(key)
    data = bytearray(path.read_bytes())
    if how == "flip":
        data[-1] ^= 0xFF
    elif how == "truncate":
        data = data[: len(data) // 2]
    elif how == "empty":
        data = bytearray()
    elif how == "foreign":
        others = [p for p in path.parent.parent.parent.rglob("*.kv") if p != path]
        data = bytearray(others[0].read_bytes())
    path.write_bytes(bytes(data))


def _host(clock: ManualClock) -> TierHarness:
    def make(capacity: int) -> Tier:
        # Host capacity is slots: one slot per object of PAYLOAD bytes.
        slots = max(1, capacity // TierHarness.object_bytes())
        return HostTier(slots * PAYLOAD, PAYLOAD)

    return TierHarness("host", make, clock, None)


def _file(clock: ManualClock, root: Path) -> TierHarness:
    made: list[int] = [0]

    def make(capacity: int) -> Tier:
        made[0] += 1
        return FileTier(root / f"t{made[0]}", capacity, clock=clock, touch_interval=0.0)

    return TierHarness("file", make, clock, _corrupt_file)


#: Every tier kind and server the contract suite runs on: the host pool, a local
#: directory, CephFS (a real shared filesystem), moto (a fast S3 stand-in that can be
#: paused) and Ceph RGW (a real S3 server). The last two kinds need the session's Ceph.
KINDS = [
    "host",
    "file",
    pytest.param("cephfs", marks=pytest.mark.ceph),
    pytest.param("s3", marks=pytest.mark.s3),
    pytest.param("rgw", marks=[pytest.mark.s3, pytest.mark.ceph]),
]
#: The shared kinds (what leases, expiry and two-node tests run on).
SHARED_KINDS = KINDS[1:]


def make_harness(
    request: pytest.FixtureRequest, clock: ManualClock, tmp_path: Path
) -> Iterator[TierHarness]:
    """The harness for ``request.param``; removes what it stored when the test ends."""
    kind = request.param
    if kind == "host":
        yield _host(clock)
    elif kind == "file":
        yield _file(clock, tmp_path)
        shutil.rmtree(tmp_path, ignore_errors=True)
    elif kind == "cephfs":
        from tests.conftest import cephfs_dir, other_node

        cluster = request.getfixturevalue("ceph")
        root = cephfs_dir(cluster, f"contract-{uuid.uuid4().hex[:12]}")
        yield dataclasses.replace(
            _file(clock, root), kind="cephfs", other_node=lambda p: other_node(cluster, p)
        )
        shutil.rmtree(root, ignore_errors=True)
    else:
        from tests.tiers.s3_harness import s3_harness

        yield from s3_harness(request, clock, server="rgw" if kind == "rgw" else "moto")


@pytest.fixture(params=KINDS)
def harness(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[TierHarness]:
    yield from make_harness(request, ManualClock(), tmp_path)
