"""The sweep report: one self-contained HTML page (figures inlined as base64 PNG).

    sweeper report --study NAME --out DIR      -> DIR/report.html (+ the PNGs beside it)

Sections: the Pareto frontier per phase (paper Fig. 1 style, log-log, frontier points
labelled batch/chips/layout), MFU against tokens per batch per FFN layout (Fig. 7 style),
latency against chips per layout (Fig. 6 style), held-out predicted vs measured with the
error table (sweeper/analysis/calibrate.py), and the recommended layout per regime. Every measured
number is labelled "measured on this host (emulated mesh)" (or the devices it ran on) and
every cost-model number "analytical". The template is `sweeper/dashboards/report.html.j2` (package data).

`summarize_sweep` is what `sweeper run` calls at the end: Pareto tables, held-out error,
report path; each part that cannot be computed says why instead of failing the sweep.
"""

from __future__ import annotations

import base64
import math
import multiprocessing
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
import jinja2

from sweeper.analysis import calibrate as cal
from sweeper.analysis import holdout
from sweeper.analysis import pareto
from sweeper.analysis import optuna_views, plots
from sweeper.analysis.fit import STUDY_TERMS, CalibrationError
from sweeper.formatting import jsonable, percent_dash, short_number
from sweeper.paths import study_dir
from workloads.config import ConfigError
from workloads.metrics import SERVING_PREDICTIONS

TEMPLATE_DIR = Path(__file__).resolve().parents[1] / "dashboards"   # sweeper/dashboards: package data
TEMPLATE = "report.html.j2"
REPORT_FILE = "report.html"
FIGURES = ("pareto", "mfu", "latency", "importance", "parallel", "hypervolume", "predicted")


def _source_sentence(source: str, hardware: str) -> str:
    if source == "analytical":
        return (f"predictions of the analytical cost model for the profile <code>{hardware}</code>; "
                "nothing here was run.")
    if hardware.startswith("devices"):
        return f"wall-clock medians measured on this machine's accelerators ({hardware})."
    return ("wall-clock medians measured on <b>this host</b>: an emulated mesh of virtual XLA CPU "
            "devices sharing its cores. They are timings of this machine, not of a TPU or GPU; "
            "MFU is relative to this host's measured peak.")


_fmt = short_number


def _table(df: pd.DataFrame, columns: list[str] | None = None) -> dict[str, Any]:
    columns = columns or list(df.columns)
    return {"columns": columns, "rows": [[_fmt(row[c]) for c in columns] for _, row in df.iterrows()]}


LATENCY_COL = "latency [s]"
COST_COL = "cost [chip·s/token]"


def regimes_table(df: pd.DataFrame) -> pd.DataFrame:
    """Per phase, frontier points for three regimes (paper Tables 2 and 3)."""
    rows = []
    for phase in pareto.PHASES:
        x, y = pareto.resolve_axes(phase)
        front = pareto.pareto_front(pareto.finished(df), phase=phase)
        if front.empty:
            continue
        picks = {"lowest latency": front[x].idxmin(), "lowest cost": front[y].idxmin(),
                 "knee (min latency × cost)": (front[x] * front[y]).idxmin()}
        for regime, i in picks.items():
            r = front.loc[i]
            rows.append({"phase": phase, "regime": regime,
                         "layout": pareto.layout_label(r, phase), "batch": r.get("batch"),
                         "chips": r.get("chips"), "topology": r.get("topology"),
                         "weights": r.get("weights"), "latency metric": x, LATENCY_COL: r[x],
                         COST_COL: r[y], "trial": r.get("number")})
    return pd.DataFrame(rows)


