"""A hung lower tier never stalls vLLM's scheduler thread (issue 10).

Every storage call of the lower tier blocks on an event, as a hard-mounted NFS server or
an S3 endpoint in a brownout does. Each connector hook must still return at once, a
request must be served (recomputed) once its lookup deadline passes, the breaker must
open, and the tier must be used again once it answers. Time is a ManualClock; the
wall-clock bounds below only check that no hook waited on the tier.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from kvtier.build import build_store
from kvtier.clock import ManualClock
from kvtier.config import KVTierConfig
from kvtier.keys import ChunkKey, Namespace, chunk_keys
from kvtier.objformat import ChunkMeta, ChunkSpec
from kvtier.tiers.base import PutStatus, WriteMode
from kvtier.tiers.file import FileTier
from kvtier.vllm.geometry import Geometry
from kvtier.vllm.protocol import KVTierWorkerMetadata
from kvtier.vllm.scheduler_side import SchedulerSide
from tests.vllm.hooks import ask, at_once, request_of

CT = 128
GEOM = Geometry(2, 2, 64, CT, 4096, "float32")
NS = Namespace(model="m", model_fingerprint="0" * 16, kv_dtype="float32", kv_layout="NHD",
               num_layers=2, num_kv_heads=2, head_size=64, chunk_tokens=CT, block_size=CT)


class HungTier(FileTier):
    """A file tier whose every storage call waits for ``gate`` (then behaves normally)."""

    def __init__(self, root: Path, gate: threading.Event, clock: ManualClock) -> None:
        super().__init__(root, 1 << 30, name="file1", clock=clock)
        self.gate = gate
        self.blocked = 0
        self.entered = threading.Event()

    def _wait(self) -> None:
        self.blocked += 1
        self.entered.set()
        self.gate.wait(30)

    def contains_prefix(self, keys: Any) -> int:
        self._wait()
        return super().contains_prefix(keys)

    def get_into(self, key: ChunkKey, dst: memoryview, *,
                 expect: ChunkSpec | None = None) -> ChunkMeta | None:
        self._wait()
        return super().get_into(key, dst, expect=expect)

    def put(self, meta: ChunkMeta, payload: Any, mode: WriteMode = WriteMode.CREATE) -> PutStatus:
        self._wait()
        return super().put(meta, payload, mode)


@pytest.fixture
def env(tmp_path: Path) -> Iterator[tuple[SchedulerSide, HungTier, ManualClock, threading.Event]]:
    cfg = KVTierConfig.model_validate({
        "chunk_tokens": CT,
        "tiers": [{"host": {"capacity": "1MiB", "pinned": "no"}},
                  {"file": {"path": str(tmp_path), "capacity": "1GiB", "write": "through"}}],
        "restore": {"recompute_threshold_tokens": 64, "lookup_timeout_seconds": 1.0},
        "health": {"failures": 3, "slow_seconds": 5.0, "cooldown_seconds": 10.0},
    })
    clock = ManualClock()
    gate = threading.Event()
    store = build_store(cfg, GEOM.chunk_bytes(CT), clock=clock)
    hung = HungTier(tmp_path, gate, clock)
    store.lower[0] = type(store.lower[0])(hung, store.lower[0].write)
    store._through = [hung]
    store._breaker_of = {id(hung): store.breakers[0]}
    sched = SchedulerSide(cfg, GEOM, NS, None, store=store, clock=clock)
    yield sched, hung, clock, gate
    gate.set()
    sched.close()


def test_every_hook_returns_at_once_and_serving_goes_on_while_a_tier_hangs(env: Any) -> None:
    sched, hung, clock, gate = env
    breaker = sched.store.breakers[0]
    # Another node stored this prompt's chunks; only the (hung) tier can say so.
    other = FileTier(hung.root, 1 << 30)
    r1 = request_of("r1", 1, CT)
    keys = chunk_keys(NS.digest(), r1.all_token_ids, CT)
    for c in range(3):
        other.put(sched._meta(NS.digest(), keys, c), np.zeros(sched.slot_bytes, np.uint8).data)

    assert at_once(sched.get_num_new_matched_tokens, r1, 0) == (None, False)  # probing
    assert hung.entered.wait(10), "the probe runs on an IO thread, and hangs there"
    first_probe = sched._probes["r1"].future
    clock.advance(0.5)
    assert at_once(sched.get_num_new_matched_tokens, r1, 0) == (None, False)
    clock.advance(0.6)  # past restore.lookup_timeout_seconds: recompute
    assert at_once(sched.get_num_new_matched_tokens, r1, 0) == (0, False)

    # The request runs; finishing it queues a write-through that hangs too.
    blocks = SimpleNamespace(get_block_ids=lambda: ([0, 1, 2],))
    at_once(sched.update_state_after_alloc, r1, blocks, 0)
    at_once(sched.build_meta)
    r1.num_computed_tokens = r1.num_tokens
    delay, _ = at_once(sched.request_finished, r1, [0, 1, 2])
    assert delay
    at_once(sched.build_meta)
    at_once(sched.on_worker_output, {"r1"}, KVTierWorkerMetadata())

    # A new prompt while the tier still hangs: its reads are at their bound, so the
    # indexes answer at once: no probe, no wait.
    r2 = request_of("r2", 2, CT)
    assert at_once(sched.get_num_new_matched_tokens, r2, 0) == (0, False)

    clock.advance(5)  # the hung calls are past health.slow_seconds: the tier is down
    assert not sched.store.can_probe() and not breaker.up
    r3 = request_of("r3", 3, CT)
    assert at_once(sched.get_num_new_matched_tokens, r3, 0) == (0, False)

    # r1's chunks are in the host tier: a returning r1 is served from there meanwhile.
    r1b = request_of("r1b", 1, CT)
    assert ask(sched, r1b) == 3 * CT
    sched.request_finished(r1b, [])  # aborted before allocation: its holds are released

    gate.set()  # the tier answers again
    sched.store.flush(10)
    first_probe.result(10)  # the calls that hung have all returned
    clock.advance(10)  # past the cooldown: the next probe is the trial call
    r4 = request_of("r4", 1, CT)
    r4.request_id = "r4"
    assert sched.store.host.delete(keys) == 3  # only the tier has r1's prompt now
    assert ask(sched, r4) == 3 * CT
    assert breaker.up, "the trial call succeeded"
    held = sched._lookups["r4"].held
    assert held is not None and held.from_tier == [1, 1, 1], "read from the tier again"
    assert hung.contains_prefix(keys) == 3
