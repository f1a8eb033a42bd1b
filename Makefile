# Two commands a new user needs: `make plan` (a capacity plan) and `make test` (the suite).
# Each bootstraps .venv on first use; torch is pinned to the CPU build via constraints-dev.txt.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: plan test bench clean

# editable_mode=compat: a plain .pth entry, so start-up is what a regular install would see.
$(STAMP): pyproject.toml setup.py constraints-dev.txt hicache/effects/_hostcopy.c hicache/pools/_pagestack.c
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check -c constraints-dev.txt -e '.[test]' --config-settings editable_mode=compat
	touch $(STAMP)

plan: $(STAMP)
	$(BIN)/hicache plan $(ARGS)

test: $(STAMP)
	$(BIN)/python -m pytest $(ARGS)

bench: $(STAMP)
	$(BIN)/python benchmarks/run.py $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis *.egg-info
