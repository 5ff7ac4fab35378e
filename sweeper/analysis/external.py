"""Fit the cost model's hardware constants to measurements taken elsewhere (a CSV of
published numbers, workloads/measurements.py), and hold rows out to score the fit.

The same constants, transforms and optimiser as `sweeper fit --study`
(sweeper/analysis/fit.py: `ParamSpace`, `PhaseTerms`, `scipy.optimize.least_squares` on
relative errors with the same weak prior toward the starting profile); the result is a
`holdout.Calibration`, so `--json` prints the same keys as a study's fit.

A row's number covers one or more cost-model calls (`measurements.phase_calls`: a prefill,
a decode over several steps, or both); its latency is their weighted sum, and for ffn `wg`
the fastest of the three weight-gathered layouts. Each call is decomposed once into its
terms at unit constants (`PhaseTerms`, as the study fit does), so the optimiser evaluates
rows with numpy; the decomposition is checked against `measurements.predict_point`, and
the fit calls the cost model directly if they ever disagree.

MFU rows: MFU is relative to the chip's published peak (paper §4: 275 TFLOP/s for TPU v4),
so it is read against the STARTING profile's peak (`--hardware`), never the fitted
effective peak: predicted MFU = model FLOPs / (chips x published peak x predicted latency).
Every residual is the relative error of the published metric (latency or MFU).

Hold-out: `loo` predicts each row from a fit on the others, holding out with it every row
measured on the same configuration (a table's latency and MFU of one run are one
measurement: leaving one in would leak it); `kfold` does the same over K_FOLDS folds of
configurations.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from sweeper.analysis.fit import (PRIOR_WEIGHT, CalibrationError, Fit, ParamSpace, PhaseTerms,
                                  by_kind_supported, prior_anchor, solve,
                                  without_group_measurements)
from sweeper.analysis.holdout import K_FOLDS, Calibration, Holdout, ranking_agreement
from workloads import costmodel
from workloads.config import ConfigError, HardwareProfile
from workloads.layouts import COLLECTIVE_KINDS
from workloads.measurements import (MeasuredPoint, load_measurements, model_flops, phase_calls,
                                    predict_point, variants)

EXTERNAL_HOLDOUTS = ("loo", "kfold")
EXTERNAL_HOLDOUT_TEXT = {
    "loo": "leave-one-out (each row held out with the rows of its configuration)",
    "kfold": f"{K_FOLDS}-fold over configurations",
}
MIN_CONFIGURATIONS = 4       # enough to hold one out and still fit
_UNIT = HardwareProfile("unit", peak_flops=1.0, hbm_bandwidth=1.0, hbm_bytes=1.0, ici_bandwidth=1.0)



@dataclass(frozen=True)
class Row:
    """One published number as a calibration point (`Calibration.points` element)."""

    point: MeasuredPoint
    trial: int               # its configuration: rows measured on one run share it
    flops: float             # unpadded model FLOPs of the number (MFU rows)

    @property
    def phase(self) -> str:
        return self.point.phase


def configuration_key(point: MeasuredPoint) -> tuple:
    """Everything but the measured value and its source: one run of the paper."""
    d = point.to_dict()
    for name in ("latency_s", "mfu", "source", "row"):
        d.pop(name)
    return tuple(sorted((k, str(v)) for k, v in d.items()))


def rows_of(points: list[MeasuredPoint]) -> list[Row]:
    keys: dict[tuple, int] = {}
    return [Row(p, keys.setdefault(configuration_key(p), len(keys)), model_flops(p))
            for p in points]


# ----------------------------------------------------------------------------- fast terms


@dataclass
class RowTerms:
    """Every cost-model call of every row at unit constants, and how calls make rows."""

    terms: PhaseTerms
    row: np.ndarray          # per call: its row
    variant: np.ndarray      # per call: its FFN variant (0..2)
    weight: np.ndarray       # per call: its multiplier (decode steps)
    n_rows: int

    @classmethod
    def of(cls, rows: list[Row], kinds: tuple[str, ...]) -> "RowTerms":
        calls = [(i, v, w, args) for i, r in enumerate(rows)
                 for v, ffn in enumerate(variants(r.point))
                 for w, args in phase_calls(r.point, ffn)]
        terms = PhaseTerms.from_calls([args for *_, args in calls], kinds, [1.0] * len(calls))
        return cls(terms, np.array([c[0] for c in calls]), np.array([c[1] for c in calls]),
                   np.array([c[2] for c in calls], dtype=float), len(rows))

    def latency(self, theta: np.ndarray, space: ParamSpace) -> np.ndarray:
        """Each row's latency: the weighted sum of its calls, the fastest variant."""
        per_call = self.terms.latency(theta, space) * self.weight
        sums = np.zeros((self.n_rows, 3))
        np.add.at(sums, (self.row, self.variant), per_call)
        present = np.zeros((self.n_rows, 3), dtype=bool)
        present[self.row, self.variant] = True
        return np.where(present, sums, np.inf).min(axis=1)


