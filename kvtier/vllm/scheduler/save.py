"""The save: which pieces of a finishing request get host slots, in chain order, and
how much of the chain its response may announce. Scheduler thread; memory only (the
store's reserve and lookups of its indexes).
"""

from __future__ import annotations

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
)


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
        for c, piece in enumerate(pieces, start=stored):
            slot = self.store.reserve(piece.key)
            if slot is None and shared and self.store.saving(piece.key):
                slot = self.store.reserve(piece.key, backup=True)
            if slot is None:
                if not self.store.holds(piece.key):
                    record_drop("host_full")
                    break
                if c == stored and supersede:  # another request's copy is (being) stored
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
        if saves:
            self._saves[rid] = _Save(saves, later)
        return nbytes, announce

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
