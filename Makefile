# `make test` and `make demo` work on a fresh machine that reaches PyPI only:
# they create .venv if missing and install the package with its test extras.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install test demo bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(STAMP): setup.cfg pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q -e '.[test]'
	# tensorflow-text names `tensorflow`; tensorflow-cpu provides it.
	$(BIN)/python -m pip install -q --no-deps tensorflow-text==2.21.1 seqio==0.0.20
	touch $(STAMP)

install: $(STAMP)

# pytest runs from tests/, where the tests and their helpers live.
test: install
	cd tests && ../$(BIN)/python -m pytest -q -p no:cacheprovider $(PYTEST_ARGS)

demo: install
	$(BIN)/python -m t5x_speed.demo $(DEMO_ARGS)

bench: install
	$(BIN)/python -m t5x_speed.bench $(BENCH_ARGS)

clean:
	rm -rf $(VENV) *.egg-info
