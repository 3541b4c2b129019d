# The two commands of the README: `make demo` and `make test`.
# Both create the project's virtual environment (.venv) and install what they need on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

.PHONY: demo test lint bench chaos
demo: $(VENV)/.installed
	$(PY) jobs/demo.py

test: $(VENV)/.installed
	$(PY) -m pytest -q -n 2 --dist loadfile

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check .

bench: $(VENV)/.installed
	$(PY) bench/emulator_ingest.py

chaos: $(VENV)/.installed
	$(PY) bench/chaos.py
