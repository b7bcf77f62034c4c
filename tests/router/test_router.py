"""The router's P/D hand-off, streaming, leases, faults, health and flags, against the
fake backends of ``tests.router.fakes`` (see there how tests drive time)."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
from pathlib import Path

import pytest
from aiohttp import web

from kvtier.keys import ChunkKey
from kvtier.router import add_arguments, settings_from_args
from kvtier.router.app import ROUTER_KEY
from kvtier.router.leases import Beat
from kvtier.tiers.file import FileTier
from tests.router.fakes import (
    Backend,
    completion_of,
    harness,
    key_of,
    post,
    run,
    stream_text,
)
from tests.tiers.harness import make_key, meta_for, payload_for

pytestmark = pytest.mark.timeout(30)


# -- validation ----------------------------------------------------------------------------


@pytest.mark.parametrize(("body", "path", "needle"), [
    (b"{not json", "/v1/completions", "not valid JSON"),
    (b"[1, 2]", "/v1/completions", "JSON object"),
    ({"model": "m"}, "/v1/completions", "'prompt' is required"),
    ({"prompt": "x"}, "/v1/chat/completions", "'messages' is required"),
    ({"prompt": "x", "stream": "yes"}, "/v1/completions", "'stream'"),
    ({"prompt": "x", "max_tokens": 0}, "/v1/completions", "'max_tokens'"),
    ({"prompt": "x", "max_tokens": True}, "/v1/completions", "'max_tokens'"),
    ({"prompt": "x", "conversation_id": ""}, "/v1/completions", "'conversation_id'"),
    ({"prompt": "x", "conversation_id": 5}, "/v1/completions", "'conversation_id'"),
    ({"prompt": "x", "conversation_id": "c\nstatus=200"}, "/v1/completions", "'conversation_id'"),
    ({"prompt": "x", "conversation_id": "\x1b[2Jc"}, "/v1/completions", "'conversation_id'"),
    ({"prompt": "x", "conversation_id": "\u202ec"}, "/v1/completions", "'conversation_id'"),
    ({"prompt": "x", "conversation_id": "c" * 257}, "/v1/completions", "'conversation_id'"),
    ({"prompt": "x", "kv_transfer_params": {}}, "/v1/completions", "kv_transfer_params"),
])
def test_malformed_requests_are_400_with_a_message(body: object, path: str,
                                                    needle: str) -> None:
    async def scenario() -> None:
        async with harness() as h:
            status, doc, _ = await post(h, body, path)
            assert status == 400
            assert doc["error"]["type"] == "invalid_request_error"
            assert needle in doc["error"]["message"]
            assert h.prefill.bodies == [] and h.decode.bodies == []
    run(scenario)


# -- the P/D hand-off ----------------------------------------------------------------------


def test_prefill_is_one_token_unstreamed_and_decode_gets_its_expect() -> None:
    async def scenario() -> None:
        async with harness() as h:
            body = {"prompt": "hello", "stream": False, "max_tokens": 4, "min_tokens": 2,
                    "stream_options": {"include_usage": True}, "conversation_id": "c1"}
            status, doc, headers = await post(h, body)
            assert status == 200 and headers["X-KVTier-Conversation"] == "new"
            assert doc["choices"][0]["text"] == "".join(completion_of("hello")[:4])
            (pre,), (dec,) = h.prefill.bodies, h.decode.bodies
            assert pre["max_tokens"] == 1 and pre["stream"] is False
            assert "stream_options" not in pre and "min_tokens" not in pre
            assert pre["kv_transfer_params"] == {"kvtier": {"phase": "prefill"}}
            assert "conversation_id" not in pre and "conversation_id" not in dec
            assert dec["max_tokens"] == 4 and dec["stream_options"] == {"include_usage": True}
            assert dec["kv_transfer_params"] == {"kvtier": {"phase": "decode", "expect": {
                "namespace": "ab" * 8, "tokens": len("hello"), "last_key": key_of("hello")}}}
    run(scenario)


def test_dp_reuse_off_tells_prefill_not_to_load_and_headers_report_the_prefill() -> None:
    async def scenario() -> None:
        async with harness(dp_reuse=False) as h:
            status, _, headers = await post(h, {"prompt": "abc", "max_tokens": 2})
            assert status == 200
            assert h.prefill.bodies[0]["kv_transfer_params"] == {
                "kvtier": {"phase": "prefill", "load": False}}
            assert headers["X-KVTier-Restored-Tokens"] == "7"
            assert headers["X-KVTier-Restore-Ms"] == "12.5"
            assert headers["X-KVTier-Restored-By-Tier"] == "file1=7"
            assert float(headers["X-KVTier-Prefill-Ms"]) > 0
    run(scenario)


def test_chat_caps_max_completion_tokens_and_header_names_the_conversation() -> None:
    async def scenario() -> None:
        async with harness() as h:
            body = {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 9}
            status, _, headers = await post(h, body, "/v1/chat/completions",
                                            **{"X-Conversation-Id": "chat-1"})
            assert status == 200 and headers["X-KVTier-Conversation"] == "new"
            assert h.prefill.bodies[0]["max_completion_tokens"] == 1
            assert h.decode.bodies[0]["max_completion_tokens"] == 9
            status, _, headers = await post(h, body, "/v1/chat/completions",
                                            **{"X-Conversation-Id": "chat-1"})
            assert headers["X-KVTier-Conversation"] == "known"
    run(scenario)


def test_decode_without_prefill_params_gets_a_bare_phase() -> None:
    async def scenario() -> None:
        prefill = Backend()
        original = prefill.generate

        async def no_params(request: web.Request) -> web.StreamResponse:
            await original(request)
            return web.json_response({"choices": [{"text": "x"}]})
        prefill.generate = no_params  # type: ignore[method-assign]
        async with harness(prefill=prefill) as h:
            status, _, _ = await post(h, {"prompt": "p"})
            assert status == 200
            assert h.decode.bodies[0]["kv_transfer_params"] == {"kvtier": {"phase": "decode"}}
    run(scenario)


def test_streaming_passes_the_sse_bytes_through() -> None:
    async def scenario() -> None:
        async with harness() as h:
            status, text, raw = await stream_text(h, "stream me", None)
            assert status == 200
            assert text == "".join(completion_of("stream me"))
            assert raw.endswith(b"data: [DONE]\n\n")
            assert raw.count(b"data: ") == len(completion_of("stream me")) + 1
    run(scenario)


def test_twenty_concurrent_streaming_conversations_neither_lose_nor_mix() -> None:
    n = 20

    async def scenario() -> None:
        async with harness(decode=Backend(barrier=asyncio.Barrier(n))) as h:
            prompts = {f"conv-{i}": f"prompt number {i} " * (i + 1) for i in range(n)}
            results = await asyncio.gather(*(stream_text(h, p, c) for c, p in prompts.items()))
            for (cid, prompt), (status, text, _) in zip(prompts.items(), results, strict=True):
                assert status == 200, cid
                assert text == "".join(completion_of(prompt)), cid
            for cid, prompt in prompts.items():  # the map holds each one's own prefill params
                status, doc, _ = await post(h, {"conversation_id": cid}, "/v1/kvtier/renew")
                assert (status, doc) == (200, {"renewed_chunks": 3}), cid
                assert h.renewed[-1] == key_of(prompt), cid
    run(scenario)


def test_non_streaming_turn_stores_the_decode_params() -> None:
    async def scenario() -> None:
        async with harness() as h:
            await post(h, {"prompt": "q", "conversation_id": "c"})
            await post(h, {"conversation_id": "c"}, "/v1/kvtier/renew")
            assert h.renewed == [key_of("q" + "".join(completion_of("q")))]
    run(scenario)


# -- conversation TTL and leases -------------------------------------------------------------


def test_conversations_expire_after_the_ttl_of_the_injected_clock() -> None:
    async def scenario() -> None:
        async with harness(lease_seconds=100.0) as h:  # ttl 90 s
            await post(h, {"prompt": "a", "conversation_id": "c"})
            h.clock.advance(89.0)
            _, _, headers = await post(h, {"prompt": "a", "conversation_id": "c"})
            assert headers["X-KVTier-Conversation"] == "known"
            h.clock.advance(89.0)  # 89 s after the last turn: still live
            assert (await post(h, {"conversation_id": "c"}, "/v1/kvtier/renew"))[0] == 200
            h.clock.advance(90.0)  # the renew restarted the ttl; now it is past
            status, doc, _ = await post(h, {"conversation_id": "c"}, "/v1/kvtier/renew")
            assert status == 404 and "unknown or expired" in doc["error"]["message"]
            _, _, headers = await post(h, {"prompt": "a", "conversation_id": "c"})
            assert headers["X-KVTier-Conversation"] == "new"
    run(scenario)


@pytest.mark.parametrize(("body", "status"), [
    (b"nope", 400), (b"{}", 400), ({"conversation_id": ""}, 400),
    ({"conversation_id": "c\r\nforged"}, 400),
    ({"conversation_id": "never-seen"}, 404),
])
def test_renew_endpoint_errors(body: object, status: int) -> None:
    async def scenario() -> None:
        async with harness() as h:
            got, doc, _ = await post(h, body, "/v1/kvtier/renew")
            assert got == status and doc["error"]["message"]
    run(scenario)


def test_heartbeat_renews_every_live_conversation() -> None:
    async def scenario() -> None:
        async with harness(lease_seconds=100.0) as h:
            await post(h, {"prompt": "a", "conversation_id": "old"})
            h.clock.advance(50.0)
            await post(h, {"prompt": "b", "conversation_id": "new"})
            h.clock.advance(45.0)  # "old" is past its 90 s ttl
            assert await h.client.app[ROUTER_KEY].leases.renew_all() == 3
            assert h.renewed == [key_of("b" + "".join(completion_of("b")))]
    run(scenario)


def file_tier_config(tmp_path: Path, keys: list[ChunkKey], *,
                     chained: bool = True) -> tuple[Path, dict[ChunkKey, Path]]:
    """A kvtier config whose file tier holds ``keys`` (one chain, or unrelated objects);
    returns the config and each object's file."""
    store = tmp_path / "store"
    config = tmp_path / "kvtier.yaml"
    config.write_text(f"tiers:\n  - host: {{capacity: 64MiB}}\n"
                      f"  - file: {{path: {store}, capacity: 1GiB}}\n")
    tier = FileTier(store, 1 << 30)
    for i, key in enumerate(keys):
        parent = keys[i - 1] if chained and i else None
        tier.put(dataclasses.replace(meta_for(key), parent=parent), payload_for(key).data)
    tier.close()
    return config, {key: tier.path_of(key) for key in keys}


