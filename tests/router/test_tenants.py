"""Tenants: the file's format and its errors, per-tenant cache salts and conversations,
prefix-hit information only on request, and reloads (file change, SIGHUP, bad file)."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import os
import signal
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier.router.app import ROUTER_KEY
from kvtier.router.tenants import TenantsError, load_tenants, parse_tenants, tenants_of
from kvtier.tenancy import ENV, SaltCheck, SecretError, issue, load_secrets, looks_issued
from tests.router.fakes import Harness, harness, post, run

pytestmark = pytest.mark.timeout(30)

ACME, ACME2, GLOBEX = "sk-acme-0123456789abcdef", "sk-acme-second-key-0001", "sk-globex-fedcba98765"
KEYS = {ACME: "acme", ACME2: "acme", GLOBEX: "globex"}


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture
def tenants_file(tmp_path: Path) -> Path:
    path = tmp_path / "tenants.yaml"
    path.write_text(yaml.safe_dump({"keys": KEYS}))
    return path


# -- the file --------------------------------------------------------------------------------


def test_yaml_and_json_files_map_keys_to_tenants(tmp_path: Path) -> None:
    as_json = tmp_path / "t.json"
    as_json.write_text(json.dumps({"keys": KEYS}))
    as_yaml = tmp_path / "t.yml"
    as_yaml.write_text("keys:\n" + "".join(f"  {k}: {t}\n" for k, t in KEYS.items()))
    for path in (as_json, as_yaml):
        m = load_tenants(path)
        assert m.tenants == {"acme", "globex"}
        assert [m.authenticate(k) for k in KEYS] == ["acme", "acme", "globex"]
        assert m.authenticate(ACME + "x") is None and m.authenticate("") is None


@pytest.mark.parametrize(("text", "json_format", "needle"), [
    ("keys: [", False, "not valid YAML"),
    ('{"keys": {"a": 1', True, "not valid JSON"),
    ("- a\n- b\n", False, "must be a mapping"),
    ("keys: {}\n", False, "non-empty mapping"),
    (f"keys: {{{ACME}: acme}}\nsalt: x\n", False, "unknown entries ['salt']"),
    (f"keys:\n  {ACME}: acme\n  {ACME}: globex\n", False, "appears twice"),
    (f'{{"keys": {{"{ACME}": "acme", "{ACME}": "b"}}}}', True, "appears twice"),
    ("keys: {short-key: acme}\n", False, "16-512 characters"),
    (f"keys: {{{ACME}: 'bad name'}}\n", False, "tenant name"),
    (f"keys: {{{ACME}: 5}}\n", False, "tenant name"),
    ("keys: {12345678901234567890: acme}\n", False, "must be text"),
    (f'{{"keys": {{"{ACME}\\u00e9": "acme"}}}}', True, "printable ASCII"),
])
def test_a_bad_file_is_a_clear_error_that_never_shows_a_key(text: str, json_format: bool,
                                                             needle: str) -> None:
    with pytest.raises(TenantsError) as err:
        parse_tenants(text, "/etc/kvtier/tenants.yaml", json_format=json_format)
    message = str(err.value)
    assert message.startswith("tenants file /etc/kvtier/tenants.yaml: ")
    assert needle in message and ACME not in message


def test_unreadable_and_non_utf8_files_name_the_file(tmp_path: Path) -> None:
    with pytest.raises(TenantsError, match=r"missing\.yaml: cannot read it"):
        load_tenants(tmp_path / "missing.yaml")
    binary = tmp_path / "bin.yaml"
    binary.write_bytes(b"keys: {\xff: a}")
    with pytest.raises(TenantsError, match=r"bin\.yaml: not UTF-8"):
        load_tenants(binary)


@settings(max_examples=200, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(st.text(max_size=200),
                 st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=30),
                              lambda inner: st.lists(inner, max_size=4)
                              | st.dictionaries(st.text(max_size=30), inner, max_size=4),
                              max_leaves=12).map(json.dumps)))
def test_hostile_files_parse_or_raise_only_tenants_errors(text: str) -> None:
    for json_format in (False, True):
        try:
            m = parse_tenants(text, "f", json_format=json_format)
        except TenantsError:
            continue
        assert m.entries and all(len(d) == 32 for d, _ in m.entries)


def _counting_compares(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """The lengths of what each ``hmac.compare_digest`` call compares."""
    calls: list[tuple[int, int]] = []
    real = hmac.compare_digest

    def counting(a: bytes, b: bytes) -> bool:
        calls.append((len(a), len(b)))
        return bool(real(a, b))

    monkeypatch.setattr(hmac, "compare_digest", counting)
    return calls


def test_a_tenant_key_is_one_lookup_by_its_digest_whatever_the_number_of_keys(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """O(1) per request, refused ones included: the map is a dict keyed by each key's
    SHA-256, and a lookup's time depends only on the presented token's digest, never on
    how much of a key it shares (issue 32 review item 10: N comparisons per request)."""
    many = {f"sk-tenant-{i:012d}-xxxx": f"t{i % 7}" for i in range(20_000)}
    m = tenants_of({**many, **KEYS})
    calls = _counting_compares(monkeypatch)
    for token, want in ((ACME, "acme"), (GLOBEX, "globex"), ("nobody-at-all-xxxxxxxx", None),
                        ("sk-tenant-000000019999-xxxx", "t0")):
        calls.clear()
        assert m.authenticate(token) == want
        assert len(calls) <= 1 and all(n == (32, 32) for n in calls)


def test_the_single_api_key_is_compared_by_digest_never_as_raw_text(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Raw tokens of different lengths made ``compare_digest`` return early, telling a
    caller the key's length (issue 32 review item 10)."""
    from kvtier.router.guard import Authenticator

    auth = Authenticator(ACME, None)
    assert ACME.encode() not in vars(auth).values()  # only its digest is kept
    calls = _counting_compares(monkeypatch)
    for token, ok in (("x", False), (ACME, True), (ACME + "y" * 100, False),
                      (ACME[:-1] + "0", False)):
        calls.clear()
        assert auth.identify(token) == (ok, None)
        assert calls == [(32, 32)]


