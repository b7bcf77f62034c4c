"""Key identity of a request: everything besides token ids that changes a chunk's KV.

Two requests with the same token ids can have different KV:

* a **LoRA adapter** changes the K/V projections: the adapter's name *and* a fingerprint
  of its files are mixed into the request's namespace digest, so two nodes with
  different files under one adapter name never share, and the base model never reads an
  adapter's KV (or the reverse);
* **multimodal inputs** are placeholder tokens, identical for every image: each chunk's
  key covers the content identifier (vLLM's ``mm_feature.identifier``) of every input
  overlapping the chunk, with its offset relative to the chunk start;
* **prompt embeddings** arrive with token ids all zero: each chunk's key covers a digest
  of the embeddings of its positions (dtype, shape and bytes);
* ``cache_salt``: mixed into the namespace digest, as before.

This mirrors what vLLM's own prefix cache hashes (``generate_block_hash_extra_keys``).
A request whose identity cannot be established (an adapter whose files cannot be read,
a multimodal input without an identifier) is *refused*: kvtier loads nothing for it and
stores nothing from it, and says so once per cause in the log. It never mixes.

Every namespace digest also carries the engine's weights epoch
(``RequestIdentities.bump_epoch``, called when vLLM resets its prefix cache after a
weight update): KV computed with other weights is never found again.

The per-chunk extras are self-delimiting and tagged (``encode_mm``, ``_embeds_extra``),
so no two different inputs give the same bytes.

Threads: ``RequestIdentities.of`` runs on vLLM's scheduler thread and touches memory
only. Fingerprinting an adapter reads its files, and noticing that they changed stats
them, so both run on a background thread (``AdapterFingerprints``); until a fingerprint
is known ``of`` answers ``PENDING`` and the caller asks again on a later step (as vLLM
itself does with ``None``).
"""

from __future__ import annotations

import hashlib
import logging
import os
import secrets
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

from kvtier.clock import SYSTEM_CLOCK, Clock
from kvtier.keys import Namespace

log = logging.getLogger("kvtier.vllm")

#: Namespace digests kept (one per distinct salt x adapter); least recently used go first.
MAX_DIGESTS = 4096

_READ = 1 << 20

#: First byte of each kind of per-chunk extra: parts of different kinds never collide.
_MM_TAG = b"\x01"
_EMBEDS_TAG = b"\x02"


class Pending(Enum):
    PENDING = "pending"


PENDING = Pending.PENDING


class Unsupported(Exception):
    """The request's KV identity cannot be established; kvtier must not touch its KV."""


@dataclass(frozen=True)
class RequestIdentity:
    """The namespace digest of a request and the per-chunk extra bytes of its keys.

    ``chunk_extra(c)`` is a pure function of the request's immutable inputs, so keys can
    be extended incrementally as tokens are appended.
    """

    namespace: bytes
    chunk_extra: Callable[[int], bytes] | None = None


def _adapter_files(path: str | os.PathLike[str]) -> list[Path]:
    if not str(path):
        raise FileNotFoundError("the adapter has no local path")
    root = Path(path).expanduser()
    if root.is_file():
        return [root]
    if not root.is_dir():
        raise FileNotFoundError(f"no adapter files at {str(root)!r}")
    files = sorted(p for p in root.iterdir() if p.is_file())
    if not files:
        raise FileNotFoundError(f"adapter directory {str(root)!r} is empty")
    return files


def adapter_fingerprint(path: str | os.PathLike[str]) -> str:
    """A digest of every regular file of a LoRA adapter (names, sizes and contents).

    Adapters are small (megabytes to a few hundred), so all bytes are hashed, not a
    sample: two adapters that differ in one weight never share KV.
    """
    h = hashlib.blake2b(digest_size=16)
    for f in _adapter_files(path):
        h.update(len(f.name).to_bytes(8, "little") + f.name.encode())
        h.update(f.stat().st_size.to_bytes(8, "little"))
        with open(f, "rb") as fh:
            while block := fh.read(_READ):
                h.update(block)
    return h.hexdigest()


#: ``(name, size, mtime_ns, inode, device)`` of every file of an adapter.
Signature = tuple[tuple[str, int, int, int, int], ...]


def adapter_signature(path: str | os.PathLike[str]) -> Signature:
    """What changes when an adapter's files do: each file's name, size, mtime and inode
    (a file rewritten in place, replaced by ``rename``, added or removed). Stats only."""
    out = []
    for f in _adapter_files(path):
        st = f.stat()
        out.append((f.name, st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev))
    return tuple(out)


