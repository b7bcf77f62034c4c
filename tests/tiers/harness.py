"""What the contract suite needs to know about one tier kind, and shared test data."""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import numpy as np

from kvtier.clock import ManualClock
from kvtier.keys import ChunkKey, Namespace
from kvtier.objformat import HEADER_SPAN, MAGIC, OBJECT_VERSION, ChunkMeta, ChunkSpec
from kvtier.tiers.base import Tier
from kvtier.tiers.host import HostTier

PAYLOAD = 64 * 1024
NS = Namespace(
    model="test-model",
    model_fingerprint="0" * 16,
    kv_dtype="float32",
    kv_layout="NHD",
    num_layers=2,
    num_kv_heads=2,
    head_size=64,
    chunk_tokens=128,
    block_size=128,
)
NS_DIGEST = NS.digest()


def make_key(i: int) -> ChunkKey:
    return ChunkKey(i.to_bytes(4, "big") + bytes(12))


def payload_for(key: ChunkKey, n: int = PAYLOAD) -> np.ndarray:
    """Deterministic bytes that differ for every key."""
    rng = np.random.default_rng(int.from_bytes(key, "big") % 2**63)
    return rng.integers(0, 256, n, dtype=np.uint8)


def meta_for(key: ChunkKey, n: int = PAYLOAD, *, namespace: bytes = NS_DIGEST) -> ChunkMeta:
    return ChunkMeta(
        namespace=namespace,
        key=key,
        parent=None,
        num_tokens=128,
        dtype="uint8",
        shape=(n,),
        payload_len=n,
    )


def spec_for(n: int = PAYLOAD) -> ChunkSpec:
    """What a reader of ``meta_for(key, n)`` chunks expects."""
    return ChunkSpec(NS_DIGEST, 128, "uint8", (n,), n)


SPEC = spec_for()


def raw_object(wire: Any, payload: bytes = b"", *, version: int = OBJECT_VERSION) -> bytes:
    """An object with any msgpack-able ``wire`` header, valid or not, padded to the span
    as a writer would (longer headers are left unpadded)."""
    body: bytes = msgpack.packb(wire, use_bin_type=True)
    head = struct.pack("<6sHI", MAGIC, version, len(body)) + body
    return head + bytes(max(0, HEADER_SPAN - len(head))) + payload


def drain_host(host: HostTier) -> None:
    """Remove every chunk from ``host``, asserting that no slot is still held (holds
    back at zero), being written or dirty: what a leak-free load leaves behind."""
    assert host.index.clean_or_free() == host.index.num_slots, "a slot is WRITING or dirty"
    for _, meta in host.index.entries():
        assert host.index.delete(meta.key), f"chunk {meta.key.hex()} is still held"
    assert len(host.index) == 0


#: How a test damages a stored object: (tier, key, kind) with kind one of
#: "flip" (one payload byte), "truncate", "empty", "foreign" (another key's object).
Corruptor = Callable[[Tier, ChunkKey, str], None]


@dataclass
class TierHarness:
    kind: str
    make: Callable[[int], Tier]  # capacity in bytes -> a fresh, empty tier
    clock: ManualClock
    corrupt: Corruptor | None  # None: the tier holds no bytes outside this process
    #: A directory tier's root as another node sees it (CephFS: the second mount).
    other_node: Callable[[Path], Path] = lambda root: root

    @staticmethod
    def object_bytes(n: int = PAYLOAD) -> int:
        """Bytes one object of an ``n``-byte payload takes against capacity."""
        return HEADER_SPAN + n
