"""Fit the cost model's hardware constants to measured trials; report held-out error.

What is fitted (docs/architecture.md "The analytical cost model"): only `HardwareProfile` constants,
never the formulas of `workloads/costmodel.py`:

  peak_flops      effective FLOP/s          compute_s = FLOPs / (n * peak_flops)
  hbm_bandwidth   effective bytes/s         memory_s  = bytes read / hbm_bandwidth
  ici_bandwidth   effective bytes/s         comm_s    = bytes * factor / ici_bandwidth
  collective_latency_s_by_kind              + count * latency, per collective kind
  op_overhead_s   per layer-phase           + op_overhead_s * n_layers
  overlap         in [0, 1]                 (1 - o) * sum(terms) + o * max(terms)

Each measured trial gives two points, `prefill_s` and `decode_step_s`. The objective is
the relative error pred/measured - 1, minimised by `scipy.optimize.least_squares` over
log-parameters (positive constants) and a logistic overlap. Held-out error: every point is
predicted by a fit that did not see it — k-fold over trial shapes (all layouts of one
batch/chips shape held out together), leave-one-layout-out, or leave-one-chip-count-out —
and only those predictions enter MAPE, median and max absolute percent error and the
ranking agreement (per (batch, chips, phase) group, with model, weights and lengths equal:
does the fitted model pick the measured-best layout, and Kendall's tau between predicted and
measured layout times; groups where the model predicts all layouts equal are left out).

Speed: a point's latency is linear in 1/peak, 1/bandwidths and the latencies once overlap is
fixed, so each point is decomposed once into its terms by calling `predict_phase` with unit
profiles (`PhaseTerms`); the optimiser evaluates those terms with numpy. Every reported
prediction is made again by `costmodel.predict_phase` with the fitted profile, and the two
are checked to agree (a cost-model change that breaks the decomposition falls back to
calling `predict_phase` inside the fit).

Emulated mesh: the `host` profile is the whole machine and a trial's virtual chip gets a
share of it (`workloads.hardware.per_chip`: peak numbers x cores fraction / chips). The fitted
profile is the whole host; each point's own profile is that profile scaled by the trial's
share, which is recovered from the trial's stored prediction (pred compute time).
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping

import numpy as np
import pandas as pd

from sweeper.formatting import jsonable, percent_dash
from workloads import costmodel
from workloads.config import ConfigError, HardwareProfile, load_model
from workloads.hardware import load_hardware
from workloads.layouts import COLLECTIVE_KINDS, PHASES, PhaseLayout, stores_1d
from workloads.trial import DEFAULTS as TRIAL_DEFAULTS, TrialConfig

HOLDOUTS = ("kfold", "layout", "chips")
HOLDOUT_TEXT = {
    "kfold": "k-fold over trial shapes (all layouts of one batch/chips/... shape held out together)",
    "layout": "leave-one-layout-out (every point of one FFN/attention layout held out together)",
    "chips": "leave-one-chip-count-out (every point of one chip count held out together)",
}
PHASE_METRIC = {"prefill": "prefill_s", "decode": "decode_step_s"}
MIN_TRIALS = 6           # 12 points for at most 9 constants, with points left to hold out
K_FOLDS = 5
TOP1_TOLERANCE = 0.05    # "within 5%": the model's pick is measured within 5% of the best
PREDICTED_TIE = 1e-9     # predictions this close are one pick (float noise of equal formulas)
PRIOR_WEIGHT = 0.01      # weak pull of log peak/bandwidths toward the starting profile
LATENCY_BOUNDS = (1e-12, 1.0)
FACTOR_BOUND = 1e4       # peak and bandwidths move at most this factor from the start


class CalibrationError(ConfigError):
    """Too few measured points (or none): one line for the CLI, exit code 2."""


# ----------------------------------------------------------------------------- points


@dataclass
class Point:
    """One measured phase time of one trial, with what the cost model needs to predict it."""

    trial: int
    phase: str
    config: TrialConfig
    measured_s: float
    scale: float = 1.0       # the trial's per-chip profile = fitted whole profile x scale

    @property
    def layout(self) -> PhaseLayout:
        return self.config.prefill if self.phase == "prefill" else self.config.decode

    @property
    def layout_key(self) -> str:
        return str(self.layout)

    @property
    def shape_key(self) -> tuple:
        """Everything but the layouts: trials of one shape compete in the rankings."""
        c = self.config
        return (c.model.name, c.weights, c.input_len, c.decode_steps, c.batch, c.chips)


def phase_arguments(config: TrialConfig, phase: str) -> dict[str, Any]:
    """The arguments `costmodel.predict` gives `predict_phase` for this phase of a trial."""
    layout = config.prefill if phase == "prefill" else config.decode
    # the decode context exactly as costmodel.predict computes it (fit and sweep agree)
    context = config.input_len if phase == "prefill" else costmodel.decode_context(config)
    return dict(model=config.model, chips=config.chips, batch=config.batch, phase=phase,
                input_len=config.input_len, context=context, layout=layout,
                weights=config.weights, topology=config.mesh_shape,
                one_d=stores_1d(config.prefill, config.decode), validate=False)


def predict_point(point: Point, profile: HardwareProfile) -> float:
    """The cost model's latency of the point with `profile` (the whole, unscaled profile)."""
    args = phase_arguments(point.config, point.phase)
    return costmodel.predict_phase(hw=profile.scaled(point.scale), **args).latency_s


