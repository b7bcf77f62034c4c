"""A host pool smaller than the users' histories, in front of a write-back file tier
(issue 36): the LMCache multi-round shape, users taking turns, at unit scale.

Requests are plain records with the attributes of vLLM's ``Request`` that the scheduler
side reads; the store is real (a 16-slot host pool and a file tier); the worker's part is
the ``finished_sending`` and ``loaded_steps`` reports. Between two requests the test
waits for the queued writes (``store.flush``): a healthy, idle disk keeps up.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtier import metrics as m
from kvtier.keys import Namespace
from kvtier.vllm.geometry import Geometry
from kvtier.vllm.protocol import KVTierWorkerMetadata
from kvtier.vllm.scheduler_side import SchedulerSide
from tests.vllm.hooks import Blocks, ask, request_record, small_pool_sched

BS, BPC = 16, 4
CT = BS * BPC
GEOM = Geometry(2, 2, 8, BS, 1024, "float32")
NS = Namespace(model="m", model_fingerprint="0" * 16, kv_dtype="float32", kv_layout="NHD",
               num_layers=2, num_kv_heads=2, head_size=8, chunk_tokens=CT, block_size=BS)
SLOTS, USERS, ROUNDS = 16, 6, 4
HISTORY = 5 * CT + 20  # about 6 chunks a conversation: 36 for all users, 16 slots



@pytest.fixture
def sched(tmp_path: Path) -> Iterator[SchedulerSide]:
    s = small_pool_sched(tmp_path, GEOM, NS, CT, SLOTS)
    yield s
    s.close()


def _step(sched: SchedulerSide, sent: set[str] | None = None) -> None:
    """One engine step: the worker copies its loads and saves and reports them (a step
    with streamed saves is acknowledged as the worker does, ``saved_steps``)."""
    meta = sched.build_meta()
    acked = any(op.req_id in meta.saves_acked for op in meta.saves)
    sched.on_worker_output(sent, KVTierWorkerMetadata(
        loaded_steps=[meta.step] if meta.loads else [], step=meta.step,
        saved_steps=[meta.step] if acked else []))


def _finish(sched: SchedulerSide, rid: str, out: list[int]) -> None:
    """``rid`` finishes with ``out``: its save is copied (over as many steps as a
    streamed save takes, the disk writing between steps), then reported finished."""
    sched.request_finished(request_record(rid, out), list(range(-(-len(out) // BS))))
    for _ in range(100):
        _step(sched)
        if rid not in sched._save_streams:
            break
        assert sched.store.flush(10.0)  # an idle disk: the queued writes are done
    _step(sched, {rid})  # the save is copied: its chunks are committed, dirty


def test_users_taking_turns_restore_their_whole_history_and_no_save_is_dropped(
        sched: SchedulerSide, export: m.StatsBatch) -> None:
    rng = random.Random(0)
    convs = [[rng.randrange(3, 500) for _ in range(HISTORY)] for _ in range(USERS)]
    short: list[tuple[int, int, int, int]] = []
    for r in range(ROUNDS):
        for u in range(USERS):
            prompt = convs[u] + [rng.randrange(3, 500) for _ in range(rng.randint(8, 24))]
            rid = f"{u}-{r}"
            req = request_record(rid, prompt, computed=0)
            n = ask(sched, req) or 0
            if r and n < len(convs[u]) // CT * CT:  # its history, down to the chunk
                short.append((u, r, n, len(convs[u])))
            blocks = list(range(-(-len(prompt) // BS)))
            sched.update_state_after_alloc(req, Blocks(blocks), n)
            _step(sched)  # the loads are copied; their host slots are released
            out = [*prompt, *(rng.randrange(3, 500) for _ in range(4))]
            _finish(sched, rid, out)
            assert sched.store.flush(10.0)  # an idle disk: every queued write is done
            convs[u] = out
    drops = export.drain().get(m.DROPS.name, {})
    assert short == [] and drops.get("host_full", 0) == 0, (short, drops)


def test_a_pool_smaller_than_one_conversation_restores_all_it_stored(
        tmp_path: Path) -> None:
    """5 slots (a staging cap of 2) against 6-chunk histories: every turn's save streams
    all its chunks through the pool (``_SaveStream``: before, a save stopped where the
    pool ran out of free slots), and every return restores the whole prefix the tiers
    hold, streamed through the window (``stream.py``; before, a restore stopped where the
    pool ran out of slots)."""
    import concurrent.futures as cf

    sched = small_pool_sched(tmp_path, GEOM, NS, CT, 5)
    try:
        rng = random.Random(1)
        convs = [[rng.randrange(3, 500) for _ in range(HISTORY)] for _ in range(3)]
        streamed = 0
        for r in range(3):
            for u, conv in enumerate(convs):
                prompt = conv + [rng.randrange(3, 500) for _ in range(rng.randint(8, 24))]
                rid = f"{u}-{r}"
                req = request_record(rid, prompt, computed=0)
                stored = sched.store.lookup_indexed(sched.chunk_keys(req)).hits
                if r:  # the last turn's save streamed every chunk through the pool (the
                    # last token's KV is not computed: it is not saved)
                    assert stored == (len(conv) - 1) // CT, (rid, stored)
                n = ask(sched, req) or 0
                assert n == stored * CT, (rid, n, stored)
                sched.update_state_after_alloc(req, Blocks(list(range(-(-len(prompt) // BS)))),
                                               n)
                streamed += rid in sched._streams
                _step(sched)
                for _ in range(50):  # the stream's reads, one window a step
                    st = sched._streams.get(rid)
                    if st is None:
                        break
                    if st.future is not None:
                        cf.wait([st.future], timeout=10)
                    _step(sched)
                assert rid not in sched._streams
                if rid in sched._recving:  # the worker reports the request received
                    sched.on_worker_output(None, None, finished_recving={rid})
                out = [*prompt, *(rng.randrange(3, 500) for _ in range(4))]
                _finish(sched, rid, out)
                assert sched.store.flush(10.0)
                convs[u] = out
        assert streamed >= 3
        assert sched.store.host.index.num_held() == 0
    finally:
        sched.close()


def test_a_restore_over_the_staging_cap_streams_and_no_wait_outlasts_its_bound(
        tmp_path: Path, export: m.StatsBatch) -> None:
    """Requests that return together: the first one's staged chunks (waiting for vLLM to
    admit it) fill most of the staging cap (8 of 16 slots). The second streams through
    the room left instead of waiting for that admission; the third finds no room at all
    and waits, but only as long as its recompute would take (here, unmeasured: the load's
    stall allowance): then vLLM recomputes it (``staging_cap``)."""
    sched = small_pool_sched(tmp_path, GEOM, NS, CT, SLOTS)
    try:
        rng = random.Random(2)
        convs = [[rng.randrange(3, 500) for _ in range(6 * CT + 8)] for _ in range(3)]
        for u, conv in enumerate(convs):
            req = request_record(f"w{u}", conv, computed=0)
            assert ask(sched, req) == 0
            _finish(sched, f"w{u}", conv)
            assert sched.store.flush(10.0)
        reqs = [request_record(f"r{u}", [*conv, 7, 8], computed=0)
                for u, conv in enumerate(convs)]
        assert ask(sched, reqs[0]) == 6 * CT  # staged whole: 6 of the cap's 8
        assert sched._lookups["r0"].stream is None
        assert ask(sched, reqs[1]) == 6 * CT  # through the 2 slots left
        assert sched._lookups["r1"].stream is not None  # claimed as a streamed load
        assert ask(sched, reqs[2]) is None  # no room: it waits
        assert export.drain().get(m.DROPS.name, {}).get("staging_cap", 0) == 0
        sched.clock.advance(sched.load_stall_s + 0.1)  # type: ignore[attr-defined]
        assert ask(sched, reqs[2]) == 0  # waited as long as allowed: recompute
        assert export.drain().get(m.DROPS.name, {}).get("staging_cap", 0) == 1
    finally:
        sched.close()


def test_a_save_that_never_finds_a_slot_is_still_reported_finished(
        tmp_path: Path, export: m.StatsBatch) -> None:
    """Every host slot is held by others when a request finishes: its save waits for one
    (vLLM keeps its blocks), and gives up after the wait bound. Even though no copy of it
    was ever issued, its id goes to the worker once in ``saves_more`` (the step that also
    carries its finished id), so the worker reports it finished sending and vLLM frees
    its blocks; a stream that ended silently would hold them forever."""
    from kvtier.keys import ChunkKey

    sched = small_pool_sched(tmp_path, GEOM, NS, 4 * BS, 4)
    try:
        held = [sched.store.reserve(ChunkKey(bytes([i]) * 32)) for i in range(4)]
        assert all(s is not None for s in held)
        out = [random.Random(3).randrange(3, 500) for _ in range(3 * CT + 9)]
        delay, _ = sched.request_finished(request_record("a", out),
                                          list(range(-(-len(out) // BS))))
        assert delay and "a" in sched._save_streams
        sched.clock.advance(60.0)  # type: ignore[attr-defined]
        sched.on_worker_output(None, KVTierWorkerMetadata(step=0))  # it gives up
        assert export.drain().get(m.DROPS.name, {}).get("host_full", 0) == 1
        meta = sched.build_meta()
        assert meta.saves == [] and meta.saves_more == ["a"]  # told once
        sched.on_worker_output(None, KVTierWorkerMetadata(step=meta.step))
        assert sched.build_meta().saves_more == []
        assert not sched._save_streams and not sched.has_pending_saves()
    finally:
        sched.close()


def test_save_streams_leave_the_staging_caps_share_of_the_pool_to_restores(
        tmp_path: Path, export: m.StatsBatch) -> None:
    """Four first turns longer than a 5-slot pool finish together: their save streams
    together never hold more uncommitted slots than the pool less the staging cap (2),
    so a returning request always finds room to restore through; and every chunk is
    still saved. (Here the write-back's pacing frees at most three slots a step, so the
    bound is reached, not forced; the bound is what holds whatever the pacing.)"""
    sched = small_pool_sched(tmp_path, GEOM, NS, CT, 5)
    try:
        rng = random.Random(2)
        outs = {f"s{u}": [rng.randrange(3, 500) for _ in range(HISTORY)] for u in range(4)}
        for rid, out in outs.items():
            sched.request_finished(request_record(rid, out), list(range(-(-len(out) // BS))))
        peak = 0
        whole = set(outs) - set(sched._save_streams)  # found its slots: copied in a step
        assert len(whole) == 1 and len(sched._save_streams) == 3
        sent = whole
        for _ in range(200):
            meta = sched.build_meta()
            peak = max(peak, sum(op.req_id in meta.saves_acked for op in meta.saves
                                 if op.req_id in sched._save_streams))
            acked = any(op.req_id in meta.saves_acked for op in meta.saves)
            sched.on_worker_output(sent, KVTierWorkerMetadata(
                step=meta.step, saved_steps=[meta.step] if acked else []))
            sent = set()
            if not sched._save_streams:
                break
            assert sched.store.flush(10.0)
        _step(sched, set(outs) - whole)
        assert 0 < peak <= sched._save_room == 3, peak
        assert sched.store.flush(10.0)
        for rid, out in outs.items():
            keys = sched.chunk_keys(request_record(rid, out))
            assert sched.store.lookup(keys).hits == (len(out) - 1) // CT, rid
        assert export.drain().get(m.DROPS.name, {}).get("host_full", 0) == 0
    finally:
        sched.close()
