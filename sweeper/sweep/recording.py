"""Recording a trial the sweep ends: Optuna user attrs, then one MLflow child run, then tell.

    recorder = Recorder(study, space, tracking, on_trial)
    recorder.record(trial, TrialOutcome("PRUNED", reason="infeasible: ...", flat=flat))

Order (docs/architecture.md, "The data path", 6): every user attr first with `outcome`
last, then the MLflow child run (`sweeper.tracking.link`, which survives an outage), then
`study.tell` (Optuna's state last). A controller killed in between leaves a RUNNING trial:
with `outcome` stored, `--resume` tells it with its result (`tell_recorded`); without, it
runs the trial again (`resume_trials`).

Each Optuna trial carries user_attrs: `config` (TrialConfig.to_dict()), `flat_params`,
`measurement` (Measurement.metrics()), `prediction` (the cost model's, also for measured
trials), `source`, `hardware`, `reason`, `worker` (pid, Ray node id and IP, the resources
it held, cores, slot, start/end time, cache stats, attempts), `worker_lost` (earlier
attempts whose worker died), `constraints`, `mlflow_run_id`, `outcome` (the state being
recorded), `retry_of` (the interrupted trial it re-runs), and for a serving trial
`prediction_note` (why its `pred_*` are NaN, or where they came from, in one line).
A serving trial's whole `Measurement.extra["serving"]` (per-request records with tokens,
slices, warm-up, the prediction note) is the artifact `serving.json` of its MLflow child
run (docs/serving.md): too large for a user attr, which every `ask` reads back.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Literal

from sweeper.spec.space import SearchSpace
from sweeper.tracking.link import TrackingLink
from workloads.metrics import Measurement
from workloads.trial import TrialConfig

INTERRUPTED = "interrupted: the controller stopped before this trial finished"
STATE_KEYS = {"COMPLETE": "complete", "FAIL": "failed", "PRUNED": "pruned"}
State = Literal["COMPLETE", "FAIL", "PRUNED"]


@dataclass
class TrialOutcome:
    """How one trial ended, as the sweep's loop saw it."""

    state: State
    reason: str | None = None            # why PRUNED / FAIL
    config: TrialConfig | None = None    # None: the point did not make a TrialConfig
    flat: dict[str, Any] = field(default_factory=dict)         # its flat parameters
    prediction: dict[str, float] = field(default_factory=dict)  # the cost model's metrics
    metrics: dict[str, float] | None = None    # what the worker reported (None: it did not run)
    worker: dict | None = None           # placement of the worker that ran it
    measurement: Measurement | None = None     # the worker's whole report (device label)
    interrupted: bool = False            # Ctrl-C / lost controller or cluster: --resume re-runs


@dataclass
class TrialRecord:
    """What the controller stores on a trial it ends (its Optuna user attrs; MLflow logs the
    same through sweeper/tracking/mlflow_log.trial_run_fields)."""

    flat_params: dict[str, Any]          # TrialConfig.FLAT_PARAMS
    source: str                          # measured | analytical
    hardware: str                        # the sweep's hardware label
    prediction: dict[str, float]         # the cost model's metrics (per-chip profile)
    measurement: dict[str, float]        # what the worker reported ({} if it did not run)
    outcome: str                         # COMPLETE | PRUNED | FAIL: stored last
    device: str | None = None            # what the engine reported it ran on
    config: dict | None = None           # TrialConfig.to_dict()
    reason: str | None = None            # why PRUNED / FAIL
    worker: dict | None = None           # placement of the worker that ran it
    interrupted: bool = False            # Ctrl-C / lost controller: run again on --resume
    constraints: dict[str, float] | None = None   # COMPLETE: each constraint's value (<= 0 met)
    feasible: bool | None = None         # COMPLETE: every constraint met
    prediction_note: str | None = None   # serving trial: its prediction's note in one line

    def user_attrs(self) -> dict[str, Any]:
        """The attrs to store, `outcome` last: with it stored, `--resume` tells the trial."""
        attrs: dict[str, Any] = {"flat_params": self.flat_params, "source": self.source,
                                 "hardware": self.hardware, "prediction": self.prediction,
                                 "measurement": self.measurement}
        optional = {"device": self.device, "config": self.config, "reason": self.reason,
                    "worker": self.worker, "interrupted": self.interrupted or None,
                    "constraints": self.constraints, "feasible": self.feasible,
                    "prediction_note": self.prediction_note}
        attrs.update({k: v for k, v in optional.items() if v is not None})
        attrs["outcome"] = self.outcome
        return attrs


