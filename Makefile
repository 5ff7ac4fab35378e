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

# the long tests CI runs too (docs/development.md "Tests"): real sweeps, serving runs,
# faults and the engine equivalence matrix's pairwise subset; the slowest listed at the end
test-ci-slow: install
	$(BIN)/python -m pytest -q -m ci_slow --durations=25 tests

# every test, with the whole engine equivalence matrix (570 cases, ~50 min on 2 cores)
test-all: install
	SWEEPER_FULL_MATRIX=1 $(BIN)/python -m pytest -q tests

ui: install
	$(BIN)/sweeper ui

bench: install
	$(BIN)/pip install -q -e '.[test,bench]'
	$(BIN)/python -m benchmarks.run_all

clean:
	rm -rf $(VENV) .sweeper .pytest_cache
