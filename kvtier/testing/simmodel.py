"""The simulated model of ``kvtier.testing.sim``: its KV-cache shapes, the vLLM configs
that describe it, and the KV bytes it "computes".

Every KV row a simulated token writes is a pure function of the token prefix that token
ends (``token_hashes``, ``expected_rows``), so the world can check any block against the
bytes of its own prefix. Pure functions and frozen data; any thread may call them.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

#: Layers per KV-cache group, heads per rank and head size of the simulated model: tiny,
#: so that a step costs microseconds of copying.
HEAD_SIZE = 8
HEADS = 2
LAYERS_PER_GROUP = 2
_MIX = np.uint64(0x9E3779B97F4A7C15)


@dataclass(frozen=True)
class Shape:
    """The model's KV-cache groups, in vLLM's order: ``"full"``, ``"window:W"`` (sliding
    window of W tokens), ``"chunked:A"`` (chunked-local attention of A tokens) or
    ``"mla"`` (one latent per token, the same on every TP rank)."""

    groups: tuple[str, ...] = ("full",)

    @property
    def name(self) -> str:
        return "+".join(self.groups)


SHAPES = {
    "full": Shape(("full",)),
    "window": Shape(("window:48",)),
    "hybrid": Shape(("window:48", "full")),
    "chunked": Shape(("chunked:64", "full")),
    "mla": Shape(("mla",)),
}


def token_hashes(tokens: Sequence[int], salt: bytes = b"",
                 after: int | None = None) -> np.ndarray:
    """``h[p]``: a 64-bit hash of ``salt`` and ``tokens[: p + 1]`` (what token ``p``'s KV
    depends on), for every position; ``after``: the hash of the positions before
    ``tokens`` (the chain goes on from it)."""
    h = (int.from_bytes(hashlib.blake2b(salt, digest_size=8).digest(), "little")
         if after is None else after)
    out = np.empty(len(tokens), dtype=np.uint64)
    mask = (1 << 64) - 1
    for p, t in enumerate(tokens):
        h = ((h ^ (int(t) + 0x100)) * 0x100000001B3 + (h >> 29)) & mask
        out[p] = h
    return out


def expected_rows(hashes: np.ndarray, layer: int, width: int) -> np.ndarray:
    """The KV row of each position for flat layer ``layer``: ``width`` float32 values,
    each an exact small integer derived from the position's prefix hash."""
    j = np.arange(1, width + 1, dtype=np.uint64)
    with np.errstate(over="ignore"):
        mixed = hashes[:, None] * (j[None, :] * _MIX) + np.uint64(layer * 7919 + 1)
    out: np.ndarray = ((mixed >> np.uint64(40)) & np.uint64(0xFFFF)).astype(np.float32)
    return out


def sampled_token(prefix_hash: int) -> int:
    """The token the simulated model samples after a prefix whose last position hashes
    to ``prefix_hash`` (greedy: a pure function of the prefix)."""
    return int(prefix_hash % 400) + 3


@dataclass
class SimRequest:
    """What the world knows of a request it added: its prefix salt (``cache_salt`` and
    LoRA change KV bytes, so they change the expected bytes too), its prompt, and its
    token hashes. Sampling is greedy and a pure function of the prefix, so the whole
    sequence (prompt, then every token the model will sample) is known from the prompt
    (``sequence``): the reference every output is compared with, and what the model
    runner computes on when vLLM's scheduler holds only placeholders for the tokens of
    steps still in flight (async scheduling)."""

    rid: str
    salt: bytes
    prompt: list[int] = field(default_factory=list)
    max_tokens: int = 0
    hashes: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.uint64))
    _seq: list[int] = field(default_factory=list)

    def sequence(self, n: int) -> list[int]:
        """The request's first ``n`` tokens: its prompt, then what the model samples."""
        if not self._seq:
            self._seq = list(self.prompt)
        while len(self._seq) < n:
            h = self.hashes_for(self._seq)
            self._seq.append(sampled_token(int(h[len(self._seq) - 1])))
        return self._seq[:n]

    def reference_output(self) -> list[int]:
        """The output of a recompute: ``max_tokens`` greedy tokens after the prompt."""
        return self.sequence(len(self.prompt) + self.max_tokens)[len(self.prompt):]

    def hashes_for(self, tokens: Sequence[int]) -> np.ndarray:
        """The hashes of at least ``tokens`` (the request's, which only grow), extended
        by the new positions only."""
        have = len(self.hashes)
        if have < len(tokens):
            more = token_hashes(tokens[have:], self.salt,
                                int(self.hashes[-1]) if have else None)
            self.hashes = np.concatenate([self.hashes, more])
        return self.hashes


