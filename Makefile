# megatron_ext developer commands. `make demo` and `make test` are the README's two commands.
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup demo test bench bench-quick lint clean

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

bench: setup
	$(VENV)/bin/megatron-ext bench --overwrite --json docs/benchmarks.json

bench-quick: setup
	$(VENV)/bin/megatron-ext bench --quick --overwrite --json out/benchmarks.json --markdown out/BENCHMARKS.md

lint: setup
	$(VENV)/bin/ruff check megatron_ext tests tools

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache out
