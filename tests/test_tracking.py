"""Tracking: the analytical backend through the real controller, a real SQLite Optuna study
and a real SQLite MLflow store in a temp dir; no Ray is needed for cost-model trials.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import mlflow
import optuna
import pytest
import yaml
from mlflow.tracking import MlflowClient

from sweeper.sweep.controller import run_sweep
from sweeper.tracking.results import COLUMNS, METRIC_COLUMNS, PARAM_COLUMNS, load_runs, load_trials
from sweeper.tracking.mlflow_log import experiment_name
from workloads.config import ConfigError
from workloads.metrics import METRIC_NAMES


# PaLM 62B on TPU v4: some points fit, some do not (memory, divisibility): both show up.
SPACE = {
    "name": "track-test",
    "model": "palm-62b",
    "hardware": "analytical:tpu-v4",
    "input_len": 128,
    "decode_steps": 16,
    "params": {"batch": [1, 8, 64, 512], "chips": [1, 4, 16], "decode_ffn": ["ws1d", "ws2d"],
               "attn": ["head", "batch"], "weights": ["bf16", "int8"]},
    "constraints": ["decode_step_s <= 0.05"],
    "sampler": {"type": "grid", "seed": 0},
    "trials": 12,
}


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    home = tmp_path_factory.mktemp("sweeper_home")
    return {"home": home, "storage": f"sqlite:///{home / 'optuna.db'}",
            "tracking_uri": f"sqlite:///{home / 'mlflow.db'}"}


@pytest.fixture(scope="module")
def space_file(stores):
    path = stores["home"] / "track-test.yaml"
    path.write_text(yaml.safe_dump(SPACE, sort_keys=False))
    return path


@pytest.fixture(scope="module")
def sweep(stores, space_file):
    seen = []
    result = run_sweep(str(space_file), storage=stores["storage"], tracking_uri=stores["tracking_uri"],
                       progress=False, on_trial=seen.append)
    return result, seen


def test_trial_counts_match(sweep):
    result, seen = sweep
    counts = result.counts
    assert counts["complete"] + counts["failed"] + counts["pruned"] == SPACE["trials"] == len(seen)
    study = optuna.load_study(study_name=result.study_name, storage=result.storage)
    assert len(study.trials) == SPACE["trials"]
    assert counts["complete"] >= 1 and counts["pruned"] >= 1     # this space has both kinds
    assert result.source == "analytical"
    assert result.to_json()["trials_complete"] == counts["complete"]
    parent = MlflowClient(result.tracking_uri).get_run(result.parent_run_id)
    assert parent.data.metrics["trials_complete"] == counts["complete"]
    assert parent.data.metrics["trials_pruned"] == counts["pruned"]
    assert parent.info.status == "FINISHED"


def test_optuna_user_attrs(sweep):
    result, _ = sweep
    study = optuna.load_study(study_name=result.study_name, storage=result.storage)
    for t in study.trials:
        attrs = t.user_attrs
        assert attrs["source"] == "analytical" and attrs["mlflow_run_id"]
        assert set(attrs["flat_params"]) == set(PARAM_COLUMNS)
        if t.state == optuna.trial.TrialState.COMPLETE:
            assert attrs["config"]["model"]["name"] == "palm-62b"
            assert attrs["measurement"]["decode_step_s"] == t.values[0]
            assert attrs["prediction"] == attrs["measurement"]      # analytical: one and the same
            assert set(attrs["constraints"]) == {"decode_step_s <= 0.05"}
            assert attrs["feasible"] == (attrs["measurement"]["decode_step_s"] <= 0.05)
            assert list(t.constraints.values()) == list(attrs["constraints"].values())
        else:
            assert t.state == optuna.trial.TrialState.PRUNED
            assert attrs["reason"].startswith("infeasible: ")


def test_infeasible_points_are_pruned_with_their_reason(sweep):
    result, _ = sweep
    df = load_trials(result.study_name, result.storage)
    pruned = df[df.state == "PRUNED"]
    assert len(pruned) >= 1
    assert pruned.reason.str.contains("memory|multiple of|divisor").all(), pruned.reason.tolist()
    # the reason names what failed: e.g. the batch-sharded KV cache needs batch % chips == 0
    for _, row in pruned.iterrows():
        if "batch-sharded" in row.reason:
            assert row.batch % row.chips != 0


def test_params_and_metrics_round_trip_through_mlflow_search_runs(sweep):
    result, _ = sweep
    mlflow.set_tracking_uri(result.tracking_uri)
    runs = mlflow.search_runs(experiment_names=[result.experiment],
                              filter_string=f"tags.`mlflow.parentRunId` = '{result.parent_run_id}'")
    assert len(runs) == SPACE["trials"]
    study = optuna.load_study(study_name=result.study_name, storage=result.storage)
    by_id = {t.user_attrs["mlflow_run_id"]: t for t in study.trials}
    for _, run in runs.iterrows():
        trial = by_id[run["run_id"]]
        flat = trial.user_attrs["flat_params"]
        for name in PARAM_COLUMNS:
            assert run[f"params.{name}"] == str(flat[name])
        assert run["tags.status"] == trial.state.name
        assert run["tags.source"] == "analytical"
        assert run["tags.hardware"] == "analytical:tpu-v4"
        for tag in ("prefill_ffn", "prefill_attn", "decode_ffn", "decode_attn", "weights"):
            assert run[f"tags.{tag}"] == str(flat[tag])
        for name, value in trial.user_attrs["measurement"].items():
            assert run[f"metrics.{name}"] == pytest.approx(value, rel=1e-12)
        for name, value in trial.user_attrs["prediction"].items():
            assert run[f"metrics.pred_{name}"] == pytest.approx(value, rel=1e-12)
        if trial.state.name == "PRUNED":
            assert run["tags.reason"] == trial.user_attrs["reason"][:5000]
            assert run["status"] == "KILLED"
        else:
            assert run["status"] == "FINISHED"


def test_parent_run_has_space_file_study_and_git_revision(sweep, space_file):
    result, _ = sweep
    client = MlflowClient(result.tracking_uri)
    parent = client.get_run(result.parent_run_id)
    assert parent.data.tags["study"] == result.study_name
    assert parent.data.tags["source"] == "analytical"
    assert parent.data.tags["git_revision"]
    assert parent.data.params["space"] == "track-test"
    artifacts = [a.path for a in client.list_artifacts(result.parent_run_id)]
    assert space_file.name in artifacts
    local = client.download_artifacts(result.parent_run_id, space_file.name, str(space_file.parent / "dl"))
    assert Path(local).read_text() == space_file.read_text()
    # artifacts live under the store's folder, not in the working directory
    assert str(space_file.parent) in client.get_experiment(parent.info.experiment_id).artifact_location


def test_load_trials_and_load_runs_give_the_same_table(sweep):
    result, _ = sweep
    from_optuna = load_trials(result.study_name, result.storage)
    from_mlflow = load_runs(result.tracking_uri, parent_run_id=result.parent_run_id)
    assert list(from_optuna.columns) == list(from_mlflow.columns) == list(COLUMNS)
    assert len(from_optuna) == len(from_mlflow) == SPACE["trials"]
    a, b = from_optuna.set_index("number"), from_mlflow.set_index("number")
    for column in a.columns:
        left, right = a[column], b.loc[a.index, column]
        same = (left == right) | (left.isna() & right.isna())
        assert same.all(), column
    by_experiment = load_runs(result.tracking_uri, experiment=result.experiment)
    assert len(by_experiment) >= SPACE["trials"]


def test_metric_columns_are_measurement_names(sweep):
    result, _ = sweep
    df = load_trials(result.study_name, result.storage)
    assert set(METRIC_COLUMNS) == set(METRIC_NAMES)
    complete = df[df.state == "COMPLETE"]
    assert complete.decode_step_s.notna().all()
    assert (complete.decode_step_s == complete.pred_decode_step_s).all()


def test_pareto_rows_are_non_dominated_and_feasible(sweep):
    result, _ = sweep
    df = load_trials(result.study_name, result.storage)
    ok = df[(df.state == "COMPLETE") & (df.decode_step_s <= 0.05)]
    x, y = "decode_step_s", "decode_cost_chip_s_per_token"
    front = {r["number"] for r in result.pareto}
    assert front and front <= set(ok.number)
    for _, p in ok.iterrows():
        dominated = ((ok[x] <= p[x]) & (ok[y] <= p[y]) & ((ok[x] < p[x]) | (ok[y] < p[y]))).any()
        assert dominated != (p.number in front)


def test_resume_continues_the_study_and_its_parent_run(stores, space_file, sweep):
    result, _ = sweep
    more = run_sweep(str(space_file), storage=stores["storage"], tracking_uri=stores["tracking_uri"],
                     study_name=result.study_name, resume=True, trials=SPACE["trials"] + 3,
                     progress=False)
    assert more.study_name == result.study_name
    assert more.parent_run_id == result.parent_run_id
    assert sum(more.counts.values()) == SPACE["trials"] + 3
    runs = load_runs(stores["tracking_uri"], parent_run_id=result.parent_run_id)
    assert sorted(runs.number) == list(range(SPACE["trials"] + 3))


def test_resume_without_study_picks_the_latest_of_the_space(stores, space_file, sweep):
    result, _ = sweep
    again = run_sweep(str(space_file), storage=stores["storage"], tracking_uri=stores["tracking_uri"],
                      resume=True, trials=1, progress=False)
    assert again.study_name == result.study_name      # nothing left to do: trials already met
    assert sum(again.counts.values()) >= SPACE["trials"]


def test_study_name_clash_needs_resume(stores, space_file, sweep):
    result, _ = sweep
    with pytest.raises(ConfigError) as info:
        run_sweep(str(space_file), storage=stores["storage"], tracking_uri=stores["tracking_uri"],
                  study_name=result.study_name, progress=False)
    assert info.value.field == "--study" and "--resume" in str(info.value)


def test_analytical_and_measured_experiments_never_mix():
    assert experiment_name("x", "analytical") != experiment_name("x", "measured")
    assert experiment_name("x", "analytical").endswith("(analytical)")


def test_cli_json_output(stores, space_file, tmp_path):
    env = {**os.environ, "SWEEPER_HOME": str(tmp_path / "home")}
    proc = subprocess.run([sys.executable, "-m", "sweeper.cli", "run", str(space_file), "--trials", "3",
                           "--json"], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert set(out) >= {"study", "trials_complete", "trials_failed", "trials_pruned", "pareto",
                        "parent_run_id", "tracking_uri", "storage"}
    assert out["trials_complete"] + out["trials_failed"] + out["trials_pruned"] == 3
    assert out["storage"] == f"sqlite:///{tmp_path / 'home' / 'optuna.db'}"
    assert out["tracking_uri"] == f"sqlite:///{tmp_path / 'home' / 'mlflow.db'}"
    assert "[3/3]" in proc.stderr           # the progress line
    runs = load_runs(out["tracking_uri"], parent_run_id=out["parent_run_id"])
    assert len(runs) == 3 and (runs.source == "analytical").all()


def test_cli_table_output_names_the_stores(space_file, tmp_path):
    env = {**os.environ, "SWEEPER_HOME": str(tmp_path / "home")}
    proc = subprocess.run([sys.executable, "-m", "sweeper.cli", "run", str(space_file), "--trials", "2"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "Pareto-optimal trials" in proc.stdout
    assert f"sqlite:///{tmp_path / 'home' / 'mlflow.db'}" in proc.stdout
    assert "sweeper ui" in proc.stdout


def test_ui_command_points_at_the_default_store(tmp_path, monkeypatch):
    from sweeper.cli.run import ui_command

    monkeypatch.setenv("SWEEPER_HOME", str(tmp_path))
    from sweeper.paths import default_tracking_uri

    cmd = ui_command(default_tracking_uri(), "127.0.0.1", 5055)
    assert cmd[1:4] == ["-m", "mlflow", "ui"]
    assert cmd[cmd.index("--backend-store-uri") + 1] == f"sqlite:///{tmp_path / 'mlflow.db'}"
    assert cmd[cmd.index("--port") + 1] == "5055"
    assert (tmp_path / "mlartifacts").as_uri() in cmd


def test_ui_without_a_store_exits_2(tmp_path):
    env = {**os.environ, "SWEEPER_HOME": str(tmp_path / "empty")}
    proc = subprocess.run([sys.executable, "-m", "sweeper.cli", "ui"], capture_output=True, text=True,
                          env=env, timeout=120)
    assert proc.returncode == 2 and "no sweep has used it" in proc.stderr


def test_nan_free_metrics_only(sweep):
    result, _ = sweep
    client = MlflowClient(result.tracking_uri)
    runs = client.search_runs([client.get_run(result.parent_run_id).info.experiment_id])
    for run in runs:
        assert all(math.isfinite(v) for v in run.data.metrics.values())


def test_resume_records_trials_left_running_as_interrupted_and_runs_them_again(stores, space_file):
    first = run_sweep(str(space_file), storage=stores["storage"], tracking_uri=stores["tracking_uri"],
                      study_name="stale", trials=2, progress=False)
    study = optuna.load_study(study_name="stale", storage=first.storage)
    stale = study.ask()            # a trial the controller started and never finished (it died)
    more = run_sweep(str(space_file), storage=stores["storage"], tracking_uri=stores["tracking_uri"],
                     study_name="stale", resume=True, trials=3, progress=False)
    trials = optuna.load_study(study_name="stale", storage=first.storage).trials
    assert trials[stale.number].state == optuna.trial.TrialState.FAIL
    assert trials[stale.number].user_attrs["reason"].startswith("interrupted")
    counted = [t for t in trials if not t.user_attrs.get("interrupted")]
    assert len(counted) == 3 and all(t.state.is_finished() for t in counted)
    assert more.parent_run_id == first.parent_run_id