def row_space(rows: list[Row]) -> ParamSpace:
    """One fixed latency per collective kind the rows use (as fit.default_space does)."""
    if not by_kind_supported():
        return ParamSpace(("",))
    seen = set()
    for r in rows:
        for ffn in variants(r.point):
            for _, args in phase_calls(r.point, ffn):
                seen.update(c.kind for c in costmodel.predict_phase(hw=_UNIT, **args).collectives)
    return ParamSpace(tuple(k for k in COLLECTIVE_KINDS if k in seen) or ("",))


# ----------------------------------------------------------------------------- predicting


def predict_latency(row: Row, profile: HardwareProfile) -> float:
    """The cost model's latency of the row (seconds), whatever the row measured."""
    as_latency = dataclasses.replace(row.point, latency_s=1.0, mfu=None)
    return predict_point(as_latency, profile)


def metric_of(row: Row, latency: np.ndarray | float, published_peak: float):
    """The row's published metric from a latency: itself, or MFU against the published peak."""
    if row.point.metric == "latency_s":
        return latency
    return row.flops / (row.point.chips * published_peak * latency)


def measured_latency(row: Row, published_peak: float) -> float:
    """The latency a row's number implies (an MFU row: model FLOPs at that MFU)."""
    p = row.point
    return p.latency_s if p.metric == "latency_s" else row.flops / (p.chips * published_peak * p.mfu)


# ----------------------------------------------------------------------------- fitting


def fit_rows(rows: list[Row], base: HardwareProfile, space: ParamSpace | None = None,
             loss: str = "linear", name: str | None = None) -> Fit:
    """fit.fit_profile's least squares, on the rows' published metrics."""
    if not rows:
        raise CalibrationError("rows", 0, "at least one measurement row to fit")
    space = space or row_space(rows)
    base = without_group_measurements(base)   # as fit.fit_profile: the fit's start
    peak = base.peak_flops
    measured = np.array([r.point.measured for r in rows])
    is_mfu = np.array([r.point.metric == "mfu" for r in rows])
    flops_per_peak = np.array([r.flops / (r.point.chips * peak) for r in rows])
    terms = RowTerms.of(rows, space.kinds)
    exact = _fast_path_agrees(rows, terms, space, base)
    anchor = prior_anchor(base)

    def residuals(theta: np.ndarray) -> np.ndarray:
        if exact:
            latency = terms.latency(theta, space)
        else:   # the cost model changed shape: call it for every row (slow, still right)
            profile = space.profile(theta, base)
            latency = np.array([predict_latency(r, profile) for r in rows])
        predicted = np.where(is_mfu, flops_per_peak / latency, latency)
        prior = PRIOR_WEIGHT * (theta[:3] - anchor)
        return np.concatenate([predicted / measured - 1.0, prior])

    return solve(residuals, space, base, exact, loss, name)


def _fast_path_agrees(rows, terms: RowTerms, space: ParamSpace, base) -> bool:
    theta = space.start(base, 1e-5, 0.5)
    fast = terms.latency(theta, space)
    profile = space.profile(theta, base)
    slow = np.array([predict_latency(r, profile) for r in rows])
    agrees = bool(np.allclose(fast, slow, rtol=1e-5, atol=0.0))   # float noise in a few sums
    if not agrees:
        warnings.warn("external fit: the cost model's latency is no longer (1-o)*sum + o*max + "
                      "overhead of linear terms; fitting through predict_phase (slow)")
    return agrees


# ----------------------------------------------------------------------------- hold-out


