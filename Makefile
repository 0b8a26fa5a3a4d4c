# partial-fc — `make train` sets a fresh machine up and runs the embedded CPU default;
# `make test` runs the test suite (CI runs exactly that).
PY      := .venv/bin/python
STAMP   := .venv/.installed
NPROC_PER_NODE ?= 2
NNODES  ?= 1
NODE_RANK ?= 0
MASTER_ADDR ?= 127.0.0.1
MASTER_PORT ?= 29500
DATA    ?=
OUT     ?=
SRC     ?=
ARGS    ?=

.PHONY: setup train test test-fast lint bench

setup: $(STAMP)

$(STAMP): pyproject.toml
	python3 -m venv .venv
	.venv/bin/pip install -q torch==2.13.0 -e '.[test]'
	touch $(STAMP)

test: setup
	$(PY) -m pytest -n 2 -q

test-fast: setup
	$(PY) -m pytest -n 2 -q -m "not slow"

lint: setup
	$(PY) -m ruff check partial_fc data_pipeline launch tests bench
