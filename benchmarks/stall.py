"""A slow or hung tier never stalls vLLM (issue 10): TTFT while the S3 endpoint hangs.

One real vLLM OpenAI API server with kvtier: a host pool, a write-through file tier and a
write-through S3 tier on a local moto server started here (every request touches S3).
Requests are sequential, streamed (TTFT: the first streamed token), temperature 0,
``ignore_eos``, of two kinds: ``new`` (never-seen random token ids) and ``returning`` (a
conversation seeded before the healthy phase, its output and a few new tokens: restored
by kvtier or recomputed). Three phases: ``healthy``; ``hung`` (the moto process
SIGSTOPped: the kernel still accepts connections and nothing answers, like an S3
brownout; at least ``--hang-seconds``); ``recovered`` (SIGCONT). A client timeout per
request (``--request-timeout``) makes a stall a number, not a hung benchmark.

Targets: new prompts during the hang within 3x their healthy median TTFT or at most 2 s
more (each); every returning conversation's tokens identical to a recompute
(``kv_transfer_params {"kvtier": {"load": false, "save": false}}``, a unique
``cache_salt``, computed in the healthy phase); after recovery S3 is used again (a new
prompt's last chunk lands in the bucket; with the host and file copies dropped its
conversation is restored from S3 with a recompute's tokens).

Writes ``<out>/stall.json`` and ``stall.png`` (TTFT per request over time, phases shaded).
``--smoke``: the tiny fp32 model, 2 + 2 requests per phase, one S3 attempt per call.
Moto is resumed and every server stopped on every exit path (Ctrl-C and SIGTERM too).
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
from pydantic import BaseModel

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.machine import describe
from kvtier.config import RestoreConfig, S3Config, parse_config
from kvtier.testing.engines import tokens
from kvtier.testing.models import build_bench_llama, build_tiny_llama
from kvtier.testing.s3server import MotoServer, dummy_credentials
from kvtier.testing.servers import APIServer
from kvtier.vllm.settings import kv_transfer_config

RESULTS = Path(__file__).resolve().parent / "results"
PHASES = ("healthy", "hung", "recovered")
KINDS = ("new", "returning")
NO_CACHE = {"kvtier": {"load": False, "save": False}}
BUCKET, PREFIX = "kvtier-stall", "stall/"
USER_TOKENS = 16  # what a returning conversation adds to its history
KV_BLOCKS = 24  # vLLM's own cache holds ~3 prompts: returning ones come from kvtier


@dataclass
class Sample:
    phase: str
    kind: str
    index: int
    start_s: float  # since the healthy phase began
    ttft_s: float | None  # None: no token before the timeout or an error
    total_s: float
    token_ids: list[int] = field(default_factory=list)
    cached_tokens: int | None = None
    error: str | None = None
    matches_recompute: bool | None = None  # returning only

    @property
    def waited_s(self) -> float:  # TTFT, or how long the client waited for nothing
        return self.ttft_s if self.ttft_s is not None else self.total_s


def sample_line(s: Sample) -> str:
    """One request, as the benchmarks print it while they run."""
    ttft = f"{s.ttft_s:.3f} s" if s.ttft_s is not None else f"none after {s.total_s:.1f} s"
    extra = "" if s.matches_recompute is None else f", same tokens: {s.matches_recompute}"
    cached = "" if s.cached_tokens is None else f", cached {s.cached_tokens}"
    return (f"  {s.phase:<9} {s.kind:<11} #{s.index}: TTFT {ttft}{cached}{extra}"
            f"{', ' + s.error if s.error else ''}")


class Client:
    """Streamed completions against one server, token ids in and out."""

    def __init__(self, url: str, timeout_s: float, max_tokens: int) -> None:
        self.url, self.max_tokens = url, max_tokens
        self.http = httpx.Client(timeout=httpx.Timeout(timeout_s, connect=10.0))

    def body(self, prompt: list[int], params: dict[str, Any] | None,
             salt: str | None) -> dict[str, Any]:
        body: dict[str, Any] = {"model": "model", "prompt": prompt, "temperature": 0,
                                "max_tokens": self.max_tokens, "ignore_eos": True,
                                "return_token_ids": True}
        if params is not None:
            body["kv_transfer_params"] = params
        if salt is not None:
            body["cache_salt"] = salt
        return body

    def stream(self, sample: Sample, prompt: list[int], *,
               params: dict[str, Any] | None = None, salt: str | None = None) -> Sample:
        body = {**self.body(prompt, params, salt), "stream": True,
                "stream_options": {"include_usage": True}}
        t0 = time.perf_counter()
        try:
            with self.http.stream("POST", self.url + "/v1/completions", json=body) as r:
                if r.status_code != 200:
                    sample.error = f"HTTP {r.status_code}: {r.read()[:300]!r}"
                else:
                    for line in r.iter_lines():
                        self._take(sample, line, t0)
        except httpx.TimeoutException:
            sample.error = "timeout"
        except httpx.HTTPError as e:
            sample.error = f"{type(e).__name__}: {e}"
        sample.total_s = time.perf_counter() - t0
        return sample

    @staticmethod
    def _take(sample: Sample, line: str, t0: float) -> None:
        if not line.startswith("data: ") or line == "data: [DONE]":
            return
        chunk = json.loads(line[len("data: "):])
        for choice in chunk.get("choices") or ():
            ids = choice.get("token_ids") or []
            if ids and sample.ttft_s is None:
                sample.ttft_s = time.perf_counter() - t0
            sample.token_ids.extend(ids)
        details = (chunk.get("usage") or {}).get("prompt_tokens_details") or {}
        if "cached_tokens" in details:
            sample.cached_tokens = details["cached_tokens"]

    def complete(self, prompt: list[int]) -> dict[str, Any]:
        """One non-streamed completion: token ids and kvtier's ``kv_transfer_params``."""
        r = self.http.post(self.url + "/v1/completions", json=self.body(prompt, None, None))
        r.raise_for_status()
        data: dict[str, Any] = r.json()
        return {"token_ids": data["choices"][0]["token_ids"],
                "kvtier": (data.get("kv_transfer_params") or {}).get("kvtier", {})}

    def reset_caches(self, timeout_s: float = 60.0) -> None:
        """vLLM's prefix cache and kvtier's host tier; refused while saves are in flight."""
        deadline = time.monotonic() + timeout_s
        while not self.http.post(self.url + "/reset_prefix_cache",
                                 params={"reset_external": "true"}).json()["success"]:
            if time.monotonic() > deadline:
                raise RuntimeError("the prefix cache never reset")
            time.sleep(0.2)  # polling another process


