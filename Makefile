# Entry points, self-installing on a fresh Linux machine with Python >= 3.10:
#   make demo   conversion report on the built-in demo model
#   make test   the test suite (kernels through Triton's interpreter when there is no GPU), without the
#               cases marked `slow` on the CPU
#   make test-all  the test suite with the `slow` cases (TWELL_SLOW=1): docs/testing.md
#   make mutate mutation testing of the modules where a bug is a silent wrong result (slow; not part
#               of `make test` or CI): docs/testing.md. MUTANTS narrows it, e.g. MUTANTS='twell.format.*'
PYTHON ?= python3
VENV ?= .venv
# CPU build by default; override for a CUDA machine, e.g. `make test TORCH_SPEC=torch`.
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin

.PHONY: demo test test-all lint mutate clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.installed: $(BIN)/python pyproject.toml
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e ".[hf]"
	touch $@

$(VENV)/.dev-installed: $(VENV)/.installed
	$(BIN)/python -m pip install -q -e ".[dev]"
	touch $@

demo: $(VENV)/.installed
	$(BIN)/twell report

test: $(VENV)/.dev-installed
	$(BIN)/python -m pytest -q -n auto

test-all: $(VENV)/.dev-installed
	TWELL_SLOW=1 $(BIN)/python -m pytest -q -n auto

lint: $(VENV)/.dev-installed
	$(BIN)/ruff check .

MUTANTS ?=
mutate: $(VENV)/.dev-installed
	$(BIN)/python -m pip install -q -e ".[mutate]"
	set -f; $(BIN)/mutmut run --max-children 2 $(MUTANTS)
	$(BIN)/mutmut results

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache mutants
