# atoll: set-up and checks. Everything a fresh machine needs is installed here.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# CPU build on a machine without CUDA. GPU users: install your own torch into .venv first
# (or create .venv with VENV_FLAGS=--system-site-packages over a system torch).
TORCH_SPEC ?= torch==2.13.0
VENV_FLAGS ?=
STAMP := $(VENV)/.atoll-installed

.PHONY: venv install netlab-deps test lint typecheck check demo bench-quick bench-parity clean

venv: $(STAMP)

$(STAMP): pyproject.toml Makefile
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "atoll needs Python >= 3.11")'
	@test -x $(PY) || $(PYTHON) -m venv $(VENV_FLAGS) $(VENV)
	@$(PY) -m pip install -q --upgrade pip
	@$(PY) -c 'import torch' 2>/dev/null || { echo "installing $(TORCH_SPEC)"; $(PY) -m pip install -q "$(TORCH_SPEC)"; }
	@$(PY) -m pip install -q -e '.[dev]'
	@touch $(STAMP)

install: venv

# What the network-namespace lab of the integration tests needs (atoll.node.netlab): `ip`
# and `tc` (iproute2) and iptables, installed with apt-get when missing and running as root.
# Not root: nothing happens, and those tests skip, saying why.
netlab-deps:
	@if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	  pkgs=""; \
	  command -v ip >/dev/null 2>&1 && command -v tc >/dev/null 2>&1 || pkgs=" iproute2"; \
	  command -v iptables >/dev/null 2>&1 || pkgs="$$pkgs iptables"; \
	  if [ -n "$$pkgs" ]; then \
	    echo "installing$$pkgs (the network lab of the integration tests)"; \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -q $$pkgs >/dev/null || \
	    { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q $$pkgs >/dev/null; } || \
	    echo "could not install$$pkgs: the network-lab tests will skip"; \
	  fi; \
	fi

test: venv netlab-deps
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
