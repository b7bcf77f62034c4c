"""What the contract suite needs to know about one tier kind, and shared test data."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from kvtier.clock import ManualClock
from kvtier.keys import ChunkKey, Namespace
from kvtier.objformat import HEADER_SPAN, ChunkMeta
from kvtier.tiers.base import Tier

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


#: How a test damages a stored object: (tier, key, kind) with kind one of
#: "flip" (one payload byte), "truncate", "empty", "foreign" (another key's object).
Corruptor = Callable[[Tier, ChunkKey, str], None]


@dataclass
class TierHarness:
    kind: str
    make: Callable[[int], Tier]  # capacity in bytes -> a fresh, empty tier
    clock: ManualClock
    corrupt: Corruptor | None  # None: the tier holds no bytes outside this process

    @staticmethod
    def object_bytes(n: int = PAYLOAD) -> int:
        """Bytes one object of an ``n``-byte payload takes against capacity."""
        return HEADER_SPAN + n
