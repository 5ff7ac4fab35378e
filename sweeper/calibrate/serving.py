"""The serving loop's host costs for `sweeper calibrate` (docs/host-calibration.md): what
`sweeper serve --measure-overheads` measures (sweeper/serving/overheads.py), on two fixed
probe deployments of a small probe model, one aggregated and one disaggregated, so that a
plan made on a calibrated host prices the loop's own work without a serving run first, and
the spread of each loop's call durations, which a plan's error band draws from
(sweeper/serving/bands.py `serving_spread`).
The figures are per decode step, per prompt and per handover; they are taken on one
model and one slot count, and docs/host-calibration.md says how far they carry.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from workloads.config import HardwareProfile, ModelConfig
from workloads.deployment import Deployment, PhaseSlice
from workloads.serving.costs import HostCosts
from workloads.serving.hostcosts import duration_spread

# A small probe model (not a preset: the blind benchmark never draws it; workloads/probes.py)
MODEL = ModelConfig("serving-probe", 256, 1024, 2, 8, 2, 32, 1000, "serial", "swiglu", False)
INPUT_LEN, OUTPUT_LEN = 32, 16
SLOTS = 4
# quantiles of each spread of call durations kept in the profile: the top one is the 99.5th
# percentile, which is what a served stream's p99 rests on
SPREAD_QUANTILES = 100


def deployments(hardware: HardwareProfile) -> dict[str, Deployment]:
    one = dict(chips=1, replicas=1, ffn="ws2d", attn="head", weights="bf16")
    return {"aggregated": Deployment(MODEL, hardware, "aggregated",
                                     PhaseSlice(batch=1, **one), PhaseSlice(batch=SLOTS, **one)),
            "disaggregated": Deployment(MODEL, hardware, "disaggregated",
                                        PhaseSlice(batch=1, **one), PhaseSlice(batch=SLOTS, **one))}


def measure(profile: HardwareProfile) -> dict[str, Any]:
    """{"fields": {"host_costs": the profile's HostCosts}, "detail": what each deployment
    measured, "spread": each deployment's spread of call durations}: the handover's costs
    and the prefill slice's wake from the disaggregated deployment, the rest from the
    aggregated one."""
    from sweeper.serving.overheads import measure as measure_costs

    detail, measured, spread = {}, {}, {}
    for mode, deployment in deployments(profile).items():
        costs = measure_costs(deployment, INPUT_LEN, OUTPUT_LEN)
        detail[mode] = {k: v for k, v in costs.items() if isinstance(v, (int, float))}
        measured[mode] = HostCosts.from_measured(costs)
        spread[mode] = dict(zip(("prefill", "decode"), map(quantiles, duration_spread(costs))))
    handover = {name: getattr(measured["disaggregated"], name) for name in HostCosts.disaggregated_names()}
    return {"fields": {"host_costs": dataclasses.replace(measured["aggregated"], **handover)},
            "detail": detail, "spread": spread}


def quantiles(factors, n: int = SPREAD_QUANTILES) -> list[float]:
    """`n` quantiles (at (k + 1/2) / n) of a spread of duration factors: what a plan's band
    draws each call's factor from (sweeper/serving/bands.py `serving_spread`), small enough
    for the profile YAML; [] for none."""
    if len(factors) == 0:
        return []
    levels = (np.arange(n) + 0.5) / n
    return [round(float(q), 4) for q in np.quantile(np.asarray(factors, dtype=float), levels)]
