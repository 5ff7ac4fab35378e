"""Run every benchmark and write `benchmarks/results/summary.md` (what `make bench` runs).

    python -m benchmarks.run_all [--out DIR] [--quick]

Order: the host profile is measured afresh (so every MFU in this run uses one peak), then
engine efficiency, sweep overhead (which also runs the quickstart), calibration and search
efficiency (both on the recorded calibration sweep, benchmarks/data/: no measurement), the
paper fit, the planner's speed, the serving validation, the example outputs the pages show
(`benchmarks.examples`), and last `benchmarks.readme_numbers`, which regenerates summary.md
(every target with its measured value) and every number quoted in README.md and docs/ from
the results files. Each
runs in its own process, one after the other, so a failure in one is reported and the others
still run; the step table (exit code, minutes) is printed at the end.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

from benchmarks import common, report

ROOT = Path(__file__).resolve().parents[1]


def run(module: str, args: list[str]) -> tuple[int, float]:
    start = time.perf_counter()
    print(f"\n=== {module} {' '.join(args)}", file=sys.stderr, flush=True)
    rc = subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT).returncode
    return rc, time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(common.RESULTS))
    parser.add_argument("--quick", action="store_true", help="fewer sizes, trials and seeds")
    parser.add_argument("--skip", default="", help="comma-separated steps to skip, keeping their "
                        "results from an earlier run (engine_efficiency, sweep_overhead, calibration, "
                        "profile_predict, search_efficiency, paper_fit, world, plan_speed, "
                        "serving_validation, examples)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    from workloads import hostprofile

    hostprofile.host_profile(refresh=not args.skip)   # one fresh peak for every MFU of this run
    quick = ["--quick"] if args.quick else []
    skip = set(filter(None, args.skip.split(",")))
    runs: dict[str, tuple[int, float]] = {}

    def step(name: str, argv: list[str]) -> None:
        if name in skip:
            return
        runs[name] = run(f"benchmarks.{name}", argv)

    step("engine_efficiency", ["--out", str(out), *quick])
    step("sweep_overhead", ["--out", str(out)] + (["--trials", "20"] if args.quick else []))
    # calibration and search efficiency use the recorded calibration sweep (benchmarks/data/)
    step("calibration", ["--out", str(out)])
    # the committed op-level profile (benchmarks/data/) alone against the same sweep
    step("profile_predict", ["--out", str(out)])
    step("search_efficiency", ["--out", str(out), "--gp-seeds", "3"]
         + (["--seeds", "3"] if args.quick else ["--seeds", "10"]))
    # the cost model on the paper's published numbers (no measurement), the planner's speed,
    # and the serving model against real serving runs of the engine on this host (~5 min)
    step("paper_fit", ["--out", str(out)])
    # the presets on real engines' published numbers; writes the fitted presets it ships
    step("world", ["--out", str(out)])
    step("plan_speed", ["--out", str(out)] + (["--repeats", "2"] if args.quick else []))
    step("serving_validation", ["--out", str(out)])
    # the example outputs README.md and docs/ show: each command run as a user types it
    step("examples", ["--out", str(out)])
    # summary.md, the README's and docs/' numbers: all generated from the results files
    step("readme_numbers", ["--results", str(out)])
    print("\n".join(report.table(["step", "exit code", "minutes"],
                                 [[name, rc, f"{seconds / 60:.1f}"] for name, (rc, seconds) in runs.items()])))
    return 0 if all(rc == 0 for rc, _ in runs.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
