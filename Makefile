# Shortcuts for the commands in README.md and docs/ (each target is one of them).
PY := .venv/bin/python

.PHONY: setup setup-dev train test test-fast lint format config-reference

setup:            ## create .venv with torch (CPU build without an NVIDIA GPU) and what training needs
	bash scripts/setup.sh

setup-dev:        ## add what the tests need and every feature's requirements/*.txt
	bash scripts/setup.sh --dev

train:            ## train the default digits example
	$(PY) train.py

test:             ## the whole test suite (what CI runs)
	$(PY) -m pytest

test-fast:        ## skip the slow end-to-end tests
	$(PY) -m pytest -m "not slow"

lint:             ## ruff lint and format check; `make format` fixes most of what it finds
	@$(PY) -m ruff check . && $(PY) -m ruff format --check . || { echo "make format fixes most of it" >&2; exit 1; }

format:           ## ruff autofix and format, then what is left to fix by hand
	$(PY) -m ruff check --fix --exit-zero --silent . && $(PY) -m ruff format . && $(PY) -m ruff check .


config-reference: ## regenerate the config table in docs/config.md from src/config.py
	$(PY) scripts/config_reference.py
