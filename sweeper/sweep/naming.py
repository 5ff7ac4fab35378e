"""Which study a sweep writes to: a new name, or the study `--resume` continues.

    name, exists = choose_study(space, storage, study_name=None, resume=False)
    study = open_study(space, storage, name, exists, generated=True)

New sweeps get `<space>-<YYYYmmdd-HHMMSS>` (`-2`, `-3`... when taken). `--resume` without
`--study` finds the latest study of the same space and hardware. A study continues only
with the hardware, objectives and parameter values it was started with, and only when no
live controller holds it (`sweeper.spec.lease`). Every refusal is a `ConfigError` raised
before Ray, Optuna's storage or MLflow are touched, apart from listing the studies.
"""

from __future__ import annotations

import time
from typing import Any

from sweeper import paths
from sweeper.formatting import one_line
from sweeper.spec import lease
from sweeper.spec.space import SearchSpace
from workloads.config import ConfigError


def study_summaries(storage: str) -> list:
    """Optuna's summaries of every study in `storage` ([] when its SQLite file is absent:
    nothing is created just to look)."""
    db = paths.sqlite_path(storage)
    if db is not None and not db.exists():
        return []
    import optuna   # lazy: Optuna + SQLAlchemy take ~1 s; bad input exits first

    try:
        return optuna.study.get_all_study_summaries(paths.open_optuna_storage(storage),
                                                    include_best_trial=False)
    except Exception as err:  # noqa: BLE001 - a bad URL, an unreachable database server
        raise ConfigError("--storage", storage, f"a reachable Optuna RDB storage "
                          f"({one_line(err)[:300]})") from None


def study_names(storage: str) -> list[str]:
    return [s.study_name for s in study_summaries(storage)]


def sqlite_study_names(storage: str) -> list[str] | None:
    """The study names of a SQLite Optuna store read with SQL, read-only, without importing
    Optuna (~1 s before Ray starts, issue 22); None when that cannot say (not SQLite, a file
    without Optuna's tables, a read error): ask Optuna."""
    import sqlite3

    db = paths.sqlite_path(storage)
    if db is None:
        return None
    if not db.exists():
        return []
    try:
        connection = sqlite3.connect(f"{db.resolve().as_uri()}?mode=ro", uri=True, timeout=30)
        try:
            return [row[0] for row in connection.execute("SELECT study_name FROM studies")]
        finally:
            connection.close()
    except sqlite3.Error:
        return None


def choose_study(space: SearchSpace, storage: str, study_name: str | None,
                 resume: bool) -> tuple[str, bool]:
    """(study name, exists). New sweeps get `<space>-<timestamp>`; --resume finds the latest.
    A new sweep with a generated name on a SQLite store only needs the names taken (read
    with SQL; `open_study` moves on if another sweep takes the name meanwhile)."""
    if study_name is None and not resume:
        names = sqlite_study_names(storage)
        if names is not None:
            return free_name(f"{space.name}-{time.strftime('%Y%m%d-%H%M%S')}", set(names)), False
    summaries = study_summaries(storage)
    existing = {s.study_name: s for s in summaries}
    if study_name is not None:
        if study_name in existing and not resume:
            raise ConfigError("--study", study_name, "a new study name, or --resume to continue "
                              "this one")
        if resume and study_name not in existing:
            raise ConfigError("--study", study_name, f"an existing study to resume in {storage} "
                              f"(have {sorted(existing)[-10:]})")
        if study_name in existing:
            check_resumable(space, existing[study_name], storage)
        return study_name, study_name in existing
    if resume:
        mine = [s for s in summaries if s.user_attrs.get("space") == space.name
                and s.user_attrs.get("hardware") == space.hardware.label]
        if not mine:
            raise ConfigError("--resume", space.name, f"a space with a study in {storage} to "
                              "resume (none found; run without --resume to start one)")
        latest = max(mine, key=lambda s: (s.datetime_start or 0, s._study_id))
        check_resumable(space, latest, storage)
        return latest.study_name, True
    return free_name(f"{space.name}-{time.strftime('%Y%m%d-%H%M%S')}", existing), False


