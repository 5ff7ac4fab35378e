"""Serving host costs: what a serving loop adds on the host to the engine's own calls,
measured on this host outside any served stream (docs/serving.md "Serving host costs").

    costs = measure(deployment, input_len=32, output_len=32)    # starts its own workers
    hardware = with_overheads(deployment.hardware, costs)        # the profile fields (+ the wake)

Each cost is a field of `HostCosts` (workloads/serving/costs.py, where each is declared
with its meaning); the serving model (workloads/serving/model.py) adds them to the cost
model's step times:
- `step_overhead_s`: per decode step, the mean step of the serving loop itself
  (`SlotServer.step()`, the clock read, the slot bookkeeping; a closed loop with every slot
  full and no arrivals; a mean, so that the host's interruptions of the loop are in it:
  a queue pays them) minus the median of the engine's decode call of the same slot batch
  (decode program and argmax, arguments placed before the timer, synchronised), plus that
  call minus the same call run back to back with one wait at the end (how a trial times
  its steps, so the step the fitted cost model predicts: the loop waits for every step's
  tokens, workloads/serving/hostcosts.py `step_sync_s`). Both are
  PAIRED: a decode slice's closed loop times the engine's call right before each step (an
  aggregated loop, the engine's calls in the blocks just before and after each of its
  blocks), and the cost is the median over blocks of (the block's mean step - the mean of
  those engine calls), so the other processes' load of the measurement's seconds, in both, cancels
  instead of being charged to every step of every stream (unpaired, one dis-1+1chip-4slots
  measurement read 1.82 ms for a 0.85 ms median difference, and over-predicted its
  streams' TPOT by 20-68%; another, with the engine's calls caught in a burst, read 0);
- `prefill_overhead_per_prompt_s`: per PROMPT of a prefill call, the loop's mean prefill
  (prompts, the call, argmax, sync, its rows written into slots or, on a prefill slice,
  their KV exported) minus the engine's prefill program alone (as a trial times it),
  divided by the prompts per call of the closed loop (the rows' inserts or exports are
  most of it: a served call of one prompt in a 4-prompt deployment pays ~1/4 of the
  4-prompt call's host cost). Aggregated: prefill calls of 1..prefill_batch prompts, each
  paired with the engine's prefill right before it, the median of the differences per
  prompt count, per prompt (workloads/serving/hostcosts.py `paired_prefill_calls`: a saturated
  loop of a multi-prompt prefill times one call per block). Disaggregated: measured on
  the prefill worker, paired by block (each block's mean call against the engine's blocks
  beside it, the median over blocks, as the aggregated step);
- `handover_overhead_s` (disaggregated): what one KV handover costs the decode slice's
  loop: the decode worker process's CPU per handover (Ray receiving and unpickling the KV,
  the call, the insert; `decode_cpu_s`, over handovers at two KV sizes, `handover_send`),
  or, where more, the figure measured on that loop STEPPING with the prefill worker's
  handovers arriving at a stream's rate (`measure_stepping_handovers`,
  workloads/serving/hostcosts.py `stepping_handover_costs`: its insert, and the step right after
  it where slower, per handover, at least the insert). The worker's Ray threads are not on
  its pinned core, so the receipt's share of that CPU lands on the loop's core only as
  far as the other core is busy; the validation runs matched the CPU per handover better
  than the inserts alone (docs/serving.md "What a handover costs a stepping decode
  loop"). The prefill slice's share, the Ray call after the export
  (its submission and the Ray work it leaves on the prefill core), is in
  `prefill_overhead_per_prompt_s`: the prefill slice's closed loop sends its KV to the decode
  worker as a stream does (server.py `measure_host_costs(decode=...)`); the rest of the
  handover's wall clock (the prefill process's work, waiting between the processes) is not
  charged to either loop (its fixed part, the intercept of a straight line through the
  handovers' wall clock from export to slot, is in the detail, `fixed_s`); the bytes' part
  is the link the cost model prices. Then requests one at a time through the two workers'
  own serving loops, the decode loop idle at each (workloads/serving/hostcosts.py
  `idle_handover_costs`), give `handover_latency_s` (send to insert: the KV's transport and
  the idle loop's poll, charged to neither loop), `decode_wake_s` (an idle decode loop's
  first step, beyond the model's) and `prefill_idle_after_s` (an idle prefill loop's export
  and send after its first tokens, per prompt); their median insert (an idle loop's, longer
  than a stepping one's) stays in the detail; docs/serving.md "Serving host costs", "What a
  handover costs a stepping decode loop".

The mean is a robust one (workloads/serving/hostcosts.py `measure_loop`, run by server.py
`measure_host_costs` and by a serving trial's worker): the closed loop runs in `BLOCKS`
blocks, each `ROUNDS` rounds (aggregated: a burst of `ROUNDS x slots` requests) repeated
until the block has run at least `MIN_BLOCK_S` seconds (so the loop runs at least 1.25 s,
spread over more with the engine's calls timed before the first block and after each), and
the mean is the MEDIAN of the blocks' means: still what a stream pays on
average, but a burst of other processes' load over fewer than half the blocks does not move
it (one pooled mean over a ~1 s loop once read 3.45 ms for a step whose median was 0.7 ms).

Beside those, `prefill_wake_s`: how much longer a prefill call on an IDLE loop
takes to its first token than the engine's prefill (server.py `measure_host_costs` serves
short requests 0.1 s apart through the worker's own loop; the closed loop never idles,
a stream's prefill worker does between arrivals), `prefill_wake_short_s`, the same 0.01 s
apart (the wake grows with the loop's idle time, each recorded as `prefill_wake_idle_s`,
`prefill_wake_short_idle_s`; HostCosts `wake_after`); on an aggregated loop the requests
decode a few steps, and what those take beyond the model's steps is `decode_after_wake_s`
(`decode_after_wake_short_s` after the short idle; hostcosts `decode_after_wake`); and
`prefill_wake_weight_bytes`, the
prefill slice's weights it was measured with (`measure`; the serving model moves the wake
to other weights on a calibrated host, workloads/serving/model.py `host_costs_for`).

And `prefill_first_overhead_s`: of a prefill call's host work, the part before its first
tokens, per call (the closed loop's calls to their first tokens minus the engine's
prefill; aggregated, the median of the paired calls' differences; `first_token_overhead`):
the serving model delays the first tokens by it and
charges the rest of the per-prompt cost after them. `with_overheads` writes them all into
a profile's `host_costs`: a serving run's prediction reads them from its deployment's.

Each worker runs where `sweeper serve` runs it (the same cores, `ServingSession`), so the
costs include the core share a deployment gets. A difference below zero (timer noise) is 0.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from workloads.config import HardwareProfile
from workloads.deployment import Deployment
from workloads.serving import hostcosts
from workloads.serving.costs import HostCosts
from workloads.serving.profile import merge_decoded
# the measuring code and the costs from its answers live in workloads (a serving trial's
# worker measures them too, workloads/serving/trial.py); their names stay importable here
from workloads.serving.hostcosts import (combine, duration_spread, first_token_overhead,  # noqa: F401
                                         handover_costs, host_costs)

FIELDS = HostCosts.names()          # the costs, as a measurement's dict names them
ROUNDS = hostcosts.ROUNDS            # rounds of the closed loop (workloads/serving/hostcosts.py)
BLOCKS = hostcosts.BLOCKS            # blocks; the median of the blocks' means
MIN_BLOCK_S = hostcosts.MIN_BLOCK_S
IDLE_HANDOVER_MARGIN_S = 0.5   # the idle handovers' start after their Ray calls are made
IDLE_HANDOVER_SEED = 9500      # their prompts' seed (no stream's)


def measure_session(session, input_len: int, output_len: int, rounds: int = ROUNDS,
                    blocks: int = BLOCKS, min_block_s: float = MIN_BLOCK_S) -> dict[str, Any]:
    """The costs (module docstring) on a started `ServingSession`'s workers, before
    (or between) its streams; with the medians and block means they come from."""
    ray = session.ray
    actors = session.actors
    how = (input_len, output_len, rounds, blocks, min_block_s)
    if session.deployment.mode == "aggregated":
        worker = ray.get(actors["aggregated"].measure_host_costs.remote(*how))   # replica 0
        return combine(worker, worker)
    # the prefill slice's closed loop sends each call's KV to the decode worker (as a
    # stream's does): the Ray submission and what it leaves on the prefill core are in
    # its prefill cost; and it runs while the decode slice steps (server.py
    # `decode_beside`, on the decode worker's core): in a stream the decode loop is
    # stepping during most prefill calls, and the two cores' work slows each other's
    # calls (measured in the commit that added this; docs/serving.md "Serving host
    # costs"). The decode slice's own closed loop runs after it, alone: run together, the
    # two saturated loops contend more than a stream's decode loop sees, whose prefill
    # slice mostly waits
    token = time.monotonic_ns()
    beside = actors["decode"].decode_beside.remote(token)
    try:
        pre = ray.get(actors["prefill"].measure_host_costs.remote(*how, decode=actors["decode"]))
    finally:
        ray.get(actors["decode"].stop_decode_beside.remote(token))
    pre["decode_beside_steps"] = ray.get(beside)
    dec = ray.get(actors["decode"].measure_host_costs.remote(*how))
    lengths = sorted({max(input_len // 2, 1), input_len})
    samples = []
    cpu_before = ray.get(actors["decode"].cpu_seconds.remote())
    for length in lengths:
        samples += ray.get(actors["prefill"].handover_send.remote(length, actors["decode"]))
    # the decode process's CPU per handover: Ray receiving and unpickling the KV, the
    # call, the insert (the decode loop's core pays all of it, not the insert alone)
    decode_cpu = (ray.get(actors["decode"].cpu_seconds.remote()) - cpu_before) / len(samples)
    # What each loop's core pays (docs/serving.md "Checking the model against the
    # server"): the decode loop the decode process's CPU per handover (or the stepping
    # loop's figure, below, where more), not the handover's whole wall clock, part of
    # which is the prefill process's and waiting between the two; the prefill loop the
    # export and the Ray call (both in its closed loop's prefill cost, per prompt;
    # `submit_mean_s`, the submission alone, is a diagnostic).
    # the handover on an idle loop: requests one at a time through the two workers' own
    # serving loops (workloads/serving/hostcosts.py `idle_handover_costs`: the KV's latency to the
    # decode loop, its insert there, the decode loop's wake)
    reqs = hostcosts.idle_handover_requests(
        input_len, output_len, hostcosts.idle_handover_gap_s(pre, dec, output_len))
    start_at = time.time() + IDLE_HANDOVER_MARGIN_S
    decoded = actors["decode"].serve_decode.remote(len(reqs), start_at)
    served = ray.get(actors["prefill"].serve_prefill.remote(reqs, start_at, IDLE_HANDOVER_SEED,
                                                            actors["decode"]))
    merge_decoded(served, ray.get(decoded))
    # what a handover costs the decode loop while it steps, as in a stream: the loop
    # stepping with the prefill worker's handovers arriving at a stream's rate, paired by
    # window with the same loop without them (workloads/serving/hostcosts.py `stepping_decode_loop`)
    stepping = measure_stepping_handovers(session, pre, dec, input_len, output_len)
    return combine(pre, dec, handover_costs(samples, decode_cpu), served, stepping)


def measure_stepping_handovers(session, pre: dict, dec: dict, input_len: int, output_len: int,
                               windows: int = hostcosts.STEPPING_WINDOWS,
                               window_s: float = hostcosts.STEPPING_WINDOW_S,
                               load: float = hostcosts.STEPPING_LOAD) -> dict[str, Any]:
    """A disaggregated session's decode loop stepping with handovers from its prefill worker
    at `load` of its closed loop's capacity, against itself without them
    (`hostcosts.stepping_handover_costs`'s dict, with the rate)."""
    ray = session.ray
    actors = session.actors
    rate = hostcosts.stepping_rate(pre, dec, session.deployment.decode.batch, output_len, load)
    start_at = time.time() + IDLE_HANDOVER_MARGIN_S
    calls = actors["decode"].stepping_decode.remote(start_at, windows, window_s)
    sent = ray.get(actors["prefill"].stepping_send.remote(
        input_len, output_len, start_at, rate, actors["decode"], windows, window_s))
    log = ray.get(calls)
    out = hostcosts.stepping_handover_costs(log, start_at, windows, window_s)
    out["rate_rps"], out["sent_per_window"] = rate, sent
    out["calls"] = [(kind, a - start_at, b - start_at) for kind, a, b in log]   # its log
    return out


def measure(deployment: Deployment, input_len: int, output_len: int, seed: int = 0,
            emulated: bool = True) -> dict[str, Any]:
    """Start the deployment's workers as `sweeper serve` does, measure, stop them."""
    from sweeper.serving.serve import ServingSession

    from workloads.serving.model import prefill_weight_bytes

    lengths = sorted({max(input_len // 2, 1), input_len})
    with ServingSession(deployment, input_len + output_len + 1, lengths, seed, emulated) as session:
        costs = measure_session(session, input_len, output_len)
    # what the wake was measured with (the serving model moves it to other weights)
    costs["prefill_wake_weight_bytes"] = prefill_weight_bytes(deployment)
    return costs


def with_overheads(hardware: HardwareProfile, costs: dict) -> HardwareProfile:
    """`hardware` with the measured `HostCosts` (0 where not measured: an aggregated
    deployment's handover costs); the rest as it is."""
    return dataclasses.replace(hardware, host_costs=HostCosts.from_measured(costs))


def with_deployment_overheads(deployment: Deployment, costs: dict) -> Deployment:
    return dataclasses.replace(deployment, hardware=with_overheads(deployment.hardware, costs))
