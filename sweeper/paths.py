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
