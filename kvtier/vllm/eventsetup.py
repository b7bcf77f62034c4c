"""KV events wired to vLLM and to a scheduler side: how a store's tiers are published
(``tier_media``), what vLLM says of each KV-cache group (``group_meta``), vLLM's
per-block extra keys (``extra_keys``), the events of a scheduler side (``events_for``),
and waking an idle engine so events observed off the scheduler thread leave
(``engine_waker``).

Threads: ``events_for`` and ``engine_waker`` run once, where the connector is built
(vLLM's engine-core process, the scheduler's thread); the waker they return may be
called from any thread (it never blocks). ``extra_keys`` on the scheduler thread.
"""

from __future__ import annotations

import logging
import queue
import sys
from collections.abc import Callable, Sequence
from typing import Any

from kvtier.vllm.events import (
    LOCAL,
    MEDIUM_CPU,
    MEDIUM_STORAGE,
    REMOTE,
    GroupMeta,
    KVEvents,
    Medium,
)

log = logging.getLogger("kvtier.vllm.events")


def events_for(sched: Any, kv_cache_config: Any) -> KVEvents:
    """The KV events of a scheduler side (``SchedulerSide``), hooked to its store, with
    each KV-cache group's kind and sliding window as vLLM publishes them
    (``group_meta``)."""
    geom = sched.geom
    full: list[int] | None = None
    if geom.groups:
        from kvtier.vllm.hybrid import full_groups

        full = full_groups(geom)
    store = sched.store
    ev = KVEvents(tier_media([t.name for t in store.tiers]), block_size=sched.bs,
                  blocks_per_chunk=sched.bpc, chunk_tokens=sched.ct,
                  groups=group_meta(kv_cache_config), full_groups=full,
                  max_chunks=sched.cfg.events.max_chunks,
                  max_payloads=sched.cfg.events.max_payload_chunks)
    ev.attach(store.host.index, [lt.tier for lt in store.lower])
    log.info("kvtier: KV events on: host as CPU, %s as STORAGE; at most %d pieces claimed%s",
             ", ".join(lt.tier.name for lt in store.lower) or "no lower tier", ev.max_chunks,
             f"; {len(geom.groups)} KV-cache groups" if geom.groups else "")
    return ev


def group_meta(kv_cache_config: Any) -> list[GroupMeta]:
    """Each KV-cache group's kind and sliding window, as vLLM's ``KVCacheManager`` sets
    them on its store events (``get_kv_cache_spec_kind``, ``..._sliding_window``); one
    group of unknown kind without a config."""
    try:
        from vllm.v1.kv_cache_interface import (
            get_kv_cache_spec_kind,
            get_kv_cache_spec_sliding_window,
        )

        return [GroupMeta(get_kv_cache_spec_kind(g.kv_cache_spec).value,
                          get_kv_cache_spec_sliding_window(g.kv_cache_spec))
                for g in kv_cache_config.kv_cache_groups]
    except (ImportError, AttributeError):
        return []


def tier_media(names: Sequence[str]) -> list[Medium]:
    """How a store's tiers are published: the host (``names[0]``) as this node's ``CPU``,
    every lower tier as shared ``STORAGE`` owned by its name."""
    return [Medium(MEDIUM_CPU, LOCAL, None),
            *(Medium(MEDIUM_STORAGE, REMOTE, n) for n in names[1:])]


def extra_keys(request: Any, start: int, block_size: int,
                blocks: int) -> list[tuple[Any, ...] | None] | None:
    """vLLM's per-block ``extra_keys`` for the blocks from token ``start`` on, as its GPU
    events carry them (None where vLLM's helpers are not there: a plain request object)."""
    try:
        from vllm.v1.core.kv_cache_utils import (
            generate_block_hash_extra_keys,
            to_event_extra_keys,
        )
    except ImportError:  # pragma: no cover - vLLM is a dependency
        return None
    if not hasattr(request, "mm_features"):
        return None
    keys: list[tuple[Any, ...] | None] = []
    mm = 0
    for b in range(blocks):
        lo = start + b * block_size
        extra, mm = generate_block_hash_extra_keys(request, lo, lo + block_size, mm)
        keys.append(extra)
    return to_event_extra_keys(keys)


def engine_waker(frame_depth: int = 64) -> Callable[[], None] | None:
    """A callable that wakes vLLM's idle engine core, or None where there is none to wake.

    vLLM 0.32's busy loop (``EngineCoreProc._process_input_queue``) asks
    ``has_work()`` (with it the connector's ``has_pending_push_work``) only before it
    blocks on its input queue; once blocked, only a request wakes it. So an event
    observed off the scheduler thread while the engine is idle (a lower-tier write
    finishing late, the idle flush's writes, a walk or collection noticing an expiry)
    would wait for the next request. The waker puts vLLM's own no-op request
    (``EngineCoreRequestType.WAKEUP``, what vLLM's shutdown path sends) on that queue:
    the loop wakes, sees the connector's pending events, steps once and publishes them.

    vLLM has no API for this: the queue is found on the call stack that builds the
    connector (``EngineCoreProc.__init__`` sets ``input_queue`` before it builds the
    scheduler, and with it this connector). Call it from the connector's constructor.
    None where not found (an in-process engine, another vLLM): events then leave at
    the next engine step. The waker never blocks (an unbounded ``queue.Queue``)."""
    q = _engine_input_queue(frame_depth)
    if q is None:
        return None
    from vllm.v1.engine import EngineCoreRequestType

    wakeup = (EngineCoreRequestType.WAKEUP, None)

    def wake() -> None:
        q.put_nowait(wakeup)

    return wake


def _engine_input_queue(depth: int) -> queue.Queue[Any] | None:
    """The ``input_queue`` of the vLLM engine core whose constructor is on the caller's
    stack (at most ``depth`` frames up)."""
    frame = sys._getframe(1)
    for _ in range(depth):
        if frame is None:
            return None
        owner = frame.f_locals.get("self")
        q = getattr(owner, "input_queue", None)
        if isinstance(q, queue.Queue) and "EngineCore" in type(owner).__name__:
            return q
        frame = frame.f_back  # type: ignore[assignment]
    return None

