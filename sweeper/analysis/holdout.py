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

import dataclasses
import functools
import json
import math
from dataclasses import dataclass, field
from typing import Any, Iterable

import numpy as np
import pandas as pd
from scipy.stats import kendalltau

from sweeper.analysis.fit import (DEFAULT_TERMS, EXTRA_TERMS, CalibrationError, Fit, ParamSpace,
                                  Point, default_space, fit_profile)
from sweeper.analysis.observations import metric_of, predict_latency
from workloads.config import ConfigError, HardwareProfile
from workloads.layouts import PHASES
from workloads.validate import one_of

HOLDOUTS = ("kfold", "layout", "chips", "extrapolation")   # a study's schemes (`--holdout all`)
SCHEMES = HOLDOUTS + ("loo",)
HOLDOUT_TEXT = {
    "loo": "leave-one-out (each point held out with the points of its run: a table's latency "
           "and MFU of one configuration are one measurement)",
    "kfold": "k-fold over trial shapes (all layouts of one batch/chips/... shape held out together; "
             "the shapes of one chip count dealt to different folds)",
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
    chips = np.array([p.chips for p in points])
    out = []
    for n in sorted(set(chips.tolist())):
        train = np.flatnonzero(chips <= n / 2)
        if n >= EXTRAPOLATE_FROM and len(set(chips[train].tolist())) >= 2:
            out.append((train, np.flatnonzero(chips == n)))
    return out


def folds(points: list[Point], scheme: str, k: int = K_FOLDS, seed: int = 0) -> list[np.ndarray]:
    """Index arrays of held-out points, each point held out exactly once (not extrapolation,
    whose held-out sets are `splits`')."""
    one_of("--holdout", scheme, [s for s in SCHEMES if s != "extrapolation"])
    if scheme == "loo":
        keys = [p.group for p in points]
    elif scheme == "kfold" and any(p.config is None for p in points):
        # published numbers: folds of runs (a run's latency and MFU together)
        units = sorted({p.group for p in points}, key=str)
        order = [units[i] for i in np.random.default_rng(seed).permutation(len(units))]
        k = max(2, min(k, len(units)))
        fold_of = {u: i % k for i, u in enumerate(order)}
        keys = [fold_of[p.group] for p in points]
    elif scheme == "kfold":
        # Folds of trial shapes: every trial of one (batch, chips, ...) shape, both phases,
        # is held out together, so each ranking group is predicted by one model that saw
        # none of its layouts. A study of a single shape falls back to folds of trials.
        # Stratified by chip count (shapes dealt in chip-count order, random within a
        # count): a count's shapes land in different folds, so k-fold measures prediction
        # between chip counts the fit saw; an unseen chip count is the `chips` and
        # `extrapolation` schemes' question (issue 20: unstratified, seed 0 held out both
        # 8-chip shapes of the calibration sweep in one fold).
        shapes = sorted({p.shape_key for p in points}, key=str)
        unit = (lambda p: p.shape_key) if len(shapes) >= 2 else (lambda p: p.group)
        units = sorted({unit(p) for p in points}, key=str)
        chips_of = {unit(p): p.chips for p in points}
        draw = np.random.default_rng(seed).random(len(units))
        order = [u for _, _, u in sorted(zip([chips_of[u] for u in units], draw, units),
                                         key=lambda t: (t[0], t[1]))]
        k = max(2, min(k, len(units)))
        fold_of = {u: i % k for i, u in enumerate(order)}
        keys = [fold_of[unit(p)] for p in points]
    elif scheme == "layout":
        keys = [p.layout_key for p in points]
    else:
        keys = [p.chips for p in points]
    out = []
    for key in sorted(set(keys), key=str):
        out.append(np.array([i for i, kk in enumerate(keys) if kk == key]))
    return out


# ----------------------------------------------------------------------------- noise floor


@dataclass
class NoiseFloor:
    """One measurement's error, from replicates (the same configuration measured in several
    trials, other seed): each measurement against the median of its replicates, divided by
    sqrt(1 + 1/(n-1)) (for a pair: the pair error / sqrt 2) so it carries one measurement's
    noise, not two. No model of the configuration can predict a single trial better than
    this, on average; against the mean of n replicates the floor is this / sqrt(n)
    (`mean_mape`)."""

    mape: float
    median_ape: float
    n_points: int                        # points that have at least one replicate
    groups: int                          # configurations measured more than once
    by_phase: dict[str, dict[str, float]] = field(default_factory=dict)
    replicates: float = math.nan         # mean number of measurements per replicated configuration

    @property
    def mean_mape(self) -> float:
        """The floor of a score against replicate means: one measurement's error / sqrt(n)."""
        return self.mape / math.sqrt(self.replicates) if self.replicates > 0 else math.nan

    def summary(self) -> dict[str, Any]:
        return {"mape": self.mape, "median_ape": self.median_ape, "n_points": self.n_points,
                "groups": self.groups, "by_phase": self.by_phase,
                "definition": "one measurement's error: replicate error / sqrt(1 + 1/(n-1))",
                "replicate_mean_floor_mape": self.mean_mape}


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
        # one measurement against the others' median differs by two measurements' noise
        # (its own and the others', variance 1 + 1/(n-1)): dividing by that factor gives one
        # measurement's error (for a pair: the pair error / sqrt 2), what a perfect model of
        # the configuration would score against single measurements
        single = math.sqrt(1.0 + 1.0 / (len(members) - 1))
        for j, i in enumerate(members):
            out[i] = abs(float(np.median(np.delete(values, j))) - values[j]) / values[j] / single
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
    return NoiseFloor(mape, median, len(apes), groups, by_phase,
                      replicates=len(apes) / groups if groups else math.nan)


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
    fold_profiles: list = field(default_factory=list)   # each fold's fitted profile

    # computed once: a Holdout's points are not changed after it is made, and the summary,
    # the blow-up check and the report each read these
    @functools.cached_property
    def replicate_means(self) -> pd.DataFrame:
        return replicate_means(self.points)

    @property
    def mape_vs_mean(self) -> float:
        """Held-out MAPE against the mean of each configuration's replicates."""
        m = self.replicate_means
        return float(m["ape"].mean()) if len(m) else math.nan

    @property
    def median_vs_mean(self) -> float:
        m = self.replicate_means
        return float(m["ape"].median()) if len(m) else math.nan

    @functools.cached_property
    def blowup(self) -> dict[str, Any] | None:
        return None if self.skipped else blowup(self.points)

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
                "caveats": self.caveats, "skipped": self.skipped,
                "mape_vs_replicate_mean": self.mape_vs_mean,
                "median_ape_vs_replicate_mean": self.median_vs_mean,
                "blowup": self.blowup,
                "residuals": {phase: [float(v) for v in
                                      self.points.loc[self.points["phase"] == phase,
                                                      "relative_error"].dropna()]
                              for phase in PHASES} if not self.skipped else {}}


