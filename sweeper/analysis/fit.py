"""Fit the cost model's hardware constants to measured points (docs/architecture.md,
"The analytical cost model"): only `HardwareProfile` constants, never the formulas of
`workloads/costmodel.py`:

  peak_flops      effective FLOP/s          compute_s = FLOPs / (n * peak_flops)
  hbm_bandwidth   effective bytes/s         memory_s  = bytes read / hbm_bandwidth
  ici_bandwidth   effective bytes/s         comm_s    = bytes * factor / ici_bandwidth
  collective_latency_s_by_kind              + count * latency, per collective kind
  op_overhead_s   per layer-phase           + op_overhead_s * n_layers
  overlap         in [0, 1]                 (1 - o) * sum(terms) + o * max(terms)
  collective_latency_s_per_device           + per op x (group size - 1), in comm_s
  launch_overhead_s                         + once per phase call (EXTRA_TERMS: their reasons)

Each point's relative error is weighted by its measured uncertainty (`point_weights`).

Each measured trial gives two points, `prefill_s` and `decode_step_s`. The objective is
the relative error pred/measured - 1, minimised by `scipy.optimize.least_squares` over
log-parameters (positive constants) and a logistic overlap.

Speed: a point's latency is linear in 1/peak, 1/bandwidths and the latencies once overlap is
fixed, so each point is decomposed once into its terms by calling `predict_phase` with unit
profiles (`PhaseTerms`); the optimiser evaluates those terms with numpy. Every reported
prediction is made again by `costmodel.predict_phase` with the fitted profile, and the two
are checked to agree (a cost-model change that breaks the decomposition falls back to
calling `predict_phase` inside the fit).

Emulated mesh: the `host` profile is the whole machine and a trial's virtual chip gets a
share of it (`workloads.hardware.per_chip`: peak numbers x cores fraction / chips). The fitted
profile is the whole host; each point's own profile is that profile scaled by the trial's
share, recorded with the trial (`hardware_share`; older studies: recovered from the stored
prediction).
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

import numpy as np
import pandas as pd
from scipy.optimize import least_squares

from workloads import costmodel
from workloads.config import ConfigError, HardwareProfile, load_model
from workloads.layouts import COLLECTIVE_KINDS, PHASES, PhaseLayout, stores_1d
from workloads.layouts import Collective
from workloads.trial import DEFAULTS as TRIAL_DEFAULTS, TrialConfig

PHASE_METRIC = {"prefill": "prefill_s", "decode": "decode_step_s"}
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
    ci_rel: float = math.nan  # the measurement's 95% CI half-width / median (nan: unknown)

    @property
    def layout(self) -> PhaseLayout:
        return self.config.prefill if self.phase == "prefill" else self.config.decode

    @property
    def layout_key(self) -> str:
        return str(self.layout)

    @property
    def replicate_key(self) -> tuple:
        """Everything that decides the program and its timing but the seed: points with the
        same key are replicates of one configuration (the noise floor, holdout.noise_floor)."""
        c = self.config
        return (self.phase, c.model.name, c.weights, c.input_len, c.decode_steps, c.batch,
                c.chips, tuple(c.mesh_shape), str(c.prefill), str(c.decode))

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
    seed = _float(row.get("seed"))
    if math.isfinite(seed):
        data["seed"] = int(seed)     # replicates differ only here (holdout.noise_floor)
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
                out.append(Point(int(row["number"]), phase, config, value, scale,
                                 _float(row.get(f"{phase}_ci_rel"))))
    return out


def point_weights(points: list[Point]) -> np.ndarray:
    """Each point's weight in the fit: 1 / its relative uncertainty, normalised to mean 1.

    sigma_i = sqrt(ci_i^2 + ci_typical^2), ci_typical = the median CI of the points: a noisy
    point (wide CI) counts less, and a very quiet one at most ~1.4x a typical one, because
    trials also differ from each other by more than their own CI (the replicate error).
    Points without a CI get the typical one; with no CI at all every weight is 1."""
    ci = np.array([p.ci_rel for p in points], float)
    known = ci[np.isfinite(ci) & (ci > 0)]
    if not len(known):
        return np.ones(len(points))
    typical = float(np.median(known))
    ci = np.where(np.isfinite(ci) & (ci > 0), ci, typical)
    weights = 1.0 / np.sqrt(ci ** 2 + typical ** 2)
    return weights / weights.mean()


# ----------------------------------------------------------------------------- parameters

_UNIT = HardwareProfile("unit", peak_flops=1.0, hbm_bandwidth=1.0, hbm_bytes=1.0, ici_bandwidth=1.0)


def by_kind_supported() -> bool:
    """Does the cost model charge `collective_latency_s_by_kind`? (A fitted per-kind
    latency the model ignored would be a constant that changes nothing.)"""
    if not any(f.name == "collective_latency_s_by_kind" for f in dataclasses.fields(HardwareProfile)):
        return False
    probe = dataclasses.replace(_UNIT, collective_latency_s_by_kind={"all-gather": 1.0})
    ops = [Collective("all-gather", ("x",), 1, 2, 3, "probe")]
    return costmodel.comm_time_s(ops, probe) > costmodel.comm_time_s(ops, _UNIT)


# Terms beyond the paper's constants, fitted because the measurements demand them (issue 10);
# each is a HardwareProfile field that workloads/costmodel.py charges:
#   collective_latency_s_per_device  per collective op x (group size - 1): a ring's hops, an
#                                     emulated mesh's rendezvous of g device threads
#   launch_overhead_s                once per phase call: program dispatch and the host sync
EXTRA_TERMS = ("collective_latency_s_per_device", "launch_overhead_s")
# The terms a default fit frees: those that lowered the held-out error of the recorded
# calibration sweep (benchmarks/results/calibration.md, "What each fitted term buys"); the
# others stay 0 unless a caller asks for them (`terms=`).
DEFAULT_TERMS: tuple[str, ...] = ()
EXTRA_BOUNDS = {"collective_latency_s_per_device": (1e-12, 1e-2),   # <= 10 ms per device-hop
                "launch_overhead_s": (1e-12, 1.0)}                  # <= 1 s per launch


@dataclass(frozen=True)
class ParamSpace:
    """The free constants and their transforms (log for positives, logistic for overlap).

    theta = [log peak, log hbm, log ici, log latency per kind..., log extra term...,
             log op_overhead_s, logit overlap]"""

    kinds: tuple[str, ...]          # collective kinds with their own latency ("" = one for all)
    terms: tuple[str, ...] = DEFAULT_TERMS   # the extra terms fitted (others stay 0)

    @property
    def names(self) -> list[str]:
        lat = [f"collective_latency_s[{k}]" if k else "collective_latency_s" for k in self.kinds]
        return ["peak_flops", "hbm_bandwidth", "ici_bandwidth", *lat, *self.terms,
                "op_overhead_s", "overlap"]

    def start(self, base: HardwareProfile, latency: float, overlap: float) -> np.ndarray:
        lat = [math.log(latency)] * len(self.kinds)
        extra = [math.log(min(max(latency, EXTRA_BOUNDS[t][0]), EXTRA_BOUNDS[t][1])) for t in self.terms]
        return np.array([math.log(base.peak_flops), math.log(base.hbm_bandwidth),
                         math.log(base.ici_bandwidth), *lat, *extra, math.log(latency),
                         _logit(overlap)])

    def bounds(self, base: HardwareProfile) -> tuple[np.ndarray, np.ndarray]:
        span = math.log(FACTOR_BOUND)
        lo_lat, hi_lat = (math.log(b) for b in LATENCY_BOUNDS)
        lows = [math.log(base.peak_flops) - span, math.log(base.hbm_bandwidth) - span,
                math.log(base.ici_bandwidth) - span] + [lo_lat] * len(self.kinds) \
            + [math.log(EXTRA_BOUNDS[t][0]) for t in self.terms] + [lo_lat, -12.0]
        highs = [math.log(base.peak_flops) + span, math.log(base.hbm_bandwidth) + span,
                 math.log(base.ici_bandwidth) + span] + [hi_lat] * len(self.kinds) \
            + [math.log(EXTRA_BOUNDS[t][1]) for t in self.terms] + [hi_lat, 12.0]
        return np.array(lows), np.array(highs)

    def split(self, theta: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, float, float]:
        """(peak/hbm/ici, latencies per kind, extra terms, op_overhead_s, overlap), untransformed."""
        k, t = len(self.kinds), len(self.terms)
        values = np.exp(theta[:-1])
        return (values[:3], values[3:3 + k], values[3 + k:3 + k + t], float(values[3 + k + t]),
                float(_sigmoid(theta[-1])))

    def profile(self, theta: np.ndarray, base: HardwareProfile, name: str | None = None) -> HardwareProfile:
        (peak, hbm, ici), lat, extra, overhead, overlap = self.split(theta)
        values: dict[str, Any] = dict(peak_flops=float(peak), hbm_bandwidth=float(hbm),
                                      ici_bandwidth=float(ici), op_overhead_s=overhead,
                                      overlap=overlap, name=name or base.name)
        values.update({t: 0.0 for t in EXTRA_TERMS})
        values.update({t: float(v) for t, v in zip(self.terms, extra)})
        lat = [float(v) for v in lat]
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


def unit_terms(args: dict, kinds: tuple[str, ...]) -> tuple:
    """One call's latency terms at unit constants (PhaseTerms's columns, without the scale):
    compute, memory, comm, per-kind collective counts, per-device group latency, launches,
    per-layer overhead — each read off `predict_phase` by probing one constant at a time."""
    base = costmodel.predict_phase(hw=_UNIT, **args)

    def probe(**fields) -> Any:
        return costmodel.predict_phase(hw=dataclasses.replace(_UNIT, **fields), **args)

    counts = []
    for kind in kinds:
        one = (probe(collective_latency_s=1.0) if kind == ""
               else probe(collective_latency_s_by_kind={kind: 1.0}))
        counts.append(one.comm_s - base.comm_s)
    return (base.compute_s, base.memory_s, base.comm_s, counts,
            probe(collective_latency_s_per_device=1.0).comm_s - base.comm_s,
            probe(launch_overhead_s=1.0).latency_s - base.latency_s,
            probe(op_overhead_s=1.0).latency_s - base.latency_s)


@dataclass
class PhaseTerms:
    """A point's latency terms at unit constants, taken from `predict_phase` (see module doc)."""

    compute: np.ndarray      # FLOPs / n            (compute_s at peak 1)
    memory: np.ndarray       # bytes read           (memory_s at bandwidth 1)
    comm: np.ndarray         # bytes * factor       (comm_s at bandwidth 1, no latency)
    counts: np.ndarray       # [points, kinds] collective ops per kind
    group: np.ndarray        # sum of ops x (group size - 1)   (per-device latency, in comm)
    launches: np.ndarray     # launch_overhead_s multiplier     (outside the overlap)
    layers: np.ndarray       # op_overhead_s multiplier
    scale: np.ndarray        # per-point share of the profile

    @classmethod
    def of(cls, points: list[Point], kinds: tuple[str, ...]) -> "PhaseTerms":
        return cls.from_calls([phase_arguments(p.config, p.phase) for p in points], kinds,
                              [p.scale for p in points])

    @classmethod
    def from_calls(cls, calls: list[dict], kinds: tuple[str, ...],
                   scales: list[float]) -> "PhaseTerms":
        """The terms of `costmodel.predict_phase(**args)` for each call's arguments."""
        rows = [unit_terms(args, kinds) for args in calls]
        col = lambda i: np.array([r[i] for r in rows], dtype=float)  # noqa: E731
        return cls(col(0), col(1), col(2),
                   np.array([r[3] for r in rows], dtype=float).reshape(len(rows), len(kinds)),
                   col(4), col(5), col(6), np.array(scales, dtype=float))

    def latency(self, theta: np.ndarray, space: "ParamSpace") -> np.ndarray:
        """costmodel.predict_phase's latency_s, vectorised over points (module doc formula)."""
        (peak, hbm, ici), lat, extra, overhead, overlap = space.split(theta)
        fields = dict(zip(space.terms, extra))
        compute = self.compute / (peak * self.scale)
        memory = self.memory / (hbm * self.scale)
        comm = (self.comm / (ici * self.scale) + self.counts @ lat
                + self.group * fields.get("collective_latency_s_per_device", 0.0))
        terms = np.stack([compute, memory, comm])
        return ((1 - overlap) * terms.sum(axis=0) + overlap * terms.max(axis=0)
                + overhead * self.layers + fields.get("launch_overhead_s", 0.0) * self.launches)


