"""KVLayout: the block dim and chunk sizes come from the backend's declarations."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from kvtier.ops import KVLayout, cross_layer_view, layout_from_backend


class LegacyFlash:
    """The pre-0.2x vLLM API: get_kv_cache_shape + get_kv_cache_stride_order."""

    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
    ) -> tuple[int, ...]:
        return (2, num_blocks, block_size, num_kv_heads, head_size)

    @staticmethod
    def get_kv_cache_stride_order() -> tuple[int, ...]:
        return (0, 1, 3, 2, 4)  # HND


class LegacyNoOrder:
    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
    ) -> tuple[int, ...]:
        return (num_blocks, 2, block_size, num_kv_heads, head_size)

    @staticmethod
    def get_kv_cache_stride_order() -> tuple[int, ...]:
        raise NotImplementedError


@dataclass(frozen=True)
class FakeKVCacheLayout:
    stride_order: tuple[int, ...]


class Modern:
    """The vLLM 0.3x API: supported_kv_cache_layouts(), no get_kv_cache_shape."""

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[FakeKVCacheLayout, ...]:
        return (FakeKVCacheLayout((0, 2, 1, 3, 4)),)  # LHBNC


def test_legacy_flash_attn_has_two_outer_rows() -> None:
    lay = layout_from_backend(LegacyFlash, 10, 16, 4, 64, dtype=torch.float16)
    assert (lay.block_dim, lay.outer, lay.inner) == (1, 2, 16 * 4 * 64)
    assert lay.block_bytes() == 2 * 16 * 4 * 64 * 2
    assert lay.chunk_bytes(num_layers=3, blocks_per_chunk=5) == 15 * lay.block_bytes()


def test_block_dim_is_found_even_when_another_dim_has_the_same_size() -> None:
    lay = layout_from_backend(LegacyFlash, 2, 16, 2, 2, dtype=torch.float16)
    assert lay.block_dim == 1


def test_not_implemented_stride_order_is_the_identity() -> None:
    lay = layout_from_backend(LegacyNoOrder, 7, 16, 2, 8, dtype=torch.float32)
    assert (lay.stride_order, lay.block_dim, lay.outer) == ((0, 1, 2, 3, 4), 0, 1)


def test_modern_api_uses_the_preferred_layout() -> None:
    lay = layout_from_backend(Modern, 6, 16, 4, 32, dtype=torch.bfloat16)
    assert lay.shape == (6, 4, 16, 64)
    assert (lay.stride_order, lay.outer, lay.inner) == ((1, 0, 2, 3), 4, 16 * 64)


def test_explicit_layout_overrides_the_preference() -> None:
    lay = layout_from_backend(Modern, 6, 16, 4, 32, dtype=torch.bfloat16,
                              kv_cache_layout=FakeKVCacheLayout((1, 0, 2, 3, 4)))
    assert (lay.stride_order, lay.outer) == ((0, 1, 2, 3), 1)


def test_vllm_cpu_backend_layout() -> None:
    cpu_attn = pytest.importorskip("vllm.v1.attention.backends.cpu_attn")
    lay = layout_from_backend(cpu_attn.CPUAttentionBackend, 100, 128, 4, 64,
                              dtype=torch.bfloat16)
    # vLLM's CPU layer tensor: (num_blocks, num_kv_heads, block_size, 2 * head_size)
    assert lay.shape == (100, 4, 128, 128)
    assert (lay.block_dim, lay.outer, lay.inner) == (0, 1, 4 * 128 * 128)
    view = lay.block_view(torch.zeros(lay.shape, dtype=torch.bfloat16))
    assert view.shape == (1, 100, 4 * 128 * 128)


def test_block_view_shares_storage_and_follows_the_stride_order() -> None:
    lay = layout_from_backend(LegacyFlash, 5, 4, 2, 8, dtype=torch.float32)
    phys = torch.arange(2 * 5 * 2 * 4 * 8, dtype=torch.float32).view(2, 5, 2, 4, 8)
    logical = phys.permute(0, 1, 3, 2, 4)  # what the backend hands out
    view = lay.block_view(logical)
    assert view.shape == (2, 5, 64) and view.data_ptr() == phys.data_ptr()
    assert torch.equal(view[1, 3], phys[1, 3].flatten())


def test_block_view_rejects_a_tensor_that_breaks_the_declared_order() -> None:
    lay = layout_from_backend(LegacyFlash, 5, 4, 2, 8, dtype=torch.float32)
    with pytest.raises(ValueError, match="dense block interior"):
        lay.block_view(torch.zeros(lay.shape))  # NHD tensor, HND declared
    with pytest.raises(ValueError, match="does not match the declared layout"):
        lay.block_view(torch.zeros(lay.shape, dtype=torch.float16))


def test_layout_validates_itself() -> None:
    with pytest.raises(ValueError, match="not a permutation"):
        KVLayout((2, 3), (0, 0), 0, torch.float32)
    with pytest.raises(ValueError, match="block_dim"):
        KVLayout((2, 3), (0, 1), 2, torch.float32)


def test_cross_layer_view_needs_adjacent_layers() -> None:
    lay = KVLayout((4, 8), (0, 1), 0, torch.float32)
    separate = [lay.block_view(torch.zeros(4, 8)) for _ in range(2)]
    with pytest.raises(ValueError, match="layers per block"):
        cross_layer_view(separate)
