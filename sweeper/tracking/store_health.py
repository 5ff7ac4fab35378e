"""Is the store a sweep writes to still the file it opened, and intact? (issue 23)

A SQLite store can be deleted, replaced or truncated under a running sweep. SQLite does
not notice: its open connections keep writing to the unlinked file (or to pages past the
new end of a truncated one), the sweep prints the store's path and exits 0, and the trials
it "stored" are gone. The controller therefore watches its SQLite stores:

    watch = StoreWatch.open("optuna", storage_url, study_name)  # after the store is opened
    problem = watch.check()        # every few seconds and at the end: None or StoreProblem
    problem.line()                 # one line: the store, what happened, the command to run

A problem is one of
  deleted    the path no longer exists (the sweep still writes to the unlinked file)
  replaced   the path is another file (its device/inode differ from the one opened)
  damaged    `PRAGMA quick_check` reports errors (a truncated or overwritten file)
  half-created schema   (MLflow only) some of MLflow's tables or its schema version are
             missing: the disk filled up while MLflow created its tables; every later open
             failed with "table ... already exists".

What to run names `sweeper sync --study NAME`, which repairs either side from the other
(sweeper/tracking/sync.py): the Optuna study from the MLflow runs, or the MLflow runs from
the Optuna study, moving a damaged file aside first (`move_aside`).

Only SQLite files are watched (a database server reports its own failures on the next
write, which the sweep already turns into one line).
"""

from __future__ import annotations

import os
import sqlite3
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from sweeper.paths import sqlite_path

QUICK_CHECK_ROWS = 3      # enough to say what is wrong in one line


@dataclass
class StoreProblem:
    kind: str                 # optuna | mlflow
    url: str
    what: str                 # deleted | replaced | damaged (...) | half-created schema (...)
    fix: str                  # the command that repairs it

    def line(self) -> str:
        return f"the {'Optuna' if self.kind == 'optuna' else 'MLflow'} store {self.url} " \
               f"{self.what}; {self.fix}"


class StoreLost(RuntimeError):
    """A store of the running sweep was deleted, replaced or damaged (exit 1, one line)."""

    def __init__(self, problems: list[StoreProblem]):
        self.problems = problems
        super().__init__("; ".join(p.line() for p in problems))


def sync_command(study: str | None, storage: str | None = None,
                 tracking_uri: str | None = None) -> str:
    """`sweeper sync --study S`, with --storage / --tracking-uri where they are not the
    defaults under $SWEEPER_HOME."""
    from sweeper import paths

    command = f"sweeper sync --study {study or 'NAME'}"
    if storage and storage != paths.default_storage(create=False):
        command += f" --storage {storage}"
    if tracking_uri and tracking_uri != paths.default_tracking_uri(create=False):
        command += f" --tracking-uri {tracking_uri}"
    return command


def _fix(study: str | None, kind: str, command: str | None = None) -> str:
    other = "MLflow" if kind == "optuna" else "Optuna"
    return (f"every finished trial is still in the {other} store: run `"
            f"{command or sync_command(study)}` to rebuild it")


def quick_check(path: Path) -> list[str]:
    """SQLite's `PRAGMA quick_check` of a file, read-only: ['ok'] or what is wrong."""
    try:
        connection = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True, timeout=30)
        try:
            return [str(row[0]) for row in
                    connection.execute(f"PRAGMA quick_check({QUICK_CHECK_ROWS})")]
        finally:
            connection.close()
    except sqlite3.Error as err:
        return [str(err)]


def _tables(path: Path) -> tuple[set[str], str | None]:
    """(table names, alembic revision or None) of a SQLite file, read-only."""
    connection = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True, timeout=30)
    try:
        tables = {r[0] for r in connection.execute(
            "SELECT name FROM sqlite_master WHERE type = 'table'")}
        revision = None
        if "alembic_version" in tables:
            row = connection.execute("SELECT version_num FROM alembic_version").fetchone()
            revision = row[0] if row else None
        return tables, revision
    finally:
        connection.close()


SCHEMA_CACHE = "mlflow-schema-{version}.json"    # under $SWEEPER_HOME/cache


def _schema_cache_file() -> Path | None:
    """Where this MLflow version's expected schema is kept: one file per installed MLflow
    version, so an upgrade never reads another version's tables or head revision; None
    when $SWEEPER_HOME does not exist yet (nothing is created before the checks pass)."""
    from importlib import metadata

    from sweeper.paths import sweeper_home

    home = sweeper_home(create=False)
    if not home.is_dir():
        return None
    try:
        version = metadata.version("mlflow")
    except metadata.PackageNotFoundError:
        return None
    return home / "cache" / SCHEMA_CACHE.format(version=version)


