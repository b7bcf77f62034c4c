"""KV events: what kvtier holds, per medium, on vLLM's own KV event stream.

vLLM's scheduler publishes ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared``
(``--kv-events-config``, ZMQ) for the blocks on the GPU and merges in whatever the
connector's ``take_events()`` returns. ``KVEvents`` is kvtier's side of that: KV-aware
routers (llm-d's precise prefix-cache scorer, Dynamo's KV router) then see which node's
host pool (``CPU``) and which shared tier (``STORAGE``) hold a conversation's blocks.

What is published, with vLLM's own block hashes (``request.block_hashes``, converted as
vLLM converts them for its events):

* ``BlockStored`` for a chunk when it becomes READY in the host pool (a save, or a
  restore promoting it from a lower tier): ``medium="CPU"``, ``locality="LOCAL"``; and
  when this node's ``put`` wrote it into a lower tier (file, S3): ``medium="STORAGE"``,
  ``locality="REMOTE"`` (the lower tiers are shared by the fleet), ``ownership`` = the
  tier's name. One event per chunk: its ``blocks_per_chunk`` block hashes, the parent
  (the hash of the block before the chunk), its tokens, ``block_size`` = vLLM's block
  size, LoRA id and name, vLLM's per-block ``extra_keys``, ``group_idx`` and the group's
  ``kv_cache_spec_kind`` and ``kv_cache_spec_sliding_window`` (what vLLM's
  ``KVCacheManager.take_events`` sets on its own GPU events for that group).
  Self-contained (its own parent), so order is free.
* Hybrid models (several KV-cache groups, ``hybrid.py``): kvtier stores each group's
  piece as an object of its own, so each piece is one event of its group: a full group's
  chunk (``blocks_per_chunk`` blocks) or tail, a sliding-window or chunked-local group's
  window part; ``block_hashes`` are vLLM's block hashes of exactly those blocks (every
  group of a hybrid model kvtier stores has one block size, so a group's hashes are
  ``request.block_hashes``, as vLLM's ``cache_full_blocks`` resolves them), ``parent``
  the hash of the block before the piece, ``token_ids`` the piece's tokens: the event
  vLLM itself publishes for those blocks of that group on ``GPU``, but for ``medium``.
* ``BlockRemoved`` (same medium, locality, ownership, the chunk's hashes) when the copy
  in that medium goes: host eviction or removal (``reset_cache``), a lower tier's
  collection, expiry (by any process: seen when this node's index drops the key, i.e.
  its walk or a read notices), a corrupt object removed, or the mapping's cap
  (below). After a weights reset every claim this node made is withdrawn.
* ``AllBlocksCleared`` is never sent by kvtier: it carries no medium, so a router would
  drop the node's GPU blocks too (vLLM sends its own when it clears the GPU).

**Who publishes a shared object.** Only the node whose ``put`` created it (the writer):
the hook is on ``ObjectTier.put``'s ``STORED``, never on objects another node wrote
(found by the start scan, the walk or a probe), nor on ``EXISTS``. The writer also
publishes its removal, whoever removed it: when its own index drops the key. So a
subscriber to every node counts one object once, attributed to its writer; a router
must treat ``locality="REMOTE"`` ``STORAGE`` blocks as readable by every node sharing
that tier (``ownership`` names it). A restarted writer forgets its claims: the router
drops a restarted node's state anyway (vLLM's event stream starts afresh).

**Only what is known is claimed (precision first).** A chunk is published only if
``note`` saw the request it belongs to (its block hashes come from vLLM's request, not
from the chunk): whole chunks when noted (``note``, from vLLM's lookup on); a hybrid
model's tails and window parts when the request that stores them finishes
(``note_hybrid_end``). A single-group model's partial tails and window parts are not
noted, so not published. A hybrid piece another request stored and this one only
restores is published if its payload is still kept (``max_payloads``). Pieces of one
group may name the same blocks (a tail and the later whole chunk over it; the windows of
nearby ends): each is published when stored, and the removal of one names its blocks
though another piece may still hold them, so a router can under-count what is held
(recall), never over-count it. If the raw queue ever overflows, every claim is
withdrawn (removals for all), so the stream never says a block is held that is not.

**Bounded.** ``held``: chunk (or piece) key -> one ``bytes`` (a medium bit mask, the
group index, the parent hash, the piece's block hashes; 8 bytes a hash with vLLM's
default integer hashes) for each piece published as held somewhere; at most
``max_chunks`` (oldest claims withdrawn beyond, in batches). ``payloads``: the tokens
and extra keys a ``BlockStored`` needs, kept for the ``max_payloads`` most recently noted
pieces; a piece that reaches a tier after its payload went is published with empty
``token_ids``. ``held_bytes`` measures what one held piece costs (README: the figure at
1M chunks).

Threads: ``observe`` (the tiers' hooks) may be called from any thread, under the tiers'
locks: it only appends to a ``deque`` (never blocks). ``note``, ``take``, ``pending``,
``withdraw_all`` run on vLLM's scheduler thread only; ``take`` does no I/O.
"""

