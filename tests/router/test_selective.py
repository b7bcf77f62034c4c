"""Selective P/D: the decision rule, the measured threshold, the token estimate, and the
router taking each path against the fake backends (``tests.router.fakes``).

The fake backends report ``tokens`` as the prompt's character count, so once the router has
seen one prefill call its estimate is one token per byte."""

from __future__ import annotations

import asyncio
import math
import re
from pathlib import Path

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from kvtier.router.app import ROUTER_KEY
from kvtier.router.metrics import Turn
from kvtier.router.planner import computed_tokens
from kvtier.router.protocol import PromptUsage, prompt_usage
from kvtier.router.selective import (
    DEFAULT_THRESHOLD_TOKENS,
    MIN_OBSERVATIONS,
    Estimator,
    Loads,
    PathCosts,
    decide,
)
from tests.router.fakes import (
    Backend,
    Harness,
    completion_of,
    harness,
    post,
    run,
    stream_text,
    tiered_harness,
)

pytestmark = pytest.mark.timeout(30)


# -- the rule --------------------------------------------------------------------------------


@pytest.mark.parametrize(("uncached", "loads", "path", "reason"), [
    (100, Loads(), "decode_only", "short"),
    (512, Loads(), "decode_only", "short"),
    (513, Loads(), "prefill_decode", "long"),
    (900, Loads(prefill_tokens=1000), "decode_only", "prefill_busy"),
    (100, Loads(decode_only_tokens=450), "prefill_decode", "decode_busy"),
    (3000, Loads(prefill_tokens=10_000), "prefill_decode", "long"),  # over the cap
])
def test_decide_names_its_reason(uncached: int, loads: Loads, path: str, reason: str) -> None:
    d = decide("auto", uncached, 512, loads, 2048)
    assert (d.path, d.reason) == (path, reason)


def test_forced_modes_ignore_costs_and_load() -> None:
    assert decide("always", 0, 512, Loads(prefill_tokens=1e9), 2048).path == "prefill_decode"
    assert decide("never", 10**6, 0, Loads(decode_only_tokens=1e9), 0).path == "decode_only"
    assert decide("never", 5, 512, Loads(), 2048).reason == "forced"


@given(st.integers(-10, 10**6), st.integers(-10, 10**6), st.integers(0, 10**5),
       st.floats(0, 1e6), st.floats(0, 1e6), st.integers(0, 10**5))
def test_decode_only_is_exactly_the_turns_up_to_the_limit(
        u1: int, u2: int, threshold: int, queued_p: float, queued_d: float, cap: int) -> None:
    loads = Loads(queued_p, queued_d)
    lo, hi = sorted((u1, u2))
    a, b = decide("auto", lo, threshold, loads, cap), decide("auto", hi, threshold, loads, cap)
    assert a.limit_tokens == b.limit_tokens <= cap
    for d in (a, b):
        assert (d.path == "decode_only") == (d.uncached_tokens <= d.limit_tokens)
        assert d.uncached_tokens >= 0
    assert not (b.path == "decode_only" and a.path == "prefill_decode")  # monotone


# -- the measured threshold ------------------------------------------------------------------


def test_threshold_is_the_default_until_prefill_calls_of_several_sizes_are_measured() -> None:
    costs = PathCosts()
    for _ in range(MIN_OBSERVATIONS * 2):
        costs.observe_prefill_decode(100, 0.06, 0.1)  # one size only: no slope
    t = costs.threshold()
    assert (t.tokens, t.measured) == (DEFAULT_THRESHOLD_TOKENS, False)
    assert "prefill calls measured" in t.why


def test_threshold_is_the_default_while_prefill_sizes_are_all_alike() -> None:
    costs = PathCosts()
    for i in range(MIN_OBSERVATIONS * 2):  # first turns of one workload: 1530-1590 tokens
        u = 1530 + (i * 37) % 61
        costs.observe_prefill_decode(u, 0.7e-3 * u + (0.05 if i % 2 else -0.05), 1.0)
    assert costs.threshold().measured is False
    for i in range(MIN_OBSERVATIONS):  # returning turns: short suffixes
        costs.observe_prefill_decode(60 + 10 * i, 0.7e-3 * (60 + 10 * i), 0.3)
    assert costs.threshold().measured


