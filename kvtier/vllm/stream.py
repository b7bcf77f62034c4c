"""A restore streamed through a bounded window of host slots (issue 36).

A one-group model's restore is staged whole in host slots when it fits the staging
window; a longer one would need as many free slots as it has chunks, and a host pool
smaller than one conversation could not restore it at all. Such a restore is streamed:

1. the lookup stages the first chunks (at most half the window) and, once they are
   held, claims the whole stored prefix with an asynchronous load (vLLM holds the request
   in ``WAITING_FOR_REMOTE_KVS`` with its blocks allocated);
2. each engine step, ``StreamedLoad.advance`` hands the worker copy ops for the chunks
   read since the last step and starts reading the next ones into the slots the worker
   has finished copying from (a step's slots are released when every rank acknowledges
   it), so at most ``window`` chunks are held or being read at any time, and chunk
   ``i + 1`` is read while chunk ``i`` is copied;
3. when the last chunk's ops are out the request leaves ``KVTierMetadata.more`` and the
   worker reports it received once they are copied.

The request's KV is all there, or it is recomputed: a chunk that cannot be read (gone,
corrupt, a tier that stopped answering for longer than the stall bound) ends the stream
with a load that fails on purpose (slot -1): the worker reports the request failed, and
vLLM recomputes it from its first token.

Threads: everything here runs on vLLM's scheduler thread, in the scheduler side's hooks;
the store's read futures complete on IO threads and are only polled.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

from kvtier.objformat import ChunkSpec
from kvtier.store import Held, LoadProgress, Lookup, TieredStore
from kvtier.vllm.protocol import CopyOp

#: The window of a streamed restore, in host slots, at most: larger windows gain little
#: once a read overlaps a copy, and leave the pool's slots to saves and other restores.
STREAM_WINDOW_MAX = 8


@dataclass(frozen=True)
class ChunkCopy:
    """Where one entry of a restore goes: ``block_ids`` are chunk blocks ``first..`` of
    the slot it is read into; ``span`` as in ``CopyOp`` (a tail's block count)."""

    block_ids: list[int]
    first: int
    span: int


@dataclass
class Advance:
    """What one step of a stream produced: copy ops, the holds they read from (released
    once every rank acknowledged the step), the tokens restored by tier index, and
    whether the stream ended (``failed``: with a load that fails on purpose)."""

    ops: list[CopyOp] = field(default_factory=list)
    holds: list[Held] = field(default_factory=list)
    tokens_by_tier: dict[int, int] = field(default_factory=dict)
    ended: bool = False
    failed: bool = False
    stalled: bool = False  # failed because a read made no progress (not a short read)


def release_when_done(fut: Future[Held]) -> None:
    """Release a read that was abandoned. A failed one holds no slots (``store.load``
    releases them before it fails)."""
    if not fut.cancelled() and fut.exception() is None:
        fut.result().release()


class StreamedLoad:
    """One request's streamed restore, from its block allocation to its last copy op.

    ``found``/``specs`` are the entries still to read (chunks in order, possibly ending
    in a tail), ``copies`` where each goes (``None``: an entry with no block to fill).
    ``emitted`` are the holds handed to the worker: a released one is empty, so the
    window's use is the slots still held plus those being read.
    """

    def __init__(self, rid: str, found: Lookup, specs: Sequence[ChunkSpec],
                 copies: Sequence[ChunkCopy | None], window: int, block_size: int,
                 progress: Callable[[], LoadProgress]) -> None:
        if not (found.hits == len(specs) == len(copies)):
            raise ValueError("a stream needs one spec and one copy per entry")
        self.rid = rid
        self.found = found
        self.specs = list(specs)
        self.copies = list(copies)
        self.window = max(1, window)
        self.block_size = block_size
        self._new_progress = progress
        self.next = 0  # entries handed out (or being read) so far: [0, next)
        self.future: Future[Held] | None = None
        self.asked = 0  # entries the pending read asked for
        self.progress: LoadProgress | None = None
        self.emitted: list[Held] = []
        #: the tokens it restores, [from, to): what a stalled read's bound is set by
        self.span_tokens = (0, 0)
        self.failed_at = -1  # the entry it could not read, once it failed
        #: a copy op of this request went out: the worker knows it and reports it
        #: received; until then a stream that ends must tell it (``cancel``)
        self.told = False

    @property
    def remaining(self) -> int:
        return self.found.hits - self.next

    def in_flight(self) -> int:
        """Host slots this stream holds (handed out, not acknowledged) or is reading."""
        self.emitted = [h for h in self.emitted if len(h)]
        return sum(len(h) for h in self.emitted) + (self.asked if self.future else 0)

    def hand_out(self, held: Held, out: Advance) -> None:
        """Copy ops for ``held``, the next ``len(held)`` entries. A hold no op reads from
        (its entries fill no block) is released now: only a step that carries ops is
        acknowledged by the workers."""
        before = len(out.ops)
        for i in range(len(held)):
            copy = self.copies[self.next + i]
            tier = held.from_tier[i]
            if copy is not None and copy.block_ids:
                out.ops.append(CopyOp(self.rid, held.slots[i][0], list(copy.block_ids),
                                      copy.first, copy.span))
                out.tokens_by_tier[tier] = (out.tokens_by_tier.get(tier, 0)
                                            + len(copy.block_ids) * self.block_size)
        self.next += len(held)
        if len(out.ops) == before:
            held.release()
            return
        self.told = True
        self.emitted.append(held)
        out.holds.append(held)

    def skip(self, n: int) -> None:
        """The first ``n`` entries fill no block (vLLM's own hit grew past them while the
        restore was staged): never read them."""
        self.next = max(self.next, min(n, self.found.hits))

    def advance(self, store: TieredStore, stall_s: float, room: int | None = None) -> Advance:
        """One step: hand out what was read, fail a read that stalled or came back short,
        and start the next read if the window has room (at most ``room`` more slots:
        what the staging cap leaves to this stream)."""
        out = Advance()
        if self.future is not None:
            fut = self.future
            if not fut.done():
                assert self.progress is not None
                if self.progress.idle_for() < stall_s:
                    return out
                self.progress.cancel()  # a tier stopped answering: recompute
                fut.add_done_callback(release_when_done)
                self.future = None
                out.stalled = True
                return self._fail(out)
            self.future = None
            try:
                held = fut.result()
            except Exception:
                return self._fail(out)
            short = len(held) < self.asked
            self.hand_out(held, out)
            if short:
                return self._fail(out)
        if self.remaining == 0:
            out.ended = True
            return out
        free = self.window - self.in_flight()
        if room is not None:
            free = min(free, room)
        if free > 0:
            n = min(free, self.remaining)
            self.progress = self._new_progress()
            head = Lookup(self.found.keys[self.next : self.next + n],
                          self.found.tiers[self.next : self.next + n])
            self.asked = n
            self.future = store.load(head, self.specs[self.next : self.next + n],
                                     self.progress)
        return out

    def _fail(self, out: Advance) -> Advance:
        out.ops.append(CopyOp(self.rid, -1, [], 0, 0))  # the worker fails it: recompute
        self.told = True
        out.ended = out.failed = True
        self.failed_at = self.next
        self.next = self.found.hits
        return out

    def cancel(self) -> None:
        """Stop reading (the request finished or was aborted): a pending read's slots are
        released when it returns; handed-out holds are released by their steps' acks.
        A stream the worker was never told of (``told``) must still be ended there by
        the caller (``SchedulerState._tell_ended``), or vLLM waits for its load forever."""
        if self.future is not None:
            if self.progress is not None:
                self.progress.cancel()
            self.future.add_done_callback(release_when_done)
            self.future = None
        self.next = self.found.hits
