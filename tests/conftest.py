"""Session-wide fixtures: the throwaway Ceph cluster (RGW and two CephFS mounts).

The cluster starts on first use, once per test session, and is torn down at its end.
Where Ceph is not installed the tests that need it skip with the command to run, unless
``KVTIER_REQUIRE_CEPH=1`` (set by ``make test``), where that is a failure: CI runs the
real servers.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

import kvtier.metrics as m
from kvtier.testing.ceph import REQUIRE_ENV, CephCluster, ceph_cluster, unavailable_reason
from kvtier.testing.s3server import dummy_credentials

#: The bucket every RGW test shares (each tier gets a prefix of its own).
RGW_BUCKET = "kvtier-tests"
#: The CephFS mounts: two clients of one filesystem, standing in for two nodes.
NODES = ("node1", "node2")


@pytest.fixture(scope="session")
def ceph(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CephCluster]:
    """The session's Ceph cluster: RGW with ``RGW_BUCKET`` created, CephFS on ``NODES``."""
    reason = unavailable_reason()
    if reason is not None:
        if os.environ.get(REQUIRE_ENV) == "1":
            pytest.fail(f"{REQUIRE_ENV}=1 but {reason}")
        pytest.skip(reason)
    import boto3

    with dummy_credentials(), ceph_cluster(tmp_path_factory.mktemp("ceph")) as cluster:
        for node in NODES:
            cluster.mount(node)
        client = boto3.client("s3", endpoint_url=cluster.s3_endpoint, region_name="us-east-1")
        client.create_bucket(Bucket=RGW_BUCKET)
        client.close()
        yield cluster


def cephfs_dir(cluster: CephCluster, name: str, node: int = 0) -> Path:
    """``name`` under CephFS as node ``node`` sees it (created; the same directory on
    every node)."""
    path = cluster.mounts[node] / name
    path.mkdir(parents=True, exist_ok=True)
    return path


def other_node(cluster: CephCluster, path: Path) -> Path:
    """The same CephFS path as the other node's mount sees it."""
    first, second = cluster.mounts[0], cluster.mounts[1]
    if path.is_relative_to(first):
        return second / path.relative_to(first)
    return first / path.relative_to(second)


@pytest.fixture
def export() -> Iterator[m.StatsBatch]:
    """kvtier's metric export on for one test, and off again after it (the module
    default)."""
    batch = m.enable_export()
    batch.drain()
    try:
        yield batch
    finally:
        m.disable_export()
