"""GPU check of the worker's copy engine (``kvtier.ops.stepcopy.StepCopier``), without vLLM.

What the connector's worker runs each step, on a real CUDA device, with KV caches in the
two layouts vLLM's CUDA backends declare per layer:

* FlashAttention ``(2, num_blocks, block_size, kv_heads, head_size)``: two outer rows,
  so a partial chunk is two pieces per layer;
* FlashInfer ``(num_blocks, 2, block_size, kv_heads, head_size)``: one piece.

Checks and measurements (one JSON document on stdout and in ``--out``):

1. ``round_trip``: saves (``start_saves``) of whole chunks into a pinned host pool, the
   blocks wiped, then loads (``start_loads`` + ``wait_layer`` per layer + ``finish``) of
   whole and partial chunks (``first != 0``, fewer blocks) into other blocks; every
   byte compared with the torch reference (the original blocks), for each CUDA strategy
   (``memcpy``: DMA engines; ``kernel``: SMs over mapped pinned memory) and layout.
2. ``bandwidth``: a step's loads and saves through ``StepCopier`` as a fraction of one
   ``cudaMemcpyAsync`` of the same bytes from/to pinned memory (torch ``copy_``).
3. ``overlap``: a layer-wise load against a matmul per layer on the compute stream.
   ``serial``: all loads complete, then the matmuls; ``pipelined``: ``wait_layer(i)``
   then layer ``i``'s matmul, as vLLM's forward does. Overlap works when ``pipelined``
   is near ``max(copy, compute)`` rather than their sum.
4. ``sampling``: a step's sampling (a small matmul on the compute stream) enqueued
   while an asynchronous restore's copies run must not wait for them (FAIL if it takes
   more than half the copy's time); after a synchronous load it does.

On a machine without CUDA it prints ``no CUDA device`` and exits 0 (nothing to check).
Run it through ``benchmarks/gpu_check.sh`` (which builds ``kvtier._C`` first), or alone:
``python benchmarks/gpu_worker_check.py --out /tmp/worker.json``. About a minute on an
H200.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvtier.ops import CopyBackend, CudaStrategy, KVLayout, native_status, resolve_copy_backend
from kvtier.ops.stepcopy import SaveFailed, StepCopier


@dataclass(frozen=True)
class Model:
    """A Llama-3-8B-like KV cache: the sizes that set the copy pattern."""

    layers: int = 32
    kv_heads: int = 8
    head_size: int = 128
    block_size: int = 16
    blocks_per_chunk: int = 16  # 256-token chunks
    num_blocks: int = 2048
    slots: int = 24
    dtype: torch.dtype = torch.bfloat16
    device: str = "cuda"


def layouts(m: Model) -> dict[str, KVLayout]:
    nb, bs, h, hs = m.num_blocks, m.block_size, m.kv_heads, m.head_size
    return {
        "flash_attn": KVLayout((2, nb, bs, h, hs), (0, 1, 2, 3, 4), 1, m.dtype),
        "flashinfer": KVLayout((nb, 2, bs, h, hs), (0, 1, 2, 3, 4), 0, m.dtype),
    }


class Op:
    """A chunk copy: ``block_ids[i]`` is chunk block ``first + i`` of ``slot``, which
    holds ``span`` blocks (0: a whole chunk)."""

    def __init__(self, slot: int, block_ids: list[int], first: int = 0, span: int = 0) -> None:
        self.slot, self.block_ids, self.first, self.span = slot, block_ids, first, span


@dataclass
class Rig:
    layout: KVLayout
    caches: list[torch.Tensor]
    copier: StepCopier


def make_rig(m: Model, layout: KVLayout, backend: CopyBackend, pool: torch.Tensor) -> Rig:
    caches = [torch.randn(layout.shape, device=m.device).to(m.dtype) for _ in range(m.layers)]
    views = [layout.block_view(c) for c in caches]
    slot_bytes = layout.chunk_bytes(m.layers, m.blocks_per_chunk)
    copier = StepCopier(backend, views, pool, slot_bytes, m.blocks_per_chunk, m.layers)
    return Rig(layout, caches, copier)


def block(rig: Rig, layer: int, b: int) -> torch.Tensor:
    return rig.caches[layer].select(rig.layout.block_dim, b)


def saves_for(m: Model, chunks: int) -> list[Op]:
    bpc = m.blocks_per_chunk
    return [Op(s, list(range(s * bpc, (s + 1) * bpc))) for s in range(chunks)]


def wait_all(handles: list[Any]) -> None:
    for h in handles:
        if isinstance(h, SaveFailed):
            raise h.error
        h.wait()


def round_trip(m: Model, rig: Rig) -> dict[str, Any]:
    """Saves 4 chunks, wipes their blocks' destinations, loads whole and partial chunks."""
    bpc, base = m.blocks_per_chunk, 8 * m.blocks_per_chunk
    wait_all(rig.copier.start_saves(saves_for(m, 4)))
    expected: dict[int, int] = {}  # destination block -> source block
    loads = [Op(0, list(range(base, base + bpc)))]  # whole
    expected.update({base + i: i for i in range(bpc)})
    mid, n = max(1, bpc // 4), max(1, bpc // 2)  # vLLM's own hit ends mid-chunk
    loads.append(Op(1, [base + bpc + i for i in range(n)], first=mid))
    expected.update({base + bpc + i: bpc + mid + i for i in range(n)})
    loads.append(Op(2, [base + 2 * bpc + i for i in range(bpc - 1)]))  # a prompt's last chunk
    expected.update({base + 2 * bpc + i: 2 * bpc + i for i in range(bpc - 1)})
    loads.append(Op(3, [base + 3 * bpc], first=bpc - 1))  # one block, the last
    expected[base + 3 * bpc] = 3 * bpc + bpc - 1
    orig = [torch.stack([block(rig, layer, s) for s in expected.values()]).clone()
            for layer in range(m.layers)]
    dst = torch.tensor(list(expected), device=m.device)
    for c in rig.caches:
        c.index_fill_(rig.layout.block_dim, dst, 0)
    step = rig.copier.start_loads(loads)
    bad_layers = []
    for layer in range(m.layers):
        step.wait_layer(layer)
        got = torch.stack([block(rig, layer, d) for d in expected])  # on the compute stream
        if not torch.equal(got, orig[layer]):
            bad_layers.append(layer)
    skipped = step.finish()
    sync()
    return {"ok": not bad_layers and not skipped and step.done() and not step.failed_blocks(),
            "bad_layers": bad_layers, "blocks": len(expected), "ops": len(loads)}


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fns: dict[str, Callable[[], object]], reps: int) -> dict[str, float]:
    """Median seconds of each (round robin, one warm-up dropped, synchronized)."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(reps + 1):
        for k, fn in fns.items():
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v[1:]) for k, v in times.items()}


def bandwidth(m: Model, rig: Rig, pool: torch.Tensor, chunks: int, reps: int) -> dict[str, Any]:
    """A step of ``chunks`` whole-chunk saves, then of loads, vs one contiguous copy."""
    saves = saves_for(m, chunks)
    bpc = m.blocks_per_chunk
    loads = [Op(s, list(range((chunks + s) * bpc, (chunks + s + 1) * bpc)))
             for s in range(chunks)]
    nbytes = chunks * rig.copier.slot_bytes
    host = pool[:nbytes]
    dev = torch.empty(nbytes, dtype=torch.uint8, device=m.device)

    def load() -> None:
        step = rig.copier.start_loads(loads)
        step.finish()

    secs = timed({
        "save": lambda: wait_all(rig.copier.start_saves(saves)),
        "load": load,
        "memcpy_d2h": lambda: host.copy_(dev, non_blocking=True),
        "memcpy_h2d": lambda: dev.copy_(host, non_blocking=True),
    }, reps)
    gbps = {k: nbytes / v / 1e9 for k, v in secs.items()}
    return {"bytes": nbytes, "gbps": gbps,
            "save_vs_memcpy": gbps["save"] / gbps["memcpy_d2h"],
            "load_vs_memcpy": gbps["load"] / gbps["memcpy_h2d"]}


def overlap(m: Model, rig: Rig, chunks: int, reps: int) -> dict[str, Any]:
    """Layer-wise load vs a matmul per layer, sized to about one layer's copy time."""
    bpc = m.blocks_per_chunk
    loads = [Op(s, list(range((chunks + s) * bpc, (chunks + s + 1) * bpc)))
             for s in range(chunks)]

    def copy_only() -> None:
        rig.copier.start_loads(loads).finish()

    layer_copy_s = timed({"c": copy_only}, reps)["c"] / m.layers
    n = 4096 if m.device == "cuda" else 64  # ~0.2 ms in bf16 on an H100/H200
    a = torch.randn(n, n, device=m.device, dtype=m.dtype)
    per_mm = timed({"mm": lambda: a @ a}, reps)["mm"]
    mms = max(1, round(layer_copy_s / per_mm))

    def compute_layer() -> None:
        for _ in range(mms):
            torch.mm(a, a)

    def compute_only() -> None:
        for _ in range(m.layers):
            compute_layer()

    def serial() -> None:
        rig.copier.start_loads(loads).finish()
        compute_only()

    def pipelined() -> None:
        step = rig.copier.start_loads(loads)
        for layer in range(m.layers):
            step.wait_layer(layer)
            compute_layer()
        step.finish()

    secs = timed({"copy": copy_only, "compute": compute_only, "serial": serial,
                  "pipelined": pipelined}, reps)
    ideal = max(secs["copy"], secs["compute"])
    return {"seconds": secs, "matmuls_per_layer": mms,
            "pipelined_vs_serial": secs["pipelined"] / secs["serial"],
            "pipelined_vs_ideal": secs["pipelined"] / ideal,
            "overlaps": secs["pipelined"] < 0.8 * secs["serial"]}