# ----------------------------------------------------------------------------- fitting


@dataclass
class Fit:
    profile: HardwareProfile
    cost: float
    success: bool
    message: str
    nfev: int


def fit_profile(points: list[Point], base: HardwareProfile, space: ParamSpace | None = None,
                loss: str = "linear", name: str | None = None, weighted: bool = True) -> Fit:
    """Least squares on relative error over log-parameters; a few starts, the best kept.
    `weighted`: each relative error times `point_weights` (its measured uncertainty)."""
    if not points:
        raise CalibrationError("points", 0, "at least one measured point to fit")
    # A profile's measured times by kind and group size (`sweeper profile`) would override
    # the fitted bandwidth and latencies for those collectives, leaving them unfittable and
    # breaking PhaseTerms's linear terms: the fit starts from the profile's scalar constants.
    base = without_group_measurements(base)
    space = space or default_space(points)
    measured = np.array([p.measured_s for p in points])
    weights = point_weights(points) if weighted else np.ones(len(points))
    terms = PhaseTerms.of(points, space.kinds)
    theta_check = space.start(base, 1e-5, 0.5)
    exact = _fast_path_agrees(points, terms, space, theta_check, base)
    anchor = prior_anchor(base)

    def residuals(theta: np.ndarray) -> np.ndarray:
        if exact:
            pred = terms.latency(theta, space)
        else:   # the cost model changed shape: call it for every point (slow, still right)
            profile = space.profile(theta, base)
            pred = np.array([predict_point(p, profile) for p in points])
        prior = PRIOR_WEIGHT * (theta[:3] - anchor)
        return np.concatenate([weights * (pred / measured - 1.0), prior])

    return solve(residuals, space, base, exact, loss, name)


