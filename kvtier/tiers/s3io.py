"""The S3 data plane of ``S3Tier``: moves one object's bytes between caller buffers and S3.

It knows object names, never keys, the index or capacity (``kvtier.tiers.s3`` owns those).

Invariants:

* Request bodies are sent from the caller's buffers without joining them (``ChainReader``)
  and response bodies are streamed straight into slices of them (``readinto``).
* Work split across the thread pools (ranges, parts, HEADs) is always waited for in full
  before a call returns or raises: it reads or writes buffers the caller owns.
* Foreground transfers (a read's ranges, a write's parts) and background work (the
  batched HEADs and deletes of collection and expiry) run on separate bounded pools
  (``s3-parts``, ``s3-bg``; ``workers`` threads each), so a restore's ranged GETs never
  queue behind a batch of collection HEADs (issue 32: they shared one pool, and a
  restore could run past its allowance and trip the breaker). Restamps have their own
  thread (``kvtier.tiers.s3``).
* ``read`` returns the object's length and ETag, raises ``Missing`` when there is no object
  and ``Changed`` unless every range came from one version (same ETag and length).
* ``write`` with ``create=True`` raises ``Exists`` instead of replacing an object: by the
  condition ``If-None-Match: *`` on the PUT or the multipart completion where the endpoint
  honours it (``Conditionals``, probed at start), else by a HEAD just before the PUT, or
  before CreateMultipartUpload and again just before CompleteMultipartUpload. After that
  last HEAD a concurrent create can still land and be replaced by ours: both are complete
  objects of the same key (``kvtier.tiers.s3caps``). A failed or refused multipart upload
  is aborted. Nothing uses the completion's ETag (RGW answers an empty one).
* A range past the object's end (416) gives the length from ``ActualObjectSize`` where the
  endpoint reports it (AWS, moto) and none otherwise (RGW 16.2). Without it, a 416 for
  the range from 0 means an empty object, and a later range counts as empty: right if it
  starts at or past the length the range from 0 reported, else the read is ``Changed``.
* Endpoint faults propagate as botocore exceptions (``S3_ERRORS``), after botocore's own
  retries; ``describe`` names them without quoting requests or credentials. A size the
  endpoint reports that is not a byte count is such a fault too (``BadAnswer``).
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, wait
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

from kvtier.iopool import IOPool
from kvtier.objformat import HEADER_SPAN
from kvtier.tiers.transport import Changed, Exists, Missing

if TYPE_CHECKING:
    from kvtier.tiers.s3caps import Conditionals

MiB = 2**20
MIN_PART = 5 * MiB  # S3's smallest multipart part (all but the last)
MAX_PARTS = 10_000
READ_SLICE = MiB  # NOTE: urllib3's readinto reads into a temporary first; bound its size
_T = TypeVar("_T")
_R = TypeVar("_R")


class BadAnswer(Exception):
    """The endpoint answered a GET with a size it cannot mean: a fault like any other
    (it is one of ``S3_ERRORS``), never a crash of the read path."""


def parse_size(value: object) -> int:
    """A byte count the endpoint reported (``Content-Range`` total, ``Content-Length``)."""
    text = str(value)
    if not (text.isascii() and text.isdigit()):  # rejects "*" (unknown), "-1", "None"
        raise BadAnswer(f"size {text[:32]!r}")
    return int(text)


S3_ERRORS = (BotoCoreError, ClientError, BadAnswer)


@dataclass(frozen=True)
class Head:
    size: int
    etag: str
    metadata: dict[str, str]
    last_modified: float


@dataclass(frozen=True)
class _Range:
    start: int
    end: int
    total: int | None  # object length as the server reported it (None: not reported)
    etag: str | None  # None for a range that starts past the end
    got: int


def code(e: ClientError) -> str:
    return str(e.response.get("Error", {}).get("Code", ""))


def status(e: ClientError) -> int:
    return int(e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0))


def describe(e: Exception) -> str:
    """A fault in words that cannot quote credentials or signed requests."""
    if isinstance(e, ClientError):
        return f"HTTP {status(e)} {code(e)}"
    return type(e).__name__


def spans(head: memoryview, body: memoryview, start: int, end: int) -> list[memoryview]:
    """The slices of ``head`` (object bytes [0, HEADER_SPAN)) and ``body`` (the bytes after
    it) that hold object bytes [start, end)."""
    out = []
    if start < HEADER_SPAN:
        out.append(head[start : min(end, HEADER_SPAN)])
    if end > HEADER_SPAN:
        out.append(body[max(start, HEADER_SPAN) - HEADER_SPAN : end - HEADER_SPAN])
    return [v for v in out if v.nbytes]


def stream_into(body: Any, views: list[memoryview]) -> int:
    """Read a response body into ``views`` in order, until they are full or it ends."""
    total = 0
    for v in views:
        off = 0
        while off < v.nbytes:
            n = body.readinto(v[off : off + READ_SLICE])
            if not n:
                return total + off
            off += n
        total += off
    return total


class ChainReader:
    """A seekable, read-only file over several buffers: a request body sent without joining
    them. ``read(n)`` may return fewer than ``n`` bytes; it never crosses a buffer."""

    def __init__(self, parts: list[memoryview]) -> None:
        self._parts = parts
        self._len = sum(p.nbytes for p in parts)
        self._pos = 0

    def __len__(self) -> int:
        return self._len

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = 0) -> int:
        base = (0, self._pos, self._len)[whence]
        self._pos = min(max(base + offset, 0), self._len)
        return self._pos

    def read(self, n: int | None = -1) -> bytes | memoryview:
        if n is None or n < 0:
            rest = []
            while chunk := self.read(self._len):
                rest.append(bytes(chunk))
            return b"".join(rest)
        off = self._pos
        for p in self._parts:
            if off < p.nbytes:
                end = min(p.nbytes, off + n)
                self._pos += end - off
                return p[off:end]
            off -= p.nbytes
        return b""


def make_client(
    session: Any,
    endpoint_url: str | None,
    path_style: bool,
    connect_timeout: float,
    read_timeout: float,
    attempts: int,
    *,
    pool: int,
) -> Any:
    """An S3 client: standard-mode retries with backoff, bounded timeouts, credentials
    from boto3's standard chain only."""
    config = Config(
        signature_version="s3v4",
        s3={"addressing_style": "path" if path_style else "auto"},
        retries={"mode": "standard", "total_max_attempts": attempts},  # incl. the first
        connect_timeout=connect_timeout,
        read_timeout=read_timeout,
        max_pool_connections=pool,
        # kvtier checksums every payload itself (xxh3 in the header).
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
    )
    return session.client("s3", endpoint_url=endpoint_url, config=config)


