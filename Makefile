# Two commands set everything up: `make demo` runs the main job, `make test` the test suite.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# torch, transformers, diffusers, peft and lm-eval live in a second environment, for tools/,
# reference tests and the benchmarks that compare with them; the default suite never needs them.
REF := .venv-ref
REF_STAMP := $(REF)/.installed

.PHONY: demo test test-slow test-reference bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e ".[test]"
	touch $(STAMP)

$(REF_STAMP): pyproject.toml
	$(PYTHON) -m venv $(REF)
	$(REF)/bin/pip install --quiet --upgrade pip
	$(REF)/bin/pip install --quiet -e ".[test,reference,eval-harness]"
	touch $(REF_STAMP)

demo: $(STAMP)
	$(BIN)/dew demo

test: $(STAMP)
	$(BIN)/python -m pytest -n 2 -q

test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -m slow

test-reference: $(REF_STAMP)
	$(REF)/bin/python -m pytest -q -m reference

bench: $(STAMP) $(REF_STAMP)
	$(BIN)/python benchmarks/step_overhead.py
	$(REF)/bin/python benchmarks/lm_train.py --dew-python $(BIN)/python
	$(REF)/bin/python benchmarks/lm_decode.py --dew-python $(BIN)/python
	$(REF)/bin/python benchmarks/diffusion_train.py --dew-python $(BIN)/python
	$(REF)/bin/python benchmarks/moe_train.py --dew-python $(BIN)/python
	$(REF)/bin/python benchmarks/vae_decode.py --dew-python $(BIN)/python
	$(REF)/bin/python benchmarks/latent_diffusion_train.py --dew-python $(BIN)/python
	$(REF)/bin/python benchmarks/pipeline_sampling.py --dew-python $(BIN)/python
	$(BIN)/python benchmarks/kv_cache_quality.py

clean:
	rm -rf $(VENV) $(REF) runs