def test_computed_tokens_come_from_vllms_usage_when_it_reports_the_cached_ones() -> None:
    def turn(usage: PromptUsage | None, restored: int = 0,
             uncached: int | None = None) -> Turn:
        return Turn("completions", 0.0, prefill_tokens=1792, restored_tokens=restored,
                    uncached_tokens=uncached, prefill_usage=usage)

    # --enable-prompt-tokens-details: exact, whatever served the rest
    assert computed_tokens(turn(PromptUsage(1850, 1792), uncached=1000)) == 58
    # without it: the prompt less kvtier's restore, capped by the uncached estimate
    # (the prefill node's own prefix cache served the history)
    assert computed_tokens(turn(PromptUsage(1850), restored=256, uncached=120)) == 120
    assert computed_tokens(turn(PromptUsage(1850), restored=1792, uncached=120)) == 58
    assert computed_tokens(turn(None, restored=0)) == 1792  # no usage: the params' tokens
    assert computed_tokens(Turn("completions", 0.0)) is None
    doc = {"usage": {"prompt_tokens": 1850, "prompt_tokens_details": {"cached_tokens": 1792}}}
    assert prompt_usage(doc) == PromptUsage(1850, 1792)
    assert prompt_usage({"usage": {"prompt_tokens": 10}}) == PromptUsage(10)
    assert prompt_usage({"usage": {"prompt_tokens": True}}) is None
    assert prompt_usage({"usage": None}) is None and prompt_usage([]) is None
    over = {"prompt_tokens": 10, "prompt_tokens_details": {"cached_tokens": 11}}
    assert prompt_usage({"usage": over}) == PromptUsage(10)  # more cached than prompt: unknown


def test_threshold_is_the_saved_hop_over_the_per_token_prefill_cost() -> None:
    hop, per_token, leg = 0.030, 50e-6, 0.020  # 30 ms hop, 20k tokens/s, 20 ms decode leg
    costs = PathCosts(max_direct_tokens=100_000)
    for i in range(MIN_OBSERVATIONS):
        u = 200 * (i + 1)
        costs.observe_prefill_decode(u, hop + per_token * u, hop + per_token * u + leg)
    t = costs.threshold()  # decode-only's fixed cost not measured yet: taken as the leg
    assert t.measured and t.tokens == pytest.approx(hop / per_token, abs=2)
    for u in (10, 400, 800, 1600):  # decode-only turns: 5 ms fixed cost, same compute
        costs.observe_decode_only(u, 0.005 + per_token * u)
    for _ in range(MIN_OBSERVATIONS):
        costs.observe_decode_only(100, 0.005 + per_token * 100)
    saved = hop + leg - 0.005
    assert costs.threshold().tokens == pytest.approx(saved / per_token, abs=2)
    capped = PathCosts(max_direct_tokens=300)
    for i in range(MIN_OBSERVATIONS):
        u = 200 * (i + 1)
        capped.observe_prefill_decode(u, hop + per_token * u, None)
    assert capped.threshold().tokens == 300


def test_the_estimate_counts_only_the_bytes_added_since_the_anchor() -> None:
    est = Estimator()
    assert est.tokens(4000) == 1000  # 4 bytes per token until measured
    est.observe(3000, 1000)
    assert est.bytes_per_token == 3.0
    assert est.tokens(3030, anchor_bytes=3000, anchor_tokens=1234) == 1244
    assert est.tokens(100, anchor_bytes=3000, anchor_tokens=1234) == math.ceil(100 / 3)


# -- the router ------------------------------------------------------------------------------
# The fake engines store real chunk objects (16 tokens, blocks of 4; one token per byte) in
# a file tier the router opens with --tiers: the router's held count is the tier's.


async def metrics_text(h: object) -> str:
    async with h.client.get("/metrics") as resp:  # type: ignore[attr-defined]
        return str(await resp.text())


def decisions(text: str) -> list[tuple[str, str, str]]:
    return sorted(re.findall(
        r'kvtier_router_pd_decisions_total\{path="(\w+)",reason="(\w+)"\} (\S+)', text))


async def chat(h: Harness, messages: list[dict[str, str]], cid: str | None = None,
               **headers: str) -> tuple[str, str]:
    body: dict[str, object] = {"messages": messages, "model": "m"}
    if cid is not None:
        body["conversation_id"] = cid
    status, doc, resp_headers = await post(h, body, "/v1/chat/completions", **headers)
    assert status == 200, doc
    return resp_headers["X-KVTier-Path"], doc["choices"][0]["text"]


