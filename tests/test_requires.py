"""`require` skips a test whose need is missing on a developer's machine and fails it under
CI=true (tests/requires.py): CI cannot pass by not running a test."""

import pytest

from requires import in_ci, require


@pytest.mark.parametrize("value, ci", [("true", True), ("1", True), ("yes", True), ("", False),
                                       ("false", False), ("0", False)])
def test_ci_is_read_from_the_environment(value, ci, monkeypatch):
    monkeypatch.setenv("CI", value)
    assert in_ci() is ci


def test_a_missing_need_skips_locally_and_fails_in_ci(monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    require(True, "present")                              # a need that is there: nothing happens
    with pytest.raises(pytest.skip.Exception, match="no chromium"):
        require(False, "no chromium")
    monkeypatch.setenv("CI", "true")
    require(1, "present")
    with pytest.raises(pytest.fail.Exception, match="CI is set and this test cannot run: no chromium"):
        require(None, "no chromium")
