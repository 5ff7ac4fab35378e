"""`sweeper` command line: argument parsing and printing; every command calls into a library module.

User errors (`ConfigError`) print one line and exit with code 2, before any expensive
work starts. Each command group has its own `_add_*` function below.
"""

from __future__ import annotations

import argparse
import errno
import signal
import sys
import warnings
from importlib import metadata
from typing import Callable

from sweeper import paths
from sweeper.cli import analytical   # pure Python: no JAX import on this path
from sweeper.cli import calibrate as calibrate_cmd   # JAX runs in its worker processes only
from sweeper.cli import examples   # the shipped search spaces: reads YAML only
from sweeper.cli import plan as plan_cmd   # serving planner: pure Python, MLflow when it logs
from sweeper.cli import profile as profile_cmd  # imports no JAX until the device count is set
from sweeper.cli import run as run_cmd   # Optuna, Ray, MLflow: imported when a sweep starts
from sweeper.cli import serve as serve_cmd   # Ray, JAX, MLflow: imported when a stream is served
from sweeper.cli import studies   # export, compare, schema: the analysis stack when they run
from sweeper.cli import sync   # imports no MLflow/Optuna until it runs
from sweeper.cli import trial as trial_cmd  # imports no JAX: bad input exits 2 before JAX starts
from sweeper.cli import options
from sweeper.sweep import stopping as sweep_stopping
from sweeper.sweep.stopping import Terminated   # SIGTERM's stop (stdlib only)
from sweeper.sweep.workers import ClusterLost   # (imports no Ray: that is lazy)
from sweeper.tracking.store_health import StoreLost   # (stdlib only)
from workloads.config import ConfigError
from workloads.hf_config import ModelApproximation


class _Parser(argparse.ArgumentParser):
    """argparse exits 2 on bad arguments already; keep its message to one line."""

    def error(self, message: str):  # noqa: D401
        self.exit(2, f"{self.prog}: {message}\n")


# ----------------------------------------------------------------- analytical (cost model)
def _add_analytical_commands(sub) -> None:
    """max-context, predict, recommend: the paper's analytical model (workloads/costmodel.py)."""
    analytical.add_parsers(sub)


# ----------------------------------------------------------------- engine
def _add_engine_commands(sub) -> None:
    """trial, host-profile, profile: the sharded JAX engine (workloads/engine.py,
    workloads/measure.py) and the op-level profile of a mesh (workloads/opprofile.py)."""
    p = sub.add_parser("trial", help="run one trial on an emulated mesh (or real devices) and "
                       "print its Measurement")
    p.add_argument("--config", required=True, metavar="TRIAL.yaml",
                   help="trial YAML (model, chips, topology, batch, input_len, decode_steps, "
                   "weights, prefill, decode, seed, repeats); see examples/trial.yaml")
    p.add_argument("--verify", action="store_true",
                   help="also run the unsharded reference: verify_max_abs_err, tokens_match")
    options.add_json(p, "the Measurement as JSON")
    p.set_defaults(handler=trial_cmd.trial)

    p = sub.add_parser("host-profile", help="this host's measured peak FLOP/s and bandwidths "
                       "(the `host` hardware profile; cached under $SWEEPER_HOME)")
    options.add_json(p, "as JSON")
    p.add_argument("--refresh", action="store_true", help="measure again, replacing the cache")
    p.set_defaults(handler=trial_cmd.host_profile)

    profile_cmd.add_parser(sub)
    calibrate_cmd.add_parser(sub)


