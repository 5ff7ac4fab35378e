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
  collective_rendezvous_s                   + per op x g x (g - 1), in comm_s
  launch_overhead_s                         + once per phase call (EXTRA_TERMS: their reasons)
  matmul_half_rows, matmul_half_dim,        compute_s x (1 + half / rows or / tile width) per
  attention_half_rows                       matmul (attention's alone): small shapes below peak

The points are `observations.Observation`s, from a study or from a CSV of published numbers
(one pipeline: this fit and holdout.py serve both). The objective is each observation's
relative error pred/measured - 1 in its own metric (seconds, or MFU against the published
peak), weighted by its measured uncertainty (`point_weights`), minimised by
`scipy.optimize.least_squares` over log-parameters (positive constants) and a logistic
overlap, with every constant bounded by what the hardware can do (rates never above the
start profile's sheet or measured peak, overheads >= 0, a measured host's per-op collective
latency at most one whole small collective: HOST_COLLECTIVE_LATENCY_MAX_S) and a weak prior toward the start
whose strength is stated at PRIOR_WEIGHT.

Speed: a point's latency is linear in 1/peak, 1/bandwidths, the latencies and the matmul
half-rows/half-dim (over peak) once overlap is fixed, so each point is decomposed once into its terms by calling `predict_phase` with unit
profiles (`PhaseTerms`); the optimiser evaluates those terms, and their analytic Jacobian
(`PhaseTerms.call_jacobian`: one evaluation per step instead of one per constant), with
numpy. Every reported
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
import functools
import math
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
from scipy.optimize import least_squares

from sweeper.analysis import hostfit
from sweeper.analysis.observations import (PHASE_METRIC, UNIT as _UNIT, Observation,  # noqa: F401
                                           from_frame, metric_of, predict_latency, rate_scales)
from workloads import costmodel
from workloads.config import ConfigError, HardwareProfile
from workloads.layouts import COLLECTIVE_KINDS
from workloads.layouts import Collective

# The prior: each rate's log-ratio to the sheet (or measured) value enters the least squares
# as PRIOR_WEIGHT x log(value / sheet), next to each point's (weighted) relative error. Its
# strength, stated: halving a rate costs as much as one point mispredicted by 3.5%
# (0.05 x ln 2); a rate the points constrain moves freely, one they do not stays at the sheet.
PRIOR_WEIGHT = 0.05
LATENCY_BOUNDS = (1e-12, 1.0)   # overheads: >= 0 (1e-12 s is 0 on any measured scale), <= 1 s
# Rates are bounded by what the hardware can do: never above the sheet or measured peak
# (the start profile), at most RATE_FLOOR times below it (an efficiency of 1/RATE_FLOOR).
RATE_FLOOR = 1e3
# On a measured host (the emulated mesh) a collective's fixed start-up latency is part of a
# collective, never more than a whole one: the upper bound of the per-op latencies
# (collective_latency_s, per kind) is what one whole all-gather of a 2.36 MB shard per device
# on 2 emulated devices took on this host, 1.05 ms (benchmarks/results/collectives.md, (a)
# 1x2). Why it is needed (issue 20, docs/calibration.md "The 1-chip fold"): every multi-chip
# decode step of the calibration sweep has the same collectives per layer, so a fit without
# 1-chip points can move the whole per-layer cost (op_overhead_s, the one term a 1-chip step
# has) into one kind's latency (op_overhead_s 0, reduce-scatter 2.4 ms per op) and predict a
# 1-chip decode 37% too fast; a latency above a whole collective is not physical.
HOST_COLLECTIVE_LATENCY_MAX_S = 1.05e-3

# The study's and the CSV's observations are one type (observations.py); these names stay
# for the callers that read a study.
Point = Observation
points_from_frame = from_frame
predict_point = predict_latency


class CalibrationError(ConfigError):
    """Too few measured points (or none): one line for the CLI, exit code 2."""


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

def by_kind_supported() -> bool:
    """Does the cost model charge `collective_latency_s_by_kind`? (A fitted per-kind
    latency the model ignored would be a constant that changes nothing.)"""
    if not any(f.name == "collective_latency_s_by_kind" for f in dataclasses.fields(HardwareProfile)):
        return False
    probe = dataclasses.replace(_UNIT, collective_latency_s_by_kind={"all-gather": 1.0})
    ops = [Collective("all-gather", ("x",), 1, 2, 3, "probe")]
    return costmodel.comm_time_s(ops, probe) > costmodel.comm_time_s(ops, _UNIT)


# Terms beyond the paper's constants, each a HardwareProfile field that workloads/costmodel.py
# charges, each for an effect the paper's model lacks (issues 10 and 20):
#   collective_latency_s_per_device  per collective op x (group size - 1): a ring's hops, an
#                                     emulated mesh's rendezvous of g device threads
#   launch_overhead_s                once per phase call: program dispatch and the host sync
#   device_overhead_s                per layer x chips: each op dispatched once per device, a
#                                     cost that does not shrink with the device's core share
#   collective_rendezvous_s          per collective op x g x (g - 1): a collective's g device
#                                     threads share cores on an emulated mesh, each waiting
#                                     through the other g - 1 threads' turns
#   matmul_half_rows                 a chip's matmul of r rows runs at peak x r / (r + half):
#                                     a systolic array fills, drains and loads each weight
#                                     tile once per pass, amortised over the rows (small
#                                     per-chip shapes run far below peak, large ones near it)
#   matmul_half_dim                  the same for the weight tile's narrower side per chip
#                                     (costmodel.weight_tile_dim: 4608 for PaLM in ws2d on 64
#                                     chips, 18432 in wg_xyz): each tile's pass has a fixed part
#   attention_half_rows              the same for attention alone: each (sequence, KV head)
#                                     pair's attention is its own matmul of the queries sharing
#                                     the KV head (paper §3.3), filled and drained once per pair,
#                                     where a weight matmul's pass serves the chip's whole batch
#                                     (costmodel.ATTENTION_HALF_ROWS)
EXTRA_TERMS = ("collective_latency_s_per_device", "launch_overhead_s", "device_overhead_s",
               "collective_rendezvous_s", "matmul_half_rows", "matmul_half_dim",
               costmodel.ATTENTION_HALF_ROWS)
# The terms nested cross-validation chooses among by default (holdout.select_terms): the
# study's terms of issues 10 and 20 (2^5 subsets x 3 inner folds per held-out fold); a
# caller names others (`candidates`: the paper CSV's benchmark names its own).
SELECT_CANDIDATES = ("collective_latency_s_per_device", "launch_overhead_s", "device_overhead_s",
                     "collective_rendezvous_s", costmodel.ATTENTION_HALF_ROWS)
# The terms `sweeper fit --study` and the end-of-sweep analysis free by default: those the
# recorded calibration sweep's nested selection freed (benchmarks/results/calibration.md),
# fixed so a fit takes seconds; choosing them per fit by nested cross-validation
# (`--terms select`) took 205 s on the quickstart's 20 trials (2^5 subsets x 3 inner folds
# per held-out fold, 4 schemes) against 2.2 s with these, fitted with finite differences;
# with the analytic Jacobian (PhaseTerms.call_jacobian) 95 s of CPU against 1.2 s.
STUDY_TERMS = SELECT_CANDIDATES
# The terms nested cross-validation chooses among on published accelerator numbers
# (`sweeper fit --measurements --terms select`, benchmarks/paper_fit.py): a chip's fixed
# cost per call and small-shape matmul efficiency; not the emulated mesh's thread terms.
MEASUREMENT_CANDIDATES = ("launch_overhead_s", "matmul_half_rows", "matmul_half_dim",
                          costmodel.ATTENTION_HALF_ROWS)
# The terms a default fit frees: chosen per fit by nested cross-validation (select_terms)
# when the caller asks for it (`terms="select"`); otherwise none (the paper's constants).
DEFAULT_TERMS: tuple[str, ...] = ()
EXTRA_BOUNDS = {"collective_latency_s_per_device": (1e-12, 1e-2),   # <= 10 ms per device-hop
                "launch_overhead_s": (1e-12, 1.0),                  # <= 1 s per launch
                "device_overhead_s": (1e-12, 1e-2),                 # <= 10 ms per layer-device
                "collective_rendezvous_s": (1e-12, 1e-3),           # <= 1 ms per op and thread pair
                # rows: 0 (always at peak) up to 16384 rows for half the peak (a 128 x 128
                # systolic array at 1/128 of its rate; docs/cost-model.md "Matmul efficiency")
                "matmul_half_rows": (1e-12, 16384.0),
                "matmul_half_dim": (1e-12, 16384.0),
                costmodel.ATTENTION_HALF_ROWS: (1e-12, 16384.0)}   # as matmul_half_rows
# Where a term's search starts: a rows term starts mid-range in rows (from ~0 its gradient
# in log space vanishes); the time terms start at the fit's latency start.
EXTRA_START = {"matmul_half_rows": 128.0, "matmul_half_dim": 1024.0,
               costmodel.ATTENTION_HALF_ROWS: 128.0}


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
        extra = [math.log(min(max(EXTRA_START.get(t, latency), EXTRA_BOUNDS[t][0]), EXTRA_BOUNDS[t][1]))
                 for t in self.terms]
        # rates start a little below their ceiling (the sheet), inside the bounds
        return np.array([*(prior_anchor(base) - 0.1), *lat, *extra, math.log(latency),
                         _logit(overlap)])

    def bounds(self, base: HardwareProfile) -> tuple[np.ndarray, np.ndarray]:
        """Rates in [sheet / RATE_FLOOR, sheet]: never faster than the hardware can go;
        latencies and overheads in LATENCY_BOUNDS (>= 0), a measured host's per-op collective
        latencies at most HOST_COLLECTIVE_LATENCY_MAX_S; overlap in [0, 1]."""
        ceiling = prior_anchor(base)
        lo_lat, hi_lat = (math.log(b) for b in LATENCY_BOUNDS)
        hi_op = math.log(collective_latency_max_s(base))
        lows = [*(ceiling - math.log(RATE_FLOOR))] + [lo_lat] * len(self.kinds) \
            + [math.log(EXTRA_BOUNDS[t][0]) for t in self.terms] + [lo_lat, -12.0]
        highs = [*ceiling] + [hi_op] * len(self.kinds) \
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
        # the bounds are the sheet's numbers: a rate at its ceiling is the sheet's exactly
        values: dict[str, Any] = dict(peak_flops=min(float(peak), base.peak_flops),
                                      hbm_bandwidth=min(float(hbm), base.hbm_bandwidth),
                                      ici_bandwidth=min(float(ici), base.ici_bandwidth),
                                      op_overhead_s=overhead, overlap=overlap, name=name or base.name)
        values.update({t: 0.0 for t in EXTRA_TERMS})
        values.update({t: float(v) for t, v in zip(self.terms, extra)})
        lat = [float(v) for v in lat]
        if self.kinds == ("",):
            values["collective_latency_s"] = lat[0]
        else:
            values["collective_latency_s"] = float(np.median(lat)) if lat else 0.0
            values["collective_latency_s_by_kind"] = dict(zip(self.kinds, lat))
        return dataclasses.replace(base, **values)


def collective_latency_max_s(base: HardwareProfile) -> float:
    """The upper bound of a fitted per-op collective latency: HOST_COLLECTIVE_LATENCY_MAX_S
    on a measured host profile (the emulated mesh), LATENCY_BOUNDS' otherwise."""
    return HOST_COLLECTIVE_LATENCY_MAX_S if base.measured else LATENCY_BOUNDS[1]


def _logit(p: float) -> float:
    p = min(max(p, 1e-6), 1 - 1e-6)
    return math.log(p / (1 - p))


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


# ----------------------------------------------------------------------------- fast terms


_UNIT_HOST = dataclasses.replace(_UNIT, measured=True)


@functools.lru_cache(maxsize=65536)
def at_unit(call: costmodel.PhaseCall, measured: bool = False) -> Any:
    """`call.predict` at unit constants, cached (each fold's `default_space` reads its
    collectives, `unit_terms` its terms). `measured`: as a measured host profile (the
    emulated mesh's own terms, e.g. costmodel.multigroup_gather_scale, apply)."""
    return call.predict(_UNIT_HOST if measured else _UNIT)


@functools.lru_cache(maxsize=65536)
def unit_terms(call: costmodel.PhaseCall, kinds: tuple[str, ...], measured: bool = False) -> tuple:
    """One call's latency terms at unit constants: compute, memory, comm, per-kind collective
    counts, per-device group latency, launches, per-layer overhead — each read off
    `predict_phase` by probing one constant at a time. Cached: the hold-out schemes and the
    nested term selection fit the same calls many times."""
    base = at_unit(call, measured)
    unit = _UNIT_HOST if measured else _UNIT

    def probe(**fields) -> Any:
        return call.predict(dataclasses.replace(unit, **fields))

    counts = []
    for kind in kinds:
        one = (probe(collective_latency_s=1.0) if kind == ""
               else probe(collective_latency_s_by_kind={kind: 1.0}))
        counts.append(one.comm_s - base.comm_s)
    return (base.compute_s, base.memory_s, base.comm_s, tuple(counts),
            probe(collective_latency_s_per_device=1.0).comm_s - base.comm_s,
            probe(launch_overhead_s=1.0).latency_s - base.latency_s,
            probe(op_overhead_s=1.0).latency_s - base.latency_s,
            probe(device_overhead_s=1.0).latency_s - base.latency_s,
            probe(matmul_half_rows=1.0).compute_s - base.compute_s,
            probe(matmul_half_dim=1.0).compute_s - base.compute_s,
            probe(collective_rendezvous_s=1.0).comm_s - base.comm_s,
            probe(**{costmodel.ATTENTION_HALF_ROWS: 1.0}).compute_s - base.compute_s)


@dataclass
class PhaseTerms:
    """Every cost-model call of every observation at unit constants (see module doc), and how
    calls make observations (weights, variants)."""

    compute: np.ndarray      # FLOPs / n            (compute_s at peak 1)
    memory: np.ndarray       # bytes read           (memory_s at bandwidth 1)
    comm: np.ndarray         # bytes * factor       (comm_s at bandwidth 1, no latency)
    counts: np.ndarray       # [calls, kinds] collective ops per kind
    group: np.ndarray        # sum of ops x (group size - 1)   (per-device latency, in comm)
    launches: np.ndarray     # launch_overhead_s multiplier     (outside the overlap)
    layers: np.ndarray       # op_overhead_s multiplier
    devices: np.ndarray      # device_overhead_s multiplier (layers x chips)
    rendezvous: np.ndarray   # collective_rendezvous_s multiplier (ops x g x (g - 1), in comm)
    row_compute: np.ndarray  # compute_s at peak 1 per unit of matmul_half_rows (FLOPs / rows / n)
    dim_compute: np.ndarray  # compute_s at peak 1 per unit of matmul_half_dim (FLOPs / dim / n)
    attention_compute: np.ndarray  # compute_s at peak 1 per unit of attention_half_rows
    scale: np.ndarray        # [3, calls]: its observation's share of peak, HBM, interconnect
    obs: np.ndarray          # per call: its observation
    variant: np.ndarray      # per call: its variant
    weight: np.ndarray       # per call: its multiplier (decode steps)
    n_obs: int

    @classmethod
    def of(cls, observations: list[Observation], kinds: tuple[str, ...],
           measured: bool = False) -> "PhaseTerms":
        """`measured`: the profile fitted is a measured host's (its emulated-mesh terms apply)."""
        calls = [(i, c, o.scale) for i, o in enumerate(observations) for c in o.calls]
        rows = [unit_terms(c.call, kinds, measured) for _, c, _ in calls]
        col = lambda i: np.array([r[i] for r in rows], dtype=float)  # noqa: E731
        return cls(col(0), col(1), col(2),
                   np.array([r[3] for r in rows], dtype=float).reshape(len(rows), len(kinds)),
                   col(4), col(5), col(6), col(7), col(10), col(8), col(9), col(11),
                   np.array([rate_scales(s) for *_, s in calls], dtype=float).reshape(-1, 3).T,
                   np.array([i for i, *_ in calls]), np.array([c.variant for _, c, _ in calls]),
                   np.array([c.weight for _, c, _ in calls], dtype=float), len(observations))

    def __post_init__(self) -> None:
        # calls -> (observation, variant) cells, weighted by each call's multiplier: one
        # matrix product sums every observation's variants (and their Jacobian rows)
        n_var = int(self.variant.max()) + 1 if len(self.variant) else 1
        cell = self.obs * n_var + self.variant
        self._cells = np.zeros((self.n_obs * n_var, len(cell)))
        self._cells[cell, np.arange(len(cell))] = self.weight
        present = np.zeros(self.n_obs * n_var, dtype=bool)
        present[cell] = True
        self._absent = ~present.reshape(self.n_obs, n_var)
        self._n_var = n_var

    def _parts(self, theta: np.ndarray, space: "ParamSpace"):
        (peak, hbm, ici), lat, extra, overhead, overlap = space.split(theta)
        fields = dict(zip(space.terms, extra))
        compute = (self.compute + fields.get("matmul_half_rows", 0.0) * self.row_compute
                   + fields.get("matmul_half_dim", 0.0) * self.dim_compute
                   + fields.get(costmodel.ATTENTION_HALF_ROWS, 0.0) * self.attention_compute) \
            / (peak * self.scale[0])
        memory = self.memory / (hbm * self.scale[1])
        comm = self.comm / (ici * self.scale[2])
        return (peak, hbm, ici), lat, fields, overhead, overlap, np.stack([compute, memory, comm])

    def call_latency(self, theta: np.ndarray, space: "ParamSpace") -> np.ndarray:
        """costmodel.predict_phase's latency_s, vectorised over calls (module doc formula)."""
        _, lat, fields, overhead, overlap, terms = self._parts(theta, space)
        fixed = (self.counts @ lat + self.group * fields.get("collective_latency_s_per_device", 0.0)
                 + self.rendezvous * fields.get("collective_rendezvous_s", 0.0))
        return ((1 - overlap) * terms.sum(axis=0) + overlap * terms.max(axis=0) + fixed
                + overhead * self.layers + fields.get("launch_overhead_s", 0.0) * self.launches
                + fields.get("device_overhead_s", 0.0) * self.devices)

    def call_jacobian(self, theta: np.ndarray, space: "ParamSpace") -> np.ndarray:
        """d call_latency / d theta, [calls, parameters]: the formula of `call_latency`
        differentiated in theta's transforms (log constants, logit overlap); at a tie of
        the max the first of compute, memory, comm takes the overlap's share (numpy argmax)."""
        (peak, _, _), lat, fields, overhead, overlap, terms = self._parts(theta, space)
        k, names = len(space.kinds), space.terms
        share = np.full(terms.shape, 1.0 - overlap)         # d latency / d each term
        share[terms.argmax(axis=0), np.arange(terms.shape[1])] += overlap
        jac = np.empty((terms.shape[1], len(theta)))
        jac[:, :3] = -(terms * share).T                     # d/d log rate: -term x its share
        jac[:, 3:3 + k] = self.counts * lat
        unit = {"collective_latency_s_per_device": self.group,
                "collective_rendezvous_s": self.rendezvous,
                "launch_overhead_s": self.launches, "device_overhead_s": self.devices,
                "matmul_half_rows": self.row_compute * share[0] / (peak * self.scale[0]),
                "matmul_half_dim": self.dim_compute * share[0] / (peak * self.scale[0]),
                costmodel.ATTENTION_HALF_ROWS: self.attention_compute * share[0] / (peak * self.scale[0])}
        for j, name in enumerate(names):
            jac[:, 3 + k + j] = unit[name] * fields[name]
        jac[:, -2] = self.layers * overhead
        jac[:, -1] = (terms.max(axis=0) - terms.sum(axis=0)) * overlap * (1 - overlap)
        return jac

    def _fastest(self, per_call: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(each observation's latency: its fastest variant's weighted sum of calls, and the
        row of `_cells` that variant is)."""
        sums = np.where(self._absent, np.inf, (self._cells @ per_call).reshape(self.n_obs, self._n_var))
        best = sums.argmin(axis=1)
        return sums[np.arange(self.n_obs), best], np.arange(self.n_obs) * self._n_var + best

    def latency(self, theta: np.ndarray, space: "ParamSpace") -> np.ndarray:
        """Each observation's latency: the weighted sum of its calls, the fastest variant."""
        return self._fastest(self.call_latency(theta, space))[0]

    def latency_and_jacobian(self, theta: np.ndarray,
                             space: "ParamSpace") -> tuple[np.ndarray, np.ndarray]:
        """`latency` and its Jacobian in theta, [observations, parameters] (the fastest
        variant's calls)."""
        latency, rows = self._fastest(self.call_latency(theta, space))
        return latency, self._cells[rows] @ self.call_jacobian(theta, space)


# ----------------------------------------------------------------------------- fitting


@dataclass
class Fit:
    profile: HardwareProfile
    cost: float
    success: bool
    message: str
    nfev: int


def fit_profile(points: list[Observation], base: HardwareProfile, space: ParamSpace | None = None,
                loss: str = "linear", name: str | None = None, weighted: bool = True) -> Fit:
    """Least squares on each observation's relative error (of its own metric: seconds or
    MFU) over log-parameters, bounded by the hardware, with the stated prior toward `base`;
    a few starts, the best kept. `weighted`: each relative error times `point_weights`."""
    if not points:
        raise CalibrationError("points", 0, "at least one measured point to fit")
    if base.host_model:   # a calibrated host: corrections to its measured costs (hostfit.py)
        weights = point_weights(points) if weighted else None
        return Fit(*hostfit.fit(points, base, name, weights))
    # A profile's measured times by kind and group size (`sweeper profile`) would override
    # the fitted bandwidth and latencies for those collectives, leaving them unfittable and
    # breaking PhaseTerms's linear terms: the fit starts from the profile's scalar constants.
    base = without_group_measurements(base)
    space = space or default_space(points)
    measured = np.array([p.measured for p in points])
    is_mfu = np.array([p.metric == "mfu" for p in points])
    mfu_numerator = np.array([p.flops / (p.chips * p.published_peak) if p.metric == "mfu" else 1.0
                              for p in points])
    weights = point_weights(points) if weighted else np.ones(len(points))
    terms = PhaseTerms.of(points, space.kinds, base.measured)
    exact = _fast_path_agrees(points, terms, space, space.start(base, 1e-5, 0.5), base)
    anchor = prior_anchor(base)

    def residuals(theta: np.ndarray) -> np.ndarray:
        if exact:
            latency = terms.latency(theta, space)
        else:   # the cost model changed shape: call it for every point (slow, still right)
            profile = space.profile(theta, base)
            latency = np.array([predict_latency(p, profile) for p in points])
        predicted = np.where(is_mfu, mfu_numerator / latency, latency)
        prior = PRIOR_WEIGHT * (theta[:3] - anchor)
        return np.concatenate([weights * (predicted / measured - 1.0), prior])

    prior_rows = np.zeros((3, len(space.names)))
    prior_rows[:, :3] = PRIOR_WEIGHT * np.eye(3)

    def jacobian(theta: np.ndarray) -> np.ndarray:
        """d residuals / d theta, from PhaseTerms's derivatives (one evaluation, where the
        finite differences of `residuals` took one per parameter)."""
        latency, d_latency = terms.latency_and_jacobian(theta, space)
        d_predicted = np.where(is_mfu, -mfu_numerator / latency ** 2, 1.0)[:, None] * d_latency
        return np.vstack([(weights / measured)[:, None] * d_predicted, prior_rows])

    return solve(residuals, space, base, exact, loss, name, jacobian if exact else "2-point")


def prior_anchor(base: HardwareProfile) -> np.ndarray:
    """log(peak, HBM, ICI) of the start: the prior's centre and the rates' ceiling."""
    return np.array([math.log(base.peak_flops), math.log(base.hbm_bandwidth),
                     math.log(base.ici_bandwidth)])


def solve(residuals, space: ParamSpace, base: HardwareProfile, exact: bool, loss: str,
          name: str | None, jac: Any = "2-point") -> Fit:
    """Least squares from a few starts (latency x overlap), the best kept. `exact`: the
    linear fast path agrees with the cost model, so each evaluation is cheap. `jac`: the
    residuals' Jacobian (a function of theta), or scipy's finite differences."""
    lows, highs = space.bounds(base)
    best = None
    for latency0 in (1e-6, 1e-4):
        for overlap0 in (0.2, 0.8):
            x0 = np.clip(space.start(base, latency0, overlap0), lows + 1e-9, highs - 1e-9)
            result = least_squares(residuals, x0, jac=jac, bounds=(lows, highs), loss=loss,
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
    slow = np.array([predict_latency(p, profile) for p in points[:20]])
    agrees = bool(np.allclose(fast[:len(slow)], slow, rtol=1e-6, atol=0.0))  # float noise in sums
    if not agrees:
        warnings.warn("calibrate: the cost model's latency is no longer (1-o)*sum + o*max + "
                      "overhead of linear terms; fitting through predict_phase (slow)")
    return agrees


def default_space(points: list[Observation], terms: tuple[str, ...] = DEFAULT_TERMS) -> ParamSpace:
    """One latency per collective kind seen in the points (if the cost model charges it),
    and the extra terms `terms`."""
    if not by_kind_supported():
        return ParamSpace(("",), terms)
    seen = set()
    for p in points:
        for c in p.calls:
            seen.update(op.kind for op in at_unit(c.call).collectives)
    kinds = tuple(k for k in COLLECTIVE_KINDS if k in seen)
    return ParamSpace(kinds or ("",), terms)