def _model_pick(held: pd.DataFrame, phase: str, chips, batch) -> tuple[str, set[str]] | None:
    """The held-out model's pick for a group and the layouts the formulas tie with it."""
    sel = held[(held["phase"] == phase) & (held["chips"] == chips) & (held["batch"] == batch)]
    if sel.empty:
        return None
    sel = sel.assign(key=sel["layout"] + "@" + sel["topology"])
    if "tie_s" not in sel:
        sel = sel.assign(tie_s=sel["predicted_s"])
    per = sel.groupby("key").agg(predicted_s=("predicted_s", "median"), tie_s=("tie_s", "median"))
    pick = per["predicted_s"].idxmin()
    tied = set(per.index[abs(per["tie_s"] / per.loc[pick, "tie_s"] - 1) <= holdout.PREDICTED_TIE])
    return pick, tied


def best_layouts_table(df: pd.DataFrame, held: pd.DataFrame | None) -> pd.DataFrame:
    """Measured-best layout per (phase, chips, batch); the held-out model's pick beside it.

    The pick counts as agreeing when the measured best is among the layouts the formulas
    predict equal to it (as in calibrate.ranking_agreement)."""
    rows = []
    done = pareto.finished(df)
    for phase in pareto.PHASES:
        x, _ = pareto.resolve_axes(phase)
        ffn, attn = pareto.layout_columns(phase)
        pts = done[pd.to_numeric(done[x], errors="coerce").notna()] if x in done else done.iloc[0:0]
        if pts.empty:
            continue
        pts = pts.assign(key=pts[ffn].astype(str) + "/" + pts[attn].astype(str)
                         + "@" + pts["topology"].astype(str))
        for (chips, batch), grp in pts.groupby(["chips", "batch"]):
            per = grp.groupby("key")[x].median().sort_values()
            row = {"phase": phase, "chips": int(chips), "batch": int(batch),
                   "best layout (measured)": per.index[0], LATENCY_COL: float(per.iloc[0]),
                   "layouts compared": len(per),
                   "runner-up": per.index[1] if len(per) > 1 else "—",
                   "margin": percent_dash(float(per.iloc[1] / per.iloc[0] - 1)) if len(per) > 1 else "—"}
            if held is not None and len(held):
                found = _model_pick(held, phase, chips, batch)
                if found is not None:
                    pick, tied = found
                    row["model's pick (held-out, analytical)"] = pick
                    if len(per) < 2:
                        row["agree"] = "—"
                    elif tied >= set(per.index):
                        row["agree"] = "tie: all predicted equal"
                    elif per.index[0] in tied:
                        row["agree"] = "yes" if len(tied) == 1 else f"yes (tied with {len(tied) - 1})"
                    else:
                        row["agree"] = "no"
            rows.append(row)
    return pd.DataFrame(rows)


def _varying(table: pd.DataFrame, keep: tuple[str, ...]) -> pd.DataFrame:
    """Drop columns with one value across the study (model, lengths...), keep the metrics."""
    cols = [c for c in table.columns if c in keep or table[c].astype(str).nunique() > 1]
    return table[cols]


