# pddnet: the two commands a newcomer needs are `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
EXTRAS := ucx,test,bench

.PHONY: venv test lint typecheck unit demo fuzz clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e ".[$(EXTRAS)]"
	touch $(STAMP)

lint: venv
	$(BIN)/ruff check pddnet tests bench
	$(BIN)/ruff format --check pddnet tests bench

typecheck: venv
	$(BIN)/mypy

unit: venv
	$(BIN)/python -m pytest -q

test: lint typecheck unit

demo: venv
	$(BIN)/pddnet demo

# Longer coverage-guided fuzzing of every decoder (not part of `make test`).
fuzz: venv
	$(BIN)/pip install -q atheris
	for t in chunk_header control_frame tokens endpoint_blob link_frame auth_frame; do \
	  $(BIN)/python tests/fuzz_atheris.py $$t -max_total_time=$${FUZZ_SECONDS:-120} || exit 1; done

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis
