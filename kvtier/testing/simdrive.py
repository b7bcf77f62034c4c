"""Random workloads for the simulation (``sim.py``), each a function of its seed.

``run_seed`` builds a ``SimWorld`` over one of vLLM's schedulers (``SCHEDULERS``: the
synchronous ``Scheduler`` or the GPU default ``AsyncScheduler``) and plays a workload
that real agent traffic produces: many requests at once on shared new prefixes,
conversations that return with grown histories, histories edited in the middle,
``prompt_logprobs`` requests (vLLM reads no prefix cache for them), tenants'
``cache_salt``, aborts at any step (while staging, during asynchronous loads, while a
save is in flight), vLLM's own prefix cache reset (its hit shrinks between two calls of
the lookup hook), preemption (a small GPU cache), faults of the lower tier (objects
corrupted or deleted under kvtier, reads that hang for a few steps or past every
deadline, writes that fail) and of the workers (copies that fail). After every step it
checks the block-bytes invariant and that no request leaks or stalls
(``check_progress``); at the end, once every request has finished and the world is
idle, that every completed output equals a recompute and nothing kvtier keeps per
request outlived its request (``check_quiescent``). A failure raises ``Violation``
naming the seed, so that ``make soak`` can print it and a test can replay it.
"""

from __future__ import annotations

import os
import random
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvtier.testing.sim import SHAPES, SimWorld, Violation

#: Steps a run may take to drain after its last arrival before it counts as stuck.
DRAIN_STEPS = 600


#: A request vLLM still holds this many steps after it finished or was aborted is
#: leaked (its blocks held for the engine's life); one that made no progress for
#: ``STALL_STEPS`` while unfinished is stalled. Both exceed every kvtier bound the
#: workload configures (a load stall of 0.2 s is 10 steps; a hang lasts at most 40).
LEAK_STEPS = 150
STALL_STEPS = 300

#: vLLM's two schedulers: ``Scheduler`` (synchronous; the CPU platform's) and
#: ``AsyncScheduler`` (vLLM 0.32's default on GPUs: the next step is scheduled before the
#: last one's output is processed). Every seed runs on both.
SCHEDULERS = ("sync", "async")


@dataclass
class SimReport:
    seed: int
    shape: str
    tp: int
    scheduler: str = "sync"
    steps: int = 0
    requests: int = 0
    blocks_checked: int = 0
    restored_tokens: int = 0
    restores: int = 0
    aborts: int = 0
    faults: int = 0
    copy_faults: int = 0
    write_faults: int = 0
    outputs_checked: int = 0
    preemptions: int = 0
    notes: list[str] = field(default_factory=list)


def kvtier_doc(root: Path, *, chunk_tokens: int = 64, host: str = "96KiB",
               write: str = "back") -> dict[str, Any]:
    """A small config: a host pool of a few dozen chunks (the sim's chunks are a few KiB)
    over a file tier, restoring anything (threshold 1 token)."""
    return {
        "chunk_tokens": chunk_tokens,
        "tiers": [{"host": {"capacity": host, "pinned": "no"}},
                  {"file": {"path": str(root / "store"), "capacity": "64MiB",
                            "write": write}}],
        # deadlines of a few steps (the world's clock advances 20 ms a step): a hung
        # tier costs a few steps, then the request recomputes
        "restore": {"recompute_threshold_tokens": 1, "lookup_timeout_seconds": 0.1,
                    "load_timeout_seconds": 0.2},
        "copy_backend": "torch",
    }


def run_seed(root: Path, seed: int, shape: str = "full", *, tp: int = 1,
             arrivals: int = 40, faults: bool = True, scheduler: str = "sync") -> SimReport:
    """Play the workload of ``seed`` on ``shape`` at ``tp`` ranks under vLLM's
    ``scheduler`` (``SCHEDULERS``); ``Violation`` on any broken invariant (its message
    starts with the seed, shape, TP size and scheduler)."""
    if scheduler not in SCHEDULERS:
        raise ValueError(f"scheduler must be one of {SCHEDULERS}, not {scheduler!r}")
    rng = random.Random(seed)
    root.mkdir(parents=True, exist_ok=True)
    groups = len(SHAPES[shape].groups)
    blocks = rng.choice([40, 56, 96])  # per group: a small GPU cache evicts and preempts
    host = rng.choice(["48KiB", "96KiB", "512KiB"]) if tp == 1 else "192KiB"
    doc = kvtier_doc(root, host=host, write=rng.choice(["back", "through"]))
    doc["reset_cache"] = rng.choice(["weights", "host"])
    world = SimWorld(root, SHAPES[shape], doc,
                     tp=tp, num_blocks=blocks * groups,
                     max_num_seqs=rng.choice([4, 8]),
                     max_batched_tokens=rng.choice([128, 256]),
                     async_scheduling=scheduler == "async", tp_skew=True, seed=seed)
    report = SimReport(seed, shape, tp, scheduler)
    where = f"seed {seed} shape {shape} tp {tp} {scheduler}"
    try:
        if faults and rng.random() < 0.5:  # worker copies and lower-tier writes fail
            world.fail_copies(rng.choice([0.01, 0.03]))
            world.fail_writes(rng.choice([0.05, 0.2]))
        _play(world, rng, report, arrivals, faults, max_len=blocks * world.bs * 2 // 3)
        report.outputs_checked = world.check_outputs()
        report.copy_faults, report.write_faults = world.copy_faults, world.write_faults
        report.steps = world.steps
        report.preemptions = world.preemptions
        report.restored_tokens = sum(world.restored.values())
        report.restores = len(world.restored)
        return report
    except Violation as e:
        raise Violation(f"{where}: {e}") from e
    except Exception as e:  # vLLM raised or asserted: the engine would be dead
        raise Violation(f"{where}: step {world.steps} raised "
                        f"{type(e).__name__}: {e}") from e
    finally:
        world.close()


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 500) for _ in range(n)]