class _FilesChanged(Exception):
    pass


@dataclass
class _Adapter:
    """One ``(name, path)``: its fingerprint as of ``signature``, or why there is none."""

    fingerprint: str | None = None
    signature: Signature | None = None
    checked_at: float = 0.0  # when the signature was last found unchanged
    error: str | None = None  # the last check failed; retried at ``retry_at``
    failures: int = 0
    retry_at: float = 0.0
    running: bool = False  # a check is queued or running
    #: its files changed on disk after it was fingerprinted (not through a
    #: ``load_inplace`` reload): which weights vLLM serves is not known
    drifted: bool = False


class AdapterFingerprints:
    """LoRA adapter fingerprints by ``(name, path)``, kept current on a background thread.

    ``get`` is called on the scheduler thread and never touches a file: it answers the
    fingerprint, ``PENDING``, or raises ``Unsupported``, from memory, and queues a check
    when one is due. A check (on the background ``executor``) stats every file of the
    adapter (``adapter_signature``) and re-reads them all only if the signature changed.
    So:

    * A new adapter is ``PENDING`` until fingerprinted.
    * A known one is re-checked at most every ``revalidate_s``; meanwhile, and while the
      check runs, ``get`` answers the fingerprint it has. A check that finds the files
      changed refuses the adapter (``Unsupported``) from then on: vLLM keeps serving the
      weights it loaded until it evicts and re-reads the adapter, which kvtier cannot
      see, so neither the old fingerprint nor the new one is known to name the KV it
      computes. A ``load_inplace`` reload (``forget``: vLLM reads the files again) or a
      restart clears it.
    * A check that fails (unreadable, missing, or files changing while read) refuses the
      adapter (``Unsupported``) until a retry, after ``retry_s`` doubling per failure up
      to ``max_retry_s``; a retry that succeeds serves it again.

    At most ``max_adapters`` entries are kept (least recently asked go first).
    """

    def __init__(
        self,
        fingerprint: Callable[[str], str] = adapter_fingerprint,
        *,
        signature: Callable[[str], Any] = adapter_signature,
        executor: Executor | None = None,
        clock: Clock = SYSTEM_CLOCK,
        revalidate_s: float = 5.0,
        retry_s: float = 1.0,
        max_retry_s: float = 60.0,
        max_adapters: int = 1024,
    ) -> None:
        self._fingerprint = fingerprint
        self._signature = signature
        self._executor = executor or ThreadPoolExecutor(1, thread_name_prefix="kvtier-lora-fp")
        self._clock = clock
        self.revalidate_s = revalidate_s
        self.retry_s = retry_s
        self.max_retry_s = max_retry_s
        self.max_adapters = max_adapters
        self._lock = threading.Lock()
        self._entries: OrderedDict[tuple[str, str], _Adapter] = OrderedDict()

    def get(self, name: str, path: str) -> str | Pending:
        key = (name, path)
        entry = self._due(key)
        if entry is not None:
            self._start(entry, path)
        return self._answer(name, key)

    def forget(self, name: str, path: str) -> None:
        """Drop what is known of the adapter (it is being reloaded in place): the next
        ``get`` answers ``PENDING`` and fingerprints its files again. A check still
        running for the old entry updates only that entry."""
        with self._lock:
            self._entries.pop((name, path), None)

    def _due(self, key: tuple[str, str]) -> _Adapter | None:
        """The entry of ``key`` if a check must start now (marked running), else None."""
        now = self._clock.monotonic()
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                entry = self._entries[key] = _Adapter()
                self._trim()
            self._entries.move_to_end(key)
            if entry.running:
                return None
            if entry.error is not None:
                due = now >= entry.retry_at
            else:
                due = entry.fingerprint is None or now - entry.checked_at >= self.revalidate_s
            entry.running = due
            return entry if due else None

    def _trim(self) -> None:
        while len(self._entries) > self.max_adapters:
            self._entries.popitem(last=False)

    def _start(self, entry: _Adapter, path: str) -> None:
        try:
            self._executor.submit(self._check, entry, path)
        except RuntimeError:  # the executor is shut down (closing)
            with self._lock:
                entry.running = False

    def _answer(self, name: str, key: tuple[str, str]) -> str | Pending:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return PENDING
            if entry.drifted:
                raise Unsupported(
                    f"LoRA adapter {name!r}: its files changed on disk after kvtier "
                    "fingerprinted them, and vLLM may still serve the weights it loaded "
                    "before; kvtier neither restores nor stores KV for it until it is "
                    "reloaded with load_inplace or the server restarts")
            if entry.fingerprint is not None:
                return entry.fingerprint
            if entry.error is None or entry.running:  # first check, or a retry, running
                return PENDING
            err = entry.error
        raise Unsupported(
            f"LoRA adapter {name!r}: its files cannot be fingerprinted ({err}); kvtier "
            "neither restores nor stores KV for it until a retry (in the background, "
            "backing off) succeeds"
        )

    def _check(self, entry: _Adapter, path: str) -> None:
        """Background thread: confirm or renew ``entry``'s fingerprint."""
        try:
            sig = self._signature(path)
            with self._lock:
                if entry.fingerprint is not None and entry.signature == sig:
                    entry.checked_at = self._clock.monotonic()
                    return
                if entry.fingerprint is not None:  # changed under vLLM: refused
                    entry.drifted = True
                    entry.fingerprint = None
                    return
                entry.fingerprint = None  # PENDING until the new one is known
            fp = self._fingerprint(path)
            if self._signature(path) != sig:
                raise _FilesChanged("its files changed while they were read")
            with self._lock:
                entry.fingerprint, entry.signature = fp, sig
                entry.checked_at = self._clock.monotonic()
                entry.error, entry.failures = None, 0
        except Exception as e:  # every failure refuses the adapter until the retry
            with self._lock:
                entry.fingerprint = entry.signature = None
                entry.failures += 1
                entry.error = str(e) or type(e).__name__
                backoff = min(self.max_retry_s, self.retry_s * 2 ** (entry.failures - 1))
                entry.retry_at = self._clock.monotonic() + backoff
        finally:
            with self._lock:
                entry.running = False

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


