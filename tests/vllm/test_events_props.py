"""KV events replayed as a router does equal what kvtier holds, per medium (property tests).

Pieces of a few conversations that share prefixes overlap the way kvtier's objects do:
whole chunks, tails (the first blocks of a chunk), window parts (any run of at most a
chunk's blocks), the same blocks under two keys (two namespaces), in two KV-cache groups.
Random sequences of stores, host evictions, expiries, collections and weights resets
drive ``KVEvents`` through the tiers' hooks (``observe``: host = ``CPU``, two lower tiers =
``STORAGE``); the stream, replayed as a set of ``(medium, group, hash)``, must equal the
blocks held by some copy in that medium after every ``take``, and no event may claim a
block already held or remove one not held (a router that counts is exact too).
Requests are vLLM's own, with vLLM's block hasher.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from vllm.distributed.kv_events import BlockRemoved, BlockStored
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import (
    get_request_block_hasher,
    init_none_hash,
    maybe_convert_block_hash,
)
from vllm.v1.request import Request

from kvtier.keys import ChunkKey
from kvtier.vllm.events import GroupMeta, KVEvents
from kvtier.vllm.eventsetup import tier_media

BS, BPC = 16, 4
init_none_hash(sha256)
HASHER = get_request_block_hasher(BS, sha256)
TIERS = tier_media(["host", "file", "s3"])  # CPU, STORAGE, STORAGE


def _request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=1), None, block_hasher=HASHER)


_rng = np.random.default_rng(35)
_BASE = [int(x) for x in _rng.integers(3, 500, 3 * BPC * BS + 5)]
#: three conversations: one, one branching inside chunk 1, one branching after block 9
REQUESTS = [
    _request("a", _BASE),
    _request("b", _BASE[: 6 * BS] + [int(x) for x in _rng.integers(3, 500, 5 * BS + 3)]),
    _request("c", _BASE[: 9 * BS] + [int(x) for x in _rng.integers(3, 500, 3 * BS + 1)]),
]


@dataclass(frozen=True)
class Piece:
    key: ChunkKey
    req: int
    group: int
    first: int
    blocks: int


def _pieces() -> list[Piece]:
    out: list[Piece] = []
    for r, req in enumerate(REQUESTS):
        n = len(req.block_hashes)
        spans = {(c * BPC, k) for c in range(n // BPC + 1) for k in (1, 3, BPC)
                 if c * BPC + k <= n}  # chunks and tails
        spans |= {(b, k) for b in range(1, n, 3) for k in (2, BPC) if b + k <= n}  # windows
        for ns in (0, 1):  # two namespaces: the same blocks under two keys
            for group in (0, 1):
                for first, blocks in sorted(spans):
                    if ns and (first + blocks) % 3:
                        continue
                    key = ChunkKey(bytes([r, ns, group, first, blocks]).ljust(16, b"k"))
                    out.append(Piece(key, r, group, first, blocks))
    return out


PIECES = _pieces()


def _events(max_chunks: int = 1_000_000) -> KVEvents:
    ev = KVEvents(TIERS, block_size=BS, blocks_per_chunk=BPC, chunk_tokens=BPC * BS,
                  groups=[GroupMeta("full_attention"), GroupMeta("sliding_window", 40)],
                  max_chunks=max_chunks)
    for p in PIECES:
        assert ev.note_pieces(REQUESTS[p.req], [(p.key, p.group, p.first, p.blocks)]) == 1
    return ev


def _blocks(p: Piece, medium: str) -> set[tuple[str, int, Any]]:
    hashes = REQUESTS[p.req].block_hashes[p.first : p.first + p.blocks]
    return {(medium, p.group, maybe_convert_block_hash(h)) for h in hashes}


def _truth(copies: set[tuple[int, int]]) -> set[tuple[str, int, Any]]:
    out: set[tuple[str, int, Any]] = set()
    for i, tier in copies:
        out |= _blocks(PIECES[i], TIERS[tier].medium)
    return out


def _replay(state: set[tuple[str, int, Any]], events: list[Any]) -> None:
    """A router's view: stores add, removals discard; strict (no double claims)."""
    for e in events:
        names = {(e.medium, e.group_idx, h) for h in e.block_hashes}
        if isinstance(e, BlockStored):
            assert not names & state, "claimed a block already held"
            state |= names
            _check_stored(e)
        else:
            assert isinstance(e, BlockRemoved)
            assert names <= state, "removed a block not held"
            state -= names


_TOKENS = {maybe_convert_block_hash(h): (r, i) for r, req in enumerate(REQUESTS)
           for i, h in enumerate(req.block_hashes)}


def _check_stored(e: Any) -> None:
    """A store is self-contained: its parent is the block before its first, its tokens
    are its blocks' tokens."""
    r, i = _TOKENS[e.block_hashes[0]]
    req = REQUESTS[r]
    want_parent = maybe_convert_block_hash(req.block_hashes[i - 1]) if i else None
    assert e.parent_block_hash == want_parent
    for k, h in enumerate(e.block_hashes):
        r, i = _TOKENS[h]
        assert e.token_ids[k * BS : (k + 1) * BS] == \
            list(REQUESTS[r].all_token_ids[i * BS : (i + 1) * BS])


OPS = st.lists(st.tuples(st.sampled_from(["store", "evict", "expire", "collect", "take"]),
                         st.integers(0, len(PIECES) - 1), st.integers(1, 2)),
               min_size=1, max_size=120)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(OPS)
def test_the_replayed_stream_is_what_kvtier_holds_per_medium(ops: list[Any]) -> None:
    ev = _events()
    copies: set[tuple[int, int]] = set()  # (piece, tier) held
    state: set[tuple[str, int, Any]] = set()
    for op, i, lower in ops:
        key = PIECES[i].key
        if op == "store":  # a save's host commit, then its write below
            ev.observe(0, True, key)
            ev.observe(lower, True, key)
            copies |= {(i, 0), (i, lower)}
        elif op == "evict":  # host eviction (or a superseded tail dropped)
            ev.observe(0, False, key)
            copies.discard((i, 0))
        elif op in ("expire", "collect"):  # a lower tier's index drops the key
            ev.observe(lower, False, key)
            copies.discard((i, lower))
        else:
            _replay(state, ev.take())
            assert state == _truth(copies)
    _replay(state, ev.take())
    assert state == _truth(copies)
    ev.withdraw_all()  # a weights reset: every claim withdrawn
    _replay(state, ev.take())
    assert state == set() and ev.counts.blocks() == 0


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(OPS, st.integers(1, 12))
def test_the_cap_withdraws_claims_without_ever_over_claiming(ops: list[Any], cap: int) -> None:
    """With the held map capped, the oldest claims are withdrawn: the stream then says
    less than kvtier holds (recall), never more (precision), and stays exact for what it
    still claims."""
    ev = _events(max_chunks=cap)
    copies: set[tuple[int, int]] = set()
    state: set[tuple[str, int, Any]] = set()
    for op, i, lower in ops:
        key = PIECES[i].key
        if op == "store":
            ev.observe(0, True, key)
            ev.observe(lower, True, key)
            copies |= {(i, 0), (i, lower)}
        elif op == "evict":
            ev.observe(0, False, key)
            copies.discard((i, 0))
        elif op in ("expire", "collect"):
            ev.observe(lower, False, key)
            copies.discard((i, lower))
        _replay(state, ev.take())
        assert state <= _truth(copies)
        still = {(j, t) for j, t in copies  # the copies still claimed (not capped)
                 if ev.held.get(PIECES[j].key, b"\0")[0] & (1 << t)}
        assert state == _truth(still)
