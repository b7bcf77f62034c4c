"""Build of kvtier's native extension ``kvtier._C`` (package metadata: pyproject.toml).

``python setup.py build_ext --inplace`` (``make native``) builds ``kvtier/_C*.so``:

* the CPU part (native/ops.cpp, native/pinned.cpp) always;
* the CUDA part (native/ops_cuda.cpp, native/cuda_copy.cu) only when the installed
  torch is a CUDA build and nvcc is found (``CUDA_HOME`` or ``PATH``);
  ``KVTIER_BUILD_CUDA=0`` forces a CPU-only build, ``=1`` makes a missing CUDA an error.

The build imports the torch it links against, so it runs without build isolation.

Invariant: the extension never makes an install fail. When torch is not importable
(``pip install .`` in an isolated build environment) or the compile or link fails (no
compiler, no OpenMP, a torch/CUDA mismatch), one message on stderr names the cause and
the command to retry, and kvtier is installed without ``kvtier._C``: ``kvtier.ops`` runs
its torch reference ops, the connector warns once at start, and ``kvtier doctor`` says
so. Two exceptions, both asked for: ``KVTIER_BUILD_CUDA=1`` and ``KVTIER_NATIVE=1``
(the extension is required) make a failed build an error. ``KVTIER_NATIVE=0`` skips it.
pip shows a successful build's output only with ``-v``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from typing import Any

from setuptools import setup

NATIVE = "native"
RETRY = (
    "  pip install --no-build-isolation --force-reinstall --no-deps .   (from the checkout)\n"
    "  python setup.py build_ext --inplace                              (an editable install)"
)


#: What a compiler without OpenMP says (gcc, clang, ld), never the command line itself.
_NO_OPENMP = ("omp.h: No such file", "'omp.h' file not found", "cannot find -lgomp",
              "cannot find -lomp", "option '-fopenmp'", "unsupported option '-fopenmp'")


def _warn(cause: str, fix: str) -> None:
    """The one message of a build without kvtier._C (stderr, multi-line)."""
    bar = "=" * 78
    print(
        f"\n{bar}\nkvtier: kvtier._C was NOT built: {cause}\n"
        "kvtier is installed without its native extension and runs its torch reference\n"
        "ops instead: correct, but slower (the scatter is 14-40x slower on CPU).\n"
        f"{fix}\n"
        f"Once fixed, retry with:\n{RETRY}\n"
        f"`kvtier doctor` shows the extension's state.\n{bar}\n",
        file=sys.stderr,
        flush=True,
    )


def _cause(error: BaseException) -> tuple[str, str]:
    """(what went wrong, what to do) for a failed compile or link."""
    text = str(error)
    compiler = (os.environ.get("CXX") or "c++").split()[0]
    tail = "\n".join(textwrap.indent(line, "    ") for line in text.strip().splitlines()[-8:])
    if shutil.which(compiler) is None:
        return (f"no C++ compiler ({compiler!r} is not on PATH)",
                "Install one (e.g. `apt-get install g++`), or point CXX at one.")
    try:
        runs = subprocess.run([compiler, "--version"], capture_output=True).returncode == 0
    except OSError:
        runs = False
    if not runs:
        return (f"the C++ compiler {compiler!r} does not run (`{compiler} --version` fails)",
                "Install a working one (e.g. `apt-get install g++`), or point CXX at one.")
    if any(sign in text for sign in _NO_OPENMP):
        return ("the C++ compiler has no OpenMP",
                "Install the compiler's OpenMP support (libgomp, e.g. `apt-get install g++`).")
    if isinstance(error, RuntimeError) and "mismatches the version" in text:
        detail = error.args[0] % error.args[1:] if len(error.args) == 3 else text
        return (f"the CUDA toolkit (nvcc) does not match torch's CUDA ({detail})",
                "Use the nvcc of torch's CUDA version (CUDA_HOME), or KVTIER_BUILD_CUDA=0 "
                "for a CPU-only build.")
    return (f"the compile or link failed ({type(error).__name__}):\n{tail}",
            "The compiler's output (its last lines above) says why.")


def _want_cuda(torch: Any) -> bool:
    forced = os.environ.get("KVTIER_BUILD_CUDA")
    nvcc = shutil.which("nvcc") or (
        os.path.join(os.environ["CUDA_HOME"], "bin", "nvcc")
        if os.environ.get("CUDA_HOME")
        else None
    )
    have = torch.version.cuda is not None and nvcc is not None and os.path.exists(nvcc)
    if forced == "0":
        return False
    if forced == "1" and not have:
        sys.exit(
            f"KVTIER_BUILD_CUDA=1 but torch {torch.__version__} has CUDA "
            f"{torch.version.cuda} and nvcc is {nvcc}"
        )
    return have


def _required() -> bool:
    """A failed build is an error only where the user asked for the extension."""
    return os.environ.get("KVTIER_BUILD_CUDA") == "1" or os.environ.get("KVTIER_NATIVE") == "1"


def _build_ext_class(base: Any) -> Any:
    """``base`` (torch's BuildExtension) whose failure installs kvtier without _C."""

    class BuildExtOrFallback(base):  # type: ignore[misc, valid-type]
        def run(self) -> None:
            try:
                super().run()
            except Exception as e:  # compile, link, toolchain: all end the same way
                if _required():
                    raise
                _warn(*_cause(e))
                # Nothing was built: nothing to copy in place or install.
                del self.extensions[:]
                self.inplace = False

    return BuildExtOrFallback


def _extensions() -> tuple[list[Any], dict[str, Any]]:
    if os.environ.get("KVTIER_NATIVE") == "0":  # `make` installs first, then `make native`
        return [], {}
    try:
        import torch
        from torch.utils import cpp_extension
    except ImportError as e:
        if _required():
            sys.exit(f"kvtier: KVTIER_NATIVE=1 or KVTIER_BUILD_CUDA=1 but torch is not "
                     f"importable ({e}); install with --no-build-isolation")
        _warn(f"torch is not importable by the build ({e})",
              "pip built kvtier in an isolated environment, which has no torch: install\n"
              "with `pip install --no-build-isolation ...` into the environment that has\n"
              "torch (and setuptools, wheel) installed.")
        return [], {}

    # The C++ standard is the one torch.utils.cpp_extension picks for this torch.
    cxx = ["-O3", "-fopenmp", "-Wall", "-Wextra", "-Wno-unused-parameter"]
    sources = [f"{NATIVE}/ops.cpp", f"{NATIVE}/pinned.cpp"]
    # -fopenmp at link time records libgomp.so.1, the soname of the libgomp that torch
    # ships and has already loaded, so at::parallel_for shares torch's thread pool.
    link = ["-fopenmp"]
    if _want_cuda(torch):
        sources += [f"{NATIVE}/ops_cuda.cpp", f"{NATIVE}/cuda_copy.cu"]
        ext = cpp_extension.CUDAExtension(
            "kvtier._C",
            sources,
            include_dirs=[os.path.abspath(NATIVE)],
            define_macros=[("KVTIER_WITH_CUDA", "1")],
            extra_compile_args={"cxx": cxx, "nvcc": ["-O3"]},
            extra_link_args=link,
        )
        print("kvtier: building kvtier._C with CUDA", file=sys.stderr)
    else:
        ext = cpp_extension.CppExtension(
            "kvtier._C",
            sources,
            include_dirs=[os.path.abspath(NATIVE)],
            extra_compile_args=cxx,
            extra_link_args=link,
        )
        print("kvtier: building kvtier._C for CPU only", file=sys.stderr)
    use_ninja = shutil.which("ninja") is not None
    build_ext = _build_ext_class(cpp_extension.BuildExtension).with_options(use_ninja=use_ninja)
    return [ext], {"build_ext": build_ext}


ext_modules, cmdclass = _extensions()
setup(ext_modules=ext_modules, cmdclass=cmdclass)
