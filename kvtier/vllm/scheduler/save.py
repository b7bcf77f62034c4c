"""The save: which pieces of a finishing request get host slots, in chain order, and
how much of the chain its response may announce. Scheduler thread; memory only (the
store's reserve and lookups of its indexes).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from kvtier.keys import ChunkKey
from kvtier.metrics import (
    record_drop,
    record_spill,
)
from kvtier.objformat import ChunkMeta
from kvtier.store import WritePolicy
from kvtier.vllm.protocol import CopyOp
from kvtier.vllm.scheduler.keys import RequestKeys
from kvtier.vllm.scheduler.records import (
    _Save,
    _SavePiece,
    _SaveStream,
)

log = logging.getLogger("kvtier.vllm")


class Saves(RequestKeys):
    """Reserve and queue a finishing request's pieces."""

    def _save(
        self, rid: str, request: Any, ns: bytes, keys: list[ChunkKey],
        block_ids: Sequence[int], tail: _SavePiece | None,
    ) -> tuple[int, int]:
        """Queue copies of the chunks not stored yet, then of the ``tail`` (if any).
        Returns (bytes to copy, length of the stored prefix in pieces: whole chunks, and
        ``len(keys) + 1`` if the tail is stored or will be): what the response announces.

        Concurrent saves of one prefix (requests that share a new system prompt and finish
        in the same step): a chunk another request is saving counts as held, and this
        request goes on to its own chunks. The announcement never names a chunk that will
        not exist (a P/D decode node would wait ``wait_seconds`` for it):

        * a chunk that gets no host slot ends it (and the chunks after it are not copied:
          a prefix with a hole is not reusable);
        * for a node that hands KV to another node (``role`` prefill or decode), a chunk
          another request is still saving is copied again into a *backup* slot
          (``store.reserve(backup=True)``), so this request's chain never depends on the
          other save succeeding; the first commit is published and the other slot is
          freed. One backup per chunk: a chunk that already has two saves in flight is
          announced without a third copy (both would have to fail). Without a backup
          slot such a chunk ends the announcement (the other save usually lands);
        * for such a node, so does a write-through that the store queue cannot take now.

        A node that serves its own requests (``both``) makes no backups: the worst a
        failed save of a shared chunk costs it is a recompute of the chunks after it.
        The tail is one more piece after the whole chunks, under the same rules; the first
        piece this request saves itself supersedes the shorter tails of its chunk
        (``_superseded``), once the save commits.
        """
        n_chunks = len(keys)
        stored = self.store.lookup_indexed(keys).hits  # memory only: scheduler thread
        held = stored
        shared = self.role != "both" and any(
            lt.write is WritePolicy.THROUGH for lt in self.store.lower)
        # A re-offer costs one existence check per chunk per tier: at most once per
        # quarter lease per chunk (a renewal or write within that keeps it alive).
        if shared and stored and self.store.rewrite_through(
                keys[:stored], min_age_s=self.lease_s / 4) == 0:
            # Our host copy may have outlived the shared one (collected past its lease),
            # and the job that offers them again was dropped: announce what the shared
            # tier's index knows.
            held = next((i for i, k in enumerate(keys[:stored]) if not any(
                lt.tier.indexed(k) for lt in self.store.lower)), stored)
        pieces = [_SavePiece(keys[c], self._meta(ns, keys, c),
                         list(block_ids[c * self.bpc : (c + 1) * self.bpc]))
                  for c in range(stored, n_chunks)]
        if tail is not None:
            pieces.append(tail)
        return self._save_pieces(rid, request, keys, pieces, stored, held,
                                 supersede=self.tails, baseline=n_chunks * self.slot_bytes)

    def _save_pieces(self, rid: str, request: Any, keys: Sequence[ChunkKey],
                     pieces: list[_SavePiece], stored: int, held: int, *,
                     supersede: bool, baseline: int) -> tuple[int, int]:
        """Reserve and queue ``pieces`` (the chain's pieces from number ``stored`` on;
        ``held`` of the chain are known stored), under ``_save``'s rules; ``baseline``:
        the bytes a save of everything would write (a metric). Returns (bytes to copy,
        pieces of the chain announced)."""
        shared = self.role != "both" and any(
            lt.write is WritePolicy.THROUGH for lt in self.store.lower)
        room = (self.store.free_store_slots(WritePolicy.THROUGH) if shared
                else len(pieces) + 1)
        if shared and not self.store.shared_up(every=True):
            room = 0  # a down shared tier drops writes: announce nothing new
        announce = held  # grows only while the chain from chunk 0 stays whole
        saves: list[tuple[int, ChunkMeta]] = []
        later: list[ChunkKey] = []  # superseded once this save commits
        nbytes = 0
        stream: _SaveStream | None = None
        for c, piece in enumerate(pieces, start=stored):
            slot = self.store.reserve(piece.key)
            if slot is None and shared and self.store.saving(piece.key):
                slot = self.store.reserve(piece.key, backup=True)
            if slot is None:
                if not self.store.holds(piece.key):
                    if self._streams_saves():
                        # the rest waits for slots as the ones before it are written
                        # below (``_advance_save_streams``); announced as far as it got
                        stream = self._save_stream(pieces[c - stored :])
                        break
                    record_drop("host_full")
                    break
                if c == stored and supersede and not self.store.saving(piece.key):
                    # another request's copy is stored: the shorter tails are repeated
                    # in it. (One still being saved supersedes them itself when its save
                    # commits, and keeps them if it fails.)
                    self.store.delete(self._superseded(request, keys, c,
                                                        piece.span or self.bpc))
                # stored meanwhile, or being saved by another request: held. Announced
                # if published, or (P/D) if two saves of it are in flight already (one
                # request's and a backup: both would have to fail)
                if announce == c and not (shared and self.store.saving(piece.key) == 1):
                    announce = c + 1
                continue
            if c == stored and supersede:
                later = self._superseded(request, keys, c, piece.span or self.bpc)
            saves.append((slot, piece.meta))
            nbytes += piece.meta.payload_len
            self._to_save.append(CopyOp(rid, slot, piece.block_ids, 0, piece.span,
                                        piece.group))
            if announce == c and len(saves) <= room:
                announce = c + 1
        record_spill(nbytes, baseline)
        if stream is not None:
            stream.issued, stream.supersedes = saves, later
            self._save_streams[rid] = stream
        elif saves:
            self._saves[rid] = _Save(saves, later)
        return nbytes, announce

    def _streams_saves(self) -> bool:
        """Whether a save that finds no free host slot waits for one (``_SaveStream``):
        on a node that serves its own requests (a P/D node's announcement must name only
        pieces that have a slot), with a tier below that the host pool's chunks are
        written to, so that slots come free as the pieces before are written."""
        return self.role == "both" and bool(self.store.lower)

    def _save_stream(self, pending: list[_SavePiece]) -> _SaveStream:
        """A stream for ``pending`` (pieces that found no slot, in chain order). Its wait
        for a slot is the load's stall allowance, or (storage suspect) the recompute of
        what it would save (``waitbound``)."""
        now = self.clock.monotonic()
        tokens = sum((p.span or self.bpc) * self.bs for p in pending)
        return _SaveStream(pending, now, self.waits.save_seconds(self.load_stall_s, tokens, now))

    def _advance_save_streams(self) -> None:
        """Give the streams' waiting pieces the host slots that came free, in chain order,
        at most ``_stream_window`` uncommitted per stream and ``_save_room`` over all
        streams (a returning request's restore needs slots too: the staging cap's share
        of the pool is left to restores); end a stream whose next piece waited past its
        bound (the rest is not saved). Memory only."""
        now = self.clock.monotonic()
        room = self._save_room - sum(st.uncommitted() for st in self._save_streams.values())
        for rid, st in list(self._save_streams.items()):
            in_flight = st.uncommitted()
            while st.pending and not st.failed and in_flight < self._stream_window \
                    and room > 0:
                piece = st.pending[0]
                slot = self.store.reserve(piece.key)
                if slot is None:
                    if self.store.holds(piece.key):  # stored meanwhile, or being saved
                        st.pending.pop(0)
                        st.since = now
                        continue
                    if now - st.since > st.wait_s:
                        log.info("kvtier: save of %s waited %.2f s for a host slot; %d "
                                 "pieces not saved", rid, now - st.since, len(st.pending))
                        record_drop("host_full")
                        # (not ``waits.missed``: a write-back that lags says nothing of
                        # how fast the tiers answer reads)
                        st.pending = []
                    break
                st.pending.pop(0)
                st.since = now
                st.issued.append((slot, piece.meta))
                in_flight += 1
                room -= 1
                self._to_save.append(CopyOp(rid, slot, piece.block_ids, 0, piece.span,
                                            piece.group))
                record_spill(piece.meta.payload_len, 0)
            if st.pending and (in_flight >= self._stream_window or room <= 0):
                st.since = now  # waiting for copies in flight, not for the pool
            if st.done():
                del self._save_streams[rid]

    def _stamp_save_streams(self, step: int) -> tuple[list[str], list[str]]:
        """The streams' slots issued for ``step`` (the metadata being built) wait for its
        acknowledgement; returns (requests acknowledged per step, requests whose saves
        continue after this step). Memory only."""
        more = []
        for rid, st in self._save_streams.items():
            if st.issued:
                st.by_step[step], st.issued = st.issued, []
            if st.pending or not st.told:
                # a stream that lost its pending pieces before its first step is still
                # named once: vLLM delays the free, so the worker must report it
                more.append(rid)
                st.told = True
        return sorted(self._save_streams), sorted(more)

    def _end_save_stream(self, rid: str, failed: bool) -> None:
        """vLLM reported ``rid``'s save finished on every rank (``finished_sending``):
        every copy it was given is done. Steps not acknowledged yet are settled now
        (committed, unless a rank reported the request's save failed); slots given out
        for a step not yet sent are aborted and their copies withdrawn (vLLM frees the
        blocks now). A worker reports a streamed save finished only after its last step,
        so those two are for workers that do not acknowledge steps."""
        st = self._save_streams.pop(rid, None)
        if st is None:
            return
        bad = failed or st.failed
        for step in sorted(st.by_step):
            self._settle_slots(st, st.by_step[step], bad)
        if st.issued:
            for slot, _ in st.issued:
                self.store.abort(slot)
            self._to_save = [op for op in self._to_save if op.req_id != rid]

    def _settle_slots(self, st: _SaveStream, slots: list[tuple[int, ChunkMeta]],
                      bad: bool) -> None:
        """Abort ``slots`` of ``st`` if ``bad``; else commit them, and delete the shorter
        tails its first piece supersedes (once)."""
        for slot, meta in slots:
            if bad:
                self.store.abort(slot)
            else:
                self.store.commit(slot, meta)
        if not bad and st.supersedes:
            self.store.delete(st.supersedes)
            st.supersedes = []

    def _save_step_acked(self, step: int, failed: bool) -> None:
        """One rank acknowledged ``step``'s streamed saves (``failed``: one of its copies
        failed). Once every rank has, the step's slots are committed, or aborted if any
        rank failed or the stream failed before (its chain has a hole): the stream ends."""
        n, bad = self._save_acks.pop(step, (0, False))
        n, bad = n + 1, bad or failed
        if n < self.geom.tp_world:
            self._save_acks[step] = (n, bad)
            return
        for rid, st in list(self._save_streams.items()):
            slots = st.by_step.pop(step, None)
            if slots is None:
                continue
            if bad and not st.failed:
                log.error("kvtier: streamed save of %s failed; the rest is not saved", rid)
            st.failed = st.failed or bad
            self._settle_slots(st, slots, st.failed)
            if st.failed:
                st.pending = []
            if st.done():
                del self._save_streams[rid]

    def _superseded(self, request: Any, keys: Sequence[ChunkKey], chunk: int,
                    blocks: int) -> list[ChunkKey]:
        """The keys of the tails of chunk ``chunk`` shorter than ``blocks`` blocks
        (``blocks_per_chunk``: the whole chunk), which the host tier drops once the save
        that covers them commits: it holds their bytes too (a save that fails drops
        nothing). A return that agrees with the longer save restores it; one that
        branches inside the chunk recomputes at most that chunk, as without tails. Lower
        tiers keep what they were given (write-through tails of a P/D node; spilled ones)
        until their collection: a shared tier may serve another node's request. Memory
        only: at most ``blocks_per_chunk - 1`` keys hashed."""
        return [self._tail_key(request, keys, chunk, k) for k in range(1, blocks)]
