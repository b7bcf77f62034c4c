"""KV geometry and namespace of a vLLM engine, as both connector sides see it.

The scheduler derives the chunk size from ``KVCacheConfig`` (page bytes x layers x blocks
per chunk); the worker derives it from the KV tensors it registers. They must agree, and
the shared pool's size is the check.

The namespace fingerprints the model by its name, its HF config and a sample of its
weight files (size plus the first and last MiB of each), so two different checkpoints
under one name never share KV, without hashing gigabytes at start.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtier.keys import Namespace
from kvtier.tiers.base import TierError

_SAMPLE = 1 << 20


@dataclass(frozen=True)
class Geometry:
    num_layers: int
    num_kv_heads: int
    head_size: int
    block_size: int
    page_bytes: int  # one block of one layer
    kv_dtype: str

    def blocks_per_chunk(self, chunk_tokens: int) -> int:
        if chunk_tokens % self.block_size:
            raise TierError(
                f"chunk_tokens: {chunk_tokens} is not a multiple of vLLM's block size "
                f"{self.block_size}; use a multiple such as {self.block_size * 2}"
            )
        return chunk_tokens // self.block_size

    def chunk_bytes(self, chunk_tokens: int) -> int:
        return self.num_layers * self.page_bytes * self.blocks_per_chunk(chunk_tokens)


def geometry_from_kv_cache_config(kv_cache_config: Any) -> Geometry:
    """The geometry of a single-group, full-attention ``KVCacheConfig``."""
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise TierError(
            f"kvtier supports models with one KV cache group (full attention); this model "
            f"has {len(groups)} (hybrid or sliding-window layers)"
        )
    spec = groups[0].kv_cache_spec
    for attr in ("num_kv_heads", "head_size", "block_size", "page_size_bytes", "dtype"):
        if not hasattr(spec, attr):
            raise TierError(f"kvtier cannot store KV of {type(spec).__name__} layers")
    return Geometry(
        num_layers=len(groups[0].layer_names),
        num_kv_heads=int(spec.num_kv_heads),
        head_size=int(spec.head_size),
        block_size=int(spec.block_size),
        page_bytes=int(spec.page_size_bytes),
        kv_dtype=str(spec.dtype).removeprefix("torch."),
    )


def _weights_sample_digest(model_dir: Path) -> str:
    h = hashlib.blake2b(digest_size=16)
    files = sorted(model_dir.glob("*.safetensors")) + sorted(model_dir.glob("*.bin"))
    for f in files:
        size = f.stat().st_size
        h.update(f.name.encode() + size.to_bytes(8, "little"))
        with open(f, "rb") as fh:
            h.update(fh.read(_SAMPLE))
            if size > 2 * _SAMPLE:
                fh.seek(size - _SAMPLE)
                h.update(fh.read(_SAMPLE))
    return h.hexdigest()


def model_fingerprint(model_config: Any) -> str:
    """A digest of the model's identity: HF config plus a sample of its weights."""
    h = hashlib.blake2b(digest_size=16)
    hf = getattr(model_config, "hf_config", None)
    if hf is not None and hasattr(hf, "to_dict"):
        h.update(json.dumps(hf.to_dict(), sort_keys=True, default=str).encode())
    h.update(str(getattr(model_config, "revision", None)).encode())
    path = Path(str(model_config.model))
    if path.is_dir():
        h.update(_weights_sample_digest(path).encode())
    return h.hexdigest()


def namespace_for(
    vllm_config: Any,
    kv_cache_config: Any,
    geometry: Geometry,
    chunk_tokens: int,
    fingerprint: str | None,
) -> Namespace:
    pc = vllm_config.parallel_config
    layout = getattr(kv_cache_config, "kv_cache_layout", None) or "backend-default"
    return Namespace(
        model=str(vllm_config.model_config.model),
        model_fingerprint=fingerprint or model_fingerprint(vllm_config.model_config),
        kv_dtype=geometry.kv_dtype,
        kv_layout=str(layout),
        num_layers=geometry.num_layers,
        num_kv_heads=geometry.num_kv_heads,
        head_size=geometry.head_size,
        chunk_tokens=chunk_tokens,
        block_size=geometry.block_size,
        tp_rank=int(getattr(pc, "rank", 0)) % max(1, int(pc.tensor_parallel_size)),
        tp_world_size=int(pc.tensor_parallel_size),
    )
