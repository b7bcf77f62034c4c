"""KV geometry and namespace of a vLLM engine, as both connector sides see it.

The scheduler derives the chunk size from ``KVCacheConfig`` (page bytes x layers x blocks
per chunk); the worker derives it from the KV tensors it registers. They must agree, and
the shared pool's size is the check. ``geometry_from_kv_cache_config`` holds the rules of
which KV-cache specs kvtier stores (full attention, sliding window, dense MLA, hybrid
groups of those) and how TP and MLA shape a chunk.

The namespace (``namespace_for``) is every setting that changes the bytes of a stored
chunk; ``docs/architecture.md`` ("Keys") lists each with the vLLM setting it comes from.
Two of its inputs only the worker can see (``kvtier.vllm.physical``: the physical layout
and the k/v scales); the model's identity is ``kvtier.vllm.fingerprint``. Both are
re-exported here, where callers have always imported them.

Reads files only at engine start (fingerprint) and never on a request's path.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvtier.keys import Namespace
from kvtier.tiers.base import TierError
from kvtier.vllm.fingerprint import model_fingerprint, resolve_revision
from kvtier.vllm.physical import (
    PhysicalKV,
    check_kv_scales_config,
    describe_layout,
    kv_scales_digest,
)

__all__ = [
    "Geometry",
    "GroupShape",
    "PhysicalKV",
    "check_kv_scales_config",
    "describe_layout",
    "geometry_from_kv_cache_config",
    "kv_scales_digest",
    "model_fingerprint",
    "namespace_for",
    "resolve_revision",
    "tp_placement",
]



@dataclass(frozen=True)
class GroupShape:
    """One KV-cache group of a hybrid model: its layer count and what it keeps of a
    request: its last ``window`` tokens (sliding-window attention), or the tokens of its
    current ``chunk``-token attention chunk (chunked-local attention: Llama-4's RoPE
    layers); neither (both 0): everything, full attention."""

    layers: int
    window: int = 0
    chunk: int = 0

    @property
    def local(self) -> bool:
        """Whether vLLM keeps only a local part of a request's KV for this group (and
        pads the rest with its null block): sliding-window or chunked-local attention."""
        return bool(self.window or self.chunk)

    @property
    def kind(self) -> str:
        """The group's kind for the namespace."""
        if self.window:
            return f"sliding_window:{self.window}"
        return f"chunked_local:{self.chunk}" if self.chunk else "full"


