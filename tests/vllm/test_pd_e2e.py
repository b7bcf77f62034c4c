"""P/D disaggregation end to end: two real vLLM API servers, the kvtier router, fp32.

Topology (all on 127.0.0.1): a prefill server (prefix caching off, to emulate eviction,
as seed 000 does), a decode server, and ``python -m kvtier router`` in front. KV moves
only through the shared file tier, a directory on CephFS that each server reaches through
its own ``ceph-fuse`` mount. Every output is compared with a recompute reference:
the same prompt on the prefill server with ``kvtier: {load: false, save: false}``.

What a turn restored on the prefill node is read from vLLM's own counters
(``vllm:prompt_tokens_by_source_total``), so requests here run one at a time except in
the concurrency test, which checks outputs only.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import shutil
import tempfile
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvtier.clock import ManualClock
from kvtier.keys import key_from_hex
from kvtier.testing.ceph import CephCluster
from kvtier.testing.servers import APIServer, router_process, servers_started, split_cpus
from kvtier.tiers.file import FileTier
from kvtier.vllm.settings import kv_transfer_config
from tests.conftest import cephfs_dir

pytestmark = pytest.mark.vllm

CT = 128  # chunk tokens = vLLM's CPU block size
THRESHOLD = 200  # above one chunk, so a single reusable chunk is below it
LEASE = 480.0
VOCAB_LO, VOCAB_HI = 10, 400
BASE = {"model": "model", "temperature": 0, "ignore_eos": True, "return_token_ids": True}
REFERENCE = {"kvtier": {"load": False, "save": False}}
KEY_ALPHA, KEY_BETA = "sk-alpha-0123456789", "sk-beta-0123456789"  # tenants' API keys


@dataclass
class PD:
    prefill: APIServer
    decode: APIServer
    router_url: str
    shared: Path
    shared_tier: FileTier  # this process's view of the shared directory (object paths)
    tiers_config: Path  # the prefill node's config, which the router reads (--tiers)
    client: httpx.Client = field(default_factory=lambda: httpx.Client(timeout=300))

    def reference(self, prompt: list[int], max_tokens: int) -> dict[str, Any]:
        body = {**BASE, "prompt": prompt, "max_tokens": max_tokens,
                "kv_transfer_params": REFERENCE}
        r = self.client.post(self.prefill.url + "/v1/completions", json=body)
        assert r.status_code == 200, r.text
        choice: dict[str, Any] = r.json()["choices"][0]
        return choice

    def turn(self, conv: str, prompt: list[int], max_tokens: int) -> httpx.Response:
        body = {**BASE, "prompt": prompt, "max_tokens": max_tokens, "conversation_id": conv}
        return self.client.post(self.router_url + "/v1/completions", json=body)

    def prefill_tokens(self) -> dict[str, float]:
        return self.prompt_tokens(self.prefill)

    def prompt_tokens(self, server: APIServer) -> dict[str, float]:
        """vLLM's prompt tokens of ``server`` so far, by source (``local_compute``,
        ``local_cache_hit``, ``external_kv_transfer``)."""
        text = self.client.get(server.url + "/metrics").text
        out: dict[str, float] = {}
        for m in re.finditer(
            r'^vllm:prompt_tokens_by_source_total\{[^}]*source="(\w+)"[^}]*\} ([0-9.e+]+)$',
            text, re.M,
        ):
            out[m.group(1)] = float(m.group(2))
        return out

    def wait_stored(self, last_key: str, timeout: float = 60.0) -> None:
        """The decode node writes after it answers; wait until the chain's end is on disk."""
        path = self.shared_tier.path_of(key_from_hex(last_key))
        deadline = time.monotonic() + timeout
        while not path.exists():
            assert time.monotonic() < deadline, f"{path} never appeared"
            time.sleep(0.05)  # polling another process, not driving test time


def _tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB_LO, VOCAB_HI) for _ in range(n)]


