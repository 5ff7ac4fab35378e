"""A study's fit on a calibrated host (docs/host-calibration.md "After a sweep: corrections").

A calibrated profile already predicts any model (workloads/hostmodel.py). What a few of one
model's own trials can add is a correction per phase and per group of terms: that model's
kernels run a little faster or slower than the probes' did. So on a profile with a
`host_model`, `sweeper fit` (and the end-of-sweep analysis) fits a multiplier per (phase,
group) with a log-normal prior toward 1, and never the host's costs one by one: a dozen
points cannot pin nineteen costs, and the calibration already did.

The prior's strength is not a constant chosen once: it is picked from `PRIOR_WEIGHTS` by
cross-validation over whole trials of the points being fitted (the weight whose fits best
predict each trial from the others), so where a model's errors do not follow the groups the
fit keeps to the calibrated profile instead of bending to noise. The blind benchmark's fits on a
dozen points made held-out errors worse than the profile alone at one fixed weight.

The same cross-validation also weighs a simpler correction: one factor per phase, every
group alike (`STRUCTURES`). A model whose trials all run some percent slower than the probes
predicted (a host busier than at its calibration, a model whose kernels are all a little
slower) needs two numbers, not ten: on the second host's first blind run the group factors'
cross-validation kept the profile for three models of five, and a prefill error of -15%
across every chip count with it. (Refitting that run, held-out prefill 14.3% -> 13.1%; on
the next blind seed no change beyond noise: docs/host-calibration.md.) Trying the groups
only where the trials outnumber their factors (so a fit of six trials has one factor per
phase) was measured and not kept: refitting two development seeds' six-trial fits, held-out
prefill / decode went 12.4% / 15.2% -> 11.6% / 12.7%, but on the next blind seed
(269572979, whose mesh trials ran slow: the groups' mesh factor fits that) 11.6% / 14.5%
-> 13.0% / 16.6%.

Groups: dispatch (per call, per layer, per collective op, a mesh's per-layer handover),
compute (matmuls, attention, dequantisation), memory (bytes read, those beyond the cache),
communication (collective bytes); and per phase one factor of trials on more than one chip
(`_Problem`).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
from scipy.optimize import least_squares

from sweeper.analysis.observations import Observation
from workloads import costmodel
from workloads.config import HardwareProfile
from workloads.hostmodel import HostModel

GROUPS = {
    "dispatch": ("launch", "layer_device", "collective_op", "layer_mesh"),
    "compute": ("matmul_flops", "matmul_weights", "attention_flops", "attention_rows", "dequant",
                "elementwise"),
    "memory": ("memory_bytes", "dram_bytes", "dram_weights", "dram_dequant", "dram_gather",
               "fault_bytes"),
    "communication": ("gather_bytes", "scatter_bytes", "exchange_bytes"),
}
PHASES = ("prefill", "decode")
# The prior: each multiplier's log enters the least squares as weight x log(factor), beside
# each point's relative error: at 0.3, a factor of 2 costs as much as one point mispredicted
# by 0.3 x ln 2 = 21%. The weights the cross-validation chooses from, weakest to
# strongest; inf keeps every factor at 1 (the calibrated profile alone).
PRIOR_WEIGHTS = (0.1, 0.3, 1.0, 3.0, 10.0, math.inf)
# The corrections' structures the cross-validation chooses from, simplest first: one factor
# per phase (every group alike, `ALL`), or one per (phase, group) and per phase on meshes.
STRUCTURES = ("per phase", "groups")
ALL = "all"        # a free factor over every group of its phase (the "per phase" structure)
# Below this many trials there is nothing to cross-validate on: the strongest finite weight.
MIN_CV_TRIALS = 3
CV_FOLDS = 12         # folds of whole trials (each trial's phases held out together)
FACTOR_BOUNDS = (0.2, 5.0)
# The mesh factor's prior, relative to the groups': weaker, so that what only trials on
# several chips show goes to it rather than to the groups every chip count shares. A
# one-device call's costs are what the calibration's probes measure best; what a mesh of
# emulated devices adds is where it is weakest. Chosen on development data (the quickstart
# studies of three calibrations; docs/host-calibration.md).
MESH_PRIOR = 0.3


def _parts(obs: Observation, host: HostModel, scale: float) -> tuple[str, bool, np.ndarray]:
    """(phase, on a mesh of several devices, seconds per group) of an observation at the
    calibrated costs."""
    out = np.zeros(len(GROUPS))
    phase = obs.calls[0].call.phase
    for c in obs.calls:
        if c.variant != 0:
            continue
        seconds = costmodel.host_term_seconds(host, c.call, scale * c.call.chips)
        for j, terms in enumerate(GROUPS.values()):
            out[j] += c.weight * sum(seconds.get(t, 0.0) for t in terms)
    return phase, obs.calls[0].call.chips > 1, out


def corrected(base: HardwareProfile, factors: dict[str, dict[str, float]],
              mesh_factors: dict[str, float] | None = None) -> HardwareProfile:
    """`base` with each phase's host costs multiplied by their group's factor, and on a mesh
    of several devices by the phase's mesh factor too (`HostModel.mesh_costs`)."""
    host = HostModel.from_dict(base.host_model)
    group_of = {t: g for g, ts in GROUPS.items() for t in ts}
    mesh_factors = mesh_factors or {}

    def scaled(table, mesh: bool):
        return {phase: {t: v * factors.get(phase, {}).get(group_of.get(t, ""), 1.0)
                        * (mesh_factors.get(phase, 1.0) if mesh else 1.0) for t, v in terms.items()}
                for phase, terms in table.items()}

    mesh = (scaled(host.mesh_costs or host.costs, True)
            if mesh_factors or host.mesh_costs else None)
    model = dataclasses.replace(host, costs=scaled(host.costs, False), mesh_costs=mesh).to_dict()
    model["corrections"] = factors
    if mesh_factors:
        model["mesh_corrections"] = mesh_factors
    return dataclasses.replace(base, host_model=model)


