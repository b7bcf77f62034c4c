"""Copy backends: one object with gather/scatter/alloc_pinned over native or torch kernels.

A ``CopyBackend`` is chosen once (``resolve_copy_backend``) and then routes every call:

* CPU layers: the copy runs on the calling thread and is complete on return; the
  returned handle is already done.
* CUDA layers: the copy is enqueued on a dedicated copy stream of the layers' device,
  after the work already enqueued on the current stream (so the KV being read was
  written). The returned ``CopyHandle`` wraps a ``torch.cuda.Event`` recorded behind
  the copy; the caller polls ``done()`` and must not touch the chunk or the blocks
  until then (or makes a stream wait: ``stream.wait_event(EventHandle.event)``). The
  layers must outlive the copy (they are the KV cache).
* CPU copies use ``torch.get_num_threads()`` OpenMP threads (one for copies under
  256 KiB). Called from a thread other than the one running the model, that is a
  second OpenMP team competing with the model's for the same cores; calling from the
  model's thread (between layers) reuses its idle team.

CUDA copy strategy (native backend only): ``memcpy`` (DMA engines, batched) or
``kernel`` (SMs reading/writing mapped pinned memory). ``auto`` takes
``DEFAULT_CUDA_STRATEGY`` per direction. NOTE: those defaults were not measured on a
GPU yet; ``benchmarks/gpu_check.sh`` measures both and prints which to choose.

Invariant: ``resolve_copy_backend("auto")`` logs each distinct fallback reason once to
``kvtier.ops``; ``native`` never falls back; a broken build always raises.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple, Protocol

import torch

from kvtier.hostmem import mem_available
from kvtier.ops import reference
from kvtier.ops.native import BUILD_HINT, NativeStatus, native_status

log = logging.getLogger("kvtier.ops")

CopyMode = Literal["auto", "native", "torch"]
CudaStrategy = Literal["auto", "memcpy", "kernel"]
Direction = Literal["gather", "scatter"]

#: Chosen per direction when ``cuda_strategy="auto"``. Unmeasured (see module docstring):
#: saves (gather) overlap the forward pass, so they use the DMA engines and leave the SMs
#: to the model; loads (scatter) sit on the critical path of a prefill and use the
#: kernel, which needs no per-block DMA setup for small blocks.
DEFAULT_CUDA_STRATEGY: dict[Direction, Literal["memcpy", "kernel"]] = {
    "gather": "memcpy",
    "scatter": "kernel",
}
_STRATEGY_CODE = {"memcpy": 1, "kernel": 2}  # kvtier::Strategy in native/ops_common.h


class NativeUnavailableError(RuntimeError):
    """``copy_backend: native`` was asked for but ``kvtier._C`` cannot serve it."""


class PinnedAlloc(NamedTuple):
    tensor: torch.Tensor  # 1-D uint8, page-aligned, pre-touched
    is_pinned: bool  # page-locked and mapped for CUDA


class CopyHandle(Protocol):
    """Completion of one gather/scatter."""

    def done(self) -> bool: ...

    def wait(self) -> None: ...


class DoneHandle:
    """A copy that completed before it was returned (all CPU copies)."""

    def done(self) -> bool:
        return True

    def wait(self) -> None:
        return None


@dataclass(frozen=True)
class EventHandle:
    """A CUDA copy; complete once ``event`` has been reached on the copy stream."""

    event: torch.cuda.Event

    def done(self) -> bool:
        return bool(self.event.query())  # type: ignore[no-untyped-call]

    def wait(self) -> None:
        self.event.synchronize()


DONE = DoneHandle()


class Kernels(Protocol):
    """The two op implementations: ``torch.ops.kvtier`` or ``kvtier.ops.reference``."""

    def gather(
        self, layers: Sequence[torch.Tensor], ids: torch.Tensor, dst: torch.Tensor,
        stream: int, strategy: int,
    ) -> None: ...

    def scatter(
        self, src: torch.Tensor, layers: Sequence[torch.Tensor], ids: torch.Tensor,
        stream: int, strategy: int,
    ) -> None: ...

    def alloc_pinned(self, nbytes: int) -> tuple[torch.Tensor, bool]: ...


class NativeKernels:
    def gather(self, layers: Sequence[torch.Tensor], ids: torch.Tensor, dst: torch.Tensor,
               stream: int, strategy: int) -> None:
        torch.ops.kvtier.gather_blocks(list(layers), ids, dst, stream, strategy)

    def scatter(self, src: torch.Tensor, layers: Sequence[torch.Tensor], ids: torch.Tensor,
                stream: int, strategy: int) -> None:
        torch.ops.kvtier.scatter_blocks(src, list(layers), ids, stream, strategy)

    def alloc_pinned(self, nbytes: int) -> tuple[torch.Tensor, bool]:
        tensor, pinned = torch.ops.kvtier.alloc_pinned(nbytes)
        return tensor, bool(pinned)


class TorchKernels:
    """The reference ops; they run on the current stream, so ``stream`` is unused."""

    def gather(self, layers: Sequence[torch.Tensor], ids: torch.Tensor, dst: torch.Tensor,
               stream: int, strategy: int) -> None:
        reference.gather_blocks(layers, ids, dst)

    def scatter(self, src: torch.Tensor, layers: Sequence[torch.Tensor], ids: torch.Tensor,
                stream: int, strategy: int) -> None:
        reference.scatter_blocks(src, layers, ids)

    def alloc_pinned(self, nbytes: int) -> tuple[torch.Tensor, bool]:
        return reference.alloc_pinned(nbytes)


@functools.cache
def copy_stream(device_index: int) -> torch.cuda.Stream:
    """The dedicated copy stream of one device (one per process and device)."""
    return torch.cuda.Stream(device=device_index)  # type: ignore[no-untyped-call]




def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


@dataclass(frozen=True)
class CopyBackend:
    """Gather/scatter/alloc over one implementation; see the module docstring."""

    name: Literal["native", "torch"]
    reason: str
    kernels: Kernels
    cuda_strategy: CudaStrategy = "auto"

    def gather(
        self, layers: Sequence[torch.Tensor], block_ids: torch.Tensor, dst: torch.Tensor
    ) -> CopyHandle:
        """Copies ``block_ids`` of every layer block view into ``dst`` (chunk layout)."""
        return self._launch(
            "gather", layers, dst,
            lambda stream, code: self.kernels.gather(layers, block_ids, dst, stream, code),
        )

    def scatter(
        self, src: torch.Tensor, layers: Sequence[torch.Tensor], block_ids: torch.Tensor
    ) -> CopyHandle:
        """Writes chunk ``src`` into ``block_ids`` of every layer block view."""
        return self._launch(
            "scatter", layers, src,
            lambda stream, code: self.kernels.scatter(src, layers, block_ids, stream, code),
        )

    def alloc_pinned(self, nbytes: int, *, hint: str | None = None) -> PinnedAlloc:
        """``nbytes`` of page-aligned, pre-touched host memory, pinned where CUDA is.

        Raises ``MemoryError`` with the sizes (and ``hint``, e.g. the setting to lower)
        when the memory is not there.
        """
        if nbytes <= 0:
            raise ValueError(f"alloc_pinned: nbytes must be > 0, got {nbytes}")
        avail = mem_available()
        suffix = f": {hint}" if hint else ""
        if avail is not None and nbytes > avail:
            raise MemoryError(
                f"alloc_pinned: cannot allocate {_gib(nbytes)} pinned host memory "
                f"(MemAvailable {_gib(avail)}){suffix}"
            )
        try:
            tensor, pinned = self.kernels.alloc_pinned(nbytes)
        except RuntimeError as e:
            if "alloc_pinned: cannot allocate" not in str(e):
                raise
            raise MemoryError(f"{e}{suffix}") from e
        return PinnedAlloc(tensor, pinned)

    def strategy_for(self, direction: Direction) -> Literal["memcpy", "kernel"]:
        if self.cuda_strategy == "auto":
            return DEFAULT_CUDA_STRATEGY[direction]
        return self.cuda_strategy

    def _launch(
        self, direction: Direction, layers: Sequence[torch.Tensor], chunk: torch.Tensor,
        run: Callable[[int, int], None],
    ) -> CopyHandle:
        device = layers[0].device if layers else chunk.device
        if device.type != "cuda":
            run(0, 0)
            return DONE
        index = device.index if device.index is not None else torch.cuda.current_device()
        stream = copy_stream(index)
        stream.wait_stream(torch.cuda.current_stream(index))
        with torch.cuda.stream(stream):
            run(stream.cuda_stream, _STRATEGY_CODE[self.strategy_for(direction)])
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(stream)
        if chunk.is_cuda:
            chunk.record_stream(stream)  # the caching allocator must not reuse it early
        return EventHandle(event)


@functools.cache
def _log_fallback(reason: str) -> None:
    log.info("copy_backend auto: using the torch reference ops: %s", reason)


def resolve_copy_backend(
    mode: CopyMode,
    *,
    cuda_strategy: CudaStrategy = "auto",
    native: NativeStatus | None = None,
) -> CopyBackend:
    """The backend for ``copy_backend: mode``.

    ``torch``: the reference ops. ``native``: ``kvtier._C``, or ``NativeUnavailableError``
    saying how to build it. ``auto``: native when usable for the devices present, else
    the reference (the reason logged once). ``native`` defaults to ``native_status()``;
    a broken build raises ``NativeBrokenError`` in every mode but ``torch``.
    """
    if mode not in ("auto", "native", "torch"):
        raise ValueError(f"copy_backend: unknown mode {mode!r} (auto, native or torch)")
    if cuda_strategy not in ("auto", "memcpy", "kernel"):
        raise ValueError(f"cuda_strategy: unknown {cuda_strategy!r} (auto, memcpy or kernel)")
    if mode == "torch":
        return CopyBackend("torch", "copy_backend=torch", TorchKernels(), cuda_strategy)
    status = native if native is not None else native_status()
    problem = None
    if not status.available:
        problem = status.detail
    elif torch.cuda.is_available() and not status.has_cuda:
        problem = f"kvtier._C was built without CUDA but CUDA is available; {BUILD_HINT}"
    if problem is None:
        return CopyBackend("native", status.detail, NativeKernels(), cuda_strategy)
    if mode == "native":
        raise NativeUnavailableError(f"copy_backend=native: {problem}")
    _log_fallback(problem)
    return CopyBackend("torch", problem, TorchKernels(), cuda_strategy)


@functools.cache
def default_backend() -> CopyBackend:
    """``resolve_copy_backend("auto")``, once per process."""
    return resolve_copy_backend("auto")
