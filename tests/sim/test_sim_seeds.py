"""Fixed seeds of the simulation over vLLM's own scheduler (``kvtier/testing/sim.py``):
every model shape kvtier accepts, and TP=2, under a random workload with aborts, shrinking
hits, ``prompt_logprobs`` requests, tenants' salts, preemption and damaged objects.
``make soak SECONDS=N`` runs random seeds for longer."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.testing.simdrive import run_seed

CASES = [("full", 1), ("window", 1), ("hybrid", 1), ("chunked", 1), ("mla", 1),
         ("full", 2), ("hybrid", 2)]
SEEDS = (1, 2, 3, 4)


@pytest.mark.parametrize(("shape", "tp"), CASES, ids=[f"{s}-tp{t}" for s, t in CASES])
def test_seeds_keep_every_invariant(tmp_path_factory: pytest.TempPathFactory,
                                    shape: str, tp: int) -> None:
    root = tmp_path_factory.mktemp("sim")
    restored = 0
    for seed in SEEDS:
        report = run_seed(root / f"seed{seed}", seed, shape, tp=tp)
        assert report.blocks_checked > 0
        restored += report.restored_tokens
    assert restored > 0, "no seed restored anything: the workload does not exercise kvtier"


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