def test_renew_through_the_tiers_of_a_kvtier_config(tmp_path: Path) -> None:
    pytest.importorskip("kvtier.lease")
    keys = [make_key(i) for i in range(3)]
    config, _ = file_tier_config(tmp_path, keys)

    async def scenario() -> None:
        prefill = Backend(last_key=keys[-1].hex())
        async with harness(prefill=prefill, real_tiers=True, tiers=config) as h:
            assert (await stream_text(h, "x", "c"))[0] == 200
            status, doc, _ = await post(h, {"conversation_id": "c"}, "/v1/kvtier/renew")
            assert (status, doc) == (200, {"renewed_chunks": 3})
    run(scenario)


def test_heartbeat_renews_live_chains_then_collects_only_objects_past_the_lease(
        tmp_path: Path) -> None:
    pytest.importorskip("kvtier.lease")
    live, old, fresh = (make_key(i) for i in range(3))
    config, paths = file_tier_config(tmp_path, [live, old, fresh], chained=False)

    async def scenario() -> None:
        prefill = Backend(last_key=live.hex())
        async with harness(prefill=prefill, real_tiers=True, tiers=config,
                           lease_seconds=100.0) as h:
            assert (await stream_text(h, "x", "c"))[0] == 200  # "c" ends at ``live``
            h.clock.advance(25.0)  # a quarter lease later its chain is due for renewal
            now = h.clock.wall()
            for key, mtime in ((live, now - 101.0), (old, now - 101.0), (fresh, now - 99.0)):
                os.utime(paths[key], (mtime, mtime))
            assert await h.client.app[ROUTER_KEY].leases.beat_once() == Beat(renewed=1, expired=1)
            assert not paths[old].exists()
            assert paths[live].exists() and paths[fresh].exists()
            async with h.client.get("/metrics") as resp:
                assert "kvtier_router_expired_objects_total 1.0" in await resp.text()
    run(scenario)


