"""``ObjectTier``: the one algorithm of a persistent tier of objects (file, S3) over a
``Transport`` (``kvtier.tiers.transport``): index, start scan, lookups, reads and writes
with verification, recency, capacity collection, leases and expiry, and the walk that keeps
the index fresh. ``FileTier`` and ``S3Tier`` only build a transport and add what their
store alone has (temp files; the restamp thread).

Invariants:

* **Serve from the first second.** The constructor lists nothing: it checks that the
  store can be listed with one call of constant cost (``Transport.check_listing``; a
  store that cannot be listed fails there, with a message naming the setting) and, with
  ``background_index``, fills the whole index on a thread of its own. Until it is
  complete a key the index does not know is answered by the store itself
  (``contains_prefix`` asks it: ``TieredStore.probe`` does that on a probe thread, never
  the scheduler's), and ``collect`` does nothing (usage is not known yet). Progress and
  readiness are exported (``kvtier_tier_index_scanned_objects``, ``kvtier_tier_index_ready``)
  and the end is logged with the time taken. The scan itself is ``kvtier.tiers.scan``'s:
  ``index_threads`` workers list the store's slices (a file tier's top-level
  directories) in parallel. With ``scan_rate`` (objects per second, 0: no limit) it waits
  before each page until, counted from its start, it has listed at most that many per
  second (``scan_delay``): whole pages, so a burst is one page per worker (one leaf
  directory, one S3 listing page). ``close`` ends the wait at once. Collection waits for
  the whole scan, so a rate that makes it take hours leaves the tier uncollected that
  long.
* **A compact index** (``CompactIndex``, 44 bytes an entry plus its table cell). Scanned
  entries are linked coldest first when the scan ends; until then eviction has nothing to
  go on, which is why ``collect`` waits.
* **Incremental freshness, bounded ticks.** The walk (``kvtier.tiers.walk``) lists one
  page per step (one leaf directory, one S3 listing page) and reconciles it with the
  index: objects other nodes wrote are added, objects gone from the pages' key range
  (and not recorded since the listing began) are dropped, and (exact listings) newer
  stamps are taken. One tick (an ``expire`` call, or ``collect``'s walk step every
  ``walk_interval`` seconds) stops at the first page boundary after ``tick.objects``
  listed objects or ``tick.seconds`` (the injected clock), or at the end of a pass, and
  the next tick resumes at the next page. A full pass takes about its listing cost /
  ``tick.seconds`` ticks (``walk.last_pass`` measures it); no heartbeat lists the world.
* **Re-checks before deletion** (``kvtier.tiers.reclaim``): ``collect`` and ``expire``
  decide on an index snapshot and delete only what the store confirms.
* No I/O under the index lock; one collection at a time (``collect`` returns at once
  while one runs, ``expire`` and ``rescan`` wait for it).
* Any thread may call any method; data-path methods never raise store faults (they are
  counted, the first of an outage logged) and turn them into misses or ``FAILED``.
"""

from __future__ import annotations

import errno
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence

from kvtier.clock import Clock
from kvtier.crypt import ChunkCipher, ForeignKey
from kvtier.keys import ChunkKey
from kvtier.metrics import TierMetrics
from kvtier.objformat import (
    HEADER_SPAN,
    ChunkMeta,
    ChunkSpec,
    CorruptObject,
    decode_header,
    decode_sealed_header,
    encode_header,
    verify_payload,
)
from kvtier.tiers.base import ObjectInfo, PutStatus, TierUsage, WriteMode, as_bytes_view
from kvtier.tiers.compact import MAX_SIZE, CompactIndex
from kvtier.tiers.reclaim import Reclaimer
from kvtier.tiers.scan import StartScan
from kvtier.tiers.transport import (
    Changed,
    Exists,
    Missing,
    Outcome,
    Transport,
    Version,
)
from kvtier.tiers.walk import UNBOUNDED, TickBudget, Walk

log = logging.getLogger("kvtier.objtier")