SECRET = b"s" * 40


def test_salts_are_keyed_stable_and_distinct() -> None:
    """A tenant's salt needs the router's secret: not its name's hash (anyone could
    compute that and reach the tenant's KV on a backend directly, issue 47)."""
    acme = issue(SECRET, "acme")
    assert acme == issue(SECRET, "acme") != issue(SECRET, "globex")
    assert "acme" not in acme and looks_issued(acme)
    assert issue(b"t" * 40, "acme") != acme  # another secret, another salt
    unkeyed = "kvtier-tenant-" + hashlib.blake2b(b"acme", digest_size=16).hexdigest()
    check = SaltCheck([SECRET])
    assert check(acme) and not check(unkeyed) and not check(issue(b"t" * 40, "acme"))
    assert SaltCheck([b"t" * 40, SECRET])(acme)  # a rotation's overlap
    forged = acme[:-1] + ("0" if acme[-1] != "0" else "1")
    assert not check(forged) and not check(None) and not check("mine")


def test_the_secret_comes_from_a_file_or_the_environment(tmp_path: Path) -> None:
    f = tmp_path / "secret"
    f.write_text("# rotation: new first\n" + "n" * 32 + "\n\n" + "o" * 32 + "\n")
    assert load_secrets(f) == [b"n" * 32, b"o" * 32]
    assert load_secrets(None, {ENV: "a" * 32 + ";" + "b" * 32}) == [b"a" * 32, b"b" * 32]
    assert load_secrets(None, {}) == []
    f.write_text("short\n")
    with pytest.raises(SecretError, match="at least 32"):
        load_secrets(f)
    with pytest.raises(SecretError, match="cannot be read"):
        load_secrets(tmp_path / "missing")
    with pytest.raises(SecretError, match="needs a tenant secret"):
        SaltCheck([])


