# atoll: set-up and checks. Everything a fresh machine needs is installed here.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# CPU build on a machine without CUDA. GPU users: install your own torch into .venv first
# (or create .venv with VENV_FLAGS=--system-site-packages over a system torch).
TORCH_SPEC ?= torch==2.13.0
VENV_FLAGS ?=
STAMP := $(VENV)/.atoll-installed

.PHONY: venv install test lint typecheck check demo bench-quick bench-parity clean

venv: $(STAMP)

$(STAMP): pyproject.toml Makefile
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "atoll needs Python >= 3.11")'
	@test -x $(PY) || $(PYTHON) -m venv $(VENV_FLAGS) $(VENV)
	@$(PY) -m pip install -q --upgrade pip
	@$(PY) -c 'import torch' 2>/dev/null || { echo "installing $(TORCH_SPEC)"; $(PY) -m pip install -q "$(TORCH_SPEC)"; }
	@$(PY) -m pip install -q -e '.[dev]'
	@touch $(STAMP)

install: venv

test: venv
	@$(VENV)/bin/pytest -q

lint: venv
	@$(VENV)/bin/ruff check .
	@$(VENV)/bin/ruff format --check .

typecheck: venv
	@mkdir -p .typecheck/atoll && for p in node protocol dht security; do ln -sfn ../../$$p .typecheck/atoll/$$p; done
	@MYPYPATH=.typecheck $(VENV)/bin/mypy -p atoll.node -p atoll.protocol -p atoll.dht -p atoll.security

check: lint typecheck test

demo: venv
	@$(VENV)/bin/atoll demo

bench-quick: venv
	@$(PY) bench/parity.py --quick --json bench-quick.json

bench-parity: venv
	@$(PY) bench/parity.py --json bench-parity.json

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
