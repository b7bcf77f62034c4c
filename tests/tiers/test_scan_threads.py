"""The start scan on several threads (``index_threads``) indexes exactly what one thread
does: the same keys, sizes and recency, also with puts, overwrites and deletes while it
runs. Scan threads are held at page boundaries on events and a barrier (no sleeps); the
clock is a ``ManualClock``."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtier.build import build_lower_tiers
from kvtier.clock import ManualClock
from kvtier.config import parse_config
from kvtier.keys import ChunkKey, key_from_hex
from kvtier.tiers.base import WriteMode
from kvtier.tiers.file import FileTier, FileTransport
from kvtier.tiers.transport import Page
from tests.tiers.harness import meta_for, payload_for

SAFETY_S = 30.0  # only a deadlock gets there
WORKERS = 4


def spread_key(i: int) -> ChunkKey:
    """Keys over many top-level directories (and leaves): ``i * 37 % 256`` first."""
    return ChunkKey(bytes([(i * 37) % 256, (i * 11) % 256]) + i.to_bytes(14, "big"))


def size_of(i: int) -> int:
    return 16 + 8 * (i % 7)


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


def put(tier: FileTier, clock: ManualClock, key: ChunkKey, n: int,
        mode: WriteMode = WriteMode.CREATE) -> None:
    clock.advance(1)
    tier.put(meta_for(key, n), payload_for(key, n).data, mode)


def fill(root: Path, clock: ManualClock, n: int) -> list[ChunkKey]:
    """``n`` objects of a few sizes, 1 s apart, spread over the top-level directories."""
    tier = FileTier(root, 1 << 40, clock=clock, fsync=False)
    keys = [spread_key(i) for i in range(n)]
    for i, key in enumerate(keys):
        put(tier, clock, key, size_of(i))
    tier.close()
    return keys


def on_disk(root: Path) -> dict[ChunkKey, int]:
    """Every object file under ``root`` with its size: what a complete index holds."""
    found = {}
    for where, _, names in os.walk(root / "kv"):
        for name in names:
            if name.endswith(".kv"):
                found[key_from_hex(name[:-3])] = os.lstat(Path(where) / name).st_size
    return found


def indexed(tier: FileTier) -> dict[ChunkKey, tuple[int, float]]:
    return {key: (e.size, e.last_used) for key, e in tier.index.items()}


class ScanGate:
    """Scan threads (named ``*-index*``) meet at a barrier on their first page, so that
    ``workers`` of them are shown to list at once; with ``park``, each then waits at the
    first page of its second slice until ``release()`` (the slices before are listed)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, workers: int, *, park: bool) -> None:
        self.listers: set[str] = set()
        self._barrier = threading.Barrier(workers, timeout=SAFETY_S)
        self._parked = threading.Semaphore(0)
        self._go = threading.Event()
        self._workers, self._park = workers, park
        self._slices_begun: dict[str, int] = {}
        real = FileTransport.page

        def page(transport: FileTransport, cursor: object | None) -> Page:
            name = threading.current_thread().name
            if "-index" in name:
                self.listers.add(name)
                if cursor is None or cursor in transport.slices():  # a slice's first page
                    begun = self._slices_begun.get(name, 0)
                    self._slices_begun[name] = begun + 1
                    if begun == 0:
                        self._barrier.wait()
                    elif begun == 1 and self._park:
                        self._parked.release()
                        assert self._go.wait(SAFETY_S)
            return real(transport, cursor)

        monkeypatch.setattr(FileTransport, "page", page)

    def wait_parked(self) -> None:
        for _ in range(self._workers):
            assert self._parked.acquire(timeout=SAFETY_S), "a scan thread did not park"

    def release(self) -> None:
        self._go.set()


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> Iterator[ScanGate]:
    g = ScanGate(monkeypatch, WORKERS, park=True)
    yield g
    g.release()


