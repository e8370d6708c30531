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

.PHONY: install compile demo test check bench fixtures fuzz clean

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

# The test lanes spread the tests over TEST_JOBS pytest-xdist workers (auto: one per core).
# --dist loadfile: a test file runs whole on one worker, which builds its module-scoped
# fixtures once; tests/conftest.py spreads the files listed in SPREAD_FILES test by test.
# Markers (pyproject.toml):
#   serial  a bound that other work on the machine moves (wall time, peak RSS, page-cache
#           residency): left out of the parallel pass and run alone after it
#   slow    seconds or more each (whole ckpt processes, servers, large inputs)
# `make test` (CI) runs every test: the parallel pass, then the serial one; both run
# and either failing fails the target (a PYTEST_ARGS -k that selects no serial test is no failure).
# `make check` is the edit loop's lane (under 2 minutes on 2 quiet cores): neither slow
# nor serial tests, in parallel. Extra pytest arguments: make check PYTEST_ARGS='-k dcp -x'
TEST_JOBS ?= auto
PYTEST_ARGS ?=
XDIST := -n $(TEST_JOBS) --dist loadfile
test: compile
	@status=0; \
	$(PY) -m pytest -q $(XDIST) -m "not serial" $(PYTEST_ARGS) || status=$$?; \
	$(PY) -m pytest -q -m serial $(PYTEST_ARGS) || { rc=$$?; [ $$rc -eq 5 ] || status=$$rc; }; \
	exit $$status

check: compile
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

# Regenerate the committed fixtures with real orbax-checkpoint and torch.
fixtures: $(STAMP)
	$(PY) fixtures/generate.py
	$(PY) fixtures/gen_fsdp2.py
	$(PY) fixtures/gen_dcp_variants.py
	$(PY) fixtures/gen_safetensors.py
	$(MAKE) $(TRANSFORMERS4_STAMP)
	$(PY) fixtures/gen_torch_save.py
	$(PY) fixtures/gen_runs.py
	$(PYTHON) fixtures/gen_orbax_versions.py
	$(PYTHON) fixtures/gen_legacy_jax.py
	$(MAKE) $(DEEPSPEED_STAMP)
	DS_ACCELERATOR=cpu $(DEEPSPEED_VENV)/bin/python fixtures/gen_deepspeed.py
	DS_ACCELERATOR=cpu $(DEEPSPEED_VENV)/bin/python fixtures/gen_deepspeed_pipe_moe.py

# transformers 5 writes safetensors only: the .bin fixtures come from 4.57 (same torch) in its own venv
TRANSFORMERS4_VENV := build/venv-transformers-4.57
TRANSFORMERS4_STAMP := $(TRANSFORMERS4_VENV)/.installed
$(TRANSFORMERS4_STAMP):
	$(PYTHON) -m venv $(TRANSFORMERS4_VENV)
	$(TRANSFORMERS4_VENV)/bin/python -m pip install $(PIP_QUIET) torch==2.13.0 'transformers==4.57.*' numpy
	touch $@

# DeepSpeed ZeRO fixtures: deepspeed 0.19 (no compiled ops: DS_BUILD_OPS=0) on torch 2.13's CPU build, in its own venv;
# run with DS_ACCELERATOR=cpu (gloo ranks on 127.0.0.1); safetensors and huggingface_hub for zero_to_fp32 --safe_serialization (the bench);
# transformers (the test venv's 5.24) for the Llama trained under ZeRO-3 (deepspeed_z3_hf_llama)
DEEPSPEED_VENV := build/venv-deepspeed-0.19
DEEPSPEED_STAMP := $(DEEPSPEED_VENV)/.installed
$(DEEPSPEED_STAMP):
	$(PYTHON) -m venv $(DEEPSPEED_VENV)
	DS_BUILD_OPS=0 $(DEEPSPEED_VENV)/bin/python -m pip install $(PIP_QUIET) torch==2.13.0 'deepspeed==0.19.*' numpy 'safetensors==0.8.*' 'huggingface_hub==2.4.*' 'transformers==5.24.*'
	touch $@

clean:
	rm -rf $(VENV) $(DEMO_VENV) build *.egg-info
