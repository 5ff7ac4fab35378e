"""`sweeper export`, `sweeper compare`, `sweeper schema`: a study as a file, two studies
side by side, the JSON Schema of space files. Libraries: sweeper/analysis/export.py,
sweeper/analysis/compare.py, sweeper/spec/schema.py."""

from __future__ import annotations

import argparse
import json
import math
import sys

from sweeper.cli import options
from sweeper.cli.output import print_json
from sweeper.formatting import jsonable, percent_dash, short_number
from sweeper.spec.schema import space_schema
from workloads.config import ConfigError

EXPORT_FORMATS = ("csv", "parquet")


def add_export_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--study", required=True, help="study name (as `sweeper run` printed it)")
    options.add_storage(p)
    p.add_argument("--format", choices=EXPORT_FORMATS, default="csv", help="csv (default) or parquet")
    p.add_argument("--out", metavar="FILE", help="where to write (default: <study>.<format>; "
                   "'-' writes CSV to stdout)")


def cmd_export(args: argparse.Namespace) -> int:
    from sweeper.analysis import export   # lazy: pandas (the analysis stack)
    from sweeper.tracking.results import load_trials   # lazy: Optuna (~1 s) after the checks

    if not args.study.strip():
        raise ConfigError("--study", args.study, "a study name")
    out = args.out or export.default_path(args.study, args.format)
    df = load_trials(args.study, args.storage)
    written = export.write_table(df, args.format, out)
    if written:
        print(f"{len(df)} trials x {len(df.columns)} columns of study {args.study} -> {written}")
    return 0


def add_compare_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("study_a", metavar="STUDY_A", help="the baseline study")
    p.add_argument("study_b", metavar="STUDY_B", help="the study to compare with it")
    options.add_storage(p, "Optuna RDB URL of both studies")
    p.add_argument("--storage-b", help="Optuna RDB URL of STUDY_B if it is stored elsewhere")
    p.add_argument("--out", metavar="DIR", help="folder for the overlay plots "
                   "(compare-<phase>.png; default: no plots)")
    options.add_json(p)


def cmd_compare(args: argparse.Namespace) -> int:
    from sweeper.analysis import compare as cmp   # lazy: pandas and matplotlib
    from sweeper.tracking.results import load_trials   # lazy: Optuna (~1 s)

    a = load_trials(args.study_a, args.storage)
    b = load_trials(args.study_b, args.storage_b or args.storage)
    result = cmp.compare(a, b, args.study_a, args.study_b)
    figures = cmp.write_figures(result, a, b, args.out) if args.out else {}
    if args.json:
        print_json(jsonable({**result.to_dict(), "figures": figures}))
        return 0
    print(format_comparison(result))
    for phase, path in figures.items():
        print(f"{phase} overlay: {path}")
    return 0


def format_comparison(result) -> str:
    lines = [f"{result.study_b} vs {result.study_a} ({result.source_label})"]
    for phase, comp in result.phases.items():
        hv_a, hv_b, change = comp.a.hypervolume, comp.b.hypervolume, comp.hypervolume_change
        rel = change / hv_a if hv_a and math.isfinite(hv_a) else math.nan
        lines.append(f"{phase}: frontier of {comp.x} vs {comp.y}; hypervolume against the shared "
                     f"reference ({short_number(comp.reference[0])}, {short_number(comp.reference[1])})")
        lines.append(f"  {result.study_a}: {short_number(hv_a)} ({len(comp.a.front)} of {comp.a.n_points} "
                     f"on the frontier)   {result.study_b}: {short_number(hv_b)} ({len(comp.b.front)} "
                     f"of {comp.b.n_points})   change {short_number(change)} ({_signed(rel)})")
        lines.append(f"  {'layout':<14} {'n A':>4} {'median A':>10} {'n B':>4} {'median B':>10} "
                     f"{'change':>8}   ({comp.x}, lower is better)")
        for row in comp.layouts.itertuples():
            lines.append(f"  {row.layout:<14} {row.n_a:>4} {short_number(row.median_a):>10} "
                         f"{row.n_b:>4} {short_number(row.median_b):>10} {_signed(row.change):>8}")
    return "\n".join(lines)


def _signed(fraction: float) -> str:
    if fraction is None or not math.isfinite(fraction):
        return "—"
    return ("+" if fraction > 0 else "") + percent_dash(fraction)


def cmd_schema(args: argparse.Namespace) -> int:
    text = json.dumps(space_schema(), indent=2)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text + "\n")
        print(f"JSON Schema of space files -> {args.out}", file=sys.stderr)
    else:
        print(text)
    return 0
