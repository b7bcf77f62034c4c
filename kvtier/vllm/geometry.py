"""KV geometry and namespace of a vLLM engine, as both connector sides see it.

The scheduler derives the chunk size from ``KVCacheConfig`` (page bytes x layers x blocks
per chunk); the worker derives it from the KV tensors it registers. They must agree, and
the shared pool's size is the check.

The namespace (``namespace_for``) is every setting that changes the bytes of a stored
chunk; ``docs/architecture.md`` ("Keys") lists each with the vLLM setting it comes from.
Two of its inputs only the worker can see, because they live in its attention layers:
the physical KV layout (``describe_layout``) and the k/v scales an fp8 cache is quantized
with (``kv_scales_digest``). The worker publishes them as a ``PhysicalKV`` next to the host
pool (``kvtier.vllm.shm``), before vLLM builds the scheduler, which reads them into its
namespace.

The model fingerprint (``model_fingerprint``) covers the HF config, the resolved
revision, and every weight file (names, sizes, safetensors headers and the first and last
4 KiB of every tensor, index and config files, the first and last MiB of each), so two
different checkpoints under one name never share KV, without hashing gigabytes at start.

Reads files only at engine start (fingerprint) and never on a request's path.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtier.keys import Namespace
from kvtier.tiers.base import TierError

_SAMPLE = 1 << 20
#: Files whose bytes are weights; each is sampled (size, header, first and last MiB).
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".ckpt", ".npz")
#: A JSON file (config, safetensors index, quantization config) up to this size is hashed
#: whole; a bigger one is sampled like a weight file.
_WHOLE_JSON = 16 << 20
#: A safetensors header (tensor names, dtypes, shapes, offsets) up to this size is hashed.
_MAX_ST_HEADER = 100 << 20
#: Bytes hashed at the start and at the end of every tensor of a safetensors file.
_TENSOR_SAMPLE = 4096
#: Other weight files: this many windows of ``_WINDOW`` bytes between first and last MiB.
_WINDOWS, _WINDOW = 16, 64 << 10
#: KV cache dtypes that store K and V as computed (no scales).
UNQUANTIZED_KV = frozenset({"auto", "float16", "bfloat16", "float32", "float", "half"})
_COMMIT = re.compile(r"[0-9a-f]{40}")


@dataclass(frozen=True)
class GroupShape:
    """One KV-cache group of a hybrid model: its layer count and what it keeps of a
    request: its last ``window`` tokens (sliding-window attention), or the tokens of its
    current ``chunk``-token attention chunk (chunked-local attention: Llama-4's RoPE
    layers); neither (both 0): everything, full attention."""

    layers: int
    window: int = 0
    chunk: int = 0

    @property
    def local(self) -> bool:
        """Whether vLLM keeps only a local part of a request's KV for this group (and
        pads the rest with its null block): sliding-window or chunked-local attention."""
        return bool(self.window or self.chunk)

    @property
    def kind(self) -> str:
        """The group's kind for the namespace."""
        if self.window:
            return f"sliding_window:{self.window}"
        return f"chunked_local:{self.chunk}" if self.chunk else "full"