def kvtier_doc(store: Path, endpoint: str, args: argparse.Namespace
               ) -> tuple[dict[str, Any], list[str]]:
    """The kvtier config, and the optional keys this kvtier's config does not have."""
    s3: dict[str, Any] = {"bucket": BUCKET, "prefix": PREFIX, "endpoint_url": endpoint,
                          "region": "us-east-1", "path_style": True, "capacity": "4GiB",
                          "write": "through"}
    restore: dict[str, Any] = {}
    wanted: list[tuple[dict[str, Any], type[BaseModel], str, dict[str, float | None]]] = [
        (s3, S3Config, "tiers[2].s3", {"connect_timeout": args.s3_connect_timeout,
                                       "read_timeout": args.s3_read_timeout,
                                       "max_attempts": args.s3_max_attempts}),
        (restore, RestoreConfig, "restore", {"lookup_timeout_seconds": args.lookup_timeout})]
    skipped = []
    for section, model, where, keys in wanted:
        for key, value in keys.items():
            if value is None:
                continue
            if key in model.model_fields:
                section[key] = value
            else:
                skipped.append(f"{where}.{key}")
    doc: dict[str, Any] = {"chunk_tokens": 256, "reset_cache": "host", "tiers": [
        {"host": {"capacity": args.host_capacity}},
        {"file": {"path": str(store), "capacity": "4GiB", "write": "through"}},
        {"s3": s3}]}
    if restore:
        doc["restore"] = restore
    parse_config(json.loads(json.dumps(doc)), source="stall.py")  # fail here, not in vLLM
    return doc, skipped


