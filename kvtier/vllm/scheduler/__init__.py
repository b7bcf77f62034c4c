"""kvtier's scheduler side, in rooms by job (``scheduler_side.SchedulerSide`` is all of them).

One per-engine state (``state.py``) and one mixin per job over it, each small enough to
read at once:

* ``shapes.py``: the model's shape (whole chunks, a sliding window, a hybrid model's
  groups), read from the geometry once: which start, loads and finish the hooks take;
* ``keys.py``: a request's identity and keys (chunks, tails, window parts, hybrid
  pieces) and what each stored object must be (specs, metas);
* ``lookup.py``: ``get_num_new_matched_tokens``, where a returning request's restore
  starts (what vLLM may be told); ``starts.py``: the per-shape start of the staging
  (chunks, a sliding window, a hybrid prefix); ``probes.py``: the lower tiers' probes
  and the P/D announcements it waits for;
* ``load.py``: ``update_state_after_alloc``, the staged KV turned into copy ops
  (streamed restores: ``kvtier.vllm.stream``);
* ``finish.py``: ``request_finished`` (the eviction hook) and the response's
  ``kv_transfer_params``; ``save.py``: what a finishing request saves and announces;
* ``steps.py``: the step's metadata and the worker's reports (acks, failures,
  releases);
* ``shutdown.py``: reset and engine shutdown;
* ``records.py``: the per-request records and the rooms' constants.
"""
