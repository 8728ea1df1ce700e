# Two commands: `make demo` runs the main job, `make test` runs the whole test suite.
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

.PHONY: demo test
demo: $(STAMP)
	$(PY) demo.py

test: $(STAMP)
	$(PY) -m pytest -q -n 2