def _window_of(kind: str) -> int:
    return int(kind.split(":")[1]) if ":" in kind else 0


def mla_backend() -> Any:
    """vLLM's CPU MLA attention backend (what an MLA group's layers report)."""
    from vllm.v1.attention.backends.mla.cpu_mla import CPUMLABackend  # type: ignore

    return CPUMLABackend


def vllm_config_for(root: Path, cfg_path: Path, shape: Shape, *, tp: int, num_blocks: int,
                 block_size: int, max_num_seqs: int, max_batched_tokens: int,
                 max_model_len: int, engine_id: str, async_scheduling: bool = False) -> Any:
    """The ``VllmConfig`` of a simulated engine: the tiny Llama (built under ``root``'s
    parent) as the model, prefix caching and chunked prefill on, kvtier configured by
    the file at ``cfg_path``. ``async_scheduling``: vLLM's GPU default (two batches in
    flight); the CPU platform turns it off while the config is built, so it is set on
    the built config, where the scheduler reads it (``max_concurrent_batches``: vLLM
    then defers the free of blocks a step in flight may still write)."""
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVTransferConfig,
        ModelConfig,
        ParallelConfig,
        SchedulerConfig,
        VllmConfig,
    )

    from kvtier.testing.models import build_tiny_llama
    from kvtier.vllm.settings import kv_transfer_config

    model = build_tiny_llama(root.parent / "sim-model", dtype="float32")
    mc = ModelConfig(model=str(model), dtype="float32", skip_tokenizer_init=True,
                     max_model_len=max_model_len, seed=0)
    cc = CacheConfig(block_size=block_size, enable_prefix_caching=True)
    cc.num_gpu_blocks = num_blocks
    sc = SchedulerConfig(max_model_len=max_model_len, is_encoder_decoder=False,
                         max_num_seqs=max_num_seqs,
                         max_num_batched_tokens=max_batched_tokens,
                         enable_chunked_prefill=True, async_scheduling=False)
    ktc = KVTransferConfig(**kv_transfer_config(
        cfg_path, model_fingerprint=f"sim-{shape.name}"), engine_id=engine_id)
    pc = ParallelConfig(tensor_parallel_size=tp)
    cfg = VllmConfig(model_config=mc, cache_config=cc, scheduler_config=sc,
                     kv_transfer_config=ktc, parallel_config=pc,
                     device_config=DeviceConfig("cpu"))
    cfg.scheduler_config.async_scheduling = async_scheduling
    return cfg


def kv_cache_config_for(shape: Shape, num_blocks: int, block_size: int, tp: int) -> Any:
    """The ``KVCacheConfig`` vLLM would build for ``shape``: one group per kind, of
    ``LAYERS_PER_GROUP`` layers each, every layer its own tensor."""
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        KVCacheTensor,
        MLAAttentionSpec,
        SlidingWindowSpec,
    )

    groups, tensors = [], []
    for g, kind in enumerate(shape.groups):
        names = [f"model.layers.{g * LAYERS_PER_GROUP + i}.self_attn.attn"
                 for i in range(LAYERS_PER_GROUP)]
        common: dict[str, Any] = dict(block_size=block_size, num_kv_heads=HEADS,
                                      head_size=HEAD_SIZE, dtype=torch.float32)
        spec: Any
        if kind == "full":
            spec = FullAttentionSpec(**common)
        elif kind.startswith("window:"):
            spec = SlidingWindowSpec(**common, sliding_window=_window_of(kind))
        elif kind.startswith("chunked:"):
            spec = ChunkedLocalAttentionSpec(**common, attention_chunk_size=_window_of(kind))
        elif kind == "mla":
            spec = MLAAttentionSpec(block_size=block_size, num_kv_heads=1,
                                    head_size=HEAD_SIZE * 2, dtype=torch.float32)
        else:
            raise ValueError(f"unknown group kind {kind!r}")
        groups.append(KVCacheGroupSpec(names, spec))
        for n in names:
            page = spec.page_size_bytes
            tensors.append(KVCacheTensor(size=page * num_blocks, layers=[n],
                                         layer_stride=page * num_blocks, block_stride=page))
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=tensors,
                         kv_cache_groups=groups)
