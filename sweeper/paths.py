"""Where a sweep keeps its state by default: `$SWEEPER_HOME`, else `./.sweeper/`.

Optuna storage   sqlite:///$SWEEPER_HOME/optuna.db
MLflow tracking  sqlite:///$SWEEPER_HOME/mlflow.db
MLflow artifacts $SWEEPER_HOME/mlartifacts/

Every path is absolute, so a URL printed by one command works from any directory.
Flags (`--storage`, `--tracking-uri`) override these; a server URL needs no local folder.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import sqlite3
from pathlib import Path

from workloads.config import ConfigError

HOME_ENV = "SWEEPER_HOME"
# MLflow stores a sweep can log to (database URLs as SQLAlchemy writes them, or a server).
TRACKING_SCHEMES = ("sqlite", "postgresql", "mysql", "mssql", "http", "https", "file",
                    "databricks")
_URL = re.compile(r"^([A-Za-z][A-Za-z0-9]*)(\+[A-Za-z0-9_]+)?://")


def sweeper_home(create: bool = False) -> Path:
    home = Path(os.environ.get(HOME_ENV) or ".sweeper").expanduser().resolve()
    if create:
        home.mkdir(parents=True, exist_ok=True)
    return home


# A study name becomes a folder under $SWEEPER_HOME (reports/<study>, fits/<study>): a safe
# character set, no leading dot ('..', hidden files) and a length every file system takes.
STUDY_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,99}")


def check_study_name(name: str, field: str = "--study") -> str:
    """A study name of letters, digits, '.', '_', '-' (no leading '.'), at most 100 long."""
    if not isinstance(name, str) or not STUDY_NAME.fullmatch(name):
        raise ConfigError(field, name, "a study name of at most 100 letters, digits, '.', '_' "
                          "or '-', not starting with '.'")
    return name


def study_dir(kind: str, study: str) -> Path:
    """$SWEEPER_HOME/<kind>/<study> (reports, fits), checked to stay inside $SWEEPER_HOME."""
    home = sweeper_home(create=False)
    folder = (home / kind / check_study_name(study, "study")).resolve()
    if not folder.is_relative_to(home):
        raise ConfigError("study", study, f"a study name whose folder stays inside {home}")
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def default_storage(create: bool = True) -> str:
    """Optuna RDB storage URL (SQLite file under SWEEPER_HOME)."""
    return f"sqlite:///{sweeper_home(create) / 'optuna.db'}"


def default_tracking_uri(create: bool = True) -> str:
    """MLflow tracking store URL (SQLite file under SWEEPER_HOME)."""
    return f"sqlite:///{sweeper_home(create) / 'mlflow.db'}"


def sqlite_path(url: str) -> Path | None:
    """The file behind a `sqlite:///...` URL, else None (a server or another database)."""
    prefix = "sqlite:///"
    if not url.startswith(prefix):
        return None
    return Path(url[len(prefix):])


def artifact_root(tracking_uri: str) -> str | None:
    """Artifact folder for experiments we create on a local SQLite store: next to the database.

    For a tracking server, None: the server decides where artifacts go.
    """
    db = sqlite_path(tracking_uri)
    if db is None:
        return None
    root = db.parent / "mlartifacts"
    root.mkdir(parents=True, exist_ok=True)
    return root.resolve().as_uri()


def tune_sqlite(engine) -> None:
    """WAL journal + synchronous=NORMAL on a SQLAlchemy SQLite engine.

    A sweep commits a handful of small transactions per trial (Optuna user attrs, MLflow
    params and metrics). SQLite's default rollback journal fsyncs several times per commit
    (~20 ms each here); in WAL mode with synchronous=NORMAL a commit is an append, still
    safe against a crash of the process (only an OS crash may lose the last commits), and
    readers (`sweeper ui`, optuna-dashboard) do not block the running sweep.
    """
    if engine is None or getattr(engine.dialect, "name", "") != "sqlite":
        return
    from sqlalchemy import event   # lazy: SQLAlchemy, only when a SQLite store is opened

    def _pragmas(dbapi_connection, _record):
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.close()

    if not event.contains(engine, "connect", _pragmas):
        event.listen(engine, "connect", _pragmas)
    engine.dispose()      # pooled connections were opened before the listener: reopen


def precreate_sqlite_wal(url: str) -> None:
    """Create an empty SQLite file in WAL mode (a file setting) before a tool migrates it:
    MLflow's first-time schema migration makes ~100 commits, 3x faster in WAL."""
    db = sqlite_path(url)
    if db is None or db.exists() or str(db) in ("", ":memory:"):
        return
    db.parent.mkdir(parents=True, exist_ok=True)
    connection = sqlite3.connect(db)
    try:
        connection.execute("PRAGMA journal_mode=WAL")
    finally:
        connection.close()


