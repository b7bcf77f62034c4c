"""What only the worker sees of a vLLM engine's KV bytes, and publishes for the scheduler.

Two inputs of the namespace (``kvtier.vllm.geometry.namespace_for``) live in the
worker's attention layers: the physical KV layout (``describe_layout``) and the k/v
scales an fp8 cache is quantized with (``kv_scales_digest``). The worker publishes them
as a ``PhysicalKV`` next to the host pool (``kvtier.vllm.shm``), before vLLM builds the
scheduler, which reads them into its namespace. ``check_kv_scales_config`` refuses
scales computed at run time, which no other engine could reproduce.

Runs at engine start only (the worker's ``register_kv_caches``; the connector's
constructor), never on a request's path.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvtier.tiers.base import TierError

#: KV cache dtypes that store K and V as computed (no scales).
UNQUANTIZED_KV = frozenset({"auto", "float16", "bfloat16", "float32", "float", "half"})


@dataclass(frozen=True)
class PhysicalKV:
    """What only the worker sees of the KV bytes: it publishes this, the scheduler keys by it.

    ``kv_layout`` is ``describe_layout`` of the registered tensors, ``kv_cache_dtype``
    the cache dtype string the worker's layers were built with, ``kv_scales``
    ``kv_scales_digest`` of its attention layers.
    """

    kv_layout: str
    kv_cache_dtype: str
    kv_scales: str


def is_quantized_kv(cache_dtype: str) -> bool:
    return str(cache_dtype) not in UNQUANTIZED_KV


def check_kv_scales_config(cache_config: Any) -> None:
    """Refuse KV scales computed at run time: KV stored by one engine would be read back
    with another engine's scales (``TierError`` saying what to change)."""
    dtype = str(getattr(cache_config, "cache_dtype", "auto"))
    if getattr(cache_config, "calculate_kv_scales", False) and is_quantized_kv(dtype):
        raise TierError(_RUNTIME_SCALES.format(dtype=dtype))


_RUNTIME_SCALES = (
    "kvtier: kv_cache_dtype {dtype} with calculate_kv_scales computes the k/v scales from "
    "the first batch this engine sees, so KV stored under one engine's scales would be "
    "restored under another's (wrong attention). Drop --calculate-kv-scales (the scales "
    "then come from the checkpoint, or are 1.0), or use --kv-cache-dtype auto"
)


def _scale_bytes(layer: Any, name: str) -> bytes:
    tensor = getattr(layer, f"_{name}", None)
    if tensor is not None and hasattr(tensor, "detach"):
        return bytes(tensor.detach().float().cpu().contiguous().numpy().tobytes())
    value = float(getattr(layer, f"_{name}_float", 1.0))
    return value.hex().encode()


def kv_scales_digest(layers: Sequence[tuple[str, Any]], cache_dtype: str) -> str:
    """Digest of the k/v scales the attention ``layers`` (``(name, module)``, in KV-cache
    order) quantize with; ``""`` when the cache is not quantized (scales unused).

    Reads each layer's ``_k_scale``/``_v_scale`` (a tensor, per tensor or per head) after
    the weights are loaded, and the layer's own cache dtype (``kv_cache_dtype_skip_layers``
    leaves some layers unquantized). Raises ``TierError`` for a layer that computes its
    scales at run time (``calculate_kv_scales``).
    """
    dtypes = [str(getattr(m, "kv_cache_dtype", cache_dtype)) for _, m in layers]
    if not is_quantized_kv(cache_dtype) and not any(is_quantized_kv(d) for d in dtypes):
        return ""
    h = hashlib.blake2b(digest_size=16)
    for (name, layer), dtype in zip(layers, dtypes, strict=True):
        if getattr(layer, "calculate_kv_scales", False) and is_quantized_kv(dtype):
            raise TierError(_RUNTIME_SCALES.format(dtype=dtype))
        for part in (name.encode(), dtype.encode(), _scale_bytes(layer, "k_scale"),
                     _scale_bytes(layer, "v_scale")):
            h.update(len(part).to_bytes(8, "little") + part)
    return h.hexdigest()


def describe_layout(backend_cls: Any, layout_name: str | None, layout: Any) -> str:
    """The physical layout of the registered KV tensors as one string: the attention
    backend, vLLM's resolved ``KVCacheLayout`` name, and the per-layer shape (blocks as
    ``*``), stride order, block dim and dtype (a ``kvtier.ops.KVLayout``)."""
    get_name = getattr(backend_cls, "get_name", None)
    backend = str(get_name()) if callable(get_name) else str(backend_cls.__qualname__)
    shape = ",".join("*" if i == layout.block_dim else str(s) for i, s in enumerate(layout.shape))
    order = ",".join(str(d) for d in layout.stride_order)
    dtype = str(layout.dtype).removeprefix("torch.")
    return (f"{backend};layout={layout_name or 'backend-preferred'};shape={shape};"
            f"order={order};block_dim={layout.block_dim};dtype={dtype}")