def encode_mm(items: Sequence[tuple[str, int]]) -> bytes:
    """Canonical bytes of ``(identifier, offset relative to the chunk start)`` pairs, in
    order: a count, then per item the identifier's UTF-8 length and bytes and the offset
    as a signed 64-bit integer. Self-delimiting, so two different lists never encode to
    the same bytes (``tests/vllm/test_identity.py`` fuzzes it). ``b""`` for no items."""
    if not items:
        return b""
    out = [_MM_TAG, len(items).to_bytes(8, "little")]
    for ident, offset in items:
        raw = ident.encode("utf-8", "surrogatepass")
        out += [len(raw).to_bytes(8, "little"), raw, offset.to_bytes(8, "little", signed=True)]
    return b"".join(out)


def _mm_extra(features: list[Any], ct: int) -> Callable[[int], bytes]:
    spans: list[tuple[int, int, str]] = []
    for f in features:
        ident = getattr(f, "identifier", None)
        pos = getattr(f, "mm_position", None)
        if not ident or pos is None:
            raise Unsupported(
                "a multimodal input has no content identifier; kvtier cannot tell "
                "its KV from another input's"
            )
        spans.append((int(pos.offset), int(pos.length), str(ident)))

    def extra(c: int) -> bytes:
        lo, hi = c * ct, (c + 1) * ct
        return encode_mm([(ident, off - lo) for off, length, ident in spans
                          if off < hi and off + length > lo])

    return extra


def _embeds_extra(embeds: Any, ct: int) -> Callable[[int], bytes]:
    import torch

    n = int(embeds.shape[0])
    meta = f"{embeds.dtype}:{tuple(embeds.shape[1:])}".encode()

    def extra(c: int) -> bytes:
        lo, hi = c * ct, min((c + 1) * ct, n)
        if lo >= n:
            return b""  # generated tokens: their ids are real
        part = embeds[lo:hi].detach().contiguous().cpu()
        raw = part.view(torch.uint8).numpy().tobytes()
        return (_EMBEDS_TAG + len(meta).to_bytes(8, "little") + meta
                + hashlib.blake2b(raw, digest_size=16).digest())

    return extra


def _combine(parts: list[Callable[[int], bytes]]) -> Callable[[int], bytes] | None:
    """One chunk-extra function of several. Each part is self-delimiting and starts with
    its own tag (``encode_mm``, ``_embeds_extra``), so their concatenation in a fixed
    order is unambiguous; an empty part adds nothing (a chunk no input overlaps keys
    like plain text)."""
    if not parts:
        return None
    if len(parts) == 1:
        return parts[0]
    return lambda c: b"".join(p(c) for p in parts)


