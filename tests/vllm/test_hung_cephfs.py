"""A shared filesystem that really hangs: CephFS with its MDS and OSD frozen (SIGSTOP), as
a hard-mounted NFS behaves when its server is gone (issue 10 on a real server, issue 13).

The scheduler side's hooks must return at once while calls into the mount block, requests
must be recomputed once the lookup deadline passes, and once the filesystem answers again
the chunks another node stored there are restored. Time is a ManualClock; the wall clock
only bounds the hooks ("no wait on storage") and the daemons' recovery.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from concurrent.futures import TimeoutError as FuturesTimeout
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvtier.build import build_store
from kvtier.clock import ManualClock
from kvtier.config import KVTierConfig
from kvtier.keys import Namespace, chunk_keys
from kvtier.testing.ceph import CephCluster
from kvtier.tiers.file import FileTier
from kvtier.vllm.geometry import Geometry
from kvtier.vllm.scheduler_side import SchedulerSide
from tests.conftest import cephfs_dir, other_node
from tests.vllm.hooks import ask, at_once, request_of

pytestmark = pytest.mark.ceph

CT = 128
GEOM = Geometry(2, 2, 64, CT, 4096, "float32")
NS = Namespace(model="m", model_fingerprint="0" * 16, kv_dtype="float32", kv_layout="NHD",
               num_layers=2, num_kv_heads=2, head_size=64, chunk_tokens=CT, block_size=CT)
RECOVERY_S = 60.0  # how long the daemons may take to answer again after SIGCONT


@pytest.fixture
def env(ceph: CephCluster) -> Iterator[tuple[SchedulerSide, Path, ManualClock]]:
    root = cephfs_dir(ceph, f"hung-{uuid.uuid4().hex[:12]}")
    cfg = KVTierConfig.model_validate({
        "chunk_tokens": CT,
        "tiers": [{"host": {"capacity": "1MiB", "pinned": "no"}},
                  {"file": {"path": str(root), "capacity": "1GiB", "write": "through"}}],
        "restore": {"recompute_threshold_tokens": 64, "lookup_timeout_seconds": 1.0},
        "health": {"failures": 3, "slow_seconds": 5.0, "cooldown_seconds": 10.0},
    })
    clock = ManualClock()
    store = build_store(cfg, GEOM.chunk_bytes(CT), clock=clock)
    sched = SchedulerSide(cfg, GEOM, NS, None, store=store, clock=clock)
    # The store's start scan ends before the other node writes: a scan that met some of
    # its chunks would index them, and the test would then restore (and wait on) a
    # chunk instead of asking the lower tier about all three
    try:
        tier = store.lower[0].tier
        assert isinstance(tier, FileTier) and tier.wait_indexed(RECOVERY_S)
        yield sched, root, clock
    finally:
        ceph.resume("mds", "osd")
        sched.close()


def test_hooks_never_wait_on_a_hung_cephfs_and_restore_resumes_after(
    env: Any, ceph: CephCluster
) -> None:
    sched, root, clock = env
    # Another node stored the prompt's chunks, through its own mount.
    r1 = request_of("r1", 1, CT)
    keys = chunk_keys(NS.digest(), r1.all_token_ids, CT)
    node2 = FileTier(other_node(ceph, root), 1 << 30)
    for c in range(3):
        node2.put(sched._meta(NS.digest(), keys, c), np.zeros(sched.slot_bytes, np.uint8).data)

    ceph.pause("mds", "osd")  # calls into the mount that need either block from now on
    assert at_once(sched.get_num_new_matched_tokens, r1, 0) == (None, False)  # probing
    probe = sched._probes["r1"].future
    clock.advance(0.5)
    assert at_once(sched.get_num_new_matched_tokens, r1, 0) == (None, False)
    with pytest.raises(FuturesTimeout):  # the probe really is stuck in the frozen mount
        probe.result(timeout=1.0)
    clock.advance(0.6)  # past restore.lookup_timeout_seconds: recompute
    assert at_once(sched.get_num_new_matched_tokens, r1, 0) == (0, False)
    for i in range(2, 5):  # new prompts meanwhile: answered at once, then recomputed
        r = request_of(f"r{i}", i, CT)
        first, _ = at_once(sched.get_num_new_matched_tokens, r, 0)
        clock.advance(1.1)
        assert first in (None, 0)
        assert at_once(sched.get_num_new_matched_tokens, r, 0) == (0, False)
        sched.request_finished(r, [])

    ceph.resume("mds", "osd")
    probe.result(RECOVERY_S)  # the stuck call returns once the filesystem answers
    clock.advance(11)  # past any cooldown the hang caused
    r1b = request_of("r1b", 1, CT)
    deadline = time.monotonic() + RECOVERY_S
    while (got := ask(sched, r1b)) != 3 * CT:  # the first trial may still meet the backlog
        assert time.monotonic() < deadline, f"never restored again after the hang ({got})"
        sched.request_finished(r1b, [])
        clock.advance(11)
    held = sched._lookups["r1b"].held
    assert held is not None and held.from_tier == [1, 1, 1], "read from CephFS again"
