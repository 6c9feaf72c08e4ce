# Two commands do everything on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The core and the plugins (editable, with the test and dev extras; dsp-nvrtc with NVRTC itself, so
# the tests compile every generated kernel on a machine without a GPU).
STAMP := $(VENV)/.installed
# The test distributions (a null backend, fault backends, deliberately broken plugins):
# installed for `make test` only. `make demo` removes them, so what a user sees after it
# (`dsp backends list`) is what a user of the real distributions sees.
TEST_STAMP := $(VENV)/.installed-test-dists
PLUGINS := plugins/cpu_ref plugins/cuda_graphs plugins/triton plugins/nvrtc plugins/openvino plugins/onnxruntime
TEST_DISTS := tests/dists/dsp_test_backends
TEST_DIST_NAMES := dsp-test-backends
# `make dist` writes a wheel of every distribution this repository builds here.
DIST ?= dist

.PHONY: demo test gpu-test lint typecheck node-suite bench fuzz fixtures dist clean without-test-dists

$(STAMP): pyproject.toml $(addsuffix /pyproject.toml,$(PLUGINS))
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e ".[test,dev]" $(addprefix -e ,$(filter-out plugins/nvrtc,$(PLUGINS))) -e "plugins/nvrtc[nvrtc,test]"
	touch $(STAMP)

$(TEST_STAMP): $(STAMP) $(TEST_DISTS)/pyproject.toml
	$(BIN)/pip install -q --no-deps $(addprefix -e ,$(TEST_DISTS))
	touch $(TEST_STAMP)

# Asks the venv itself (not a stamp), so a venv made by an older Makefile is cleaned too.
without-test-dists: $(STAMP)
	@for d in $(TEST_DIST_NAMES); do \
	  if $(BIN)/python -c "import importlib.metadata as m, sys; m.distribution(sys.argv[1])" $$d 2>/dev/null; then \
	    echo "make demo: removing the test distribution $$d from $(VENV) (make test installs it again)"; \
	    $(BIN)/pip uninstall -q -y $$d; \
	  fi; \
	done
	@rm -f $(TEST_STAMP)

demo: without-test-dists
	$(BIN)/python examples/demo.py

test: $(TEST_STAMP)
	$(BIN)/python -m pytest -q

# Wheels of dsp-core and every plugin into $(DIST)/ (built with the venv's setuptools, no
# download): `pip install --find-links dist dsp-core` then works in any venv.
dist: $(STAMP)
	rm -rf $(DIST) build $(addsuffix /build,$(PLUGINS))
	$(BIN)/python -m pip wheel -q --no-deps --no-build-isolation -w $(DIST) . $(PLUGINS)
	@ls $(DIST)

# On a GPU machine. With GPU_PYTHON=python3 it uses that interpreter as it is (the GPU
# image has no network: install the project there with scripts/gpu_setup.sh first).
GPU_PYTHON ?=
gpu-test:
ifeq ($(GPU_PYTHON),)
	$(MAKE) $(STAMP)
	$(BIN)/python -m pytest -q tests/gpu
else
	$(GPU_PYTHON) -m pytest -q tests/gpu
endif

lint: $(STAMP)
	$(BIN)/ruff check dsp_core plugins tests benchmarks scripts examples
	$(BIN)/mypy
	$(BIN)/mypy plugins/triton/dsp_triton
	$(BIN)/mypy plugins/nvrtc/dsp_nvrtc

node-suite: $(STAMP)
	$(BIN)/python scripts/node_suite.py

bench: $(STAMP)
	$(BIN)/python benchmarks/cpu_overhead.py

# Fuzzes dsp.compile/run with mutated ONNX models (docs/fuzzing.md); exits 1 on a crash,
# hang, blow-up, non-DSPError or a run/run_legacy mismatch (FUZZ_ARGS= to report mismatches
# only). FUZZ_TIME seconds (default 120; no limit with FUZZ_CASES), FUZZ_CASES inputs,
# FUZZ_JOBS workers, FUZZ_MEM_MB cap, FUZZ_TIMEOUT per case, FUZZ_SEED, FUZZ_OUT,
# FUZZ_ENGINE=atheris for coverage-guided fuzzing (atheris comes with the test extra).
FUZZ_ARGS ?= --fail-on-mismatch
fuzz: $(STAMP)
	FUZZ_TIME="$(FUZZ_TIME)" FUZZ_CASES="$(FUZZ_CASES)" FUZZ_JOBS="$(FUZZ_JOBS)" FUZZ_MEM_MB="$(FUZZ_MEM_MB)" \
	FUZZ_TIMEOUT="$(FUZZ_TIMEOUT)" FUZZ_SEED="$(FUZZ_SEED)" FUZZ_OUT="$(FUZZ_OUT)" FUZZ_ENGINE="$(FUZZ_ENGINE)" \
	$(BIN)/python scripts/fuzz.py $(FUZZ_ARGS)

# Regenerates tests/fixtures (needs torch; uses its own venv, not needed by tests).
fixtures:
	test -x .fixture-venv/bin/python || ($(PYTHON) -m venv .fixture-venv && .fixture-venv/bin/pip install torch==2.13.0 transformers==5.24.0 onnx==1.23.2 onnxscript==0.7.2 onnxruntime==1.32.0 numpy)
	.fixture-venv/bin/python scripts/make_fixtures.py --out tests/fixtures

clean:
	rm -rf $(VENV) build $(DIST) *.egg-info
