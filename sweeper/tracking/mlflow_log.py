"""MLflow tracking of a sweep: one parent run per sweep, one nested child run per trial.

Parent run   params: the space's name, model, hardware, sampler, trials, parallel, objectives
             tags:   study name, Optuna storage, source, sweeper_version (the installed
                     inference-sweeper's version, always) and git_revision (the checkout's
                     commit; 'unknown' for an installed wheel, which has no .git)
             artifact: the space file as written
Child run    params: every `TrialConfig.flat_params()` field (same names in every run)
             metrics: every Measurement metric by its own name, and the cost model's
                      prediction of each as `pred_<name>`
             tags:   prefill_ffn, prefill_attn, decode_ffn, decode_attn, weights, hardware,
                     source (measured | analytical), status (COMPLETE | PRUNED | FAIL), reason,
                     trial_number, mlflow.parentRunId; a serving trial's prediction_note
             artifact: a serving trial's serving.json (its Measurement.extra["serving"])

Measured and analytical sweeps log to different experiments (`sweeper/<space>` and
`sweeper/<space> (analytical)`), so the two are never mixed in one table or plot.
Everything goes through `MlflowClient` with explicit run ids: no global active run, so
the controller can log from any thread. Default store: SQLite under $SWEEPER_HOME.

A child run is written when its trial has finished (any state), from the trial's Optuna
user attrs (`trial_run_fields`), so a run logged live and one backfilled later by
`sweeper.tracking.sync` are the same. Optuna is the record; MLflow is kept in step with it.

Tracking servers (`http(s)://`): MLflow's HTTP client retries a failed request 7 times
with exponential backoff and waits up to 120 s for an answer, so one request to a server
that is down could stall a sweep for minutes. `Tracker` lowers these (only where the
environment does not set them): MLFLOW_HTTP_REQUEST_MAX_RETRIES=1,
MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR=1, MLFLOW_HTTP_REQUEST_BACKOFF_JITTER=0.5,
MLFLOW_HTTP_REQUEST_TIMEOUT=10: an outage costs seconds, and the trials it misses are
backfilled when the server answers again. MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT=true
keeps MLflow from printing each run's URL on stdout (`--json` output stays JSON).
"""

from __future__ import annotations

import json
import logging
import math
import os
import subprocess
import time
from pathlib import Path
from typing import Any, Mapping

from sweeper import installed_version
from sweeper.paths import (artifact_root, default_tracking_uri, precreate_sqlite_wal,
                           store_creation_lock, tune_sqlite)
from workloads.trial import TrialConfig

PARENT_TAG = "mlflow.parentRunId"
KIND_TAG = "sweeper.kind"
SWEEP_KIND, TRIAL_KIND = "sweep", "trial"
PRED_PREFIX = "pred_"
LAYOUT_TAGS = TrialConfig.LAYOUT_PARAMS     # searchable in the MLflow UI as tags too
# Optuna state -> MLflow run status (a pruned trial never ran: KILLED).
RUN_STATUS = {"COMPLETE": "FINISHED", "FAIL": "FAILED", "PRUNED": "KILLED"}
PROJECT_ROOT = Path(__file__).resolve().parents[2]
# MLflow 3's UI opens an experiment in its GenAI (traces) view unless told it holds model
# runs; ours are runs to compare in the table and charts.
EXPERIMENT_TAGS = {"mlflow.experimentKind": "custom_model_development"}
# See the module docstring: an unreachable server must cost seconds, not minutes.
# (and no "View run ... at: URL" line on stdout per finished run, which would break
# `sweeper run --json` and costs one more request each)
HTTP_CLIENT_DEFAULTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1",
                        "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
                        "MLFLOW_HTTP_REQUEST_BACKOFF_JITTER": "0.5",
                        "MLFLOW_HTTP_REQUEST_TIMEOUT": "10",
                        "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT": "true"}
# Worker placement recorded on each child run (user attr `worker` key -> tag).
WORKER_TAGS = {"node_id": "node_id", "node_ip": "node_ip", "pid": "worker_pid",
               "attempts": "attempts"}


