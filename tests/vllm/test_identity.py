"""Key identity beyond token ids: LoRA adapters, multimodal inputs, prompt embeddings.

Requests are plain records with the attributes of vLLM's ``Request`` that kvtier reads.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import Any, ParamSpec, TypeVar

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvtier.build import build_store
from kvtier.clock import ManualClock
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
    adapter_signature,
    encode_mm,
)
from kvtier.vllm.scheduler_side import SchedulerSide

P = ParamSpec("P")
T = TypeVar("T")

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


class Inline(Executor):
    """Runs each job at once on the calling thread: fingerprints are known immediately."""

    def submit(self, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> Future[T]:
        fut: Future[T] = Future()
        fut.set_result(fn(*args, **kwargs))
        return fut


class Recorded(ThreadPoolExecutor):
    """A real background thread whose jobs a test can wait for."""

    def __init__(self) -> None:
        super().__init__(1)
        self.jobs: list[Future[Any]] = []

    def submit(self, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> Future[T]:
        fut = super().submit(fn, *args, **kwargs)
        self.jobs.append(fut)
        return fut

    def drain(self) -> None:
        for fut in self.jobs:
            fut.result(timeout=10)


def _ready(ids: RequestIdentities, req: SimpleNamespace) -> RequestIdentity:
    """The identity; the fixture's adapters fingerprint inline, so it is known at once."""
    got = ids.of(req)
    assert isinstance(got, RequestIdentity)
    return got


def _keys(ident: RequestIdentity) -> list[ChunkKey]:
    return chunk_keys(ident.namespace, TOKENS, CT, extra=ident.chunk_extra or b"")


@pytest.fixture
def ids() -> Iterator[RequestIdentities]:
    ident = RequestIdentities(NS, CT, AdapterFingerprints(executor=Inline()))
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

    pool = Recorded()
    fps = AdapterFingerprints(slow, signature=lambda p: (), executor=pool, clock=ManualClock())
    try:
        assert fps.get("a", "/x") is PENDING
        gate.set()
        pool.drain()
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

    pool = Recorded()
    sched.identities.adapters = AdapterFingerprints(slow, signature=lambda p: (),
                                                    executor=pool, clock=ManualClock())
    req = _req(lora_request=_lora("a", tmp_path))
    assert sched.get_num_new_matched_tokens(req, 0) == (None, False)
    gate.set()
    pool.drain()
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)  # nothing stored yet


# -- LoRA adapters whose files change ----------------------------------------------------------
def _fps(clock: ManualClock, **kw: Any) -> AdapterFingerprints:
    return AdapterFingerprints(executor=kw.pop("executor", Inline()), clock=clock, **kw)


def test_an_adapter_rewritten_in_place_is_refused_until_reloaded(tmp_path: Path) -> None:
    """vLLM keeps serving the weights it loaded until it re-reads the adapter, which
    kvtier cannot see: once the files change on disk, neither fingerprint is known to
    name the KV, so the adapter is refused (review 2026-12-04, old defect 7: the keys
    followed the files); a ``load_inplace`` reload (``forget``) fingerprints it again."""
    clock = ManualClock()
    fps = _fps(clock, revalidate_s=5.0)
    a = _adapter(tmp_path, "a", b"weights-1")
    first = fps.get("a", str(a))
    assert first == adapter_fingerprint(a)
    (a / "adapter_model.safetensors").write_bytes(b"weights-2")
    assert fps.get("a", str(a)) == first, "not re-checked before revalidate_s"
    clock.advance(5.0)
    with pytest.raises(Unsupported, match="changed on disk"):
        fps.get("a", str(a))
    clock.advance(60.0)
    with pytest.raises(Unsupported, match="changed on disk"):
        fps.get("a", str(a))  # not served again by time alone
    fps.forget("a", str(a))  # vLLM reloads it in place
    assert fps.get("a", str(a)) == adapter_fingerprint(a) != first


def test_an_adapter_replaced_by_rename_with_the_same_size_is_noticed(tmp_path: Path) -> None:
    clock = ManualClock()
    fps = _fps(clock, revalidate_s=1.0)
    a = _adapter(tmp_path, "a", b"AAAA")
    fps.get("a", str(a))
    new = tmp_path / "staged"
    new.write_bytes(b"BBBB")  # same size; another inode
    os.utime(new, ns=(0, (a / "adapter_model.safetensors").stat().st_mtime_ns))  # same mtime
    new.rename(a / "adapter_model.safetensors")
    clock.advance(1.0)
    with pytest.raises(Unsupported, match="changed on disk"):
        fps.get("a", str(a))


def test_unchanged_files_are_stated_not_read_again(tmp_path: Path) -> None:
    reads: list[str] = []

    def counting(path: str) -> str:
        reads.append(path)
        return adapter_fingerprint(path)

    clock = ManualClock()
    fps = AdapterFingerprints(counting, executor=Inline(), clock=clock, revalidate_s=1.0)
    a = _adapter(tmp_path, "a", b"w")
    for _ in range(3):
        assert fps.get("a", str(a)) == adapter_fingerprint(a)
        clock.advance(1.0)
    assert reads == [str(a)]