# ----------------------------------------------------------------- sweeps
def _add_sweep_commands(sub) -> None:
    """run, ui, sync: Optuna controller over Ray workers, MLflow tracking (sweeper/sweep/controller.py)."""
    p = sub.add_parser("run", help="run a sweep from a search-space YAML")
    run_cmd.add_run_arguments(p)
    p.set_defaults(handler=run_cmd.cmd_run)
    p = sub.add_parser("examples", help="list the shipped search spaces (`sweeper run NAME` runs "
                       "one from anywhere; `sweeper examples NAME` prints its file)")
    examples.add_examples_arguments(p)
    p.set_defaults(handler=examples.cmd_examples)
    p = sub.add_parser("ui", help="open the MLflow UI on the sweeps' tracking store")
    run_cmd.add_ui_arguments(p)
    p.set_defaults(handler=run_cmd.cmd_ui)

    p = sub.add_parser("sync", help="log a study's trials that MLflow missed (tracking server "
                       "down) and remove duplicate runs; finish its parent run")
    sync.add_sync_arguments(p)
    p.set_defaults(handler=sync.cmd_sync)


# ----------------------------------------------------------------- analysis
def _add_analysis_commands(sub) -> None:
    """fit, pareto, report: calibration, Pareto frontiers, HTML report."""

    def study_args(p, mlflow: bool = True):
        p.add_argument("--study", required=True, help="study name (as `sweeper run` printed it)")
        options.add_storage(p)
        if mlflow:
            p.add_argument("--no-mlflow", action="store_true",
                           help="do not log to the sweep's MLflow parent run")
        options.add_json(p)

    # The analysis stack (pandas, scipy, matplotlib) is imported when one of these runs.
    def fit(args):
        if args.study is not None:      # else --measurements: a CSV, no study
            paths.check_study_name(args.study)
        from sweeper.cli.analysis import run_fit
        return run_fit(args)

    def pareto(args):
        paths.check_study_name(args.study)
        from sweeper.cli.analysis import run_pareto
        return run_pareto(args)

    def report(args):
        paths.check_study_name(args.study)
        from sweeper.analysis.report import check_out_dir   # --out a file: one line, exit 2
        check_out_dir(args.out)
        from sweeper.cli.analysis import run_report
        return run_report(args)

    p = sub.add_parser("fit", help="fit the cost model's hardware constants to a study's "
                       "measured trials (or a CSV of measurements taken elsewhere); report "
                       "held-out prediction error")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--study", help="study name (as `sweeper run` printed it)")
    source.add_argument("--measurements", metavar="FILE.csv", help="published measurements, one "
                        "row per number (format: workloads/measurements.py; e.g. "
                        "benchmarks/data/paper-tpu-v4.csv); needs --hardware")
    options.add_storage(p)
    p.add_argument("--no-mlflow", action="store_true",
                   help="do not log to the sweep's MLflow parent run")
    options.add_json(p)
    p.add_argument("--holdout", choices=["kfold", "layout", "chips", "extrapolation", "loo", "all"], default=None,
                   help="held-out points: k-fold over trials, leave-one-layout-out, "
                   "leave-one-chip-count-out, extrapolation (fit on chip counts <= n/2, predict "
                   "n), or all four (the first gives the headline); "
                   "with --measurements: loo (default) or kfold over configurations")
    p.add_argument("--out", metavar="FITTED.yaml", help="where to write the fitted hardware "
                   "profile (default: $SWEEPER_HOME/fits/<study>/<profile>-fitted.yaml)")
    p.add_argument("--hardware", help="starting profile (default: the one the sweep used; "
                   "required with --measurements: the chip the numbers were measured on)")
    p.add_argument("--loss", choices=["linear", "soft_l1", "huber"], default="linear",
                   help="least-squares loss on relative errors (default linear)")
    p.add_argument("--artifacts-dir", help="folder for the error table and plot")
    p.add_argument("--terms", metavar="select|none|T1,T2", default=None,
                   help="extra terms beyond the paper's constants (docs/calibration.md): a comma "
                   "list of term names (default with --study: the five the calibration sweep's "
                   "nested selection freed), none (the paper's constants; the default with "
                   "--measurements) or select (chosen per fit by nested cross-validation, each "
                   "held-out fold on its own training points: minutes)")
    p.set_defaults(handler=fit)

    p = sub.add_parser("pareto", help="latency/cost Pareto frontier of a study and its hypervolume")
    study_args(p, mlflow=False)
    p.add_argument("--phase", choices=["prefill", "decode"], default="decode")
    p.add_argument("--x", default="latency_per_token", help="metric on x (default: decode_step_s "
                   "for decode, prefill_s for prefill)")
    p.add_argument("--y", default="cost_chip_s_per_token", help="metric on y (default: the "
                   "phase's chip-seconds per token)")
    p.add_argument("--source", choices=["optuna", "mlflow"], default="optuna",
                   help="read the trials from Optuna storage or from the MLflow runs")
    options.add_tracking_uri(p, "MLflow store for --source mlflow", default="")
    p.add_argument("--reference", metavar="X,Y", help="hypervolume reference point "
                   "(default: 1.1 x the worst finished value on each axis)")
    p.add_argument("--csv", metavar="FILE", help="write the frontier as CSV")
    p.add_argument("--png", metavar="FILE", help="draw the frontier (log-log) as PNG")
    p.set_defaults(handler=pareto)

    p = sub.add_parser("report", help="one self-contained HTML report of a study (figures, "
                       "held-out error, recommended layouts)")
    study_args(p)
    p.add_argument("--out", required=True, metavar="DIR", help="folder for report.html")
    p.add_argument("--no-fit", action="store_true", help="leave out the calibration section")
    p.set_defaults(handler=report)

    p = sub.add_parser("export", help="a study's whole trial table (params, measured and "
                       "predicted metrics, state, reason) as CSV or Parquet")
    studies.add_export_arguments(p)
    p.set_defaults(handler=studies.cmd_export)

    p = sub.add_parser("compare", help="two studies side by side: frontier overlay per phase, "
                       "hypervolume of each (shared reference) and per-layout median latency change")
    studies.add_compare_arguments(p)
    p.set_defaults(handler=studies.cmd_compare)

    p = sub.add_parser("schema", help="print the JSON Schema of search-space files (for editors)")
    p.add_argument("--out", metavar="FILE", help="write it to FILE instead of stdout")
    p.set_defaults(handler=studies.cmd_schema)


