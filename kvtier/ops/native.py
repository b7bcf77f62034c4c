"""Loading of the native extension ``kvtier._C``.

Two failures are told apart and never confused:

* not built: ``kvtier._C`` does not exist for this interpreter (``ModuleNotFoundError``
  naming exactly ``kvtier._C``). ``copy_backend: auto`` falls back to the torch
  reference; ``native`` is an error that says to run ``make native``.
* built but broken: the module exists but does not load (undefined symbol after a torch
  upgrade, missing library, missing ops). That is always a ``NativeBrokenError`` carrying
  the original error, whatever the mode: a stale build must not be silently bypassed.

Invariant: the module is imported at most once per process (``native_status`` caches),
and a missing build is said once per process, loudly: ``native_status``'s first call logs
a WARNING to ``kvtier.ops`` naming how to build it (unless ``KVTIER_NATIVE=0`` says the
extension was left out on purpose). pip hides the build's own message unless ``-v``.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch

log = logging.getLogger("kvtier.ops")

MODULE = "kvtier._C"
BUILD_HINT = (
    "run `make native` (python setup.py build_ext --inplace) in an editable checkout, or "
    "reinstall: pip install --no-build-isolation --force-reinstall --no-deps <checkout>; "
    "`kvtier doctor` checks the install"
)


class NativeBrokenError(RuntimeError):
    """``kvtier._C`` exists but cannot be used."""


@dataclass(frozen=True)
class NativeStatus:
    """Whether ``kvtier._C`` is usable, and with which devices."""

    available: bool
    has_cuda: bool
    detail: str  # build info when available, why not otherwise


def load_native(importer: Callable[[str], ModuleType] = importlib.import_module) -> NativeStatus:
    """Imports ``kvtier._C`` (registering the ``torch.ops.kvtier`` ops) and reports on it.

    Raises ``NativeBrokenError`` when the module exists but fails to load.
    """
    try:
        importer(MODULE)
    except ModuleNotFoundError as e:
        if e.name != MODULE:
            raise NativeBrokenError(
                f"{MODULE} is built but a module it needs is missing ({e}); {BUILD_HINT}"
            ) from e
        return NativeStatus(False, False, f"{MODULE} is not built; {BUILD_HINT}")
    except (ImportError, OSError) as e:
        raise NativeBrokenError(
            f"{MODULE} is built but cannot be loaded with torch {torch.__version__} ({e}); "
            f"rebuild it: {BUILD_HINT}"
        ) from e
    try:
        info = str(torch.ops.kvtier.build_info())
    except (AttributeError, RuntimeError) as e:
        raise NativeBrokenError(
            f"{MODULE} loaded but does not register the kvtier ops ({e}); {BUILD_HINT}"
        ) from e
    return NativeStatus(True, "cuda=1" in info.split(), info)


@functools.cache
def native_status() -> NativeStatus:
    """``load_native()`` once per process; a missing build is logged once as a warning."""
    status = load_native()
    if not status.available and os.environ.get("KVTIER_NATIVE") != "0":
        log.warning("%s. kvtier runs its torch reference ops instead: correct, but the "
                    "host<->device copies are slower (the scatter is 14-40x slower on CPU)",
                    status.detail)
    return status