def test_four_scan_threads_index_what_one_does(
    tmp_path: Path, clock: ManualClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    keys = fill(tmp_path, clock, 600)
    one = FileTier(tmp_path, 1 << 40, clock=clock)
    gate = ScanGate(monkeypatch, WORKERS, park=False)
    four = FileTier(tmp_path, 1 << 40, clock=clock, background_index=True,
                    index_threads=WORKERS)
    assert four.wait_indexed(SAFETY_S)
    assert len(gate.listers) == WORKERS, "the scan did not list on four threads at once"
    expected = on_disk(tmp_path)
    assert len(expected) == len(keys)
    assert indexed(four) == indexed(one)
    assert {k: size for k, (size, _) in indexed(four).items()} == expected
    # Recency, not the order in which threads listed: coldest first, as the objects were put.
    assert [k for k, _ in four.index.coldest(len(keys))] == keys
    assert four.usage() == one.usage()
    assert four.metrics.index_ready and four.metrics.index_scanned == len(keys)
    one.close()
    four.close()


def test_puts_overwrites_and_deletes_during_a_four_thread_scan_are_kept(
    tmp_path: Path, clock: ManualClock, gate: ScanGate
) -> None:
    keys = fill(tmp_path, clock, 600)
    tier = FileTier(tmp_path, 1 << 40, clock=clock, background_index=True,
                    index_threads=WORKERS)
    gate.wait_parked()  # four slices listed, four taken and not listed, the rest not taken
    assert not tier.index_ready and len(gate.listers) == WORKERS
    new = [ChunkKey(bytes([top, 7]) + b"\xee" * 14) for top in (0, 1, 2, 3, 5, 0x80, 0xFF)]
    for key in new:
        put(tier, clock, key, 40)
    rewritten = keys[:5] + keys[300:305]
    for key in rewritten:
        put(tier, clock, key, 72, WriteMode.OVERWRITE)
    assert tier.delete(keys[100:104] + keys[400:404]) == 8
    gate.release()
    assert tier.wait_indexed(SAFETY_S)
    got = indexed(tier)
    assert {k: size for k, (size, _) in got.items()} == on_disk(tmp_path)
    assert all(got[k][0] == meta_for(k, 72).object_len for k in rewritten)
    # What this node recorded during the scan is the hottest, in the order it was recorded.
    recorded = new + rewritten
    assert [k for k, _ in tier.index.items()][-len(recorded):] == recorded
    # One thread, opening the same directory afresh, indexes the same.
    assert indexed(FileTier(tmp_path, 1 << 40, clock=clock)) == got
    tier.close()


def test_a_listing_fault_stops_every_scan_thread_and_the_walk_finds_the_rest(
    tmp_path: Path, clock: ManualClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    keys = fill(tmp_path, clock, 300)
    real = FileTransport.page
    broken = (0x10 << 8, None)  # the first page of top-level directory 10

    def page(transport: FileTransport, cursor: object | None) -> Page:
        if cursor == broken and "-index" in threading.current_thread().name:
            raise OSError(5, "Input/output error")
        return real(transport, cursor)

    monkeypatch.setattr(FileTransport, "page", page)
    tier = FileTier(tmp_path, 1 << 40, clock=clock, background_index=True,
                    index_threads=WORKERS)
    assert tier.wait_indexed(SAFETY_S)  # ready, though incomplete
    assert tier.metrics.counts.errors == 1  # the one fault, logged once
    assert len(tier.index) < len(keys)
    tier.rescan()
    assert {k: size for k, (size, _) in indexed(tier).items()} == on_disk(tmp_path)
    tier.close()


def test_index_threads_reaches_the_tier_and_is_at_least_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(ValueError, match="index_threads: must be >= 1"):
        FileTier(tmp_path, 1 << 40, index_threads=0)
    doc = {"tiers": [{"host": {"capacity": "1GiB"}},
                     {"file": {"path": str(tmp_path), "capacity": "1GiB", "index_threads": 3}}]}
    gate = ScanGate(monkeypatch, 3, park=False)
    (lower,) = build_lower_tiers(parse_config(doc, environ={}))
    assert isinstance(lower.tier, FileTier) and lower.tier.wait_indexed(SAFETY_S)
    assert gate.listers == {"file1-index", "file1-index-1", "file1-index-2"}
    lower.tier.close()
