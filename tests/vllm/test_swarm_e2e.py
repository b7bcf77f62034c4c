"""A swarm in real vLLM (issue 17): conversations that start at the same moment on one new
system prompt each keep their own KV; and ``reset_cache`` after a weight sync never serves
what was stored before.

One engine, tiny fp32 model, host tier only, vLLM's prefix cache off: every reuse comes
from kvtier. Every output is compared with a recompute (a fresh ``cache_salt`` shares no
key with anything).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvtier.testing.engines import CompletionResult, LLMWorker, tokens
from tests.vllm.conftest import write_config

pytestmark = pytest.mark.vllm

OUT = 24
CT = 256
BS = 128  # vLLM's CPU block size: a conversation's tail is stored down to it
N = 4


def _kvtier(r: CompletionResult) -> dict[str, Any]:
    params: dict[str, Any] = (r.kv_transfer_params or {}).get("kvtier", {})
    return params


@pytest.fixture(scope="module")
def engine(engine_factory: Callable[..., LLMWorker], tiny_fp32: Path,
           tmp_path_factory: pytest.TempPathFactory) -> LLMWorker:
    cfg = write_config(tmp_path_factory.mktemp("cfg") / "swarm.yaml", [], chunk_tokens=CT)
    return engine_factory(tiny_fp32, cfg, enable_prefix_caching=False)


def _reference(engine: LLMWorker, prompt: list[int], salt: str) -> list[int]:
    r = engine.generate([prompt], max_tokens=OUT, cache_salt=[salt]).outputs[0]
    assert _kvtier(r)["restored_tokens"] == 0
    return r.token_ids


def test_a_swarm_on_a_new_prefix_keeps_every_conversations_own_chunks(
    engine: LLMWorker,
) -> None:
    system = tokens(600, seed=901)  # new: nothing stored has it
    prompts = [system + tokens(600, seed=910 + i) for i in range(N)]
    # All N in one batch: same length, same output length, so they finish in one step.
    first = engine.generate(prompts, max_tokens=OUT).outputs
    for r in first:  # whole chunks, then the tail's full blocks
        assert _kvtier(r)["tokens"] == (len(prompts[0]) + OUT - 1) // BS * BS
    for i, (p, r) in enumerate(zip(prompts, first, strict=True)):
        back = p + r.token_ids + tokens(50, seed=920 + i)  # the conversation returns
        ref = _reference(engine, back, f"swarm-ref-{i}")
        got = engine.generate([back], max_tokens=OUT).outputs[0]
        own = (len(p) + OUT - 1) // BS * BS  # every full chunk and block it stored
        assert _kvtier(got)["restored_tokens"] == own, f"conversation {i}"
        assert got.token_ids == ref, f"conversation {i}"


def test_after_a_weights_reset_nothing_stored_before_is_served(engine: LLMWorker) -> None:
    p = tokens(900, seed=931)
    engine.generate([p], max_tokens=OUT)
    again = engine.generate([p], max_tokens=OUT).outputs[0]
    assert _kvtier(again)["restored_tokens"] >= 768  # stored and served
    assert engine.reset_prefix_cache(reset_connector=True)  # an RL trainer's weight sync
    after = engine.generate([p], max_tokens=OUT).outputs[0]
    assert _kvtier(after)["restored_tokens"] == 0
    assert after.token_ids == again.token_ids
    # what the new epoch stores is served again
    assert _kvtier(engine.generate([p], max_tokens=OUT).outputs[0])["restored_tokens"] >= 768
