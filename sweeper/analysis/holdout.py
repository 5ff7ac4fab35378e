"""Held-out error of the fitted cost model, and `calibrate`: the fit plus its evaluation.

Every point is predicted by a fit that did not see it: k-fold over trial shapes (all layouts
of one batch/chips shape held out together), leave-one-layout-out,
leave-one-chip-count-out, or extrapolation (fit on chip counts <= n/2, predict n: the
question "I measured small meshes, how fast is the big one?"). Only those predictions enter MAPE, median and max absolute
percent error and the ranking agreement (per (batch, chips, phase) group, with model,
weights and lengths equal: does the fitted model pick the measured-best layout, and
Kendall's tau between predicted and measured layout times; groups where the model predicts
all layouts equal are left out).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Iterable

import numpy as np
import pandas as pd
from scipy.stats import kendalltau

from sweeper.analysis.fit import (DEFAULT_TERMS, CalibrationError, Fit, ParamSpace, Point,
                                  default_space, fit_profile, predict_point)
from workloads.config import ConfigError, HardwareProfile
from workloads.layouts import PHASES

HOLDOUTS = ("kfold", "layout", "chips", "extrapolation")
HOLDOUT_TEXT = {
    "kfold": "k-fold over trial shapes (all layouts of one batch/chips/... shape held out together)",
    "layout": "leave-one-layout-out (every point of one FFN/attention layout held out together)",
    "chips": "leave-one-chip-count-out (every point of one chip count held out together)",
    "extrapolation": "extrapolation (each chip count n >= 4 predicted by a fit on chip counts "
                     "<= n/2 only)",
}
EXTRAPOLATE_FROM = 4     # n/2 must include a multi-chip count, or no collective was ever seen
NOISE_COMPARABLE = 0.5   # noise floor >= half the error: the error is mostly measurement noise
MIN_GROUPS = 10          # fewer ranking groups: top-1 agreement moves by >= 10% per group
MIN_TRIALS = 6           # 12 points for at most 9 constants, with points left to hold out
K_FOLDS = 5
TOP1_TOLERANCE = 0.05    # "within 5%": the model's pick is measured within 5% of the best
PREDICTED_TIE = 1e-9     # predictions this close are one pick (float noise of equal formulas)


# ----------------------------------------------------------------------------- held-out error


def splits(points: list[Point], scheme: str, k: int = K_FOLDS,
           seed: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    """(training, held-out) index arrays per fold. Extrapolation trains on chip counts
    <= n/2 and holds out n (the points of counts in between are in neither); every other
    scheme trains on the complement of its held-out fold."""
    if scheme == "extrapolation":
        return extrapolation_splits(points)
    out = []
    for test in folds(points, scheme, k, seed):
        held = set(test.tolist())
        out.append((np.array([i for i in range(len(points)) if i not in held], int), test))
    return out


def extrapolation_splits(points: list[Point]) -> list[tuple[np.ndarray, np.ndarray]]:
    """For each chip count n >= EXTRAPOLATE_FROM: train on chips <= n/2, hold out chips == n."""
    chips = np.array([p.config.chips for p in points])
    out = []
    for n in sorted(set(chips.tolist())):
        train = np.flatnonzero(chips <= n / 2)
        if n >= EXTRAPOLATE_FROM and len(set(chips[train].tolist())) >= 2:
            out.append((train, np.flatnonzero(chips == n)))
    return out


def folds(points: list[Point], scheme: str, k: int = K_FOLDS, seed: int = 0) -> list[np.ndarray]:
    """Index arrays of held-out points, each point held out exactly once (not extrapolation,
    whose held-out sets are `splits`')."""
    if scheme not in HOLDOUTS or scheme == "extrapolation":
        raise ConfigError("--holdout", scheme, f"one of {list(HOLDOUTS)}")
    if scheme == "kfold":
        # Folds of trial shapes: every trial of one (batch, chips, ...) shape, both phases,
        # is held out together, so each ranking group is predicted by one model that saw
        # none of its layouts. A study of a single shape falls back to folds of trials.
        shapes = sorted({p.shape_key for p in points}, key=str)
        unit = (lambda p: p.shape_key) if len(shapes) >= 2 else (lambda p: p.trial)
        units = sorted({unit(p) for p in points}, key=str)
        order = [units[i] for i in np.random.default_rng(seed).permutation(len(units))]
        k = max(2, min(k, len(units)))
        fold_of = {u: i % k for i, u in enumerate(order)}
        keys = [fold_of[unit(p)] for p in points]
    elif scheme == "layout":
        keys = [p.layout_key for p in points]
    else:
        keys = [p.config.chips for p in points]
    out = []
    for key in sorted(set(keys), key=str):
        out.append(np.array([i for i, kk in enumerate(keys) if kk == key]))
    return out


# ----------------------------------------------------------------------------- noise floor


@dataclass
class NoiseFloor:
    """The replicate error: the same configuration measured in several trials (other seed),
    each measurement predicted by the median of its replicates. No model of the
    configuration can predict a single trial better than this, on average."""

    mape: float
    median_ape: float
    n_points: int                        # points that have at least one replicate
    groups: int                          # configurations measured more than once
    by_phase: dict[str, dict[str, float]] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        return {"mape": self.mape, "median_ape": self.median_ape, "n_points": self.n_points,
                "groups": self.groups, "by_phase": self.by_phase}


def replicate_apes(points: list[Point]) -> dict[int, float]:
    """Point index -> |median of its replicates - it| / it, for points with replicates."""
    groups: dict[tuple, list[int]] = {}
    for i, p in enumerate(points):
        groups.setdefault(p.replicate_key, []).append(i)
    out = {}
    for members in groups.values():
        if len(members) < 2:
            continue
        values = np.array([points[i].measured_s for i in members])
        for j, i in enumerate(members):
            out[i] = abs(float(np.median(np.delete(values, j))) - values[j]) / values[j]
    return out


def noise_floor(points: list[Point], only: Iterable[int] | None = None) -> NoiseFloor:
    """The replicate error of `points` (of those indices in `only`, when given)."""
    apes = replicate_apes(points)
    if only is not None:
        keep = set(only)
        apes = {i: v for i, v in apes.items() if i in keep}

    def stats(values: list[float]) -> tuple[float, float]:
        return (float(np.mean(values)), float(np.median(values))) if values else (math.nan, math.nan)

    mape, median = stats(list(apes.values()))
    by_phase = {}
    for phase in PHASES:
        vals = [v for i, v in apes.items() if points[i].phase == phase]
        m, med = stats(vals)
        by_phase[phase] = {"mape": m, "median_ape": med, "n_points": len(vals)}
    groups = len({points[i].replicate_key for i in apes})
    return NoiseFloor(mape, median, len(apes), groups, by_phase)


def caveats(mape: float, noise: NoiseFloor | None, groups: int) -> list[str]:
    """Why a held-out figure is not a verdict: the noise floor is comparable to the error,
    or the ranking check has too few groups. Empty when neither."""
    out = []
    if noise is not None and math.isfinite(noise.mape) and math.isfinite(mape) \
            and noise.mape >= NOISE_COMPARABLE * mape:
        out.append(f"noise floor {100 * noise.mape:.1f}% is comparable to the error: model "
                   "error and measurement noise cannot be told apart")
    elif noise is None or not noise.n_points:
        out.append("no replicated configurations: noise floor unknown")
    if groups < MIN_GROUPS:
        out.append(f"top-1 over {groups} groups: too few groups to judge (>= {MIN_GROUPS})")
    return out


@dataclass
class Holdout:
    """Held-out predictions of one scheme and the numbers computed from them."""

    scheme: str
    points: pd.DataFrame                 # one row per point: measured_s, predicted_s, ape, ...
    mape: float
    median_ape: float
    max_ape: float
    top1_agreement: float
    top1_within_tolerance: float
    kendall_tau: float
    groups: int
    folds: int
    skipped: str | None = None           # why a scheme could not run (one group only)
    noise: NoiseFloor | None = None      # replicate error of the held-out points

    @property
    def caveats(self) -> list[str]:
        return [] if self.skipped else caveats(self.mape, self.noise, self.groups)

    @property
    def errors(self) -> pd.DataFrame:
        return error_table(self.points)

    def summary(self) -> dict[str, Any]:
        return {"scheme": self.scheme, "n_points": int(len(self.points)), "folds": self.folds,
                "mape_heldout": self.mape, "median_ape_heldout": self.median_ape,
                "max_ape_heldout": self.max_ape, "top1_agreement": self.top1_agreement,
                "top1_within_5pct": self.top1_within_tolerance,
                "kendall_tau": self.kendall_tau, "ranking_groups": self.groups,
                "noise_floor_mape": self.noise.mape if self.noise else math.nan,
                "noise_floor_median_ape": self.noise.median_ape if self.noise else math.nan,
                "noise_floor_points": self.noise.n_points if self.noise else 0,
                "noise_floor": self.noise.summary() if self.noise else None,
                "caveats": self.caveats, "skipped": self.skipped}


def point_frame(points: list[Point], predicted: np.ndarray, fold: np.ndarray | None = None) -> pd.DataFrame:
    rows = []
    for i, (p, pred) in enumerate(zip(points, predicted)):
        c = p.config
        rows.append({"trial": p.trial, "phase": p.phase, "layout": p.layout_key,
                     "ffn": p.layout.ffn, "attn": p.layout.attn,
                     "topology": "x".join(map(str, c.mesh_shape)), "chips": c.chips,
                     "batch": c.batch, "model": c.model.name, "weights": c.weights,
                     "input_len": c.input_len, "decode_steps": c.decode_steps,
                     "seed": c.seed, "ci_rel": p.ci_rel,
                     "measured_s": p.measured_s, "predicted_s": float(pred),
                     "ape": abs(float(pred) - p.measured_s) / p.measured_s,
                     "fold": int(fold[i]) if fold is not None else -1})
    return pd.DataFrame(rows)


def heldout(points: list[Point], base: HardwareProfile, scheme: str = "kfold",
            space: ParamSpace | None = None, loss: str = "linear", seed: int = 0,
            tie_reference: np.ndarray | None = None, weighted: bool = True,
            terms: tuple[str, ...] = DEFAULT_TERMS) -> Holdout:
    """Predict every point from a fit on the other folds; score only those predictions.

    `tie_reference`: one model's predictions of all points (the fit on everything), used only
    to tell which layouts the formulas make equal; without it, the held-out predictions."""
    parts = splits(points, scheme, seed=seed)
    predicted = np.full(len(points), math.nan)
    fold_id = np.full(len(points), -1)
    if len(parts) < (1 if scheme == "extrapolation" else 2):
        df = point_frame(points, predicted, fold_id)
        why = (f"needs chip counts n >= {EXTRAPOLATE_FROM} and at least two counts <= n/2"
               if scheme == "extrapolation" else f"only one {scheme} group: nothing to hold out")
        return Holdout(scheme, df, *([math.nan] * 6), 0, len(parts), skipped=why)
    for i, (train_idx, test) in enumerate(parts):
        train = [points[j] for j in train_idx]
        # Latencies only for the kinds the training points contain; a held-out layout's
        # unseen kind is charged the fitted `collective_latency_s` (median of the others).
        fitted = fit_profile(train, base, default_space(train, terms) if space is None else space,
                             loss, weighted=weighted).profile
        for j in test:
            predicted[j] = predict_point(points[j], fitted)
            fold_id[j] = i
    df = point_frame(points, predicted, fold_id)
    df["tie_s"] = tie_reference if tie_reference is not None else df["predicted_s"]
    predicted_idx = np.flatnonzero(fold_id >= 0)
    df = df.iloc[predicted_idx].reset_index(drop=True)   # extrapolation leaves some unpredicted
    top1, top1_tol, tau, groups = ranking_agreement(df)
    ape = df["ape"]
    return Holdout(scheme, df, float(ape.mean()), float(ape.median()), float(ape.max()),
                   top1, top1_tol, tau, groups, len(parts),
                   noise=noise_floor(points, predicted_idx.tolist()))


def error_table(df: pd.DataFrame) -> pd.DataFrame:
    """MAPE, median and max absolute percent error: overall, per phase, per phase x layout."""
    rows = []

    def add(phase, layout, sel):
        ape = sel["ape"].dropna()
        if len(ape):
            rows.append({"phase": phase, "layout": layout, "n": int(len(ape)),
                         "mape": float(ape.mean()), "median_ape": float(ape.median()),
                         "max_ape": float(ape.max())})

    add("all", "all", df)
    for phase in PHASES:
        sel = df[df["phase"] == phase]
        add(phase, "all", sel)
        for layout, grp in sorted(sel.groupby("layout"), key=lambda kv: kv[0]):
            add(phase, layout, grp)
    return pd.DataFrame(rows, columns=["phase", "layout", "n", "mape", "median_ape", "max_ape"])


GROUP_COLUMNS = ["model", "weights", "input_len", "decode_steps", "batch", "chips", "phase"]


def layout_rankings(df: pd.DataFrame) -> list[pd.DataFrame]:
    """Per (batch, chips, phase) group (other trial fields equal): median measured and
    predicted time of each (ffn, attn, topology), for groups with at least two layouts."""
    out = []
    ok = df.dropna(subset=["predicted_s", "measured_s"])
    if "tie_s" not in ok:
        ok = ok.assign(tie_s=ok["predicted_s"])
    for _, grp in ok.groupby(GROUP_COLUMNS):
        per_layout = grp.groupby(["layout", "topology"], as_index=False).agg(
            measured_s=("measured_s", "median"), predicted_s=("predicted_s", "median"),
            tie_s=("tie_s", "median"))
        if len(per_layout) >= 2:
            for col in GROUP_COLUMNS:
                per_layout[col] = grp[col].iloc[0]
            out.append(per_layout)
    return out


def ranking_agreement(df: pd.DataFrame) -> tuple[float, float, float, int]:
    """(top-1 agreement, top-1 within 5% of the best, mean Kendall tau, groups counted).

    Ties are the formulas' (column `tie_s`: one model's predictions): groups where it
    predicts every layout equal (one chip: no collectives, the same program) are left out,
    the model makes no pick there; when its pick is tied with other layouts (ws1d and ws2d
    on an X = 1 torus are the same program), the measured best being among them is
    agreement. The pick itself is the held-out prediction's."""
    groups = layout_rankings(df)
    if not groups:
        return math.nan, math.nan, math.nan, 0
    hits, near, taus = [], [], []
    for g in groups:
        if g["tie_s"].max() <= g["tie_s"].min() * (1 + PREDICTED_TIE):
            continue   # every layout predicted equal: no pick to score
        best_measured = g["measured_s"].idxmin()
        pick = g["predicted_s"].idxmin()
        tied = g.index[abs(g["tie_s"] / g.loc[pick, "tie_s"] - 1) <= PREDICTED_TIE]
        hits.append(best_measured in tied)
        worst_pick = g.loc[tied, "measured_s"].max()
        near.append(worst_pick <= (1 + TOP1_TOLERANCE) * g["measured_s"].min())
        tau = kendalltau(g["predicted_s"], g["measured_s"]).statistic
        if tau is not None and math.isfinite(tau):
            taus.append(tau)
    if not hits:
        return math.nan, math.nan, math.nan, 0
    return (float(np.mean(hits)), float(np.mean(near)),
            float(np.mean(taus)) if taus else math.nan, len(hits))


# ----------------------------------------------------------------------------- one call


@dataclass
class Calibration:
    """The fit on all points, and the held-out evaluation of each requested scheme."""

    study: str
    base: HardwareProfile
    fitted: HardwareProfile
    points: list[Point]
    insample: pd.DataFrame
    holdouts: dict[str, Holdout]
    headline: str
    fit: Fit
    noise: NoiseFloor | None = None      # replicate error of all points
    weighted: bool = True                # points weighted by their measured uncertainty
    parent_run_id: str | None = None
    tracking_uri: str | None = None
    artifacts: dict[str, str] = field(default_factory=dict)

    @property
    def main(self) -> Holdout:
        return self.holdouts[self.headline]

    def fitted_constants(self) -> dict[str, Any]:
        p = self.fitted
        return {"peak_flops": p.peak_flops, "hbm_bandwidth": p.hbm_bandwidth,
                "ici_bandwidth": p.ici_bandwidth, "collective_latency_s": p.collective_latency_s,
                "collective_latency_s_by_kind": dict(getattr(p, "collective_latency_s_by_kind", {})),
                "op_overhead_s": p.op_overhead_s, "overlap": p.overlap}

    def summary(self) -> dict[str, Any]:
        """What `sweeper fit --json` prints."""
        h = self.main
        return {"study": self.study, "holdout": self.headline,
                "mape_heldout": h.mape, "median_ape_heldout": h.median_ape,
                "max_ape_heldout": h.max_ape, "top1_agreement": h.top1_agreement,
                "top1_within_5pct": h.top1_within_tolerance, "kendall_tau": h.kendall_tau,
                "n_points": len(self.points), "n_trials": len({p.trial for p in self.points}),
                "ranking_groups": h.groups,
                "noise_floor": self.noise.summary() if self.noise else None, "caveats": h.caveats,
                "weighted": self.weighted,
                "fitted": self.fitted_constants(),
                "start": {k: getattr(self.base, k) for k in ("peak_flops", "hbm_bandwidth",
                                                             "ici_bandwidth")},
                "insample_mape": float(self.insample["ape"].mean()),
                "holdouts": {name: ho.summary() for name, ho in self.holdouts.items()},
                "errors": _records(h.errors),
                "artifacts": self.artifacts, "parent_run_id": self.parent_run_id}


def _records(df: pd.DataFrame) -> list[dict]:
    return json.loads(df.to_json(orient="records"))


def calibrate(points: list[Point], base: HardwareProfile, holdouts: Iterable[str] = ("kfold",),
              study: str = "", loss: str = "linear", min_trials: int = MIN_TRIALS,
              weighted: bool = True, terms: tuple[str, ...] = DEFAULT_TERMS) -> Calibration:
    """Fit on all points (the profile to use) and evaluate each hold-out scheme."""
    holdouts = tuple(holdouts)
    for scheme in holdouts:
        if scheme not in HOLDOUTS:
            raise ConfigError("--holdout", scheme, f"one of {list(HOLDOUTS) + ['all']}")
    trials = len({p.trial for p in points})
    if trials < min_trials:
        raise CalibrationError("study", study or "points", f"a study with at least {min_trials} "
                               f"complete measured trials to fit and hold out (it has {trials}, "
                               f"{len(points)} points); run more trials (--resume)")
    space = default_space(points, terms)
    fit = fit_profile(points, base, space, loss, name=f"{base.name}-fitted", weighted=weighted)
    insample = point_frame(points, np.array([predict_point(p, fit.profile) for p in points]))
    reference = insample["predicted_s"].to_numpy()
    results = {scheme: heldout(points, base, scheme, None, loss, tie_reference=reference,
                               weighted=weighted, terms=terms)
               for scheme in holdouts}
    return Calibration(study, base, fit.profile, points, insample, results, holdouts[0], fit,
                       noise=noise_floor(points), weighted=weighted)


