# plainrl: the executable README. `make help` lists the targets.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TINY_DIR ?= outputs/models/tiny
ENV ?= reverse_text
PORT ?= 8000
ENGINE ?= auto

.PHONY: help setup test lint lock tiny chat demo clean

help:  ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed -E 's/:.*## /\t/'

# The venv is rebuilt only when the lock or pyproject changes.
$(STAMP): requirements.lock pyproject.toml
	$(PYTHON) -m venv $(VENV) && $(VENV)/bin/pip install -q -r requirements.lock
	$(VENV)/bin/pip install -q --no-deps --no-build-isolation -e . && touch $(STAMP)

setup: $(STAMP)  ## create .venv from requirements.lock (skipped when up to date)

test: setup  ## lint and run the test suite
	$(VENV)/bin/ruff check .
	$(VENV)/bin/pytest

lint: setup  ## ruff check + format check
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

lock: setup  ## regenerate requirements.lock and requirements-vllm.lock from pyproject.toml
	UV=$(VENV)/bin/uv bash ci/lock.sh

tiny: setup  ## write the tiny CPU model to $(TINY_DIR)
	$(PY) scripts/tiny.py --out $(TINY_DIR)

demo: tiny  ## the CPU demo
	$(PY) scripts/tiny.py --out $(TINY_DIR) --chat "Hello"

clean:  ## remove outputs and caches (keeps .venv)
	rm -rf outputs .pytest_cache .ruff_cache
