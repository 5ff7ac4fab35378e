"""What a test needs from outside Python, asked for in one way (issue 21: tests that cannot
pass by skipping).

`require(condition, why)` skips the test with `why` on a developer's machine, where Chromium,
PostgreSQL's binaries or root may be missing; under `CI=true` it fails the test instead, so
CI (.ci/run, which installs what the tests need and runs as root) never passes by not
running what it claims to test. docs/development.md "What a test needs, and CI".
"""

from __future__ import annotations

import os

import pytest


def in_ci() -> bool:
    """CI=true (or any value but empty, 0, false, no), as CI services set it."""
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def require(condition: object, why: str) -> None:
    """Go on when `condition` holds; else skip here, or fail under CI."""
    if condition:
        return
    if in_ci():
        pytest.fail(f"CI is set and this test cannot run: {why}", pytrace=False)
    pytest.skip(why)
