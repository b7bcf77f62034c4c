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
* The index, recency, capacity, leases and the walk are ``kvtier.tiers.objtier``'s; this
  module is the prefix's transport (``S3Transport``) and the restamp thread. A page of
  the walk is one listing page (1,000 keys); a listing has only LastModified, which
  stands in for recency until a HEAD reads ``kvtier-used``. Victims of ``collect`` and
  ``expire`` are HEADed (in parallel) and deleted conditioned on the ETag the HEAD saw (a
  conditional batch, conditional DELETEs, or one HEAD-compare-DELETE each that also
  compares the stamp; ``s3caps.Deleter``), so an object replaced by different bytes
  survives. A restamp (a renewal) keeps the ETag, and no endpoint kvtier runs on
  conditions DeleteObject on the stamp (AWS's ``IfMatchLastModifiedTime`` is for
  directory buckets only; moto and RGW ignore it): a renewal between the batch's HEADs
  and its deletes is lost with its object; only the HEAD path sees it.
* Leases (``kvtier.lease``): ``kvtier-used`` is also the lease start; ``renew`` rewrites
  it to now unconditionally. Any thread may call any method.
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
from collections.abc import Sequence
from typing import Any

import boto3
from botocore.exceptions import BotoCoreError, ClientError

from kvtier.clock import SYSTEM_CLOCK, Clock
from kvtier.iopool import IOPool, IOPoolClosed
from kvtier.keys import ChunkKey, key_from_hex
from kvtier.tiers.base import TierError
from kvtier.tiers.compact import key_int
from kvtier.tiers.objtier import DEFAULT_TICK, ObjectTier
from kvtier.tiers.s3caps import USED, Conditionals, Deleter, Mode, Victim, resolve, used
from kvtier.tiers.s3check import check_bucket
from kvtier.tiers.s3io import (
    MIN_PART,
    S3_ERRORS,
    Head,
    MiB,
    ObjectIO,
    code,
    describe,
    make_client,
)
from kvtier.tiers.transport import KEY_SPACE_END, Listed, Outcome, Page, Stat, Version
from kvtier.tiers.walk import TickBudget

log = logging.getLogger("kvtier.s3")

_SUFFIX = ".kv"
_GONE = frozenset({"NoSuchKey", "404", "PreconditionFailed"})  # deleted or replaced
#: Restamps waiting for the stamping thread; beyond that a hit keeps only local recency.
STAMP_QUEUE = 256
#: Keys one listing page asks for (S3's maximum).
PAGE_KEYS = 1000


def _stat(head: Head) -> Stat:
    return Stat(head.size, used(head), head.etag)


class S3Transport:
    """Objects under ``<prefix>kv/`` of one bucket (see the module invariants)."""

    faults: tuple[type[Exception], ...] = S3_ERRORS
    cheap_head = False
    exact_listing = False

    def __init__(self, io: ObjectIO, prefix: str, conditionals: Conditionals) -> None:
        self.io = io
        self.bucket = io.bucket
        self.prefix = prefix
        self.conditionals = conditionals
        self._deleter = Deleter(io, conditionals)

    def object_name(self, key: ChunkKey) -> str:
        h = key.hex()
        return f"{self.prefix}kv/{h[0:2]}/{h}{_SUFFIX}"

    def key_of(self, name: str) -> ChunkKey | None:
        try:
            key = key_from_hex(name[len(self.prefix) + 6 : -len(_SUFFIX)])
        except ValueError:
            return None
        return key if name == self.object_name(key) else None

    def describe(self, key: ChunkKey) -> str:
        return f"s3://{self.bucket}/{self.object_name(key)}"

    def head(self, key: ChunkKey) -> Stat | None:
        head = self.io.head(self.object_name(key))
        return None if head is None else _stat(head)

    def heads(self, keys: Sequence[ChunkKey]) -> list[Stat | None]:
        return self.io.parallel(self.head, keys, background=True)  # collection, expiry

    def read(self, key: ChunkKey, head: memoryview, body: memoryview,
             plan: int) -> tuple[int, Version]:
        return self.io.read(self.object_name(key), head, body, plan)

    def read_header(self, key: ChunkKey, head: memoryview) -> int | None:
        try:
            r = self.io.client.get_object(Bucket=self.bucket, Key=self.object_name(key),
                                          Range=f"bytes=0-{head.nbytes - 1}")
            data = r["Body"].read()
            total = int(r["ContentRange"].rsplit("/", 1)[1])
        except ClientError as e:
            if code(e) in _GONE or code(e) == "InvalidRange":
                return None
            raise
        except (KeyError, ValueError) as e:
            raise BotoCoreError() from e
        head[: len(data)] = data
        return total

    def write(self, key: ChunkKey, header: memoryview, body: memoryview, *, create: bool,
              now: float) -> float:
        self.io.write(self.object_name(key), header, body, {USED: repr(now)}, create=create)
        return now

    def delete_if(self, key: ChunkKey, version: Version) -> Outcome | Exception:
        return self._deleter.delete_one(Victim(self.object_name(key), str(version)))

    def stamp_if(self, name: str, now: float, etag: str = "") -> bool:
        """Set the object's ``kvtier-used`` to ``now`` by a server-side copy onto itself
        (only if it is still version ``etag``, when given and the endpoint honours that;
        copying a newer version instead is harmless, see ``s3caps``); False if gone.
        Raises endpoint faults."""
        cond = {"CopySourceIfMatch": etag} if etag and self.conditionals.copy_if_match else {}
        try:
            self.io.client.copy_object(
                Bucket=self.bucket, Key=name, CopySource={"Bucket": self.bucket, "Key": name},
                MetadataDirective="REPLACE", Metadata={USED: repr(now)}, **cond,
            )
        except ClientError as e:
            if code(e) in _GONE:
                return False
            raise
        return True

    def stamp(self, key: ChunkKey, now: float) -> Stat | None:
        name = self.object_name(key)
        if not self.stamp_if(name, now):
            return None
        head = self.io.head(name)
        return None if head is None else Stat(head.size, now, head.etag)

    def delete(self, victims: Sequence[tuple[ChunkKey, Stat | None]]
               ) -> tuple[dict[ChunkKey, Outcome], Exception | None]:
        by_name = {self.object_name(k): k for k, _ in victims}
        removal = self._deleter.delete([
            Victim(self.object_name(k), "", None) if st is None
            else Victim(self.object_name(k), str(st.version), st.used) for k, st in victims])
        return {by_name[n]: o for n, o in removal.outcomes.items()}, removal.fault

    def check_listing(self) -> None:
        self.io.client.list_objects_v2(Bucket=self.bucket, Prefix=f"{self.prefix}kv/",
                                       MaxKeys=1)

    def slices(self) -> list[object | None]:
        """One slice: a listing continues only from the token its last page gave."""
        return [None]

    def page(self, cursor: object | None) -> Page:
        """One listing page; the cursor is ``(continuation token, first key number)``."""
        token, lo = cursor if isinstance(cursor, tuple) else (None, 0)
        kw: dict[str, Any] = {"ContinuationToken": token} if token else {}
        r = self.io.client.list_objects_v2(Bucket=self.bucket, Prefix=f"{self.prefix}kv/",
                                           MaxKeys=PAGE_KEYS, **kw)
        found: list[Listed] = []
        for obj in r.get("Contents", []):
            key = self.key_of(obj["Key"])
            if key is not None:
                found.append(Listed(key, int(obj["Size"]), obj["LastModified"].timestamp()))
        if not r.get("IsTruncated"):
            return Page(found, lo, KEY_SPACE_END, None)
        hi = key_int(found[-1].key) if found else lo - 1
        return Page(found, lo, hi, (r["NextContinuationToken"], max(lo, hi + 1)))

    def close(self) -> None:
        self.io.close()


