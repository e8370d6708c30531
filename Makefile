# Every install step lives here and in pyproject.toml: CI runs `make test`
# on a clean clone.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install compile demo test bench fixtures fuzz clean

# compat mode puts the source on sys.path through a .pth file instead of an
# import hook that costs every `ckpt` start ~20 ms
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]' --config-settings editable_mode=compat
	touch $(STAMP)

# byte-compile our sources: where PYTHONDONTWRITEBYTECODE is set, every run
# would otherwise recompile them
compile: $(STAMP)
	@$(PY) -m compileall -q ckpt_tool

install: compile

demo: compile
	@bash fixtures/demo.sh $(CURDIR)/$(VENV)/bin/ckpt

test: compile
	$(PY) -m pytest -q

bench: compile
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
	$(PYTHON) fixtures/gen_orbax_versions.py
	$(PYTHON) fixtures/gen_legacy_jax.py

clean:
	rm -rf $(VENV) build *.egg-info