def version() -> str:
    """The installed distribution's version (renamed `inference-sweeper`; older installs: `sweeper`)."""
    for name in ("inference-sweeper", "sweeper"):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="sweeper", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    _add_analytical_commands(sub)
    _add_engine_commands(sub)
    _add_sweep_commands(sub)
    _add_analysis_commands(sub)
    plan_cmd.add_parser(sub)
    serve_cmd.add_parser(sub)
    return parser


# commands that stop cleanly on SIGINT/SIGTERM (the sweep's Ray session, a served stream)
SIGNAL_COMMANDS = ("run", "serve")


def _stop_signals(stopping: list[int]) -> None:
    """SIGINT and SIGTERM stop a command once (the signal is appended to `stopping`: Ray may
    re-raise the exception as a plain KeyboardInterrupt); a repeated one while it records its
    in-flight trials and stops its workers is ignored (it would interrupt that clean-up)."""

    def stop(signum, _frame):
        if stopping:
            return
        stopping.append(signum)
        err = Terminated() if signum == signal.SIGTERM else KeyboardInterrupt()
        sweep_stopping.request(err)    # raised again by the sweep loop if this one is lost
        if sweep_stopping.holding():   # finishing what must be done whole: acted on after
            return
        raise err

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    default_hook = sys.unraisablehook

    def unraisable(info) -> None:
        # the stop raised inside a finalizer: Python drops it ("Exception ignored in",
        # a traceback); the sweep loop raises it again (sweeper.sweep.stopping)
        if not isinstance(info.exc_value, KeyboardInterrupt):
            default_hook(info)

    sys.unraisablehook = unraisable


