# Two commands for a newcomer: `make train` and `make test`. Both set up .venv first.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
STAMP  := $(VENV)/.installed

.PHONY: setup train test bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet -c constraints.txt -e '.[dev]'
	touch $(STAMP)

train: setup
	$(PY) train.py $(ARGS)

test: setup
	$(PY) -m pytest -q $(ARGS)

clean:
	rm -rf $(VENV) runs .cache build *.egg-info
