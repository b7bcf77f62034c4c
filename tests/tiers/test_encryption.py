"""KV encrypted at rest (``kvtier.crypt``, issue 47 item 2), on a real file tier and on S3
(moto): sealed on write, opened on read; a changed, moved or planted object is never
served; one another configuration can read is refused but left in place."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvtier.build import build_lower_tiers, cipher_of
from kvtier.config import KVTierConfig
from kvtier.crypt import ChunkCipher, KeyError_, load_master_keys
from kvtier.objformat import HEADER_SPAN, SEALED_VERSION, decode_sealed_header, encode_header
from kvtier.tiers.file import FileTier
from tests.tiers.harness import PAYLOAD, TierHarness, make_key, meta_for, payload_for

K1, K2 = bytes(range(32)), bytes(range(1, 33))


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "store"


def _tier(root: Path, *keys: bytes) -> FileTier:
    t = FileTier(root, 1 << 30)
    t.cipher = ChunkCipher(list(keys)) if keys else None
    return t


@pytest.fixture
def sealed(root: Path) -> Iterator[FileTier]:
    t = _tier(root, K1)
    yield t
    t.close()


def _get(tier: FileTier, i: int) -> np.ndarray | None:
    buf = np.full(PAYLOAD, 0xAB, dtype=np.uint8)
    return buf if tier.get_into(make_key(i), buf.data) is not None else None


def _put(tier: FileTier, i: int, namespace: bytes | None = None) -> None:
    key = make_key(i)
    meta = meta_for(key) if namespace is None else meta_for(key, namespace=namespace)
    assert tier.put(meta, payload_for(key).data).name == "STORED"


def test_a_sealed_object_holds_no_plaintext_and_reads_back_exactly(sealed: FileTier) -> None:
    _put(sealed, 1)
    raw = sealed.path_of(make_key(1)).read_bytes()
    plain = payload_for(make_key(1)).tobytes()
    assert plain[:256] not in raw and raw[HEADER_SPAN:] != plain
    _meta, _csum, seal = decode_sealed_header(raw[:HEADER_SPAN], object_len=len(raw))
    assert seal is not None and raw[6:8] == SEALED_VERSION.to_bytes(2, "little")
    got = _get(sealed, 1)
    assert got is not None
    np.testing.assert_array_equal(got, payload_for(make_key(1)))


def test_a_changed_byte_is_a_counted_corruption_and_the_object_goes(sealed: FileTier) -> None:
    _put(sealed, 2)
    path = sealed.path_of(make_key(2))
    raw = bytearray(path.read_bytes())
    raw[HEADER_SPAN + 100] ^= 1
    # and fix the checksum up, as a writer who knows the format but not the key would
    meta, _, seal = decode_sealed_header(bytes(raw[:HEADER_SPAN]))
    raw[:HEADER_SPAN] = encode_header(meta, memoryview(raw)[HEADER_SPAN:], seal)
    path.write_bytes(bytes(raw))
    before = sealed.metrics.counts.corruptions  # type: ignore[attr-defined]
    assert _get(sealed, 2) is None
    assert sealed.metrics.counts.corruptions == before + 1  # type: ignore[attr-defined]
    assert not path.exists()  # damage is removed


def test_an_object_moved_to_another_key_is_never_served(sealed: FileTier) -> None:
    _put(sealed, 3)
    src = sealed.path_of(make_key(3)).read_bytes()
    meta, _, seal = decode_sealed_header(src[:HEADER_SPAN])
    # claim to be chunk 4: a consistent header, checksum and all, but the tag binds the key
    forged = dataclasses.replace(meta, key=make_key(4))
    body = memoryview(src)[HEADER_SPAN:]
    dst = sealed.path_of(make_key(4))
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.write_bytes(encode_header(forged, body, seal) + bytes(body))
    assert _get(sealed, 4) is None
    assert _get(sealed, 3) is not None


def test_a_planted_plaintext_object_is_refused_and_left(root: Path, sealed: FileTier) -> None:
    plain = _tier(root)  # a writer without the key
    try:
        _put(plain, 5)
        assert _get(sealed, 5) is None  # never served where encryption is on
        assert plain.path_of(make_key(5)).exists()  # not damage: another configuration's
        _put(sealed, 6)
        assert _get(plain, 6) is None  # ciphertext is never taken for KV
        assert sealed.path_of(make_key(6)).exists()
    finally:
        plain.close()


def test_another_key_is_refused_and_a_rotation_reads_both(root: Path, sealed: FileTier) -> None:
    _put(sealed, 7)
    other, rotated = _tier(root, K2), _tier(root, K2, K1)
    try:
        assert _get(other, 7) is None and other.path_of(make_key(7)).exists()
        assert _get(rotated, 7) is not None  # the old key still opens
        _put(rotated, 8)  # sealed under K2, the first
        assert _get(sealed, 8) is None and _get(other, 8) is not None
    finally:
        other.close()
        rotated.close()


def test_each_namespace_has_its_own_data_key() -> None:
    c = ChunkCipher([K1])
    a, b = c._data_key(c.kid, b"tenant-a"), c._data_key(c.kid, b"tenant-b")
    assert a != b and len(a) == 32 and a != K1
    meta = meta_for(make_key(9), namespace=b"tenant-a")
    ct, seal = c.seal(meta, payload_for(make_key(9)).data)
    out = bytearray(PAYLOAD)
    c.open_into(meta, seal, memoryview(ct), memoryview(out))
    assert bytes(out) == payload_for(make_key(9)).tobytes()
    with pytest.raises(Exception, match="tag"):  # the same bytes under another namespace
        c.open_into(dataclasses.replace(meta, namespace=b"tenant-b"), seal, memoryview(ct),
                    memoryview(bytearray(PAYLOAD)))


def test_keys_come_from_a_file_or_the_environment(tmp_path: Path) -> None:
    f = tmp_path / "key"
    f.write_text("# current first\n" + K2.hex() + "\n" + K1.hex() + "\n")
    assert load_master_keys(f) == [K2, K1]
    assert load_master_keys(None, {"KVTIER_ENCRYPTION_KEY": K1.hex()}) == [K1]
    f.write_text("not hex\n")
    with pytest.raises(KeyError_, match="64 hex characters"):
        load_master_keys(f)
    with pytest.raises(ValueError, match="needs a master key"):
        KVTierConfig.model_validate({"tiers": [{"host": {"capacity": "8MiB"}}],
                                     "encryption": {"enabled": True}})


def test_the_config_seals_every_lower_tier(tmp_path: Path) -> None:
    key = tmp_path / "key"
    key.write_text(K1.hex() + "\n")
    cfg = KVTierConfig.model_validate({
        "tiers": [{"host": {"capacity": "8MiB"}},
                  {"file": {"path": str(tmp_path / "t"), "capacity": "1GiB"}}],
        "encryption": {"enabled": True, "key_file": str(key)}})
    assert cipher_of(cfg) is not None
    (lt,) = build_lower_tiers(cfg)
    try:
        assert getattr(lt.tier, "cipher", None) is not None
    finally:
        lt.tier.close()


def test_every_shared_tier_seals_and_refuses_tampering(harness: TierHarness) -> None:
    tier = harness.make(10 * harness.object_bytes())
    if not hasattr(tier, "cipher"):
        pytest.skip(f"the {harness.kind} tier keeps no bytes outside this process")
    tier.cipher = ChunkCipher([K1])
    key = make_key(11)
    assert tier.put(meta_for(key), payload_for(key).data).name == "STORED"
    buf = np.zeros(PAYLOAD, dtype=np.uint8)
    assert tier.get_into(key, buf.data) is not None
    np.testing.assert_array_equal(buf, payload_for(key))
    tier.cipher = ChunkCipher([K2])  # as a node with another key sees it
    assert tier.get_into(key, buf.data) is None
