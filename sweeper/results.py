"""A sweep's trials as one table, read from Optuna storage or from MLflow: same columns.

One row per trial:

  number, state, reason, source, hardware       trial identity and outcome
  model, chips, batch, input_len, decode_steps,  the trial's flat parameters
  topology, weights, prefill_ffn, prefill_attn,  (`TrialConfig.flat_params()`)
  decode_ffn, decode_attn, seed, repeats
  <metric> for every Measurement metric          what the trial reported (NaN if absent)
  pred_<metric>                                  the cost model's prediction of it
  mlflow_run_id                                  the trial's MLflow child run (logged live,
                                                 or backfilled later: sweeper.sync)

`state` is Optuna's state name: COMPLETE, PRUNED (infeasible, never ran), FAIL, RUNNING.
`source` is `measured` or `analytical`, never mixed within one study or experiment.
Calibration, Pareto frontiers and the report are built on these two loaders.
"""

from __future__ import annotations

import difflib
import math
from typing import Any, Iterable, Mapping

import pandas as pd

from workloads.config import ConfigError
from workloads.metrics import METRIC_NAMES

ID_COLUMNS = ("number", "state", "reason", "source", "hardware")
PARAM_COLUMNS = ("model", "chips", "batch", "input_len", "decode_steps", "topology", "weights",
                 "prefill_ffn", "prefill_attn", "decode_ffn", "decode_attn", "seed", "repeats",
                 "pad_heads")
INT_PARAMS = ("chips", "batch", "input_len", "decode_steps", "seed", "repeats")
METRIC_COLUMNS = METRIC_NAMES
PRED_PREFIX = "pred_"
PRED_COLUMNS = tuple(PRED_PREFIX + m for m in METRIC_NAMES)
COLUMNS = (*ID_COLUMNS, *PARAM_COLUMNS, *METRIC_COLUMNS, *PRED_COLUMNS, "mlflow_run_id")

# Trial states, as Optuna names them (MLflow child runs carry the same word in tag `status`).
COMPLETE, PRUNED, FAIL, RUNNING = "COMPLETE", "PRUNED", "FAIL", "RUNNING"


def trial_row(*, number: int, state: str, reason: str | None, source: str | None,
              hardware: str | None, params: Mapping[str, Any], metrics: Mapping[str, float],
              prediction: Mapping[str, float], mlflow_run_id: str | None) -> dict[str, Any]:
    """One table row; every column present (NaN / None where the trial has no value)."""
    row: dict[str, Any] = {"number": number, "state": state, "reason": reason or None,
                           "source": source, "hardware": hardware}
    for name in PARAM_COLUMNS:
        row[name] = params.get(name)
    for name in METRIC_COLUMNS:
        row[name] = _number(metrics.get(name))
    for name in METRIC_COLUMNS:
        row[PRED_PREFIX + name] = _number(prediction.get(name))
    row["mlflow_run_id"] = mlflow_run_id
    return row


def frame(rows: Iterable[Mapping[str, Any]]) -> pd.DataFrame:
    df = pd.DataFrame(list(rows), columns=list(COLUMNS))
    for name in INT_PARAMS:  # ints where every row has one; nullable Int64 otherwise
        df[name] = pd.to_numeric(df[name], errors="coerce").astype("Int64")
    if df["number"].notna().all():
        df["number"] = df["number"].astype(int)
    return df.sort_values("number", kind="stable").reset_index(drop=True)


def _number(value: Any) -> float:
    if value is None:
        return math.nan
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


# ----------------------------------------------------------------------------- Optuna


def load_trials(study_name: str, storage: str | None = None) -> pd.DataFrame:
    """Every trial of an Optuna study (as `sweeper run` stored it) as a table of COLUMNS."""
    from sweeper.paths import default_storage

    from sweeper.sync import mlflow_run_ids

    storage = storage or default_storage(create=False)
    study = load_study(study_name, storage)
    run_ids = mlflow_run_ids(study)
    rows = []
    for trial in study.get_trials(deepcopy=False):
        attrs = trial.user_attrs
        rows.append(trial_row(
            number=trial.number, state=trial.state.name, reason=attrs.get("reason"),
            source=attrs.get("source"), hardware=attrs.get("hardware"),
            params=attrs.get("flat_params") or {}, metrics=attrs.get("measurement") or {},
            prediction=attrs.get("prediction") or {}, mlflow_run_id=run_ids.get(trial.number)))
    return frame(rows)


def study_names(storage: str) -> list[str]:
    import optuna

    from sweeper.paths import open_optuna_storage

    return [s.study_name for s in optuna.study.get_all_study_summaries(
        open_optuna_storage(storage), include_best_trial=False)]


def load_study(study_name: str, storage: str):
    """optuna.load_study, with a one-line ConfigError (and a suggestion) for an unknown name."""
    import optuna

    from sweeper.paths import open_optuna_storage, sqlite_path

    db = sqlite_path(storage)
    if db is not None and not db.is_file():      # do not create an empty store just to look
        raise ConfigError("--storage", storage, "an Optuna storage with studies (no such file; "
                          "run `sweeper run` first, or set SWEEPER_HOME / --storage)")
    names = study_names(storage)
    if study_name not in names:
        close = difflib.get_close_matches(study_name, names, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        listed = names if len(names) <= 10 else names[-10:] + ["..."]
        raise ConfigError("study", study_name, f"a study in {storage}: {listed}{hint}")
    return optuna.load_study(study_name=study_name, storage=open_optuna_storage(storage))


# ----------------------------------------------------------------------------- MLflow


def load_runs(tracking_uri: str | None = None, experiment: str | None = None, *,
              parent_run_id: str | None = None) -> pd.DataFrame:
    """The trial (child) runs of one sweep (`parent_run_id`) or of a whole experiment.

    Same columns as `load_trials`. Params come back from MLflow as strings; the integer
    parameters are converted back.
    """
    from mlflow.tracking import MlflowClient

    from sweeper.paths import default_tracking_uri
    from sweeper.tracking import KIND_TAG, PARENT_TAG, TRIAL_KIND

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
                     prediction=predicted, mlflow_run_id=run.info.run_id)
