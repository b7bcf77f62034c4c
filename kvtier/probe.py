"""Probe one tier: write objects, time reading them back, delete them.

``probe_tier`` measures what ``kvtier.costmodel`` needs to seed a tier's read estimate:
a per-read ``latency`` and a ``bandwidth``, from the median read times of objects of two
sizes (``latency + nbytes / bandwidth`` through both points), and the put and get rates
of the full-size objects that ``kvtier check`` prints.

Invariants:

* Probe objects carry the ``kvtier-probe`` namespace and fresh random keys (128 bits,
  never a real chunk's key), and are written with ``WriteMode.CREATE``.
* Every key the probe tried to write is deleted on every exit path, even when a write,
  a read or the verification fails, and even if deleting one key fails: a probe never
  leaves objects behind.
* Bytes read back are compared with those written; a miss or a mismatch raises
  ``ProbeFailed`` naming the tier.

Threads: it blocks on the tier's I/O, so run it at start (``kvtier check``, engine start)
or on an IO thread, never on vLLM's scheduler thread. Files read back right after they
were written may come from the page cache; pass ``before_reads`` to drop it.
"""

from __future__ import annotations

import secrets
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from kvtier.keys import ChunkKey
from kvtier.objformat import ChunkMeta
from kvtier.tiers.base import PutStatus, Tier, WriteMode

PROBE_NAMESPACE = b"kvtier-probe".ljust(16, b"\0")
#: Size of the small probe objects (the latency point), capped at a quarter of the payload.
SMALL_PROBE_BYTES = 4096


class ProbeFailed(Exception):
    """The tier did not give back what the probe wrote. The message names the tier."""


@dataclass(frozen=True)
class ProbeResult:
    tier: str
    latency_s: float  # per read, independent of size
    bandwidth_Bps: float  # bytes per second past the latency
    put_Bps: float  # full-size objects, whole write path
    get_Bps: float  # full-size objects, whole read path

    def read_seconds(self, nbytes: int) -> float:
        return self.latency_s + nbytes / self.bandwidth_Bps


def probe_meta(key: ChunkKey, nbytes: int) -> ChunkMeta:
    return ChunkMeta(PROBE_NAMESPACE, key, None, 0, "uint8", (nbytes,), nbytes)


def probe_tier(
    tier: Tier,
    payload_len: int,
    n: int,
    *,
    before_reads: Callable[[Sequence[ChunkKey]], None] | None = None,
    timer: Callable[[], float] = time.perf_counter,
) -> ProbeResult:
    """Write ``n`` objects of ``payload_len`` bytes and ``n`` small ones, read each back
    (timed), delete them all. ``before_reads`` runs untimed before the reads."""
    if payload_len <= 0 or n <= 0:
        raise ValueError(f"probe needs payload_len > 0 and n > 0, got {payload_len}, {n}")
    small = min(SMALL_PROBE_BYTES, payload_len // 4)
    sizes = [payload_len, small] if small > 0 else [payload_len]
    rng = np.random.default_rng()
    plan = [(ChunkKey(secrets.token_bytes(16)), rng.integers(0, 256, size, dtype=np.uint8))
            for size in sizes for _ in range(n)]
    tried: list[ChunkKey] = []
    try:
        put_s = _write(tier, plan, tried, timer)[:n]
        if before_reads is not None:
            before_reads([key for key, _ in plan])
        get_s = _read(tier, plan, payload_len, timer)
    finally:
        _delete_each(tier, tried)
    big_t = statistics.median(get_s[:n])
    latency, bandwidth = 0.0, payload_len / max(big_t, 1e-9)
    if small > 0:
        small_t = statistics.median(get_s[n:])
        if big_t > small_t:
            bandwidth = (payload_len - small) / (big_t - small_t)
            latency = max(0.0, small_t - small / bandwidth)
    total = payload_len * n
    return ProbeResult(tier.name, latency, bandwidth, total / max(sum(put_s), 1e-9),
                       total / max(sum(get_s[:n]), 1e-9))


def _write(
    tier: Tier, plan: list[tuple[ChunkKey, np.ndarray]], tried: list[ChunkKey],
    timer: Callable[[], float],
) -> list[float]:
    out = []
    for key, payload in plan:
        tried.append(key)
        t0 = timer()
        status = tier.put(probe_meta(key, len(payload)), payload.data, WriteMode.CREATE)
        out.append(timer() - t0)
        if status is not PutStatus.STORED:
            raise ProbeFailed(f"{tier.name}: probe write returned {status.value}")
    return out


def _read(
    tier: Tier, plan: list[tuple[ChunkKey, np.ndarray]], payload_len: int,
    timer: Callable[[], float],
) -> list[float]:
    buf = np.empty(payload_len, dtype=np.uint8)
    out = []
    for key, payload in plan:
        t0 = timer()
        meta = tier.get_into(key, buf.data)
        out.append(timer() - t0)
        if meta is None or not np.array_equal(buf[: len(payload)], payload):
            raise ProbeFailed(f"{tier.name}: probe object read back wrong or missing")
    return out


def _delete_each(tier: Tier, keys: list[ChunkKey]) -> None:
    """Delete every key, one at a time so one failure does not strand the rest."""
    error: BaseException | None = None
    for key in keys:
        try:
            tier.delete([key])
        except Exception as e:
            error = error or e
    if error is not None:
        raise error
