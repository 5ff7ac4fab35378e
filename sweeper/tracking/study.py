"""A sweep's Optuna study: opening it by name, its trial counts, its trials' MLflow run ids.

Optuna storage is the record of a sweep (see sweeper/tracking/sync.py); the readers of a study
(the results tables, sync, the controller) share these helpers.
"""

from __future__ import annotations

import difflib

from sweeper.formatting import one_line
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


def _open_storage(storage: str):
    """The storage of `storage`, or a one-line ConfigError for a damaged file or an
    unreachable database server."""
    try:
        return open_optuna_storage(storage)
    except Exception as err:  # noqa: BLE001 - a damaged file, an unreachable database server
        raise ConfigError("--storage", storage, f"a readable Optuna storage "
                          f"({one_line(err)[:200]})") from None


def study_names(storage: str, opened=None) -> list[str]:
    """The studies of `storage`; `opened`: that storage already opened (`_open_storage`)."""
    import optuna   # lazy: Optuna (and SQLAlchemy) cost ~1 s to import

    opened = opened or _open_storage(storage)
    try:
        summaries = optuna.study.get_all_study_summaries(opened, include_best_trial=False)
    except Exception as err:  # noqa: BLE001 - a damaged file, an unreachable database server
        raise ConfigError("--storage", storage, f"a readable Optuna storage "
                          f"({one_line(err)[:200]})") from None
    return [s.study_name for s in summaries]


def load_study(study_name: str, storage: str):
    """optuna.load_study, with a one-line ConfigError (and a suggestion) for an unknown name.
    The storage is opened once (each open of an RDB storage builds an engine and checks the
    schema's version: docs/performance.md, "Sweep overhead")."""
    import optuna   # lazy: Optuna (and SQLAlchemy) cost ~1 s to import

    db = sqlite_path(storage)
    if db is not None and not db.is_file():      # do not create an empty store just to look
        raise ConfigError("--storage", storage, "an Optuna storage with studies (no such file: "
                          "no sweep has used it; set SWEEPER_HOME or --storage to the one a "
                          "sweep used)")
    opened = _open_storage(storage)
    names = study_names(storage, opened)
    if study_name not in names:
        close = difflib.get_close_matches(study_name, names, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        listed = names if len(names) <= 10 else names[-10:] + ["..."]
        raise ConfigError("study", study_name, f"a study in {storage}: {listed}{hint}")
    return optuna.load_study(study_name=study_name, storage=opened)
