# Two commands a new user needs: `make plan` (a capacity plan) and `make test` (the suite).
# Each bootstraps .venv on first use (hicache with its "cuda", "test" and "metrics" extras; torch pinned to
# the CPU build by constraints-dev.txt). Commands are not echoed, so
# `make plan ARGS="--format json" > plan.json` writes plain JSON.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
.SILENT:

.PHONY: help plan test test-loaded test-floors test-sanitized bench clean sglang docs

help:  ## list the targets
	grep -E '^[a-z-]+:.*## ' $(firstword $(MAKEFILE_LIST)) | sed -E 's/:.*## /\t/' | expand -t 16

# editable_mode=compat: a plain .pth entry, so start-up is what a regular install would see.
$(STAMP): pyproject.toml setup.py constraints-dev.txt hicache/effects/_copy/_hostcopy.c hicache/effects/_arena/_slotops.c hicache/pools/_pagestack.c
	echo "setting up $(VENV) (first run only)" >&2
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check -c constraints-dev.txt -e '.[cuda,test,metrics]' --config-settings editable_mode=compat >&2
	touch $(STAMP)

# SGLang 0.5.23's real code for the suite's SGLang tests (they skip, naming this target, where
# it is absent; .ci/run builds it and requires them): the wheel without its dependencies (they
# pin torch 2.14.1 and CUDA), then the light packages its host-pool imports need and Mooncake's
# non-CUDA wheel (the L3 test's real master and client), whose binaries need Debian's RDMA and
# NUMA libraries even for TCP: installed here when missing and run as root, else named.
SGLANG_STAMP := $(VENV)/.sglang-0.5.23
MOONCAKE_LIBS := libibverbs1 librdmacm1 libnuma1
$(SGLANG_STAMP): $(STAMP) requirements-sglang.txt
	if ! ldconfig -p | grep -q 'libibverbs\.so\.1 ' || ! ldconfig -p | grep -q 'librdmacm\.so\.1 ' \
	   || ! ldconfig -p | grep -q 'libnuma\.so\.1 '; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "installing $(MOONCAKE_LIBS) for Mooncake's binaries" >&2; \
	    apt-get install -y -q --no-install-recommends $(MOONCAKE_LIBS) >/dev/null 2>&1 \
	      || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q --no-install-recommends $(MOONCAKE_LIBS) >&2; }; \
	  else \
	    echo "warning: Mooncake's binaries need $(MOONCAKE_LIBS): apt-get install $(MOONCAKE_LIBS)" >&2; \
	  fi; \
	fi
	echo "installing sglang 0.5.23 for the suite (first run only): the wheel without its own dependencies, which pin torch 2.14.1 and CUDA; the light ones it needs on CPU come from requirements-sglang.txt" >&2
	$(BIN)/pip install --quiet --disable-pip-version-check -c constraints-dev.txt -r requirements-sglang.txt >&2
	$(BIN)/pip install --quiet --disable-pip-version-check --no-deps -c constraints-dev.txt sglang==0.5.23 >&2
	touch $(SGLANG_STAMP)

sglang: $(SGLANG_STAMP)  ## SGLang 0.5.23's real code in .venv, for its tests (requirements-sglang.txt)

docs: $(STAMP)  ## regenerate docs/environment.md from the one table of HICACHE_* variables
	$(BIN)/python -c "from hicache.plan._env import environment_markdown as m; open('docs/environment.md', 'w').write(m())"

plan: $(STAMP)  ## capacity plan (ARGS="--model deepseek-v3.2 --host-gb 300", ARGS="--format json")
	$(BIN)/hicache plan $(ARGS)

# Tests run in parallel workers (pytest-xdist; each test goes to the first free worker, except that
# the ones importing SGLang in-process share one, which pays that import once: tests/worker_groups.py).
# Three on two cores: many tests wait on child processes. TEST_WORKERS=0 runs them in this process.
TEST_WORKERS ?= 3
test: $(STAMP)  ## the whole test suite (ARGS passes pytest options; TEST_WORKERS=0: no workers)
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --sglang-on-one-worker $(ARGS)