class Bench:
    """The prompts of one run, their recompute references, and the samples taken."""

    def __init__(self, client: Client, args: argparse.Namespace, vocab: int) -> None:
        self.client, self.args, self.vocab = client, args, vocab
        self.samples: list[Sample] = []
        self.t0 = time.perf_counter()
        self.spans: dict[str, tuple[float, float]] = {}
        n = args.prompts
        self.returning: dict[tuple[str, int], list[int]] = {}
        self.refs: dict[tuple[str, int], list[int]] = {}
        self.seeds = {(p, i): tokens(args.prompt_tokens, seed=5000 + 100 * pi + i, vocab=vocab)
                      for pi, p in enumerate(PHASES) for i in range(n)}
        self.resumed_at = 0.0

    def prompt(self, phase: str, i: int) -> list[int]:
        return tokens(self.args.prompt_tokens, seed=1000 * (PHASES.index(phase) + 1) + i,
                      vocab=self.vocab)

    def sample(self, phase: str, kind: str, i: int) -> Sample:
        return Sample(phase, kind, i, time.perf_counter() - self.t0, None, 0.0)

    def prepare(self) -> None:
        """Seed every returning conversation, then compute their references (recompute)."""
        self.client.stream(self.sample("warmup", "new", 0), tokens(300, seed=1, vocab=self.vocab),
                           params=NO_CACHE, salt="warmup")
        for (phase, i), seed in self.seeds.items():
            s = self.client.stream(self.sample("seed", "new", i), seed)
            if s.error:
                raise RuntimeError(f"seeding conversation {phase}/{i} failed: {s.error}")
            user = tokens(USER_TOKENS, seed=7000 + 100 * PHASES.index(phase) + i,
                          vocab=self.vocab)
            self.returning[phase, i] = [*seed, *s.token_ids, *user]
        for (phase, i), prompt in self.returning.items():
            s = self.client.stream(self.sample("reference", "returning", i), prompt,
                                   params=NO_CACHE, salt=f"ref-{phase}-{i}")
            if s.error or len(s.token_ids) != self.args.max_tokens:
                raise RuntimeError(f"reference {phase}/{i} failed: {s.error}")
            self.refs[phase, i] = s.token_ids
        self.t0 = time.perf_counter()

    def phase(self, phase: str) -> None:
        start = time.perf_counter() - self.t0
        for i in range(self.args.prompts):  # interleaved: new, returning, new, ...
            s = self.client.stream(self.sample(phase, "new", i), self.prompt(phase, i))
            self.report(s)
            s = self.client.stream(self.sample(phase, "returning", i), self.returning[phase, i])
            s.matches_recompute = s.error is None and s.token_ids == self.refs[phase, i]
            self.report(s)
        self.spans[phase] = (start, time.perf_counter() - self.t0)

    def report(self, s: Sample) -> None:
        self.samples.append(s)
        print(sample_line(s), flush=True)

    def hang(self, moto: MotoServer) -> None:
        """The hung phase; the endpoint is resumed however it ends (Ctrl-C included)."""
        t_stop = time.monotonic()
        moto.pause()
        try:
            self.phase("hung")
            rest = self.args.hang_seconds - (time.monotonic() - t_stop)
            if rest > 0:
                print(f"  (endpoint stays stopped {rest:.0f} s more: --hang-seconds)", flush=True)
                time.sleep(rest)  # the brownout's length, not a test's clock
        finally:
            moto.resume()
        self.resumed_at = time.perf_counter()
        self.spans["hung"] = (self.spans["hung"][0], self.resumed_at - self.t0)  # to SIGCONT

    def s3_probe(self, store: Path, s3: Any) -> dict[str, Any]:
        """After recovery: new prompts until one's last chunk reaches the bucket (a tier
        marked down comes back after its cooldown), then its conversation is restored
        from S3 once the host and file copies are gone, with a recompute's tokens."""
        deadline = time.monotonic() + self.args.probe_timeout
        out: dict[str, Any] = {"written": False, "tries": 0, "from_s3": 0,
                               "restored_by_tier": {}, "matches_recompute": False}
        prompt: list[int] = []
        while not out["written"] and time.monotonic() < deadline:
            prompt = tokens(self.args.prompt_tokens, seed=9000 + out["tries"], vocab=self.vocab)
            out["tries"] += 1
            last = self.client.complete(prompt)["kvtier"].get("last_key")
            out["written"] = bool(last) and landed(s3, f"{PREFIX}kv/{last[:2]}/{last}",
                                                   min(deadline, time.monotonic() + 5.0))
        out["written_after_resume_s"] = round(time.perf_counter() - self.resumed_at, 3)
        if not out["written"]:
            return out
        back = [*prompt, *tokens(USER_TOKENS, seed=9999, vocab=self.vocab)]
        ref = self.client.stream(self.sample("reference", "returning", 0), back,
                                 params=NO_CACHE, salt="ref-probe").token_ids
        self.client.reset_caches()
        shutil.rmtree(store / "kv", ignore_errors=True)
        got = self.client.complete(back)
        out["restored_by_tier"] = got["kvtier"].get("restored_by_tier", {})
        out["from_s3"] = sum(n for t, n in out["restored_by_tier"].items() if t.startswith("s3"))
        out["matches_recompute"] = bool(ref) and got["token_ids"] == ref
        return out


