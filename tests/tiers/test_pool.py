"""HostPool: private or shared memory cut into slots, checked at start; HostTier over it."""

from __future__ import annotations

import mmap
from pathlib import Path

import numpy as np
import pytest
import torch

from kvtier.hostmem import PINNED_UNAVAILABLE, anonymous
from kvtier.tiers.base import TierError
from kvtier.tiers.host import HostTier
from kvtier.tiers.pool import HostPool
from kvtier.vllm.shm import attach_host_pool
from tests.tiers.harness import make_key, meta_for, payload_for

SLOT = 2 * mmap.PAGESIZE


def test_slots_for_names_the_setting_when_nothing_fits() -> None:
    assert HostPool.slots_for(5 * SLOT + 1, SLOT) == 5
    with pytest.raises(TierError, match=r"tiers\[0\]\.host\.capacity: .*holds no chunk"):
        HostPool.slots_for(SLOT - 1, SLOT)


def test_views_are_disjoint_slots_of_the_buffer() -> None:
    pool = HostPool(anonymous(3 * SLOT), SLOT, 3, pinned=False)
    for i in range(3):
        pool.view(i)[:] = i + 1
    assert [int(pool.array[i * SLOT]) for i in range(3)] == [1, 2, 3]
    assert pool.view(1, 10).nbytes == 10
    with pytest.raises(IndexError):
        pool.view(3)
    with pytest.raises(ValueError, match="do not fit"):
        pool.view(0, SLOT + 1)


def test_allocate_is_private_and_pageable_with_the_mmap_allocator() -> None:
    from kvtier.hostmem import mmap_allocator

    pool = HostPool.allocate(4 * SLOT, SLOT, allocator=mmap_allocator)
    assert (pool.num_slots, pool.nbytes, pool.pinned) == (4, 4 * SLOT, False)


def test_a_shared_pool_is_seen_by_its_attacher_and_the_name_is_unlinked(
    tmp_path: Path,
) -> None:
    path = tmp_path / "pool"
    worker = HostPool.create_shm(path, SLOT, 4, pinned="no")
    assert path.stat().st_size == 4 * SLOT and not worker.pinned
    scheduler = HostPool.attach_shm(path, SLOT, 4)
    assert not path.exists(), "the attacher unlinks the name once mapped"
    scheduler.view(2)[:] = 7
    assert np.all(worker.view(2) == 7) and np.all(worker.view(1) == 0)
    worker.view(3)[:5] = 9
    assert list(scheduler.view(3, 6)) == [9, 9, 9, 9, 9, 0]


def test_attach_refuses_another_geometry_and_says_so(tmp_path: Path) -> None:
    path = tmp_path / "pool"
    HostPool.create_shm(path, SLOT, 4, pinned="no")
    with pytest.raises(TierError, match=f"is {4 * SLOT} bytes, this process expects {3 * SLOT}"):
        HostPool.attach_shm(path, SLOT, 3)
    assert path.exists(), "a refused attach leaves the name to the right process"


def test_attach_to_a_missing_pool(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        HostPool.attach_shm(tmp_path / "none", SLOT, 1)
    with pytest.raises(TierError, match="worker side of the connector did not start"):
        attach_host_pool(tmp_path / "none", SLOT, 1)


@pytest.mark.skipif(torch.cuda.is_available(), reason="page-locking works here")
def test_create_shm_pinned_yes_fails_at_start_and_leaves_no_file(tmp_path: Path) -> None:
    path = tmp_path / "pool"
    with pytest.raises(TierError) as err:
        HostPool.create_shm(path, SLOT, 2, pinned="yes")
    assert str(err.value) == PINNED_UNAVAILABLE
    assert not path.exists()
    assert not HostPool.create_shm(path, SLOT, 2, pinned="auto").pinned


def test_create_shm_that_does_not_fit_names_the_capacity(tmp_path: Path) -> None:
    with pytest.raises(TierError, match=r"tiers\[0\]\.host\.capacity: .*does not fit"):
        HostPool.create_shm(tmp_path / "pool", 1 << 40, 1 << 20, pinned="no")
    assert not (tmp_path / "pool").exists()


def test_host_tier_over_an_attached_pool_fills_the_creators_bytes(tmp_path: Path) -> None:
    """The scheduler's index over the worker's bytes: what one writes, the other reads."""
    path = tmp_path / "pool"
    worker = HostPool.create_shm(path, SLOT, 2, pinned="no")
    host = HostTier.over(HostPool.attach_shm(path, SLOT, 2))
    key = make_key(1)
    meta = meta_for(key, SLOT)
    r = host.reserve(key)
    assert r is not None
    worker.view(r.slot)[:] = payload_for(key, SLOT)  # the worker's save copy
    host.commit(r.slot, meta)
    buf = np.zeros(SLOT, dtype=np.uint8)
    assert host.get_into(key, buf.data) == meta
    np.testing.assert_array_equal(buf, payload_for(key, SLOT))


def test_commit_of_a_meta_bigger_than_a_slot_aborts_the_slot() -> None:
    host = HostTier(2 * SLOT, SLOT)
    r = host.reserve(make_key(1))
    assert r is not None
    with pytest.raises(ValueError, match="does not fit"):
        host.commit(r.slot, meta_for(make_key(1), SLOT + 1))
    assert host.index.clean_or_free() == 2 and not host.indexed(make_key(1))
