"""Where a sweep keeps its state by default: `$SWEEPER_HOME`, else `./.sweeper/`.

Optuna storage   sqlite:///$SWEEPER_HOME/optuna.db
MLflow tracking  sqlite:///$SWEEPER_HOME/mlflow.db
MLflow artifacts $SWEEPER_HOME/mlartifacts/

Every path is absolute, so a URL printed by one command works from any directory.
Flags (`--storage`, `--tracking-uri`) override these; a server URL needs no local folder.
"""

from __future__ import annotations

import os
from pathlib import Path

HOME_ENV = "SWEEPER_HOME"


def sweeper_home(create: bool = False) -> Path:
    home = Path(os.environ.get(HOME_ENV) or ".sweeper").expanduser().resolve()
    if create:
        home.mkdir(parents=True, exist_ok=True)
    return home


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
    from sqlalchemy import event

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
    import sqlite3

    db = sqlite_path(url)
    if db is None or db.exists() or str(db) in ("", ":memory:"):
        return
    db.parent.mkdir(parents=True, exist_ok=True)
    connection = sqlite3.connect(db)
    try:
        connection.execute("PRAGMA journal_mode=WAL")
    finally:
        connection.close()


def open_optuna_storage(url: str):
    """An Optuna storage for `url` (SQLite tuned as in `tune_sqlite`; other URLs as they are)."""
    import optuna

    if sqlite_path(url) is None:
        return url
    storage = optuna.storages.RDBStorage(url, engine_kwargs={"connect_args": {"timeout": 60}})
    tune_sqlite(storage.engine)
    return storage
