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
  size, LoRA id and name, vLLM's per-block ``extra_keys``, ``group_idx`` 0 and the
  group's ``kv_cache_spec_kind``. Self-contained (its own parent), so order is free.
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
from the chunk); partial tails, sliding-window parts and hybrid models' group pieces are
not published. If the raw queue ever overflows, every claim is withdrawn (removals for
all), so the stream never says a block is held that is not.

**Bounded.** ``held``: chunk key -> one ``bytes`` (a medium bit mask, the parent hash,
the chunk's block hashes; 8 bytes a hash with vLLM's default integer hashes) for each
chunk published as held somewhere; at most ``max_chunks`` (oldest claims withdrawn
beyond, in batches). ``payloads``: the tokens and extra keys a ``BlockStored`` needs,
kept for the ``max_payloads`` most recently noted chunks; a chunk that reaches a tier
after its payload went is published with empty ``token_ids``. ``held_bytes`` measures
what one held chunk costs (README: the figure at 1M chunks).

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

from kvtier.keys import ChunkKey

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
        spec_kind: str | None = None,
        max_chunks: int = MAX_CHUNKS,
        max_payloads: int = MAX_PAYLOADS,
        convert: Callable[[Any], int | bytes] | None = None,
    ) -> None:
        if not 1 <= len(tiers) <= 8:
            raise ValueError("between 1 and 8 tiers (one mask byte)")
        if max_chunks < 1 or max_payloads < 1:
            raise ValueError("max_chunks and max_payloads must be >= 1")
        self.tiers = list(tiers)
        self.block_size = block_size
        self.bpc = blocks_per_chunk
        self.ct = chunk_tokens
        self.spec_kind = spec_kind
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
        so their stores and removals can be published. Chunks whose blocks vLLM has not
        hashed yet are skipped. Returns the chunks noted. Scheduler thread only."""
        hashes = request.block_hashes
        n = min(len(keys), len(hashes) // self.bpc)
        if n <= first:
            return 0
        lora = getattr(request, "lora_request", None)
        lora_id = lora.adapter_id if lora is not None else None
        lora_name = lora.name if lora is not None else None
        session = getattr(request, "session_id", None)
        tokens = request.all_token_ids
        done = 0
        for c in range(first, n):
            key = keys[c]
            if key in self.payloads:
                continue
            lo = c * self.bpc
            record = self._record(hashes[lo - 1] if lo else None, hashes[lo : lo + self.bpc])
            if record is None:
                continue
            self.payloads[key] = _Payload(
                record, array("i", tokens[c * self.ct : (c + 1) * self.ct]), lora_id,
                lora_name, _extra_keys(request, c * self.ct, self.block_size, self.bpc),
                session)
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
        last_removed: tuple[int, list[Any]] | None = None
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
                if last_removed is not None and last_removed[0] == tier:
                    last_removed[1].extend(hashes)
                else:
                    ev = self._removed(tier, hashes, block_removed)
                    out.append(ev)
                    last_removed = (tier, ev.block_hashes)
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
        """Bytes one ``held`` entry costs: the record, the key, and the dict's slot
        (three words) plus its share of the hash table (about one more word at the
        table's lowest load)."""
        return sys.getsizeof(record) + sys.getsizeof(key) + 4 * 8

    # -- internals -----------------------------------------------------------------------
    def _record(self, parent: Any, hashes: Sequence[Any]) -> bytes | None:
        if len(hashes) != self.bpc or any(h is None for h in hashes):
            return None
        conv = [self._convert(h) for h in hashes]
        if not self._width:
            self._ints = isinstance(conv[0], int)
            self._width = 8 if self._ints else len(conv[0])  # type: ignore[arg-type]
        parts = [self._pack(h) for h in conv]
        if any(p is None for p in parts):
            return None
        head = (bytes([_NO_PARENT]) + bytes(self._width) if parent is None else
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
        start = 2 + w
        return [self._unpack(rec[i : i + w]) for i in range(start, len(rec), w)]

    def _parent(self, rec: bytes) -> int | bytes | None:
        return self._unpack(rec[2 : 2 + self._width]) if rec[1] == _PARENT else None

    def _stored(self, tier: int, rec: bytes, pay: _Payload | None, cls: Any) -> Any:
        m = self.tiers[tier]
        return cls(
            block_hashes=self._hashes(rec),
            parent_block_hash=self._parent(rec),
            token_ids=list(pay.tokens) if pay is not None else [],
            block_size=self.block_size,
            lora_id=pay.lora_id if pay is not None else None,
            medium=m.medium,
            lora_name=pay.lora_name if pay is not None else None,
            extra_keys=pay.extra_keys if pay is not None else None,
            group_idx=0,
            kv_cache_spec_kind=self.spec_kind,
            locality=m.locality,
            ownership=m.ownership,
            session_id=pay.session_id if pay is not None else None,
        )

    def _removed(self, tier: int, hashes: list[int | bytes], cls: Any) -> Any:
        m = self.tiers[tier]
        return cls(block_hashes=hashes, medium=m.medium, group_idx=0,
                   locality=m.locality, ownership=m.ownership)

    def _removals(self, recs: list[tuple[ChunkKey, bytes]], cls: Any) -> list[Any]:
        """One removal per tier for every claim in ``recs``."""
        by_tier: dict[int, list[int | bytes]] = {}
        for _, rec in recs:
            for tier in range(len(self.tiers)):
                if rec[0] & (1 << tier):
                    by_tier.setdefault(tier, []).extend(self._hashes(rec))
        return [self._removed(t, h, cls) for t, h in sorted(by_tier.items())]


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


def events_for(sched: Any, kv_cache_config: Any) -> KVEvents | None:
    """The KV events of a scheduler side (``SchedulerSide``), hooked to its store; None
    for a hybrid model (several KV-cache groups: not published, logged)."""
    geom = sched.geom
    if geom.groups:
        log.warning("kvtier: KV events: a hybrid model's stored pieces are not published "
                    "(only vLLM's own GPU events are)")
        return None
    spec_kind: str | None = None
    try:
        from vllm.v1.kv_cache_interface import get_kv_cache_spec_kind

        spec_kind = get_kv_cache_spec_kind(
            kv_cache_config.kv_cache_groups[0].kv_cache_spec).value
    except (ImportError, AttributeError, IndexError):
        pass
    store = sched.store
    ev = KVEvents(tier_media([t.name for t in store.tiers]), block_size=sched.bs,
                  blocks_per_chunk=sched.bpc, chunk_tokens=sched.ct, spec_kind=spec_kind,
                  max_chunks=sched.cfg.events.max_chunks,
                  max_payloads=sched.cfg.events.max_payload_chunks)
    ev.attach(store.host.index, [lt.tier for lt in store.lower])
    log.info("kvtier: KV events on: host as CPU, %s as STORAGE; at most %d chunks claimed",
             ", ".join(lt.tier.name for lt in store.lower) or "no lower tier", ev.max_chunks)
    return ev


def tier_media(names: Sequence[str]) -> list[Medium]:
    """How a store's tiers are published: the host (``names[0]``) as this node's ``CPU``,
    every lower tier as shared ``STORAGE`` owned by its name."""
    return [Medium(MEDIUM_CPU, LOCAL, None),
            *(Medium(MEDIUM_STORAGE, REMOTE, n) for n in names[1:])]
