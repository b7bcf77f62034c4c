"""Copy backends: one object with gather/scatter/alloc_pinned over native or torch kernels.

A ``CopyBackend`` is chosen once (``resolve_copy_backend``) and then routes every call:

* CPU layers: the copy runs on the calling thread and is complete on return; the
  returned handle is already done.
* CUDA layers: the copy is enqueued on a dedicated copy stream of the layers' device,
  after the work already enqueued on the current stream (so the KV being read was
  written). The returned ``CopyHandle`` wraps a ``torch.cuda.Event`` recorded behind
  the copy; the caller polls ``done()`` and must not touch the chunk or the blocks
  until then, or orders later GPU work after it with ``stream_wait()`` (no host sync).
  The layers must outlive the copy (they are the KV cache).
* Several copies issued as one unit: ``CopyBackend.batch(device)`` is ordered once,
  when it is opened, after the current stream's work; ``mark()`` returns a handle that
  completes when everything issued on the batch so far has (one event, not one per
  copy). Copies issued on a batch later, e.g. between layers of the forward pass, are
  *not* ordered after compute enqueued since the batch was opened: that is what lets a
  layer's load overlap the previous layer's compute. ``gather``/``scatter`` are a
  batch of one.
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
    """Completion of one gather/scatter (or of a batch up to a ``mark``).

    ``done()`` polls without blocking; ``wait()`` blocks the calling thread;
    ``stream_wait()`` makes work enqueued later on the calling thread's current CUDA
    stream wait for the copy, without blocking the host (a no-op for a copy that is
    already complete). Any thread may poll; ``stream_wait`` belongs to the thread that
    enqueues the work that reads the copied bytes.
    """

    def done(self) -> bool: ...

    def wait(self) -> None: ...

    def stream_wait(self) -> None: ...


class DoneHandle:
    """A copy that completed before it was returned (all CPU copies)."""

    def done(self) -> bool:
        return True

    def wait(self) -> None:
        return None

    def stream_wait(self) -> None:
        return None


class BothHandles:
    """Done when both handles are (one request's saves on two KV-cache groups' batches)."""

    def __init__(self, a: CopyHandle, b: CopyHandle) -> None:
        self._a, self._b = a, b

    def done(self) -> bool:
        return self._a.done() and self._b.done()

    def wait(self) -> None:
        self._a.wait()
        self._b.wait()

    def stream_wait(self) -> None:
        self._a.stream_wait()
        self._b.stream_wait()


@dataclass(frozen=True)
class EventHandle:
    """A CUDA copy; complete once ``event`` has been reached on the copy stream."""

    event: torch.cuda.Event
    device: int

    def done(self) -> bool:
        return bool(self.event.query())  # type: ignore[no-untyped-call]

    def wait(self) -> None:
        self.event.synchronize()

    def stream_wait(self) -> None:
        torch.cuda.current_stream(self.device).wait_event(self.event)


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


class CopyBatch:
    """Copies issued as one unit on one device; see the module docstring.

    CPU: each copy runs on the calling thread and is complete when the call returns;
    ``mark()`` is ``DONE``. CUDA: opening the batch makes the copy stream wait for the
    work already on the current stream; each copy is then enqueued on the copy stream,
    and ``mark()`` records an event behind everything issued so far. A copy whose
    arguments are wrong raises at the call, on every device, and enqueues nothing.

    Invariant: one thread issues on a batch (it is not locked); handles may be polled
    from anywhere.
    """

    def __init__(self, backend: CopyBackend, device: torch.device) -> None:
        self._backend = backend
        self._stream: torch.cuda.Stream | None = None
        self._device = 0
        if device.type == "cuda":
            self._device = device.index if device.index is not None else (
                torch.cuda.current_device())
            self._stream = copy_stream(self._device)
            self._stream.wait_stream(torch.cuda.current_stream(self._device))

    def gather(
        self, layers: Sequence[torch.Tensor], block_ids: torch.Tensor, dst: torch.Tensor
    ) -> None:
        """Copies ``block_ids`` of every layer block view into ``dst`` (chunk layout)."""
        k = self._backend.kernels
        self._run("gather", dst, lambda s, c: k.gather(layers, block_ids, dst, s, c))

    def scatter(
        self, src: torch.Tensor, layers: Sequence[torch.Tensor], block_ids: torch.Tensor
    ) -> None:
        """Writes chunk ``src`` into ``block_ids`` of every layer block view."""
        k = self._backend.kernels
        self._run("scatter", src, lambda s, c: k.scatter(src, layers, block_ids, s, c))

    def mark(self) -> CopyHandle:
        """A handle that completes once every copy issued so far has."""
        if self._stream is None:
            return DONE
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(self._stream)
        return EventHandle(event, self._device)

    def _run(self, direction: Direction, chunk: torch.Tensor,
             run: Callable[[int, int], None]) -> None:
        if self._stream is None:
            run(0, 0)
            return
        code = _STRATEGY_CODE[self._backend.strategy_for(direction)]
        with torch.cuda.stream(self._stream):
            run(self._stream.cuda_stream, code)
        if chunk.is_cuda:
            chunk.record_stream(self._stream)  # the caching allocator must not reuse it early


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
        batch = self.batch(layers[0].device if layers else dst.device)
        batch.gather(layers, block_ids, dst)
        return batch.mark()

    def scatter(
        self, src: torch.Tensor, layers: Sequence[torch.Tensor], block_ids: torch.Tensor
    ) -> CopyHandle:
        """Writes chunk ``src`` into ``block_ids`` of every layer block view."""
        batch = self.batch(layers[0].device if layers else src.device)
        batch.scatter(src, layers, block_ids)
        return batch.mark()

    def batch(self, device: torch.device) -> CopyBatch:
        """A ``CopyBatch`` on ``device`` (the KV cache's), ordered after the current
        stream's work as of now."""
        return CopyBatch(self, device)

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
