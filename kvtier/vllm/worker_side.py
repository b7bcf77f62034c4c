"""Worker side of the connector: the bytes. Owns the KV cache views and the host pool.

It creates the shared host pool (see ``shm.py``), and each step executes the scheduler's
``CopyOp``s with the copy backend (``copy_backend``: native ops or the torch reference):
loads (host slot -> KV blocks) before the forward pass, saves (KV blocks -> host slot)
for finished requests whose blocks vLLM keeps allocated until we report them.

Invariants: the layout comes from the attention backend's declaration
(``kvtier.ops.layout_from_backend``), never from probing; the chunk size it implies must
equal the scheduler's, or start-up fails. A copy that raises is reported (load errors
make vLLM recompute those blocks; failed saves are never committed).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from kvtier.config import KVTierConfig
from kvtier.ops import CopyBackend, KVLayout, layout_from_backend, resolve_copy_backend
from kvtier.ops.reference import register_pinned
from kvtier.tiers.base import TierError
from kvtier.tiers.pool import PINNED_UNAVAILABLE
from kvtier.vllm.geometry import Geometry
from kvtier.vllm.protocol import CopyOp, KVTierMetadata, KVTierWorkerMetadata
from kvtier.vllm.shm import create_pool, remove_pool

log = logging.getLogger("kvtier.vllm")


class WorkerSide:
    def __init__(
        self, cfg: KVTierConfig, geometry: Geometry, layer_names: list[str], pool_path: Any
    ) -> None:
        self.cfg = cfg
        self.geom = geometry
        self.layer_names = layer_names
        self.pool_path = pool_path
        self.bpc = geometry.blocks_per_chunk(cfg.chunk_tokens)
        self.backend: CopyBackend = resolve_copy_backend(cfg.copy_backend)
        self.views: list[torch.Tensor] = []
        self.slot_bytes = 0
        self._pool_map: Any = None
        self.pool: torch.Tensor | None = None
        self._saved: set[str] = set()
        self._failed_saves: set[str] = set()
        self._loaded_steps: list[int] = []
        self._load_errors: set[int] = set()

    def register(
        self,
        kv_caches: dict[str, torch.Tensor],
        backend_cls: Any,
        kv_cache_layout: Any,
        num_blocks: int,
    ) -> None:
        missing = [n for n in self.layer_names if n not in kv_caches]
        if missing:
            raise TierError(f"kvtier: KV caches missing for layers {missing[:3]}")
        first = kv_caches[self.layer_names[0]]
        layout: KVLayout = layout_from_backend(
            backend_cls,
            num_blocks=num_blocks,
            block_size=self.geom.block_size,
            num_kv_heads=self.geom.num_kv_heads,
            head_size=self.geom.head_size,
            dtype=first.dtype,
            kv_cache_layout=kv_cache_layout,
        )
        self.views = [layout.block_view(kv_caches[n]) for n in self.layer_names]
        self.slot_bytes = layout.chunk_bytes(len(self.views), self.bpc)
        expected = self.geom.chunk_bytes(self.cfg.chunk_tokens)
        if self.slot_bytes != expected:
            raise TierError(
                f"kvtier: the KV tensors give {self.slot_bytes}-byte chunks but the KV cache "
                f"spec says {expected}; this attention backend's layout is not supported"
            )
        num_slots = self.cfg.host.capacity // self.slot_bytes
        if num_slots == 0:
            raise TierError(
                f"tiers[0].host.capacity: {self.cfg.host.capacity} bytes hold no "
                f"{self.slot_bytes}-byte chunk; raise it or lower chunk_tokens"
            )
        self._pool_map = create_pool(self.pool_path, num_slots * self.slot_bytes)
        self.pool = torch.frombuffer(self._pool_map, dtype=torch.uint8)
        pinned = False
        if self.cfg.host.pinned != "no":
            pinned = register_pinned(self.pool, owner=self._pool_map)  # H2D/D2H DMA on CUDA
        if self.cfg.host.pinned == "yes" and not pinned:
            raise TierError(PINNED_UNAVAILABLE)
        log.info(
            "kvtier worker: %d layers, %d slots of %.1f MiB (%s), copy backend %s (%s)",
            len(self.views), num_slots, self.slot_bytes / 2**20,
            "pinned" if pinned else "pageable", self.backend.name, self.backend.reason,
        )

    # -- per step -------------------------------------------------------------------------
    def _slot(self, slot: int) -> torch.Tensor:
        assert self.pool is not None
        return self.pool[slot * self.slot_bytes : (slot + 1) * self.slot_bytes]

    def _load(self, op: CopyOp) -> None:
        ids = torch.tensor(op.block_ids, dtype=torch.int64)
        src = self._slot(op.slot)
        if op.first != 0 or len(op.block_ids) != self.bpc:
            # A partial chunk: its blocks are strided in the layer-major chunk layout
            # (layer, outer, block, inner), so gather them into one contiguous piece.
            rows = src.view(len(self.views) * int(self.views[0].shape[0]), self.bpc, -1)
            src = rows[:, op.first : op.first + len(op.block_ids)].contiguous().view(-1)
        self.backend.scatter(src, self.views, ids).wait()

    def _save(self, op: CopyOp) -> None:
        ids = torch.tensor(op.block_ids, dtype=torch.int64)
        self.backend.gather(self.views, ids, self._slot(op.slot)).wait()

    def run(self, meta: KVTierMetadata) -> None:
        for op in meta.loads:
            try:
                self._load(op)
            except Exception:
                log.exception("kvtier: load into blocks %s failed; vLLM recomputes", op.block_ids)
                self._load_errors.update(op.block_ids)
        if meta.loads:
            self._loaded_steps.append(meta.step)
        for op in meta.saves:
            try:
                self._save(op)
            except Exception:
                log.exception("kvtier: save of %s failed; not stored", op.req_id)
                self._failed_saves.add(op.req_id)
            self._saved.add(op.req_id)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, None]:
        """Requests whose blocks vLLM may free now: finished, and their saves done.

        vLLM hands a finished request's id to the workers in the same step as the
        metadata carrying its saves (``Scheduler.schedule`` builds both from one
        ``_free_request``), and ``run`` executes those saves before this is called. So a
        finished id with no save by now never gets one and is not remembered; only
        saves of requests not yet reported finished wait here. Nothing grows per request.
        """
        done = self._saved & finished_req_ids
        self._saved -= done
        return (done or None), None

    def load_errors(self) -> set[int]:
        errs, self._load_errors = self._load_errors, set()
        return errs

    def worker_meta(self) -> KVTierWorkerMetadata | None:
        if not self._loaded_steps and not self._failed_saves:
            return None
        meta = KVTierWorkerMetadata(self._loaded_steps, sorted(self._failed_saves))
        self._loaded_steps, self._failed_saves = [], set()
        return meta

    def close(self) -> None:
        remove_pool(self.pool_path)
