"""The held prefix: namespace learning, keys as the engines compute them, and the bounded
lookup over a real file tier (``kvtier.router.prefix``)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtier.clock import ManualClock
from kvtier.keys import chunk_keys
from kvtier.router.prefix import (
    Held,
    HeldLookup,
    NamespaceBook,
    PrefixReader,
    Probe,
    prompt_keys,
)
from kvtier.router.protocol import parse_request
from kvtier.router.storage import guarded
from kvtier.tiers.file import FileTier
from tests.router.fakes import KVStore

pytestmark = pytest.mark.timeout(30)

IDS = [(i * 7919) % 50_000 for i in range(1, 300)]


@pytest.fixture
def tier(tmp_path: Path) -> Iterator[FileTier]:
    t = FileTier(tmp_path / "store", 1 << 30)
    yield t
    t.close()


def reader_tier(tmp_path: Path) -> FileTier:
    """A second process's view of the same store (nothing in its index yet)."""
    return FileTier(tmp_path / "store", 1 << 30)


def test_the_digest_is_learnt_per_identity_only_from_answers_that_verify(
        tier: FileTier) -> None:
    kv = KVStore(tier, adapters=("sql-lora",))
    book = NamespaceBook(16)
    plain, salted = {"model": "base"}, {"model": "base", "cache_salt": "t1"}
    lora = {"model": "sql-lora"}
    for body in (plain, salted, lora):
        params = kv.save(body, IDS)
        ident = (body.get("cache_salt"), body["model"])
        assert not book.learn(ident, [*IDS[:-5], 1, 2, 3, 4, 5], params)  # other ids
        assert not book.learn(ident, IDS, params | {"namespace": "ab" * 16})
        assert not book.learn(ident, IDS[:10], params)  # more tokens than ids: unverifiable
        assert book.get(ident) is None
        assert book.learn(ident, IDS, params)
        assert book.get(ident) == (kv.digest(body), 8)  # stored 296 = 18 * 16 + 8
    digests = {book.get((b.get("cache_salt"), b["model"])) for b in (plain, salted, lora)}
    assert len(digests) == 3  # salt and adapter each give their own keys


def test_keys_are_the_engines_and_stop_before_the_last_token(tier: FileTier) -> None:
    kv = KVStore(tier)
    book = NamespaceBook(16)
    book.learn((None, None), IDS, kv.save({}, IDS))
    pk = prompt_keys(book, (None, None), IDS[:64])  # exactly 4 chunks
    assert pk is not None
    assert pk.keys == chunk_keys(kv.digest({}), IDS[:48], 16)  # the 4th holds the last token
    # tails at the granularity seen so far (the 296 stored tokens: 8; blocks are 4): a
    # coarser grain only undercounts
    assert [t for t, _ in pk.tail_candidates(3)] == [8]
    book.learn((None, None), IDS, kv.save({}, IDS[:149]))  # 148 = 9 * 16 + 4
    pk = prompt_keys(book, (None, None), IDS[:64])
    assert pk is not None and [t for t, _ in pk.tail_candidates(3)] == [12, 8, 4]


def test_the_probe_finds_the_stored_chain_in_few_lookups(tier: FileTier,
                                                         tmp_path: Path) -> None:
    # the router's view of the store, opened before the engine wrote: its index knows nothing
    other, small = reader_tier(tmp_path), reader_tier(tmp_path)
    try:
        assert other.wait_indexed(5) and small.wait_indexed(5)
        kv = KVStore(tier)
        book = NamespaceBook(16)
        book.learn((None, None), IDS, kv.save({}, IDS[:150]))  # 9 chunks and a 4-token tail
        lookup = HeldLookup(guarded([other], ManualClock()))
        prompt = IDS[:150] + [3] * 100  # 15 restorable chunks
        pk = prompt_keys(book, (None, None), prompt)
        assert pk is not None
        probe = Probe(lookup.index_prefix(pk))
        assert probe.chunks == 0
        lookup.probe(pk, probe, threading.Event())
        held = lookup.held(pk, probe)
        assert (held.chunks, held.tail_tokens, held.tokens) == (9, 4, 148)
        assert held.heads == 4 + 3  # a binary search over 15 chunks, then tails of 12, 8, 4
        bounded = HeldLookup(guarded([small], ManualClock()), max_heads=2)
        p = Probe(bounded.index_prefix(pk))
        bounded.probe(pk, p, threading.Event())
        assert p.heads == 2 and p.chunks == 8 and p.tail_tokens == 0  # a lower bound
    finally:
        other.close()
        small.close()