def landed(s3: Any, name: str, until: float, quiet_s: float = 1.0) -> bool:
    """Whether an object named ``name...`` appears in the bucket before ``until``; once it
    has, wait for the object count to stay still for ``quiet_s`` (a prompt's other chunks
    are written alongside its last)."""
    count, since, seen = -1, time.monotonic(), False
    while time.monotonic() < until:
        seen = seen or s3.list_objects_v2(Bucket=BUCKET, Prefix=name).get("KeyCount", 0) > 0
        pages = s3.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=PREFIX)
        now = sum(p.get("KeyCount", 0) for p in pages)
        if now != count:
            count, since = now, time.monotonic()
        elif seen and time.monotonic() - since >= quiet_s:
            break
        time.sleep(0.2)  # polling the write-through
    return seen


def summarise(samples: list[Sample], kinds: tuple[str, ...] = KINDS) -> list[dict[str, Any]]:
    """Per phase and kind: TTFT median and max, the slowest last token, requests without
    a token, the ratio to the healthy median and (kinds other than ``new``) how many
    had a recompute's tokens; also ``stall_fs.py``'s table."""
    rows = []
    healthy: dict[str, float] = {}
    for phase in PHASES:
        for kind in kinds:
            mine = [s for s in samples if s.phase == phase and s.kind == kind]
            waited = [s.waited_s for s in mine]
            row: dict[str, Any] = {"phase": phase, "kind": kind, "n": len(mine),
                                   "median_s": round(statistics.median(waited), 4),
                                   "max_s": round(max(waited), 4),
                                   "max_done_s": round(max(s.total_s for s in mine), 4),
                                   "timeouts": sum(s.ttft_s is None for s in mine)}
            if phase == "healthy":
                healthy[kind] = row["median_s"]
            row["vs_healthy"] = round(row["median_s"] / healthy[kind], 2)
            if kind != "new":
                row["same_tokens"] = sum(bool(s.matches_recompute) for s in mine)
            rows.append(row)
    return rows


def targets(rows: list[dict[str, Any]], samples: list[Sample],
            probe: dict[str, Any]) -> list[dict[str, Any]]:
    base = next(r["median_s"] for r in rows if r["phase"] == "healthy" and r["kind"] == "new")
    bound = max(3 * base, base + 2.0)
    hung_new = [s for s in samples if s.phase == "hung" and s.kind == "new"]
    hung = [s.waited_s for s in hung_new]
    hung_ok = all(s.ttft_s is not None for s in hung_new)
    returning = [s for s in samples if s.kind == "returning"]
    return [
        {"name": "new prompts during the hang <= 3x healthy TTFT or +2 s (each)",
         "value": f"max {max(hung):.3f} s vs bound {bound:.3f} s",
         "pass": hung_ok and max(hung) <= bound},
        {"name": "returning conversations: tokens identical to a recompute",
         "value": f"{sum(bool(s.matches_recompute) for s in returning)}/{len(returning)}",
         "pass": all(s.matches_recompute for s in returning)},
        {"name": "after recovery the S3 tier is used again",
         "value": f"chunk written: {probe['written']} ({probe['tries']} prompt(s), "
                  f"{probe['written_after_resume_s']:.1f} s after SIGCONT), restored from S3: "
                  f"{probe['from_s3']} tokens, same tokens: {probe['matches_recompute']}",
         "pass": bool(probe["written"] and probe["from_s3"] > 0 and probe["matches_recompute"])},
    ]


