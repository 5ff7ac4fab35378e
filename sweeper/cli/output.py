"""What every command prints with: one JSON object for `--json`."""

from __future__ import annotations

import json


def print_json(obj) -> None:
    print(json.dumps(obj, indent=2, sort_keys=False, default=str))


def say_profile(profile) -> None:
    """One line on stderr naming the measured hardware profile a command used and how far to
    trust it: calibrated (when, held-out error) or not, and how to fix that
    (docs/host-calibration.md). Presets and files say nothing here: their name is in the output."""
    import sys

    from workloads.hardware import describe

    if profile.measured:
        print(f"hardware: {describe(profile)}", file=sys.stderr)
