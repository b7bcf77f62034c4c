"""``kvtier doctor``: is this environment ready to run kvtier under vLLM?

One ``Check`` per thing kvtier needs, each found by looking, never by doing: Python,
kvtier itself, vLLM (and kvtier's connector importing against it), torch and CUDA, the
native extension ``kvtier._C``, page-locking a few KiB of host memory, ``/dev/shm``
(where the connector's host pool lives) and, with a config, whether that config
validates and its host pool fits.

Invariants:

* Read-only and small: it never allocates the configured host pool, opens or creates a
  tier, or writes a file. The largest allocation is one page (the pinned probe).
* Every failing check carries the fix; ``run`` returns 0 when no check failed, 1
  otherwise. A ``warn`` (e.g. another vLLM version than the tested one) never fails.
* With ``--json`` stdout holds exactly one JSON object: whatever the imported libraries
  print while they are imported goes to stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import mmap
import os
import platform
import resource
import sys
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from kvtier.sizes import format_size

Status = Literal["ok", "warn", "fail"]

#: The vLLM release kvtier's tests run against.
TESTED_VLLM = "0.32.0"
MIN_PYTHON = (3, 11)
#: Below this, /dev/shm is too small for any useful host pool (Docker's default is 64 MB).
SMALL_SHM = 1 << 30
REINSTALL = "pip install --no-build-isolation --force-reinstall --no-deps <checkout or git URL>"
SHM_FIX = ("give the container a larger /dev/shm (`docker run --shm-size=16g`, or a "
           "memory-backed emptyDir on Kubernetes) or lower tiers[0].host.capacity")


@dataclass(frozen=True)
class Check:
    """One finding: what was looked at, what was found, and the fix when it is not ok."""

    name: str
    status: Status
    found: str
    fix: str = ""
    details: dict[str, Any] = field(default_factory=dict)


def check_python() -> Check:
    """The interpreter: kvtier needs 3.11 or later."""
    version = platform.python_version()
    details = {"version": version, "executable": sys.executable}
    if sys.version_info[:2] < MIN_PYTHON:
        return Check("python", "fail", f"{version} ({sys.executable})",
                     "kvtier needs Python 3.11 or later", details)
    return Check("python", "ok", f"{version} ({sys.executable})", details=details)


def check_kvtier() -> Check:
    """kvtier's version and where it was imported from."""
    import kvtier

    path = str(Path(kvtier.__file__).resolve().parent)
    return Check("kvtier", "ok", f"{kvtier.__version__} at {path}",
                 details={"version": kvtier.__version__, "path": path})


def check_vllm() -> Check:
    """vLLM importable, its version against the tested one, and kvtier's connector
    importing against it (what ``kv_connector_module_path: kvtier.vllm`` loads)."""
    try:
        import vllm
    except Exception as e:  # any import failure: a broken install is as bad as none
        return Check("vllm", "fail", f"not importable ({type(e).__name__}: {e})",
                     f"install vLLM into this environment (kvtier is tested with vLLM "
                     f"{TESTED_VLLM})", {"version": None})
    version = str(getattr(vllm, "__version__", "unknown"))
    details: dict[str, Any] = {"version": version, "tested": TESTED_VLLM}
    try:
        importlib.import_module("kvtier.vllm.connector")
    except Exception as e:
        return Check("vllm", "fail",
                     f"{version}, but kvtier's connector does not import against it "
                     f"({type(e).__name__}: {e})",
                     f"use vLLM {TESTED_VLLM}, the version kvtier is tested with", details)
    if version != TESTED_VLLM:
        return Check("vllm", "warn", f"{version}; kvtier is tested with {TESTED_VLLM}",
                     f"vLLM {TESTED_VLLM} is the tested version; others may work", details)
    return Check("vllm", "ok", f"{version} (the tested version); connector imports",
                 details=details)


