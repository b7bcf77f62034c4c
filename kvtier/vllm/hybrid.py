"""Hybrid models: which objects hold a prefix when KV-cache groups differ.

With vLLM's hybrid KV-cache manager on (kvtier declares ``SupportsHMA``), a model that
mixes full-attention and sliding-window layers (Gemma-2/3, gpt-oss, Cohere2) has
several KV-cache groups, each with its own block table: the full-attention groups keep
every block of a request, the sliding-window groups only the blocks of its last ``W``
tokens, the chunked-local groups only those of its current attention chunk (the others
become vLLM's null block as it runs; ``window.py``). "Window" below means either.

So each group is stored as objects of its own, keyed ``keys.group_key(piece key,
group)``. A prefix of ``L`` tokens (``L`` a multiple of the block size) is held by:

* per full-attention group, every chunk below ``L`` and, when ``L`` ends inside a chunk,
  that chunk's tail of ``L``'s blocks (the chunk and tail keys of the single-group path);
* per sliding-window group, the window of ``L``: its last ``cdiv(W - 1, B)`` blocks, in
  parts of at most a chunk (``window.window_parts``), keyed from the key of the chunk or
  tail that ends at ``L`` (``keys.window_key``);
* per chunked-local group (Llama-4's RoPE layers, attention chunk ``A``), likewise the
  blocks from ``L // A * A`` to ``L``: the attention chunk the next token attends within
  (none when ``L`` is a multiple of ``A``). Below it vLLM holds its null block.

A request that finishes stores all of them for the prefix it ends (chunks another request
stored already are not stored again; windows are per end point). A returning request's
hit is the longest such end whose pieces are all stored; it restores the full groups'
chunks past vLLM's own hit and the window groups' window, nothing else.

Every piece is one host slot and one object per tier; a group's piece has that group's
layers only. The pieces of one prefix chain through their headers in one order (chunk
after chunk, each chunk's groups in order, then the tail's, then the windows), so a lease
renewal from the last piece walks the whole prefix. Pure functions; any thread.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvtier.keys import ChunkKey, group_key, window_key
from kvtier.vllm.geometry import Geometry
from kvtier.vllm.window import window_parts


@dataclass(frozen=True)
class Piece:
    """One object of a hybrid prefix: ``blocks`` blocks of group ``group`` from block
    ``first`` (absolute, in the request's block table of that group). ``span`` is 0 for
    a whole chunk, else ``blocks`` (a tail or a short window part, packed at the slot's
    start); ``parent`` the key of the piece before it in the prefix's chain."""

    group: int
    first: int
    blocks: int
    key: ChunkKey
    span: int
    parent: ChunkKey | None


def full_groups(geom: Geometry) -> list[int]:
    return [g for g, shape in enumerate(geom.groups) if not shape.local]


def local_groups(geom: Geometry) -> list[int]:
    """The sliding-window and chunked-local groups: each keeps a local part."""
    return [g for g, shape in enumerate(geom.groups) if shape.local]


def prefix_pieces(geom: Geometry, bpc: int, chunk_keys: Sequence[ChunkKey],
                  tail: tuple[int, ChunkKey] | None, start_chunk: int = 0) -> list[Piece]:
    """The pieces of the prefix of ``len(chunk_keys)`` whole chunks plus, if ``tail``
    is ``(blocks, key)``, that many blocks of the next chunk, in chain order (parents
    set), less the whole chunks before ``start_chunk``. The prefix must be non-empty."""
    n = len(chunk_keys)
    full = full_groups(geom)
    out: list[Piece] = []
    start_chunk = min(start_chunk, n)
    prev: ChunkKey | None = (group_key(chunk_keys[start_chunk - 1], full[-1])
                             if start_chunk and full else None)

    def add(group: int, first: int, blocks: int, key: ChunkKey, span: int) -> None:
        nonlocal prev
        out.append(Piece(group, first, blocks, key, span, prev))
        prev = key

    for c in range(start_chunk, n):
        key = chunk_keys[c]
        for g in full:
            add(g, c * bpc, bpc, group_key(key, g), 0)
    if tail is not None:
        blocks, key = tail
        for g in full:
            add(g, n * bpc, blocks, group_key(key, g), blocks)
    end_key = tail[1] if tail is not None else chunk_keys[-1]
    end_block = n * bpc + (tail[0] if tail is not None else 0)
    for g in local_groups(geom):
        nb = geom.local_blocks(g, end_block)
        parts = window_parts(end_block, nb, bpc) if nb else []  # none: on a chunk boundary
        for i, (first, blocks) in enumerate(parts):
            add(g, first, blocks, group_key(window_key(end_key, i, len(parts)), g),
                blocks if blocks < bpc else 0)
    return out


def saveable_groups(geom: Geometry, block_ids: Sequence[Sequence[int]], pieces: Sequence[Piece],
                    null_block: int = 0) -> bool:
    """Whether every block of ``pieces`` is still allocated in its group (not vLLM's null
    block: a sliding-window group frees the first block of the window in one corner,
    ``window.saveable``)."""
    for p in pieces:
        ids = block_ids[p.group] if p.group < len(block_ids) else ()
        if len(ids) < p.first + p.blocks or null_block in ids[p.first : p.first + p.blocks]:
            return False
    return True
