"""KV capacity a hybrid model keeps with kvtier loaded (issue 19).

vLLM's hybrid KV-cache manager gives a model that mixes sliding-window and full-attention
layers (gpt-oss, Gemma-2/3, Cohere2) one KV-cache group per kind, and frees a
sliding-window layer's blocks once they fall out of its window. A KV connector that does
not declare ``SupportsHMA`` makes vLLM turn that manager off: every layer then keeps KV
for every token. This measures, in real vLLM on this machine, one engine per case, on
the same KV space:

* ``vllm``       no connector (the hybrid manager on: vLLM's own capacity);
* ``kvtier``     kvtier loaded (it declares ``SupportsHMA``: the manager stays on);
* ``kvtier_off`` kvtier loaded with ``disable_hybrid_kv_cache_manager=True``: what
                 loading kvtier did before it declared ``SupportsHMA``.

Per case: the manager's state, the KV-cache groups, the blocks of the KV space, the KV
blocks one request of ``max_model_len`` tokens takes (vLLM's own count, the sum over
groups of ``cdiv(max memory usage, page size)``) and the maximum concurrency at that
length that vLLM reports. The model is a tiny random-weight Gemma-2 shaped like gpt-oss's
attention: layers alternating a 128-token sliding window and full attention.

    python -m benchmarks.hybrid_capacity [--layers 8] [--window 128]
        [--max-model-len 32768] [--max-num-batched-tokens 2048]
        [--out benchmarks/results/hybrid_capacity.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.machine import describe

CASES = ("vllm", "kvtier", "kvtier_off")


def run_case(case: str, model: Path, max_model_len: int, batched: int,
             tmp: Path) -> dict[str, Any]:
    """One engine, in this process (run in a subprocess of its own by ``main``)."""
    os.environ.update({"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "1",
                       "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                       "VLLM_CACHE_ROOT": str(tmp / "cache"),
                       "VLLM_RPC_BASE_PATH": str(tmp / "rpc")})
    from vllm import LLM
    from vllm.v1.core.kv_cache_utils import get_max_concurrency_for_kv_cache_config

    from kvtier.vllm.settings import kv_transfer_config

    kw: dict[str, Any] = {}
    if case != "vllm":
        cfg = tmp / "kvtier.yaml"
        cfg.write_text(json.dumps({"chunk_tokens": 256, "tiers": [  # JSON is YAML
            {"host": {"capacity": "64MiB", "pinned": "no"}},
            {"file": {"path": str(tmp / "store"), "capacity": "1GiB"}}]}))
        kw["kv_transfer_config"] = kv_transfer_config(cfg)
    if case == "kvtier_off":
        kw["disable_hybrid_kv_cache_manager"] = True
    llm = LLM(str(model), dtype="float32", max_model_len=max_model_len, enforce_eager=True,
              block_size=128, max_num_batched_tokens=batched, **kw)
    core = llm.llm_engine.engine_core.engine_core  # type: ignore[attr-defined]
    vcfg, kcfg = core.vllm_config, core.scheduler.kv_cache_config
    per_request = 0
    for g in kcfg.kv_cache_groups:
        spec = g.kv_cache_spec
        per_request += -(-spec.max_memory_usage_bytes(vcfg) // spec.page_size_bytes)
    return {
        "case": case,
        "hybrid_manager": not vcfg.scheduler_config.disable_hybrid_kv_cache_manager,
        "groups": [f"{type(g.kv_cache_spec).__name__}x{len(g.layer_names)}"
                   for g in kcfg.kv_cache_groups],
        "num_blocks": int(kcfg.num_blocks),
        "blocks_per_max_len_request": int(per_request),
        "max_concurrency": round(float(get_max_concurrency_for_kv_cache_config(vcfg, kcfg)),
                                 2),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--window", type=int, default=128)
    p.add_argument("--max-model-len", type=int, default=32768)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="vLLM's prefill chunk: a sliding-window group must hold the window "
                        "plus one chunk (vLLM's default on GPUs)")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/hybrid_capacity.json"))
    p.add_argument("--case", choices=CASES, help=argparse.SUPPRESS)
    p.add_argument("--model", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--tmp", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.case:  # a child: one engine, one JSON line on stdout
        row = run_case(args.case, args.model, args.max_model_len,
                       args.max_num_batched_tokens, args.tmp)
        print("ROW " + json.dumps(row), flush=True)
        return
    from kvtier.testing.models import TinyLlamaSpec, build_from_spec

    with tempfile.TemporaryDirectory(prefix="kvtier-hybcap-") as d:
        root = Path(d)
        model = build_from_spec(root / "model", TinyLlamaSpec(
            arch="gemma2", sliding_window=args.window, layers=args.layers,
            max_pos=args.max_model_len))
        rows = []
        for case in CASES:
            tmp = root / case
            tmp.mkdir()
            out = subprocess.run(
                [sys.executable, "-m", "benchmarks.hybrid_capacity", "--case", case,
                 "--model", str(model), "--tmp", str(tmp),
                 "--max-model-len", str(args.max_model_len),
                 "--max-num-batched-tokens", str(args.max_num_batched_tokens)],
                capture_output=True, text=True, check=False)
            line = next((ln for ln in out.stdout.splitlines() if ln.startswith("ROW ")), None)
            if line is None:
                sys.exit(f"{case} failed:\n{out.stderr[-4000:]}")
            rows.append(json.loads(line[4:]))
            print(rows[-1], flush=True)
    base = rows[0]["max_concurrency"]
    print(f"\n| case | hybrid manager | KV-cache groups | blocks in the KV space | blocks per "
          f"{args.max_model_len}-token request | max concurrency | vs vLLM alone |")
    print("|---|---|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['case']} | {'on' if r['hybrid_manager'] else 'off'} | "
              f"{', '.join(r['groups'])} | {r['num_blocks']} | "
              f"{r['blocks_per_max_len_request']} | {r['max_concurrency']} | "
              f"{r['max_concurrency'] / base:.2f}x |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"machine": describe(), "layers": args.layers,
                                    "window": args.window,
                                    "max_model_len": args.max_model_len,
                                    "max_num_batched_tokens": args.max_num_batched_tokens,
                                    "rows": rows},
                                   indent=1))


if __name__ == "__main__":
    main()
