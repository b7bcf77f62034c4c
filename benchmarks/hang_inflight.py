"""A shared tier that hangs mid-run, with requests in flight together (issue 43).

The operator's case: one real vLLM OpenAI API server with kvtier as ``configs/nfs.yaml``
ships it (one write-through file tier, defaults otherwise) or, with ``--hang s3``, a
host pool and one write-through S3 tier (a local moto server); a small host pool
(``--host-capacity``, 6 MiB). The file tier lives on a FUSE passthrough (``bindfs``,
``kvtier.testing.fuse``) whose daemon is stopped (SIGSTOP) to hang it, the way a dead
hard-mounted NFS server behaves; the S3 endpoint is frozen the same way.

Each round: a conversation stored earlier, whose KV is then only on the lower tier
(vLLM's prefix cache and the host pool reset), returns; ``--gap`` seconds later two new
prompts (nothing stored anywhere) are sent; all three are in flight together, streamed
(TTFT: the first token), temperature 0. ``--rounds`` rounds healthy, then as many hung:
each hung round stops the tier just before its requests and resumes it after them, with
the breaker's cooldown in between (every hung round is a hang's first requests). Then,
recovered, one more return must be restored from the tier.

Reference, from the same run: every return's recompute (kvtier bypassed with
``kv_transfer_params {"kvtier": {"load": false, "save": false}}``, a unique salt), its
tokens and its TTFT. Targets (issue 43): while the tier hangs, every new prompt within
its healthy median + 0.3 s; every return within max(the healthy return median + 0.3 s,
its recompute's TTFT), with a recompute's tokens; after recovery a return is restored
from the tier. Prints each target with its ratio; writes ``<out>/hang_inflight.json``.
``--smoke``: one round each, for the test suite.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from contextlib import ExitStack
from dataclasses import asdict
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.machine import describe
from benchmarks.stall import NO_CACHE, USER_TOKENS, Client, Sample, sample_line
from kvtier.config import parse_config
from kvtier.testing.engines import tokens
from kvtier.testing.fuse import BindMount, unavailable_reason
from kvtier.testing.models import build_tiny_llama
from kvtier.testing.s3server import MotoServer, dummy_credentials
from kvtier.testing.servers import APIServer
from kvtier.vllm.settings import kv_transfer_config

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
BUCKET, PREFIX = "kvtier-hang", "hang/"
MARGIN_S = 0.3  # what a hang may add to a request (issue 43)


class Tier:
    """The lower tier under test: how it is configured, hung, resumed, and whether an
    object has landed on it (read beside the hang: never through the stopped mount)."""

    def __init__(self, kind: str, work: Path, stack: ExitStack) -> None:
        self.kind = kind
        if kind == "fuse":
            reason = unavailable_reason()
            if reason is not None:
                raise SystemExit(f"no FUSE passthrough here: {reason}")
            self.src = work / "backing"
            self.mount = stack.enter_context(BindMount(self.src, work / "mnt"))
            stack.callback(self.mount.resume)
        else:
            stack.enter_context(dummy_credentials())
            self.moto = MotoServer()
            stack.callback(self.moto.stop)
            self.endpoint = self.moto.start()
            import boto3

            self.s3 = boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1")
            self.s3.create_bucket(Bucket=BUCKET)
            stack.callback(self.moto.resume)

    def doc(self, host_capacity: str) -> dict[str, Any]:
        """``configs/nfs.yaml`` as shipped (or its S3 counterpart), on this tier, with a
        ``host_capacity`` host pool; everything else as the shipped file says."""
        doc: dict[str, Any] = yaml.safe_load((CONFIGS / "nfs.yaml").read_text())
        doc["tiers"][0]["host"]["capacity"] = host_capacity
        doc["reset_cache"] = "host"  # /reset_prefix_cache drops the host pool too
        if self.kind == "fuse":
            doc["tiers"][1]["file"].update(path=str(self.mount.mnt), capacity="4GiB")
        else:
            doc["tiers"][1] = {"s3": {"bucket": BUCKET, "prefix": PREFIX,
                                      "endpoint_url": self.endpoint, "region": "us-east-1",
                                      "path_style": True, "capacity": "4GiB",
                                      "write": "through"}}
        parse_config(json.loads(json.dumps(doc)), source="hang_inflight.py")
        return doc

    def landed(self, key_hex: str) -> bool:
        if self.kind == "fuse":
            return any(self.src.rglob(f"{key_hex}*"))
        got = self.s3.list_objects_v2(Bucket=BUCKET, Prefix=f"{PREFIX}kv/{key_hex[:2]}/{key_hex}")
        return int(got.get("KeyCount", 0)) > 0

    def pause(self) -> None:
        (self.mount if self.kind == "fuse" else self.moto).pause()

    def resume(self) -> None:
        (self.mount if self.kind == "fuse" else self.moto).resume()


class Run:
    def __init__(self, args: argparse.Namespace, client: Client, tier: Tier, vocab: int) -> None:
        self.args, self.client, self.tier, self.vocab = args, client, tier, vocab
        self.samples: list[Sample] = []
        self.recompute_s: dict[tuple[str, int], float] = {}
        self.history: dict[tuple[str, int], list[int]] = {}
        self.refs: dict[tuple[str, int], list[int]] = {}
        self.t0 = time.perf_counter()

    def seed(self, phases: tuple[str, ...]) -> None:
        """Store every returning conversation on the tier (write-through: wait until its
        last chunk landed), then take its recompute: tokens and TTFT."""
        self.client.stream(Sample("warmup", "new", 0, 0.0, None, 0.0),
                           tokens(self.args.prompt_tokens, seed=1, vocab=self.vocab),
                           params=NO_CACHE, salt="warmup")
        for p, phase in enumerate(phases):
            for i in range(self.args.rounds):
                prompt = tokens(self.args.prompt_tokens, seed=50_000 + 100 * p + i,
                                vocab=self.vocab)
                got = self.client.complete(prompt)
                last = got["kvtier"].get("last_key")
                if not last:
                    raise RuntimeError(f"kvtier stored nothing for {phase}/{i}: {got['kvtier']}")
                self._wait_landed(last)
                user = tokens(USER_TOKENS, seed=60_000 + 100 * p + i, vocab=self.vocab)
                self.history[phase, i] = [*prompt, *got["token_ids"], *user]
        for key, hist in self.history.items():
            s = self.client.stream(Sample("reference", "returning", key[1], 0.0, None, 0.0),
                                   hist, params=NO_CACHE, salt=f"ref-{key[0]}-{key[1]}")
            if s.error or s.ttft_s is None:
                raise RuntimeError(f"reference {key} failed: {s.error}")
            self.refs[key], self.recompute_s[key] = s.token_ids, s.ttft_s

    def _wait_landed(self, key_hex: str, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.tier.landed(key_hex):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the write-through of {key_hex[:16]} never landed")
            time.sleep(0.1)  # polling another process's writes

    def round(self, phase: str, i: int) -> None:
        """The return, then ``--gap`` s later two new prompts, all in flight together."""
        self.client.reset_caches()  # the return's KV is only on the lower tier now
        if phase == "hung":
            self.tier.pause()
        try:
            out: list[Sample] = []

            def send(kind: str, j: int, prompt: list[int]) -> None:
                s = Sample(phase, kind, i, time.perf_counter() - self.t0, None, 0.0)
                # each request on its own connection: all three are in flight together
                c = Client(self.client.url, self.args.request_timeout, self.args.max_tokens)
                try:
                    c.stream(s, prompt)
                finally:
                    c.http.close()
                if kind == "returning":
                    s.matches_recompute = s.error is None and s.token_ids == self.refs[phase, i]
                out.append(s)

            threads = [threading.Thread(target=send, args=("returning", 0,
                                                           self.history[phase, i]))]
            for j in (1, 2):
                seed = 70_000 + 1000 * (phase == "hung") + 10 * i + j
                new = tokens(self.args.prompt_tokens, seed=seed, vocab=self.vocab)
                threads.append(threading.Thread(target=send, args=("new", j, new)))
            threads[0].start()
            time.sleep(self.args.gap)  # the client's own pacing, not a test's clock
            for t in threads[1:]:
                t.start()
            for t in threads:
                t.join()
        finally:
            if phase == "hung":
                self.tier.resume()
        for s in sorted(out, key=lambda s: s.start_s):
            self.samples.append(s)
            print(sample_line(s), flush=True)

    def recovered(self) -> dict[str, Any]:
        """After the last hang and the cooldown: one stored return restored from the tier."""
        prompt = tokens(self.args.prompt_tokens, seed=80_000, vocab=self.vocab)
        got = self.client.complete(prompt)
        self._wait_landed(got["kvtier"]["last_key"])
        back = [*prompt, *got["token_ids"], *tokens(USER_TOKENS, seed=80_001, vocab=self.vocab)]
        ref = self.client.stream(Sample("reference", "returning", 0, 0.0, None, 0.0), back,
                                 params=NO_CACHE, salt="ref-recovered").token_ids
        self.client.reset_caches()
        again = self.client.complete(back)
        by_tier = again["kvtier"].get("restored_by_tier", {})
        lower = sum(n for t, n in by_tier.items() if not t.startswith("host"))
        return {"restored_by_tier": by_tier, "from_lower_tier": lower,
                "matches_recompute": again["token_ids"] == ref}


def summarise(samples: list[Sample], recompute_s: dict[tuple[str, int], float],
              recovered: dict[str, Any]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    def waited(phase: str, kind: str) -> list[float]:
        return [s.waited_s for s in samples if s.phase == phase and s.kind == kind]

    healthy_new = statistics.median(waited("healthy", "new"))
    healthy_ret = statistics.median(waited("healthy", "returning"))
    hung_new, hung_ret = waited("hung", "new"), waited("hung", "returning")
    ret_bounds = [max(healthy_ret + MARGIN_S, recompute_s["hung", s.index])
                  for s in samples if s.phase == "hung" and s.kind == "returning"]
    new_bound = healthy_new + MARGIN_S
    table = {"healthy_new_median_s": round(healthy_new, 4),
             "healthy_return_median_s": round(healthy_ret, 4),
             "recompute_median_s": round(statistics.median(recompute_s.values()), 4),
             "hung_new_max_s": round(max(hung_new), 4),
             "hung_return_max_s": round(max(hung_ret), 4),
             "hung_new_vs_healthy": round(max(hung_new) / healthy_new, 2),
             "hung_return_vs_bound": round(max(w / b for w, b in zip(hung_ret, ret_bounds,
                                                                      strict=True)), 2)}
    answered = all(s.error is None and s.ttft_s is not None for s in samples)
    checks = [
        {"name": "every request answered", "pass": answered,
         "value": f"{sum(s.ttft_s is not None for s in samples)}/{len(samples)}"},
        {"name": f"hung: every new prompt within healthy + {MARGIN_S} s",
         "pass": max(hung_new) <= new_bound,
         "value": f"max {max(hung_new):.3f} s <= {new_bound:.3f} s "
                  f"({max(hung_new) / new_bound:.2f}x the bound)"},
        {"name": f"hung: every return within max(healthy + {MARGIN_S} s, its recompute)",
         "pass": all(w <= b for w, b in zip(hung_ret, ret_bounds, strict=True)),
         "value": "; ".join(f"{w:.3f} s <= {b:.3f} s" for w, b in zip(hung_ret, ret_bounds,
                                                                      strict=True))},
        {"name": "every return's tokens identical to a recompute",
         "pass": all(s.matches_recompute for s in samples if s.kind == "returning"),
         "value": f"{sum(bool(s.matches_recompute) for s in samples if s.kind == 'returning')}"
                  f"/{sum(s.kind == 'returning' for s in samples)}"},
        {"name": "recovered: a return is restored from the tier, with a recompute's tokens",
         "pass": recovered["from_lower_tier"] > 0 and recovered["matches_recompute"],
         "value": f"{recovered['restored_by_tier']}"},
    ]
    return table, checks


def run(args: argparse.Namespace) -> int:
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    model = build_tiny_llama(Path(args.cache_dir) / "tiny-fp32", dtype="float32")
    vocab = int(json.loads((model / "config.json").read_text())["vocab_size"])
    with ExitStack() as stack:
        work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvhang-")))
        tier = Tier(args.hang, work, stack)
        doc = tier.doc(args.host_capacity)
        cfg_path = work / "kvtier.yaml"
        cfg_path.write_text(yaml.safe_dump(doc))
        srv = APIServer(work, model=model, name="hang", max_model_len=2048,
                        kv_transfer_config=kv_transfer_config(cfg_path),
                        num_gpu_blocks_override=args.kv_blocks,
                        extra_env={"VLLM_SERVER_DEV_MODE": "1"})  # /reset_prefix_cache
        stack.callback(srv.stop)  # after the tier resumes: its shutdown may write
        srv.start()
        client = Client(srv.url, args.request_timeout, args.max_tokens)
        stack.callback(client.http.close)
        r = Run(args, client, tier, vocab)
        print(f"seeding ({time.perf_counter() - t_start:.0f} s)", flush=True)
        r.seed(("healthy", "hung"))
        r.t0 = time.perf_counter()
        for phase in ("healthy", "hung"):
            for i in range(args.rounds):
                r.round(phase, i)
                if phase == "hung":
                    # the breaker's cooldown: the next hang meets a tier it trusts again
                    time.sleep(args.cooldown_wait)
        recovered = r.recovered()
    table, checks = summarise(r.samples, r.recompute_s, recovered)
    report = {"benchmark": "hang_inflight", "settings": vars(args), "summary": table,
              "targets": checks, "recovered": recovered, "config": doc,
              "machine": describe(), "samples": [asdict(s) for s in r.samples],
              "wall_s": round(time.perf_counter() - t_start, 1)}
    (out / "hang_inflight.json").write_text(json.dumps(report, indent=2) + "\n")
    print(" ".join(f"{k}={v}" for k, v in table.items()))
    print("targets (issue 43):")
    for c in checks:
        print(f"  {'PASS' if c['pass'] else 'FAIL'}  {c['name']}: {c['value']}")
    return 0 if all(c["pass"] for c in checks) else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hang", choices=("fuse", "s3"), default="fuse")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt-tokens", type=int, default=900)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--gap", type=float, default=0.3,
                    help="seconds between the return and the two new prompts")
    ap.add_argument("--host-capacity", default="6MiB")
    ap.add_argument("--kv-blocks", type=int, default=256)
    ap.add_argument("--cooldown-wait", type=float, default=11.0,
                    help="seconds after each hung round (health.cooldown_seconds + 1)")
    ap.add_argument("--request-timeout", type=float, default=60.0)
    ap.add_argument("--cache-dir", default=str(Path(tempfile.gettempdir()) / "kvtier-models"))
    ap.add_argument("--out-dir", default=str(Path(__file__).resolve().parent / "results"))
    ap.add_argument("--smoke", action="store_true", help="one round each (the test suite)")
    args = ap.parse_args(argv)
    if args.smoke:
        args.rounds = 1
    return run(args)


if __name__ == "__main__":
    raise SystemExit(main())
