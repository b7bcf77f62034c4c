"""The scheduler side's per-request records and constants, shared by its rooms.

Plain data: every record is made, read and dropped on vLLM's scheduler thread (see
``state.SchedulerState``), except the futures they carry, which complete on IO threads.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from kvtier.keys import ChunkKey
from kvtier.objformat import ChunkMeta, ChunkSpec
from kvtier.store import Held, LoadProgress, Lookup
from kvtier.vllm.hybrid import Piece
from kvtier.vllm.identity import RequestIdentity


def _request_params(request: Any) -> dict[str, Any]:
    """The request's ``kv_transfer_params["kvtier"]`` (empty if absent or malformed).

    Keys read: ``expect`` (P/D announcement), ``load: false`` (never restore: a
    recompute reference, or D->P reuse switched off), ``save: false`` (store nothing),
    ``recompute_threshold_tokens`` (this request's own fixed threshold; see
    ``_request_threshold``).
    """
    params = getattr(request, "kv_transfer_params", None)
    mine = params.get("kvtier") if isinstance(params, dict) else None
    return mine if isinstance(mine, dict) else {}


def _request_threshold(params: dict[str, Any]) -> tuple[int | None, bool]:
    """A request's ``recompute_threshold_tokens`` and whether it was malformed: a
    non-negative integer overrides the configured threshold (fixed or ``auto``) for that
    request only, e.g. to compare always-restore with ``auto`` on one engine."""
    value = params.get("recompute_threshold_tokens")
    if value is None:
        return None, False
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value, False
    return None, True


def _saveable_tokens(request: Any) -> int:
    """The tokens of a finished request whose KV is known to be computed: at most
    ``num_tokens - 1`` (the last token is sampled, never computed), however far
    ``num_computed_tokens`` ran ahead (speculative drafts not verified, async scheduling's
    in-flight step)."""
    return max(0, min(int(request.num_computed_tokens), int(request.num_tokens) - 1))


@dataclass(frozen=True)
class _FoundTail:
    """A stored partial tail a lookup found: the first ``blocks`` blocks of chunk
    ``chunk`` (``keys.tail_key``); ``tier`` is where."""

    chunk: int
    blocks: int
    key: ChunkKey
    tier: int = 0


@dataclass(frozen=True)
class _SavePiece:
    """One thing a finishing request saves: a whole chunk (``span`` 0) or its tail, a
    window part, a hybrid piece, with the meta it is committed under and the blocks it is
    copied from (``hybrid.Piece`` only says where a piece lies in a prefix)."""

    key: ChunkKey
    meta: ChunkMeta
    block_ids: list[int]
    span: int = 0
    group: int = 0  # a hybrid model's KV-cache group


@dataclass
class _Staging:
    """A request's staging, between its lookup and its block allocation (the store's
    ``Lookup`` only says where keys are). It stages ``full`` whole chunks from
    ``first_chunk`` on, then, if ``tail_blocks``, the next chunk's tail."""

    keys: list[ChunkKey]
    first_chunk: int = 0
    full: int = 0
    tail_blocks: int = 0
    future: Future[Held] | None = None
    held: Held | None = None
    start_tokens: int = 0
    t0: float = field(default_factory=time.perf_counter)
    threshold: int | None = None  # the request's own fixed threshold, if it set one
    progress: LoadProgress | None = None  # of ``future``: abandoned when it stalls
    chunks: int = 0  # staged (or being staged) host chunks
    staged_step: int | None = None  # the engine step its chunks were all held in
    #: a sliding-window model's restore: it ends at token ``end``, and ``parts`` (first
    #: block, blocks) are the window's parts, staged in this order (``window.py``)
    end: int = 0
    parts: list[tuple[int, int]] = field(default_factory=list)
    #: a hybrid model's restore: it ends at token ``end``; these are staged, in order
    pieces: list[Piece] = field(default_factory=list)
    #: vLLM's own hit when this lookup started: a window or hybrid prefix staged for it
    #: holds nothing below it, so a smaller hit later needs a new lookup
    asked_at: int = 0
    #: a restore longer than the staging cap (``stream.py``): every entry (chunks, then
    #: the tail) and its spec; ``future`` stages only the first of them
    stream: tuple[Lookup, list[ChunkSpec]] | None = None


