"""The test-support model builder and the long-lived engine worker."""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import pytest

from kvtier.testing.engines import SHARED_CACHE_ENV, engine_env
from kvtier.testing.models import (
    BENCH_90M,
    CPU_ATTN_HEAD_SIZES,
    MARKER_NAME,
    TinyLlamaSpec,
    build_tiny_llama,
    read_marker,
)


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_specs_fit_cpu_attention() -> None:
    assert TinyLlamaSpec().resolved_head_dim == 32  # 64 // 4 = 16 is not supported
    assert BENCH_90M.resolved_head_dim == 64
    assert 80e6 < BENCH_90M.num_params < 100e6
    assert TinyLlamaSpec(hidden=256, heads=4).resolved_head_dim == 64
    with pytest.raises(ValueError, match="head_dim"):
        TinyLlamaSpec(head_dim=48)
    with pytest.raises(ValueError, match="kv_heads"):
        TinyLlamaSpec(heads=4, kv_heads=3)
    for spec in (TinyLlamaSpec(), BENCH_90M):
        assert spec.resolved_head_dim in CPU_ATTN_HEAD_SIZES


def test_build_is_deterministic_and_cached(tmp_path: Path) -> None:
    a = build_tiny_llama(tmp_path / "a", seed=3)
    marker = read_marker(a)
    assert marker is not None and marker["spec"]["seed"] == 3
    files = {p.name: _digest(p) for p in a.iterdir()}
    assert {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        MARKER_NAME,
    } <= set(files)
    mtime = (a / "model.safetensors").stat().st_mtime_ns

    t0 = time.perf_counter()
    assert build_tiny_llama(tmp_path / "a", seed=3) == a  # cache hit: untouched
    assert time.perf_counter() - t0 < 1.0
    assert (a / "model.safetensors").stat().st_mtime_ns == mtime

    b = build_tiny_llama(tmp_path / "b", seed=3)
    assert {p.name: _digest(p) for p in b.iterdir()} == files

    c = build_tiny_llama(tmp_path / "a", seed=4)  # a different spec replaces the old build
    assert _digest(c / "model.safetensors") != files["model.safetensors"]

    config = json.loads((a / "config.json").read_text())
    assert config["head_dim"] == 32 and config["vocab_size"] == 512

    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "x.txt").write_text("not a model")
    with pytest.raises(FileExistsError):
        build_tiny_llama(tmp_path / "foreign")


def test_tokenizer_loads_and_covers_vocab(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    path = build_tiny_llama(tmp_path / "m")
    tok = transformers.AutoTokenizer.from_pretrained(str(path))
    assert len(tok) == 512
    ids = tok.encode("hello there, general kenobi.", add_special_tokens=False)
    assert ids and all(0 <= i < 512 for i in ids)
    assert tok.decode(ids) == "hello there, general kenobi."
    tok.decode(list(range(512)))  # every model id decodes
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert chat.endswith("<|assistant|>\n")


def test_engine_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(SHARED_CACHE_ENV, raising=False)
    env = engine_env(tmp_path, 2)
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "2"
    assert env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "1"
    for var in ("VLLM_CACHE_ROOT", "VLLM_RPC_BASE_PATH", "TMPDIR"):
        assert Path(env[var]).is_dir() and Path(env[var]).is_relative_to(tmp_path)
    with pytest.raises(ValueError):
        engine_env(tmp_path, 0)
    # A shared cache (the test session's): only the cache moves, sockets stay apart.
    monkeypatch.setenv(SHARED_CACHE_ENV, str(tmp_path / "shared"))
    env = engine_env(tmp_path / "e", 1)
    assert env["VLLM_CACHE_ROOT"] == str(tmp_path / "shared")
    assert Path(env["VLLM_CACHE_ROOT"]).is_dir()
    assert Path(env["VLLM_RPC_BASE_PATH"]).is_relative_to(tmp_path / "e")
