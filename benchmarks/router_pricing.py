"""How well the router prices what the shared tier holds while engines collect (issue 44).

Fake engines write ``--conversations`` chains of ``--chunks`` chunks each to a file tier
(real kvtier objects, keyed as engines key them). The router's view of that tier
(``RouterTiers``' kind: a ``FileTier`` of its own, behind a breaker) prices every chain
once, so its index knows them all. Then another node's collector removes chunks the way
leases and LRU do: the whole chain for ``--whole`` of the conversations, a tail of
random length for ``--tails`` of them, one chunk strictly inside for ``--holes`` (rare in
practice: a restore reads and so renews a whole prefix at once). Every conversation is
then priced again, three ways:

* ``index``: what the router's index claims (the pricing before issue 44);
* ``confirmed``: ``HeldLookup`` now (the chain's ends checked in the store);
* ``after shortfall``: ``confirmed`` with the identity distrusted (every chunk checked),
  as after a decode node restored less than priced.

Precision is the tokens priced that are really restorable (the stored prefix from the
chain's head) over the tokens priced: under 1, the router sent turns decode-only that
the decode node then recomputed. Also the lookups' p50 and p99 and store lookups per
turn. Prints a table and one ratio per way; writes JSON. Exits 1 if the pricing after a
shortfall misses the target (95 %): that is what the decode node sees from the second
turn after a collection on.

    python -m benchmarks.router_pricing --conversations 400 --chunks 12
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.machine import describe
from kvtier.clock import ManualClock
from kvtier.router.prefix import HeldLookup, Probe, PromptKeys, keys_under
from kvtier.router.storage import guarded
from kvtier.tiers.file import FileTier
from tests.tiers.harness import meta_for, payload_for

CT = 16
TARGET = 0.95


def _chains(n: int, chunks: int, rng: random.Random) -> list[PromptKeys]:
    digest = bytes(16)
    out = []
    for _ in range(n):
        ids = [rng.randrange(1, 50_000) for _ in range(chunks * CT + 1)]
        out.append(keys_under(digest, CT, CT, ids))
    return out


def _stored_prefix(pk: PromptKeys, tier: FileTier) -> int:
    for i, key in enumerate(pk.keys):
        if not tier.present(key):
            return i
    return len(pk.keys)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--conversations", type=int, default=400)
    ap.add_argument("--chunks", type=int, default=12, help="chunks per conversation")
    ap.add_argument("--whole", type=float, default=0.3, help="share collected whole")
    ap.add_argument("--tails", type=float, default=0.3, help="share cut in half")
    ap.add_argument("--holes", type=float, default=0.1, help="share with a middle hole")
    ap.add_argument("--payload", type=int, default=4096, help="bytes per chunk object")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" /
                                         "router_pricing.json"))
    args = ap.parse_args(argv)
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        engine = FileTier(Path(tmp) / "store", 1 << 40)
        chains = _chains(args.conversations, args.chunks, rng)
        for pk in chains:
            for i, key in enumerate(pk.keys):
                meta = dataclasses.replace(meta_for(key, args.payload),
                                           parent=pk.keys[i - 1] if i else None)
                engine.put(meta, payload_for(key, args.payload).data)
        router_view = FileTier(Path(tmp) / "store", 1 << 40)
        router_view.wait_indexed(60)
        lookup = HeldLookup(guarded([router_view], ManualClock()))
        for pk in chains:  # the router has priced every chain: its index knows them
            assert lookup.index_prefix(pk) == len(pk.keys)
        order = list(range(len(chains)))
        rng.shuffle(order)
        cut = {"whole": int(args.whole * len(order)), "tails": int(args.tails * len(order)),
               "holes": int(args.holes * len(order))}
        at = 0
        for how, n in cut.items():
            for c in order[at: at + n]:
                keys = chains[c].keys
                hole = rng.randrange(1, len(keys) - 1)  # neither end: the ends do not show it
                gone = {"whole": keys, "tails": keys[rng.randrange(1, len(keys)):],
                        "holes": [keys[hole]]}[how]
                engine.delete(gone)  # another node's collector: the router is not told
            at += n
        truth = [_stored_prefix(pk, engine) for pk in chains]
        rows: list[dict[str, Any]] = []
        for way in ("index", "confirmed", "after shortfall"):
            priced, good, heads, lat = 0, 0, [], []
            for pk, real in zip(chains, truth, strict=True):
                t0 = time.perf_counter()
                if way == "index":
                    got = lookup.index_prefix(pk)
                    n_heads = 0
                else:
                    probe = Probe(0 if way == "after shortfall" else lookup.index_prefix(pk),
                                  distrusted=way == "after shortfall")
                    lookup.probe(pk, probe, threading.Event())
                    got, n_heads = probe.chunks, probe.heads
                lat.append(time.perf_counter() - t0)
                priced += got
                good += min(got, real)
                heads.append(n_heads)
            precision = good / priced if priced else 1.0
            lat.sort()
            rows.append({"way": way, "precision": round(precision, 4),
                         "priced_chunks": priced, "restorable_chunks": good,
                         "held_chunks": sum(truth),
                         "lookups_per_turn": round(statistics.mean(heads), 2),
                         "p50_ms": round(lat[len(lat) // 2] * 1e3, 3),
                         "p99_ms": round(lat[int(len(lat) * 0.99) - 1] * 1e3, 3)})
        engine.close()
        router_view.close()
    print(f"{'pricing':<16} {'precision':>9} {'priced':>7} {'held':>6} {'lookups':>8} "
          f"{'p50 ms':>7} {'p99 ms':>7}")
    for r in rows:
        ok = "ok" if r["precision"] >= TARGET else "MISS"
        print(f"{r['way']:<16} {r['precision']:9.3f} {r['priced_chunks']:7d} "
              f"{r['held_chunks']:6d} {r['lookups_per_turn']:8.2f} {r['p50_ms']:7.3f} "
              f"{r['p99_ms']:7.3f}  >= {TARGET} {ok}")
    out = {"benchmark": "router_pricing", "machine": describe(), "args": vars(args),
           "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.out}")
    final = next(r for r in rows if r["way"] == "after shortfall")
    return 0 if final["precision"] >= TARGET else 1


if __name__ == "__main__":
    sys.exit(main())
