"""What every command prints with: one JSON object for `--json`."""

from __future__ import annotations

import json

from sweeper.formatting import jsonable


def print_json(obj) -> None:
    print(json.dumps(obj, indent=2, sort_keys=False, default=str))


def print_json_plain(obj) -> None:
    """NaN/inf as null first (a Measurement's missing numbers), then `print_json`."""
    print_json(jsonable(obj))
