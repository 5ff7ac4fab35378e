"""Options several commands share, declared once (issue 37): the JSON switch and the two
stores. Each takes the parser and, where a command means something more specific, the words
that say so; the flag, its destination and its default stay the same everywhere."""

from __future__ import annotations

import argparse

STORE_DEFAULT = "default: sqlite under $SWEEPER_HOME"


def add_json(p: argparse.ArgumentParser, what: str = "one JSON object") -> None:
    """--json: print `what` instead of the text summary."""
    p.add_argument("--json", action="store_true", help=f"print {what}")


def add_storage(p: argparse.ArgumentParser, what: str = "Optuna RDB URL",
                default: str = STORE_DEFAULT) -> None:
    """--storage: the Optuna store of the studies."""
    p.add_argument("--storage", help=f"{what} ({default})")


def add_tracking_uri(p: argparse.ArgumentParser, what: str = "MLflow store",
                     default: str = STORE_DEFAULT) -> None:
    """--tracking-uri: the MLflow store the runs are logged to or read from."""
    p.add_argument("--tracking-uri", help=f"{what} ({default})" if default else what)
