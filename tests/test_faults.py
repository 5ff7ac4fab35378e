"""Faults injected for real: a worker killed with SIGKILL mid-trial, the `sweeper run`
controller killed with SIGKILL mid-sweep and resumed, the MLflow tracking server stopped
mid-sweep and started again, and two sweeps run at once on the same stores (and the study
name race of two sweeps started in the same second). The trial timeout, which kills and
replaces a worker, is tested in test_sweep.py.

Real components throughout: one local Ray instance for the module (its address is given to
the `sweeper run` subprocesses with --address), real SQLite Optuna storage, real MLflow (a
SQLite store, and a real `mlflow server` on a loopback port for the outage). The workers run
the JAX engine on one CPU device (`hardware: devices`, a tiny model); the tracking and
concurrency tests use the analytical backend, which needs no workers.

To kill a worker *in the middle* of a trial, the workers honour the test-only variable
SWEEPER_TEST_TRIAL_DELAY_S (sleep before the trial; `SECONDS` or `SECONDS:N1,N2`). Only
processes this test started are killed, by pid, and each pid is checked to descend from
this test process (worker) or to be the subprocess it started (controller, server).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import optuna
import psutil
import pytest
import yaml
from mlflow.tracking import MlflowClient

import ray  # noqa: E402 - a dependency: a broken install fails here, never skips

from sweeper.sweep.controller import Controller, choose_study, run_sweep  # noqa: E402
from sweeper.paths import open_optuna_storage  # noqa: E402
from sweeper.tracking.results import load_runs, load_trials  # noqa: E402
from sweeper.spec.space import load_space  # noqa: E402
from sweeper.tracking.sync import sync_study  # noqa: E402
from sweeper.tracking.mlflow_log import PARENT_TAG  # noqa: E402
from workloads.config import ConfigError  # noqa: E402

DELAY_ENV = "SWEEPER_TEST_TRIAL_DELAY_S"
TRIAL_FIELDS = {"model": "tiny", "hardware": "devices", "chips": 1, "batch": 2, "input_len": 8,
                "decode_steps": 2, "repeats": 1, "warmup": 0, "timeout_s": 120}
ANALYTICAL = {"model": "palm-62b", "hardware": "analytical:tpu-v4", "input_len": 128,
              "decode_steps": 16, "sampler": {"type": "grid"},
              "params": {"batch": [1, 8, 64, 512], "chips": [4, 16], "decode_ffn": ["ws1d", "ws2d"]}}


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def home(session_sweeper_home):
    """$SWEEPER_HOME of this module and its subprocesses: the session's, where this host's
    profile (which a CPU worker measures for MFU) is measured once and cached. The stores of
    each test are in its own tmp_path."""
    old = os.environ.get("SWEEPER_HOME")
    os.environ["SWEEPER_HOME"] = str(session_sweeper_home)
    yield session_sweeper_home
    if old is None:
        os.environ.pop("SWEEPER_HOME", None)
    else:
        os.environ["SWEEPER_HOME"] = old


@pytest.fixture(scope="module")
def ray_address(home):
    """One local Ray instance (head node) for the module; subprocesses join it by address."""
    started = not ray.is_initialized()
    if started:
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray.get_runtime_context().gcs_address
    if started:
        ray.shutdown()


@pytest.fixture
def stores(tmp_path):
    return {"storage": f"sqlite:///{tmp_path / 'optuna.db'}",
            "tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}"}


def write_space(directory: Path, base: dict, **fields) -> str:
    data = {k: v for k, v in {**base, **fields}.items() if v is not None}   # None: left out
    path = directory / f"{data['name']}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return str(path)


def sweeper_cli(*args: str, env: dict | None = None, **popen) -> subprocess.Popen:
    popen.setdefault("stdout", subprocess.PIPE)
    popen.setdefault("stderr", subprocess.PIPE)
    return subprocess.Popen([sys.executable, "-m", "sweeper.cli", *args], text=True,
                            env={**os.environ, **(env or {})}, **popen)


def load(study_name: str, storage: str):
    """The study, read while a sweep may still be creating the store (locked like it)."""
    return optuna.load_study(study_name=study_name, storage=open_optuna_storage(storage))


def child_runs(tracking_uri: str, parent_run_id: str) -> dict[int, list]:
    client = MlflowClient(tracking_uri)
    experiment = client.get_run(parent_run_id).info.experiment_id
    runs: dict[int, list] = {}
    for run in client.search_runs([experiment], f"tags.`{PARENT_TAG}` = '{parent_run_id}'",
                                  max_results=1000):
        runs.setdefault(int(run.data.tags["trial_number"]), []).append(run)
    return runs


def is_descendant(pid: int, ancestor: int) -> bool:
    try:
        return any(p.pid == ancestor for p in psutil.Process(pid).parents())
    except psutil.NoSuchProcess:
        return False


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def wait_until(condition, timeout: float, what: str, interval: float = 0.2):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")


class WorkerKiller(threading.Thread):
    """Watches the study; SIGKILLs the worker of trial N on each attempt listed for it."""

    def __init__(self, storage: str, study_name: str, attempts_to_kill: dict[int, int]):
        super().__init__(daemon=True)
        self.storage, self.study_name = storage, study_name
        self.plan = attempts_to_kill
        self.killed: dict[tuple[int, int], int] = {}     # (trial, attempt) -> pid
        self.stop = threading.Event()
        self.errors: list[str] = []

    def done(self) -> bool:
        return len(self.killed) == sum(self.plan.values())

    def run(self) -> None:
        storage = open_optuna_storage(self.storage)   # (locks while the sweep creates it)
        while not self.stop.is_set() and not self.done():
            try:
                study = optuna.load_study(study_name=self.study_name, storage=storage)
            except KeyError:                     # not created yet
                time.sleep(0.1)
                continue
            for t in study.get_trials(deepcopy=False,
                                      states=(optuna.trial.TrialState.RUNNING,)):
                worker = t.user_attrs.get("worker") or {}
                attempt = worker.get("attempts")
                key = (t.number, attempt)
                if (worker.get("running") and attempt and attempt <= self.plan.get(t.number, 0)
                        and key not in self.killed):
                    pid = int(worker["pid"])
                    if not is_descendant(pid, os.getpid()):   # only a worker of our own Ray
                        self.errors.append(f"pid {pid} is not a worker of this test")
                        self.stop.set()
                        return
                    os.kill(pid, signal.SIGKILL)
                    self.killed[key] = pid
            time.sleep(0.1)


# ----------------------------------------------------------------------------- worker death


def test_a_worker_killed_mid_trial_is_retried_on_a_fresh_worker_then_failed(
        ray_address, stores, tmp_path, monkeypatch):
    # Trials 0 and 1 wait 2 s before running. Trial 0's worker is killed on both attempts
    # (max_retries 1: recorded FAIL); trial 1's once, and its retry completes on a fresh
    # worker, which trial 2 then reuses.
    monkeypatch.setenv(DELAY_ENV, "2:0,1")
    space = write_space(tmp_path, TRIAL_FIELDS, name="worker-death", trials=3, parallel=1,
                        max_retries=1)
    killer = WorkerKiller(stores["storage"], "worker-death", {0: 2, 1: 1})
    killer.start()
    try:
        result = run_sweep(space, study_name="worker-death", progress=False, **stores)
    finally:
        killer.stop.set()
        killer.join()
    assert not killer.errors, killer.errors
    assert set(killer.killed) == {(0, 1), (0, 2), (1, 1)}
    assert result.counts == {"complete": 2, "failed": 1, "pruned": 0}   # the sweep completed
    trials = load("worker-death", stores["storage"]).trials
    assert [t.state.name for t in trials] == ["FAIL", "COMPLETE", "COMPLETE"]

    failed = trials[0].user_attrs
    assert failed["reason"].startswith("worker died: 2 attempts (max_retries 1); last: pid "
                                       f"{killer.killed[(0, 2)]} ")
    assert [lost["pid"] for lost in failed["worker"]["lost"]] == [killer.killed[(0, 1)],
                                                                   killer.killed[(0, 2)]]
    retried = trials[1].user_attrs
    assert retried["worker"]["attempts"] == 2
    assert [lost["pid"] for lost in retried["worker"]["lost"]] == [killer.killed[(1, 1)]]
    assert "died" in retried["worker"]["lost"][0]["reason"]
    fresh = retried["worker"]["pid"]
    assert fresh not in killer.killed.values()                        # a fresh worker ...
    assert trials[2].user_attrs["worker"]["pid"] == fresh              # ... kept for trial 2
    assert trials[2].user_attrs["worker"]["attempts"] == 1
    assert all(gone(pid) for pid in killer.killed.values())

    # MLflow: one run per trial, the state Optuna recorded; a dead attempt left no run.
    runs = child_runs(stores["tracking_uri"], result.parent_run_id)
    assert sorted(runs) == [0, 1, 2] and all(len(r) == 1 for r in runs.values())
    assert [runs[n][0].info.status for n in range(3)] == ["FAILED", "FINISHED", "FINISHED"]
    assert runs[0][0].data.tags["reason"].startswith("worker died")
    assert runs[1][0].data.tags["attempts"] == "2"
    assert runs[1][0].data.tags["worker_pid"] == str(fresh)
    assert runs[1][0].data.metrics["decode_step_s"] == trials[1].values[0]


# ----------------------------------------------------------------------------- controller death


# slow + ci_slow: ~30 s each; CI runs them in `make test-ci-slow`, which keeps `make test`
# under 10 minutes on 2 cores
@pytest.mark.slow
@pytest.mark.ci_slow
def test_a_killed_controller_resumes_without_losing_or_rerunning_trials(ray_address, tmp_path):
    storage = f"sqlite:///{tmp_path / 'optuna.db'}"
    tracking = f"sqlite:///{tmp_path / 'mlflow.db'}"
    # One slot (fewer JAX start-ups to pay for): trial 0 completes, trial 1 is in flight.
    space = write_space(tmp_path, TRIAL_FIELDS, name="crash", trials=3, parallel=1,
                        params={"batch": [2, 4, 6]}, batch=None, sampler={"type": "grid"})
    common = ["--study", "crash", "--address", ray_address, "--storage", storage,
              "--tracking-uri", tracking, "--json", "--no-analysis"]
    log = open(tmp_path / "first.log", "w")      # (a file: nobody reads a pipe while it runs)
    first = sweeper_cli("run", space, *common, env={DELAY_ENV: "3"}, stdout=log, stderr=log)
    try:
        def trials():
            if first.poll() is not None:
                raise AssertionError((tmp_path / "first.log").read_text()[-3000:])
            if not (tmp_path / "optuna.db").exists():
                return None
            try:
                return load("crash", storage).get_trials(deepcopy=False)
            except KeyError:             # the store exists, the study not yet
                return None

        def in_flight():
            complete = [t for t in trials() or [] if t.state.name == "COMPLETE"]
            running = [t for t in trials() or [] if t.state.name == "RUNNING"
                       and (t.user_attrs.get("worker") or {}).get("running")]
            return complete and running

        wait_until(trials, 120, "the sweep to start")
        # While it runs, a second controller may not take the study over.
        second = sweeper_cli("run", space, *common[:-2], "--resume")
        _, err = second.communicate(timeout=120)
        assert second.returncode == 2 and f"pid {first.pid}" in err, err
        wait_until(in_flight, 240, "trial 0 to complete and trial 1 to run")
        os.kill(first.pid, signal.SIGKILL)
    finally:
        if first.poll() is None:
            os.kill(first.pid, signal.SIGKILL)
        first.wait()
        log.close()
    assert first.returncode == -signal.SIGKILL

    before = {t.number: t for t in load("crash", storage).trials}
    running = [t for t in before.values() if t.state.name == "RUNNING"]
    interrupted = [t for t in running if "outcome" not in t.user_attrs]
    assert interrupted
    # The dead controller's workers belong to its Ray job: Ray ends them.
    # (a point asked ahead for a free slot is RUNNING without a worker yet: controller `_pick`)
    pids = [t.user_attrs["worker"]["pid"] for t in running if "worker" in t.user_attrs]
    assert pids
    wait_until(lambda: all(gone(pid) for pid in pids), 60, "the dead controller's workers to end")
    complete_before = {n: t for n, t in before.items() if t.state.name == "COMPLETE"}
    parent = load("crash", storage).user_attrs["mlflow_parent_run_id"]

    resumed = sweeper_cli("run", space, *common[:-2], "--resume", "--json", "--no-analysis")
    out, err = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, err[-3000:]
    summary = json.loads(out)
    assert summary["parent_run_id"] == parent                        # the same MLflow parent
    assert summary["trials_complete"] == 3                           # the requested number
    assert summary["trials_interrupted"] == len(interrupted)
    assert summary["trials_failed"] == len(interrupted)

    after = {t.number: t for t in load("crash", storage).trials}
    for number, t in complete_before.items():                        # not run again
        assert after[number].values == t.values
        assert after[number].user_attrs["worker"] == t.user_attrs["worker"]
    for t in interrupted:                                            # failed, then run again
        assert after[t.number].state.name == "FAIL"
        assert after[t.number].user_attrs["reason"].startswith("interrupted")
        retry = [r for r in after.values() if r.user_attrs.get("retry_of") == t.number]
        assert len(retry) == 1 and retry[0].params == t.params
        assert retry[0].state.name == "COMPLETE"
    complete = [t for t in after.values() if t.state.name == "COMPLETE"]
    assert sorted(t.params["batch"] for t in complete) == [2, 4, 6]         # the whole grid

    runs = child_runs(tracking, parent)
    assert sorted(runs) == sorted(after) and all(len(r) == 1 for r in runs.values())
    for number, t in after.items():
        expected = "FINISHED" if t.state.name == "COMPLETE" else "FAILED"
        assert runs[number][0].info.status == expected
    parent_run = MlflowClient(tracking).get_run(parent)
    assert parent_run.info.status == "FINISHED"
    assert parent_run.data.metrics["trials_complete"] == 3
    trials_table = load_trials("crash", storage)
    assert set(trials_table.mlflow_run_id) == {r[0].info.run_id for r in runs.values()}


# ----------------------------------------------------------------------------- tracking outage


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MlflowServer:
    """`mlflow server` on a loopback port, SQLite backend store in a temp dir."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.port = free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        self.backend = f"sqlite:///{folder / 'server.db'}"
        self.process: subprocess.Popen | None = None

    def start(self, timeout: float = 120) -> None:
        cmd = [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", self.backend,
               "--artifacts-destination", str(self.folder / "artifacts"), "--host", "127.0.0.1",
               "--port", str(self.port), "--workers", "1"]
        log = open(self.folder / "server.log", "a")
        # Its own session: the server and its uvicorn child are stopped together, by group.
        self.process = subprocess.Popen(cmd, stdout=log, stderr=log, start_new_session=True,
                                        env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"})
        log.close()

        def healthy():
            if self.process.poll() is not None:
                raise AssertionError((self.folder / "server.log").read_text()[-3000:])
            try:
                with urllib.request.urlopen(f"{self.uri}/health", timeout=1) as response:
                    return response.status == 200
            except OSError:
                return False

        wait_until(healthy, timeout, "the MLflow server to answer")

    def stop(self) -> None:
        """An outage: the server and its workers are killed (SIGKILL), as in a crash."""
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)     # the group this test created
            self.process.wait()


