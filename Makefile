# The two quickstart commands: `make train` (main job on the built-in default)
# and `make test` (test suite, ruff included via tests/test_lint.py). Each creates .venv on first use.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: train test format clean

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt -e '.[test]'
	touch $(STAMP)

train: $(STAMP)
	$(PY) -m jaxrl_llm.train --config configs/quickstart.py --workdir runs/quickstart $(ARGS)
	$(PY) scripts/plot_metrics.py runs/quickstart --out runs/quickstart/curve.png

test: $(STAMP)
	$(PY) -m pytest -q $(ARGS)

format: $(STAMP)
	$(PY) -m ruff format .
	$(PY) -m ruff check --fix .

clean:
	rm -rf $(VENV)
