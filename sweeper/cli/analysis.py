"""`sweeper fit`, `sweeper pareto`, `sweeper report`: run the analysis library, print its results.

The library (sweeper/analysis/) returns data; these handlers format and print it.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

from sweeper.analysis import calibrate as cal
from sweeper.analysis import holdout
from sweeper.analysis import pareto, plots
from sweeper.analysis import report as report_mod
from sweeper.cli.output import print_json
from sweeper.formatting import jsonable, percent_dash
from sweeper.paths import study_dir, sweeper_home
from workloads.config import ConfigError
from workloads.hardware import load_hardware


# ----------------------------------------------------------------------------- fit


def format_calibration(result: holdout.Calibration) -> str:
    lines = [f"study {result.study}: {len(result.points)} measured points "
             f"({len({p.trial for p in result.points})} trials x prefill, decode)",
             f"fitted constants (start -> fitted), profile {result.fitted.name}:"]
    for key in ("peak_flops", "hbm_bandwidth", "ici_bandwidth"):
        lines.append(f"  {key:<22} {getattr(result.base, key):.4g} -> {getattr(result.fitted, key):.4g}")
    by_kind = getattr(result.fitted, "collective_latency_s_by_kind", {}) or {}
    if by_kind:
        for kind, value in by_kind.items():
            lines.append(f"  latency[{kind}]{'':<{max(0, 13 - len(kind))}} {value * 1e6:.3g} us")
    else:
        lines.append(f"  collective_latency_s   {result.fitted.collective_latency_s * 1e6:.3g} us")
    lines.append(f"  op_overhead_s          {result.fitted.op_overhead_s * 1e6:.3g} us per layer")
    lines.append(f"  overlap                {result.fitted.overlap:.3f}")
    for term in result.terms:       # the extra terms freed (docs/calibration.md)
        lines.append(f"  {term:<22} {getattr(result.fitted, term):.4g}")
    if not result.terms:
        lines.append("  extra terms            none (the paper's constants)")
    lines.append(f"in-sample MAPE {percent_dash(float(result.insample['ape'].mean()))} (not a claim; "
                 "held-out below)")
    noise = result.noise
    if noise is not None and noise.n_points:
        lines.append(f"noise floor (one measurement's error: {noise.groups} configurations measured "
                     f"more than once, each trial against the median of the others / sqrt(1 + 1/(n-1))): "
                     f"MAPE {percent_dash(noise.mape)}, median {percent_dash(noise.median_ape)} over "
                     f"{noise.n_points} points; against replicate means {percent_dash(noise.mean_mape)}")
    else:
        lines.append("noise floor: unknown (no configuration measured twice; add `seed: [0, 1]`)")
    lines.append("points weighted by their measured 95% CI" if result.weighted else
                 "points weighted equally")
    header = f"{'hold-out':<13} {'points':>6} {'MAPE':>7} {'median':>7} {'max':>7} {'noise':>7} " \
             f"{'top-1':>6} {'top-1~5%':>8} {'tau':>6} {'groups':>6}"
    lines.append(header + "   (noise: replicate MAPE of the same held-out points)")
    notes = []
    for name, ho in result.holdouts.items():
        if ho.skipped:
            lines.append(f"{name:<13} skipped: {ho.skipped}")
            continue
        tau = f"{ho.kendall_tau:.2f}" if math.isfinite(ho.kendall_tau) else "—"
        floor = percent_dash(ho.noise.mape) if ho.noise else "—"
        lines.append(f"{name:<13} {len(ho.points):>6} {percent_dash(ho.mape):>7} {percent_dash(ho.median_ape):>7} "
                     f"{percent_dash(ho.max_ape):>7} {floor:>7} {percent_dash(ho.top1_agreement):>6} "
                     f"{percent_dash(ho.top1_within_tolerance):>8} {tau:>6} {ho.groups:>6}")
        if ho.noise is not None and ho.noise.n_points:
            lines.append(f"{'':<13} against replicate means: MAPE {percent_dash(ho.mape_vs_mean)}, "
                         f"median {percent_dash(ho.median_vs_mean)} (floor {percent_dash(ho.noise.mean_mape)})")
        notes += [f"  {name}: {c}" for c in ho.caveats]
    if notes:
        lines.append("not a verdict:")
        lines.extend(notes)
    lines.append(f"per phase and layout ({result.headline}):")
    for _, row in result.main.errors.iterrows():
        lines.append(f"  {row['phase']:<8} {row['layout']:<14} n={row['n']:<4} MAPE {percent_dash(row['mape']):>6} "
                     f"median {percent_dash(row['median_ape']):>6} max {percent_dash(row['max_ape']):>6}")
    return "\n".join(lines)


def run_fit(args) -> int:
    """`sweeper fit`: fit, evaluate on held-out points, write the YAML, log to MLflow."""
    if args.measurements:
        return run_fit_measurements(args)
    if args.holdout == "loo":
        raise ConfigError("--holdout", "loo", "kfold, layout, chips, extrapolation or all with --study "
                          "(loo is for --measurements)")
    schemes = holdout.HOLDOUTS if args.holdout == "all" else (args.holdout or "kfold",)
    from sweeper.analysis.fit import STUDY_TERMS

    terms = holdout.parse_terms(args.terms) if args.terms else STUDY_TERMS
    data = cal.load_study_data(args.study, args.storage)
    base = load_hardware(args.hardware, field="--hardware") if args.hardware else None
    result = cal.calibrate_study(data, schemes, base, args.loss, terms=terms)
    out_dir = Path(args.artifacts_dir) if args.artifacts_dir else study_dir("fits", args.study)
    files = cal.write_outputs(result, out_dir, args.out)
    refused = result.refused
    logged = False
    if not args.no_mlflow:
        try:
            logged = cal.log_to_mlflow(result, files)
        except Exception as err:  # noqa: BLE001 - the fit is done; say why logging failed
            print(f"sweeper fit: MLflow logging failed: {err}", file=sys.stderr)
    if args.json:
        out = jsonable(result.summary())
        out["mlflow_logged"] = logged
        print_json(out)
    else:
        print(format_calibration(result))
        if not refused:
            print(f"fitted profile: {files['fitted_yaml']} (use it with --hardware)")
        print(f"error table, plot: {out_dir}" + (f"; logged to MLflow run {result.parent_run_id}"
                                                 if logged else ""))
    return _refusal(refused)


def _refusal(reason: str | None) -> int:
    """A fit whose worst held-out fold blew up is not published: one line on stderr, no
    profile written. Exit 0: the evaluation itself succeeded (its tables and JSON are the
    result; `refused` in --json says why there is no profile)."""
    if reason is not None:
        print(f"sweeper fit: {reason} (no fitted profile written; the error tables are)",
              file=sys.stderr)
    return 0


def run_fit_measurements(args) -> int:
    """`sweeper fit --measurements FILE.csv --hardware H`: the same fit and JSON keys as a
    study's, on published numbers (sweeper/analysis/external.py)."""
    from sweeper.analysis import external   # the analysis stack (scipy), as for --study

    if not args.hardware:
        raise ConfigError("--hardware", None, "the profile the measurements were taken on "
                          "(a preset such as tpu-v4, or a hardware YAML) with --measurements")
    if args.holdout not in (None, "all", *external.EXTERNAL_HOLDOUTS):
        raise ConfigError("--holdout", args.holdout, "loo, kfold or all with --measurements")
    holdouts = (external.EXTERNAL_HOLDOUTS if args.holdout == "all"
                else (args.holdout or "loo",))
    terms = holdout.parse_terms(args.terms or "none")
    base = load_hardware(args.hardware, field="--hardware")
    from sweeper.analysis.fit import MEASUREMENT_CANDIDATES

    result = external.calibrate_measurements(args.measurements, base, holdouts, args.loss, terms,
                                             candidates=MEASUREMENT_CANDIDATES)
    out = Path(args.out) if args.out else (sweeper_home(create=True) / "fits"
                                           / Path(args.measurements).stem / f"{result.fitted.name}.yaml")
    refused = result.refused
    if not refused:
        cal.write_profile(result.fitted, out, note=(
        f"fitted by `sweeper fit --measurements {args.measurements} --hardware {args.hardware}` "
        f"({len(result.points)} rows); held-out MAPE {percent_dash(result.main.mape)} "
            f"({external.EXTERNAL_HOLDOUT_TEXT[result.headline]})"))
        result.artifacts = {"fitted_yaml": str(out)}
    if args.json:
        data = jsonable(result.summary())
        data["mlflow_logged"] = False     # no sweep, no parent run to log to
        print_json(data)
        return _refusal(refused)
    print(format_calibration(result).replace("measured points", "published rows", 1)
          .replace("trials x prefill, decode", "configurations", 1))
    print("per row (held out):")
    for _, row in result.main.points.iterrows():
        print(f"  row {row['row']:>3} {row['metric']:<9} measured {row['measured']:<9.4g} "
              f"predicted {row['predicted']:<9.4g} {row['relative_error']:+7.1%}  {row['source']}")
    if not refused:
        print(f"fitted profile: {out} (use it with --hardware)")
    return _refusal(refused)


