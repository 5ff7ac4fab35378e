"""One calibration process of `sweeper calibrate`, started by sweeper/calibrate/runner.py:

    python -m sweeper.calibrate.worker --devices N --cores 0 --tasks FILE.json [--claim FILE]

Parses the flags and hands them to workloads/hostcal.py `serve_tasks`, which pins the process,
sets the device count, runs the tasks and writes one JSON record per line to stdout. Nothing
here imports JAX (`serve_tasks` sets the device count before the first measurement does).
"""

from __future__ import annotations

import argparse
import sys

from workloads.hostcal import serve_tasks


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sweeper.calibrate.worker")
    parser.add_argument("--devices", type=int, required=True)
    parser.add_argument("--cores", required=True, help="comma-separated CPU cores to pin to")
    parser.add_argument("--tasks", required=True, help="JSON list of tasks")
    parser.add_argument("--claim", help="counter file shared with other processes on the "
                        "same task list: each task is run by the process that claims it")
    args = parser.parse_args(argv)
    return serve_tasks(args.devices, {int(c) for c in args.cores.split(",")}, args.tasks,
                       args.claim)


if __name__ == "__main__":
    sys.exit(main())
