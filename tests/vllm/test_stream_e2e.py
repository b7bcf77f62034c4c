"""A host pool smaller than one conversation, on a real vLLM engine (issue 36): the
returning prompt is restored from the file tier through a window of a few host slots
(``kvtier/vllm/stream.py``: an asynchronous load whose chunks arrive over several engine
steps), and its output equals a full recompute's (fp32)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvtier.testing.engines import CompletionResult, LLMWorker, tokens
from tests.vllm.conftest import write_config

pytestmark = pytest.mark.vllm

EngineFactory = Callable[..., LLMWorker]

OUT = 16
CT = 128  # 64 KiB chunks of the tiny fp32 Llama: a 256 KiB pool is 4 slots, a cap of 2


def _kvtier(r: CompletionResult) -> dict[str, Any]:
    params: dict[str, Any] = r.kv_transfer_params or {}
    out: dict[str, Any] = params.get("kvtier", {})
    return out


@pytest.fixture(scope="module")
def small(engine_factory: EngineFactory, tiny_fp32: Path,
          tmp_path_factory: pytest.TempPathFactory) -> LLMWorker:
    store = tmp_path_factory.mktemp("stream-store")
    cfg = write_config(
        tmp_path_factory.mktemp("cfg") / "stream.yaml",
        [{"file": {"path": str(store), "capacity": "1GiB", "write": "through"}}],
        chunk_tokens=CT, reset_cache="host")
    doc = cfg.read_text().replace('"capacity": "64MiB"', '"capacity": "256KiB"')
    cfg.write_text(doc)
    return engine_factory(tiny_fp32, cfg, enable_prefix_caching=True)


def test_a_prompt_longer_than_the_host_pool_is_restored_whole(small: LLMWorker) -> None:
    p = tokens(1000, seed=97)  # 7 whole chunks and a tail, through 4 slots
    ref = small.generate([p], max_tokens=OUT, cache_salt=["ref-stream"]).outputs[0]
    assert _kvtier(ref).get("restored_tokens", 0) == 0
    # turns that grow by a chunk or two each: a save reserves a slot per new chunk at
    # once, so each turn stores what a 4-slot pool can take
    for n in (200, 400, 600, 800, 1000):
        small.generate([p[:n]], max_tokens=OUT)
        small.reset_until_done()  # host tier and vLLM's prefix cache emptied
    got = small.generate([p], max_tokens=OUT).outputs[0]
    assert _kvtier(got)["restored_tokens"] >= 7 * CT, _kvtier(got)
    assert set(_kvtier(got)["restored_by_tier"]) == {"file1"}
    assert got.token_ids == ref.token_ids


def test_one_turn_longer_than_the_host_pool_is_saved_whole(small: LLMWorker) -> None:
    """The save streams too (``_SaveStream``): one turn of 7 whole chunks through 4 host
    slots stores all of them (each step's copies are committed, written below and their
    slots reused), and the return restores them from the file tier."""
    p = tokens(1000, seed=131)
    ref = small.generate([p], max_tokens=OUT, cache_salt=["ref-save-stream"]).outputs[0]
    # the reference's own streamed save done and its slots free (on a loaded disk its
    # write-through still held them when the next turn finished: 1 chunk announced)
    small.reset_until_done()
    first = small.generate([p[:990]], max_tokens=OUT).outputs[0]
    assert _kvtier(first)["tokens"] >= 2 * CT  # announced as far as slots were free
    small.reset_until_done()
    got = small.generate([p], max_tokens=OUT).outputs[0]
    assert _kvtier(got)["restored_tokens"] >= 7 * CT, _kvtier(got)
    assert set(_kvtier(got)["restored_by_tier"]) == {"file1"}
    assert got.token_ids == ref.token_ids
