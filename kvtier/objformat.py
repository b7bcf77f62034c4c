"""The self-describing object format shared by every persistent tier.

Layout of one object (file or S3 object)::

    offset 0     MAGIC (6 bytes) | version (u16 LE) | header_len (u32 LE)
    offset 12    msgpack header (header_len bytes): see ``ChunkMeta``
    ...          zero padding up to ``HEADER_SPAN`` (4 KiB)
    HEADER_SPAN  payload (``payload_len`` bytes, raw KV in kvtier's chunk layout, or its
                 AES-256-GCM ciphertext in a sealed object: version 2, field ``enc``)

Invariants:

* The payload starts at a fixed, page-aligned offset, so readers can ``readinto`` it
  straight into a caller's buffer and ranged GETs can start at a known byte.
* The payload checksum is computed by the writer from the bytes it writes, never taken on
  trust from the caller.
* Every read is verified: magic, version, header schema (exact types, values in range),
  key, namespace, total length, that the payload fits the reader's buffer, and payload
  checksum (xxh3-64). A reader that knows what it expects (``ChunkSpec``: namespace,
  tokens, dtype, shape, payload length) also gets those checked, so a self-consistent
  object of another geometry, or a short one, is rejected too.
* Whatever is wrong with the bytes, decoding raises ``CorruptObject`` and nothing else
  (no ``OverflowError``, ``MemoryError`` or ``ValueError`` from a hostile header); callers
  turn it into a counted miss. Bytes that fail verification are never handed out.
* The header is msgpack of plain types only. No pickle anywhere.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any, TypeVar

import msgpack
import xxhash

from kvtier.keys import KEY_BYTES, ChunkKey

MAGIC = b"KVTIER"
OBJECT_VERSION = 1
#: An object whose payload is sealed (``kvtier.crypt``): a reader that does not know the
#: seal must not take its ciphertext for KV, so it is another version.
SEALED_VERSION = 2
ALG = "aes-256-gcm"
NONCE_BYTES = 12
TAG_BYTES = 16
KID_BYTES = 8
_PREFIX = struct.Struct("<6sHI")
HEADER_SPAN = 4096
MAX_HEADER = HEADER_SPAN - _PREFIX.size
_U64 = 2**64
MAX_PAYLOAD = 2**48  # far above any chunk; bounds every size a header can claim
_MAX_DIMS = 8
_MAX_TEXT = 64  # dtype names are short ("bfloat16", "float8_e4m3fn")
_Sized = TypeVar("_Sized", bytes, str, list[Any])


class CorruptObject(Exception):
    """An object failed verification. It must be treated as a miss, never as data."""


def checksum(payload: Any) -> int:
    """xxh3-64 of a buffer (bytes, memoryview, numpy array)."""
    return int(xxhash.xxh3_64_intdigest(payload))


def _field(d: dict[Any, Any], name: str, kind: type[_Sized], limit: int) -> _Sized:
    """``d[name]``, checked to be a ``kind`` of at most ``limit`` items."""
    value = d.get(name)
    if not isinstance(value, kind):
        raise CorruptObject(f"header field {name!r}: {type(value).__name__}, not {kind.__name__}")
    if len(value) > limit:
        raise CorruptObject(f"header field {name!r} is too long")
    return value


def _count(value: Any, name: str, limit: int = MAX_PAYLOAD) -> int:
    """``value``, checked to be an int (a bool is not) in ``[0, limit)``."""
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < limit:
        raise CorruptObject(f"header field {name!r} is not a count in range: {value!r:.40}")
    return value


@dataclass(frozen=True)
class Seal:
    """What a sealed object's header records of its payload (``kvtier.crypt``): the id
    of the master key, the nonce and the GCM tag."""

    kid: bytes
    nonce: bytes
    tag: bytes

    def to_wire(self) -> dict[str, Any]:
        return {"alg": ALG, "kid": self.kid, "nonce": self.nonce, "tag": self.tag}

    @classmethod
    def from_wire(cls, d: Any) -> Seal:
        if type(d) is not dict or d.get("alg") != ALG:
            raise CorruptObject("header field 'enc' is not an aes-256-gcm seal")
        kid, nonce, tag = d.get("kid"), d.get("nonce"), d.get("tag")
        if not (isinstance(kid, bytes) and len(kid) == KID_BYTES
                and isinstance(nonce, bytes) and len(nonce) == NONCE_BYTES
                and isinstance(tag, bytes) and len(tag) == TAG_BYTES):
            raise CorruptObject("header field 'enc' has fields of the wrong type or size")
        return cls(kid, nonce, tag)


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
        """Parse a wire header into ``(meta, payload_checksum)``; ``CorruptObject`` on
        anything else than the exact schema ``to_wire`` writes, values in range."""
        if type(d) is not dict:
            raise CorruptObject(f"header is a {type(d).__name__}, not a map")
        key = _field(d, "key", bytes, KEY_BYTES)
        parent = _field(d, "parent", bytes, KEY_BYTES)
        shape = _field(d, "shape", list, _MAX_DIMS)
        if len(key) != KEY_BYTES or len(parent) not in (0, KEY_BYTES):
            raise CorruptObject("header key or parent has the wrong length")
        meta = cls(
            namespace=_field(d, "ns", bytes, MAX_HEADER),
            key=ChunkKey(key),
            parent=ChunkKey(parent) if parent else None,
            num_tokens=_count(d.get("ntok"), "ntok"),
            dtype=_field(d, "dtype", str, _MAX_TEXT),
            shape=tuple(_count(x, "shape") for x in shape),
            payload_len=_count(d.get("plen"), "plen"),
        )
        return meta, _count(d.get("csum"), "csum", _U64)

    @property
    def object_len(self) -> int:
        return HEADER_SPAN + self.payload_len


@dataclass(frozen=True)
class ChunkSpec:
    """What a reader expects every chunk of one engine to be: all of ``ChunkMeta`` but
    the key and parent. A chunk that differs in any field is not served."""

    namespace: bytes
    num_tokens: int
    dtype: str
    shape: tuple[int, ...]
    payload_len: int

    def meta(self, key: ChunkKey, parent: ChunkKey | None) -> ChunkMeta:
        """The meta of chunk ``key`` (after ``parent``) written under this spec."""
        return ChunkMeta(
            self.namespace, key, parent, self.num_tokens, self.dtype, self.shape, self.payload_len
        )

    def check(self, meta: ChunkMeta) -> None:
        """Raise ``CorruptObject`` naming every field where ``meta`` differs."""
        why = self.mismatch(meta)
        if why is not None:
            raise CorruptObject(why)

    def mismatch(self, meta: ChunkMeta) -> str | None:
        """Every field where ``meta`` differs, in words; ``None`` if it matches."""
        wrong = [
            f"{name} {got!r} != {want!r}"
            for name, got, want in (
                ("namespace", meta.namespace, self.namespace),
                ("num_tokens", meta.num_tokens, self.num_tokens),
                ("dtype", meta.dtype, self.dtype),
                ("shape", meta.shape, self.shape),
                ("payload_len", meta.payload_len, self.payload_len),
            )
            if got != want
        ]
        return "chunk is not what this reader expects: " + ", ".join(wrong) if wrong else None


def encode_header(meta: ChunkMeta, payload: Any, seal: Seal | None = None) -> bytes:
    """The first ``HEADER_SPAN`` bytes of the object holding ``payload`` under ``meta``
    (with ``seal``: ``payload`` is its ciphertext, the object ``SEALED_VERSION``)."""
    if memoryview(payload).nbytes != meta.payload_len:
        raise ValueError(
            f"payload is {memoryview(payload).nbytes} bytes, meta says {meta.payload_len}"
        )
    # a sealed payload's GCM tag authenticates every byte: no checksum (readers of sealed
    # objects never look at it, and readers that cannot open them refuse them)
    wire = meta.to_wire(checksum(payload) if seal is None else 0)
    if seal is not None:
        wire["enc"] = seal.to_wire()
    body: bytes = msgpack.packb(wire, use_bin_type=True)
    if len(body) > MAX_HEADER:
        raise ValueError(f"header of {len(body)} bytes exceeds {MAX_HEADER}")
    version = OBJECT_VERSION if seal is None else SEALED_VERSION
    head = _PREFIX.pack(MAGIC, version, len(body)) + body
    return head + bytes(HEADER_SPAN - len(head))


def decode_header(
    span: bytes | memoryview,
    *,
    expect_key: ChunkKey | None = None,
    expect_namespace: bytes | None = None,
    expect: ChunkSpec | None = None,
    object_len: int | None = None,
    max_payload: int | None = None,
) -> tuple[ChunkMeta, int]:
    """Parse and check a header span into ``(meta, payload_checksum)``.

    ``max_payload`` is the reader's buffer size: a larger payload is corrupt, not an
    error of the reader. Raises ``CorruptObject`` on any mismatch, and nothing else.
    """
    meta, csum, _seal = decode_sealed_header(
        span, expect_key=expect_key, expect_namespace=expect_namespace, expect=expect,
        object_len=object_len, max_payload=max_payload)
    return meta, csum


def decode_sealed_header(
    span: bytes | memoryview,
    *,
    expect_key: ChunkKey | None = None,
    expect_namespace: bytes | None = None,
    expect: ChunkSpec | None = None,
    object_len: int | None = None,
    max_payload: int | None = None,
) -> tuple[ChunkMeta, int, Seal | None]:
    """``decode_header``, and the payload's seal (None: a plaintext object)."""
    try:
        meta, csum, seal = _decode(span)
    except CorruptObject:
        raise
    except Exception as e:  # any surprise from hostile bytes is corruption, not a crash
        raise CorruptObject(f"undecodable header: {type(e).__name__}") from None
    if expect_key is not None and meta.key != expect_key:
        raise CorruptObject(f"header key {meta.key.hex()} != requested {expect_key.hex()}")
    if expect_namespace is not None and meta.namespace != expect_namespace:
        raise CorruptObject("header is from another namespace")
    if expect is not None:
        expect.check(meta)
    if object_len is not None and object_len != meta.object_len:
        raise CorruptObject(f"object is {object_len} bytes, header says {meta.object_len}")
    if max_payload is not None and meta.payload_len > max_payload:
        raise CorruptObject(
            f"payload of {meta.payload_len} bytes does not fit the {max_payload}-byte buffer"
        )
    return meta, csum, seal