def test_changed_files_are_refused_once_the_check_sees_them(tmp_path: Path) -> None:
    """While the check runs, the fingerprint it has is answered (from memory); once the
    check has seen the new signature, the adapter is refused, never answered with the
    old fingerprint for new files."""
    a = _adapter(tmp_path, "a", b"weights-1")
    first_gate = threading.Event()
    calls = 0

    def gated(path: str) -> str:
        nonlocal calls
        calls += 1
        if calls == 1:  # the first check may not finish before the first answer
            first_gate.wait(10)
        return adapter_fingerprint(path)

    clock, pool = ManualClock(), Recorded()
    fps = AdapterFingerprints(gated, executor=pool, clock=clock, revalidate_s=1.0)
    try:
        assert fps.get("a", str(a)) is PENDING
        first_gate.set()
        pool.drain()
        first = fps.get("a", str(a))
        (a / "adapter_model.safetensors").write_bytes(b"weights-22")
        clock.advance(1.0)
        assert fps.get("a", str(a)) == first, "answered from memory while the check runs"
        pool.drain()
        with pytest.raises(Unsupported, match="changed on disk"):
            fps.get("a", str(a))
        assert calls == 1, "the changed files are not read: the adapter is refused"
    finally:
        first_gate.set()
        fps.close()


def test_the_scheduler_thread_never_touches_adapter_files(tmp_path: Path) -> None:
    threads: set[str] = set()

    def sig(path: str) -> Any:
        threads.add(threading.current_thread().name)
        return adapter_signature(path)

    def fp(path: str) -> str:
        threads.add(threading.current_thread().name)
        return adapter_fingerprint(path)

    clock, pool = ManualClock(), Recorded()
    fps = AdapterFingerprints(fp, signature=sig, executor=pool, clock=clock, revalidate_s=1.0)
    a = _adapter(tmp_path, "a", b"w")
    try:
        for _ in range(3):
            fps.get("a", str(a))
            pool.drain()
            clock.advance(1.0)
        assert threads and threading.current_thread().name not in threads
    finally:
        fps.close()


def test_a_failed_fingerprint_is_retried_after_a_backoff(tmp_path: Path) -> None:
    a = tmp_path / "late"
    clock = ManualClock()
    fps = _fps(clock, retry_s=1.0, max_retry_s=60.0)
    with pytest.raises(Unsupported, match="LoRA adapter 'late'"):
        fps.get("late", str(a))
    clock.advance(0.5)
    with pytest.raises(Unsupported):
        fps.get("late", str(a))  # refused from memory during the backoff
    clock.advance(0.5)
    with pytest.raises(Unsupported):
        fps.get("late", str(a))  # retried: still missing, next try in 2 s
    clock.advance(1.0)
    _adapter(tmp_path, "late", b"w")
    with pytest.raises(Unsupported):
        fps.get("late", str(a))  # the backoff doubled
    clock.advance(1.0)
    assert fps.get("late", str(a)) == adapter_fingerprint(a)


def test_an_adapter_that_disappears_is_refused_not_served_stale(tmp_path: Path) -> None:
    clock = ManualClock()
    fps = _fps(clock, revalidate_s=1.0)
    a = _adapter(tmp_path, "a", b"w")
    assert isinstance(fps.get("a", str(a)), str)
    for f in a.iterdir():
        f.unlink()
    clock.advance(1.0)
    with pytest.raises(Unsupported, match="empty"):
        fps.get("a", str(a))


# -- weights epoch -------------------------------------------------------------------------------
def test_epoch_zero_is_the_digest_without_an_epoch() -> None:
    assert NS.digest(epoch=0) == NS.digest()
    assert NS.digest("s", adapter="a\x00f", epoch=0) == NS.digest("s", adapter="a\x00f")
    assert len({NS.digest(epoch=e) for e in range(4)}) == 4
    with pytest.raises(ValueError, match="epoch"):
        NS.digest(epoch=-1)


def test_bump_epoch_changes_every_key_and_a_restart_starts_at_zero(
    ids: RequestIdentities,
) -> None:
    before = _keys(_ready(ids, _req(cache_salt="t")))
    first = ids.bump_epoch()
    assert first != 0
    after = _keys(_ready(ids, _req(cache_salt="t")))
    assert not set(before) & set(after)
    assert _keys(_ready(ids, _req(cache_salt="t"))) == after, "stable within an epoch"
    assert ids.bump_epoch() not in (0, first)  # a new epoch every time
    assert not set(_keys(_ready(ids, _req(cache_salt="t")))) & (set(after) | set(before))
    restarted = RequestIdentities(NS, CT, AdapterFingerprints(executor=Inline()))
    try:
        assert _keys(_ready(restarted, _req(cache_salt="t"))) == before
    finally:
        restarted.close()


