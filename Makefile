# Two commands on a fresh machine with Python >= 3.10 and pip: `make test`, `make bench`.
PYTHON ?= python3
# the CPU build of torch for the device-mirror tests; never the multi-GB CUDA build
TORCH_CPU ?= torch==2.13.0+cpu
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: test test-slow test-nojit bench bench-suite lint clean

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

bench: $(STAMP)
	$(VENV)/bin/mtpstate bench

bench-suite: $(STAMP)
	$(PY) -m pytest benchmarks

lint: $(STAMP)
	$(VENV)/bin/ruff check mtpstate tests benchmarks
	$(VENV)/bin/ruff format --check mtpstate tests benchmarks

clean:
	rm -rf $(VENV) build *.egg-info