@pytest.fixture
def mlflow_server(tmp_path):
    server = MlflowServer(tmp_path)
    server.start()
    yield server
    server.stop()


# slow + ci_slow: ~30 s each; CI runs them in `make test-ci-slow`, which keeps `make test`
# under 10 minutes on 2 cores
@pytest.mark.slow
@pytest.mark.ci_slow
def test_a_tracking_outage_loses_and_duplicates_nothing(home, mlflow_server, tmp_path, capsys):
    storage = f"sqlite:///{tmp_path / 'optuna.db'}"
    space = write_space(tmp_path, ANALYTICAL, name="outage", trials=16)
    events = {2: mlflow_server.stop, 6: mlflow_server.start, 10: mlflow_server.stop}
    seen = []

    def on_trial(info):       # the sweep's own callback: outages happen between trials
        seen.append(info["number"])
        if info["number"] in events:
            events[info["number"]]()

    result = run_sweep(space, storage=storage, tracking_uri=mlflow_server.uri,
                       study_name="outage", on_trial=on_trial, progress=False)
    # Every trial is in Optuna, whatever happened to MLflow.
    assert seen == list(range(16)) and sum(result.counts.values()) == 16
    study = load("outage", storage)
    assert all(t.state.is_finished() for t in study.trials) and len(study.trials) == 16
    assert result.tracking_errors and result.mlflow_missing == 5      # trials 11..15
    assert f"sweeper sync --study outage --storage {storage}" in capsys.readouterr().err
    # The controller did not call the dead server for every trial (it backs off).
    assert len(result.tracking_errors) < 8

    # Read the server's own database while it is down: trials 3..6, missed during the first
    # outage, were backfilled automatically when it answered again (trial 7).
    direct = child_runs(mlflow_server.backend, result.parent_run_id)
    assert sorted(direct) == list(range(11)) and all(len(r) == 1 for r in direct.values())
    assert MlflowClient(mlflow_server.backend).get_run(result.parent_run_id).info.status == "RUNNING"

    # The server comes back; one run is doubled (a retried request) and one never finished.
    mlflow_server.start()
    client = MlflowClient(mlflow_server.uri)
    experiment = client.get_run(result.parent_run_id).info.experiment_id
    original = direct[0][0]
    double = client.create_run(experiment, tags=original.data.tags)
    client.set_terminated(double.info.run_id, "FINISHED")
    broken = client.create_run(experiment, tags={PARENT_TAG: result.parent_run_id,
                                                 "trial_number": "1", "status": "COMPLETE"})

    sync = sweeper_cli("sync", "--study", "outage", "--storage", storage, "--json")
    out, err = sync.communicate(timeout=300)
    assert sync.returncode == 0, err[-3000:]
    report = json.loads(out)
    assert report["created"] == [11, 12, 13, 14, 15]
    assert sorted(report["removed"]) == sorted([double.info.run_id, broken.info.run_id])
    assert report["parent_run_id"] == result.parent_run_id and report["parent_status"] == "FINISHED"

    runs = child_runs(mlflow_server.uri, result.parent_run_id)
    assert sorted(runs) == list(range(16)) and all(len(r) == 1 for r in runs.values())
    assert runs[0][0].info.run_id == original.info.run_id
    for t in study.trials:
        run = runs[t.number][0]
        assert run.data.tags["status"] == t.state.name
        for name, value in t.user_attrs["measurement"].items():
            assert run.data.metrics[name] == pytest.approx(value, rel=1e-12)
    parent = client.get_run(result.parent_run_id)
    assert parent.info.status == "FINISHED"
    assert parent.data.metrics["trials_complete"] == result.counts["complete"]
    # Optuna and MLflow now give the same table, run ids included.
    a = load_trials("outage", storage).set_index("number")
    b = load_runs(mlflow_server.uri, parent_run_id=result.parent_run_id).set_index("number")
    assert (a.mlflow_run_id == b.loc[a.index, "mlflow_run_id"]).all()
    assert (a.state == b.loc[a.index, "state"]).all()

    again = sync_study("outage", storage)                               # idempotent
    assert again.created == [] and again.removed == [] and again.present == 16