from __future__ import annotations

import logging
import sys
from array import array
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvtier.keys import ChunkKey, group_key

log = logging.getLogger("kvtier.vllm.events")

MEDIUM_CPU = "CPU"
MEDIUM_STORAGE = "STORAGE"
LOCAL = "LOCAL"
REMOTE = "REMOTE"

#: Raw observations waiting for ``take`` at most; beyond, every claim is withdrawn.
MAX_RAW = 1 << 20
#: Default cap of chunks claimed held (``held``).
MAX_CHUNKS = 1_000_000
#: Default number of chunks whose store payload (tokens, extra keys) is kept.
MAX_PAYLOADS = 16_384

_NO_PARENT = 0
_PARENT = 1


@dataclass(frozen=True, slots=True)
class Medium:
    """How one tier (index 0: host) is published."""

    medium: str
    locality: str
    ownership: str | None


@dataclass(frozen=True, slots=True)
class GroupMeta:
    """What vLLM's store events say of a KV-cache group (``KVCacheManager``'s
    ``kv_cache_event_metadata``): its spec's kind and sliding window."""

    kind: str | None = None
    sliding_window: int | None = None


@dataclass(frozen=True, slots=True)
class _Payload:
    """What a ``BlockStored`` carries besides the hashes (``MAX_PAYLOADS`` kept)."""

    record: bytes  # the ``held`` record without its mask byte
    tokens: array[int]
    lora_id: int | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None
    session_id: str | None


def _event_types() -> tuple[Any, Any]:
    from vllm.distributed.kv_events import BlockRemoved, BlockStored

    return BlockStored, BlockRemoved