def _kvtier(resp: httpx.Response) -> dict[str, Any]:
    assert resp.status_code == 200, resp.text
    params: dict[str, Any] = resp.json()["kv_transfer_params"]["kvtier"]
    return params


@pytest.fixture(scope="module")
def pd(tiny_fp32: Path, ceph: CephCluster) -> Iterator[PD]:
    """The two nodes share a directory on CephFS, each through a ``ceph-fuse`` mount of its
    own (prefill and this test process on the first, decode on the second): a real shared
    filesystem whose clients cache, not one kernel's coherent view of a local directory."""
    with tempfile.TemporaryDirectory(prefix="kvt-pd-") as d:
        tmp = Path(d)
        name = f"pd-{uuid.uuid4().hex[:12]}"
        shared = cephfs_dir(ceph, name, node=0)
        configs = {}
        for role, node in (("prefill", 0), ("decode", 1)):
            configs[role] = tmp / f"pd-{role}.yaml"
            configs[role].write_text(json.dumps({
                "chunk_tokens": CT,
                "tiers": [{"host": {"capacity": "64MiB"}},
                          {"file": {"path": str(cephfs_dir(ceph, name, node=node)),
                                    "capacity": "1GiB", "write": "through"}}],
                # min_wait_seconds: the tiny model recomputes a turn in ~0.03 s, less
                # than a CephFS read takes with both cores busy (0.2-0.3 s for 4
                # chunks, CI), so by default a slow read is rightly given up; these
                # tests are about the hand-off, so restores may wait for the reads
                "restore": {"recompute_threshold_tokens": THRESHOLD, "wait_seconds": 30,
                            "min_wait_seconds": 1.0},
                "retention": {"lease_seconds": LEASE},
            }))
        p_cpus, d_cpus = split_cpus(2)  # a shared core starves the prefill while decode waits
        with servers_started(
                APIServer(tmp, model=tiny_fp32, name="prefill", prefix_caching=False,
                          cpus=p_cpus, kv_transfer_config=kv_transfer_config(
                              configs["prefill"], role="prefill")),
                APIServer(tmp, model=tiny_fp32, name="decode", cpus=d_cpus,
                          kv_transfer_config=kv_transfer_config(configs["decode"],
                                                                role="decode"))) as (p, dec):
            args = ["--tiers", str(configs["prefill"]), "--request-timeout", "60",
                    "--pd-mode", "always"]  # these tests are about the P/D hand-off
            with router_process(tmp, p.url, dec.url, args=args) as url:
                env = PD(p, dec, url, shared, FileTier(shared, 1 << 30), configs["prefill"])
                try:
                    yield env
                finally:
                    env.client.close()
                    shutil.rmtree(shared, ignore_errors=True)


def test_turn1_decode_loads_the_prefill_nodes_kv(pd: PD) -> None:
    prompt = _tokens(600, seed=1)
    ref = pd.reference(prompt, 16)
    r = pd.turn("t1", prompt, 16)
    params = _kvtier(r)
    assert r.json()["choices"][0]["token_ids"] == ref["token_ids"]
    assert params["restored_tokens"] == 512  # 4 full chunks; vLLM computes the rest
    assert set(params["restored_by_tier"]) == {"file1"}
    assert r.headers["X-KVTier-Conversation"] == "new"