def point_frame(points: list[Point], predicted: np.ndarray, fold: np.ndarray | None = None) -> pd.DataFrame:
    """One line per observation: `predicted` are latencies; `measured`/`predicted` are in
    the observation's metric and `ape`/`relative_error` compare those (what was published);
    `measured_s`/`predicted_s` are latency equivalents (the rankings compare those)."""
    rows = []
    for i, (p, pred) in enumerate(zip(points, predicted)):
        value = float(metric_of(p, float(pred))) if math.isfinite(pred) else math.nan
        rows.append({"trial": p.trial, "phase": p.phase, **p.info, "chips": p.chips,
                     "metric": p.metric, "ci_rel": p.ci_rel, "replicate": str(p.replicate_key),
                     "measured": p.measured, "predicted": value,
                     "relative_error": value / p.measured - 1,
                     "measured_s": p.measured_s, "predicted_s": float(pred),
                     "ape": abs(value / p.measured - 1),
                     "fold": int(fold[i]) if fold is not None else -1})
    return pd.DataFrame(rows)


# `terms=SELECT`: the extra terms (fit.EXTRA_TERMS) are chosen per fit by an inner k-fold
# over the fit's own training points only (nested cross-validation: a held-out fold never
# takes part in choosing the terms that predict it).
SELECT = "select"
INNER_FOLDS = 3
SELECT_TIE = 1e-6        # inner MAPEs this close (1e-4 points) choose the fewer terms