# The suite's concurrency tests (marker `concurrency`: processes, threads, signals, waits) again,
# beside six busy processes - the load of a shared 2-core box - in a random file order (workers as
# above: SGLang's in-process import, ~25 s under this load, is paid once).
test-loaded: $(STAMP)  ## the concurrency tests under a load of about 8 (scripts/under_load.py)
	HICACHE_TEST_ORDER=$${HICACHE_TEST_ORDER:-random} $(BIN)/python scripts/under_load.py --hogs 6 -- \
	  $(BIN)/python -m pytest -n $(TEST_WORKERS) --sglang-on-one-worker -m "concurrency and not load_free" $(ARGS)

# The suite on the lowest version of each requirement pyproject.toml admits (constraints-floors.txt),
# in its own venv: every floor with what it needs (torch 2.4's CUDA build from PyPI, several GB),
# then Triton's floor over the Triton 3.0 torch 2.4 pins (below the test extra's 3.2), then
# hicache. Python 3.10 is the floor too: `make test-floors PYTHON=python3.10`. SGLang 0.5.23 needs 3.11.
FLOORS := .venv-floors
test-floors:  ## the suite on the lowest versions pyproject.toml admits (PYTHON=python3.10; downloads torch 2.4)
	[ -x $(FLOORS)/bin/python ] || $(PYTHON) -m venv $(FLOORS)
	$(FLOORS)/bin/pip install --quiet --disable-pip-version-check wheel \
	  $$(grep -v -e '^#' -e '^triton==' constraints-floors.txt) >&2
	$(FLOORS)/bin/pip install --quiet --disable-pip-version-check --no-deps "$$(grep ^triton== constraints-floors.txt)" >&2
	$(FLOORS)/bin/pip install --quiet --disable-pip-version-check --no-deps --no-build-isolation -e . \
	  --config-settings editable_mode=compat >&2
	$(FLOORS)/bin/python -m pytest -n $(TEST_WORKERS) --sglang-on-one-worker $(ARGS)

# The suite over the C helpers built with AddressSanitizer and UBSan (gcc's libasan): in a copy of
# the tree (build/sanitized; the helpers in the tree stay as they are), the helpers rebuilt there
# with the sanitizers, then .venv's Python runs the copy's tests on the copy's hicache (PYTHONPATH)
# with libasan loaded first and Python's allocations through malloc (PYTHONMALLOC), where ASan
# sees their bounds (CFLAGS goes on to the tests' own builds of a helper: tests/store_support.py's
# build_slotops). Any out-of-bounds access, use after free or undefined behaviour in a
# helper ends its process with the sanitizer's report. HICACHE_SANITIZED=1 tells the suite:
# tests/test_sanitizers.py proves the helpers are the sanitized build and that an overrun is
# caught; the few marked `sanitizer_free(why)` (RLIMIT_AS, which ASan's shadow memory exceeds) skip.
SANITIZED := build/sanitized
SANITIZE := -fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer -g
test-sanitized: $(STAMP)  ## the suite over the C helpers built with ASan and UBSan (gcc; ARGS as for test)
	asan=$$(gcc -print-file-name=libasan.so 2>/dev/null); stdcxx=$$(gcc -print-file-name=libstdc++.so 2>/dev/null); \
	  case "$$asan" in /*) ;; *) echo "test-sanitized needs gcc with libasan (Debian: apt-get install gcc)" >&2; exit 2;; esac; \
	  rm -rf $(SANITIZED) && mkdir -p $(SANITIZED) && \
	  git ls-files -co --exclude-standard -z | tar --null -cf - -T - | tar -xf - -C $(SANITIZED) && \
	  cd $(SANITIZED) && CC=gcc CFLAGS="$(SANITIZE)" LDFLAGS="$(SANITIZE)" $(abspath $(BIN))/python setup.py -q build_ext --inplace >&2 && \
	  HICACHE_SANITIZED=1 CFLAGS="$(SANITIZE)" PYTHONPATH=. PYTHONMALLOC=malloc LD_PRELOAD="$$asan $$stdcxx" \
	  ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1 \
	  $(abspath $(BIN))/python -m pytest -n $(TEST_WORKERS) --sglang-on-one-worker -p no:cacheprovider $(ARGS)

bench: $(STAMP)  ## the benchmarks: figure, baseline, ratio (ARGS=plan runs bench_plan only)
	$(BIN)/python benchmarks/run.py $(ARGS)

clean:  ## remove the virtualenv, build products and caches
	rm -rf $(VENV) $(FLOORS) .pytest_cache .hypothesis *.egg-info build dist
	find hicache -name '*.so' -delete
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
