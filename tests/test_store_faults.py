"""A store deleted, truncated or half-created, for real (issue 23): the checks see it and
`sweeper sync` repairs it from the other store.

  - StoreWatch on a real Optuna SQLite store that is open: deleted, replaced, truncated;
  - a real sweep (analytical: no Ray; and, `ci_slow`, a quickstart-like `devices` sweep on
    Ray), then optuna.db deleted, or truncated to 8 KiB: `sweeper export` exits 2, `sweeper
    sync --study` rebuilds the study from the MLflow runs, and `sweeper export` then gives
    every trial with the same table as before, and `--resume` continues it;
  - a real full disk (a tmpfs, root only) while MLflow creates its schema: the half-created
    schema is named in one line, moved aside on the next start when it holds no run, and
    `sweeper sync` fills a fresh store from Optuna.
"""

from __future__ import annotations

import os
import shutil
import sqlite3
import subprocess
import sys
import time
import uuid
from pathlib import Path

import optuna
import pandas as pd
import pytest
import yaml
from requires import require

from sweeper.cli import main
from sweeper.paths import open_optuna_storage
from sweeper.sweep.controller import run_sweep
from sweeper.tracking.results import load_runs, load_trials
from sweeper.tracking.store_health import (StoreWatch, mlflow_schema_problem,
                                           prepare_tracking_store, store_problem)
from workloads.config import HARDWARE_PRESETS, ConfigError

# tpu-v4 without the preset's 10% memory reserve (tpu-v4-whole.yaml, beside the space): its
# 4-chip points hold palm-62b's weights, so exactly batch 512 on 4 chips is pruned.
ANALYTICAL = {"name": "an", "model": "palm-62b", "hardware": "analytical:tpu-v4-whole.yaml",
              "input_len": 128, "decode_steps": 16, "sampler": {"type": "grid"},
              "params": {"batch": [1, 8, 64, 512], "chips": [4, 16],
                         "decode_ffn": ["ws1d", "ws2d"]},
              "objectives": [{"metric": "decode_step_s", "direction": "minimize"},
                             {"metric": "decode_cost_chip_s_per_token", "direction": "minimize"}],
              "trials": 6, "parallel": 1}


def write_space(folder: Path, data: dict) -> Path:
    path = folder / f"{data['name']}.yaml"
    path.write_text(yaml.safe_dump(data))
    whole = {**HARDWARE_PRESETS["tpu-v4"].to_dict(), "name": "tpu-v4", "memory_reserve": 0.0}
    (folder / "tpu-v4-whole.yaml").write_text(yaml.safe_dump(whole))
    return path


def same_table(a: pd.DataFrame, b: pd.DataFrame) -> None:
    """Every column of `sweeper export` equal (NaN == NaN), row by row."""
    assert list(a.columns) == list(b.columns)
    assert len(a) == len(b)
    pd.testing.assert_frame_equal(a.reset_index(drop=True), b.reset_index(drop=True),
                                  check_dtype=False)


def damage_optuna_store(home: Path, damage: str) -> None:
    """The real fault: optuna.db (and its -wal/-shm) deleted, or truncated to 8 KiB."""
    if damage == "deleted":
        for path in home.glob("optuna.db*"):
            if not path.name.endswith(".lock"):
                path.unlink()
    else:
        with sqlite3.connect(home / "optuna.db") as c:
            c.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        os.truncate(home / "optuna.db", 8192)


def export(study: str, out: Path) -> tuple[int, pd.DataFrame | None]:
    rc = main(["export", "--study", study, "--out", str(out)])
    return rc, (pd.read_csv(out) if rc == 0 else None)


# ----------------------------------------------------------------------------- the watch


def test_the_watch_sees_an_open_store_deleted_replaced_and_truncated(tmp_path):
    db = tmp_path / "optuna.db"
    url = f"sqlite:///{db}"
    storage = open_optuna_storage(url)
    study = optuna.create_study(storage=storage, study_name="s")
    study.set_user_attr("x", 1)
    watch = StoreWatch.open("optuna", url, "s")
    assert watch.check() is None
    os.unlink(db)                                   # the engine still has it open
    study.set_user_attr("y", 2)                     # ... and writes to the unlinked file
    problem = watch.check()
    assert problem is not None and "was deleted" in problem.what
    assert "sweeper sync --study s" in problem.line() and "\n" not in problem.line()
    db.write_bytes(b"")                             # another file at the path
    assert "replaced" in watch.check().what
    # truncated to 8 KiB under an open store (a fresh watch: same file, damaged)
    db2 = tmp_path / "optuna2.db"
    url2 = f"sqlite:///{db2}"
    storage2 = open_optuna_storage(url2)
    study2 = optuna.create_study(storage=storage2, study_name="t")
    for i in range(50):
        study2.set_user_attr(f"k{i}", "v" * 2000)
    storage2.engine.dispose()           # checkpoint: the pages are in the main file
    with sqlite3.connect(db2) as c:
        c.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    watch2 = StoreWatch.open("optuna", url2, "t")
    assert watch2.check() is None
    os.truncate(db2, 8192)
    problem = watch2.check()
    assert problem is not None and "damaged" in problem.what, problem
    assert store_problem("optuna", url2, "t") is not None