def parse_terms(text: str, field: str = "--terms") -> tuple[str, ...] | str:
    """`none` (the paper's constants), `select` (nested cross-validation) or a comma list
    of extra terms (fit.EXTRA_TERMS); anything else is a one-line ConfigError."""
    if text in ("none", SELECT):
        return () if text == "none" else SELECT
    names = tuple(t.strip() for t in text.split(",") if t.strip())
    bad = [t for t in names if t not in EXTRA_TERMS]
    if bad or not names:
        raise ConfigError(field, text, f"none, select or a comma list of {list(EXTRA_TERMS)}")
    return names


def select_terms(points: list[Point], base: HardwareProfile, loss: str = "linear",
                 weighted: bool = True, candidates: tuple[str, ...] | None = None) -> tuple[str, ...]:
    """The subset of `candidates` (default fit.SELECT_CANDIDATES; each in fit.EXTRA_TERMS) with
    the lowest inner k-fold MAPE on `points` (ties, within SELECT_TIE: fewer terms); the paper's constants alone
    when there are too few points to split."""
    from itertools import combinations

    from sweeper.analysis.fit import EXTRA_TERMS, SELECT_CANDIDATES

    pool = tuple(SELECT_CANDIDATES if candidates is None else candidates)
    for term in pool:
        one_of("terms", term, EXTRA_TERMS)
    candidates = [c for n in range(len(pool) + 1) for c in combinations(pool, n)]
    try:
        parts = splits(points, "kfold", k=INNER_FOLDS, seed=1)
    except ConfigError:
        return ()
    if len(parts) < 2:
        return ()
    scores = []
    for terms in candidates:
        apes = []
        for train_idx, test in parts:
            train = [points[j] for j in train_idx]
            fitted = fit_profile(train, base, default_space(train, terms), loss, weighted=weighted).profile
            apes += [abs(float(metric_of(points[j], predict_latency(points[j], fitted)))
                         / points[j].measured - 1) for j in test]
        scores.append((float(np.mean(apes)), terms))
    return fewest_within_tie(scores)


def fewest_within_tie(scores: list[tuple[float, tuple[str, ...]]]) -> tuple[str, ...]:
    """The terms of the lowest inner MAPE, where scores within SELECT_TIE of the best are a
    tie won by the fewer terms (then the lower score): a term that moves the inner MAPE by
    less than that has not earned its place (a term fitted to its 0 bound moves it by ~1e-10,
    the optimiser's tolerance, either way)."""
    best = min(score for score, _ in scores)
    return min((len(terms), score, terms) for score, terms in scores if score <= best + SELECT_TIE)[2]


