"""Chunk keys: chained, deterministic across processes, namespaced, hex-safe."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from kvtier.keys import chunk_keys, key_from_hex
from tests.tiers.harness import NS

TOKENS = list(range(1000))


def test_only_full_chunks_get_keys() -> None:
    assert len(chunk_keys(NS.digest(), TOKENS, 128)) == 7
    assert chunk_keys(NS.digest(), TOKENS[:127], 128) == []


def test_keys_are_chained_prefix_hashes() -> None:
    a = chunk_keys(NS.digest(), TOKENS, 128)
    b = chunk_keys(NS.digest(), [*TOKENS[:128], 7, *TOKENS[129:]], 128)
    assert a[0] == b[0]
    assert all(x != y for x, y in zip(a[1:], b[1:], strict=True)), "a change poisons the rest"


def test_extending_from_a_parent_matches_full_computation() -> None:
    full = chunk_keys(NS.digest(), TOKENS, 128)
    tail = chunk_keys(NS.digest(), TOKENS, 128, start_chunk=3, parent=full[2])
    assert tail == full[3:]


def test_keys_are_identical_in_another_process() -> None:
    code = (
        "from tests.test_keys import TOKENS; from tests.tiers.harness import NS;"
        "from kvtier.keys import chunk_keys;"
        "print(','.join(k.hex() for k in chunk_keys(NS.digest(), TOKENS, 128)))"
    )
    env = {"PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env={**__import__("os").environ, **env}).stdout.strip()
    assert out == ",".join(k.hex() for k in chunk_keys(NS.digest(), TOKENS, 128))


@pytest.mark.parametrize(
    "change",
    [
        {"model_fingerprint": "1" * 16},
        {"kv_dtype": "bfloat16"},
        {"kv_layout": "HND"},
        {"num_layers": 3},
        {"num_kv_heads": 4},
        {"head_size": 128},
        {"chunk_tokens": 256},
        {"block_size": 64},
        {"tp_rank": 1, "tp_world_size": 2},
        {"format_version": 99},
        {"kv_cache_dtype": "fp8_e5m2"},
        {"kv_scales": "ab" * 16},
        {"quantization": "fp8"},
        {"revision": "0" * 40},
        {"model_dtype": "float16"},
    ],
)
def test_every_namespace_field_changes_the_keys(change: dict[str, object]) -> None:
    other = dataclasses.replace(NS, **change)  # type: ignore[arg-type]
    assert other.digest() != NS.digest()


def test_cache_salt_isolates_requests() -> None:
    assert NS.digest("tenant-a") != NS.digest("tenant-b") != NS.digest()


def test_namespace_rejects_bad_geometry() -> None:
    with pytest.raises(ValueError, match="multiple of block_size"):
        dataclasses.replace(NS, chunk_tokens=100)
    with pytest.raises(ValueError, match="head_size must be > 0"):
        dataclasses.replace(NS, head_size=0)


def test_hex_keys_cannot_escape_a_directory() -> None:
    k = chunk_keys(NS.digest(), TOKENS, 128)[0]
    assert key_from_hex(k.hex()) == k
    for bad in ["../" + "0" * 29, "A" * 32, "0" * 31, "0" * 30 + "/x"]:
        with pytest.raises(ValueError):
            key_from_hex(bad)


def test_fp8_variants_with_one_torch_dtype_get_different_keys() -> None:
    """vLLM stores fp8_e4m3 and fp8_e5m2 both as uint8: ``kv_dtype`` alone is equal."""
    e4m3 = dataclasses.replace(NS, kv_dtype="uint8", kv_cache_dtype="fp8_e4m3")
    e5m2 = dataclasses.replace(NS, kv_dtype="uint8", kv_cache_dtype="fp8_e5m2")
    assert e4m3.digest() != e5m2.digest()
    assert e4m3.digest() == dataclasses.replace(e5m2, kv_cache_dtype="fp8_e4m3").digest()


def test_the_epoch_changes_the_keys_and_zero_is_no_epoch() -> None:
    assert chunk_keys(NS.digest(epoch=0), TOKENS, 128) == chunk_keys(NS.digest(), TOKENS, 128)
    assert NS.digest(epoch=1) != NS.digest() and NS.digest(epoch=1) != NS.digest(epoch=2)
    assert NS.digest("t", epoch=1) != NS.digest("t")
