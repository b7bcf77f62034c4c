"""The restore-or-recompute cost model: read EWMAs, the step fit, decide(), the policy.

Time only enters as explicit observations: nothing here sleeps or reads a clock.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.config import ConfigError, RestoreConfig, parse_config
from kvtier.costmodel import CostModel, Outcome, ReadModels, ThresholdPolicy
from kvtier.stepfit import StepModel

MiB = 2**20
CT = 256
CHUNK = 4 * MiB
# Known engine costs: per step, per prefill token, per token*context, decode terms.
C0, A, B, DREQ, DCTX = 3e-3, 2e-5, 3e-9, 1e-4, 2e-8


def true_step(reqs: Sequence[tuple[int, int]]) -> float:
    t = C0
    for n, ctx in reqs:
        if n == 1:
            t += DREQ + DCTX * (ctx + 0.5)
        else:
            t += A * n + B * n * (ctx + n / 2)
    return t


def synthetic_steps(
    n: int, *, seed: int = 0, noise: float = 0.0, prefill_share: float = 0.3
) -> list[tuple[list[tuple[int, int]], float]]:
    rng = random.Random(seed)
    out: list[tuple[list[tuple[int, int]], float]] = []
    while len(out) < n:
        reqs = [(1, rng.randrange(100, 8000)) for _ in range(rng.randrange(0, 32))]
        if rng.random() < prefill_share:
            reqs += [(rng.randrange(16, 2048), rng.randrange(0, 8192))
                     for _ in range(rng.randrange(1, 3))]
        if reqs:
            out.append((reqs, true_step(reqs) * (1 + rng.gauss(0, noise))))
    return out


def warm_model(margin: float = 0.1, **seeds: tuple[float, float]) -> CostModel:
    """A model fed exact synthetic steps until warm; ``seeds``: tier -> (latency, Bps)."""
    m = CostModel(margin=margin, warmup_steps=20, host_bandwidth=10e9)
    for tier, (lat, bw) in seeds.items():
        m.seed(tier, lat, bw)
    for reqs, t in synthetic_steps(200, prefill_share=1.0):
        m.observe_step(reqs, t)
    assert m.steps.warm
    return m


def recompute(lo: int, hi: int) -> float:
    return A * (hi - lo) + B * (hi * hi - lo * lo) / 2


# -- read estimates -------------------------------------------------------------------------
def test_ewma_converges_to_observed_reads() -> None:
    r = ReadModels(alpha=0.2)
    r.seed("file1", 1e-3, 1e9)  # probe: 1 ms + 4.2 ms for 4 MiB
    for _ in range(60):
        r.observe("file1", CHUNK, 0.020)  # reality: 20 ms per chunk
    est = r.seconds("file1", CHUNK)
    assert est == pytest.approx(0.020, rel=1e-3)
    assert r.observations("file1") == 60


def test_unprobed_tier_is_unknown_until_read() -> None:
    r = ReadModels()
    assert r.seconds("s31", CHUNK) is None
    r.observe("s31", CHUNK, 0.05)
    assert r.seconds("s31", CHUNK) == pytest.approx(0.05)


def test_one_wild_read_moves_the_estimate_a_bounded_step() -> None:
    r = ReadModels(alpha=0.2)
    r.seed("file1", 0.0, 1e9)
    before = r.seconds("file1", CHUNK)
    assert before is not None
    r.observe("file1", CHUNK, 1e6)  # a stuck NFS read
    after = r.seconds("file1", CHUNK)
    assert after is not None and after <= before * (1 + 0.2 * 100)
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        r.observe("file1", CHUNK, bad)
    assert r.seconds("file1", CHUNK) == after


def test_observe_read_is_thread_safe() -> None:
    m = CostModel()
    m.seed("file1", 0.0, 1e9)
    barrier = threading.Barrier(8)

    def hammer() -> None:
        barrier.wait()
        for _ in range(2000):
            m.observe_read("file1", CHUNK, 0.010)

    threads = [threading.Thread(target=hammer) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert m.reads.observations("file1") == 16000
    assert m.reads.seconds("file1", CHUNK) == pytest.approx(0.010, rel=1e-6)


def test_seed_rejects_nonsense() -> None:
    with pytest.raises(ValueError, match="bandwidth"):
        ReadModels().seed("x", 0.0, 0.0)


# -- the step fit ---------------------------------------------------------------------------
def test_fit_recovers_known_coefficients_from_noisy_steps() -> None:
    m = StepModel()
    rng = random.Random(1)
    for reqs, t in synthetic_steps(3000, seed=2, noise=0.03):
        m.observe(reqs, t * 10 if rng.random() < 0.01 else t)  # 1 % stalls
    c = m.coefficients()
    assert c.prefill_tokens == pytest.approx(A, rel=0.1)
    assert c.prefill_attention == pytest.approx(B, rel=0.1)
    assert c.step == pytest.approx(C0, rel=0.1)
    assert m.recompute_seconds(0, 4096) == pytest.approx(recompute(0, 4096), rel=0.05)
    assert m.clipped > 0


def test_recompute_is_additive_and_superlinear() -> None:
    m = warm_model().steps
    whole = m.recompute_seconds(0, 4096)
    assert whole == pytest.approx(m.recompute_seconds(0, 1000) + m.recompute_seconds(1000, 4096))
    assert m.recompute_seconds(3072, 4096) > m.recompute_seconds(0, 1024)
    assert m.recompute_seconds(10, 10) == 0.0


def test_decode_only_steps_do_not_break_the_fit() -> None:
    m = warm_model().steps
    before = m.coefficients()
    rng = random.Random(3)
    for _ in range(5000):  # a long decode phase, its cost not like the prefill's at all
        reqs = [(1, rng.randrange(100, 8000)) for _ in range(rng.randrange(1, 64))]
        m.observe(reqs, true_step(reqs) * (1 + rng.gauss(0, 0.05)))
    after = m.coefficients()
    assert m.warm
    assert after.prefill_tokens == pytest.approx(before.prefill_tokens, rel=0.1)
    assert after.prefill_attention == pytest.approx(before.prefill_attention, rel=0.1)


def test_coefficients_are_never_negative() -> None:
    m = StepModel(warmup_steps=5)
    rng = random.Random(4)
    for _ in range(300):  # time falls with work: least squares would go negative
        n = rng.randrange(16, 2048)
        m.observe([(n, 0)], max(0.0, 0.1 - 4e-5 * n) + rng.random() * 1e-3)
    assert all(v >= 0 for v in vars(m.coefficients()).values())
    assert not m.warm  # prefill found free: not trusted, the policy stays cold


# -- decide ---------------------------------------------------------------------------------
def test_cold_model_restores_everything() -> None:
    m = CostModel(warmup_steps=20)
    m.seed("s31", 0.5, 1e6)  # absurdly slow, and still restored: not warm yet
    d = m.decide(0, CT, CHUNK, ["s31", "s31"])
    assert (d.outcome, d.chunks, d.tokens) == (Outcome.RESTORE_ALL, 2, 2 * CT)
    assert d.reason.startswith("cold") and d.cold


def test_slow_tier_and_short_prefix_recomputes() -> None:
    m = warm_model(s31=(0.05, 50e6))  # 50 ms + 84 ms per 4 MiB chunk
    d = m.decide(0, CT, CHUNK, ["s31"])
    assert d.outcome is Outcome.RECOMPUTE and d.chunks == 0
    assert d.restore_s is not None and d.recompute_s is not None
    assert d.restore_s > d.recompute_s


def test_fast_tier_restores() -> None:
    m = warm_model(file1=(1e-4, 2e9))
    d = m.decide(0, CT, CHUNK, ["host"] * 4 + ["file1"] * 4)
    assert (d.outcome, d.chunks, d.tokens) == (Outcome.RESTORE_ALL, 8, 8 * CT)
    assert "restore" in str(d)


def test_cheap_head_slow_tail_restores_the_head() -> None:
    m = warm_model(s31=(0.5, 20e6))
    d = m.decide(0, CT, CHUNK, ["host", "host", "s31", "s31"])
    assert (d.outcome, d.chunks) == (Outcome.RESTORE_PARTIAL, 2)


def test_partial_is_never_chosen_when_all_is_cheaper() -> None:
    m = warm_model()
    d = m.decide(0, CT, CHUNK, ["host"] * 16)
    assert d.outcome is Outcome.RESTORE_ALL and d.chunks == 16


def test_margin() -> None:
    # One chunk from tier x: make its restore exactly 5 % cheaper than recompute.
    copy = CHUNK / 10e9
    target = 0.95 * recompute(0, CT) - copy
    strict, lax = warm_model(0.1), warm_model(0.0)
    for m in (strict, lax):
        m.seed("x", target, 1e18)
    assert strict.decide(0, CT, CHUNK, ["x"]).outcome is Outcome.RECOMPUTE
    assert lax.decide(0, CT, CHUNK, ["x"]).outcome is Outcome.RESTORE_ALL


def test_start_mid_chunk_and_limit() -> None:
    m = warm_model()
    # vLLM already has 128 tokens of chunk 2 (starts at 512); the prompt allows 1000.
    d = m.decide(640, CT, CHUNK, ["host"] * 4, limit_tokens=1000)
    assert d.chunks == 2  # chunk 2 (640..768) and chunk 3 (768..1000); 4th adds nothing
    assert d.tokens == 1000 - 640
    assert m.decide(1000, CT, CHUNK, ["host"], limit_tokens=1000).chunks == 0


def test_unmeasured_tier_restores_until_measured() -> None:
    m = warm_model()
    d = m.decide(0, CT, CHUNK, ["host", "nfs9"])
    assert d.outcome is Outcome.RESTORE_ALL and "nfs9" in d.reason


@settings(max_examples=150, deadline=None)
@given(
    start=st.integers(0, 3000),
    ct=st.sampled_from([16, 64, 256]),
    tiers=st.lists(st.sampled_from(["host", "file1", "s31"]), max_size=12),
    limit=st.one_of(st.none(), st.integers(0, 6000)),
    margin=st.sampled_from([0.0, 0.1, 0.3]),
    file_lat=st.floats(0, 0.05),
    s3_lat=st.floats(0, 0.5),
)
def test_decide_properties(
    start: int, ct: int, tiers: list[str], limit: int | None, margin: float,
    file_lat: float, s3_lat: float,
) -> None:
    m = warm_model(margin, file1=(file_lat, 1e9), s31=(s3_lat, 1e8))
    d = m.decide(start, ct, CHUNK, tiers, limit_tokens=limit)
    assert 0 <= d.chunks <= len(tiers)
    costs = m.prefix_costs(start, ct, CHUNK, tiers, limit)
    assert d.chunks <= len(costs)
    rel = [0.0] + [r - c for _, r, c in costs if r is not None]  # total(k) - total(0)
    chosen = rel[d.chunks]
    assert chosen <= 0.0  # never worse than recomputing everything
    if costs:
        assert chosen - min(rel) <= margin * costs[-1][2] + 1e-12
        assert d.tokens == (costs[d.chunks - 1][0] if d.chunks else 0)


# -- the policy -----------------------------------------------------------------------------
def test_fixed_policy_keeps_todays_rule() -> None:
    p = ThresholdPolicy.fixed(64)
    assert p.model is None
    assert p.chunks_to_restore(0, CT, CHUNK, ["file1"]).chunks == 1
    # 1 chunk, but vLLM must compute the last block: 16 new tokens < 64
    small = p.chunks_to_restore(240, CT, CHUNK, ["file1"], limit_tokens=256)
    assert small.outcome is Outcome.RECOMPUTE and small.tokens == 0
    assert p.chunks_to_restore(0, CT, CHUNK, ["host"] * 3, limit_tokens=600).chunks == 3
    assert ThresholdPolicy.fixed(0).chunks_to_restore(0, CT, CHUNK, ["host"]).chunks == 1
    assert p.counts.as_dict() == {"restore_all": 2, "restore_partial": 0, "recompute": 1,
                                  "cold": 0}


def test_auto_policy_counts_outcomes() -> None:
    p = ThresholdPolicy.from_config(RestoreConfig(recompute_threshold_tokens="auto",
                                                  auto_margin=0.2, auto_warmup_steps=5))
    assert p.model is not None and p.model.margin == 0.2
    p.chunks_to_restore(0, CT, CHUNK, ["host"])
    assert p.counts.restore_all == 1 and p.counts.cold == 1
    assert ThresholdPolicy.from_config(RestoreConfig()).fixed_tokens == 64


def test_policy_is_one_or_the_other() -> None:
    with pytest.raises(ValueError):
        ThresholdPolicy(64, CostModel())


def test_config_validates_auto_keys() -> None:
    base = {"tiers": [{"host": {"capacity": "1GiB"}}]}
    with pytest.raises(ConfigError, match=r"restore\.auto_margin"):
        parse_config({**base, "restore": {"auto_margin": 1.0}})
    cfg = parse_config({**base, "restore": {"recompute_threshold_tokens": "auto"}})
    assert (cfg.restore.auto_margin, cfg.restore.auto_warmup_steps) == (0.1, 20)
