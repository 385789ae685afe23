# One command sets everything up and runs the demo (`make demo`);
# one sets up, lints and runs the tests (`make test`).  CI runs `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup demo lint test bench bench-quick clean

setup: $(VENV)/.installed

# The demo needs only ckptc and transformers; the tests need the dev extra.
$(VENV)/.demo-installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e ".[demo]"
	touch $@

# torch is pinned to exactly 2.13.0 (a CPU build lies on the build machines'
# disk; an unpinned torch would pull a multi-GB CUDA build).  Never add
# torchvision or timm: PyPI's torchvision fails to import beside torch 2.13.0.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $@

demo: $(VENV)/.demo-installed
	$(PY) -m ckptc.demo

# Lint (ruff check: pyflakes, pycodestyle, isort, bugbear, pyupgrade) and format check; never reformats.
# ruff is pinned in the dev extra: another version may format differently.  `ruff format .` fixes it.
lint: setup
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

# Two workers, one test file each at a time (a module's fixtures, such as the DDP process group, start once):
# most tests are single-threaded Python (Dynamo, AOTAutograd, the solvers), so two workers use both cores.
test: lint
	$(PY) -m pytest -q -p no:cacheprovider -n 2 --dist loadfile

bench: setup
	$(PY) -m bench.run

bench-quick: setup
	$(PY) -m bench.run --quick

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
