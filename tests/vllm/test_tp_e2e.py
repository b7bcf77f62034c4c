"""Tensor parallel in real vLLM (issue 19): ``tensor_parallel_size=2`` on the CPU (the mp
executor, gloo and shared-memory all-reduce, one core per rank).

One engine, tiny fp32 model (2 KV heads: one per rank), a host tier and a write-through
file tier. A prompt's first run computes it (the reference: kvtier moves bytes, it never
changes how they are computed); after the host tier and vLLM's prefix cache are reset it
is restored from the file tier, with one object per chunk holding both ranks' parts, and
gives the same greedy tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from kvtier.testing.engines import LLMWorker, tokens
from tests.vllm.conftest import write_config
from tests.vllm.test_connector_e2e import restored, tiers_used

pytestmark = pytest.mark.vllm

OUT = 16
CT = 256


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tp-store")


@pytest.fixture(scope="module")
def engine(engine_factory: Callable[..., LLMWorker], tiny_fp32: Path, store: Path,
           tmp_path_factory: pytest.TempPathFactory) -> LLMWorker:
    cfg = write_config(
        tmp_path_factory.mktemp("cfg") / "tp.yaml",
        [{"file": {"path": str(store), "capacity": "1GiB", "write": "through"}}],
        chunk_tokens=CT, reset_cache="host",
    )
    return engine_factory(tiny_fp32, cfg, tensor_parallel_size=2,
                          extra_env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"})


def test_tp2_restores_a_returning_prompt_from_one_object_per_chunk(
    engine: LLMWorker, store: Path,
) -> None:
    p = tokens(3 * CT + 100, seed=1901)
    first = engine.generate([p], max_tokens=OUT).outputs[0]
    assert restored(first) == 0
    engine.reset_until_done()  # host tier and vLLM's prefix cache: only the file tier has it
    objects = sorted(store.rglob("*.kv"))
    assert len(objects) == 3, "one object per chunk, holding every rank's part"
    sizes = {f.stat().st_size for f in objects}
    assert len(sizes) == 1
    again = engine.generate([p], max_tokens=OUT).outputs[0]
    assert restored(again) == 3 * CT
    assert tiers_used(again) == {"file1"}
    assert again.token_ids == first.token_ids
    # the conversation's next turn, after vLLM's prefix cache dropped it: its stored
    # chunks are restored and the rest computed, as a recompute would
    turn = p + first.token_ids + tokens(40, seed=1902)
    ref = engine.generate([turn], max_tokens=OUT, cache_salt=["tp-ref"]).outputs[0]
    engine.reset_until_done()
    got = engine.generate([turn], max_tokens=OUT).outputs[0]
    assert restored(got) == 3 * CT
    assert got.token_ids == ref.token_ids