def configure_http_client(tracking_uri: str) -> None:
    """Short MLflow HTTP retries and timeout for a tracking server (user settings win)."""
    if tracking_uri.startswith(("http://", "https://")):
        for name, value in HTTP_CLIENT_DEFAULTS.items():
            os.environ.setdefault(name, value)


def experiment_name(space_name: str, source: str) -> str:
    """Measured and analytical runs of the same space live in separate experiments."""
    return f"sweeper/{space_name}" + (" (analytical)" if source == "analytical" else "")


def git_revision(root: Path = PROJECT_ROOT) -> str:
    """The project's commit (with '+dirty' for uncommitted changes), or 'unknown'.

    Only a checkout of this project counts (its pyproject.toml and .git beside the code): an
    installed copy lives in site-packages, which may itself sit inside some other repository
    whose commit says nothing about this code.
    """
    if not ((root / "pyproject.toml").is_file() and (root / ".git").exists()):
        return "unknown"
    try:
        rev = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True,
                             text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain",
                                "--untracked-files=no"], capture_output=True, text=True,
                               timeout=10).stdout.strip()
        return rev + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _quiet_store_logs() -> None:
    # Creating a SQLite store runs Alembic migrations that log a dozen INFO lines.
    for name in ("alembic", "mlflow.tracking._tracking_service.utils"):
        logging.getLogger(name).setLevel(logging.WARNING)
    # MLflow's SQL store logs every failed write with its full traceback (~45 lines; a
    # read-only mlflow.db printed hundreds per sweep) and then raises it as an
    # MlflowException anyway: the caller reports that in one line (`TrackingLink`, `sync`).
    logging.getLogger("mlflow.store.db.utils").setLevel(logging.CRITICAL)


def store_error(err: BaseException) -> str:
    """A store failure as one short line: the innermost cause (`OperationalError: attempt to
    write a readonly database`), without SQLAlchemy's autoflush and SQL text around it."""
    root = err
    while root.__cause__ is not None and root.__cause__ is not root:
        root = root.__cause__
    text = " ".join(str(root).split())
    return f"{type(root).__name__}: {text}"[:300]


def _finite(metrics: Mapping[str, float] | None) -> dict[str, float]:
    return {k: float(v) for k, v in (metrics or {}).items()
            if isinstance(v, (int, float)) and math.isfinite(v)}


