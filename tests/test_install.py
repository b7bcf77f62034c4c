"""Installing kvtier into an existing vLLM environment, and ``kvtier doctor`` on it.

* ``kvtier doctor`` in this environment reports vLLM, torch, the extension and
  ``/dev/shm``; a config whose host pool is larger than ``/dev/shm``'s free space fails
  with the ``--shm-size`` hint.
* The wheel path: ``pip wheel --no-build-isolation`` with this interpreter builds a wheel
  that carries ``kvtier/_C*.so``; installed into a fresh venv that sees this one's
  packages (vLLM, torch) through a ``.pth`` file, kvtier runs from that venv, extension
  included, and its connector imports.
* The fallback: a build whose compiler fails still produces a wheel, without the
  extension, and says why and how to retry.

Every build runs on a copy of the sources in a temporary directory (without any
``kvtier/_C*.so`` already built there), never in the checkout. Nothing here starts
vLLM; the wheel build compiles the extension once (about 40 s of CPU).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import site
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from kvtier import cli
from kvtier.ops import native
from kvtier.ops.native import NativeStatus

REPO = Path(__file__).resolve().parents[1]
BUILD_TIMEOUT_S = 540
RUN_TIMEOUT_S = 180


def _env(**extra: str) -> dict[str, str]:
    """This process's environment without PYTHONPATH (a fresh venv must not see the
    checkout), plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(extra)
    return env


def _sources(dest: Path) -> Path:
    """A copy of what a build reads (no built extension, no caches) under ``dest``."""
    src = dest / "kvtier-src"
    src.mkdir(parents=True)
    for name in ("setup.py", "pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, src / name)
    skip = shutil.ignore_patterns("__pycache__", "*.so", "*.pyc")
    shutil.copytree(REPO / "kvtier", src / "kvtier", ignore=skip)
    shutil.copytree(REPO / "native", src / "native", ignore=skip)
    return src


def _pip_wheel(src: Path, out: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """``pip wheel -v --no-build-isolation --no-deps`` of ``src`` into ``out``, offline."""
    return subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-v", "--no-build-isolation", "--no-deps",
         "--no-index", "-w", str(out), str(src)],
        env=env, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S, check=False)


