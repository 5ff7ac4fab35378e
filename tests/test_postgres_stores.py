"""Server stores under concurrency: Optuna storage and the MLflow backend on a real
PostgreSQL server (a private cluster started here, see tests/postgres_server.py), with two
`sweeper run` processes writing at once into the same two databases, both starting on
empty databases (so both create the schemas at the same moment) and both logging to the
same MLflow experiment (so both create it at the same moment).

Two variants: cost-model trials (dense writes; in `make test`) and trials measured by Ray
workers (the controller also writes while trials run; `slow`). Afterwards every trial of
each study is recorded exactly once in both stores: one MLflow child run per Optuna trial,
under that sweep's parent run, with the run id the trial names; none missing, no
duplicates, nothing from one study under the other's parent.

Without PostgreSQL binaries the test is skipped with the reason, except in CI (CI set,
as for the browser test), where `.ci/run` installs them: there a missing server fails.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from postgres_server import MISSING, make_server
from requires import require

ROOT = Path(__file__).resolve().parents[1]


def unavailable(reason: str):
    """Skip here; in CI (.ci/run installs the server and `make test` the drivers) fail."""
    require(False, reason)


@pytest.fixture(scope="module")
def postgres():
    if importlib.util.find_spec("psycopg2") is None:       # the fixture creates databases with it
        unavailable("psycopg2 not installed: pip install -e '.[test]'")
    server = make_server()
    if server is None:
        unavailable(MISSING)
    try:
        server.start()
        yield server
    finally:
        server.stop()


# (hardware, trials per sweep, trials in flight, chips searched)
VARIANTS = {
    # Quickstart's tiny model and layouts on the cost model: each trial takes milliseconds,
    # so the two sweeps' writes to the stores are as dense as they get and interleave.
    "analytical": ("analytical:tpu-v4", 24, 2, [1, 2, 4, 8]),
    # Measured on emulated meshes by Ray workers (each sweep starts its own local Ray): the
    # controller also writes a trial's `worker` attrs while it runs.
    "measured": ("host", 3, 1, [1, 2]),
}


def write_space(directory: Path, variant: str) -> tuple[Path, int]:
    hardware, trials, parallel, chips = VARIANTS[variant]
    space = yaml.safe_load((ROOT / "search_spaces" / "quickstart.yaml").read_text())
    space.update({"name": f"pg-{variant}", "hardware": hardware, "trials": trials,
                  "parallel": parallel, "sampler": {"type": "random", "seed": 0}})
    space["params"]["chips"] = chips
    path = directory / f"pg-{variant}.yaml"
    path.write_text(yaml.safe_dump(space, sort_keys=False))
    return path, trials


def start_sweep(space: Path, study: str, storage: str, tracking: str, home: Path):
    cmd = [sys.executable, "-m", "sweeper.cli", "run", str(space), "--storage", storage,
           "--tracking-uri", tracking, "--study", study, "--json", "--no-analysis"]
    env = {**os.environ, "SWEEPER_HOME": str(home), "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


# The measured variant takes ~1-2 minutes on the 2-core VM (two local Ray instances): ci_slow.
@pytest.mark.parametrize("variant", ["analytical",
                                     pytest.param("measured", marks=pytest.mark.ci_slow)])
def test_two_concurrent_sweeps_record_each_trial_once_in_both_stores(postgres, tmp_path, variant):
    import optuna
    from mlflow.tracking import MlflowClient

    for database in (f"optuna_{variant}", f"mlflow_{variant}"):     # empty: no schema yet
        postgres.create_database(database)
    storage = postgres.url(f"optuna_{variant}", "+psycopg2")
    tracking = postgres.url(f"mlflow_{variant}")
    space, trials_per_sweep = write_space(tmp_path, variant)
    studies = ["pg-a", "pg-b"]
    started = time.monotonic()
    procs = [start_sweep(space, s, storage, tracking, tmp_path / "home") for s in studies]
    results = {}
    for study, proc in zip(studies, procs):
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, f"{study}: {err[-3000:]}\n{postgres.log()[-2000:]}"
        results[study] = json.loads(out)
    print(f"two concurrent {variant} sweeps on PostgreSQL: {time.monotonic() - started:.1f}s")

    client = MlflowClient(tracking)
    spans = []
    experiments = {r["experiment_id"] for r in results.values()}
    assert len(experiments) == 1                      # one experiment, created once
    for study in studies:
        result = results[study]
        assert result["mlflow_missing"] == 0 and result["tracking_errors"] == 0
        trials = optuna.load_study(study_name=study, storage=storage).trials
        assert len(trials) == trials_per_sweep
        assert all(t.state.is_finished() for t in trials)
        assert sorted(t.number for t in trials) == list(range(trials_per_sweep))
        runs = client.search_runs(list(experiments),
                                  f"tags.`mlflow.parentRunId` = '{result['parent_run_id']}'",
                                  max_results=1000)
        numbers = sorted(int(r.data.tags["trial_number"]) for r in runs)
        assert numbers == list(range(trials_per_sweep)), f"{study}: MLflow child runs {numbers}"
        assert {t.user_attrs["mlflow_run_id"] for t in trials} == {r.info.run_id for r in runs}
        for t in trials:
            run = client.get_run(t.user_attrs["mlflow_run_id"])
            assert run.data.tags["trial_number"] == str(t.number)
            assert run.data.tags["status"] == t.state.name
        spans.append((min(t.datetime_start for t in trials),
                      max(t.datetime_complete for t in trials)))
    # the two sweeps really wrote at the same time (else this test would prove nothing)
    (a_start, a_end), (b_start, b_end) = spans
    assert a_start < b_end and b_start < a_end, f"the sweeps did not overlap: {spans}"
