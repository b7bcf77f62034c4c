"""LoRA in real vLLM: KV is restored within one adapter and never across adapters.

An adapter changes the K and V projections, so KV computed under adapter A is wrong for
adapter B and for the base model, although the token ids are the same. The engine runs
with vLLM's own prefix cache off, so every reuse here is kvtier's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvtier.testing.engines import LLMWorker, LoRA, tokens
from kvtier.testing.models import build_lora_adapter
from tests.vllm.conftest import write_config

pytestmark = pytest.mark.vllm

OUT = 24


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


@pytest.fixture(scope="module")
def engine(engine_factory: Any, tiny_fp32: Path,
           tmp_path_factory: pytest.TempPathFactory) -> LLMWorker:
    store = tmp_path_factory.mktemp("lora-store")
    cfg = write_config(
        tmp_path_factory.mktemp("cfg") / "lora.yaml",
        [{"file": {"path": str(store), "capacity": "1GiB", "write": "through"}}],
    )
    eng: LLMWorker = engine_factory(tiny_fp32, cfg, enable_prefix_caching=False,
                                    enable_lora=True, max_lora_rank=8, max_loras=2)
    return eng


def test_kv_is_restored_within_an_adapter_and_never_across(
    engine: LLMWorker, adapters: dict[str, LoRA]
) -> None:
    p = tokens(700, seed=5)
    a, b, a2 = adapters["a"], adapters["b"], adapters["a2"]
    # References: a fresh salt shares nothing, so these are full recomputes.
    refs = {name: restored(engine, p, lora, salt=f"ref-{name}")
            for name, lora in (("a", a), ("b", b), ("a2", a2), ("base", None))}
    assert all(n == 0 for n, _ in refs.values())
    outs = [toks for _, toks in refs.values()]
    assert len({tuple(t) for t in outs}) == 4, "each adapter must change the output"

    assert restored(engine, p, a)[0] == 0  # stores adapter A's KV
    for name, lora in (("b", b), ("base", None), ("a2", a2)):
        n, toks = restored(engine, p, lora)
        assert n == 0, f"{name} restored adapter A's KV"
        assert toks == refs[name][1], f"{name} differs from its recompute"
    n, toks = restored(engine, p, a)
    assert n >= 512, "adapter A's own chunks come back from kvtier"
    assert toks == refs["a"][1]