# ----------------------------------------------------------------------------- two sweeps at once


def test_two_sweeps_at_once_on_the_same_stores_do_not_interfere(home, tmp_path):
    # Same space, same fresh stores, started together: two studies, two parent runs.
    storage = f"sqlite:///{tmp_path / 'stores' / 'optuna.db'}"
    tracking = f"sqlite:///{tmp_path / 'stores' / 'mlflow.db'}"
    space = write_space(tmp_path, ANALYTICAL, name="twice", trials=12)
    env = {DELAY_ENV: "0.3"}   # each sweep takes 4 s at least
    procs = [sweeper_cli("run", space, "--storage", storage, "--tracking-uri", tracking, "--json",
                         "--no-analysis", env=env) for _ in range(2)]
    outputs = [p.communicate(timeout=300) for p in procs]
    for proc, (_, err) in zip(procs, outputs):
        assert proc.returncode == 0, err[-3000:]
    results = [json.loads(out) for out, _ in outputs]
    names = {r["study"] for r in results}
    parents = {r["parent_run_id"] for r in results}
    assert len(names) == 2 and len(parents) == 2
    spans = []
    for r in results:
        study = load(r["study"], storage)
        counts = {s: sum(t.state.name == s for t in study.trials) for s in ("COMPLETE", "PRUNED")}
        assert len(study.trials) == 12
        assert (r["trials_complete"], r["trials_pruned"]) == (counts["COMPLETE"], counts["PRUNED"])
        assert study.user_attrs["mlflow_parent_run_id"] == r["parent_run_id"]
        runs = child_runs(tracking, r["parent_run_id"])
        assert sorted(runs) == list(range(12)) and all(len(v) == 1 for v in runs.values())
        assert {v[0].info.run_id for v in runs.values()} == \
            {t.user_attrs["mlflow_run_id"] for t in study.trials}
        parent = MlflowClient(tracking).get_run(r["parent_run_id"])
        assert parent.data.tags["study"] == r["study"] and parent.info.status == "FINISHED"
        assert parent.data.metrics["trials_complete"] == r["trials_complete"]
        spans.append((min(t.datetime_start for t in study.trials),
                      max(t.datetime_complete for t in study.trials)))
    (a0, a1), (b0, b1) = spans
    assert a0 < b1 and b0 < a1, spans                    # they really ran at the same time


