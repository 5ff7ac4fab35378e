"""`sweeper` command line: argument parsing only; every command calls into a library module.

User errors (`ConfigError`) print one line and exit with code 2, before any expensive
work starts. Each command group has its own `_add_*` function below.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Callable

from workloads.config import ConfigError


class _Parser(argparse.ArgumentParser):
    """argparse exits 2 on bad arguments already; keep its message to one line."""

    def error(self, message: str):  # noqa: D401
        self.exit(2, f"{self.prog}: {message}\n")


def print_json(obj) -> None:
    print(json.dumps(obj, indent=2, sort_keys=False, default=str))


# ----------------------------------------------------------------- analytical (cost model)
def _add_analytical_commands(sub) -> None:
    """max-context, predict, recommend: the paper's analytical model (workloads/costmodel.py)."""
    from sweeper import analytical   # pure Python: no JAX import on this path

    analytical.add_parsers(sub)


# ----------------------------------------------------------------- engine
def _add_engine_commands(sub) -> None:
    """trial, host-profile: the sharded JAX engine (workloads/engine.py, workloads/measure.py)."""


# ----------------------------------------------------------------- sweeps
def _add_sweep_commands(sub) -> None:
    """run, ui: Optuna controller over Ray workers, MLflow tracking (sweeper/controller.py)."""
    from sweeper import run_cmd

    p = sub.add_parser("run", help="run a sweep from a search-space YAML")
    run_cmd.add_run_arguments(p)
    p.set_defaults(handler=run_cmd.cmd_run)
    p = sub.add_parser("ui", help="open the MLflow UI on the sweeps' tracking store")
    run_cmd.add_ui_arguments(p)
    p.set_defaults(handler=run_cmd.cmd_ui)


# ----------------------------------------------------------------- analysis
def _add_analysis_commands(sub) -> None:
    """fit, pareto, report: calibration, Pareto frontiers, HTML report."""


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="sweeper", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    _add_analytical_commands(sub)
    _add_engine_commands(sub)
    _add_sweep_commands(sub)
    _add_analysis_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    handler: Callable[[argparse.Namespace], int | None] = args.handler
    try:
        return int(handler(args) or 0)
    except ConfigError as err:
        print(f"sweeper {args.command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
