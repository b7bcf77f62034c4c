"""KVTierConnector end to end in real vLLM: restore equals recompute, under eviction,
from S3 or CephFS only, with corruption, and isolated by namespace. (A restarted engine
restoring from disk only, token-identical: ``test_restart_e2e.py``, after every way a
server stops.)"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvtier.objformat import HEADER_SPAN, decode_header
from kvtier.testing.engines import CompletionResult, Conversation, LLMWorker, WorkerError, tokens
from kvtier.vllm.settings import kv_transfer_config
from tests.conftest import cephfs_dir
from tests.tiers.s3_harness import BUCKET, rgw_endpoint
from tests.vllm.conftest import SMALL_KV_BLOCKS, EngineFactory, write_config

pytestmark = pytest.mark.vllm

OUT = 24  # output tokens per turn

def restored(r: CompletionResult) -> int:
    params: dict[str, Any] = r.kv_transfer_params or {}
    return int(params.get("kvtier", {}).get("restored_tokens", 0))


def tiers_used(r: CompletionResult) -> set[str]:
    params: dict[str, Any] = r.kv_transfer_params or {}
    return set(params.get("kvtier", {}).get("restored_by_tier", {}))


def reference(engine: LLMWorker, prompt: list[int], salt: str) -> list[int]:
    """A full recompute: a fresh salt shares no cached block with anything."""
    r = engine.generate([prompt], max_tokens=OUT, cache_salt=[salt]).outputs[0]
    assert restored(r) == 0 and r.num_cached_tokens == 0
    return r.token_ids


@pytest.fixture(scope="module")
def bad_config_engine(tiny_fp32: Path) -> Iterator[LLMWorker]:
    """An engine whose kvtier config is invalid, only launched: it fails to start while
    the module's first engines start (``fp32_and_bf16`` asks for it first), and
    ``test_bad_config_fails_at_engine_start`` reads how it failed."""
    with tempfile.TemporaryDirectory(prefix="kvt-") as short:  # unix socket paths are short
        tmp = Path(short)
        cfg = write_config(tmp / "ok.yaml", [])
        w = LLMWorker(tmp / "eng", model=str(tiny_fp32), max_model_len=2048,
                      kv_transfer_config=kv_transfer_config(
                          cfg, overrides={"tiers.0.host.capacity": "lots"}))
        w.launch()
        try:
            yield w
        finally:
            w.close()


@pytest.fixture(scope="module")
def fp32_and_bf16(engine_factory: EngineFactory, tiny_fp32: Path, tiny_bf16: Path,
                  shared_store: Path, tmp_path_factory: pytest.TempPathFactory,
                  bad_config_engine: LLMWorker) -> list[LLMWorker]:
    """The module's two long-lived engines, started side by side (with the bad config's
    failing start)."""
    cfg = tmp_path_factory.mktemp("cfg")
    fp32_cfg = write_config(
        cfg / "fp32.yaml",
        [{"file": {"path": str(shared_store), "capacity": "1GiB", "write": "through"}}],
        reset_cache="host",  # resets leave prompts on the file tier only
        # Every restore here from the file tier is meant to read it. Once any probe or
        # load wait runs out (a loaded machine: the defaults are 1 s and 2 s), every wait
        # is cut to the measured recompute (0.25 s at least) for a minute
        # (``WaitBound.suspect``), and a healthy read still queued then is given up
        # unread: the corruption test would see no object read.
        restore={"lookup_timeout_seconds": 60.0, "load_timeout_seconds": 60.0},
    )
    bf16_cfg = write_config(
        cfg / "bf16.yaml",
        [{"file": {"path": str(shared_store), "capacity": "1GiB", "write": "through"}}],
    )
    return engine_factory.side_by_side(
        (tiny_fp32, fp32_cfg, {"enable_prefix_caching": True,
                               "num_gpu_blocks_override": SMALL_KV_BLOCKS}),
        (tiny_bf16, bf16_cfg, {"enable_prefix_caching": True}))


@pytest.fixture(scope="module")
def fp32(fp32_and_bf16: list[LLMWorker]) -> LLMWorker:
    return fp32_and_bf16[0]


@pytest.fixture(scope="module")
def bf16(fp32_and_bf16: list[LLMWorker]) -> LLMWorker:
    return fp32_and_bf16[1]


#: kvtier bypassed: what vLLM alone does on this engine (the harness checks below).
BYPASS = {"kvtier": {"load": False, "save": False}}


def test_the_harness_engine_is_deterministic_and_caches_prefixes(fp32: LLMWorker) -> None:
    """The test harness itself (``LLMWorker`` over vLLM, kvtier bypassed): greedy output is
    deterministic, vLLM's own prefix cache serves full blocks, a reset empties it, and a
    multi-turn ``Conversation`` finds its previous turn cached. Every token comparison in
    these tests rests on this."""
    prompts = [tokens(300, seed=1), tokens(200, seed=2)]
    kw: dict[str, Any] = {"max_tokens": 8, "kv_transfer_params": [BYPASS] * 2,
                          "cache_salt": ["harness"] * 2}
    first = fp32.generate(prompts, reset_prefix_cache=True, **kw)
    assert [o.num_prompt_tokens for o in first.outputs] == [300, 200]
    assert all(len(o.token_ids) == 8 and o.finish_reason == "length" for o in first.outputs)
    assert first.outputs[0].token_ids != first.outputs[1].token_ids
    second = fp32.generate(prompts, **kw)
    assert [o.token_ids for o in second.outputs] == [o.token_ids for o in first.outputs]
    assert [o.num_cached_tokens for o in second.outputs] == [256, 128]
    third = fp32.generate(prompts, reset_prefix_cache=True, **kw)
    assert third.reset_ok is True
    assert [o.num_cached_tokens for o in third.outputs] == [0, 0]
    assert [o.token_ids for o in third.outputs] == [o.token_ids for o in first.outputs]

    conv = Conversation()
    for turn in range(3):
        prompt = conv.next_prompt(tokens(150, seed=10 + turn))
        out = fp32.generate([prompt], max_tokens=10, kv_transfer_params=[BYPASS],
                            cache_salt=["harness-conv"]).outputs[0]
        if turn:  # the previous turn's full blocks (prompt and generated tokens)
            assert out.num_cached_tokens == (len(conv.history) - 1) // 128 * 128
        conv.record(prompt, out)
    assert len(conv.history) == 3 * 160


def test_restore_is_token_identical_to_recompute_fp32(fp32: LLMWorker) -> None:
    shared = tokens(700, seed=11)
    prompts = [shared + tokens(150, seed=100 + i) for i in range(3)]
    refs = [reference(fp32, p, f"ref-a{i}") for i, p in enumerate(prompts)]
    fp32.generate([prompts[0]], max_tokens=OUT)  # stores the shared prefix
    for p, ref in zip(prompts[1:], refs[1:], strict=True):
        r = fp32.generate([p], max_tokens=OUT, reset_prefix_cache=True).outputs[0]
        assert restored(r) >= 512, "the two full shared chunks come from kvtier"
        assert r.token_ids == ref


def test_forced_eviction_every_returning_turn_is_restored(fp32: LLMWorker) -> None:
    """6 conversations x 4 turns on a KV cache that holds about two of them."""
    convs = [tokens(900, seed=200 + c) for c in range(6)]
    for turn in range(4):
        for c in range(6):
            prompt = convs[c]
            ref = reference(fp32, prompt, f"ref-conv{c}-t{turn}")
            r = fp32.generate([prompt], max_tokens=OUT).outputs[0]
            assert r.token_ids == ref, f"conversation {c} turn {turn}"
            kv = (r.kv_transfer_params or {})["kvtier"]
            if turn > 0:
                assert restored(r) > 0, f"conversation {c} turn {turn} was not restored"
                # Only the chunks this turn completed are copied, never one stored before.
                assert kv["spilled_bytes"] < kv["write_through_bytes"]
            convs[c] = prompt + r.token_ids + tokens(40, seed=1000 * c + turn)


def test_concurrent_requests_with_preemption_match_reference(fp32: LLMWorker) -> None:
    base = tokens(600, seed=31)
    prompts = [base + tokens(500, seed=300 + i) for i in range(4)]
    refs = [reference(fp32, p, f"ref-cc{i}") for i, p in enumerate(prompts)]
    fp32.generate([prompts[0]], max_tokens=OUT)
    out = fp32.generate(prompts, max_tokens=OUT, reset_prefix_cache=True).outputs
    assert [o.token_ids for o in out] == refs
    assert sum(restored(o) for o in out) > 0


def _kv(r: CompletionResult) -> dict[str, Any]:
    params: dict[str, Any] = (r.kv_transfer_params or {})["kvtier"]
    return params


def test_a_returning_turn_restores_up_to_its_last_full_block(fp32: LLMWorker) -> None:
    """Partial tails (chunks of 256 tokens, vLLM blocks of 128): turn 1 leaves 2 chunks
    and a 1-block tail; turn 2 restores all of it (640 tokens, not 512) and equals a
    recompute; turn 3 finds chunk 2 whole (turn 2 superseded the tail) and restores 768."""
    prompt = tokens(700, seed=31)
    r = fp32.generate([prompt], max_tokens=OUT).outputs[0]  # 723 computed: 5 blocks
    kv = _kv(r)
    assert kv["tokens"] == 640, "2 whole chunks and a one-block tail are stored"
    for turn, expect in ((2, 640), (3, 768)):
        prompt = prompt + r.token_ids + tokens(50, seed=31 + turn)
        ref = reference(fp32, prompt, f"ref-tail-t{turn}")
        r = fp32.generate([prompt], max_tokens=OUT, reset_prefix_cache=True).outputs[0]
        assert restored(r) == expect, f"turn {turn}"
        assert r.token_ids == ref, f"turn {turn}"
        assert r.num_cached_tokens == expect  # vLLM's own cache was reset: all from kvtier


def test_requests_sharing_a_prefix_restore_their_own_tails(fp32: LLMWorker) -> None:
    """Two conversations on one new 512-token prefix, sent together, end in different
    tails; their returns, sent together, each get their own tail (a partial restore on
    top of vLLM's own prefix-cache hit for one of them)."""
    shared = tokens(512, seed=41)
    prompts = [shared + tokens(150, seed=42 + i) for i in range(2)]
    first = fp32.generate(prompts, max_tokens=OUT).outputs
    assert [_kv(r)["tokens"] for r in first] == [640, 640]
    assert _kv(first[0])["last_key"] != _kv(first[1])["last_key"]
    back = [p + r.token_ids + tokens(40, seed=50 + i)
            for i, (p, r) in enumerate(zip(prompts, first, strict=True))]
    refs = [reference(fp32, p, f"ref-share-{i}") for i, p in enumerate(back)]
    again = fp32.generate(back, max_tokens=OUT, reset_prefix_cache=True).outputs
    assert [r.num_cached_tokens for r in again] == [640, 640]
    assert restored(again[0]) == 640
    # the second finds the shared chunks in vLLM's own cache (the first just loaded
    # them) and restores only its own tail, or is scheduled first and restores it all
    assert restored(again[1]) in (128, 640)
    assert [r.token_ids for r in again] == refs


def test_a_p_d_hand_off_announces_and_restores_the_tail(fp32: LLMWorker) -> None:
    """The P/D protocol on one engine: a prefill-style run (1 output token) announces 2
    chunks and a 1-block tail; the decode-style request carries that announcement as
    ``expect`` (checked against its own prompt's keys, the tail's included) and restores
    all 640 tokens, equal to a recompute. Waiting for an announced tail to appear on a
    shared tier is ``test_tails.py``'s."""
    prompt = tokens(700, seed=61)
    ref = reference(fp32, prompt, "ref-pd-tail")
    kv = _kv(fp32.generate([prompt], max_tokens=1).outputs[0])
    assert kv["tokens"] == 640
    expect = {"expect": {k: kv[k] for k in ("namespace", "tokens", "last_key")}}
    r = fp32.generate([prompt], max_tokens=OUT, reset_prefix_cache=True,
                      kv_transfer_params=[{"kvtier": expect}]).outputs[0]
    assert restored(r) == 640  # the announced chunks and tail, from host or file tier
    assert r.token_ids == ref


def test_cache_salt_isolates(fp32: LLMWorker) -> None:
    p = tokens(800, seed=41)
    fp32.generate([p], max_tokens=OUT, cache_salt=["tenant-a"])
    r = fp32.generate([p], max_tokens=OUT, cache_salt=["tenant-b"],
                      reset_prefix_cache=True).outputs[0]
    assert restored(r) == 0
    r = fp32.generate([p], max_tokens=OUT, cache_salt=["tenant-a"],
                      reset_prefix_cache=True).outputs[0]
    assert restored(r) > 0


def stored_objects(store: Path, kv: dict[str, Any]) -> list[Path]:
    """The file-tier objects of the prefix a finished request stored (its ``kvtier``
    ``kv_transfer_params``), first chunk first: ``last_key``'s object, then each header's
    parent back to the first chunk. Only that request's own objects, whatever other
    requests wrote meanwhile; asserts every one of them is on disk."""
    on_disk = {f.name: f for f in store.rglob("*.kv")}
    chain: list[Path] = []
    key: str | None = kv["last_key"]
    while key is not None:
        f = on_disk.get(f"{key}.kv")
        assert f is not None, f"chunk {len(chain)} from the end ({key}) is not on disk"
        with f.open("rb") as fh:
            meta, _ = decode_header(fh.read(HEADER_SPAN))
        assert meta.namespace.hex() == kv["namespace"]
        chain.append(f)
        key = None if meta.parent is None else meta.parent.hex()
    assert len(chain) == -(-kv["tokens"] // 256), "one object per stored chunk"
    return chain[::-1]


def test_corrupt_object_on_disk_means_recompute(fp32: LLMWorker, shared_store: Path) -> None:
    p = tokens(800, seed=51)
    ref = reference(fp32, p, "ref-corrupt")
    first = fp32.generate([p], max_tokens=OUT).outputs[0]
    # host tier dropped, disk kept: a reset completes once no write-through holds a
    # host slot, so every chunk's write has ended
    fp32.reset_until_done()
    objects = stored_objects(shared_store, _kv(first))  # this prompt's, written through
    assert len(objects) == 3
    for f in objects:
        data = bytearray(f.read_bytes())
        data[-7] ^= 0x5A
        f.write_bytes(bytes(data))
    r = fp32.generate([p], max_tokens=OUT, reset_prefix_cache=True).outputs[0]
    assert _kv(r)["decision"] is not None, "the lookup found the chunks and loaded them"
    assert restored(r) == 0
    assert r.token_ids == ref
    # The first chunk failed verification and was removed; the load stopped there, so
    # the later (also damaged) chunks were never read: they are caught when they are.
    assert not objects[0].exists(), "a corrupt object that was read is removed"
    assert all(f.exists() for f in objects[1:]), "no chunk after it was read"


def test_bf16_restore_equals_vllm_prefix_cache_hit(bf16: LLMWorker) -> None:
    p = tokens(1000, seed=71)
    bf16.generate([p], max_tokens=OUT)
    hit = bf16.generate([p], max_tokens=OUT).outputs[0]  # vLLM's own prefix-cache hit
    assert hit.num_cached_tokens > 0 and restored(hit) == 0
    r = bf16.generate([p], max_tokens=OUT, reset_prefix_cache=True).outputs[0]
    assert restored(r) > 0
    assert r.token_ids == hit.token_ids


def test_other_dtype_gets_no_hit(fp32: LLMWorker, bf16: LLMWorker) -> None:
    """The same tokens stored by the fp32 engine are invisible to the bf16 engine."""
    p = tokens(900, seed=81)
    fp32.generate([p], max_tokens=OUT)
    fp32.reset_until_done()
    r = bf16.generate([p], max_tokens=OUT, reset_prefix_cache=True).outputs[0]
    assert restored(r) == 0


# S3 on moto behind a real engine runs in the benchmark smokes (restore_vs_recompute's
# S3 rung, and the stall benchmark's hung endpoint); here the real S3 server is RGW.
@pytest.mark.s3
@pytest.mark.ceph
def test_one_lower_tier_on_a_storage_server(
    engine_factory: EngineFactory, tiny_fp32: Path,
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """The only lower tier is S3 (Ceph RGW: a real S3 server) or CephFS (a real shared
    filesystem), one engine each (started side by side); what the host pool forgot comes
    back from it, token-identical."""
    cluster = request.getfixturevalue("ceph")
    endpoint = rgw_endpoint(request)  # also puts test credentials in the environment
    tiers: dict[str, tuple[str, dict[str, Any]]] = {
        "rgw": ("s31", {"s3": {
            "bucket": BUCKET, "prefix": "e2e/", "endpoint_url": endpoint,
            "region": "us-east-1", "path_style": True, "capacity": "1GiB", "write": "through",
            "part_size": "8MiB", "multipart_threshold": "64MiB"}}),
        "cephfs": ("file1", {"file": {"path": str(cephfs_dir(cluster, "e2e-store")),
                                      "capacity": "1GiB", "write": "through"}}),
    }
    cfg = tmp_path_factory.mktemp("cfg")
    engines = engine_factory.side_by_side(*[
        (tiny_fp32, write_config(cfg / f"{server}.yaml", [tier], reset_cache="host"),
         {"enable_prefix_caching": False}) for server, (_, tier) in tiers.items()])
    p = tokens(900, seed=91)
    for (server, (name, _)), eng in zip(tiers.items(), engines, strict=True):
        first = eng.generate([p], max_tokens=OUT).outputs[0]
        eng.reset_until_done()  # only the lower tier holds it now
        r = eng.generate([p], max_tokens=OUT).outputs[0]
        assert restored(r) >= 768, server
        assert tiers_used(r) == {name}, server
        assert r.token_ids == first.token_ids, server
    for eng in engines:  # do not keep them alive until the module ends
        eng.close()


def test_bad_config_fails_at_engine_start(bad_config_engine: LLMWorker) -> None:
    with pytest.raises(WorkerError) as e:
        bad_config_engine.wait_ready()
    assert "tiers[0].host.capacity" in str(e.value) + bad_config_engine.log_path.read_text()