# -- the router ------------------------------------------------------------------------------


def test_each_tenant_gets_its_own_salt_whatever_the_client_sent(tenants_file: Path) -> None:
    async def scenario() -> None:
        async with harness(tenants=tenants_file, api_key="backend-key") as h:
            salts_of = h.client.app[ROUTER_KEY].salts
            assert salts_of is not None
            salt_of = salts_of.salt_of
            for key, client_salt in ((ACME, None), (ACME2, "mine"), (GLOBEX, salt_of("acme")),
                                     (GLOBEX, None)):
                body: dict[str, object] = {"prompt": "the same prompt"}
                if client_salt is not None:
                    body["cache_salt"] = client_salt
                assert (await post(h, body, **bearer(key)))[0] == 200
            salts = [b["cache_salt"] for b in h.prefill.bodies]
            assert salts == [salt_of("acme")] * 2 + [salt_of("globex")] * 2
            assert [b["cache_salt"] for b in h.decode.bodies] == salts
            # tenants' keys never reach the backends; the router's own key does
            assert set(h.prefill.auth) == set(h.decode.auth) == {"Bearer backend-key"}
            assert (await post(h, {"prompt": "x"}, **bearer("backend-key")))[0] == 401
    run(scenario)


def test_conversations_are_per_tenant(tenants_file: Path) -> None:
    async def scenario() -> None:
        async with harness(tenants=tenants_file) as h:
            body = {"prompt": "hello", "conversation_id": "c"}
            assert (await post(h, body, **bearer(ACME)))[2]["X-KVTier-Conversation"] == "new"
            assert (await post(h, body, **bearer(ACME2)))[2]["X-KVTier-Conversation"] == "known"
            renew = {"conversation_id": "c"}
            assert (await post(h, renew, "/v1/kvtier/renew", **bearer(GLOBEX)))[0] == 404
            assert (await post(h, body, **bearer(GLOBEX)))[2]["X-KVTier-Conversation"] == "new"
            assert (await post(h, renew, "/v1/kvtier/renew", **bearer(ACME)))[0] == 200
    run(scenario)


def test_prefix_hits_are_reported_only_when_asked_for(tenants_file: Path) -> None:
    async def scenario() -> None:
        async with harness(tenants=tenants_file) as h:
            _, doc, headers = await post(h, {"prompt": "p"}, **bearer(ACME))
            assert "kv_transfer_params" not in doc and "X-KVTier-Restored-Tokens" not in headers
            assert headers["X-KVTier-Path"] == "prefill_decode"
            asked = bearer(ACME) | {"X-KVTier-Report": "hits"}
            _, doc, headers = await post(h, {"prompt": "p"}, **asked)
            assert doc["kv_transfer_params"]["kvtier"]["restored_tokens"] == 7
            assert headers["X-KVTier-Restored-Tokens"] == "7"
    run(scenario)


async def rewrite(path: Path, keys: dict[str, str] | str) -> None:
    """Replace the file atomically (a new inode), as a deployment tool would."""
    tmp = path.with_suffix(".new")
    tmp.write_text(keys if isinstance(keys, str) else yaml.safe_dump({"keys": keys}))
    os.replace(tmp, path)


async def status_of(h: Harness, key: str) -> int:
    return (await post(h, {"prompt": "x"}, **bearer(key)))[0]


