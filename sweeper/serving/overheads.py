"""Serving host costs: what a serving loop adds on the host to the engine's own calls,
measured on this host outside any served stream (docs/serving.md "Serving host costs").

    costs = measure(deployment, input_len=32, output_len=32)    # starts its own workers
    hardware = with_overheads(deployment.hardware, costs)        # the profile fields (+ the wake)

The serving model (workloads/servingmodel.py) adds them to the cost model's step times:
- `serving_step_overhead_s`: per decode step, the mean step of the serving loop itself
  (`SlotServer.step()`, the clock read, the slot bookkeeping; a closed loop with every slot
  full and no arrivals; a mean, so that the host's interruptions of the loop are in it:
  a queue pays them) minus the median of the engine's decode call of the same slot batch
  (decode program and argmax, arguments placed before the timer, synchronised once: how a
  calibration trial times a step, so what the fitted cost model predicts). Both are
  PAIRED: a decode slice's closed loop times the engine's call right before each step (an
  aggregated loop, the engine's calls in the blocks just before and after each of its
  blocks), and the cost is the median over blocks of (the block's mean step - the mean of
  those engine calls), so the other processes' load of the measurement's seconds, in both, cancels
  instead of being charged to every step of every stream (unpaired, one dis-1+1chip-4slots
  measurement read 1.82 ms for a 0.85 ms median difference, and over-predicted its
  streams' TPOT by 20-68%; another, with the engine's calls caught in a burst, read 0);
- `serving_prefill_overhead_s`: per PROMPT of a prefill call, the loop's mean prefill
  (prompts, the call, argmax, sync, its rows written into slots or, on a prefill slice,
  their KV exported) minus the engine's prefill program alone (as a trial times it),
  divided by the prompts per call of the closed loop (the rows' inserts or exports are
  most of it: a served call of one prompt in a 4-prompt deployment pays ~1/4 of the
  4-prompt call's host cost). Disaggregated: measured on the prefill worker;
- `handover_overhead_s` (disaggregated): what one KV handover costs the decode slice's
  loop: the decode worker process's CPU seconds per handover (Ray receiving and unpickling
  the KV, the call, the insert into a slot; at least the insert's wall clock), over
  handovers at two KV sizes (the prompt and half of it): the worker is pinned to its core,
  so its loop loses that time. The prefill slice's share, the Ray call after the export
  (its submission and the Ray work it leaves on the prefill core), is in
  `serving_prefill_overhead_s`: the prefill slice's closed loop sends its KV to the decode
  worker as a stream does (server.py `measure_host_costs(decode=...)`); the rest of the
  handover's wall clock (the prefill process's work, waiting between the processes) is not
  charged to either loop (its fixed part, the intercept of a straight line through the
  handovers' wall clock from export to slot, is in the detail, `fixed_s`); the bytes' part
  is the link the cost model prices.

The mean is a robust one (server.py `measure_host_costs`): the closed loop runs in `BLOCKS`
blocks, each `ROUNDS` rounds (aggregated: a burst of `ROUNDS x slots` requests) repeated
until the block has run at least `MIN_BLOCK_S` seconds (so the loop runs at least 1.25 s,
spread over more with the engine's calls timed before the first block and after each), and
the mean is the MEDIAN of the blocks' means: still what a stream pays on
average, but a burst of other processes' load over fewer than half the blocks does not move
it (one pooled mean over a ~1 s loop once read 3.45 ms for a step whose median was 0.7 ms).

Beside the three fields, `prefill_wake_s`: how much longer a prefill call on an IDLE loop
takes to its first token than the engine's prefill (server.py `measure_host_costs` serves
one-token requests 0.1 s apart through the worker's own loop; the closed loop never idles,
a stream's prefill worker does between arrivals): the profile's `serving_prefill_wake_s`
(StepTimes `prefill_wake_s`).

And `prefill_first_overhead_s`: of a prefill call's host work, the part before its first
tokens, per call (the closed loop's calls to their first tokens minus the engine's
prefill; `first_token_overhead`): the serving model delays the first tokens by it and
charges the rest of the per-prompt cost after them (StepTimes `prefill_first_overhead_s`).
The profile's `serving_prefill_first_overhead_s` (`with_overheads` writes it with the others:
a serving run's prediction reads all five from its deployment's profile).

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
ROUNDS = 2      # rounds of the closed loop, repeated until a block has run MIN_BLOCK_S
BLOCKS = 5      # blocks (server.py `measure_host_costs`); the median of the blocks' means
MIN_BLOCK_S = 0.25


def measure_session(session, input_len: int, output_len: int, rounds: int = ROUNDS,
                    blocks: int = BLOCKS, min_block_s: float = MIN_BLOCK_S) -> dict[str, Any]:
    """The three costs (module docstring) on a started `ServingSession`'s workers, before
    (or between) its streams; with the medians and block means they come from."""
    ray = session.ray
    actors = session.actors
    how = (input_len, output_len, rounds, blocks, min_block_s)
    if session.deployment.mode == "aggregated":
        worker = ray.get(actors["aggregated"].measure_host_costs.remote(*how))   # replica 0
        pre = dec = worker
        detail: dict[str, Any] = {"aggregated": worker}
    else:
        # one worker after the other: run together, their closed loops (each saturating its
        # own loop) contend more than a stream does, whose prefill slice mostly waits
        # the prefill slice's closed loop sends each call's KV to the decode worker (as a
        # stream's does): the Ray submission and what it leaves on the prefill core are in
        # its prefill cost
        pre = ray.get(actors["prefill"].measure_host_costs.remote(*how, decode=actors["decode"]))
        dec = ray.get(actors["decode"].measure_host_costs.remote(*how))
        detail = {"prefill": pre, "decode": dec}
    out: dict[str, Any] = {**host_costs(pre, dec), "handover_overhead_s": 0.0,
                           # a prefill call on an idle loop: its extra seconds (StepTimes
                           # `prefill_wake_s`; server.py `measure_host_costs`)
                           "prefill_wake_s": float(pre.get("prefill_wake_s", 0.0)),
                           # of a prefill call's host work, the part before its first tokens
                           "prefill_first_overhead_s": first_token_overhead(pre)}
    if session.deployment.mode == "disaggregated":
        lengths = sorted({max(input_len // 2, 1), input_len})
        samples = []
        cpu_before = ray.get(actors["decode"].cpu_seconds.remote())
        for length in lengths:
            samples += ray.get(actors["prefill"].handover_send.remote(length, actors["decode"]))
        # the decode process's CPU per handover: Ray receiving and unpickling the KV, the
        # call, the insert (the decode loop's core pays all of it, not the insert alone)
        decode_cpu = (ray.get(actors["decode"].cpu_seconds.remote()) - cpu_before) / len(samples)
        size = np.array([s["bytes"] for s in samples], dtype=float)
        seconds = np.array([s["in_slot"] - s["start"] for s in samples])
        if len(set(size)) > 1:
            slope, intercept = np.polyfit(size, seconds, 1)
        else:
            slope, intercept = 0.0, float(np.median(seconds))
        insert = float(np.mean([s["insert_s"] for s in samples]))
        submit = float(np.mean([s["submitted"] - s["exported"] for s in samples]))
        # What each loop's core pays (docs/serving.md "Checking the model against the
        # server"): the decode loop the decode process's CPU per handover (receiving, the
        # call, the insert; at least the insert), not the handover's whole wall clock, part
        # of which is the prefill process's and waiting between the two; the prefill loop
        # the export and the Ray call (both in its closed loop's prefill cost, per prompt;
        # `submit_mean_s`, the submission alone, is a diagnostic).
        out["handover_overhead_s"] = max(decode_cpu, insert)
        detail["handover"] = {"bytes": sorted(set(size.tolist())),
                              "median_s": {int(b): float(np.median(seconds[size == b]))
                                           for b in sorted(set(size))},
                              "fixed_s": max(float(intercept), 0.0), "insert_mean_s": insert,
                              "decode_cpu_s": decode_cpu,
                              "submit_mean_s": submit,
                              "seconds_per_byte": float(slope), "samples": len(samples)}
    out["detail"] = detail
    return out


def host_costs(prefill: dict, decode: dict) -> dict[str, float]:
    """The step and prefill host costs from a worker's `measure_host_costs` (server.py):
    the loop's MEANS (the median of its blocks' means: module docstring) against the
    engine's medians, the prefill's per prompt of the closed loop's calls. Means: a stream's
    queue is paid in mean service time;
    a replay of served streams through the serving model with their own calls' durations
    reproduces the measured TTFT with the means, and misses it by ~25% (p50, 85% load) with
    the medians (docs/serving.md "Checking the model against the server")."""
    prompts = float(prefill.get("loop_prefill_prompts") or 1.0)
    # the step is paired with the engine's calls (a decode slice: the call just before each
    # step; aggregated: the engine's blocks just before and after each block of the loop):
    # its host work per step is the median over blocks of their means' difference, so that
    # the other processes' load during the measurement (in both) is not charged to every
    # step of a stream that may not see it (module docstring)
    step = decode.get("loop_step_paired_extra_s")
    if step is None:
        step = decode["loop_step_mean_s"] - decode["engine_step_s"]
    return {"serving_step_overhead_s": max(step, 0.0),
            "serving_prefill_overhead_s": max(prefill["loop_prefill_mean_s"]
                                              - prefill["engine_prefill_s"], 0.0) / prompts}


def first_token_overhead(prefill: dict) -> float:
    """Of a prefill call's host work, the seconds before its first tokens (per call): the
    closed loop's calls to their first tokens minus the engine's prefill program, paired
    (server.py `measure_host_costs`: per block, against the engine's calls just before and
    after it; the median over blocks), at most the call's whole host work; 0 for a
    measurement without it."""
    if "loop_prefill_first_paired_extra_s" not in prefill:
        return 0.0
    whole = max(prefill["loop_prefill_mean_s"] - prefill["engine_prefill_s"], 0.0)
    return min(max(prefill["loop_prefill_first_paired_extra_s"], 0.0), whole)


def duration_spread(costs: dict) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """(prefill, decode step) duration factors of mean 1 from a measurement's closed loops
    (each call's seconds over their mean; server.py `measure_host_costs`): the spread the
    serving model draws from (StepTimes `prefill_spread`, `step_spread`)."""
    detail = costs["detail"]
    pre = detail["aggregated"] if "aggregated" in detail else detail["prefill"]
    dec = detail["aggregated"] if "aggregated" in detail else detail["decode"]

    def factors(samples) -> tuple[float, ...]:
        values = np.asarray(samples or [], dtype=float)
        return tuple((values / values.mean()).tolist()) if values.size and values.mean() > 0 else ()

    return factors(pre.get("loop_prefill_samples_s")), factors(dec.get("loop_step_samples_s"))


def measure(deployment: Deployment, input_len: int, output_len: int, seed: int = 0,
            emulated: bool = True) -> dict[str, Any]:
    """Start the deployment's workers as `sweeper serve` does, measure, stop them."""
    from sweeper.serving.serve import ServingSession

    lengths = sorted({max(input_len // 2, 1), input_len})
    with ServingSession(deployment, input_len + output_len + 1, lengths, seed, emulated) as session:
        return measure_session(session, input_len, output_len)


def with_overheads(hardware: HardwareProfile, costs: dict) -> HardwareProfile:
    """`hardware` with the three measured fields, the idle-loop wake and the part of a
    prefill's host work before its first tokens (the rest as it is)."""
    return dataclasses.replace(
        hardware, **{k: float(costs[k]) for k in FIELDS},
        serving_prefill_wake_s=float(costs.get("prefill_wake_s", 0.0)),
        serving_prefill_first_overhead_s=float(costs.get("prefill_first_overhead_s", 0.0)))


def with_deployment_overheads(deployment: Deployment, costs: dict) -> Deployment:
    return dataclasses.replace(deployment, hardware=with_overheads(deployment.hardware, costs))
