"""Turn a validated ``KVTierConfig`` into live tiers and a ``TieredStore``.

The only place that maps config types to tier classes (by type, never by name string).
Every resource is checked here, at start: pool memory, directory writability, bucket
reachability. A failure raises ``TierError`` naming the config field to change.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import wait
from functools import partial

from kvtier.clock import SYSTEM_CLOCK, Clock
from kvtier.config import FileConfig, HostConfig, KVTierConfig, S3Config
from kvtier.crypt import ChunkCipher
from kvtier.health import breakers_for
from kvtier.iopool import IOPool
from kvtier.store import LowerTier, TieredStore, WritePolicy
from kvtier.tiers.base import SharedTier, TierError
from kvtier.tiers.file import FileTier
from kvtier.tiers.host import HostTier
from kvtier.tiers.late import LateTier, open_in_background
from kvtier.tiers.objtier import TICK_OBJECTS
from kvtier.tiers.pool import PINNED_UNAVAILABLE, Allocator, mmap_allocator
from kvtier.tiers.walk import TickBudget


def build_host(cfg: HostConfig, slot_bytes: int) -> HostTier:
    """The host tier; ``pinned: yes`` fails here if the pool could not be page-locked."""
    allocator: Allocator | None = mmap_allocator if cfg.pinned == "no" else None
    host = HostTier(cfg.capacity, slot_bytes, allocator=allocator)
    if cfg.pinned == "yes" and not host.pool.pinned:
        host.close()
        raise TierError(PINNED_UNAVAILABLE)
    return host


def build_lower(spec: FileConfig | S3Config, index: int, clock: Clock) -> SharedTier:
    setting = f"tiers[{index}]"
    if isinstance(spec, FileConfig):
        return FileTier(
            spec.path,
            spec.capacity,
            name=f"file{index}",
            fsync=spec.fsync,
            touch_interval=spec.touch_interval,
            mode=spec.mode,
            temp_grace=spec.temp_grace_seconds,
            clock=clock,
            background_index=spec.index == "background",
            scan_rate=spec.index_objects_per_second,
            index_threads=spec.index_threads,
            tick=TickBudget(TICK_OBJECTS, spec.walk_tick_seconds),
            setting=f"{setting}.file",
        )
    from kvtier.tiers.s3 import S3Tier  # boto3 is imported only when S3 is configured

    tier: SharedTier = S3Tier(
        bucket=spec.bucket,
        prefix=spec.prefix,
        endpoint_url=spec.endpoint_url,
        region=spec.region,
        path_style=spec.path_style,
        capacity_bytes=spec.capacity,
        multipart_threshold=spec.multipart_threshold,
        part_size=spec.part_size,
        max_concurrency=spec.max_concurrency,
        max_attempts=spec.max_attempts,
        connect_timeout=spec.connect_timeout,
        read_timeout=spec.read_timeout,
        touch_interval=spec.touch_interval,
        conditionals=spec.conditionals,
        clock=clock,
        background_index=spec.index == "background",
        scan_rate=spec.index_objects_per_second,
        tick=TickBudget(TICK_OBJECTS, spec.walk_tick_seconds),
        name=f"s3{index}",
        setting=f"{setting}.s3",
    )
    return tier


def cipher_of(cfg: KVTierConfig) -> ChunkCipher | None:
    """``encryption``'s cipher, or None when it is off. Raises ``crypt.KeyError_``."""
    if not cfg.encryption.enabled:
        return None
    from kvtier.crypt import load_master_keys

    return ChunkCipher(load_master_keys(cfg.encryption.key_file))


def _sealed(opener: Callable[[FileConfig | S3Config, int, Clock], SharedTier],
            cipher: ChunkCipher | None, spec: FileConfig | S3Config, index: int,
            clock: Clock) -> SharedTier:
    """``opener``'s tier, sealing with ``cipher`` (set before any call reaches it)."""
    tier = opener(spec, index, clock)
    if cipher is not None:
        setattr(tier, "cipher", cipher)  # noqa: B010 - every ObjectTier has it
    return tier


def build_lower_tiers(
    cfg: KVTierConfig, clock: Clock = SYSTEM_CLOCK, *, only: int | None = None
) -> list[LowerTier]:
    """The persistent tiers ``tiers[1:]`` (or just ``tiers[only]``), each with its policy.

    If one cannot be set up, those already built are closed before the error propagates.
    """
    lower: list[LowerTier] = []
    cipher = cipher_of(cfg)
    try:
        for i, entry in enumerate(cfg.tiers[1:], start=1):
            if only is not None and i != only:
                continue
            spec = entry.spec
            assert isinstance(spec, FileConfig | S3Config)
            lower.append(LowerTier(_sealed(build_lower, cipher, spec, i, clock),
                                   WritePolicy(spec.write)))
    except BaseException:
        for lt in lower:
            lt.tier.close()
        raise
    return lower


