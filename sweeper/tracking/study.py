"""A sweep's Optuna study: opening it by name, its trial counts, its trials' MLflow run ids.

Optuna storage is the record of a sweep (see sweeper/tracking/sync.py); the readers of a study
(the results tables, sync, the controller) share these helpers.
"""

from __future__ import annotations

import difflib

from sweeper.paths import open_optuna_storage, sqlite_path
from workloads.config import ConfigError

# A run logged after its trial finished (backfill, `sweeper sync`) cannot be stored on the
# finished trial (Optuna refuses updates): its id goes into a study user attr instead.
RUN_ID_ATTR_PREFIX = "mlflow_run_id:"


def mlflow_run_ids(study) -> dict[int, str]:
    """Trial number -> its MLflow child run: logged live (trial attr) or later (study attr)."""
    ids = {t.number: t.user_attrs["mlflow_run_id"] for t in study.get_trials(deepcopy=False)
           if t.user_attrs.get("mlflow_run_id")}
    for key, value in study.user_attrs.items():
        if key.startswith(RUN_ID_ATTR_PREFIX) and key[len(RUN_ID_ATTR_PREFIX):].isdigit():
            number = int(key[len(RUN_ID_ATTR_PREFIX):])
            if value:
                ids[number] = value
            else:                 # cleared: the run was in a tracking store no longer used
                ids.pop(number, None)
    return ids


def study_counts(study) -> dict[str, int]:
    counts = {"complete": 0, "failed": 0, "pruned": 0}
    names = {"COMPLETE": "complete", "FAIL": "failed", "PRUNED": "pruned"}
    for t in study.get_trials(deepcopy=False):
        if t.state.name in names:
            counts[names[t.state.name]] += 1
    return counts


def study_names(storage: str) -> list[str]:
    import optuna   # lazy: Optuna (and SQLAlchemy) cost ~1 s to import

    return [s.study_name for s in optuna.study.get_all_study_summaries(
        open_optuna_storage(storage), include_best_trial=False)]


def load_study(study_name: str, storage: str):
    """optuna.load_study, with a one-line ConfigError (and a suggestion) for an unknown name."""
    import optuna   # lazy: Optuna (and SQLAlchemy) cost ~1 s to import

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