def _one_wheel(out: Path) -> Path:
    wheels = list(out.glob("kvtier-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


def _extension_in(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as z:
        return [n for n in z.namelist() if n.startswith("kvtier/_C") and n.endswith(".so")]


def _doctor(python: str, *args: str, cwd: Path, env: dict[str, str]
            ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([python, "-m", "kvtier", "doctor", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=RUN_TIMEOUT_S, check=False)


def _checks(stdout: str) -> dict[str, dict[str, Any]]:
    report = json.loads(stdout)
    return {c["name"]: c for c in report["checks"]}


# --- kvtier doctor in this environment -----------------------------------------------


def test_doctor_reports_this_environment(capsys: pytest.CaptureFixture[str]) -> None:
    """One line per check (the wheel test below runs the command in a subprocess)."""
    rc = cli.main(["doctor"])
    out = capsys.readouterr().out
    lines = {line.split()[1]: line for line in out.splitlines()
             if line.split() and line.split()[0] in ("OK", "WARN", "FAIL")}
    assert set(lines) >= {"python", "kvtier", "vllm", "torch", "kvtier._C", "pinned", "shm"}
    assert "0.32.0" in lines["vllm"], out
    import torch

    assert torch.__version__ in lines["torch"]
    assert "CPU build" in lines["torch"] or "CUDA" in lines["torch"]
    assert "built" in lines["kvtier._C"], lines["kvtier._C"]  # "built, ..." or "not built"
    assert os.environ.get("KVTIER_SHM_DIR", "/dev/shm") in lines["shm"]
    failed = [line for line in lines.values() if line.startswith("FAIL")]
    assert rc == (1 if failed else 0), out


def test_doctor_json_is_one_object(capsys: pytest.CaptureFixture[str]) -> None:
    rc = cli.main(["doctor", "--json"])
    out = capsys.readouterr().out
    report = json.loads(out)  # nothing else on stdout
    checks = _checks(out)
    assert report["ok"] == (rc == 0) == all(c["status"] != "fail" for c in checks.values())
    assert checks["vllm"]["details"]["version"] == "0.32.0"
    assert checks["vllm"]["status"] == "ok"
    assert isinstance(checks["kvtier._C"]["details"]["available"], bool)
    assert checks["shm"]["details"]["free"] > 0


def test_doctor_fails_a_host_pool_larger_than_shm(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """Nothing is allocated: the capacity is larger than /dev/shm can hold."""
    st = os.statvfs(os.environ.get("KVTIER_SHM_DIR", "/dev/shm"))
    too_big = st.f_bavail * st.f_frsize + 2**30
    cfg = tmp_path / "big.yaml"
    cfg.write_text(f"tiers:\n  - host: {{capacity: {too_big}}}\n")
    rc = cli.main(["doctor", "--config", str(cfg)])
    out = capsys.readouterr().out
    assert rc == 1
    shm = next(line for line in out.splitlines() if line.split()[1:2] == ["shm"])
    assert shm.startswith("FAIL") and "does not fit" in shm
    assert "--shm-size" in out
    assert any(line.startswith("OK    config") for line in out.splitlines()), out


def test_doctor_names_an_invalid_config(tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("tiers:\n  - host: {capacity: 1GiB, bogus: 1}\n")
    assert cli.main(["doctor", "--json", "--config", str(cfg)]) == 1
    config = _checks(capsys.readouterr().out)["config"]
    assert config["status"] == "fail" and "tiers[0].host.bogus" in config["found"]


# --- the runtime warning --------------------------------------------------------------


@pytest.fixture
def fresh_native_status() -> Iterator[None]:
    native.native_status.cache_clear()
    yield
    native.native_status.cache_clear()  # the next caller loads the real one


def _absent(name: str) -> ModuleType:
    raise ModuleNotFoundError(f"No module named {name!r}", name=name)


@pytest.mark.usefixtures("fresh_native_status")
def test_missing_extension_is_a_warning_once(monkeypatch: pytest.MonkeyPatch,
                                             caplog: pytest.LogCaptureFixture) -> None:
    missing = native.load_native(_absent)
    monkeypatch.setattr(native, "load_native", lambda: missing)
    monkeypatch.delenv("KVTIER_NATIVE", raising=False)
    with caplog.at_level(logging.WARNING, logger="kvtier.ops"):
        assert native.native_status() == NativeStatus(False, False, missing.detail)
        native.native_status()
    warned = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1
    assert "kvtier._C is not built" in warned[0].getMessage()
    assert "--no-build-isolation" in warned[0].getMessage()


@pytest.mark.usefixtures("fresh_native_status")
def test_no_warning_when_the_extension_was_left_out(monkeypatch: pytest.MonkeyPatch,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    missing = native.load_native(_absent)
    monkeypatch.setattr(native, "load_native", lambda: missing)
    monkeypatch.setenv("KVTIER_NATIVE", "0")
    with caplog.at_level(logging.WARNING, logger="kvtier.ops"):
        native.native_status()
    assert not caplog.records


# --- the wheel into an existing vLLM environment ----------------------------------------


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A wheel built the way the README says, with this interpreter (which has vLLM,
    torch, setuptools and wheel), extension included."""
    base = tmp_path_factory.mktemp("wheel")
    out = base / "dist"
    done = _pip_wheel(_sources(base), out, _env())
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    return _one_wheel(out)


def _fresh_venv(root: Path, wheel: Path) -> Path:
    """A venv made with ``python -m venv --without-pip`` that sees this environment's
    packages (vLLM, torch, ...) through a ``.pth`` file, so nothing is downloaded again:
    an existing vLLM environment. The wheel is unpacked into its site-packages (what
    ``pip install --no-deps`` does), rather than installed with pip: through the ``.pth``
    pip would see this environment's own kvtier and could try to replace it. The
    ``.pth`` names directories only, so this environment's editable-install hook (itself
    a ``.pth`` line) does not run there: kvtier comes from the wheel or nowhere."""
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True,
                   timeout=RUN_TIMEOUT_S)
    python = venv / "bin" / "python"
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True, env=_env()).stdout.strip()
    site_packages = Path(purelib)
    (site_packages / "existing-vllm-env.pth").write_text(
        "".join(f"{p}\n" for p in site.getsitepackages()))
    with zipfile.ZipFile(wheel) as z:
        z.extractall(site_packages)
    return python


def test_wheel_carries_the_extension_and_runs_from_a_fresh_venv(
        wheel: Path, tmp_path: Path) -> None:
    assert _extension_in(wheel), f"no kvtier/_C*.so in {wheel.name}"
    python = _fresh_venv(tmp_path, wheel)
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    env = _env()

    done = _doctor(str(python), "--json", cwd=elsewhere, env=env)
    checks = _checks(done.stdout)
    venv = str(tmp_path / "venv")
    assert checks["kvtier"]["details"]["path"].startswith(venv), checks["kvtier"]
    ext = checks["kvtier._C"]
    assert ext["status"] == "ok" and ext["details"]["available"], ext
    assert ext["details"]["path"].startswith(venv), ext
    assert checks["vllm"]["details"]["version"] == "0.32.0"

    imported = subprocess.run(
        [str(python), "-c", "import kvtier, kvtier.vllm; "
         "from kvtier.vllm.connector import KVTierConnector; print(kvtier.__file__)"],
        cwd=elsewhere, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S,
        check=False)
    assert imported.returncode == 0, imported.stderr[-4000:]
    assert imported.stdout.strip().splitlines()[-1].startswith(venv)


# --- the fallback --------------------------------------------------------------------


def test_a_failing_compiler_still_installs_and_says_so(tmp_path: Path) -> None:
    """``CXX`` is what torch's ninja build compiles and links with, ``CC`` what the
    distutils path (no ninja) compiles with: both fail."""
    out = tmp_path / "dist"
    done = _pip_wheel(_sources(tmp_path), out, _env(CXX="/bin/false", CC="/bin/false"))
    said = done.stdout + done.stderr
    assert done.returncode == 0, said[-4000:]
    assert not _extension_in(_one_wheel(out))
    assert "kvtier._C was NOT built" in said
    assert "torch reference" in said
    assert "pip install --no-build-isolation --force-reinstall --no-deps ." in said
    assert "python setup.py build_ext --inplace" in said


def test_a_required_extension_fails_the_build(tmp_path: Path) -> None:
    """``KVTIER_NATIVE=1``: the user asked for the extension, so its failure is an error."""
    out = tmp_path / "dist"
    done = _pip_wheel(_sources(tmp_path), out,
                      _env(CXX="/bin/false", CC="/bin/false", KVTIER_NATIVE="1"))
    assert done.returncode != 0
    assert not list(out.glob("*.whl"))


def test_an_isolated_build_says_no_build_isolation(tmp_path: Path) -> None:
    """Where the build cannot import torch (pip's isolated build environment)."""
    src = _sources(tmp_path)
    script = ("import sys; sys.modules['torch'] = None; sys.argv = ['setup.py', '--version']; "
              "exec(compile(open('setup.py').read(), 'setup.py', 'exec'))")
    done = subprocess.run([sys.executable, "-c", script], cwd=src, env=_env(),
                          capture_output=True, text=True, timeout=RUN_TIMEOUT_S, check=False)
    assert done.returncode == 0, done.stderr
    assert "torch is not importable" in done.stderr
    assert "isolated" in done.stderr and "--no-build-isolation" in done.stderr


def test_the_build_message_names_the_cause(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    """Each cause by what the toolchain says, not by the command line it ran."""
    import runpy

    from torch.utils.cpp_extension import CUDA_MISMATCH_MESSAGE

    monkeypatch.chdir(_sources(tmp_path))
    monkeypatch.setenv("KVTIER_NATIVE", "0")  # setup() builds nothing
    monkeypatch.setattr(sys, "argv", ["setup.py", "--version"])
    cause = runpy.run_path("setup.py")["_cause"]
    capsys.readouterr()
    generic = cause(RuntimeError("FAILED: ops.o\nc++ -fopenmp -c ops.cpp\nops.cpp:1: error: x"))
    assert "the compile or link failed" in generic[0] and "error: x" in generic[0]
    no_omp = cause(RuntimeError("ops.cpp:1: fatal error: omp.h: No such file or directory"))
    assert "no OpenMP" in no_omp[0]
    mismatch = cause(RuntimeError(CUDA_MISMATCH_MESSAGE, "12.1", "12.8"))
    assert "(12.1)" in mismatch[0] and "KVTIER_BUILD_CUDA=0" in mismatch[1]
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    assert "no C++ compiler" in cause(RuntimeError("x"))[0]
