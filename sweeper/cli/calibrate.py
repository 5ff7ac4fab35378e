"""`sweeper calibrate`: measure this host once (docs/host-calibration.md)."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

from sweeper.cli import options
from sweeper.formatting import jsonable
from workloads.config import ConfigError


def add_parser(sub) -> None:
    p = sub.add_parser("calibrate", help="measure this host once (microbenchmarks and real "
                       "trials of random probe models, about 5 minutes on 2 cores); every "
                       "`--hardware host` prediction uses the profile it writes")
    p.add_argument("--quick", action="store_true",
                   help="fewer probes and microbenchmarks (about a minute; a rougher profile)")
    p.add_argument("--out", metavar="FILE.yaml", help="where to write the profile (default "
                   "$SWEEPER_HOME/calibration/host.yaml, the one `host` resolves to)")
    p.add_argument("--no-serving", action="store_true",
                   help="skip the serving loop's host costs (sweeper serve's per-step costs)")
    p.add_argument("--check", action="store_true",
                   help="measure again a few of the calibration's probe trials (about a "
                   "minute) and say how far this host now runs from it; writes nothing "
                   "(the profile: --out's, else this host's)")
    options.add_json(p)
    p.set_defaults(handler=calibrate)


def calibrate(args) -> int:
    out = Path(args.out) if args.out else None
    if out is not None and out.suffix not in (".yaml", ".yml"):
        raise ConfigError("--out", str(out), "a path ending in .yaml or .yml")
    if args.check:
        return check(args, out)
    from sweeper.calibrate import tasks
    from sweeper.calibrate.calibrate import calibrate as run   # JAX-free: workers import it

    serving = None
    if not args.no_serving:
        from sweeper.calibrate.serving import measure as serving
    progress = None if args.json else (lambda line: print(line, file=sys.stderr, flush=True))
    result = run(tasks.QUICK if args.quick else tasks.FULL, quick=args.quick, out=out,
                 progress=progress, serving=serving)
    if args.json:
        print(json.dumps(jsonable(summary(result)), indent=2))
    else:
        print(format_summary(result))
    return 0


def check(args, path: Path | None) -> int:
    from sweeper.calibrate.check import check as run, format_check

    progress = None if args.json else (lambda line: print(line, file=sys.stderr, flush=True))
    result = run(path, progress=progress)
    print(json.dumps(jsonable(result), indent=2) if args.json else format_check(result))
    return 0


def serving_line(profile) -> str | None:
    """What the serving loop's probes measured (the costs a plan charges beyond the engine's
    calls, and the spread its band draws from); None where they were skipped."""
    from sweeper.serving.bands import serving_spread
    from workloads.serving.costs import HostCosts

    c = profile.host_costs
    if c == HostCosts():
        return None
    ms = lambda s: f"{s * 1e3:.2f} ms"        # noqa: E731
    text = (f"  serving loop (probe deployments): +{ms(c.step_overhead_s)} per decode step; a "
            f"prefill on a loop idle {ms(c.prefill_wake_idle_s)} +{ms(c.prefill_wake_s)}")
    if c.slice_wake_s:
        text += f" (a prefill slice's: +{ms(c.slice_wake_s)})"
    if c.decode_after_wake_s:
        text += f", the decode steps after it +{ms(c.decode_after_wake_s)}"
    _, steps = serving_spread(profile, "aggregated")
    if steps:
        text += f"; decode steps' spread: 99.5th percentile x{max(steps):.2f} the mean"
    return text


def summary(result) -> dict:
    cal = result.profile.calibration
    return {"profile": str(result.path), "points": str(result.points_path),
            "elapsed_s": result.elapsed_s, "calibration": cal,
            "heldout": {ph: {"mape": statistics.fmean(map(abs, e)) if e else None,
                             "median_ape": statistics.median(map(abs, e)) if e else None,
                             "n": len(e)} for ph, e in result.fit.heldout.items()},
            "costs": result.fit.model.costs, "device_factors": result.fit.model.device_factors,
            "host_costs": result.profile.host_costs.to_dict(),
            "microbench_prior": result.micro.prior(),
            "failed": [{"task": f["task"], "error": f.get("error")} for f in result.failed]}


def format_summary(result) -> str:
    cal = result.profile.calibration
    lines = [f"calibrated this host in {result.elapsed_s:.0f} s: {cal['probe_trials']} probe "
             f"trials of {cal['probe_models']} models (random, and the ladder's) on "
             f"{cal['chips']} emulated chips (seed {cal['probe_seed']}), load "
             f"{cal['load_average_1min'][0]} -> "
             f"{cal['load_average_1min'][1]}"]
    for phase, errs in result.fit.heldout.items():
        if errs:
            ape = sorted(abs(e) for e in errs)
            lines.append(f"  {phase:<8} held-out error (each probe model predicted by a fit "
                         f"without it): MAPE {statistics.fmean(ape):.1%}, median "
                         f"{statistics.median(ape):.1%}, worst {ape[-1]:.0%} over {len(ape)} trials")
    factors = result.fit.model.device_factors or {}
    if factors:
        lines.append("  mesh factors (each mesh's probes against the shared costs): " + "; ".join(
            f"{phase} " + ", ".join(f"x{f:.2f} on {n} devices" for n, f in table.items())
            for phase, table in factors.items()))
    serving = serving_line(result.profile)
    if serving:
        lines.append(serving)
    if result.failed:
        lines.append(f"  {len(result.failed)} measurement(s) failed (kept in the points file), "
                     f"first: {result.failed[0].get('error', '')[:100]}")
    lines.append(f"profile  {result.path}   (every `hardware: host` / `--hardware host` uses it)")
    lines.append(f"points   {result.points_path}")
    return "\n".join(lines)
