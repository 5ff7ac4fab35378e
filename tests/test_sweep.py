"""Sweeps on the emulated mesh: a real local Ray instance, real Ray actors running the JAX
engine, a real SQLite Optuna study and a real SQLite MLflow store in a temp dir.

One Ray session serves the whole module (starting Ray takes seconds); models are tiny and
trial counts small. Timings are never asserted, only where and when trials ran.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import optuna
import psutil
import pytest
import yaml

import ray  # noqa: E402 - a dependency: a broken install fails here, never skips
from requires import require  # noqa: E402

from sweeper.sweep.controller import run_sweep  # noqa: E402
from sweeper.tracking.results import load_runs, load_trials  # noqa: E402
from sweeper.spec.space import load_space  # noqa: E402
from workloads.config import ConfigError  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "search_spaces" / "quickstart.yaml"
CORES = sorted(os.sched_getaffinity(0))


@pytest.fixture(scope="module")
def home(session_sweeper_home, tmp_path_factory):
    """Stores of this module; SWEEPER_HOME is the session's (host profile measured once)."""
    path = tmp_path_factory.mktemp("sweep_stores")
    old = os.environ.get("SWEEPER_HOME")
    os.environ["SWEEPER_HOME"] = str(session_sweeper_home)
    yield path
    if old is None:
        os.environ.pop("SWEEPER_HOME", None)
    else:
        os.environ["SWEEPER_HOME"] = old


@pytest.fixture(scope="module")
def ray_session(home):
    started = not ray.is_initialized()
    if started:
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    if started:
        ray.shutdown()


@pytest.fixture(scope="module")
def stores(home, ray_session):
    return {"storage": f"sqlite:///{home / 'optuna.db'}", "tracking_uri": f"sqlite:///{home / 'mlflow.db'}"}


def process_gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def write_space(directory: Path, **fields) -> str:
    data = {"name": "t", "model": "tiny", "hardware": "host", "input_len": 8, "decode_steps": 2,
            "repeats": 2, "warmup": 1, "chips": 2, "batch": 4, "parallel": 1, "timeout_s": 300,
            "memory_budget_bytes": "1GiB"}
    data.update(fields)
    path = directory / f"{data['name']}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return str(path)


@pytest.fixture(scope="module")
def quickstart(stores):
    """The shipped quickstart, end to end, with a reduced trial count."""
    return run_sweep(str(QUICKSTART), trials=4, progress=False, **stores)


def test_quickstart_runs_end_to_end(quickstart):
    result = quickstart
    assert sum(result.counts.values()) == 4
    assert result.counts["complete"] >= 1, load_trials(result.study_name, result.storage).reason.tolist()
    assert result.source == "measured" and result.experiment == "sweeper/quickstart"
    assert result.pareto and all(r["mlflow_run_id"] for r in result.pareto)
    df = load_trials(result.study_name, result.storage)
    complete = df[df.state == "COMPLETE"]
    # measured timings of this host, with the cost model's prediction beside each
    assert (complete.source == "measured").all() and (complete.hardware == "host").all()
    assert complete.decode_step_s.gt(0).all() and complete.pred_decode_step_s.gt(0).all()
    assert complete.compile_s.notna().all() and complete.peak_bytes_per_chip.gt(0).all()
    runs = load_runs(result.tracking_uri, parent_run_id=result.parent_run_id)
    assert sorted(runs.number) == sorted(df.number)
    assert (runs.source == "measured").all()


def test_measured_params_and_metrics_round_trip_through_mlflow(quickstart):
    import mlflow

    result = quickstart
    mlflow.set_tracking_uri(result.tracking_uri)
    runs = mlflow.search_runs(experiment_names=[result.experiment],
                              filter_string=f"tags.`mlflow.parentRunId` = '{result.parent_run_id}'")
    study = optuna.load_study(study_name=result.study_name, storage=result.storage)
    by_id = {t.user_attrs["mlflow_run_id"]: t for t in study.trials}
    assert len(runs) == len(study.trials) == 4
    for _, run in runs.iterrows():
        trial = by_id[run["run_id"]]
        assert run["params.chips"] == str(trial.user_attrs["flat_params"]["chips"])
        assert run["tags.status"] == trial.state.name
        for name, value in trial.user_attrs["measurement"].items():
            assert run[f"metrics.{name}"] == pytest.approx(value, rel=1e-12)
        for name, value in trial.user_attrs["prediction"].items():
            assert run[f"metrics.pred_{name}"] == pytest.approx(value, rel=1e-12)
        if trial.state.name == "COMPLETE":
            assert trial.user_attrs["prediction"]          # always predicted, also when measured


