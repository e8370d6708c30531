# Every install step lives here and in pyproject.toml: CI runs `make test`
# on a clean clone.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# `make demo` runs ckpt only: its own venv with `pip install .` (ckpt and its
# runtime dependencies, ~200 MB), not the test stack (torch, jax, transformers)
DEMO_VENV := .venv-demo
DEMO_STAMP := $(DEMO_VENV)/.installed
PIP_QUIET := -q --disable-pip-version-check

.PHONY: install compile demo typecheck test check bench fixtures fuzz clean

# compat mode puts the source on sys.path through a .pth file instead of an
# import hook that costs every `ckpt` start ~20 ms; setuptools warns that the
# mode is transitional in a 12-line banner that -q does not hide (pip >= 25
# shows build-backend warnings): the filter silences that one warning only
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install $(PIP_QUIET) --upgrade pip
	PYTHONWARNINGS='ignore:Compat editable installs' \
	  $(PY) -m pip install $(PIP_QUIET) -e '.[test]' --config-settings editable_mode=compat
	touch $(STAMP)

# a plain (not editable) install, as a user installs ckpt: rebuilt when a source changes
$(DEMO_STAMP): pyproject.toml $(wildcard ckpt_tool/*.py ckpt_tool/*/*.py ckpt_tool/*/*/*.py ckpt_tool/*/*/*/*.py)
	$(PYTHON) -m venv $(DEMO_VENV)
	@# setuptools builds in build/lib and reuses it: a module moved or deleted since would be installed again
	rm -rf build/lib build/bdist.*
	$(DEMO_VENV)/bin/python -m pip install $(PIP_QUIET) .
	touch $(DEMO_STAMP)

# byte-compile our sources: where PYTHONDONTWRITEBYTECODE is set, every run
# would otherwise recompile them
compile: $(STAMP)
	@$(PY) -m compileall -q ckpt_tool

install: compile

demo: $(DEMO_STAMP)
	@bash fixtures/demo.sh $(CURDIR)/$(DEMO_VENV)/bin/ckpt

# the whole package under pyproject.toml's [tool.mypy] (the format contract and its callers with
# every function typed); cached in build/mypy: ~20 s of CPU the first time, under 1 s after
typecheck: $(STAMP)
	$(PY) -m mypy

# The test lanes spread the tests over TEST_JOBS pytest-xdist workers (below).
# --dist loadfile: a test file runs whole on one worker, which builds its module-scoped
# fixtures once; tests/conftest.py spreads the files listed in SPREAD_FILES test by test.
# Markers (pyproject.toml):
#   serial  a bound that other work on the machine moves (wall time, peak RSS, page-cache
#           residency): left out of the parallel pass and run alone after it
#   slow    seconds or more each (whole ckpt processes, servers, large inputs)
# `make test` (CI) runs every test: the parallel pass, then the serial one; both run
# and either failing fails the target (a PYTEST_ARGS -k that selects no serial test is no failure).
# `make check` is the edit loop's lane (about 3 minutes on 2 quiet cores: 3 min 6 s, 2,879 tests, 2026-12-06): neither slow
# nor serial tests, in parallel. Extra pytest arguments: make check PYTEST_ARGS='-k dcp -x'
# half again as many workers as cores: much of the suite waits on whole processes, servers and deadlines, and
# the parallel pass on 2 cores took 493 s with 3 workers against 635-684 s with 2 (fresh clones, 2026-12-07)
TEST_JOBS ?= $(shell $(PYTHON) -c 'import os; print(max(2, (os.cpu_count() or 1) * 3 // 2))')
PYTEST_ARGS ?=
XDIST := -n $(TEST_JOBS) --dist loadfile
# the serial pass collects only the files that mark a test serial (collecting all of tests/ to
# deselect 4,000 tests took 11 of its seconds); with PYTEST_ARGS, what they name
SERIAL_FILES = $(if $(PYTEST_ARGS),,$(shell grep -rl --include='test_*.py' 'mark\.serial' tests))
test: compile typecheck
	@status=0; \
	$(PY) -m pytest -q $(XDIST) -m "not serial" $(PYTEST_ARGS) || status=$$?; \
	$(PY) -m pytest -q -m serial $(PYTEST_ARGS) $(SERIAL_FILES) || { rc=$$?; [ $$rc -eq 5 ] || status=$$rc; }; \
	exit $$status

check: compile typecheck
	$(PY) -m pytest -q $(XDIST) -m "not slow and not serial" $(PYTEST_ARGS)

# matplotlib draws the scale bench's plots (bench/scale_bench.py): installed for `make bench` only, not for CI
BENCH_STAMP := $(VENV)/.bench-installed
$(BENCH_STAMP): $(STAMP)
	$(PY) -m pip install $(PIP_QUIET) 'matplotlib>=3.7'
	touch $@

bench: compile $(BENCH_STAMP)
	$(PY) bench/run_all.py

# the long fuzzing run (tests/fuzz_lib.py): mutants of every fixture file kind + the explicit cases,
# summary in build/fuzz/summary.json, each failing mutant under build/fuzz/failures/; exit 1 if any
MUTANTS ?= 5000
SEED ?= 1
JOBS ?= 2
fuzz: compile
	$(PY) fuzz/run_fuzz.py --mutants $(MUTANTS) --seed $(SEED) --jobs $(JOBS) --out build/fuzz

# Regenerate the committed fixtures with the real writers: fixtures/generate_all.py runs every
# generator (fixtures/generate.py, fixtures/gen_*.py) as the `# fixtures-...` lines at its top say
# (which python, the venv it needs made first, its environment, the generators it must follow)
fixtures: $(STAMP)
	$(PYTHON) fixtures/generate_all.py --test-python $(PY)

clean:
	rm -rf $(VENV) $(DEMO_VENV) build *.egg-info
