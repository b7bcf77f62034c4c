"""A request's identity and keys: its chunks' keys (cached per request), its tails',
a sliding window's parts, a hybrid model's pieces, and the spec and meta each stored
object must have. Memory only, scheduler thread.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from kvtier.keys import ChunkKey, chunk_keys, tail_key, window_key
from kvtier.objformat import ChunkMeta, ChunkSpec
from kvtier.vllm.hybrid import Piece, prefix_pieces
from kvtier.vllm.identity import PENDING, Pending, Unsupported
from kvtier.vllm.scheduler.records import (
    WINDOW_TAIL_CHUNKS,
    _FoundTail,
    _Keys,
)
from kvtier.vllm.scheduler.state import SchedulerState
from kvtier.vllm.window import window_parts


class RequestKeys(SchedulerState):
    """Keys, specs and metas of a request's chunks, tails, windows and pieces."""

    def _keys(self, request: Any, num_tokens: int) -> tuple[bytes, list[ChunkKey]] | Pending:
        """Keys of the full chunks of the request's first ``num_tokens`` tokens.

        Cached per request and extended incrementally (a request's tokens are only ever
        appended to), because vLLM asks again every step while a request waits. The keys
        cover the request's whole identity (``identity.py``): ``PENDING`` while it is
        being established, ``Unsupported`` if it cannot be.
        """
        rid = request.request_id
        cached = self._key_cache.get(rid)
        mm_inputs = len(getattr(request, "mm_features", None) or ())
        if cached is not None and (cached.epoch != self.identities.epoch
                                   or cached.mm_inputs != mm_inputs):
            # made before a weights reset (its keys are the old epoch's), or before the
            # request's inputs grew (a streaming-input session's update)
            cached = None
        if cached is None:
            ident = self.identities.of(request)
            if ident is PENDING:
                return PENDING
            cached = self._key_cache[rid] = _Keys(ident, self.identities.epoch,
                                                  mm_inputs=mm_inputs)
        n = num_tokens // self.ct
        have = cached.keys
        if len(have) < n:
            tokens = request.all_token_ids[: n * self.ct]
            extra = cached.identity.chunk_extra or b""
            have.extend(chunk_keys(
                cached.identity.namespace, tokens, self.ct, extra=extra,
                start_chunk=len(have), parent=have[-1] if have else None,
            ))
        return cached.identity.namespace, have[:n]

    def chunk_keys(self, request: Any) -> list[ChunkKey]:
        """Keys of the request's full chunks over all its tokens so far (``[]`` while its
        identity is pending or if it cannot be stored): the KV events' ``note``
        (``kvtier.vllm.events``). Scheduler thread; cached as ``_keys`` is."""
        try:
            got = self._keys(request, request.num_tokens)
        except Unsupported:
            return []
        return [] if got is PENDING else list(got[1])

    def _group_spec(self, ns: bytes, group: int, blocks: int) -> ChunkSpec:
        """What a piece of ``blocks`` blocks of KV-cache group ``group`` (0 with one group)
        of a request with namespace digest ``ns`` must be, exactly: every TP rank's first
        ``blocks`` blocks of that group's layers, rank after rank, packed
        (``StepCopier.slot``), and nothing else. One rank: the pre-TP shape, so objects
        stored before TP support stay readable."""
        layers = self.geom.group_layer_count(group)
        shape: tuple[int, ...] = (layers, blocks, self.geom.page_bytes)
        if self.geom.slot_ranks > 1:
            shape = (self.geom.slot_ranks, *shape)
        return ChunkSpec(ns, blocks * self.bs, self.geom.kv_dtype, shape,
                         self.geom.slot_ranks * layers * blocks * self.geom.page_bytes)

    def _spec(self, ns: bytes) -> ChunkSpec:
        """What every whole chunk of a single-group model must be."""
        return self._group_spec(ns, 0, self.bpc)

    def _tail_spec(self, ns: bytes, blocks: int) -> ChunkSpec:
        """What a tail (or a window part) of ``blocks`` blocks must be: a chunk's shape
        over its first ``blocks`` blocks (a whole chunk's spec when ``blocks`` is all)."""
        return self._group_spec(ns, 0, blocks)

    def _meta(self, ns: bytes, keys: Sequence[ChunkKey], c: int) -> ChunkMeta:
        return self._spec(ns).meta(keys[c], keys[c - 1] if c else None)

    def _tail_key(self, request: Any, keys: Sequence[ChunkKey], chunk: int,
                  blocks: int) -> ChunkKey:
        """The key of the request's tail of ``blocks`` blocks in chunk ``chunk`` (its
        keys up to ``chunk`` are in ``keys``; its identity is cached by ``_keys``)."""
        ident = self._key_cache[request.request_id].identity
        lo = chunk * self.ct
        extra = ident.chunk_extra(chunk) if ident.chunk_extra is not None else b""
        return tail_key(keys[chunk - 1] if chunk else ident.namespace,
                        request.all_token_ids[lo : lo + blocks * self.bs], extra)

    def _tail_candidates(self, request: Any, keys: Sequence[ChunkKey], chunk: int,
                         num_computed: int, limit: int) -> list[tuple[int, ChunkKey]]:
        """``(blocks, key)`` of every tail of chunk ``chunk`` that would restore something
        past ``num_computed`` below ``limit``, longest first (at most ``blocks_per_chunk
        - 1`` keys hashed)."""
        lo = chunk * self.ct
        if not self.tails or lo >= limit or chunk > len(keys):
            return []
        most = min(self.bpc - 1, (request.num_tokens - lo) // self.bs)
        return [(k, self._tail_key(request, keys, chunk, k)) for k in range(most, 0, -1)
                if lo + k * self.bs > num_computed]

    def _find_tail(self, request: Any, keys: Sequence[ChunkKey], chunk: int,
                   num_computed: int, limit: int) -> _FoundTail | None:
        """The longest stored tail of chunk ``chunk`` (the first one not stored whole)
        that would restore something past ``num_computed`` below ``limit``. Memory only:
        the candidates looked up in the indexes."""
        for k, key in self._tail_candidates(request, keys, chunk, num_computed, limit):
            found = self.store.lookup_indexed([key])
            if found.hits:
                return _FoundTail(chunk, k, key, found.tiers[0])
        return None

    def _window_keys(self, end_key: ChunkKey, end: int) -> tuple[list[tuple[int, int]],
                                                                 list[ChunkKey]]:
        """The parts of the window of a hit of ``end`` tokens, and their keys."""
        parts = window_parts(end // self.bs, self.geom.window_blocks, self.bpc)
        return parts, [window_key(end_key, i, len(parts)) for i in range(len(parts))]

    def _save_ends(self, top: int, num_computed: int, limit: int) -> Iterator[int]:
        """Where a saved prefix may end, past ``num_computed`` and at most ``limit`` tokens,
        longest first, from chunk ``top`` down: chunk boundaries (each costs hashing one
        key of 16 bytes) and, with tails, block boundaries inside a chunk (each costs
        hashing up to a chunk's tokens), those in the ``WINDOW_TAIL_CHUNKS`` highest
        chunks only."""
        tail_chunks = WINDOW_TAIL_CHUNKS if self.tails else 0
        for n in range(top, -1, -1):
            ends: list[int] = []
            if tail_chunks > 0:
                tail_chunks -= 1
                ends += [n * self.ct + k * self.bs for k in range(self.bpc - 1, 0, -1)]
            if n:
                ends.append(n * self.ct)
            for end in ends:
                if end > limit:
                    continue
                if end <= num_computed:
                    return
                yield end

    def _end_key(self, request: Any, keys: Sequence[ChunkKey], end: int) -> ChunkKey:
        """The chain key of the chunk or tail that ends at token ``end``."""
        n, rest = divmod(end, self.ct)
        return self._tail_key(request, keys, n, rest // self.bs) if rest else keys[n - 1]

    def _hybrid_pieces(self, request: Any, keys: Sequence[ChunkKey], end: int,
                       lo_block: int) -> list[Piece]:
        """The pieces of the prefix of ``end`` tokens that hold blocks past ``lo_block``
        (vLLM's own hit), in chain order."""
        n, rest = divmod(end, self.ct)
        tail = (rest // self.bs, self._end_key(request, keys, end)) if rest else None
        pieces = prefix_pieces(self.geom, self.bpc, keys[:n], tail,
                               start_chunk=lo_block // self.bpc)
        return [p for p in pieces if p.first + p.blocks > lo_block]