def heldout(points: list[Point], base: HardwareProfile, scheme: str = "kfold",
            space: ParamSpace | None = None, loss: str = "linear", seed: int = 0,
            tie_reference: np.ndarray | None = None, weighted: bool = True,
            terms: tuple[str, ...] = DEFAULT_TERMS,
            candidates: tuple[str, ...] | None = None) -> Holdout:
    """Predict every point from a fit on the other folds; score only those predictions.
    `terms=SELECT`: each fold's terms chosen among `candidates` on its training points only.

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
    profiles = []
    for i, (train_idx, test) in enumerate(parts):
        train = [points[j] for j in train_idx]
        # Latencies only for the kinds the training points contain; a held-out layout's
        # unseen kind is charged the fitted `collective_latency_s` (median of the others).
        fold_terms = (select_terms(train, base, loss, weighted, candidates) if terms == SELECT
                      else terms)
        fitted = fit_profile(train, base, default_space(train, fold_terms) if space is None else space,
                             loss, weighted=weighted).profile
        profiles.append(fitted)
        for j in test:
            predicted[j] = predict_latency(points[j], fitted)
            fold_id[j] = i
    df = point_frame(points, predicted, fold_id)
    df["tie_s"] = tie_reference if tie_reference is not None else df["predicted_s"]
    predicted_idx = np.flatnonzero(fold_id >= 0)
    df = df.iloc[predicted_idx].reset_index(drop=True)   # extrapolation leaves some unpredicted
    top1, top1_tol, tau, groups = ranking_agreement(df)
    ape = df["ape"]
    return Holdout(scheme, df, float(ape.mean()), float(ape.median()), float(ape.max()),
                   top1, top1_tol, tau, groups, len(parts),
                   noise=noise_floor(points, predicted_idx.tolist()), fold_profiles=profiles)


def replicate_means(df: pd.DataFrame) -> pd.DataFrame:
    """One row per configuration and phase: the mean of its measurements (replicates) and
    of their held-out predictions, and the error between the two (`relative_error`, `ape`)."""
    if df.empty or "replicate" not in df:
        return pd.DataFrame(columns=["replicate", "phase", "chips", "n", "measured_s",
                                     "predicted_s", "relative_error", "ape"])
    ok = df.dropna(subset=["predicted_s"])
    g = ok.groupby("replicate", as_index=False).agg(
        phase=("phase", "first"), chips=("chips", "first"), n=("measured_s", "size"),
        measured_s=("measured_s", "mean"), predicted_s=("predicted_s", "mean"))
    g["relative_error"] = g["predicted_s"] / g["measured_s"] - 1
    g["ape"] = g["relative_error"].abs()
    return g


# A fit is not published when one held-out fold is far worse than the typical one: its
# error is the MAPE of the fold's held-out points (under leave-one-out: one run's points).
BLOWUP_RATIO = 3.0
BLOWUP_FLOOR = 0.02      # folds within 3 x 2% are never a blow-up (a 0.5% median is no scale)


def blowup(df: pd.DataFrame) -> dict[str, Any] | None:
    """The worst held-out fold when its error is > BLOWUP_RATIO x the median fold's, with
    its worst point; None when no fold blew up (or fewer than 3 folds)."""
    ok = df.dropna(subset=["ape"])
    per_fold = ok.groupby("fold")["ape"].mean()
    if len(per_fold) < 3:
        return None
    median = float(per_fold.median())
    worst = per_fold.idxmax()
    if per_fold[worst] <= BLOWUP_RATIO * max(median, BLOWUP_FLOOR):
        return None
    sel = ok[ok["fold"] == worst]
    point = sel.loc[sel["ape"].idxmax()]
    where = ", ".join(f"{k} {point[k]}" for k in ("row", "trial", "phase", "layout", "chips", "batch",
                                                  "source") if k in point and pd.notna(point[k]))
    return {"fold": int(worst), "fold_mape": float(per_fold[worst]), "median_fold_mape": median,
            "ratio": float(per_fold[worst] / median) if median > 0 else math.inf,
            "point": where, "relative_error": float(point["relative_error"])}


def blowup_reason(result: "Calibration") -> str | None:
    """Why the headline fit must not be published: which point blew up, and which constant
    its fold's fit moved furthest from the fit on all points (measured); None if none did."""
    b = result.main.blowup
    if b is None:
        return None
    fold_fit = result.main.fold_profiles[b["fold"]] if b["fold"] < len(result.main.fold_profiles) else None
    moved = ""
    if fold_fit is not None:
        ratios = {}
        for name in ("peak_flops", "hbm_bandwidth", "ici_bandwidth", "op_overhead_s",
                     "collective_latency_s", "launch_overhead_s", "collective_latency_s_per_device",
                     "device_overhead_s", "collective_rendezvous_s", "matmul_half_rows",
                     "matmul_half_dim"):
            a, c = getattr(fold_fit, name), getattr(result.fitted, name)
            # a term at its 0 bound says nothing: overheads under 1 ns, matmul terms under a row
            zero = 1.0 if name.startswith("matmul_half") else 1e-9
            if a > 0 and c > 0 and max(a, c) > zero:
                ratios[name] = a / c
        ratios["overlap"] = (fold_fit.overlap + 1e-3) / (result.fitted.overlap + 1e-3)
        name = max(ratios, key=lambda k: abs(math.log(ratios[k])))
        moved = (f"; without it the fit moves {name} by x{ratios[name]:.3g} "
                 f"({getattr(fold_fit, name):.4g} vs {getattr(result.fitted, name):.4g} on all points)")
    return (f"held-out fold {b['fold']} ({b['point']}) is off by {100 * b['fold_mape']:.0f}%, "
            f"{b['ratio']:.1f}x the median fold's {100 * b['median_fold_mape']:.1f}% "
            f"(limit {BLOWUP_RATIO:g}x){moved}: the model lacks a term this point needs, so "
            "the fit is not published")


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
    # one grouped median over (group, layout) cells, then split by group: the same rows as a
    # groupby per group (pandas sorts both), in one pass
    cells = ok.groupby(GROUP_COLUMNS + ["layout", "topology"], as_index=False).agg(
        measured_s=("measured_s", "median"), predicted_s=("predicted_s", "median"),
        tie_s=("tie_s", "median"))
    for _, grp in cells.groupby(GROUP_COLUMNS, sort=True):
        if len(grp) >= 2:
            out.append(grp[["layout", "topology", "measured_s", "predicted_s", "tie_s",
                            *GROUP_COLUMNS]].reset_index(drop=True))
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
    terms: tuple = ()                    # the extra terms the published fit frees
    parent_run_id: str | None = None
    tracking_uri: str | None = None
    artifacts: dict[str, str] = field(default_factory=dict)
    pngs: dict[str, bytes] = field(default_factory=dict)   # figures drawn, by title (drawn once)

    @property
    def main(self) -> Holdout:
        return self.holdouts[self.headline]

    @property
    def refused(self) -> str | None:
        """Why this fit must not be published (a held-out fold blew up), or None."""
        return blowup_reason(self)

    def fitted_constants(self) -> dict[str, Any]:
        p = self.fitted
        return {"peak_flops": p.peak_flops, "hbm_bandwidth": p.hbm_bandwidth,
                "ici_bandwidth": p.ici_bandwidth, "collective_latency_s": p.collective_latency_s,
                "collective_latency_s_by_kind": dict(getattr(p, "collective_latency_s_by_kind", {})),
                "op_overhead_s": p.op_overhead_s, "overlap": p.overlap,
                **{term: getattr(p, term) for term in EXTRA_TERMS}}

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
                "mape_vs_replicate_mean": h.mape_vs_mean,
                "terms": list(self.terms),
                "refused": self.refused,
                "artifacts": self.artifacts, "parent_run_id": self.parent_run_id}