def store_failure(err: BaseException) -> str | None:
    """One line for a store that stopped accepting writes mid-command (disk full, read-only
    file system or file), or None for any other error."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        text = str(err).lower()
        full = isinstance(err, OSError) and err.errno == errno.ENOSPC
        if full or "database or disk is full" in text or "no space left" in text:
            return "the disk is full"
        read_only = isinstance(err, OSError) and err.errno in (errno.EROFS, errno.EACCES)
        if read_only or "readonly database" in text or "disk i/o error" in text:
            return f"a store could not be written ({' '.join(str(err).split())[:160]})"
        err = err.__cause__ or err.__context__
    return None


def store_failure_advice(args: argparse.Namespace, err: BaseException) -> str:
    """What to run after a store failure, a command that works in the state it left
    (tests/test_advice.py runs each): `sweeper run` continues the study it created with
    --resume, or, when it failed before creating one (a disk too full for optuna.db), runs
    again as it was; any other command runs again (only `run` has --resume)."""
    if args.command != "run":
        return "run the same command again"
    study = getattr(err, "sweeper_study", None)      # set by the controller (None: no study)
    if args.resume:
        return "run the same command again"
    if study is None:
        return "run the same command again (no study was created)"
    if args.study:
        return "run the same command with --resume"
    return f"run the same command with --study {study} --resume"


def main(argv: list[str] | None = None) -> int:
    code = _main(argv)
    session = sys.modules.get("sweeper.sweep.session")     # (imported only where Ray started)
    if argv is None and session is not None:     # the command line, not a caller in-process
        session.exit_without_finalizing_if_abandoned(code)
    return code


def _show_warning(message, category, filename, lineno, file=None, line=None,
                  _default=warnings.showwarning):
    """A model approximation (workloads/hf_config.py) is one stderr line; others as Python shows them."""
    if issubclass(category, ModelApproximation):
        print(f"warning: {message}", file=sys.stderr)
        return
    _default(message, category, filename, lineno, file, line)


def _main(argv: list[str] | None) -> int:
    # JAX warns at every fork once it is imported; the forks here are Ray's and the
    # calibration's subprocesses, which exec at once (no JAX state is used in the child)
    warnings.filterwarnings("ignore", message=r"os\.fork\(\) was called", category=RuntimeWarning)
    warnings.showwarning = _show_warning
    parser = build_parser()
    args = parser.parse_args(argv)
    handler: Callable[[argparse.Namespace], int | None] = args.handler
    stopping: list[int] = []
    sweep_stopping.clear()
    if args.command in SIGNAL_COMMANDS:
        _stop_signals(stopping)
    try:
        return int(handler(args) or 0)
    except ConfigError as err:
        print(f"sweeper {args.command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as err:
        term = isinstance(err, Terminated) or signal.SIGTERM in stopping[:1]
        if args.command == "serve":     # (a stream's stop is handled by cmd_serve: this is
            # before the stream started, or after it was recorded)
            name = "terminated (SIGTERM)" if term else "interrupted (SIGINT)"
            print(f"sweeper serve: {name} before a stream was served; nothing was served or "
                  "logged", file=sys.stderr)
            return 143 if term else 130
        if not term:
            print("interrupted", file=sys.stderr)
            return 130
        print(f"sweeper {args.command}: terminated (SIGTERM); in-flight trials are recorded as "
              "interrupted: --resume runs them again", file=sys.stderr)
        return 143
    except BrokenPipeError:  # `sweeper ... | head`: the reader left; not an error of ours
        sys.stderr.close()
        return 0
    except StoreLost as err:       # a store deleted or damaged mid-sweep (store_health.py)
        print(f"sweeper {args.command}: error: {err}", file=sys.stderr)
        return 1
    except ClusterLost as err:
        if args.command == "serve":     # (no trial, no study: nothing to resume)
            print(f"sweeper serve: error: {err}; nothing was served", file=sys.stderr)
            return 3
        print(f"sweeper {args.command}: error: {err}; trials that were in flight are recorded "
              "as interrupted: --resume runs them again", file=sys.stderr)
        return 3
    except Exception as err:  # noqa: BLE001 - only a store failure is turned into one line
        reason = store_failure(err)
        if reason is None:
            raise
        print(f"sweeper {args.command}: error: {reason}; what was recorded before is kept: fix "
              f"it, then {store_failure_advice(args, err)}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