def _trial_scale(config: TrialConfig, row: Mapping, base: HardwareProfile) -> float:
    """The trial's per-chip share of `base`: recorded with the trial (`hardware_share`).

    Studies from before it was recorded: recovered from the compute time the sweep predicted
    (pred compute_s = FLOPs / (chips * peak_chip), so peak_chip = (FLOPs / chips) / compute_s);
    without a stored prediction, the whole profile split over the chips for a measured
    (host) profile, the profile itself otherwise."""
    recorded = _float(row.get("hardware_share"))
    if math.isfinite(recorded) and recorded > 0:
        return recorded
    for phase in PHASES:
        pred = _float(row.get(f"pred_{phase}_compute_s"))
        if math.isfinite(pred) and pred > 0:
            unit = costmodel.predict_phase(hw=_UNIT, **phase_arguments(config, phase))
            return (unit.compute_s / pred) / base.peak_flops
    return 1.0 / config.chips if base.measured else 1.0


def _float(value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def _config_of(row: Mapping, configs: Mapping[int, Mapping] | None) -> TrialConfig:
    number = int(row["number"])
    if configs and number in configs:
        return TrialConfig.from_dict(configs[number], validate=False).resolved()
    topology = row.get("topology")
    data = {"model": load_model(row["model"]), "chips": int(row["chips"]),
            "batch": int(row["batch"]), "input_len": int(row["input_len"]),
            "decode_steps": int(row["decode_steps"]),
            "weights": row.get("weights") or TRIAL_DEFAULTS["weights"],
            "topology": topology if isinstance(topology, str) and topology else None,
            "prefill": {"ffn": row["prefill_ffn"], "attn": row["prefill_attn"]},
            "decode": {"ffn": row["decode_ffn"], "attn": row["decode_attn"]}}
    return TrialConfig.from_dict(data, validate=False).resolved()


def points_from_frame(df: pd.DataFrame, base: HardwareProfile,
                      configs: Mapping[int, Mapping] | None = None,
                      sources: Iterable[str] = ("measured",)) -> list[Point]:
    """Two points (prefill_s, decode_step_s) per COMPLETE trial of an accepted source."""
    sources = tuple(sources)
    out: list[Point] = []
    for _, row in df.iterrows():
        if str(row.get("state", "COMPLETE")).upper() != "COMPLETE":
            continue
        if row.get("source") not in sources:
            continue
        config = _config_of(row, configs)
        scale = _trial_scale(config, row, base)
        for phase in PHASES:
            value = _float(row.get(PHASE_METRIC[phase]))
            if math.isfinite(value) and value > 0:
                out.append(Point(int(row["number"]), phase, config, value, scale))
    return out


# ----------------------------------------------------------------------------- parameters

_UNIT = HardwareProfile("unit", peak_flops=1.0, hbm_bandwidth=1.0, hbm_bytes=1.0, ici_bandwidth=1.0)


def by_kind_supported() -> bool:
    """Does the cost model charge `collective_latency_s_by_kind`? (A fitted per-kind
    latency the model ignored would be a constant that changes nothing.)"""
    if not any(f.name == "collective_latency_s_by_kind" for f in dataclasses.fields(HardwareProfile)):
        return False
    from workloads.layouts import Collective

    probe = dataclasses.replace(_UNIT, collective_latency_s_by_kind={"all-gather": 1.0})
    ops = [Collective("all-gather", ("x",), 1, 2, 3, "probe")]
    return costmodel.comm_time_s(ops, probe) > costmodel.comm_time_s(ops, _UNIT)


@dataclass(frozen=True)
class ParamSpace:
    """The free constants and their transforms (log for positives, logistic for overlap)."""

    kinds: tuple[str, ...]          # collective kinds with their own latency ("" = one for all)

    @property
    def names(self) -> list[str]:
        lat = [f"collective_latency_s[{k}]" if k else "collective_latency_s" for k in self.kinds]
        return ["peak_flops", "hbm_bandwidth", "ici_bandwidth", *lat, "op_overhead_s", "overlap"]

    def start(self, base: HardwareProfile, latency: float, overlap: float) -> np.ndarray:
        lat = [math.log(latency)] * len(self.kinds)
        return np.array([math.log(base.peak_flops), math.log(base.hbm_bandwidth),
                         math.log(base.ici_bandwidth), *lat, math.log(latency),
                         _logit(overlap)])

    def bounds(self, base: HardwareProfile) -> tuple[np.ndarray, np.ndarray]:
        span = math.log(FACTOR_BOUND)
        lo_lat, hi_lat = (math.log(b) for b in LATENCY_BOUNDS)
        lows = [math.log(base.peak_flops) - span, math.log(base.hbm_bandwidth) - span,
                math.log(base.ici_bandwidth) - span] + [lo_lat] * (len(self.kinds) + 1) + [-12.0]
        highs = [math.log(base.peak_flops) + span, math.log(base.hbm_bandwidth) + span,
                 math.log(base.ici_bandwidth) + span] + [hi_lat] * (len(self.kinds) + 1) + [12.0]
        return np.array(lows), np.array(highs)

    def profile(self, theta: np.ndarray, base: HardwareProfile, name: str | None = None) -> HardwareProfile:
        peak, hbm, ici = (float(math.exp(v)) for v in theta[:3])
        lat = [float(math.exp(v)) for v in theta[3:3 + len(self.kinds)]]
        overhead = float(math.exp(theta[3 + len(self.kinds)]))
        overlap = float(_sigmoid(theta[-1]))
        values: dict[str, Any] = dict(peak_flops=peak, hbm_bandwidth=hbm, ici_bandwidth=ici,
                                      op_overhead_s=overhead, overlap=overlap,
                                      name=name or base.name)
        if self.kinds == ("",):
            values["collective_latency_s"] = lat[0]
        else:
            values["collective_latency_s"] = float(np.median(lat)) if lat else 0.0
            values["collective_latency_s_by_kind"] = dict(zip(self.kinds, lat))
        return dataclasses.replace(base, **values)


def _logit(p: float) -> float:
    p = min(max(p, 1e-6), 1 - 1e-6)
    return math.log(p / (1 - p))


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


# ----------------------------------------------------------------------------- fast terms


@dataclass
class PhaseTerms:
    """A point's latency terms at unit constants, taken from `predict_phase` (see module doc)."""

    compute: np.ndarray      # FLOPs / n            (compute_s at peak 1)
    memory: np.ndarray       # bytes read           (memory_s at bandwidth 1)
    comm: np.ndarray         # bytes * factor       (comm_s at bandwidth 1, no latency)
    counts: np.ndarray       # [points, kinds] collective ops per kind
    layers: np.ndarray       # op_overhead_s multiplier
    scale: np.ndarray        # per-point share of the profile

    @classmethod
    def of(cls, points: list[Point], kinds: tuple[str, ...]) -> "PhaseTerms":
        rows = []
        for p in points:
            args = phase_arguments(p.config, p.phase)
            base = costmodel.predict_phase(hw=_UNIT, **args)
            with_overhead = costmodel.predict_phase(hw=dataclasses.replace(_UNIT, op_overhead_s=1.0), **args)
            counts = []
            for kind in kinds:
                probe = (dataclasses.replace(_UNIT, collective_latency_s=1.0) if kind == ""
                         else dataclasses.replace(_UNIT, collective_latency_s_by_kind={kind: 1.0}))
                counts.append(costmodel.predict_phase(hw=probe, **args).comm_s - base.comm_s)
            rows.append((base.compute_s, base.memory_s, base.comm_s, counts,
                         with_overhead.latency_s - base.latency_s, p.scale))
        return cls(np.array([r[0] for r in rows]), np.array([r[1] for r in rows]),
                   np.array([r[2] for r in rows]),
                   np.array([r[3] for r in rows], dtype=float).reshape(len(rows), len(kinds)),
                   np.array([r[4] for r in rows]), np.array([r[5] for r in rows]))

    def latency(self, theta: np.ndarray, n_kinds: int) -> np.ndarray:
        """costmodel.predict_phase's latency_s, vectorised over points (module doc formula)."""
        peak, hbm, ici = np.exp(theta[:3])
        lat = np.exp(theta[3:3 + n_kinds])
        overhead = math.exp(theta[3 + n_kinds])
        overlap = _sigmoid(theta[-1])
        compute = self.compute / (peak * self.scale)
        memory = self.memory / (hbm * self.scale)
        comm = self.comm / (ici * self.scale) + self.counts @ lat
        terms = np.stack([compute, memory, comm])
        return ((1 - overlap) * terms.sum(axis=0) + overlap * terms.max(axis=0)
                + overhead * self.layers)


# ----------------------------------------------------------------------------- fitting


@dataclass
class Fit:
    profile: HardwareProfile
    cost: float
    success: bool
    message: str
    nfev: int


def fit_profile(points: list[Point], base: HardwareProfile, space: ParamSpace | None = None,
                loss: str = "linear", name: str | None = None) -> Fit:
    """Least squares on relative error over log-parameters; a few starts, the best kept."""
    from scipy.optimize import least_squares

    if not points:
        raise CalibrationError("points", 0, "at least one measured point to fit")
    space = space or default_space(points)
    n_kinds = len(space.kinds)
    measured = np.array([p.measured_s for p in points])
    terms = PhaseTerms.of(points, space.kinds)
    theta_check = space.start(base, 1e-5, 0.5)
    exact = _fast_path_agrees(points, terms, space, theta_check, base)
    anchor = np.array([math.log(base.peak_flops), math.log(base.hbm_bandwidth),
                       math.log(base.ici_bandwidth)])

    def residuals(theta: np.ndarray) -> np.ndarray:
        if exact:
            pred = terms.latency(theta, n_kinds)
        else:   # the cost model changed shape: call it for every point (slow, still right)
            profile = space.profile(theta, base)
            pred = np.array([predict_point(p, profile) for p in points])
        prior = PRIOR_WEIGHT * (theta[:3] - anchor)
        return np.concatenate([pred / measured - 1.0, prior])

    lows, highs = space.bounds(base)
    best = None
    for latency0 in (1e-6, 1e-4):
        for overlap0 in (0.2, 0.8):
            x0 = np.clip(space.start(base, latency0, overlap0), lows + 1e-9, highs - 1e-9)
            result = least_squares(residuals, x0, bounds=(lows, highs), loss=loss,
                                   f_scale=0.1, x_scale=1.0, max_nfev=400 if exact else 60)
            if best is None or result.cost < best.cost:
                best = result
    profile = space.profile(best.x, base, name)
    return Fit(profile, float(best.cost), bool(best.success), str(best.message), int(best.nfev))


def _fast_path_agrees(points, terms, space, theta, base) -> bool:
    fast = terms.latency(theta, len(space.kinds))
    profile = space.profile(theta, base)
    slow = np.array([predict_point(p, profile) for p in points[:20]])
    agrees = bool(np.allclose(fast[:len(slow)], slow, rtol=1e-9, atol=0.0))
    if not agrees:
        warnings.warn("calibrate: the cost model's latency is no longer (1-o)*sum + o*max + "
                      "overhead of linear terms; fitting through predict_phase (slow)")
    return agrees


def default_space(points: list[Point]) -> ParamSpace:
    """One latency per collective kind seen in the points (if the cost model charges it)."""
    if not by_kind_supported():
        return ParamSpace(("",))
    seen = set()
    for p in points:
        args = phase_arguments(p.config, p.phase)
        seen.update(c.kind for c in costmodel.predict_phase(hw=_UNIT, **args).collectives)
    kinds = tuple(k for k in COLLECTIVE_KINDS if k in seen)
    return ParamSpace(kinds or ("",))


# ----------------------------------------------------------------------------- held-out error


def folds(points: list[Point], scheme: str, k: int = K_FOLDS, seed: int = 0) -> list[np.ndarray]:
    """Index arrays of held-out points, each point held out exactly once."""
    if scheme not in HOLDOUTS:
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

    @property
    def errors(self) -> pd.DataFrame:
        return error_table(self.points)

    def summary(self) -> dict[str, Any]:
        return {"scheme": self.scheme, "n_points": int(len(self.points)), "folds": self.folds,
                "mape_heldout": self.mape, "median_ape_heldout": self.median_ape,
                "max_ape_heldout": self.max_ape, "top1_agreement": self.top1_agreement,
                "top1_within_5pct": self.top1_within_tolerance,
                "kendall_tau": self.kendall_tau, "ranking_groups": self.groups,
                "skipped": self.skipped}


def point_frame(points: list[Point], predicted: np.ndarray, fold: np.ndarray | None = None) -> pd.DataFrame:
    rows = []
    for i, (p, pred) in enumerate(zip(points, predicted)):
        c = p.config
        rows.append({"trial": p.trial, "phase": p.phase, "layout": p.layout_key,
                     "ffn": p.layout.ffn, "attn": p.layout.attn,
                     "topology": "x".join(map(str, c.mesh_shape)), "chips": c.chips,
                     "batch": c.batch, "model": c.model.name, "weights": c.weights,
                     "input_len": c.input_len, "decode_steps": c.decode_steps,
                     "measured_s": p.measured_s, "predicted_s": float(pred),
                     "ape": abs(float(pred) - p.measured_s) / p.measured_s,
                     "fold": int(fold[i]) if fold is not None else -1})
    return pd.DataFrame(rows)


def heldout(points: list[Point], base: HardwareProfile, scheme: str = "kfold",
            space: ParamSpace | None = None, loss: str = "linear", seed: int = 0,
            tie_reference: np.ndarray | None = None) -> Holdout:
    """Predict every point from a fit on the other folds; score only those predictions.

    `tie_reference`: one model's predictions of all points (the fit on everything), used only
    to tell which layouts the formulas make equal; without it, the held-out predictions."""
    splits = folds(points, scheme, seed=seed)
    predicted = np.full(len(points), math.nan)
    fold_id = np.full(len(points), -1)
    if len(splits) < 2:
        df = point_frame(points, predicted, fold_id)
        return Holdout(scheme, df, *([math.nan] * 6), 0, len(splits),
                       skipped=f"only one {scheme} group: nothing to hold out")
    for i, test in enumerate(splits):
        held = set(test.tolist())
        train = [p for j, p in enumerate(points) if j not in held]
        # Latencies only for the kinds the training points contain; a held-out layout's
        # unseen kind is charged the fitted `collective_latency_s` (median of the others).
        fitted = fit_profile(train, base, default_space(train) if space is None else space,
                             loss).profile
        for j in test:
            predicted[j] = predict_point(points[j], fitted)
            fold_id[j] = i
    df = point_frame(points, predicted, fold_id)
    df["tie_s"] = tie_reference if tie_reference is not None else df["predicted_s"]
    top1, top1_tol, tau, groups = ranking_agreement(df)
    ape = df["ape"]
    return Holdout(scheme, df, float(ape.mean()), float(ape.median()), float(ape.max()),
                   top1, top1_tol, tau, groups, len(splits))


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
    from scipy.stats import kendalltau

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
              study: str = "", loss: str = "linear", min_trials: int = MIN_TRIALS) -> Calibration:
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
    space = default_space(points)
    fit = fit_profile(points, base, space, loss, name=f"{base.name}-fitted")
    insample = point_frame(points, np.array([predict_point(p, fit.profile) for p in points]))
    reference = insample["predicted_s"].to_numpy()
    results = {scheme: heldout(points, base, scheme, None, loss, tie_reference=reference)
               for scheme in holdouts}
    return Calibration(study, base, fit.profile, points, insample, results, holdouts[0], fit)


