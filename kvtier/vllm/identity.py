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

Threads: ``RequestIdentities.of`` runs on vLLM's scheduler thread and touches memory
only. Fingerprinting an adapter reads its files, so it runs once per adapter on a
background thread; until it is done ``of`` answers ``PENDING`` and the caller asks again
on a later step (as vLLM itself does with ``None``).
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

from kvtier.keys import Namespace

log = logging.getLogger("kvtier.vllm")

#: Namespace digests kept (one per distinct salt x adapter); least recently used go first.
MAX_DIGESTS = 4096

_READ = 1 << 20


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


def adapter_fingerprint(path: str | os.PathLike[str]) -> str:
    """A digest of every regular file of a LoRA adapter (names, sizes and contents).

    Adapters are small (megabytes to a few hundred), so all bytes are hashed, not a
    sample: two adapters that differ in one weight never share KV.
    """
    if not str(path):
        raise FileNotFoundError("the adapter has no local path")
    root = Path(path).expanduser()
    if root.is_file():
        files = [root]
    elif root.is_dir():
        files = sorted(p for p in root.iterdir() if p.is_file())
    else:
        raise FileNotFoundError(f"no adapter files at {str(root)!r}")
    if not files:
        raise FileNotFoundError(f"adapter directory {str(root)!r} is empty")
    h = hashlib.blake2b(digest_size=16)
    for f in files:
        h.update(len(f.name).to_bytes(8, "little") + f.name.encode())
        h.update(f.stat().st_size.to_bytes(8, "little"))
        with open(f, "rb") as fh:
            while block := fh.read(_READ):
                h.update(block)
    return h.hexdigest()


class AdapterFingerprints:
    """LoRA adapter fingerprints by ``(name, path)``, computed once on a background thread.

    ``get`` is called on the scheduler thread and never reads a file: it returns the
    fingerprint, ``PENDING`` (started or still running), or raises ``Unsupported``.
    """

    def __init__(self, fingerprint: Callable[[str], str] = adapter_fingerprint) -> None:
        self._fingerprint = fingerprint
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvtier-lora-fp")
        self._lock = threading.Lock()
        self._jobs: dict[tuple[str, str], Future[str]] = {}

    def get(self, name: str, path: str) -> str | Pending:
        key = (name, path)
        with self._lock:
            fut = self._jobs.get(key)
            if fut is None:
                fut = self._jobs[key] = self._pool.submit(self._fingerprint, path)
        if not fut.done():
            return PENDING
        err = fut.exception()
        if err is not None:
            raise Unsupported(
                f"LoRA adapter {name!r}: its files cannot be fingerprinted ({err}); "
                "kvtier neither restores nor stores KV for it"
            )
        return fut.result()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _mm_extra(features: list[Any], ct: int) -> Callable[[int], bytes]:
    spans: list[tuple[int, int, bytes]] = []
    for f in features:
        ident = getattr(f, "identifier", None)
        pos = getattr(f, "mm_position", None)
        if not ident or pos is None:
            raise Unsupported(
                "a multimodal input has no content identifier; kvtier cannot tell "
                "its KV from another input's"
            )
        spans.append((int(pos.offset), int(pos.length), str(ident).encode()))

    def extra(c: int) -> bytes:
        lo, hi = c * ct, (c + 1) * ct
        parts = [
            b"mm:" + ident + b"@" + str(off - lo).encode()
            for off, length, ident in spans
            if off < hi and off + length > lo
        ]
        return b"|".join(parts)

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
        return b"embeds:" + meta + hashlib.blake2b(raw, digest_size=16).digest()

    return extra


def _combine(parts: list[Callable[[int], bytes]]) -> Callable[[int], bytes] | None:
    if not parts:
        return None
    if len(parts) == 1:
        return parts[0]
    return lambda c: b"\x00".join(p(c) for p in parts)


class RequestIdentities:
    """Builds ``RequestIdentity`` for vLLM requests. Scheduler thread only (not locked)."""

    def __init__(self, namespace: Namespace, chunk_tokens: int) -> None:
        self.ns = namespace
        self.ct = chunk_tokens
        self.adapters = AdapterFingerprints()
        self._digests: OrderedDict[tuple[str | None, str | None], bytes] = OrderedDict()
        self._refused: set[str] = set()

    def of(self, request: Any) -> RequestIdentity | Pending:
        """The identity of ``request``; ``PENDING`` while an adapter is fingerprinted.

        Raises ``Unsupported`` (logged once per cause) if it cannot be established.
        """
        try:
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
        fp = self.adapters.get(name, str(getattr(lora, "lora_path", "") or ""))
        return fp if fp is PENDING else f"{name}\x00{fp}"

    def _digest(self, salt: str | None, adapter: str | None) -> bytes:
        key = (salt, adapter)
        got = self._digests.get(key)
        if got is None:
            got = self._digests[key] = self.ns.digest(salt, adapter=adapter)
            if len(self._digests) > MAX_DIGESTS:
                self._digests.popitem(last=False)
        else:
            self._digests.move_to_end(key)
        return got

    def close(self) -> None:
        self.adapters.close()
