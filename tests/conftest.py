"""Shared test set-up.

JAX reads the number of virtual CPU devices once, when its backend starts, so the
emulated 8-chip mesh is requested here, before any test module imports JAX.
"""

import os
import re

_FLAG = "--xla_force_host_platform_device_count"
if not re.search(rf"{_FLAG}=\d+", os.environ.get("XLA_FLAGS", "")):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FLAG}=8".strip()

import pytest  # noqa: E402


@pytest.fixture
def sweeper_home(tmp_path, monkeypatch):
    """A fresh, empty $SWEEPER_HOME for one test (nothing is written to ./.sweeper)."""
    home = tmp_path / "sweeper_home"
    home.mkdir()
    monkeypatch.setenv("SWEEPER_HOME", str(home))
    return home


@pytest.fixture(scope="session")
def session_sweeper_home(tmp_path_factory):
    """One $SWEEPER_HOME for the session: the host profile is measured once, then cached."""
    return tmp_path_factory.mktemp("sweeper_home")


@pytest.fixture
def shared_sweeper_home(session_sweeper_home, monkeypatch):
    """Point $SWEEPER_HOME at the session's home for one test."""
    monkeypatch.setenv("SWEEPER_HOME", str(session_sweeper_home))
    return session_sweeper_home


@pytest.fixture(scope="session")
def engine_cache():
    """Compiled trials shared across test modules (run_trial's `engine_cache`), so a trial
    shape used by several tests compiles once per session."""
    return {}


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """A `ci_slow` test is also `slow` (docs/development.md "Tests"), so `make test`
    (`-m "not slow"`) leaves it to `make test-ci-slow`, which CI runs next, whether or not
    the test carries both marks. Runs before pytest's own `-m` selection (tryfirst)."""
    only_slow = []
    for item in items:
        if item.get_closest_marker("slow") and not item.get_closest_marker("ci_slow"):
            only_slow.append(item.nodeid)
        if item.get_closest_marker("ci_slow") and not item.get_closest_marker("slow"):
            item.add_marker(pytest.mark.slow)
    # CI runs every test (issue 36): a test marked `slow` alone would run nowhere;
    # tests/test_ci_markers.py fails on any (read before `-m` deselects them)
    config.stash[SLOW_ONLY] = only_slow


SLOW_ONLY = pytest.StashKey[list]()
