"""A study's fit on a calibrated host (docs/host-calibration.md "After a sweep: corrections").

A calibrated profile already predicts any model (workloads/hostmodel.py). What a few of one
model's own trials can add is a correction per phase and per group of terms: that model's
kernels run a little faster or slower than the probes' did. So on a profile with a
`host_model`, `sweeper fit` (and the end-of-sweep analysis) fits a multiplier per (phase,
group) with a log-normal prior toward 1, whose strength is stated (`PRIOR_WEIGHT`), and
never the host's costs one by one: a dozen points cannot pin fifteen constants, and the
calibration already did.

Groups: dispatch (per call, per layer and per collective op), compute (matmuls, attention,
dequantisation), memory (bytes read, those beyond the cache), communication (collective bytes).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
from scipy.optimize import least_squares

from sweeper.analysis.observations import Observation
from workloads import costmodel
from workloads.config import HardwareProfile
from workloads.hostmodel import THROUGHPUT_TERMS, HostModel

GROUPS = {
    "dispatch": ("launch", "layer_device", "collective_op"),
    "compute": ("matmul_flops", "matmul_weights", "attention_flops", "attention_rows", "dequant"),
    "memory": ("memory_bytes", "dram_bytes", "dram_weights", "dram_dequant", "dram_gather"),
    "communication": ("gather_bytes", "scatter_bytes", "exchange_bytes"),
}
PHASES = ("prefill", "decode")
# The prior: each multiplier's log enters the least squares as PRIOR_WEIGHT x log(factor),
# beside each point's relative error: a factor of 2 costs as much as one point mispredicted
# by 0.3 x ln 2 = 21%, so a correction needs several points that agree on it.
PRIOR_WEIGHT = 0.3
FACTOR_BOUNDS = (0.2, 5.0)


def _parts(obs: Observation, host: HostModel, scale: float) -> tuple[str, np.ndarray]:
    """(phase, seconds per group) of an observation at the calibrated costs."""
    out = np.zeros(len(GROUPS))
    phase = obs.calls[0].call.phase
    for c in obs.calls:
        if c.variant != 0:
            continue
        share = scale * c.call.chips
        counts = costmodel.host_counts(c.call, host.cache_for(share))
        ratio = host.throughput_ratio(share, c.call.chips)
        for j, terms in enumerate(GROUPS.values()):
            out[j] += c.weight * sum(counts[t] * host.costs[c.call.phase].get(t, 0.0)
                                     * (ratio if t in THROUGHPUT_TERMS else 1.0) for t in terms)
    return phase, out


def corrected(base: HardwareProfile, factors: dict[str, dict[str, float]]) -> HardwareProfile:
    """`base` with each phase's host costs multiplied by their group's factor."""
    host = HostModel.from_dict(base.host_model)
    costs = {}
    for phase, terms in host.costs.items():
        group_of = {t: g for g, ts in GROUPS.items() for t in ts}
        costs[phase] = {t: v * factors.get(phase, {}).get(group_of.get(t, ""), 1.0)
                        for t, v in terms.items()}
    model = dataclasses.replace(host, costs=costs).to_dict()
    model["corrections"] = factors
    return dataclasses.replace(base, host_model=model)


def fit(points: list[Observation], base: HardwareProfile, name: str | None = None,
        weights: np.ndarray | None = None) -> tuple[HardwareProfile, float, bool, str, int]:
    """(profile, cost, success, message, evaluations) of the corrections' least squares."""
    host = HostModel.from_dict(base.host_model)
    parts = [_parts(p, host, p.scale) for p in points]
    measured = np.array([p.measured_s for p in points])
    weights = np.ones(len(points)) if weights is None else weights
    phase_index = np.array([PHASES.index(ph) for ph, _ in parts])
    seconds = np.array([s for _, s in parts])                    # [points, groups]
    present = np.zeros((len(PHASES), len(GROUPS)), bool)
    for i, s in zip(phase_index, seconds):
        present[i] |= s > 0
    free = [(i, j) for i in range(len(PHASES)) for j in range(len(GROUPS)) if present[i, j]]

    def factors_of(theta):
        f = np.ones((len(PHASES), len(GROUPS)))
        for (i, j), v in zip(free, theta):
            f[i, j] = math.exp(v)
        return f

    def residuals(theta):
        f = factors_of(theta)
        predicted = (seconds * f[phase_index]).sum(axis=1)
        return np.concatenate([weights * (predicted / measured - 1.0), PRIOR_WEIGHT * theta])

    lo, hi = (math.log(b) for b in FACTOR_BOUNDS)
    result = least_squares(residuals, np.zeros(len(free)), bounds=(lo, hi)) if free else None
    f = factors_of(result.x) if result is not None else np.ones((len(PHASES), len(GROUPS)))
    factors = {ph: {g: round(float(f[i, j]), 6) for j, g in enumerate(GROUPS) if present[i, j]}
               for i, ph in enumerate(PHASES)}
    profile = corrected(base, factors)
    if name:
        profile = dataclasses.replace(profile, name=name)
    if result is None:
        return profile, 0.0, True, "nothing to fit", 0
    return profile, float(result.cost), bool(result.success), str(result.message), int(result.nfev)