class RequestIdentities:
    """Builds ``RequestIdentity`` for vLLM requests. Scheduler thread only (not locked)."""

    def __init__(
        self, namespace: Namespace, chunk_tokens: int,
        adapters: AdapterFingerprints | None = None,
        salt_check: Callable[[object], bool] | None = None,
    ) -> None:
        self.ns = namespace
        self.ct = chunk_tokens
        #: ``tenancy.require_router_salt``: a request whose ``cache_salt`` the router did
        #: not issue (``kvtier.tenancy.SaltCheck``) is ``Unsupported``: no KV of it is read
        #: or stored, so a client reaching the engine directly gets no tenant's KV
        self.salt_check = salt_check
        self.adapters = adapters or AdapterFingerprints()
        self.epoch = 0
        self._digests: OrderedDict[tuple[str | None, str | None], bytes] = OrderedDict()
        self._refused: set[str] = set()

    def bump_epoch(self) -> int:
        """The engine's weights changed in place: every namespace digest made from now on
        differs from every one made before (the epoch is mixed in; cached digests are
        dropped). Returns the new epoch. In memory only: a restarted engine starts at 0,
        the weights on disk, whose digests are those of an engine that never bumped.
        Identities handed out before keep the old digest; the caller drops them.

        The epoch is a fresh random 63-bit value, not a counter: a restarted engine is at
        0 again, and a counter would give its first reset the epoch 1 that the previous
        process used for other weights, in a namespace the shared tiers still hold."""
        prev = self.epoch
        while self.epoch in (0, prev):
            self.epoch = secrets.randbits(63)
        self._digests.clear()
        return self.epoch

    def of(self, request: Any) -> RequestIdentity | Pending:
        """The identity of ``request``; ``PENDING`` while an adapter is fingerprinted.

        Raises ``Unsupported`` (logged once per cause) if it cannot be established.
        """
        try:
            if self.salt_check is not None and not self.salt_check(
                    getattr(request, "cache_salt", None)):
                raise Unsupported(
                    "a request without a router-issued cache_salt (tenancy."
                    "require_router_salt): its KV is neither read nor stored")
            adapter = self._adapter(request)
            if adapter is PENDING:
                return PENDING
            extras: list[Callable[[int], bytes]] = []
            features = getattr(request, "mm_features", None)
            if features:
                extras.append(_mm_extra(list(features), self.ct))
            embeds = getattr(request, "prompt_embeds", None)
            if embeds is not None:
                extras.append(_embeds_extra(embeds, self.ct))
        except Unsupported as e:
            if str(e) not in self._refused and len(self._refused) < MAX_DIGESTS:
                self._refused.add(str(e))
                log.warning("kvtier: %s", e)
            raise
        ns = self._digest(getattr(request, "cache_salt", None), adapter)
        return RequestIdentity(ns, _combine(extras))

    def _adapter(self, request: Any) -> str | Pending | None:
        lora = getattr(request, "lora_request", None)
        if lora is None:
            return None
        name = str(lora.lora_name)
        path = str(getattr(lora, "lora_path", "") or "")
        if getattr(lora, "load_inplace", False):
            # vLLM reloads the adapter's files when it runs this request (RL loops update
            # an adapter in place): the weights it serves from then on may be files
            # kvtier has not fingerprinted. Its fingerprint is dropped (every later
            # request waits for the new one) and this request's KV is neither restored
            # nor stored: which files it was computed with is not known here.
            self.adapters.forget(name, path)
            raise Unsupported(
                f"LoRA adapter {name!r} is reloaded in place (load_inplace): kvtier "
                "neither restores nor stores KV for the request that reloads it, and "
                "fingerprints its files again for the requests after it")
        fp = self.adapters.get(name, path)
        return fp if fp is PENDING else f"{name}\x00{fp}"

    def _digest(self, salt: str | None, adapter: str | None) -> bytes:
        key = (salt, adapter)
        got = self._digests.get(key)
        if got is None:
            got = self._digests[key] = self.ns.digest(salt, adapter=adapter, epoch=self.epoch)
            if len(self._digests) > MAX_DIGESTS:
                self._digests.popitem(last=False)
        else:
            self._digests.move_to_end(key)
        return got

    def close(self) -> None:
        self.adapters.close()
