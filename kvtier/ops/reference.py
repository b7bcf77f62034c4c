"""Pure-torch reference implementation of the kvtier ops.

Same contract as the native ops (``native/ops.cpp``): same arguments, same chunk layout
(``kvtier/ops/layout.py``), same argument checks with ``RuntimeError``s naming the op and
the argument. It is the oracle of the tests and the fallback of ``copy_backend: auto``.

Invariants: a gather writes every byte of ``dst`` and nothing else; a scatter writes
exactly the listed blocks of every layer; on CUDA the work is enqueued on the current
stream (the caller's copy stream) and ``dst``/``src`` on the host must be pinned for the
copy to be asynchronous.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvtier.hostmem import anonymous, register_pinned

#: ``register_pinned`` lives in ``kvtier.hostmem``; importing it from here still works.
__all__ = [
    "BlockGeometry",
    "alloc_pinned",
    "check_block_args",
    "chunk_nbytes",
    "gather_blocks",
    "register_pinned",
    "scatter_blocks",
]


@dataclass(frozen=True)
class BlockGeometry:
    """Checked sizes of one gather/scatter: ``(outer, num_blocks, inner_bytes)`` per layer."""

    outer: int
    num_blocks: int
    inner_bytes: int
    num_ids: int

    @property
    def layer_bytes(self) -> int:
        """Bytes of one layer's part of the chunk."""
        return self.outer * self.num_ids * self.inner_bytes


def _check(cond: bool, op: str, msg: str) -> None:
    if not cond:
        raise RuntimeError(f"{op}: {msg}")


def check_block_args(
    op: str,
    layers: Sequence[torch.Tensor],
    block_ids: torch.Tensor,
    chunk: torch.Tensor,
    *,
    scatter: bool,
) -> BlockGeometry:
    """The checks of ``kvtier::check_block_args`` (native/ops.cpp), in Python."""
    name = "src" if scatter else "dst"
    _check(len(layers) > 0, op, "layers must not be empty")
    first = layers[0]
    for i, t in enumerate(layers):
        _check(
            t.dim() == 3,
            op,
            f"layers[{i}] must be a 3-D block view (outer, num_blocks, inner), got "
            f"{t.dim()} dims {list(t.shape)}; build it with kvtier.ops.KVLayout.block_view()",
        )
        _check(t.dtype == first.dtype, op, f"layers[{i}] has dtype {t.dtype} but layers[0] "
               f"has {first.dtype}")
        _check(t.device == first.device, op, f"layers[{i}] is on {t.device} but layers[0] "
               f"is on {first.device}")
        _check(t.shape == first.shape, op, f"layers[{i}] has shape {list(t.shape)} but "
               f"layers[0] has {list(first.shape)}")
        _check(t.shape[2] == 1 or t.stride(2) == 1, op, f"layers[{i}] must have a contiguous "
               f"last dim (stride 1), got strides {list(t.stride())}")
        _check(t.numel() > 0, op, f"layers[{i}] is empty {list(t.shape)}")
    outer, nb, inner = first.shape
    inner_bytes = inner * first.element_size()
    _check(block_ids.dtype == torch.int64, op, f"block_ids must be int64, got {block_ids.dtype}")
    _check(block_ids.device.type == "cpu", op,
           f"block_ids must be a CPU tensor, got {block_ids.device}")
    _check(block_ids.dim() == 1 and block_ids.is_contiguous(), op,
           f"block_ids must be a contiguous 1-D tensor, got shape {list(block_ids.shape)}")
    ids = block_ids.tolist()
    for i, b in enumerate(ids):
        _check(0 <= b < nb, op, f"block_ids[{i}] = {b} is out of range [0, {nb})")
    if scatter and len(set(ids)) != len(ids):
        dup = next(b for b in ids if ids.count(b) > 1)
        _check(False, op, f"block id {dup} appears twice in block_ids; a scatter writes "
               "each block once")
    geom = BlockGeometry(outer, nb, inner_bytes, len(ids))
    total = len(layers) * geom.layer_bytes
    _check(chunk.dtype == torch.uint8, op, f"{name} must be a uint8 buffer, got {chunk.dtype}")
    _check(chunk.is_contiguous(), op, f"{name} must be contiguous")
    _check(chunk.numel() == total, op, f"{name} has {chunk.numel()} bytes but {len(layers)} "
           f"layers x {outer} outer x {len(ids)} blocks x {inner_bytes} B = {total} bytes "
           "are needed")
    _check(chunk.device.type == "cpu" or chunk.device == first.device, op,
           f"{name} is on {chunk.device} but the layers are on {first.device}")
    return geom