def free_name(base: str, taken) -> str:
    """`base`, or `base-2`, `base-3`... the first not in `taken`."""
    name, i = base, 1
    while name in taken:
        i += 1
        name = f"{base}-{i}"
    return name


def check_resumable(space: SearchSpace, summary, storage: str) -> None:
    """A study continues only with the hardware, objectives and parameter values it was
    started with, and only when no live controller is running it."""
    attrs = summary.user_attrs
    if attrs.get("hardware") not in (None, space.hardware.label):
        raise ConfigError("hardware", space.hardware.label, f"{attrs['hardware']!r}, the hardware "
                          f"study {summary.study_name!r} was run on", space.source)
    if attrs.get("objectives") not in (None, space.metric_names) or \
            attrs.get("directions") not in (None, space.directions):
        raise ConfigError("objectives", space.metric_names, f"the objectives of study "
                          f"{summary.study_name!r}: {attrs.get('objectives')} "
                          f"{attrs.get('directions')}", space.source)
    lease.check_free(attrs, summary.study_name, "--resume")
    check_same_params(space, summary.study_name, storage)


def check_same_params(space: SearchSpace, study_name: str, storage: str) -> None:
    """Each searched parameter keeps the kind of values (and a categorical its choices) its
    trials were asked with: Optuna's samplers cannot read old trials under changed choices
    (a ValueError in the middle of the resumed sweep, RUNNING trials left behind)."""
    import optuna   # lazy: Optuna + SQLAlchemy take ~1 s; bad input exits first

    study = optuna.load_study(study_name=study_name, storage=paths.open_optuna_storage(storage))
    asked: dict[str, Any] = {}
    for t in study.get_trials(deepcopy=False):
        for name, distribution in t.distributions.items():
            asked.setdefault(name, distribution)
    for name, new in space.distributions().items():
        old = asked.get(name)
        if old is None:
            continue
        try:
            optuna.distributions.check_distribution_compatibility(old, new)
        except ValueError:
            raise ConfigError(f"params.{name}", _values(new), f"the values study {study_name!r} "
                              f"was run with, {_values(old)} (start a new study for a changed "
                              "space)", space.source) from None


def _values(distribution) -> Any:
    choices = getattr(distribution, "choices", None)
    if choices is not None:
        return list(choices)
    return f"{type(distribution).__name__}({distribution.low}..{distribution.high})"


def open_study(space: SearchSpace, storage: str, study_name: str, exists: bool, *,
               generated: bool):
    """The Optuna study to run; a new one gets the space's identity as user attrs (what
    `check_resumable` compares on --resume). Returns (study, its name): a `generated` name
    another sweep has just created moves on to the next free one."""
    import optuna   # lazy: Optuna + SQLAlchemy take ~1 s; bad input exits first

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    name = study_name
    while True:
        try:
            study = optuna.create_study(storage=paths.open_optuna_storage(storage),
                                        study_name=name, sampler=space.make_sampler(),
                                        directions=space.directions, load_if_exists=exists)
            break
        except optuna.exceptions.DuplicatedStudyError:
            # Another sweep created this name since choose_study looked (two sweeps of
            # one space started in the same second): a generated name moves on.
            if not generated:
                raise ConfigError("--study", name, "a new study name (another sweep has just "
                                  "created this one), or --resume") from None
            name = free_name(study_name, set(study_names(storage)))
    if not exists:   # (a resumed study was checked against the space by choose_study)
        for key, value in {"space": space.name, "hardware": space.hardware.label,
                           "source": space.hardware.source, "objectives": space.metric_names,
                           "directions": space.directions, "space_file": space.source,
                           "constraints": [c.text for c in space.constraints]}.items():
            study.set_user_attr(key, value)
    return study, name
