"""Property tests of the object format: whatever the bytes, decoding yields a verified
chunk or ``CorruptObject``, never another exception and never unverified bytes."""

from __future__ import annotations

from typing import Any

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.keys import KEY_BYTES
from kvtier.objformat import (
    HEADER_SPAN,
    ChunkMeta,
    CorruptObject,
    checksum,
    decode_header,
    encode_header,
    verify_payload,
)
from tests.tiers.damage import FIELDS, any_value, damaged_object, mutated_wire
from tests.tiers.harness import make_key, meta_for, payload_for, raw_object, spec_for

N = 64  # a small payload keeps every example cheap
KEY = make_key(5)
SPEC = spec_for(N)
PAYLOAD = bytes(payload_for(KEY, N))
WIRE = meta_for(KEY, N).to_wire(checksum(PAYLOAD))
OBJECT = encode_header(meta_for(KEY, N), PAYLOAD) + PAYLOAD

FORMAT = settings(max_examples=200, deadline=None, database=None)


def _read(obj: bytes, *, expect_key: bool = True) -> tuple[ChunkMeta, bytes] | None:
    """What a tier does with an object's bytes: the verified ``(meta, payload)``, or
    ``None`` for ``CorruptObject``. Any other exception fails the test."""
    buf = bytearray(N)
    try:
        meta, csum = decode_header(
            obj[:HEADER_SPAN],
            expect_key=KEY if expect_key else None,
            expect=SPEC,
            object_len=len(obj),
            max_payload=N,
        )
        body = obj[HEADER_SPAN : HEADER_SPAN + meta.payload_len]
        buf[: len(body)] = body
        verify_payload(meta, csum, memoryview(buf)[: meta.payload_len])
    except CorruptObject:
        return None
    return meta, bytes(buf)


def _sane(meta: ChunkMeta) -> None:
    assert isinstance(meta.namespace, bytes) and len(meta.key) == KEY_BYTES
    assert meta.parent is None or len(meta.parent) == KEY_BYTES
    assert all(type(x) is int and x >= 0 for x in meta.shape)
    assert type(meta.num_tokens) is int and meta.num_tokens >= 0
    assert type(meta.payload_len) is int and meta.payload_len >= 0
    assert type(meta.dtype) is str


@FORMAT
@given(st.binary(max_size=HEADER_SPAN + 2 * N), st.booleans())
def test_arbitrary_bytes_decode_to_a_sane_header_or_corrupt(data: bytes, framed: bool) -> None:
    span = (OBJECT[:12] + data if framed else data).ljust(HEADER_SPAN, b"\0")
    try:
        meta, csum = decode_header(span)
    except CorruptObject:
        return
    _sane(meta)
    assert 0 <= csum < 2**64


@FORMAT
@given(any_value)
def test_any_msgpack_header_decodes_exactly_or_is_corrupt(wire: Any) -> None:
    try:
        meta, csum = decode_header(raw_object(wire))
    except CorruptObject:
        return
    _sane(meta)
    assert isinstance(wire, dict)
    assert meta.to_wire(csum) == {f: wire[f] for f in FIELDS}  # exact types, nothing coerced


@FORMAT
@given(mutated_wire(WIRE))
def test_mutated_header_fields_are_verified_or_rejected(wire: dict[str, Any]) -> None:
    got = _read(raw_object(wire, PAYLOAD))
    if got is not None:
        meta, payload = got
        SPEC.check(meta)
        assert meta.key == KEY and payload == PAYLOAD


@FORMAT
@given(damaged_object(OBJECT, WIRE, PAYLOAD))
def test_damaged_objects_are_verified_or_rejected(obj: bytes) -> None:
    got = _read(obj)
    if got is not None:
        meta, payload = got
        SPEC.check(meta)
        assert meta.key == KEY
        assert payload == PAYLOAD  # verified bytes are the bytes that were written


def test_the_undamaged_object_reads_back() -> None:
    got = _read(OBJECT)
    assert got is not None
    assert got[0] == meta_for(KEY, N)
    assert np.array_equal(np.frombuffer(got[1], np.uint8), payload_for(KEY, N))