def prior_anchor(base: HardwareProfile) -> np.ndarray:
    """log(peak, HBM, ICI) of the start: the weak prior keeps unconstrained ones near it."""
    return np.array([math.log(base.peak_flops), math.log(base.hbm_bandwidth),
                     math.log(base.ici_bandwidth)])


def solve(residuals, space: ParamSpace, base: HardwareProfile, exact: bool, loss: str,
          name: str | None) -> Fit:
    """Least squares from a few starts (latency x overlap), the best kept. `exact`: the
    linear fast path agrees with the cost model, so each evaluation is cheap."""
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


def without_group_measurements(profile: HardwareProfile) -> HardwareProfile:
    """`profile` with its per-group collective measurements dropped (the fit's start)."""
    if not (profile.collective_latency_s_by_group or profile.collective_bandwidth_by_group):
        return profile
    return dataclasses.replace(profile, collective_latency_s_by_group={},
                               collective_bandwidth_by_group={})


def _fast_path_agrees(points, terms, space, theta, base) -> bool:
    fast = terms.latency(theta, space)
    profile = space.profile(theta, base)
    slow = np.array([predict_point(p, profile) for p in points[:20]])
    agrees = bool(np.allclose(fast[:len(slow)], slow, rtol=1e-9, atol=0.0))
    if not agrees:
        warnings.warn("calibrate: the cost model's latency is no longer (1-o)*sum + o*max + "
                      "overhead of linear terms; fitting through predict_phase (slow)")
    return agrees


def default_space(points: list[Point], terms: tuple[str, ...] = DEFAULT_TERMS) -> ParamSpace:
    """One latency per collective kind seen in the points (if the cost model charges it),
    and the extra terms `terms`."""
    if not by_kind_supported():
        return ParamSpace(("",), terms)
    seen = set()
    for p in points:
        args = phase_arguments(p.config, p.phase)
        seen.update(c.kind for c in costmodel.predict_phase(hw=_UNIT, **args).collectives)
    kinds = tuple(k for k in COLLECTIVE_KINDS if k in seen)
    return ParamSpace(kinds or ("",), terms)


