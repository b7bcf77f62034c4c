"""Key identity beyond token ids: LoRA adapters, multimodal inputs, prompt embeddings.

Requests are plain records with the attributes of vLLM's ``Request`` that kvtier reads.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from kvtier.build import build_store
from kvtier.config import KVTierConfig
from kvtier.keys import ChunkKey, Namespace, chunk_keys
from kvtier.vllm.geometry import Geometry
from kvtier.vllm.identity import (
    MAX_DIGESTS,
    PENDING,
    AdapterFingerprints,
    RequestIdentities,
    RequestIdentity,
    Unsupported,
    adapter_fingerprint,
)
from kvtier.vllm.scheduler_side import SchedulerSide

CT = 16
NS = Namespace(model="m", model_fingerprint="0" * 16, kv_dtype="float32", kv_layout="NHD",
               num_layers=2, num_kv_heads=2, head_size=64, chunk_tokens=CT, block_size=CT)
TOKENS = [7] * (4 * CT)  # placeholder-like: identical ids everywhere


def _adapter(root: Path, name: str, weights: bytes) -> Path:
    d = root / name
    d.mkdir()
    (d / "adapter_config.json").write_text('{"r": 8}')
    (d / "adapter_model.safetensors").write_bytes(weights)
    return d


def _req(rid: str = "r", **attrs: Any) -> SimpleNamespace:
    base: dict[str, Any] = dict(request_id=rid, all_token_ids=TOKENS, num_tokens=len(TOKENS),
                                cache_salt=None, lora_request=None, mm_features=None,
                                prompt_embeds=None, kv_transfer_params=None)
    base.update(attrs)
    return SimpleNamespace(**base)


def _lora(name: str, path: Path | str) -> SimpleNamespace:
    return SimpleNamespace(lora_name=name, lora_int_id=1, lora_path=str(path))


def _mm(ident: str | None, offset: int, length: int) -> SimpleNamespace:
    return SimpleNamespace(identifier=ident, mm_position=SimpleNamespace(offset=offset,
                                                                         length=length))


def _ready(ids: RequestIdentities, req: SimpleNamespace) -> RequestIdentity:
    """The identity, once the adapter fingerprint (a background job) is done."""
    got = ids.of(req)
    if got is PENDING:
        for fut in ids.adapters._jobs.values():
            fut.exception()  # wait; a failure is raised by ``of`` below
        got = ids.of(req)
    assert isinstance(got, RequestIdentity)
    return got


def _keys(ident: RequestIdentity) -> list[ChunkKey]:
    return chunk_keys(ident.namespace, TOKENS, CT, extra=ident.chunk_extra or b"")


@pytest.fixture
def ids() -> Iterator[RequestIdentities]:
    ident = RequestIdentities(NS, CT)
    yield ident
    ident.close()


def test_adapter_fingerprint_covers_every_byte(tmp_path: Path) -> None:
    a = _adapter(tmp_path, "a", b"\x00" * 5000 + b"\x01")
    b = _adapter(tmp_path, "b", b"\x00" * 5000 + b"\x02")
    a_copy = _adapter(tmp_path, "a-copy", b"\x00" * 5000 + b"\x01")
    assert adapter_fingerprint(a) != adapter_fingerprint(b)
    assert adapter_fingerprint(a) == adapter_fingerprint(a_copy)


def test_keys_differ_by_adapter_name_and_files_but_not_by_path(
    ids: RequestIdentities, tmp_path: Path
) -> None:
    a = _adapter(tmp_path, "a", b"weights-a")
    a_elsewhere = _adapter(tmp_path, "a-on-another-node", b"weights-a")
    other_files = _adapter(tmp_path, "a-other-files", b"weights-x")
    base = _keys(_ready(ids, _req()))
    k_a = _keys(_ready(ids, _req(lora_request=_lora("tenant-a", a))))
    k_a_moved = _keys(_ready(ids, _req(lora_request=_lora("tenant-a", a_elsewhere))))
    k_other = _keys(_ready(ids, _req(lora_request=_lora("tenant-a", other_files))))
    k_renamed = _keys(_ready(ids, _req(lora_request=_lora("tenant-b", a))))
    assert k_a == k_a_moved, "the same adapter files on two nodes share KV"
    assert len({base[0], k_a[0], k_other[0], k_renamed[0]}) == 4


def test_an_adapter_is_pending_until_fingerprinted_and_the_hook_asks_again(
    tmp_path: Path,
) -> None:
    gate = threading.Event()

    def slow(path: str) -> str:
        gate.wait(10)
        return "fp"

    fps = AdapterFingerprints(slow)
    try:
        assert fps.get("a", "/x") is PENDING
        gate.set()
        fps._jobs[("a", "/x")].result()
        assert fps.get("a", "/x") == "fp"
    finally:
        fps.close()


def test_an_adapter_that_cannot_be_read_is_refused(ids: RequestIdentities,
                                                  tmp_path: Path) -> None:
    for path in (tmp_path / "missing", ""):
        req = _req(lora_request=_lora("gone", path))
        with pytest.raises(Unsupported, match="LoRA adapter 'gone'"):
            _ready(ids, req)


def test_multimodal_inputs_key_the_chunks_they_overlap(ids: RequestIdentities) -> None:
    # An image in chunk 1 (tokens 20..27): chunk 0 is shared, chunk 1 on differ.
    cat = _keys(_ready(ids, _req(mm_features=[_mm("img-cat", 20, 8)])))
    dog = _keys(_ready(ids, _req(mm_features=[_mm("img-dog", 20, 8)])))
    shifted = _keys(_ready(ids, _req(mm_features=[_mm("img-cat", 21, 8)])))
    text = _keys(_ready(ids, _req()))
    assert cat[0] == dog[0] == text[0]
    assert len({cat[1], dog[1], shifted[1], text[1]}) == 4
    # An image spanning chunks 1..2 keys both.
    wide = _ready(ids, _req(mm_features=[_mm("img-cat", 20, 20)]))
    assert wide.chunk_extra is not None
    assert wide.chunk_extra(1) and wide.chunk_extra(2) and not wide.chunk_extra(3)


def test_a_multimodal_input_without_identifier_is_refused(ids: RequestIdentities) -> None:
    with pytest.raises(Unsupported, match="multimodal"):
        ids.of(_req(mm_features=[_mm(None, 0, 4)]))


def test_prompt_embeds_key_each_chunk_by_its_embeddings(ids: RequestIdentities) -> None:
    gen = torch.Generator().manual_seed(0)
    e1 = torch.randn(3 * CT, 8, generator=gen, dtype=torch.float32)
    e2 = e1.clone()
    e2[CT + 3, 0] += 1.0  # one value in chunk 1
    k1 = _keys(_ready(ids, _req(prompt_embeds=e1)))
    k2 = _keys(_ready(ids, _req(prompt_embeds=e2)))
    k1_again = _keys(_ready(ids, _req(prompt_embeds=e1.clone())))
    k_bf16 = _keys(_ready(ids, _req(prompt_embeds=e1.to(torch.bfloat16))))
    text = _keys(_ready(ids, _req()))
    assert k1 == k1_again
    assert k1[0] == k2[0] and k1[1] != k2[1]
    assert k1[0] != text[0] and k1[0] != k_bf16[0]
    ident = _ready(ids, _req(prompt_embeds=e1))
    assert ident.chunk_extra is not None and ident.chunk_extra(3) == b""  # generated tokens


def test_the_digest_cache_is_bounded(ids: RequestIdentities) -> None:
    for i in range(MAX_DIGESTS + 100):
        ids.of(_req(cache_salt=f"tenant-{i}"))
    assert len(ids._digests) == MAX_DIGESTS


@pytest.fixture
def sched(tmp_path: Path) -> Iterator[SchedulerSide]:
    cfg = KVTierConfig.model_validate({
        "chunk_tokens": CT,
        "tiers": [{"host": {"capacity": "4MiB", "pinned": "no"}}],
        "restore": {"recompute_threshold_tokens": 1},
    })
    geom = Geometry(2, 2, 64, CT, 4096, "float32")
    s = SchedulerSide(cfg, geom, NS, None, store=build_store(cfg, geom.chunk_bytes(CT)))
    yield s
    s.close()


def test_a_refused_request_loads_nothing_and_stores_nothing(sched: SchedulerSide) -> None:
    req = _req(mm_features=[_mm(None, 0, 4)], num_computed_tokens=len(TOKENS))
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    delay, params = sched.request_finished(req, list(range(4)))
    assert not delay and params["kvtier"]["tokens"] == 0
    assert not list(sched.store.host.index.entries())


def test_a_pending_adapter_makes_the_hook_ask_again(sched: SchedulerSide, tmp_path: Path) -> None:
    gate = threading.Event()

    def slow(path: str) -> str:
        gate.wait(10)
        return "fp"

    sched.identities.adapters = AdapterFingerprints(slow)
    req = _req(lora_request=_lora("a", tmp_path))
    assert sched.get_num_new_matched_tokens(req, 0) == (None, False)
    gate.set()
    sched.identities.adapters._jobs[("a", str(tmp_path))].result()
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)  # nothing stored yet
