"""The ``kvtier`` command: check the install, check a config, inspect and collect tiers.

Exit codes: 0 success; 1 a check failed (data mismatch); 2 bad usage or invalid config;
3 a resource is unusable (memory, directory, bucket).
"""

from __future__ import annotations

import argparse
import logging
import secrets
import sys
import time
from collections.abc import Sequence
from datetime import UTC, datetime

import numpy as np

from kvtier import doctor, router
from kvtier.build import build_lower_tiers, build_store
from kvtier.clock import SYSTEM_CLOCK
from kvtier.config import ConfigError, KVTierConfig, S3Config, load_config
from kvtier.keys import ChunkKey
from kvtier.objformat import ChunkMeta
from kvtier.sizes import format_size, parse_size
from kvtier.tiers.base import PutStatus, SharedTier, Tier, TierError
from kvtier.tiers.file import FileTier
from kvtier.tiers.objtier import ObjectTier

EXIT_OK, EXIT_CHECK_FAILED, EXIT_USAGE, EXIT_RESOURCE = 0, 1, 2, 3


class CheckFailed(Exception):
    pass


def _probe_meta(key: ChunkKey, n: int) -> ChunkMeta:
    return ChunkMeta(b"kvtier-check".ljust(16, b"\0"), key, None, 0, "uint8", (n,), n)


def _probe_tier(tier: Tier, chunk: int, count: int) -> tuple[float, float]:
    """Write, read back and delete ``count`` probe objects, in batches of at most half
    what the tier holds (a small host pool evicted its own first probes before they were
    read back, and a valid config failed the check; issue 32). Returns (put, get) bytes/s."""
    rng = np.random.default_rng()
    fits = tier.usage().capacity // (2 * max(chunk, 1))
    batch = max(1, min(count, fits))
    put_s = get_s = 0.0
    buf = np.empty(chunk, dtype=np.uint8)
    for start in range(0, count, batch):
        n = min(batch, count - start)
        payloads = [rng.integers(0, 256, chunk, dtype=np.uint8) for _ in range(n)]
        keys = [ChunkKey(secrets.token_bytes(16)) for _ in range(n)]
        try:
            t0 = time.perf_counter()
            for key, p in zip(keys, payloads, strict=True):
                status = tier.put(_probe_meta(key, chunk), p.data)
                if status is not PutStatus.STORED:
                    raise CheckFailed(f"{tier.name}: probe write returned {status.value}")
            t1 = time.perf_counter()
            for key, p in zip(keys, payloads, strict=True):
                if tier.get_into(key, buf.data) is None or not np.array_equal(buf, p):
                    raise CheckFailed(f"{tier.name}: probe read back wrong or missing")
            t2 = time.perf_counter()
        finally:
            tier.delete(keys)
        put_s, get_s = put_s + t1 - t0, get_s + t2 - t1
    total = chunk * count
    return total / max(put_s, 1e-9), total / max(get_s, 1e-9)


def _print_conditionals(cfg: KVTierConfig, tiers: Sequence[Tier]) -> None:
    """Per S3 tier: which conditional requests its endpoint honours (probed at start)."""
    if not any(isinstance(t.spec, S3Config) for t in cfg.tiers):
        return
    from kvtier.tiers.s3 import S3Tier  # boto3 is imported only when S3 is configured

    for tier in tiers:
        if isinstance(tier, S3Tier):
            print(f"{tier.name}: {tier.conditionals.summary()}")


def cmd_check(cfg: KVTierConfig, args: argparse.Namespace) -> int:
    chunk = parse_size(args.chunk_size)
    store = build_store(cfg, chunk, open_bound_s=None)  # a tool: wait for the answer
    try:
        print(f"config ok: {len(cfg.tiers)} tiers, chunk_tokens={cfg.chunk_tokens}")
        print(f"{'tier':<10} {'kind':<6} {'capacity':>10} {'put GB/s':>9} {'get GB/s':>9}")
        for tier in store.tiers:
            put_bw, get_bw = _probe_tier(tier, chunk, args.count)
            cap = format_size(tier.usage().capacity)
            kind = type(tier).__name__.removesuffix("Tier").lower()
            print(f"{tier.name:<10} {kind:<6} {cap:>10} {put_bw / 1e9:>9.2f} {get_bw / 1e9:>9.2f}")
        _print_conditionals(cfg, store.tiers)
    finally:
        store.close()
    print("check passed")
    return EXIT_OK