# ----------------------------------------------------------------------------- pareto


def run_pareto(args) -> int:
    """`sweeper pareto`: the frontier table (or JSON), optionally as CSV and PNG."""
    reference = None
    if args.reference:
        try:
            reference = tuple(float(v) for v in args.reference.split(","))
            assert len(reference) == 2
        except (ValueError, AssertionError):
            raise ConfigError("--reference", args.reference, "two numbers X,Y") from None
    df = pareto.load_points(args.study, args.source, args.storage, args.tracking_uri)
    result = pareto.analyse(df, args.phase, args.x, args.y, reference)
    if args.csv:
        result.table().to_csv(args.csv, index=False)
    if args.png:
        label = plots.source_label_of(df)
        with open(args.png, "wb") as fh:
            fh.write(plots.png_bytes(plots.pareto_phase_figure(df, args.phase, result.x,
                                                               result.y, label)))
    if args.json:
        out = result.to_dict()
        out.update({"study": args.study, "read_from": args.source})
        print_json(out)
        return 0
    goal = {m: "max" if m in pareto.MAXIMISED else "min" for m in (result.x, result.y)}
    hv = (f"hypervolume {result.hypervolume:.4g} against reference ({result.reference[0]:.4g}, "
          f"{result.reference[1]:.4g})" if math.isfinite(result.hypervolume)
          else "no hypervolume (defined here for two minimised metrics)")
    print(f"study {args.study} (read from {args.source}), {args.phase}: {len(result.front)} of "
          f"{result.n_points} finished trials on the frontier of {result.x} ({goal[result.x]}) "
          f"vs {result.y} ({goal[result.y]}); {hv}")
    if len(result.front):
        print(result.table().to_string(index=False))
    for path, what in ((args.csv, "csv"), (args.png, "png")):
        if path:
            print(f"{what}: {path}")
    return 0