def mlflow_expected_schema() -> tuple[set[str], str]:
    """(tables MLflow's ORM needs, the head revision of its migrations) for this MLflow.

    Importing MLflow to ask takes ~1.7 s, on the path of every `sweeper run` before Ray
    starts (issue 22: the quickstart's checks took 2.9 s), so the answer is kept per MLflow
    version under $SWEEPER_HOME/cache; an unreadable or missing file is asked again."""
    import json

    cache = _schema_cache_file()
    if cache is not None and cache.is_file():
        try:
            kept = json.loads(cache.read_text())
            return set(kept["tables"]), str(kept["head"])
        except (OSError, ValueError, KeyError, TypeError):
            pass
    from mlflow.store.db import utils as db_utils   # lazy: MLflow (~1 s) and Alembic

    tables, head = set(db_utils.Base.metadata.tables), db_utils._get_latest_schema_revision()
    if cache is not None:
        partial = cache.with_suffix(f".{os.getpid()}.tmp")
        try:                       # a full disk or a read-only home: asked again next time
            cache.parent.mkdir(exist_ok=True)
            partial.write_text(json.dumps({"tables": sorted(tables), "head": head}))
            os.replace(partial, cache)
        except OSError:
            partial.unlink(missing_ok=True)
    return tables, head


def mlflow_schema_problem(path: Path) -> str | None:
    """None for a missing or empty file or a complete schema; else what is missing.

    A file with no table yet is fine (MLflow creates its schema on first open). Tables
    without every table MLflow needs, or without the head schema revision, are a schema
    creation that stopped half-way (a full disk): MLflow's next open tries to create the
    tables again and fails ("table ... already exists")."""
    if not path.is_file() or path.stat().st_size == 0:
        return None
    try:
        tables, revision = _tables(path)
    except sqlite3.Error as err:
        return f"unreadable ({err})"
    ours = {t for t in tables if not t.startswith(("alembic_", "sqlite_"))}
    if not ours and revision is None:
        return None
    expected, head = mlflow_expected_schema()
    missing = sorted(expected - tables)
    if missing:
        shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        return f"half-created schema ({len(missing)} of MLflow's {len(expected)} tables missing: " \
               f"{shown})"
    if revision != head:
        return f"half-created schema (schema revision {revision}, MLflow {head})"
    return None


def store_problem(kind: str, url: str, study: str | None = None) -> StoreProblem | None:
    """A store that exists but cannot be used as it is (damaged, half-created); else None."""
    db = sqlite_path(url)
    if db is None or not db.is_file():
        return None
    checked = quick_check(db)
    if checked != ["ok"]:
        return StoreProblem(kind, url, f"is damaged ({'; '.join(checked)[:160]})", _fix(study, kind))
    if kind == "mlflow":
        schema = mlflow_schema_problem(db)
        if schema:
            return StoreProblem(kind, url, f"has a {schema}", _fix(study, kind))
    return None


@dataclass
class StoreWatch:
    """The identity (device, inode) of a store's file when the sweep opened it."""

    kind: str
    url: str
    path: Path
    identity: tuple[int, int]
    study: str | None = None
    command: str | None = None        # the sync command to print (default: sync_command)

    @classmethod
    def open(cls, kind: str, url: str, study: str | None = None,
             command: str | None = None) -> "StoreWatch | None":
        """A watch on a SQLite store that exists now; None for a server or no file."""
        db = sqlite_path(url)
        if db is None or str(db) in ("", ":memory:"):
            return None
        try:
            st = os.stat(db)
        except OSError:
            return None
        return cls(kind, url, db, (st.st_dev, st.st_ino), study, command)

    def check(self, integrity: bool = True) -> StoreProblem | None:
        """deleted / replaced (always), damaged (with `integrity`: a read of every page's
        b-tree structure, milliseconds for a sweep's store)."""
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return StoreProblem(self.kind, self.url, "was deleted while the sweep ran",
                                _fix(self.study, self.kind, self.command))
        except OSError as err:
            return StoreProblem(self.kind, self.url, f"cannot be read ({err.strerror})",
                                _fix(self.study, self.kind, self.command))
        if (st.st_dev, st.st_ino) != self.identity:
            return StoreProblem(self.kind, self.url, "was replaced by another file while the "
                                "sweep ran", _fix(self.study, self.kind, self.command))
        if integrity:
            checked = quick_check(self.path)
            if checked != ["ok"]:
                return StoreProblem(self.kind, self.url, f"was damaged while the sweep ran "
                                    f"({'; '.join(checked)[:160]})", _fix(self.study, self.kind, self.command))
        return None


def check_stores(watches, integrity: bool = True) -> list[StoreProblem]:
    """Every problem of the watched stores (None entries are skipped)."""
    return [p for p in (w.check(integrity) for w in watches if w is not None) if p is not None]


