"""The lookup: ``get_num_new_matched_tokens``, what vLLM may be told of a returning
request's stored prefix. It starts the staging (``starts.py``) and answers None ("ask
again") until the staged chunks are held in host memory or the read is given up (then
0: vLLM recomputes). Scheduler thread. It never touches storage; it waits for a read it
has just started only briefly (``_read_grace``: at most ``READ_GRACE_S`` per engine step
in all, never longer than the recompute, not at all while storage is suspect), so a
read that a healthy tier finishes in milliseconds is answered in the same step.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from typing import Any

from kvtier.metrics import (
    record_drop,
    record_restore_stages,
)
from kvtier.vllm.identity import PENDING, Unsupported
from kvtier.vllm.scheduler.records import (
    _request_params,
    _Staging,
)
from kvtier.vllm.scheduler.starts import ShapeStarts
from kvtier.vllm.waitbound import READ_GRACE_S

log = logging.getLogger("kvtier.vllm")


class Lookups(ShapeStarts):
    """The lookup hook (``get_num_new_matched_tokens``)."""

    def _at_stake(self, lk: _Staging) -> tuple[int, int]:
        """The tokens ``[start, end)`` a staging restores: what waiting for its read may
        save (``waitbound``)."""
        return lk.first_chunk * self.ct, lk.end or (
            (lk.first_chunk + max(1, lk.full)) * self.ct + lk.tail_blocks * self.bs)

    def _read_grace(self, future: Future[Any], start_tokens: int, end_tokens: int) -> None:
        """Wait for a read just started, briefly (``WaitBound.grace``): without it the
        request is asked again only in the next engine step, however soon the read
        ends. The waits of one step share ``READ_GRACE_S``. Scheduler thread."""
        if self._grace_step != self._step:
            self._grace_step, self._grace_left = self._step, READ_GRACE_S
        budget = self.waits.grace(start_tokens, end_tokens, self._grace_left,
                                  self.clock.monotonic())
        if budget <= 0:
            return
        t0 = time.perf_counter()
        wait_futures([future], timeout=budget)
        self._grace_left -= time.perf_counter() - t0

    def get_num_new_matched_tokens(
        self, request: Any, num_computed: int
    ) -> tuple[int | None, bool]:
        rid = request.request_id
        self._epoch_of.setdefault(rid, self.identities.epoch)
        limit = ((request.num_tokens - 1) // self.bs) * self.bs  # vLLM must compute >= 1 token
        lk = self._lookups.get(rid)
        if lk is not None and lk.held is None and lk.future is None:
            lk = None
        if lk is not None and (num_computed < lk.first_chunk * self.ct or (
                (lk.parts or lk.pieces) and num_computed < lk.asked_at)):
            # vLLM's own hit shrank below what we started from (its cache evicted blocks
            # while the request waited): what was staged misses the blocks in between
            self._forget(rid)
            lk = None
        if lk is None:
            if not self._may_load(request) or rid in self._load_failed \
                    or getattr(request, "skip_reading_prefix_cache", False):
                # load: false; a load of this request failed already (vLLM asks again
                # after a failed asynchronous load: the same load would fail the same
                # way); or vLLM reads no prefix cache for it (prompt_logprobs) and would
                # take 0 tokens whatever kvtier staged
                return 0, False
            try:
                got = self._keys(request, request.num_tokens)
            except Unsupported:
                return 0, False
            if got is PENDING:
                return None, False
            ns, keys = got
            started = self.shape.start(request, ns, keys, num_computed, limit)
            if not isinstance(started, _Staging):
                return started
            lk = started
            self._lookups[rid] = lk
            if lk.future is not None and not lk.future.done():
                self._read_grace(lk.future, *self._at_stake(lk))
        if lk.future is not None:
            if not lk.future.done():
                # the wait never outlasts the recompute of what it restores (waitbound)
                # (a P/D decode restoring what its prefill node announced keeps the
                # configured allowance: that restore is the point of the hand-off)
                stall_s = self.load_stall_s if _request_params(request).get("expect") \
                    else self._idle_bound(self.load_stall_s, lk.progress, *self._at_stake(lk))
                if lk.progress is None or lk.progress.idle_for() < stall_s:
                    return None, False
                # A read made no progress for too long (a hung filesystem blocks in the
                # kernel): recompute now; the read's slots are released when it returns.
                lk.progress.cancel()
                self.waits.missed(self.clock.monotonic())
                record_restore_stages({**lk.progress.stages,
                                       "staged": time.perf_counter() - lk.t0})
                self._forget(rid)
                record_drop("load_timeout")
                log.warning("kvtier: restore for %s made no progress for %.2f s; "
                            "recomputing", rid, stall_s)
                return 0, False
            fut, lk.future = lk.future, None
            if lk.progress is not None:
                record_restore_stages({**lk.progress.stages,
                                       "staged": time.perf_counter() - lk.t0})
            try:
                lk.held = fut.result()
            except Exception:
                log.exception("kvtier: staging KV for %s failed; recomputing", rid)
                self._lookups.pop(rid, None)
                return 0, False
            if lk.stream is not None and len(lk.held) < lk.chunks:
                # a streamed restore's head did not all read (``lk.chunks`` is what it
                # asked for): restore what did, synchronously; claim nothing more
                lk.stream = None
            lk.chunks, lk.staged_step = len(lk.held), self._step
        assert lk.held is not None
        held = lk.stream[0].hits if lk.stream is not None else len(lk.held)
        tokens = (lk.first_chunk + min(held, lk.full)) * self.ct
        if held > lk.full:  # the tail was read too
            tokens += lk.tail_blocks * self.bs
        if lk.parts or lk.pieces:  # a window or a hybrid prefix: all of it, or nothing
            tokens = lk.end if len(lk.held) == len(lk.parts or lk.pieces) else 0
        tokens = min(tokens, limit)
        ext = tokens - num_computed
        # A fixed threshold applies to what was staged (a failed read shrinks it); under
        # ``auto`` the reads are paid for, so what is held is claimed.
        threshold = lk.threshold if lk.threshold is not None else self.policy.fixed_tokens
        if ext < max(1, threshold or 1):
            self._forget(rid)
            return 0, False
        lk.start_tokens = num_computed
        # a hybrid model's loads are asynchronous: a failed one must be reported per
        # request (vLLM cannot map block-level errors to requests across groups); so is
        # a streamed restore (its chunks arrive over several steps)
        # (and every restore where vLLM overlaps its steps: ``async_restores``)
        return ext, self.shape.async_loads or lk.stream is not None or self.async_restores