class Recorder:
    """Records ended trials into the study and MLflow, and keeps the sweep's counts and its
    best feasible value of the first objective (the progress line's)."""

    def __init__(self, study, space: SearchSpace, tracking: TrackingLink | None = None,
                 on_trial: Callable[[dict], None] | None = None):
        self.study = study                   # optuna.Study
        self.space = space
        self.source = space.hardware.source
        self.tracking = tracking             # None until MLflow is set up
        self.on_trial = on_trial
        self.counts = {"complete": 0, "failed": 0, "pruned": 0}
        self.interrupted = 0
        self.best: tuple[str, float, int] | None = None   # (metric, value, trial number)

    def record(self, trial, outcome: TrialOutcome) -> None:
        """user_attrs (`outcome` last) -> MLflow child run -> tell (Optuna state last)."""
        import optuna   # lazy: Optuna + SQLAlchemy take ~1 s; bad input exits first

        state = optuna.trial.TrialState[outcome.state]
        metrics = outcome.metrics
        # One hardware label per sweep (host, devices:<profile>, analytical:<profile>); what the
        # engine reported (e.g. the accelerator's device kind) is kept as `device`.
        record = TrialRecord(
            flat_params=outcome.flat, source=self.source, hardware=self.space.hardware.label,
            prediction=outcome.prediction, measurement=metrics or {}, outcome=outcome.state,
            device=outcome.measurement.hardware if outcome.measurement is not None else None,
            config=outcome.config.to_dict() if outcome.config is not None else None,
            reason=outcome.reason or None, worker=outcome.worker or None,
            interrupted=outcome.interrupted)
        serving = (outcome.measurement.extra.get("serving")
                   if outcome.measurement is not None else None)
        if serving is not None:
            record.prediction_note = prediction_note(serving.get("prediction"))
        values = None
        feasible = True
        if outcome.state == "COMPLETE":
            record.constraints = {c.text: c.value(metrics) for c in self.space.constraints}
            feasible = record.feasible = all(v <= 0 for v in record.constraints.values())
            for i, value in enumerate(record.constraints.values()):
                trial.set_constraint(str(i), value)
            values = [metrics[m] for m in self.space.metric_names]
        for key, value in record.user_attrs().items():
            trial.set_user_attr(key, value)
        artifacts = {"serving.json": serving} if serving is not None else None
        run_id = (self.tracking.log_trial(trial, outcome.state, artifacts)
                  if self.tracking else None)
        if run_id:
            trial.set_user_attr("mlflow_run_id", run_id)
        else:
            trial.set_user_attr("mlflow_error", self.tracking.last_error if self.tracking
                                else "not logged: the sweep stopped before MLflow was set up")
        self.study.tell(trial, values=values, state=state)
        if outcome.interrupted:
            self.interrupted += 1
        else:
            self.counts[STATE_KEYS[outcome.state]] += 1
        if outcome.state == "COMPLETE" and feasible:
            self.update_best(trial.number, metrics)
        if self.on_trial is not None:
            self.on_trial({"number": trial.number, "state": outcome.state,
                           "reason": outcome.reason, "params": outcome.flat,
                           "metrics": metrics or {}, "worker": outcome.worker})

    def count_finished(self, number: int, state: str, attrs: dict) -> None:
        """A trial a previous controller finished (a resumed study) counts as if recorded."""
        self.counts[STATE_KEYS[state]] += 1
        if state == "COMPLETE" and attrs.get("feasible", True):
            self.update_best(number, attrs.get("measurement") or {})

    def update_best(self, number: int, metrics: dict) -> None:
        objective = self.space.objectives[0]
        value = metrics.get(objective.metric)
        if value is None or not math.isfinite(value):
            return
        better = (self.best is None or (value < self.best[1] if objective.direction == "minimize"
                                        else value > self.best[1]))
        if better:
            self.best = (objective.metric, value, number)


def prediction_note(note: dict | None) -> str:
    """A serving trial's prediction note (workloads/serving/trial.py `predict_stream`) in one
    line: why there is no prediction (`pred_*` NaN), or its source and profile."""
    if not note:
        return "no prediction note"
    if note.get("source") is None:
        return f"no prediction: {note.get('reason') or 'no reason given'}"[:5000]
    return f"{note['source']}: serving model, {note.get('hardware')} profile, " \
           f"step times {note.get('step_times')}"


def tell_recorded(study, space: SearchSpace, trial) -> Any:
    """Tell a RUNNING trial whose record was complete when its controller died; its
    TrialState, or None when the record was not complete (the trial must run again)."""
    import optuna   # lazy: Optuna + SQLAlchemy take ~1 s; bad input exits first

    outcome = trial.user_attrs.get("outcome")
    if outcome not in STATE_KEYS:
        return None
    state = optuna.trial.TrialState[outcome]
    values = None
    if outcome == "COMPLETE":
        measured = trial.user_attrs.get("measurement") or {}
        values = [measured.get(m) for m in space.metric_names]
        if not all(isinstance(v, (int, float)) and math.isfinite(v) for v in values):
            return None
    study.tell(trial.number, values=values, state=state)
    return state


def resume_trials(study, space: SearchSpace, recorder: Recorder) -> tuple[int, list[tuple[int, dict]]]:
    """(trials of a resumed study that count toward `trials`, interrupted trials to run
    again as (number, params)).

    A RUNNING trial was left by a controller that died: if it had been fully recorded
    (`outcome` stored) it is told now with its result; otherwise it is FAIL
    (`interrupted`, not counted) and its parameters are queued to run again.
    """
    import optuna   # lazy: Optuna + SQLAlchemy take ~1 s; bad input exits first

    TrialState = optuna.trial.TrialState
    trials = study.get_trials(deepcopy=False)
    retried = {t.user_attrs.get("retry_of") for t in trials}
    retry: list[tuple[int, dict]] = []
    done = 0
    for t in trials:
        attrs = t.user_attrs
        state = t.state
        if state == TrialState.RUNNING:
            state = tell_recorded(study, space, t)
            if state is None:
                study._storage.set_trial_user_attr(t._trial_id, "reason", INTERRUPTED)
                study._storage.set_trial_user_attr(t._trial_id, "interrupted", True)
                study.tell(t.number, state=TrialState.FAIL)
                attrs = {**attrs, "interrupted": True}
        if attrs.get("interrupted"):
            recorder.interrupted += 1
            if t.number not in retried:
                retry.append((t.number, dict(t.params)))
            continue
        if state.is_finished():
            done += 1
            recorder.count_finished(t.number, state.name, attrs)
    return done, retry
