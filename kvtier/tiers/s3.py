"""``S3Tier``: chunks as objects in an S3 bucket (AWS or any S3-compatible endpoint).

Layout: ``<prefix>kv/<k[0:2]>/<key-hex>.kv``, one self-describing object per chunk
(``kvtier.objformat``). Names are hex only, so no key can escape ``prefix``. This module
keeps the index, recency and capacity; ``kvtier.tiers.s3io`` moves the bytes.

Invariants:

* A PUT is atomic: readers see the whole object or none. CREATE is a conditional put
  (``If-None-Match: *``), so it never replaces an object, not even one another node wrote
  a moment ago; OVERWRITE is a plain put. Objects above ``multipart_threshold`` go up as
  a multipart upload with parallel parts.
* Which conditions the endpoint honours is probed once at start (``conditionals: auto``;
  ``kvtier.tiers.s3caps``) or set by config (``trusted``/``untrusted``), and is fixed for
  the tier's life (``self.conditionals``). Where one is not honoured (Ceph RGW 16.2
  ignores If-None-Match on multipart completion, ETag conditions on DeleteObject and
  DeleteObjects, and the copy condition) a HEAD just before the request stands in for
  it; each such window is stated in ``s3caps`` and costs at most a recompute, never
  wrong KV.
* A GET is ranged GETs streamed straight into the caller's buffer, in parallel above
  ``part_size``, all from one object version. Header and payload (and the reader's
  ``ChunkSpec``, when given) are verified before the meta is returned. A corrupt object
  is counted and deleted, but only if it is still the version that was read (``If-Match``,
  or an ETag-comparing HEAD); a version replaced mid-read is read once more from the
  start (another node's restamp of a multipart object changes its ETag, not its bytes),
  then a plain miss.
* Recency is shared by all nodes: a hit rewrites the object's ``kvtier-used`` metadata
  (kvtier's wall clock) with a server-side copy onto itself, at most once per
  ``touch_interval``; that also refreshes LastModified for listings. The restamp is never
  part of the read: ``get_into`` queues it (one per key, at most ``STAMP_QUEUE``; beyond
  that this node's own recency is all that is kept) to one stamping thread, so a read's
  time, which the breaker judges, is the read's alone.
* The index (coldest first, by kvtier's clock) is rebuilt by listing the prefix at start
  and on ``rescan()``; a listing has only LastModified, which stands in for recency.
  Objects other nodes write later are found by a HEAD on an index miss. ``collect()``
  re-reads each victim's recency with a HEAD, keeps those another node used since, and
  deletes the rest conditioned on the ETag it saw (a conditional batch, conditional
  DELETEs, or one HEAD-compare-DELETE each that also compares the stamp; ``s3caps.Deleter``),
  so an object replaced by different bytes survives (a restamp may keep the ETag: only the
  HEAD path sees it).
* Leases (``kvtier.lease``): ``kvtier-used`` is also the lease start. ``renew`` rewrites
  it to now unconditionally; ``expire`` lists the prefix, HEADs each candidate (another
  node may have renewed it) and deletes the expired ones the same way as ``collect``.
* No I/O under the index lock (``RecencyIndex``): a lookup never waits for a HEAD or a
  DELETE. ``collect`` and ``expire`` pick victims from a snapshot of the index, HEAD and
  DELETE unlocked, skip a victim this node read, wrote or renewed since the snapshot, and
  drop only the entry they picked. A use between that check and the DELETE (the HEAD's
  answer, for other nodes) is lost, costing a recompute, never wrong KV. One collection
  at a time (``_collecting``): ``collect`` returns at once while one runs, ``expire``
  waits for it. Any thread may call any method.
* Endpoint faults are retried by botocore (standard mode: backoff, ``max_attempts`` tries
  in all, connect/read timeouts), then counted and turned into misses or
  ``PutStatus.FAILED``; data-path methods never raise them. Credentials come only from
  boto3's standard chain. Neither they, the client config nor exception texts (which can
  quote requests) are ever logged.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import boto3
from botocore.exceptions import BotoCoreError, ClientError

from kvtier.clock import SYSTEM_CLOCK, Clock
from kvtier.iopool import IOPool, IOPoolClosed
from kvtier.keys import ChunkKey, key_from_hex
from kvtier.metrics import TierMetrics
from kvtier.objformat import (
    HEADER_SPAN,
    ChunkMeta,
    ChunkSpec,
    CorruptObject,
    decode_header,
    encode_header,
    verify_payload,
)
from kvtier.tiers.base import (
    ObjectInfo,
    PutStatus,
    TierError,
    TierUsage,
    WriteMode,
    as_bytes_view,
)
from kvtier.tiers.recency import Entry, RecencyIndex
from kvtier.tiers.s3caps import USED, Deleter, Mode, Outcome, Victim, resolve, used
from kvtier.tiers.s3check import check_bucket
from kvtier.tiers.s3io import (
    MIN_PART,
    S3_ERRORS,
    Changed,
    Exists,
    Head,
    MiB,
    Missing,
    ObjectIO,
    code,
    describe,
    make_client,
)

log = logging.getLogger("kvtier.s3")

_SUFFIX = ".kv"
_CLOCK_SKEW_S = 60.0  # leeway between a node's clock and the endpoint's LastModified
_GONE = frozenset({"NoSuchKey", "404", "PreconditionFailed"})  # deleted or replaced
#: Restamps waiting for the stamping thread; beyond that a hit keeps only local recency.
STAMP_QUEUE = 256


@dataclass(frozen=True)
class _Doomed:
    key: ChunkKey
    victim: Victim  # the object and the version (ETag, stamp) the decision was made on
    seen: Entry | None  # the index entry the decision was made on (None: any)


class S3Tier:
    #: ``put`` collects (capacity) itself; a ``TieredStore`` turns this off and queues
    #: collection as a job of its own, outside the breaker-timed write.
    collect_on_put = True

    def __init__(
        self,
        *,
        bucket: str,
        capacity_bytes: int,
        prefix: str = "",
        endpoint_url: str | None = None,
        region: str | None = None,
        path_style: bool = False,
        multipart_threshold: int = 64 * MiB,
        part_size: int = 16 * MiB,
        max_concurrency: int = 4,
        max_attempts: int = 5,
        connect_timeout: float = 2.0,
        read_timeout: float = 10.0,
        touch_interval: float = 60.0,
        low_watermark: float = 0.9,
        clock: Clock = SYSTEM_CLOCK,
        name: str = "s3",
        setting: str = "s3",
        conditionals: Mode = "auto",
    ) -> None:
        self._name = name
        self._setting = setting
        self.bucket = bucket
        self.prefix = "".join(f"{p}/" for p in prefix.split("/") if p)  # "/a//b" -> "a/b/"
        self.endpoint_url = endpoint_url
        self.capacity = capacity_bytes
        self._touch_interval = touch_interval
        self._low_watermark = low_watermark
        self._clock = clock
        self.metrics = TierMetrics(name)
        self._recency = RecencyIndex()
        self._collecting = threading.Lock()  # one collection at a time
        self._faulting = False  # log the first fault of an outage; count the rest
        self._stamps: IOPool | None = None  # restamps after hits, off the read path
        self._stamp_keys: set[ChunkKey] = set()  # queued restamps (one per key)
        self._stamp_lock = threading.Lock()
        for ok, problem in [
            (capacity_bytes > 0, f"capacity: must be > 0, got {capacity_bytes}"),
            (part_size >= MIN_PART, f"part_size: {part_size} is below S3's 5 MiB minimum"),
            (max_concurrency >= 1, f"max_concurrency: must be >= 1, got {max_concurrency}"),
            (max_attempts >= 1, f"max_attempts: must be >= 1, got {max_attempts}"),
            (0 < low_watermark <= 1, f"low_watermark: must be in (0, 1], got {low_watermark}"),
            (conditionals in ("auto", "trusted", "untrusted"),
             "conditionals: must be auto, trusted or untrusted"),
        ]:
            if not ok:
                raise TierError(f"{setting}.{problem}")
        session = boto3.session.Session(region_name=region)
        pool = max(10, 4 * max_concurrency)
        make = functools.partial(make_client, session, endpoint_url, path_style, pool=pool)
        probe = make(min(connect_timeout, 2.0), min(read_timeout, 5.0), min(max_attempts, 2))
        try:
            check_bucket(probe, bucket, setting=setting, endpoint_url=endpoint_url)
            #: What the endpoint honours, and so which fallbacks run (``s3caps``).
            self.conditionals = resolve(conditionals, probe, bucket, self.prefix, name=name)
        finally:
            probe.close()
        self.io = ObjectIO(
            make(connect_timeout, read_timeout, max_attempts),
            bucket,
            part_size=part_size,
            multipart_threshold=multipart_threshold,
            workers=max_concurrency,
            conditionals=self.conditionals,
        )
        self._deleter = Deleter(self.io, self.conditionals)
        try:
            self.rescan()
        except TierError:
            self.io.close()
            raise

    @property
    def name(self) -> str:
        return self._name

    def _fault(self, op: str, e: Exception) -> None:
        self.metrics.error(op)
        if not self._faulting:
            what = f"S3 {op} failed ({describe(e)}); counting, not logging, until it recovers"
            log.warning("%s: %s", self._name, what)
        self._faulting = True

    def object_name(self, key: ChunkKey) -> str:
        h = key.hex()
        return f"{self.prefix}kv/{h[0:2]}/{h}{_SUFFIX}"

    def _key_of(self, name: str) -> ChunkKey | None:
        try:
            key = key_from_hex(name[len(self.prefix) + 6 : -len(_SUFFIX)])
        except ValueError:
            return None
        return key if name == self.object_name(key) else None

    # -- index ---------------------------------------------------------------------------
    def rescan(self) -> None:
        """Rebuild the index by listing the prefix (other nodes' objects included)."""
        found: list[tuple[float, ChunkKey, int]] = []
        try:
            pages = self.io.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=f"{self.prefix}kv/"
            )
            for page in pages:
                for obj in page.get("Contents", []):
                    key = self._key_of(obj["Key"])
                    if key is not None:
                        found.append((obj["LastModified"].timestamp(), key, int(obj["Size"])))
        except S3_ERRORS as e:
            raise TierError(
                f"{self._setting}: listing s3://{self.bucket}/{self.prefix}kv/ failed "
                f"({describe(e)}); the credentials need s3:ListBucket on this bucket"
            ) from None
        self._recency.reset(found)
        self.metrics.used(self._recency.bytes)

    def _known(self, key: ChunkKey) -> bool:
        """Indexed, or in the bucket (written by another node). The index may be stale:
        another node's collector can delete what we remember; a read then misses."""
        if key in self._recency:
            return True
        return self._in_bucket(key)

    def _in_bucket(self, key: ChunkKey) -> bool:
        """Ask the endpoint (HEAD), never the index; refresh the index either way."""
        try:
            head = self.io.head(self.object_name(key))
        except S3_ERRORS as e:
            self._fault("head", e)
            return False
        if head is None:
            self._recency.forget(key)
            return False
        self._recency.remember(key, head.size, used(head))
        return True

    # -- Tier protocol -------------------------------------------------------------------
    def indexed(self, key: ChunkKey) -> bool:
        """In this node's index (memory only; may be stale, see ``contains_prefix``)."""
        return key in self._recency

    def contains_prefix(self, keys: Sequence[ChunkKey]) -> int:
        for i, key in enumerate(keys):
            if not self._known(key):
                return i
        return len(keys)

    def get_into(
        self, key: ChunkKey, dst: memoryview, *, expect: ChunkSpec | None = None
    ) -> ChunkMeta | None:
        t0 = time.perf_counter()
        dst = as_bytes_view(dst)
        name = self.object_name(key)
        head = memoryview(bytearray(HEADER_SPAN))
        cap = HEADER_SPAN + dst.nbytes
        entry = self._recency.get(key)
        plan = max(1, min(entry.size, cap)) if entry is not None else cap
        try:
            try:
                total, etag = self.io.read(name, head, dst, plan)
            except Changed:  # replaced mid-read (a restamp of a multipart object): once more
                total, etag = self.io.read(name, head, dst, plan)
        except (Missing, Changed) as e:
            if isinstance(e, Missing):
                self._recency.forget(key)
            self.metrics.miss()
            return None
        except S3_ERRORS as e:
            self._fault("get", e)
            self.metrics.miss()
            return None
        try:
            span = head[: min(total, HEADER_SPAN)]
            meta, csum = decode_header(
                span, expect_key=key, expect=expect, object_len=total, max_payload=dst.nbytes
            )
            verify_payload(meta, csum, dst[: meta.payload_len])
        except CorruptObject as e:
            self._quarantine(key, name, etag, str(e))
            self.metrics.miss()
            return None
        self._faulting = False
        self._touch(key, name, total, etag)
        self.metrics.hit(meta.payload_len)
        self.metrics.observe("get", time.perf_counter() - t0)
        return meta

    def _touch(self, key: ChunkKey, name: str, size: int, etag: str) -> None:
        now = self._clock.wall()
        entry = self._recency.get(key)
        if entry is not None and now - entry.touched < self._touch_interval:
            self._recency.use(key, now)  # this node's view; the shared one waits for the next
            return
        self._recency.remember(key, size, now, now)
        self._queue_stamp(key, name, now, etag)

    def _queue_stamp(self, key: ChunkKey, name: str, now: float, etag: str) -> None:
        """Restamp on the stamping thread; dropped (this node's recency is kept) when
        ``STAMP_QUEUE`` are waiting or one for ``key`` already is."""
        with self._stamp_lock:
            if key in self._stamp_keys or len(self._stamp_keys) >= STAMP_QUEUE:
                return
            if self._stamps is None:
                self._stamps = IOPool(1, STAMP_QUEUE, name=f"{self._name}-stamp")
            self._stamp_keys.add(key)
            stamps = self._stamps

        def run() -> None:
            try:
                self._stamp(name, now, etag)  # gone or replaced: the next lookup notices
            finally:
                with self._stamp_lock:
                    self._stamp_keys.discard(key)

        try:
            queued = stamps.submit_store(run)
        except IOPoolClosed:
            queued = None
        if queued is None:
            with self._stamp_lock:
                self._stamp_keys.discard(key)

    def stamps_pending(self) -> int:
        """Restamps queued or running (tests, debugging)."""
        with self._stamp_lock:
            return len(self._stamp_keys)

    def _stamp(self, name: str, now: float, etag: str = "") -> bool:
        """Set the object's ``kvtier-used`` to ``now`` by a server-side copy onto itself
        (only if it is still version ``etag``, when given and the endpoint honours that;
        copying a newer version instead is harmless, see ``s3caps``); False if gone or
        failed."""
        cond = {"CopySourceIfMatch": etag} if etag and self.conditionals.copy_if_match else {}
        try:
            self.io.client.copy_object(
                Bucket=self.bucket,
                Key=name,
                CopySource={"Bucket": self.bucket, "Key": name},
                MetadataDirective="REPLACE",
                Metadata={USED: repr(now)},
                **cond,
            )
        except ClientError as e:
            if code(e) not in _GONE:
                self._fault("touch", e)
            return False
        except BotoCoreError as e:
            self._fault("touch", e)
            return False
        return True

    def _quarantine(self, key: ChunkKey, name: str, etag: str, why: str) -> None:
        """Delete a corrupt object, unless someone replaced it since it was read."""
        self.metrics.corrupt()
        outcome = self._deleter.delete_one(Victim(name, etag))
        if isinstance(outcome, Exception):
            self._fault("delete", outcome)
        done = "removed" if outcome is Outcome.DELETED else "not removed"
        log.warning("corrupt object s3://%s/%s %s: %s", self.bucket, name, done, why)
        self._recency.forget(key)

    def put(
        self, meta: ChunkMeta, payload: memoryview, mode: WriteMode = WriteMode.CREATE
    ) -> PutStatus:
        t0 = time.perf_counter()
        create = mode is WriteMode.CREATE
        # An indexed key is confirmed with a HEAD (not a blind conditional PUT of the whole
        # payload): a stale entry must not turn a write-through into a silent no-op.
        if create and meta.key in self._recency and self._in_bucket(meta.key):
            return PutStatus.EXISTS
        if meta.object_len > self.capacity:
            return PutStatus.NO_SPACE
        body = as_bytes_view(payload)
        head = memoryview(encode_header(meta, body))
        now = self._clock.wall()
        try:
            self.io.write(self.object_name(meta.key), head, body, {USED: repr(now)}, create=create)
        except Exists:
            return PutStatus.EXISTS
        except S3_ERRORS as e:
            self._fault("put", e)
            return PutStatus.FAILED
        self._faulting = False
        self._recency.remember(meta.key, meta.object_len, now, now)
        self.metrics.wrote(meta.payload_len)
        self.metrics.observe("put", time.perf_counter() - t0)
        if self.collect_on_put:  # else whoever owns the tier collects (TieredStore)
            self.collect()
        self.metrics.used(self._recency.bytes)
        return PutStatus.STORED

    def delete(self, keys: Iterable[ChunkKey]) -> int:
        names = {self.object_name(k): k for k in keys if self._known(k)}
        doomed = {n: _Doomed(k, Victim(n, ""), None) for n, k in names.items()}
        return self._delete(doomed, evicting=False)[0]

    def _delete(self, doomed: dict[str, _Doomed], *, evicting: bool) -> tuple[int, int]:
        """Delete ``doomed`` (by object name), each only while it is still the version its
        victim names (``s3caps.Deleter``). A deleted key leaves the index only if its entry
        is still the one ``seen``. Returns ``(objects, bytes)`` deleted."""
        n = freed = 0
        removal = self._deleter.delete([d.victim for d in doomed.values()])
        if removal.fault is not None:
            self._fault("collect" if evicting else "delete", removal.fault)
        for name, outcome in removal.outcomes.items():
            d = doomed[name]
            if outcome is Outcome.KEPT:  # e.g. replaced since
                continue
            if d.seen is None:
                entry = self._recency.forget(d.key)
                size = entry.size if entry is not None else 0
            else:
                self._recency.forget_if(d.key, d.seen)
                size = d.seen.size
            if outcome is Outcome.DELETED:
                n, freed = n + 1, freed + size
        if evicting:
            self.metrics.evicted(n)
        self.metrics.used(self._recency.bytes)
        return n, freed

    def scan(self) -> Iterator[ObjectInfo]:
        for key, e in self._recency.items():
            yield ObjectInfo(key, e.size, e.last_used)

    def usage(self) -> TierUsage:
        return self._recency.usage(self.capacity)

    # -- capacity ------------------------------------------------------------------------
    def collect(self) -> int:
        """Delete least recently used objects until usage is under the low watermark.
        Returns 0 at once if another thread is collecting."""
        if not self._collecting.acquire(blocking=False):
            return 0
        try:
            if self._recency.bytes <= self.capacity:
                return 0
            freed = 0
            for _ in range(3):  # victims another node used meanwhile are kept; pick again
                victims = self._victims(int(self.capacity * self._low_watermark))
                if not victims:
                    break
                heads = self._heads(victims, "collect")
                if heads is None:
                    break
                doomed = self._doom(victims, heads, None)
                freed += self._delete(doomed, evicting=True)[1]
            return freed
        finally:
            self._collecting.release()

    def _victims(self, target: int) -> list[tuple[ChunkKey, Entry]]:
        """The coldest entries whose removal brings usage down to ``target`` bytes."""
        out, snapshot = [], self._recency.items()
        excess = sum(e.size for _, e in snapshot) - target
        for key, entry in snapshot:
            if excess <= 0:
                break
            out.append((key, entry))
            excess -= entry.size
        return out

    def _heads(self, picked: list[tuple[ChunkKey, Entry]], op: str) -> list[Head | None] | None:
        try:
            return self.io.parallel(lambda p: self.io.head(self.object_name(p[0])), picked)
        except S3_ERRORS as e:
            self._fault(op, e)
            return None

    def _doom(
        self, picked: list[tuple[ChunkKey, Entry]], heads: list[Head | None],
        keep_from: float | None,
    ) -> dict[str, _Doomed]:
        """Which of ``picked`` to delete, given their HEADs: not those gone, used by another
        node at or after ``keep_from`` (None: after the pick), or recorded by this node
        since the pick. Updates the index for the ones kept."""
        doomed: dict[str, _Doomed] = {}
        for (key, seen), head in zip(picked, heads, strict=True):
            if head is None:
                self._recency.forget_if(key, seen)  # already gone
            elif used(head) >= (seen.last_used + 1e-3 if keep_from is None else keep_from):
                self._recency.replace_if(key, seen, head.size, used(head))
            elif self._recency.get(key) is seen:  # else this node used it since the pick
                name = self.object_name(key)
                doomed[name] = _Doomed(key, Victim(name, head.etag, used(head)), seen)
        return doomed

    # -- leases --------------------------------------------------------------------------
    def read_meta(self, key: ChunkKey) -> ChunkMeta | None:
        """The object's verified header (not its payload), or ``None`` if absent or bad."""
        try:
            r = self.io.client.get_object(
                Bucket=self.bucket, Key=self.object_name(key), Range=f"bytes=0-{HEADER_SPAN - 1}"
            )
            head = r["Body"].read()
            total = int(r["ContentRange"].rsplit("/", 1)[1])
        except ClientError as e:
            if code(e) not in _GONE and code(e) != "InvalidRange":
                self._fault("get", e)
            return None
        except (BotoCoreError, KeyError, ValueError) as e:
            self._fault("get", e)
            return None
        try:
            return decode_header(memoryview(head), expect_key=key, object_len=total)[0]
        except CorruptObject:
            return None

    def renew(self, key: ChunkKey) -> bool:
        """Restart the object's lease now; ``False`` if it is not there."""
        now = self._clock.wall()
        name = self.object_name(key)
        if not self._stamp(name, now):
            self._recency.forget(key)
            return False
        try:
            head = self.io.head(name)
        except S3_ERRORS as e:
            self._fault("head", e)
            return False
        if head is None:
            self._recency.forget(key)
            return False
        self._recency.remember(key, head.size, now, now)
        return True

    def expire(self, lease_seconds: float) -> int:
        """Remove every object not used or renewed for ``lease_seconds``; returns count."""
        with self._collecting:
            self.rescan()  # listing times are the endpoint's LastModified, not kvtier's stamp
            cutoff = self._clock.wall() - lease_seconds
            maybe = cutoff + _CLOCK_SKEW_S  # the HEAD below decides with kvtier's own stamp
            old = [(k, e) for k, e in self._recency.items() if e.last_used < maybe]
            if not old:
                return 0
            heads = self._heads(old, "expire")
            if heads is None:
                return 0
            return self._delete(self._doom(old, heads, cutoff), evicting=True)[0]

    def close(self) -> None:
        with self._stamp_lock:
            stamps, self._stamps = self._stamps, None
        if stamps is not None:
            stamps.close(timeout=0)  # a restamp stuck in a hung endpoint is abandoned
        self.io.close()