@dataclass(frozen=True)
class Geometry:
    num_layers: int
    num_kv_heads: int
    head_size: int
    block_size: int
    page_bytes: int  # one block of one layer, on one TP rank
    kv_dtype: str
    #: TP ranks of the engine; unless ``replicated``, a chunk holds every rank's bytes,
    #: one after the other (rank 0 first), and each rank has ``num_kv_heads`` of the
    #: model's heads
    tp_world: int = 1
    #: every rank holds the same KV (MLA's latent): a chunk is one copy, written by rank 0
    #: and read by every rank, so it does not depend on the TP size
    replicated: bool = False
    #: V's head size when it is not ``head_size`` (0 for MLA: the latent has no V)
    head_size_v: int | None = None
    #: sliding-window attention in every layer (one ``SlidingWindowSpec`` group): vLLM
    #: keeps KV for a request's last ``window`` tokens (its ``sliding_window`` plus
    #: ``extra_retained_tokens``) and has swapped every block wholly before them for its
    #: null block; 0 for full attention and MLA
    window: int = 0
    #: a hybrid model's KV-cache groups (vLLM's hybrid KV-cache manager: each group has
    #: its own block table; ``kvtier/vllm/hybrid.py``), in vLLM's group order; empty for
    #: a single group. ``num_layers`` is then the largest group's (a host slot's size)
    groups: tuple[GroupShape, ...] = ()
    #: digest of which layers are in which group (hybrid only; part of the namespace)
    group_layers: str = ""

    @property
    def window_blocks(self) -> int:
        """Blocks a hit ending on a block boundary needs (vLLM's null block pads those
        before them): ``cdiv(window - 1, block_size)``, 0 without a window."""
        return self.blocks_for_window(self.window)

    def blocks_for_window(self, window: int) -> int:
        """``cdiv(window - 1, block_size)``: the blocks before a hit that a ``window``
        -token sliding window reads; 0 for full attention (``window`` 0)."""
        return -(-(window - 1) // self.block_size) if window else 0

    def local_blocks(self, group: int, end_block: int) -> int:
        """The blocks before block ``end_block`` that hybrid group ``group`` keeps for a
        request whose next token is the first of that block: all ``end_block`` of them
        (full attention), the window's ``blocks_for_window`` (sliding window), or those
        from the start of the attention chunk holding the next token (chunked-local, as
        vLLM's ``ChunkedLocalAttentionManager`` computes it; none on a chunk boundary)."""
        shape = self.groups[group]
        if shape.window:
            return min(end_block, self.blocks_for_window(shape.window))
        if shape.chunk:
            start = end_block * self.block_size // shape.chunk * shape.chunk
            return end_block - start // self.block_size
        return end_block

    @property
    def attention(self) -> str:
        """What of a request's KV is kept, for the namespace: "" (full attention, one
        group), ``sliding_window:W``, or a hybrid model's groups (each group's kind and
        layer count, and the digest of its layers' names)."""
        if self.groups:
            kinds = ",".join(f"{g.kind}x{g.layers}" for g in self.groups)
            return f"hybrid:{kinds};layers={self.group_layers}"
        return f"sliding_window:{self.window}" if self.window else ""

    @property
    def slot_ranks(self) -> int:
        """How many ranks' parts a chunk (a host slot, an object) holds."""
        return 1 if self.replicated else self.tp_world

    def blocks_per_chunk(self, chunk_tokens: int) -> int:
        if chunk_tokens % self.block_size:
            raise TierError(
                f"chunk_tokens: {chunk_tokens} is not a multiple of vLLM's block size "
                f"{self.block_size}; use a multiple such as {self.block_size * 2}"
            )
        return chunk_tokens // self.block_size

    def rank_chunk_bytes(self, chunk_tokens: int) -> int:
        """One TP rank's part of a chunk: what one worker copies (of a hybrid model, the
        largest group's part: a host slot holds one group's chunk)."""
        return self.num_layers * self.page_bytes * self.blocks_per_chunk(chunk_tokens)

    def group_layer_count(self, group: int) -> int:
        """Layers of KV-cache group ``group`` (every layer with one group)."""
        return self.groups[group].layers if self.groups else self.num_layers

    def chunk_bytes(self, chunk_tokens: int) -> int:
        """A whole chunk, every rank's part: a host slot, one object in every tier."""
        return self.slot_ranks * self.rank_chunk_bytes(chunk_tokens)


def geometry_from_kv_cache_config(kv_cache_config: Any, tp_world: int = 1,
                                  model: str = "this model") -> Geometry:
    """The geometry of a single-group ``KVCacheConfig`` of full attention (this rank's
    heads; ``tp_world`` ranks of them make a chunk), dense MLA (one latent per token,
    the same on every rank: ``replicated``) or sliding-window attention in every layer
    (``window``: kvtier stores only the blocks a hit needs, see ``docs/architecture.md``).
    ``TierError`` naming the model's shape and what to do for any other: kvtier knows
    which blocks of these layers hold a prefix; for other specs (chunked-local attention,
    Mamba state) it would store or restore the wrong bytes."""
    groups = kv_cache_config.kv_cache_groups
    if not groups:
        raise TierError(f"kvtier: {model} keeps no KV cache (attention-free); run it "
                        "without kvtier")
    if len(groups) > 1:
        return _hybrid_geometry(groups, tp_world, model)
    spec = groups[0].kv_cache_spec
    kind = type(spec).__name__
    window = 0
    if kind == "MLAAttentionSpec":
        _check_mla(spec)
    elif kind == "SlidingWindowSpec":
        window = _window_tokens(spec)
    elif kind != "FullAttentionSpec":
        raise TierError(_SPEC_REFUSED.get(kind, _SPEC_OTHER).format(kind=kind))
    for attr in ("num_kv_heads", "head_size", "block_size", "page_size_bytes", "dtype"):
        if not hasattr(spec, attr):
            raise TierError(f"kvtier cannot store KV of {kind} layers (no {attr})")
    return Geometry(
        num_layers=len(groups[0].layer_names),
        **_page_fields(spec),
        tp_world=tp_world,
        replicated=kind == "MLAAttentionSpec",
        window=window,
    )


def _window_tokens(spec: Any) -> int:
    """The tokens a ``SlidingWindowSpec`` group keeps of a request: its window plus
    vLLM's ``extra_retained_tokens``."""
    return int(spec.sliding_window) + int(getattr(spec, "extra_retained_tokens", 0))


def _page_fields(spec: Any) -> dict[str, Any]:
    """The ``Geometry`` fields a KV-cache spec gives for each of its layers' blocks."""
    return {
        "num_kv_heads": int(spec.num_kv_heads),
        "head_size": int(spec.head_size),
        "block_size": int(spec.block_size),
        "page_bytes": int(spec.page_size_bytes),
        "kv_dtype": str(spec.dtype).removeprefix("torch."),
        "head_size_v": _head_size_v(spec),
    }


def _hybrid_geometry(groups: Sequence[Any], tp_world: int, model: str) -> Geometry:
    """A hybrid model's geometry: every group full, sliding-window or chunked-local
    attention, with one block size and one page shape (what vLLM's hybrid manager makes
    of Gemma-2/3, gpt-oss, Cohere2, Mistral-style interleaved windows, and of Llama-4
    when ``VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE`` lets it keep chunked-local
    groups). Anything else is refused, naming the model and the group kind:
    Mamba/linear-attention state and MLA groups are stored per request, not per prefix
    block, or laid out otherwise."""
    shapes: list[GroupShape] = []
    first = groups[0].kv_cache_spec
    names = hashlib.blake2b(digest_size=8)
    for i, g in enumerate(groups):
        spec = g.kv_cache_spec
        kind = type(spec).__name__
        if kind not in ("FullAttentionSpec", "SlidingWindowSpec", "ChunkedLocalAttentionSpec"):
            raise TierError(
                f"kvtier cannot store the KV of {model}: its KV-cache group {i} is {kind} "
                f"({_HYBRID_WHY.get(kind, 'a kind of state kvtier does not know the blocks of')}"
                "). kvtier stores hybrid models whose groups are full, sliding-window and "
                "chunked-local attention. Run this model without kvtier"
            )
        mine, base = _page_fields(spec), _page_fields(first)
        for attr, value in mine.items():
            if value != base[attr]:
                raise TierError(
                    f"kvtier cannot store the KV of {model}: its KV-cache groups differ in "
                    f"{attr} ({base[attr]} vs {value} in group {i}); run it without kvtier"
                )
        window = chunk = 0
        if kind == "SlidingWindowSpec":
            window = _window_tokens(spec)
        elif kind == "ChunkedLocalAttentionSpec":
            chunk = int(spec.attention_chunk_size)
        shapes.append(GroupShape(len(g.layer_names), window, chunk))
        joined = "|".join(g.layer_names).encode()
        names.update(len(joined).to_bytes(8, "little") + joined)
    return Geometry(
        num_layers=max(s.layers for s in shapes),
        **_page_fields(first),
        tp_world=tp_world,
        groups=tuple(shapes),
        group_layers=names.hexdigest(),
    )


_HYBRID_WHY = {
    "MambaSpec": "Mamba/linear-attention state: one state per request, not a KV block per "
                 "prefix position",
    "MLAAttentionSpec": "MLA in a hybrid model",
}


def _head_size_v(spec: Any) -> int | None:
    v = getattr(spec, "head_size_v", None)
    return None if v is None or int(v) == int(spec.head_size) else int(v)


def _check_mla(spec: Any) -> None:
    """Dense MLA (DeepSeek-V2/V3's latent cache, every token's latent in its block) is
    stored like full attention, one copy for all ranks. Sparse and padded variants
    (DeepSeek-V3.2/V4: an indexer cache, aligned or compressed states) lay blocks out
    otherwise and are refused."""
    odd = {name: getattr(spec, name, None) for name in ("alignment", "model_version")}
    odd = {k: v for k, v in odd.items() if v is not None}
    if getattr(spec, "is_index_group_leader", False):
        odd["is_index_group_leader"] = True
    if odd:
        raise TierError(
            f"kvtier supports dense MLA caches (DeepSeek-V2/V3); this model's MLA cache has "
            f"{odd} (a sparse or padded variant, e.g. DeepSeek-V3.2/V4). Run it without kvtier"
        )


_SPEC_OTHER = (
    "kvtier supports full-attention KV caches (FullAttentionSpec); this model's KV cache "
    "is {kind}, whose blocks kvtier would store or restore wrongly. Run it without kvtier"
)
_SPEC_REFUSED = {
    "ChunkedLocalAttentionSpec": (
        "kvtier does not support a model whose layers are all chunked-local attention "
        "({kind}): out-of-chunk blocks are vLLM's null block. Run it without kvtier"
    ),
}


def tp_placement(vllm_config: Any) -> tuple[int, int]:
    """``(tp_rank, tp_world_size)`` of this process; both sides derive the pool name from it."""
    pc = vllm_config.parallel_config
    world = int(pc.tensor_parallel_size)
    return int(getattr(pc, "rank", 0)) % max(1, world), world


def namespace_for(
    vllm_config: Any,
    geometry: Geometry,
    chunk_tokens: int,
    *,
    physical: PhysicalKV,
    fingerprint: str | None = None,
) -> Namespace:
    """The engine's namespace: the model, how its KV is computed and stored, and what
    the worker published (``physical``). ``fingerprint`` overrides ``model_fingerprint``."""
    mc = vllm_config.model_config
    load_config = getattr(vllm_config, "load_config", None)
    tp_rank, tp_world = tp_placement(vllm_config)
    if geometry.replicated:  # one copy, whatever the TP size: shared across TP sizes
        tp_rank, tp_world = 0, 1
    quant = getattr(mc, "quantization", None)
    dtype = getattr(mc, "dtype", None)
    return Namespace(
        model=str(mc.model),
        model_fingerprint=fingerprint or model_fingerprint(mc, load_config),
        kv_dtype=geometry.kv_dtype,
        kv_layout=physical.kv_layout,
        num_layers=geometry.num_layers,
        num_kv_heads=geometry.num_kv_heads,
        head_size=geometry.head_size,
        chunk_tokens=chunk_tokens,
        block_size=geometry.block_size,
        tp_rank=tp_rank,
        tp_world_size=tp_world,
        kv_cache_dtype=physical.kv_cache_dtype,
        kv_scales=physical.kv_scales,
        quantization="" if quant is None else str(quant),
        revision=resolve_revision(mc, load_config)[0],
        model_dtype="" if dtype is None else str(dtype).removeprefix("torch."),
        attention=geometry.attention,
    )