def test_turns_2_to_4_prefill_loads_the_decode_retained_kv(pd: PD) -> None:
    prompt = _tokens(600, seed=2)
    rng = random.Random(2)
    retained = 0
    for turn in range(1, 5):
        ref = pd.reference(prompt, 48)
        before = pd.prefill_tokens()
        r = pd.turn("t2", prompt, 48)
        after = pd.prefill_tokens()
        params = _kvtier(r)
        out = r.json()["choices"][0]["token_ids"]
        assert out == ref["token_ids"], f"turn {turn}"
        loaded = after["external_kv_transfer"] - before["external_kv_transfer"]
        computed = after["local_compute"] - before["local_compute"]
        if turn > 1:
            assert r.headers["X-KVTier-Conversation"] == "known"
            assert loaded == retained > 0, f"turn {turn}: D->P loaded {loaded} of {retained}"
            assert computed == len(prompt) - retained  # only the new suffix
        retained = params["tokens"]  # the decode node kept prompt + output, full chunks
        # ... except the last output token, whose KV is never computed.
        assert retained == (len(prompt) + len(out) - 1) // CT * CT
        pd.wait_stored(params["last_key"])
        prompt = prompt + out + [rng.randrange(VOCAB_LO, VOCAB_HI) for _ in range(100)]


def test_fewer_reusable_tokens_than_the_threshold_recompute(pd: PD) -> None:
    prompt = _tokens(200, seed=3)  # one full chunk: 128 < THRESHOLD reusable tokens
    ref = pd.reference(prompt, 8)
    r = pd.turn("t3", prompt, 8)
    assert r.json()["choices"][0]["token_ids"] == ref["token_ids"]
    assert _kvtier(r)["restored_tokens"] == 0


def test_a_changed_history_reuses_exactly_the_matching_prefix(pd: PD) -> None:
    prompt = _tokens(600, seed=10)
    r = pd.turn("t5", prompt, 48)
    params = _kvtier(r)
    pd.wait_stored(params["last_key"])
    # The client rewrites the history (e.g. strips a reasoning trace) from token 300 on.
    edited = prompt[:300] + _tokens(400, seed=11)
    ref = pd.reference(edited, 8)
    before = pd.prefill_tokens()
    r = pd.turn("t5", edited, 8)
    loaded = pd.prefill_tokens()["external_kv_transfer"] - before["external_kv_transfer"]
    assert r.json()["choices"][0]["token_ids"] == ref["token_ids"]
    assert loaded == 256  # chunks 0-1 match; chunk 2 holds the first edited token


def test_chat_completions_through_the_router(pd: PD) -> None:
    messages = [{"role": "user", "content": "tell me about tiered caches " * 40}]
    body: dict[str, Any] = {"model": "model", "messages": messages, "max_tokens": 12,
                            "temperature": 0, "ignore_eos": True}
    ref = pd.client.post(pd.prefill.url + "/v1/chat/completions",
                         json={**body, "kv_transfer_params": REFERENCE})
    assert ref.status_code == 200, ref.text
    for turn in range(2):
        r = pd.client.post(pd.router_url + "/v1/chat/completions",
                           json={**body, "conversation_id": "chat"})
        assert r.status_code == 200, r.text
        answer = r.json()["choices"][0]["message"]["content"]
        assert answer == ref.json()["choices"][0]["message"]["content"], f"turn {turn}"
        assert r.headers["X-KVTier-Conversation"] == ("new" if turn == 0 else "known")


