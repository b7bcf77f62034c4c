#!/usr/bin/env bash
# GPU check of kvtier's native ops and the worker's copy engine, in one run of at most
# 10 minutes on a lent CUDA machine (H200): builds kvtier._C with CUDA, runs the ops
# tests (the CUDA targets included, tests/ops/test_layerwise.py among them), prints the
# device<->pinned-host bandwidth table for both copy strategies against a plain pinned
# cudaMemcpy (target >= 0.85x) and which strategy to make the default per direction
# (kvtier/ops/backend.py: DEFAULT_CUDA_STRATEGY), then drives the worker's per-step copy
# engine (kvtier/ops/stepcopy.py, what the vLLM connector runs; no vLLM needed) with
# FlashAttention and FlashInfer KV layouts: round trips against the torch reference,
# step bandwidth as a fraction of cudaMemcpyAsync, and a layer-wise load overlapping a
# matmul per layer, and that a step's sampling does not wait for an asynchronous restore
# in flight (benchmarks/gpu_worker_check.py -> worker_cuda.json).
#
# Without a CUDA device it says so and exits 0: there is nothing to check.
#
# The lent machine has python3 with a CUDA build of torch, nvcc, ninja, setuptools and
# pytest, and no network: nothing is installed. Run it from the device tool as
#     bash benchmarks/gpu_check.sh          (timeout_s=600)
# Results go to $OUT (what the tool brings back) or benchmarks/results/.
#
# Environment: PYTHON (default python3), TORCH_CUDA_ARCH_LIST (default 9.0),
# MAX_JOBS (default: cores).
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
RESULTS=${OUT:-benchmarks/results}
export PYTHONUNBUFFERED=1
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
export MAX_JOBS=${MAX_JOBS:-$(nproc)}
export KVTIER_BUILD_CUDA=1  # a missing CUDA toolchain is an error here, not a CPU build
mkdir -p "$RESULTS"
t0=$SECONDS
step() { printf '\n== [%ds] %s\n' "$((SECONDS - t0))" "$*"; }

no_cuda=$("$PY" -c 'import torch; print("" if torch.cuda.is_available() else
             "torch.cuda.is_available() is False")' 2>/dev/null || echo "$PY cannot import torch")
if [[ -n "$no_cuda" ]]; then
    echo "gpu_check: no CUDA device ($no_cuda); nothing to check"
    exit 0
fi

step "machine"
nvidia-smi --query-gpu=name,driver_version,memory.total,pcie.link.gen.current,pcie.link.width.current \
    --format=csv || true
nvcc --version | tail -1
"$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda,
          "device", torch.cuda.get_device_name())'

step "build kvtier._C (sm ${TORCH_CUDA_ARCH_LIST}, ${MAX_JOBS} jobs)"
rm -f kvtier/_C*.so  # never test a build made elsewhere
rm -rf build
timeout 300 "$PY" setup.py build_ext --inplace >"$RESULTS/gpu_build.log" 2>&1 || {
    tail -40 "$RESULTS/gpu_build.log"
    echo "gpu_check: BUILD FAILED (log: $RESULTS/gpu_build.log)"
    exit 1
}
"$PY" -c 'import torch, kvtier._C; print("built:", torch.ops.kvtier.build_info())'

step "ops tests (CPU and CUDA targets)"
# --confcutdir: only tests/ops' own conftest, so other suites' dependencies are not needed.
set +e
timeout 180 "$PY" -m pytest tests/ops -q -x -p no:cacheprovider --confcutdir=tests/ops \
    -o addopts="" 2>&1 | tee "$RESULTS/gpu_tests.log" | tail -25
rc=${PIPESTATUS[0]}
set -e
[[ $rc -eq 0 ]] || { echo "gpu_check: TESTS FAILED (rc $rc, log: $RESULTS/gpu_tests.log)"; exit 1; }

step "bandwidth: device <-> pinned host, memcpy and kernel strategies vs cudaMemcpy"
timeout 150 "$PY" benchmarks/copy_blocks.py --device cuda --out "$RESULTS/copy_cuda.json"

step "worker copy engine: layouts, round trips, step bandwidth, layer-wise overlap"
set +e
timeout 90 "$PY" benchmarks/gpu_worker_check.py --out "$RESULTS/worker_cuda.json" \
    >"$RESULTS/gpu_worker.log" 2>&1
rc=$?
set -e
grep -v '^[ {}]' "$RESULTS/gpu_worker.log" | tail -20  # per-run lines; the JSON is in the file
[[ $rc -eq 0 ]] || { echo "gpu_check: WORKER CHECK FAILED (rc $rc, log: $RESULTS/gpu_worker.log)"; exit 1; }

step "done in $((SECONDS - t0))s"