def _play(world: SimWorld, rng: random.Random, report: SimReport, arrivals: int,
          faults: bool, max_len: int) -> None:
    prefixes = [_tokens(rng, rng.randrange(70, 200)) for _ in range(3)]
    histories: list[list[int]] = []  # finished conversations' prompt + output
    live: dict[str, list[int]] = {}  # rid -> prompt
    n = 0
    hung_until = 0  # the step the lower tiers answer again (0: they answer)

    progress: dict[str, tuple[Any, int]] = {}  # rid -> (what it had done, since when)
    ended: dict[str, int] = {}  # rid -> the step it finished or was aborted

    def step(k: int) -> None:
        for _ in range(k):
            world.step()
            report.blocks_checked += world.check_blocks()
            check_step(world)
            for rid in list(live):
                if rid in world.finished:
                    prompt = live.pop(rid)
                    ended[rid] = world.steps
                    histories.append(prompt + world.outputs.get(rid, []))
            check_progress(world, live, ended, progress)

    for _ in range(arrivals):
        if hung_until and world.steps >= hung_until:
            world.unhang()
            hung_until = 0
        action = rng.choices(
            ["new", "return", "return", "edit", "logprobs", "burst", "abort", "reset",
             "fault", "hang"],
            weights=[3, 4, 4, 1, 1, 1, 2, 1, 1 if faults else 0,
                     1 if faults and not hung_until else 0])[0]
        if action in ("return", "edit", "logprobs") and not histories:
            action = "new"
        kwargs: dict[str, Any] = {}
        if action == "new":
            prompt = rng.choice(prefixes) + _tokens(rng, rng.randrange(1, 150))
        elif action == "burst":  # a swarm on a new shared prefix
            shared = _tokens(rng, rng.randrange(100, 260))
            for _ in range(rng.randrange(2, 5)):
                rid = f"r{n}"
                n += 1
                live[rid] = (shared + _tokens(rng, rng.randrange(1, 40)))[:max_len]
                world.add(rid, live[rid], max_tokens=rng.randrange(1, 6))
                report.requests += 1
            step(rng.randrange(0, 4))
            continue
        elif action == "abort":
            if live:
                # half the time, one vLLM holds in a transfer state: staging, an
                # asynchronous load, a save in flight
                odd = sorted(r for r in live if r in world.scheduler.requests and
                             world.scheduler.requests[r].status.name != "RUNNING")
                rid = rng.choice(odd if odd and rng.random() < 0.5 else sorted(live))
                world.abort(rid)
                live.pop(rid)
                ended[rid] = world.steps
                report.aborts += 1
            step(rng.randrange(0, 3))
            continue
        elif action == "reset":
            # vLLM's own cache (its hits shrink), and now and then kvtier's too
            # (``reset_cache``: a new weights epoch, or the host tier emptied)
            world.scheduler.reset_prefix_cache(reset_connector=rng.random() < 0.3)
            step(rng.randrange(0, 3))
            continue
        elif action == "fault":
            report.faults += _damage(world, rng)
            step(rng.randrange(0, 3))
            continue
        elif action == "hang":  # the lower tiers stop answering for a while
            world.hang_reads()
            # a few steps (reads pending across step boundaries), or long enough for
            # every deadline to run out
            hung_until = world.steps + rng.choice([rng.randrange(1, 4), rng.randrange(5, 40)])
            report.faults += 1
            step(rng.randrange(0, 3))
            continue
        else:
            hist = rng.choice(histories)
            prompt = hist + _tokens(rng, rng.randrange(1, 120))
            if action == "edit":
                at = rng.randrange(len(hist))
                prompt[at] = 3 + (prompt[at] + 1) % 497
            if action == "logprobs":
                kwargs["prompt_logprobs"] = 1
        if rng.random() < 0.15:
            kwargs["cache_salt"] = rng.choice(["tenant-a", "tenant-b"])
        prompt = prompt[:max_len]
        rid = f"r{n}"
        n += 1
        live[rid] = prompt
        # some decode long: more requests run at once, and a small cache preempts
        out = rng.randrange(1, 8) if rng.random() < 0.7 else rng.randrange(16, 64)
        world.add(rid, prompt, max_tokens=out, **kwargs)
        report.requests += 1
        step(rng.randrange(0, 6))
    world.unhang()
    for _ in range(DRAIN_STEPS):
        if world.idle and not world.connector.scheduler_side.has_pending_saves():
            break
        step(1)
    else:
        side = world.connector.scheduler_side
        stuck = sorted(
            (r.request_id, r.status.name, f"{r.num_computed_tokens}/{r.num_tokens} computed",
             f"{len(world.outputs.get(r.request_id, []))}/{r.max_tokens} out",
             f"{r.num_preemptions} preemptions")
            for r in world.scheduler.requests.values())
        raise Violation(f"not idle after {DRAIN_STEPS} drain steps: {stuck[:6]}; "
                        f"{world.preemptions} preemptions, save streams "
                        f"{sorted(side._save_streams)}, streams {sorted(side._streams)}, "
                        f"{side.store.host.index.num_held()} host slots held")
    check_quiescent(world)