def _decode(span: bytes | memoryview) -> tuple[ChunkMeta, int, Seal | None]:
    if len(span) < HEADER_SPAN:
        raise CorruptObject(f"truncated header: {len(span)} < {HEADER_SPAN} bytes")
    magic, version, hlen = _PREFIX.unpack_from(span, 0)
    if magic != MAGIC:
        raise CorruptObject("bad magic")
    if version not in (OBJECT_VERSION, SEALED_VERSION):
        raise CorruptObject(f"object version {version}, this kvtier reads "
                            f"{OBJECT_VERSION} and {SEALED_VERSION}")
    if hlen > MAX_HEADER:
        raise CorruptObject(f"header length {hlen} out of range")
    try:
        wire = msgpack.unpackb(bytes(span[_PREFIX.size : _PREFIX.size + hlen]), raw=False)
    except Exception as e:  # msgpack raises several unrelated types on garbage
        raise CorruptObject(f"header is not msgpack: {type(e).__name__}") from None
    meta, csum = ChunkMeta.from_wire(wire)
    sealed = version == SEALED_VERSION
    if sealed != ("enc" in wire):
        raise CorruptObject("object version and seal disagree")
    return meta, csum, Seal.from_wire(wire["enc"]) if sealed else None


def verify_payload(meta: ChunkMeta, payload_checksum: int, payload: Any) -> None:
    """Raise ``CorruptObject`` unless ``payload`` matches the header's length and checksum."""
    n = memoryview(payload).nbytes
    if n != meta.payload_len:
        raise CorruptObject(f"payload is {n} bytes, header says {meta.payload_len}")
    if checksum(payload) != payload_checksum:
        raise CorruptObject("payload checksum mismatch")
