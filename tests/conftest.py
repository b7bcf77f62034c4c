"""Session-wide fixtures: the throwaway Ceph cluster (RGW and two CephFS mounts), the
tiny test models (built once per session in one directory, which the benchmark smokes
also take as their ``--cache-dir``), and one vLLM cache every engine of the session shares.

The cluster starts on first use, once per test session, and is torn down at its end.
Where Ceph is not installed the tests that need it skip with the command to run, unless
``KVTIER_REQUIRE_CEPH=1`` (set by ``make test``), where that is a failure: CI runs the
real servers.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

import kvtier.metrics as m
from kvtier.testing.ceph import REQUIRE_ENV, CephCluster, ceph_cluster, unavailable_reason
from kvtier.testing.engines import SHARED_CACHE_ENV, START_LOG_ENV
from kvtier.testing.models import build_tiny_llama
from kvtier.testing.s3server import dummy_credentials

#: The bucket every RGW test shares (each tier gets a prefix of its own).
RGW_BUCKET = "kvtier-tests"
#: The CephFS mounts: two clients of one filesystem, standing in for two nodes.
NODES = ("node1", "node2")


_SESSION_DIR: Path | None = None


def pytest_configure(config: pytest.Config) -> None:
    """One vLLM cache for every engine of the session, benchmark subprocesses included
    (they inherit the environment): vLLM inspects a model class once, not once per engine
    start (``kvtier.testing.engines.SHARED_CACHE_ENV``); and a log of engine starts, which
    the summary counts. Either variable set by the caller is kept. Under pytest-xdist
    the controller sets them before it starts the workers, which inherit them."""
    global _SESSION_DIR
    if hasattr(config, "workerinput"):  # an xdist worker: the controller set both
        return
    _SESSION_DIR = Path(tempfile.mkdtemp(prefix="kvtier-session-"))
    os.environ.setdefault(SHARED_CACHE_ENV, str(_SESSION_DIR / "vllm-cache"))
    os.environ.setdefault(START_LOG_ENV, str(_SESSION_DIR / "engine-starts.log"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Modules that start vLLM first, each module's tests together, otherwise in the
    order collected. ``make test`` runs the suite on two workers, one module at a time
    each (``-n 2 --dist loadfile --no-loadscope-reorder``): the long modules start first
    and the many short ones fill the end, so neither worker idles while the other still
    has an engine module to run."""
    heavy = {item.path for item in items if item.get_closest_marker("vllm") is not None}
    items.sort(key=lambda item: item.path not in heavy)  # stable: collection order kept


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """``vLLM starts: N (...), S s to ready in all``: what keeps the suite's wall time in
    check (S counts the starts that got ready; overlapping starts each count in full)."""
    try:
        lines = Path(os.environ[START_LOG_ENV]).read_text().splitlines()
    except (KeyError, OSError):
        return
    seconds = sum(float(line.split()[1]) for line in lines if line.split()[0] != "failed")
    kinds: dict[str, int] = {}
    for line in lines:
        kinds[line.split()[0]] = kinds.get(line.split()[0], 0) + 1
    detail = ", ".join(f"{n} {k}" for k, n in sorted(kinds.items()))
    terminalreporter.write_line(
        f"vLLM starts: {len(lines)} ({detail}), {seconds:.0f} s to ready in all")


def pytest_unconfigure(config: pytest.Config) -> None:
    if _SESSION_DIR is not None:
        shutil.rmtree(_SESSION_DIR, ignore_errors=True)


#: Environment variable: a directory the test models are built in and kept between runs
#: (``make test`` sets it; a build is reused only if its spec hash matches).
MODELS_ENV = "KVTIER_TEST_MODELS"


@pytest.fixture(scope="session")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The session's model directory (``MODELS_ENV``, else a temporary one): every test
    model is built there once; ``tiny-fp32`` and ``tiny-bf16`` under the names
    ``kvtier.testing.models.preset_model`` uses, so a benchmark smoke given it as
    ``--cache-dir`` reuses them."""
    kept = os.environ.get(MODELS_ENV)
    if kept:
        Path(kept).mkdir(parents=True, exist_ok=True)
        return Path(kept)
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def tiny_fp32(models_dir: Path) -> Path:
    return build_tiny_llama(models_dir / "tiny-fp32", dtype="float32")


@pytest.fixture(scope="session")
def tiny_bf16(models_dir: Path) -> Path:
    return build_tiny_llama(models_dir / "tiny-bf16", dtype="bfloat16")


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


@pytest.fixture
def tiny_fs(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs: a real filesystem that fills up (needs root, as Ceph does)."""
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({r.stderr.strip()}); see the EFBIG test")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)
