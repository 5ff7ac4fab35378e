"""`sweeper run` and `sweeper ui`: the command-line side of sweeps (the parser is in sweeper/cli/__init__.py)."""

from __future__ import annotations

import argparse
import math
import os
import sys

from sweeper import paths
from sweeper.cli import options
from sweeper.cli.output import print_json, say_profile
from sweeper.formatting import metric_text, one_line, percent_dash, short_number
from sweeper.spec.overrides import load_space_with_overrides
from workloads.config import ConfigError
from workloads.validate import integer, positive_int


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("space", help="search-space YAML, or the name of a shipped one (e.g. "
                   "quickstart; `sweeper examples` lists them)")
    p.add_argument("--address", help="an existing Ray cluster (default: start a local one)")
    options.add_storage(p)
    options.add_tracking_uri(p, "MLflow tracking URI")
    p.add_argument("--study", help="study name (default: <space name>-<date-time>)")
    p.add_argument("--resume", action="store_true",
                   help="continue a study (--study, else the latest of this space)")
    p.add_argument("--trials", type=int, help="override the space's trial count")
    p.add_argument("--parallel", type=int, help="override the space's trials in flight")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a field of the space file before it is validated: KEY a "
                   "dotted path (params.batch, sampler.type, objectives.0.metric), VALUE YAML "
                   "(e.g. --set params.batch=[4,8] --set trials=10); repeatable")
    options.add_json(p, "the result as one JSON object")
    p.add_argument("--no-analysis", action="store_true",
                   help="skip the end-of-sweep analysis (calibration, report)")


def cmd_run(args: argparse.Namespace) -> int:
    # the controller imports Optuna, Ray and MLflow where it uses them
    from sweeper.sweep.controller import run_sweep   # lazy: Ray, Optuna, MLflow behind it

    # every input error (in the file or a --set override) exits 2 here, before any work
    space = load_space_with_overrides(paths.resolve_space(args.space), args.set)
    for flag in ("trials", "parallel"):
        if getattr(args, flag) is not None:
            positive_int(f"--{flag}", getattr(args, flag))
    # (run_sweep checks --storage, --tracking-uri, --address and --study before it starts,
    # then names the host profile the predictions use)
    named = (lambda: say_profile(space.hardware.resolve())) if space.hardware.kind == "host" \
        else None
    result = run_sweep(space, storage=args.storage, tracking_uri=args.tracking_uri,
                       study_name=args.study, resume=args.resume, trials=args.trials,
                       parallel=args.parallel, address=args.address, progress=True,
                       after_trials=None if args.no_analysis else import_analysis,
                       on_start=named)
    summary = None
    if not args.no_analysis:
        summary = end_of_sweep_analysis(result)
    if args.json:
        print_json({**result.to_json(), **({"analysis": summary} if summary else {})})
    else:
        print(render_result(result))
        if summary:
            print()
            print(format_sweep_summary(summary))
    return 0


def format_sweep_summary(summary: dict) -> str:
    """Readable lines for the end of `sweeper run`."""
    lines = []
    for phase, front in summary["pareto"].items():
        if not front["n_points"] and summary.get("serving"):
            continue        # a serving study has no prefill/decode batch points
        lines.append(f"{phase} Pareto frontier ({front['x']} vs {front['y']}): "
                     f"{front['n_front']} of {front['n_points']} trials, hypervolume "
                     f"{short_number(front['hypervolume'])}")
        for row in front["front"]:
            lines.append(f"  #{row.get('number')!s:<4} {row['label']:<28} {front['x']}={short_number(row[front['x']])}"
                         f"  {front['y']}={short_number(row[front['y']])}")
    serving = summary.get("serving") or {}
    if serving:
        errors = ", ".join(f"{metric} {percent_dash(e['median_ape'])} ({e['median_signed_error']:+.0%})"
                           for metric, e in serving.items())
        n = max(e["n"] for e in serving.values())
        lines.append(f"serving model vs measured, median |error| (signed) over {n} "
                     f"trials: {errors} (host: step times and host costs measured before each "
                     f"stream, docs/serving.md \"Serving trials in `sweeper run`\"; each "
                     f"trial's pred_* beside its measured values: `sweeper export`)")
    held = summary["heldout"]
    if "skipped" not in held:
        for name, ho in held["holdouts"].items():
            if ho.get("skipped"):
                lines.append(f"held-out ({name}): skipped, {ho['skipped']}")
                continue
            lines.append(heldout_line(name, ho))
        lines.append(fitted_profile_line(summary))
    elif not serving:   # (a serving study: the cost model is fitted to prefill/decode trials)
        lines.append(f"held-out prediction error: not computed ({held['skipped']})")
    lines.append(f"report: {summary['report']}")
    for err in summary.get("errors", []):
        lines.append(f"warning: {err}")
    return "\n".join(lines)