# ----------------------------------------------------------------------------- studies


def study_base_profile(attrs: Mapping[str, Any]) -> HardwareProfile:
    """The profile the sweep predicted with: `host` (this host, measured and cached), a
    preset or a YAML (relative to the space file), from the study's `hardware` label.
    A study that stored the profile itself (user attr `hardware_profile`) gives that one."""
    if isinstance(attrs.get("hardware_profile"), Mapping):
        return HardwareProfile.from_dict(attrs["hardware_profile"], source="study user_attrs")
    label = str(attrs.get("hardware") or "host")
    kind, _, profile = label.partition(":")
    spec = profile or "host"
    if spec.endswith((".yaml", ".yml")) and not Path(spec).is_absolute() and attrs.get("space_file"):
        candidate = Path(str(attrs["space_file"])).parent / spec
        if candidate.is_file():
            spec = str(candidate)
    return load_hardware(spec, field="hardware")


@dataclass
class StudyData:
    """A study's trials as `sweeper.tracking.results` reads them, plus what calibration needs."""

    name: str
    storage: str
    frame: pd.DataFrame
    attrs: dict[str, Any]
    configs: dict[int, dict]

    @property
    def parent_run_id(self) -> str | None:
        return self.attrs.get("mlflow_parent_run_id")

    @property
    def tracking_uri(self) -> str | None:
        return self.attrs.get("tracking_uri")

    @property
    def source(self) -> str:
        return str(self.attrs.get("source") or "measured")