# ----------------------------------------------------------------------------- rebuild


@pytest.fixture
def analytical_sweep(sweeper_home, tmp_path):
    """A real 6-trial analytical sweep (5 COMPLETE, 1 PRUNED) and its exported table."""
    space = write_space(tmp_path, ANALYTICAL)
    result = run_sweep(str(space), study_name="an1", progress=False)
    assert result.counts == {"complete": 5, "failed": 0, "pruned": 1}
    rc, table = export("an1", tmp_path / "before.csv")
    assert rc == 0 and len(table) == 6
    return sweeper_home, space, table


@pytest.mark.parametrize("damage", ["deleted", pytest.param("truncated", marks=pytest.mark.ci_slow)])
def test_sync_rebuilds_a_lost_optuna_study_from_mlflow(analytical_sweep, tmp_path, capsys, damage):
    home, space, before = analytical_sweep
    db = home / "optuna.db"
    rdb = open_optuna_storage(f"sqlite:///{db}")
    original = optuna.load_study(study_name="an1", storage=rdb)
    trials = [(t.number, t.state, t.params, t.distributions, t.values, t.system_attrs)
              for t in original.get_trials()]
    rdb.engine.dispose()
    damage_optuna_store(home, damage)
    capsys.readouterr()
    assert export("an1", tmp_path / "x.csv")[0] == 2       # the damage is bad input to export
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--storage" in err

    assert main(["sync", "--study", "an1"]) == 0
    out = capsys.readouterr().out
    assert "rebuilt from 6 MLflow runs" in out
    if damage == "truncated":
        assert "moved    a damaged store aside to" in out
        assert list(home.glob("optuna.db.damaged-*"))      # kept, not deleted

    rc, after = export("an1", tmp_path / "after.csv")
    assert rc == 0
    same_table(before, after)
    rebuilt = optuna.load_study(study_name="an1", storage=open_optuna_storage(f"sqlite:///{db}"))
    assert [(t.number, t.state, t.params, t.distributions, t.values, t.system_attrs)
            for t in rebuilt.get_trials()] == trials
    # a second sync changes nothing; --resume continues the grid where it stopped
    assert main(["sync", "--study", "an1"]) == 0
    assert "0 logged now, 0 duplicate" in capsys.readouterr().out
    resumed = run_sweep(str(space), study_name="an1", resume=True, trials=8, progress=False)
    assert sum(resumed.counts.values()) == 8
    points = [tuple(sorted(t.params.items())) for t in resumed.study.get_trials()]
    assert len(set(points)) == 8                            # no grid point run twice


