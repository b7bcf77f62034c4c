"""IOPool: loads before stores, a bounded store queue, clean drain on close."""

from __future__ import annotations

import threading
from functools import partial

import pytest

from kvtier.iopool import IOPool, IOPoolClosed


def test_loads_run_before_queued_stores() -> None:
    gate = threading.Event()
    order: list[str] = []
    pool = IOPool(threads=1, max_queued_stores=10)
    try:
        pool.submit_load(gate.wait)  # occupies the only thread
        for i in range(3):
            pool.submit_store(partial(order.append, f"s{i}"))
        last = pool.submit_load(lambda: order.append("load"))
        gate.set()
        last.result(timeout=10)
    finally:
        pool.close()
    assert order[0] == "load"
    assert order[1:] == ["s0", "s1", "s2"]


def test_full_store_queue_refuses_without_blocking() -> None:
    gate, started = threading.Event(), threading.Event()

    def hold() -> None:  # occupy the only thread until the gate opens
        started.set()
        gate.wait()

    pool = IOPool(threads=1, max_queued_stores=2)
    try:
        pool.submit_load(hold)
        assert started.wait(timeout=10)
        assert pool.submit_store(lambda: None) is not None
        assert pool.submit_store(lambda: None) is not None
        assert pool.submit_store(lambda: None) is None
        assert pool.pending() == (0, 2)
    finally:
        gate.set()
        pool.close()


def test_close_drains_queued_work_and_refuses_more() -> None:
    done: list[int] = []
    gate = threading.Event()
    pool = IOPool(threads=2, max_queued_stores=100)
    pool.submit_load(gate.wait)
    futs = [pool.submit_store(partial(done.append, i)) for i in range(20)]
    gate.set()
    pool.close()
    assert sorted(done) == list(range(20))
    assert all(f is not None and f.done() for f in futs)
    with pytest.raises(IOPoolClosed):
        pool.submit_store(lambda: None)


def test_task_exception_lands_in_future_and_pool_keeps_working() -> None:
    with IOPool(threads=1) as pool:
        bad = pool.submit_load(lambda: 1 / 0)
        with pytest.raises(ZeroDivisionError):
            bad.result(timeout=10)
        assert pool.submit_load(lambda: 42).result(timeout=10) == 42
