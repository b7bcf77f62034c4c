"""Where the blocks are in a paged KV tensor, and kvtier's chunk layout.

This docstring is the one definition of the chunk layout; ``native/copy_plan.h`` and
``kvtier/ops/reference.py`` implement it.

Block view
    Each per-layer KV tensor is seen, without a copy, as ``(outer, num_blocks, inner)``.
    The backend declares the tensor's logical shape and its stride order (logical dims,
    outermost in memory first); the block dim is located in that physical order, and

    * ``outer`` is the product of the dims physically before the block dim,
    * ``inner`` is the product of the dims after it: one contiguous run of elements.

    =====================================================  =====  ====================
    per-layer tensor                                       outer  inner
    =====================================================  =====  ====================
    vLLM CPU ``(num_blocks, heads, block_size, 2*hs)``     1      heads*block_size*2*hs
    flash-attn ``(2, num_blocks, block_size, heads, hs)``  2      block_size*heads*hs
    vLLM ``LHBNC`` layer view ``[B, H, N, C]``             H      N*C
    =====================================================  =====  ====================

    Blocks may be further apart than ``inner`` (layers interleaved per block, padded
    pages); the inner run itself must be dense, or ``KVLayout.block_view`` raises.

Chunk layout
    The chunk for ``layers`` and ``block_ids`` is, concatenated without padding::

        for layer in layers: for o in range(outer): for b in block_ids: inner bytes of b

    i.e. ``len(layers) * outer * len(block_ids) * inner * itemsize`` bytes
    (``KVLayout.chunk_bytes``). Scattering a chunk back restores the exact bytes.

Cross-layer layout
    When all layers share one allocation with blocks outermost and each block's layers
    adjacent (vLLM's ``BL...`` layouts), ``cross_layer_view`` returns one
    ``(1, num_blocks, num_layers * inner)`` view to pass as the single "layer". Its
    chunk is block-major (``for b: for layer: page``), so the bytes of a chunk depend on
    which view produced it: a stored chunk must only be restored through the same kind
    of view.

Invariants: ``KVLayout`` is immutable and validated at construction; ``block_view``
never copies (it returns a view of the same storage or raises ``ValueError``).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch


class HasStrideOrder(Protocol):
    """vLLM's ``KVCacheLayout``: a stride order over the logical ``[L, B, H, N, C]``."""

    @property
    def stride_order(self) -> tuple[int, ...]: ...