def load_study_data(study_name: str, storage: str | None = None) -> StudyData:
    from sweeper.tracking import results
    from sweeper.paths import default_storage

    storage = storage or default_storage(create=False)
    frame = results.load_trials(study_name, storage)
    study = results.load_study(study_name, storage)
    configs = {t.number: t.user_attrs["config"] for t in study.get_trials(deepcopy=False)
               if isinstance(t.user_attrs.get("config"), Mapping)}
    return StudyData(study_name, storage, frame, dict(study.user_attrs), configs)


def calibrate_study(data: StudyData, holdouts: Iterable[str] = ("kfold",),
                    start: HardwareProfile | None = None, loss: str = "linear") -> Calibration:
    """Calibrate a study's measured trials. Each trial's share of the hardware is taken
    relative to the profile the sweep used; `start` only changes where the fit begins."""
    if data.source != "measured":
        raise CalibrationError("study", data.name, "a study of measured trials (this one is "
                               f"{data.source}: the cost model fitted to itself says nothing)")
    swept = study_base_profile(data.attrs)
    points = points_from_frame(data.frame, swept, data.configs)
    result = calibrate(points, start or swept, holdouts, data.name, loss)
    result.parent_run_id, result.tracking_uri = data.parent_run_id, data.tracking_uri
    return result


