"""Bad arguments raise a RuntimeError naming the op and the argument; nothing crashes."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from kvtier.ops import CopyBackend, KVLayout
from tests.ops.conftest import HAS_CUDA, require_native

LAYOUT = KVLayout((8, 2, 4, 16), (0, 1, 2, 3), 0, torch.float32)
IDS = torch.tensor([1, 3], dtype=torch.int64)


def _views(n: int = 2, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    return [torch.zeros(LAYOUT.shape, dtype=dtype).view(1, 8, -1) for _ in range(n)]


def _chunk(n: int = 2) -> torch.Tensor:
    return torch.zeros(LAYOUT.chunk_bytes(n, 2), dtype=torch.uint8)


Case = Callable[[], tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]]

GATHER_CASES: dict[str, tuple[Case, str]] = {
    "dst-dtype": (lambda: (_views(), IDS, _chunk().view(torch.float32)), "must be a uint8"),
    "dst-size": (lambda: (_views(), IDS, _chunk()[:-1]), "bytes are needed"),
    "dst-noncontig": (lambda: (_views(), IDS, _chunk().view(2, -1).t()), "contiguous"),
    "ids-dtype": (lambda: (_views(), IDS.int(), _chunk()), "int64"),
    "ids-2d": (lambda: (_views(), IDS.view(1, 2), _chunk()), "1-D"),
    "ids-range": (lambda: (_views(), torch.tensor([1, 8]), _chunk()), "out of range"),
    "ids-negative": (lambda: (_views(), torch.tensor([-1, 0]), _chunk()), "out of range"),
    "layer-2d": (lambda: ([v.view(8, -1) for v in _views()], IDS, _chunk()), "3-D block view"),
    "layer-dtype": (lambda: ([_views()[0], _views(1, torch.float64)[0]], IDS, _chunk()),
                    r"layers\[1\] has dtype"),
    "layer-shape": (lambda: ([_views()[0], torch.zeros(1, 9, 128)], IDS, _chunk()),
                    r"layers\[1\] has shape"),
    "layer-stride": (lambda: ([v.transpose(1, 2).contiguous().transpose(1, 2)
                               for v in _views()], IDS, _chunk()), "contiguous last dim"),
    "no-layers": (lambda: ([], IDS, _chunk()), "must not be empty"),
}


@pytest.mark.parametrize("case", list(GATHER_CASES))
def test_gather_rejects(cpu_backend: CopyBackend, case: str) -> None:
    make, pattern = GATHER_CASES[case]
    layers, ids, dst = make()
    with pytest.raises(RuntimeError, match=pattern) as info:
        cpu_backend.gather(layers, ids, dst)
    assert "gather_blocks" in str(info.value)


@pytest.mark.parametrize("case", ["dst-dtype", "dst-size", "ids-range", "layer-2d"])
def test_scatter_rejects(cpu_backend: CopyBackend, case: str) -> None:
    make, pattern = GATHER_CASES[case]
    layers, ids, src = make()
    with pytest.raises(RuntimeError, match=pattern.replace("dst", "src")) as info:
        cpu_backend.scatter(src, layers, ids)
    assert "scatter_blocks" in str(info.value)


def test_scatter_rejects_repeated_ids(cpu_backend: CopyBackend) -> None:
    with pytest.raises(RuntimeError, match="block id 3 appears twice"):
        cpu_backend.scatter(_chunk(), _views(), torch.tensor([3, 3]))


def test_chunk_on_another_device_is_rejected(cpu_backend: CopyBackend) -> None:
    if not HAS_CUDA:
        # The only other device here is "meta": the dispatcher refuses it cleanly.
        with pytest.raises((RuntimeError, NotImplementedError)):
            cpu_backend.gather(_views(), IDS, _chunk().to("meta"))
        return
    with pytest.raises(RuntimeError, match="dst is on cuda"):
        cpu_backend.gather(_views(), IDS, _chunk().cuda())


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device")
@pytest.mark.parametrize("strategy", ["memcpy", "kernel"])
def test_cuda_rejects_pageable_chunk_and_device_ids(strategy: str) -> None:
    from kvtier.ops import resolve_copy_backend

    require_native()
    backend = resolve_copy_backend("native", cuda_strategy=strategy)  # type: ignore[arg-type]
    views = [v.cuda() for v in _views()]
    with pytest.raises(RuntimeError, match="pageable"):
        backend.gather(views, IDS, _chunk()).wait()
    with pytest.raises(RuntimeError, match="CPU tensor"):
        backend.gather(views, IDS.cuda(), _chunk().pin_memory()).wait()