def _lower_tiers(cfg: KVTierConfig, only: int | None) -> list[SharedTier]:
    """The persistent tiers, each with its whole index (the tools wait for the scan)."""
    out = [lt.tier for lt in build_lower_tiers(cfg, SYSTEM_CLOCK, only=only)]
    for tier in out:
        if isinstance(tier, ObjectTier):
            tier.wait_indexed()
    if only is not None and not out:
        raise ConfigError(f"--tier {only}: no such persistent tier (tiers[1..] only)")
    return out


def cmd_ls(cfg: KVTierConfig, args: argparse.Namespace) -> int:
    for tier in _lower_tiers(cfg, args.tier):
        for info in sorted(tier.scan(), key=lambda o: o.last_used):
            when = datetime.fromtimestamp(info.last_used, UTC).isoformat(timespec="seconds")
            print(f"{tier.name}\t{info.key.hex()}\t{info.size}\t{when}")
    return EXIT_OK


def cmd_stats(cfg: KVTierConfig, args: argparse.Namespace) -> int:
    print(f"{'tier':<10} {'objects':>9} {'used':>10} {'capacity':>10} {'use%':>6}")
    for tier in _lower_tiers(cfg, args.tier):
        u = tier.usage()
        pct = 100 * u.bytes / u.capacity if u.capacity else 0.0
        print(f"{tier.name:<10} {u.objects:>9} {format_size(u.bytes):>10} "
              f"{format_size(u.capacity):>10} {pct:>6.1f}")
    return EXIT_OK


def cmd_gc(cfg: KVTierConfig, args: argparse.Namespace) -> int:
    lease = cfg.retention.lease_seconds
    for tier in _lower_tiers(cfg, args.tier):
        expired = 0
        if args.expired:  # a whole pass, not one heartbeat's tick
            expired = tier.expire(lease, whole_pass=True) if isinstance(tier, ObjectTier) \
                else tier.expire(lease)
        freed = tier.collect()
        # Opening the tier scanned it and removed temp files past file.temp_grace_seconds.
        temps = tier.deleted_temps if isinstance(tier, FileTier) else 0
        u = tier.usage()
        print(f"{tier.name}: freed {format_size(freed)}, removed {temps} stale temp files"
              + (f" and {expired} objects past their {lease:.0f} s lease" if args.expired else "")
              + f"; now {u.objects} objects, {format_size(u.bytes)} of {format_size(u.capacity)}")
    return EXIT_OK


#: Objects deleted per call while purging (bounds what one call holds in memory).
PURGE_BATCH = 1000


def _namespaces(values: Sequence[str]) -> set[bytes]:
    out = set()
    for v in values:
        try:
            digest = bytes.fromhex(v)
        except ValueError:
            digest = b""
        if not digest:
            raise ValueError(f"--namespace {v!r}: not a hex digest (the 'namespace' an engine "
                             "returns in kv_transfer_params, or `kvtier ls --namespaces`)")
        out.add(digest)
    return out


def cmd_purge(cfg: KVTierConfig, args: argparse.Namespace) -> int:
    """Remove every object of the given namespaces (a tenant's salt, a model, an adapter
    or a weights epoch each make their own) from the persistent tiers; a dry run unless
    ``--yes``. Safe while engines run: a read of a purged object misses and recomputes.
    Headers are read one at a time and deletes go in batches of ``PURGE_BATCH``."""
    wanted = _namespaces(args.namespace)
    for tier in _lower_tiers(cfg, args.tier):
        matched = removed = nbytes = 0
        batch: list[ChunkKey] = []
        for info in list(tier.scan()):
            meta = tier.read_meta(info.key)
            if meta is None or meta.namespace not in wanted:
                continue
            matched += 1
            nbytes += info.size
            if args.yes:
                batch.append(info.key)
                if len(batch) >= PURGE_BATCH:
                    removed += tier.delete(batch)
                    batch.clear()
        if batch:
            removed += tier.delete(batch)
        what = (f"removed {removed}" if args.yes
                else "dry run: rerun with --yes to remove them")
        print(f"{tier.name}: {matched} objects ({format_size(nbytes)}) of "
              f"{len(wanted)} namespace(s); {what}")
    return EXIT_OK


