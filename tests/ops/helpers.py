"""Test data and a loop-per-block oracle for the block copy tests."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvtier.ops import KVLayout

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.uint8]  # uint8: fp8 stand-in

ID_CASES = {
    "noncontig": [5, 1, 9, 3],
    "repeated": [2, 2, 7, 2],
    "reverse": list(range(15, -1, -1)),
    "single": [4],
    "empty": [],
}
UNIQUE_ID_CASES = {k: v for k, v in ID_CASES.items() if len(set(v)) == len(v)}


@dataclass(frozen=True)
class CacheCase:
    """How to build one layer's KV tensor: a declared layout and an allocation shape."""

    layout: KVLayout
    physical: tuple[int, ...]  # allocation shape, permuted by ``layout.stride_order``
    pad_blocks: bool = False  # allocate a gap after every block (block stride > inner)


def layouts(dtype: torch.dtype, num_blocks: int = 16) -> dict[str, CacheCase]:
    heads, bs, hs = 2, 4, 8
    cpu = KVLayout((num_blocks, heads, bs, 2 * hs), (0, 1, 2, 3), 0, dtype)
    flash = KVLayout((2, num_blocks, bs, heads, hs), (0, 1, 3, 2, 4), 1, dtype)  # HND order
    lhbnc = KVLayout((num_blocks, heads, bs, 2 * hs), (1, 0, 2, 3), 0, dtype)
    return {
        "cpu": CacheCase(cpu, cpu.physical_shape),
        "flash-hnd": CacheCase(flash, flash.physical_shape),
        "head-major": CacheCase(lhbnc, lhbnc.physical_shape),
        "padded": CacheCase(cpu, cpu.physical_shape, pad_blocks=True),
    }


def random_bytes(shape: Sequence[int], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    if dtype == torch.uint8:
        return torch.randint(0, 256, tuple(shape), dtype=torch.uint8, generator=gen)
    return torch.randn(tuple(shape), generator=gen).to(dtype)


def make_cache(case: CacheCase, device: torch.device, seed: int) -> torch.Tensor:
    """A random per-layer KV tensor with the case's logical shape and physical strides."""
    gen = torch.Generator().manual_seed(seed)
    phys = case.physical
    if case.pad_blocks:  # physical dim 0 is the block dim in the padded case
        raw = random_bytes((phys[0], 2 * phys[1], *phys[2:]), case.layout.dtype, gen)
        phys_t = raw[:, : phys[1]]
    else:
        phys_t = random_bytes(phys, case.layout.dtype, gen)
    phys_t = phys_t.to(device)
    inverse = [case.layout.stride_order.index(d) for d in range(len(phys))]
    return phys_t.permute(inverse)


def oracle_chunk(views: Sequence[torch.Tensor], ids: Sequence[int]) -> torch.Tensor:
    """The chunk layout, one block at a time (kvtier/ops/layout.py)."""
    parts = [
        v[o, b].contiguous().view(torch.uint8).flatten()
        for v in views
        for o in range(v.shape[0])
        for b in ids
    ]
    if not parts:
        return torch.empty(0, dtype=torch.uint8)
    return torch.cat([p.cpu() for p in parts])


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A KV tensor's bytes in logical order, on the CPU."""
    return t.contiguous().view(torch.uint8).cpu()