def external_folds(rows: list[Row], scheme: str, seed: int = 0) -> list[np.ndarray]:
    """Index arrays of held-out rows; a configuration's rows are held out together."""
    if scheme not in EXTERNAL_HOLDOUTS:
        raise ConfigError("--holdout", scheme, f"one of {list(EXTERNAL_HOLDOUTS)} (with --measurements)")
    configs = sorted({r.trial for r in rows})
    if scheme == "loo":
        fold_of = {c: c for c in configs}
    else:
        order = np.random.default_rng(seed).permutation(configs)
        k = max(2, min(K_FOLDS, len(configs)))
        fold_of = {int(c): i % k for i, c in enumerate(order)}
    keys = np.array([fold_of[r.trial] for r in rows])
    return [np.flatnonzero(keys == key) for key in sorted(set(keys.tolist()))]


def row_frame(rows: list[Row], latency: np.ndarray, published_peak: float,
              fold: np.ndarray | None = None) -> pd.DataFrame:
    """One line per row: the published metric measured and predicted, its absolute percent
    error (`ape`), and latency equivalents (`measured_s`, `predicted_s`) for the rankings."""
    out = []
    for i, (r, lat) in enumerate(zip(rows, latency)):
        p = r.point
        predicted = float(metric_of(r, lat, published_peak))
        out.append({"row": p.row, "trial": r.trial, "source": p.source, "metric": p.metric,
                    "phase": p.phase, "layout": f"{p.ffn}/{p.attn}", "ffn": p.ffn, "attn": p.attn,
                    "topology": "x".join(map(str, p.topology)) if p.topology else "best",
                    "chips": p.chips, "batch": p.batch, "model": p.model, "weights": p.weights,
                    "input_len": p.input_len, "context": p.context,
                    "decode_steps": p.decode_steps, "measured": p.measured,
                    "predicted": predicted, "relative_error": predicted / p.measured - 1,
                    "ape": abs(predicted / p.measured - 1),
                    "measured_s": measured_latency(r, published_peak), "predicted_s": float(lat),
                    "fold": int(fold[i]) if fold is not None else -1})
    return pd.DataFrame(out)


def heldout_rows(rows: list[Row], base: HardwareProfile, scheme: str, loss: str = "linear",
                 space: ParamSpace | None = None,
                 tie_reference: np.ndarray | None = None) -> Holdout:
    """Predict every row from a fit on the other folds; score only those predictions."""
    splits = external_folds(rows, scheme)
    latency = np.full(len(rows), math.nan)
    fold_id = np.full(len(rows), -1)
    for i, test in enumerate(splits):
        held = set(test.tolist())
        train = [r for j, r in enumerate(rows) if j not in held]
        fitted = fit_rows(train, base, space, loss).profile
        for j in test:
            latency[j] = predict_latency(rows[j], fitted)
            fold_id[j] = i
    df = row_frame(rows, latency, base.peak_flops, fold_id)
    df["tie_s"] = tie_reference if tie_reference is not None else df["predicted_s"]
    top1, top1_tol, tau, groups = ranking_agreement(df)
    ape = df["ape"]
    return Holdout(scheme, df, float(ape.mean()), float(ape.median()), float(ape.max()),
                   top1, top1_tol, tau, groups, len(splits))


def calibrate_measurements(path: str | Path, base: HardwareProfile, holdouts=("loo",),
                           loss: str = "linear") -> Calibration:
    """Fit `base`'s constants to every row of the CSV and evaluate each hold-out scheme."""
    holdouts = tuple(holdouts)
    for scheme in holdouts:
        if scheme not in EXTERNAL_HOLDOUTS:
            raise ConfigError("--holdout", scheme, f"one of {list(EXTERNAL_HOLDOUTS)} (with --measurements)")
    rows = rows_of(load_measurements(path))
    configs = len({r.trial for r in rows})
    if configs < MIN_CONFIGURATIONS:
        raise CalibrationError("measurements", str(path), f"at least {MIN_CONFIGURATIONS} distinct "
                               f"configurations to fit and hold out (it has {configs})")
    space = row_space(rows)
    fit = fit_rows(rows, base, space, loss, name=f"{base.name}-fitted")
    insample_latency = np.array([predict_latency(r, fit.profile) for r in rows])
    insample = row_frame(rows, insample_latency, base.peak_flops)
    results = {scheme: heldout_rows(rows, base, scheme, loss, space, insample_latency)
               for scheme in holdouts}
    return Calibration(Path(path).name, base, fit.profile, rows, insample, results, holdouts[0], fit)


def unfitted_frame(result: Calibration) -> pd.DataFrame:
    """The starting (peak) profile's predictions of every row, for the comparison table."""
    latency = np.array([predict_latency(r, result.base) for r in result.points])
    return row_frame(result.points, latency, result.base.peak_flops)
