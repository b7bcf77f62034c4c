"""Driving the scheduler side's lookup hook as vLLM does, without an engine."""

from __future__ import annotations

import time
from concurrent.futures import Future
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

from kvtier.build import build_store
from kvtier.clock import ManualClock
from kvtier.config import KVTierConfig
from kvtier.keys import Namespace
from kvtier.vllm.geometry import Geometry
from kvtier.vllm.scheduler_side import PROBE_INTERVAL_S, SchedulerSide


class Blocks:
    """vLLM's ``KVCacheBlocks`` as the scheduler side reads it: one group's block ids."""

    def __init__(self, ids: list[int]) -> None:
        self.ids = ids

    def get_block_ids(self) -> tuple[list[int]]:
        return (self.ids,)


def ask(sched: SchedulerSide, req: SimpleNamespace, num_computed: int = 0) -> int | None:
    """One scheduler step's question, once the IO work it started (a probe of the lower
    tiers, then staging) has finished. With a ManualClock a step is ``PROBE_INTERVAL_S``."""
    if isinstance(sched.clock, ManualClock):
        sched.clock.advance(PROBE_INTERVAL_S)
    n: int | None = None
    for _ in range(6):  # a probe of the chunks, one of the tail, the staging
        n, _ = sched.get_num_new_matched_tokens(req, num_computed)
        probes = [p for p in (sched._probes.get(req.request_id),
                              sched._tail_probes.get(req.request_id)) if p is not None]
        lk = sched._lookups.get(req.request_id)
        futures: list[Future[Any] | None] = [*(p.future for p in probes),
                                             lk.future if lk else None]
        pending = [f for f in futures if f is not None and not f.done()]
        if n is not None or not pending:
            return n
        for f in pending:
            f.exception()  # IO threads: let them finish, then ask again
    return n


#: A hook "returns at once" within this: generous for a shared 2-core machine, far below
#: any storage wait the hung-tier tests provoke.
HOOK_BUDGET_S = 0.05


def request_of(rid: str, seed: int, chunk_tokens: int, chunks: int = 3) -> SimpleNamespace:
    """A request as the scheduler side sees it: ``chunks`` full chunks of random tokens
    (from ``seed``) and a partial one."""
    toks = list(np.random.default_rng(seed).integers(3, 500, chunks * chunk_tokens + 7))
    return SimpleNamespace(request_id=rid, num_tokens=len(toks), all_token_ids=toks,
                           kv_transfer_params=None, cache_salt=None, lora_request=None,
                           mm_features=None, prompt_embeds=None, num_computed_tokens=0)


def at_once(fn: Any, *args: Any) -> Any:
    """``fn(*args)``, asserting it returned within ``HOOK_BUDGET_S`` (waited on nothing)."""
    t0 = time.perf_counter()
    out = fn(*args)
    assert time.perf_counter() - t0 < HOOK_BUDGET_S, f"{fn.__name__} waited on storage"
    return out


def through_sched(tmp_path: Path, geom: Geometry, ns: Namespace, chunk_tokens: int,
                  **extra: Any) -> SchedulerSide:
    """A scheduler side over a 1 MiB host tier and a write-through file tier in
    ``tmp_path`` that restores anything (threshold 1 token), on a ManualClock; ``extra``
    goes into its config."""
    cfg = KVTierConfig.model_validate({
        "chunk_tokens": chunk_tokens,
        "tiers": [{"host": {"capacity": "1MiB", "pinned": "no"}},
                  {"file": {"path": str(tmp_path), "capacity": "1GiB", "write": "through"}}],
        "restore": {"recompute_threshold_tokens": 1},
        **extra,
    })
    store = build_store(cfg, geom.chunk_bytes(chunk_tokens))
    return SchedulerSide(cfg, geom, ns, None, store=store, clock=ManualClock())


def request_record(rid: str, tokens: list[int], computed: int | None = None) -> SimpleNamespace:
    """A request with ``tokens`` as the scheduler side reads it; ``computed`` tokens
    (default: all but the last, as at its finish)."""
    return SimpleNamespace(
        request_id=rid, num_tokens=len(tokens), all_token_ids=tokens,
        num_computed_tokens=len(tokens) - 1 if computed is None else computed,
        kv_transfer_params=None, cache_salt=None, lora_request=None,
        mm_features=None, prompt_embeds=None)


def small_pool_sched(tmp_path: Path, geom: Geometry, ns: Namespace, chunk_tokens: int,
                     slots: int) -> SchedulerSide:
    """A scheduler side over a host pool of ``slots`` chunks and a write-back file tier
    in ``tmp_path`` that restores anything (threshold 1 token), without partial tails or
    idle flushes, on a ManualClock."""
    cfg = KVTierConfig.model_validate({
        "chunk_tokens": chunk_tokens,
        "tiers": [{"host": {"capacity": slots * geom.chunk_bytes(chunk_tokens),
                            "pinned": "no"}},
                  {"file": {"path": str(tmp_path), "capacity": "1GiB", "write": "back"}}],
        "restore": {"recompute_threshold_tokens": 1},
        "idle_flush_seconds": 0, "max_dirty_seconds": 0, "partial_tails": False,
    })
    return SchedulerSide(cfg, geom, ns, None,
                         store=build_store(cfg, geom.chunk_bytes(chunk_tokens)),
                         clock=ManualClock())