def test_a_client_without_ids_gets_decode_only_for_returning_turns(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with tiered_harness(tmp_path) as h:
            history = [{"role": "user", "content": "a long first question " * 40}]
            path, answer = await chat(h, history)  # 880 tokens, nothing held, ns unknown
            assert path == "prefill_decode"
            history += [{"role": "assistant", "content": answer},
                        {"role": "user", "content": "and a short follow-up?"}]
            path, answer = await chat(h, history)
            assert path == "decode_only" and len(h.prefill.bodies) == 1
            router = h.client.app[ROUTER_KEY]
            assert len(router.conversations) == 0  # nothing tracked: no id was sent
            history += [{"role": "assistant", "content": answer},
                        {"role": "user", "content": "a new document " * 100}]
            assert (await chat(h, history))[0] == "prefill_decode"  # 1,500 new tokens
            text = await metrics_text(h)
        assert decisions(text) == [("decode_only", "short", "1.0"),
                                   ("prefill_decode", "long", "1.0"),
                                   ("prefill_decode", "no_namespace", "1.0")]
        assert "kvtier_router_prefix_lookup_seconds_count 3.0" in text
    run(scenario)


def test_a_compacted_history_under_the_same_id_takes_the_prefill_hop(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with tiered_harness(tmp_path) as h:
            first = [{"role": "user", "content": "turn one of a coding session " * 60}]
            path, answer = await chat(h, first, "agent")
            assert path == "prefill_decode"
            second = [*first, {"role": "assistant", "content": answer},
                      {"role": "user", "content": "+40 tokens of a question here"}]
            path, _ = await chat(h, second, "agent")
            assert path == "decode_only"
            # the client summarises and replaces its history: as long, all new tokens
            compacted = [{"role": "user", "content": "Summary: " + "compacted text " * 120}]
            path, _ = await chat(h, compacted, "agent")
            assert path == "prefill_decode" and len(h.prefill.bodies) == 2
            # an edited history of the same length: what changed is not held
            edited = [{"role": "user", "content": "turn 1 of a coding session " * 60}, *second[1:]]
            assert (await chat(h, edited, "agent"))[0] == "prefill_decode"
            assert len(h.client.app[ROUTER_KEY].conversations) == 1  # still renewable
    run(scenario)


def test_a_streamed_decode_only_turn_streams_and_is_remembered(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with tiered_harness(tmp_path) as h:
            prompt = "a streamed conversation " * 20
            assert (await stream_text(h, prompt, "c"))[0] == 200  # learns the namespace
            follow = prompt + "".join(completion_of(prompt)) + " short"
            status, text, _ = await stream_text(h, follow, "c")
            assert status == 200 and text == "".join(completion_of(follow))
            assert len(h.prefill.bodies) == 1  # the follow-up went decode-only
            _, _, headers = await post(h, {"prompt": "short, again", "conversation_id": "c"})
            assert headers["X-KVTier-Conversation"] == "known"
    run(scenario)


def test_a_busy_prefill_node_sends_a_medium_turn_decode_only(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with tiered_harness(tmp_path, pd_default_threshold=100) as h:
            await post(h, {"prompt": "warm up"})  # learns the namespace
            h.prefill.mode = "hang"
            stuck = asyncio.create_task(post(h, {"prompt": "x" * 1000}))  # 1000 queued
            await asyncio.wait_for(h.prefill.wait_for_calls(2), 5)
            status, _, headers = await post(h, {"prompt": "y" * 300})  # 300 tokens
            assert status == 200 and headers["X-KVTier-Path"] == "decode_only"
            assert len(h.prefill.bodies) == 2
            h.prefill.mode = "ok"
            h.prefill.release.set()
            assert (await stuck)[0] == 200
            text = await metrics_text(h)
        assert 'path="decode_only",reason="prefill_busy"} 1.0' in text
    run(scenario)


@pytest.mark.parametrize(("mode", "path"), [("always", "prefill_decode"),
                                            ("never", "decode_only")])
def test_pd_mode_forces_the_path_without_a_lookup(mode: str, path: str) -> None:
    async def scenario() -> None:
        async with harness(pd_mode=mode) as h:
            for prompt in ("tiny", "huge " * 5000):
                status, _, headers = await post(h, {"prompt": prompt})
                assert status == 200 and headers["X-KVTier-Path"] == path
            assert len(h.prefill.bodies) == (2 if mode == "always" else 0)
            assert h.prefill.tokenized == h.decode.tokenized == []
    run(scenario)


def test_token_id_prompts_are_keyed_without_tokenizing(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with tiered_harness(tmp_path, pd_default_threshold=16) as h:
            base = list(range(1, 200))
            await post(h, {"prompt": base})  # learns the namespace; prefill stores 196
            _, _, headers = await post(h, {"prompt": base + [7] * 10})
            assert headers["X-KVTier-Path"] == "decode_only"  # 13 uncached: 12 chunks + tail
            _, _, headers = await post(h, {"prompt": base + [7] * 20})
            assert headers["X-KVTier-Path"] == "decode_only"  # the last turn stored 208
            _, _, headers = await post(h, {"prompt": base + [9] * 30})
            assert headers["X-KVTier-Path"] == "prefill_decode"  # 33 uncached
            assert h.prefill.tokenized == h.decode.tokenized == []
    run(scenario)


@pytest.mark.parametrize(("change", "reason"), [
    ("no_tiers", "no_tier"),
    ("image", "multimodal"),
    ("documents", "unsupported_prompt"),
    ("tokenizer_fails", "tokenizer"),
    ("tokenizer_hangs", "tokenizer"),
])
def test_a_prompt_whose_keys_cannot_be_computed_takes_the_prefill_hop(
        tmp_path: Path, change: str, reason: str) -> None:
    async def scenario() -> None:
        prefill = Backend(tokenize_mode={"tokenizer_fails": "fail500",
                                         "tokenizer_hangs": "hang"}.get(change, "ok"))
        content: object = "short"
        body: dict[str, object] = {}
        if change == "image":
            content = [{"type": "text", "text": "what is this?"},
                       {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}}]
        if change == "documents":
            body["documents"] = [{"title": "t", "text": "d"}]
        ctx = (harness(prefill, pd_mode="auto") if change == "no_tiers"
               else tiered_harness(tmp_path, prefill, tokenize_timeout=0.2))
        async with ctx as h:
            body["messages"] = [{"role": "user", "content": content}]
            status, _, headers = await post(h, body, "/v1/chat/completions")
            assert status == 200 and headers["X-KVTier-Path"] == "prefill_decode"
            text = await metrics_text(h)
        assert decisions(text) == [("prefill_decode", reason, "1.0")]
    run(scenario)


def test_tenants_hold_only_their_own_prefixes(tmp_path: Path) -> None:
    keys = {"sk-acme-0123456789abcdef": "acme", "sk-globex-fedcba98765": "globex"}
    tenants = tmp_path / "tenants.yaml"
    tenants.write_text(yaml.safe_dump({"keys": keys}))
    acme, globex = ({"Authorization": f"Bearer {k}"} for k in keys)

    async def scenario() -> None:
        async with tiered_harness(tmp_path, tenants=tenants) as h:
            for who in (acme, globex):  # each learns its own namespace
                assert (await chat(h, [{"role": "user", "content": "hi"}], **who))[0] == \
                    "prefill_decode"
            secret = [{"role": "user", "content": "acme's confidential document " * 40}]
            await chat(h, secret, **acme)
            probe = [*secret, {"role": "user", "content": "?"}]
            # globex sends acme's exact history: nothing of it is globex's, so the long hop
            status, doc, headers = await post(h, {"messages": probe, "model": "m"},
                                              "/v1/chat/completions", **globex)
            assert status == 200 and headers["X-KVTier-Path"] == "prefill_decode"
            assert not any(name.startswith("X-KVTier-Restore") for name in headers)
            assert "kv_transfer_params" not in doc
            assert (await chat(h, probe, **acme))[0] == "decode_only"  # acme's own: held
            salts = {b.get("cache_salt") for b in h.prefill.tokenized}
            assert len(salts) == 1 and None in salts  # /tokenize is not salted: no KV
    run(scenario)


def test_the_namespace_is_learnt_only_from_answers_that_verify(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with tiered_harness(tmp_path) as h:
            h.prefill.last_key = "00" * 16
            kv = h.prefill.kv
            assert kv is not None
            real_save = kv.save

            def forged(body: dict[str, object], ids: list[int]) -> dict[str, object]:
                return real_save(body, ids) | {"last_key": "00" * 16}

            kv.save = forged  # type: ignore[method-assign]
            prompt = "a conversation " * 20
            for _ in range(2):  # a last_key that is not this prompt's: never learnt
                _, _, headers = await post(h, {"prompt": prompt})
                assert headers["X-KVTier-Path"] == "prefill_decode"
            kv.save = real_save  # type: ignore[method-assign]
            await post(h, {"prompt": prompt})
            _, _, headers = await post(h, {"prompt": prompt + " more"})
            assert headers["X-KVTier-Path"] == "decode_only"
            text = await metrics_text(h)
        assert ("prefill_decode", "no_namespace", "3.0") in decisions(text)
    run(scenario)


# -- what the cost fit learns from -----------------------------------------------------------


def test_non_streamed_turns_teach_only_the_prefill_line() -> None:
    from kvtier.router import RouterSettings
    from kvtier.router.conversations import ConversationMap
    from kvtier.router.planner import Planner

    planner = Planner(RouterSettings(prefill=("http://p",), decode=("http://d",)),
                      ConversationMap(10.0, lambda: 0.0))

    def turn(path: str, streamed: bool, ttft: float) -> Turn:
        return Turn("chat", 0.0, path=path, status=200, prefill_s=0.05, ttft_s=ttft,
                    streamed=streamed, prefill_tokens=500, uncached_tokens=500)

    for _ in range(MIN_OBSERVATIONS):  # the whole answer took 4 s: not a first byte
        planner.learn(turn("prefill_decode", False, 4.0))
        planner.learn(turn("decode_only", False, 4.0))
    assert planner.costs.prefill.n == MIN_OBSERVATIONS
    assert planner.costs.decode_leg.value is None and planner.costs.direct.n == 0
    planner.learn(turn("prefill_decode", True, 0.08))
    planner.learn(turn("decode_only", True, 0.03))
    assert planner.costs.decode_leg.value == pytest.approx(0.03)
    assert planner.costs.direct.n == 1


def test_a_decode_only_turn_leaves_the_queue_at_its_first_byte(tmp_path: Path) -> None:
    async def scenario() -> None:
        decode = Backend(mode="stall")  # streams one piece, then hangs
        async with tiered_harness(tmp_path, decode=decode, pd_mode="never") as h:
            router = h.client.app[ROUTER_KEY]
            task = asyncio.create_task(stream_text(h, "x" * 300, None))
            await asyncio.wait_for(decode.hanging.wait(), 5)  # first byte out, still going
            assert router.planner.queued["decode_only"] == 0.0
            decode.release.set()
            assert (await task)[0] == 200
    run(scenario)


def test_a_chain_the_engines_collected_is_not_priced_as_held(tmp_path: Path) -> None:
    """The router's index still names a conversation's chunks after an engine's collector
    removed them (it learns of deletions only through its walk): the next follow-up must
    take the prefill hop, not go decode-only to a node that would recompute everything."""
    async def scenario() -> None:
        async with tiered_harness(tmp_path) as h:
            history = [{"role": "user", "content": "a long first question " * 40}]
            assert (await chat(h, history))[0] == "prefill_decode"
            history += [{"role": "assistant", "content": "an answer"},
                        {"role": "user", "content": "and a short follow-up?"}]
            assert (await chat(h, history))[0] == "decode_only"  # held, and indexed now
            # the fake reports no cached_tokens: nothing to compare, no shortfall counted
            assert "kvtier_router_pricing_shortfalls_total 0.0" in await metrics_text(h)
            router = h.client.app[ROUTER_KEY]
            assert router.tiers is not None
            (tier,) = router.tiers.tiers
            kv = h.prefill.kv
            assert kv is not None
            keys = [info.key for info in kv.tier.scan()]
            indexed = [k for k in keys if tier.indexed(k)]
            assert indexed  # what the last turn was priced by
            assert kv.tier.delete(keys) == len(keys)  # another node's collector
            assert all(tier.indexed(k) for k in indexed)  # the router's index did not see it
            # the same turn again (a client's retry): priced by the same, collected chunks
            assert (await chat(h, history))[0] == "prefill_decode"
    run(scenario)
