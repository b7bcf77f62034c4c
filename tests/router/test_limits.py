"""Router limits: a cached /health that a flood cannot pass through and that clears no
cooldown, bounded request bodies (size and read time), a bounded conversation map, and a
bounded lease heartbeat (fakes in ``tests.router.fakes``)."""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

import pytest

from kvtier.clock import ManualClock
from kvtier.router import add_arguments, settings_from_args
from kvtier.router.app import ROUTER_KEY
from kvtier.router.conversations import ConversationMap
from tests.router.fakes import harness, post, run

pytestmark = pytest.mark.timeout(30)

KEY = "s3cret-key"


def test_a_health_flood_reaches_each_backend_once_per_interval() -> None:
    async def scenario() -> None:
        async with harness(api_key=KEY) as h:
            async def health() -> tuple[int, dict[str, object]]:
                async with h.client.get("/health") as resp:
                    return resp.status, await resp.json()

            answers = await asyncio.gather(*(health() for _ in range(50)))
            assert all(a == (200, {"status": "ok"}) for a in answers)  # no URLs, no reasons
            assert (h.prefill.health_calls, h.decode.health_calls) == (1, 1)
            h.clock.advance(0.9)
            await asyncio.gather(*(health() for _ in range(20)))
            assert h.decode.health_calls == 1
            h.decode.health = 503
            h.clock.advance(0.1)
            status, doc = await health()
            assert (status, doc) == (503, {"status": "unhealthy"})
            assert h.decode.health_calls == 2
            async with h.client.get("/health",
                                    headers={"Authorization": f"Bearer {KEY}"}) as resp:
                detailed = await resp.json()
            assert list(detailed["failed"]) == detailed["decode"]
            assert "answered 503" in next(iter(detailed["failed"].values()))
    run(scenario)


def test_health_never_clears_a_cooldown() -> None:
    async def scenario() -> None:
        async with harness(prefill=None, decode_urls=("http://127.0.0.1:9",)) as h:
            assert (await post(h, {"prompt": "x"}))[0] == 502  # refused: cooling down
            async with h.client.get("/health") as resp:
                assert resp.status == 503
            status, doc, _ = await post(h, {"prompt": "x"})
            assert status == 503 and "no healthy decode backend" in doc["error"]["message"]
    run(scenario)


def test_a_body_over_max_body_bytes_is_413_naming_the_flag() -> None:
    async def scenario() -> None:
        async with harness(max_body_bytes=1000) as h:
            status, doc, _ = await post(h, {"prompt": "x" * 2000})
            assert status == 413 and "--max-body-bytes" in doc["error"]["message"]
            assert h.prefill.bodies == []
    run(scenario)


def test_a_body_that_trickles_past_the_body_timeout_is_408() -> None:
    async def scenario() -> None:
        async with harness(body_timeout=0.2) as h:
            port = h.client.server.port
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                         b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n"
                         b'{"prompt": ')  # and then nothing more
            await writer.drain()
            head = await asyncio.wait_for(reader.readline(), 5)
            assert head.startswith(b"HTTP/1.1 408")
            writer.close()
            assert h.prefill.bodies == []
    run(scenario)


def test_the_conversation_map_drops_the_least_recently_updated_past_its_capacity() -> None:
    clock = ManualClock()
    m = ConversationMap(100.0, clock.monotonic, capacity=3)
    for cid in "abc":
        m.record(cid, {"tokens": 1})
        clock.advance(1.0)
    m.touch("a")  # now the most recent
    m.record("d", {})
    m.record("e", {})
    assert [cid for cid, _ in m.live()] == ["a", "d", "e"]
    assert m.evictions == 2


def test_the_eviction_count_is_a_metric() -> None:
    async def scenario() -> None:
        async with harness(max_conversations=2) as h:
            for cid in "abc":
                await post(h, {"prompt": "x", "conversation_id": cid})
            async with h.client.get("/metrics") as resp:
                text = await resp.text()
            assert "kvtier_router_conversations_evicted_total 1.0" in text
            assert "kvtier_router_conversations 2.0" in text
    run(scenario)


