"""Selective P/D: the decision rule, the measured threshold, the token estimate, and the
router taking each path against the fake backends (``tests.router.fakes``).

The fake backends report ``tokens`` as the prompt's character count, so once the router has
seen one prefill call its estimate is one token per byte."""

from __future__ import annotations

import asyncio
import math
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

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
from tests.router.fakes import Backend, completion_of, harness, post, run, stream_text

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


async def metrics_text(h: object) -> str:
    async with h.client.get("/metrics") as resp:  # type: ignore[attr-defined]
        return str(await resp.text())


def test_a_short_follow_up_goes_decode_only_and_a_long_turn_prefill_then_decode() -> None:
    async def scenario() -> None:
        async with harness(pd_mode="auto") as h:
            first = "a long first turn " * 200  # 3600 bytes: 900 tokens by the default
            status, doc, headers = await post(h, {"prompt": first, "conversation_id": "c"})
            assert status == 200 and headers["X-KVTier-Path"] == "prefill_decode"
            assert len(h.prefill.bodies) == 1
            follow_up = first + doc["choices"][0]["text"] + " and a short question?"
            status, doc, headers = await post(h, {"prompt": follow_up, "conversation_id": "c"})
            assert status == 200 and headers["X-KVTier-Path"] == "decode_only"
            assert len(h.prefill.bodies) == 1  # the prefill node got no request
            assert h.decode.bodies[-1]["kv_transfer_params"] == {"kvtier": {"phase": "decode"}}
            assert doc["choices"][0]["text"] == "".join(completion_of(follow_up))
            assert "X-KVTier-Prefill-Ms" not in headers
            long_turn = follow_up + doc["choices"][0]["text"] + " new document " * 300
            status, _, headers = await post(h, {"prompt": long_turn, "conversation_id": "c"})
            assert headers["X-KVTier-Path"] == "prefill_decode" and len(h.prefill.bodies) == 2
            text = await metrics_text(h)
        decisions = re.findall(
            r'kvtier_router_pd_decisions_total\{path="(\w+)",reason="(\w+)"\} (\S+)', text)
        assert sorted(decisions) == [("decode_only", "short", "1.0"),
                                     ("prefill_decode", "long", "2.0")]
        assert 'kvtier_router_uncached_tokens_bucket{le="64.0",path="decode_only"} 1.0' in text
        assert 'kvtier_router_path_ttft_seconds_count{path="decode_only"} 1.0' in text
        assert 'kvtier_router_path_ttft_seconds_count{path="prefill_decode"} 2.0' in text
        assert f"kvtier_router_pd_threshold_tokens {DEFAULT_THRESHOLD_TOKENS}.0" in text
    run(scenario)


def test_a_streamed_decode_only_turn_streams_and_is_remembered() -> None:
    async def scenario() -> None:
        async with harness(pd_mode="auto") as h:
            status, text, _ = await stream_text(h, "short", "c")
            assert status == 200 and text == "".join(completion_of("short"))
            assert h.prefill.bodies == []
            _, _, headers = await post(h, {"prompt": "short, again", "conversation_id": "c"})
            assert headers["X-KVTier-Conversation"] == "known"
    run(scenario)


def test_a_busy_prefill_node_sends_a_medium_turn_decode_only() -> None:
    async def scenario() -> None:
        async with harness(prefill=Backend(mode="hang"), pd_mode="auto",
                           pd_default_threshold=100) as h:
            stuck = asyncio.create_task(post(h, {"prompt": "x" * 4000}))  # 1000 tokens queued
            await asyncio.wait_for(h.prefill.wait_for_calls(1), 5)
            status, _, headers = await post(h, {"prompt": "y" * 1200})  # 300 tokens
            assert status == 200 and headers["X-KVTier-Path"] == "decode_only"
            assert len(h.prefill.bodies) == 1
            h.prefill.mode = "ok"
            h.prefill.release.set()
            assert (await stuck)[0] == 200
            text = await metrics_text(h)
        assert 'path="decode_only",reason="prefill_busy"} 1.0' in text
    run(scenario)


@pytest.mark.parametrize(("mode", "path"), [("always", "prefill_decode"),
                                            ("never", "decode_only")])
def test_pd_mode_forces_the_path(mode: str, path: str) -> None:
    async def scenario() -> None:
        async with harness(pd_mode=mode) as h:
            for prompt in ("tiny", "huge " * 5000):
                status, _, headers = await post(h, {"prompt": prompt})
                assert status == 200 and headers["X-KVTier-Path"] == path
            assert len(h.prefill.bodies) == (2 if mode == "always" else 0)
    run(scenario)


def test_token_id_prompts_are_counted_exactly() -> None:
    async def scenario() -> None:
        async with harness(pd_mode="auto", pd_default_threshold=10) as h:
            _, _, headers = await post(h, {"prompt": list(range(10))})
            assert headers["X-KVTier-Path"] == "decode_only"
            _, _, headers = await post(h, {"prompt": list(range(11))})
            assert headers["X-KVTier-Path"] == "prefill_decode"
    run(scenario)
