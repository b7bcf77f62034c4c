"""A filesystem tier that hangs mid-read never leaves a request unanswered (issue 18).

``benchmarks/stall.py --hang cephfs`` runs this. One real vLLM OpenAI API server with
kvtier: a small host pool and two write-through file tiers, ``file1`` on CephFS (a
throwaway single-node cluster, through ``ceph-fuse``) and ``file2`` on a local directory.
Freezing the MDS and the OSD (SIGSTOP) makes every ``open``, ``stat`` and ``read`` on the
mount block in the kernel, as on a hard-mounted NFS whose server is gone.

Conversations are seeded by a first server; then, with the server stopped, each
conversation's objects are removed from one of the two tiers, so that a second server
(whose start-up scan indexes what is there) finds the KV of ``cephfs-only`` conversations
only on CephFS and that of ``local-only`` ones only on the local directory. Requests are
sequential and streamed (TTFT: the first streamed token), temperature 0, of three kinds:
``new`` (never seen), ``cephfs-only`` and ``local-only`` returning conversations (their
history plus a few tokens). Three phases: ``healthy``, ``hung`` (MDS and OSD frozen for
at least ``--hang-seconds``), ``recovered``.

Targets (issue 18): every request is answered within max(3x its kind's healthy TTFT,
healthy + 2 s) with tokens identical to a recompute (the seeding server's answer with
kvtier bypassed); after recovery CephFS is used again (a ``cephfs-only`` conversation is
restored from ``file1``). Writes ``<out>/stall_fs.json`` and ``stall_fs.png``.
"""

from __future__ import annotations

import argparse
import json
import re
import tempfile
import time
from contextlib import ExitStack
from dataclasses import asdict
from pathlib import Path
from typing import Any

from benchmarks.machine import describe
from benchmarks.stall import NO_CACHE, USER_TOKENS, Client, Sample, plot, sample_line
from benchmarks.stall import summarise as table_rows
from kvtier.keys import chunk_keys
from kvtier.testing.ceph import ceph_cluster, unavailable_reason
from kvtier.testing.engines import tokens
from kvtier.testing.models import build_tiny_llama
from kvtier.testing.s3server import dummy_credentials
from kvtier.testing.servers import APIServer
from kvtier.tiers.file import FileTier
from kvtier.vllm.settings import kv_transfer_config

PHASES = ("healthy", "hung", "recovered")
KINDS = ("new", "cephfs-only", "local-only")
CT = 256


def _config(path: Path, cephfs: Path, local: Path, args: argparse.Namespace) -> Path:
    doc = {"chunk_tokens": CT, "reset_cache": "host",
           "tiers": [{"host": {"capacity": args.host_capacity}},
                     {"file": {"path": str(cephfs), "capacity": "4GiB", "write": "through"}},
                     {"file": {"path": str(local), "capacity": "4GiB", "write": "through"}}],
           "restore": {"lookup_timeout_seconds": args.lookup_timeout,
                       "load_timeout_seconds": args.load_timeout},
           "health": {"cooldown_seconds": args.cooldown}}
    path.write_text(json.dumps(doc))
    return path


