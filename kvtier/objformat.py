"""The self-describing object format shared by every persistent tier.

Layout of one object (file or S3 object)::

    offset 0     MAGIC (6 bytes) | version (u16 LE) | header_len (u32 LE)
    offset 12    msgpack header (header_len bytes): see ``ChunkMeta``
    ...          zero padding up to ``HEADER_SPAN`` (4 KiB)
    HEADER_SPAN  payload (``payload_len`` bytes, raw KV in kvtier's chunk layout)

Invariants:

* The payload starts at a fixed, page-aligned offset, so readers can ``readinto`` it
  straight into a caller's buffer and ranged GETs can start at a known byte.
* The payload checksum is computed by the writer from the bytes it writes, never taken on
  trust from the caller.
* Every read is verified: magic, version, header schema, key, namespace, total length and
  payload checksum (xxh3-64). Any mismatch raises ``CorruptObject``; callers turn that into
  a miss. Bytes that fail verification are never handed out.
* The header is msgpack of plain types only. No pickle anywhere.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import msgpack
import xxhash

from kvtier.keys import KEY_BYTES, ChunkKey

MAGIC = b"KVTIER"
OBJECT_VERSION = 1
_PREFIX = struct.Struct("<6sHI")
HEADER_SPAN = 4096
MAX_HEADER = HEADER_SPAN - _PREFIX.size


class CorruptObject(Exception):
    """An object failed verification. It must be treated as a miss, never as data."""


def checksum(payload: Any) -> int:
    """xxh3-64 of a buffer (bytes, memoryview, numpy array)."""
    return int(xxhash.xxh3_64_intdigest(payload))


@dataclass(frozen=True)
class ChunkMeta:
    """What a tier records about one chunk, in memory and in the object header."""

    namespace: bytes
    key: ChunkKey
    parent: ChunkKey | None
    num_tokens: int
    dtype: str
    shape: tuple[int, ...]
    payload_len: int

    def to_wire(self, payload_checksum: int) -> dict[str, Any]:
        return {
            "ns": self.namespace,
            "key": bytes(self.key),
            "parent": b"" if self.parent is None else bytes(self.parent),
            "ntok": self.num_tokens,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "plen": self.payload_len,
            "csum": payload_checksum,
        }

    @classmethod
    def from_wire(cls, d: Any) -> tuple[ChunkMeta, int]:
        """Parse a wire header into ``(meta, payload_checksum)``."""
        try:
            ns, key, parent = d["ns"], d["key"], d["parent"]
            meta = cls(
                namespace=bytes(ns),
                key=ChunkKey(bytes(key)),
                parent=ChunkKey(bytes(parent)) if parent else None,
                num_tokens=int(d["ntok"]),
                dtype=str(d["dtype"]),
                shape=tuple(int(x) for x in d["shape"]),
                payload_len=int(d["plen"]),
            )
            csum = int(d["csum"])
        except (KeyError, TypeError, ValueError) as e:
            raise CorruptObject(f"header schema: {e!r}") from None
        if len(meta.key) != KEY_BYTES or meta.payload_len < 0 or meta.num_tokens < 0:
            raise CorruptObject("header values out of range")
        return meta, csum

    @property
    def object_len(self) -> int:
        return HEADER_SPAN + self.payload_len


def encode_header(meta: ChunkMeta, payload: Any) -> bytes:
    """The first ``HEADER_SPAN`` bytes of the object holding ``payload`` under ``meta``."""
    if memoryview(payload).nbytes != meta.payload_len:
        raise ValueError(
            f"payload is {memoryview(payload).nbytes} bytes, meta says {meta.payload_len}"
        )
    body: bytes = msgpack.packb(meta.to_wire(checksum(payload)), use_bin_type=True)
    if len(body) > MAX_HEADER:
        raise ValueError(f"header of {len(body)} bytes exceeds {MAX_HEADER}")
    head = _PREFIX.pack(MAGIC, OBJECT_VERSION, len(body)) + body
    return head + bytes(HEADER_SPAN - len(head))


def decode_header(
    span: bytes | memoryview,
    *,
    expect_key: ChunkKey | None = None,
    expect_namespace: bytes | None = None,
    object_len: int | None = None,
) -> tuple[ChunkMeta, int]:
    """Parse and check a header span into ``(meta, payload_checksum)``.

    Raises ``CorruptObject`` on any mismatch.
    """
    if len(span) < HEADER_SPAN:
        raise CorruptObject(f"truncated header: {len(span)} < {HEADER_SPAN} bytes")
    magic, version, hlen = _PREFIX.unpack_from(span, 0)
    if magic != MAGIC:
        raise CorruptObject("bad magic")
    if version != OBJECT_VERSION:
        raise CorruptObject(f"object version {version}, this kvtier reads {OBJECT_VERSION}")
    if hlen > MAX_HEADER:
        raise CorruptObject(f"header length {hlen} out of range")
    try:
        wire = msgpack.unpackb(bytes(span[_PREFIX.size : _PREFIX.size + hlen]), raw=False)
    except Exception as e:  # msgpack raises several unrelated types on garbage
        raise CorruptObject(f"header is not msgpack: {e!r}") from None
    meta, csum = ChunkMeta.from_wire(wire)
    if expect_key is not None and meta.key != expect_key:
        raise CorruptObject(f"header key {meta.key.hex()} != requested {expect_key.hex()}")
    if expect_namespace is not None and meta.namespace != expect_namespace:
        raise CorruptObject("header is from another namespace")
    if object_len is not None and object_len != meta.object_len:
        raise CorruptObject(f"object is {object_len} bytes, header says {meta.object_len}")
    return meta, csum


def verify_payload(meta: ChunkMeta, payload_checksum: int, payload: Any) -> None:
    """Raise ``CorruptObject`` unless ``payload`` matches the header's length and checksum."""
    n = memoryview(payload).nbytes
    if n != meta.payload_len:
        raise CorruptObject(f"payload is {n} bytes, header says {meta.payload_len}")
    if checksum(payload) != payload_checksum:
        raise CorruptObject("payload checksum mismatch")
