"""One engine step's chunk copies between the host pool and the KV cache, layer by layer.

``StepCopier`` is the worker's copy engine, free of vLLM so that the GPU check
(``benchmarks/gpu_worker_check.py``) drives exactly the code the connector runs. It
knows host slots (kvtier's chunk layout, ``kvtier/ops/layout.py``) and per-layer block
views; ``kvtier/vllm/worker_side.py`` maps vLLM's hooks onto it.

Loads (host slot -> KV blocks) are issued on one ``CopyBatch`` per step, in one of two
ways (``issue``), with one completion handle per layer either way:

* ``issue`` = an int ``k`` (CUDA's default, ``k`` = all layers): *per layer*. The chunk
  layout is layer-major ``(layer, outer, block, inner)``, so one layer's part of a slot
  is one contiguous piece (of a partial chunk, one piece per outer row); every op is
  scattered for layer 0, then layer 1, and so on, with a ``mark`` after each layer.
  ``LayerLoads.wait_layer(i)`` issues the layers up to ``i + k`` not yet issued, then
  orders layer ``i``'s copies before the work the caller enqueues next. On CUDA all of
  it is enqueued on the copy stream when the step starts and ``wait_layer(i)`` makes
  the compute stream wait for layer ``i``'s event (``stream_wait``), never the host, so
  layer ``i + 1`` is copied while layer ``i`` computes. ``k`` = 0 copies layer ``i``
  only inside ``wait_layer(i)``.
* ``issue`` = ``"whole"`` (the CPU default): each whole chunk is one copy of all its
  layers (a partial chunk still goes per layer: its blocks are strided across layers),
  everything when the step starts; every layer shares the one handle. Why on the CPU:
  a CPU copy completes on the calling thread, so nothing can overlap the forward, and
  per-layer copies only add calls and OpenMP barriers. Measured on this project's
  2-core machine, 10 two-block chunks of a 6-layer fp32 model (native ops): 0.43-0.52 ms
  whole (as fast as one call per chunk before layer-wise loads) vs 0.83-0.95 ms per
  layer (best of 400, two runs); while other processes loaded the cores, medians of
  7 ms per layer vs 1.1 ms whole (each barrier may wait for a descheduled thread).

The protocol, the bookkeeping and the failure paths are the same in both.

Saves (KV blocks -> host slot) are whole chunks of all layers, issued together on one
batch; each returns a handle the caller polls (the blocks must stay allocated and the
slot unread until it is done).

Invariants: ``finish()`` issues and orders every layer not yet waited, so once it
returns no work enqueued later can read a block whose load is pending; an op that fails
(bad slot or block ids) is skipped for its remaining layers and its block ids are
reported, never retried; the host pool and the views outlive the copies. Threads: one
thread (vLLM's model thread) calls everything here; ``done()`` may be polled anywhere.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

import torch

from kvtier.ops.backend import CopyHandle

log = logging.getLogger("kvtier.ops")


class ChunkCopy(Protocol):
    """One chunk's blocks: ``block_ids[i]`` is chunk block ``first + i`` of ``slot``
    (``kvtier.vllm.protocol.CopyOp`` is one). ``span`` is how many blocks the slot's
    chunk holds: 0 for a whole chunk, ``1 <= span < blocks_per_chunk`` for a partial
    tail (kvtier's chunk layout over ``span`` blocks, at the start of each rank's part;
    see ``StepCopier.slot``)."""

    @property
    def slot(self) -> int: ...

    @property
    def block_ids(self) -> list[int]: ...

    @property
    def first(self) -> int: ...

    @property
    def span(self) -> int: ...


class Batch(Protocol):
    """``kvtier.ops.backend.CopyBatch``: copies issued as one unit, one ``mark`` each."""

    def gather(
        self, layers: Sequence[torch.Tensor], block_ids: torch.Tensor, dst: torch.Tensor
    ) -> None: ...

    def scatter(
        self, src: torch.Tensor, layers: Sequence[torch.Tensor], block_ids: torch.Tensor
    ) -> None: ...

    def mark(self) -> CopyHandle: ...


class Batches(Protocol):
    """What opens batches: ``kvtier.ops.CopyBackend`` (tests pass a controllable one)."""

    def batch(self, device: torch.device) -> Batch: ...


#: How a step's loads are issued: layers ahead of the one waited for, or ``"whole"``.
Issue = int | Literal["whole"]


def default_issue(device: torch.device, num_layers: int) -> Issue:
    """Per layer, all at once, where a copy engine runs beside the model (CUDA); whole
    chunks where the copy runs on the model's thread (CPU)."""
    return num_layers if device.type == "cuda" else "whole"


class SaveFailed:
    """A save that raised when it was issued: nothing of it was enqueued after the error."""

    def __init__(self, error: Exception) -> None:
        self.error = error