def test_a_changed_file_is_reloaded_and_a_bad_one_keeps_the_previous_keys(
        tenants_file: Path, caplog: pytest.LogCaptureFixture) -> None:
    rotated = "sk-acme-rotated-key-9999"

    async def scenario() -> None:
        async with harness(tenants=tenants_file) as h:
            await rewrite(tenants_file, {rotated: "acme"})
            assert await status_of(h, ACME) == 200  # not looked at again within a second
            h.clock.advance(1.0)
            assert await status_of(h, ACME) == 401
            assert await status_of(h, rotated) == 200
            await rewrite(tenants_file, "keys: {oops")
            h.clock.advance(1.0)
            assert await status_of(h, rotated) == 200  # the previous map stays
            async with h.client.get("/metrics") as resp:
                text = await resp.text()
            assert 'kvtier_router_tenant_reloads_total{result="ok"} 2.0' in text
            assert 'kvtier_router_tenant_reloads_total{result="error"} 1.0' in text
    run(scenario)
    assert "tenants.yaml: not valid YAML" in caplog.text and "keeping the previous" in caplog.text


def test_a_request_without_a_key_is_refused_before_any_other_work(tenants_file: Path) -> None:
    """No bearer token: refused at once, without looking at the tenants file (issue 32
    review item 10: every request, refused ones too, paid for the registry's look)."""
    rotated = "sk-acme-rotated-key-9999"

    async def reloads(h: Harness) -> str:
        async with h.client.get("/metrics") as resp:
            text = await resp.text()
        return next(line for line in text.splitlines()
                    if line.startswith('kvtier_router_tenant_reloads_total{result="ok"}'))

    async def scenario() -> None:
        async with harness(tenants=tenants_file) as h:
            before = await reloads(h)
            await rewrite(tenants_file, {rotated: "acme"})
            h.clock.advance(1.0)
            assert (await post(h, {"prompt": "x"}))[0] == 401
            assert (await post(h, {"prompt": "x"}, Authorization="Basic abc"))[0] == 401
            assert await reloads(h) == before  # the file was not looked at
            assert await status_of(h, rotated) == 200  # a keyed request looks, and reloads
            assert await reloads(h) != before
    run(scenario)


def test_sighup_reloads_at_once(tenants_file: Path) -> None:
    rotated = "sk-globex-after-sighup-1"

    async def scenario() -> None:
        async with harness(tenants=tenants_file) as h:
            registry = h.client.app[ROUTER_KEY].tenants
            assert registry is not None
            await rewrite(tenants_file, {rotated: "globex"})
            os.kill(os.getpid(), signal.SIGHUP)
            for _ in range(1000):  # the loop runs the handler on its next turns
                if registry.due():
                    break
                await asyncio.sleep(0)
            assert registry.due()
            assert await status_of(h, rotated) == 200  # no clock advance needed
            assert await status_of(h, GLOBEX) == 401
    run(scenario)


def test_a_bad_file_at_start_is_refused(tmp_path: Path) -> None:
    bad = tmp_path / "t.yaml"
    bad.write_text("keys: {short: a}\n")

    async def scenario() -> None:
        async with harness(tenants=bad):
            pass
    with pytest.raises(TenantsError, match=r"t\.yaml: keys entry 1 \(tenant 'a'\)"):
        run(scenario)


def test_routers_holding_one_secret_issue_the_same_salts(tenants_file: Path,
                                                         tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_text("k" * 48 + "\n")

    async def scenario() -> None:
        seen = []
        for _ in range(2):  # a restart, or a second router
            async with harness(tenants=tenants_file, tenant_secret_file=secret) as h:
                assert (await post(h, {"prompt": "p"}, **bearer(ACME)))[0] == 200
                seen.append(h.prefill.bodies[-1]["cache_salt"])
        assert seen[0] == seen[1] == issue(b"k" * 48, "acme")
    run(scenario)


def test_a_client_salt_imitating_the_routers_is_refused() -> None:
    async def scenario() -> None:
        async with harness() as h:
            status, doc, _ = await post(h, {"prompt": "p",
                                            "cache_salt": issue(SECRET, "acme")})
            assert status == 400 and "kvtier-tenant-" in doc["error"]["message"]
            assert not h.prefill.bodies
    run(scenario)