def check_torch() -> Check:
    """torch's version, whether it is a CUDA build, and the device it sees."""
    try:
        import torch
    except Exception as e:
        return Check("torch", "fail", f"not importable ({type(e).__name__}: {e})",
                     "install the torch your vLLM needs (pip shows it: pip show vllm)")

    cuda_build = torch.version.cuda
    available = bool(torch.cuda.is_available())
    device = torch.cuda.get_device_name(0) if available else None
    details = {"version": torch.__version__, "cuda_build": cuda_build,
               "cuda_available": available, "device": device}
    build = f"CUDA {cuda_build} build" if cuda_build else "CPU build"
    seen = f"CUDA available: {device}" if available else "CUDA not available"
    found = f"{torch.__version__}, {build}, {seen}"
    if cuda_build and not available:
        return Check("torch", "warn", found,
                     "a CUDA build sees no GPU: check the driver and CUDA_VISIBLE_DEVICES",
                     details)
    return Check("torch", "ok", found, details=details)


def check_native() -> Check:
    """``kvtier._C``: built, with CUDA, and usable for the devices present."""
    import torch

    from kvtier.ops.native import MODULE, NativeBrokenError, load_native

    where = None
    try:
        status = load_native()
    except NativeBrokenError as e:
        return Check("kvtier._C", "fail", f"built but broken: {e}",
                     f"rebuild it against this torch: {REINSTALL}", {"available": False})
    if status.available:
        where = getattr(sys.modules.get(MODULE), "__file__", None)
    details = {"available": status.available, "has_cuda": status.has_cuda,
               "detail": status.detail, "path": where}
    if not status.available:
        if os.environ.get("KVTIER_NATIVE") == "0":
            return Check("kvtier._C", "warn", "not built (KVTIER_NATIVE=0): torch reference ops",
                         f"to build it: {REINSTALL}", details)
        return Check("kvtier._C", "fail",
                     "not built: kvtier runs its torch reference ops (slower)",
                     f"install a C++ compiler with OpenMP, then {REINSTALL} (add -v to see "
                     "the build); in an editable checkout: python setup.py build_ext --inplace",
                     details)
    kind = "with CUDA" if status.has_cuda else "CPU only"
    found = f"built, {kind} ({status.detail}) at {where}"
    if torch.cuda.is_available() and not status.has_cuda:
        return Check("kvtier._C", "fail", f"{found}, but CUDA is available",
                     f"rebuild it with nvcc on PATH or CUDA_HOME set: {REINSTALL}", details)
    package = Path(importlib.import_module("kvtier").__file__ or ".").resolve().parent
    if where is not None and Path(where).resolve().parent != package:
        return Check("kvtier._C", "warn", f"{found}, outside the kvtier imported ({package})",
                     "another install's extension is on the path (an editable install of "
                     "another checkout?): build this one's, or run the one installed", details)
    return Check("kvtier._C", "ok", found, details=details)


def check_pinned() -> Check:
    """Page-lock one page of host memory the way the host pool is (``register_pinned``);
    where there is no CUDA device, pageable memory is what the pool uses."""
    from kvtier.hostmem import anonymous, register_pinned

    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    memlock = "unlimited" if soft == resource.RLIM_INFINITY else format_size(soft)
    details: dict[str, Any] = {"memlock_limit": None if soft == resource.RLIM_INFINITY
                               else soft}
    buf = anonymous(mmap.PAGESIZE)
    try:
        import torch

        if not torch.cuda.is_available():
            details["pinned"] = False
            return Check("pinned memory", "ok",
                         f"not needed: no CUDA device, the host pool is pageable "
                         f"(ulimit -l {memlock})", details=details)
        try:
            pinned = register_pinned(buf, owner=buf)
        except RuntimeError as e:
            details["pinned"] = False
            return Check("pinned memory", "fail", f"cannot page-lock host memory: {e}",
                         "raise the memlock limit (`ulimit -l unlimited`, docker "
                         "`--ulimit memlock=-1`) or set tiers[0].host.pinned: no", details)
        details["pinned"] = pinned
        return Check("pinned memory", "ok",
                     f"page-locked {format_size(mmap.PAGESIZE)} (ulimit -l {memlock})",
                     details=details)
    finally:
        del buf  # the registration goes with the mapping


def _shm_dir() -> Path:
    return Path(os.environ.get("KVTIER_SHM_DIR", "/dev/shm"))


