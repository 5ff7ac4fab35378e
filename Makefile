# make sweep : install into .venv (created if missing) and run the quickstart sweep on this machine
# make test  : install into .venv and run the test suite
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed

.PHONY: sweep test test-all test-ci-slow ui bench install clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e '.[test]'
	touch $(STAMP)

# inside a git checkout, use the repository's hooks (.githooks/commit-msg: a subject of at most
# 72 characters, a blank line, the body; docs/development.md "Commits"); elsewhere nothing
install: $(STAMP)
	@if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then git config core.hooksPath .githooks; fi

sweep: install
	$(BIN)/sweeper run search_spaces/quickstart.yaml

# every generated number in README.md, docs/ and benchmarks/results/summary.md matches its
# results file (about a second; docs/development.md "Generated numbers"), then the tests;
# the 25 slowest are listed at the end, so every CI log shows where the time went
test: install
	$(BIN)/python -m benchmarks.readme_numbers --check
	$(BIN)/python -m pytest -q -m "not slow" --durations=25 tests

# the slow fault-injection tests CI runs too (docs/development.md "Tests")
test-ci-slow: install
	$(BIN)/python -m pytest -q -m ci_slow tests

test-all: install
	$(BIN)/python -m pytest -q tests

ui: install
	$(BIN)/sweeper ui

bench: install
	$(BIN)/pip install -q -e '.[test,bench]'
	$(BIN)/python -m benchmarks.run_all

clean:
	rm -rf $(VENV) .sweeper .pytest_cache
