"""Chunked-local attention in real vLLM (issue 19): a Llama-4 text model, whose RoPE
layers attend only within aligned chunks of ``A`` tokens and whose NoPE layers attend to
everything. vLLM keeps its hybrid KV-cache manager on for it when
``VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE=1`` (by default it turns the
manager off for such models, and kvtier then stores every layer's blocks as one
full-attention group): a ``ChunkedLocalAttentionSpec`` group and a full-attention group,
each with its own block table, the chunked one holding vLLM's null block below the
current attention chunk.

kvtier stores the full group's chunks (and tail) and, of the chunked-local group, only
the blocks of the attention chunk that each saved prefix ends in. Tiny fp32 Llama-4
(no experts), a host tier and a write-through file tier; greedy tokens equal a
recompute by the same engine (a fresh ``cache_salt`` shares nothing).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from kvtier.objformat import decode_header
from kvtier.testing.engines import LLMWorker
from kvtier.testing.models import build_tiny_llama4
from tests.vllm.conftest import two_conversations_return, write_through_config
from tests.vllm.test_connector_e2e import restored, tiers_used

pytestmark = pytest.mark.vllm

CT = 256
A = 512  # the attention chunk: 4 of vLLM's 128-token CPU blocks


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("llama4-store")


@pytest.fixture(scope="module")
def engine(engine_factory: Callable[..., LLMWorker], store: Path,
           tmp_path_factory: pytest.TempPathFactory) -> LLMWorker:
    model = build_tiny_llama4(tmp_path_factory.mktemp("models") / "llama4",
                              attention_chunk=A, layers=4)
    cfg = write_through_config(tmp_path_factory.mktemp("cfg") / "llama4.yaml", store, CT)
    return engine_factory(model, cfg, extra_env={
        "VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE": "1"})


def test_chunked_local_conversations_restore_their_attention_chunk(
        engine: LLMWorker, store: Path) -> None:
    r = two_conversations_return(engine, store, seed=4101, chunk_tokens=CT)
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