# ----------------------------------------------------------------------------- report


def run_report(args) -> int:
    """`sweeper report`."""
    data = cal.load_study_data(args.study, args.storage)
    figures = report_mod.start_figures(data)     # drawn while the calibration is fitted
    try:
        calibration, fit_error = ((None, "skipped (--no-fit)") if args.no_fit
                                  else report_mod.try_calibrate(data))
        if calibration is not None:
            files = cal.write_outputs(calibration, Path(args.out) / "calibration",
                                      source_label=figures.label)
            if not args.no_mlflow:
                try:
                    cal.log_to_mlflow(calibration, files)
                except Exception as err:  # noqa: BLE001
                    print(f"sweeper report: MLflow logging failed: {err}", file=sys.stderr)
        report = report_mod.write_report(data, args.out, calibration, fit_error, figures)
    finally:
        figures.close()
    if not args.no_mlflow:
        try:
            report.logged = report_mod.log_report(report, data)
        except Exception as err:  # noqa: BLE001
            print(f"sweeper report: MLflow logging failed: {err}", file=sys.stderr)
    if args.json:
        print_json({"report": str(report.path), "figures": {k: str(v) for k, v in report.figures.items()},
                    "calibrated": calibration is not None, "fit_error": fit_error,
                    "logged_to_mlflow": report.logged, "parent_run_id": data.parent_run_id})
    else:
        print(f"report: {report.path}" + (f" (also on MLflow run {data.parent_run_id}, artifacts/report)"
                                          if report.logged else ""))
        if fit_error:
            print(f"calibration: {fit_error}")
    return 0
