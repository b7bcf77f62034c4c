"""The held prefix of a prompt, read from the shared tier: what selective P/D prices a turn by.

A returning turn is cheap decode-only because the decode node restores what the tier holds
of its prompt. The router therefore asks the tier itself, from the prompt's own content,
never from a client hint (a conversation id says nothing about a compacted or edited
history):

1. **Token ids.** The request's own ids (a completions prompt of ids), else vLLM's
   ``/tokenize`` on a backend (``protocol.ProxyRequest.tokenize``: the same messages, chat
   template and template fields the completion call carries), so the ids are the ones the
   engine will hash.
2. **Keys.** ``kvtier.keys.chunk_keys`` / ``tail_key`` over those ids, exactly as the
   engines do (``kvtier.vllm.scheduler_side``), under the namespace digest of the request's
   identity: its ``cache_salt`` (a tenant's salt, with tenants) and its ``model`` (a LoRA
   adapter is selected by model name). That digest mixes in what only the engine knows
   (geometry, adapter fingerprint, weights epoch), so it is *learnt from the backends'
   answers* (``NamespaceBook``): a prefill call returns ``namespace``, ``tokens`` and
   ``last_key``, and the router keeps the digest only if the key it computes over the
   same ids under it equals ``last_key``. An identity seen for the first time, or whose
   answers do not verify (a sliding-window or hybrid model, whose ``last_key`` names other
   objects), has no digest: its turns take the prefill hop.
3. **Lookup** (``HeldLookup``): the leading full chunks the tier's index knows (memory),
   then one bounded probe at the frontier (a worker thread, at most ``max_heads`` store
   lookups and ``probe_timeout`` seconds): a binary search over the remaining chunk keys
   for the last one stored, then the longest stored tail of the next chunk (block
   granularity, when the block size has been learnt). The binary search assumes what the
   engines' writes give: a chain is stored from its first chunk on, so whether a chunk is
   stored is monotone along the chain. A probe that times out counts what it confirmed.

Invariants:

* Keys are always computed under the request's own identity: a tenant's lookups use only
  its salt's digest, so what one tenant's prompts left in the tier never changes another
  tenant's path, timing or hit report.
* A prompt whose keys cannot be computed has no held count (``Unkeyed`` names why): the
  caller sends it through the prefill hop.
* ``NamespaceBook`` and ``HeldLookup.index_prefix`` run on the event loop's thread and
  touch memory only; ``HeldLookup.probe`` does I/O and runs on a probe thread of the
  lookup's own ``BoundedExecutor`` (it reads and writes only its own ``Probe``, and the
  tiers, which any thread may call). A turn that finds every probe thread busy (a hung
  tier holds them) is priced from the index alone: nothing queues behind a hang
  (``kvtier.router.storage``).
"""

from __future__ import annotations

import asyncio
import math
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from kvtier.keys import ChunkKey, chunk_keys, tail_key
from kvtier.router.storage import PROBE_THREADS, BoundedExecutor

#: Why a prompt's held prefix is unknown (a ``kvtier_router_pd_decisions_total`` reason).
Unkeyed = Literal["no_tier", "multimodal", "unsupported_prompt", "no_namespace",
                  "tokenizer", "too_long"]
UNKEYED: tuple[Unkeyed, ...] = ("no_tier", "multimodal", "unsupported_prompt",
                                "no_namespace", "tokenizer", "too_long")
#: Prompts of more ids than this are keyed on a worker thread, not the event loop's.
OFF_LOOP_IDS = 32_768

#: Identities (salt x model) whose digest is kept; least recently used go first.
MAX_NAMESPACES = 4096
#: ``chunk_tokens`` when the router has no tiers config (nothing is looked up then).
DEFAULT_CHUNK_TOKENS = 256
#: Store lookups one probe may make (a binary search over 1,000 chunks needs 10, and
#: confirming what the index claims 2 more).
DEFAULT_MAX_HEADS = 24
#: A decode-only turn whose decode node restored less than this share of what was priced
#: as held makes its identity distrusted for ``DISTRUST_S`` (``PrefixReader.shortfall``).
TRUSTED_SHARE = 0.95
DISTRUST_S = 60.0

Identity = tuple[str | None, str | None]  # (cache_salt, model)


