"""A sweep's trials as one table, read from Optuna storage or from MLflow: same columns.

One row per trial:

  number, state, reason, source, hardware,      trial identity and outcome; the share of
  hardware_share                                 the profile one chip ran with
  model, chips, batch, ... (FLAT_PARAMS)         the trial's flat parameters, derived from
                                                 TrialConfig's field metadata (workloads/
                                                 trial.py; integer ones as Int64 columns)
  <metric> for every Measurement metric          what the trial reported (NaN if absent)
  pred_<metric>                                  the cost model's prediction of it
  mlflow_run_id                                  the trial's MLflow child run (logged live,
                                                 or backfilled later: sweeper.tracking.sync)

`state` is Optuna's state name: COMPLETE, PRUNED (infeasible, never ran), FAIL, RUNNING.
`source` is `measured` or `analytical`, never mixed within one study or experiment.
Calibration, Pareto frontiers and the report are built on these two loaders.
"""

from __future__ import annotations

import difflib
import math
from typing import Any, Iterable, Mapping

import pandas as pd

from sweeper.paths import default_storage, default_tracking_uri
from sweeper.tracking.mlflow_log import KIND_TAG, PARENT_TAG, TRIAL_KIND
from sweeper.tracking.study import load_study, mlflow_run_ids
from workloads.config import ConfigError
from workloads.metrics import METRIC_NAMES
from workloads.trial import FLAT_PARAMS, INT_FLAT_PARAMS

ID_COLUMNS = ("number", "state", "reason", "source", "hardware", "hardware_share")
PARAM_COLUMNS = FLAT_PARAMS
INT_PARAMS = INT_FLAT_PARAMS
METRIC_COLUMNS = METRIC_NAMES
PRED_PREFIX = "pred_"
PRED_COLUMNS = tuple(PRED_PREFIX + m for m in METRIC_NAMES)
COLUMNS = (*ID_COLUMNS, *PARAM_COLUMNS, *METRIC_COLUMNS, *PRED_COLUMNS, "mlflow_run_id")

# Trial states, as Optuna names them (MLflow child runs carry the same word in tag `status`).
COMPLETE, PRUNED, FAIL, RUNNING = "COMPLETE", "PRUNED", "FAIL", "RUNNING"


def trial_row(*, number: int, state: str, reason: str | None, source: str | None,
              hardware: str | None, params: Mapping[str, Any], metrics: Mapping[str, float],
              prediction: Mapping[str, float], mlflow_run_id: str | None,
              hardware_share: Any = None) -> dict[str, Any]:
    """One table row; every column present (NaN / None where the trial has no value)."""
    row: dict[str, Any] = {"number": number, "state": state, "reason": reason or None,
                           "source": source, "hardware": hardware,
                           "hardware_share": _float(hardware_share)}
    for name in PARAM_COLUMNS:
        row[name] = params.get(name)
    for name in METRIC_COLUMNS:
        row[name] = _float(metrics.get(name))
    for name in METRIC_COLUMNS:     # (a serving trial's measurement carries its own pred_*)
        row[PRED_PREFIX + name] = _float(prediction.get(name, metrics.get(PRED_PREFIX + name)))
    row["mlflow_run_id"] = mlflow_run_id
    return row


def frame(rows: Iterable[Mapping[str, Any]]) -> pd.DataFrame:
    df = pd.DataFrame(list(rows), columns=list(COLUMNS))
    for name in INT_PARAMS:  # ints where every row has one; nullable Int64 otherwise
        df[name] = pd.to_numeric(df[name], errors="coerce").astype("Int64")
    if df["number"].notna().all():
        df["number"] = df["number"].astype(int)
    return df.sort_values("number", kind="stable").reset_index(drop=True)


def _float(value: Any) -> float:
    """A stored metric as a float, NaN when absent or not a number (a conversion, not a check)."""
    if value is None:
        return math.nan
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


# ----------------------------------------------------------------------------- Optuna


def load_trials(study_name: str, storage: str | None = None) -> pd.DataFrame:
    """Every trial of an Optuna study (as `sweeper run` stored it) as a table of COLUMNS."""
    return trials_frame(load_study(study_name, storage or default_storage(create=False)))


def trials_frame(study, trials: list | None = None) -> pd.DataFrame:
    """An opened Optuna study's trials (`trials`: its `get_trials(deepcopy=False)` already
    read) as a table of COLUMNS."""
    run_ids = mlflow_run_ids(study)
    rows = []
    for trial in study.get_trials(deepcopy=False) if trials is None else trials:
        attrs = trial.user_attrs
        rows.append(trial_row(
            number=trial.number, state=trial.state.name, reason=attrs.get("reason"),
            source=attrs.get("source"), hardware=attrs.get("hardware"),
            params=attrs.get("flat_params") or {}, metrics=attrs.get("measurement") or {},
            prediction=attrs.get("prediction") or {}, mlflow_run_id=run_ids.get(trial.number),
            hardware_share=attrs.get("hardware_share")))
    return frame(rows)


# ----------------------------------------------------------------------------- MLflow


def load_runs(tracking_uri: str | None = None, experiment: str | None = None, *,
              parent_run_id: str | None = None) -> pd.DataFrame:
    """The trial (child) runs of one sweep (`parent_run_id`) or of a whole experiment.

    Same columns as `load_trials`. Params come back from MLflow as strings; the integer
    parameters are converted back.
    """
    from mlflow.tracking import MlflowClient   # lazy: MLflow (~1 s) only when a store is read

    if experiment is None and parent_run_id is None:
        raise ConfigError("experiment", None, "an experiment name or a parent run id")
    tracking_uri = tracking_uri or default_tracking_uri(create=False)
    client = MlflowClient(tracking_uri=tracking_uri)
    if parent_run_id is not None:
        experiment_ids = [client.get_run(parent_run_id).info.experiment_id]
        query = f"tags.`{PARENT_TAG}` = '{parent_run_id}'"
    else:
        exp = client.get_experiment_by_name(experiment)
        if exp is None:
            names = [e.name for e in client.search_experiments()]
            close = difflib.get_close_matches(experiment, names, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError("experiment", experiment, f"an experiment in {tracking_uri}: {names}{hint}")
        experiment_ids = [exp.experiment_id]
        query = f"tags.`{KIND_TAG}` = '{TRIAL_KIND}'"
    rows, token = [], None
    while True:
        page = client.search_runs(experiment_ids, filter_string=query, max_results=1000,
                                  page_token=token)
        for run in page:
            rows.append(_run_row(run))
        token = page.token
        if not token:
            break
    return frame(rows)


def _run_row(run) -> dict[str, Any]:
    tags, metrics = run.data.tags, run.data.metrics
    measured = {k: v for k, v in metrics.items() if not k.startswith(PRED_PREFIX)}
    predicted = {k[len(PRED_PREFIX):]: v for k, v in metrics.items() if k.startswith(PRED_PREFIX)}
    return trial_row(number=int(tags.get("trial_number", -1)), state=tags.get("status"),
                     reason=tags.get("reason"), source=tags.get("source"),
                     hardware=tags.get("hardware"), params=run.data.params, metrics=measured,
                     prediction=predicted, mlflow_run_id=run.info.run_id,
                     hardware_share=tags.get("hardware_share"))