def fitted_profile_line(summary: dict) -> str:
    """Where the fitted profile is, or (one line) why none was written: `sweeper fit` refuses
    to publish a fit whose worst held-out fold blew up (sweeper/analysis/holdout.py)."""
    if summary.get("fitted_yaml"):
        return f"fitted profile: {summary['fitted_yaml']}"
    why = summary.get("heldout", {}).get("refused") or "no profile was written"
    return f"fitted profile: refused, not written ({' '.join(str(why).split())})"


def heldout_line(name: str, ho: dict) -> str:
    """One hold-out scheme's figures, the noise floor beside the error and, in the same line,
    why a figure is not a verdict (`caveats`, sweeper/analysis/holdout.py: too few ranking
    groups, or a noise floor comparable to the error)."""
    floor = _num(ho.get("noise_floor_mape"))
    noise = (f"noise floor {percent_dash(floor)}" if math.isfinite(floor)
             else "noise floor unknown")
    line = (f"held-out ({name}): MAPE {percent_dash(_num(ho['mape_heldout']))} ({noise}), median "
            f"{percent_dash(_num(ho['median_ape_heldout']))}, max "
            f"{percent_dash(_num(ho['max_ape_heldout']))}, top-1 layout agreement "
            f"{percent_dash(_num(ho['top1_agreement']))} over {ho['ranking_groups']} groups")
    caveats = ho.get("caveats") or []
    return line + (f" (not a verdict: {'; '.join(caveats)})" if caveats else "")


def _num(value) -> float:
    return math.nan if value is None else float(value)


def import_analysis() -> None:
    """The end-of-sweep analysis's imports, which the controller runs in a thread while the
    sweep shuts down (docs/performance.md, "Start-up and shutdown")."""
    import sweeper.analysis.report  # noqa: F401 - lazy: pandas, scipy, matplotlib (~2 s)


def end_of_sweep_analysis(result) -> dict | None:
    """Pareto frontiers, held-out prediction error of the fitted cost model and the HTML
    report (also logged on the parent MLflow run). The sweep's results are stored already:
    a failure here is reported on stderr and does not fail the command."""
    from sweeper.analysis.report import summarize_sweep   # pandas, scipy, matplotlib

    try:
        return summarize_sweep(result.study_name, result.storage, result.tracking_uri)
    except Exception as err:  # noqa: BLE001
        print(f"sweeper: end-of-sweep analysis failed ({one_line(err)[:300]}); the trials are "
              f"stored: sweeper report --study {result.study_name} --out DIR", file=sys.stderr)
        return None


