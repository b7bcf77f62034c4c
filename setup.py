"""Build of kvtier's native extension ``kvtier._C`` (package metadata: pyproject.toml).

``python setup.py build_ext --inplace`` (``make native``) builds ``kvtier/_C*.so``:

* the CPU part (native/ops.cpp, native/pinned.cpp) always;
* the CUDA part (native/ops_cuda.cpp, native/cuda_copy.cu) only when the installed
  torch is a CUDA build and nvcc is found (``CUDA_HOME`` or ``PATH``);
  ``KVTIER_BUILD_CUDA=0`` forces a CPU-only build, ``=1`` makes a missing CUDA an error.

The build imports the torch it links against, so it runs without build isolation. When
torch is not importable (e.g. ``pip install .`` in an isolated build environment), the
package is installed without the extension and ``kvtier.ops`` uses its torch reference
implementation until ``make native`` is run.
"""

from __future__ import annotations

import os
import shutil
import sys
from typing import Any

from setuptools import setup

NATIVE = "native"


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


def _extensions() -> tuple[list[Any], dict[str, Any]]:
    if os.environ.get("KVTIER_NATIVE") == "0":  # `make` installs first, then `make native`
        return [], {}
    try:
        import torch
        from torch.utils import cpp_extension
    except ImportError:
        print("kvtier: torch is not importable; building without kvtier._C", file=sys.stderr)
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
    build_ext = cpp_extension.BuildExtension.with_options(use_ninja=use_ninja)
    return [ext], {"build_ext": build_ext}


ext_modules, cmdclass = _extensions()
setup(ext_modules=ext_modules, cmdclass=cmdclass)