@dataclass(frozen=True)
class StepCopier:
    """Copies between ``pool`` and the per-layer ``views``.

    ``views`` are ``KVLayout.block_view``s ``(outer, num_blocks, inner)`` of one dtype
    and shape; ``slot_bytes`` is this rank's part of a whole chunk (``blocks_per_chunk``
    blocks of every layer). A pool slot holds ``tp_world`` such parts, rank after rank:

    * a whole chunk: rank ``r``'s part is bytes ``[r * slot_bytes, (r + 1) * slot_bytes)``
      of the slot;
    * a partial tail of ``span`` blocks: each rank's part is ``span / blocks_per_chunk`` of
      that, and the parts are packed from the slot's start (rank ``r`` at
      ``r * part``), so the tail's payload is one contiguous prefix of the slot and
      nothing of an earlier chunk in the same slot is ever part of it.
    """

    backend: Batches
    views: Sequence[torch.Tensor]
    #: uint8 host memory, 1-D: slot after slot, each ``tp_world * slot_bytes``
    pool: torch.Tensor
    slot_bytes: int
    blocks_per_chunk: int
    issue: Issue
    tp_rank: int = 0
    tp_world: int = 1
    #: bytes from one pool slot to the next; 0: ``tp_world * slot_bytes`` (a hybrid
    #: model's smaller group uses the front of slots sized for its largest group)
    stride: int = 0

    @property
    def num_layers(self) -> int:
        return len(self.views)

    @property
    def device(self) -> torch.device:
        return self.views[0].device

    def span_of(self, op: ChunkCopy) -> int:
        """Blocks in ``op``'s slot: ``blocks_per_chunk``, or a tail's ``span``."""
        span = op.span or self.blocks_per_chunk
        if not 0 < span <= self.blocks_per_chunk:
            raise ValueError(f"a {span}-block span of a {self.blocks_per_chunk}-block chunk")
        return span

    def slot(self, slot: int, span: int = 0) -> torch.Tensor:
        """This rank's bytes of ``slot`` holding ``span`` blocks (0: a whole chunk)."""
        whole = self.stride or self.slot_bytes * self.tp_world
        if not 0 <= slot < self.pool.numel() // whole:
            raise IndexError(f"host slot {slot} is outside the pool")
        part = self.slot_bytes * (span or self.blocks_per_chunk) // self.blocks_per_chunk
        start = slot * whole + self.tp_rank * part
        return self.pool[start : start + part]

    def start_loads(self, ops: Sequence[ChunkCopy]) -> LayerLoads:
        """This step's loads, ordered after the work on the current stream; issues what
        ``issue`` says is issued at the start (see the module docstring)."""
        loads = LayerLoads(self, ops)
        if self.issue == "whole":
            loads.issue_whole()
        else:
            loads.issue_through(self.issue - 1)
        return loads

    def start_saves(self, ops: Sequence[ChunkCopy]) -> list[CopyHandle | SaveFailed]:
        """Gathers each op's blocks of every layer into its slot; one result per op.

        Issued in order on one batch, so an op's handle also covers the ops before it.
        An op must cover its whole span (``first == 0``; ``blocks_per_chunk`` blocks, or a
        tail's ``span``).
        """
        if not ops:
            return []
        batch = self.backend.batch(self.device)
        out: list[CopyHandle | SaveFailed] = []
        for op in ops:
            try:
                span = self.span_of(op)
                if op.first != 0 or len(op.block_ids) != span:
                    raise ValueError(
                        f"a save covers its whole span: blocks {op.first}.. of "
                        f"{len(op.block_ids)} in a {span}-block span"
                    )
                ids = torch.tensor(op.block_ids, dtype=torch.int64)
                batch.gather(self.views, ids, self.slot(op.slot, op.span))
                out.append(batch.mark())
            except Exception as e:
                out.append(SaveFailed(e))
        return out