def test_no_collect_leaves_objects_past_the_lease(tmp_path: Path) -> None:
    pytest.importorskip("kvtier.lease")
    old = make_key(0)
    config, paths = file_tier_config(tmp_path, [old])

    async def scenario() -> None:
        async with harness(real_tiers=True, tiers=config, lease_seconds=100.0,
                           collect=False) as h:
            then = h.clock.wall() - 1000.0
            os.utime(paths[old], (then, then))
            assert await h.client.app[ROUTER_KEY].leases.beat_once() == Beat(renewed=0, expired=0)
            assert paths[old].exists()
    run(scenario)


def test_a_failing_collector_is_logged_and_the_heartbeat_goes_on(
        caplog: pytest.LogCaptureFixture) -> None:
    def collector() -> int:
        raise OSError("store unmounted")

    async def scenario() -> None:
        async with harness(collector=collector) as h:
            await post(h, {"prompt": "a", "conversation_id": "c"})
            h.clock.advance(h.client.app[ROUTER_KEY].settings.lease_seconds / 4)  # due
            assert await h.client.app[ROUTER_KEY].leases.beat_once() == Beat(renewed=3, expired=0)
            assert len(h.renewed) == 1
    run(scenario)
    assert "lease collector failed" in caplog.text and "store unmounted" in caplog.text


def test_renew_without_tiers_is_501() -> None:
    async def scenario() -> None:
        async with harness(real_tiers=True) as h:
            await post(h, {"prompt": "x", "conversation_id": "c"})
            status, doc, _ = await post(h, {"conversation_id": "c"}, "/v1/kvtier/renew")
            assert status == 501 and "--tiers" in doc["error"]["message"]
    run(scenario)