def cmd_namespaces(cfg: KVTierConfig, args: argparse.Namespace) -> int:
    """Each namespace the persistent tiers hold, with its object count and bytes."""
    for tier in _lower_tiers(cfg, args.tier):
        counts: dict[bytes, list[int]] = {}
        for info in list(tier.scan()):
            meta = tier.read_meta(info.key)
            if meta is not None:
                c = counts.setdefault(meta.namespace, [0, 0])
                c[0] += 1
                c[1] += info.size
        for ns, (n, size) in sorted(counts.items(), key=lambda kv: -kv[1][1]):
            print(f"{tier.name}\t{ns.hex()}\t{n}\t{size}")
    return EXIT_OK


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvtier", description=__doc__)
    p.add_argument("-v", "--verbose", action="store_true")
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser("check", help="validate a config and probe every tier")
    c.add_argument("config")
    c.add_argument("--chunk-size", default="4MiB", help="probe object size (default 4MiB)")
    c.add_argument("--count", type=int, default=16, help="probe objects per tier")
    c.set_defaults(fn=cmd_check)
    for name, fn, help_ in (
        ("ls", cmd_ls, "list the objects of the persistent tiers"),
        ("stats", cmd_stats, "summarise the persistent tiers"),
        ("gc", cmd_gc, "enforce capacity on the persistent (shared) tiers"),
        ("namespaces", cmd_namespaces, "list the namespaces the persistent tiers hold, "
         "with objects and bytes (reads every object's header)"),
        ("purge", cmd_purge, "remove every object of some namespaces from the persistent "
         "tiers (dry run unless --yes)"),
    ):
        s = sub.add_parser(name, help=help_)
        s.add_argument("config")
        s.add_argument("--tier", type=int, default=None, help="only tiers[N]")
        if name == "gc":
            s.add_argument("--expired", action="store_true",
                           help="also remove objects past retention.lease_seconds")
        if name == "purge":
            s.add_argument("--namespace", action="append", required=True, metavar="HEX",
                           help="a namespace digest (repeatable): the 'namespace' engines "
                           "return in kv_transfer_params, or one `kvtier namespaces` lists")
            s.add_argument("--yes", action="store_true", help="remove (default: dry run)")
        s.set_defaults(fn=fn)
    d = sub.add_parser("doctor", help="check this environment: Python, vLLM, torch, CUDA, "
                       "kvtier._C, pinned memory, /dev/shm (exit 1 if something is missing)")
    doctor.add_arguments(d)
    r = sub.add_parser("router", help="proxy OpenAI requests to prefill and decode vLLM servers")
    router.add_arguments(r)  # no positional config: the router's --tiers is optional
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        if args.command == "router":
            return router.serve(args)
        if args.command == "doctor":
            return doctor.run(args)
        cfg = load_config(args.config)
        rc: int = args.fn(cfg, args)
        return rc
    except ConfigError as e:
        print(f"kvtier: {e}", file=sys.stderr)
        return EXIT_USAGE
    except ValueError as e:
        print(f"kvtier: {e}", file=sys.stderr)
        return EXIT_USAGE
    except TierError as e:
        print(f"kvtier: {e}", file=sys.stderr)
        return EXIT_RESOURCE
    except CheckFailed as e:
        print(f"kvtier: check failed: {e}", file=sys.stderr)
        return EXIT_CHECK_FAILED


if __name__ == "__main__":
    sys.exit(main())