@contextlib.contextmanager
def store_creation_lock(url: str):
    """Serialise opening (and so creating) a store across the processes that share it.

    Optuna creates its tables and MLflow runs its schema migrations the first time a store
    is opened, and neither is safe against a second process doing the same at that moment
    (two sweeps started together on a fresh store): one fails with "table already exists"
    ("duplicate key ... pg_type_typname_nsp_index" on PostgreSQL) or a half-migrated schema.
    The second process waits until the first has finished:
      SQLite      an exclusive `flock` on `<db>.lock` (processes of this machine);
      PostgreSQL  a session advisory lock (`pg_advisory_lock`) held on the server, so every
                  machine of a cluster that writes to the database takes part;
      MySQL       a named lock (`GET_LOCK`), likewise.
    Other URLs (a tracking server, files) are left as they are. A server that cannot be
    reached is not waited for: opening the store then reports that error itself.
    """
    db = sqlite_path(url)
    if db is not None:
        if str(db) in ("", ":memory:"):
            yield
            return
        db.parent.mkdir(parents=True, exist_ok=True)
        with open(db.with_name(db.name + ".lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)
        return
    match = _URL.match(url or "")
    statements = _SERVER_LOCKS.get(match.group(1) if match else "")
    connection = _server_lock(url, statements[0]) if statements else None
    try:
        yield
    finally:
        if connection is not None:
            _server_unlock(connection, statements[1])


# dialect -> (acquire, release): a lock held by one database session. PostgreSQL waits
# without a timeout (a first MLflow migration takes seconds to a minute); MySQL's GET_LOCK
# needs one.
_LOCK_KEY = 0x53574545504552       # "SWEEPER": one lock for every sweeper store
_SERVER_LOCKS = {
    "postgresql": (f"SELECT pg_advisory_lock({_LOCK_KEY})",
                   f"SELECT pg_advisory_unlock({_LOCK_KEY})"),
    "mysql": ("SELECT GET_LOCK('sweeper-store-creation', 600)",
              "SELECT RELEASE_LOCK('sweeper-store-creation')"),
}


def _server_lock(url: str, acquire: str):
    """A connection holding the lock, or None if the server cannot be reached."""
    import sqlalchemy   # lazy: SQLAlchemy only when a database server is opened

    try:
        engine = sqlalchemy.create_engine(url, poolclass=sqlalchemy.pool.NullPool)
        connection = engine.connect()
    except Exception:  # noqa: BLE001  unreachable, no driver: the store's own open says why
        return None
    connection.execute(sqlalchemy.text(acquire))
    return connection


def _server_unlock(connection, release: str) -> None:
    import sqlalchemy   # lazy: as in _server_lock

    try:
        connection.execute(sqlalchemy.text(release))
    finally:
        connection.close()


def open_optuna_storage(url: str):
    """An Optuna storage for `url`, created under `store_creation_lock` (SQLite tuned as in
    `tune_sqlite`)."""
    import optuna   # lazy: Optuna + SQLAlchemy take ~1 s; bad input exits first

    if sqlite_path(url) is None:
        with store_creation_lock(url):
            return optuna.storages.RDBStorage(url)
    with store_creation_lock(url):
        storage = optuna.storages.RDBStorage(url, engine_kwargs={"connect_args": {"timeout": 60}})
    tune_sqlite(storage.engine)
    return storage


def check_storage_url(url: str, field: str = "--storage") -> str:
    """An Optuna RDB URL (dialect[+driver]://...); a SQLite file's folder must exist.

    Checked before anything starts: nothing is created here.
    """
    match = _URL.match(url or "")
    if not match or match.group(1) in ("http", "https", "file"):
        raise ConfigError(field, url, "an Optuna RDB URL such as sqlite:///path/optuna.db or "
                          "postgresql://user@host/db")
    _check_sqlite_folder(url, field)
    return url


def check_tracking_uri(uri: str, field: str = "--tracking-uri") -> str:
    """An MLflow tracking URI: a database URL, http(s)://server:port, file:, databricks."""
    match = _URL.match(uri or "") or re.match(r"^(databricks|file)(:)", uri or "")
    if not match or match.group(1) not in TRACKING_SCHEMES:
        raise ConfigError(field, uri, "an MLflow tracking URI such as sqlite:///path/mlflow.db "
                          "or http://mlflow-server:5000")
    _check_sqlite_folder(uri, field)
    return uri


def check_home(url: str) -> None:
    """A default store's folder ($SWEEPER_HOME) can be created or written: checked before Ray
    starts, so a read-only or misplaced home is one line, not a traceback minutes later."""
    _check_sqlite_folder(url, HOME_ENV)


def check_sqlite_store(url: str, field: str) -> None:
    """An existing SQLite store is a readable, intact database (a truncated or overwritten
    file is reported here, before a study or a run is created in the other store)."""
    db = sqlite_path(url)
    if db is None or str(db) in ("", ":memory:") or not db.is_file():
        return
    try:
        connection = sqlite3.connect(f"{db.as_uri()}?mode=ro", uri=True, timeout=60)
        try:
            problems = [row[0] for row in connection.execute("PRAGMA quick_check(1)")]
        finally:
            connection.close()
    except sqlite3.Error as err:
        problems = [str(err)]
    if problems != ["ok"]:
        raise ConfigError(field, url, f"an intact SQLite database ({'; '.join(problems)[:200]}); "
                          "restore it from a backup or use another store")


def _check_sqlite_folder(url: str, field: str) -> None:
    db = sqlite_path(url)
    if db is None or str(db) in ("", ":memory:"):
        return
    if db.is_dir():
        raise ConfigError(field, url, "a SQLite file, not a folder")
    existing = db.parent
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir() or not os.access(existing, os.W_OK):
        raise ConfigError(field, url, f"a SQLite file in a folder this user can create or "
                          f"write ({existing} is not writable)")


# ----------------------------------------------------------------- shipped search spaces
SPACE_SUFFIXES = (".yaml", ".yml")


def shipped_spaces_dir() -> Path:
    """The example search spaces that come with the project.

    Installed from a wheel they are package data in `sweeper/search_spaces/` (pyproject.toml
    maps the package `sweeper.search_spaces` to the repository's `search_spaces/`); in a
    checkout, editable install or not, they are that top-level folder itself.
    """
    package = Path(__file__).resolve().parent
    installed = package / "search_spaces"
    return installed if installed.is_dir() else package.parent / "search_spaces"


def shipped_spaces() -> dict[str, Path]:
    """name (the file's stem) -> file, for every shipped search space, sorted by name."""
    folder = shipped_spaces_dir()
    files = sorted(f for f in folder.glob("*") if f.suffix in SPACE_SUFFIXES) \
        if folder.is_dir() else []
    return {f.stem: f for f in files}


def resolve_space(spec: str) -> str:
    """A space argument as typed -> the file to read.

    An existing file is itself; a bare name (no folder, no .yaml) that is not a file here is
    the shipped space of that name (`sweeper run quickstart` from any directory). Anything
    else is returned as typed, for the loader to report.
    """
    path = Path(spec)
    if path.exists():
        return spec
    shipped = shipped_spaces()
    if path.suffix in SPACE_SUFFIXES or len(path.parts) != 1:
        # a missing path to a shipped file (search_spaces/X.yaml outside a checkout)
        if path.suffix in SPACE_SUFFIXES and path.stem in shipped:
            raise ConfigError("file", spec, "an existing YAML file (not here; the shipped "
                              f"space of that name runs from anywhere: sweeper run {path.stem})")
        return spec
    if spec in shipped:
        return str(shipped[spec])
    raise ConfigError("space", spec, "an existing YAML file or the name of a shipped space ("
                      f"{', '.join(shipped) or 'none installed'}; `sweeper examples` lists them)")
