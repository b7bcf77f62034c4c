"""alloc_pinned: aligned, touched, honest about pinning, clear when memory is short."""

from __future__ import annotations

import mmap

import pytest
import torch

from kvtier.ops import CopyBackend, alloc_pinned


def test_alloc_is_page_aligned_uint8(cpu_backend: CopyBackend) -> None:
    buf, pinned = cpu_backend.alloc_pinned(3 * mmap.PAGESIZE + 5)
    assert buf.dtype == torch.uint8 and buf.device.type == "cpu"
    assert buf.shape == (3 * mmap.PAGESIZE + 5,)
    assert buf.data_ptr() % mmap.PAGESIZE == 0
    assert pinned == torch.cuda.is_available()
    buf.fill_(7)
    assert int(buf.sum()) == 7 * buf.numel()


def test_too_large_names_the_numbers_and_the_hint(cpu_backend: CopyBackend) -> None:
    with pytest.raises(MemoryError, match=r"cannot allocate 1048576\.0 GiB.*MemAvailable "
                       r"[0-9.]+ GiB.*reduce tiers\[0\]\.host\.capacity"):
        cpu_backend.alloc_pinned(1 << 50, hint="reduce tiers[0].host.capacity")


def test_non_positive_size_is_rejected(cpu_backend: CopyBackend) -> None:
    with pytest.raises(ValueError, match="nbytes must be > 0"):
        cpu_backend.alloc_pinned(0)


def test_module_level_alloc_unpacks_as_a_pair() -> None:
    tensor, pinned = alloc_pinned(1 << 16)
    assert tensor.numel() == 1 << 16 and isinstance(pinned, bool)


def test_register_pinned_takes_a_tensor_or_a_buffer_and_is_honest() -> None:
    """One page-locking path for the ops' buffers and the shared host pool
    (``kvtier.hostmem``): True only where CUDA registered the memory."""
    from kvtier.hostmem import anonymous, register_pinned

    buf = anonymous(2 * mmap.PAGESIZE)
    assert register_pinned(buf, owner=buf) == torch.cuda.is_available()
    mem = anonymous(mmap.PAGESIZE)
    tensor = torch.frombuffer(mem, dtype=torch.uint8)
    assert register_pinned(tensor, owner=mem) == torch.cuda.is_available()
