"""The object format: self-describing, verified on every read, never pickle."""

from __future__ import annotations

import pytest

from kvtier.objformat import (
    HEADER_SPAN,
    CorruptObject,
    decode_header,
    encode_header,
    verify_payload,
)
from tests.tiers.harness import NS_DIGEST, make_key, meta_for, payload_for


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
