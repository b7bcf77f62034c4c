"""Where a returning request's staging starts, per model shape: whole chunks (and a
tail) for full attention and MLA, the window of the longest stored prefix for a
sliding-window model, every group's pieces for a hybrid model. Each answers the
request's ``_Staging`` (its staging under way) or the hook's answer (0: nothing to
stage; None: ask again). Scheduler thread; memory only (store loads run on IO threads).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

from kvtier.keys import ChunkKey, group_key
from kvtier.metrics import record_drop
from kvtier.objformat import ChunkSpec
from kvtier.store import Lookup
from kvtier.vllm.hybrid import full_groups
from kvtier.vllm.scheduler.probes import Probes
from kvtier.vllm.scheduler.records import _Staging

log = logging.getLogger("kvtier.vllm")


class ShapeStarts(Probes):
    """The shape-specific starts of a lookup's staging."""

    def _chunk_start(self, request: Any, ns: bytes, keys: list[ChunkKey],
                     num_computed: int, limit: int) -> _Staging | tuple[int | None, bool]:
        """Start staging the stored chunks (and tail) past vLLM's own hit: its
        ``_Staging``, or the hook's answer when there is nothing to stage (0) or it must
        ask again (None: a probe or an announced chain pending, or no room now)."""
        rid = request.request_id
        first = num_computed // self.ct
        wanted = keys[: -(-limit // self.ct)]
        hit = self.store.lookup_indexed(wanted[first:])
        announced, ann_tail = self._announced(request, keys, limit)

        def missing() -> bool:  # announced by the prefill node, not visible here yet
            return announced > first + hit.hits or (
                ann_tail is not None and not self.store.lookup_indexed([ann_tail]).hits)

        beyond = wanted[first + hit.hits :]
        if ann_tail is not None:  # the announced chain: its chunks, then its tail
            beyond = wanted[first + hit.hits : announced]
            if not self.store.lookup_indexed([ann_tail]).hits:
                beyond.append(ann_tail)
        if self._probing(rid, beyond, missing()):
            return None, False
        if beyond:
            hit = self.store.lookup_indexed(wanted[first:])  # what a probe found
        if missing() and self.store.shared_up(every=False) and self._keep_waiting(rid):
            return None, False  # (no shared tier can answer: stop waiting now)
        waited = self.clock.monotonic() - self._waiting.pop(rid, self.clock.monotonic())
        t0 = time.perf_counter() - waited
        tail = self._find_tail(request, keys, first + hit.hits, num_computed, limit)
        if tail is None and self.tails and self.store.indexes_filling():
            # A lower tier's index is still filling (a restart): the tail may be stored
            # and not indexed yet. Its candidates are asked once, like the chunks were.
            cands = self._tail_candidates(request, keys, first + hit.hits, num_computed,
                                          limit)
            if self._probing(rid, [k for _, k in cands], False, alternatives=True,
                             tail=True):
                return None, False
            tail = self._find_tail(request, keys, first + hit.hits, num_computed, limit)
        if hit.hits == 0 and tail is None:
            return 0, False
        own = self._own_threshold(request)
        tiers, lim = list(hit.tiers), limit
        if tail is not None:  # an entry of its own, ending the restore where it ends
            tiers.append(tail.tier)
            lim = min(limit, tail.chunk * self.ct + tail.blocks * self.bs)
        d = self.policy.chunks_to_restore(
            num_computed, self.ct, self.slot_bytes,
            [self.store.tiers[i].name for i in tiers], limit_tokens=lim,
            fixed_tokens=own,
        )
        log.debug("kvtier: %s: %s", rid, d)
        self._decisions[rid] = d
        if d.chunks == 0:
            return 0, False
        staged = self._staged_chunks()
        # Other requests' staged KV fills the cap (it waits for admission): a restore
        # of more than one entry streams through the room left instead of waiting for
        # them; with no room for its first window, it waits (bounded: ``_cap_refused``)
        head = max(1, self._stream_window // 2)
        over = bool(staged) and staged + d.chunks > self._staged_cap
        if over:
            head = min(head, self._staged_cap - staged)
            if d.chunks < 2 or head < 1:
                return self._cap_refused(rid, num_computed, lim)
        self._cap_since.pop(rid, None)
        full = min(d.chunks, hit.hits)
        found, specs = hit.head(full), [self._spec(ns)] * full
        tail_blocks = 0
        if tail is not None and d.chunks > hit.hits:
            found = Lookup((*found.keys, tail.key), (*found.tiers, tail.tier))
            specs.append(self._tail_spec(ns, tail.blocks))
            tail_blocks = tail.blocks
        lk = _Staging(keys, first, full=full, tail_blocks=tail_blocks,
                     t0=t0, threshold=own, progress=self._progress(rid),
                     chunks=len(specs))
        if found.hits > self._staged_cap or (over and found.hits > head):
            # more than the staging cap holds (or has room for now): stream it; its first
            # entries are staged now, and prove the store answers before the whole
            # prefix is claimed
            lk.stream = (found, specs)
            lk.chunks = head
            found, specs = found.head(lk.chunks), specs[: lk.chunks]
        lk.future = self.store.load(found, specs, lk.progress)
        return lk

    def _cap_refused(self, rid: str, start_tokens: int,
                     end_tokens: int) -> tuple[int | None, bool]:
        """The hook's answer while the staging cap has no room for ``rid``'s restore of
        tokens ``[start_tokens, end_tokens)``: ask again (None), until it has waited as
        long as their recompute would take (``waitbound``; the configured load stall
        while the engine's speed is unmeasured): then 0, vLLM recomputes
        (``kvtier_drops_total{reason="staging_cap"}``). Before this bound a request could
        wait for room as long as other requests' staged KV waited for admission (up to
        ``STAGED_STEPS`` engine steps). Memory only."""
        now = self.clock.monotonic()
        since = self._cap_since.setdefault(rid, now)
        self._capped.setdefault(rid, time.perf_counter())
        if now - since <= self.waits.limit(self.load_stall_s, start_tokens, end_tokens):
            return None, False
        self._cap_since.pop(rid, None)
        self._capped.pop(rid, None)
        record_drop("staging_cap")
        log.info("kvtier: %s waited %.2f s for room under the staging cap; recomputing",
                 rid, now - since)
        return 0, False

    def _stage_whole(self, request: Any, keys: list[ChunkKey], first: int,
                     num_computed: int, end: int, found: Lookup, specs: list[ChunkSpec],
                     **staged: Any) -> _Staging | tuple[int | None, bool]:
        """Start staging ``found`` (a prefix restored whole or not at all: a window, a
        hybrid prefix) ending at token ``end``: its ``_Staging`` (with ``staged``'s
        fields), or the hook's answer when it restores less than the fixed threshold (0)
        or staged KV is waiting for admission (None)."""
        own = self._own_threshold(request)
        fixed = own if own is not None else self.policy.fixed_tokens
        if end - num_computed < max(1, fixed or 1):
            return 0, False
        held = self._staged_chunks()
        if held and held + len(specs) > self._staged_cap:
            return self._cap_refused(request.request_id, num_computed, end)
        self._cap_since.pop(request.request_id, None)
        lk = _Staging(keys, first, threshold=own, progress=self._progress(request.request_id),
                     chunks=len(specs), end=end, asked_at=num_computed, **staged)
        lk.future = self.store.load(found, specs, lk.progress)
        return lk

    def _find_window(self, request: Any, keys: Sequence[ChunkKey], num_computed: int,
                     limit: int) -> tuple[int, list[tuple[int, int]], Lookup] | None:
        """The longest prefix past ``num_computed``, at most ``limit`` tokens, whose window
        is stored whole (ends as ``_save_ends`` tries them): its end, the window's parts
        and where they are. Memory only."""
        for end in self._save_ends(min(limit // self.ct, len(keys)), num_computed, limit):
            parts, part_keys = self._window_keys(self._end_key(request, keys, end), end)
            hit = self.store.lookup_indexed(part_keys)
            if hit.hits == len(part_keys):
                return end, parts, hit
        return None

    def _window_start(self, request: Any, ns: bytes, keys: list[ChunkKey],
                      num_computed: int, limit: int) -> _Staging | tuple[int | None, bool]:
        """Start staging the window of the longest stored prefix of a sliding-window
        model's request: its ``_Staging``, or the hook's answer when there is nothing to
        stage (0) or no room now (None). Lower tiers are not probed: a window stored by
        another node is found once the tier's index has it."""
        found = self._find_window(request, keys, num_computed, limit)
        if found is None:
            return 0, False
        end, parts, hit = found
        return self._stage_whole(request, keys, 0, num_computed, end, hit,
                                 [self._tail_spec(ns, b) for _, b in parts], parts=parts)

    def _hybrid_start(self, request: Any, ns: bytes, keys: list[ChunkKey],
                      num_computed: int, limit: int) -> _Staging | tuple[int | None, bool]:
        """Start staging the longest stored prefix of a hybrid model's request past
        vLLM's own hit: every full-attention group's chunks (and tail) from that hit on,
        and every sliding-window group's window at its end (``hybrid.py``). Ends are
        tried as ``_save_ends`` lists them. Memory only; lower tiers are not probed (a
        prefix another node stored is found once the index has it)."""
        lo = num_computed // self.bs
        c0 = num_computed // self.ct
        full = full_groups(self.geom)
        top = min(limit // self.ct, len(keys))
        if full:  # chunks from c0 on that every full group holds
            flat = [group_key(keys[c], g) for c in range(c0, top) for g in full]
            top = c0 + self.store.lookup_indexed(flat).hits // len(full)
        for end in self._save_ends(top, num_computed, limit):
            pieces = self._hybrid_pieces(request, keys, end, lo)
            hit = self.store.lookup_indexed([p.key for p in pieces])
            if pieces and hit.hits == len(pieces):
                return self._stage_whole(
                    request, keys, c0, num_computed, end, hit,
                    [self._group_spec(ns, p.group, p.blocks) for p in pieces], pieces=pieces)
        return 0, False