def test_streaming_through_the_router(pd: PD) -> None:
    prompt = _tokens(400, seed=4)
    ref = pd.reference(prompt, 16)
    body = {**BASE, "prompt": prompt, "max_tokens": 16, "stream": True,
            "conversation_id": "t4"}
    text = []
    with pd.client.stream("POST", pd.router_url + "/v1/completions", json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text.append(json.loads(line[6:])["choices"][0]["text"])
    assert "".join(text) == ref["text"]


def _follow_up(conversation: str, turn: int) -> int:
    return 1000 + int(conversation[1:]) * 10 + turn


def test_concurrent_streaming_conversations_never_mix(pd: PD) -> None:
    n, turns = 6, 2
    prompts = {f"c{i}": _tokens(300 + 40 * i, seed=100 + i) for i in range(n)}
    refs: dict[str, list[str]] = {c: [] for c in prompts}
    histories = dict(prompts)
    for c, p in prompts.items():  # references first, one at a time
        for t in range(turns):
            ref = pd.reference(p, 12)
            refs[c].append(ref["text"])
            p = p + ref["token_ids"] + _tokens(50, seed=_follow_up(c, t))

    async def conversation(client: httpx.AsyncClient, c: str) -> list[str]:
        p, got = histories[c], []
        for t in range(turns):
            body = {**BASE, "prompt": p, "max_tokens": 12, "stream": True,
                    "conversation_id": c}
            parts: list[str] = []
            ids: list[int] = []
            async with client.stream("POST", pd.router_url + "/v1/completions", json=body) as r:
                assert r.status_code == 200, (await r.aread()).decode()
                async for line in r.aiter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        choice = json.loads(line[6:])["choices"][0]
                        parts.append(choice["text"])
                        ids += choice.get("token_ids") or []
            got.append("".join(parts))
            p = p + ids + _tokens(50, seed=_follow_up(c, t))
        return got

    async def main() -> dict[str, list[str]]:
        async with httpx.AsyncClient(timeout=120) as client:
            outs = await asyncio.wait_for(
                asyncio.gather(*(conversation(client, c) for c in prompts)), timeout=600
            )
        return dict(zip(prompts, outs, strict=True))

    assert asyncio.run(main()) == refs


def test_a_swarm_on_a_new_prefix_each_decode_restores_its_own_suffix(pd: PD) -> None:
    """Four prefills start at once on one new 300-token system prompt (as the router sends
    them: ``max_tokens=1``, phase prefill): the prefill node saves the shared chunks once
    (the others back them up) and every request's own chunks, and announces all four
    chunks for each. Each decode then restores its own suffix (issue 17: three of four
    used to announce nothing). The decodes run one at a time, each with its own
    announcement, as the router would hand them over."""
    system = _tokens(300, seed=40)
    prompts = [system + _tokens(300, seed=41 + i) for i in range(4)]
    refs = [pd.reference(p, 8)["token_ids"] for p in prompts]

    async def prefills() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=120) as client:
            return list(await asyncio.gather(*(client.post(
                pd.prefill.url + "/v1/completions",
                json={**BASE, "prompt": p, "max_tokens": 1,
                      "kv_transfer_params": {"kvtier": {"phase": "prefill"}}})
                for p in prompts)))

    announced = [_kvtier(r) for r in asyncio.run(prefills())]
    for i, (p, ref, a) in enumerate(zip(prompts, refs, announced, strict=True)):
        assert a["tokens"] == 512, (i, a)  # every full chunk: the shared two and its own
        expect = {k: a[k] for k in ("namespace", "tokens", "last_key")}
        r = pd.client.post(pd.decode.url + "/v1/completions", json={
            **BASE, "prompt": p, "max_tokens": 8,
            "kv_transfer_params": {"kvtier": {"expect": expect}}})
        params = _kvtier(r)
        assert r.json()["choices"][0]["token_ids"] == ref, i
        # chunks 2-3 are this conversation's own: only kvtier can have them (the decode
        # node's prefix cache may hold the shared chunks 0-1 from a sibling)
        assert params["restored_tokens"] >= 256, (i, params)


def test_expired_lease_recomputes_and_renewal_keeps_a_conversation(pd: PD) -> None:
    first = {c: _tokens(600, seed=s) for c, s in (("expire", 5), ("renew", 6))}
    seconds = {}
    for c, p in first.items():
        r = pd.turn(c, p, 48)
        params = _kvtier(r)
        pd.wait_stored(params["last_key"])
        out = r.json()["choices"][0]["token_ids"]
        seconds[c] = (p + out + _tokens(100, seed=7), params["tokens"])
    # Age every stored object by 100 s, renew one conversation through the router, then
    # collect at a time past the original expiry of everything.
    now = time.time()
    for path in pd.shared.rglob("*.kv"):
        os.utime(path, (now - 100, now - 100))
    r = pd.client.post(pd.router_url + "/v1/kvtier/renew", json={"conversation_id": "renew"})
    assert r.status_code == 200 and r.json()["renewed_chunks"] == seconds["renew"][1] // CT
    collector = FileTier(pd.shared, 1 << 30, clock=ManualClock(start=now - 100 + LEASE + 1))
    assert collector.expire(LEASE) > 0
    for c, (prompt, retained) in seconds.items():
        ref = pd.reference(prompt, 8)
        before = pd.prefill_tokens()
        r = pd.turn(c, prompt, 8)
        loaded = pd.prefill_tokens()["external_kv_transfer"] - before["external_kv_transfer"]
        assert r.json()["choices"][0]["token_ids"] == ref["token_ids"], c
        if c == "renew":
            assert loaded == retained  # the decode-written chunk survived in the shared tier
        else:  # only the prompt chunks the prefill node still holds in host memory
            assert loaded == 512 < retained


