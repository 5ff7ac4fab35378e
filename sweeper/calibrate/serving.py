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
    """{"fields": the profile's serving fields, "detail": what each deployment measured}."""
    from sweeper.serving.overheads import measure as measure_costs
    from sweeper.serving.overheads import with_overheads

    detail, fields = {}, {}
    for mode, deployment in deployments(profile).items():
        costs = measure_costs(deployment, INPUT_LEN, OUTPUT_LEN)
        detail[mode] = {k: v for k, v in costs.items() if isinstance(v, (int, float))}
        measured = with_overheads(profile, costs)
        names = [f.name for f in dataclasses.fields(HardwareProfile) if f.name.startswith("serving_")
                 or f.name == "handover_overhead_s"]
        for name in names:
            value = getattr(measured, name)
            if mode == "aggregated" and name in ("handover_overhead_s", "serving_handover_latency_s",
                                                 "serving_decode_wake_s", "serving_prefill_idle_after_s"):
                continue
            if mode == "disaggregated" and name not in ("handover_overhead_s", "serving_handover_latency_s",
                                                        "serving_decode_wake_s", "serving_prefill_idle_after_s"):
                continue
            fields[name] = value
    return {"fields": fields, "detail": detail}
