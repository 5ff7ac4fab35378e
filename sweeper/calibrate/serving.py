"""The serving loop's host costs for `sweeper calibrate` (docs/host-calibration.md): what
`sweeper serve --measure-overheads` measures (sweeper/serving/overheads.py), on two fixed
probe deployments of a small probe model, one aggregated and one disaggregated, so that a
plan made on a calibrated host prices the loop's own work without a serving run first.
The figures are per decode step, per prompt and per handover; they are taken on one
model and one slot count, and docs/host-calibration.md says how far they carry.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from workloads.config import HardwareProfile, ModelConfig
from workloads.deployment import Deployment, PhaseSlice
from workloads.serving.costs import HostCosts

# A small probe model (not a preset: the blind benchmark never draws it; workloads/probes.py)
MODEL = ModelConfig("serving-probe", 256, 1024, 2, 8, 2, 32, 1000, "serial", "swiglu", False)
INPUT_LEN, OUTPUT_LEN = 32, 16
SLOTS = 4


def deployments(hardware: HardwareProfile) -> dict[str, Deployment]:
    one = dict(chips=1, replicas=1, ffn="ws2d", attn="head", weights="bf16")
    return {"aggregated": Deployment(MODEL, hardware, "aggregated",
                                     PhaseSlice(batch=1, **one), PhaseSlice(batch=SLOTS, **one)),
            "disaggregated": Deployment(MODEL, hardware, "disaggregated",
                                        PhaseSlice(batch=1, **one), PhaseSlice(batch=SLOTS, **one))}


def measure(profile: HardwareProfile) -> dict[str, Any]:
    """{"fields": {"host_costs": the profile's HostCosts}, "detail": what each deployment
    measured}: the handover's costs from the disaggregated deployment, the rest from the
    aggregated one."""
    from sweeper.serving.overheads import measure as measure_costs

    detail, measured = {}, {}
    for mode, deployment in deployments(profile).items():
        costs = measure_costs(deployment, INPUT_LEN, OUTPUT_LEN)
        detail[mode] = {k: v for k, v in costs.items() if isinstance(v, (int, float))}
        measured[mode] = HostCosts.from_measured(costs)
    handover = {name: getattr(measured["disaggregated"], name) for name in HostCosts.disaggregated_names()}
    return {"fields": {"host_costs": dataclasses.replace(measured["aggregated"], **handover)},
            "detail": detail}
