"""A worker's saves: the copies of finished requests' KV into host slots, until reported.

``WorkerSaves`` is the save half of ``WorkerSide`` (``worker_side.py``), which owns the
copiers and hands each step's save ops here. Every method runs on vLLM's model thread,
in step order: ``start`` (from ``start_load_kv``), then ``finished`` (``get_finished``),
then ``steps`` and ``take_failed`` (``build_connector_worker_meta``).

Invariants: a request is reported finished only when every copy issued for it is done
and the scheduler has named its last copies (it is not in this step's ``saves_more``);
a failed save is reported like a done one, in the same step as its id in
``take_failed``, so the scheduler aborts its slots and vLLM frees its blocks. A step of
acknowledged saves (``KVTierMetadata.saves_acked``) is reported saved, or failed, once
all its copies on this rank are done. State held: saves not yet reported, nothing else.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from kvtier.ops.backend import BothHandles, CopyHandle
from kvtier.ops.stepcopy import SaveFailed, StepCopier
from kvtier.tiers.base import TierError
from kvtier.vllm.protocol import CopyOp

log = logging.getLogger("kvtier.vllm")


def by_group(ops: list[CopyOp]) -> dict[int, list[CopyOp]]:
    """``ops`` per KV-cache group, each in the order given."""
    out: dict[int, list[CopyOp]] = {}
    for op in ops:
        out.setdefault(op.group, []).append(op)
    return out


class WorkerSaves:
    """A worker's saves in flight and their reports (model thread only)."""

    def __init__(self, copier_of: Callable[[int], StepCopier]) -> None:
        """``copier_of(group)``: the copier of a KV-cache group (raises ``TierError`` for
        a group that does not exist)."""
        self._copier_of = copier_of
        # Each request id is in at most one of these at a time, except _failed (a subset
        # of _in_flight | _saved) and _finished (a subset of _in_flight | _streaming).
        self._in_flight: dict[str, CopyHandle] = {}  # copying; the last op's handle
        self._saved: set[str] = set()  # copied (or failed), finished id not seen yet
        self._finished: set[str] = set()  # finished id seen, still copying
        self._failed: set[str] = set()  # failed, not reported yet
        self._failed_saves: set[str] = set()  # failed, reported this step
        # Streamed saves (``saves_acked`` / ``saves_more``): per step, the handles of its
        # acknowledged saves and whether one failed, until reported
        self._acked: dict[int, tuple[list[CopyHandle], bool]] = {}
        self._streaming: set[str] = set()  # ever in ``saves_more``, not reported finished
        self._more: set[str] = set()  # this step's ``saves_more``

    def start(self, ops: list[CopyOp], step: int = 0,
              acked: set[str] | frozenset[str] = frozenset(),
              more: set[str] | frozenset[str] = frozenset(), *, copies: bool = True) -> None:
        """Issue ``ops``; the handles of those of ``acked`` requests are also kept under
        ``step`` until ``steps`` reports it saved (or failed). ``more``: the requests
        whose saves continue in a later step. ``copies=False``: this rank writes no copy
        (a replicated layout's rank other than 0); its requests count as copied."""
        self._more = set(more)
        self._streaming |= self._more
        if any(op.req_id in acked for op in ops):
            self._acked[step] = ([], False)
        if not copies:
            self._saved.update(op.req_id for op in ops)
            return
        results: dict[int, CopyHandle | SaveFailed] = {}
        for group, group_ops in by_group(ops).items():
            try:
                copier = self._copier_of(group)
                for op, result in zip(group_ops, copier.start_saves(group_ops), strict=True):
                    results[id(op)] = result
            except TierError as e:
                results.update((id(op), SaveFailed(e)) for op in group_ops)
        for op in ops:  # in the scheduler's order: a request's last op's handle last
            result = results[id(op)]
            if op.req_id in acked:
                handles, _ = self._acked[step]
                if isinstance(result, SaveFailed):
                    self._acked[step] = (handles, True)
                else:
                    handles.append(result)
            if isinstance(result, SaveFailed):
                if op.req_id not in self._failed:
                    log.error("kvtier: save of %s failed; not stored: %s", op.req_id,
                              result.error)
                self._failed.add(op.req_id)
                self._saved.add(op.req_id)  # reported once the copies issued before are done
            else:
                # covers its earlier ops on this group; with several groups (one batch
                # each) the request waits for every handle it was given
                prev = self._in_flight.get(op.req_id)
                self._in_flight[op.req_id] = (result if prev is None or prev is result
                                              else BothHandles(prev, result))

    def finished(self, finished_req_ids: set[str]) -> set[str]:
        """The requests whose saves are complete and whose finished id vLLM has given
        (now or before): their blocks may be freed. A finished id with no save by now
        never gets one and is not remembered."""
        self._finished |= finished_req_ids & (self._in_flight.keys() | self._streaming)
        for rid, handle in list(self._in_flight.items()):
            if handle.done():
                del self._in_flight[rid]
                self._saved.add(rid)
        # a streamed save is finished once its last copies came (not in ``saves_more``)
        # and are done, whether or not its last steps carried any
        ended = self._streaming - self._more
        ready = ((self._saved | ended) - self._more) & (
            (finished_req_ids | self._finished) - self._in_flight.keys())
        self._streaming -= ready
        self._saved -= ready
        self._finished -= ready
        self._failed_saves |= ready & self._failed
        self._failed -= ready
        return ready

    def steps(self) -> tuple[list[int], list[int]]:
        """Steps of acknowledged saves now complete on this rank: (saved, failed)."""
        saved: list[int] = []
        failed: list[int] = []
        for s, (handles, bad) in list(self._acked.items()):
            if all(h.done() for h in handles):
                del self._acked[s]
                (failed if bad else saved).append(s)
        return sorted(saved), sorted(failed)

    def take_failed(self) -> list[str]:
        """Failed saves reported finished since the last call, reported once."""
        failed, self._failed_saves = sorted(self._failed_saves), set()
        return failed

    def held(self) -> dict[str, int]:
        """How much per-request and per-step state is held (tests, debugging)."""
        return {"saves_in_flight": len(self._in_flight), "saves_unreported": len(self._saved),
                "finished_waiting": len(self._finished), "failed_unreported": len(self._failed),
                "save_steps_unreported": len(self._acked),
                "saves_streaming": len(self._streaming)}