def test_selective_pd_and_tenants_on_the_same_servers(pd: PD, tmp_path: Path) -> None:
    """A second router on the same two servers, as shipped (``--pd-mode auto``) and with a
    tenants file: a long first turn goes through the prefill node, its short follow-up
    straight to the decode node (which restores the held prefix and computes the rest),
    both equal to a recompute; another tenant sending the same prompt and the same
    ``cache_salt`` gets none of the first tenant's KV (the router sets the salt), and no
    prefix-hit information unless it asks; the same when both tenants send no
    ``cache_salt`` at all, while the first tenant's own next request (another
    conversation, another client salt) is priced by what its own salt holds in the tier
    and goes decode-only; ``/health`` shows no backend to a
    caller without a key, and a flood of ``/health`` calls does not reach the servers."""
    tenants = tmp_path / "tenants.yaml"
    tenants.write_text(json.dumps({"keys": {KEY_ALPHA: "alpha", KEY_BETA: "beta"}}))
    args = ["--tiers", str(pd.tiers_config), "--request-timeout", "60", "--pd-mode", "auto",
            "--tenants", str(tenants)]

    with router_process(tmp_path, pd.prefill.url, pd.decode.url, name="router-auto",
                        args=args) as url:
        def send(key: str, conv: str, prompt: list[int], hits: bool = True,
                 salt: str | None = "chosen-by-the-client") -> httpx.Response:
            headers = {"Authorization": f"Bearer {key}"}
            if hits:
                headers["X-KVTier-Report"] = "hits"
            body = {**BASE, "prompt": prompt, "max_tokens": 16, "conversation_id": conv}
            if salt is not None:
                body["cache_salt"] = salt
            r = pd.client.post(url + "/v1/completions", json=body, headers=headers)
            assert r.status_code == 200, r.text
            return r

        prompt = _tokens(600, seed=41)
        r1 = send(KEY_ALPHA, "sel", prompt)
        assert r1.headers["X-KVTier-Path"] == "prefill_decode"  # 600 uncached tokens
        out = r1.json()["choices"][0]["token_ids"]
        assert out == pd.reference(prompt, 16)["token_ids"]
        pd.wait_stored(_kvtier(r1)["last_key"])

        follow = prompt + out + _tokens(40, seed=42)
        ref = pd.reference(follow, 16)["token_ids"]
        before = pd.prefill_tokens()
        r2 = send(KEY_ALPHA, "sel", follow)
        assert r2.headers["X-KVTier-Path"] == "decode_only"
        assert r2.json()["choices"][0]["token_ids"] == ref
        assert pd.prefill_tokens() == before  # the prefill node saw nothing of it
        pd.wait_stored(_kvtier(r2)["last_key"])  # alpha's whole turn is in the shared tier

        before = pd.prefill_tokens()
        r3 = send(KEY_BETA, "other", follow, hits=False)
        after = pd.prefill_tokens()
        assert r3.json()["choices"][0]["token_ids"] == ref
        # beta's prompt is new to beta: the prefill node computed all of it, none of
        # alpha's chunks (same tokens, same client salt) was restored
        assert after["external_kv_transfer"] == before["external_kv_transfer"]
        assert after["local_compute"] - before["local_compute"] == len(follow)
        assert "kv_transfer_params" not in r3.json()
        assert not any(h.lower().startswith("x-kvtier-restore") for h in r3.headers)

        # No cache_salt from either client: without tenants both would share one namespace.
        fresh = _tokens(600, seed=43)
        ref = pd.reference(fresh, 16)["token_ids"]
        r4 = send(KEY_ALPHA, "alpha-unsalted", fresh, salt=None)
        assert r4.headers["X-KVTier-Path"] == "prefill_decode"  # a new 600-token prompt
        assert r4.json()["choices"][0]["token_ids"] == ref
        before = pd.prefill_tokens()
        r5 = send(KEY_BETA, "beta-unsalted", fresh, salt=None)
        after = pd.prefill_tokens()
        assert r5.headers["X-KVTier-Path"] == "prefill_decode"
        assert r5.json()["choices"][0]["token_ids"] == ref
        assert after["external_kv_transfer"] == before["external_kv_transfer"]
        assert after["local_compute"] - before["local_compute"] == len(fresh)
        # ... while alpha's next request, under another conversation and another client
        # salt, finds what alpha's first one stored (the router keys it under alpha's salt
        # and asks the tier, issue 33): 4 full chunks held, 88 tokens uncached, so it goes
        # straight to the decode node, and the prefill node sees nothing of it.
        before = pd.prefill_tokens()
        r6 = send(KEY_ALPHA, "alpha-again", fresh, salt="another-client-salt")
        assert r6.json()["choices"][0]["token_ids"] == ref
        assert r6.headers["X-KVTier-Path"] == "decode_only"
        assert pd.prefill_tokens() == before

        health = pd.client.get(url + "/health")
        assert pd.prefill.url not in health.text and pd.decode.url not in health.text

        # an unauthenticated flood of /health is answered from the router's cached state:
        # each vLLM server's access log shows at most a probe or two from it (one per
        # second of flood), not one per call
        def probes() -> int:
            return sum(s.log_path.read_text(errors="replace").count("GET /health")
                       for s in (pd.prefill, pd.decode))

        before_probes = probes()
        t0 = time.monotonic()
        with ThreadPoolExecutor(8) as pool:
            codes = list(pool.map(lambda _: httpx.get(url + "/health").status_code,
                                  range(64)))
        seconds = time.monotonic() - t0  # long on a loaded machine: a probe per second
        assert set(codes) == {200}
        allowed = 2 * (int(seconds) + 2)  # 2 backends, one probe per second (health_interval)
        assert 0 < probes() - before_probes <= min(allowed, 64), \
            f"the flood reached the backends ({seconds:.1f} s of flood)"


