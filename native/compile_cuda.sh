#!/usr/bin/env bash
# Compile-only check of kvtier's CUDA sources, so they cannot rot on machines without a
# GPU or a CUDA build of torch (`make cuda-check`).
#
#   1. nvcc compiles native/cuda_copy.cu (CUDA runtime only) for $KVTIER_CUDA_ARCHS,
#      warnings as errors, and links it against cudart with a tiny driver program;
#   2. g++ syntax-checks the torch binding (native/ops_cuda.cpp) and the CUDA branches of
#      native/ops.cpp and native/pinned.cpp against torch's headers (the CPU wheels ship
#      them), again with warnings as errors.
#
# Exit status: 0 when everything compiles, or when nvcc is absent (the check is skipped
# and says so); non-zero on any compile error.
set -euo pipefail
cd "$(dirname "$0")/.."

NVCC=${NVCC:-nvcc}
if ! command -v "$NVCC" >/dev/null 2>&1; then
    echo "compile_cuda.sh: SKIPPED: nvcc not found on PATH (set NVCC=/path/to/nvcc)"
    exit 0
fi
if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
CXX=${CXX:-g++}
ARCHS=${KVTIER_CUDA_ARCHS:-"80 90"}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT

echo "compile_cuda.sh: $("$NVCC" --version | tail -1)"
gencode=()
for a in $ARCHS; do gencode+=(-gencode "arch=compute_$a,code=sm_$a"); done

echo "[1/3] nvcc native/cuda_copy.cu (sm: $ARCHS)"
"$NVCC" -std=c++17 -O3 "${gencode[@]}" -Werror all-warnings \
    -Xcompiler -Wall,-Wextra,-Werror -Inative -c native/cuda_copy.cu -o "$out/cuda_copy.o"

echo "[2/3] link against cudart"
cat >"$out/driver.cpp" <<'EOF'
#include <cstdio>
#include "cuda_copy.h"
int main() {
  std::printf("cudart %d, %d device(s)\n", kvtier::cuda::runtime_version(),
              kvtier::cuda::device_count());
  return 0;
}
EOF
"$NVCC" -std=c++17 -Inative "$out/driver.cpp" "$out/cuda_copy.o" -o "$out/driver" -lcudart
"$out/driver" || echo "  (driver program did not run here; linking is what is checked)"

echo "[3/3] $CXX -fsyntax-only: torch binding and CUDA branches"
if ! includes=$("$PYTHON" - <<'EOF'
import sysconfig
from torch.utils.cpp_extension import include_paths
print(" ".join(["-isystem" + p for p in include_paths()]
               + ["-isystem" + sysconfig.get_paths()["include"]]))
EOF
); then
    echo "compile_cuda.sh: FAILED: $PYTHON cannot import torch for its headers" >&2
    exit 1
fi
read -r -a inc <<<"$includes"
for f in native/ops_cuda.cpp native/ops.cpp native/pinned.cpp; do
    echo "  $f"
    "$CXX" -std=c++20 -fsyntax-only -DKVTIER_WITH_CUDA -Inative "${inc[@]}" \
        -Wall -Wextra -Wno-unused-parameter -Werror "$f"
done
echo "compile_cuda.sh: OK"
