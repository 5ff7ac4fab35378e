"""Optuna's analyses of a sweep, for the report: parameter importance, a parallel-coordinate
view and hypervolume against trial number (issue 14, item 6).

All three are computed from the study table (`sweeper.tracking.results` columns), so a
study read from Optuna, from MLflow or built by a test gives the same views:

- importance: `optuna.importance.get_param_importances` with Optuna's default fANOVA
  evaluator (it fits scikit-learn's random forest; scikit-learn comes with MLflow), on an
  in-memory study holding the finished trials, one per phase, with target log10 of the
  phase's latency (`decode_step_s`, `prefill_s`): latencies span orders of magnitude and
  layouts and chips change them by factors, which a log makes additive. Only parameters
  that vary among those trials are scored; a parameter the space fixed has no importance;
- parallel coordinates: one line per finished trial through its varying parameters and
  the phase's latency (log), coloured by that latency; matplotlib's object API, like
  sweeper/analysis/plots.py (plotly is not a dependency);
- hypervolume after each trial number, per phase, against the final reference (1.1 x the
  worst finished value over the whole study), so the curve ends at the hypervolume the
  report's Pareto section gives.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pandas as pd
import matplotlib
from matplotlib import colors, ticker

from sweeper.analysis import pareto, plots
from sweeper.tracking.results import PARAM_COLUMNS

MIN_TRIALS = 3          # fewer finished trials give no importance worth showing


def _python(value):
    """Plain Python values for Optuna's distributions (no numpy or pandas scalars)."""
    if isinstance(value, (np.integer,)):
        return int(value)
    if isinstance(value, (np.floating,)):
        return float(value)
    return value


def finished_points(df: pd.DataFrame, metric: str) -> pd.DataFrame:
    """Finished trials with a finite positive value of `metric`."""
    done = pareto.finished(df)
    if metric not in done:
        return done.iloc[0:0]
    values = pd.to_numeric(done[metric], errors="coerce")
    return done[np.isfinite(values) & (values > 0)]


def varying_params(points: pd.DataFrame) -> list[str]:
    """Searched parameters that take more than one value among these trials."""
    return [p for p in PARAM_COLUMNS if p in points and points[p].dropna().nunique() > 1]


# ----------------------------------------------------------------------------- importance


@dataclass
class Importance:
    phase: str
    metric: str
    n_trials: int
    importances: dict[str, float]      # parameter -> share of the variance (sums to 1)
    evaluator: str
    skipped: str | None = None


def param_importance(df: pd.DataFrame, phase: str, seed: int = 0) -> Importance:
    """fANOVA importance of each varying parameter for log10(latency) of the phase."""
    metric = pareto.resolve_axes(phase)[0]
    points = finished_points(df, metric)
    names = varying_params(points)
    if len(points) < MIN_TRIALS or not names:
        why = (f"{len(points)} finished trials (at least {MIN_TRIALS} needed)"
               if len(points) < MIN_TRIALS else "no parameter varies among the finished trials")
        return Importance(phase, metric, len(points), {}, "", skipped=why)
    import optuna   # lazy: Optuna (~1 s) only when a report is rendered
    from optuna.distributions import CategoricalDistribution
    from optuna.importance import FanovaImportanceEvaluator, PedAnovaImportanceEvaluator

    distributions = {n: CategoricalDistribution(sorted({_python(v) for v in points[n].dropna()},
                                                       key=str)) for n in names}
    trials = [optuna.trial.create_trial(
        params={n: _python(row[n]) for n in names}, distributions=distributions,
        value=math.log10(float(row[metric]))) for _, row in points.iterrows()
        if all(pd.notna(row[n]) for n in names)]
    verbosity = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.WARNING)   # no "study created" line per report
    try:
        study = optuna.create_study(direction="minimize")
    finally:
        optuna.logging.set_verbosity(verbosity)
    study.add_trials(trials)
    try:
        import sklearn  # noqa: F401   # lazy: fANOVA's random forest (an MLflow dependency)
        evaluator, label = FanovaImportanceEvaluator(seed=seed), "fANOVA"
    except ImportError:
        evaluator, label = PedAnovaImportanceEvaluator(), "PED-ANOVA"
    found = optuna.importance.get_param_importances(study, evaluator=evaluator)
    return Importance(phase, metric, len(trials), {k: float(v) for k, v in found.items()}, label)


def importance_figure(results: list[Importance], source_label: str):
    fig = plots._figure(6.8, 2.4 * max(1, len(results)))
    for i, res in enumerate(results):
        ax = fig.add_subplot(len(results), 1, i + 1)
        if res.skipped:
            plots._empty(ax, f"{res.phase}: {res.skipped}")
            continue
        names = list(res.importances)[::-1]          # most important on top
        ax.barh(names, [res.importances[n] for n in names], color="tab:blue")
        ax.set_xlim(0, 1)
        ax.set_title(f"{plots.PHASE_TITLES[res.phase]}: importance for log10 {res.metric} "
                     f"({res.evaluator}, {res.n_trials} trials)", fontsize=9)
    fig.supxlabel(f"share of the variance explained — {source_label}", fontsize=9)
    return fig


