"""What a lookup asks beyond the indexes: the lower tiers' probes (asked on an IO
thread, bounded by ``restore.lookup_timeout_seconds``) and, for a P/D decode node, what
its prefill node announced and how long it waits for it. Scheduler thread; never waits.
"""

from __future__ import annotations

import logging
from typing import Any

from kvtier.keys import ChunkKey
from kvtier.store import LoadProgress
from kvtier.vllm.scheduler.keys import RequestKeys
from kvtier.vllm.scheduler.records import (
    PROBE_INTERVAL_S,
    _Probe,
    _request_params,
)

log = logging.getLogger("kvtier.vllm")


class Probes(RequestKeys):
    """Lower-tier probes and P/D announcements, for the lookup."""

    def _probing(self, rid: str, beyond: list[ChunkKey], waiting: bool, *,
                 alternatives: bool = False, tail: bool = False) -> bool:
        """Ask the lower tiers about ``beyond`` (the chunks past what the indexes know) on
        an IO thread; True while the answer is pending: the hook then answers "ask again".

        One probe per request, given up after ``restore.lookup_timeout_seconds``, or after
        the recompute of what it asks about once a tier call it waits on has run that
        long (``waitbound``); then the indexes' answer stands: a recompute, never a wait
        on storage. A P/D decode that
        waits for announced chunks probes again, at most every ``PROBE_INTERVAL_S``.
        ``tail``: the request's second probe, for its tail's candidates (``_tail_probes``).
        """
        if not beyond:
            return False
        now = self.clock.monotonic()
        probes = self._tail_probes if tail else self._probes
        p = probes.get(rid)
        if p is None or (waiting and p.answered is not None
                         and now - p.answered >= PROBE_INTERVAL_S):
            stalled_s = self.waits.evidence_s
            if not self.store.can_probe(stalled_s):
                return False  # every lower tier is down, busy or stalled: the indexes answer
            progress = LoadProgress(self.clock)
            fut = self.store.probe(beyond, progress=progress, fresh=waiting,
                                   alternatives=alternatives, stalled_s=stalled_s)
            if fut is None:
                log.debug("kvtier: probe queue full; %s answered from the indexes", rid)
                return False
            probes[rid] = _Probe(fut, now, progress, at_stake=len(beyond) * self.ct,
                                 waiting=waiting)
            return True
        if p.answered is not None:
            return False
        if p.future.done():
            p.answered = now
            return False
        # the probe never outlasts the recompute of what it asks about once a tier call
        # it waits on has stalled (waitbound); a P/D decode waiting for announced chunks
        # keeps the configured seconds
        limit = self.lookup_timeout_s if p.waiting else self._idle_bound(
            self.lookup_timeout_s, p.progress, 0, p.at_stake)
        if now - p.started < limit:
            return True
        p.answered = now
        self.waits.missed(now)
        p.progress.cancel()  # it asks nothing more once its tier answers
        p.future.cancel()  # not started yet: never runs
        log.info("kvtier: lower tiers did not answer for %s within %.2f s; not waiting",
                 rid, limit)
        return False

    def _announced(self, request: Any, keys: list[ChunkKey],
                   limit: int) -> tuple[int, ChunkKey | None]:
        """What the prefill node announced for this request and we may use (P/D), below
        ``limit`` tokens: its whole chunks, and the key of its tail when it announced one
        (``tokens`` not a multiple of ``chunk_tokens``; ``last_key`` then names the
        tail)."""
        usable = min(len(keys), -(-limit // self.ct))
        expect = _request_params(request).get("expect")
        if not isinstance(expect, dict):
            return 0, None
        tokens, last = expect.get("tokens"), expect.get("last_key")
        if not isinstance(tokens, int) or not isinstance(last, str) or tokens < self.bs:
            return 0, None
        n, k = divmod(tokens, self.ct)
        k //= self.bs
        ok = n <= len(keys) and tokens <= request.num_tokens
        if ok and k:
            tail = self._tail_key(request, keys, n, k)
            if tail.hex() == last:
                # usable if it restores a block below the limit; with tails off here,
                # wait for the whole chunks only
                use = self.tails and n * self.ct < limit
                return min(n, usable), tail if use else None
            ok = False
        if not ok or (not k and keys[n - 1].hex() != last):
            log.warning(
                "kvtier: %s announces %d tokens ending in %s, which is not this prompt's "
                "chunk; not waiting for it", request.request_id, tokens, last[:16],
            )
            return 0, None
        return min(n, usable), None

    def _keep_waiting(self, rid: str) -> bool:
        now = self.clock.monotonic()
        t0 = self._waiting.setdefault(rid, now)
        if now - t0 < self.wait_s:
            return True
        log.warning(
            "kvtier: announced KV for %s not visible after %.1f s; computing the rest",
            rid, now - t0,
        )
        return False
