"""A hybrid model in real vLLM (issue 19): Gemma-2, whose layers alternate between a
257-token sliding window and full attention. With kvtier loaded vLLM keeps its hybrid
KV-cache manager on (kvtier declares ``SupportsHMA``): one full-attention group and one
sliding-window group, each with its own block table.

kvtier stores each group as objects of its own: the full group's chunks (and tail), and
the sliding-window group's window at the end of each saved prefix. A returning request
restores both, through asynchronous loads. Tiny fp32 Gemma-2 (soft-capped logits), a
host tier and a write-through file tier; greedy tokens equal a recompute by the same
engine (a fresh ``cache_salt`` shares nothing).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from kvtier.objformat import decode_header
from kvtier.testing.engines import LLMWorker, tokens
from kvtier.testing.models import build_tiny_gemma2
from tests.vllm.conftest import write_through_config
from tests.vllm.test_connector_e2e import restored, tiers_used

pytestmark = pytest.mark.vllm

OUT = 16
CT = 256
WINDOW = 257  # (W - 1) a multiple of vLLM's CPU block (128): no save falls in the corner


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("hybrid-store")


@pytest.fixture(scope="module")
def engine(engine_factory: Callable[..., LLMWorker], store: Path,
           tmp_path_factory: pytest.TempPathFactory) -> LLMWorker:
    model = build_tiny_gemma2(tmp_path_factory.mktemp("models") / "gemma2",
                              sliding_window=WINDOW, layers=4)
    cfg = write_through_config(tmp_path_factory.mktemp("cfg") / "hybrid.yaml", store, CT)
    return engine_factory(model, cfg)


def test_hybrid_conversations_restore_every_group(engine: LLMWorker, store: Path) -> None:
    shared = tokens(2 * CT, seed=2951)  # a new system prompt, two conversations on it
    a = shared + tokens(300, seed=2952)
    b = shared + tokens(180, seed=2953)
    first = engine.generate([a, b], max_tokens=OUT).outputs
    assert [restored(r) for r in first] == [0, 0]
    engine.reset_until_done()  # host tier and vLLM's prefix cache: only the file tier has it
    objects = sorted(store.rglob("*.kv"))
    # a (827 computed: 3 chunks) and b (707: 2 chunks, shared with a, and a 1-block
    # tail): the full group's 3 chunks and b's tail, one window each (two blocks)
    assert len(objects) == 6, objects
    shapes = sorted(decode_header(p.read_bytes())[0].shape for p in objects)
    assert shapes == [(2, 1, 65536)] + [(2, 2, 65536)] * 5, shapes  # 2 layers per group
    turns = [p + r.token_ids + tokens(40, seed=2954 + i)
             for i, (p, r) in enumerate(zip((a, b), first, strict=True))]
    refs = [engine.generate([t], max_tokens=OUT, cache_salt=[f"h-ref{i}"]).outputs[0]
            for i, t in enumerate(turns)]
    engine.reset_until_done()
    got = engine.generate(turns, max_tokens=OUT).outputs
    # each restores its own prefix down to its last full block
    assert [restored(r) for r in got] == [6 * 128, 5 * 128], [r.kv_transfer_params for r in got]
    # the shared chunks are read once: the first reader promotes them, the other holds
    # them from the host tier (or waits for that read); each window comes from the file
    assert all("file1" in tiers_used(r) and tiers_used(r) <= {"file1", "host"} for r in got)
    assert [r.token_ids for r in got] == [r.token_ids for r in refs]