def _fit_context(result: holdout.Calibration) -> dict[str, Any]:
    schemes = []
    for name, ho in result.holdouts.items():
        tau = f"{ho.kendall_tau:.2f}" if math.isfinite(ho.kendall_tau) else "—"
        schemes.append({"name": name if not ho.skipped else f"{name} (skipped: {ho.skipped})",
                        "n_points": len(ho.points), "mape": percent_dash(ho.mape),
                        "median": percent_dash(ho.median_ape), "max": percent_dash(ho.max_ape),
                        "top1": percent_dash(ho.top1_agreement),
                        "top1_tol": percent_dash(ho.top1_within_tolerance), "tau": tau,
                        "groups": ho.groups,
                        "noise": percent_dash(ho.noise.mape) if ho.noise else "—",
                        "caveats": "; ".join(ho.caveats) or "—"})
    errors = result.main.errors.copy()
    for col in ("mape", "median_ape", "max_ape"):
        errors[col] = errors[col].map(percent_dash)
    constants = []
    for key in ("peak_flops", "hbm_bandwidth", "ici_bandwidth", "collective_latency_s",
                "op_overhead_s", "overlap"):
        constants.append((key, _fmt(float(getattr(result.base, key))),
                          _fmt(float(getattr(result.fitted, key)))))
    for kind, value in (getattr(result.fitted, "collective_latency_s_by_kind", {}) or {}).items():
        constants.append((f"collective latency [{kind}] (s)", "0", _fmt(float(value))))
    table = _table(errors)
    noise = result.noise
    noise_text = (f"{noise.groups} configurations measured in more than one trial, each trial "
                  f"against the median of the others: MAPE {percent_dash(noise.mape)}, median "
                  f"{percent_dash(noise.median_ape)} over {noise.n_points} points"
                  if noise is not None and noise.n_points else
                  "unknown: no configuration was measured twice")
    return {"holdout_desc": "; ".join(holdout.HOLDOUT_TEXT[n] for n in result.holdouts),
            "noise": noise_text,
            "n_points": len(result.points), "n_trials": len({p.trial for p in result.points}),
            "schemes": schemes, "table_scheme": holdout.HOLDOUT_TEXT[result.headline],
            "error_columns": table["columns"], "error_rows": table["rows"],
            "constants": constants}


def source_and_hardware(df: pd.DataFrame, attrs: dict[str, Any]) -> tuple[str, str]:
    """Where a study's numbers come from (`measured`/`analytical`) and its hardware label."""
    source = str(attrs.get("source") or (df["source"].dropna().iloc[0] if df["source"].notna().any()
                                          else "measured"))
    hardware = str(attrs.get("hardware") or (df["hardware"].dropna().iloc[0]
                                             if df["hardware"].notna().any() else "host"))
    return source, hardware


TABLE_PARTS = ("pareto", "mfu", "latency", "optuna")
# The parts a forked child draws while this process fits the calibration; this process draws
# the others once the fit is done (about even shares of the quickstart's analysis on 2 cores:
# docs/performance.md, "Sweep overhead").
FORKED_PARTS = ("latency", "optuna")
CHILD_TIMEOUT_S = 120     # the child's parts take a few seconds; past this, drawn here


def table_figures(df: pd.DataFrame, label: str, parts: tuple[str, ...] = TABLE_PARTS
                  ) -> tuple[dict[str, Any], dict[str, bytes]]:
    """What the report draws from the study table alone (no calibration), the `parts` of it
    named: the Pareto, MFU and latency figures, Optuna's views (fANOVA, parallel coordinates,
    hypervolume history: `optuna`); their template context ({} without `optuna`) and PNGs."""
    figures = {"pareto": plots.pareto_figure, "mfu": plots.mfu_figure,
               "latency": plots.latency_figure}
    pngs = {name: plots.png_bytes(figures[name](df, label)) for name in figures if name in parts}
    views: dict[str, Any] = {}
    if "optuna" in parts:
        views, view_pngs = optuna_context(df, label)
        pngs.update(view_pngs)
    return views, pngs