#: What one tick of the walk (an ``expire`` call, ``collect``'s walk step) costs at most:
#: listed objects, and seconds (the first page boundary after them).
TICK_OBJECTS = 20_000
TICK_SECONDS = 1.0
DEFAULT_TICK = TickBudget(TICK_OBJECTS, TICK_SECONDS)


#: S3 error codes that say the bucket or account is out of space (RGW's quota, MinIO).
FULL_CODES = frozenset({"QuotaExceeded", "XMinioStorageFull", "InsufficientStorage"})


#: After a refusal for space, each object stored raises the room by this fraction of its
#: size (``ObjectTier._full``).
REGROW = 4


def is_full(e: Exception) -> bool:
    """A write refused for space: ENOSPC or EDQUOT from a filesystem, or an S3 quota."""
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    response = getattr(e, "response", None)  # botocore's ClientError
    if isinstance(response, dict):
        return response.get("Error", {}).get("Code") in FULL_CODES
    return False


class ObjectTier:
    #: ``put`` collects (capacity) itself; a ``TieredStore`` turns this off and queues
    #: collection as a job of its own, outside the breaker-timed write.
    collect_on_put = True

    def __init__(
        self, transport: Transport, capacity_bytes: int, *, name: str, clock: Clock,
        touch_interval: float, low_watermark: float,
        tick: TickBudget = DEFAULT_TICK,
        walk_interval: float = 30.0, scan_rate: float = 0.0, index_threads: int = 1,
        metrics: TierMetrics | None = None,
    ) -> None:
        """Subclasses call ``_open`` once their transport is ready. ``index_threads``:
        workers of the start scan (``kvtier.tiers.scan``). ``metrics``: the tier's
        counters, when its transport counts into them too (else new ones)."""
        if scan_rate < 0:
            raise ValueError(f"scan_rate: must be >= 0 objects/s (0: no limit), got {scan_rate}")
        if index_threads < 1:
            raise ValueError(f"index_threads: must be >= 1, got {index_threads}")
        self.transport = transport
        self._capacity = capacity_bytes
        #: what collection keeps usage under: ``capacity``, or less once the store
        #: refused a write for space (``_full``); grows back by each object stored
        self.room = capacity_bytes
        self._name = name
        self._clock = clock
        self._touch_interval = touch_interval
        #: ``encryption.enabled``: payloads are sealed on write and opened on read
        #: (``kvtier.crypt``); set once, before the tier is used (``kvtier.build``)
        self.cipher: ChunkCipher | None = None
        self._scratch = threading.local()  # per IO thread: a sealed payload as read
        self._low_watermark = low_watermark
        self._tick = tick
        self._walk_interval = walk_interval
        self.metrics = metrics if metrics is not None else TierMetrics(name)
        self.metrics.capacity(capacity_bytes)
        self.index = CompactIndex()
        self._collecting = threading.Lock()  # one collection at a time; held across I/O
        #: The walk (used under ``_collecting`` only).
        self.walk = Walk(transport, self.index, clock, self._fault, name=name)
        self._next_walk = clock.monotonic() + walk_interval
        #: Re-checked removal (``collect``, ``expire``; under ``_collecting`` only).
        self._reclaim = Reclaimer(transport, self.index, self.metrics, self._fault, self._used)
        self._ready = threading.Event()
        self._scan_rate = scan_rate
        self._index_threads = index_threads
        self._closing = threading.Event()  # set by close: the start scan stops
        self._faulting = False  # log the first fault of an outage; count the rest
        self._said: set[tuple[str, str]] = set()  # persistent faults logged (op, kind)
        self.index_seconds: float | None = None  # how long the start scan took
        #: Told each key this node's ``put`` wrote (``STORED``; not objects other nodes
        #: wrote, found by the scan or walk): the KV event stream publishes a shared
        #: object from its writer only (``kvtier.vllm.events``). Must only enqueue.
        self.on_stored: Callable[[ChunkKey], None] | None = None

    @property
    def capacity(self) -> int:
        """The configured capacity (bytes); setting it resets ``room`` to it."""
        return self._capacity

    @capacity.setter
    def capacity(self, nbytes: int) -> None:
        self._capacity = self.room = nbytes
        self.metrics.capacity(nbytes)

    @property
    def name(self) -> str:
        return self._name

    # -- start scan ----------------------------------------------------------------------
    def _open(self, background: bool) -> None:
        """Check that the store can be listed (one call of constant cost; raises the
        transport's fault if not), then scan it here or, with ``background``, on a
        thread of its own."""
        self.metrics.index_scan(0, ready=False)
        t0 = time.perf_counter()
        self.transport.check_listing()
        if background:
            threading.Thread(target=self._fill, args=(t0,), name=f"{self._name}-index",
                             daemon=True).start()
        else:
            self._fill(t0)

    def _fill(self, t0: float) -> None:
        scanned = StartScan(
            self.transport, self.index, threads=self._index_threads, rate=self._scan_rate,
            stop=self._closing, name=self._name,
            progress=lambda n: self.metrics.index_scan(n, ready=False),
        ).run()
        n = scanned.objects
        if scanned.fault is not None:  # the thread must end ready: the walk finds the rest
            self._fault("scan", scanned.fault)
            log.warning("%s: the start scan stopped after %d objects (%s); the walk "
                        "finds the rest", self._name, n, type(scanned.fault).__name__)
        self.index.finish_scan()
        self._after_fill()
        self._report_used()
        self.index_seconds = time.perf_counter() - t0
        self._ready.set()
        self.metrics.index_scan(n, ready=True)
        log.info("%s: index ready: %d objects scanned in %.2f s by %d threads (%d indexed)",
                 self._name, n, self.index_seconds, self._index_threads, len(self.index))

    def wait_indexed(self, timeout: float | None = None) -> bool:
        """Wait until the start scan is done (tools, tests); True if it is."""
        return self._ready.wait(timeout)

    @property
    def index_ready(self) -> bool:
        return self._ready.is_set()

    # -- hooks of the store kinds ----------------------------------------------------------
    def _after_fill(self) -> None:
        """Runs once the start scan is done (on its thread)."""

    def _extra_bytes(self) -> int:
        """Bytes the store holds outside indexed objects (temp files)."""
        return 0

    def _before_collect(self) -> None:
        """Runs at the start of each ``collect`` (under the collection lock)."""

    def _after_hit(self, key: ChunkKey, now: float, version: Version) -> bool:
        """Write the shared stamp after a hit (at most once per ``touch_interval``);
        False if it was neither written nor queued (the next hit tries again)."""
        try:
            self.transport.stamp(key, now)
        except self.transport.faults as e:
            self._fault("touch", e)
        return True

    # -- small helpers -------------------------------------------------------------------
    def _fault(self, op: str, e: Exception) -> None:
        self.metrics.error(op)
        if getattr(e, "persistent", False):  # a setting, not an outage: said once
            if (op, type(e).__name__) not in self._said:
                self._said.add((op, type(e).__name__))
                log.error("%s: %s failed: %s (counted in kvtier_tier_errors_total; logged "
                          "once)", self._name, op, e)
            return
        if not self._faulting:
            log.warning("%s: %s failed (%s: %s); counting, not logging, until it recovers",
                        self._name, op, type(e).__name__, str(e)[:300])
        self._faulting = True

    def _used(self) -> int:
        return self.index.bytes + self._extra_bytes()

    def _report_used(self) -> None:
        self.metrics.used(self._used())

    def _known(self, key: ChunkKey) -> bool:
        """Indexed, or in the store (written by another node, or not scanned yet). The
        index may be stale: another node's collector can delete what we remember; a read
        then misses and recomputes."""
        return key in self.index or self._present(key)

    def _present(self, key: ChunkKey) -> bool:
        """Ask the store, never the index; refresh the index either way."""
        try:
            st = self.transport.head(key)
        except self.transport.faults as e:
            self._fault("head", e)
            return False
        if st is None:
            self.index.forget(key)
            return False
        self.index.remember(key, st.size, st.used)
        return True

    def present(self, key: ChunkKey) -> bool:
        """``SharedTier.present``: one HEAD or stat, whatever the index says."""
        return self._present(key)

    # -- Tier protocol -------------------------------------------------------------------
    def indexed(self, key: ChunkKey) -> bool:
        """In this node's index (memory only; may be stale, see ``contains_prefix``)."""
        return key in self.index

    def contains_prefix(self, keys: Sequence[ChunkKey]) -> int:
        """The stored prefix; asks the store of each key the index does not know (I/O:
        IO and probe threads only)."""
        for i, key in enumerate(keys):
            if not self._known(key):
                return i
        return len(keys)

    def _scratch_of(self, nbytes: int) -> memoryview:
        """This thread's buffer for a sealed payload, as read or to be written (grown,
        never shrunk; one call's use ends before the thread's next call)."""
        buf: bytearray | None = getattr(self._scratch, "buf", None)
        if buf is None or len(buf) < nbytes:
            buf = self._scratch.buf = bytearray(nbytes)
        return memoryview(buf)[:nbytes]

    def get_into(
        self, key: ChunkKey, dst: memoryview, *, expect: ChunkSpec | None = None
    ) -> ChunkMeta | None:
        t0 = time.perf_counter()
        out = dst = as_bytes_view(dst)
        cipher = self.cipher
        if cipher is not None:  # read the ciphertext aside, open it into ``out``
            dst = self._scratch_of(out.nbytes)
        head = memoryview(bytearray(HEADER_SPAN))
        entry = self.index.get(key)
        cap = HEADER_SPAN + dst.nbytes
        plan = max(1, min(entry.size, cap)) if entry is not None else cap
        try:
            try:
                total, version = self.transport.read(key, head, dst, plan)
            except Changed:  # replaced mid-read (a restamp of a multipart object): once more
                total, version = self.transport.read(key, head, dst, plan)
        except (Missing, Changed) as e:
            if isinstance(e, Missing):
                self.index.forget(key)
            self.metrics.miss()
            return None
        except self.transport.faults as e:
            self._fault("get", e)
            self.metrics.miss()
            return None
        try:
            meta, csum, seal = decode_sealed_header(
                head[: min(total, HEADER_SPAN)], expect_key=key, expect=expect,
                object_len=total, max_payload=dst.nbytes)
            if seal is not None and cipher is None:
                raise ForeignKey("a sealed object, and encryption is off here")
            if cipher is not None:
                # the GCM tag authenticates every byte (the checksum would only repeat it);
                # a plaintext object is refused there
                cipher.open_into(meta, seal, dst[: meta.payload_len], out[: meta.payload_len])
            else:
                verify_payload(meta, csum, dst[: meta.payload_len])
        except ForeignKey as e:  # readable by another configuration: not damage
            self._refused_once(key, str(e))
            self.metrics.miss()
            return None
        except CorruptObject as e:
            self._quarantine(key, version, str(e))
            self.metrics.miss()
            return None
        self._faulting = False
        self._touch(key, total, version)
        self.metrics.hit(meta.payload_len)
        self.metrics.observe("get", time.perf_counter() - t0)
        return meta

    def _touch(self, key: ChunkKey, size: int, version: Version) -> None:
        now = self._clock.wall()
        entry = self.index.get(key)
        if entry is not None and now - entry.touched < self._touch_interval:
            self.index.touch(key, now)  # this node's view; the shared one waits for the next
            return
        self.index.remember(key, size, now, now)
        if not self._after_hit(key, now, version):  # dropped: not done, so not recorded
            self.index.remember(key, size, now, float("-inf") if entry is None else entry.touched)

    def _refused_once(self, key: ChunkKey, why: str) -> None:
        """An object this node may not read (``ForeignKey``): counted, left in place,
        logged once per tier."""
        self.metrics.corrupt()
        if not getattr(self, "_foreign_logged", False):
            self._foreign_logged = True
            log.warning("object %s not served: %s (every node sharing this tier needs the "
                        "same encryption settings and keys); further ones are counted in "
                        "kvtier_tier_corruptions_total only",
                        self.transport.describe(key), why)

    def _quarantine(self, key: ChunkKey, version: Version, why: str) -> None:
        """Remove a corrupt object, unless someone replaced it since it was read."""
        self.metrics.corrupt()
        outcome = self.transport.delete_if(key, version)
        if isinstance(outcome, Exception):
            self._fault("delete", outcome)
        done = "removed" if outcome is Outcome.DELETED else "not removed"
        log.warning("corrupt object %s %s: %s", self.transport.describe(key), done, why)
        self.index.forget(key)

    def put(
        self, meta: ChunkMeta, payload: memoryview, mode: WriteMode = WriteMode.CREATE
    ) -> PutStatus:
        t0 = time.perf_counter()
        create = mode is WriteMode.CREATE
        # Ask the store, not the index: a stale entry (another node's collector removed
        # the object) must not turn a write-through into a silent no-op.
        if create and (self.transport.cheap_head or meta.key in self.index) \
                and self._present(meta.key):
            self.refresh(meta.key)
            return PutStatus.EXISTS
        if meta.object_len > min(self.capacity, MAX_SIZE):
            return PutStatus.NO_SPACE
        body = as_bytes_view(payload)
        seal = None
        if self.cipher is not None:  # sealed into this thread's scratch buffer
            body, seal = self.cipher.seal(meta, body, self._scratch_of(body.nbytes))
        header = memoryview(encode_header(meta, body, seal))
        try:
            stamp = self.transport.write(meta.key, header, body, create=create,
                                         now=self._clock.wall())
        except Exists:
            self.refresh(meta.key)
            return PutStatus.EXISTS
        except self.transport.faults as e:
            if not is_full(e):
                self._fault("put", e)
                return PutStatus.FAILED
            self._full(e, meta.object_len)
            if self.collect_on_put:
                self.collect()
            return PutStatus.NO_SPACE
        self._faulting = False
        if self.room < self.capacity:  # feel for room coming back (others collected)
            self.room = min(self.capacity, self.room + meta.object_len // REGROW)
            self.metrics.capacity(self.room)
        self.index.remember(meta.key, meta.object_len, stamp, stamp)
        if self.on_stored is not None:
            self.on_stored(meta.key)
        self.metrics.wrote(meta.payload_len)
        self.metrics.observe("put", time.perf_counter() - t0)
        if self.collect_on_put:  # else whoever owns the tier collects (TieredStore)
            self.collect()
        self._report_used()
        return PutStatus.STORED

    def delete(self, keys: Iterable[ChunkKey]) -> int:
        known = [k for k in dict.fromkeys(keys) if self._known(k)]
        outcomes, fault = self.transport.delete([(k, None) for k in known])
        if fault is not None:
            self._fault("delete", fault)
        n = 0
        for key in known:
            outcome = outcomes.get(key)
            if outcome is None or outcome is Outcome.KEPT:
                continue
            self.index.forget(key)
            n += outcome is Outcome.DELETED
        self._report_used()
        return n

    def scan(self) -> Iterator[ObjectInfo]:
        for key, e in self.index.items():
            yield ObjectInfo(key, e.size, e.last_used)

    def _full(self, e: Exception, nbytes: int) -> None:
        """The store refused a write for space (a full filesystem, a quota: ``is_full``)
        although this node's view was within ``capacity``: the real room is smaller
        (other nodes' objects this node has not seen yet, files kvtier does not count,
        a quota below ``capacity``). Collection now keeps usage under what is held less
        the ``nbytes`` that did not fit (``room``), so it frees room at once; each
        object stored after raises ``room`` by ``1 / REGROW`` of its size, up to
        ``capacity``, so a store that stays full refuses about one write in
        ``REGROW / (1 - low_watermark)`` chunks (review N4: a full store was never
        collected and the tier stayed unwritable for good)."""
        first = self.room >= self.capacity  # the first refusal since room was whole
        self.room = min(self.room, max(0, self._used() - nbytes))
        self.metrics.full(self.room)
        if first:
            log.warning("%s: the store is full (%s); collecting to %d bytes (configured "
                        "capacity %d); counted in kvtier_tier_full_total", self._name, e,
                        self.room, self.capacity)

    def usage(self) -> TierUsage:
        """Objects indexed; bytes include what the store holds besides (temp files)."""
        return TierUsage(len(self.index), self._used(), self.capacity)

    # -- capacity ------------------------------------------------------------------------
    @property
    def passes(self) -> int:
        """Full passes the walk has completed (tests, benchmarks)."""
        return self.walk.passes

    def collect(self) -> int:
        """Walk one tick if ``walk_interval`` has passed, then delete least recently used
        objects until usage is under the low watermark. Returns bytes freed; 0 at once if
        another thread is collecting or the start scan is still running."""
        if not self._collecting.acquire(blocking=False):
            return 0
        try:
            if not self._ready.is_set():
                return 0
            now = self._clock.monotonic()
            if now >= self._next_walk:
                self._next_walk = now + self._walk_interval
                for _ in self.walk.tick(self._tick, "collect"):
                    pass
            self._before_collect()
            return self._reclaim.evict_coldest(self.room, self._low_watermark)
        finally:
            self._collecting.release()

    def rescan(self) -> None:
        """Walk one whole pass from the start now (other nodes' writes, removals)."""
        with self._collecting:
            self.walk.restart()
            for _ in self.walk.tick(UNBOUNDED, "scan"):
                pass
            self._report_used()

    # -- leases --------------------------------------------------------------------------
    def read_meta(self, key: ChunkKey) -> ChunkMeta | None:
        """The object's verified header (not its payload), or ``None`` if absent or bad."""
        head = memoryview(bytearray(HEADER_SPAN))
        try:
            total = self.transport.read_header(key, head)
        except self.transport.faults as e:
            self._fault("get", e)
            return None
        if total is None:
            return None
        try:
            return decode_header(head[: min(total, HEADER_SPAN)], expect_key=key,
                                 object_len=total)[0]
        except CorruptObject:
            return None

    @property
    def touch_interval(self) -> float:
        """Seconds between two writes of an object's shared stamp (recency, lease)."""
        return self._touch_interval

    def refresh(self, key: ChunkKey) -> bool:
        """``renew`` unless this node stamped ``key`` within ``touch_interval``: a save
        that found the object there already (``EXISTS``) or a hit on a copy held above
        (the host pool) is a use, and without it the object's lease ran out under a
        chunk hot in memory (review N9). False if it was not stamped now."""
        entry = self.index.get(key)
        if entry is not None and self._clock.wall() - entry.touched < self._touch_interval:
            return False
        return self.renew(key)

    def renew(self, key: ChunkKey) -> bool:
        """Restart the object's lease now; ``False`` if it is not there."""
        now = self._clock.wall()
        try:
            st = self.transport.stamp(key, now)
        except self.transport.faults as e:
            self._fault("touch", e)
            return False
        if st is None:
            self.index.forget(key)
            return False
        self.index.remember(key, st.size, now, now)
        return True

    def expire(self, lease_seconds: float, *, whole_pass: bool = False) -> int:
        """One tick of expiry: walk one tick's pages (``tick``: listed objects, seconds;
        the end of a pass ends it too) and remove the objects on them not used or renewed
        for ``lease_seconds``, re-checking each first. ``whole_pass`` (tools): one whole
        pass from the start instead. Returns how many were removed."""
        with self._collecting:
            if whole_pass:
                self.walk.restart()
            cutoff = self._clock.wall() - lease_seconds
            budget = UNBOUNDED if whole_pass else self._tick
            n = sum(self._reclaim.expire_page(page, cutoff)
                    for page in self.walk.tick(budget, "expire"))
            self._report_used()
        return n

    def close(self) -> None:
        self._closing.set()  # the start scan stops after its current page (or wait)
        self.transport.close()