def table(rows: list[dict[str, Any]]) -> str:
    """TTFT median and max per phase and kind; ``max done s``: the slowest request's last
    token (a stall after the first token, e.g. in the save path, shows there)."""
    lines = [f"{'phase':<10} {'kind':<10} {'n':>3} {'median s':>9} {'max s':>8} "
             f"{'vs healthy':>10} {'max done s':>10} {'timeouts':>8} {'same tokens':>11}"]
    for r in rows:
        same = f"{r['same_tokens']}/{r['n']}" if "same_tokens" in r else "-"
        lines.append(f"{r['phase']:<10} {r['kind']:<10} {r['n']:>3} {r['median_s']:>9.3f} "
                     f"{r['max_s']:>8.3f} {r['vs_healthy']:>9.2f}x {r['max_done_s']:>10.3f} "
                     f"{r['timeouts']:>8} {same:>11}")
    return "\n".join(lines)


def plot(samples: list[Sample], spans: dict[str, tuple[float, float]], out: Path, *,
         kinds: tuple[str, ...] = KINDS,
         title: str = "TTFT while the S3 endpoint hangs (moto SIGSTOP)") -> bool:
    """TTFT per request over time, phases shaded, one marker per kind (an ``x`` for a
    request that got no token); also ``stall_fs.py``'s plot."""
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)")
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    colours = {"healthy": "tab:green", "hung": "tab:red", "recovered": "tab:blue"}
    for phase, (a, b) in spans.items():
        ax.axvspan(a, b, color=colours[phase], alpha=0.12, label=f"{phase} phase")
    for kind, marker in zip(kinds, "os^v", strict=False):
        for lost in (False, True):
            mine = [s for s in samples if s.kind == kind and (s.ttft_s is None) == lost]
            if mine:
                ax.scatter([s.start_s for s in mine], [s.waited_s for s in mine],
                           marker="x" if lost else marker,
                           label=f"{kind}: {'no token (timeout/error)' if lost else 'TTFT'}")
    ax.set_yscale("log")
    ax.set_xlabel("request start (s since the healthy phase began)")
    ax.set_ylabel("TTFT (s)")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    return True


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--hang", choices=["s3", "cephfs"], default="s3",
                    help="s3: the S3 endpoint hangs (moto SIGSTOP); cephfs: a file tier on "
                         "CephFS hangs mid-read (MDS + OSD SIGSTOP; benchmarks/stall_fs.py)")
    ap.add_argument("--smoke", action="store_true",
                    help="tiny model, 2+2 requests per phase, 1 S3 attempt, short hang")
    ap.add_argument("--preset", choices=["tiny", "bench90m"], default="tiny",
                    help="tiny: fp32, exact; bench90m: bf16 (a near-tie can flip a token)")
    ap.add_argument("--prompts", type=int, default=5, help="new and returning, per phase")
    ap.add_argument("--prompt-tokens", type=int, default=900)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--hang-seconds", type=float, default=30.0,
                    help="the endpoint stays stopped at least this long")
    ap.add_argument("--request-timeout", type=float, default=180.0)
    ap.add_argument("--probe-timeout", type=float, default=60.0,
                    help="wait this long for a chunk to reach S3 after recovery")
    ap.add_argument("--host-capacity", default="64MiB")
    ap.add_argument("--lookup-timeout", type=float, default=0.5,
                    help="restore.lookup_timeout_seconds (if this kvtier has it)")
    ap.add_argument("--s3-connect-timeout", type=float, default=1.0)
    ap.add_argument("--s3-read-timeout", type=float, default=2.0)
    ap.add_argument("--s3-max-attempts", type=int, default=2)
    ap.add_argument("--out-dir", default=str(RESULTS))
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--cache-dir", default=str(Path.home() / ".cache" / "kvtier-models"))
    from benchmarks.stall_fs import add_arguments

    add_arguments(ap)
    args = ap.parse_args(argv)
    if args.smoke:
        args.preset, args.prompts, args.hang_seconds = "tiny", 2, 5.0
        args.request_timeout, args.s3_max_attempts = 60.0, 1
    return args