#: What vLLM's own P/D proxy (its disaggregation tests' toy proxy) and llm-d's routing
#: sidecar put in the prefill request (with ``max_tokens: 1``, not streamed).
VLLM_PROXY_PREFILL = {"do_remote_decode": True, "do_remote_prefill": False,
                      "remote_engine_id": None, "remote_block_ids": None,
                      "remote_host": None, "remote_port": None}


def _restorable(prompt: list[int]) -> int:
    """The most a decode node can be handed: every full block of the prompt but the one
    holding its last token (vLLM computes at least one), here ``CT`` (vLLM's CPU block
    size) at a time; on a GPU (16-token blocks) that is all but a few tokens."""
    return (len(prompt) - 1) // CT * CT


def _vllm_proxy_turn(client: httpx.Client, pd: PD, prompt: list[int],
                     max_tokens: int) -> httpx.Response:
    """One request through the hop vLLM's proxy makes: the prefill node first, with the
    protocol's params and one output token; then the decode node with whatever
    ``kv_transfer_params`` the prefill answered (nothing kvtier-specific added)."""
    first = client.post(pd.prefill.url + "/v1/completions", json={
        **BASE, "prompt": prompt, "max_tokens": 1, "stream": False,
        "kv_transfer_params": VLLM_PROXY_PREFILL})
    assert first.status_code == 200, first.text
    body: dict[str, Any] = {**BASE, "prompt": prompt, "max_tokens": max_tokens}
    handed = first.json().get("kv_transfer_params")
    if handed:
        body["kv_transfer_params"] = handed
    return client.post(pd.decode.url + "/v1/completions", json=body)


