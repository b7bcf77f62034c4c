"""Start is never held by storage (issue 32): a lower tier whose opening does not answer
(a hard NFS mount whose server is gone) starts down, the store serves from the host pool
meanwhile, and the tier joins once it answers. The opening blocks on a gate, as a
``mkdir`` on a dead mount does; the breakers' time is a ManualClock.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from kvtier.build import build_lower, build_store
from kvtier.clock import Clock, ManualClock
from kvtier.config import FileConfig, KVTierConfig, S3Config
from kvtier.tiers.base import SharedTier, TierError
from kvtier.tiers.late import LateTier
from tests.tiers.harness import PAYLOAD, make_key, meta_for, payload_for


def _cfg(tmp: Path) -> KVTierConfig:
    return KVTierConfig.model_validate({
        "tiers": [{"host": {"capacity": 16 * PAYLOAD, "pinned": "no"}},
                  {"file": {"path": str(tmp / "t"), "capacity": "1GiB", "write": "back"}}],
    })


def test_a_tier_that_does_not_open_starts_down_and_joins_when_it_answers(
    tmp_path: Path,
) -> None:
    clock = ManualClock()
    gate = threading.Event()

    def hung_open(spec: FileConfig | S3Config, i: int, c: Clock) -> SharedTier:
        gate.wait(30)  # the mount answers only when the test says so
        return build_lower(spec, i, c)

    t0 = time.monotonic()
    store = build_store(_cfg(tmp_path), PAYLOAD, clock=clock, open_tier=hung_open,
                        open_bound_s=0.5)
    try:
        assert time.monotonic() - t0 < 5, "start waited on the hung tier"
        tier = store.lower[0].tier
        assert isinstance(tier, LateTier) and not tier.ready
        assert not store.breakers[0].up
        k = make_key(1)
        assert store.put(meta_for(k), payload_for(k))  # the host pool serves meanwhile
        assert store.lookup_indexed([k]).tiers == (0,)
        clock.advance(11)  # a trial while it still hangs fails: it stays down
        assert store.write_back_some(1) == 1
        assert store.flush(10)
        assert not store.breakers[0].up and k in store.host.index.dirty_keys()
        gate.set()
        end = time.monotonic() + 10
        while not tier.ready and time.monotonic() < end:
            threading.Event().wait(0.01)
        assert tier.ready
        clock.advance(11)  # the next trial succeeds: the tier joins
        assert store.write_back_some(1) == 1
        assert store.flush(10)
        assert store.breakers[0].up and tier.indexed(k)
        assert not store.host.index.dirty_keys()
    finally:
        gate.set()
        store.close(timeout=5)


def test_a_tier_that_fails_to_open_at_once_still_fails_the_start(tmp_path: Path) -> None:
    cfg = KVTierConfig.model_validate({
        "tiers": [{"host": {"capacity": 16 * PAYLOAD, "pinned": "no"}},
                  {"file": {"path": str(tmp_path / "no" / "such"), "capacity": "1GiB"}}],
    })
    with pytest.raises(TierError, match=r"tiers\[1\]\.file\.path"):
        build_store(cfg, PAYLOAD)