def identity_of(body: Mapping[str, Any]) -> Identity:
    """What selects a request's namespace besides the engine: its ``cache_salt`` and
    ``model`` (a LoRA adapter's name), as the client body (after the tenant's salt is set)
    carries them."""
    salt, model = body.get("cache_salt"), body.get("model")
    return (salt if isinstance(salt, str) else None, model if isinstance(model, str) else None)


@dataclass
class _Learnt:
    digest: bytes
    block_tokens: int  # a multiple of the engine's block size (gcd of what was seen)


class NamespaceBook:
    """Namespace digests learnt from verified backend answers, per ``Identity``, and the
    granularity of stored tails (see the module docstring). Event loop thread only."""

    def __init__(self, chunk_tokens: int, capacity: int = MAX_NAMESPACES) -> None:
        if chunk_tokens <= 0:
            raise ValueError(f"chunk_tokens must be > 0, got {chunk_tokens}")
        self.chunk_tokens = chunk_tokens
        self.capacity = capacity
        self._entries: OrderedDict[Identity, _Learnt] = OrderedDict()

    def get(self, identity: Identity) -> tuple[bytes, int] | None:
        """``(digest, tail granularity in tokens)`` of ``identity``, or None if not learnt.
        The granularity is ``chunk_tokens`` (no tails) until a tail was seen."""
        got = self._entries.get(identity)
        if got is None:
            return None
        self._entries.move_to_end(identity)
        return got.digest, got.block_tokens

    def learn(self, identity: Identity, ids: Sequence[int],
              params: Mapping[str, Any] | None) -> bool:
        """Keep ``params["namespace"]`` for ``identity`` if the key of the first
        ``params["tokens"]`` of ``ids`` under it is ``params["last_key"]``; True if kept."""
        if params is None:
            return False
        ns_hex, tokens, last = (params.get("namespace"), params.get("tokens"),
                                params.get("last_key"))
        if (not isinstance(ns_hex, str) or not isinstance(last, str)
                or not isinstance(tokens, int) or isinstance(tokens, bool)
                or not 0 < tokens <= len(ids)):
            return False
        try:
            digest = bytes.fromhex(ns_hex)
        except ValueError:
            return False
        ct = self.chunk_tokens
        n, rest = divmod(tokens, ct)
        keys = chunk_keys(digest, ids[: n * ct], ct)
        end = tail_key(keys[-1] if keys else digest, ids[n * ct: tokens]) if rest else keys[-1]
        if end.hex() != last:
            return False
        known = self._entries.get(identity)
        grain = ct if known is None or known.digest != digest else known.block_tokens
        self._entries[identity] = _Learnt(digest, math.gcd(grain, rest) if rest else grain)
        self._entries.move_to_end(identity)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)
        return True


@dataclass
class Probe:
    """What one probe confirmed so far (written by its worker thread; read after it
    finished or timed out, where a stale read only undercounts)."""

    indexed: int  # leading full chunks the router's index claims (not yet confirmed)
    distrusted: bool = False  # the identity's pricing fell short lately: check each chunk
    chunks: int = 0  # leading full chunks confirmed stored
    tail_tokens: int = 0  # tokens of the longest stored tail of the next chunk
    heads: int = 0  # store lookups made
    done: bool = False


@dataclass(frozen=True)
class Held:
    """What the tier holds of one prompt."""

    tokens: int  # the held prefix, in tokens (full chunks, then a tail)
    prompt_tokens: int
    chunks: int
    tail_tokens: int
    heads: int  # store lookups the probe made (0: the index knew)


