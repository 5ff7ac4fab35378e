"""Options several commands share, declared once (issue 37): the JSON switch and the two
stores. Each takes the parser and, where a command means something more specific, the words
that say so; the flag, its destination and its default stay the same everywhere."""

from __future__ import annotations

import argparse

from workloads.trial import DEFAULTS as TRIAL_DEFAULTS
from workloads.trial import field_help

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


def add_trial_flag(p: argparse.ArgumentParser, name: str, **kwargs) -> None:
    """--<name> for a trial field, its help and default the field's own (workloads/trial.py
    TrialConfig: the one declaration of trial fields); `kwargs` go to add_argument."""
    kwargs.setdefault("help", field_help(name))
    if not kwargs.get("required"):
        kwargs.setdefault("default", TRIAL_DEFAULTS.get(name))
    p.add_argument("--" + name.replace("_", "-"), **kwargs)
