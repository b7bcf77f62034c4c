"""Chunk keys: chained content hashes under a namespace.

Invariants:

* ``key_0 = H(ns_digest, tokens_0, extra)`` and ``key_i = H(key_{i-1}, tokens_i, extra)``,
  with ``H`` = BLAKE2b-128 over a fixed little-endian encoding. So a key identifies the
  whole token prefix up to and including its chunk, and two nodes serving the same model
  compute the same keys without a coordinator.
* Never Python's ``hash()``: keys are identical across processes, machines and runs.
* The namespace digest covers everything that makes KV bytes incompatible (model identity,
  revision, quantization, KV cache dtype and fp8 scales, physical layout, geometry,
  chunking, TP placement, format version; per request the ``cache_salt`` and LoRA
  adapter; per engine the weights epoch). Different namespaces never share a key. What
  varies per chunk (multimodal inputs, prompt embeddings) goes into that chunk's
  ``extra``. ``docs/architecture.md`` ("Keys") lists every input and its vLLM setting.
* A partial *tail* (the first ``k`` blocks of a chunk that is not full yet, ``tail_key``)
  is ``H(key_{i-1}, tokens, extra, TAIL)``: one more part than any full chunk's input,
  so a tail key never equals a full chunk's key, and its parent names the prefix before
  it exactly as a full chunk's does.
* ``ChunkKey.hex()`` is only ``[0-9a-f]``: tier paths and object names built from it
  cannot escape their root.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import NewType

import msgpack
import numpy as np

from kvtier import FORMAT_VERSION

#: 16 raw bytes. Use ``key.hex()`` for names.
ChunkKey = NewType("ChunkKey", bytes)

KEY_BYTES = 16


def _h(*parts: bytes) -> bytes:
    h = hashlib.blake2b(digest_size=KEY_BYTES)
    for p in parts:
        # Length-prefix every part so (a, bc) and (ab, c) never collide.
        h.update(len(p).to_bytes(8, "little"))
        h.update(p)
    return h.digest()


@dataclass(frozen=True)
class Namespace:
    """Everything that must match for stored KV bytes to be reusable."""

    model: str
    model_fingerprint: str
    kv_dtype: str
    kv_layout: str
    num_layers: int
    num_kv_heads: int
    head_size: int
    chunk_tokens: int
    block_size: int
    tp_rank: int = 0
    tp_world_size: int = 1
    format_version: int = FORMAT_VERSION
    #: ``cache_config.cache_dtype`` as configured ("auto", "fp8_e4m3", ...): vLLM gives
    #: every fp8 variant the same torch dtype (uint8), so ``kv_dtype`` cannot tell them apart.
    kv_cache_dtype: str = "auto"
    #: Digest of the k/v scales the worker's attention layers quantize with ("" when the
    #: KV cache is not quantized and the scales are unused).
    kv_scales: str = ""
    #: ``model_config.quantization`` ("" for none).
    quantization: str = ""
    #: The resolved model revision (a commit for hub ids; "" for a local directory).
    revision: str = ""
    #: ``model_config.dtype``: the dtype K and V are computed in before they are stored.
    model_dtype: str = ""
    #: What of a request's KV is kept ("" full attention; ``sliding_window:N``: the last
    #: N tokens). Left out of the digest when "", so full-attention digests are those
    #: of before this field.
    attention: str = ""

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_size", "chunk_tokens", "block_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"Namespace.{name} must be > 0, got {getattr(self, name)}")
        if self.chunk_tokens % self.block_size:
            raise ValueError(
                f"chunk_tokens ({self.chunk_tokens}) must be a multiple of "
                f"block_size ({self.block_size})"
            )
        if not 0 <= self.tp_rank < self.tp_world_size:
            raise ValueError(f"tp_rank {self.tp_rank} outside tp_world_size {self.tp_world_size}")

    def digest(
        self, cache_salt: str | None = None, *, adapter: str | None = None, epoch: int = 0
    ) -> bytes:
        """16-byte digest of this namespace, specialised by a request's salt and adapter
        and by the engine's weights epoch.

        ``adapter`` identifies a LoRA adapter (its name and a fingerprint of its files);
        ``None`` is the base model. ``epoch`` counts in-place weight updates of this
        engine since it started; epoch 0 is the weights on disk, so its digest is the
        one without an epoch (a restarted engine finds what the last one stored at 0).
        """
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0, got {epoch}")
        items = {k: v for k, v in asdict(self).items() if k != "attention" or v}
        fields = msgpack.packb(sorted(items.items()), use_bin_type=True)
        salt = b"" if cache_salt is None else b"salt:" + cache_salt.encode("utf-8")
        parts = [b"kvtier-namespace", fields, salt]
        if adapter is not None:
            parts.append(b"lora:" + adapter.encode("utf-8"))
        if epoch:
            parts.append(b"epoch:" + epoch.to_bytes(8, "little"))
        return _h(*parts)


def encode_tokens(tokens: Sequence[int] | np.ndarray) -> bytes:
    """Canonical byte encoding of token ids (little-endian uint32)."""
    arr = np.asarray(tokens, dtype=np.int64)
    if arr.size and (arr.min() < 0 or arr.max() >= 2**32):
        raise ValueError("token ids must be in [0, 2**32)")
    return arr.astype("<u4").tobytes()


def chunk_keys(
    ns_digest: bytes,
    tokens: Sequence[int] | np.ndarray,
    chunk_tokens: int,
    *,
    extra: bytes | Callable[[int], bytes] = b"",
    start_chunk: int = 0,
    parent: ChunkKey | None = None,
) -> list[ChunkKey]:
    """Keys of every *full* chunk of ``tokens``; a trailing partial chunk gets no key.

    ``extra`` is mixed into every chunk's key: the same bytes for all chunks, or a
    function of the absolute chunk index (multimodal inputs and prompt embeddings
    differ per chunk). To extend an earlier computation, pass ``start_chunk`` and the key
    of chunk ``start_chunk - 1`` as ``parent``; the result then starts at chunk
    ``start_chunk``.
    """
    if chunk_tokens <= 0:
        raise ValueError(f"chunk_tokens must be > 0, got {chunk_tokens}")
    if (start_chunk == 0) != (parent is None):
        raise ValueError("parent must be given exactly when start_chunk > 0")
    prev = ns_digest if parent is None else bytes(parent)
    end = len(tokens) // chunk_tokens * chunk_tokens
    encoded = encode_tokens(tokens[start_chunk * chunk_tokens : end])  # only what is hashed
    step = chunk_tokens * 4
    keys: list[ChunkKey] = []
    for i in range(len(encoded) // step):
        more = extra(start_chunk + i) if callable(extra) else extra
        prev = _h(prev, encoded[i * step : (i + 1) * step], more)
        keys.append(ChunkKey(prev))
    return keys


#: The extra part that makes a tail's key input differ from every full chunk's.
TAIL = b"kvtier-tail"


def tail_key(
    prev: bytes, tokens: Sequence[int] | np.ndarray, extra: bytes = b""
) -> ChunkKey:
    """The key of a partial tail: ``tokens`` (fewer than a chunk's, a whole number of
    blocks) right after the chunk whose key is ``prev`` (the namespace digest for a tail
    of chunk 0), with that chunk position's ``extra``."""
    if not len(tokens):
        raise ValueError("a tail holds at least one token")
    return ChunkKey(_h(bytes(prev), encode_tokens(tokens), extra, TAIL))


