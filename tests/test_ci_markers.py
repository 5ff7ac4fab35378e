"""CI runs every test (issue 36, docs/development.md "Tests"): `make test` runs those not
marked `slow`, `make test-ci-slow` those marked `ci_slow`; a test marked `slow` but not
`ci_slow` would run in neither, so there must be none. The check reads the marks of every
test this session collected, before `-m` deselects any (tests/conftest.py)."""

from conftest import SLOW_ONLY


def test_no_test_is_slow_without_running_in_ci(request):
    only_slow = request.config.stash.get(SLOW_ONLY, [])
    assert not only_slow, (f"{len(only_slow)} tests are marked `slow` but not `ci_slow`: CI "
                           f"never runs them; mark them `ci_slow` or delete them: "
                           f"{only_slow[:10]}")