class TableFigures:
    """`table_figures`, drawn in a forked process while this one fits the calibration
    (docs/performance.md, "Sweep overhead": about half of the analysis, all of it Python,
    which threads would not run in parallel). Drawn in this process instead, by `result`,
    where forking is unsafe or pointless: no `fork` start method, one usable core, or JAX
    imported (its threads). A child that fails or dies is drawn again here, so its error,
    if any, is raised where the report is rendered. Same bytes either way."""

    def __init__(self, df: pd.DataFrame, label: str):
        self.df, self.label = df, label
        self._child = None
        if _can_fork():
            context = multiprocessing.get_context("fork")
            receive, send = context.Pipe(duplex=False)
            process = context.Process(target=_draw_in_child, args=(send, df, label, FORKED_PARTS),
                                      name="sweeper-report-figures", daemon=True)
            process.start()
            send.close()
            self._child = (process, receive)

    def result(self) -> tuple[dict[str, Any], dict[str, bytes]]:
        """The template context and every PNG of `table_figures`, in its order."""
        if self._child is None:
            return table_figures(self.df, self.label)
        process, receive = self._child
        self._child = None
        try:
            _, here = table_figures(self.df, self.label,
                                    tuple(p for p in TABLE_PARTS if p not in FORKED_PARTS))
            # a child stuck on a lock some thread held at the fork would never answer
            drawn = receive.recv() if receive.poll(CHILD_TIMEOUT_S) else None
        except (EOFError, OSError):       # the child died: draw its parts here
            drawn = None
        finally:
            receive.close()
            if process.is_alive() and drawn is None:
                process.terminate()
            process.join()
        if drawn is None:
            drawn = table_figures(self.df, self.label, FORKED_PARTS)
        views, pngs = drawn
        pngs = {**here, **pngs}
        return views, {name: pngs[name] for name in FIGURES if name in pngs}

    def close(self) -> None:
        """Stop a child whose figures are no longer wanted (the analysis failed first)."""
        if self._child is not None:
            process, receive = self._child
            self._child = None
            process.terminate()
            process.join()
            receive.close()


def _can_fork() -> bool:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return ("fork" in multiprocessing.get_all_start_methods() and (cores or 1) > 1
            and "jax" not in sys.modules)


def _draw_in_child(send, df: pd.DataFrame, label: str, parts: tuple[str, ...]) -> None:
    try:
        drawn = table_figures(df, label, parts)
    except BaseException:  # noqa: BLE001 - the parent draws again and raises it there
        drawn = None
    send.send(drawn)
    send.close()


def render(df: pd.DataFrame, *, study: str, attrs: dict[str, Any],
           calibration: holdout.Calibration | None, fit_error: str | None,
           parent_run_id: str | None = None,
           figures: TableFigures | None = None) -> tuple[str, dict[str, bytes]]:
    """The HTML text and the PNG bytes of every figure. `figures`: the table's figures,
    started earlier (`TableFigures`); drawn here otherwise."""
    source, hardware = source_and_hardware(df, attrs)
    label = plots.source_label(source, hardware)
    views, pngs = figures.result() if figures is not None else table_figures(df, label)
    if calibration is not None:
        pngs["predicted"] = cal.predicted_png(calibration, label)
    pareto_ctx = []
    for phase in pareto.PHASES:
        res = pareto.analyse(df, phase)
        table = (_table(_varying(res.table(), ("number", "batch", "chips", res.x, res.y, "label")))
                 if len(res.front) else {"columns": [], "rows": []})
        pareto_ctx.append({"phase": phase, "n_front": len(res.front), "n_points": res.n_points,
                           "hypervolume": res.hypervolume, "reference": res.reference, **table})
    states = df["state"].astype(str).str.upper()
    counts = {"total": len(df), "complete": int((states == "COMPLETE").sum()),
              "pruned": int((states == "PRUNED").sum()), "failed": int((states == "FAIL").sum())}
    held = calibration.main.points if calibration is not None else None
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(TEMPLATE_DIR)),
                             autoescape=jinja2.select_autoescape(["html", "j2"]),
                             undefined=jinja2.StrictUndefined)
    html = env.get_template(TEMPLATE).render(
        study=study, generated=time.strftime("%Y-%m-%d %H:%M:%S"), counts=counts,
        models=", ".join(sorted(df["model"].dropna().astype(str).unique())) or "—",
        hardware=hardware, parent_run_id=parent_run_id,
        source_tag="analytical" if source == "analytical" else "measured",
        source_class="analytical" if source == "analytical" else "measured",
        source_sentence=jinja2.utils.markupsafe.Markup(_source_sentence(source, hardware)),
        pareto_note=("x: latency (decode: decode_step_s per generated token; prefill: prefill_s "
                     "for the whole prompt), y: chip-seconds per token, both minimised; "
                     "hypervolume against 1.1 x the worst finished value on each axis."),
        images={k: base64.b64encode(v).decode("ascii") for k, v in pngs.items()},
        pareto=pareto_ctx, fit=_fit_context(calibration) if calibration else None,
        fit_error=fit_error or "", regimes=_table(regimes_table(df)) if len(df) else _table(pd.DataFrame()),
        best_layouts=_table(best_layouts_table(df, held)), optuna=views)
    return html, pngs