class S3Tier(ObjectTier):
    """The object tier over an S3 prefix (see the module invariants)."""

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
        background_index: bool = False,
        tick: TickBudget = DEFAULT_TICK,
        scan_rate: float = 0.0,
    ) -> None:
        """``background_index``: return once a one-key listing shows the prefix can be
        listed and fill the index on a thread (an engine start); else the constructor
        lists the whole prefix. ``tick``: what one tick of expiry or collection walks at
        most.
        ``scan_rate``: objects per second the start scan lists at most (0: no limit)."""
        self.bucket = bucket
        self.prefix = "".join(f"{p}/" for p in prefix.split("/") if p)  # "/a//b" -> "a/b/"
        self.endpoint_url = endpoint_url
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
        self.objects = S3Transport(self.io, self.prefix, self.conditionals)
        super().__init__(self.objects, capacity_bytes, name=name, clock=clock,
                         touch_interval=touch_interval, low_watermark=low_watermark,
                         tick=tick, scan_rate=scan_rate)
        try:
            self._open(background_index)
        except S3_ERRORS as e:
            self.io.close()
            raise TierError(
                f"{setting}: listing s3://{bucket}/{self.prefix}kv/ failed "
                f"({describe(e)}); the credentials need s3:ListBucket on this bucket"
            ) from None

    def object_name(self, key: ChunkKey) -> str:
        return self.objects.object_name(key)

    # -- restamps after hits, on their own thread ------------------------------------------
    def _after_hit(self, key: ChunkKey, now: float, version: Version) -> bool:
        """Restamp on the stamping thread; dropped (this node's recency is kept) when
        ``STAMP_QUEUE`` are waiting or one for ``key`` already is. False when dropped
        with none queued for ``key``: the restamp is not recorded as done, so the next
        hit tries again (issue 32)."""
        name, etag = self.object_name(key), str(version)
        with self._stamp_lock:
            if key in self._stamp_keys:
                return True  # one is queued: it stamps this hit too
            if len(self._stamp_keys) >= STAMP_QUEUE:
                return False
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
            return False
        return True

    def stamps_pending(self) -> int:
        """Restamps queued or running (tests, debugging)."""
        with self._stamp_lock:
            return len(self._stamp_keys)

    def _stamp(self, name: str, now: float, etag: str = "") -> bool:
        """``S3Transport.stamp_if``, its faults counted; False if gone or failed."""
        try:
            return self.objects.stamp_if(name, now, etag)
        except S3_ERRORS as e:
            self._fault("touch", e)
            return False

    def close(self) -> None:
        with self._stamp_lock:
            stamps, self._stamps = self._stamps, None
        if stamps is not None:
            stamps.close(timeout=0)  # a restamp stuck in a hung endpoint is abandoned
        super().close()
