"""The repository's commit-msg hook (.githooks/commit-msg, enabled by `make install`):
a subject of at most 72 characters, then a blank line before the body (docs/development.md
"Commits"). Run on message files, and through a real `git commit` in a scratch repository."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HOOK = ROOT / ".githooks" / "commit-msg"

GOOD = ("Time the quickstart as a user's whole command\n\n"
        "sweep_overhead timed the quickstart inside its own process; the next\n"
        "run also times `sweeper run quickstart` as a subprocess.\n"
        "# Please enter the commit message for your changes. Lines starting\n"
        "# with '#' will be ignored, and an empty message aborts the commit.\n")
LONG = ("sweep_overhead --quickstart-runs N: the quickstart run N times, one after another, "
        "and its 30 s target judged on the median\n")


def _hook(tmp_path: Path, message: str) -> subprocess.CompletedProcess:
    path = tmp_path / "COMMIT_EDITMSG"
    path.write_text(message)
    return subprocess.run([sys.executable, str(HOOK), str(path)], capture_output=True, text=True)


def test_a_short_subject_a_blank_line_and_a_body_pass(tmp_path):
    done = _hook(tmp_path, GOOD)
    assert done.returncode == 0, done.stderr
    assert _hook(tmp_path, "Fix a typo in docs/serving.md\n").returncode == 0       # no body
    assert _hook(tmp_path, "x" * 72 + "\n").returncode == 0
    # git's own subjects are left alone: a merge, and autosquash's prefixes
    assert _hook(tmp_path, "Merge branch 'h37-docs' " + "x" * 72 + "\n").returncode == 0


def test_a_long_subject_is_refused_with_the_format_explained(tmp_path):
    done = _hook(tmp_path, LONG)
    assert done.returncode == 1
    assert f"the subject is {len(LONG.strip())} characters, more than 72" in done.stderr
    assert "a blank line, then the body" in done.stderr     # the format, explained
    # characters, not bytes: 72 of them with a multi-byte one passes, 73 does not
    assert _hook(tmp_path, "×" * 72 + "\n").returncode == 0
    assert _hook(tmp_path, "×" * 73 + "\n").returncode == 1


def test_a_body_that_starts_on_the_second_line_is_refused(tmp_path):
    done = _hook(tmp_path, "Add the hook\nit checks the subject\n")
    assert done.returncode == 1 and "not blank" in done.stderr
    # the comment lines git adds and a leading blank line do not count
    assert _hook(tmp_path, "\n# a comment\nAdd the hook\n# a comment\n\nbody\n").returncode == 0


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_git_commit_runs_the_hook_through_core_hooks_path(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()

    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@example.com",
                               "-c", "commit.gpgsign=false", *args],
                              cwd=repo, capture_output=True, text=True)

    assert git("init", "-q").returncode == 0
    shutil.copytree(ROOT / ".githooks", repo / ".githooks")
    assert git("config", "core.hooksPath", ".githooks").returncode == 0
    (repo / "f.txt").write_text("a\n")
    git("add", "f.txt")
    refused = git("commit", "-q", "-m", LONG.strip())
    assert refused.returncode != 0 and "more than 72" in refused.stderr
    assert git("rev-parse", "HEAD").returncode != 0          # nothing was committed
    kept = git("commit", "-q", "-m", "Add f.txt", "-m", "Why: a test of the hook.")
    assert kept.returncode == 0, kept.stderr
    assert git("log", "--format=%s").stdout.strip() == "Add f.txt"


@pytest.mark.skipif(shutil.which("git") is None or shutil.which("make") is None, reason="needs git and make")
def test_make_install_enables_the_hooks_in_a_checkout_and_nowhere_else(tmp_path):
    """The Makefile's install target: `core.hooksPath .githooks` inside a git checkout; in a
    folder that is not one (an unpacked sdist, a CI cache) it does nothing and succeeds. The
    virtual environment is faked as installed (a stamp newer than pyproject.toml), so only the
    hook line runs."""
    for name, checkout in (("plain", False), ("checkout", True)):
        folder = tmp_path / name
        (folder / ".venv" / "bin").mkdir(parents=True)
        shutil.copy(ROOT / "Makefile", folder / "Makefile")
        shutil.copy(ROOT / "pyproject.toml", folder / "pyproject.toml")
        (folder / ".venv" / "bin" / "python").write_text("")
        (folder / ".venv" / ".installed").write_text("")
        if checkout:
            subprocess.run(["git", "init", "-q"], cwd=folder, check=True)
        env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "GIT_CONFIG_NOSYSTEM": "1",
               "GIT_CEILING_DIRECTORIES": str(tmp_path)}
        done = subprocess.run(["make", "install"], cwd=folder, capture_output=True, text=True, env=env)
        assert done.returncode == 0, done.stderr
        if checkout:
            hooks = subprocess.run(["git", "config", "core.hooksPath"], cwd=folder, env=env,
                                   capture_output=True, text=True)
            assert hooks.stdout.strip() == ".githooks"
        else:
            assert not (folder / ".git").exists()