def optuna_context(df: pd.DataFrame, label: str) -> tuple[dict[str, Any], dict[str, bytes]]:
    """Optuna's analyses (sweeper/analysis/optuna_views.py): template context and PNGs."""
    importances = [optuna_views.param_importance(df, phase) for phase in pareto.PHASES]
    rows = [{"phase": r.phase, "target": f"log10 {r.metric}", "parameter": name,
             "importance": percent_dash(value), "trials": r.n_trials}
            for r in importances for name, value in r.importances.items()]
    rows += [{"phase": r.phase, "target": f"log10 {r.metric}", "parameter": "—",
              "importance": f"not computed: {r.skipped}", "trials": r.n_trials}
             for r in importances if r.skipped]
    history = optuna_views.hypervolume_history(df)
    finals = history.groupby("phase")["hypervolume"].last() if len(history) else {}
    evaluator = next((r.evaluator for r in importances if r.evaluator), "fANOVA")
    pngs = {"importance": plots.png_bytes(optuna_views.importance_figure(importances, label)),
            "parallel": plots.png_bytes(optuna_views.parallel_coordinates_figure(df, label)),
            "hypervolume": plots.png_bytes(optuna_views.hypervolume_figure(history, label))}
    context = {"evaluator": evaluator,
               "importance": _table(pd.DataFrame(rows, columns=["phase", "target", "parameter",
                                                                "importance", "trials"])),
               "hv_note": "Final: " + ", ".join(f"{p} {short_number(float(v))}"
                                                for p, v in dict(finals).items()) + "."
               if len(finals) else ""}
    return context, pngs


@dataclass
class Report:
    path: Path
    figures: dict[str, Path]
    calibration: holdout.Calibration | None
    fit_error: str | None
    logged: bool = False
    files: dict[str, str] = field(default_factory=dict)