def test_a_probe_that_times_out_counts_what_it_confirmed(tier: FileTier) -> None:
    kv = KVStore(tier)
    gate, started = threading.Event(), threading.Event()

    class SlowTier(FileTier):
        def present(self, key):  # type: ignore[no-untyped-def]
            started.set()
            gate.wait(5)
            return super().present(key)

    slow = SlowTier(tier.root, 1 << 30)

    async def scenario() -> Held | str:
        reader = PrefixReader(16, HeldLookup(guarded([slow], ManualClock())), probe_timeout=0.05)
        reader.book.learn((None, None), IDS, kv.save({}, IDS))
        try:
            return await reader.held((None, None), IDS + [1] * 40)
        finally:
            gate.set()

    try:
        held = asyncio.run(scenario())
        # the index's chunks (if its scan got to them) count; the blocked lookup does not
        assert isinstance(held, Held) and started.is_set()
        assert held.heads == 1 and held.tail_tokens == 0 and held.tokens % 16 == 0
    finally:
        slow.close()


def test_prompts_whose_keys_cannot_be_computed_say_why() -> None:
    def unkeyed(endpoint: str, body: str) -> str | None:
        return parse_request(endpoint, body.encode(), {}).unkeyed  # type: ignore[arg-type]

    image = '{"type": "image_url", "image_url": {"url": "x"}}'
    assert unkeyed("chat", f'{{"messages": [{{"role": "user", "content": [{image}]}}]}}') \
        == "multimodal"
    assert unkeyed("chat", '{"messages": [], "documents": []}') == "unsupported_prompt"
    assert unkeyed("completions", '{"prompt": ["a", "b"]}') == "unsupported_prompt"
    assert unkeyed("completions", '{"prompt": "", "prompt_embeds": "AAAA"}') \
        == "unsupported_prompt"
    req = parse_request("chat", b'{"messages": [{"role": "user", "content": "hi"}], '
                        b'"model": "m", "tools": [], "temperature": 0}', {}, salt="s")
    assert req.unkeyed is None and req.identity == ("s", "m")
    assert req.tokenize == {"messages": [{"role": "user", "content": "hi"}], "model": "m",
                            "tools": []}
    ids = parse_request("completions", b'{"prompt": [1, 2, 3]}', {})
    assert ids.prompt_ids == (1, 2, 3) and ids.tokenize is None


def test_what_the_index_claims_is_confirmed_at_the_chains_ends(tier: FileTier,
                                                               tmp_path: Path) -> None:
    """The router's index learns of deletions late (its walk): a chain the engines
    collected since must not be priced as held. Its first and last claimed chunks are
    checked; a chain cut at its end is searched below; one whose head went holds nothing;
    a hole in the middle (which the ends do not show) is found once the identity's
    pricing fell short (``PrefixReader.shortfall``: chunk by chunk)."""
    kv = KVStore(tier)
    book = NamespaceBook(16)
    book.learn((None, None), IDS, kv.save({}, IDS[:150]))  # 9 chunks and a tail
    pk = prompt_keys(book, (None, None), IDS[:150] + [3] * 100)
    assert pk is not None
    reader = reader_tier(tmp_path)
    try:
        lookup = HeldLookup(guarded([reader], ManualClock()))

        def held(indexed: int, distrusted: bool = False) -> Held:
            probe = Probe(indexed, distrusted)
            lookup.probe(pk, probe, threading.Event())
            return lookup.held(pk, probe)

        whole = held(9)
        # the two ends, a binary search over the 6 chunks beyond, the tails 12, 8, 4
        assert (whole.chunks, whole.tail_tokens) == (9, 4) and whole.heads == 2 + 2 + 3
        for key in pk.keys[6:9]:  # an engine collected the chain's last chunks
            tier.delete([key])
        cut = held(9)
        assert cut.chunks == 6 and cut.tail_tokens == 0  # the tail's chunk is gone too
        tier.delete([pk.keys[3]])  # a hole: the ends still answer
        # neither the ends nor a binary search (chains are monotone, but for holes) see it
        assert held(9).chunks == 6
        reader_book = PrefixReader(16, lookup, probe_timeout=1.0)
        assert reader_book.shortfall((None, None), priced=9 * 16, restored=3 * 16, now=0.0)
        assert not reader_book.shortfall((None, None), priced=100, restored=96, now=0.0)
        assert reader_book.distrusted((None, None), 59.0)
        assert not reader_book.distrusted((None, None), 61.0)
        assert held(9, distrusted=True).chunks == 3  # each chunk checked: the hole shows
        tier.delete([pk.keys[0]])
        assert held(9).chunks == 0 and held(9).heads == 1  # no head: nothing restores
    finally:
        reader.close()
