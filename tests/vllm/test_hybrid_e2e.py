"""A hybrid model in real vLLM at TP=2 (issue 19): Gemma-2, whose layers alternate
between a 257-token sliding window and full attention. With kvtier loaded vLLM keeps its hybrid
KV-cache manager on (kvtier declares ``SupportsHMA``): one full-attention group and one
sliding-window group, each with its own block table.

kvtier stores each group as objects of its own: the full group's chunks (and tail), and
the sliding-window group's window at the end of each saved prefix. A returning request
restores both, through asynchronous loads. With ``tensor_parallel_size=2`` every piece
holds both ranks' heads, and each rank's worker copies only its own (a hybrid model at
TP=1 is ``test_llama4_e2e.py``). Tiny fp32 Gemma-2 (soft-capped logits), a host tier and
a write-through file tier; greedy tokens equal a recompute by the same engine (a fresh
``cache_salt`` shares nothing).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from kvtier.objformat import decode_header
from kvtier.testing.engines import LLMWorker
from kvtier.testing.models import build_tiny_gemma2
from tests.vllm.conftest import two_conversations_return
from tests.vllm.test_connector_e2e import restored, tiers_used
from tests.vllm.test_tp_e2e import CT, tp2_engine

pytestmark = pytest.mark.vllm

WINDOW = 257  # (W - 1) a multiple of vLLM's CPU block (128): no save falls in the corner


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("hybrid-store")


@pytest.fixture(scope="module")
def engine(engine_factory: Callable[..., LLMWorker], store: Path,
           tmp_path_factory: pytest.TempPathFactory) -> LLMWorker:
    model = build_tiny_gemma2(tmp_path_factory.mktemp("models") / "gemma2",
                              sliding_window=WINDOW, layers=4)
    return tp2_engine(engine_factory, model, store,
                      tmp_path_factory.mktemp("cfg") / "hybrid.yaml")


def test_hybrid_conversations_restore_every_group(engine: LLMWorker, store: Path) -> None:
    r = two_conversations_return(engine, store, seed=2951, chunk_tokens=CT)
    assert [restored(x) for x in r.first] == [0, 0]
    # a (827 computed: 3 chunks) and b (707: 2 chunks, shared with a, and a 1-block
    # tail): the full group's 3 chunks and b's tail, one window each (two blocks)
    assert len(r.objects) == 6, r.objects
    shapes = sorted(decode_header(p.read_bytes())[0].shape for p in r.objects)
    # both ranks' halves of each block (one KV head each), 2 layers per group
    assert shapes == [(2, 2, 1, 32768)] + [(2, 2, 2, 32768)] * 5, shapes
    # each restores its own prefix down to its last full block
    assert [restored(x) for x in r.got] == [6 * 128, 5 * 128], \
        [x.kv_transfer_params for x in r.got]
    # the shared chunks are read once: the first reader promotes them, the other holds
    # them from the host tier (or waits for that read); each window comes from the file
    assert all("file1" in tiers_used(x) and tiers_used(x) <= {"file1", "host"} for x in r.got)
    assert [x.token_ids for x in r.got] == [x.token_ids for x in r.refs]
