"""One tenant cannot hurt the others, and hostile input costs nothing (issue 44 item 3):
per-tenant conversation caps and renew rates, renewals shared per heartbeat and skipped
while fresh, a renewal that found nothing counted as lapsed, token ids checked before any
work."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from kvtier.router.app import ROUTER_KEY
from kvtier.router.conversations import ConversationMap
from kvtier.router.leases import RenewLimiter
from tests.router.fakes import harness, post, run

pytestmark = pytest.mark.timeout(30)

FLOOD, QUIET = "sk-flood-0123456789abcdef", "sk-quiet-fedcba9876543210"


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture
def tenants(tmp_path: Path) -> Path:
    path = tmp_path / "tenants.yaml"
    path.write_text(yaml.safe_dump({"keys": {FLOOD: "flood", QUIET: "quiet"}}))
    return path


def test_a_tenant_flooding_new_conversations_drops_only_its_own(tenants: Path) -> None:
    async def scenario() -> None:
        async with harness(tenants=tenants, max_conversations=8) as h:  # 2 per tenant
            for cid in ("q1", "q2"):
                assert (await post(h, {"prompt": cid, "conversation_id": cid},
                                   **bearer(QUIET)))[0] == 200
            for i in range(40):
                assert (await post(h, {"prompt": f"f{i}", "conversation_id": f"f{i}"},
                                   **bearer(FLOOD)))[0] == 200
            router = h.client.app[ROUTER_KEY]
            assert len(router.conversations) == 4
            for cid in ("q1", "q2"):  # the quiet tenant's conversations are still tracked
                status, doc, _ = await post(h, {"conversation_id": cid}, "/v1/kvtier/renew",
                                            **bearer(QUIET))
                assert status == 200, doc
            status, _, _ = await post(h, {"conversation_id": "f0"}, "/v1/kvtier/renew",
                                      **bearer(FLOOD))
            assert status == 404  # the flooder's oldest went
    run(scenario)


def test_the_map_caps_each_tenant_and_still_the_whole() -> None:
    now = [0.0]
    m = ConversationMap(100.0, lambda: now[0], capacity=5, tenant_capacity=2)
    for i in range(4):
        m.record(f"a\x00{i}", {})
        now[0] += 1
    assert [k for k, _ in m.live()] == ["a\x002", "a\x003"] and m.evictions == 2
    for i in range(3):
        m.record(f"b\x00{i}", {})
    m.record("untenanted", {})
    assert len(m) == 5 and m.evictions == 3  # b's third dropped b's first
    m.record("untenanted-too", {})
    assert len(m) == 5  # the whole map's cap: the oldest entry overall went
    assert m.get("a\x002") is None and m.get("a\x003") is not None
    now[0] += 200
    assert m.prune() == 5 and len(m) == 0


def test_renew_calls_are_rate_limited_per_tenant(tenants: Path) -> None:
    async def scenario() -> None:
        async with harness(tenants=tenants, renew_rate=1.0) as h:  # bursts of 4
            for key in (FLOOD, QUIET):
                await post(h, {"prompt": "x", "conversation_id": "c"}, **bearer(key))
            statuses = [(await post(h, {"conversation_id": "c"}, "/v1/kvtier/renew",
                                    **bearer(FLOOD)))[0] for _ in range(6)]
            assert statuses == [200] * 4 + [429] * 2
            status, doc, headers = await post(h, {"conversation_id": "c"},
                                              "/v1/kvtier/renew", **bearer(FLOOD))
            assert status == 429 and "--renew-rate" in doc["error"]["message"]
            assert int(headers["Retry-After"]) >= 1
            # the other tenant is not limited by the flooder's calls
            assert (await post(h, {"conversation_id": "c"}, "/v1/kvtier/renew",
                               **bearer(QUIET)))[0] == 200
            h.clock.advance(1.0)
            assert (await post(h, {"conversation_id": "c"}, "/v1/kvtier/renew",
                               **bearer(FLOOD)))[0] == 200
    run(scenario)


def test_a_limiter_refills_at_its_rate_up_to_its_burst() -> None:
    lim = RenewLimiter(2.0)  # bursts of 8
    assert all(lim.take("t", 0.0) is None for _ in range(8))
    wait = lim.take("t", 0.0)
    assert wait == pytest.approx(0.5)
    assert lim.take("t", 0.5) is None and lim.take("t", 0.5) is not None
    assert lim.take("other", 0.5) is None
    with pytest.raises(ValueError):
        RenewLimiter(0)


@pytest.mark.parametrize(("prompt", "says"), [
    ([1, 2, -3], "token id -3 at position 2"),
    ([1, 2**32], f"token id {2**32} at position 1"),
    (list(range(101)), "has 101 token ids; the router takes at most 100"),
], ids=["negative", "too-large", "too-many"])
def test_bad_token_ids_are_400_naming_them(prompt: list[int], says: str) -> None:
    async def scenario() -> None:
        async with harness(max_prompt_tokens=100) as h:
            status, doc, _ = await post(h, {"prompt": prompt})
            assert status == 400 and says in doc["error"]["message"], doc
            assert not h.prefill.bodies and not h.decode.bodies  # no work was done
    run(scenario)


def test_conversations_ending_in_one_chunk_share_one_renewal_a_beat() -> None:
    async def scenario() -> None:
        async with harness(lease_seconds=100.0) as h:
            for cid in ("c1", "c2", "c3"):  # the same text: the same chain end
                await post(h, {"prompt": "same", "conversation_id": cid})
            leases = h.client.app[ROUTER_KEY].leases
            assert await leases.renew_all() == 0 and h.renewed == []  # just written: fresh
            h.clock.advance(25.0)
            assert await leases.renew_all() == 3  # the fake renews 3 chunks, once
            assert len(h.renewed) == 1
            h.clock.advance(10.0)  # renewed 10 s ago: not due again yet
            assert await leases.renew_all() == 0 and len(h.renewed) == 1
    run(scenario)


def test_a_renewal_that_found_nothing_is_lapsed_not_renewed() -> None:
    calls: list[str] = []

    def finds_nothing(last_key: str) -> int:
        calls.append(last_key)
        return 0

    async def scenario() -> None:
        async with harness(renewer=finds_nothing, lease_seconds=100.0) as h:
            await post(h, {"prompt": "x", "conversation_id": "c"})
            leases = h.client.app[ROUTER_KEY].leases
            h.clock.advance(25.0)
            await leases.renew_all()
            h.clock.advance(1.0)
            await leases.renew_all()  # not recorded as renewed: asked again
            assert len(calls) == 2
            async with h.client.get("/metrics") as resp:
                assert "kvtier_router_leases_lapsed_total 1.0" in await resp.text()
    run(scenario)