@dataclass(frozen=True)
class KVLayout:
    """Declared layout of one layer's KV tensor.

    ``shape`` is the logical per-layer shape, ``stride_order`` lists logical dims from
    outermost to innermost in memory (``tensor.permute(stride_order)`` is the physical
    order), ``block_dim`` is the logical index of the block dim.
    """

    shape: tuple[int, ...]
    stride_order: tuple[int, ...]
    block_dim: int
    dtype: torch.dtype

    def __post_init__(self) -> None:
        n = len(self.shape)
        if sorted(self.stride_order) != list(range(n)):
            raise ValueError(
                f"KVLayout.stride_order {self.stride_order} is not a permutation of the "
                f"{n} dims of shape {self.shape}"
            )
        if not 0 <= self.block_dim < n:
            raise ValueError(f"KVLayout.block_dim {self.block_dim} outside shape {self.shape}")
        if any(s <= 0 for s in self.shape):
            raise ValueError(f"KVLayout.shape {self.shape} has a non-positive dim")

    @property
    def physical_shape(self) -> tuple[int, ...]:
        return tuple(self.shape[d] for d in self.stride_order)

    @property
    def _block_pos(self) -> int:
        return self.stride_order.index(self.block_dim)

    @property
    def num_blocks(self) -> int:
        return self.shape[self.block_dim]

    @property
    def outer(self) -> int:
        return math.prod(self.physical_shape[: self._block_pos])

    @property
    def inner(self) -> int:
        """Elements of one block in one outer row."""
        return math.prod(self.physical_shape[self._block_pos + 1 :])

    def block_bytes(self) -> int:
        """Bytes of one block of one layer (all outer rows)."""
        return self.outer * self.inner * self.dtype.itemsize

    def chunk_bytes(self, num_layers: int, blocks_per_chunk: int) -> int:
        """Bytes of a chunk of ``blocks_per_chunk`` blocks of ``num_layers`` layers."""
        return num_layers * blocks_per_chunk * self.block_bytes()

    def block_view(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` as ``(outer, num_blocks, inner)``, sharing its storage.

        Raises ``ValueError`` if the tensor's shape, dtype or strides disagree with
        the declared layout.
        """
        if tuple(tensor.shape) != self.shape or tensor.dtype != self.dtype:
            raise ValueError(
                f"KV tensor {tuple(tensor.shape)} {tensor.dtype} does not match the "
                f"declared layout {self.shape} {self.dtype}"
            )
        phys = tensor.permute(self.stride_order)
        sizes, strides, pos = phys.shape, phys.stride(), self._block_pos
        expected = 1
        for d in reversed(range(pos + 1, len(sizes))):
            if sizes[d] != 1 and strides[d] != expected:
                raise ValueError(
                    f"KV tensor strides {tensor.stride()} do not follow stride order "
                    f"{self.stride_order} with a dense block interior (physical dim {d} "
                    f"has stride {strides[d]}, expected {expected})"
                )
            expected *= sizes[d]
        outer_dims = [d for d in range(pos) if sizes[d] != 1]
        for a, b in itertools.pairwise(outer_dims):
            if strides[a] != strides[b] * sizes[b]:
                raise ValueError(
                    f"KV tensor strides {tensor.stride()}: the dims before the block dim "
                    f"in stride order {self.stride_order} do not merge into one"
                )
        outer_stride = strides[outer_dims[-1]] if outer_dims else 0
        return tensor.as_strided(
            (self.outer, self.num_blocks, self.inner),
            (outer_stride, strides[pos], 1),
            tensor.storage_offset(),
        )


def cross_layer_view(views: Sequence[torch.Tensor]) -> torch.Tensor:
    """One ``(1, num_blocks, len(views) * inner)`` view over per-layer block views.

    ``views`` are ``KVLayout.block_view`` results with ``outer == 1`` whose layer ``i``
    starts ``i * inner`` elements after layer 0 and whose block stride is
    ``len(views) * inner`` (all layers of a block adjacent). Raises ``ValueError``
    otherwise.
    """
    if not views:
        raise ValueError("cross_layer_view: no layers")
    first = views[0]
    outer, nb, inner = first.shape
    num_layers = len(views)
    if outer != 1 or (nb > 1 and first.stride(1) != num_layers * inner):
        raise ValueError(
            f"cross_layer_view: block view {tuple(first.shape)} strides {first.stride()} "
            f"does not hold {num_layers} layers per block"
        )
    for i, v in enumerate(views):
        same = v.shape == first.shape and v.dtype == first.dtype and v.stride() == first.stride()
        adjacent = v.data_ptr() == first.data_ptr() + i * inner * first.element_size()
        if not (same and adjacent):
            raise ValueError(f"cross_layer_view: layer {i} is not adjacent to layer {i - 1}")
    return first.as_strided(
        (1, nb, num_layers * inner), (0, num_layers * inner, 1), first.storage_offset()
    )


def layout_from_backend(
    backend_cls: Any,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_size: int,
    *,
    dtype: torch.dtype,
    kv_cache_layout: HasStrideOrder | None = None,
    head_size_v: int | None = None,
) -> KVLayout:
    """The per-layer ``KVLayout`` that ``backend_cls`` declares.

    Two attention-backend APIs are understood:

    * ``get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size)`` plus the
      optional ``get_kv_cache_stride_order()`` (vLLM up to about 0.1x, and backends
      that still define them). The block dim is the one dim that grows by one when
      ``num_blocks`` does.
    * ``KVCacheLayout`` (vLLM 0.2x/0.3x, which removed ``get_kv_cache_shape``): every
      layer view is the logical ``[B, H, N, C]`` with ``N = block_size`` tokens and
      ``C = head_size + head_size_v`` (K and V side by side), blocks in dim 0; the
      physical order is the layout's ``stride_order`` without its layer axis. Pass the
      resolved layout (``kv_cache_config.kv_cache_layout``) as ``kv_cache_layout``;
      otherwise the backend's most preferred ``supported_kv_cache_layouts()`` is used,
      and the identity order when it declares none.
    """
    shape_fn = getattr(backend_cls, "get_kv_cache_shape", None)
    if shape_fn is not None:
        shape = tuple(int(s) for s in shape_fn(num_blocks, block_size, num_kv_heads, head_size))
        grown = tuple(int(s) for s in shape_fn(num_blocks + 1, block_size, num_kv_heads, head_size))
        changed = [i for i, (a, b) in enumerate(zip(shape, grown, strict=True)) if a != b]
        if len(changed) != 1 or grown[changed[0]] != shape[changed[0]] + 1:
            raise ValueError(
                f"{backend_cls.__name__}.get_kv_cache_shape: cannot locate the block dim "
                f"({shape} for {num_blocks} blocks, {grown} for {num_blocks + 1})"
            )
        return KVLayout(shape, _legacy_stride_order(backend_cls, len(shape)), changed[0], dtype)

    layout = kv_cache_layout if kv_cache_layout is not None else _preferred_layout(backend_cls)
    v = head_size if head_size_v is None else head_size_v
    shape = (num_blocks, num_kv_heads, block_size, head_size + v)
    if layout is None:
        return KVLayout(shape, (0, 1, 2, 3), 0, dtype)
    order5 = tuple(layout.stride_order)
    if sorted(order5) != list(range(5)):
        raise ValueError(f"kv_cache_layout stride order {order5} is not over [L, B, H, N, C]")
    # Drop the layer axis (0) and renumber [B, H, N, C] as 0..3.
    return KVLayout(shape, tuple(d - 1 for d in order5 if d != 0), 0, dtype)


def _legacy_stride_order(backend_cls: Any, ndim: int) -> tuple[int, ...]:
    order_fn = getattr(backend_cls, "get_kv_cache_stride_order", None)
    if order_fn is None:
        return tuple(range(ndim))
    try:
        order = tuple(int(d) for d in order_fn())
    except NotImplementedError:  # vLLM's way of saying "the identity order"
        return tuple(range(ndim))
    if len(order) != ndim:
        raise ValueError(
            f"{backend_cls.__name__}.get_kv_cache_stride_order() = {order} does not match "
            f"the {ndim} dims of its KV cache shape"
        )
    return order


def _preferred_layout(backend_cls: Any) -> HasStrideOrder | None:
    supported = getattr(backend_cls, "supported_kv_cache_layouts", None)
    layouts = supported() if supported is not None else None
    return layouts[0] if layouts else None