def test_a_heartbeat_stops_starting_renewals_at_its_budget_and_resumes_with_the_rest() -> None:
    renewed: list[str] = []
    clock_box: list[ManualClock] = []

    def slow_renewer(last_key: str) -> int:  # each renewal takes one second of the clock
        renewed.append(last_key)
        clock_box[0].advance(1.0)
        return 1

    async def scenario() -> None:
        async with harness(renewer=slow_renewer, lease_seconds=100.0,
                           renew_concurrency=1) as h:  # interval 25 s, budget 12.5 s
            clock_box.append(h.clock)
            for i in range(30):
                await post(h, {"prompt": f"p{i}", "conversation_id": f"c{i}"})
            h.clock.advance(25.0)  # a quarter lease: every chain is due
            leases = h.client.app[ROUTER_KEY].leases
            assert await leases.renew_all() == 13  # started at t = 25..37
            first = set(renewed)
            renewed.clear()
            assert await leases.renew_all() == 13  # the 17 not reached go first
            assert not first & set(renewed)  # (the 13 just renewed are not due yet)
            async with h.client.get("/metrics") as resp:
                text = await resp.text()
            assert "kvtier_router_renew_deferred_total 21.0" in text  # 17, then 4 of 17
            assert "kvtier_router_heartbeat_renew_seconds_count 2.0" in text
    run(scenario)


def test_a_chain_unrenewed_for_a_lease_is_counted_lapsed_once() -> None:
    async def scenario() -> None:
        async with harness(lease_seconds=100.0) as h:
            body = {"prompt": "x", "conversation_id": "c"}
            await post(h, body)
            h.clock.advance(80.0)
            await post(h, body)  # live again, but its chain was not renewed since t = 0
            h.clock.advance(30.0)
            leases = h.client.app[ROUTER_KEY].leases
            leases.renewer = None  # this beat renews nothing: it can only count
            await leases.renew_all()
            await leases.renew_all()
            async with h.client.get("/metrics") as resp:
                text = await resp.text()
            assert "kvtier_router_leases_lapsed_total 1.0" in text
    run(scenario)


def test_the_new_flags_reach_the_settings_and_bad_values_are_refused(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    urls = ["--prefill", "http://p", "--decode", "http://d"]
    s = settings_from_args(parser.parse_args([
        *urls, "--pd-mode", "never", "--pd-default-threshold", "64",
        "--pd-max-direct-tokens", "1024", "--max-body-bytes", "4096", "--body-timeout", "2.5",
        "--max-conversations", "10", "--renew-concurrency", "3",
        "--tenants", str(tmp_path / "t.yaml")]))
    assert (s.pd_mode, s.pd_default_threshold, s.pd_max_direct_tokens) == ("never", 64, 1024)
    assert (s.max_body_bytes, s.body_timeout, s.max_conversations) == (4096, 2.5, 10)
    assert (s.renew_concurrency, s.tenants) == (3, tmp_path / "t.yaml")
    assert settings_from_args(parser.parse_args(urls)).pd_mode == "auto"
    for flag, value, needle in (("--body-timeout", "0", "body_timeout"),
                                ("--max-conversations", "0", "max_conversations"),
                                ("--pd-max-direct-tokens", "-1", "pd_max_direct_tokens")):
        with pytest.raises(ValueError, match=needle):
            settings_from_args(parser.parse_args([*urls, flag, value]))
    with pytest.raises(SystemExit):
        parser.parse_args([*urls, "--pd-mode", "sometimes"])
    capsys.readouterr()
    from kvtier.cli import EXIT_USAGE, main

    bad = tmp_path / "bad.yaml"
    bad.write_text("keys: {sk-0123456789abcdef: 'no spaces allowed'}\n")
    assert main(["router", *urls, "--tenants", str(bad)]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert f"tenants file {bad}: keys entry 1" in err and "sk-0123456789abcdef" not in err
