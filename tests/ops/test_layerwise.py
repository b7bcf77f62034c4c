"""``StepCopier``: a step's loads issued layer by layer, its saves whole, on every target.

The same tests run on each (implementation, device) of ``conftest.TARGETS``: on CUDA the
copies go to the copy stream and ``wait_layer`` orders the current stream after them;
on the CPU each layer is copied inside its ``wait_layer`` (``issue`` 0), all layers at
the start (``issue`` = all), or whole chunks at the start (``"whole"``). The KV caches
are in the layouts the attention backends declare: vLLM's CPU
``(blocks, heads, block_size, 2*head)``, FlashAttention
``(2, blocks, block_size, heads, head)`` (two outer rows: a partial chunk is two pieces
per layer) and FlashInfer ``(blocks, 2, block_size, heads, head)``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kvtier.ops import KVLayout
from kvtier.ops.stepcopy import Issue, SaveFailed, StepCopier, default_issue
from tests.ops.conftest import Target

LAYERS, NB, BPC = 3, 20, 4
HEADS, BS, HEAD = 2, 4, 8


def layouts() -> dict[str, KVLayout]:
    f = torch.float16
    return {
        "cpu": KVLayout((NB, HEADS, BS, 2 * HEAD), (0, 1, 2, 3), 0, f),
        "flash": KVLayout((2, NB, BS, HEADS, HEAD), (0, 1, 2, 3, 4), 1, f),
        "flashinfer": KVLayout((NB, 2, BS, HEADS, HEAD), (0, 1, 2, 3, 4), 0, f),
    }


class Op:
    def __init__(self, slot: int, block_ids: list[int], first: int = 0, span: int = 0) -> None:
        self.slot, self.block_ids, self.first, self.span = slot, block_ids, first, span


#: Loads after slots 0 (blocks 0-3) and 1 (blocks 4-7) were saved: whole and partial.
LOADS = [Op(0, [8, 9, 10, 11]), Op(1, [12, 13], first=1), Op(0, [14, 15, 16]),
         Op(1, [17], first=3)]
EXPECTED = {8: 0, 9: 1, 10: 2, 11: 3, 12: 5, 13: 6, 14: 0, 15: 1, 16: 2, 17: 7}


def rig(target: Target, layout: KVLayout, issue: Issue) -> tuple[StepCopier, list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(3)
    caches = [torch.randn(layout.shape, generator=gen).to(layout.dtype).to(target.device)
              for _ in range(LAYERS)]
    views = [layout.block_view(t) for t in caches]
    slot_bytes = layout.chunk_bytes(LAYERS, BPC)
    pool = target.new_chunk(4 * slot_bytes)
    if pool.is_cuda:
        pytest.skip("the host pool is host memory")
    return StepCopier(target.backend, views, pool, slot_bytes, BPC, issue), caches


def blocks(cache: torch.Tensor, layout: KVLayout, ids: list[int]) -> torch.Tensor:
    return torch.stack([cache.select(layout.block_dim, b) for b in ids]).cpu()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@pytest.mark.parametrize("name", list(layouts()))
@pytest.mark.parametrize("issue", [0, LAYERS, "whole"], ids=["ahead0", "ahead-all", "whole"])
def test_loads_round_trip_exactly(target: Target, name: str, issue: Issue) -> None:
    layout = layouts()[name]
    copier, caches = rig(target, layout, issue)
    saves = copier.start_saves([Op(0, [0, 1, 2, 3]), Op(1, [4, 5, 6, 7])])
    assert not any(isinstance(h, SaveFailed) for h in saves)
    for h in saves:
        h.wait()  # type: ignore[union-attr]
    orig = [c.clone() for c in caches]
    for c in caches:
        c.index_fill_(layout.block_dim, torch.arange(8, 18, device=c.device), 0)
    loads = copier.start_loads(LOADS)
    for i in range(LAYERS):
        loads.wait_layer(i)
        synchronize(target.device)  # what the compute stream sees after its wait
        got = blocks(caches[i], layout, list(EXPECTED))
        assert torch.equal(got, blocks(orig[i], layout, list(EXPECTED.values())))
    assert loads.finish() == []
    synchronize(target.device)
    assert loads.done() and loads.failed_blocks() == set()
    others = [b for b in range(NB) if b not in EXPECTED]
    for c, o in zip(caches, orig, strict=True):
        assert torch.equal(blocks(c, layout, others), blocks(o, layout, others))


def test_issue_ahead_zero_copies_a_layer_only_when_it_is_waited_for(target: Target) -> None:
    layout = layouts()["flash"]
    copier, caches = rig(target, layout, 0)
    for h in copier.start_saves([Op(0, [0, 1, 2, 3])]):
        h.wait()  # type: ignore[union-attr]
    for c in caches:
        c.index_fill_(1, torch.arange(8, 12, device=c.device), 0)
    loads = copier.start_loads([Op(0, [8, 9, 10, 11])])
    loads.wait_layer(1)  # layers 0 and 1 are issued, 2 is not
    synchronize(target.device)
    assert [bool(c[:, 8:12].any()) for c in caches] == [True, True, False]
    assert loads.finish() == [0, 2]  # the layers no wait came for
    synchronize(target.device)
    assert all(bool(c[:, 8:12].any()) for c in caches)


@pytest.mark.parametrize("issue", [LAYERS, "whole"], ids=["per-layer", "whole"])
def test_a_bad_op_fails_alone_and_names_its_blocks(target: Target, issue: Issue) -> None:
    copier, _ = rig(target, layouts()["cpu"], issue)
    loads = copier.start_loads([Op(99, [1, 2]), Op(0, [3], first=4), Op(0, [5, 6, 7, 8])])
    assert loads.finish() == list(range(LAYERS))
    synchronize(target.device)
    assert loads.failed_blocks() == {1, 2, 3}
    saves = copier.start_saves([Op(0, [1, 2]), Op(99, [1, 2, 3, 4]), Op(1, [1, 2, 3, 4])])
    assert [isinstance(s, SaveFailed) for s in saves] == [True, True, False]


def test_no_loads_is_done_and_issues_nothing(target: Target) -> None:
    copier, _ = rig(target, layouts()["cpu"], LAYERS)
    loads = copier.start_loads([])
    loads.wait_layer(0)
    assert loads.empty and loads.finish() == [] and loads.done()
    assert copier.start_saves([]) == []


def test_default_issue() -> None:
    assert default_issue(torch.device("cpu"), 32) == "whole"
    assert default_issue(torch.device("cuda", 0), 32) == 32


def test_gpu_worker_check_runs_on_the_cpu(tmp_path: Path) -> None:
    """benchmarks/gpu_worker_check.py (GPU-only numbers) is exercised here in its
    ``--cpu-smoke`` mode: its round trips pass, every section reports."""
    from benchmarks import gpu_worker_check

    out = tmp_path / "worker.json"
    assert gpu_worker_check.main(["--cpu-smoke", "--reps", "1", "--chunks", "4",
                                  "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["ok"] and set(result["runs"]) >= {"flash_attn/torch", "flashinfer/torch"}
    for name, run in result["runs"].items():
        assert run["round_trip"]["ok"], name
        if not name.endswith("/torch"):
            assert run["bandwidth"]["gbps"]["load"] > 0 and "pipelined" in run["overlap"]["seconds"]
            assert run["sampling"]["sampling_waits_for_async"] is False, name


@pytest.mark.parametrize("name", ["cpu", "flash"])
@pytest.mark.parametrize("issue", [LAYERS, "whole"], ids=["per-layer", "whole"])
def test_a_partial_tail_is_packed_at_the_slot_start_for_every_tp_rank(
    target: Target, name: str, issue: Issue
) -> None:
    """Two TP ranks save a 2-block tail of a 4-block chunk into one shared slot: each
    rank's part is half its whole-chunk part, packed rank after rank from the slot's
    start, and nothing else of the slot is written; loads (whole span and one block of
    it) restore the exact bytes on each rank."""
    layout = layouts()[name]
    gen = torch.Generator().manual_seed(5)
    part = layout.chunk_bytes(LAYERS, BPC)  # one rank's whole chunk
    pool = target.new_chunk(3 * 2 * part)
    if pool.is_cuda:
        pytest.skip("the host pool is host memory")
    pool.fill_(0xAA)
    ranks = []
    for r in range(2):
        caches = [torch.randn(layout.shape, generator=gen).to(layout.dtype).to(target.device)
                  for _ in range(LAYERS)]
        views = [layout.block_view(t) for t in caches]
        ranks.append((StepCopier(target.backend, views, pool, part, BPC, issue, r, 2), caches))
    for copier, _ in ranks:
        for h in copier.start_saves([Op(1, [2, 3], span=2)]):
            assert not isinstance(h, SaveFailed)
            h.wait()
    slot = pool[2 * part : 4 * part]
    half = part // 2
    assert bool((slot[2 * half :] == 0xAA).all())  # only the tail's bytes were written
    for r, (copier, caches) in enumerate(ranks):
        assert torch.equal(copier.slot(1, 2), slot[r * half : (r + 1) * half])
        orig = [c.clone() for c in caches]
        loads = copier.start_loads([Op(1, [10, 11], span=2), Op(1, [12], first=1, span=2)])
        loads.finish()
        synchronize(target.device)
        assert loads.failed_blocks() == set()
        for c, o in zip(caches, orig, strict=True):
            assert torch.equal(blocks(c, layout, [10, 11, 12]), blocks(o, layout, [2, 3, 3]))
    # a save must cover its whole span; a span beyond the chunk is refused
    copier = ranks[0][0]
    bad = copier.start_saves([Op(0, [1], span=2), Op(0, [1, 2, 3, 4, 5], span=5)])
    assert all(isinstance(s, SaveFailed) for s in bad)