def test_sync_says_in_one_line_when_neither_store_has_the_study(sweeper_home, capsys):
    (sweeper_home / "mlflow.db").write_bytes(b"")
    assert main(["sync", "--study", "nothing"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "neither has it" in err
    (sweeper_home / "mlflow.db").unlink()        # no store at all: Optuna's own line
    assert main(["sync", "--study", "nothing"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--storage" in err and "no such file" in err


# ----------------------------------------------------------------------------- full disk


def cli(*args: str) -> subprocess.CompletedProcess:
    """`sweeper ARGS` in its own process, as a user runs it (MLflow caches a store's engine
    per process: a file moved aside would still be open in this one)."""
    return subprocess.run([sys.executable, "-m", "sweeper.cli", *args], capture_output=True,
                          text=True, timeout=600)


@pytest.mark.ci_slow      # ~30 s quiet, 70 s at load 15: three `sweeper` processes
def test_a_full_disk_while_mlflow_creates_its_schema_is_named_and_repaired(small_disk, tmp_path,
                                                                          monkeypatch):
    mnt, leave, filler = small_disk
    home = mnt / "home"
    monkeypatch.setenv("SWEEPER_HOME", str(home))
    leave(700 * 1024)          # room for optuna.db, not for MLflow's schema (~4 MiB of WAL)
    space = write_space(tmp_path, ANALYTICAL)
    done = cli("run", str(space), "--study", "full1", "--no-analysis")
    assert done.returncode == 1 and "the disk is full" in done.stderr
    db = home / "mlflow.db"
    problem = mlflow_schema_problem(db)
    assert problem and problem.startswith("half-created schema")   # quick_check is ok
    assert store_problem("mlflow", f"sqlite:///{db}", "full1") is not None
    filler.unlink()

    # the repair: sync moves it aside and fills a fresh store from the Optuna study
    done = cli("sync", "--study", "full1")
    assert done.returncode == 0, done.stderr
    assert "moved    a damaged store aside to" in done.stdout
    assert mlflow_schema_problem(db) is None
    done = cli("run", str(space), "--study", "full1", "--resume", "--no-analysis")
    assert done.returncode == 0, done.stderr
    trials = load_trials("full1")
    runs = load_runs(f"sqlite:///{db}", "sweeper/an (analytical)")
    assert len(trials) == 6 and sorted(runs["number"]) == sorted(trials["number"])


@pytest.mark.ci_slow      # ~24 s at load 15 (MLflow's schema creation until the disk is full)
def test_a_half_created_store_with_no_run_is_moved_aside_before_a_sweep(small_disk):
    mnt, leave, filler = small_disk
    db = mnt / "mlflow.db"
    leave(256 * 1024)
    code = f"from sweeper.tracking.mlflow_log import Tracker; Tracker('sqlite:///{db}')"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode != 0 and "full" in done.stderr
    filler.unlink()
    line = prepare_tracking_store(f"sqlite:///{db}", "s")
    assert line is not None and "half-created schema" in line and "\n" not in line
    assert not db.exists() and list(mnt.glob("mlflow.db.damaged-*"))
    assert prepare_tracking_store(f"sqlite:///{db}", "s") is None


def test_a_damaged_mlflow_store_at_the_start_names_sync(tmp_path):
    db = tmp_path / "mlflow.db"
    with sqlite3.connect(db) as c:
        c.execute("CREATE TABLE runs (x)")
        c.executemany("INSERT INTO runs VALUES (?)", [("v" * 3000,)] * 20)
    os.truncate(db, 8192)
    with pytest.raises(ConfigError) as err:
        prepare_tracking_store(f"sqlite:///{db}", "s")
    assert "sweeper sync --study s" in str(err.value)


# ----------------------------------------------------------------------------- Ray (slow)


DEVICES = {"name": "qs", "model": "tiny", "hardware": "devices", "chips": 1, "input_len": 8,
           "decode_steps": 2, "repeats": 1, "warmup": 0, "timeout_s": 120,
           "params": {"batch": [2, 4], "decode_attn": ["head", "batch"]},
           "objectives": [{"metric": "decode_step_s", "direction": "minimize"},
                          {"metric": "decode_cost_chip_s_per_token", "direction": "minimize"}],
           "sampler": {"type": "grid"}, "trials": 3, "parallel": 1}


@pytest.mark.ci_slow      # a 3-trial Ray sweep, then two repairs: ~30 s
def test_a_ray_sweep_whose_optuna_store_is_deleted_then_truncated_is_rebuilt(
        shared_sweeper_home, tmp_path, capsys):
    """Quickstart-like: 3 trials of the tiny model on Ray workers (`sweeper run` itself)."""
    import ray  # noqa: F401 - a dependency: a broken install fails here, never skips
    storage = f"sqlite:///{tmp_path / 'optuna.db'}"
    tracking = f"sqlite:///{tmp_path / 'mlflow.db'}"
    space = write_space(tmp_path, DEVICES)
    study = f"qs-{uuid.uuid4().hex[:6]}"
    done = subprocess.run([sys.executable, "-m", "sweeper.cli", "run", str(space), "--study",
                           study, "--storage", storage, "--tracking-uri", tracking,
                           "--no-analysis"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    args = ["--study", study, "--storage", storage]
    assert main(["export", *args, "--out", str(tmp_path / "before.csv")]) == 0
    before = pd.read_csv(tmp_path / "before.csv")
    assert (before["state"] == "COMPLETE").sum() == 3
    for damage in ("deleted", "truncated"):
        damage_optuna_store(tmp_path, damage)
        assert main(["export", *args, "--out", str(tmp_path / "x.csv")]) == 2
        assert main(["sync", *args, "--tracking-uri", tracking]) == 0
        assert "rebuilt from 3 MLflow runs" in capsys.readouterr().out
        assert main(["export", *args, "--out", str(tmp_path / "after.csv")]) == 0
        same_table(before, pd.read_csv(tmp_path / "after.csv"))
    shutil.rmtree(tmp_path / "mlartifacts", ignore_errors=True)


# ----------------------------------------------------------------------------- mid-sweep


def start_sweep(tmp_path: Path, study: str, delay: str, trials: int = 3) -> subprocess.Popen:
    """`sweeper run` of the DEVICES space in its own process (stderr to a file)."""
    space = write_space(tmp_path, DEVICES)
    env = dict(os.environ, SWEEPER_TEST_TRIAL_DELAY_S=delay)
    return subprocess.Popen(
        [sys.executable, "-m", "sweeper.cli", "run", str(space), "--study", study, "--storage",
         f"sqlite:///{tmp_path / 'optuna.db'}", "--tracking-uri",
         f"sqlite:///{tmp_path / 'mlflow.db'}", "--no-analysis", "--trials", str(trials)],
        env=env, stdout=open(tmp_path / "out", "w"), stderr=open(tmp_path / "err", "w"))


def wait_complete(proc: subprocess.Popen, db: Path, n: int, timeout_s: float = 600) -> None:
    """Until `n` trials are COMPLETE in the Optuna file (read-only)."""
    deadline = time.monotonic() + timeout_s
    while True:
        assert proc.poll() is None, (db.parent / "err").read_text()[-2000:]
        assert time.monotonic() < deadline
        try:
            with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5) as c:
                if c.execute("SELECT count(*) FROM trials WHERE state = 'COMPLETE'"
                             ).fetchone()[0] >= n:
                    return
        except sqlite3.Error:
            pass
        time.sleep(0.5)


def last_line(path: Path) -> str:
    return [line for line in path.read_text().splitlines() if line.strip()][-1]


@pytest.mark.ci_slow
def test_the_optuna_store_truncated_mid_sweep_stops_it_then_sync_and_resume_repair_it(
        shared_sweeper_home, tmp_path):
    pytest.importorskip("ray")
    proc = start_sweep(tmp_path, "mid", delay="4")
    db = tmp_path / "optuna.db"
    wait_complete(proc, db, 1)
    os.truncate(db, 8192)                       # under the running sweep
    assert proc.wait(timeout=600) == 1
    line = last_line(tmp_path / "err")
    assert line.startswith("sweeper run: error: the Optuna store") and "damaged" in line
    sync = line[line.index("`") + 1:line.rindex("`")]
    assert sync.startswith(f"sweeper sync --study mid --storage sqlite:///{db}")
    args = sync.split()[2:]
    assert main(["sync", *args]) == 0
    table = load_trials("mid", f"sqlite:///{db}")
    assert (table["state"] == "COMPLETE").sum() >= 1      # every trial that finished
    done = subprocess.run([sys.executable, "-m", "sweeper.cli", "run",
                           str(tmp_path / "qs.yaml"), "--study", "mid", "--resume", "--storage",
                           f"sqlite:///{db}", "--tracking-uri",
                           f"sqlite:///{tmp_path / 'mlflow.db'}", "--no-analysis"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    table = load_trials("mid", f"sqlite:///{db}")
    assert (table["state"] == "COMPLETE").sum() == 3      # the interrupted one ran again


@pytest.mark.ci_slow      # a 3-trial Ray sweep and a sync: ~50 s
def test_the_mlflow_store_deleted_mid_sweep_is_a_warning_then_exit_1_naming_sync(
        shared_sweeper_home, tmp_path):
    pytest.importorskip("ray")
    proc = start_sweep(tmp_path, "midml", delay="4")
    wait_complete(proc, tmp_path / "optuna.db", 1)
    for path in tmp_path.glob("mlflow.db*"):
        if not path.name.endswith(".lock"):
            path.unlink()
    assert proc.wait(timeout=600) == 1
    err = (tmp_path / "err").read_text()
    assert "sweeper: warning: the MLflow store" in err and "was deleted" in err
    line = last_line(tmp_path / "err")
    assert line.startswith("sweeper run: error: the MLflow store") and "sweeper sync" in line
    storage = f"sqlite:///{tmp_path / 'optuna.db'}"
    assert (load_trials("midml", storage)["state"] == "COMPLETE").sum() == 3   # all kept
    assert main(["sync", "--study", "midml", "--storage", storage, "--tracking-uri",
                 f"sqlite:///{tmp_path / 'mlflow.db'}"]) == 0
    runs = load_runs(f"sqlite:///{tmp_path / 'mlflow.db'}", "sweeper/qs")
    assert sorted(runs["number"]) == [0, 1, 2]
