"""A request's finish: ``request_finished`` (vLLM's eviction hook) and
``request_finished_groups`` per model shape, the request's state dropped, and the
response's ``kv_transfer_params``. Scheduler thread; memory only.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

from kvtier.keys import ChunkKey
from kvtier.metrics import record_drop
from kvtier.vllm.hybrid import full_groups, local_groups, saveable_groups
from kvtier.vllm.identity import PENDING, Unsupported
from kvtier.vllm.scheduler.records import (
    _saveable_tokens,
    _SavePiece,
)
from kvtier.vllm.scheduler.save import Saves
from kvtier.vllm.window import saveable

log = logging.getLogger("kvtier.vllm")


class Finish(Saves):
    """The eviction hooks and the response's ``kv_transfer_params``."""

    def request_finished(
        self, request: Any, block_ids: Sequence[int]
    ) -> tuple[bool, dict[str, Any]]:
        """Reserve slots for the request's unsaved full chunks and, with ``partial_tails``,
        its tail: the full blocks of its last, partial chunk.

        Returns (delay freeing the blocks, ``kv_transfer_params`` for the response):
        the params say what kvtier restored for this request and what it now holds:
        ``namespace``, ``tokens`` (the prefix, prompt and output, that is stored or being
        stored: whole chunks, then possibly a tail's blocks; what a P/D decode node may
        wait for), ``last_key`` (names the whole chain: the tail's key when ``tokens``
        ends in one) and ``expires_at`` (wall clock, end of the shared-tier lease unless
        renewed), plus restore statistics.
        """
        rid = request.request_id
        restored, restore_ms, seen_epoch, loading = self._end_or_loading(rid)
        if loading is not None:
            return False, loading
        n_blocks = min(_saveable_tokens(request) // self.bs, len(block_ids))
        n_chunks, tail_blocks = divmod(n_blocks, self.bpc)
        if not self.tails:
            tail_blocks = 0
        return self.shape.finish(request, n_chunks, tail_blocks, block_ids, seen_epoch,
                                 restored, restore_ms)

    def _chunk_finished(
        self, request: Any, n_chunks: int, tail_blocks: int, block_ids: Sequence[int],
        seen_epoch: int, restored: dict[str, int], restore_ms: float,
    ) -> tuple[bool, dict[str, Any]]:
        """``request_finished`` of a full-attention (or MLA) model: save its whole chunks
        not stored yet, then its tail (``_save``)."""
        rid = request.request_id
        try:
            got = self._keys(request, n_chunks * self.ct)
        except Unsupported:
            got = PENDING
        if seen_epoch != self.identities.epoch:
            got = PENDING  # it ran across a weights reset: its KV may mix both weights
        if got is PENDING:  # identity unknown (or refused): store nothing
            n_chunks, tail_blocks, got = 0, 0, (b"", [])
        ns, keys = got
        tail = None
        if tail_blocks:
            key = self._tail_key(request, keys, n_chunks, tail_blocks)
            meta = self._tail_spec(ns, tail_blocks).meta(
                key, keys[n_chunks - 1] if n_chunks else None)
            lo = n_chunks * self.bpc
            tail = _SavePiece(key, meta, list(block_ids[lo : lo + tail_blocks]), tail_blocks)
            if self.on_pieces is not None:
                self.on_pieces(request, [(key, 0, lo, tail_blocks)])
        wanted = (n_chunks or tail) and self._may_save(request)
        saved, held = (self._save(rid, request, ns, keys, block_ids, tail) if wanted
                       else (0, 0))
        self._key_cache.pop(rid, None)
        tokens = min(held, n_chunks) * self.ct
        last = keys[held - 1] if 0 < held <= n_chunks else None
        if held > n_chunks:
            assert tail is not None
            tokens, last = tokens + tail.span * self.bs, tail.key
        whole = n_chunks * self.slot_bytes + (tail.meta.payload_len if tail else 0)
        return self._delays(rid, saved), self._params(rid, ns, tokens, last, restored, restore_ms,
                                       saved, whole)

    def request_finished_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any]]:
        """``request_finished_all_groups``: one group goes to ``request_finished``; a
        hybrid model saves the pieces of the prefix the request ends (``hybrid.py``)."""
        return self.shape.finish_groups(request, block_ids)

    def _one_group_finished(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any]]:
        """``request_finished_groups`` of a single-group model: ``request_finished``."""
        return self.request_finished(request, block_ids[0])

    def _hybrid_finished(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any]]:
        """``request_finished_groups`` of a hybrid model: save the pieces of the prefix
        the request ends, every group's (``hybrid.py``)."""
        rid = request.request_id
        restored, restore_ms, seen_epoch, loading = self._end_or_loading(rid)
        if loading is not None:
            return False, loading
        full = full_groups(self.geom)
        held_blocks = min(len(block_ids[g]) for g in (full or range(len(block_ids))))
        n_blocks = min(_saveable_tokens(request) // self.bs, held_blocks)
        n_chunks, tail_blocks = divmod(n_blocks, self.bpc)
        if not self.tails:
            tail_blocks = 0
        try:
            got = self._keys(request, n_chunks * self.ct)
        except Unsupported:
            got = PENDING
        end = n_chunks * self.ct + tail_blocks * self.bs
        if seen_epoch != self.identities.epoch or got is PENDING or not end or \
                not self._may_save(request):
            self._key_cache.pop(rid, None)
            ns = b"" if got is PENDING else got[0]
            return False, self._params(rid, ns, 0, None, restored, restore_ms, 0, 0)
        ns, keys = got
        pieces = self._hybrid_pieces(request, keys, end, 0)
        if self.on_pieces is not None:
            self.on_pieces(request, [(p.key, p.group, p.first, p.blocks) for p in pieces])
        local = local_groups(self.geom)
        windows = [p for p in pieces if p.group in local]
        if not saveable_groups(self.geom, block_ids, windows):
            # a window group freed the window's first block (the corner): the chunks are
            # still worth keeping for longer prefixes; this end is not restorable
            record_drop("window_freed")
            pieces = [p for p in pieces if p.group not in local]
            complete = False
        else:
            complete = True
        if not saveable_groups(self.geom, block_ids, pieces):
            log.error("kvtier: %s: a full-attention group's blocks are vLLM's null block; "
                      "storing nothing", rid)
            self._key_cache.pop(rid, None)
            return False, self._params(rid, ns, 0, None, restored, restore_ms, 0, 0)
        saves = [_SavePiece(p.key, self._group_spec(ns, p.group, p.blocks).meta(p.key, p.parent),
                        list(block_ids[p.group][p.first : p.first + p.blocks]), p.span,
                        p.group) for p in pieces]
        stored = self.store.lookup_indexed([p.key for p in saves]).hits
        whole = sum(p.meta.payload_len for p in saves)
        saved, held = self._save_pieces(rid, request, keys, saves[stored:], stored, stored,
                                        supersede=False, baseline=whole)
        self._key_cache.pop(rid, None)
        tokens, last = (end, saves[-1].key) if complete and held == len(saves) else (0, None)
        return self._delays(rid, saved), self._params(rid, ns, tokens, last, restored,
                                                      restore_ms, saved, whole)

    def _window_finished(
        self, request: Any, n_chunks: int, tail_blocks: int, block_ids: Sequence[int],
        seen_epoch: int, restored: dict[str, int], restore_ms: float,
    ) -> tuple[bool, dict[str, Any]]:
        """``request_finished`` of a sliding-window model: save the window of the
        request's prefix down to its last block (down to its last chunk without tails),
        if vLLM still holds all of it. ``tokens`` announces that prefix once its window
        is stored or being stored; ``last_key`` is the key of the window's last part."""
        rid = request.request_id
        try:
            got = self._keys(request, n_chunks * self.ct)
        except Unsupported:
            got = PENDING
        if seen_epoch != self.identities.epoch or got is PENDING:
            self._key_cache.pop(rid, None)
            return False, self._params(rid, b"", 0, None, restored, restore_ms, 0, 0)
        ns, keys = got
        end = n_chunks * self.ct + tail_blocks * self.bs
        saved = whole = tokens = 0
        last: ChunkKey | None = None
        if end and self._may_save(request):
            last = self._end_key(request, keys, end)
            parts, part_keys = self._window_keys(last, end)
            if not saveable(list(block_ids), parts):
                record_drop("window_freed")
                last = None
            else:
                if self.on_pieces is not None:  # the KV events: the parts' blocks
                    self.on_pieces(request, [(k, 0, b, n) for k, (b, n)
                                             in zip(part_keys, parts, strict=True)])
                # part i's parent is part i - 1, part 0's the piece ending the prefix:
                # ``last_key`` names the last part, and a lease renewal walks the window
                prevs = [last, *part_keys[:-1]]
                pieces = [_SavePiece(k, self._tail_spec(ns, n).meta(k, prev),
                                 list(block_ids[b : b + n]), n if n < self.bpc else 0)
                          for k, prev, (b, n) in zip(part_keys, prevs, parts, strict=True)]
                stored = self.store.lookup_indexed(part_keys).hits
                whole = sum(p.meta.payload_len for p in pieces)
                saved, held = self._save_pieces(rid, request, keys, pieces[stored:],
                                                stored, stored, supersede=False,
                                                baseline=whole)
                tokens, last = (end, part_keys[-1]) if held == len(pieces) else (0, None)
        self._key_cache.pop(rid, None)
        return self._delays(rid, saved), self._params(rid, ns, tokens, last, restored, restore_ms,
                                       saved, whole)

    def _delays(self, rid: str, saved: int) -> bool:
        """Whether vLLM keeps ``rid``'s blocks after it finished: while its save copies
        ``saved`` bytes, or waits for host slots (a streamed save)."""
        return saved > 0 or rid in self._save_streams

    def _end_request(self, rid: str) -> tuple[dict[str, int], float, int]:
        """A finished (or aborted) request's per-request state is dropped: returns what it
        restored (by tier), its staging time and the weights epoch it was first seen in."""
        self._forget(rid)
        st = self._streams.pop(rid, None)
        if st is not None:
            st.cancel()  # the worker reports it received once its copies are done
            if not st.told:
                self._tell_ended(rid)  # ... and must learn of it first
        self._unconfirmed.pop(rid, None)
        self._waiting.pop(rid, None)
        self._probes.pop(rid, None)
        self._tail_probes.pop(rid, None)
        self._async_blocks.pop(rid, None)
        self._recving.discard(rid)
        self._load_failed.discard(rid)
        self._capped.pop(rid, None)
        self._cap_since.pop(rid, None)
        restored, restore_ms = self._restored.pop(rid, ({}, 0.0))
        return restored, restore_ms, self._epoch_of.pop(rid, self.identities.epoch)

    def _end_or_loading(self, rid: str) -> tuple[dict[str, int], float, int,
                                                  dict[str, Any] | None]:
        """``_end_request``, and the ``kv_transfer_params`` of a request that finished
        (was aborted) while its asynchronous load (a hybrid model's, or a streamed one)
        is in flight, else None. Such a request saves nothing: its blocks hold nothing
        computed yet, and vLLM frees them when the load is reported (a save would free
        them a second time)."""
        loading = rid in self._recving
        restored, restore_ms, seen_epoch = self._end_request(rid)
        if not loading:
            return restored, restore_ms, seen_epoch, None
        self._key_cache.pop(rid, None)
        return (restored, restore_ms, seen_epoch,
                self._params(rid, b"", 0, None, restored, restore_ms, 0, 0))

    def _params(self, rid: str, ns: bytes, tokens: int, last: ChunkKey | None,
                restored: dict[str, int], restore_ms: float, saved: int,
                whole: int) -> dict[str, Any]:
        """A finished request's ``kv_transfer_params`` (``request_finished``)."""
        params = {
            "namespace": ns.hex(),
            "tokens": tokens,
            "last_key": None if last is None else last.hex(),
            "restored_tokens": sum(restored.values()),
            "restored_by_tier": restored,
            "restore_ms": round(restore_ms, 3),
            "decision": self._decision(rid),
            "expires_at": time.time() + self.lease_s,
            "role": self.role,
            "spilled_bytes": saved,
            "write_through_bytes": whole,
        }
        return {"kvtier": params}

    def pd_answer(self, request: Any,
                  params: dict[str, Any] | None) -> dict[str, Any] | None:
        """The response's ``kv_transfer_params`` in the P/D protocol of vLLM's own proxy
        and llm-d's routing sidecar: a prefill request comes with ``do_remote_decode:
        true`` (and ``max_tokens: 1``), and whatever ``kv_transfer_params`` its response
        carries is handed to the decode node's request. So the prefill node's answer
        says ``do_remote_prefill: true`` and carries ``kvtier.expect``: the chunks (and
        tail) it stored or is storing, which the decode node waits for (bounded) and
        restores (``Probes._announced``). Other requests' params are returned as they
        are. Memory only."""
        kvp = getattr(request, "kv_transfer_params", None)
        if params is None or not isinstance(kvp, dict) or not kvp.get("do_remote_decode"):
            return params
        mine = params.get("kvtier")
        out: dict[str, Any] = {**params, "do_remote_prefill": True, "do_remote_decode": False}
        if isinstance(mine, dict) and mine.get("tokens") and mine.get("last_key"):
            out["kvtier"] = {**mine, "expect": {k: mine[k] for k in
                                                ("namespace", "tokens", "last_key")}}
        return out

    def _decision(self, rid: str) -> dict[str, str] | None:
        """The restore-or-recompute decision for ``rid``, for its response (why kvtier
        restored what it did): ``{"outcome": ..., "detail": ...}``."""
        d = self._decisions.pop(rid, None)
        return None if d is None else {"outcome": d.outcome.value, "detail": str(d)}