@dataclass(frozen=True)
class Geometry:
    num_layers: int
    num_kv_heads: int
    head_size: int
    block_size: int
    page_bytes: int  # one block of one layer, on one TP rank
    kv_dtype: str
    #: TP ranks of the engine; unless ``replicated``, a chunk holds every rank's bytes,
    #: one after the other (rank 0 first), and each rank has ``num_kv_heads`` of the
    #: model's heads
    tp_world: int = 1
    #: every rank holds the same KV (MLA's latent): a chunk is one copy, written by rank 0
    #: and read by every rank, so it does not depend on the TP size
    replicated: bool = False
    #: V's head size when it is not ``head_size`` (0 for MLA: the latent has no V)
    head_size_v: int | None = None
    #: sliding-window attention in every layer (one ``SlidingWindowSpec`` group): vLLM
    #: keeps KV for a request's last ``window`` tokens (its ``sliding_window`` plus
    #: ``extra_retained_tokens``) and has swapped every block wholly before them for its
    #: null block; 0 for full attention and MLA
    window: int = 0
    #: a hybrid model's KV-cache groups (vLLM's hybrid KV-cache manager: each group has
    #: its own block table; ``kvtier/vllm/hybrid.py``), in vLLM's group order; empty for
    #: a single group. ``num_layers`` is then the largest group's (a host slot's size)
    groups: tuple[GroupShape, ...] = ()
    #: digest of which layers are in which group (hybrid only; part of the namespace)
    group_layers: str = ""

    @property
    def window_blocks(self) -> int:
        """Blocks a hit ending on a block boundary needs (vLLM's null block pads those
        before them): ``cdiv(window - 1, block_size)``, 0 without a window."""
        return self.blocks_for_window(self.window)

    def blocks_for_window(self, window: int) -> int:
        """``cdiv(window - 1, block_size)``: the blocks before a hit that a ``window``
        -token sliding window reads; 0 for full attention (``window`` 0)."""
        return -(-(window - 1) // self.block_size) if window else 0

    def local_blocks(self, group: int, end_block: int) -> int:
        """The blocks before block ``end_block`` that hybrid group ``group`` keeps for a
        request whose next token is the first of that block: all ``end_block`` of them
        (full attention), the window's ``blocks_for_window`` (sliding window), or those
        from the start of the attention chunk holding the next token (chunked-local, as
        vLLM's ``ChunkedLocalAttentionManager`` computes it; none on a chunk boundary)."""
        shape = self.groups[group]
        if shape.window:
            return min(end_block, self.blocks_for_window(shape.window))
        if shape.chunk:
            start = end_block * self.block_size // shape.chunk * shape.chunk
            return end_block - start // self.block_size
        return end_block

    @property
    def attention(self) -> str:
        """What of a request's KV is kept, for the namespace: "" (full attention, one
        group), ``sliding_window:W``, or a hybrid model's groups (each group's kind and
        layer count, and the digest of its layers' names)."""
        if self.groups:
            kinds = ",".join(f"{g.kind}x{g.layers}" for g in self.groups)
            return f"hybrid:{kinds};layers={self.group_layers}"
        return f"sliding_window:{self.window}" if self.window else ""

    @property
    def slot_ranks(self) -> int:
        """How many ranks' parts a chunk (a host slot, an object) holds."""
        return 1 if self.replicated else self.tp_world

    def blocks_per_chunk(self, chunk_tokens: int) -> int:
        if chunk_tokens % self.block_size:
            raise TierError(
                f"chunk_tokens: {chunk_tokens} is not a multiple of vLLM's block size "
                f"{self.block_size}; use a multiple such as {self.block_size * 2}"
            )
        return chunk_tokens // self.block_size

    def rank_chunk_bytes(self, chunk_tokens: int) -> int:
        """One TP rank's part of a chunk: what one worker copies (of a hybrid model, the
        largest group's part: a host slot holds one group's chunk)."""
        return self.num_layers * self.page_bytes * self.blocks_per_chunk(chunk_tokens)

    def group_layer_count(self, group: int) -> int:
        """Layers of KV-cache group ``group`` (every layer with one group)."""
        return self.groups[group].layers if self.groups else self.num_layers

    def chunk_bytes(self, chunk_tokens: int) -> int:
        """A whole chunk, every rank's part: a host slot, one object in every tier."""
        return self.slot_ranks * self.rank_chunk_bytes(chunk_tokens)


@dataclass(frozen=True)
class PhysicalKV:
    """What only the worker sees of the KV bytes: it publishes this, the scheduler keys by it.

    ``kv_layout`` is ``describe_layout`` of the registered tensors, ``kv_cache_dtype``
    the cache dtype string the worker's layers were built with, ``kv_scales``
    ``kv_scales_digest`` of its attention layers.
    """

    kv_layout: str
    kv_cache_dtype: str
    kv_scales: str


def geometry_from_kv_cache_config(kv_cache_config: Any, tp_world: int = 1,
                                  model: str = "this model") -> Geometry:
    """The geometry of a single-group ``KVCacheConfig`` of full attention (this rank's
    heads; ``tp_world`` ranks of them make a chunk), dense MLA (one latent per token,
    the same on every rank: ``replicated``) or sliding-window attention in every layer
    (``window``: kvtier stores only the blocks a hit needs, see ``docs/architecture.md``).
    ``TierError`` naming the model's shape and what to do for any other: kvtier knows
    which blocks of these layers hold a prefix; for other specs (chunked-local attention,
    Mamba state) it would store or restore the wrong bytes."""
    groups = kv_cache_config.kv_cache_groups
    if not groups:
        raise TierError(f"kvtier: {model} keeps no KV cache (attention-free); run it "
                        "without kvtier")
    if len(groups) > 1:
        return _hybrid_geometry(groups, tp_world, model)
    spec = groups[0].kv_cache_spec
    kind = type(spec).__name__
    window = 0
    if kind == "MLAAttentionSpec":
        _check_mla(spec)
    elif kind == "SlidingWindowSpec":
        window = _window_tokens(spec)
    elif kind != "FullAttentionSpec":
        raise TierError(_SPEC_REFUSED.get(kind, _SPEC_OTHER).format(kind=kind))
    for attr in ("num_kv_heads", "head_size", "block_size", "page_size_bytes", "dtype"):
        if not hasattr(spec, attr):
            raise TierError(f"kvtier cannot store KV of {kind} layers (no {attr})")
    return Geometry(
        num_layers=len(groups[0].layer_names),
        **_page_fields(spec),
        tp_world=tp_world,
        replicated=kind == "MLAAttentionSpec",
        window=window,
    )


def _window_tokens(spec: Any) -> int:
    """The tokens a ``SlidingWindowSpec`` group keeps of a request: its window plus
    vLLM's ``extra_retained_tokens``."""
    return int(spec.sliding_window) + int(getattr(spec, "extra_retained_tokens", 0))


def _page_fields(spec: Any) -> dict[str, Any]:
    """The ``Geometry`` fields a KV-cache spec gives for each of its layers' blocks."""
    return {
        "num_kv_heads": int(spec.num_kv_heads),
        "head_size": int(spec.head_size),
        "block_size": int(spec.block_size),
        "page_bytes": int(spec.page_size_bytes),
        "kv_dtype": str(spec.dtype).removeprefix("torch."),
        "head_size_v": _head_size_v(spec),
    }


def _hybrid_geometry(groups: Sequence[Any], tp_world: int, model: str) -> Geometry:
    """A hybrid model's geometry: every group full, sliding-window or chunked-local
    attention, with one block size and one page shape (what vLLM's hybrid manager makes
    of Gemma-2/3, gpt-oss, Cohere2, Mistral-style interleaved windows, and of Llama-4
    when ``VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE`` lets it keep chunked-local
    groups). Anything else is refused, naming the model and the group kind:
    Mamba/linear-attention state and MLA groups are stored per request, not per prefix
    block, or laid out otherwise."""
    shapes: list[GroupShape] = []
    first = groups[0].kv_cache_spec
    names = hashlib.blake2b(digest_size=8)
    for i, g in enumerate(groups):
        spec = g.kv_cache_spec
        kind = type(spec).__name__
        if kind not in ("FullAttentionSpec", "SlidingWindowSpec", "ChunkedLocalAttentionSpec"):
            raise TierError(
                f"kvtier cannot store the KV of {model}: its KV-cache group {i} is {kind} "
                f"({_HYBRID_WHY.get(kind, 'a kind of state kvtier does not know the blocks of')}"
                "). kvtier stores hybrid models whose groups are full, sliding-window and "
                "chunked-local attention. Run this model without kvtier"
            )
        mine, base = _page_fields(spec), _page_fields(first)
        for attr, value in mine.items():
            if value != base[attr]:
                raise TierError(
                    f"kvtier cannot store the KV of {model}: its KV-cache groups differ in "
                    f"{attr} ({base[attr]} vs {value} in group {i}); run it without kvtier"
                )
        window = chunk = 0
        if kind == "SlidingWindowSpec":
            window = _window_tokens(spec)
        elif kind == "ChunkedLocalAttentionSpec":
            chunk = int(spec.attention_chunk_size)
        shapes.append(GroupShape(len(g.layer_names), window, chunk))
        _part(names, "|".join(g.layer_names).encode())
    return Geometry(
        num_layers=max(s.layers for s in shapes),
        **_page_fields(first),
        tp_world=tp_world,
        groups=tuple(shapes),
        group_layers=names.hexdigest(),
    )


_HYBRID_WHY = {
    "MambaSpec": "Mamba/linear-attention state: one state per request, not a KV block per "
                 "prefix position",
    "MLAAttentionSpec": "MLA in a hybrid model",
}


def _head_size_v(spec: Any) -> int | None:
    v = getattr(spec, "head_size_v", None)
    return None if v is None or int(v) == int(spec.head_size) else int(v)


def _check_mla(spec: Any) -> None:
    """Dense MLA (DeepSeek-V2/V3's latent cache, every token's latent in its block) is
    stored like full attention, one copy for all ranks. Sparse and padded variants
    (DeepSeek-V3.2/V4: an indexer cache, aligned or compressed states) lay blocks out
    otherwise and are refused."""
    odd = {name: getattr(spec, name, None) for name in ("alignment", "model_version")}
    odd = {k: v for k, v in odd.items() if v is not None}
    if getattr(spec, "is_index_group_leader", False):
        odd["is_index_group_leader"] = True
    if odd:
        raise TierError(
            f"kvtier supports dense MLA caches (DeepSeek-V2/V3); this model's MLA cache has "
            f"{odd} (a sparse or padded variant, e.g. DeepSeek-V3.2/V4). Run it without kvtier"
        )


_SPEC_OTHER = (
    "kvtier supports full-attention KV caches (FullAttentionSpec); this model's KV cache "
    "is {kind}, whose blocks kvtier would store or restore wrongly. Run it without kvtier"
)
_SPEC_REFUSED = {
    "ChunkedLocalAttentionSpec": (
        "kvtier does not support a model whose layers are all chunked-local attention "
        "({kind}): out-of-chunk blocks are vLLM's null block. Run it without kvtier"
    ),
}


def tp_placement(vllm_config: Any) -> tuple[int, int]:
    """``(tp_rank, tp_world_size)`` of this process; both sides derive the pool name from it."""
    pc = vllm_config.parallel_config
    world = int(pc.tensor_parallel_size)
    return int(getattr(pc, "rank", 0)) % max(1, world), world


# -- what only the worker sees ---------------------------------------------------------------
def is_quantized_kv(cache_dtype: str) -> bool:
    return str(cache_dtype) not in UNQUANTIZED_KV


def check_kv_scales_config(cache_config: Any) -> None:
    """Refuse KV scales computed at run time: KV stored by one engine would be read back
    with another engine's scales (``TierError`` saying what to change)."""
    dtype = str(getattr(cache_config, "cache_dtype", "auto"))
    if getattr(cache_config, "calculate_kv_scales", False) and is_quantized_kv(dtype):
        raise TierError(_RUNTIME_SCALES.format(dtype=dtype))


_RUNTIME_SCALES = (
    "kvtier: kv_cache_dtype {dtype} with calculate_kv_scales computes the k/v scales from "
    "the first batch this engine sees, so KV stored under one engine's scales would be "
    "restored under another's (wrong attention). Drop --calculate-kv-scales (the scales "
    "then come from the checkpoint, or are 1.0), or use --kv-cache-dtype auto"
)


def _scale_bytes(layer: Any, name: str) -> bytes:
    tensor = getattr(layer, f"_{name}", None)
    if tensor is not None and hasattr(tensor, "detach"):
        return bytes(tensor.detach().float().cpu().contiguous().numpy().tobytes())
    value = float(getattr(layer, f"_{name}_float", 1.0))
    return value.hex().encode()


def kv_scales_digest(layers: Sequence[tuple[str, Any]], cache_dtype: str) -> str:
    """Digest of the k/v scales the attention ``layers`` (``(name, module)``, in KV-cache
    order) quantize with; ``""`` when the cache is not quantized (scales unused).

    Reads each layer's ``_k_scale``/``_v_scale`` (a tensor, per tensor or per head) after
    the weights are loaded, and the layer's own cache dtype (``kv_cache_dtype_skip_layers``
    leaves some layers unquantized). Raises ``TierError`` for a layer that computes its
    scales at run time (``calculate_kv_scales``).
    """
    dtypes = [str(getattr(m, "kv_cache_dtype", cache_dtype)) for _, m in layers]
    if not is_quantized_kv(cache_dtype) and not any(is_quantized_kv(d) for d in dtypes):
        return ""
    h = hashlib.blake2b(digest_size=16)
    for (name, layer), dtype in zip(layers, dtypes, strict=True):
        if getattr(layer, "calculate_kv_scales", False) and is_quantized_kv(dtype):
            raise TierError(_RUNTIME_SCALES.format(dtype=dtype))
        for part in (name.encode(), dtype.encode(), _scale_bytes(layer, "k_scale"),
                     _scale_bytes(layer, "v_scale")):
            h.update(len(part).to_bytes(8, "little") + part)
    return h.hexdigest()


def describe_layout(backend_cls: Any, layout_name: str | None, layout: Any) -> str:
    """The physical layout of the registered KV tensors as one string: the attention
    backend, vLLM's resolved ``KVCacheLayout`` name, and the per-layer shape (blocks as
    ``*``), stride order, block dim and dtype (a ``kvtier.ops.KVLayout``)."""
    get_name = getattr(backend_cls, "get_name", None)
    backend = str(get_name()) if callable(get_name) else str(backend_cls.__qualname__)
    shape = ",".join("*" if i == layout.block_dim else str(s) for i, s in enumerate(layout.shape))
    order = ",".join(str(d) for d in layout.stride_order)
    dtype = str(layout.dtype).removeprefix("torch.")
    return (f"{backend};layout={layout_name or 'backend-preferred'};shape={shape};"
            f"order={order};block_dim={layout.block_dim};dtype={dtype}")


# -- model identity --------------------------------------------------------------------------
def _part(h: Any, data: bytes) -> None:
    h.update(len(data).to_bytes(8, "little") + data)


def _weight_files(root: Path, ignore: Sequence[str] = ()) -> Iterator[tuple[str, Path]]:
    """Every weight or JSON file under ``root`` (subdirectories included, hidden ones
    not), as ``(relative posix path, path)`` sorted by name, less those matching a glob
    of ``ignore`` (vLLM's ``load_config.ignore_patterns``, by default ``original/**/*``:
    files vLLM never loads must not split two copies of one checkpoint)."""
    found: list[tuple[str, Path]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for f in filenames:
            if f.endswith((*WEIGHT_SUFFIXES, ".json")) and not f.startswith("."):
                p = Path(dirpath, f)
                rel = p.relative_to(root).as_posix()
                if not any(fnmatch.fnmatch(rel, pat) or fnmatch.fnmatch(
                        rel, pat.replace("**/", "")) for pat in ignore):  # ** = 0+ dirs
                    found.append((rel, p))
    return iter(sorted(found))


def _st_header_len(head: bytes, size: int) -> int | None:
    """The header length of a safetensors file that starts with ``head``, if plausible."""
    n = int.from_bytes(head[:8], "little") if len(head) >= 8 else 0
    return n if 0 < n <= min(_MAX_ST_HEADER, size - 8) else None


def _tensor_ranges(header: bytes, base: int, size: int) -> list[tuple[int, int]]:
    """The first and last ``_TENSOR_SAMPLE`` bytes of every tensor a safetensors
    ``header`` lists (data starting at ``base``)."""
    try:
        meta = json.loads(header)
        spans = sorted((int(v["data_offsets"][0]), int(v["data_offsets"][1]))
                       for k, v in meta.items() if k != "__metadata__")
    except (ValueError, TypeError, KeyError, AttributeError, IndexError):
        return _windows(size)  # not a header we can read: sample like any other file
    out: list[tuple[int, int]] = []
    for lo, hi in spans:
        lo, hi = base + lo, min(base + hi, size)
        out.append((lo, max(0, min(hi - lo, _TENSOR_SAMPLE))))
        if hi - lo > _TENSOR_SAMPLE:
            tail = max(lo + _TENSOR_SAMPLE, hi - _TENSOR_SAMPLE)
            out.append((tail, hi - tail))
    return out


def _windows(size: int) -> list[tuple[int, int]]:
    """``_WINDOWS`` windows of ``_WINDOW`` bytes spread evenly over a file."""
    if size <= 2 * _SAMPLE:
        return []
    step = (size - 2 * _SAMPLE) // (_WINDOWS + 1)
    return [(_SAMPLE + i * step, min(_WINDOW, size - _SAMPLE - i * step))
            for i in range(1, _WINDOWS + 1)]


def _sample_file(h: Any, path: Path, size: int) -> None:
    """Every byte of a file up to 2 MiB; of a bigger one the first and last MiB, and in
    between every tensor's first and last bytes (safetensors, with its header whole) or
    ``_WINDOWS`` evenly spread windows (other formats)."""
    with open(path, "rb") as fh:
        fd = fh.fileno()
        head = os.pread(fd, _SAMPLE, 0)
        _part(h, head)
        if size > _SAMPLE:
            tail = max(_SAMPLE, size - _SAMPLE)
            _part(h, os.pread(fd, size - tail, tail))
        n = _st_header_len(head, size) if path.suffix == ".safetensors" else None
        ranges = _windows(size)
        if n is not None:
            header = os.pread(fd, n, 8)
            _part(h, header)
            ranges = _tensor_ranges(header, 8 + n, size)
        for off, length in ranges:
            _part(h, off.to_bytes(8, "little") + os.pread(fd, length, off))


def weights_digest(root: Path, ignore: Sequence[str] = ()) -> str:
    """Digest of a checkpoint's files: every weight file's relative name, size and a
    sample (``_sample_file``), and every JSON file (config, ``*.index.json``) whole;
    files matching ``ignore`` are left out. A file that cannot be read (a dangling link,
    no permission) is recorded as unreadable instead of failing the engine's start: vLLM
    fails on it itself if it needs it."""
    h = hashlib.blake2b(digest_size=16)
    files = [("", root)] if root.is_file() else list(_weight_files(root, ignore))
    for rel, path in files:
        _part(h, rel.encode())
        try:
            size = path.stat().st_size
            h.update(size.to_bytes(8, "little"))
            if path.suffix == ".json" and size <= _WHOLE_JSON:
                _part(h, path.read_bytes())
            else:
                _sample_file(h, path, size)
        except OSError as e:
            _part(h, f"unreadable:{e.errno}".encode())
    return h.hexdigest()


def _hub_cache_dirs(load_config: Any) -> list[Path]:
    dirs: list[Path] = []
    download_dir = getattr(load_config, "download_dir", None)
    if download_dir:
        dirs.append(Path(str(download_dir)))
    try:
        from huggingface_hub import constants

        dirs.append(Path(constants.HF_HUB_CACHE))
    except ImportError:  # pragma: no cover - vLLM depends on it
        pass
    return dirs


def resolve_revision(model_config: Any, load_config: Any = None) -> tuple[str, Path | None]:
    """``(revision, snapshot directory)`` of the model.

    A local directory or file: ``model_config.revision`` or ``""`` (its files are the
    identity). A hub id: the commit the HF cache resolved ``revision`` (default ``main``)
    to (``refs/<revision>``), and that commit's snapshot directory; a 40-hex revision is a
    commit already. If the cache does not know it: ``unresolved:<revision>`` and no
    directory (this engine could not have loaded the weights offline either).
    """
    model = str(model_config.model)
    rev = getattr(model_config, "revision", None)
    if Path(model).exists():
        return ("" if rev is None else str(rev)), None
    wanted = str(rev) if rev else "main"
    repo = "models--" + model.replace("/", "--")
    for cache in _hub_cache_dirs(load_config):
        commit = wanted if _COMMIT.fullmatch(wanted) else None
        if commit is None:
            try:
                commit = (cache / repo / "refs" / wanted).read_text().strip()
            except OSError:
                continue
        snapshot = cache / repo / "snapshots" / commit
        if _COMMIT.fullmatch(commit) and snapshot.is_dir():
            return commit, snapshot
    if _COMMIT.fullmatch(wanted):
        return wanted, None
    return f"unresolved:{wanted}", None


def model_fingerprint(model_config: Any, load_config: Any = None) -> str:
    """A digest of the model's identity: HF config, resolved revision, weight files."""
    h = hashlib.blake2b(digest_size=16)
    hf = getattr(model_config, "hf_config", None)
    if hf is not None and hasattr(hf, "to_dict"):
        _part(h, json.dumps(hf.to_dict(), sort_keys=True, default=str).encode())
    revision, snapshot = resolve_revision(model_config, load_config)
    _part(h, revision.encode())
    path = Path(str(model_config.model))
    files = path if path.exists() else snapshot
    if files is not None:
        ignore = getattr(load_config, "ignore_patterns", None)
        patterns = [str(p) for p in ignore] if isinstance(ignore, (list, tuple)) else []
        _part(h, weights_digest(files, patterns).encode())
    return h.hexdigest()


def namespace_for(
    vllm_config: Any,
    geometry: Geometry,
    chunk_tokens: int,
    *,
    physical: PhysicalKV,
    fingerprint: str | None = None,
) -> Namespace:
    """The engine's namespace: the model, how its KV is computed and stored, and what
    the worker published (``physical``). ``fingerprint`` overrides ``model_fingerprint``."""
    mc = vllm_config.model_config
    load_config = getattr(vllm_config, "load_config", None)
    tp_rank, tp_world = tp_placement(vllm_config)
    if geometry.replicated:  # one copy, whatever the TP size: shared across TP sizes
        tp_rank, tp_world = 0, 1
    quant = getattr(mc, "quantization", None)
    dtype = getattr(mc, "dtype", None)
    return Namespace(
        model=str(mc.model),
        model_fingerprint=fingerprint or model_fingerprint(mc, load_config),
        kv_dtype=geometry.kv_dtype,
        kv_layout=physical.kv_layout,
        num_layers=geometry.num_layers,
        num_kv_heads=geometry.num_kv_heads,
        head_size=geometry.head_size,
        chunk_tokens=chunk_tokens,
        block_size=geometry.block_size,
        tp_rank=tp_rank,
        tp_world_size=tp_world,
        kv_cache_dtype=physical.kv_cache_dtype,
        kv_scales=physical.kv_scales,
        quantization="" if quant is None else str(quant),
        revision=resolve_revision(mc, load_config)[0],
        model_dtype="" if dtype is None else str(dtype).removeprefix("torch."),
        attention=geometry.attention,
    )
