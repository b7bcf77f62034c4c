"""Which conditional S3 operations an endpoint honours, and what ``S3Tier`` does instead
where one is not honoured (Ceph RGW 16.2, for one, silently ignores several).

``probe`` asks the endpoint once, at start, with a handful of tiny objects; ``Deleter``
applies the answer to deletes. The create fallbacks live in ``kvtier.tiers.s3io``
(``ObjectIO.write``), driven by the same ``Conditionals``.

Invariants:

* An operation counts as honoured only if the endpoint refused it with 412 when its
  condition was false, and (for deletes) the object is still there afterwards. Anything
  else (ignored, rejected as unsupported, an endpoint fault) is "not honoured": the safe
  side. A probe cut short by a fault answers "not honoured" for everything it had not yet
  seen honoured, and says why in ``source``; it never raises.
* Probe objects live under ``<prefix>_probe/<uuid>/`` (outside ``<prefix>kv/``, so never
  listed as chunks) and are deleted, and an upload aborted, before ``probe`` returns. Only
  an endpoint that fails mid-probe can leave them behind (a few bytes; safe to delete).
  The probe stops at its first fault, so it costs at most one fault's retries and timeouts
  plus one cleanup attempt.
* A condition not known to be honoured is not sent (an endpoint may reject it outright).
  For creates and deletes a HEAD just before the request stands in for it, which leaves
  a window between that HEAD and the request:

  - create (single PUT or multipart completion): HEAD first, ``Exists`` if the object is
    there. Two nodes creating one key in the same window both store; the later object
    wins. Both are complete, verified objects of that key, so a reader sees one or the
    other (or ``Changed``: a miss), never a mix.
  - delete of a version (corrupt-object quarantine, ``collect``, ``expire``): a batch
    with per-object ETags where honoured, else one DeleteObject with If-Match per object,
    else (no If-Match either) one object at a time: HEAD it, compare the ETag (and the
    ``kvtier-used`` stamp where the decision rested on it), delete only if unchanged. A
    replacement or use landing between that HEAD and the DELETE is deleted with it: it
    costs a recompute, never wrong KV. (With a condition, a use in the same window is
    lost as well: a restamp keeps the ETag.)
  - the restamp (a self-copy with ``CopySourceIfMatch``) without the copy condition (no
    HEAD): copying whatever version is there now is harmless. The copy is server-side and
    atomic, so it reproduces one complete object; a newer version gets a fresh stamp,
    which it had anyway (its writer stamped it a moment before).
"""

from __future__ import annotations

import contextlib
import logging
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from botocore.exceptions import ClientError

from kvtier.tiers.s3io import S3_ERRORS, Head, ObjectIO, code, describe, status
from kvtier.tiers.transport import Outcome

log = logging.getLogger("kvtier.s3")

Mode = Literal["auto", "trusted", "untrusted"]
USED = "kvtier-used"  # object metadata: kvtier wall-clock time of the last use
_WRONG_ETAG = '"' + "0" * 32 + '"'  # the ETag of no object the probe writes
_GONE = frozenset({"NoSuchKey", "404"})


def used(head: Head) -> float:
    """The object's ``kvtier-used`` stamp, or its LastModified if kvtier did not write it."""
    try:
        return float(head.metadata[USED])
    except (KeyError, ValueError):
        return head.last_modified


_LABELS = {  # Conditionals field -> the operation, as ``kvtier check`` names it
    "put_if_none_match": "PutObject If-None-Match",
    "complete_if_none_match": "CompleteMultipartUpload If-None-Match",
    "delete_if_match": "DeleteObject If-Match",
    "batch_delete_etag": "DeleteObjects ETag",
    "copy_if_match": "CopyObject CopySourceIfMatch",
}