#: How long an engine start waits for a lower tier to open (mkdir, a probe write, a
#: listing; S3 also probes which conditional requests its endpoint honours, several round
#: trips) before it starts without it: long enough for a healthy NFS mount or S3 endpoint
#: on a busy node, short against an engine start (tens of seconds).
OPEN_BOUND_S = 10.0


def _where(spec: FileConfig | S3Config) -> str:
    if isinstance(spec, FileConfig):
        return str(spec.path)
    return f"s3://{spec.bucket}/{spec.prefix} at {spec.endpoint_url or 'AWS'}"


def open_lower_tiers(
    cfg: KVTierConfig, clock: Clock, bound_s: float | None,
    open_tier: Callable[[FileConfig | S3Config, int, Clock], SharedTier] | None = None,
) -> tuple[list[LowerTier], list[str]]:
    """The persistent tiers, each opened on a thread of its own, all at once; returns
    them and the names of those that did not answer within ``bound_s`` seconds (None:
    wait for every one, as tools do).

    Start is never held by storage (issue 32): a tier whose opening has not returned by
    then (a hung NFS mount, a frozen endpoint) is a ``LateTier`` standing in for it until
    it answers. A tier whose opening *fails* within the bound (a wrong path, missing
    permissions) fails the start, as before, naming the config field; those built are
    closed first. ``open_tier`` replaces ``build_lower`` (tests inject a hanging one)."""
    opener = partial(_sealed, open_tier or build_lower, cipher_of(cfg))
    specs: list[tuple[int, FileConfig | S3Config, str]] = []
    for i, entry in enumerate(cfg.tiers[1:], start=1):
        spec = entry.spec
        assert isinstance(spec, FileConfig | S3Config)
        specs.append((i, spec, f"{'file' if isinstance(spec, FileConfig) else 's3'}{i}"))
    opening = [open_in_background(partial(opener, spec, i, clock), name)
               for i, spec, name in specs]
    wait(opening, timeout=bound_s)
    lower: list[LowerTier] = []
    late: list[str] = []
    failed: BaseException | None = None
    for fut, (_, spec, name) in zip(opening, specs, strict=True):
        write = WritePolicy(spec.write)
        if not fut.done():
            lower.append(LowerTier(LateTier(name, fut, _where(spec)), write))
            late.append(name)
        elif fut.exception() is not None:
            failed = failed or fut.exception()
        else:
            lower.append(LowerTier(fut.result(), write))
    if failed is not None:
        for lt in lower:
            lt.tier.close()
        raise failed
    return lower, late


def build_store(
    cfg: KVTierConfig,
    slot_bytes: int,
    *,
    clock: Clock = SYSTEM_CLOCK,
    host: HostTier | None = None,
    open_tier: Callable[[FileConfig | S3Config, int, Clock], SharedTier] | None = None,
    open_bound_s: float | None = OPEN_BOUND_S,
) -> TieredStore:
    """All tiers of ``cfg`` with host slots of ``slot_bytes`` (one chunk each).

    ``host`` replaces the host tier ``cfg`` describes, e.g. one mapped onto memory that
    another process allocated. A lower tier that does not open within ``open_bound_s``
    starts down and joins when it answers (``open_lower_tiers``): the engine's start
    never waits on storage (None: wait, for tools such as ``kvtier check``).
    """
    host = host or build_host(cfg.host, slot_bytes)
    lower, late = open_lower_tiers(cfg, clock, open_bound_s, open_tier)
    # One pool per lower tier (its own threads and store queue): a hung tier holds only
    # its own, and never delays another tier's loads or writes.
    pools = [IOPool(cfg.io.threads, cfg.io.max_queued_stores, name=f"io-{lt.tier.name}")
             for lt in lower] or [IOPool(cfg.io.threads, cfg.io.max_queued_stores)]
    breakers = breakers_for([lt.tier.name for lt in lower], cfg.health, cfg.io.threads, clock)
    for lt, breaker in zip(lower, breakers, strict=True):
        if lt.tier.name in late:
            assert isinstance(lt.tier, LateTier)
            breaker.start_down(
                f"opening {lt.tier.where} did not answer within "
                f"{open_bound_s:g} s at start; serving without it until it does")
    return TieredStore(host, lower, pools[0], breakers=breakers,
                       tier_io=pools if lower else None)
