"""Scheduler side of the connector: keys, lookups, load and save decisions. No bytes.

Runs in vLLM's engine-core process, next to the scheduler. It owns the ``TieredStore``
(index, lower tiers, IO threads); the host pool's bytes are shared with the worker.

Request life cycle:

1. ``get_num_new_matched_tokens``: hash the request's tokens into chunk keys, look up
   the stored prefix beyond vLLM's own hit, and start ``store.load`` on that lookup
   (lower-tier hits are promoted into host slots on IO threads, from the tier the lookup
   named). Until that finishes it answers ``None`` ("ask again"), so the scheduler loop
   never waits on storage. When it is done the chunks are *held* (never evicted while
   held) and it answers the exact token count (or 0 below the threshold).
2. ``update_state_after_alloc``: turn the held chunks into per-chunk ``CopyOp``s onto
   the request's new blocks; they go out with this step's metadata and the worker
   copies them before the forward pass.
3. The worker reports the step done (worker metadata); the holds are released.
4. ``request_finished`` (the eviction hook): the chunks of prompt *and* output not yet
   stored get host slots reserved by key; the request's blocks stay allocated
   (delay-free) until the worker reports the copies done (``finished_sending``), then
   the slots are committed with the chunks' metas and cascade to the lower tiers.

P/D roles (``role: prefill | decode``): the KV moves through a write-through shared tier.
A decode request's ``kv_transfer_params["kvtier"]["expect"]`` names what the prefill node
announced (``tokens``, ``last_key``); step 1 then answers ``None`` until those chunks are
visible, or ``restore.wait_seconds`` pass (then it takes what is there and computes the
rest). An announcement whose last key does not match this prompt's own chunk key is
ignored: keys are content hashes, so a mismatch means a different prompt, never a wait.

Invariants: a chunk is never saved twice (lookup before reserve); a load covers only
chunks whose bytes are held in host memory; whatever fails, vLLM recomputes.

Where each step lives: ``kvtier.vllm.scheduler``, one module per job (its package
docstring and ``docs/architecture.md`` map them), every room a mixin over one per-engine
state whose docstring (``scheduler/state.py``) states the thread rules.
"""

from __future__ import annotations

from kvtier.vllm.scheduler.finish import Finish
from kvtier.vllm.scheduler.lookup import Lookups
from kvtier.vllm.scheduler.records import PROBE_INTERVAL_S, STAGED_STEPS
from kvtier.vllm.scheduler.shapes import Shape, shape_of
from kvtier.vllm.scheduler.shutdown import Shutdown
from kvtier.vllm.scheduler.steps import Steps

__all__ = ["PROBE_INTERVAL_S", "STAGED_STEPS", "SchedulerSide"]


class SchedulerSide(Lookups, Steps, Finish, Shutdown):
    """The connector's scheduler side: every room of ``kvtier.vllm.scheduler`` over one
    state. The class the connector and tests use."""

    def _shape(self) -> Shape:
        return shape_of(self)
