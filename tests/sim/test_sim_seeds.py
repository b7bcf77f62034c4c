"""Fixed seeds of the simulation over vLLM's own schedulers (``kvtier/testing/sim.py``),
``Scheduler`` and ``AsyncScheduler`` (the GPU default: the next step is scheduled before
the last one's output is processed), every seed on both: every model shape kvtier
accepts, and TP=2 with ranks that report in different steps, under a random workload
with aborts, shrinking hits, ``prompt_logprobs`` requests, tenants' salts, preemption,
damaged objects, hung reads, and failing worker copies and lower-tier writes. Every
completed request's output is compared with a recompute. ``make soak SECONDS=N`` runs
random seeds for longer."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.testing.simdrive import SCHEDULERS, run_seed

CASES = [(shape, tp, sched) for shape, tp in (
    ("full", 1), ("window", 1), ("hybrid", 1), ("chunked", 1), ("mla", 1), ("full", 2),
    ("hybrid", 2)) for sched in SCHEDULERS]
SEEDS = (1, 2, 3, 4, 5, 6)


@pytest.mark.parametrize(("shape", "tp", "scheduler"), CASES,
                         ids=[f"{s}-tp{t}-{k}" for s, t, k in CASES])
def test_seeds_keep_every_invariant(tmp_path_factory: pytest.TempPathFactory,
                                    shape: str, tp: int, scheduler: str) -> None:
    root = tmp_path_factory.mktemp("sim")
    restored = outputs = faults = 0
    for seed in SEEDS:
        report = run_seed(root / f"seed{seed}", seed, shape, tp=tp, scheduler=scheduler)
        assert report.blocks_checked > 0
        restored += report.restored_tokens
        outputs += report.outputs_checked
        faults += report.copy_faults + report.write_faults
    assert restored > 0, "no seed restored anything: the workload does not exercise kvtier"
    assert outputs > 0, "no output was compared with a recompute"
    assert faults > 0, "no seed injected a copy or write failure"


def test_block_check_sees_wrong_bytes(tmp_path: Path) -> None:
    """The invariant is not vacuous: a byte changed in a computed block is reported."""
    from kvtier.testing.sim import SHAPES, SimWorld, Violation
    from kvtier.testing.simdrive import kvtier_doc

    world = SimWorld(tmp_path / "w", SHAPES["full"], kvtier_doc(tmp_path), num_blocks=32)
    try:
        world.add("a", list(range(3, 70)), max_tokens=4)
        while not world.scheduler.running:
            world.step()
        assert world.check_blocks() > 0
        block = world.scheduler.kv_cache_manager.get_block_ids("a")[0][1]
        cache = next(iter(world.caches[0].values()))
        cache[block, 0, 3, 0] += 1.0
        with pytest.raises(Violation, match="does not hold the KV of its prefix"):
            world.check_blocks()
    finally:
        world.close()
