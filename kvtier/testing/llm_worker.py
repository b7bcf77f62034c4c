"""A long-lived offline vLLM engine driven by JSON lines on stdin/stdout.

Run as ``python -m kvtier.testing.llm_worker '<engine kwargs as JSON>'``. The JSON object
is passed to ``vllm.LLM(**kwargs)`` (``kv_transfer_config`` may be a dict). Use
:class:`kvtier.testing.engines.LLMWorker` rather than talking to it by hand.

Protocol (one JSON object per line; the worker answers every request with one line):

* On start the worker prints ``{"event": "ready", "startup_s": float, "pid": int,
  "vllm_version": str}``, or ``{"event": "error", "error": str}`` and exits.
* ``{"op": "generate", "prompts": [[int, ...], ...], "max_tokens": int,
  "reset_prefix_cache": bool, "ignore_eos": bool, "temperature": float,
  "kv_transfer_params": [dict | null, ...], "cache_salt": [str | null, ...],
  "lora": [{"name": str, "id": int, "path": str} | null, ...]}``
  answers ``{"ok": true, "reset_ok": bool | null, "elapsed_s": float, "outputs": [...]}``
  with one output per prompt, in order: ``{"token_ids": [...], "num_cached_tokens": int,
  "num_prompt_tokens": int, "finish_reason": str, "kv_transfer_params": dict | null,
  "ttft_s": float | null}``. Greedy (temperature 0) and ``ignore_eos`` true by default.
  ``reset_prefix_cache`` runs ``LLM.reset_prefix_cache()`` before the batch.
* ``{"op": "reset_prefix_cache", "reset_connector": bool}`` answers ``{"ok": true,
  "reset_ok": bool}``.
* ``{"op": "ping"}`` answers ``{"ok": true}``.
* ``{"op": "shutdown"}`` answers ``{"ok": true}``, shuts the engine down and exits 0.

Any failure answers ``{"ok": false, "error": str}`` and the worker keeps serving. The
protocol uses a private copy of the original stdout; file descriptor 1 is pointed at
stderr before vLLM is imported, so vLLM's logs (and its engine subprocesses' logs) can
never corrupt the protocol stream.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from typing import IO, Any


def _protocol_stream() -> IO[str]:
    proto_fd = os.dup(1)  # non-inheritable: engine subprocesses never see it
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return os.fdopen(proto_fd, "w", buffering=1)


def _send(out: IO[str], obj: dict[str, Any]) -> None:
    out.write(json.dumps(obj) + "\n")
    out.flush()


def _generate(llm: Any, req: dict[str, Any]) -> dict[str, Any]:
    from vllm import SamplingParams

    prompts = req["prompts"]
    if not isinstance(prompts, list) or not all(isinstance(p, list) for p in prompts):
        raise ValueError("prompts must be a list of token-id lists")
    n = len(prompts)
    kv_params = req.get("kv_transfer_params") or [None] * n
    salts = req.get("cache_salt") or [None] * n
    loras = req.get("lora") or [None] * n
    if len(kv_params) != n or len(salts) != n or len(loras) != n:
        raise ValueError("kv_transfer_params, cache_salt and lora need one entry per prompt")
    reset_ok = None
    if req.get("reset_prefix_cache", False):
        reset_ok = bool(llm.reset_prefix_cache())
    params = []
    for kvp in kv_params:
        extra = {"kv_transfer_params": kvp} if kvp is not None else None
        params.append(
            SamplingParams(
                max_tokens=int(req.get("max_tokens", 16)),
                temperature=float(req.get("temperature", 0.0)),
                ignore_eos=bool(req.get("ignore_eos", True)),
                seed=req.get("seed"),
                extra_args=extra,
            )
        )
    inputs = []
    for ids, salt in zip(prompts, salts, strict=True):
        item: dict[str, Any] = {"prompt_token_ids": [int(t) for t in ids]}
        if salt is not None:
            item["cache_salt"] = salt
        inputs.append(item)
    lora_requests = None
    if any(lr is not None for lr in loras):
        from vllm.lora.request import LoRARequest

        lora_requests = [
            None if lr is None else LoRARequest(str(lr["name"]), int(lr["id"]), str(lr["path"]))
            for lr in loras
        ]
    t0 = time.perf_counter()
    results = llm.generate(inputs, params, use_tqdm=False, lora_request=lora_requests)
    elapsed = time.perf_counter() - t0
    outputs = []
    for res in results:
        comp = res.outputs[0]
        ttft = None
        metrics: Any = getattr(res, "metrics", None)
        latency = getattr(metrics, "first_token_latency", None)
        if latency:  # only set when the engine logs stats
            ttft = float(latency)
        outputs.append(
            {
                "token_ids": [int(t) for t in comp.token_ids],
                "num_cached_tokens": int(res.num_cached_tokens or 0),
                "num_prompt_tokens": len(res.prompt_token_ids or []),
                "finish_reason": comp.finish_reason,
                "kv_transfer_params": res.kv_transfer_params,
                "ttft_s": ttft,
            }
        )
    return {"ok": True, "reset_ok": reset_ok, "elapsed_s": elapsed, "outputs": outputs}


def main(argv: list[str]) -> int:
    out = _protocol_stream()
    try:
        kwargs = json.loads(argv[1]) if len(argv) > 1 else {}
        if not isinstance(kwargs, dict):
            raise ValueError("engine kwargs must be a JSON object")
        t0 = time.perf_counter()
        import vllm
        from vllm import LLM

        llm = LLM(**kwargs)
        startup = time.perf_counter() - t0
    except Exception as exc:
        traceback.print_exc()
        _send(out, {"event": "error", "error": f"{type(exc).__name__}: {exc}"})
        return 1
    _send(
        out,
        {
            "event": "ready",
            "startup_s": startup,
            "pid": os.getpid(),
            "vllm_version": vllm.__version__,
        },
    )

    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            req = json.loads(line)
            op = req.get("op", "generate")
            if op == "generate":
                resp = _generate(llm, req)
            elif op == "reset_prefix_cache":
                ok = llm.reset_prefix_cache(reset_connector=bool(req.get("reset_connector", False)))
                resp = {"ok": True, "reset_ok": bool(ok)}
            elif op == "ping":
                resp = {"ok": True}
            elif op == "shutdown":
                _send(out, {"ok": True})
                break
            else:
                raise ValueError(f"unknown op {op!r}")
        except Exception as exc:
            traceback.print_exc()
            resp = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        _send(out, resp)

    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:
        traceback.print_exc()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