class Run:
    def __init__(self, args: argparse.Namespace, vocab: int) -> None:
        self.args, self.vocab = args, vocab
        self.history: dict[tuple[str, str, int], list[int]] = {}  # (phase, kind, i)
        self.refs: dict[tuple[str, str, int], list[int]] = {}
        self.samples: list[Sample] = []
        self.spans: dict[str, tuple[float, float]] = {}
        self.t0 = time.perf_counter()

    def seed(self, client: Client, cephfs: FileTier, local: FileTier) -> None:
        """Store every returning conversation (both tiers, write-through), take its
        recompute reference, then keep it on one tier only."""
        keep: dict[tuple[str, str, int], list[Any]] = {}
        for p, phase in enumerate(PHASES):
            for k, kind in enumerate(KINDS[1:]):
                for i in range(self.args.prompts):
                    prompt = tokens(self.args.prompt_tokens, seed=20_000 + 1000 * p
                                    + 100 * k + i, vocab=self.vocab)
                    got = client.complete(prompt)
                    user = tokens(USER_TOKENS, seed=30_000 + 1000 * p + 100 * k + i,
                                  vocab=self.vocab)
                    key = (phase, kind, i)
                    self.history[key] = [*prompt, *got["token_ids"], *user]
                    ns = bytes.fromhex(got["kvtier"]["namespace"])
                    stored = [*prompt, *got["token_ids"]][: got["kvtier"]["tokens"]]
                    keep[key] = chunk_keys(ns, stored, CT)
        for key, hist in self.history.items():
            s = client.stream(Sample("reference", key[1], key[2], 0.0, None, 0.0), hist,
                              params=NO_CACHE, salt=f"ref-{'-'.join(map(str, key))}")
            if s.error:
                raise RuntimeError(f"reference {key} failed: {s.error}")
            self.refs[key] = s.token_ids
        for key, keys in keep.items():
            drop = local if key[1] == "cephfs-only" else cephfs
            self._wait_written(cephfs, keys)
            self._wait_written(local, keys)
            for k in keys:
                drop.path_of(k).unlink()

    @staticmethod
    def _wait_written(tier: FileTier, keys: list[Any], timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not all(tier.path_of(k).exists() for k in keys):
            if time.monotonic() > deadline:
                raise RuntimeError(f"write-through to {tier.name} never landed")
            time.sleep(0.1)  # polling another process's writes

    def phase(self, client: Client, phase: str) -> None:
        start = time.perf_counter() - self.t0
        for i in range(self.args.prompts):
            new = tokens(self.args.prompt_tokens, seed=40_000 + 100 * PHASES.index(phase) + i,
                         vocab=self.vocab)
            self._take(client.stream(self._sample(phase, "new", i), new))
            for kind in KINDS[1:]:
                key = (phase, kind, i)
                s = client.stream(self._sample(phase, kind, i), self.history[key])
                s.matches_recompute = s.error is None and s.token_ids == self.refs[key]
                self._take(s)
        self.spans[phase] = (start, time.perf_counter() - self.t0)

    def _sample(self, phase: str, kind: str, i: int) -> Sample:
        return Sample(phase, kind, i, time.perf_counter() - self.t0, None, 0.0)

    def _take(self, s: Sample) -> None:
        self.samples.append(s)
        print(sample_line(s), flush=True)


def restored_from(client: Client, tier: str, timeout_s: float = 10.0) -> float:
    """``kvtier_restored_tokens_total{tier=...}`` on the server's ``/metrics`` (vLLM
    pushes the engine's counts with each step's outputs: read after the last request)."""
    pattern = re.compile(r'^kvtier_restored_tokens_total\{[^}]*tier="' + re.escape(tier)
                         + r'"[^}]*\} ([0-9.e+]+)$', re.M)
    text = client.http.get(client.url + "/metrics", timeout=timeout_s).text
    return sum(float(m.group(1)) for m in pattern.finditer(text))


def summarise(samples: list[Sample]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    rows = table_rows(samples, kinds=KINDS)
    healthy = {r["kind"]: r["median_s"] for r in rows if r["phase"] == "healthy"}
    for row in rows:
        h = healthy[row["kind"]]
        row["bound_s"] = round(max(3 * h, h + 2.0), 4)
    checks = [
        {"name": "every request answered within max(3x healthy, healthy + 2 s) (each)",
         "pass": all(r["timeouts"] == 0 and r["max_s"] <= r["bound_s"] for r in rows),
         "value": "; ".join(f"{r['phase']}/{r['kind']} max {r['max_s']:.3f} s <= "
                            f"{r['bound_s']:.3f} s" for r in rows if r["phase"] == "hung")},
        {"name": "returning conversations: tokens identical to a recompute",
         "pass": all(s.matches_recompute for s in samples if s.kind != "new"),
         "value": f"{sum(bool(s.matches_recompute) for s in samples if s.kind != 'new')}/"
                  f"{sum(s.kind != 'new' for s in samples)}"},
    ]
    return rows, checks


def run(args: argparse.Namespace) -> int:
    reason = unavailable_reason()
    if reason is not None:
        print(f"no Ceph here ({reason}): `make ceph` installs it")
        return 2
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    model = build_tiny_llama(Path(args.cache_dir) / "tiny-fp32", dtype="float32")
    vocab = int(json.loads((model / "config.json").read_text())["vocab_size"])
    max_len = max(2048, -(-(args.prompt_tokens + 64) // 512) * 512)
    with ExitStack() as stack:
        work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvsf-",
                                                                    dir=args.workdir)))
        stack.enter_context(dummy_credentials())
        cluster = stack.enter_context(ceph_cluster(work / "ceph"))
        cephfs = cluster.mount("bench") / "kvtier"
        cephfs.mkdir()
        local = work / "local"
        cfg = kv_transfer_config(_config(work / "kvtier.yaml", cephfs, local, args))
        r = Run(args, vocab)

        def server(name: str) -> tuple[APIServer, Client]:
            srv = APIServer(work, model=model, name=name, max_model_len=max_len,
                            kv_transfer_config=cfg, num_gpu_blocks_override=args.kv_blocks)
            stack.callback(srv.stop)
            srv.start()
            client = Client(srv.url, args.request_timeout, args.max_tokens)
            stack.callback(client.http.close)
            return srv, client

        seeder, client = server("seed")
        print(f"seeding ({time.perf_counter() - t_start:.0f} s)", flush=True)
        r.seed(client, FileTier(cephfs, 1 << 32), FileTier(local, 1 << 32))
        seeder.stop()
        _, client = server("bench")  # its start-up scan indexes what each tier holds
        stack.callback(cluster.resume, "mds", "osd")  # before anything stops
        r.t0 = time.perf_counter()
        print("phases (sequential requests):", flush=True)
        r.phase(client, "healthy")
        t_stop = time.monotonic()
        cluster.pause("mds", "osd")
        try:
            r.phase(client, "hung")
            rest = args.hang_seconds - (time.monotonic() - t_stop)
            if rest > 0:
                time.sleep(rest)  # the outage's length, not a test's clock
        finally:
            cluster.resume("mds", "osd")
        r.spans["hung"] = (r.spans["hung"][0], time.perf_counter() - r.t0)
        time.sleep(args.cooldown + 1)  # the breaker's cooldown: then one trial call
        before = restored_from(client, "file1")
        r.phase(client, "recovered")
        from_cephfs = restored_from(client, "file1") - before
    rows, checks = summarise(r.samples)
    checks.append({"name": "after recovery CephFS is used again (tokens restored from it)",
                   "pass": from_cephfs > 0, "value": f"{from_cephfs:.0f} tokens"})
    report = {"benchmark": "stall_fs", "settings": vars(args), "rows": rows,
              "targets": checks, "phases": r.spans, "machine": describe(),
              "samples": [asdict(s) for s in r.samples],
              "wall_s": round(time.perf_counter() - t_start, 1)}
    (out / "stall_fs.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"{'phase':<10} {'kind':<12} {'n':>2} {'median s':>9} {'max s':>8} {'bound s':>8} "
          f"{'same':>5}")
    for row in rows:
        same = f"{row['same_tokens']}/{row['n']}" if "same_tokens" in row else "-"
        print(f"{row['phase']:<10} {row['kind']:<12} {row['n']:>2} {row['median_s']:>9.3f} "
              f"{row['max_s']:>8.3f} {row['bound_s']:>8.3f} {same:>5}")
    print("targets (issue 18):")
    for c in checks:
        print(f"  {'PASS' if c['pass'] else 'FAIL'}  {c['name']}: {c['value']}")
    plot(r.samples, r.spans, out / "stall_fs.png", kinds=KINDS,
         title="TTFT while CephFS hangs (MDS + OSD SIGSTOP)")
    return 0 if all(c["pass"] for c in checks) else 1


def add_arguments(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("--hang cephfs")
    g.add_argument("--kv-blocks", type=int, default=24)
    g.add_argument("--load-timeout", type=float, default=1.0,
                   help="restore.load_timeout_seconds")
    g.add_argument("--cooldown", type=float, default=3.0, help="health.cooldown_seconds")
