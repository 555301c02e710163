# Two commands on a fresh machine with Python >= 3.10 and pip: `make test`, `make bench`.
PYTHON ?= python3
# the CPU build of torch for the device-mirror tests; never the multi-GB CUDA build
TORCH_CPU ?= torch==2.13.0+cpu
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: test test-slow test-nojit test-vllm bench bench-suite bench-vllm gpu-check lint clean

# vLLM 0.34.0 tier: its unpacked sdist (nothing built) + its pure-Python deps
VLLM_DIR := .vllm
VLLM_SRC := $(VLLM_DIR)/vllm-0.34.0
VVENV := .venv-vllm
VPY := $(VVENV)/bin/python
VSTAMP := $(VVENV)/.installed
VLLM_PATCHED := $(VLLM_DIR)/vllm-0.34.0-mtpstate
VRUN := PYTHONPATH=$(CURDIR)/$(VLLM_SRC) VLLM_LOGGING_LEVEL=ERROR

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	$(PY) -m pip install -q --only-binary :all: '$(TORCH_CPU)' \
	  || echo "note: no CPU build of torch for this Python/platform ($(TORCH_CPU)); the device-mirror tests will skip"
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q
	NUMBA_DISABLE_JIT=1 $(PY) -m pytest -q tests/test_nojit.py
	$(PY) -m pytest -q benchmarks --benchmark-disable

test-slow: $(STAMP)
	HYPOTHESIS_PROFILE=slow $(PY) -m pytest -q -m 'slow or not slow'

$(VSTAMP): pyproject.toml integrations/vllm/requirements.txt
	test -x $(VPY) || $(PYTHON) -m venv $(VVENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q --only-binary :all: -r integrations/vllm/requirements.txt
	$(VPY) -m pip install -q -e '.[dev]'
	$(VPY) integrations/vllm/fetch_vllm.py $(VLLM_DIR)
	touch $(VSTAMP)

# the worked patch, applied to a copy of the source (the patched-runner tests use it)
$(VLLM_PATCHED)/.patched: $(VSTAMP) integrations/vllm/mtpstate-mrv2.patch
	rm -rf $(VLLM_PATCHED)
	cp -r $(VLLM_SRC) $(VLLM_PATCHED)
	patch -p1 --quiet -d $(VLLM_PATCHED) < integrations/vllm/mtpstate-mrv2.patch
	touch $@

test-vllm: $(VSTAMP) $(VLLM_PATCHED)/.patched
	MTPSTATE_VLLM_PATCHED=$(CURDIR)/$(VLLM_PATCHED) $(VRUN) $(VPY) -m pytest -q -p no:cacheprovider integrations/vllm

bench-vllm: $(VSTAMP) $(VLLM_PATCHED)/.patched
	$(VRUN) $(VPY) integrations/vllm/harness.py --bench --json docs/bench-vllm.json
	PYTHONPATH=$(CURDIR)/$(VLLM_PATCHED) VLLM_LOGGING_LEVEL=ERROR $(VPY) integrations/vllm/harness.py --bench --patched \
	  --json docs/bench-vllm-patched.json

# on a CUDA machine with torch, numba, pytest(-benchmark), hypothesis installed
# (no network, no venv): cuda tests, ring-reuse stress, mirror bench; files
# under $$MTPSTATE_GPU_OUT (see integrations/gpu/gpu_check.py)
gpu-check:
	$(PYTHON) integrations/gpu/gpu_check.py

bench: $(STAMP)
	$(VENV)/bin/mtpstate bench

bench-suite: $(STAMP)
	$(PY) -m pytest benchmarks

lint: $(STAMP)
	$(VENV)/bin/ruff check mtpstate tests benchmarks
	$(VENV)/bin/ruff format --check mtpstate tests benchmarks

clean:
	rm -rf $(VENV) $(VVENV) $(VLLM_DIR) build *.egg-info
