"""What the scheduler side tells the worker side each step, and what comes back.

Plain dataclasses of ints and strings, so they survive any of vLLM's serialisers.
A ``CopyOp`` moves the blocks of one chunk: ``block_ids[i]`` is chunk block
``first + i``; its bytes are in host slot ``slot`` (kvtier's chunk layout,
``kvtier/ops/layout.py``). ``span`` is 0 for a whole chunk, or the block count of a
partial tail (a chunk's first ``span`` blocks, packed at the slot's start:
``kvtier.ops.stepcopy.StepCopier``). ``group`` is the KV-cache group whose layers and
block table the op copies (a hybrid model's; 0 otherwise).

A hybrid model's loads are asynchronous (``KVTierMetadata.async_loads``), and so is a
restore streamed through a bounded window of host slots (``KVTierMetadata.async_reqs``,
``kvtier/vllm/stream.py``): vLLM holds the requests in ``WAITING_FOR_REMOTE_KVS`` until
the worker reports each one received (or failed: vLLM cannot map a block-level error to a
request when there are several groups, and recomputes the request). A streamed request's
loads arrive over several steps: while its id is in ``KVTierMetadata.more``, more of its
loads follow, and the worker does not report it received.

A save streamed through the host pool (``Saves._save_pieces`` in
``kvtier/vllm/scheduler/save.py``: a finishing request
with more new chunks than the pool has free slots) goes the same way in the other
direction: its copies arrive over several steps while its id is in
``KVTierMetadata.saves_more`` (the worker does not report it finished sending, so vLLM
keeps its blocks), and the saves of a request in ``KVTierMetadata.saves_acked`` are
acknowledged per step (``KVTierWorkerMetadata.saved_steps``), so the scheduler commits
each step's slots as soon as they are copied and they can be written below and reused.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)


@dataclass
class CopyOp:
    req_id: str
    slot: int
    block_ids: list[int]
    first: int = 0
    span: int = 0
    group: int = 0


@dataclass
class KVTierMetadata(KVConnectorMetadata):
    step: int = 0
    loads: list[CopyOp] = field(default_factory=list)  # host slot -> KV cache, this step
    saves: list[CopyOp] = field(default_factory=list)  # KV cache -> host slot, this step
    #: the loads are of requests vLLM holds until the worker reports them received
    async_loads: bool = False
    #: requests whose loads this step are asynchronous although ``async_loads`` is
    #: False (streamed restores of a one-group model)
    async_reqs: list[str] = field(default_factory=list)
    #: asynchronously loading requests whose loads continue in a later step
    more: list[str] = field(default_factory=list)
    #: requests whose saves in this step are acknowledged per step (streamed saves)
    saves_acked: list[str] = field(default_factory=list)
    #: requests whose saves continue in a later step (not finished sending yet)
    saves_more: list[str] = field(default_factory=list)


@dataclass
class KVTierWorkerMetadata(KVConnectorWorkerMetadata):
    """Steps whose loads the worker finished, saves that failed, and the step this
    output belongs to (``KVTierMetadata.step`` of the step the worker ran; 0: none ran),
    by which the scheduler pairs an output with the step it timed.

    At TP > 1 vLLM folds the ranks' metadata with ``aggregate`` into one per step and
    counts nothing: ``loaded_steps`` is a multiset (a step appears once per rank that
    finished its loads; the scheduler releases the step's host slots only once it has
    counted every rank, over as many outputs as that takes), ``failed_saves`` a union
    (the scheduler keeps a failure until vLLM reports that request's save finished on
    every rank).

    ``saved_steps`` and ``failed_save_steps`` (multisets, like ``loaded_steps``): steps
    whose per-step acknowledged saves (``KVTierMetadata.saves_acked``) this rank finished
    copying, all of them, or with at least one failure. A step is settled once every rank
    reported it in one list or the other; failed if any rank failed it."""

    loaded_steps: list[int] = field(default_factory=list)
    failed_saves: list[str] = field(default_factory=list)
    step: int = 0
    saved_steps: list[int] = field(default_factory=list)
    failed_save_steps: list[int] = field(default_factory=list)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, KVTierWorkerMetadata)
        return KVTierWorkerMetadata(
            sorted(self.loaded_steps + other.loaded_steps),
            sorted(set(self.failed_saves) | set(other.failed_saves)),
            max(self.step, other.step),
            sorted(self.saved_steps + other.saved_steps),
            sorted(self.failed_save_steps + other.failed_save_steps),
        )