def test_vllms_pd_proxy_protocol_restores_every_turn_on_the_decode_node(pd: PD) -> None:
    """Four conversations through vLLM's P/D proxy protocol (``do_remote_decode`` on the
    prefill request, its answer handed to the decode node as it is), first turns all at
    once (the decode requests race the prefill node's write-through), then two more
    turns each: a first turn's decode restores every full block of its prompt; a later
    one computes only its last partial block and what its own prefix cache misses if
    that is below the restore threshold (the rest restored by kvtier); every answer
    equals a recompute. Before, the prefill's answer named nothing the decode node
    waited for, and first turns recomputed most of their prompts. (After the selective
    test: its dozen turns fill the shared tier, which a router started later must scan
    before its prices know them; before the faults test, which stops a server.)"""
    convs = {f"v{i}": _tokens(500 + 90 * i, seed=700 + i) for i in range(4)}
    refs = {c: pd.reference(p, 12)["token_ids"] for c, p in convs.items()}

    def first_turn(c: str) -> httpx.Response:
        with httpx.Client(timeout=300) as client:
            return _vllm_proxy_turn(client, pd, convs[c], 12)

    with ThreadPoolExecutor(len(convs)) as pool:
        firsts = dict(zip(convs, pool.map(first_turn, convs), strict=True))
    for c, r in firsts.items():
        params = _kvtier(r)
        assert r.json()["choices"][0]["token_ids"] == refs[c], c
        assert params["restored_tokens"] == _restorable(convs[c]), (c, params)
    last: dict[str, httpx.Response] = firsts
    for turn in (2, 3):
        for c in convs:
            out = last[c].json()["choices"][0]["token_ids"]
            convs[c] = convs[c] + out + _tokens(60, seed=_follow_up(c, turn))
        last = {}
        for c, prompt in convs.items():
            ref = pd.reference(prompt, 12)["token_ids"]
            before = pd.prompt_tokens(pd.decode)
            r = _vllm_proxy_turn(pd.client, pd, prompt, 12)
            after = pd.prompt_tokens(pd.decode)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["token_ids"] == ref, (c, turn)
            computed = after["local_compute"] - before["local_compute"]
            # (what its own cache misses is restored unless it is below this module's
            # THRESHOLD, which vLLM then recomputes: the configured policy)
            assert computed < len(prompt) - _restorable(prompt) + THRESHOLD, \
                (c, turn, computed, _kvtier(r))
            last[c] = r


def test_router_faults_get_a_clear_status(pd: PD) -> None:
    url = pd.router_url + "/v1/completions"
    r = pd.client.post(url, content=b"{not json")
    assert r.status_code == 400 and "JSON" in r.text
    r = pd.client.post(url, json={"model": "model", "max_tokens": 4})
    assert r.status_code == 400 and "prompt" in r.text
    r = pd.client.post(pd.router_url + "/v1/kvtier/renew", json={"conversation_id": "nobody"})
    assert r.status_code == 404
    r = pd.turn("never-seen", _tokens(50, seed=8), 4)  # unknown: served as a new one
    assert r.status_code == 200 and r.headers["X-KVTier-Conversation"] == "new"
    pd.decode.kill()
    t0 = time.monotonic()
    r = pd.turn("after-kill", _tokens(50, seed=9), 4)
    assert r.status_code in (502, 503) and time.monotonic() - t0 < 30
    assert pd.client.get(pd.router_url + "/health").status_code == 503