def render_result(result) -> str:
    """The Pareto table and where the study and the MLflow runs are."""
    lines = []
    objectives = ", ".join(f"{d} {m}" for m, d in result.objectives)
    c = result.counts
    lines.append(f"Pareto-optimal trials ({objectives}): {len(result.pareto)} of "
                 f"{c['complete']} complete")
    if result.pareto:
        metrics = [m for m, _ in result.objectives]
        shown = [k for k in ("input_len", "decode_steps", "serving_mode") if k in result.searched]
        header = ["#", *metrics, "batch", "chips", *shown, "topology", "weights", "prefill",
                  "decode"]
        rows = [[str(r["number"]), *[metric_text(m, r[m]) for m in metrics], str(r["batch"]),
                 str(r["chips"]), *[str(r[k]) for k in shown], str(r["topology"]),
                 str(r["weights"]), f"{r['prefill_ffn']}/{r['prefill_attn']}",
                 f"{r['decode_ffn']}/{r['decode_attn']}"]
                for r in result.pareto]
        widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(header)]
        lines.append("  ".join(h.ljust(w) for h, w in zip(header, widths)))
        lines.extend("  ".join(v.ljust(w) for v, w in zip(row, widths)) for row in rows)
    label = "host timings (emulated mesh)" if result.source == "measured" else "cost-model predictions"
    lines.append("")
    failed = f"{c['failed']} failed"
    if result.interrupted:
        failed += f" ({result.interrupted} interrupted and run again)"
    lines.append(f"study    {result.study_name}: {c['complete']} complete, {failed}, "
                 f"{c['pruned']} pruned ({label}) in {result.elapsed_s:.0f}s")
    lines.append(f"optuna   {result.storage}")
    parent = result.parent_run_id or "not created yet (MLflow unreachable)"
    lines.append(f"mlflow   {result.tracking_uri}  experiment '{result.experiment}', parent run "
                 f"{parent}")
    ui = "sweeper ui" if result.tracking_uri == paths.default_tracking_uri(create=False) else \
        f"sweeper ui --tracking-uri {result.tracking_uri}"
    lines.append(f"browse   {ui}   then open {experiment_url(result.experiment_id)}")
    if result.tracking_errors:
        lines.append(f"warning  {len(result.tracking_errors)} MLflow logging errors; first: "
                     f"{result.tracking_errors[0]}")
    if result.mlflow_missing:
        lines.append(f"warning  {result.mlflow_missing} trials are in Optuna but not yet in MLflow: "
                     f"sweeper sync --study {result.study_name} --storage {result.storage}")
    return "\n".join(lines)


def experiment_url(experiment_id: str | None, host: str = "127.0.0.1", port: int = 5000) -> str:
    """The experiment's runs table in the MLflow UI (MLflow 3 opens a GenAI view otherwise)."""
    base = f"http://{host}:{port}"
    if not experiment_id:
        return base
    return f"{base}/#/experiments/{experiment_id}/runs?workflowType=machine_learning"


def add_ui_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--port", type=int, default=5000, help="port (default 5000)")
    p.add_argument("--host", default="127.0.0.1", help="interface (default 127.0.0.1)")
    options.add_tracking_uri(p)


def ui_command(tracking_uri: str, host: str, port: int) -> list[str]:
    cmd = [sys.executable, "-m", "mlflow", "ui", "--backend-store-uri", tracking_uri,
           "--host", host, "--port", str(port)]
    root = paths.artifact_root(tracking_uri)
    if root:
        cmd += ["--default-artifact-root", root]
    return cmd


def cmd_ui(args: argparse.Namespace) -> int:
    integer("--port", args.port, maximum=65535, what="a TCP port 1-65535")
    uri = args.tracking_uri or paths.default_tracking_uri(create=False)
    db = paths.sqlite_path(uri)
    if db is not None and not db.is_file():
        raise ConfigError("--tracking-uri", uri, "an MLflow store with runs (no such file: no "
                          "sweep has used it; set SWEEPER_HOME or --tracking-uri to the one a "
                          "sweep used)")
    print(f"MLflow UI for {uri} at http://{args.host}:{args.port}  (Ctrl-C to stop); runs of an "
          f"experiment: {experiment_url('<id>', args.host, args.port)}", file=sys.stderr)
    sys.stderr.flush()
    cmd = ui_command(uri, args.host, args.port)
    os.execv(cmd[0], cmd)      # become the server: signals (Ctrl-C, kill) reach it directly
