"""Block gather/scatter between a paged KV cache and contiguous chunks, and pinned memory.

Public API::

    layout = layout_from_backend(backend_cls, num_blocks, block_size, num_kv_heads,
                                 head_size, dtype=dtype)
    views = [layout.block_view(t) for t in kv_caches]        # (outer, num_blocks, inner)
    buf, pinned = alloc_pinned(layout.chunk_bytes(len(views), blocks_per_chunk))
    gather_blocks(views, block_ids, buf).wait()              # cache -> chunk
    scatter_blocks(buf, views, block_ids).wait()             # chunk -> cache

``block_ids`` is an int64 CPU tensor; the chunk is a contiguous uint8 tensor of exactly
``chunk_bytes`` bytes (layout: ``kvtier/ops/layout.py``). The module-level functions use
``default_backend()`` (``copy_backend: auto``); ``resolve_copy_backend`` picks one
explicitly. Importing this package does not load the native extension.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvtier.ops.backend import (
    DEFAULT_CUDA_STRATEGY,
    CopyBackend,
    CopyHandle,
    CopyMode,
    CudaStrategy,
    NativeUnavailableError,
    PinnedAlloc,
    default_backend,
    resolve_copy_backend,
)
from kvtier.ops.layout import KVLayout, cross_layer_view, layout_from_backend
from kvtier.ops.native import NativeBrokenError, NativeStatus, native_status


def gather_blocks(
    layers: Sequence[torch.Tensor], block_ids: torch.Tensor, dst: torch.Tensor
) -> CopyHandle:
    """Copies ``block_ids`` of every layer block view into the chunk ``dst``."""
    return default_backend().gather(layers, block_ids, dst)


def scatter_blocks(
    src: torch.Tensor, layers: Sequence[torch.Tensor], block_ids: torch.Tensor
) -> CopyHandle:
    """Writes the chunk ``src`` into ``block_ids`` of every layer block view."""
    return default_backend().scatter(src, layers, block_ids)


def alloc_pinned(nbytes: int, *, hint: str | None = None) -> PinnedAlloc:
    """``(tensor, is_pinned)``: page-aligned, pre-touched uint8 host memory."""
    return default_backend().alloc_pinned(nbytes, hint=hint)


__all__ = [
    "DEFAULT_CUDA_STRATEGY",
    "CopyBackend",
    "CopyHandle",
    "CopyMode",
    "CudaStrategy",
    "KVLayout",
    "NativeBrokenError",
    "NativeStatus",
    "NativeUnavailableError",
    "PinnedAlloc",
    "alloc_pinned",
    "cross_layer_view",
    "default_backend",
    "gather_blocks",
    "layout_from_backend",
    "native_status",
    "resolve_copy_backend",
    "scatter_blocks",
]
