"""Gather/scatter correctness: every implementation and device against the oracle.

Every destination is poisoned before the copy; every case checks exact bytes.
"""

from __future__ import annotations

import pytest
import torch

from kvtier.ops import KVLayout, cross_layer_view
from tests.ops.conftest import HAS_CUDA, POISON, Target
from tests.ops.helpers import (
    DTYPES,
    ID_CASES,
    UNIQUE_ID_CASES,
    as_bytes,
    layouts,
    make_cache,
    oracle_chunk,
)

NUM_LAYERS = 3
LAYOUT_NAMES = list(layouts(torch.float32))


def _caches(
    target: Target, dtype: torch.dtype, layout_name: str, seed: int = 0
) -> tuple[KVLayout, list[torch.Tensor], list[torch.Tensor]]:
    case = layouts(dtype)[layout_name]
    caches = [make_cache(case, target.device, seed + i) for i in range(NUM_LAYERS)]
    return case.layout, caches, [case.layout.block_view(c) for c in caches]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout_name", LAYOUT_NAMES)
@pytest.mark.parametrize("ids_case", list(ID_CASES))
def test_gather_matches_oracle(
    target: Target, dtype: torch.dtype, layout_name: str, ids_case: str
) -> None:
    layout, _, views = _caches(target, dtype, layout_name)
    ids = ID_CASES[ids_case]
    dst = target.new_chunk(layout.chunk_bytes(NUM_LAYERS, len(ids)))
    target.backend.gather(views, torch.tensor(ids, dtype=torch.int64), dst).wait()
    assert torch.equal(dst.cpu(), oracle_chunk(views, ids))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout_name", LAYOUT_NAMES)
@pytest.mark.parametrize("ids_case", list(UNIQUE_ID_CASES))
def test_round_trip_restores_listed_blocks_only(
    target: Target, dtype: torch.dtype, layout_name: str, ids_case: str
) -> None:
    layout, caches, views = _caches(target, dtype, layout_name)
    ids = UNIQUE_ID_CASES[ids_case]
    block_ids = torch.tensor(ids, dtype=torch.int64)
    chunk = target.new_chunk(layout.chunk_bytes(NUM_LAYERS, len(ids)))
    target.backend.gather(views, block_ids, chunk).wait()

    _, fresh, fresh_views = _caches(target, dtype, layout_name, seed=100)
    before = [as_bytes(f) for f in fresh]
    target.backend.scatter(chunk, fresh_views, block_ids).wait()

    block_dim = layout.block_dim
    for orig, new, old in zip(caches, fresh, before, strict=True):
        new_b, orig_b = as_bytes(new), as_bytes(orig)
        for b in range(layout.num_blocks):
            want = orig_b if b in ids else old
            assert torch.equal(new_b.select(block_dim, b), want.select(block_dim, b)), b


def test_gather_then_scatter_large_blocks(target: Target) -> None:
    """Blocks larger than the native piece size (64 KiB) and the serial threshold."""
    layout = KVLayout((8, 4, 64, 256), (0, 1, 2, 3), 0, torch.float32)  # 256 KiB blocks
    gen = torch.Generator().manual_seed(7)
    caches = [torch.randn(layout.shape, generator=gen).to(target.device) for _ in range(2)]
    views = [layout.block_view(c) for c in caches]
    ids = torch.tensor([6, 0, 3, 4, 5], dtype=torch.int64)  # 3-4-5 coalesce natively
    chunk = target.new_chunk(layout.chunk_bytes(2, 5))
    target.backend.gather(views, ids, chunk).wait()
    assert torch.equal(chunk.cpu(), oracle_chunk(views, ids.tolist()))
    fresh = [torch.zeros_like(c) for c in caches]
    target.backend.scatter(chunk, [layout.block_view(f) for f in fresh], ids).wait()
    for c, f in zip(caches, fresh, strict=True):
        assert torch.equal(f[ids].cpu(), c[ids].cpu())
        assert not f[[1, 2, 7]].any()


def test_cross_layer_view_round_trip(target: Target) -> None:
    """One allocation, blocks outermost, layers of a block adjacent (vLLM BLHNC)."""
    nb, layers, heads, bs, c = 10, 4, 2, 4, 16
    gen = torch.Generator().manual_seed(3)
    raw = torch.randn((nb, layers, heads, bs, c), generator=gen).to(target.device)
    layout = KVLayout((nb, heads, bs, c), (0, 1, 2, 3), 0, torch.float32)
    views = [layout.block_view(raw[:, i]) for i in range(layers)]
    cross = cross_layer_view(views)
    assert cross.shape == (1, nb, layers * heads * bs * c)
    ids = torch.tensor([7, 2, 9], dtype=torch.int64)
    chunk = target.new_chunk(layout.chunk_bytes(layers, 3))
    target.backend.gather([cross], ids, chunk).wait()
    assert torch.equal(chunk.cpu(), as_bytes(raw[ids]).flatten())  # block-major

    fresh = torch.zeros_like(raw)
    fresh_cross = cross_layer_view([layout.block_view(fresh[:, i]) for i in range(layers)])
    target.backend.scatter(chunk, [fresh_cross], ids).wait()
    assert torch.equal(fresh[ids].cpu(), raw[ids].cpu())
    assert not fresh[[0, 1, 3, 4, 5, 6, 8]].any()


def test_handle_reports_completion(target: Target) -> None:
    """CPU copies are complete on return; a CUDA copy is complete once waited for."""
    layout, _, views = _caches(target, torch.float32, "cpu")
    dst = target.new_chunk(layout.chunk_bytes(NUM_LAYERS, 2))
    handle = target.backend.gather(views, torch.tensor([1, 2], dtype=torch.int64), dst)
    if target.device.type == "cpu":
        assert handle.done()
    handle.wait()
    assert handle.done()
    assert not torch.equal(dst.cpu(), torch.full_like(dst.cpu(), POISON))


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device: the CUDA targets did not run")
def test_cuda_suite_present() -> None:
    assert torch.cuda.device_count() > 0


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_reference_ops_on_cuda_never_wait_for_earlier_copies_on_the_stream() -> None:
    """The torch backend (``copy_backend: auto`` without the extension) uploads block ids
    asynchronously: a scatter issued behind a long kernel returns while the kernel runs
    (a pageable upload would wait for it, blocking ``start_load_kv`` on the last step)."""
    from kvtier.ops import reference
    from kvtier.ops.reference import alloc_pinned

    layers = [torch.zeros(2, 64, 256, device="cuda") for _ in range(2)]
    view = [t.view(torch.uint8) for t in layers]
    ids = torch.tensor([3, 9, 17], dtype=torch.int64)
    chunk, _ = alloc_pinned(2 * 2 * 3 * 256 * 4)
    chunk.fill_(7)
    stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    with torch.cuda.stream(stream):
        torch.cuda._sleep(2_000_000_000)  # type: ignore[no-untyped-call] # ~1 s of GPU time on this stream
        reference.scatter_blocks(chunk, view, ids)
        reference.gather_blocks(view, ids, chunk)
        busy = not stream.query()
    stream.synchronize()
    assert busy, "the host waited for the stream"
    assert torch.all(view[0][:, 3] == 7) and torch.all(view[1][:, 17] == 7)
