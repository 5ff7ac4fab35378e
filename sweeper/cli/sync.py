"""`sweeper sync`: reconcile a study's MLflow runs with its Optuna trials (sweeper/tracking/sync.py)."""

from __future__ import annotations

import argparse
import sys

from sweeper import paths
from sweeper.cli import options
from sweeper.cli.output import print_json
from sweeper.tracking.mlflow_log import store_error
from sweeper.tracking.sync import sync_study
from workloads.config import ConfigError


def add_sync_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--study", required=True, help="study name (as `sweeper run` printed it)")
    options.add_storage(p)
    options.add_tracking_uri(p, default="default: the one the sweep logged to")
    options.add_json(p)


def cmd_sync(args: argparse.Namespace) -> int:
    if args.storage is not None:
        paths.check_storage_url(args.storage)
    paths.check_study_name(args.study)
    try:
        report = sync_study(args.study, args.storage, args.tracking_uri)
    except ConfigError:
        raise
    except Exception as err:  # noqa: BLE001 - MLflow still unreachable: say so in one line
        print(f"sweeper sync: error: the MLflow store failed ({store_error(err)}); nothing is "
              "lost, run it again when it answers (and accepts writes)", file=sys.stderr)
        return 1
    if args.json:
        print_json(report.to_json())
        return 0
    for path in report.moved_aside:
        print(f"moved    a damaged store aside to {path}")
    if report.optuna_rebuilt is not None:
        lost = f", {report.optuna_lost} with no run recorded FAIL (lost)" if report.optuna_lost else ""
        print(f"optuna   study {report.study} rebuilt from {report.optuna_rebuilt} MLflow runs"
              f"{lost}")
    print(f"study    {report.study}: {report.trials} finished trials; MLflow: "
          f"{report.present} already logged, {len(report.created)} logged now, "
          f"{len(report.removed)} duplicate or incomplete runs removed")
    print(f"mlflow   {report.tracking_uri}  parent run {report.parent_run_id} "
          f"({'created, ' if report.parent_created else ''}{report.parent_status})")
    return 0
