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

from kvtier.testing.engines import LLMWorker
from kvtier.testing.models import build_tiny_mistral
from tests.vllm.conftest import two_conversations_return, write_through_config
from tests.vllm.test_connector_e2e import restored, tiers_used

pytestmark = pytest.mark.vllm

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
    r = two_conversations_return(engine, store, seed=1951, chunk_tokens=CT)
    assert [restored(x) for x in r.first] == [0, 0]
    # one window object per conversation (its last two blocks), no chunk objects
    assert len(r.objects) == 2, r.objects
    # each restores its own prefix down to its last full block: a 828 + 15 computed
    # (6 blocks), b 708 + 15 computed (5 blocks)
    assert [restored(x) for x in r.got] == [6 * 128, 5 * 128]
    assert all(tiers_used(x) == {"file1"} for x in r.got)
    assert [x.token_ids for x in r.got] == [x.token_ids for x in r.refs]