# ----------------------------------------------------------------------------- outputs


def write_profile(profile: HardwareProfile, path: str | Path, note: str | None = None) -> Path:
    """A hardware YAML that `--hardware` (HardwareProfile.from_dict) loads back."""
    import yaml

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = profile.to_dict()
    if not data.get("collective_latency_s_by_kind"):
        data.pop("collective_latency_s_by_kind", None)
    header = f"# {note}\n" if note else ""
    path.write_text(header + yaml.safe_dump(data, sort_keys=False))
    HardwareProfile.from_dict(yaml.safe_load(path.read_text()), source=str(path))  # round-trips
    return path


def write_outputs(result: Calibration, out_dir: str | Path, fitted_yaml: str | Path | None = None) -> dict[str, str]:
    """errors.csv / errors.json / heldout_points.csv / predicted_vs_measured.png / fitted YAML."""
    from sweeper.analysis import plots

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    files: dict[str, str] = {}
    tables = []
    for name, ho in result.holdouts.items():
        table = ho.errors.assign(holdout=name)
        tables.append(table)
    errors = pd.concat(tables, ignore_index=True) if tables else pd.DataFrame()
    errors.to_csv(out_dir / "errors.csv", index=False)
    files["errors_csv"] = str(out_dir / "errors.csv")
    (out_dir / "errors.json").write_text(json.dumps(jsonable(result.summary()), indent=2))
    files["errors_json"] = str(out_dir / "errors.json")
    pd.concat([ho.points.assign(holdout=n) for n, ho in result.holdouts.items()],
              ignore_index=True).to_csv(out_dir / "heldout_points.csv", index=False)
    files["heldout_points_csv"] = str(out_dir / "heldout_points.csv")
    fig = plots.predicted_vs_measured_figure(
        result.main.points, f"study {result.study}: held-out predictions ({HOLDOUT_TEXT[result.headline]}), "
        f"MAPE {percent_dash(result.main.mape)}; measured on this host")
    (out_dir / "predicted_vs_measured.png").write_bytes(plots.png_bytes(fig))
    files["predicted_vs_measured_png"] = str(out_dir / "predicted_vs_measured.png")
    yaml_path = Path(fitted_yaml) if fitted_yaml else out_dir / f"{result.fitted.name}.yaml"
    write_profile(result.fitted, yaml_path,
                  note=f"fitted by `sweeper fit` to study {result.study} ({len(result.points)} "
                       f"points); held-out MAPE {percent_dash(result.main.mape)}")
    files["fitted_yaml"] = str(yaml_path)
    result.artifacts = files
    return files


def log_to_mlflow(result: Calibration, files: Mapping[str, str]) -> bool:
    """Metrics and artifacts on the sweep's parent run; False when there is none."""
    if not (result.parent_run_id and result.tracking_uri):
        return False
    from mlflow.entities import Metric
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=result.tracking_uri)
    now = int(time.time() * 1000)
    metrics = []
    for name, ho in result.holdouts.items():
        for key, value in (("mape", ho.mape), ("median_ape", ho.median_ape), ("max_ape", ho.max_ape),
                           ("top1_agreement", ho.top1_agreement), ("kendall_tau", ho.kendall_tau)):
            if math.isfinite(value):
                metrics.append(Metric(f"heldout_{key}_{name}", float(value), now, 0))
                if name == result.headline:
                    metrics.append(Metric(f"heldout_{key}" if key != "top1_agreement"
                                          else "top1_agreement", float(value), now, 0))
    metrics.append(Metric("calibration_points", float(len(result.points)), now, 0))
    client.log_batch(result.parent_run_id, metrics=metrics)
    for path in files.values():
        client.log_artifact(result.parent_run_id, path, artifact_path="calibration")
    return True