@dataclass
class PromptKeys:
    """A prompt's ids and the keys of its full chunks under its namespace digest."""

    digest: bytes
    ids: Sequence[int]
    keys: list[ChunkKey]
    chunk_tokens: int
    grain: int  # tail granularity in tokens (chunk_tokens: no tails)
    tails: list[tuple[int, ChunkKey]] = field(default_factory=list)

    def tail_candidates(self, chunk: int) -> list[tuple[int, ChunkKey]]:
        """``(tokens, key)`` of every tail of chunk ``chunk`` the engine could restore
        (it computes at least the prompt's last token), longest first."""
        ct, g = self.chunk_tokens, self.grain
        if g >= ct:
            return []
        lo = chunk * ct
        room = min(ct - g, (len(self.ids) - 1 - lo) // g * g)
        prev = self.keys[chunk - 1] if chunk else self.digest
        return [(t, tail_key(prev, self.ids[lo: lo + t])) for t in range(room, 0, -g)]


class LookupTier(Protocol):
    """What a lookup asks of a shared tier (``kvtier.router.storage.GuardedTier``: each
    call under the tier's breaker, answering "not stored" while it refuses)."""

    def indexed(self, key: ChunkKey) -> bool: ...

    def stored(self, key: ChunkKey) -> bool: ...


class HeldLookup:
    """How much of a prompt's chain the shared tiers hold (see the module docstring).
    Probes run on ``executor``'s threads, never on asyncio's default executor (aiohttp's
    DNS resolution and the tenants-file refresh use that one)."""

    def __init__(self, tiers: Sequence[LookupTier], *, max_heads: int = DEFAULT_MAX_HEADS,
                 executor: BoundedExecutor | None = None) -> None:
        self.tiers = list(tiers)
        self.max_heads = max_heads
        self.executor = executor or BoundedExecutor(PROBE_THREADS, "probe")

    def _indexed(self, key: ChunkKey) -> bool:
        return any(t.indexed(key) for t in self.tiers)

    def _stored(self, key: ChunkKey, probe: Probe) -> bool:
        probe.heads += 1
        return any(t.stored(key) for t in self.tiers)

    def index_prefix(self, pk: PromptKeys) -> int:
        """Leading chunks the tiers' indexes know (memory only)."""
        for i, key in enumerate(pk.keys):
            if not self._indexed(key):
                return i
        return len(pk.keys)

    def needs_probe(self, pk: PromptKeys) -> bool:
        """Always, where anything may be held: what the index claims is confirmed too."""
        return bool(pk.keys) or bool(pk.tail_candidates(0))

    def _confirm(self, pk: PromptKeys, probe: Probe, stop: threading.Event) -> tuple[int, int]:
        """Check the index's claim: ``(lo, hi)``, stored ``[0, lo)``, unknown ``[lo, hi)``.

        The index learns of deletions late (its walk), so a claim is confirmed at the
        chain's first chunk (the oldest: the first collected, and without it nothing
        restores) and its last claimed one; if that one is gone, the search goes on below
        it. An identity whose pricing fell short lately (``distrusted``: a hole in the
        chain, which the ends do not show) has its chunks checked one by one."""
        keys, k = pk.keys, probe.indexed
        if probe.distrusted:
            for i, key in enumerate(keys):
                if probe.heads >= self.max_heads or stop.is_set():
                    return i, len(keys)  # out of budget: a binary search for the rest
                if not self._stored(key, probe):
                    return i, i
                probe.chunks = i + 1
            return len(keys), len(keys)
        if k == 0:
            return 0, len(keys)
        if not self._stored(keys[0], probe):
            return 0, 0  # the chain's head is gone: nothing of it restores
        probe.chunks = 1
        if k == 1 or self._stored(keys[k - 1], probe):
            probe.chunks = k
            return k, len(keys)
        return 1, k - 1

    def probe(self, pk: PromptKeys, probe: Probe, stop: threading.Event) -> None:
        """Worker thread: confirm what the index claims (``_confirm``), then the last
        stored chunk (binary search) and the longest stored tail after it, in at most
        ``max_heads`` store lookups, stopping early when ``stop`` is set."""
        try:
            lo, hi = self._confirm(pk, probe, stop)  # stored: [0, lo); unknown: [lo, hi)
            if lo == hi and lo < len(pk.keys):
                return  # chunk ``lo`` is not stored: no tail after it either
            while lo < hi and probe.heads < self.max_heads and not stop.is_set():
                mid = (lo + hi) // 2
                if self._stored(pk.keys[mid], probe):
                    lo = mid + 1
                    probe.chunks = lo
                else:
                    hi = mid
            if lo < hi:
                return  # out of budget: the chain may go further, its tail is not looked at
            for tokens, key in pk.tail_candidates(lo):
                if probe.heads >= self.max_heads or stop.is_set():
                    return
                if self._indexed(key) or self._stored(key, probe):
                    probe.tail_tokens = tokens
                    return
        finally:
            probe.done = True

    @staticmethod
    def held(pk: PromptKeys, probe: Probe) -> Held:
        chunks, tail = probe.chunks, probe.tail_tokens
        return Held(chunks * pk.chunk_tokens + tail, len(pk.ids), chunks, tail, probe.heads)


def prompt_keys(book: NamespaceBook, identity: Identity,
                ids: Sequence[int]) -> PromptKeys | None:
    """The keys of ``ids`` under ``identity``'s learnt digest; None if none is learnt."""
    got = book.get(identity)
    if got is None:
        return None
    return keys_under(got[0], got[1], book.chunk_tokens, ids)


def keys_under(digest: bytes, grain: int, chunk_tokens: int,
               ids: Sequence[int]) -> PromptKeys:
    """The keys of ``ids`` under ``digest`` (pure: any thread)."""
    # the engine computes at least the prompt's last token: a chunk ending there is not
    # restored, so it is not keyed here either
    restorable = ids[: max(0, len(ids) - 1)]
    return PromptKeys(digest, ids, chunk_keys(digest, restorable, chunk_tokens),
                      chunk_tokens, grain)


class PrefixReader:
    """The held prefix of a prompt whose ids are known: keys, index, one bounded probe
    (event loop thread; the probe runs on a worker thread)."""

    def __init__(self, chunk_tokens: int, lookup: HeldLookup | None, *,
                 probe_timeout: float, max_ids: int = 1 << 20) -> None:
        self.book = NamespaceBook(chunk_tokens)
        self.max_ids = max_ids  # longer prompts are not keyed ("too_long")
        self.lookup = lookup
        self.probe_timeout = probe_timeout
        #: probes not made because every probe thread was busy (priced as nothing held)
        self.skipped = 0
        #: identity -> until when its held counts are checked chunk by chunk (``shortfall``)
        self._distrust: OrderedDict[Identity, float] = OrderedDict()

    def shortfall(self, identity: Identity, priced: int, restored: int, now: float) -> bool:
        """A decode-only turn priced ``priced`` tokens as held and the decode node restored
        ``restored``: below ``TRUSTED_SHARE`` of it, ``identity``'s next lookups for
        ``DISTRUST_S`` check each chunk (a hole the chain's ends did not show) and the
        router's index is not believed. True if it fell short. Event loop thread."""
        if priced <= 0 or restored >= TRUSTED_SHARE * priced:
            return False
        self._distrust[identity] = now + DISTRUST_S
        self._distrust.move_to_end(identity)
        while len(self._distrust) > MAX_NAMESPACES:
            self._distrust.popitem(last=False)
        return True

    def distrusted(self, identity: Identity, now: float) -> bool:
        until = self._distrust.get(identity)
        if until is not None and now >= until:
            del self._distrust[identity]
            return False
        return until is not None

    async def held(self, identity: Identity, ids: Sequence[int],
                   now: float = 0.0) -> Held | Unkeyed:
        """What the tiers hold of ``ids`` under ``identity`` (``now``: the router's
        monotonic clock, for ``distrusted``): only what a probe confirmed counts."""
        if self.lookup is None:
            return "no_tier"
        if len(ids) > self.max_ids:
            return "too_long"
        got = self.book.get(identity)  # the book is the event loop thread's
        if got is None:
            return "no_namespace"
        ct = self.book.chunk_tokens
        if len(ids) > OFF_LOOP_IDS:  # hashing a long prompt is not the event loop's work
            pk = await asyncio.to_thread(keys_under, got[0], got[1], ct, ids)
        else:
            pk = keys_under(got[0], got[1], ct, ids)
        lookup = self.lookup
        distrusted = self.distrusted(identity, now)
        probe = Probe(0 if distrusted else lookup.index_prefix(pk), distrusted)
        if lookup.needs_probe(pk):
            stop = threading.Event()
            fut = lookup.executor.submit(lookup.probe, pk, probe, stop)
            if fut is None:  # every probe thread is busy (a tier that hangs): the index
                self.skipped += 1
                return lookup.held(pk, probe)
            try:
                await asyncio.wait_for(asyncio.wrap_future(fut), self.probe_timeout)
            except TimeoutError:
                stop.set()  # the thread ends at its next lookup; what it confirmed counts
        return lookup.held(pk, probe)