WINDOW = b"kvtier-window"


def window_key(end: ChunkKey, part: int, parts: int) -> ChunkKey:
    """The key of part ``part`` of ``parts`` of a sliding-window model's *window object*:
    the KV a hit ending where the chunk or tail keyed ``end`` ends needs (the blocks vLLM
    keeps below that point; ``kvtier.vllm.window``)."""
    if not 0 <= part < parts:
        raise ValueError(f"window part {part} outside 0..{parts - 1}")
    return ChunkKey(_h(bytes(end), WINDOW, part.to_bytes(4, "little"),
                       parts.to_bytes(4, "little")))


GROUP = b"kvtier-group"


def group_key(key: ChunkKey, group: int) -> ChunkKey:
    """The key of KV-cache group ``group``'s part of the piece keyed ``key``, in a hybrid
    model (vLLM's hybrid KV-cache manager: each group has its own blocks and is stored as
    objects of its own; ``kvtier.vllm.hybrid``)."""
    if group < 0:
        raise ValueError(f"KV-cache group {group} is negative")
    return ChunkKey(_h(bytes(key), GROUP, group.to_bytes(4, "little")))


def key_from_hex(text: str) -> ChunkKey:
    """Parse a hex key, rejecting anything that is not exactly 32 hex digits."""
    if len(text) != 2 * KEY_BYTES or any(c not in "0123456789abcdef" for c in text):
        raise ValueError(f"not a kvtier key (32 lowercase hex digits): {text!r}")
    return ChunkKey(bytes.fromhex(text))
