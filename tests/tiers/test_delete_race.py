"""Deletes race renewals: collection and expiry stat a batch of victims, then delete them.
On the file tier a delete is conditional on what the stat saw (rename to a graveyard name,
re-stat, then unlink or put back), so a renewal landing between the stat and the delete
survives (issue 32 review item 7). Time is a ``ManualClock``; nothing sleeps."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import pytest

from kvtier.clock import ManualClock
from kvtier.keys import ChunkKey
from kvtier.tiers.file import FileTier
from kvtier.tiers.transport import Outcome, Stat
from tests.tiers.harness import make_key, meta_for, payload_for

LEASE = 480.0


def _tier(root: Path, clock: ManualClock) -> FileTier:
    return FileTier(root, 1 << 30, clock=clock, touch_interval=0.0)


def _put(tier: FileTier, key: ChunkKey) -> None:
    assert tier.put(meta_for(key), payload_for(key).data).value == "stored"


def _leftovers(root: Path) -> list[str]:
    return sorted(p.name for p in (root / "kv").rglob("*") if p.is_file()
                  and not p.name.endswith(".kv"))


def test_a_renewal_between_the_stat_and_the_delete_keeps_the_object(tmp_path: Path) -> None:
    clock = ManualClock()
    tier, other = _tier(tmp_path, clock), _tier(tmp_path, clock)
    key = make_key(1)
    _put(tier, key)
    clock.advance(1000)
    seen = tier.files.head(key)
    assert seen is not None
    assert other.renew(key)  # another node renews it after the stat
    outcomes, fault = tier.files.delete([(key, seen)])
    assert fault is None and outcomes == {key: Outcome.KEPT}
    assert tier.path_of(key).stat().st_mtime == pytest.approx(clock.wall())
    assert _leftovers(tmp_path) == []
    # Unchanged since its stat: deleted, and nothing is left behind.
    seen = tier.files.head(key)
    assert seen is not None
    assert tier.files.delete([(key, seen)]) == ({key: Outcome.DELETED}, None)
    assert not tier.path_of(key).exists() and _leftovers(tmp_path) == []


def test_expiry_keeps_an_object_renewed_while_its_batch_was_stated(tmp_path: Path) -> None:
    clock = ManualClock()
    tier, other = _tier(tmp_path, clock), _tier(tmp_path, clock)
    live, dead = make_key(1), make_key(2)
    _put(tier, live)
    _put(tier, dead)
    clock.advance(LEASE + 10)
    real = tier.files.heads

    def heads_then_renew(keys: Sequence[ChunkKey]) -> list[Stat | None]:
        got = real(keys)
        other.renew(live)  # lands after the batch's stats, before its deletes
        return got

    tier.files.heads = heads_then_renew  # type: ignore[method-assign]
    assert tier.expire(LEASE, whole_pass=True) == 1
    assert tier.path_of(live).exists() and not tier.path_of(dead).exists()
    assert _leftovers(tmp_path) == []


def test_an_object_replaced_while_in_the_graveyard_is_not_overwritten(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The put-back never replaces an object published under the name meanwhile."""
    clock = ManualClock()
    tier = _tier(tmp_path, clock)
    key = make_key(3)
    _put(tier, key)
    path = tier.path_of(key)
    seen = tier.files.head(key)
    assert seen is not None
    os.utime(path, (5.0, 5.0))  # renewed (changed) since the stat
    real_rename = os.rename

    def rename_then_publish(src: str, dst: str, **kw: int) -> None:
        real_rename(src, dst, **kw)
        if str(src) == path.name:  # another writer publishes the key right after
            path.write_bytes(b"new")

    monkeypatch.setattr(os, "rename", rename_then_publish)
    outcomes, _ = tier.files.delete([(key, seen)])
    monkeypatch.undo()
    assert outcomes == {key: Outcome.KEPT}
    assert path.read_bytes() == b"new" and _leftovers(tmp_path) == []