def _stop_on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)  # unwinds the ExitStack: moto resumed, servers stopped


def serve(stack: ExitStack, args: argparse.Namespace, work: Path, model: Path
          ) -> tuple[MotoServer, Any, APIServer, dict[str, Any], list[str]]:
    """The moto endpoint (bucket created) and the API server, stopped by ``stack``; the
    moto process is resumed before the server stops (its shutdown may write to S3)."""
    stack.enter_context(dummy_credentials())
    moto = MotoServer()
    stack.callback(moto.stop)
    endpoint = moto.start()
    import boto3

    s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    s3.create_bucket(Bucket=BUCKET)
    doc, skipped = kvtier_doc(work / "store", endpoint, args)
    for key in skipped:
        print(f"note: this kvtier's config has no {key}; not set")
    cfg = work / "kvtier.yaml"
    cfg.write_text(json.dumps(doc))
    longest = args.prompt_tokens + 2 * args.max_tokens + USER_TOKENS
    max_len = max(2048, -(-longest // 512) * 512)
    server = APIServer(
        work, model=model, name="stall", dtype=args.dtype, max_model_len=max_len,
        kv_transfer_config=kv_transfer_config(cfg),
        num_gpu_blocks_override=max(KV_BLOCKS, max_len // 128 + 8),
        extra_args=["--enable-prompt-tokens-details"],
        extra_env={"VLLM_SERVER_DEV_MODE": "1"})
    stack.callback(server.stop)  # registered before start: a Ctrl-C during start stops it
    stack.callback(moto.resume)
    print(f"model {model}; starting vLLM ...", flush=True)
    server.start()
    return moto, s3, server, doc, skipped


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _stop_on_sigterm)
    if args.hang == "cephfs":
        from benchmarks.stall_fs import run

        return run(args)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    cache = Path(args.cache_dir)
    if args.preset == "tiny":
        model, args.dtype = build_tiny_llama(cache / "tiny-fp32", dtype="float32"), "float32"
    else:
        model, args.dtype = build_bench_llama(cache / "bench-90m"), "bfloat16"
    vocab = int(json.loads((model / "config.json").read_text())["vocab_size"])
    with ExitStack() as stack:
        work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvst-",
                                                                    dir=args.workdir)))
        moto, s3, server, doc, skipped = serve(stack, args, work, model)
        print(f"server up after {time.perf_counter() - t_start:.0f} s", flush=True)
        client = Client(server.url, args.request_timeout, args.max_tokens)
        stack.callback(client.http.close)
        bench = Bench(client, args, vocab)
        bench.prepare()
        print("phases (sequential requests):", flush=True)
        bench.phase("healthy")
        bench.hang(moto)
        bench.phase("recovered")
        probe = bench.s3_probe(work / "store", s3)
    rows = summarise(bench.samples)
    checks = targets(rows, bench.samples, probe)
    report = {"benchmark": "stall", "model": str(model), "settings": vars(args),
              "kvtier_config": doc, "skipped_config_keys": skipped, "phases": bench.spans,
              "rows": rows, "targets": checks, "s3_probe": probe,
              "samples": [asdict(s) for s in bench.samples], "machine": describe(),
              "wall_s": round(time.perf_counter() - t_start, 1)}
    (out / "stall.json").write_text(json.dumps(report, indent=2) + "\n")
    print(table(rows) + "\n\ntargets (issue 10):")
    for c in checks:
        print(f"  {'PASS' if c['pass'] else 'FAIL'}  {c['name']}: {c['value']}")
    wrote = [out / "stall.json"]
    if plot(bench.samples, bench.spans, out / "stall.png"):
        wrote.append(out / "stall.png")
    print(f"wrote {' and '.join(map(str, wrote))} ({report['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