@dataclass(frozen=True)
class Conditionals:
    """Which conditions the endpoint honours, and where that answer came from."""

    put_if_none_match: bool  # PutObject If-None-Match: * (a create)
    complete_if_none_match: bool  # CompleteMultipartUpload If-None-Match: *
    delete_if_match: bool  # DeleteObject If-Match: <etag>
    batch_delete_etag: bool  # DeleteObjects, per-object <ETag>
    copy_if_match: bool  # CopyObject x-amz-copy-source-if-match
    source: str  # "probed", "trusted (config)", ...

    @classmethod
    def all(cls, honoured: bool, source: str) -> Conditionals:
        h = honoured
        return cls(h, h, h, h, h, source)

    def ignored(self) -> list[str]:
        """The operations not honoured, by name."""
        return [label for f, label in _LABELS.items() if not getattr(self, f)]

    def summary(self) -> str:
        """One line for ``kvtier check``: every operation, yes or no, and the source."""
        ops = ", ".join(
            f"{label} {'yes' if getattr(self, f) else 'no'}" for f, label in _LABELS.items()
        )
        return f"conditionals ({self.source}): {ops}"


TRUSTED = Conditionals.all(True, "trusted (config)")
UNTRUSTED = Conditionals.all(False, "untrusted (config)")


def resolve(mode: Mode, client: Any, bucket: str, prefix: str, *, name: str) -> Conditionals:
    """The answer ``mode`` asks for: probed (``auto``) or assumed (``trusted``,
    ``untrusted``). Logs once at warning which fallbacks are in effect."""
    caps = TRUSTED if mode == "trusted" else UNTRUSTED if mode == "untrusted" else None
    if caps is None:
        caps = probe(client, bucket, prefix)
    if caps.ignored():
        log.warning(
            "%s: conditionals %s; not honoured: %s. Using HEAD-checked fallbacks (a short "
            "race window each; see README, S3-compatible endpoints)",
            name, caps.source, ", ".join(caps.ignored()),
        )  # fmt: skip
    return caps


class _Fault(Exception):
    """The endpoint failed (not refused): stop probing."""

    def __init__(self, cause: Exception) -> None:
        super().__init__(describe(cause))


