"""KV events: what kvtier holds, per medium, on vLLM's own KV event stream.

vLLM's scheduler publishes ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared``
(``--kv-events-config``, ZMQ) for the blocks on the GPU and merges in whatever the
connector's ``take_events()`` returns. ``KVEvents`` is kvtier's side of that: KV-aware
routers (llm-d's precise prefix-cache scorer, Dynamo's KV router) then see which node's
host pool (``CPU``) and which shared tier (``STORAGE``) hold a conversation's blocks.

What is published, with vLLM's own block hashes (``request.block_hashes``, converted as
vLLM converts them for its events):

* ``BlockStored`` when a piece (a chunk, a tail, a window part, a hybrid model's piece)
  becomes READY in the host pool (a save, or a restore promoting it from a lower tier):
  ``medium="CPU"``, ``locality="LOCAL"``; and when this node's ``put`` wrote it into a
  lower tier (file, S3): ``medium="STORAGE"``, ``locality="REMOTE"`` (the lower tiers
  are shared by the fleet), ``ownership`` = the tier's name. It names the piece's blocks
  not held in that medium before (below): their hashes, the parent (the hash of the
  block before them), their tokens, ``block_size`` = vLLM's block size, LoRA id and
  name, vLLM's per-block ``extra_keys``, ``group_idx`` and the group's
  ``kv_cache_spec_kind`` and ``kv_cache_spec_sliding_window`` (what vLLM's
  ``KVCacheManager.take_events`` sets on its own GPU events for that group): the event
  vLLM itself publishes for those blocks of that group on ``GPU``, but for ``medium``.
  Self-contained (its own parent), so order is free.
* Pieces: a single-group model's whole chunks (``blocks_per_chunk`` blocks) and partial
  tails (the full blocks of its last, partial chunk: ``partial_tails``), a
  sliding-window model's window parts (``window.py``), and per group a hybrid model's
  (``hybrid.py``: a full group's chunks and tail, a sliding-window or chunked-local
  group's window parts). Every group of a model kvtier stores has one block size, so a
  group's hashes are ``request.block_hashes``, as vLLM's ``cache_full_blocks`` resolves
  them.
* ``BlockRemoved`` (same medium, locality, ownership) for the blocks whose last copy in
  that medium went: host eviction or removal (``reset_cache``, a superseded tail), a
  lower tier's collection, expiry (by any process: seen when this node's index drops
  the key, i.e. its walk or a read notices), a corrupt object removed, or the mapping's
  cap (below). After a weights reset every claim this node made is withdrawn.
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

**Only what is known is claimed (precision first).** A piece is published only if
``note_pieces`` saw the request it belongs to (its block hashes come from vLLM's
request, not from the object): whole chunks when noted (``note``, from vLLM's lookup
on); a finishing request's tail, window parts and hybrid pieces when the scheduler side
is about to save them (``SchedulerState.on_pieces``). A tail holds only the full blocks
of a partial chunk (vLLM hashes full blocks only) and a restore loads all of them; a
window part holds the blocks a restore of its end loads. A piece another request stored
and this one only restores is published if its payload is still kept
(``max_payloads``).

**One copy or many: counted per block (``heldblocks.py``).** Pieces may hold the same
blocks in one medium (a tail and the later whole chunk over it; the windows of nearby
ends; one object in two ``STORAGE`` tiers). Every copy counts per ``(medium, KV-cache
group, block hash)``: ``BlockStored`` names the blocks whose first copy in the medium
arrived (one event per contiguous run of them, its parent the block before), and
``BlockRemoved`` the blocks whose last copy went. So the stream, replayed as a set per
medium, is exactly what kvtier holds (``tests/vllm/test_events_props.py``); its
``ownership`` names the tier of the copy that made the change. If the raw queue ever
overflows, every claim is withdrawn (removals for all), so the stream never says a
block is held that is not.

**Bounded.** ``held``: piece key -> one ``bytes`` (a medium bit mask, the group, the
parent hash, the piece's block hashes; 8 bytes a hash with vLLM's default integer
hashes) for each piece held somewhere: about 250 bytes for a 16-block chunk
(``held_bytes``); plus the per-block counts (``heldblocks.py``: 68-85 bytes a block per
medium holding it). At most ``max_chunks`` pieces (oldest claims withdrawn beyond, in
batches): at 1M 16-block chunks held in both media, about 250 MB + 2.2 GB.
``payloads``: the tokens and extra keys a ``BlockStored`` needs, kept for the
``max_payloads`` most recently noted pieces. A finishing request's pieces are noted
again at its finish (its save stores them next), so its payloads are there when its
stores are observed; a piece whose payload went anyway (more than ``max_payloads`` pieces
noted in between) is not published: the stream omits it, it never claims a block it
cannot name.

**When events leave.** vLLM publishes what ``take_events`` returns once per engine step;
an idle engine does not step. The connector keeps it stepping while events wait
(``has_pending_push_work``) and wakes an idle engine when a background thread (a
lower-tier write, the idle flush, a walk noticing an expiry) queues one (``wake``,
``eventsetup.engine_waker``), so events leave within about a step of being observed.

Threads: ``observe`` (the tiers' hooks) may be called from any thread, under the tiers'
locks: it only appends to a ``deque`` and calls ``wake`` (which must not block). ``note``,
``note_pieces``, ``take``, ``pending``, ``withdraw_all`` run on vLLM's scheduler thread
only; ``take`` does no I/O.
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
from kvtier.vllm.heldblocks import HeldBlocks

log = logging.getLogger("kvtier.vllm.events")

MEDIUM_CPU = "CPU"
MEDIUM_STORAGE = "STORAGE"
LOCAL = "LOCAL"
REMOTE = "REMOTE"

#: Raw observations waiting for ``take`` at most; beyond, every claim is withdrawn.
MAX_RAW = 1 << 20

#: Observations ``take`` turns into events per call (per engine step), at most: a lower
#: tier's collection or expiry walk that drops 100k objects costs the scheduler thread a
#: bounded slice each step instead of one long stall (the rest stays queued, in order;
#: ``pending`` keeps the engine stepping until it is out).
TAKE_BUDGET = 8192
#: Default cap of pieces claimed held (``held``).
MAX_CHUNKS = 1_000_000
#: Default number of chunks whose store payload (tokens, extra keys) is kept.
MAX_PAYLOADS = 16_384

_HEAD = 3  # mask, group, parent flag
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
        media = list(dict.fromkeys(m.medium for m in self.tiers))
        self._medium = [media.index(m.medium) for m in self.tiers]  # tier -> medium id
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
        self.counts = HeldBlocks()
        self.payloads: dict[ChunkKey, _Payload] = {}
        self._withdrawn: list[Any] = []  # removals queued by withdraw_all / the caps
        self.published = 0  # events handed to vLLM (tests, metrics)
        #: called (any thread, must not block) when an observation arrives while none
        #: waited: the connector wakes an idle engine so the event leaves (``wake``)
        self.wake: Callable[[], None] | None = None

    # -- any thread ----------------------------------------------------------------------
    def observe(self, tier: int, stored: bool, key: ChunkKey) -> None:
        """A tier's hook: ``key`` became held (``stored``) or left tier ``tier``. Only
        appends (``deque.append`` is atomic) and calls ``wake``; never blocks."""
        if len(self._raw) >= MAX_RAW:
            self._overflow = True
            return
        was_empty = not self._raw
        self._raw.append((tier, stored, key))
        if was_empty and self.wake is not None:
            self.wake()

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
        ``group`` (one group's blocks are named by ``request.block_hashes``: full blocks
        only). Pieces already remembered, and those whose blocks vLLM has not hashed, are
        skipped. Returns the pieces noted. Scheduler thread only."""
        hashes = request.block_hashes
        lora = getattr(request, "lora_request", None)
        lora_id = lora.adapter_id if lora is not None else None
        lora_name = lora.name if lora is not None else None
        session = getattr(request, "session_id", None)
        tokens = request.all_token_ids
        bs = self.block_size
        done = 0
        from kvtier.vllm.eventsetup import extra_keys  # wiring imports this module
        for key, group, lo, blocks in pieces:
            if key in self.payloads or not 0 <= group < len(self.groups) or blocks < 1 \
                    or lo < 0 or lo + blocks > len(hashes):
                continue
            record = self._record(group, hashes[lo - 1] if lo else None,
                                  hashes[lo : lo + blocks])
            if record is None:
                continue
            self.payloads[key] = _Payload(
                record, array("i", tokens[lo * bs : (lo + blocks) * bs]), lora_id,
                lora_name, extra_keys(request, lo * bs, bs, blocks), session)
            done += 1
        if len(self.payloads) > self.max_payloads:
            _drop_oldest(self.payloads, len(self.payloads) - self.max_payloads
                         + self.max_payloads // 16)
        return done

    def take(self) -> list[Any]:
        """The events since the last call, in the order the tiers saw them (adjacent
        removals of one tier and group merged). Scheduler thread only; memory only."""
        block_stored, block_removed = _event_types()
        out: list[Any] = self._withdrawn
        self._withdrawn = []
        if self._overflow:
            self._raw.clear()
            self._overflow = False
            log.warning("kvtier: KV event queue overflowed; withdrawing every claim")
            out.extend(self._removals(list(self.held.items()), block_removed))
            self.held.clear()
            self.counts.clear()
        last: tuple[int, int, list[Any]] | None = None  # the last removal: merge into it
        budget = TAKE_BUDGET  # the rest waits for the next step (``pending``)
        while self._raw and budget > 0:
            budget -= 1
            tier, stored, key = self._raw.popleft()
            bit = 1 << tier
            rec = self.held.get(key)
            if stored:
                if rec is not None and rec[0] & bit:
                    continue
                pay = self.payloads.get(key)
                if rec is None:
                    if pay is None:
                        continue  # not a piece this node can name (another node's)
                    rec = bytes([bit]) + pay.record
                else:
                    rec = bytes([rec[0] | bit]) + rec[1:]
                self.held[key] = rec
                new = self.counts.add(self._medium[tier], rec[1], self._hashes(rec))
                stored_events = self._stored(tier, rec, pay, new, block_stored)
                if stored_events:
                    out.extend(stored_events)
                    last = None
            else:
                if rec is None or not rec[0] & bit:
                    continue
                mask = rec[0] & ~bit
                if mask:
                    self.held[key] = bytes([mask]) + rec[1:]
                else:
                    del self.held[key]
                gone = self.counts.remove(self._medium[tier], rec[1], self._hashes(rec))
                if not gone:
                    continue
                hashes = self._hashes(rec)
                names = [hashes[j] for j in gone]
                if last is not None and last[:2] == (tier, rec[1]):
                    last[2].extend(names)
                else:
                    ev = self._removed(tier, rec[1], names, block_removed)
                    out.append(ev)
                    last = (tier, rec[1], ev.block_hashes)
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
        what it stored before) and forget them; returns the pieces withdrawn."""
        _, block_removed = _event_types()
        n = len(self.held)
        self._withdrawn.extend(self._removals(list(self.held.items()), block_removed))
        self.held.clear()
        self.counts.clear()
        self.payloads.clear()
        return n

    @staticmethod
    def held_bytes(record: bytes, key: ChunkKey) -> int:
        """Bytes one ``held`` entry costs: the record (3 header bytes, the parent and the
        piece's hashes), the key, and the dict's slot (three words) plus its share of the
        hash table (about one more word at the table's lowest load). The per-block
        counts are ``HeldBlocks.block_bytes``."""
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
            bytes([0]) + bytes(self._width) if parent is None else
            bytes([_PARENT]) + (self._pack(self._convert(parent)) or bytes(self._width)))
        return head + b"".join(p for p in parts if p is not None)

    def _pack(self, h: int | bytes) -> bytes | None:
        if self._ints:
            return h.to_bytes(8, "big") if isinstance(h, int) and 0 <= h < 1 << 64 else None
        return bytes(h) if isinstance(h, bytes) and len(h) == self._width else None

    def _unpack(self, b: bytes) -> int | bytes:
        return int.from_bytes(b, "big") if self._ints else b

    def _hashes(self, rec: bytes) -> list[int | bytes]:
        w = self._width
        return [self._unpack(rec[i : i + w]) for i in range(_HEAD + w, len(rec), w)]

    def _parent(self, rec: bytes) -> int | bytes | None:
        return self._unpack(rec[_HEAD : _HEAD + self._width]) if rec[2] == _PARENT else None

    def _stored(self, tier: int, rec: bytes, pay: _Payload | None, new: list[int],
                cls: Any) -> list[Any]:
        """One ``BlockStored`` per contiguous run of ``new`` (indices into the piece's
        blocks), each with the block before it as its parent."""
        if not new:
            return []
        m, group, bs = self.tiers[tier], self.groups[rec[1]], self.block_size
        hashes = self._hashes(rec)
        out: list[Any] = []
        runs: list[list[int]] = []
        for j in new:
            if runs and runs[-1][1] == j:
                runs[-1][1] = j + 1
            else:
                runs.append([j, j + 1])
        for a, b in runs:
            extra = pay.extra_keys[a:b] if pay is not None and pay.extra_keys is not None \
                else None
            out.append(cls(
                block_hashes=hashes[a:b],
                parent_block_hash=hashes[a - 1] if a else self._parent(rec),
                token_ids=list(pay.tokens[a * bs : b * bs]) if pay is not None else [],
                block_size=bs,
                lora_id=pay.lora_id if pay is not None else None,
                medium=m.medium,
                lora_name=pay.lora_name if pay is not None else None,
                extra_keys=extra,
                group_idx=rec[1],
                kv_cache_spec_kind=group.kind,
                kv_cache_spec_sliding_window=group.sliding_window,
                locality=m.locality,
                ownership=m.ownership,
                session_id=pay.session_id if pay is not None else None,
            ))
        return out

    def _removed(self, tier: int, group: int, hashes: list[int | bytes], cls: Any) -> Any:
        m = self.tiers[tier]
        return cls(block_hashes=hashes, medium=m.medium, group_idx=group,
                   locality=m.locality, ownership=m.ownership)

    def _removals(self, recs: list[tuple[ChunkKey, bytes]], cls: Any) -> list[Any]:
        """Every copy in ``recs`` uncounted: one removal per tier and group naming the
        blocks that no other copy holds."""
        by_tier: dict[tuple[int, int], list[int | bytes]] = {}
        for _, rec in recs:
            hashes = self._hashes(rec)
            for tier in range(len(self.tiers)):
                if rec[0] & (1 << tier):
                    gone = self.counts.remove(self._medium[tier], rec[1], hashes)
                    if gone:
                        by_tier.setdefault((tier, rec[1]), []).extend(hashes[j] for j in gone)
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