def check_progress(world: SimWorld, live: dict[str, list[int]], ended: dict[str, int],
                   progress: dict[str, tuple[Any, int]]) -> None:
    """After every step: no request vLLM still holds ``LEAK_STEPS`` after it finished
    or was aborted (kvtier holding its load or its free forever: the engine never goes
    idle, its blocks never come back); no request waiting for kvtier's load
    (``WAITING_FOR_REMOTE_KVS``) for ``STALL_STEPS``; and no ``STALL_STEPS`` in which no
    request made progress while some were unfinished (a request queued behind others in
    a small cache waits as long as they take: that alone is not a stall)."""
    sched = world.scheduler
    for rid, at in list(ended.items()):
        if rid not in sched.requests:
            del ended[rid]
        elif world.steps - at > LEAK_STEPS:
            raise Violation(f"step {world.steps}: request {rid} ended at step {at} and "
                            f"vLLM still holds it ({sched.requests[rid].status.name})")
    moved = False
    for rid in live:
        req = sched.requests.get(rid)
        if req is None:
            continue
        now = (req.status.name, req.num_computed_tokens, len(world.outputs.get(rid, [])))
        seen = progress.get(rid)
        if seen is None or seen[0] != now:
            progress[rid] = (now, world.steps)
            moved = True
        elif now[0] == "WAITING_FOR_REMOTE_KVS" and world.steps - seen[1] > STALL_STEPS:
            raise Violation(f"step {world.steps}: request {rid} waited {STALL_STEPS} steps "
                            f"for kvtier's load ({now[1]} tokens computed)")
    last = progress.get("", ((), world.steps))[1]
    if moved or not any(r in sched.requests for r in live):
        progress[""] = ((), world.steps)
    elif world.steps - last > STALL_STEPS:
        raise Violation(f"step {world.steps}: no request made progress for {STALL_STEPS} "
                        f"steps ({len(sched.requests)} held by vLLM)")


def _damage(world: SimWorld, rng: random.Random) -> int:
    """Corrupt or delete one object of the file tier under kvtier (another node, a bad
    disk): a restore that reads it must fail cleanly and recompute."""
    store = world.root / "store"
    files = sorted(p for p in store.rglob("*.kv")) if store.exists() else []
    if not files:
        return 0
    victim = rng.choice(files)
    if rng.random() < 0.5:
        victim.unlink(missing_ok=True)
    else:
        data = bytearray(victim.read_bytes())
        if data:
            at = rng.randrange(len(data))
            data[at] ^= 0x5A
            tmp = victim.with_name(victim.name + ".sim")
            tmp.write_bytes(bytes(data))
            os.replace(tmp, victim)
    return 1


def check_step(world: SimWorld) -> None:
    """After every step: kvtier stages host chunks only for requests vLLM has not
    admitted; a request vLLM runs (it took another answer, e.g. ``prompt_logprobs``: it
    reads no prefix cache) holds no staging."""
    side = world.connector.scheduler_side
    for rid, lk in side._lookups.items():
        req = world.scheduler.requests.get(rid)
        if req is None:
            raise Violation(f"step {world.steps}: staging of finished request {rid} kept")
        if req.status.name == "RUNNING" and (lk.held is not None or lk.future is not None):
            raise Violation(f"step {world.steps}: request {rid} runs and still holds "
                            f"{lk.chunks} staged host chunks")


