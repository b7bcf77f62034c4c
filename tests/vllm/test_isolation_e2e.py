"""Isolation in real vLLM, two engines started side by side (each start costs 15-45 s of
mostly single-threaded imports), tiny fp32 model, vLLM's own prefix cache off on both, so
every reuse here is kvtier's:

* **A swarm** (issue 17), host tier only: conversations that start at the same moment on
  one new system prompt each keep their own KV; and ``reset_cache`` after a weight sync
  never serves what was stored before. Every output is compared with a recompute (a
  fresh ``cache_salt`` shares no key with anything).
* **LoRA**, host and write-through file tier: KV is restored within one adapter and never
  across adapters. An adapter changes the K and V projections, so KV computed under
  adapter A is wrong for adapter B and for the base model, although the token ids are
  the same.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvtier.testing.engines import CompletionResult, LLMWorker, LoRA, tokens
from kvtier.testing.models import build_lora_adapter
from tests.vllm.conftest import EngineFactory, write_config

pytestmark = pytest.mark.vllm

OUT = 24
CT = 256
BS = 128  # vLLM's CPU block size: a conversation's tail is stored down to it
N = 4


@pytest.fixture(scope="module")
def engines(engine_factory: EngineFactory, tiny_fp32: Path,
            tmp_path_factory: pytest.TempPathFactory) -> list[LLMWorker]:
    cfg = tmp_path_factory.mktemp("cfg")
    store = tmp_path_factory.mktemp("lora-store")
    return engine_factory.side_by_side(
        (tiny_fp32, write_config(cfg / "swarm.yaml", [], chunk_tokens=CT),
         {"enable_prefix_caching": False}),
        (tiny_fp32, write_config(
            cfg / "lora.yaml",
            [{"file": {"path": str(store), "capacity": "1GiB", "write": "through"}}]),
         {"enable_prefix_caching": False, "enable_lora": True, "max_lora_rank": 8,
          "max_loras": 2}))


@pytest.fixture(scope="module")
def swarm_engine(engines: list[LLMWorker]) -> LLMWorker:
    return engines[0]


@pytest.fixture(scope="module")
def lora_engine(engines: list[LLMWorker]) -> LLMWorker:
    return engines[1]


# -- a swarm ------------------------------------------------------------------------------

def _kvtier(r: CompletionResult) -> dict[str, Any]:
    params: dict[str, Any] = (r.kv_transfer_params or {}).get("kvtier", {})
    return params


def _reference(engine: LLMWorker, prompt: list[int], salt: str) -> list[int]:
    r = engine.generate([prompt], max_tokens=OUT, cache_salt=[salt]).outputs[0]
    assert _kvtier(r)["restored_tokens"] == 0
    return r.token_ids


def test_a_swarm_on_a_new_prefix_keeps_every_conversations_own_chunks(
    swarm_engine: LLMWorker,
) -> None:
    system = tokens(600, seed=901)  # new: nothing stored has it
    prompts = [system + tokens(600, seed=910 + i) for i in range(N)]
    # All N in one batch: same length, same output length, so they finish in one step.
    first = swarm_engine.generate(prompts, max_tokens=OUT).outputs
    for r in first:  # whole chunks, then the tail's full blocks
        assert _kvtier(r)["tokens"] == (len(prompts[0]) + OUT - 1) // BS * BS
    for i, (p, r) in enumerate(zip(prompts, first, strict=True)):
        back = p + r.token_ids + tokens(50, seed=920 + i)  # the conversation returns
        ref = _reference(swarm_engine, back, f"swarm-ref-{i}")
        got = swarm_engine.generate([back], max_tokens=OUT).outputs[0]
        own = (len(p) + OUT - 1) // BS * BS  # every full chunk and block it stored
        assert _kvtier(got)["restored_tokens"] == own, f"conversation {i}"
        assert got.token_ids == ref, f"conversation {i}"


def test_after_a_weights_reset_nothing_stored_before_is_served(swarm_engine: LLMWorker) -> None:
    p = tokens(900, seed=931)
    swarm_engine.generate([p], max_tokens=OUT)
    again = swarm_engine.generate([p], max_tokens=OUT).outputs[0]
    assert _kvtier(again)["restored_tokens"] >= 768  # stored and served
    # an RL trainer's weight sync; vLLM refuses while the save just finished still holds
    # its blocks (the delayed free), so it is asked again until it takes
    swarm_engine.reset_until_done()
    after = swarm_engine.generate([p], max_tokens=OUT).outputs[0]
    assert _kvtier(after)["restored_tokens"] == 0
    assert after.token_ids == again.token_ids
    # what the new epoch stores is served again
    assert _kvtier(swarm_engine.generate([p], max_tokens=OUT).outputs[0])["restored_tokens"] >= 768


# -- LoRA --------------------------------------------------------------------------------
def restored(engine: LLMWorker, prompt: list[int], lora: LoRA | None,
             salt: str | None = None) -> tuple[int, list[int]]:
    r = engine.generate([prompt], max_tokens=OUT, lora=[lora],
                        cache_salt=None if salt is None else [salt]).outputs[0]
    params: dict[str, Any] = r.kv_transfer_params or {}
    return int(params.get("kvtier", {}).get("restored_tokens", 0)), r.token_ids


@pytest.fixture(scope="module")
def adapters(tiny_fp32: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, LoRA]:
    root = tmp_path_factory.mktemp("lora")
    a = build_lora_adapter(root / "a", tiny_fp32, seed=1)
    b = build_lora_adapter(root / "b", tiny_fp32, seed=2)
    a2 = build_lora_adapter(root / "a-other-files", tiny_fp32, seed=3)
    return {"a": LoRA("tenant-a", 1, str(a)), "b": LoRA("tenant-b", 2, str(b)),
            # The same adapter name as "a", other weights (another node's files).
            "a2": LoRA("tenant-a", 3, str(a2))}


def test_kv_is_restored_within_an_adapter_and_never_across(
    lora_engine: LLMWorker, adapters: dict[str, LoRA]
) -> None:
    p = tokens(700, seed=5)
    a, b, a2 = adapters["a"], adapters["b"], adapters["a2"]
    # References: a fresh salt shares nothing, so these are full recomputes.
    refs = {name: restored(lora_engine, p, lora, salt=f"ref-{name}")
            for name, lora in (("a", a), ("b", b), ("a2", a2), ("base", None))}
    assert all(n == 0 for n, _ in refs.values())
    outs = [toks for _, toks in refs.values()]
    assert len({tuple(t) for t in outs}) == 4, "each adapter must change the output"

    assert restored(lora_engine, p, a)[0] == 0  # stores adapter A's KV
    for name, lora in (("b", b), ("base", None), ("a2", a2)):
        n, toks = restored(lora_engine, p, lora)
        assert n == 0, f"{name} restored adapter A's KV"
        assert toks == refs[name][1], f"{name} differs from its recompute"
    n, toks = restored(lora_engine, p, a)
    assert n >= 512, "adapter A's own chunks come back from kvtier"
    assert toks == refs["a"][1]
