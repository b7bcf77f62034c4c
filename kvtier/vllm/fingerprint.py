"""The model fingerprint: a digest of a model's identity, part of every namespace.

``model_fingerprint`` covers the HF config, the resolved revision, and every weight file
(names, sizes, safetensors headers and the first and last 4 KiB of every tensor, index
and config files, the first and last MiB of each), so two different checkpoints under
one name never share KV, without hashing gigabytes at start.

Reads files only at engine start and never on a request's path.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import re
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

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
_COMMIT = re.compile(r"[0-9a-f]{40}")


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