def test_two_workers_run_at_once_on_disjoint_cores_and_reuse_compiled_shapes(stores, tmp_path):
    require(len(CORES) >= 2, "needs two CPU cores")
    # One fixed shape, four trials, two slots: each worker compiles it once, then hits its cache.
    space = write_space(tmp_path, name="cores", parallel=2, trials=4)
    result = run_sweep(space, progress=False, **stores)
    study = optuna.load_study(study_name=result.study_name, storage=result.storage)
    trials = study.trials
    assert [t.state.name for t in trials] == ["COMPLETE"] * 4, [t.user_attrs.get("reason") for t in trials]
    workers = [t.user_attrs["worker"] for t in trials]
    by_slot: dict[int, list[dict]] = {}
    for w in workers:
        by_slot.setdefault(w["slot"], []).append(w)
    assert set(by_slot) == {0, 1}
    cores = {slot: set(ws[0]["cores"]) for slot, ws in by_slot.items()}
    assert all(len({tuple(w["cores"]) for w in ws}) == 1 for ws in by_slot.values())
    assert cores[0] and cores[1] and not cores[0] & cores[1]             # disjoint cores
    overlapping = any(a["started"] < b["finished"] and b["started"] < a["finished"]
                      for a in by_slot[0] for b in by_slot[1])
    assert overlapping, workers                                           # at the same time
    for ws in by_slot.values():
        ws.sort(key=lambda w: w["started"])
        assert len({w["pid"] for w in ws}) == 1                           # one actor per slot
        assert ws[0]["cache_hit"] is False and ws[0]["new_cache_entries"] == 1
        for later in ws[1:]:
            assert later["cache_hit"] is True and later["new_cache_entries"] == 0
    # a cache hit compiled nothing: compile time 0 after the first trial of each worker
    for ws in by_slot.values():
        pids = {w["pid"] for w in ws}
        compiles = [t.user_attrs["measurement"]["compile_s"] for t in
                    sorted(trials, key=lambda t: t.user_attrs["worker"]["started"])
                    if t.user_attrs["worker"]["pid"] in pids]
        assert compiles[0] > 0 and all(c == 0 for c in compiles[1:]), compiles


def test_infeasible_configs_are_pruned_with_their_reason_before_any_worker(stores, tmp_path):
    space = write_space(tmp_path, name="infeasible", chips=4, batch=2, trials=2,
                        memory_budget_bytes="1KiB", params={"decode_attn": ["head", "batch"]},
                        sampler={"type": "grid"})
    result = run_sweep(space, progress=False, **stores)
    assert result.counts == {"complete": 0, "failed": 0, "pruned": 2}
    df = load_trials(result.study_name, result.storage).set_index("decode_attn")
    assert "multiple of chips=4" in df.loc["batch", "reason"]     # batch-sharded KV cache
    assert "memory" in df.loc["head", "reason"] and "budget" in df.loc["head", "reason"]
    study = optuna.load_study(study_name=result.study_name, storage=result.storage)
    assert all("worker" not in t.user_attrs for t in study.trials)      # never dispatched
    runs = load_runs(result.tracking_uri, parent_run_id=result.parent_run_id)
    assert (runs.state == "PRUNED").all() and runs.reason.str.startswith("infeasible: ").all()


def test_a_trial_past_its_timeout_fails_its_worker_is_replaced_and_the_sweep_goes_on(
        stores, tmp_path, monkeypatch):
    # Each trial waits 60 s first (test-only variable): both run past timeout_s. The first
    # one's worker is killed; the second trial starts on a new worker, and is killed too.
    monkeypatch.setenv("SWEEPER_TEST_TRIAL_DELAY_S", "60")
    space = write_space(tmp_path, name="timeout", timeout_s=5, trials=2)
    result = run_sweep(space, progress=False, **stores)
    assert result.counts == {"complete": 0, "failed": 2, "pruned": 0}
    df = load_trials(result.study_name, result.storage)
    assert df.reason.str.startswith("timeout").all()
    study = optuna.load_study(study_name=result.study_name, storage=result.storage)
    workers = [t.user_attrs["worker"] for t in study.trials]
    assert all(w["killed"] == "timeout" and w["attempts"] == 1 for w in workers)
    first, second = workers
    assert first["slot"] == second["slot"] and first["pid"] != second["pid"]   # replaced
    deadline = time.monotonic() + 30                                   # and really stopped
    while not all(process_gone(w["pid"]) for w in workers) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert all(process_gone(w["pid"]) for w in workers)
    runs = load_runs(result.tracking_uri, parent_run_id=result.parent_run_id)
    assert (runs.state == "FAIL").all() and len(runs) == 2


