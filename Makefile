# tequant: each target does its own set-up on a fresh machine.
#   make demo   set-up and build, then train a small GPT once per recipe and once in bf16
#               (python -m tequant.demo $(DEMO_ARGS); table, loss.png, results.json in demo_out/)
#   make test   install what is missing (torch 2.13 CPU if no torch; pytest, numpy, hypothesis,
#               matplotlib, transformers and peft for tests/test_hf.py;
#               the nvidia-cublas wheel when nvcc exists but the CUDA install lacks cuBLAS),
#               build, run pytest
#   make build  the set-up and the build only
#   make bench  the benchmarks in benchmarks/ (tables under docs/results/)
#   make fuzz   the long property-based fuzz (tests/fuzz_tequant.py; docs/results/fuzz.md)
#   make test-torch TORCH_VERSION=2.11.0   make test in a venv of its own with that torch
#               (.venv-torch-2.11.0): the GPU machine runs torch 2.11, CI 2.13; this runs the
#               whole CPU suite on the other version without a GPU
#   make sanitize  the build, then tests/test_sanitize_{kernels,fused,gemm}.py under
#               compute-sanitizer's memcheck, racecheck, initcheck and synccheck
#               (tools/sanitize.sh; docs/sanitize.md)
# An existing torch is used as it is (the GPU machine has torch+CUDA and no network).

PYTHON ?= python3
PIP := $(PYTHON) -m pip
TORCH_SPEC ?= torch==2.13.0
HF_SPEC ?= "transformers>=5,<6" "peft>=0.17"
PYTEST_ARGS ?= -q
# e.g. make demo DEMO_ARGS="--recipes bf16,mxfp8 --steps 300" (python -m tequant.demo --help)
DEMO_ARGS ?=

.PHONY: demo test test-torch build deps test-deps bench fuzz clean

deps:
	@$(PYTHON) -c "import torch" 2>/dev/null || $(PIP) install "$(TORCH_SPEC)"
	@$(PYTHON) -c "import pytest, numpy, hypothesis" 2>/dev/null || $(PIP) install pytest numpy hypothesis
# matplotlib only draws the demo's loss.png: without it (no network) the demo still writes its
# table and JSON and says what is missing, so a failed install does not stop make.
	@$(PYTHON) -c "import matplotlib" 2>/dev/null || $(PIP) install matplotlib || \
		echo "make deps: matplotlib could not be installed; the demo will write no loss.png"
# The editable build needs setuptools >= 70.1, or >= 64 with the wheel package (a fresh venv of
# Python 3.11 has setuptools 65 and no wheel); the version installed satisfies both supported
# torches (2.13: >= 77.0.3, 2.11: < 82)
	@$(PYTHON) -c "import importlib.util as u, setuptools, sys; \
		v = tuple(map(int, setuptools.__version__.split('.')[:2])); \
		sys.exit(not (v >= (70, 1) or (v >= (64, 0) and u.find_spec('wheel'))))" \
		2>/dev/null || $(PIP) install "setuptools>=77.0.3,<82"
	@req="$$($(PYTHON) build_tools/cuda.py --missing-cublas)"; \
		if [ -n "$$req" ]; then echo "installing $$req (nvcc found, cuBLAS missing)"; $(PIP) install "$$req"; fi

build: deps
	$(PIP) install --no-build-isolation --no-deps -e . -q

demo: build
	$(PYTHON) -m tequant.demo $(DEMO_ARGS)

# transformers and peft are test-only (tests/test_hf.py, skipped without them): a failed install
# (no network) does not stop make.
test-deps: deps
	@$(PYTHON) -c "import transformers, peft" 2>/dev/null || $(PIP) install $(HF_SPEC) || \
		echo "make test-deps: transformers/peft could not be installed; tests/test_hf.py will skip"

# pytest exits 5 when it collects no test; make treats any non-zero exit as a failure.
test: build test-deps
	$(PYTHON) -m pytest $(PYTEST_ARGS) tests

# PyPI's torch wheel of 2.11 brings its CUDA libraries (~3 GB); it runs without a GPU.
TORCH_VERSION ?= 2.11.0
test-torch:
	@[ -x .venv-torch-$(TORCH_VERSION)/bin/python ] || $(PYTHON) -m venv .venv-torch-$(TORCH_VERSION)
	$(MAKE) test PYTHON=$(CURDIR)/.venv-torch-$(TORCH_VERSION)/bin/python \
		TORCH_SPEC=torch==$(TORCH_VERSION) PYTEST_ARGS="$(PYTEST_ARGS)"

# bench_quantize, bench_norm, bench_act, bench_block, bench_gemm, bench_overhead, bench_linear
# and bench_tp_overhead need a GPU; without one they run their quick CPU-side checks.
bench: build
	$(PYTHON) benchmarks/bench_autocast.py
	@if $(PYTHON) -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then \
		$(PYTHON) benchmarks/bench_quantize.py && $(PYTHON) benchmarks/bench_norm.py && \
		$(PYTHON) benchmarks/bench_act.py && \
		$(PYTHON) benchmarks/bench_block.py && $(PYTHON) benchmarks/bench_gemm.py && \
		$(PYTHON) benchmarks/bench_overhead.py && $(PYTHON) benchmarks/bench_linear.py && \
		$(PYTHON) benchmarks/bench_tp_overhead.py; \
	else $(PYTHON) benchmarks/bench_quantize.py --device cpu --shapes 256x256 && \
		$(PYTHON) benchmarks/bench_norm.py --device cpu --shapes 64x1024,16x4096:fp32 && \
		$(PYTHON) benchmarks/bench_act.py --device cpu --shapes 32x1024,8x1002:fp32 && \
		$(PYTHON) benchmarks/bench_block.py --device cpu && \
		$(PYTHON) benchmarks/bench_gemm.py --device cpu && \
		$(PYTHON) benchmarks/bench_overhead.py --device cpu && \
		$(PYTHON) benchmarks/bench_linear.py --device cpu && \
		$(PYTHON) benchmarks/bench_tp_overhead.py --device cpu --recipes current; fi

# The long fuzz profile (the quick one runs in make test): FUZZ_EXAMPLES cases, summary appended
# to docs/results/fuzz.md.
FUZZ_EXAMPLES ?= 100000
fuzz: build
	$(PYTHON) tests/fuzz_tequant.py --examples $(FUZZ_EXAMPLES) --seed 7 --out docs/results/fuzz.md

# SANITIZE_* variables (tools/sanitize.sh) pass through the environment, e.g.
# make sanitize SANITIZE_PARALLEL=1 (one tool per GPU)
.PHONY: sanitize
sanitize: build
	PYTHON=$(PYTHON) bash tools/sanitize.sh

clean:
	rm -rf build python/tequant/*.so *.egg-info python/*.egg-info