def _wait_released(side: Any, seconds: float = 10.0) -> None:
    """Reads abandoned at their deadline release their slots when they return (on IO
    threads, after ``unhang``): wait for that, in real time, boundedly."""
    import time

    end = time.monotonic() + seconds
    while side.store.host.index.num_held() and time.monotonic() < end:
        time.sleep(0.01)


def check_quiescent(world: SimWorld) -> None:
    """Once every request finished: nothing per request outlives it, no host slot is
    held, and vLLM has every block back."""
    side = world.connector.scheduler_side
    world.deliver_reports()
    side.store.flush(10.0)
    _wait_released(side)
    left = {name: len(getattr(side, name)) for name in (
        "_lookups", "_saves", "_probes", "_tail_probes", "_waiting", "_decisions", "_async_blocks",
        "_key_cache", "_epoch_of", "_restored", "_failed_saves", "_loads", "_to_save",
        "_streams", "_save_streams", "_recving", "_load_failed", "_capped", "_cap_since",
        "_save_acks", "_load_acks", "_load_holds", "_async_reqs", "_unconfirmed")}
    left = {k: v for k, v in left.items() if v}
    if left:
        raise Violation(f"per-request state outlived its requests: {left}")
    for rank, conn in enumerate(world.workers):
        kept = {k: v for k, v in conn.worker_side.held().items() if v}
        if kept:
            raise Violation(f"rank {rank}'s worker side still holds {kept}")
    held = side.store.host.index.num_held()
    if held:
        raise Violation(f"{held} host slot holds outstanding at quiescence")
    # steps whose holds were never released (a rank that never acknowledged)
    stale = {s for s in side._holds_by_step if s < world.steps - 2}
    if stale:
        raise Violation(f"loads of steps {sorted(stale)[:5]} never acknowledged by every rank")
    bp = world.scheduler.kv_cache_manager.block_pool
    if bp.get_num_free_blocks() != bp.num_gpu_blocks - 1:
        raise Violation(f"vLLM has {bp.get_num_free_blocks()} of {bp.num_gpu_blocks - 1} "
                        "blocks free at quiescence")


def main(argv: list[str] | None = None) -> int:
    """``make soak SECONDS=N``: random seeds over every shape and TP=2 for N seconds;
    prints each run, and the seed, shape and TP size of the first failure (replay it with
    ``run_seed``; a failure found this way becomes a named regression test)."""
    import argparse
    import logging
    import tempfile
    import time

    ap = argparse.ArgumentParser(prog="python -m kvtier.testing.simdrive")
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--seed", type=int, default=None, help="first seed (default: random)")
    ap.add_argument("--arrivals", type=int, default=40)
    args = ap.parse_args(argv)
    logging.disable(logging.WARNING)
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**31)
    cases = [(shape, tp, sched) for shape, tp in (
        ("full", 1), ("window", 1), ("hybrid", 1), ("chunked", 1), ("mla", 1), ("full", 2),
        ("hybrid", 2)) for sched in SCHEDULERS]
    deadline = time.monotonic() + args.seconds
    runs = steps = requests = blocks = restored = outputs = 0
    with tempfile.TemporaryDirectory(prefix="kvtier-soak-") as tmp:
        while time.monotonic() < deadline:
            shape, tp, sched = cases[runs % len(cases)]
            where = Path(tmp) / f"s{seed}-{shape}-{tp}-{sched}"
            try:
                r = run_seed(where, seed, shape, tp=tp, arrivals=args.arrivals,
                             scheduler=sched)
            except Violation as e:
                print(f"FAIL after {runs} runs: {e}", flush=True)
                return 1
            shutil.rmtree(where, ignore_errors=True)
            runs += 1
            steps += r.steps
            requests += r.requests
            blocks += r.blocks_checked
            restored += r.restored_tokens
            outputs += r.outputs_checked
            print(f"seed {seed} {shape} tp{tp} {sched}: {r.steps} steps, {r.requests} "
                  f"requests, {r.restores} restores ({r.restored_tokens} tokens), "
                  f"{r.aborts} aborts, {r.preemptions} preemptions, {r.faults} faults, "
                  f"{r.copy_faults} copy and {r.write_faults} write failures, "
                  f"{r.outputs_checked} outputs equal a recompute", flush=True)
            if runs % len(cases) == 0:
                seed += 1
    print(f"soak: {runs} runs, {steps} steps, {requests} requests, {blocks} blocks "
          f"checked, {outputs} outputs compared, {restored} tokens restored: no violation",
          flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