class Tracker:
    """One MLflow store; creates the sweep's parent run and its trials' child runs."""

    def __init__(self, tracking_uri: str | None = None):
        from mlflow.tracking import MlflowClient   # lazy: MLflow (~1 s) only when a store is read

        _quiet_store_logs()
        self.tracking_uri = tracking_uri or default_tracking_uri()
        configure_http_client(self.tracking_uri)
        with store_creation_lock(self.tracking_uri):    # another sweep may be creating it
            precreate_sqlite_wal(self.tracking_uri)
            self.client = MlflowClient(tracking_uri=self.tracking_uri)
            store = getattr(getattr(self.client, "_tracking_client", None), "store", None)
        tune_sqlite(getattr(store, "engine", None))   # see paths.tune_sqlite

    # ------------------------------------------------------------------ experiments
    def experiment_id(self, name: str) -> str:
        exp = self.client.get_experiment_by_name(name)
        if exp is not None:
            if exp.lifecycle_stage == "deleted":
                self.client.restore_experiment(exp.experiment_id)
            return exp.experiment_id
        root = artifact_root(self.tracking_uri)
        location = f"{root}/{name.replace('/', '_').replace(' ', '_')}" if root else None
        try:
            return self.client.create_experiment(name, artifact_location=location,
                                                 tags=EXPERIMENT_TAGS)
        except Exception:  # another process created it first
            exp = self.client.get_experiment_by_name(name)
            if exp is None:
                raise
            return exp.experiment_id

    # ------------------------------------------------------------------ the sweep
    def start_sweep(self, space, study_name: str, storage: str) -> str:
        """Create the parent run of a sweep; returns its run id."""
        from mlflow.entities import Param, RunTag   # lazy: MLflow (~1 s)

        source = space.hardware.source
        exp_id = self.experiment_id(experiment_name(space.name, source))
        run = self.client.create_run(exp_id, run_name=study_name, tags={
            KIND_TAG: SWEEP_KIND, "study": study_name, "storage": _redact(storage),
            "git_revision": git_revision(), "sweeper_version": installed_version(),
            "source": source, "hardware": space.hardware.label,
            "space_file": space.source or "", "mlflow.note.content": space.description})
        summary = space.summary()
        params = {"space": space.name, "model": space.model.name, "hardware": space.hardware.label,
                  "sampler": space.sampler.type, "sampler_seed": space.sampler.seed,
                  "trials": summary["trials"], "parallel": space.parallel,
                  "timeout_s": space.timeout_s, "objectives": ", ".join(summary["objectives"]),
                  "constraints": "; ".join(summary["constraints"]) or "none",
                  "memory_budget_bytes": space.memory_budget_bytes,
                  "searched": ", ".join(summary["params"])}
        self.client.log_batch(run.info.run_id, params=[Param(k, str(v)) for k, v in params.items()],
                              tags=[RunTag("mlflow.runName", study_name)])
        if space.text is not None:
            name = Path(space.source).name if space.source else f"{space.name}.yaml"
            self.client.log_text(run.info.run_id, space.text, name)
        return run.info.run_id

    def start_sweep_from_study(self, study_name: str, attrs: Mapping[str, Any], storage: str) -> str:
        """A parent run for a study whose space file is gone (`sweeper sync`): from its attrs."""
        source = str(attrs.get("source") or "measured")
        exp_id = self.experiment_id(experiment_name(str(attrs.get("space") or study_name), source))
        run = self.client.create_run(exp_id, run_name=study_name, tags={
            KIND_TAG: SWEEP_KIND, "study": study_name, "storage": _redact(storage),
            "git_revision": git_revision(), "sweeper_version": installed_version(),
            "source": source, "hardware": str(attrs.get("hardware")),
            "space_file": str(attrs.get("space_file") or ""),
            "mlflow.runName": study_name})
        return run.info.run_id

    def parent_state(self, run_id: str) -> str:
        """'active', 'deleted' or 'missing' (a run id this store does not know)."""
        try:
            run = self.client.get_run(run_id)
        except Exception as err:  # noqa: BLE001
            if getattr(err, "error_code", "") == "RESOURCE_DOES_NOT_EXIST":
                return "missing"
            raise                  # the store is unreachable: not the same as missing
        return "deleted" if run.info.lifecycle_stage == "deleted" else "active"

    def resume_sweep(self, run_id: str) -> None:
        self.client.update_run(run_id, status="RUNNING")

    def finish_sweep(self, run_id: str, counts: Mapping[str, int], status: str = "FINISHED") -> None:
        from mlflow.entities import Metric   # lazy: MLflow (~1 s)

        now = int(time.time() * 1000)
        self.client.log_batch(run_id, metrics=[Metric(f"trials_{k}", float(v), now, 0)
                                               for k, v in counts.items()])
        self.client.set_terminated(run_id, status=status)

    def experiment_of(self, run_id: str) -> str:
        return self.client.get_run(run_id).info.experiment_id

    def child_runs(self, parent_run_id: str, experiment_id: str) -> dict[int, list]:
        """The active child runs of a sweep, by trial number (a trial may have several)."""
        from mlflow.entities import ViewType   # lazy: MLflow (~1 s)

        query = f"tags.`{PARENT_TAG}` = '{parent_run_id}'"
        runs: dict[int, list] = {}
        token = None
        while True:
            page = self.client.search_runs([experiment_id], filter_string=query,
                                           run_view_type=ViewType.ACTIVE_ONLY, max_results=1000,
                                           page_token=token)
            for run in page:
                number = run.data.tags.get("trial_number", "")
                if number.isdigit():
                    runs.setdefault(int(number), []).append(run)
            token = page.token
            if not token:
                return runs

    def delete_run(self, run_id: str) -> None:
        self.client.delete_run(run_id)

    # ------------------------------------------------------------------ trials
    def log_trial(self, parent_run_id: str, experiment_id: str, *, number: int,
                  params: Mapping[str, Any], metrics: Mapping[str, float] | None,
                  prediction: Mapping[str, float] | None, state: str, reason: str | None,
                  source: str, hardware: str, extra_tags: Mapping[str, str] | None = None,
                  artifacts: Mapping[str, Any] | None = None) -> str:
        """One child run for a finished trial (any state); returns its run id. `artifacts`:
        file name -> a JSON-able value, stored as that file of the run."""
        from mlflow.entities import Metric, Param   # lazy: MLflow (~1 s)

        tags = {PARENT_TAG: parent_run_id, KIND_TAG: TRIAL_KIND, "trial_number": str(number),
                "source": source, "hardware": hardware, "status": state}
        tags.update({k: str(params.get(k)) for k in LAYOUT_TAGS})
        if reason:
            tags["reason"] = reason[:5000]
        tags.update(extra_tags or {})
        run = self.client.create_run(experiment_id, tags=tags, run_name=_run_name(number, params))
        now = int(time.time() * 1000)
        logged = [Metric(k, v, now, 0) for k, v in _finite(metrics).items()]
        logged += [Metric(PRED_PREFIX + k, v, now, 0) for k, v in _finite(prediction).items()]
        self.client.log_batch(run.info.run_id, metrics=logged,
                              params=[Param(k, str(v)) for k, v in params.items()])
        for name, value in (artifacts or {}).items():
            self.client.log_text(run.info.run_id, json.dumps(value, default=_json_default),
                                 name)
        self.client.set_terminated(run.info.run_id, status=RUN_STATUS.get(state, "FAILED"))
        return run.info.run_id


