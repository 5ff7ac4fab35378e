"""The controller's link to MLflow: it survives a tracking outage and backfills what it missed.

Optuna storage is the record of a sweep; MLflow is kept in step with it. A trial is stored
in Optuna first and then logged here; when MLflow does not answer:

- the trial is still told to Optuna (it carries `mlflow_error`) and its number is kept in
  `unlogged`;
- the link stops calling MLflow for a backoff that doubles from 2 s up to 60 s, so a sweep
  does not wait on a dead server for every trial (and the HTTP client's own retries are
  short, see `sweeper.tracking.mlflow_log`);
- the first call that succeeds after the backoff (the next finished trial) reconciles the
  whole study (`sweeper.tracking.sync.reconcile`): every missing run is logged, doubled ones removed;
- at the end of the sweep it tries once more, whatever the backoff, reconciles when anything
  may be missing or doubled (a resumed sweep, an outage, a tracking server whose requests may
  have been retried) and records the final counts on the parent run.
- stderr gets ONE line per outage (the store, the innermost error, the `sweeper sync`
  command that catches up later), not MLflow's own traceback per failed write.
"""

from __future__ import annotations

import sys
import time
from typing import Any, Callable

from sweeper.tracking.mlflow_log import Tracker, store_error, trial_run_fields
from sweeper.tracking.sync import reconcile

MAX_BACKOFF_S = 60.0
RUN_STATUS_OF = {"finished": "FINISHED", "failed": "FAILED", "killed": "KILLED"}


class TrackingLink:
    def __init__(self, tracking_uri: str, *, space, study, study_name: str, storage: str,
                 resumed: bool):
        self.tracking_uri = tracking_uri
        self.space, self.study, self.study_name, self.storage = space, study, study_name, storage
        self.resumed = resumed
        self.tracker = Tracker(tracking_uri)
        self.parent_run_id: str | None = None
        self.experiment_id: str | None = None
        self.errors: list[str] = []
        self.unlogged: set[int] = set()          # finished in this run, no MLflow run yet
        self._up = True
        self._backoff = 0.0
        self._retry_at = 0.0
        self._warned = False

    # ------------------------------------------------------------------ the parent run
    def start(self) -> None:
        self._call("parent run", self._ensure_parent, force=True)

    def _ensure_parent(self) -> None:
        """Reuse the study's parent run in this store (resume) or create one."""
        if self.parent_run_id is not None and self.experiment_id is not None:
            return
        attrs = self.study.user_attrs
        parent = attrs.get("mlflow_parent_run_id")
        if parent and attrs.get("tracking_uri") == self.tracking_uri:
            if self.tracker.parent_state(parent) == "active":
                self.tracker.resume_sweep(parent)
            else:        # deleted from the store: a new parent; reconcile relogs the trials
                parent = None
        else:
            parent = None
        if parent is None:
            parent = self.tracker.start_sweep(self.space, self.study_name, self.storage)
            self.study.set_user_attr("mlflow_parent_run_id", parent)
            self.study.set_user_attr("tracking_uri", self.tracking_uri)
        self.experiment_id = self.tracker.experiment_of(parent)
        self.parent_run_id = parent

    # ------------------------------------------------------------------ trials
    def log_trial(self, trial, state: str, artifacts: dict[str, Any] | None = None) -> str | None:
        """The child run of a trial about to be told (from its user attrs, plus `artifacts`:
        file name -> JSON-able value); None if not logged."""
        logged: list[str] = []

        def log() -> None:
            self._ensure_parent()
            logged.append(self.tracker.log_trial(
                self.parent_run_id, self.experiment_id,
                **trial_run_fields(trial.number, state, trial.user_attrs), artifacts=artifacts))

        if self._call(f"trial {trial.number}", log):
            return logged[0]
        self.unlogged.add(trial.number)
        return None

    @property
    def last_error(self) -> str:
        return self.errors[-1] if self.errors else "not logged yet"

    def finish(self, status: str, counts: Callable[[], dict[str, int]]) -> bool:
        """End of the sweep: reconcile if needed, final counts and status on the parent run."""
        def finish() -> None:
            self._ensure_parent()
            if self.unlogged or self.resumed or self.errors or \
                    self.tracking_uri.startswith(("http://", "https://")):
                reconcile(self.study, self.tracker, self.parent_run_id, self.experiment_id)
                self.unlogged.clear()
            self.tracker.finish_sweep(self.parent_run_id, counts(),
                                      RUN_STATUS_OF.get(status, "FAILED"))

        if self._call("end of sweep", finish, force=True):
            return True
        if not self._warned:       # (a store that failed at the end only: say it here)
            self._warn(self.errors[-1])
        return False

    # ------------------------------------------------------------------ outages
    def _call(self, what: str, call: Callable[[], Any], force: bool = False) -> bool:
        """call() unless MLflow is down and its next try has not come; True when it ran.

        The first success after a failure backfills every trial MLflow missed.
        """
        if not self._up and not force and time.monotonic() < self._retry_at:
            return False
        try:
            call()
        except Exception as err:  # noqa: BLE001 - tracking trouble must not lose the trial
            self._failed(what, err)
            return False
        if not self._up:
            self._up, self._backoff, self._warned = True, 0.0, False
            print(f"sweeper: MLflow answers again; backfilling the {len(self.unlogged)} trials "
                  "it missed", file=sys.stderr)
            self._backfill()
        return True

    def _failed(self, what: str, err: BaseException) -> None:
        self.errors.append(f"{what}: {store_error(err)}")
        if self._up and not self._warned:
            self._warn(self.errors[-1])
        self._up = False
        self._backoff = min(MAX_BACKOFF_S, max(2.0, 2 * self._backoff))
        self._retry_at = time.monotonic() + self._backoff

    def _warn(self, error: str) -> None:
        """ONE line per sweep for a store that fails (a server down, a read-only mlflow.db):
        the store, why, and how to catch up. Later failures only add to `errors`."""
        self._warned = True
        print(f"sweeper: MLflow store {self.tracking_uri} failed ({error}); every trial is "
              f"still stored in Optuna and logged when the store answers again, or later "
              f"with: sweeper sync --study {self.study_name} --storage {self.storage}",
              file=sys.stderr)

    def _backfill(self) -> None:
        try:
            self._ensure_parent()
            reconcile(self.study, self.tracker, self.parent_run_id, self.experiment_id)
            self.unlogged.clear()
        except Exception as err:  # noqa: BLE001
            self._failed("backfill", err)