class StoreMonitor:
    """The controller's periodic check (`poll()` from the sweep loop, every `every_s`) and
    the one at its end (`final()`).

    Optuna is the record: a lost or damaged Optuna store stops the sweep at once (StoreLost:
    what it would record next would be lost too). MLflow is a view of it: a lost MLflow
    store is one warning line and the sweep goes on, every trial still told to Optuna;
    `final()` then raises StoreLost, so the sweep ends non-zero with the `sweeper sync`
    line that rebuilds the runs."""

    def __init__(self, watches, every_s: float = 5.0, warn=None):
        self.watches = [w for w in watches if w is not None]
        self.every_s = every_s
        self._next = time.monotonic() + every_s
        self._warned: set[str] = set()
        self._warn = warn or (lambda line: print(line, file=sys.stderr, flush=True))

    @classmethod
    def for_sweep(cls, storage: str, tracking_uri: str, study: str) -> "StoreMonitor":
        """Watches on a sweep's two stores (SQLite files only), opened now."""
        command = sync_command(study, storage, tracking_uri)
        return cls([StoreWatch.open("optuna", storage, study, command),
                    StoreWatch.open("mlflow", tracking_uri, study, command)])

    def problems(self) -> list[StoreProblem]:
        return check_stores(self.watches)

    def poll(self) -> None:
        if not self.watches or time.monotonic() < self._next:
            return
        self._next = time.monotonic() + self.every_s
        problems = self.problems()
        lost = [p for p in problems if p.kind == "optuna"]
        if lost:
            raise StoreLost(problems)
        for p in problems:
            if p.url not in self._warned:
                self._warned.add(p.url)
                self._warn(f"sweeper: warning: {p.line()} after the sweep (it goes on: every "
                           "trial is stored in Optuna)")

    def final(self) -> None:
        problems = self.problems()
        if problems:
            raise StoreLost(problems)


def move_aside(path: Path) -> Path:
    """Rename a damaged SQLite file (and its -wal, -shm) to `<name>.damaged-<time>`; the
    new name. Nothing is deleted: what it held can still be read by hand."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    target = path.with_name(f"{path.name}.damaged-{stamp}")
    i = 1
    while target.exists():
        i += 1
        target = path.with_name(f"{path.name}.damaged-{stamp}-{i}")
    os.replace(path, target)
    for suffix in ("-wal", "-shm"):
        side = path.with_name(path.name + suffix)
        if side.exists():
            os.replace(side, target.with_name(target.name + suffix))
    return target


def _runs_in(path: Path) -> int:
    try:
        tables, _ = _tables(path)
        if "runs" not in tables:
            return 0
        connection = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True, timeout=30)
        try:
            return int(connection.execute("SELECT count(*) FROM runs").fetchone()[0])
        finally:
            connection.close()
    except sqlite3.Error:
        return -1


def study_names_in(storage: str | None) -> list[str] | None:
    """The study names of a SQLite Optuna store, read with sqlite3 (no Optuna import); []
    for no file, None when they cannot be read (not SQLite, damaged)."""
    db = sqlite_path(storage) if storage else None
    if db is None:
        return None
    if not db.is_file():
        return []
    try:
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5) as con:
            return [row[0] for row in con.execute("SELECT study_name FROM studies ORDER BY study_id")]
    except sqlite3.Error:
        return None


def _repair_command(uri: str, study: str | None, storage: str | None) -> str:
    """The command that repairs a damaged MLflow store in the state it is in (a study that
    exists in the Optuna store: `sweeper sync` rebuilds the store from it; tests/test_advice.py
    runs it)."""
    names = study_names_in(storage)
    if names is None or study in (names or []):
        return f"`{sync_command(study, storage, uri)}` moves it aside and logs the study's trials " \
               "again from Optuna"
    if names:
        first = sync_command(names[0], storage, uri)
        rest = f" (then the same for each other study: {', '.join(names[1:6])})" if names[1:] else ""
        return (f"`{first}` moves it aside and logs the trials of study {names[0]!r} again "
                f"from Optuna{rest}")
    db = sqlite_path(uri)
    return (f"no study in {storage} can rebuild it: `mv {db} {db}.damaged` starts a fresh "
            "store" if db else "name another store with --tracking-uri")


def prepare_tracking_store(uri: str, study: str | None = None,
                           storage: str | None = None) -> str | None:
    """Before a sweep opens its MLflow store: a half-created schema that holds no run (the
    disk filled while MLflow created it) is moved aside, so MLflow creates a fresh one;
    returns the one line saying so (or None). A damaged store, or a half-created one with
    runs, is a ConfigError naming the command that rebuilds it (`_repair_command`: `sweeper
    sync` of a study in `storage`, the sweep's Optuna store)."""
    from workloads.config import ConfigError

    problem = store_problem("mlflow", uri, study)
    if problem is None:
        return None
    db = sqlite_path(uri)
    if "half-created" in problem.what and _runs_in(db) == 0:
        try:
            moved = move_aside(db)
        except OSError as err:
            raise ConfigError("--tracking-uri", uri, f"an MLflow store that can be created "
                              f"(this one {problem.what} and cannot be moved aside: "
                              f"{err.strerror})") from None
        return (f"sweeper: the MLflow store {uri} {problem.what}, with no "
                f"run in it (the disk filled while MLflow created it): moved aside to {moved}; "
                "a fresh one is created")
    raise ConfigError("--tracking-uri", uri, f"an intact MLflow store (this one {problem.what}); "
                      f"{_repair_command(uri, study, storage)}")