class ObjectIO:
    """Whole-object transfers on one bucket, parallel above ``part_size``."""

    def __init__(
        self,
        client: Any,
        bucket: str,
        *,
        part_size: int,
        multipart_threshold: int,
        workers: int,
        conditionals: Conditionals,
    ) -> None:
        self.client = client
        self.bucket = bucket
        self.conditionals = conditionals
        self._part_size = part_size
        self._threshold = multipart_threshold
        self._workers = workers
        #: transfers (``False``: ``s3-parts``) and background work (``True``: ``s3-bg``),
        #: made on first use; daemon threads, so one stuck in a hung endpoint never holds
        #: the process's exit (a ThreadPoolExecutor's threads are joined at exit)
        self._pools: dict[bool, IOPool] = {}
        self._lock = threading.Lock()

    def parallel(self, fn: Callable[[_T], _R], items: Sequence[_T], *,
                 background: bool = False) -> list[_R]:
        """``fn`` over ``items``: the first in this thread, the rest on the transfer pool,
        or (``background``: collection's and expiry's HEADs and deletes) on the
        background pool, which foreground reads never wait for. Returns or raises only
        after every call has finished."""
        futures: list[Future[_R]] = []
        try:
            if len(items) > 1:
                with self._lock:
                    pool = self._pools.get(background)
                    if pool is None:
                        pool = IOPool(self._workers, 1,
                                      name="s3-bg" if background else "s3-parts")
                        self._pools[background] = pool
                futures = [pool.submit_load(functools.partial(fn, item)) for item in items[1:]]
            first = fn(items[0])
        finally:
            wait(futures)
        return [first, *(f.result() for f in futures)]

    def head(self, name: str) -> Head | None:
        try:
            r = self.client.head_object(Bucket=self.bucket, Key=name)
        except ClientError as e:
            if status(e) == 404:
                return None
            raise
        return Head(
            int(r["ContentLength"]), r["ETag"], r["Metadata"], r["LastModified"].timestamp()
        )

    # -- read ----------------------------------------------------------------------------
    def read(self, name: str, head: memoryview, body: memoryview, plan: int) -> tuple[int, str]:
        """Object bytes [0, min(length, HEADER_SPAN + len(body))) into ``head`` + ``body``.

        ``plan`` is the expected object length (ranges are issued for it at once); returns
        ``(object length, etag)``. Bytes past the buffer's end are not fetched.
        """
        cap = HEADER_SPAN + body.nbytes
        ranges = self._fetch(name, head, body, 0, plan, None)
        total, etag = ranges[0].total or 0, ranges[0].etag
        if plan < total and plan < cap:
            ranges += self._fetch(name, head, body, plan, min(total, cap), etag)
        for r in ranges:
            want = max(0, min(r.end, total) - r.start)
            same = r.total in (None, total) and (r.got == 0 or r.etag == etag)
            if r.got != want or not same:
                raise Changed
        return total, etag or ""

    def _fetch(
        self, name: str, head: memoryview, body: memoryview, start: int, end: int, etag: str | None
    ) -> list[_Range]:
        step = self._part_size
        bounds = [(s, min(s + step, end)) for s in range(start, end, step)]  # end > start
        return self.parallel(lambda b: self._get_range(name, head, body, *b, etag), bounds)

    def _get_range(
        self, name: str, head: memoryview, body: memoryview, start: int, end: int, etag: str | None
    ) -> _Range:
        cond = {"IfMatch": etag} if etag else {}
        try:
            r = self.client.get_object(
                Bucket=self.bucket, Key=name, Range=f"bytes={start}-{end - 1}", **cond
            )
        except ClientError as e:
            if code(e) in ("NoSuchKey", "404"):
                raise Missing from None
            if code(e) == "PreconditionFailed":
                raise Changed from None
            if code(e) != "InvalidRange":
                raise
            # The range starts past the end; a range from 0 can only miss an empty object.
            size = e.response["Error"].get("ActualObjectSize")
            total = parse_size(size) if size is not None else (0 if start == 0 else None)
            return _Range(start, end, total, None, 0)
        try:
            content_range = r.get("ContentRange")  # "bytes 0-99/1234"; absent if Range ignored
            if content_range:
                total = parse_size(content_range.rsplit("/", 1)[-1])
                if not content_range.startswith(f"bytes {start}-"):
                    raise Changed  # not the bytes asked for: never write them into place
            elif start == 0:
                total = parse_size(r.get("ContentLength"))  # the whole object
            else:
                raise Changed
            got = stream_into(r["Body"], spans(head, body, start, end))
        finally:
            r["Body"].close()
        return _Range(start, end, total, r["ETag"], got)

    # -- write ---------------------------------------------------------------------------
    def write(
        self,
        name: str,
        head: memoryview,
        body: memoryview,
        metadata: dict[str, str],
        *,
        create: bool,
    ) -> None:
        """Store ``head`` + ``body`` as one object; with ``create``, only if it is absent
        (see the module docstring for endpoints that ignore ``If-None-Match``)."""
        multipart = head.nbytes + body.nbytes > self._threshold
        c = self.conditionals
        honoured = c.complete_if_none_match if multipart else c.put_if_none_match
        cond = {"IfNoneMatch": "*"} if create and honoured else {}
        check = create and not honoured  # a HEAD stands in for the condition
        if check and self.head(name) is not None:
            raise Exists
        try:
            if multipart:
                self._write_multipart(name, head, body, metadata, cond, check=check)
            else:
                self.client.put_object(
                    Bucket=self.bucket,
                    Key=name,
                    Body=ChainReader([head, body]),
                    Metadata=metadata,
                    **cond,
                )
        except ClientError as e:
            if create and code(e) in ("PreconditionFailed", "ConditionalRequestConflict"):
                raise Exists from None
            raise

    def _write_multipart(
        self,
        name: str,
        head: memoryview,
        body: memoryview,
        metadata: dict[str, str],
        cond: dict[str, str],
        *,
        check: bool,
    ) -> None:
        length = head.nbytes + body.nbytes
        step = max(self._part_size, -(-length // MAX_PARTS))
        upload = self.client.create_multipart_upload(
            Bucket=self.bucket, Key=name, Metadata=metadata
        )["UploadId"]

        def send(part: tuple[int, int]) -> dict[str, Any]:
            number, start = part
            r = self.client.upload_part(
                Bucket=self.bucket,
                Key=name,
                UploadId=upload,
                PartNumber=number,
                Body=ChainReader(spans(head, body, start, min(start + step, length))),
            )
            return {"PartNumber": number, "ETag": r["ETag"]}

        try:
            parts = self.parallel(send, list(enumerate(range(0, length, step), start=1)))
            if check and self.head(name) is not None:  # created meanwhile, by another node
                raise Exists
            self.client.complete_multipart_upload(
                Bucket=self.bucket,
                Key=name,
                UploadId=upload,
                MultipartUpload={"Parts": parts},
                **cond,
            )
        except BaseException:
            with contextlib.suppress(*S3_ERRORS):
                self.client.abort_multipart_upload(Bucket=self.bucket, Key=name, UploadId=upload)
            raise

    def close(self) -> None:
        with self._lock:
            pools, self._pools = list(self._pools.values()), {}
        for pool in pools:
            # Never wait: a part upload or ranged read stuck in a hung endpoint would hold
            # the engine's shutdown past its budget (the threads are abandoned).
            pool.close(timeout=0)
        self.client.close()