def test_analytical_backend_shares_the_controller_but_not_the_experiment(quickstart, stores, tmp_path):
    data = yaml.safe_load(QUICKSTART.read_text())
    data["hardware"] = "analytical:tpu-v4"
    path = tmp_path / "quickstart.yaml"
    path.write_text(yaml.safe_dump(data))
    analytical = run_sweep(str(path), trials=3, progress=False, **stores)
    assert analytical.experiment == "sweeper/quickstart (analytical)" != quickstart.experiment
    measured_runs = load_runs(stores["tracking_uri"], experiment=quickstart.experiment)
    analytical_runs = load_runs(stores["tracking_uri"], experiment=analytical.experiment)
    assert (measured_runs.source == "measured").all() and len(measured_runs) >= 4
    assert (analytical_runs.source == "analytical").all() and len(analytical_runs) == 3
    assert not set(measured_runs.mlflow_run_id) & set(analytical_runs.mlflow_run_id)
    # a measured study cannot be resumed with the cost model
    with pytest.raises(ConfigError) as info:
        run_sweep(str(path), study_name=quickstart.study_name, resume=True, progress=False, **stores)
    assert info.value.field == "hardware"


def test_parallel_override_and_space_validation_happen_first(stores, tmp_path):
    with pytest.raises(ConfigError) as info:
        run_sweep(str(QUICKSTART), parallel=0, progress=False, **stores)
    assert info.value.field == "--parallel"
    assert load_space(str(QUICKSTART)).parallel == 2


def test_devices_backend_asks_ray_for_the_space_resources(stores, tmp_path):
    # `devices` on this CPU-only machine: the worker asks Ray for one CPU, gets no device
    # count flag and no pinning, and runs on the single CPU device JAX gives it.
    space = write_space(tmp_path, name="devices", hardware="devices", chips=1, trials=2,
                        resources={"CPU": 1}, memory_budget_bytes=None)
    result = run_sweep(space, progress=False, **stores)
    assert result.counts["complete"] == 2, load_trials(result.study_name, result.storage).reason.tolist()
    study = optuna.load_study(study_name=result.study_name, storage=result.storage)
    workers = [t.user_attrs["worker"] for t in study.trials]
    assert len({w["pid"] for w in workers}) == 1 and workers[1]["cache_hit"] is True
    assert all(t.user_attrs["hardware"] == "devices" for t in study.trials)
    assert all(t.user_attrs["prediction"] == {} for t in study.trials)   # no profile named


def _store_thread(address, tracking_uri: str) -> None:
    """Run the controller's start-up thread for these arguments and wait for it."""
    import threading
    from types import SimpleNamespace

    from sweeper.sweep.controller import Controller

    Controller._warm_store_imports(SimpleNamespace(address=address, tracking_uri=tracking_uri))
    for thread in threading.enumerate():
        if thread.name == "sweeper-store-imports":
            thread.join(timeout=120)


def test_the_store_thread_builds_a_local_sweeps_mlflow_store_and_nothing_with_an_address(
        tmp_path, monkeypatch):
    """While Ray starts, a local sweep's MLflow store is created (docs/performance.md,
    "Start-up, the controller's part"); with --address nothing is, so a bad address
    leaves no store behind."""
    import sqlite3

    monkeypatch.delenv("RAY_ADDRESS", raising=False)   # no --address and none inherited: local
    joined = tmp_path / "joined" / "mlflow.db"
    joined.parent.mkdir()
    _store_thread("127.0.0.1:9", f"sqlite:///{joined}")
    assert not joined.exists()

    local = tmp_path / "local" / "mlflow.db"
    local.parent.mkdir()
    _store_thread(None, f"sqlite:///{local}")
    with sqlite3.connect(local) as db:
        tables = {row[0] for row in db.execute("select name from sqlite_master where type='table'")}
    assert {"experiments", "runs", "alembic_version"} <= tables
