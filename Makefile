# Two commands for a newcomer: `make train` and `make test`. Both set up .venv first.
# `make test-view` runs the viewer's browser tests (needs a Chromium: apt-get install chromium).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
STAMP  := $(VENV)/.installed

.PHONY: setup train test test-view view-screenshots view bench clean

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

BROWSER_STAMP := $(VENV)/.installed-browser

$(BROWSER_STAMP): $(STAMP)
	$(PIP) install --quiet -c constraints.txt -e '.[browser]'
	touch $(BROWSER_STAMP)

# The viewer end to end in headless Chromium (Playwright drives the system's browser).
test-view: $(BROWSER_STAMP)
	@command -v chromium >/dev/null 2>&1 || [ -n "$$FRESHPER_CHROMIUM" ] || \
		{ echo "make test-view needs Chromium: apt-get install chromium (or set FRESHPER_CHROMIUM=/path/to/chrome)"; exit 2; }
	$(PY) -m pytest -q tests/test_view_browser.py --browser $(ARGS)

# The same tests, writing the screenshots docs/view.md shows.
view-screenshots: $(BROWSER_STAMP)
	$(PY) -m pytest -q tests/test_view_browser.py --browser --screenshots docs/img $(ARGS)

# Browse the runs in runs/ at http://127.0.0.1:8765
view: setup
	$(PY) -m agents.view runs $(ARGS)

clean:
	rm -rf $(VENV) runs .cache build *.egg-info