#: A P/D decode waiting for announced chunks asks the shared tier at most this often.
PROBE_INTERVAL_S = 0.05


#: Staged chunks of requests vLLM has not admitted yet may hold at most this fraction of
#: the host pool (a None answer costs vLLM no token budget, so one schedule() could
#: otherwise stage the whole waiting queue and leave no slot for saves).
STAGED_FRACTION = 0.5


#: A staged lookup not admitted within this many engine steps is released.
STAGED_STEPS = 64


#: A sliding-window model's lookup tries the ends of tails in this many chunks, from the
#: last one down (at most ``blocks_per_chunk - 1`` tail keys hashed per chunk); below
#: them only chunk boundaries (no hashing).
WINDOW_TAIL_CHUNKS = 8


@dataclass
class _Probe:
    """A request's question to the lower tiers, asked on an IO thread. Kept until the
    request finishes: a request vLLM reconsiders (its allocation failed) is not probed
    again, except by a P/D decode waiting for announced chunks."""

    future: Future[int]
    started: float
    progress: LoadProgress
    answered: float | None = None  # when its answer (or its deadline) was taken
    at_stake: int = 0  # tokens its answer may save from a recompute (its wait's bound)
    waiting: bool = False  # a P/D decode's probe for announced chunks


@dataclass
class _Keys:
    """A request's identity and the keys of its full chunks computed so far."""

    identity: RequestIdentity
    epoch: int  # the weights epoch its identity was made in
    keys: list[ChunkKey] = field(default_factory=list)
    #: the request's multimodal inputs when the identity was made: a streaming-input
    #: session appends tokens *and* inputs to the same request, and the keys of chunks
    #: with new inputs' placeholders must mix those inputs in
    mm_inputs: int = 0


@dataclass
class _Save:
    slots: list[tuple[int, ChunkMeta]]
    #: shorter tails this save's longer piece supersedes: dropped from the host tier
    #: once the save commits (a save that fails leaves them: they are still the best
    #: copy of that chunk's start)
    supersedes: list[ChunkKey] = field(default_factory=list)



@dataclass
class _SaveStream:
    """A save streamed through the host pool (``Saves._save_pieces``): a finishing
    request's pieces that found no free host slot wait here, in chain order, and get one
    as the slots of the pieces before them are copied, committed and written below.
    vLLM keeps the request's blocks until the last copy is done (``saves_more``). Each
    step's copies are committed when every rank acknowledged them (``saved_steps``); one
    that failed aborts its slots and ends the stream (a prefix with a hole is not
    reusable). A piece that waits for a slot longer than ``wait_s`` ends it too: the
    pieces after it are not saved (the same as an unstreamed save that found no slot).
    Scheduler thread only."""

    #: pieces not given a slot yet, in chain order
    pending: list[_SavePiece]
    #: when the first pending piece started waiting (the scheduler's monotonic clock)
    since: float
    #: the longest a piece waits for a slot
    wait_s: float
    #: slots whose copies go out in the next step's metadata
    issued: list[tuple[int, ChunkMeta]] = field(default_factory=list)
    #: step -> its slots, copied out, until every rank acknowledged the step
    by_step: dict[int, list[tuple[int, ChunkMeta]]] = field(default_factory=dict)
    #: shorter tails the first piece supersedes (dropped once its step commits)
    supersedes: list[ChunkKey] = field(default_factory=list)
    failed: bool = False
    #: the request was in a step's ``saves_more`` (the step that also carries its
    #: finished id): only then does the worker know to report it finished sending,
    #: whether or not any copy of it was issued
    told: bool = False

    def uncommitted(self) -> int:
        """Slots given out and not yet committed or aborted (issued or awaiting an ack)."""
        return len(self.issued) + sum(len(v) for v in self.by_step.values())

    def done(self) -> bool:
        """Nothing left to give a slot, copy or acknowledge, and the worker was told."""
        return self.told and not (self.pending or self.issued or self.by_step)
