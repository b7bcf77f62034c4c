"""Fixtures of the kvtier.ops tests: one suite, run for every (implementation, device).

The native targets FAIL (not skip) when ``kvtier._C`` is not built: ``make test`` builds
it first, and a missing build must not look like a green run. CUDA targets skip when no
CUDA device is present.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

from kvtier.ops import CopyBackend, native_status, resolve_copy_backend

HAS_CUDA = torch.cuda.is_available()


@dataclass(frozen=True)
class Target:
    """Where a test runs: a backend, the cache device and a chunk allocator."""

    backend: CopyBackend
    device: torch.device
    new_chunk: Callable[[int], torch.Tensor]  # uint8 chunk of n bytes, poisoned

    @property
    def name(self) -> str:
        return f"{self.backend.name}/{self.device.type}"


POISON = 0xA5


def _host_chunk(backend: CopyBackend) -> Callable[[int], torch.Tensor]:
    def new(n: int) -> torch.Tensor:
        t = backend.alloc_pinned(n).tensor if n > 0 else torch.empty(0, dtype=torch.uint8)
        return t.fill_(POISON)

    return new


def _device_chunk(n: int) -> torch.Tensor:
    return torch.full((n,), POISON, dtype=torch.uint8, device="cuda")


def require_native() -> None:
    status = native_status()
    if not status.available:
        pytest.fail(f"native ops unavailable: {status.detail}", pytrace=False)


# CUDA targets exist only where CUDA does (test_cuda_suite_present reports the skip once).
_CPU_TARGETS = [
    pytest.param(("torch", "auto", "cpu", "host"), id="torch-cpu"),
    pytest.param(("native", "auto", "cpu", "host"), id="native-cpu"),
]
_CUDA_TARGETS = [
    pytest.param(("torch", "auto", "cuda", "host"), id="torch-cuda"),
    pytest.param(("native", "memcpy", "cuda", "host"), id="native-memcpy-cuda"),
    pytest.param(("native", "kernel", "cuda", "host"), id="native-kernel-cuda"),
    pytest.param(("native", "memcpy", "cuda", "device"), id="native-memcpy-cuda-devchunk"),
    pytest.param(("native", "kernel", "cuda", "device"), id="native-kernel-cuda-devchunk"),
]
TARGETS = _CPU_TARGETS + (_CUDA_TARGETS if HAS_CUDA else [])


@pytest.fixture(params=TARGETS)
def target(request: pytest.FixtureRequest) -> Target:
    mode, strategy, device, chunk = request.param
    if mode == "native":
        require_native()
    backend = resolve_copy_backend(mode, cuda_strategy=strategy)
    new_chunk = _device_chunk if chunk == "device" else _host_chunk(backend)
    return Target(backend, torch.device(device), new_chunk)


@pytest.fixture(params=["torch", "native"])
def cpu_backend(request: pytest.FixtureRequest) -> CopyBackend:
    """Each implementation, for the tests that only need the CPU."""
    if request.param == "native":
        require_native()
    return resolve_copy_backend(request.param)