def check_out_dir(out_dir: str | Path, field: str = "--out") -> Path:
    """A folder the report can be written to: an existing folder, or one that can be created
    (its nearest existing parent is a writable folder). Checked before the study is read."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ConfigError(field, str(out_dir), "a folder for report.html (this is a file; "
                          "name a folder, new or existing)")
    existing = out
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir() or not os.access(existing, os.W_OK):
        raise ConfigError(field, str(out_dir), f"a folder this user can create or write "
                          f"({existing} is {'not a folder' if not existing.is_dir() else 'not writable'})")
    return out


def write_report(data: cal.StudyData, out_dir: str | Path, calibration: holdout.Calibration | None = None,
                 fit_error: str | None = None, figures: TableFigures | None = None) -> Report:
    """`figures`: the table's figures started before the calibration (`start_figures`)."""
    out_dir = check_out_dir(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    html, pngs = render(data.frame, study=data.name, attrs=data.attrs, calibration=calibration,
                        fit_error=fit_error, parent_run_id=data.parent_run_id, figures=figures)
    figures = {}
    for name, blob in pngs.items():
        figures[name] = out_dir / f"{name}.png"
        figures[name].write_bytes(blob)
    path = out_dir / REPORT_FILE
    path.write_text(html, encoding="utf-8")
    return Report(path, figures, calibration, fit_error)


def start_figures(data: cal.StudyData) -> TableFigures:
    """The report's figures that need no calibration, started now (`TableFigures`)."""
    return TableFigures(data.frame, plots.source_label(*source_and_hardware(data.frame, data.attrs)))


def try_calibrate(data: cal.StudyData) -> tuple[holdout.Calibration | None, str | None]:
    """Every hold-out scheme, with `sweeper fit --study`'s default extra terms
    (fit.STUDY_TERMS); a study that cannot be fitted gives the reason instead."""
    try:
        return cal.calibrate_study(data, holdout.HOLDOUTS, terms=STUDY_TERMS), None
    except CalibrationError as err:
        return None, str(err)


def log_report(report: Report, data: cal.StudyData) -> bool:
    """The HTML and its figures as artifacts of the sweep's parent run (`report/`)."""
    if not (data.parent_run_id and data.tracking_uri):
        return False
    from mlflow.tracking import MlflowClient   # lazy: MLflow (~1 s) only when a store is read

    client = MlflowClient(tracking_uri=data.tracking_uri)
    client.log_artifact(data.parent_run_id, str(report.path), artifact_path="report")
    for path in report.figures.values():
        client.log_artifact(data.parent_run_id, str(path), artifact_path="report")
    return True


def serving_prediction_error(frame: pd.DataFrame) -> dict[str, dict[str, float]]:
    """Serving trials (docs/space-files.md "Serving trials"): per percentile, how far the
    serving model's prediction (`pred_<metric>`, analytical) is from the measured one over the
    complete trials that have both: n, the median of |pred - measured| / measured and the
    median signed error. {} for a study without serving trials."""
    out: dict[str, dict[str, float]] = {}
    complete = frame[frame["state"] == "COMPLETE"] if "state" in frame else frame
    for predicted in SERVING_PREDICTIONS:
        measured = predicted.removeprefix("pred_")
        if predicted not in complete or measured not in complete:
            continue
        both = complete[[measured, predicted]].apply(pd.to_numeric, errors="coerce").dropna()
        both = both[both[measured] > 0]
        if both.empty:
            continue
        signed = (both[predicted] - both[measured]) / both[measured]
        out[measured] = {"n": int(len(both)), "median_ape": float(signed.abs().median()),
                         "median_signed_error": float(signed.median())}
    return out


def summarize_sweep(study: str, storage: str | None = None, tracking_uri: str | None = None,
                    out_dir: str | Path | None = None, log: bool = True) -> dict[str, Any]:
    """What `sweeper run` prints at the end: Pareto tables, held-out error, report path.

    Calibrates (all three hold-out schemes) when the study has enough measured trials,
    writes the fitted profile and the report under `out_dir` (default
    $SWEEPER_HOME/reports/<study>) and logs both to the sweep's MLflow parent run.
    """
    data = cal.load_study_data(study, storage)
    if tracking_uri and not data.attrs.get("tracking_uri"):
        data.attrs["tracking_uri"] = tracking_uri
    out_dir = Path(out_dir) if out_dir else study_dir("reports", study)
    figures = start_figures(data)       # drawn while the calibration is fitted
    try:
        calibration, fit_error = try_calibrate(data)
        errors: list[str] = []
        if calibration is not None:
            files = cal.write_outputs(calibration, out_dir / "calibration",
                                      source_label=figures.label)
            if log:
                try:
                    cal.log_to_mlflow(calibration, files)
                except Exception as err:  # noqa: BLE001 - the numbers are computed; say why
                    errors.append(f"MLflow (calibration): {err}")
        report = write_report(data, out_dir, calibration, fit_error, figures)
    finally:
        figures.close()
    if log:
        try:
            report.logged = log_report(report, data)
        except Exception as err:  # noqa: BLE001
            errors.append(f"MLflow (report): {err}")
    fronts = {phase: pareto.analyse(data.frame, phase).to_dict() for phase in pareto.PHASES}
    return {"study": study, "pareto": fronts, "serving": serving_prediction_error(data.frame),
            "heldout": jsonable(calibration.summary()) if calibration else {"skipped": fit_error},
            "fitted_yaml": calibration.artifacts.get("fitted_yaml") if calibration else None,
            "report": str(report.path), "logged_to_mlflow": report.logged,
            "parent_run_id": data.parent_run_id, "errors": errors}