class KVEvents:
    """kvtier's KV events (module docstring): tiers' raw observations in, vLLM events
    out. ``tiers[i]`` says how tier ``i`` of the store is published (0: the host)."""

    def __init__(
        self,
        tiers: Sequence[Medium],
        *,
        block_size: int,
        blocks_per_chunk: int,
        chunk_tokens: int,
        groups: Sequence[GroupMeta] = (),
        full_groups: Sequence[int] | None = None,
        max_chunks: int = MAX_CHUNKS,
        max_payloads: int = MAX_PAYLOADS,
        convert: Callable[[Any], int | bytes] | None = None,
    ) -> None:
        """``groups``: vLLM's KV-cache groups (one ``GroupMeta`` each; empty: one group
        of unknown kind). ``full_groups``: a hybrid model's full-attention groups (their
        chunks are keyed ``group_key(chunk key, group)``); None for one group."""
        if not 1 <= len(tiers) <= 8:
            raise ValueError("between 1 and 8 tiers (one mask byte)")
        if len(groups) > 256:
            raise ValueError("at most 256 KV-cache groups (one group byte)")
        if max_chunks < 1 or max_payloads < 1:
            raise ValueError("max_chunks and max_payloads must be >= 1")
        self.tiers = list(tiers)
        self.block_size = block_size
        self.bpc = blocks_per_chunk
        self.ct = chunk_tokens
        self.groups = list(groups) or [GroupMeta()]
        self.full_groups = tuple(full_groups) if full_groups is not None else None
        self.max_chunks = max_chunks
        self.max_payloads = max_payloads
        if convert is None:
            from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

            convert = maybe_convert_block_hash
        self._convert: Callable[[Any], int | bytes] = convert
        self._width = 0  # bytes a hash takes in a record (8: ints; else the hash's own)
        self._ints = True
        self._raw: deque[tuple[int, bool, ChunkKey]] = deque()
        self._overflow = False
        self.held: dict[ChunkKey, bytes] = {}
        self.payloads: dict[ChunkKey, _Payload] = {}
        self._withdrawn: list[Any] = []  # removals queued by withdraw_all / the caps
        self.published = 0  # events handed to vLLM (tests, metrics)

    # -- any thread ----------------------------------------------------------------------
    def observe(self, tier: int, stored: bool, key: ChunkKey) -> None:
        """A tier's hook: ``key`` became held (``stored``) or left tier ``tier``. Only
        appends (``deque.append`` is atomic); never blocks."""
        if len(self._raw) >= MAX_RAW:
            self._overflow = True
            return
        self._raw.append((tier, stored, key))

    def attach(self, host_index: Any, lower: Sequence[Any]) -> None:
        """Hook the host tier's ``SlotIndex`` and each lower ``ObjectTier`` (in store
        order; a tier without the hooks is never published)."""
        host_index.observer = lambda stored, key: self.observe(0, stored, key)
        for i, tier in enumerate(lower, start=1):
            if i >= len(self.tiers) or not hasattr(tier, "on_stored"):
                continue
            tier.on_stored = partial_observe(self, i, True)
            tier.index.on_forget = partial_observe(self, i, False)

    # -- scheduler thread ----------------------------------------------------------------
    def pending(self) -> bool:
        """Observations (or withdrawals) wait for ``take``. Memory only."""
        return bool(self._raw) or bool(self._withdrawn) or self._overflow

    def note(self, request: Any, keys: Sequence[ChunkKey], first: int = 0) -> int:
        """Remember how chunks ``first..len(keys)-1`` of ``request`` (``keys[c]`` covers
        its tokens ``[c*chunk_tokens, (c+1)*chunk_tokens)``) map to vLLM's block hashes,
        so their stores and removals can be published: the chunk itself with one group,
        each full-attention group's piece of it in a hybrid model. Chunks whose blocks
        vLLM has not hashed yet are skipped. Returns the pieces noted. Scheduler thread
        only."""
        n = min(len(keys), len(request.block_hashes) // self.bpc)
        pieces: list[tuple[ChunkKey, int, int, int]] = []
        for c in range(first, n):
            if self.full_groups is None:
                pieces.append((keys[c], 0, c * self.bpc, self.bpc))
            else:
                pieces.extend((group_key(keys[c], g), g, c * self.bpc, self.bpc)
                              for g in self.full_groups)
        return self.note_pieces(request, pieces)

    def note_pieces(self, request: Any,
                    pieces: Sequence[tuple[ChunkKey, int, int, int]]) -> int:
        """Remember pieces of ``request``: ``(key, group, first block, blocks)`` each, the
        object keyed ``key`` holding blocks ``first..first+blocks-1`` of KV-cache group
        ``group`` (one group's blocks are named by ``request.block_hashes``). Pieces
        already remembered, and those whose blocks vLLM has not hashed, are skipped.
        Returns the pieces noted. Scheduler thread only."""
        hashes = request.block_hashes
        lora = getattr(request, "lora_request", None)
        lora_id = lora.adapter_id if lora is not None else None
        lora_name = lora.name if lora is not None else None
        session = getattr(request, "session_id", None)
        tokens = request.all_token_ids
        bs = self.block_size
        done = 0
        for key, group, lo, blocks in pieces:
            if key in self.payloads or not 0 <= group < len(self.groups) or blocks < 1 \
                    or lo + blocks > len(hashes):
                continue
            record = self._record(group, hashes[lo - 1] if lo else None,
                                  hashes[lo : lo + blocks])
            if record is None:
                continue
            self.payloads[key] = _Payload(
                record, array("i", tokens[lo * bs : (lo + blocks) * bs]), lora_id,
                lora_name, _extra_keys(request, lo * bs, bs, blocks), session)
            done += 1
        if len(self.payloads) > self.max_payloads:
            _drop_oldest(self.payloads, len(self.payloads) - self.max_payloads
                         + self.max_payloads // 16)
        return done

    def take(self) -> list[Any]:
        """The events since the last call, in the order the tiers saw them (adjacent
        removals of one tier merged). Scheduler thread only; memory only."""
        block_stored, block_removed = _event_types()
        out: list[Any] = self._withdrawn
        self._withdrawn = []
        if self._overflow:
            self._raw.clear()
            self._overflow = False
            log.warning("kvtier: KV event queue overflowed; withdrawing every claim")
            out.extend(self._removals(list(self.held.items()), block_removed))
            self.held.clear()
        last_removed: tuple[int, int, list[Any]] | None = None
        while self._raw:
            tier, stored, key = self._raw.popleft()
            bit = 1 << tier
            rec = self.held.get(key)
            if stored:
                if rec is not None and rec[0] & bit:
                    continue
                pay = self.payloads.get(key)
                if rec is None:
                    if pay is None:
                        continue  # not a chunk this node can name (another node's, a tail)
                    rec = bytes([bit]) + pay.record
                else:
                    rec = bytes([rec[0] | bit]) + rec[1:]
                self.held[key] = rec
                out.append(self._stored(tier, rec, pay, block_stored))
                last_removed = None
            else:
                if rec is None or not rec[0] & bit:
                    continue
                mask = rec[0] & ~bit
                if mask:
                    self.held[key] = bytes([mask]) + rec[1:]
                else:
                    del self.held[key]
                hashes = self._hashes(rec)
                if last_removed is not None and last_removed[:2] == (tier, rec[1]):
                    last_removed[2].extend(hashes)
                else:
                    ev = self._removed(tier, rec[1], hashes, block_removed)
                    out.append(ev)
                    last_removed = (tier, rec[1], ev.block_hashes)
        if len(self.held) > self.max_chunks:
            n = len(self.held) - self.max_chunks + self.max_chunks // 16
            victims = [(k, self.held[k]) for k in _first(self.held, n)]
            for k, _ in victims:
                del self.held[k]
            out.extend(self._removals(victims, block_removed))
        self.published += len(out)
        return out

    def withdraw_all(self) -> int:
        """Queue a removal of every claim (a weights reset: this node no longer serves
        what it stored before) and forget them; returns the chunks withdrawn."""
        _, block_removed = _event_types()
        n = len(self.held)
        self._withdrawn.extend(self._removals(list(self.held.items()), block_removed))
        self.held.clear()
        self.payloads.clear()
        return n

    @staticmethod
    def held_bytes(record: bytes, key: ChunkKey) -> int:
        """Bytes one ``held`` entry costs: the record (3 header bytes, the parent and the
        piece's hashes), the key, and the dict's slot
        (three words) plus its share of the hash table (about one more word at the
        table's lowest load)."""
        return sys.getsizeof(record) + sys.getsizeof(key) + 4 * 8

    # -- internals -----------------------------------------------------------------------
    def _record(self, group: int, parent: Any, hashes: Sequence[Any]) -> bytes | None:
        """A ``held`` record less its mask byte: the group, the parent flag and hash
        (zeros without), the hashes (``_width`` bytes each)."""
        if not hashes or any(h is None for h in hashes):
            return None
        conv = [self._convert(h) for h in hashes]
        if not self._width:
            self._ints = isinstance(conv[0], int)
            self._width = 8 if self._ints else len(conv[0])  # type: ignore[arg-type]
        parts = [self._pack(h) for h in conv]
        if any(p is None for p in parts):
            return None
        head = bytes([group]) + (
            bytes([_NO_PARENT]) + bytes(self._width) if parent is None else
            bytes([_PARENT]) + (self._pack(self._convert(parent)) or bytes(self._width)))
        return head + b"".join(p for p in parts if p is not None)

    def _pack(self, h: int | bytes) -> bytes | None:
        if self._ints:
            return h.to_bytes(8, "big") if isinstance(h, int) else None
        return bytes(h) if isinstance(h, bytes) and len(h) == self._width else None

    def _unpack(self, b: bytes) -> int | bytes:
        return int.from_bytes(b, "big") if self._ints else b

    def _hashes(self, rec: bytes) -> list[int | bytes]:
        w = self._width
        start = 3 + w
        return [self._unpack(rec[i : i + w]) for i in range(start, len(rec), w)]

    def _parent(self, rec: bytes) -> int | bytes | None:
        return self._unpack(rec[3 : 3 + self._width]) if rec[2] == _PARENT else None

    def _stored(self, tier: int, rec: bytes, pay: _Payload | None, cls: Any) -> Any:
        m = self.tiers[tier]
        group = self.groups[rec[1]]
        return cls(
            block_hashes=self._hashes(rec),
            parent_block_hash=self._parent(rec),
            token_ids=list(pay.tokens) if pay is not None else [],
            block_size=self.block_size,
            lora_id=pay.lora_id if pay is not None else None,
            medium=m.medium,
            lora_name=pay.lora_name if pay is not None else None,
            extra_keys=pay.extra_keys if pay is not None else None,
            group_idx=rec[1],
            kv_cache_spec_kind=group.kind,
            kv_cache_spec_sliding_window=group.sliding_window,
            locality=m.locality,
            ownership=m.ownership,
            session_id=pay.session_id if pay is not None else None,
        )

    def _removed(self, tier: int, group: int, hashes: list[int | bytes], cls: Any) -> Any:
        m = self.tiers[tier]
        return cls(block_hashes=hashes, medium=m.medium, group_idx=group,
                   locality=m.locality, ownership=m.ownership)

    def _removals(self, recs: list[tuple[ChunkKey, bytes]], cls: Any) -> list[Any]:
        """One removal per tier and group for every claim in ``recs``."""
        by_tier: dict[tuple[int, int], list[int | bytes]] = {}
        for _, rec in recs:
            for tier in range(len(self.tiers)):
                if rec[0] & (1 << tier):
                    by_tier.setdefault((tier, rec[1]), []).extend(self._hashes(rec))
        return [self._removed(t, g, h, cls) for (t, g), h in sorted(by_tier.items())]


def partial_observe(events: KVEvents, tier: int, stored: bool) -> Callable[[ChunkKey], None]:
    """A one-argument hook for tier ``tier``."""
    return lambda key: events.observe(tier, stored, key)


def _first(d: dict[ChunkKey, Any], n: int) -> list[ChunkKey]:
    out: list[ChunkKey] = []
    for k in d:
        if len(out) >= n:
            break
        out.append(k)
    return out


def _drop_oldest(d: dict[ChunkKey, Any], n: int) -> None:
    for k in _first(d, n):
        del d[k]


def _extra_keys(request: Any, start: int, block_size: int,
                blocks: int) -> list[tuple[Any, ...] | None] | None:
    """vLLM's per-block ``extra_keys`` for the blocks from token ``start`` on, as its GPU
    events carry them (None where vLLM's helpers are not there: a plain request object)."""
    try:
        from vllm.v1.core.kv_cache_utils import (
            generate_block_hash_extra_keys,
            to_event_extra_keys,
        )
    except ImportError:  # pragma: no cover - vLLM is a dependency
        return None
    if not hasattr(request, "mm_features"):
        return None
    keys: list[tuple[Any, ...] | None] = []
    mm = 0
    for b in range(blocks):
        lo = start + b * block_size
        extra, mm = generate_block_hash_extra_keys(request, lo, lo + block_size, mm)
        keys.append(extra)
    return to_event_extra_keys(keys)


def events_for(sched: Any, kv_cache_config: Any) -> KVEvents:
    """The KV events of a scheduler side (``SchedulerSide``), hooked to its store, with
    each KV-cache group's kind and sliding window as vLLM publishes them
    (``group_meta``)."""
    geom = sched.geom
    full: list[int] | None = None
    if geom.groups:
        from kvtier.vllm.hybrid import full_groups

        full = full_groups(geom)
    store = sched.store
    ev = KVEvents(tier_media([t.name for t in store.tiers]), block_size=sched.bs,
                  blocks_per_chunk=sched.bpc, chunk_tokens=sched.ct,
                  groups=group_meta(kv_cache_config), full_groups=full,
                  max_chunks=sched.cfg.events.max_chunks,
                  max_payloads=sched.cfg.events.max_payload_chunks)
    ev.attach(store.host.index, [lt.tier for lt in store.lower])
    log.info("kvtier: KV events on: host as CPU, %s as STORAGE; at most %d pieces claimed%s",
             ", ".join(lt.tier.name for lt in store.lower) or "no lower tier", ev.max_chunks,
             f"; {len(geom.groups)} KV-cache groups" if geom.groups else "")
    return ev


def group_meta(kv_cache_config: Any) -> list[GroupMeta]:
    """Each KV-cache group's kind and sliding window, as vLLM's ``KVCacheManager`` sets
    them on its store events (``get_kv_cache_spec_kind``, ``..._sliding_window``); one
    group of unknown kind without a config."""
    try:
        from vllm.v1.kv_cache_interface import (
            get_kv_cache_spec_kind,
            get_kv_cache_spec_sliding_window,
        )

        return [GroupMeta(get_kv_cache_spec_kind(g.kv_cache_spec).value,
                          get_kv_cache_spec_sliding_window(g.kv_cache_spec))
                for g in kv_cache_config.kv_cache_groups]
    except (ImportError, AttributeError):
        return []


def note_hybrid_end(events: KVEvents, sched: Any, request: Any,
                    block_ids: Sequence[Sequence[int]]) -> int:
    """Before a hybrid model's finished request is stored (``request_finished_all_groups``,
    scheduler thread): note the pieces of the prefix it ends, as the scheduler side
    computes them (``SchedulerSide.request_finished_groups``: the blocks every full group
    holds, at most the saveable tokens; ``hybrid.prefix_pieces``), so its tail and
    window parts are published once stored. Returns the pieces newly noted; 0 for one
    group, or when the request's keys are not known."""
    from kvtier.vllm.hybrid import full_groups

    geom = sched.geom
    if not geom.groups or not block_ids:
        return 0
    full = full_groups(geom)
    held = min(len(block_ids[g]) for g in (full or range(len(block_ids))))
    # the saveable tokens: computed ones, never the last (sampled) token
    saveable = max(0, min(int(request.num_computed_tokens), int(request.num_tokens) - 1))
    n_blocks = min(saveable // sched.bs, held)
    n_chunks, tail = divmod(n_blocks, sched.bpc)
    if not sched.tails:
        tail = 0
    keys = sched.chunk_keys(request)
    end = n_chunks * sched.ct + tail * sched.bs
    if not end or len(keys) < n_chunks:
        return 0
    try:
        pieces = sched._hybrid_pieces(request, keys[:n_chunks], end, 0)
    except KeyError:  # a tail-only prefix whose identity is pending: nothing is stored
        return 0
    return events.note_pieces(request, [(p.key, p.group, p.first, p.blocks) for p in pieces])


def tier_media(names: Sequence[str]) -> list[Medium]:
    """How a store's tiers are published: the host (``names[0]``) as this node's ``CPU``,
    every lower tier as shared ``STORAGE`` owned by its name."""
    return [Medium(MEDIUM_CPU, LOCAL, None),
            *(Medium(MEDIUM_STORAGE, REMOTE, n) for n in names[1:])]