def _bytes_view(layer: torch.Tensor) -> torch.Tensor:
    """A block view reinterpreted as uint8 ``(outer, num_blocks, inner_bytes)``."""
    return layer if layer.dtype == torch.uint8 else layer.view(torch.uint8)


def _device_ids(block_ids: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``block_ids`` on ``device`` without blocking the host. A pageable host-to-device
    copy is synchronous: it would wait for every copy queued before it on the stream (the
    previous step's saves), which is what ``start_load_kv`` must never do. The ids are
    staged in pinned memory (torch's caching host allocator keeps the buffer until the
    copy has run) and uploaded asynchronously on the current stream."""
    if device.type == "cpu":
        return block_ids
    return block_ids.pin_memory().to(device, non_blocking=True)


def gather_blocks(
    layers: Sequence[torch.Tensor], block_ids: torch.Tensor, dst: torch.Tensor
) -> None:
    """Copies ``block_ids`` of every layer into ``dst`` (chunk layout)."""
    geom = check_block_args("gather_blocks", layers, block_ids, dst, scatter=False)
    if geom.num_ids == 0:
        return
    device = layers[0].device
    ids = _device_ids(block_ids, device)
    for i, layer in enumerate(layers):
        out = dst[i * geom.layer_bytes : (i + 1) * geom.layer_bytes]
        out = out.view(geom.outer, geom.num_ids, geom.inner_bytes)
        if out.device == device:
            torch.index_select(_bytes_view(layer), 1, ids, out=out)
        else:
            out.copy_(_bytes_view(layer).index_select(1, ids), non_blocking=True)


def scatter_blocks(
    src: torch.Tensor, layers: Sequence[torch.Tensor], block_ids: torch.Tensor
) -> None:
    """Writes the chunk ``src`` back into ``block_ids`` of every layer."""
    geom = check_block_args("scatter_blocks", layers, block_ids, src, scatter=True)
    if geom.num_ids == 0:
        return
    device = layers[0].device
    ids = _device_ids(block_ids, device)
    for i, layer in enumerate(layers):
        part = src[i * geom.layer_bytes : (i + 1) * geom.layer_bytes]
        part = part.view(geom.outer, geom.num_ids, geom.inner_bytes)
        _bytes_view(layer).index_copy_(1, ids, part.to(device, non_blocking=True))


def alloc_pinned(nbytes: int) -> tuple[torch.Tensor, bool]:
    """Page-aligned, pre-touched host memory, page-locked when CUDA is available.

    The memory is ``kvtier.hostmem.anonymous`` (aligned, faulted in); ``register_pinned``
    (``cudaHostRegister`` through torch's cudart binding) pins it. The registration is
    dropped when the mapping is released.
    """
    if nbytes <= 0:
        raise RuntimeError(f"alloc_pinned: nbytes must be > 0, got {nbytes}")
    buf = anonymous(nbytes)
    tensor = torch.frombuffer(buf, dtype=torch.uint8)
    return tensor, register_pinned(tensor, owner=buf)


def chunk_nbytes(layers: Sequence[torch.Tensor], num_ids: int) -> int:
    """Bytes of the chunk of ``num_ids`` blocks of ``layers`` (block views)."""
    if not layers:
        return 0
    outer, _, inner = layers[0].shape
    return len(layers) * outer * num_ids * inner * layers[0].element_size()


