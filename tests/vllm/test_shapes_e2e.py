"""Every model shape besides full attention, in real vLLM (issue 19), one engine each,
started side by side (each start costs 15-45 s of mostly single-threaded imports):

* **Sliding window** (tiny fp32 Mistral): every layer attends to the last 257 tokens, so
  vLLM keeps one ``SlidingWindowSpec`` KV-cache group and swaps the blocks below the
  window for its null block as a request runs. kvtier stores, per finished request, only
  the window of its prefix (two 128-token blocks here, one object), and a returning
  request restores its whole prefix by copying that window.
* **Hybrid at TP=2** (tiny fp32 Gemma-2, soft-capped logits): layers alternate between a
  257-token sliding window and full attention. With kvtier loaded vLLM keeps its hybrid
  KV-cache manager on (kvtier declares ``SupportsHMA``): one full-attention group and one
  sliding-window group, each with its own block table. kvtier stores each group as
  objects of its own: the full group's chunks (and tail), and the sliding-window group's
  window at the end of each saved prefix. A returning request restores both, through
  asynchronous loads. With ``tensor_parallel_size=2`` every piece holds both ranks' heads,
  and each rank's worker copies only its own.
* **Chunked-local attention at TP=1** (tiny fp32 Llama-4 text model, no experts): its
  RoPE layers attend only within aligned chunks of ``A`` tokens and its NoPE layers to
  everything. vLLM keeps its hybrid KV-cache manager on for it when
  ``VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE=1`` (by default it turns the manager
  off for such models, and kvtier then stores every layer's blocks as one full-attention
  group): a ``ChunkedLocalAttentionSpec`` group and a full-attention group, each with its
  own block table, the chunked one holding vLLM's null block below the current attention
  chunk. kvtier stores the full group's chunks (and tail) and, of the chunked-local group,
  only the blocks of the attention chunk that each saved prefix ends in.

Each engine has a host tier and a write-through file tier of its own; greedy tokens equal
a recompute by the same engine (a fresh ``cache_salt`` shares nothing).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.objformat import decode_header
from kvtier.testing.engines import LLMWorker
from kvtier.testing.models import build_tiny_gemma2, build_tiny_llama4, build_tiny_mistral
from tests.vllm.conftest import EngineFactory, two_conversations_return, write_through_config
from tests.vllm.test_connector_e2e import restored, tiers_used
from tests.vllm.test_tp_e2e import tp2_spec

pytestmark = pytest.mark.vllm

CT = 256
WINDOW = 257  # (W - 1) a multiple of vLLM's CPU block (128): no save falls in the corner
A = 512  # the attention chunk: 4 of vLLM's 128-token CPU blocks
SHAPES = ("window", "hybrid", "llama4")


@pytest.fixture(scope="module")
def stores(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {shape: tmp_path_factory.mktemp(f"{shape}-store") for shape in SHAPES}


@pytest.fixture(scope="module")
def engines(engine_factory: EngineFactory, stores: dict[str, Path], models_dir: Path,
            tmp_path_factory: pytest.TempPathFactory) -> dict[str, LLMWorker]:
    models = models_dir
    cfg = tmp_path_factory.mktemp("cfg")
    mistral = build_tiny_mistral(models / "mistral", sliding_window=WINDOW)
    gemma2 = build_tiny_gemma2(models / "gemma2", sliding_window=WINDOW, layers=4)
    llama4 = build_tiny_llama4(models / "llama4", attention_chunk=A, layers=4)
    started = engine_factory.side_by_side(
        (mistral, write_through_config(cfg / "window.yaml", stores["window"], CT), {}),
        tp2_spec(gemma2, stores["hybrid"], cfg / "hybrid.yaml"),
        (llama4, write_through_config(cfg / "llama4.yaml", stores["llama4"], CT),
         {"extra_env": {"VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE": "1"}}))
    return dict(zip(SHAPES, started, strict=True))


def test_sliding_window_conversations_restore_their_prefix_from_the_window(
    engines: dict[str, LLMWorker], stores: dict[str, Path],
) -> None:
    r = two_conversations_return(engines["window"], stores["window"], seed=1951,
                                 chunk_tokens=CT)
    assert [restored(x) for x in r.first] == [0, 0]
    # one window object per conversation (its last two blocks), no chunk objects
    assert len(r.objects) == 2, r.objects
    # each restores its own prefix down to its last full block: a 828 + 15 computed
    # (6 blocks), b 708 + 15 computed (5 blocks)
    assert [restored(x) for x in r.got] == [6 * 128, 5 * 128]
    assert all(tiers_used(x) == {"file1"} for x in r.got)
    assert [x.token_ids for x in r.got] == [x.token_ids for x in r.refs]


def test_hybrid_conversations_restore_every_group(
    engines: dict[str, LLMWorker], stores: dict[str, Path],
) -> None:
    r = two_conversations_return(engines["hybrid"], stores["hybrid"], seed=2951,
                                 chunk_tokens=CT)
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


def test_chunked_local_conversations_restore_their_attention_chunk(
    engines: dict[str, LLMWorker], stores: dict[str, Path],
) -> None:
    r = two_conversations_return(engines["llama4"], stores["llama4"], seed=4101,
                                 chunk_tokens=CT)
    assert [restored(x) for x in r.first] == [0, 0]
    # a (827 computed: 3 chunks) and b (707: 2 chunks shared with a, and a 1-block tail):
    # the full group's 3 chunks and b's tail; of the chunked-local group, a's blocks 4-5
    # (tokens 512..767) and b's block 4 (512..639): nothing below the attention chunk
    assert len(r.objects) == 6, r.objects
    shapes = sorted(decode_header(p.read_bytes())[0].shape for p in r.objects)
    assert shapes == [(2, 1, 65536)] * 2 + [(2, 2, 65536)] * 4, shapes  # 2 layers per group
    # each holds its own prefix down to its last full block. b may wait for a's read of
    # the shared chunks (a read in flight is not read twice) and then find the shared
    # 512 tokens in vLLM's own cache: at an attention-chunk boundary the chunked-local
    # group needs no block, so vLLM's hit covers them and kvtier restores the rest
    assert [x.num_cached_tokens for x in r.got] == [6 * 128, 5 * 128]
    assert restored(r.got[0]) == 6 * 128 and restored(r.got[1]) in (5 * 128, 128), \
        [x.kv_transfer_params for x in r.got]
    assert all("file1" in tiers_used(x) and tiers_used(x) <= {"file1", "host"} for x in r.got)
    assert [x.token_ids for x in r.got] == [x.token_ids for x in r.refs]
