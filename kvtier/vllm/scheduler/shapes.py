"""The model's shape, picked once: which start, loads and finish a request takes.

kvtier stores three shapes of KV (``geometry.Geometry``): whole chunks (full attention,
MLA; TP ranks packed per chunk), the window of a prefix (sliding-window attention in
every layer: ``window.py``), and a hybrid model's pieces, every KV-cache group's
(``hybrid.py``). Each shape has its own start of a lookup (``starts.py``), its own copy
ops once vLLM admits the restore (``load.py``) and its own save at the finish
(``finish.py``); ``Shape`` names them, and ``shape_of`` is the one place that reads the
geometry to choose. A hybrid model's loads are asynchronous (vLLM is told a failed one
per request); the others' are synchronous (a failed block is reported by block).

Built once at construction; called on vLLM's scheduler thread only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvtier.keys import ChunkKey
from kvtier.vllm.scheduler.records import _Staging

if TYPE_CHECKING:
    from kvtier.vllm.scheduler_side import SchedulerSide

#: (request, namespace digest, its chunk keys, vLLM's hit, token limit) -> its staging,
#: or the lookup hook's answer (``starts.py``)
Start = Callable[[Any, bytes, list[ChunkKey], int, int], _Staging | tuple[int | None, bool]]
#: (request id, its staging, block ids per KV-cache group, tokens vLLM took) (``load.py``)
Loads = Callable[[str, _Staging, Sequence[Sequence[int]], int], None]
#: (request, whole chunks, tail blocks, block ids, epoch first seen, restored by tier,
#: staging ms) -> ``request_finished``'s answer (``finish.py``)
Finish = Callable[[Any, int, int, Sequence[int], int, dict[str, int], float],
                  tuple[bool, dict[str, Any]]]
#: (request, block ids per KV-cache group) -> ``request_finished_groups``'s answer
FinishGroups = Callable[[Any, tuple[list[int], ...]], tuple[bool, dict[str, Any]]]


@dataclass(frozen=True)
class Shape:
    """One model shape's paths through the hooks."""

    name: str  # "chunks", "window" or "hybrid"
    start: Start
    loads: Loads
    finish: Finish
    finish_groups: FinishGroups
    #: its restores are asynchronous loads (vLLM reports a failed one per request)
    async_loads: bool


def shape_of(side: SchedulerSide) -> Shape:
    """``side``'s shape, from its geometry: the only branch on the model's shape in the
    scheduler side. (A hybrid model's single-group ``request_finished``, which vLLM
    never calls for it, saves chunks, as it always did.)"""
    if side.geom.groups:
        return Shape("hybrid", side._hybrid_start, side._hybrid_loads, side._chunk_finished,
                     side._hybrid_finished, async_loads=True)
    if side.geom.window:
        return Shape("window", side._window_start, side._window_restore,
                     side._window_finished, side._one_group_finished, async_loads=False)
    return Shape("chunks", side._chunk_start, side._chunk_loads, side._chunk_finished,
                 side._one_group_finished, async_loads=False)