def test_a_generated_study_name_taken_meanwhile_by_another_sweep_moves_on(home, stores, tmp_path):
    # The race two sweeps of one space started in the same second run: both choose
    # `<space>-<time>`; the one that creates it second takes `<space>-<time>-2`.
    space = load_space(write_space(tmp_path, ANALYTICAL, name="race", trials=2))
    name, exists = choose_study(space, stores["storage"], None, False)
    optuna.create_study(study_name=name, storage=open_optuna_storage(stores["storage"]))
    result = Controller(space, study_name=name, resume=exists, trials=2, parallel=1,
                        address=None, progress=False, generated_name=True, **stores).run()
    assert result.study_name == f"{name}-2" and sum(result.counts.values()) == 2
    assert load(name, stores["storage"]).trials == []            # the other sweep's, untouched
    with pytest.raises(ConfigError) as info:                      # a name the user chose: refused
        Controller(space, study_name=f"{name}-2", resume=False, trials=1, parallel=1,
                   address=None, progress=False, **stores).run()
    assert info.value.field == "--study"


def test_a_trial_recorded_but_not_told_when_the_controller_died_is_kept(home, stores, tmp_path):
    # The window between storing a trial's result (user attrs, `outcome` last) and telling
    # Optuna its state is too short to hit with a real kill; leave a trial in it by hand.
    space = write_space(tmp_path, ANALYTICAL, name="window", trials=3)
    first = run_sweep(space, study_name="window", trials=2, progress=False, **stores)
    study = load("window", stores["storage"])
    done = [t for t in study.trials if t.state.name == "COMPLETE"][0]
    trial = study.ask()                               # what the dead controller had asked ...
    for key in ("flat_params", "measurement", "prediction", "source", "hardware", "config"):
        trial.set_user_attr(key, done.user_attrs[key])
    trial.set_user_attr("outcome", "COMPLETE")        # ... and fully recorded
    more = run_sweep(space, study_name="window", resume=True, trials=4, progress=False, **stores)
    kept = load("window", stores["storage"]).trials[trial.number]
    assert kept.state.name == "COMPLETE" and kept.values == done.values
    assert not kept.user_attrs.get("interrupted") and more.interrupted == 0
    assert sum(more.counts.values()) == 4             # counted, not run again
    runs = child_runs(stores["tracking_uri"], first.parent_run_id)
    assert sorted(runs) == [0, 1, 2, 3] and runs[trial.number][0].info.status == "FINISHED"