class _Probe:
    """The probe's objects, named under one unique sub-prefix, and the requests on them."""

    def __init__(self, client: Any, bucket: str, prefix: str) -> None:
        self.client = client
        self.bucket = bucket
        self.base = f"{prefix}_probe/{uuid.uuid4().hex}/"
        self.names: list[str] = []
        self.upload: tuple[str, str] | None = None  # (name, upload id) to abort

    def _call(self, fn: Callable[..., Any], **kw: Any) -> dict[str, Any] | ClientError:
        """The response, the refusal (a 4xx or 501 answer), or ``_Fault``."""
        try:
            r: dict[str, Any] = fn(Bucket=self.bucket, **kw)
            return r
        except ClientError as e:
            if 400 <= status(e) < 500 or status(e) == 501:
                return e
            raise _Fault(e) from None
        except S3_ERRORS as e:
            raise _Fault(e) from None

    def _refused(self, answer: dict[str, Any] | ClientError) -> bool:
        return isinstance(answer, ClientError) and status(answer) == 412

    def put(self, what: str) -> str | None:
        name = self.base + what
        self.names.append(name)
        answer = self._call(self.client.put_object, Key=name, Body=b"kvtier probe")
        return None if isinstance(answer, ClientError) else name

    def exists(self, name: str) -> bool:
        answer = self._call(self.client.head_object, Key=name)
        if isinstance(answer, ClientError) and code(answer) not in _GONE:
            raise _Fault(answer)
        return not isinstance(answer, ClientError)

    def put_if_none_match(self) -> bool:
        name = self.put("put")
        return name is not None and self._refused(
            self._call(self.client.put_object, Key=name, Body=b"again", IfNoneMatch="*")
        )

    def complete_if_none_match(self) -> bool:
        name = self.put("multipart")
        if name is None:
            return False
        answer = self._call(self.client.create_multipart_upload, Key=name)
        if isinstance(answer, ClientError):
            return False
        self.upload = (name, answer["UploadId"])
        part = self._call(  # one part: the last part may be small
            self.client.upload_part, Key=name, UploadId=self.upload[1], PartNumber=1, Body=b"x"
        )
        if isinstance(part, ClientError):
            return False
        parts = {"Parts": [{"PartNumber": 1, "ETag": part["ETag"]}]}
        answer = self._call(
            self.client.complete_multipart_upload,
            Key=name, UploadId=self.upload[1], MultipartUpload=parts, IfNoneMatch="*",
        )  # fmt: skip
        if not isinstance(answer, ClientError):
            self.upload = None  # completed: nothing to abort
        return self._refused(answer)

    def delete_if_match(self) -> bool:
        name = self.put("delete")
        if name is None:
            return False
        answer = self._call(self.client.delete_object, Key=name, IfMatch=_WRONG_ETAG)
        return self._refused(answer) and self.exists(name)

    def batch_delete_etag(self) -> bool:
        name = self.put("batch")
        if name is None:
            return False
        answer = self._call(
            self.client.delete_objects,
            Delete={"Objects": [{"Key": name, "ETag": _WRONG_ETAG}], "Quiet": True},
        )
        if isinstance(answer, ClientError):
            return False
        # only a precondition failure is the condition honoured: any other per-key error
        # (AccessDenied: credentials without s3:DeleteObject) says nothing of it
        refused = [err for err in answer.get("Errors", [])
                   if err.get("Key") == name and err.get("Code") == PRECONDITION_FAILED]
        return bool(refused) and self.exists(name)

    def copy_if_match(self) -> bool:
        name = self.put("copy")
        if name is None:
            return False
        answer = self._call(
            self.client.copy_object,
            Key=name, CopySource={"Bucket": self.bucket, "Key": name},
            CopySourceIfMatch=_WRONG_ETAG, MetadataDirective="REPLACE", Metadata={USED: "0"},
        )  # fmt: skip
        return self._refused(answer)

    def cleanup(self) -> None:
        """Best effort: stop at the first failure (the endpoint is failing; don't wait)."""
        with contextlib.suppress(*S3_ERRORS):
            if self.upload is not None:
                name, upload = self.upload
                self.client.abort_multipart_upload(Bucket=self.bucket, Key=name, UploadId=upload)
            for name in self.names:
                self.client.delete_object(Bucket=self.bucket, Key=name)


def probe(client: Any, bucket: str, prefix: str) -> Conditionals:
    """Ask the endpoint which conditions it honours (see the module docstring)."""
    p = _Probe(client, bucket, prefix)
    answers: dict[str, bool] = {}
    source = "probed"
    try:
        for field in _LABELS:
            answers[field] = getattr(p, field)()
    except _Fault as e:
        source = f"probe failed: {e}"
    finally:
        p.cleanup()
    got = [answers.get(f, False) for f in _LABELS]  # in field order
    return Conditionals(got[0], got[1], got[2], got[3], got[4], source)


# -- deletes -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Victim:
    """An object to delete: only while it is still version ``etag`` ("": any version) and,
    when ``used`` is given, still carries that ``kvtier-used`` stamp (checked only by the
    HEAD fallback: a restamp may keep the ETag)."""

    name: str
    etag: str
    used: float | None = None


@dataclass(frozen=True)
class Removal:
    outcomes: dict[str, Outcome]  # by object name; absent: not attempted (a fault)
    fault: Exception | None = None


_DELETE_BATCH = 1000  # S3's limit for one DeleteObjects call
PRECONDITION_FAILED = "PreconditionFailed"


