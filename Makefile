# fedasync: the two commands of the README.
#   make demo   create .venv, install fedasync, run the packaged quickstart on Flower's simulation engine
#   make test   run the test suite (what .ci/run calls)
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo test test-fast install clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# the CPU build of torch (a bare `torch` would pull a multi-GB CUDA build)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/fedasync simulate

test: $(STAMP)
	$(PY) -m pytest -q -ra

test-fast: $(STAMP)
	$(PY) -m pytest -q -ra -m "not engine and not deploy and not postgres"

clean:
	rm -rf $(VENV) runs .pytest_cache
