"""probe_tier on every tier kind: it measures, verifies, and never leaves objects behind."""

from __future__ import annotations

from collections.abc import Iterable

import pytest

from kvtier.keys import ChunkKey
from kvtier.objformat import ChunkMeta, ChunkSpec
from kvtier.probe import PROBE_NAMESPACE, ProbeFailed, probe_tier
from kvtier.tiers.base import PutStatus, Tier, WriteMode
from kvtier.tiers.host import HostTier
from tests.tiers.harness import PAYLOAD, TierHarness


def _empty(tier: Tier) -> bool:
    return tier.usage().objects == 0 and not list(tier.scan())


def test_probe_measures_and_cleans_up(harness: TierHarness) -> None:
    tier = harness.make(8 * harness.object_bytes())
    r = probe_tier(tier, PAYLOAD, 3)
    assert r.tier == tier.name
    assert r.latency_s >= 0 and r.bandwidth_Bps > 0 and r.put_Bps > 0 and r.get_Bps > 0
    assert _empty(tier)
    tier.close()


class _Timed:
    """A host tier whose reads take ``latency + n / bandwidth`` on a fake timer, and
    which can be told to fail a write or a read."""

    def __init__(self, latency: float, bandwidth: float, fail: str = "") -> None:
        self.inner = HostTier(16 * PAYLOAD, PAYLOAD)
        self.now, self.latency, self.bandwidth, self.fail = 0.0, latency, bandwidth, fail
        self.written: list[ChunkKey] = []

    @property
    def name(self) -> str:
        return "timed"

    def timer(self) -> float:
        return self.now

    def put(self, meta: ChunkMeta, payload: memoryview, mode: WriteMode = WriteMode.CREATE
            ) -> PutStatus:
        assert mode is WriteMode.CREATE and meta.namespace == PROBE_NAMESPACE
        self.written.append(meta.key)
        status = self.inner.put(meta, payload, mode)
        if self.fail == "put" and len(self.written) == 3:
            return PutStatus.FAILED  # stored anyway, as a timed-out S3 PUT may be
        return status

    def get_into(self, key: ChunkKey, dst: memoryview, *, expect: ChunkSpec | None = None
                 ) -> ChunkMeta | None:
        meta = self.inner.get_into(key, dst, expect=expect)
        assert meta is not None
        self.now += self.latency + meta.payload_len / self.bandwidth
        if self.fail == "read":
            dst[0] ^= 0xFF
        return meta

    def delete(self, keys: Iterable[ChunkKey]) -> int:
        keys = list(keys)
        if self.fail == "delete" and keys == self.written[:1]:
            raise OSError("first delete fails")
        return self.inner.delete(keys)


def test_probe_separates_latency_from_bandwidth() -> None:
    t = _Timed(latency=2e-3, bandwidth=1e9)
    r = probe_tier(t, PAYLOAD, 4, timer=t.timer)  # type: ignore[arg-type]
    assert r.latency_s == pytest.approx(2e-3, rel=1e-6)
    assert r.bandwidth_Bps == pytest.approx(1e9, rel=1e-6)
    assert r.read_seconds(PAYLOAD) == pytest.approx(2e-3 + PAYLOAD / 1e9)
    assert len(t.inner.index) == 0


@pytest.mark.parametrize("fail", ["put", "read", "delete"])
def test_probe_never_leaves_objects_behind(fail: str) -> None:
    t = _Timed(1e-3, 1e9, fail)
    with pytest.raises((ProbeFailed, OSError)):
        probe_tier(t, PAYLOAD, 3, timer=t.timer)  # type: ignore[arg-type]
    left = [k for k in t.written if t.inner.index.contains(k)]
    assert left == (t.written[:1] if fail == "delete" else [])  # only the one that raised


def test_probe_checks_its_arguments() -> None:
    with pytest.raises(ValueError):
        probe_tier(HostTier(PAYLOAD, PAYLOAD), 0, 1)