class DeleteRefused(Exception):
    """DeleteObjects answered per-key errors other than a failed precondition (the
    victims it names were not deleted): a fault of the collection or expiry that asked.
    ``persistent``: a setting (a policy, missing permissions), not an outage; the tier
    logs it once and counts every occurrence."""

    persistent = True

    def __init__(self, errors: Sequence[dict[str, str]]) -> None:
        codes = sorted({e.get("Code", "?") for e in errors})
        first = errors[0]
        hint = (" (the credentials need s3:DeleteObject on the bucket)"
                if "AccessDenied" in codes else "")
        super().__init__(
            f"DeleteObjects refused {len(errors)} object(s): {', '.join(codes)}{hint}; "
            f"first: {first.get('Key', '?')}: {first.get('Message', '')}")
        self.errors = list(errors)


class Deleter:
    """Deletes victims the strongest way the endpoint allows: a conditional batch, else
    conditional DeleteObjects one by one, else HEAD-compare-DELETE one by one."""

    def __init__(self, io: ObjectIO, caps: Conditionals) -> None:
        self.io = io
        self.caps = caps

    def delete(self, victims: Sequence[Victim]) -> Removal:
        plain = [v for v in victims if not v.etag]
        versioned = [v for v in victims if v.etag]
        outcomes: dict[str, Outcome] = {}
        fault: Exception | None = None
        refused: list[dict[str, str]] = []
        try:
            refused += self._batch(plain, outcomes)
            if self.caps.batch_delete_etag:
                refused += self._batch(versioned, outcomes)
        except S3_ERRORS as e:
            return Removal(outcomes, e)
        if refused:
            fault = DeleteRefused(refused)
        if versioned and not self.caps.batch_delete_etag:
            got_all = self.io.parallel(self._one, versioned, background=True)
            for v, got in zip(versioned, got_all, strict=True):
                if isinstance(got, Outcome):
                    outcomes[v.name] = got
                else:
                    fault = fault or got
        return Removal(outcomes, fault)

    def delete_one(self, victim: Victim) -> Outcome | Exception:
        """One victim, never raising: an endpoint fault is returned."""
        return self._one(victim)

    def _batch(self, victims: Sequence[Victim],
               outcomes: dict[str, Outcome]) -> list[dict[str, str]]:
        """DeleteObjects ``victims``, 1,000 a call. A per-key ``PreconditionFailed`` is a
        victim replaced since (kept); any other per-key error (``AccessDenied``, ...) is
        returned, and that victim gets no outcome (a fault, not "kept": credentials that
        may not delete must not look like a tier whose objects are all in use)."""
        refused: list[dict[str, str]] = []
        for i in range(0, len(victims), _DELETE_BATCH):
            batch = victims[i : i + _DELETE_BATCH]
            objs = [{"Key": v.name, "ETag": v.etag} if v.etag else {"Key": v.name} for v in batch]
            r = self.io.client.delete_objects(
                Bucket=self.io.bucket, Delete={"Objects": objs, "Quiet": True}
            )
            errors = {err.get("Key", ""): err for err in r.get("Errors", [])}
            for v in batch:
                err = errors.get(v.name)
                if err is None:
                    outcomes[v.name] = Outcome.DELETED
                elif err.get("Code") == PRECONDITION_FAILED:
                    outcomes[v.name] = Outcome.KEPT
                elif err.get("Code") in _GONE:
                    outcomes[v.name] = Outcome.GONE
                else:
                    refused.append(err)
        return refused

    def _one(self, v: Victim) -> Outcome | Exception:
        cond: dict[str, str] = {}
        try:
            if v.etag and self.caps.delete_if_match:
                cond = {"IfMatch": v.etag}
            elif v.etag:  # the HEAD stands in for If-Match; see the module docstring's window
                head = self.io.head(v.name)
                if head is None:
                    return Outcome.GONE
                if head.etag != v.etag or (v.used is not None and used(head) != v.used):
                    return Outcome.KEPT
            self.io.client.delete_object(Bucket=self.io.bucket, Key=v.name, **cond)
        except ClientError as e:
            if code(e) == PRECONDITION_FAILED:
                return Outcome.KEPT
            return Outcome.GONE if code(e) in _GONE else e
        except S3_ERRORS as e:
            return e
        return Outcome.DELETED


