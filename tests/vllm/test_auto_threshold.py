"""``recompute_threshold_tokens: auto`` wired into the scheduler side, without an engine.

The engine's steps are fed as vLLM's scheduler would (``build_meta(scheduler_output)``,
then the step's output); the tier's read estimate is seeded as the startup probe would.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from kvtier.build import build_store
from kvtier.config import KVTierConfig
from kvtier.costmodel import CostModel
from kvtier.keys import Namespace, chunk_keys
from kvtier.stepfit import StepModel
from kvtier.tiers.file import FileTier
from kvtier.vllm.geometry import Geometry
from kvtier.vllm.protocol import KVTierWorkerMetadata
from kvtier.vllm.scheduler_side import SchedulerSide
from tests.vllm.hooks import ask

CT = 128
GEOM = Geometry(2, 2, 64, CT, 4096, "float32")
NS = Namespace(model="m", model_fingerprint="0" * 16, kv_dtype="float32", kv_layout="NHD",
               num_layers=2, num_kv_heads=2, head_size=64, chunk_tokens=CT, block_size=CT)
TOKENS = list(range(1, 4 * CT + 40))


@pytest.fixture
def sched(tmp_path: Path) -> Iterator[SchedulerSide]:
    cfg = KVTierConfig.model_validate({
        "chunk_tokens": CT,
        "tiers": [{"host": {"capacity": "1MiB", "pinned": "no"}},
                  {"file": {"path": str(tmp_path), "capacity": "1GiB", "write": "through"}}],
        "restore": {"recompute_threshold_tokens": "auto", "auto_warmup_steps": 3},
    })
    s = SchedulerSide(cfg, GEOM, NS, None, store=build_store(cfg, GEOM.chunk_bytes(CT)))
    # Chunks another node wrote to the shared directory: only a file-tier read restores them.
    other = FileTier(tmp_path, 1 << 30)
    keys = chunk_keys(NS.digest(), TOKENS, CT)
    for c in range(4):
        other.put(s._meta(NS.digest(), keys, c), np.zeros(s.slot_bytes, np.uint8).data)
    yield s
    s.close()


def _step(s: SchedulerSide, i: int, tokens: int) -> None:
    so = SimpleNamespace(
        num_scheduled_tokens={f"w{i}": tokens},
        scheduled_new_reqs=[SimpleNamespace(req_id=f"w{i}", num_computed_tokens=0)],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], num_computed_tokens=[]),
    )
    meta = s.build_meta(so)
    s.on_worker_output(None, KVTierWorkerMetadata(step=meta.step))


def _request() -> SimpleNamespace:
    return SimpleNamespace(request_id="r", num_tokens=len(TOKENS), all_token_ids=TOKENS,
                           kv_transfer_params=None, cache_salt=None, lora_request=None,
                           mm_features=None, prompt_embeds=None)


def test_cold_auto_restores_everything_and_times_engine_steps(sched: SchedulerSide) -> None:
    model = sched.policy.model
    assert model is not None
    n, _ = sched.get_num_new_matched_tokens(_request(), 0)
    assert n is None  # the file tier is asked on an IO thread: ask again
    assert ask(sched, _request()) == 4 * CT
    assert sched.policy.counts.as_dict()["cold"] == 1
    assert model.reads.observations("file1") == 4, "each verified read was timed"
    for i in range(3):
        _step(sched, i, 512)
    assert model.steps.prefill_steps == 3


def test_warm_auto_recomputes_when_the_tier_is_slower_than_the_engine(
    sched: SchedulerSide,
) -> None:
    model = CostModel(margin=0.1, host_tier=sched.store.host.name,
                      steps=StepModel(warmup_steps=3))
    sched.policy.model = model
    model.seed("file1", latency_s=1.0, bandwidth_Bps=1e6)  # a browned-out endpoint
    for i in range(6):  # the engine computes 256 tokens per millisecond
        n = 256 * (1 + i % 3)
        model.observe_step([(n, 0)], seconds=n / 256e3)
    assert model.steps.warm
    assert ask(sched, _request()) == 0
    assert sched.policy.counts.as_dict()["recompute"] == 1
    assert "r" not in sched._lookups, "nothing was read"


def _slow_tier_warm_model(sched: SchedulerSide) -> None:
    model = CostModel(margin=0.1, host_tier=sched.store.host.name,
                      steps=StepModel(warmup_steps=3))
    sched.policy.model = model
    model.seed("file1", latency_s=1.0, bandwidth_Bps=1e6)
    for i in range(6):
        n = 256 * (1 + i % 3)
        model.observe_step([(n, 0)], seconds=n / 256e3)


@pytest.mark.parametrize(("own", "restored"), [(1, 4 * CT), (4 * CT, 4 * CT), (4 * CT + 1, 0)])
def test_a_requests_own_threshold_overrides_auto(
    sched: SchedulerSide, own: int, restored: int
) -> None:
    """``kv_transfer_params.kvtier.recompute_threshold_tokens`` is a fixed threshold for
    that request, even where ``auto`` would recompute (a tier slower than the engine)."""
    _slow_tier_warm_model(sched)
    req = _request()
    req.kv_transfer_params = {"kvtier": {"recompute_threshold_tokens": own}}
    assert ask(sched, req) == restored
    d = sched._decisions["r"]
    assert f"threshold {own}" in d.reason


@pytest.mark.parametrize("bad", [-1, "1", 1.5, True, [1]])
def test_a_malformed_own_threshold_is_ignored(
    sched: SchedulerSide, bad: object, caplog: pytest.LogCaptureFixture
) -> None:
    _slow_tier_warm_model(sched)
    req = _request()
    req.kv_transfer_params = {"kvtier": {"recompute_threshold_tokens": bad}}
    assert ask(sched, req) == 0  # auto decides, as without the key
    assert "recompute_threshold_tokens" in caplog.text