def _records(df: pd.DataFrame) -> list[dict]:
    return json.loads(df.to_json(orient="records"))


def calibrate(points: list[Point], base: HardwareProfile, holdouts: Iterable[str] = ("kfold",),
              study: str = "", loss: str = "linear", min_trials: int = MIN_TRIALS,
              weighted: bool = True, terms: tuple[str, ...] = DEFAULT_TERMS,
              candidates: tuple[str, ...] | None = None) -> Calibration:
    """Fit on all points (the profile to use) and evaluate each hold-out scheme."""
    holdouts = tuple(holdouts)
    for scheme in holdouts:
        if scheme not in SCHEMES:
            raise ConfigError("--holdout", scheme, f"one of {list(HOLDOUTS) + ['all']}")
    trials = len({p.trial for p in points})
    if trials < min_trials:
        raise CalibrationError("study", study or "points", f"a study with at least {min_trials} "
                               f"complete measured trials to fit and hold out (it has {trials}, "
                               f"{len(points)} points); run more trials (--resume)")
    # a calibrated host fits corrections to its measured costs, never these terms (hostfit.py)
    chosen = (select_terms(points, base, loss, weighted, candidates)
              if terms == SELECT and not base.host_model else terms)
    space = default_space(points, chosen)
    fit = fit_profile(points, base, space, loss, name=f"{base.name}-fitted", weighted=weighted)
    insample = point_frame(points, np.array([predict_latency(p, fit.profile) for p in points]))
    reference = insample["predicted_s"].to_numpy()
    results = {scheme: heldout(points, base, scheme, None, loss, tie_reference=reference,
                               weighted=weighted, terms=terms, candidates=candidates)
               for scheme in holdouts}
    main = results[holdouts[0]]
    fitted = fit.profile
    if not main.skipped:   # the serving planner's error bands (HardwareProfile.heldout_residuals)
        fitted = dataclasses.replace(fitted, heldout_residuals={
            phase: [round(float(v), 6) for v in values]
            for phase, values in main.summary()["residuals"].items() if values})
    return Calibration(study, base, fitted, points, insample, results, holdouts[0], fit,
                       noise=noise_floor(points), weighted=weighted, terms=tuple(chosen))


