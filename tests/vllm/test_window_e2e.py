"""A sliding-window model in real vLLM (issue 19): every layer attends to the last 257
tokens, so vLLM keeps one ``SlidingWindowSpec`` KV-cache group and swaps the blocks
below the window for its null block as a request runs.

kvtier stores, per finished request, only the window of its prefix (two 128-token
blocks here, one object), and a returning request restores its whole prefix by copying
that window. Tiny fp32 Mistral, a host tier and a write-through file tier; greedy tokens
equal a recompute by the same engine (a fresh ``cache_salt`` shares nothing).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from kvtier.testing.engines import LLMWorker, tokens
from kvtier.testing.models import build_tiny_mistral
from tests.vllm.conftest import write_through_config
from tests.vllm.test_connector_e2e import restored, tiers_used

pytestmark = pytest.mark.vllm

OUT = 16
CT = 256
WINDOW = 257  # (W - 1) a multiple of vLLM's CPU block (128): no save falls in the corner


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("window-store")


@pytest.fixture(scope="module")
def engine(engine_factory: Callable[..., LLMWorker], store: Path,
           tmp_path_factory: pytest.TempPathFactory) -> LLMWorker:
    model = build_tiny_mistral(tmp_path_factory.mktemp("models") / "mistral",
                               sliding_window=WINDOW)
    cfg = write_through_config(tmp_path_factory.mktemp("cfg") / "window.yaml", store, CT)
    return engine_factory(model, cfg)


def test_sliding_window_conversations_restore_their_prefix_from_the_window(
    engine: LLMWorker, store: Path,
) -> None:
    shared = tokens(2 * CT, seed=1951)  # a new system prompt, two conversations on it
    a = shared + tokens(300, seed=1952)
    b = shared + tokens(180, seed=1953)
    first = engine.generate([a, b], max_tokens=OUT).outputs
    assert [restored(r) for r in first] == [0, 0]
    engine.reset_until_done()  # host tier and vLLM's prefix cache: only the file tier has it
    objects = sorted(store.rglob("*.kv"))
    # one window object per conversation (its last two blocks), no chunk objects
    assert len(objects) == 2, objects
    # both return together with their next user turn, after vLLM dropped them
    turns = [p + r.token_ids + tokens(40, seed=1954 + i)
             for i, (p, r) in enumerate(zip((a, b), first, strict=True))]
    refs = [engine.generate([t], max_tokens=OUT, cache_salt=[f"w-ref{i}"]).outputs[0]
            for i, t in enumerate(turns)]
    engine.reset_until_done()
    got = engine.generate(turns, max_tokens=OUT).outputs
    # each restores its own prefix down to its last full block: a 828 + 15 computed
    # (6 blocks), b 708 + 15 computed (5 blocks)
    assert [restored(r) for r in got] == [6 * 128, 5 * 128]
    assert all(tiers_used(r) == {"file1"} for r in got)
    assert [r.token_ids for r in got] == [r.token_ids for r in refs]