# -- faults --------------------------------------------------------------------------------


def test_backend_refusing_connections_is_502_then_503_during_the_cooldown() -> None:
    async def scenario() -> None:
        async with harness(decode_urls=("http://127.0.0.1:9",)) as h:
            status, doc, _ = await post(h, {"prompt": "x"})
            assert status == 502 and "cannot connect" in doc["error"]["message"]
            status, doc, _ = await post(h, {"prompt": "x"})
            assert status == 503 and "no healthy decode backend" in doc["error"]["message"]
            h.clock.advance(5.0)
            assert (await post(h, {"prompt": "x"}))[0] == 502
    run(scenario)


def test_backend_that_never_answers_is_504_within_the_timeout() -> None:
    async def scenario() -> None:
        async with harness(prefill=Backend(mode="hang"), request_timeout=0.3) as h:
            status, doc, _ = await asyncio.wait_for(post(h, {"prompt": "x"}), 5)
            assert status == 504 and "0.3s" in doc["error"]["message"]
    run(scenario)


def test_streaming_backend_that_never_answers_is_504() -> None:
    async def scenario() -> None:
        async with harness(decode=Backend(mode="hang"), request_timeout=0.3) as h:
            status, _, _ = await asyncio.wait_for(stream_text(h, "x", None), 5)
            assert status == 504
    run(scenario)


def test_backend_500_is_502_with_its_message() -> None:
    async def scenario() -> None:
        async with harness(decode=Backend(mode="fail500")) as h:
            status, doc, _ = await post(h, {"prompt": "x"})
            assert status == 502 and "CUDA out of memory" in doc["error"]["message"]
    run(scenario)


def test_backend_4xx_passes_through() -> None:
    async def scenario() -> None:
        async with harness(prefill=Backend(mode="reject400")) as h:
            status, doc, _ = await post(h, {"prompt": "x" * 100})
            assert status == 400 and doc == {"error": {"message": "prompt too long"}}
            assert h.decode.bodies == []
    run(scenario)


def test_stream_broken_mid_way_ends_the_response() -> None:
    async def scenario() -> None:
        async with harness(decode=Backend(mode="break")) as h:
            status, text, raw = await asyncio.wait_for(stream_text(h, "x", "c"), 5)
            assert status == 200 and text == "".join(completion_of("x")[:2])
            assert b"broke off" in raw and not raw.endswith(b"[DONE]\n\n")
            status, _, _ = await post(h, {"conversation_id": "c"}, "/v1/kvtier/renew")
            assert status == 404  # a broken turn is not recorded
    run(scenario)


# -- health and metrics --------------------------------------------------------------------


def test_health_is_200_when_every_backend_is_and_503_naming_the_failed_one() -> None:
    async def scenario() -> None:
        async with harness() as h:
            async with h.client.get("/health") as resp:
                doc = await resp.json()
                assert resp.status == 200 and doc["status"] == "ok"
                assert len(doc["prefill"]) == 1 and len(doc["decode"]) == 1
            h.decode.health = 503
            h.clock.advance(1.0)  # the cached state is a second old
            async with h.client.get("/health") as resp:
                doc = await resp.json()
                assert resp.status == 503 and list(doc["failed"]) == doc["decode"]
    run(scenario)


def test_metrics_has_the_histograms_and_counts() -> None:
    async def scenario() -> None:
        async with harness() as h:
            await post(h, {"prompt": "x", "conversation_id": "c"})
            await post(h, {"prompt": 1, "stream": 3})
            async with h.client.get("/metrics") as resp:
                text = await resp.text()
        for name in ("kvtier_router_prefill_seconds_bucket", "kvtier_router_ttft_seconds_count",
                     "kvtier_router_kv_load_seconds_sum"):
            assert name in text
        assert 'kvtier_router_requests_total{endpoint="completions",status="200"} 1.0' in text
        assert 'kvtier_router_requests_total{endpoint="completions",status="400"} 1.0' in text
        assert "kvtier_router_kv_load_tokens_total 7.0" in text
        assert "kvtier_router_conversations 1.0" in text
    run(scenario)


# -- command line --------------------------------------------------------------------------


def test_cli_rejects_bad_router_flags(capsys: pytest.CaptureFixture[str]) -> None:
    from kvtier.cli import EXIT_USAGE, main

    assert main(["router", "--prefill", "ftp://x", "--decode", "http://y"]) == EXIT_USAGE
    assert "--prefill 'ftp://x'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["router", "--prefill", "http://x"])  # --decode is required


def test_no_collect_flag_turns_the_collector_off() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    urls = ["--prefill", "http://p", "--decode", "http://d"]
    assert settings_from_args(parser.parse_args(urls)).collect is True
    assert settings_from_args(parser.parse_args([*urls, "--no-collect"])).collect is False

