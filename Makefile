# megatron_ext developer commands. `make demo` and `make test` are the README's two commands.
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup demo test bench bench-quick lint clean setup-megatron-0.18.2 test-megatron-0.18.2

setup: $(STAMP)

# Re-runs only when the pins or the package metadata change: a second `make setup` takes seconds.
$(STAMP): requirements/lock.txt pyproject.toml setup.py
	@set -euo pipefail; \
	if [ ! -x $(PY) ]; then \
	  PY312=""; \
	  if python3.12 --version >/dev/null 2>&1; then PY312=python3.12; \
	  elif command -v pyenv >/dev/null 2>&1; then \
	    PY312=$$(ls -d "$$(pyenv root)"/versions/3.12.*/bin/python3 2>/dev/null | sort -V | tail -n 1); fi; \
	  if [ -z "$$PY312" ]; then echo "make setup: Python 3.12 not found (python3.12 on PATH or pyenv 3.12.x)" >&2; exit 1; fi; \
	  echo "make setup: creating $(VENV) with $$PY312"; \
	  "$$PY312" -m venv $(VENV); \
	fi; \
	$(PY) -m pip install -q --upgrade pip; \
	$(PY) -m pip install -q -r requirements/lock.txt; \
	$(PY) -m pip install -q --no-deps -e '.[test,tools,tensorboard]'; \
	if $(PY) -c 'import importlib.util,sys; sys.exit(importlib.util.find_spec("transformer_engine") is None)'; then \
	  echo "make setup: transformer_engine is installed in $(VENV); it breaks megatron.core on CPU" >&2; exit 1; fi; \
	touch $(STAMP)

demo: setup
	$(VENV)/bin/megatron-ext demo --overwrite --json out/demo.json

test: setup
	TORCHDYNAMO_DISABLE=1 $(PY) -m pytest -q

# megatron-core 0.18.2 beside the venv's 0.19.2 (docs/development.md): its wheel, pinned by version and
# sha256 in requirements/, unzipped into an ignored folder put first on PYTHONPATH, as a Megatron-LM
# source checkout is. Its dependencies (torch, numpy, packaging) are the venv's.
MC0182 := .megatron-0.18.2
MC0182_STAMP := $(MC0182)/.unpacked
MC0182_ENV := PYTHONPATH=$(CURDIR)/$(MC0182)/site:$(CURDIR) TORCHDYNAMO_DISABLE=1

setup-megatron-0.18.2: $(MC0182_STAMP)

$(MC0182_STAMP): requirements/megatron-core-0.18.2.txt | $(STAMP)
	@set -euo pipefail; rm -rf $(MC0182); \
	$(PY) -m pip download -q --no-deps --only-binary=:all: --require-hashes \
	  -r requirements/megatron-core-0.18.2.txt -d $(MC0182)/wheel; \
	$(PY) -m zipfile -e $(MC0182)/wheel/megatron_core-0.18.2-*.whl $(MC0182)/site; \
	found=$$($(MC0182_ENV) $(PY) -W ignore -c 'from megatron_ext.compat.versions import installed_megatron as v; print(v())'); \
	if [ "$$found" != 0.18.2 ]; then echo "make setup-megatron-0.18.2: imports megatron-core $$found" >&2; exit 1; fi; \
	touch $@

# The demo and the tests marked each_megatron (the real-loop launches through the rows that differ
# between the versions, and a broad smoke) on 0.18.2; pytest last, so its summary closes the log.
test-megatron-0.18.2: setup-megatron-0.18.2
	$(MC0182_ENV) $(PY) -W ignore -m megatron_ext.compat.check
	$(MC0182_ENV) $(VENV)/bin/megatron-ext demo --overwrite --json out/demo-megatron-0.18.2.json
	$(MC0182_ENV) $(PY) -m pytest -q -m each_megatron tests/compat tests/data/test_gpt_dataset.py \
	  tests/training/test_resume_checks.py tests/training/test_gpt_builder.py \
	  tests/training/test_real_loop_features.py tests/training/test_checkpoint_resume.py \
	  tests/training/test_startup_refusals.py --durations=15

bench: setup
	$(VENV)/bin/megatron-ext bench --overwrite --json docs/benchmarks.json

bench-quick: setup
	$(VENV)/bin/megatron-ext bench --quick --overwrite --json out/benchmarks.json --markdown out/BENCHMARKS.md

lint: setup
	$(VENV)/bin/ruff check megatron_ext tests tools

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache out $(MC0182)
