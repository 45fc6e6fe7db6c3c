# Two commands set everything up: `make demo` runs the main job, `make test` the test suite.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-slow test-reference bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e ".[test]"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/dew demo

test: $(STAMP)
	$(BIN)/python -m pytest -n 2 -q

test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -m slow

test-reference: $(STAMP)
	$(BIN)/pip install --quiet -e ".[test,reference]"
	$(BIN)/python -m pytest -q -m reference

clean:
	rm -rf $(VENV) runs
