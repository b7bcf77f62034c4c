"""Router hardening: a client that hangs up cancels its backend call, a concurrency limit,
bodies serialized once, timed-out backends cool down, API-key authentication, and
conversation ids that cannot forge log lines. Fakes in ``tests.router.fakes``."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
from typing import Any

import pytest

from kvtier.router import add_arguments, settings_from_args
from tests.router.fakes import Backend, completion_of, harness, post, run, stream_text

pytestmark = pytest.mark.timeout(30)


def test_the_client_body_is_serialized_once_for_both_backends(
        monkeypatch: pytest.MonkeyPatch) -> None:
    prompt = "a long shared prompt " * 1000
    raw = json.dumps({"prompt": prompt, "max_tokens": 3, "stream": False,
                      "conversation_id": "c", "temperature": 0.0}).encode()
    encoded: list[int] = []
    encode = json.JSONEncoder.encode

    def counting(self: json.JSONEncoder, o: Any) -> str:
        if isinstance(o, dict) and o.get("prompt") == prompt:
            encoded.append(1)
        return encode(self, o)

    async def scenario() -> None:
        async with harness() as h:
            monkeypatch.setattr(json.JSONEncoder, "encode", counting)
            status, doc, _ = await post(h, raw)
            assert status == 200 and doc["choices"][0]["text"] == "".join(
                completion_of(prompt)[:3])
            (pre,), (dec,) = h.prefill.bodies, h.decode.bodies
            assert pre["prompt"] == dec["prompt"] == prompt
            assert pre["temperature"] == dec["temperature"] == 0.0
            assert (pre["max_tokens"], dec["max_tokens"], dec["stream"]) == (1, 3, False)
    run(scenario)
    assert len(encoded) == 1  # not once per backend


@pytest.mark.parametrize("prompt", ["plain", "n\u00e4he \u6f22\u5b57 \U0001f600", "\ud800 lone"])
def test_backends_get_the_clients_text_unchanged(prompt: str) -> None:
    async def scenario() -> None:
        async with harness() as h:
            raw = json.dumps({"prompt": prompt, "max_tokens": 2}).encode()  # ASCII escapes
            assert (await post(h, raw))[0] == 200
            assert h.prefill.bodies[0]["prompt"] == h.decode.bodies[0]["prompt"] == prompt
    run(scenario)


def test_a_header_conversation_id_with_control_characters_is_refused() -> None:
    async def scenario() -> None:
        async with harness() as h:
            status, doc, _ = await post(h, {"prompt": "x"}, **{"X-Conversation-Id": "a\tb"})
            assert status == 400 and "X-Conversation-Id" in doc["error"]["message"]
            assert h.prefill.bodies == []
    run(scenario)


def test_log_lines_quote_the_conversation_id(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "kvtier.router")

    async def scenario() -> None:
        async with harness() as h:
            assert (await post(h, {"prompt": "x", "conversation_id": "c status=500"}))[0] == 200
    run(scenario)
    (line,) = [r.getMessage() for r in caplog.records if "endpoint=" in r.getMessage()]
    assert line.startswith("conversation='c status=500' endpoint=completions")


def test_a_backend_that_times_out_cools_down_like_one_that_refuses() -> None:
    async def scenario() -> None:
        async with harness(prefill=Backend(mode="hang"), request_timeout=0.3) as h:
            assert (await asyncio.wait_for(post(h, {"prompt": "x"}), 5))[0] == 504
            status, doc, _ = await post(h, {"prompt": "x"})
            assert status == 503 and "no healthy prefill backend" in doc["error"]["message"]
            assert len(h.prefill.bodies) == 1  # skipped, not waited for again
            h.prefill.mode = "ok"
            h.clock.advance(5.0)
            assert (await post(h, {"prompt": "x"}))[0] == 200
    run(scenario)


def test_a_stream_silent_past_the_timeout_cools_its_backend_down() -> None:
    async def scenario() -> None:
        async with harness(decode=Backend(mode="stall"), request_timeout=0.3) as h:
            status, _, raw = await asyncio.wait_for(stream_text(h, "x", None), 5)
            assert status == 200 and b"broke off" in raw
            status, doc, _ = await post(h, {"prompt": "x"})
            assert status == 503 and "no healthy decode backend" in doc["error"]["message"]
    run(scenario)


@pytest.mark.parametrize(("stream", "mode"), [(False, "hang"), (True, "hang"), (True, "stall")])
def test_a_client_that_goes_away_cancels_the_backend_call(stream: bool, mode: str) -> None:
    async def scenario() -> None:
        async with harness(decode=Backend(mode=mode)) as h:  # request_timeout: 600 s
            call = asyncio.create_task(post(h, {"prompt": "x", "stream": stream}))
            await asyncio.wait_for(h.decode.hanging.wait(), 5)
            call.cancel()  # the client hangs up while decode is still running
            await asyncio.wait_for(h.decode.cancelled.wait(), 1.0)
            async with h.client.get("/metrics") as resp:
                text = await resp.text()
            assert 'endpoint="completions",status="aborted"} 1.0' in text
            assert "kvtier_router_in_flight 0.0" in text  # its slot came back
    run(scenario)


def test_an_overloaded_router_answers_503_with_retry_after_at_once() -> None:
    async def scenario() -> None:
        async with harness(decode=Backend(mode="hang"), max_concurrency=2) as h:
            busy = [asyncio.create_task(post(h, {"prompt": f"p{i}"})) for i in range(2)]
            await asyncio.wait_for(h.decode.wait_for_calls(2), 5)
            status, doc, headers = await asyncio.wait_for(post(h, {"prompt": "more"}), 1.0)
            assert status == 503 and headers["Retry-After"] == "1"
            assert "--max-concurrency" in doc["error"]["message"]
            assert len(h.prefill.bodies) == 2  # the refused request reached no backend
            async with h.client.get("/metrics") as resp:  # open routes are never limited
                text = await resp.text()
            assert 'kvtier_router_rejected_total{reason="overloaded"} 1.0' in text
            assert "kvtier_router_in_flight 2.0" in text
            h.decode.release.set()
            assert [r[0] for r in await asyncio.gather(*busy)] == [200, 200]
            assert (await post(h, {"prompt": "after"}))[0] == 200  # the slots came back
    run(scenario)


# -- authentication --------------------------------------------------------------------------

KEY = "s3cret-key"
BEARER = {"Authorization": f"Bearer {KEY}"}


def test_an_api_key_is_required_on_every_route_but_health_and_metrics() -> None:
    async def scenario() -> None:
        async with harness(api_key=KEY) as h:
            chat = {"messages": [{"role": "user", "content": "hi"}]}
            for path, body in (("/v1/completions", {"prompt": "x"}),
                               ("/v1/chat/completions", chat),
                               ("/v1/kvtier/renew", {"conversation_id": "c"})):
                for headers in ({}, {"Authorization": "Bearer wrong"},
                                {"Authorization": KEY}, {"Authorization": f"Basic {KEY}"}):
                    status, doc, got = await post(h, body, path, **headers)
                    assert status == 401, (path, headers)
                    assert doc["error"]["type"] == "authentication_error"
                    assert "Bearer" in doc["error"]["message"]
                    assert got["WWW-Authenticate"] == "Bearer"
            assert h.prefill.bodies == [] and h.decode.bodies == []
            for page in ("/health", "/metrics"):
                async with h.client.get(page) as resp:
                    assert resp.status == 200, page
                    text = await resp.text()
            assert 'kvtier_router_rejected_total{reason="unauthorized"} 12.0' in text
            assert (await post(h, {"prompt": "x"}, **BEARER))[0] == 200
            assert h.prefill.auth == h.decode.auth == [BEARER["Authorization"]]
    run(scenario)


def test_without_an_api_key_the_callers_authorization_still_reaches_the_backends() -> None:
    async def scenario() -> None:
        async with harness() as h:
            assert (await post(h, {"prompt": "x"}, Authorization="Bearer backend-key"))[0] == 200
            assert (await post(h, {"prompt": "x"}))[0] == 200
            assert h.decode.auth == ["Bearer backend-key", None]
    run(scenario)


def test_unauthenticated_callers_cannot_tell_whether_a_conversation_exists() -> None:
    async def scenario() -> None:
        async with harness(api_key=KEY) as h:
            assert (await post(h, {"prompt": "a", "conversation_id": "c"}, **BEARER))[0] == 200
            answers = []
            for cid in ("c", "never-seen"):
                for path, body in (("/v1/completions", {"prompt": "a", "conversation_id": cid}),
                                   ("/v1/kvtier/renew", {"conversation_id": cid})):
                    status, doc, headers = await post(h, body, path,
                                                      **{"X-Conversation-Id": cid})
                    assert "X-KVTier-Conversation" not in headers
                    answers.append((path, status, doc))
            assert answers[:2] == answers[2:]
            _, _, headers = await post(h, {"prompt": "a", "conversation_id": "c"}, **BEARER)
            assert headers["X-KVTier-Conversation"] == "known"  # the key holder sees it
    run(scenario)


def test_api_key_and_max_concurrency_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    urls = ["--prefill", "http://p", "--decode", "http://d"]
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    settings = settings_from_args(parser.parse_args(urls))
    assert settings.api_key is None and settings.max_concurrency == 256
    monkeypatch.setenv("VLLM_API_KEY", "from-env")
    assert settings_from_args(parser.parse_args(urls)).api_key == "from-env"
    args = parser.parse_args([*urls, "--api-key", "from-flag", "--max-concurrency", "8"])
    settings = settings_from_args(args)
    assert (settings.api_key, settings.max_concurrency) == ("from-flag", 8)
    assert "from-flag" not in repr(settings)
    with pytest.raises(ValueError, match="max_concurrency"):
        settings_from_args(parser.parse_args([*urls, "--max-concurrency", "0"]))
    with pytest.raises(ValueError, match="api_key"):
        settings_from_args(parser.parse_args([*urls, "--api-key", "two words"]))
