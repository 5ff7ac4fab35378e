"""What every command prints with: one JSON object for `--json`."""

from __future__ import annotations

import json


def print_json(obj) -> None:
    print(json.dumps(obj, indent=2, sort_keys=False, default=str))