class LayerLoads:
    """One step's loads, issued layer by layer; see the module docstring.

    Calls come from one thread: ``StepCopier.start_loads``, then ``wait_layer`` per layer
    in any order, then ``finish`` once. ``done()`` and ``failed_blocks()`` may follow.
    """

    def __init__(self, copier: StepCopier, ops: Sequence[ChunkCopy]) -> None:
        self._copier = copier
        self._ops = list(ops)
        self._ids = [torch.tensor(op.block_ids, dtype=torch.int64) for op in self._ops]
        self._failed = [False] * len(self._ops)
        self._handles: list[CopyHandle] = []  # one per issued layer, in layer order
        self._waited = [False] * copier.num_layers
        self._batch = copier.backend.batch(copier.device) if self._ops else None

    @property
    def empty(self) -> bool:
        return not self._ops

    def issue_through(self, layer: int) -> None:
        """Issues every layer up to ``layer`` (clamped to the last) not yet issued."""
        if self._batch is None:
            return
        last = min(layer, self._copier.num_layers - 1)
        while len(self._handles) <= last:
            self._issue(len(self._handles))

    def issue_whole(self) -> None:
        """Issues every op now, a whole chunk as one copy of all layers; one handle."""
        if self._batch is None or self._handles:
            return
        c = self._copier
        for k, op in enumerate(self._ops):
            if op.first != 0 or len(op.block_ids) != (op.span or c.blocks_per_chunk):
                for layer in range(c.num_layers):
                    self._scatter(k, layer)
                continue
            try:
                self._batch.scatter(c.slot(op.slot, op.span), c.views, self._ids[k])
            except Exception:
                self._fail(k, None)
        self._handles = [self._batch.mark()] * c.num_layers

    def issue_all(self) -> None:
        """Issues every layer not issued yet, and orders nothing after them: an
        asynchronous load, whose blocks no forward reads until ``done()`` (the compute
        stream must not wait for it: the step's logits and sampling would)."""
        self.issue_through(self._copier.num_layers - 1)

    def wait_layer(self, layer: int) -> None:
        """Layer ``layer``'s blocks are loaded before any work enqueued after this."""
        if self._batch is None:
            return
        issue = self._copier.issue
        if issue != "whole":
            self.issue_through(layer + issue)
        if not self._waited[layer]:
            self._waited[layer] = True
            self._handles[layer].stream_wait()

    def finish(self) -> list[int]:
        """Issues and orders every layer not waited for; returns those layers."""
        if self._batch is None:
            return []
        self.issue_through(self._copier.num_layers - 1)
        skipped = [i for i, w in enumerate(self._waited) if not w]
        for i in skipped:
            self._waited[i] = True
            self._handles[i].stream_wait()
        return skipped

    def done(self) -> bool:
        """Every layer issued and its copies complete (the host slots may be reused)."""
        if self._batch is None:
            return True
        return len(self._handles) == self._copier.num_layers and self._handles[-1].done()

    def block_ids(self) -> set[int]:
        """Every block this step loads into (each layer of each)."""
        return {b for op in self._ops for b in op.block_ids}

    def failed_ops(self) -> list[ChunkCopy]:
        """The ops whose copies failed (all of each op is then unusable)."""
        return [op for op, bad in zip(self._ops, self._failed, strict=True) if bad]

    def failed_blocks(self) -> set[int]:
        return {b for op, bad in zip(self._ops, self._failed, strict=True) if bad
                for b in op.block_ids}

    def _issue(self, layer: int) -> None:
        assert self._batch is not None
        for k in range(len(self._ops)):
            self._scatter(k, layer)
        self._handles.append(self._batch.mark())

    def _scatter(self, k: int, layer: int) -> None:
        """One layer of op ``k``, unless the op already failed."""
        assert self._batch is not None
        if self._failed[k]:
            return
        try:
            for src, view in self._pieces(self._ops[k], layer):
                self._batch.scatter(src, [view], self._ids[k])
        except Exception:
            self._fail(k, layer)

    def _fail(self, k: int, layer: int | None) -> None:
        op = self._ops[k]
        self._failed[k] = True
        if op.slot < 0:  # the scheduler's "fail this request's load": not an error here
            log.debug("kvtier: a load failed on purpose (slot %d)", op.slot)
            return
        log.exception("kvtier: load of slot %d into blocks %s failed (%s)", op.slot,
                      op.block_ids, "all layers" if layer is None else f"layer {layer}")

    def _pieces(self, op: ChunkCopy, layer: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(contiguous source bytes, 3-D block view) pairs covering one layer of ``op``."""
        c = self._copier
        n, bpc = len(op.block_ids), c.span_of(op)
        if op.first < 0 or op.first + n > bpc:
            raise ValueError(f"blocks {op.first}..{op.first + n} of a {bpc}-block chunk")
        # the slot first: a load failed on purpose (slot -1, the scheduler's "fail this
        # request's load") fails even when it names no block
        whole = c.slot(op.slot, op.span)
        if n == 0:
            return []
        view = c.views[layer]
        per_layer = whole.numel() // c.num_layers
        part = whole[layer * per_layer : (layer + 1) * per_layer]
        if n == bpc:
            return [(part, view)]
        rows = part.view(int(view.shape[0]), bpc, -1)  # (outer, block, inner bytes)
        if view.shape[0] == 1:
            return [(rows[0, op.first : op.first + n].reshape(-1), view)]
        return [(rows[o, op.first : op.first + n].reshape(-1), view[o : o + 1])
                for o in range(int(view.shape[0]))]