def check_shm(host_capacity: int | None = None) -> Check:
    """``/dev/shm`` (``KVTIER_SHM_DIR``): its size and free bytes and, given the host
    pool's capacity, whether the pool fits in what is free."""
    shm = _shm_dir()
    try:
        st = os.statvfs(shm)
    except OSError as e:
        return Check("shm", "fail", f"{shm}: {e.strerror}",
                     f"the connector's host pool lives in {shm}: mount a tmpfs there or "
                     "point KVTIER_SHM_DIR at one", {"path": str(shm)})
    size, free = st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize
    details: dict[str, Any] = {"path": str(shm), "size": size, "free": free,
                               "host_capacity": host_capacity}
    found = f"{shm}: {format_size(size)}, {format_size(free)} free"
    if host_capacity is not None:
        need = format_size(host_capacity)
        if host_capacity > free:
            return Check("shm", "fail",
                         f"{found}; the host pool ({need}) does not fit",
                         f"the host pool lives in {shm} (Docker's default is 64 MB): "
                         f"{SHM_FIX}", details)
        return Check("shm", "ok", f"{found}; the host pool ({need}) fits", details=details)
    if size < SMALL_SHM:
        return Check("shm", "warn", f"{found}: too small for a useful host pool",
                     f"the host pool lives in {shm} (Docker's default is 64 MB): {SHM_FIX}",
                     details)
    return Check("shm", "ok", found, details=details)


def check_config(path: str) -> tuple[Check, int | None]:
    """The config validating (in memory only) and its host pool's capacity."""
    from kvtier.config import ConfigError, load_config

    try:
        cfg = load_config(path)
    except ConfigError as e:
        return Check("config", "fail", " ".join(line.strip() for line in str(e).splitlines()),
                     "fix the keys named above", {"path": path}), None
    capacity = cfg.host.capacity
    return Check("config", "ok",
                 f"{path}: valid, {len(cfg.tiers)} tiers, host pool {format_size(capacity)}",
                 details={"path": path, "tiers": len(cfg.tiers), "host_capacity": capacity}
                 ), capacity


def _guarded(name: str, fn: Callable[[], Check]) -> Check:
    """``fn()``, with an unexpected error reported as a failing check, not a traceback."""
    try:
        return fn()
    except Exception as e:
        return Check(name, "fail", f"the check itself failed: {type(e).__name__}: {e}",
                     "report this with the output of `kvtier doctor`")


def collect(config: str | None = None) -> list[Check]:
    """Every check, in the order they are printed."""
    checks = [
        _guarded("python", check_python),
        _guarded("kvtier", check_kvtier),
        _guarded("vllm", check_vllm),
        _guarded("torch", check_torch),
        _guarded("kvtier._C", check_native),
        _guarded("pinned memory", check_pinned),
    ]
    capacity = None
    if config is not None:
        cfg_check, capacity = check_config(config)
    checks.append(_guarded("shm", lambda: check_shm(capacity)))
    if config is not None:
        checks.append(cfg_check)
    return checks


def format_line(c: Check) -> str:
    """``STATUS name  found`` and, when not ok, ``  -> fix``."""
    line = f"{c.status.upper():<5} {c.name:<14} {c.found}"
    return f"{line}\n      -> {c.fix}" if c.fix and c.status != "ok" else line


@contextlib.contextmanager
def _stdout_to_stderr() -> Iterator[None]:
    """Keeps what libraries print on import off stdout (``--json`` owns it)."""
    with contextlib.redirect_stdout(sys.stderr):
        yield


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``kvtier doctor`` flags."""
    p.add_argument("--config", metavar="FILE", default=None,
                   help="also validate this config and check that its host pool fits "
                   "in /dev/shm (nothing is allocated)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead")


def run(args: argparse.Namespace) -> int:
    """Prints the checks (lines, or one JSON object with ``--json``); 0 if none failed."""
    with _stdout_to_stderr():
        checks = collect(args.config)
    ok = all(c.status != "fail" for c in checks)
    if args.json:
        print(json.dumps({"ok": ok, "checks": [asdict(c) for c in checks]}, indent=2))
    else:
        for c in checks:
            print(format_line(c))
        print("all checks passed" if ok else "some checks failed: see the fixes above")
    return 0 if ok else 1
