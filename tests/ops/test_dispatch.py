"""Backend selection: auto falls back once with a reason, native never falls back, a
broken build is never hidden."""

from __future__ import annotations

import logging
import uuid
from types import ModuleType

import pytest
import torch

from kvtier.ops import (
    NativeBrokenError,
    NativeStatus,
    NativeUnavailableError,
    native_status,
    resolve_copy_backend,
)
from kvtier.ops.native import load_native


def _not_built() -> NativeStatus:
    # A unique reason per test: auto logs each distinct reason once per process.
    return NativeStatus(False, False, f"kvtier._C is not built ({uuid.uuid4()})")


def test_torch_mode_never_loads_native() -> None:
    broken = NativeStatus(False, False, "must not be consulted")
    assert resolve_copy_backend("torch", native=broken).name == "torch"


def test_native_mode_without_build_says_how_to_build() -> None:
    status = NativeStatus(False, False, load_native(_missing).detail)
    with pytest.raises(NativeUnavailableError, match="make native"):
        resolve_copy_backend("native", native=status)


def test_auto_falls_back_and_logs_the_reason_once(caplog: pytest.LogCaptureFixture) -> None:
    status = _not_built()
    with caplog.at_level(logging.INFO, logger="kvtier.ops"):
        first = resolve_copy_backend("auto", native=status)
        second = resolve_copy_backend("auto", native=status)
    assert first.name == second.name == "torch"
    records = [r for r in caplog.records if status.detail in r.getMessage()]
    assert len(records) == 1


def test_auto_picks_native_when_usable() -> None:
    status = NativeStatus(True, torch.cuda.is_available(), "cuda=?")
    assert resolve_copy_backend("auto", native=status).name == "native"


def test_cpu_only_build_is_not_used_when_cuda_is_present() -> None:
    status = NativeStatus(True, False, "cuda=0")
    if not torch.cuda.is_available():
        assert resolve_copy_backend("native", native=status).name == "native"
        return
    with pytest.raises(NativeUnavailableError, match="without CUDA"):
        resolve_copy_backend("native", native=status)
    assert resolve_copy_backend("auto", native=status).name == "torch"


def test_unknown_modes_are_errors() -> None:
    with pytest.raises(ValueError, match="unknown mode 'fast'"):
        resolve_copy_backend("fast")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="cuda_strategy"):
        resolve_copy_backend("torch", cuda_strategy="dma")  # type: ignore[arg-type]


def _missing(name: str) -> ModuleType:
    raise ModuleNotFoundError(f"No module named {name!r}", name=name)


def test_missing_module_is_not_built() -> None:
    status = load_native(_missing)
    assert not status.available
    assert "make native" in status.detail


def test_abi_error_is_raised_with_the_original_error() -> None:
    original = ImportError("kvtier/_C.so: undefined symbol: _ZN3c106detail14torchCheckFail")

    def importer(name: str) -> ModuleType:
        raise original

    with pytest.raises(NativeBrokenError, match="undefined symbol") as info:
        load_native(importer)
    assert info.value.__cause__ is original


def test_missing_dependency_of_the_module_is_broken_not_absent() -> None:
    def importer(name: str) -> ModuleType:
        raise ModuleNotFoundError("No module named 'libfoo'", name="libfoo")

    with pytest.raises(NativeBrokenError, match="libfoo"):
        load_native(importer)


def test_this_build_matches_this_machine() -> None:
    """``make test`` builds kvtier._C first: it must load and match torch's CUDA."""
    status = native_status()
    if not status.available:
        pytest.fail(f"native ops unavailable: {status.detail}", pytrace=False)
    assert status.has_cuda == (torch.version.cuda is not None) or not torch.cuda.is_available()
