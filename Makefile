# Every install step lives here and in pyproject.toml: CI runs `make test`
# on a clean clone.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install demo test bench fixtures clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	@bash fixtures/demo.sh $(VENV)/bin/ckpt

test: $(STAMP)
	$(PY) -m pytest -q

bench: $(STAMP)
	$(PY) bench/run_all.py

# Regenerate the committed fixtures with real orbax-checkpoint and torch.
fixtures: $(STAMP)
	$(PY) fixtures/generate.py

clean:
	rm -rf $(VENV) build *.egg-info
