"""``Reads``: where a stored prefix is (lookup, probe), and holding it in host slots (load).

* ``lookup_indexed`` answers "how long is the stored prefix, and where is each chunk"
  from the indexes (memory only); ``probe`` asks the lower tiers themselves on a probe
  thread and refreshes the indexes; ``lookup`` asks them on the calling thread (tools).
* ``load(found)`` takes that answer, promotes its lower-tier entries into host slots (on
  the IO pool of the tier each is read from, ahead of stores) and hands back the chunks
  *held* (``Held``), so they cannot be evicted before the caller copies them.

Invariants:

* ``load(keys, expect)`` serves a chunk only if it is what the reader expects
  (``ChunkSpec``: namespace, tokens, dtype, shape, payload length), host hits included:
  the worker copies whole slots, so a short or foreign chunk would hand it stale bytes. A
  mismatch is a counted corruption and a miss that ends the prefix; the lower tiers also
  remove the object (only if it is still the one read).
* ``load`` never trusts a stale lookup: a host entry evicted since, or an object gone from
  the tier named, is a counted miss there, then read from the next lower tier whose index
  knows it (memory only) if any, else the end of the prefix (recompute). Never a wrong
  chunk, and a tier's own answer is asked only where the lookup or that fallback points.
* ``load`` leaks nothing: a promotion slot is committed or aborted, never left WRITING, and
  a future that fails (only a bug can make it) holds no slots; one that succeeds holds
  exactly the slots in its ``Held``, to be released once.
* Chunks promoted from a lower tier are clean: they are already stored below.

Threads and locks: ``StoreState``. ``lookup_indexed``, ``probe`` and ``load`` are memory
only on the calling thread (vLLM's scheduler thread); the promotions run on IO threads,
the probes on probe threads.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from functools import partial
from typing import NamedTuple

import numpy as np

from kvtier.health import TierUnavailable
from kvtier.iopool import IOPool, IOPoolClosed
from kvtier.keys import ChunkKey
from kvtier.metrics import record_drop
from kvtier.objformat import ChunkMeta, ChunkSpec
from kvtier.store.types import HOST, Held, Hit, LoadProgress, Lookup
from kvtier.store.writeback import WriteBack
from kvtier.tiers.base import SharedTier, Tier

#: A host hit asks the lower tiers to refresh the chunk's copy at most this often per key
#: (each tier restamps at most once per its own ``touch_interval``), remembering this
#: many keys (``Reads._refresh_below``).
REFRESH_MIN_S = 30.0
REFRESHED_MAX = 65536
#: A read that finds another thread filling the host slot of its key re-checks its own
#: cancellation this often while it waits for that fill (``Reads._promote_one``).
SETTLE_SLICE_S = 0.05
#: ... and, for a read nobody can cancel (tools), gives up after this long.
SETTLE_MAX_S = 30.0
#: A promotion that finds every host slot held or dirty writes at most this many dirty
#: chunks below itself to free one (``WriteBack._clean_one``) before it gives up.
CLEAN_MAX = 4
#: ... and, with none dirty either (every slot held: other requests' staged chunks and
#: saves in flight, which the next engine step or two release), waits for one to come
#: free, looking this often, for at most ``SLOT_WAIT_MAX_S`` or until its load is
#: cancelled (the scheduler's wait bound). Before, the read ended there: a streamed
#: restore then failed whole and the request recomputed what the tiers held.
SLOT_POLL_S = 0.005
SLOT_WAIT_MAX_S = 1.0
#: A key no tier had is not asked again for this long (a burst of one new prefix).
PROBE_MISS_TTL_S = 0.25
PROBE_MISS_MAX = 4096


class _Entry(NamedTuple):
    """A chunk to load: its key, the tier to read it from, and what it must be."""

    key: ChunkKey
    tier: int
    expect: ChunkSpec | None


class Reads(WriteBack):
    # -- where the prefix is -------------------------------------------------------------
    def lookup_indexed(self, keys: Sequence[ChunkKey]) -> Lookup:
        """The stored prefix as this process's indexes know it. Memory only: vLLM's
        scheduler thread calls it. Tiers whose breaker is open are skipped."""
        where: list[int] = []
        usable = [(i, lt.tier) for i, (lt, b) in
                  enumerate(zip(self.lower, self.breakers, strict=True), start=1) if b.up]
        for key in keys:
            if self.host.indexed(key):
                where.append(HOST)
                continue
            i = next((i for i, tier in usable if tier.indexed(key)), None)
            if i is None:
                break
            where.append(i)
        return Lookup(tuple(keys[: len(where)]), tuple(where))

    def lookup(self, keys: Sequence[ChunkKey]) -> Lookup:
        """Authoritative lookup: may ask the tiers (I/O). IO threads and tools only."""
        n_host = self.host.contains_prefix(keys)
        where = [HOST] * n_host
        for key in keys[n_host:]:
            for i, tier in enumerate(self.tiers):
                if tier.contains_prefix([key]) == 1:
                    where.append(i)
                    break
            else:
                break
        return Lookup(tuple(keys[: len(where)]), tuple(where))

    def probe(
        self, keys: Sequence[ChunkKey], *, progress: LoadProgress | None = None,
        fresh: bool = False, alternatives: bool = False, stalled_s: float | None = None,
    ) -> Future[int] | None:
        """Ask the lower tiers themselves (on a probe thread) how many of
        ``keys`` lead a stored prefix: objects other nodes wrote, which this process's
        index does not know yet. The answer refreshes the indexes, so the next
        ``lookup_indexed`` sees them. A tier that is down, or has as many reads in flight
        as its breaker allows, is not asked. The future never raises.

        ``None`` (nothing asked) when ``PROBE_QUEUE`` probes are waiting already. A key
        that no tier had within ``PROBE_MISS_TTL_S`` ends the answer without asking
        again (unless ``fresh``: a P/D decode waiting for a key to appear). Once
        ``progress`` is cancelled (the caller's deadline) the probe asks nothing more.
        With ``alternatives`` the keys are not a chain but candidates (the tails of one
        chunk, longest first): a miss does not end the answer, and every key is asked;
        the answer counts the hits. With ``stalled_s``, a tier with a call overdue by that
        long when a key is asked (``Breaker.overdue``: not answering now, a hang's first
        sign) is not asked about it: a question would only wait behind the hang. Memory
        only on the calling thread."""
        keys = list(keys)
        clock = self.host.clock
        if progress is not None:
            progress.tiers = frozenset(range(1, len(self.lower) + 1))

        def job() -> int:
            n = 0
            for key in keys:
                if progress is not None and progress.cancelled:
                    break
                if self.host.indexed(key):
                    n += 1
                    continue
                missed = self._probe_misses.get(key)
                if not fresh and missed is not None and \
                        clock.monotonic() - missed < PROBE_MISS_TTL_S:
                    if alternatives:
                        continue
                    break
                if any(self._ask(lt.tier, key) for lt, b in zip(self.lower, self.breakers,
                                                                strict=True)
                       if stalled_s is None or not b.overdue(stalled_s, reads=True)):
                    n += 1
                    continue
                with self._lock:
                    self._probe_misses[key] = clock.monotonic()
                    self._probe_misses.move_to_end(key)
                    while len(self._probe_misses) > PROBE_MISS_MAX:
                        self._probe_misses.popitem(last=False)
                if not alternatives:
                    break
            return n

        return self.probe_io.submit_store(job)

    def _ask(self, tier: SharedTier, key: ChunkKey) -> bool:
        """``tier.contains_prefix([key])`` under its breaker; False if it may not be asked."""
        try:
            with self._call(tier, read=True):
                return tier.contains_prefix([key]) == 1
        except TierUnavailable:
            return False

    # -- holding it in host slots --------------------------------------------------------
    def load(
        self, found: Lookup, expect: ChunkSpec | Sequence[ChunkSpec] | None = None,
        progress: LoadProgress | None = None,
    ) -> Future[Held]:
        """Hold the chunks of ``found`` (a ``lookup_indexed`` or ``lookup`` answer, or its
        ``head``) in host slots, in order, promoting lower-tier entries into host slots.

        Each chunk is read from the tier ``found`` names: no tier is asked again where a
        key is. What changed since the lookup is checked, not trusted: a host entry lost
        meanwhile (evicted, or not what ``expect`` says), or an object gone from its tier
        (another node's collector, a corrupt object), is a counted miss there, then read
        from the next lower tier whose index knows it, if any; it ends the prefix when
        no tier below has the chunk. A chunk
        another load promoted meanwhile is served from the host. Leading host
        entries are held at once, on the calling thread; the rest are read on the IO pool
        (loads run before stores). With ``expect`` (one spec for every chunk, or one per
        entry of ``found``: a partial tail's differs), only chunks that match it are
        served: a host slot or object of another namespace, token count, dtype, shape or
        payload length is a counted miss. The future never raises for storage faults or
        bad objects: a chunk that cannot be read ends the prefix. If it raises anyway (a
        bug), it holds no slots. Each chunk is read on the IO pool of the tier it is read
        from (a run of chunks on one tier stays on that pool, then the load moves on to
        the next tier's pool): a hung tier holds only its own pool's threads, never
        another tier's. ``progress`` is touched after each chunk read; once cancelled, the load ends
        before its next chunk (what it holds by then is in the result).
        """
        specs: list[ChunkSpec | None]
        if expect is None or isinstance(expect, ChunkSpec):
            specs = [expect] * found.hits
        else:
            specs = list(expect)
            if len(specs) != found.hits:
                raise ValueError(f"{len(specs)} specs for {found.hits} chunks")
        for spec in [expect] if isinstance(expect, ChunkSpec) else specs:
            if spec is not None and spec.payload_len > self.host.slot_bytes:
                raise ValueError(
                    f"expected chunks of {spec.payload_len} bytes do not fit the host "
                    f"tier's {self.host.slot_bytes}-byte slots"
                )
        held = Held(self.host)
        entries = [_Entry(*e) for e in zip(found.keys, found.tiers, specs, strict=True)]
        if progress is not None and found.hits:
            # a chunk gone from its tier (or from the host) is read from a tier below it
            progress.tiers = frozenset(range(max(1, min(found.tiers)), len(self.lower) + 1))
        rest: list[_Entry] = []
        try:
            for i, (key, tier, spec) in enumerate(entries):
                if tier != HOST:
                    rest = entries[i:]
                    break
                got = self._hold_host(key, spec)
                if got is None:  # gone (or bad) since the lookup: read it below, or stop
                    alt = self._indexed_below(key)
                    rest = [] if alt is None else [_Entry(key, alt, spec), *entries[i + 1 :]]
                    break
                held.add(got)
            done: Future[Held] = Future()
            if not rest:
                done.set_result(held)
                return done
            self._hand_off(done, held, rest, progress)
            return done
        except BaseException:
            held.release()
            raise

    def get_into(
        self, key: ChunkKey, dst: memoryview, expect: ChunkSpec | None = None
    ) -> ChunkMeta | None:
        """Synchronous read of one chunk from the highest tier that has it (an authoritative
        ``lookup``: may do I/O; IO threads and tools only)."""
        held = self.load(self.lookup([key]), expect).result()
        try:
            if not held.slots:
                return None
            meta = held.slots[0][1]
            np.copyto(np.frombuffer(dst, dtype=np.uint8, count=meta.payload_len), held.view(0))
            return meta
        finally:
            held.release()

    def _entry_pool(self, tier: int) -> IOPool:
        """The IO pool that reads from tier ``tier`` (host entries: the first pool)."""
        return self._pool_of(self.tiers[tier]) if tier != HOST else self.io

    def _hand_off(self, done: Future[Held], held: Held, entries: list[_Entry],
                  progress: LoadProgress | None) -> None:
        """Queue the rest of a load (``entries``, non-empty) on the pool of the tier its
        first chunk is read from; ``done`` gets the result. If the pool is closed (or
        cancels the job unstarted), the slots held so far are released and ``done``
        fails. Any thread."""
        pool = self._entry_pool(entries[0].tier)
        try:
            job = pool.submit_load(partial(self._run_load, done, held, entries, progress,
                                           pool, time.perf_counter()))
        except BaseException as e:
            held.release()
            done.set_exception(e)
            return

        def unstarted(f: Future[None]) -> None:
            if f.cancelled():
                held.release()
                done.set_exception(IOPoolClosed("the load was cancelled before it ran"))

        job.add_done_callback(unstarted)
        if progress is not None:  # abandoned while queued (behind a hung tier): unqueue
            progress.on_cancel(job.cancel)

    def _run_load(self, done: Future[Held], held: Held, entries: list[_Entry],
                  progress: LoadProgress | None, pool: IOPool,
                  queued: float | None = None) -> None:
        """Read ``entries`` on ``pool`` (an IO thread) until one must be read from a tier
        served by another pool: hand the rest to that pool (so a hung tier holds only its
        own pool's threads, issue 32), else resolve ``done``. ``queued``: when the job
        was queued (the wait behind other loads or a running write is the ``queue``
        stage)."""
        if progress is not None and queued is not None:
            progress.waited("queue", time.perf_counter() - queued)
        try:
            rest = self._read_entries(held, entries, progress, pool)
        except BaseException as e:
            done.set_exception(e)  # _read_entries released what it held
            return
        if rest:
            self._hand_off(done, held, rest, progress)
        else:
            done.set_result(held)

    def _hold_host(self, key: ChunkKey, expect: ChunkSpec | None) -> Hit | None:
        """Hold ``key``'s host slot (a ``Hit`` from ``HOST``); a miss (evicted, or not what
        ``expect`` says) is counted."""
        got = self.host.hold(key, expect)
        if got is None:
            self.host.metrics.miss()
            return None
        self._refresh_below(key)
        return Hit(got[0], got[1], HOST)

    def _refresh_below(self, key: ChunkKey) -> None:
        """A host hit is a use of the chunk's lower-tier copies too: queue their
        ``refresh`` (a restamp at most once per tier's ``touch_interval``, and this
        asks at most once per ``REFRESH_MIN_S`` per key), so an object hot only in the
        host pool does not expire below it (review N9). Only tiers whose index knows
        the key, whose breaker is up and that have no call overdue. Memory only."""
        now = self.host.clock.monotonic()
        with self._lock:
            last = self._refreshed.get(key)
            if last is not None and now - last < REFRESH_MIN_S:
                return
            self._refreshed[key] = now
            self._refreshed.move_to_end(key)
            while len(self._refreshed) > REFRESHED_MAX:
                self._refreshed.popitem(last=False)
        for lt, b in zip(self.lower, self.breakers, strict=True):
            refresh = getattr(lt.tier, "refresh", None)
            if refresh is None or not b.up or b.overdue(b.stuck_s) or \
                    not lt.tier.indexed(key):
                continue
            self._submit(partial(self._refresh_one, lt.tier, refresh, key), "refresh",
                         self._pool_of(lt.tier), count_drop=False)

    def _refresh_one(self, tier: Tier, refresh: Callable[[ChunkKey], bool],
                     key: ChunkKey) -> None:
        try:
            with self._call(tier, read=False):
                refresh(key)
        except TierUnavailable:
            pass

    def _indexed_below(self, key: ChunkKey, tier: int = HOST) -> int | None:
        """The first tier below ``tier`` whose breaker is up and whose index knows ``key``
        (memory only): where a chunk that ``tier`` lost since the lookup may still be
        read."""
        return next((i for i, (lt, b) in enumerate(zip(self.lower, self.breakers,
                                                       strict=True), start=1)
                     if i > tier and b.up and lt.tier.indexed(key)), None)

    def _read_entries(
        self, held: Held, entries: list[_Entry], progress: LoadProgress | None,
        pool: IOPool,
    ) -> list[_Entry]:
        """Read ``entries`` in order into ``held`` while each is read from a tier that
        ``pool`` serves (host entries anywhere); returns the entries left for another
        pool (a lower tier's chunk, or a fallback read below), empty when the load is
        done (every chunk, or a miss that ends the prefix, or cancelled)."""
        try:
            for i, (key, tier, expect) in enumerate(entries):
                if progress is not None and progress.cancelled:
                    break  # the caller gave up: read no more
                if tier != HOST and self._entry_pool(tier) is not pool:
                    return entries[i:]
                got = (self._hold_host(key, expect) if tier == HOST
                       else self._promote_one(key, tier, expect, progress))
                while got is None and (below := self._indexed_below(key, tier)) is not None:
                    tier = below  # lost where the lookup saw it: the next tier down
                    if self._entry_pool(tier) is not pool:
                        return [_Entry(key, tier, expect), *entries[i + 1:]]
                    got = self._promote_one(key, tier, expect, progress)
                if got is None:
                    break
                held.add(got)
                if progress is not None:
                    progress.touch()
        except BaseException:
            held.release()  # the caller gets the exception, and no slots to release
            raise
        return []

    def _promote_one(
        self, key: ChunkKey, tier_index: int, expect: ChunkSpec | None,
        progress: LoadProgress | None = None,
    ) -> Hit | None:
        """Read ``key`` from tier ``tier_index`` (where the lookup found it) into a host
        slot and hold it (a ``Hit`` from ``tier_index``), or ``None`` if it cannot be had
        now (gone, bad, or the tier is down).

        A key another thread is filling now (another request's restore of a shared
        prefix, or a save) is waited for, in slices of ``SETTLE_SLICE_S``, until that
        fill ends or ``progress`` is cancelled (the scheduler gave this load up), then
        held; if the fill failed, it is read here."""
        tier = self.lower[tier_index - 1].tier
        t0 = time.perf_counter()
        r = self.host.reserve(key)
        cleaned = 0
        slot_wait_ends: float | None = None
        while r is None:  # promoted (or being written) meanwhile by someone else
            got = self._hold_host(key, expect)
            if got is None and not self.host.index.pending(key):
                # every slot is held or dirty: write a dirty one below now, on this IO
                # thread (a healthy tier takes milliseconds), and take its slot
                if cleaned < CLEAN_MAX and not (progress and progress.cancelled) and \
                        self._clean_one(progress, self._entry_pool(tier_index)):
                    cleaned += 1
                    r = self.host.reserve(key)
                    continue
                if slot_wait_ends is None:
                    slot_wait_ends = time.perf_counter() + SLOT_WAIT_MAX_S
                if self._await_slot(progress, slot_wait_ends):
                    r = self.host.reserve(key)
                    continue
                record_drop("restore_no_slot")
                self._spill_if_needed()
                return None
            if got is not None:
                return got
            settling = time.perf_counter()
            while not self.host.wait_settled(key, SETTLE_SLICE_S):
                if progress is not None and progress.cancelled:
                    progress.waited("settle", time.perf_counter() - settling)
                    return None
                if progress is None and time.perf_counter() - t0 > SETTLE_MAX_S:
                    return None
            if progress is not None:
                progress.waited("settle", time.perf_counter() - settling)
            r = self.host.reserve(key)
        nbytes = expect.payload_len if expect is not None else self.host.slot_bytes
        reading = time.perf_counter()
        try:
            with self._call(tier, read=True, nbytes=nbytes):
                filled = self._fill(r.slot, key, tier, expect)
        except TierUnavailable:
            self.host.abort(r.slot)
            return None
        finally:
            if progress is not None:
                progress.waited("read", time.perf_counter() - reading)
        if not filled:
            return None
        got = self._hold_host(key, expect)
        if got is not None and self.on_read is not None:
            # verified hits only: what a restore really costs
            self.on_read(tier.name, got.meta.payload_len, time.perf_counter() - t0)
        return None if got is None else got._replace(tier=tier_index)

    def _await_slot(self, progress: LoadProgress | None, ends: float) -> bool:
        """IO threads only: wait until a host slot can be reserved (True), or until
        ``ends`` (``perf_counter``) or the load is cancelled (False); a read nobody can
        cancel (tools) does not wait. The time is the load's ``slot`` stage."""
        if progress is None:
            return False
        t0 = time.perf_counter()
        try:
            while not self.host.index.reservable():
                if progress.cancelled or time.perf_counter() >= ends:
                    return False
                time.sleep(SLOT_POLL_S)  # slots come free on other threads' steps
            return True
        finally:
            progress.waited("slot", time.perf_counter() - t0)

    def _fill(self, slot: int, key: ChunkKey, tier: Tier, expect: ChunkSpec | None) -> bool:
        """Read ``key`` from ``tier`` into the WRITING ``slot``; commit it (clean, with the
        meta the tier verified) if the tier returned verified bytes, else abort it. The
        slot is never left WRITING."""
        try:
            meta = tier.get_into(key, self.host.view(slot).data, expect=expect)
        except BaseException:
            self.host.abort(slot)
            raise
        if meta is None:
            self.host.abort(slot)
            return False
        self.host.commit(slot, meta, dirty=False)  # aborts and raises if it cannot
        return True
