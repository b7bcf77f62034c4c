"""The object format: self-describing, verified on every read, never pickle."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from kvtier.objformat import (
    HEADER_SPAN,
    ChunkSpec,
    CorruptObject,
    checksum,
    decode_header,
    encode_header,
    verify_payload,
)
from tests.tiers.harness import (
    NS_DIGEST,
    SPEC,
    make_key,
    meta_for,
    payload_for,
    raw_object,
    spec_for,
)


def test_header_round_trips_and_pads_to_span() -> None:
    key = make_key(3)
    payload = payload_for(key, 1000)
    head = encode_header(meta_for(key, 1000), payload)
    assert len(head) == HEADER_SPAN
    meta, csum = decode_header(head, expect_key=key, expect_namespace=NS_DIGEST,
                               object_len=HEADER_SPAN + 1000)
    assert meta == meta_for(key, 1000)
    verify_payload(meta, csum, payload)


@pytest.mark.parametrize(
    ("damage", "match"),
    [
        (lambda h: b"XXXXXX" + h[6:], "magic"),
        (lambda h: h[:6] + b"\x09\x00" + h[8:], "version"),
        (lambda h: h[:100], "truncated header"),
        (lambda h: h[:12] + b"\xc1" * 50 + h[62:], "msgpack|schema"),
    ],
)
def test_damaged_headers_are_rejected(damage: object, match: str) -> None:
    key = make_key(1)
    head = encode_header(meta_for(key, 10), payload_for(key, 10))
    with pytest.raises(CorruptObject, match=match):
        decode_header(damage(head))  # type: ignore[operator]


def test_key_namespace_and_length_mismatches_are_rejected() -> None:
    key = make_key(1)
    head = encode_header(meta_for(key, 10), payload_for(key, 10))
    with pytest.raises(CorruptObject, match="requested"):
        decode_header(head, expect_key=make_key(2))
    with pytest.raises(CorruptObject, match="another namespace"):
        decode_header(head, expect_namespace=b"\x01" * 16)
    with pytest.raises(CorruptObject, match="header says"):
        decode_header(head, object_len=HEADER_SPAN + 9)


def test_payload_checksum_and_length_are_verified() -> None:
    key = make_key(1)
    payload = payload_for(key, 10)
    meta, csum = decode_header(encode_header(meta_for(key, 10), payload))
    bad = payload.copy()
    bad[3] ^= 1
    with pytest.raises(CorruptObject, match="checksum"):
        verify_payload(meta, csum, bad)
    with pytest.raises(CorruptObject, match="header says"):
        verify_payload(meta, csum, payload[:9])


def _wire(**changes: Any) -> dict[str, Any]:
    """The wire header of a valid 10-byte chunk, with ``changes`` applied."""
    key = make_key(1)
    wire = meta_for(key, 10).to_wire(checksum(payload_for(key, 10)))
    wire.update(changes)
    return wire


@pytest.mark.parametrize(
    "changes",
    [
        {"ns": 2**63},  # bytes(2**63): OverflowError
        {"ns": 2**62},  # bytes(2**62): MemoryError
        {"ntok": float("inf")},  # int(inf): OverflowError
        {"ntok": 2**64 - 1},
        {"plen": -1},
        {"plen": True},
        {"shape": "12"},  # a string is iterable: it once parsed as (1, 2)
        {"shape": [float("nan")]},
        {"dtype": 5},
        {"key": "k" * 16},
        {"parent": b"short"},
        {"csum": -1},
        {"extra": "ignored?", "csum": None},
    ],
    ids=repr,
)
def test_hostile_header_values_are_corrupt_never_a_crash(changes: dict[str, Any]) -> None:
    with pytest.raises(CorruptObject):
        decode_header(raw_object(_wire(**changes)))


@pytest.mark.parametrize("wire", [None, 7, "text", b"bytes", [1, 2], {1: 2}], ids=repr)
def test_header_that_is_not_a_map_is_corrupt(wire: Any) -> None:
    with pytest.raises(CorruptObject):
        decode_header(raw_object(wire))


def test_payload_larger_than_the_reader_buffer_is_corrupt() -> None:
    key = make_key(1)
    head = encode_header(meta_for(key, 10), payload_for(key, 10))
    assert decode_header(head, max_payload=10)[0].payload_len == 10
    with pytest.raises(CorruptObject, match="does not fit the 9-byte buffer"):
        decode_header(head, max_payload=9)


def test_spec_builds_metas_and_accepts_its_own() -> None:
    key, parent = make_key(2), make_key(1)
    meta = SPEC.meta(key, parent)
    assert meta == replace(meta_for(key), parent=parent)
    SPEC.check(meta)
    head = encode_header(meta, payload_for(key))
    assert decode_header(head, expect_key=key, expect=SPEC)[0] == meta


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"namespace": b"", "payload_len": 0, "shape": (0,)}, "namespace.*shape.*payload_len"),
        ({"dtype": "made-up"}, "dtype 'made-up' != 'uint8'"),
        ({"num_tokens": 7}, "num_tokens 7 != 128"),
        ({"shape": (2, 32 * 1024)}, "shape"),
        ({"payload_len": 10, "shape": (10,)}, "payload_len 10"),
    ],
)
def test_self_consistent_chunk_of_another_spec_is_rejected(
    changes: dict[str, Any], named: str
) -> None:
    key = make_key(1)
    meta = replace(meta_for(key), **changes)
    head = encode_header(meta, payload_for(key, meta.payload_len))
    decode_header(head, expect_key=key)  # consistent in itself...
    with pytest.raises(CorruptObject, match=named):
        decode_header(head, expect_key=key, expect=SPEC)  # ...but not what we expect
    with pytest.raises(CorruptObject, match=named):
        SPEC.check(meta)


def test_spec_mismatch_names_nothing_when_it_matches() -> None:
    assert spec_for(10).mismatch(meta_for(make_key(1), 10)) is None
    assert isinstance(spec_for(10), ChunkSpec)