@dataclasses.dataclass
class _Problem:
    """The points' seconds per group at the calibrated costs, computed once for every fit.

    The free factors: one per (phase, group) some point has seconds in, and one per phase
    for its points on a mesh of several devices (`group` None: every group of those points).
    Emulated devices that share a core pay at every collective what a one-device call does
    not, and a fit that could only move the groups' factors bent the one-chip predictions to
    the mesh's (the quickstart's one-chip decode steps, held out, twice as slow as measured).
    The mesh factor's prior is weaker (MESH_PRIOR). Where a phase was measured on meshes only,
    its groups are not free: the fit cannot tell their correction from the mesh's, and with
    both free the prior split it, moving one-device predictions by what only meshes showed
    (a quickstart's one-chip trials, held out, 26-36% too slow from its 2- and 4-chip ones)."""

    seconds: np.ndarray          # [points, groups]
    phase_index: np.ndarray      # [points]
    mesh: np.ndarray             # [points] bool: more than one device
    measured: np.ndarray
    weights: np.ndarray
    trials: np.ndarray           # each point's trial (the cross-validation's unit)
    free: list                   # (phase, group or None for the phase's mesh factor)

    def __post_init__(self):
        # [free, points]: the points each factor applies to
        self.masks = np.zeros((len(self.free), len(self.phase_index)), bool)
        for k, (i, j) in enumerate(self.free):
            self.masks[k] = (self.phase_index == i) & (self.mesh if j is None else True)
        # the factors over every group of their points (a mesh's, a phase's)
        self.whole = [j is None or j == ALL for _, j in self.free]

    def point_factors(self, theta: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """[rows, groups]: each point's factor per group at log-factors `theta`."""
        masks = self.masks[:, rows]
        log_f = np.zeros((masks.shape[1], len(GROUPS)))
        for k, (_, j) in enumerate(self.free):
            if self.whole[k]:
                log_f += (theta[k] * masks[k])[:, None]
            else:
                log_f[:, j] += theta[k] * masks[k]
        return np.exp(log_f)

    def predict(self, theta: np.ndarray, rows: np.ndarray) -> np.ndarray:
        return (self.seconds[rows] * self.point_factors(theta, rows)).sum(axis=1)

    def solve(self, rows: np.ndarray, prior_weight: float):
        """The log-factors fitted on `rows` (a boolean mask), and the result."""
        theta = np.zeros(len(self.free))
        if not self.free or math.isinf(prior_weight):
            return theta, None
        seconds, measured, weights = self.seconds[rows], self.measured[rows], self.weights[rows]
        masks = self.masks[:, rows]

        prior = prior_weight * np.array([MESH_PRIOR if j is None else 1.0 for _, j in self.free])

        def residuals(theta):
            return np.concatenate([weights * (self.predict(theta, rows) / measured - 1.0),
                                   prior * theta])

        # d residual_i / d theta_k = w_i / m_i x the seconds factor k scales in point i: the
        # exact Jacobian (finite differences cost 60% of the cross-validation)
        def jacobian(theta):
            scaled = (weights / measured)[:, None] * seconds * self.point_factors(theta, rows)
            columns = np.column_stack([scaled.sum(axis=1) if whole else scaled[:, j]
                                       for (_, j), whole in zip(self.free, self.whole)]) * masks.T
            return np.vstack([columns, np.diag(prior)])

        lo, hi = (math.log(b) for b in FACTOR_BOUNDS)
        result = least_squares(residuals, theta, jac=jacobian, bounds=(lo, hi))
        return result.x, result

    def factors(self, theta: np.ndarray) -> tuple[dict[str, dict[str, float]], dict[str, float]]:
        """({phase: {group: factor}}, {phase: mesh factor}) of log-factors `theta`."""
        groups, mesh = {}, {}
        for (i, j), v in zip(self.free, theta):
            f = round(float(math.exp(v)), 6)
            if j is None:
                mesh[PHASES[i]] = f
            elif j == ALL:
                groups.setdefault(PHASES[i], {}).update(dict.fromkeys(GROUPS, f))
            else:
                groups.setdefault(PHASES[i], {})[list(GROUPS)[j]] = f
        return groups, mesh

    def heldout_mape(self, prior_weight: float) -> float:
        """Mean |predicted / measured - 1| of each fold's points from a fit on the other
        folds' (CV_FOLDS folds of whole trials, dealt in trial order)."""
        keys = np.unique(self.trials)
        fold_of = {k: i % CV_FOLDS for i, k in enumerate(keys)}
        folds = np.array([fold_of[t] for t in self.trials])
        errors = []
        for fold in range(min(CV_FOLDS, len(keys))):
            out = folds == fold
            theta, _ = self.solve(~out, prior_weight)
            errors.extend(np.abs(self.predict(theta, out) / self.measured[out] - 1.0))
        return float(np.mean(errors))


def _trial_key(obs: Observation) -> str:
    """One measured trial (its prefill and decode points), across models and studies."""
    model = obs.config.model.name if obs.config is not None else ""
    return f"{model}|{obs.group!r}|{obs.trial}"


def choose_corrections(problems: dict[str, _Problem]) -> tuple[str, float, dict[str, dict]]:
    """(structure, weight, {structure: held-out MAPE per weight tried}): cross-validation
    over trials, each structure of STRUCTURES at each weight of PRIOR_WEIGHTS (the
    calibrated profile alone, weight inf, once); the groups at the strongest finite weight
    where fewer than MIN_CV_TRIALS trials were measured."""
    if len(np.unique(problems["groups"].trials)) < MIN_CV_TRIALS:
        return "groups", max(w for w in PRIOR_WEIGHTS if math.isfinite(w)), {}
    scores = {(s, w): problems[s].heldout_mape(w) for s in STRUCTURES for w in PRIOR_WEIGHTS
              if math.isfinite(w) or s == "groups"}
    best = min(scores.values())
    # ties (within float noise of the best) keep nearer the profile: the profile alone,
    # then the simpler structure, then the stronger weight. (A one-standard-error rule,
    # the simplest candidate within the cross-validation's noise of the best, kept the
    # profile more often and predicted the second host's blind models' held-out trials
    # worse.)
    order = sorted(scores, key=lambda k: (math.isfinite(k[1]), STRUCTURES.index(k[0]), -k[1]))
    structure, weight = next(k for k in order if scores[k] <= best + 1e-9)
    table: dict[str, dict] = {}
    for (s, w), v in scores.items():
        table.setdefault(s, {})[str(w)] = round(v, 6)
    return structure, weight, table


def fit(points: list[Observation], base: HardwareProfile, name: str | None = None,
        weights: np.ndarray | None = None, prior_weight: float | None = None
        ) -> tuple[HardwareProfile, float, bool, str, int]:
    """(profile, cost, success, message, evaluations) of the corrections' least squares;
    `prior_weight` None: chosen by cross-validation over trials (`choose_corrections`)."""
    host = HostModel.from_dict(base.host_model)
    parts = [_parts(p, host, p.scale) for p in points]
    seconds = np.array([s for _, _, s in parts]).reshape(len(points), len(GROUPS))
    phase_index = np.array([PHASES.index(ph) for ph, _, _ in parts], int)
    mesh = np.array([m for _, m, _ in parts], bool)
    # a phase measured on meshes only cannot tell its groups' correction from its mesh's:
    # all of it goes to the mesh factor, and its one-device calls keep the calibration's
    one_device = [bool((~mesh & (phase_index == i)).any()) for i in range(len(PHASES))]
    free = {"groups": [(i, j) for i in range(len(PHASES)) for j in range(len(GROUPS))
                       if one_device[i] and (seconds[phase_index == i, j] > 0).any()]
            + [(i, None) for i in range(len(PHASES)) if (mesh & (phase_index == i)).any()],
            "per phase": [(i, ALL if one_device[i] else None) for i in range(len(PHASES))
                          if (phase_index == i).any()]}
    measured = np.array([p.measured_s for p in points])
    weights = np.ones(len(points)) if weights is None else np.asarray(weights)
    trials = np.array([_trial_key(p) for p in points])
    problems = {s: _Problem(seconds, phase_index, mesh, measured, weights, trials, free[s])
                for s in STRUCTURES}
    scores: dict[str, dict] = {}
    chosen_by, structure = "given", "groups"
    if prior_weight is None:
        structure, prior_weight, scores = choose_corrections(problems)
        chosen_by = "cross-validation over trials" if scores else f"fewer than {MIN_CV_TRIALS} trials"
    problem = problems[structure]

    theta, result = problem.solve(np.ones(len(points), bool), prior_weight)
    profile = corrected(base, *problem.factors(theta))
    profile.host_model["corrections_prior"] = {
        "weight": None if math.isinf(prior_weight) else prior_weight,
        "structure": structure if math.isfinite(prior_weight) else None,
        "chosen_by": chosen_by,
        "heldout_mape_by_weight": scores.get("groups", {}),
        "heldout_mape_per_phase_by_weight": scores.get("per phase", {})}
    if name:
        profile = dataclasses.replace(profile, name=name)
    if result is None:
        return profile, 0.0, True, "nothing to fit" if not problem.free else "the calibrated profile kept", 0
    return profile, float(result.cost), bool(result.success), str(result.message), int(result.nfev)
