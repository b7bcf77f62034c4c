"""Sliding-window models: which blocks a hit needs, and how they are stored.

A model whose layers all attend to the last ``W`` tokens (one ``SlidingWindowSpec``
KV-cache group) keeps, for a request that has computed ``c`` tokens, only the blocks
from ``(c - W + 1 - extra) // B`` on (``extra``: vLLM's ``extra_retained_tokens``); the
blocks before are swapped for vLLM's null block (block 0) as the request runs, so by the
time it finishes most of its prefix is gone. A hit of ``L`` tokens (``L`` a multiple of
``B``) needs only the ``cdiv(W - 1 + extra, B)`` blocks before ``L`` (``Geometry.
window_blocks``): vLLM pads the ones before with its null block and never reads them.

So a sliding-window model stores no chunks. Each save stores one *window object* for
the prefix it ends (``L``: the request's computed tokens down to a block): the window's
blocks, in parts of at most ``blocks_per_chunk`` blocks (``window_parts``), each a
host slot and one object per tier, keyed by the key of the chunk or tail that ends at
``L`` (``keys.window_key``). A returning request looks for the longest such ``L`` past
vLLM's own hit and restores ``L`` tokens by copying only the window. Pure functions;
any thread.
"""

from __future__ import annotations


def window_parts(end_block: int, window_blocks: int,
                 blocks_per_chunk: int) -> list[tuple[int, int]]:
    """The parts of the window ending at block ``end_block`` (exclusive), as (first
    block, blocks): from ``max(0, end_block - window_blocks)`` up, ``blocks_per_chunk``
    at a time (the last part may be shorter)."""
    if end_block <= 0 or window_blocks <= 0 or blocks_per_chunk <= 0:
        raise ValueError("a window ends after block 0 and has blocks")
    lo = max(0, end_block - window_blocks)
    return [(b, min(blocks_per_chunk, end_block - b))
            for b in range(lo, end_block, blocks_per_chunk)]


def saveable(block_ids: list[int], parts: list[tuple[int, int]], null_block: int = 0) -> bool:
    """Whether every block of ``parts`` is still allocated (not vLLM's null block). Not so
    in one corner: a request that ended one token short of a block boundary has had
    the first block of the window at its last full block freed already."""
    return all(len(block_ids) >= b + n and null_block not in block_ids[b : b + n]
               for b, n in parts)