# ----------------------------------------------------------------------------- parallel coordinates


def parallel_coordinates_figure(df: pd.DataFrame, source_label: str):
    """Per phase: varying parameters and the latency (log) as parallel axes."""
    fig = plots._figure(8.0, 6.0)
    for i, phase in enumerate(pareto.PHASES):
        ax = fig.add_subplot(2, 1, i + 1)
        metric = pareto.resolve_axes(phase)[0]
        points = finished_points(df, metric)
        names = varying_params(points)
        if len(points) < 2 or not names:
            plots._empty(ax, f"{phase}: nothing varies among {len(points)} finished trials")
            continue
        columns, ticks = [], []
        for name in names:
            levels = sorted(points[name].dropna().unique(), key=lambda v: (str(type(v)), v))
            pos = {v: (k / (len(levels) - 1) if len(levels) > 1 else 0.5) for k, v in enumerate(levels)}
            columns.append(points[name].map(pos).to_numpy(float))
            ticks.append([(pos[v], str(_python(v))) for v in levels])
        logs = np.log10(points[metric].to_numpy(float))
        lo, hi = logs.min(), logs.max()
        columns.append((logs - lo) / (hi - lo) if hi > lo else np.full(len(logs), 0.5))
        ticks.append([(0.0, f"{10 ** lo:.3g}"), (1.0, f"{10 ** hi:.3g}")])
        norm = colors.Normalize(lo, hi if hi > lo else lo + 1)
        cmap = matplotlib.colormaps["viridis"]
        xs = np.arange(len(columns))
        data = np.vstack(columns).T
        for row, value in sorted(zip(data, logs), key=lambda t: -t[1]):   # fastest drawn last
            ax.plot(xs, row, color=cmap(norm(value)), alpha=0.6, lw=1.2)
        for x, axis_ticks in zip(xs, ticks):
            ax.axvline(x, color="grey", lw=0.8)
            for y, text in axis_ticks:
                ax.text(x + 0.03, y, text, fontsize=7, va="center")
        ax.set_xticks(xs, names + [f"{metric} (log)"], fontsize=8)
        ax.set_yticks([])
        ax.set_ylim(-0.08, 1.08)
        ax.set_title(f"{plots.PHASE_TITLES[phase]}: {len(points)} finished trials, colour = "
                     f"{metric} (dark = fast)", fontsize=9)
    fig.supxlabel(source_label, fontsize=9)
    return fig


# ----------------------------------------------------------------------------- hypervolume history


def hypervolume_history(df: pd.DataFrame) -> pd.DataFrame:
    """phase, number, hypervolume: the frontier's hypervolume once trials 0..number are in."""
    rows = []
    ordered = df.sort_values("number", kind="stable")
    for phase in pareto.PHASES:
        x, y = pareto.resolve_axes(phase)
        done = pareto.finished(ordered)
        if not len(plots._finite(done, x, y)):
            continue
        reference = pareto.default_reference(done, x, y)
        seen: list[tuple[float, float]] = []
        finished_numbers = set(done["number"])
        for _, row in ordered.iterrows():
            if row["number"] in finished_numbers:
                vx, vy = pd.to_numeric(row[x], errors="coerce"), pd.to_numeric(row[y], errors="coerce")
                if np.isfinite(vx) and np.isfinite(vy):
                    seen.append((float(vx), float(vy)))
            rows.append({"phase": phase, "number": int(row["number"]),
                         "hypervolume": pareto.hypervolume(seen, reference) if seen else 0.0})
    return pd.DataFrame(rows, columns=["phase", "number", "hypervolume"])


def hypervolume_figure(history: pd.DataFrame, source_label: str):
    fig = plots._figure(6.8, 3.4)
    ax = fig.add_subplot()
    if history.empty:
        plots._empty(ax)
        return fig
    for phase, colour in zip(pareto.PHASES, ("tab:green", "tab:purple")):
        part = history[history["phase"] == phase]
        if part.empty:
            continue
        final = part["hypervolume"].iloc[-1]
        share = part["hypervolume"] / final if final > 0 else part["hypervolume"]
        ax.step(part["number"], share, where="post", color=colour, lw=1.6,
                label=f"{phase} (final {final:.3g})")
    ax.set_ylim(0, 1.05)
    ax.xaxis.set_major_locator(ticker.MaxNLocator(integer=True))
    ax.set_xlabel("trial number")
    ax.set_ylabel("hypervolume / final hypervolume")
    ax.set_title(f"hypervolume of the latency/cost frontier against trial number — {source_label}",
                 fontsize=9)
    ax.legend(fontsize=8, loc="lower right")
    return fig
