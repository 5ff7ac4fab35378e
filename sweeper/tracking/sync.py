"""Keep a sweep's MLflow runs in step with its Optuna study: one child run per finished trial.

Optuna storage is the record of a sweep: a trial is stored there before anything is sent to
MLflow, and a sweep goes on while its tracking server is down. `reconcile` then makes the
MLflow side match, trial by trial:

  no run for a finished trial                  -> log it now (backfill) from the trial's attrs
  a run that is incomplete (never terminated)  -> delete it and log the trial again
    or says another state
  several runs for one trial (a retried        -> keep one (the id the trial recorded, else
    request, a controller killed between           the oldest), delete the others
    logging and storing the run id)

so no trial is lost and none is counted twice. Deleting is MLflow's soft delete (the run
moves to the experiment's trash). The run id of a backfilled trial is kept in the study's
user attrs (`mlflow_run_id:<number>`; a finished Optuna trial cannot be updated), and
`sweeper.tracking.study.mlflow_run_ids` merges both places.

It runs inside `sweeper run` (when the tracking server answers again after an outage, and at
the end of a resumed sweep or one that had tracking errors) and as

    sweeper sync --study NAME [--storage URL] [--tracking-uri URI] [--json]

which also creates the parent run if the store has none (e.g. the server was down when the
sweep started, or `--tracking-uri` names a new store) and records the sweep's final counts
on it. `sweeper sync` refuses a study that a live controller is running (see sweeper.spec.lease).

It repairs in both directions (issue 23):
  the Optuna file is missing, damaged (quick_check), or lacks the study
      -> a damaged file is moved aside (`optuna.db.damaged-<time>`), and the study is
         rebuilt from its MLflow runs (sweeper/tracking/rebuild.py), then reconciled;
  the MLflow file is damaged or its schema half-created (a full disk while MLflow created
  it; sweeper/tracking/store_health.py)
      -> it is moved aside (`mlflow.db.damaged-<time>`) and a fresh store is filled from
         the Optuna study (its parent run and one run per finished trial).
Other studies that logged to a moved file are kept in it; `sweeper sync --study OTHER` logs
them again into the fresh store.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sweeper import paths
from sweeper.spec import lease
from sweeper.spec.space import load_space
from sweeper.tracking.mlflow_log import Tracker, run_matches, trial_run_fields
from sweeper.tracking.store_health import move_aside, store_problem
from sweeper.tracking.study import RUN_ID_ATTR_PREFIX, load_study, mlflow_run_ids, study_counts
from workloads.config import ConfigError


STATUS_OF_LEASE = {"finished": "FINISHED", "failed": "FAILED", "killed": "KILLED"}
@dataclass
class SyncReport:
    study: str
    tracking_uri: str
    parent_run_id: str | None
    trials: int = 0                                   # finished trials in the study
    present: int = 0                                  # already had exactly their run
    created: list[int] = field(default_factory=list)  # trial numbers logged now
    removed: list[str] = field(default_factory=list)  # run ids deleted (duplicate, incomplete)
    parent_created: bool = False
    parent_status: str | None = None
    optuna_rebuilt: int | None = None                 # trials recreated from MLflow runs
    optuna_lost: int = 0                              # trial numbers with no run: FAIL lost
    moved_aside: list[str] = field(default_factory=list)   # damaged files renamed

    def to_json(self) -> dict[str, Any]:
        return {"study": self.study, "tracking_uri": self.tracking_uri,
                "parent_run_id": self.parent_run_id, "trials": self.trials,
                "present": self.present, "created": self.created, "removed": self.removed,
                "parent_created": self.parent_created, "parent_status": self.parent_status,
                "optuna_rebuilt": self.optuna_rebuilt, "optuna_lost": self.optuna_lost,
                "moved_aside": self.moved_aside}


def reconcile(study, tracker, parent_run_id: str, experiment_id: str,
              report: SyncReport | None = None) -> SyncReport:
    """Exactly one complete child run per finished trial of `study` under `parent_run_id`."""
    report = report or SyncReport(study.study_name, tracker.tracking_uri, parent_run_id)
    runs = tracker.child_runs(parent_run_id, experiment_id)
    known = mlflow_run_ids(study)
    for trial in study.get_trials(deepcopy=False):
        if not trial.state.is_finished():
            continue                      # a running trial is logged when it finishes
        report.trials += 1
        state = trial.state.name
        candidates = runs.get(trial.number, [])
        good = sorted((r for r in candidates if run_matches(r, state)),
                      key=lambda r: (r.info.run_id != known.get(trial.number), r.info.start_time))
        keep = good[0] if good else None
        for run in candidates:
            if keep is None or run.info.run_id != keep.info.run_id:
                tracker.delete_run(run.info.run_id)
                report.removed.append(run.info.run_id)
        if keep is None:
            run_id = tracker.log_trial(parent_run_id, experiment_id,
                                       **trial_run_fields(trial.number, state, trial.user_attrs))
            report.created.append(trial.number)
        else:
            run_id = keep.info.run_id
            report.present += 1
        if known.get(trial.number) != run_id:
            study.set_user_attr(f"{RUN_ID_ATTR_PREFIX}{trial.number}", run_id)
    return report


def sync_study(study_name: str, storage: str | None = None,
               tracking_uri: str | None = None) -> SyncReport:
    """`sweeper sync`: backfill and de-duplicate a study's MLflow runs; finish its parent run."""
    storage = storage or paths.default_storage(create=False)
    if tracking_uri is not None:
        paths.check_tracking_uri(tracking_uri)
    moved: list[str] = []
    optuna_damaged = store_problem("optuna", storage, study_name)
    try:
        if optuna_damaged is not None:
            raise ConfigError("--storage", storage, optuna_damaged.what)
        study = load_study(study_name, storage)        # ConfigError: unknown study / no store
    except ConfigError as missing:
        db = paths.sqlite_path(storage)
        gone = db is not None and not db.is_file()
        if optuna_damaged is None and missing.field != "study" and not gone:
            raise                            # e.g. a database server that does not answer
        # the Optuna record is gone, damaged or lacks the study: rebuild it from MLflow
        uri = tracking_uri or paths.default_tracking_uri(create=False)
        mlflow_damaged = store_problem("mlflow", uri, study_name)
        db = paths.sqlite_path(uri)
        if mlflow_damaged is not None or db is not None and not db.is_file():
            raise missing from None          # neither store can give the trials back
        if optuna_damaged is not None:
            moved.append(str(move_aside(paths.sqlite_path(storage))))
        return _rebuilt(study_name, storage, uri, moved)
    attrs = study.user_attrs
    lease.check_free(attrs, study_name, "--study")
    uri = tracking_uri or attrs.get("tracking_uri") or paths.default_tracking_uri(create=False)
    mlflow_damaged = store_problem("mlflow", uri, study_name)
    if mlflow_damaged is not None:          # Optuna is intact: a fresh MLflow store from it
        moved.append(str(move_aside(paths.sqlite_path(uri))))
    paths.check_sqlite_store(uri, "--tracking-uri")
    tracker = Tracker(uri)
    parent = attrs.get("mlflow_parent_run_id") if attrs.get("tracking_uri") == uri else None
    report = SyncReport(study_name, uri, parent, moved_aside=moved)
    if parent is not None and tracker.parent_state(parent) != "active":
        parent = None
    if parent is None:
        space_file = attrs.get("space_file")
        if space_file and Path(space_file).is_file():
            parent = tracker.start_sweep(load_space(space_file), study_name, storage)
        else:
            parent = tracker.start_sweep_from_study(study_name, attrs, storage)
        study.set_user_attr("mlflow_parent_run_id", parent)
        study.set_user_attr("tracking_uri", uri)
        # run ids recorded for another store or parent mean nothing here any more
        for key in [k for k in attrs if k.startswith(RUN_ID_ATTR_PREFIX)]:
            study.set_user_attr(key, None)
        report.parent_run_id, report.parent_created = parent, True
    experiment_id = tracker.experiment_of(parent)
    reconcile(study, tracker, parent, experiment_id, report)
    state = (attrs.get(lease.LEASE_ATTR) or {}).get("status", "finished")
    # A controller that died (kill -9) left `running`; nothing runs the sweep now.
    status = STATUS_OF_LEASE.get(state, "KILLED")
    tracker.finish_sweep(parent, study_counts(study), status)
    report.parent_status = status
    return report


def _rebuilt(study_name: str, storage: str, uri: str, moved: list[str]) -> SyncReport:
    """The Optuna study recreated from the MLflow runs, then reconciled like any sync."""
    from sweeper.tracking.rebuild import rebuild_study   # lazy: only for a lost study

    tracker = Tracker(uri)
    study, rebuilt, lost = rebuild_study(study_name, storage, tracker)
    parent = study.user_attrs["mlflow_parent_run_id"]
    report = SyncReport(study_name, uri, parent, optuna_rebuilt=rebuilt, optuna_lost=lost,
                        moved_aside=moved)
    reconcile(study, tracker, parent, tracker.experiment_of(parent), report)
    status = STATUS_OF_LEASE.get(study.user_attrs[lease.LEASE_ATTR]["status"], "KILLED")
    tracker.finish_sweep(parent, study_counts(study), status)
    report.parent_status = status
    return report
