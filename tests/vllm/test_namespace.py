"""Every setting that changes KV bytes changes the namespace digest (issue 17).

Each input is tested the same way: two engines that differ only in that setting get
different digests, two identical ones the same. Settings the scheduler reads from its
config go through ``namespace_for``; those only the worker sees (physical layout, cache
dtype, fp8 scales) go through both connector roles, built as vLLM builds them (worker
first, ``register_kv_caches``, then the scheduler) over fake configs and CPU tensors.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from safetensors.torch import save_file
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
from vllm.v1.kv_cache_interface import FullAttentionSpec
from vllm.v1.kv_cache_layout import KVCacheLayout

from kvtier.keys import Namespace
from kvtier.tiers.base import TierError
from kvtier.vllm import shm
from kvtier.vllm.connector import KVTierConnector
from kvtier.vllm.geometry import (
    Geometry,
    PhysicalKV,
    model_fingerprint,
    namespace_for,
    resolve_revision,
)

LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")
HEADS, HEAD, BS, CT, NB = 2, 8, 4, 16, 8
PHYS = PhysicalKV("CPU_ATTN;layout=LBHNC", "auto", "")
GEOM = Geometry(len(LAYERS), HEADS, HEAD, BS, HEADS * BS * 2 * HEAD * 4, "float32")
_ids = itertools.count()


def _model_dir(root: Path) -> Path:
    root.mkdir(parents=True)
    (root / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    for i in (1, 2):
        save_file({f"w{i}": torch.arange(64, dtype=torch.float32) * i},
                  str(root / f"model-0000{i}-of-00002.safetensors"))
    index = {"weight_map": {"w1": "model-00001-of-00002.safetensors",
                            "w2": "model-00002-of-00002.safetensors"}}
    (root / "model.safetensors.index.json").write_text(json.dumps(index))
    return root


def _model_config(model: Path | str, **kw: Any) -> SimpleNamespace:
    base: dict[str, Any] = dict(model=str(model), hf_config=None, revision=None,
                                quantization=None, dtype=torch.float32)
    return SimpleNamespace(**{**base, **kw})


def _vllm_config(model_config: SimpleNamespace, **kw: Any) -> SimpleNamespace:
    return SimpleNamespace(
        model_config=model_config,
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1,
                                        rank=0),
        load_config=SimpleNamespace(download_dir=kw.pop("download_dir", None)),
        cache_config=SimpleNamespace(cache_dtype=kw.pop("cache_dtype", "auto")),
        **kw,
    )


def _digest(vllm_config: SimpleNamespace, physical: PhysicalKV = PHYS) -> bytes:
    return namespace_for(vllm_config, GEOM, CT, physical=physical).digest()


@pytest.fixture
def model(tmp_path: Path) -> Path:
    return _model_dir(tmp_path / "model")


# -- what the scheduler reads from its own config -------------------------------------------
@pytest.mark.parametrize("setting, a, b", [
    ("quantization", None, "fp8"),
    ("quantization", "awq", "gptq"),
    ("revision", None, "v2"),
    ("dtype", torch.bfloat16, torch.float16),
])
def test_a_model_config_setting_changes_the_namespace(
    model: Path, setting: str, a: object, b: object
) -> None:
    one = _digest(_vllm_config(_model_config(model, **{setting: a})))
    assert one == _digest(_vllm_config(_model_config(model, **{setting: a})))
    assert one != _digest(_vllm_config(_model_config(model, **{setting: b})))


def _fingerprint(model: Path | str, **kw: Any) -> str:
    return model_fingerprint(_model_config(model), SimpleNamespace(**kw))


def test_the_weight_fingerprint_covers_the_safetensors_index(model: Path) -> None:
    before = _fingerprint(model)
    index = model / "model.safetensors.index.json"
    index.write_text(index.read_text().replace("00002.safetensors\"}", "00001.safetensors\"}"))
    assert _fingerprint(model) != before


def test_the_weight_fingerprint_covers_weights_in_subdirectories(model: Path) -> None:
    before = _fingerprint(model)
    (model / "vision").mkdir()
    save_file({"p": torch.zeros(4)}, str(model / "vision" / "tower.safetensors"))
    with_tower = _fingerprint(model)
    assert with_tower != before
    save_file({"p": torch.ones(4)}, str(model / "vision" / "tower.safetensors"))
    assert _fingerprint(model) != with_tower


def test_files_vllm_ignores_do_not_split_a_checkpoint(model: Path) -> None:
    before = _fingerprint(model, ignore_patterns=["original/**/*"])
    (model / "original").mkdir()
    (model / "original" / "consolidated.pth").write_bytes(b"\x01" * 64)
    assert _fingerprint(model, ignore_patterns=["original/**/*"]) == before
    assert _fingerprint(model) != before  # without the pattern it is a weight file


def test_an_unreadable_file_is_recorded_not_fatal(model: Path) -> None:
    before = _fingerprint(model)
    (model / "broken.safetensors").symlink_to(model / "missing-target")
    after = _fingerprint(model)  # no exception: vLLM itself decides if it needs the file
    assert after != before


def test_the_weight_fingerprint_covers_every_byte_of_a_file_up_to_two_mib(model: Path) -> None:
    """A 1.5 MiB shard: the old sample read the first MiB only."""
    shard = model / "extra.bin"
    shard.write_bytes(bytes(3 << 19))
    before = _fingerprint(model)
    shard.write_bytes(bytes((3 << 19) - 1) + b"\x01")
    assert _fingerprint(model) != before


def test_the_weight_fingerprint_sees_a_tensor_in_the_middle_of_a_shard(model: Path) -> None:
    """A fine-tune that froze the first and last tensors (embeddings, head): the old
    sample (first and last MiB of each file) saw nothing of it."""
    mib = 1 << 18  # float32 elements
    tensors = {"a_embed": torch.zeros(mib), "b_layer": torch.zeros(mib),
               "c_head": torch.zeros(mib)}
    save_file(tensors, str(model / "big.safetensors"))
    before = _fingerprint(model)
    tensors["b_layer"] = torch.full((mib,), 0.5)
    save_file(tensors, str(model / "big.safetensors"))
    assert _fingerprint(model) != before


def test_the_weight_fingerprint_samples_the_middle_of_other_formats(model: Path) -> None:
    blob = bytearray(8 << 20)
    (model / "pytorch_model.bin").write_bytes(blob)
    before = _fingerprint(model)
    blob[4 << 20 : (4 << 20) + (1 << 20)] = b"\x01" * (1 << 20)  # one MiB mid-file
    (model / "pytorch_model.bin").write_bytes(blob)
    assert _fingerprint(model) != before


def test_the_weight_fingerprint_does_not_depend_on_where_the_model_is(
    model: Path, tmp_path: Path
) -> None:
    other = _model_dir(tmp_path / "elsewhere" / "model")
    assert _fingerprint(model) == _fingerprint(other)


def _hub_cache(root: Path, repo: str, commit: str, ref: str = "main") -> None:
    base = root / ("models--" + repo.replace("/", "--"))
    (base / "refs").mkdir(parents=True, exist_ok=True)
    (base / "refs" / ref).write_text(commit)
    _model_dir(base / "snapshots" / commit)


def test_a_hub_id_resolves_to_the_cached_commit(tmp_path: Path) -> None:
    c1, c2 = "1" * 40, "2" * 40
    _hub_cache(tmp_path / "hub", "org/m", c1)
    _hub_cache(tmp_path / "hub", "org/m", c2, ref="v2")
    load = SimpleNamespace(download_dir=str(tmp_path / "hub"))
    assert resolve_revision(_model_config("org/m"), load)[0] == c1
    assert resolve_revision(_model_config("org/m", revision="v2"), load)[0] == c2
    assert resolve_revision(_model_config("org/m", revision=c2), load)[0] == c2
    unknown = resolve_revision(_model_config("org/other"), load)
    assert unknown == ("unresolved:main", None)
    main = _digest(_vllm_config(_model_config("org/m"), download_dir=load.download_dir))
    v2 = _digest(_vllm_config(_model_config("org/m", revision="v2"),
                              download_dir=load.download_dir))
    assert main != v2


def test_a_hub_snapshot_is_fingerprinted_like_a_local_directory(
    tmp_path: Path, model: Path
) -> None:
    _hub_cache(tmp_path / "hub", "org/m", "3" * 40)
    snapshot = tmp_path / "hub" / "models--org--m" / "snapshots" / ("3" * 40)
    before = _fingerprint("org/m", download_dir=str(tmp_path / "hub"))
    (snapshot / "model-00002-of-00002.safetensors").write_bytes(b"different")
    assert _fingerprint("org/m", download_dir=str(tmp_path / "hub")) != before


# -- what only the worker sees: through both connector roles --------------------------------
def _attn(cache_dtype: str, k_scale: float, **kw: Any) -> SimpleNamespace:
    return SimpleNamespace(get_attn_backend=lambda: CPUAttentionBackend,
                           kv_cache_dtype=cache_dtype, _k_scale=torch.tensor(k_scale),
                           _v_scale=torch.tensor(1.0), **kw)


def _kv(layout: KVCacheLayout, dtype: torch.dtype) -> torch.Tensor:
    """One layer's cache, logical ``[B, H, N, C]`` in ``layout``'s physical order."""
    logical = (NB, HEADS, BS, 2 * HEAD)
    order = layout.layer_view_order
    phys = torch.zeros(tuple(logical[d] for d in order), dtype=dtype)
    return phys.permute(tuple(order.index(d) for d in range(4)))


class Engine:
    """The two connector roles of one fake engine, made as vLLM makes them."""

    def __init__(self, config_yaml: Path, model: Path, *, engine_id: str | None = None,
                 cache_dtype: str = "auto", k_scale: float = 1.0,
                 layout: KVCacheLayout = KVCacheLayout.LBHNC, **attn: Any) -> None:
        fp8 = cache_dtype.startswith("fp8")
        self.dtype = torch.uint8 if fp8 else torch.float32
        spec = FullAttentionSpec(num_kv_heads=HEADS, head_size=HEAD, block_size=BS,
                                 dtype=self.dtype)
        assert spec.page_size_bytes == HEADS * BS * 2 * HEAD * self.dtype.itemsize
        self.kv_cache_config = SimpleNamespace(
            kv_cache_groups=[SimpleNamespace(layer_names=list(LAYERS), kv_cache_spec=spec)],
            kv_cache_layout=layout.name, num_blocks=NB,
        )
        self.layout = layout
        self.vllm_config = _vllm_config(
            _model_config(model, dtype=torch.bfloat16), cache_dtype=cache_dtype,
            kv_transfer_config=SimpleNamespace(
                kv_connector_extra_config={"config": str(config_yaml)},
                engine_id=engine_id or f"engine-{next(_ids)}"),
            compilation_config=SimpleNamespace(static_forward_context={
                n: _attn(cache_dtype, k_scale, **attn) for n in LAYERS}),
        )
        self.worker: KVTierConnector | None = None
        self.sched: KVTierConnector | None = None

    def start_worker(self) -> KVTierConnector:
        self.worker = KVTierConnector(self.vllm_config, KVConnectorRole.WORKER,
                                      self.kv_cache_config)
        self.worker.register_kv_caches({n: _kv(self.layout, self.dtype) for n in LAYERS})
        return self.worker

    def start_scheduler(self) -> Namespace:
        self.sched = KVTierConnector(self.vllm_config, KVConnectorRole.SCHEDULER,
                                     self.kv_cache_config)
        return self.sched.scheduler_side.ns

    def start(self) -> Namespace:
        self.start_worker()
        return self.start_scheduler()

    def close(self) -> None:
        for side in (self.sched, self.worker):
            if side is not None:
                side.shutdown()


@pytest.fixture
def engines(tmp_path: Path, model: Path, monkeypatch: pytest.MonkeyPatch,
            ) -> Iterator[Callable[..., Engine]]:
    monkeypatch.setattr(shm, "SHM_DIR", tmp_path / "shm")
    (tmp_path / "shm").mkdir()
    yaml = tmp_path / "kvtier.yaml"
    yaml.write_text(f"chunk_tokens: {CT}\ntiers:\n  - host: {{capacity: 64KiB, pinned: 'no'}}\n")
    made: list[Engine] = []

    def make(**kw: Any) -> Engine:
        made.append(Engine(yaml, model, **kw))
        return made[-1]

    yield make
    for e in made:
        e.close()


def test_the_scheduler_keys_by_the_layout_the_worker_registered(
    engines: Callable[..., Engine],
) -> None:
    ns = engines().start()
    assert ns.kv_layout.startswith("CPU_ATTN;layout=LBHNC;shape=*,2,4,16;order=0,1,2,3")
    assert ns.digest() == engines().start().digest()
    other = engines(layout=KVCacheLayout.LBNHC).start()
    assert "order=0,2,1,3" in other.kv_layout and other.digest() != ns.digest()


@pytest.mark.parametrize("a, b", [("fp8_e4m3", "fp8_e5m2"), ("auto", "fp8")])
def test_the_cache_dtype_string_changes_the_namespace(
    engines: Callable[..., Engine], a: str, b: str
) -> None:
    one = engines(cache_dtype=a).start()
    assert one.kv_cache_dtype == a
    assert one.digest() == engines(cache_dtype=a).start().digest()
    assert one.digest() != engines(cache_dtype=b).start().digest()


def test_fp8_scales_change_the_namespace_and_unused_ones_do_not(
    engines: Callable[..., Engine],
) -> None:
    fp8 = engines(cache_dtype="fp8", k_scale=1.0).start()
    assert fp8.kv_scales and fp8.digest() == engines(cache_dtype="fp8").start().digest()
    assert fp8.digest() != engines(cache_dtype="fp8", k_scale=0.5).start().digest()
    plain = engines(k_scale=1.0).start()
    assert plain.kv_scales == ""
    assert plain.digest() == engines(k_scale=0.5).start().digest()


def test_scales_computed_at_run_time_are_refused_at_start(
    engines: Callable[..., Engine],
) -> None:
    layer_wise = engines(cache_dtype="fp8", calculate_kv_scales=True)
    with pytest.raises(TierError, match="--calculate-kv-scales"):
        layer_wise.start_worker()
    configured = engines(cache_dtype="fp8")
    configured.vllm_config.cache_config.calculate_kv_scales = True
    with pytest.raises(TierError, match="--calculate-kv-scales"):
        configured.start_worker()


def test_a_scheduler_without_its_workers_layout_refuses_to_start(
    engines: Callable[..., Engine],
) -> None:
    with pytest.raises(TierError, match=r"\.kv\.json does not exist.*worker did not start"):
        engines().start_scheduler()


def test_a_layout_published_by_another_engine_is_refused(
    engines: Callable[..., Engine], tmp_path: Path
) -> None:
    theirs, ours = engines(), engines()
    theirs.start_worker()
    ours.start_worker()
    mine = shm.published_path(shm.pool_path(ours.vllm_config.kv_transfer_config.engine_id))
    other = shm.published_path(shm.pool_path(theirs.vllm_config.kv_transfer_config.engine_id))
    other.replace(mine)
    with pytest.raises(TierError, match=r"engine_id .* written by another engine"):
        ours.start_scheduler()


def test_a_layout_of_an_earlier_pool_file_is_refused(engines: Callable[..., Engine]) -> None:
    e = engines()
    e.start_worker()
    pool = shm.pool_path(e.vllm_config.kv_transfer_config.engine_id)
    kept = pool.with_name("kept")
    pool.rename(kept)
    kept.with_name("copy").write_bytes(kept.read_bytes())
    kept.with_name("copy").rename(pool)  # same name and size, another file
    with pytest.raises(TierError, match="describes another host pool file"):
        e.start_scheduler()


def test_a_symlink_in_place_of_the_layout_is_not_followed(
    engines: Callable[..., Engine], tmp_path: Path
) -> None:
    e = engines()
    e.start_worker()
    published = shm.published_path(shm.pool_path(e.vllm_config.kv_transfer_config.engine_id))
    published.rename(tmp_path / "real.json")
    published.symlink_to(tmp_path / "real.json")
    with pytest.raises(TierError, match="not a regular file"):
        e.start_scheduler()


def test_two_engines_with_one_engine_id_fail_clearly(engines: Callable[..., Engine]) -> None:
    first = engines(engine_id="same")
    first.start_worker()
    second = engines(engine_id="same")
    with pytest.raises(TierError, match=r"already exists.*same kv_transfer_config\.engine_id"):
        second.start_worker()
    second.close()  # vLLM shuts a failed engine down: it must not remove the first's files
    assert first.start_scheduler().digest()


def test_a_planted_symlink_at_the_pool_name_is_not_followed(
    engines: Callable[..., Engine], tmp_path: Path
) -> None:
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep")
    shm.pool_path("planted").symlink_to(victim)
    with pytest.raises(TierError, match="symbolic link"):
        engines(engine_id="planted").start_worker()
    assert victim.read_bytes() == b"keep"


def test_the_published_file_is_removed_once_read(engines: Callable[..., Engine]) -> None:
    e = engines()
    e.start()
    pool = shm.pool_path(e.vllm_config.kv_transfer_config.engine_id)
    assert not shm.published_path(pool).exists() and not pool.exists()
    assert not list(shm.SHM_DIR.iterdir()), "no temp file left behind"
