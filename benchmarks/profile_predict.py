"""Benchmark: how well does an op-level profile alone predict the calibration sweep?

    python -m benchmarks.profile_predict                     # the committed profile
    python -m benchmarks.profile_predict --profile FILE.yaml [--devices N]
    python -m benchmarks.profile_predict --measure           # run `sweeper profile --chips 8
                                                             #   --quick` once first

The profile (`sweeper profile`, workloads/opprofile.py) times single collectives, matmuls and
memory reads; it never ran a whole trial, so every recorded calibration point
(benchmarks/data/calibration-trials.csv) is held out by construction: no trial-level fit.
Beside it: the unprofiled host profile the sweep predicted with (calibration-host.yaml) and
the trial-level fit's held-out k-fold from benchmarks/results/calibration.json.

Shares: the profile is per device of an N-device mesh that had the whole host, so the whole
host is the profile x N; each trial's chip gets its recorded share of that
(`hardware_share`, docs/architecture.md "Hardware profiles and shares"), bandwidths measured
by group size included (HardwareProfile.scaled).
Writes benchmarks/results/profile_predict.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd

from benchmarks import common, harness

ROOT, DATA = common.ROOT, common.DATA
PROFILE = DATA / "opprofile-host-8.yaml"
PROFILE_META = DATA / "opprofile-host-8.json"
TRIALS = DATA / "calibration-trials.csv"
HOST = DATA / "calibration-host.yaml"
CALIBRATION = common.RESULTS / "calibration.json"


def measure(out: Path, devices: int) -> dict:
    """Run `sweeper profile --chips N --quick` once; the load average before and after."""
    start = common.load_average()
    cmd = [sys.executable, "-m", "sweeper.cli", "profile", "--chips", str(devices), "--quick",
           "--out", str(out)]
    subprocess.run(cmd, check=True, cwd=ROOT)
    meta = {"command": " ".join(["sweeper"] + cmd[3:]), "load_average_start": start,
            "load_average_stop": common.load_average()}
    out.with_suffix(".json").write_text(json.dumps(meta, indent=2))
    return meta


def profile_devices(path: Path) -> int:
    """N of the mesh the profile was measured on (its header: `sweeper profile --chips N`)."""
    match = re.search(r"sweeper profile --chips (\d+)", path.read_text())
    if not match:
        raise SystemExit(f"benchmarks.profile_predict: {path}: no `sweeper profile --chips N` header; "
                         "pass --devices N")
    return int(match.group(1))


def errors(points, whole_host) -> pd.DataFrame:
    from sweeper.analysis import fit as calfit
    from sweeper.analysis import holdout as calho

    predicted = np.array([calfit.predict_point(p, whole_host) for p in points])
    return calho.point_frame(points, predicted)


def summary(df: pd.DataFrame) -> dict:
    from sweeper.analysis import holdout as calho

    top1, near, tau, groups = calho.ranking_agreement(df)
    stats = lambda s: {"n": int(len(s)), "mape": float(s.mean()), "median": float(s.median()),  # noqa: E731
                       "max": float(s.max())}
    signed = df["predicted_s"] / df["measured_s"] - 1
    return {**stats(df["ape"]), "top1": top1, "top1_within_5pct": near, "kendall_tau": tau,
            "ranking_groups": groups,
            "by_phase": {ph: stats(g["ape"]) for ph, g in df.groupby("phase")},
            "by_phase_chips": [{"phase": ph, "chips": int(c), **stats(g["ape"]),
                                "median_signed": float(signed[g.index].median())}
                               for (ph, c), g in df.groupby(["phase", "chips"])]}


def evaluate(profile_path: Path, devices: int) -> dict:
    from sweeper.analysis import fit as calfit
    from workloads.hardware import load_hardware

    frame = pd.read_csv(TRIALS)
    profile = load_hardware(str(profile_path), field="profile")
    # Profiles written before `sweeper profile` stored the whole host were per device of N.
    per_device = "# Per device." in profile_path.read_text()
    whole_host = profile.scaled(devices) if per_device else profile
    host = load_hardware(str(HOST), field="hardware")
    points = calfit.points_from_frame(frame, host)      # scales: the recorded hardware_share
    out = {"profile": str(profile_path.relative_to(ROOT)) if profile_path.is_relative_to(ROOT)
           else str(profile_path), "profile_devices": devices, "n_points": len(points),
           "profiled": summary(errors(points, whole_host)),
           "host_unprofiled": summary(errors(points, host)),
           "profiled_scalar_only": summary(errors(points, calfit.without_group_measurements(whole_host)))}
    meta_path = profile_path.with_suffix(".json")
    out["profiling"] = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
    if CALIBRATION.is_file():
        cal = json.loads(CALIBRATION.read_text())
        k = cal["holdouts"]["kfold"]
        out["fit_kfold"] = {"n": k["n_points"], "mape": k["mape_heldout"],
                            "median": k["median_ape_heldout"], "max": k["max_ape_heldout"],
                            "top1": k["top1_agreement"], "ranking_groups": k["ranking_groups"],
                            "by_phase_chips": k["attribution"]["by_chips"]}
        out["noise_floor"] = cal.get("noise_floor")
    return out


def arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--profile", default=str(PROFILE), help="profile YAML to predict with")
    parser.add_argument("--devices", type=int, help="mesh size it was measured on (default: its header)")
    parser.add_argument("--measure", action="store_true",
                        help=f"run `sweeper profile --chips 8 --quick --out {PROFILE.name}` first")


def run(args: argparse.Namespace, previous: dict | None) -> dict:
    path = Path(args.profile)
    if args.measure:
        print(json.dumps(measure(path, args.devices or 8)), file=sys.stderr)
    return evaluate(path, args.devices or profile_devices(path))


BENCHMARK = harness.Benchmark("profile_predict", __doc__.splitlines()[0], run, arguments=arguments)


if __name__ == "__main__":
    sys.exit(harness.main(BENCHMARK))