def trial_run_fields(number: int, state: str, attrs: Mapping[str, Any]) -> dict[str, Any]:
    """`Tracker.log_trial` arguments of a finished trial, from its Optuna user attrs."""
    extra: dict[str, str] = {}
    if attrs.get("device") is not None:
        extra["device"] = str(attrs["device"])
    if state == "COMPLETE":
        extra["feasible"] = str(attrs.get("feasible", True)).lower()
    worker = attrs.get("worker") or {}
    for key, tag in WORKER_TAGS.items():
        if worker.get(key) is not None:
            extra[tag] = str(worker[key])
    if attrs.get("hardware_share") is not None:
        extra["hardware_share"] = repr(float(attrs["hardware_share"]))
    if attrs.get("retry_of") is not None:
        extra["retry_of"] = str(attrs["retry_of"])
    if attrs.get("prediction_note") is not None:
        extra["prediction_note"] = str(attrs["prediction_note"])[:5000]
    return {"number": number, "params": attrs.get("flat_params") or {},
            "metrics": attrs.get("measurement") or None, "prediction": attrs.get("prediction") or {},
            "state": state, "reason": attrs.get("reason"), "source": attrs.get("source"),
            "hardware": attrs.get("hardware"), "extra_tags": extra}


def run_matches(run, state: str) -> bool:
    """A finished trial's run is complete and says the trial's state."""
    return (run.info.status == RUN_STATUS.get(state, "FAILED")
            and run.data.tags.get("status") == state)


def _run_name(number: int, params: Mapping[str, Any]) -> str:
    return (f"{number:04d} B{params.get('batch')} {params.get('chips')}c "
            f"{params.get('prefill_ffn')}/{params.get('prefill_attn')} > "
            f"{params.get('decode_ffn')}/{params.get('decode_attn')} {params.get('weights')}")


def _json_default(value: Any) -> Any:
    """NumPy scalars and arrays in an artifact as numbers and lists; anything else as text."""
    for convert in ("tolist", "item"):
        if hasattr(value, convert):
            return getattr(value, convert)()
    return str(value)


def _redact(url: str) -> str:
    """A storage URL without its password (postgresql://user:secret@host/db)."""
    if "://" in url and "@" in url.split("://", 1)[1]:
        scheme, rest = url.split("://", 1)
        creds, host = rest.split("@", 1)
        return f"{scheme}://{creds.split(':', 1)[0]}:***@{host}"
    return url