# -- multimodal encoding -------------------------------------------------------------------------
def _decode_mm(raw: bytes) -> list[tuple[str, int]]:
    """The inverse of ``encode_mm``: that it exists proves the encoding is injective."""
    if not raw:
        return []
    assert raw[:1] == b"\x01"
    n, pos, out = int.from_bytes(raw[1:9], "little"), 9, []
    for _ in range(n):
        size = int.from_bytes(raw[pos : pos + 8], "little")
        ident = raw[pos + 8 : pos + 8 + size].decode("utf-8", "surrogatepass")
        pos += 8 + size
        out.append((ident, int.from_bytes(raw[pos : pos + 8], "little", signed=True)))
        pos += 8
    assert pos == len(raw)
    return out


#: Identifiers of any code points, lone surrogates included; offsets of any int64.
_IDENT = st.text(st.characters(exclude_categories=()), max_size=12)
_ITEMS = st.lists(st.tuples(_IDENT, st.integers(-(2**63), 2**63 - 1)), max_size=6)


@given(_ITEMS)
def test_mm_encoding_round_trips(items: list[tuple[str, int]]) -> None:
    assert _decode_mm(encode_mm(items)) == items


@given(_ITEMS, _ITEMS)
def test_different_mm_inputs_never_encode_alike(
    a: list[tuple[str, int]], b: list[tuple[str, int]]
) -> None:
    assert (encode_mm(a) == encode_mm(b)) == (a == b)


def test_the_old_ambiguous_mm_encoding_is_gone(ids: RequestIdentities) -> None:
    # Before: b"mm:" + id + b"@" + offset joined by b"|". Two images "x" at 0 and "y" at 5
    # gave the bytes of one image named "x@0|mm:y" at 5.
    two = _ready(ids, _req(mm_features=[_mm("x", 0, 1), _mm("y", 5, 1)]))
    one = _ready(ids, _req(mm_features=[_mm("x@0|mm:y", 5, 1)]))
    assert two.chunk_extra is not None and one.chunk_extra is not None
    assert two.chunk_extra(0) != one.chunk_extra(0)


def test_mm_and_prompt_embeds_parts_cannot_stand_in_for_each_other(
    ids: RequestIdentities,
) -> None:
    e = torch.zeros(CT, 4)
    both = _ready(ids, _req(mm_features=[_mm("img", 0, 4)], prompt_embeds=e))
    only_mm = _ready(ids, _req(mm_features=[_mm("img", 0, 4)]))
    only_e = _ready(ids, _req(prompt_embeds=e))
    assert both.chunk_extra and only_mm.chunk_extra and only_e.chunk_extra
    got = {both.chunk_extra(0), only_mm.chunk_extra(0), only_e.chunk_extra(0)}
    assert len(got) == 3
    assert both.chunk_extra(1) == b"", "a chunk no input overlaps keys like text"


def test_an_engine_requiring_router_salts_touches_no_kv_of_a_request_without_one(
        tmp_path: Path) -> None:
    """``tenancy.require_router_salt`` (issue 47): a request whose salt the router did not
    issue under the shared secret (none, the client's own, an unkeyed hash of a tenant's
    name, one edited) neither restores nor stores; one the router issued does both."""
    from kvtier.tenancy import issue

    secret = tmp_path / "secret"
    secret.write_text("r" * 40 + "\n")
    cfg = KVTierConfig.model_validate({
        "chunk_tokens": CT, "tiers": [{"host": {"capacity": "4MiB", "pinned": "no"}}],
        "restore": {"recompute_threshold_tokens": 1},
        "tenancy": {"require_router_salt": True, "secret_file": str(secret)}})
    geom = Geometry(2, 2, 64, CT, 4096, "float32")
    s = SchedulerSide(cfg, geom, NS, None, store=build_store(cfg, geom.chunk_bytes(CT)))
    good = issue(b"r" * 40, "acme")
    try:
        import hashlib

        unkeyed = "kvtier-tenant-" + hashlib.blake2b(b"acme", digest_size=16).hexdigest()
        for i, salt in enumerate((None, "mine", unkeyed, good[:-1] + "f0"[good[-1] == "f"])):
            req = _req(f"bad{i}", cache_salt=salt, num_computed_tokens=len(TOKENS))
            assert s.get_num_new_matched_tokens(req, 0) == (0, False)
            _delay, params = s.request_finished(req, list(range(4)))
            assert params["kvtier"]["tokens"] == 0, salt
        assert not list(s.store.host.index.entries())
        req = _req("good", cache_salt=good, num_computed_tokens=len(TOKENS))
        assert s.get_num_new_matched_tokens(req, 0) == (0, False)  # nothing stored yet
        _delay, params = s.request_finished(req, list(range(4)))
        assert params["kvtier"]["tokens"] > 0
    finally:
        s.close()
    with pytest.raises(ValueError, match="needs the router's tenant secret"):
        KVTierConfig.model_validate({"tiers": [{"host": {"capacity": "8MiB"}}],
                                     "tenancy": {"require_router_salt": True}})
