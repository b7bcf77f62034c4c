"""The load: ``update_state_after_alloc`` turns a request's staged KV into copy ops onto
the blocks vLLM allocated (per shape: chunks, a window, a hybrid prefix), and
streamed restores (``kvtier.vllm.stream``) hand out their chunks step by step.
Scheduler thread; memory only.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

from kvtier.metrics import (
    record_drop,
    record_restore,
)
from kvtier.store import LoadProgress
from kvtier.vllm.hybrid import full_groups
from kvtier.vllm.protocol import CopyOp
from kvtier.vllm.scheduler.keys import RequestKeys
from kvtier.vllm.scheduler.records import _Staging
from kvtier.vllm.stream import (
    Advance,
    ChunkCopy,
    StreamedLoad,
)

log = logging.getLogger("kvtier.vllm")


class Loads(RequestKeys):
    """Copy ops of admitted restores, and the streamed restores."""

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external: int) -> None:
        rid = request.request_id
        lk = self._lookups.get(rid)
        if lk is None:
            return
        if lk.held is None or num_external <= 0:
            # vLLM took another answer than ours (0 tokens, or it allocated while our
            # staging was still pending: a request it reads no prefix cache for): the
            # staging is released now, not when the request finishes
            self._forget(rid)
            return
        del self._lookups[rid]
        self.shape.loads(rid, lk, blocks.get_block_ids(), num_external)

    def _window_restore(self, rid: str, lk: _Staging, groups: Sequence[Sequence[int]],
                        num_external: int) -> None:
        """A sliding-window model's restore admitted: its window's copy ops
        (``_window_loads``), its holds released when the worker has copied them."""
        assert lk.held is not None
        self._window_loads(rid, lk, groups[0], num_external)
        self._load_holds.append(lk.held)
        tier = self.store.tiers[lk.held.from_tier[0]].name
        staged_ms = (time.perf_counter() - lk.t0) * 1e3
        self._loaded(rid, {tier: num_external}, staged_ms, num_external // self.bs)
        log.info("kvtier: restoring %d tokens for %s from a %d-block window (%s), "
                 "staged in %.1f ms", num_external, rid,
                 sum(n for _, n in lk.parts), tier, staged_ms)

    def _loaded(self, rid: str, by_tier: dict[str, int], staged_ms: float,
                nblocks: int, *, asynchronous: bool = False) -> None:
        """A restore's copy ops are out (a stream's first ones): a synchronous one is
        counted as restored now; an asynchronous one (a hybrid model's, a stream, or
        any where vLLM overlaps steps: ``async_restores``) holds its request until the
        worker reports it received, and counts as restored only then
        (``_unconfirmed``, ``on_worker_output``): it can still fail."""
        if not (asynchronous or self.async_restores):
            record_restore(by_tier)
            self._restored[rid] = (by_tier, staged_ms)
            return
        self._async_reqs.append(rid)
        self._recving.add(rid)
        self._async_blocks[rid] = nblocks
        self._unconfirmed[rid] = (by_tier, staged_ms)

    def _chunk_loads(self, rid: str, lk: _Staging, groups: Sequence[Sequence[int]],
                     num_external: int) -> None:
        """A full-attention (or MLA) model's restore admitted: a copy op per staged chunk
        (and the tail) past vLLM's own hit, or a streamed restore's first ones."""
        assert lk.held is not None
        block_ids = groups[0]
        lo_blk = lk.start_tokens // self.bs
        hi_blk = (lk.start_tokens + num_external) // self.bs
        if lk.stream is not None:
            self._start_stream(rid, lk, block_ids, lo_blk, hi_blk)
            return
        by_tier: dict[str, int] = {}
        for c in range(lo_blk // self.bpc, -(-hi_blk // self.bpc)):
            lo, hi = max(lo_blk, c * self.bpc), min(hi_blk, (c + 1) * self.bpc)
            idx = c - lk.first_chunk
            slot = lk.held.slots[idx][0]
            span = lk.tail_blocks if idx == lk.full else 0
            self._loads.append(CopyOp(rid, slot, list(block_ids[lo:hi]), lo - c * self.bpc,
                                      span))
            tier = self.store.tiers[lk.held.from_tier[idx]].name
            by_tier[tier] = by_tier.get(tier, 0) + (hi - lo) * self.bs
        self._load_holds.append(lk.held)
        staged_ms = (time.perf_counter() - lk.t0) * 1e3
        self._loaded(rid, by_tier, staged_ms, hi_blk - lo_blk)
        log.info(
            "kvtier: restoring %d tokens for %s (%s), %.1f MiB, staged in %.1f ms",
            num_external, rid, ", ".join(f"{t} {n}" for t, n in by_tier.items()),
            num_external / self.ct * self.slot_bytes / 2**20, staged_ms,
        )

    def _window_loads(self, rid: str, lk: _Staging, block_ids: Sequence[int],
                      num_external: int) -> None:
        """Copy ops for a staged window: the window's blocks past vLLM's own hit (those
        before the window are vLLM's null block, and nothing is copied into them)."""
        assert lk.held is not None
        lo = lk.start_tokens // self.bs
        hi = (lk.start_tokens + num_external) // self.bs
        if lk.start_tokens + num_external != lk.end:  # vLLM took another length: the
            # staged window is not the one it needs; fail its blocks (it recomputes them)
            log.error("kvtier: %s: vLLM took %d tokens of a %d-token window restore; "
                      "failing the load", rid, num_external, lk.end - lk.start_tokens)
            self._loads.append(CopyOp(rid, -1, [b for b in block_ids[lo:hi] if b], 0, 0))
            return
        for idx, (first, n) in enumerate(lk.parts):
            a, b = max(lo, first), min(hi, first + n)
            if a < b:
                self._loads.append(CopyOp(rid, lk.held.slots[idx][0],
                                          list(block_ids[a:b]), a - first,
                                          n if n < self.bpc else 0))

    def _hybrid_loads(self, rid: str, lk: _Staging, block_ids: Sequence[Sequence[int]],
                      num_external: int) -> None:
        """Copy ops for a staged hybrid prefix: each piece's blocks past vLLM's own hit,
        into its group's blocks. The loads are asynchronous: vLLM holds the request until
        the worker reports them received, or failed (then it recomputes)."""
        assert lk.held is not None
        lo = lk.start_tokens // self.bs
        hi = (lk.start_tokens + num_external) // self.bs
        self._load_holds.append(lk.held)
        if lk.start_tokens + num_external != lk.end:  # not the prefix that was staged
            log.error("kvtier: %s: vLLM took %d tokens of a %d-token restore; failing the "
                      "load", rid, num_external, lk.end - lk.start_tokens)
            self._loads.append(CopyOp(rid, -1, [], 0, 0))  # reported failed: recomputed
            self._recving.add(rid)
            return
        nblocks = 0
        # tokens by tier: a full group's chunk or tail names its blocks' tier; blocks no
        # full group restores (a window-only model) count under the window's tier
        full = full_groups(self.geom)
        first_full = next((p.group for p in lk.pieces if p.group in full), None)
        by_tier: dict[str, int] = {}
        for idx, p in enumerate(lk.pieces):
            a, b = max(lo, p.first), min(hi, p.first + p.blocks)
            if a >= b:
                continue
            self._loads.append(CopyOp(rid, lk.held.slots[idx][0],
                                      list(block_ids[p.group][a:b]), a - p.first,
                                      p.span, p.group))
            nblocks += b - a
            if p.group == first_full or (first_full is None and p.group == lk.pieces[-1].group):
                tier = self.store.tiers[lk.held.from_tier[idx]].name
                by_tier[tier] = by_tier.get(tier, 0) + (b - a) * self.bs
        if first_full is None:  # a window-only model: its window restores the whole prefix
            tier = self.store.tiers[max(lk.held.from_tier)].name
            by_tier = {tier: num_external}
        staged_ms = (time.perf_counter() - lk.t0) * 1e3
        self._loaded(rid, by_tier, staged_ms, nblocks, asynchronous=True)
        log.info("kvtier: restoring %d tokens for %s from %d pieces of %d KV-cache groups "
                 "(%s), staged in %.1f ms", num_external, rid, len(lk.pieces),
                 len(self.geom.groups), ", ".join(f"{t} {n}" for t, n in by_tier.items()),
                 staged_ms)

    def _start_stream(self, rid: str, lk: _Staging, block_ids: Sequence[int], lo_blk: int,
                      hi_blk: int) -> None:
        """A streamed restore admitted: its first entries' copy ops go out with this step,
        the rest follow as ``_advance_streams`` reads them (``stream.py``)."""
        assert lk.held is not None and lk.stream is not None
        found, specs = lk.stream
        copies: list[ChunkCopy | None] = []
        for idx in range(found.hits):
            c = lk.first_chunk + idx
            lo, hi = max(lo_blk, c * self.bpc), min(hi_blk, (c + 1) * self.bpc)
            span = lk.tail_blocks if idx == lk.full else 0
            copies.append(ChunkCopy(list(block_ids[lo:hi]), lo - c * self.bpc, span)
                          if lo < hi else None)
        st = StreamedLoad(rid, found, specs, copies, self._stream_window, self.bs,
                          lambda: LoadProgress(self.clock))
        st.span_tokens = (lk.start_tokens, hi_blk * self.bs)
        out = Advance()
        first = len(lk.held)
        # entries vLLM's own hit covers now (it grew while the restore was staged) fill
        # no block: those of the head are released with it, the rest are never read
        below = next((i for i, c in enumerate(copies) if c is not None), len(copies))
        if below >= len(lk.held):
            lk.held.release()
            st.skip(below)
        else:
            st.hand_out(lk.held, out)
        self._streams[rid] = st
        self._take(rid, out)
        by_tier: dict[str, int] = {}
        for idx, tier in enumerate(found.tiers):
            copy = copies[idx]
            if copy is not None:
                name = self.store.tiers[tier].name
                by_tier[name] = by_tier.get(name, 0) + len(copy.block_ids) * self.bs
        staged_ms = (time.perf_counter() - lk.t0) * 1e3
        self._loaded(rid, by_tier, staged_ms, hi_blk - lo_blk, asynchronous=True)
        log.info("kvtier: streaming %d tokens for %s (%s) through %d host slots; first "
                 "%d chunks staged in %.1f ms", (hi_blk - lo_blk) * self.bs, rid,
                 ", ".join(f"{t} {n}" for t, n in by_tier.items()), st.window,
                 first, staged_ms)

    def _take(self, rid: str, out: Advance) -> None:
        """A stream's step: its ops and holds go out with the next metadata."""
        if out.ops:
            self._loads.extend(out.ops)
            self._async_reqs.append(rid)
        self._load_holds.extend(out.holds)

    def _advance_streams(self) -> None:
        """Every streamed restore moves on (``StreamedLoad.advance``); one whose read
        failed or stalled ends with a load that fails on purpose (vLLM recomputes it).
        Streams together stay within the staging cap (with the stagings waiting for
        admission): each reads more only into the room the cap has left, and a stream
        with nothing in flight may always read one slot (it holds its request's blocks;
        it must progress)."""
        now = self.clock.monotonic()
        room = self._staged_cap - self._staged_chunks()
        for rid, st in list(self._streams.items()):
            lo, hi = st.span_tokens
            stall_s = self._idle_bound(self.load_stall_s, st.progress, lo, hi)
            before = st.in_flight()
            out = st.advance(self.store, stall_s, max(room, 0 if before else 1))
            room -= st.in_flight() - before
            self._take(rid, out)
            if out.failed:
                if out.stalled:  # a tier stopped answering: storage is suspect
                    self.waits.missed(now)
                    record_drop("load_timeout")
                log.warning("kvtier: streamed restore of %s could not %s entry %d of %d; "
                            "vLLM recomputes it", rid,
                            "finish reading" if out.stalled else "read", st.failed_at + 1,
                            st.found.hits)
            if out.ended:
                del self._streams[rid]