def sampling_wait(m: Model, rig: Rig, chunks: int, reps: int) -> dict[str, Any]:
    """A step's sampling while an asynchronous restore is in flight (a streamed or hybrid
    restore: its request is not in the forward). The worker issues such loads whole and
    orders nothing after them (``LayerLoads.issue_all``), so a kernel enqueued on the
    compute stream next (the step's logits and sampling) must not wait for their copies;
    a synchronous load's ``finish`` does order the compute stream after them. Measured:
    the time from enqueueing a small matmul to its completion after each. On the CPU the
    copies complete in the call: the smoke checks the path, not the timing."""
    bpc = m.blocks_per_chunk
    loads = [Op(s, list(range((chunks + s) * bpc, (chunks + s + 1) * bpc)))
             for s in range(chunks)]
    n = 512 if m.device == "cuda" else 16
    x = torch.randn(n, n, device=m.device, dtype=m.dtype)

    def sampling_after(asynchronous: bool) -> float:
        sync()
        step = rig.copier.start_loads(loads)
        if asynchronous:
            step.issue_all()
        else:
            step.finish()
        t0 = time.perf_counter()
        torch.mm(x, x)
        if m.device == "cuda":
            torch.cuda.current_stream().synchronize()
        dt = time.perf_counter() - t0
        sync()  # the copies too, before the next run
        assert step.done()
        return dt

    copy_s = timed({"copy": lambda: rig.copier.start_loads(loads).finish()}, reps)["copy"]
    after_async = statistics.median(sampling_after(True) for _ in range(reps))
    after_sync = statistics.median(sampling_after(False) for _ in range(reps))
    waits = m.device == "cuda" and after_async > 0.5 * copy_s
    return {"copy_s": copy_s, "sampling_after_async_load_s": after_async,
            "sampling_after_sync_load_s": after_sync, "sampling_waits_for_async": waits}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--chunks", type=int, default=16, help="chunks per timed step")
    p.add_argument("--cpu-smoke", action="store_true",
                   help="a small model on the CPU: checks this script, measures nothing")
    a = p.parse_args(argv)
    if a.cpu_smoke:
        m = Model(layers=3, kv_heads=2, head_size=8, block_size=4, blocks_per_chunk=4,
                  num_blocks=64, slots=8, dtype=torch.float32, device="cpu")
    elif torch.cuda.is_available():
        m = Model()
    else:
        print("gpu_worker_check: no CUDA device (torch.cuda.is_available() is False); "
              "nothing to check")
        return 0
    status = native_status()
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if m.device == "cuda" else "cpu",
        "torch": torch.__version__, "native": status.detail,
        "model": {"layers": m.layers, "kv_heads": m.kv_heads, "head_size": m.head_size,
                  "block_size": m.block_size, "blocks_per_chunk": m.blocks_per_chunk,
                  "dtype": str(m.dtype)},
        "runs": {},
    }
    backends = {"torch": resolve_copy_backend("torch")}
    if status.available and (status.has_cuda or m.device == "cpu"):
        strategies: tuple[CudaStrategy, ...] = ("memcpy", "kernel")
        for s in strategies if m.device == "cuda" else ("auto",):
            backends[f"native-{s}"] = resolve_copy_backend("native", cuda_strategy=s)
    ok = True
    for lname, layout in layouts(m).items():
        slot_bytes = layout.chunk_bytes(m.layers, m.blocks_per_chunk)
        alloc = resolve_copy_backend("torch").alloc_pinned(m.slots * slot_bytes)
        if m.device == "cuda" and not alloc.is_pinned:
            print("gpu_worker_check: the host pool could not be pinned", file=sys.stderr)
            return 1
        for bname, backend in backends.items():
            t0 = time.perf_counter()
            rig = make_rig(m, layout, backend, alloc.tensor)
            run: dict[str, Any] = {"round_trip": round_trip(m, rig)}
            ok = ok and bool(run["round_trip"]["ok"])
            if bname != "torch":
                chunks = min(a.chunks, m.slots, m.num_blocks // (2 * m.blocks_per_chunk))
                run["bandwidth"] = bandwidth(m, rig, alloc.tensor, chunks, a.reps)
                run["overlap"] = overlap(m, rig, chunks, a.reps)
                run["sampling"] = sampling_wait(m, rig, chunks, a.reps)
                ok = ok and not run["sampling"]["sampling_waits_for_async"]
            run["seconds"] = round(time.perf_counter() - t0, 1)
            result["runs"][f"{lname}/{bname}"] = run
            print(f"{lname:10s} {bname:14s} {json.dumps(run)}", flush=True)
            del rig
            if m.device == "cuda":
                torch.cuda.empty_cache()
        del alloc
    result["ok"] = ok
    text = json.dumps(result, indent=2)
    print(text)
    if a.out is not None:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(text + "\n")
    print(f"gpu_worker_check: {'PASS' if ok else 'FAIL'} (round trips, sampling beside "
          "asynchronous restores)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
