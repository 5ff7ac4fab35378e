"""Every command an error line tells the user to run works in the state that line
describes (issue 36, item 5): each test puts a real store in that state (a real full disk:
a small tmpfs, root only; a really truncated SQLite file; a study that does not exist),
reads the command from the real CLI's last stderr line, runs it, and checks that it
succeeds.

Before: a disk that filled while `optuna.db` was created said "run the same command with
--resume", which then exited 2 (no study existed yet); a damaged `mlflow.db` at the start of
a new study's sweep named `sweeper sync --study <the new study>`, which does not exist
either. The other commands error lines name are run by the fault tests that cause them
(docs/reliability.md: `sweeper sync` in tests/test_store_faults.py and tests/test_faults.py,
`--resume` in tests/test_reliability.py and tests/test_faults.py, `sweeper plan --out` in
tests/test_serving_faults.py).
"""

from __future__ import annotations

import os
import re
import shlex
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from requires import require

ANALYTICAL = {"name": "an", "model": "palm-62b", "hardware": "analytical:tpu-v4",
              "input_len": 128, "decode_steps": 16, "sampler": {"type": "grid"},
              "params": {"batch": [1, 8, 64], "chips": [8, 16]},
              "objectives": [{"metric": "decode_step_s", "direction": "minimize"},
                             {"metric": "decode_cost_chip_s_per_token", "direction": "minimize"}],
              "trials": 6, "parallel": 1}


def sweeper(args: list[str], home: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "SWEEPER_HOME": str(home)}
    return subprocess.run([sys.executable, "-m", "sweeper.cli", *args], capture_output=True,
                          text=True, timeout=600, env=env, cwd=home.parent)


def last_line(proc: subprocess.CompletedProcess) -> str:
    lines = proc.stderr.strip().splitlines()
    assert lines, proc.stdout[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return lines[-1]


def advised(line: str, args: list[str]) -> list[str]:
    """The command a store-failure line advises: "run the same command again" -> `args`;
    "run the same command with X" -> `args` + X."""
    again = re.search(r"run the same command (again|with ([^;(]+))", line)
    assert again, line
    return args if again.group(1).startswith("again") else args + shlex.split(again.group(2))


def trial_states(home: Path, study: str) -> list[str]:
    import optuna

    storage = f"sqlite:///{home / 'optuna.db'}"
    return [t.state.name for t in optuna.load_study(study_name=study, storage=storage).trials]


@pytest.mark.ci_slow        # three `sweeper` processes on a full disk (~10 s each loaded)
@pytest.mark.parametrize("free_kib,study_made", [(150, False), (700, True)])
def test_the_full_disk_advice_of_run_works(small_disk, tmp_path, free_kib, study_made):
    """150 KiB free: optuna.db cannot be created, no study exists, the line says to run the
    same command again; 700 KiB: the study exists, MLflow's schema could not be written, the
    line names `--study S --resume`. Either way the advised command, once the disk has room,
    finishes the sweep."""
    mnt, leave, filler = small_disk
    home = mnt / "home"
    space = tmp_path / "an.yaml"
    space.write_text(yaml.safe_dump(ANALYTICAL))
    args = ["run", str(space), "--no-analysis"]
    leave(free_kib * 1024)
    full = sweeper(args, home)
    line = last_line(full)
    assert full.returncode == 1 and "the disk is full" in line, full.stderr[-2000:]
    assert ("--resume" in line) == study_made, line
    assert ("no study was created" in line) == (not study_made), line
    filler.unlink(missing_ok=True)
    again = sweeper(advised(line, args), home)
    assert again.returncode == 0, again.stderr[-3000:]
    study = re.search(r"study\s+(\S+): 6 complete", again.stdout)
    assert study, again.stdout[-2000:]
    assert trial_states(home, study.group(1)) == ["COMPLETE"] * 6


@pytest.mark.ci_slow        # a plan, twice, on a full disk
def test_the_full_disk_advice_of_another_command_works(small_disk, tmp_path):
    """`sweeper plan` logging to an MLflow store on a full disk: "run the same command
    again", which then moves the half-created store aside and logs the plan."""
    mnt, leave, filler = small_disk
    args = ["plan", "--model", "tiny", "--hardware", "tpu-v4", "--rate", "4", "--input-len", "8",
            "--output-len", "4", "--ttft", "1", "--tpot", "0.2",
            "--tracking-uri", f"sqlite:///{mnt / 'mlflow.db'}"]
    leave(150 * 1024)
    full = sweeper(args, tmp_path / "home")
    line = last_line(full)
    assert full.returncode == 1 and "the disk is full" in line, full.stderr[-2000:]
    filler.unlink(missing_ok=True)           # (the half-created mlflow.db is left: the command moves it aside)
    again = sweeper(advised(line, args), tmp_path / "home")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "logged to MLflow run" in again.stdout
    assert list(mnt.glob("mlflow.db.damaged-*")), "the half-created store was not moved aside"


def test_a_damaged_mlflow_store_names_a_sync_that_repairs_it(tmp_path):
    """A truncated mlflow.db when a new study's sweep starts: the line names `sweeper sync`
    of a study that exists (before: of the new study, which does not); running it, then the
    refused sweep again, both succeed."""
    home = tmp_path / "home"
    space = tmp_path / "an.yaml"
    space.write_text(yaml.safe_dump(ANALYTICAL))
    assert sweeper(["run", str(space), "--study", "done", "--no-analysis"], home).returncode == 0
    db = home / "mlflow.db"
    with sqlite3.connect(db) as con:
        con.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    os.truncate(db, 3000)
    args = ["run", str(space), "--study", "second", "--no-analysis"]
    refused = sweeper(args, home)
    line = last_line(refused)
    assert refused.returncode == 2 and "mlflow.db" in line, refused.stderr[-2000:]
    command = re.search(r"`(sweeper sync [^`]+)`", line)
    assert command and "--study done" in command.group(1), line
    repair = sweeper(shlex.split(command.group(1))[1:], home)
    assert repair.returncode == 0, repair.stderr[-3000:]
    again = sweeper(args, home)
    assert again.returncode == 0, again.stderr[-3000:]
    assert trial_states(home, "second") == ["COMPLETE"] * 6


def test_resume_without_a_study_names_a_run_that_starts_one(tmp_path):
    """`--resume` where the space has no study: "run without --resume to start one", which
    does."""
    home = tmp_path / "home"
    space = tmp_path / "an.yaml"
    space.write_text(yaml.safe_dump(ANALYTICAL))
    args = ["run", str(space), "--no-analysis"]
    refused = sweeper([*args, "--resume"], home)
    line = last_line(refused)
    assert refused.returncode == 2 and "run without --resume to start one" in line, line
    started = sweeper(args, home)
    assert started.returncode == 0, started.stderr[-3000:]
    assert "6 complete" in started.stdout
