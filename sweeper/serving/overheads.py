"""Serving host costs: what a serving loop adds on the host to the engine's own calls,
measured on this host outside any served stream (docs/serving.md "Serving host costs").

    costs = measure(deployment, input_len=32, output_len=32)    # starts its own workers
    hardware = with_overheads(deployment.hardware, costs)        # the three profile fields

The serving model (workloads/servingmodel.py) adds them to the cost model's step times:
- `serving_step_overhead_s`: per decode step, the median step of the serving loop itself
  (`SlotServer.step()`, the clock read, the slot bookkeeping; a closed loop with every slot
  full and no arrivals) minus the median of the engine's decode call of the same slot batch
  (decode program and argmax, arguments placed before the timer, synchronised once: how a
  calibration trial times a step, so what the fitted cost model predicts);
- `serving_prefill_overhead_s`: per prefill call, the loop's prefill (prompts, the call,
  argmax, sync, its rows written into slots or, on a prefill slice, their KV exported)
  minus the engine's prefill program alone (as a trial times it). Disaggregated: measured
  on the prefill worker;
- `handover_overhead_s` (disaggregated): the fixed part of one KV handover from the prefill
  worker starting the export to the KV in a decode slot (export, one Ray call, the insert),
  wall clock across the two processes (one host, one clock): the intercept of a straight
  line through handovers at two KV sizes (the prompt and half of it); the bytes' part is the
  link the cost model prices.

Each worker runs where `sweeper serve` runs it (the same cores, `ServingSession`), so the
costs include the core share a deployment gets. A difference below zero (timer noise) is 0.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from workloads.deployment import Deployment
from workloads.config import HardwareProfile

FIELDS = ("serving_step_overhead_s", "serving_prefill_overhead_s", "handover_overhead_s")


def measure_session(session, input_len: int, output_len: int, rounds: int = 3) -> dict[str, Any]:
    """The three costs (module docstring) on a started `ServingSession`'s workers, before
    (or between) its streams; with the medians they come from."""
    ray = session.ray
    actors = session.actors
    if session.deployment.mode == "aggregated":
        worker = ray.get(actors["aggregated"].measure_host_costs.remote(input_len, output_len, rounds))
        pre = dec = worker
        detail: dict[str, Any] = {"aggregated": worker}
    else:
        pre, dec = ray.get([actors["prefill"].measure_host_costs.remote(input_len, output_len, rounds),
                            actors["decode"].measure_host_costs.remote(input_len, output_len, rounds)])
        detail = {"prefill": pre, "decode": dec}
    out: dict[str, Any] = {
        "serving_step_overhead_s": max(dec["loop_step_s"] - dec["engine_step_s"], 0.0),
        "serving_prefill_overhead_s": max(pre["loop_prefill_s"] - pre["engine_prefill_s"], 0.0),
        "handover_overhead_s": 0.0}
    if session.deployment.mode == "disaggregated":
        lengths = sorted({max(input_len // 2, 1), input_len})
        samples = []
        for length in lengths:
            samples += ray.get(actors["prefill"].handover_send.remote(length, actors["decode"]))
        size = np.array([s["bytes"] for s in samples], dtype=float)
        seconds = np.array([s["in_slot"] - s["start"] for s in samples])
        if len(set(size)) > 1:
            slope, intercept = np.polyfit(size, seconds, 1)
        else:
            slope, intercept = 0.0, float(np.median(seconds))
        out["handover_overhead_s"] = max(float(intercept), 0.0)
        detail["handover"] = {"bytes": sorted(set(size.tolist())),
                              "median_s": {int(b): float(np.median(seconds[size == b]))
                                           for b in sorted(set(size))},
                              "seconds_per_byte": float(slope), "samples": len(samples)}
    out["detail"] = detail
    return out


def measure(deployment: Deployment, input_len: int, output_len: int, seed: int = 0,
            emulated: bool = True) -> dict[str, Any]:
    """Start the deployment's workers as `sweeper serve` does, measure, stop them."""
    from sweeper.serving.serve import ServingSession

    lengths = sorted({max(input_len // 2, 1), input_len})
    with ServingSession(deployment, input_len + output_len + 1, lengths, seed, emulated) as session:
        return measure_session(session, input_len, output_len)


def with_overheads(hardware: HardwareProfile, costs: dict) -> HardwareProfile:
    """`hardware` with the three measured fields (the rest as it is)."""
    return dataclasses.replace(hardware, **{k: float(costs[k]) for k in FIELDS})


def with_deployment_overheads(deployment: Deployment, costs: dict) -> Deployment:
    return dataclasses.replace(deployment, hardware=with_overheads(deployment.hardware, costs))
