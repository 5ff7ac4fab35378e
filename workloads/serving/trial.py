"""A serving trial: the engine serves a request stream with one sweep point's deployment.

A space with a `serving:` block (docs/space-files.md, "Serving trials") makes every trial of
`sweeper run` a real serving run instead of a timed prefill/decode batch:

    measurement = run_serving_trial(trial, hardware)    # trial.serving: the stream

- **Deployment**: aggregated, one replica on the trial's mesh (its chips, topology,
  per-phase layouts, weights and head padding), `batch` decode slots and one prompt per
  prefill call: the engine's slot server (workloads/serving/slots.py), as `sweeper serve` runs an
  aggregated plan (docs/serving.md, "Real serving runs"). Disaggregated (`serving_mode`):
  a prefill slice and a decode slice of half the chips each (`slice_topologies`), the
  trial's prefill layout on one, its decode layout and `batch` slots on the other; this
  process runs the prefill slice, the caller's decode worker the decode slice
  (`run_serving_trial(decode_slice=...)`; sweeper/sweep/meshworker.py starts it as a
  second Ray mesh worker), the loops `sweeper serve` runs (`serve_prefill_slice`,
  `serve_decode_slice` in workloads/serving/slots.py). Aggregated with `prefill_chunk` > 0:
  chunked prefill (`SlotSpec.chunk`, `_serve_chunked`); with `stages` > 1: the chips in
  pipeline stages (workloads/serving/pipeline.py `StagedSlotServer`, the topology one
  stage's mesh); with the block's `prefix_len`: prefix caching (`SlotSpec.prefix_len`).
- **Stream**: `requests` requests of the block's profile (workloads/serving/profile.py):
  Poisson arrivals at `rate` (or a trace's rows), prompt and answer lengths drawn from it,
  seeded by the trial's `seed`. Arrivals are wall clock: the loop waits for each arrival
  after a common start; every program is compiled and warmed up before (no request pays a
  compile; `compile_s` is that set-up).
- **Loop**: when prompts wait and slots are free, one prefill call (prompts of one length)
  is inserted between two decode steps; a decode step runs every slot; a slot is refilled
  as soon as its request finishes: `workloads.serving.slots.serve_aggregated`, the one loop
  `sweeper serve` runs and the serving model simulates (docs/serving.md "The serving model").
- **Metrics** (workloads/metrics.py, the serving block): TTFT = first token on the host -
  arrival; TPOT = (last token - first token) / (output tokens - 1); p50/p99 over the
  requests; throughput and tokens per second per chip over the span from the first arrival
  to the last finish; SLO attainment = share of requests within both the `ttft` and `tpot`
  targets; goodput = attainment x the offered rate (the profile's Poisson rate, else the
  stream's); cost per million output tokens when the hardware profile has a price.
  The same definitions as `sweeper serve` (workloads/serving/model.py `SimResult.summary`);
  tests/test_serving_trials.py checks that the two agree on the same requests.
- **Prediction** (`predict_stream`): the serving model (workloads/serving/model.py
  `simulate`, docs/serving.md "The serving model") serves the same requests with the same
  deployment. Step times: with this host's measured profile (`hardware: host`, which has no
  serving host costs), the deployment's engine calls and serving host costs measured on the
  trial's own warmed-up servers before the stream (`measure_before_stream`, the code of
  `sweeper serve --measure-overheads`, workloads/serving/hostcosts.py; never the stream's own calls;
  kept in `extra["serving"]["measured_before_stream"]`); with another profile (a preset or
  a fitted YAML: `devices:<profile>`), the cost model's with it: `pred_ttft_p50_s`,
  `pred_ttft_p99_s`, `pred_tpot_p50_s`, `pred_tpot_p99_s`, analytical, beside the measured
  ones; NaN (and the reason in `extra["serving"]["prediction"]`) when there is no profile or
  it cannot price the deployment. The controller stores that note as the Optuna user attr
  and MLflow tag `prediction_note`, and the whole `extra["serving"]` (per-request records
  included) as the child run's artifact `serving.json` (docs/serving.md).
"""

from __future__ import annotations

import dataclasses
import math
import time

import numpy as np

from workloads.config import ConfigError, HardwareProfile
from workloads.deployment import Deployment, PhaseSlice
from workloads.metrics import SERVING_PREDICTIONS, Measurement
from workloads.serving.costs import HostCosts
from workloads.serving.model import run_model, simulate, stream_summary
from workloads.serving.profile import (AppProfile, Request, block_profile, context_len,
                                       merge_decoded, offered_rps, requests)
from workloads.trial import TrialConfig

START_MARGIN_S = 0.05     # the stream starts this long after the set-up ends


def trial_profile(trial: TrialConfig) -> AppProfile:
    """The application profile of a serving trial's stream (already validated)."""
    return block_profile(trial.serving or {}, prefix="serving.")


def trial_requests(trial: TrialConfig) -> list[Request]:
    """The trial's request stream: `requests` requests of its profile, seeded by its seed."""
    return requests(trial_profile(trial), int(trial.serving["requests"]), seed=trial.seed)


def slice_topologies(trial: TrialConfig) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """A disaggregated trial's (prefill, decode) topologies: its slices'
    (`TrialConfig.slice_trials`: half of the trial's chips each, split as the cost model
    splits them, as `sweeper serve` does for a plan without topologies); ConfigError (field
    `chips`) when the chips cannot be halved."""
    slices = trial.slice_trials()
    return tuple(slices["prefill"].mesh_shape), tuple(slices["decode"].mesh_shape)


def trial_deployment(trial: TrialConfig, hardware: HardwareProfile) -> Deployment:
    """The deployment a serving trial runs (module docstring): aggregated, one replica of the
    trial's chips and topology, its per-phase layouts and weights, one prompt per prefill
    call (or chunks of `prefill_chunk` tokens), `batch` decode slots, in `stages` pipeline
    stages (the topology one stage's mesh, as a plan's); disaggregated, a prefill slice and a decode slice of half
    the chips each (`slice_topologies`), the same layouts, weights, prompts and slots."""
    mode = trial.serving_mode
    if mode == "disaggregated":
        chips, (tp, td) = trial.chips // 2, slice_topologies(trial)
    else:
        chips, tp, td = trial.chips, tuple(trial.mesh_shape), tuple(trial.mesh_shape)

    def phase(layout, batch: int, topology, chunk: int = 0) -> PhaseSlice:
        return PhaseSlice(chips=chips, replicas=1, ffn=layout.ffn, attn=layout.attn,
                          batch=batch, weights=trial.weights, topology=topology,
                          stages=trial.stages, chunk=chunk)

    return Deployment(trial.model, hardware, mode,
                      phase(trial.prefill, 1, tp, trial.prefill_chunk),
                      phase(trial.decode, trial.batch, td))


def slice_specs(trial: TrialConfig, context: int, prefix_len: int = 0):
    """A disaggregated trial's (prefill, decode) SlotSpecs (workloads/serving/slots.py); the
    prefill slice caches the shared prefix's KV (`prefix_len`, prefix caching)."""
    from workloads.serving.slots import SlotSpec   # lazy: imports JAX (only where a trial runs)

    tp, td = slice_topologies(trial)
    common = dict(context_len=context, weights=trial.weights, seed=trial.seed,
                  pad_heads=trial.pad_heads, prefill_batch=1)
    return (SlotSpec(trial.model, tp, trial.prefill, None, slots=1, prefix_len=prefix_len,
                     **common),
            SlotSpec(trial.model, td, None, trial.decode, slots=trial.batch, **common))


MEASURED_STEP_TIMES = "measured before the stream (closed loop), host costs measured"
# How long a serving trial measures its deployment's calls and host costs before its stream
# (workloads/serving/hostcosts.py `measure_loop`): fewer and shorter blocks than `sweeper serve
# --measure-overheads` (5 x 0.25 s, 12 idle-loop requests), so a trial pays ~1.5 s, once
# per worker process and deployment shape (`measure_before_stream`).
TRIAL_MEASURE = {"rounds": 2, "blocks": 5, "min_block_s": 0.12, "wake_requests": 6,
                 "idle_gap_s": 0.1}
_MEASURED: dict = {}      # this worker process's measurements, by deployment shape


def measures_before_stream(hardware: HardwareProfile | None) -> bool:
    """Whether a trial with this profile measures its calls before its stream: this host's
    measured profile (`hardware: host`: its roofline has no serving host costs, which
    dominate a small model's steps); a device profile (`devices:<profile>`) predicts with
    its own costs."""
    return hardware is not None and hardware.measured


def measure_before_stream(trial: TrialConfig, server, reqs: list[Request], decode_slice=None
                          ) -> dict:
    """The trial's deployment measured on its own warmed-up servers before the stream, as
    `sweeper serve --measure-overheads` measures it (workloads/serving/hostcosts.py; docs/serving.md
    "Serving host costs"): the engine's prefill and decode calls, timed as a calibration
    trial times them, and the serving host costs (`combine`'s dict), at the stream's median
    prompt and answer lengths, and the engine's prefill at each of the stream's other
    prompt lengths (`engine_prefill_by_len_s`). Disaggregated: the prefill slice here, the
    decode slice on `decode_slice`'s worker, the KV handovers between them. Chunked prefill
    (`prefill_chunk`): the loop measured as its whole-prompt loop (as `sweeper serve
    --measure-overheads` measures it), the engine's prefill of `prefill_chunk` tokens beside
    the prompts' (a chunk's call; a ragged last chunk is padded to it). Nothing of the
    stream is read. Cached per worker process and deployment shape (`cached`)."""
    from workloads.serving import hostcosts   # lazy: its measuring imports JAX

    lengths = sorted({r.input_len for r in reqs})
    input_len = sorted(r.input_len for r in reqs)[len(reqs) // 2]
    output_len = max(sorted(r.output_len for r in reqs)[len(reqs) // 2], 2)
    # chunked prefill: the chunk's length measured too (a chunk is an engine call of `chunk`
    # tokens, a ragged last one padded to it: the lookup's nearest length)
    chunk = trial.prefill_chunk
    key = (repr(trial.model), tuple(trial.mesh_shape), trial.prefill, trial.decode, trial.batch,
           trial.weights, trial.pad_heads, trial.serving_mode, trial.chips, tuple(lengths),
           input_len, output_len, server.spec.context_len, trial.stages, chunk)
    if key in _MEASURED:
        return {**_MEASURED[key], "cached": True}
    began = time.perf_counter()
    if trial.serving_mode == "disaggregated":
        # the decode slice steps beside the prefill slice's closed loop where it offers to
        # (`begin_beside`/`end_beside`), as in a stream and as `sweeper serve
        # --measure-overheads` measures it (docs/serving.md "The prefill slice beside a
        # stepping decode slice"); without, the prefill slice's closed loop runs alone
        beside = decode_slice.begin_beside() if hasattr(decode_slice, "begin_beside") else None
        try:
            pre = hostcosts.measure_loop(server, input_len, output_len, **TRIAL_MEASURE,
                                         send=decode_slice.sink, wait=decode_slice.wait)
        finally:
            steps = decode_slice.end_beside(beside) if beside is not None else None
        if steps is not None:
            pre["decode_beside_steps"] = steps
        dec = decode_slice.measure_loop(input_len, output_len, TRIAL_MEASURE)
        samples: list[dict] = []
        cpu_before = decode_slice.cpu_seconds()
        # the stream's prompt lengths only (each compiled in the warm-up): the median's and
        # the shortest (the KV size's slope when they differ)
        for length in sorted({lengths[0], input_len}):
            samples += hostcosts.handover_send(server, length, decode_slice.receive)
        decode_cpu = (decode_slice.cpu_seconds() - cpu_before) / len(samples)
        idle = idle_handovers(server, decode_slice, input_len, output_len,
                              hostcosts.idle_handover_gap_s(pre, dec, output_len))
        costs = hostcosts.combine(pre, dec, hostcosts.handover_costs(samples, decode_cpu), idle)
    else:
        # a chunked server's loop measured as its whole-prompt loop, as `sweeper serve
        # --measure-overheads` measures it (sweeper/serving/server.py `measure_overheads`)
        server.spec = dataclasses.replace(server.spec, chunk=0)
        try:
            pre = hostcosts.measure_loop(server, input_len, output_len, **TRIAL_MEASURE)
        finally:
            server.spec = dataclasses.replace(server.spec, chunk=chunk)
        costs = hostcosts.combine(pre, pre)
    costs["engine_prefill_by_len_s"] = {
        str(n): (pre["engine_prefill_s"] if n == input_len else hostcosts.engine_prefill_s(server, n))
        for n in sorted({*lengths, *([chunk] if chunk else [])})}
    costs["input_len"], costs["output_len"] = input_len, output_len
    costs["measure_before_stream_s"] = time.perf_counter() - began
    _MEASURED[key] = costs
    return {**costs, "cached": False}


def idle_handovers(server, decode_slice, input_len: int, output_len: int, gap_s: float
                   ) -> list[dict]:
    """`hostcosts.idle_handover_requests` served by the trial's own slice loops, the KV
    through `decode_slice`'s transport as the stream's (each finds the decode loop idle):
    per request `serve_prefill_slice`'s record merged with `serve_decode_slice`'s."""
    from workloads.serving import hostcosts   # lazy: as measure_before_stream
    from workloads.serving.slots import serve_prefill_slice   # lazy: imports JAX

    reqs = hostcosts.idle_handover_requests(input_len, output_len, gap_s)
    model = server.model.unpadded
    start_at = time.time() + gap_s
    decode_slice.begin(len(reqs), start_at)
    served, sent = serve_prefill_slice(
        server, reqs, lambda i: hostcosts.prompt_for(model, 9500 + i, input_len, 7), start_at,
        decode_slice.send)
    return merge_decoded(served, decode_slice.finish(sent))


def measured_step_times(deployment: Deployment, costs: dict, seed: int = 0):
    """StepTimes of a deployment from `measure_before_stream`'s costs: each prefill call the
    engine's measured prefill of its prompt length (the nearest measured length otherwise),
    each decode step the engine's measured decode call of the slot batch, the measured host
    costs on top (step, per prompt, before the first tokens, on an idle loop, per handover),
    each call scaled by a factor drawn from the closed loop's spread of durations (seeded),
    and a KV handover's bytes priced on the profile's link (the cost model's, as `sweeper
    serve` prices it: docs/serving.md "Serving host costs")."""
    from workloads.serving import hostcosts
    from workloads.serving.model import StepTimes, kv_link_bandwidth
    from workloads.costmodel import kv_bytes_per_token

    detail = costs["detail"]
    dec = detail.get("aggregated") or detail["decode"]
    by_len = {int(n): float(v) for n, v in costs["engine_prefill_by_len_s"].items()}
    step_s = float(hostcosts.engine_step_priced_s(dec))   # the step its host cost is on top of

    def prefill_s(batch: int, input_len: int) -> float:
        return by_len.get(input_len) or by_len[min(by_len, key=lambda n: abs(n - input_len))]

    if deployment.mode == "disaggregated":
        bandwidth, _ = kv_link_bandwidth(deployment)
        per_token = kv_bytes_per_token(deployment.model)
        kv_transfer_s = lambda input_len: per_token * input_len / bandwidth   # noqa: E731
    else:
        kv_transfer_s = lambda input_len: 0.0   # noqa: E731
    prefill_spread, step_spread = hostcosts.duration_spread(costs)
    return StepTimes(prefill_s, lambda slots, context: step_s, kv_transfer_s,
                     source=MEASURED_STEP_TIMES,
                     host_costs=HostCosts.from_measured(costs),
                     prefill_spread=prefill_spread, step_spread=step_spread, spread_seed=seed)


def check_described(trial: TrialConfig, deployment: Deployment) -> None:
    """ValueError when the serving model does not describe the trial's deployment: it pads
    heads as `pad_heads: auto` does (workloads/serving/model.py `run_model`), another padding
    is a model it does not describe."""
    model = run_model(deployment)
    if deployment.mode == "disaggregated":
        matches = trial.pad_heads == "auto"       # each slice padded for its own half
    else:
        matches = model == trial.run_model
    if not matches:
        raise ValueError(f"pad_heads={trial.pad_heads!r}: the serving model pads heads "
                         "as pad_heads auto does")


def predictable(trial: TrialConfig, hardware: HardwareProfile | None) -> bool:
    """Whether `predict_stream` can predict the trial with this profile (else its note says
    why): a trial that cannot be predicted measures nothing before its stream."""
    if hardware is None:
        return False
    try:
        check_described(trial, trial_deployment(trial, hardware))
    except ValueError:
        return False
    return True


def predict_stream(trial: TrialConfig, reqs: list[Request], hardware: HardwareProfile | None,
                   costs: dict | None = None) -> tuple[dict[str, float], dict]:
    """The serving model's prediction of the trial's stream (module docstring): the
    `pred_<metric>` values (NaN where it has none) and a note for `extra` (source, the
    profile, the step times, why there is no prediction). `costs`: the deployment's calls
    and host costs measured before the stream (`measure_before_stream`), its step times;
    None: the profile's (the cost model's, with the profile's host costs)."""
    values = dict.fromkeys(SERVING_PREDICTIONS, math.nan)
    if hardware is None:
        return values, {"source": None, "reason": "no hardware profile to price the deployment"}
    # the label says where the step times came from: the cost model's are `analytical`; the
    # calls measured before the stream are this host's measurements, never called analytical
    note = {"source": "analytical" if costs is None else "measured calls",
            "hardware": hardware.name}
    deployment = trial_deployment(trial, hardware)
    try:
        check_described(trial, deployment)
        times = measured_step_times(deployment, costs, trial.seed) if costs is not None else None
        result = simulate(deployment, reqs, times)
    except ValueError as err:     # ConfigError too: a layout the cost model cannot price
        return values, {**note, "source": None, "reason": str(err)}
    summary = result.summary()
    for name in SERVING_PREDICTIONS:
        values[name] = float(summary[name[len("pred_"):]])
    note.update(step_times=result.step_source, completed=summary["completed"],
                throughput_rps=summary["throughput_rps"])
    return values, note


def run_serving_trial(trial: TrialConfig, hardware: HardwareProfile | None = None,
                      decode_slice=None) -> Measurement:
    """Serve the trial's stream on this process's mesh; its metrics (module docstring).

    Disaggregated (`serving_mode`): this process runs the prefill slice on the first half of
    its devices; `decode_slice`, the caller's decode worker on the other half (another
    process: sweeper/sweep/meshworker.py `DecodeSlice`), answers `setup(spec, prompt_lens)`
    (build and warm up; its warm-up seconds), `begin(expected, start_at)` (start serving in
    the background), `send(handover)` (one call's KV caches, not waited for) and
    `finish(sent)` (wait for the sends and the decoding: per request `kv_ready_s`,
    `finish_s` and its decoded tokens); with a measured profile also, before the stream
    (`measure_before_stream`), `measure_loop(input_len, output_len, how)` (its closed loop,
    workloads/serving/hostcosts.py), `sink(handover)` and `wait(sent)` (the prefill closed loop's
    handovers, dropped), `receive(handover)` (one timed handover: a call that returns its
    `handover_receive` answer) and `cpu_seconds()`; and, where it offers them,
    `begin_beside()` (start stepping every slot back to back, workloads/serving/hostcosts.py
    `step_beside`; a token) and `end_beside(token)` (stop; the steps made): the prefill
    slice's closed loop then runs beside a stepping decode slice."""
    from workloads.hoststate import HostSampler
    from workloads.measure import hardware_label
    from workloads.model import prompt_tokens
    from workloads.serving.pipeline import slot_server
    from workloads.serving.slots import (SlotServer, SlotSpec, serve_aggregated, serve_prefill_slice,
                                         with_shared_prefix)

    if trial.hosts != 1:
        raise ValueError("a serving trial runs on one host (hosts: 1)")
    mode = trial.serving_mode
    if mode == "disaggregated" and decode_slice is None:
        raise ValueError("a disaggregated serving trial needs a decode worker")
    try:     # checked when the space was loaded; a trace may have gone since
        profile = trial_profile(trial)
        reqs = trial_requests(trial)
    except ConfigError as err:
        raise RuntimeError(f"the serving trial's request stream cannot be drawn: {err}") from None
    setup = time.perf_counter()
    lengths = sorted({r.input_len for r in reqs})
    # prefix caching (the block's prefix_len, prefix_hit): the shared prefix's KV computed
    # when the server is built, the prompts that hit it extended from it
    prefix_len = max((r.cached_len for r in reqs), default=0)
    warmup: dict = {}
    if mode == "disaggregated":
        prefill_spec, decode_spec = slice_specs(trial, context_len(reqs), prefix_len)
        server = SlotServer(prefill_spec)
        warmup["decode"] = decode_slice.setup(decode_spec, lengths)
    else:
        # chunked prefill (`prefill_chunk`) and pipeline stages (`stages`; the topology one
        # stage's mesh): the servers `sweeper serve` builds for a plan with them
        server = slot_server(SlotSpec(trial.model, tuple(trial.mesh_shape), trial.prefill,
                                      trial.decode, slots=trial.batch, prefill_batch=1,
                                      context_len=context_len(reqs), weights=trial.weights,
                                      seed=trial.seed, pad_heads=trial.pad_heads,
                                      chunk=trial.prefill_chunk, prefix_len=prefix_len),
                             trial.stages)
    for length in lengths:
        warmup[length] = server.warm_up(length)
    for length, cached_len in sorted({(r.input_len, r.cached_len) for r in reqs if r.cached_len}):
        warmup[f"{length}/{cached_len}"] = server.warm_up(length, cached_len=cached_len)
    model = server.model.unpadded
    compile_s = time.perf_counter() - setup
    # this host's profile: the deployment's calls and host costs measured now, before the
    # stream, on its own servers (the prediction's step times; never the stream's own calls)
    costs = (measure_before_stream(trial, server, reqs, decode_slice)
             if measures_before_stream(hardware) and predictable(trial, hardware) else None)

    def prompt(i: int):
        """Request i's prompt, made when it is prefilled (as `sweeper serve` makes it),
        starting with the shared prefix when it hits it."""
        tokens = prompt_tokens(model, 1, reqs[i].input_len, trial.seed * 1_000_003 + i)[0]
        return with_shared_prefix(model, tokens, reqs[i].cached_len, prefix_len)

    host = HostSampler().start()
    start_at = time.time() + START_MARGIN_S
    if mode == "disaggregated":
        # the decode worker waits for the same start; its handovers arrive through the
        # caller's transport (Ray), as `sweeper serve` hands them over (docs/serving.md)
        decode_slice.begin(sum(r.output_len > 1 for r in reqs), start_at)
        served, sent = serve_prefill_slice(server, [dataclasses.asdict(r) for r in reqs],
                                           prompt, start_at, decode_slice.send)
        merge_decoded(served, decode_slice.finish(sent))
    else:
        served = serve_aggregated(server, reqs, prompt, start_at)
    state = host.stop()
    wall_s = time.time() - start_at

    m = Measurement(source="measured", hardware=hardware_label())
    m.compile_s = compile_s
    m.measure_s = wall_s
    m.host_load_avg_1m, m.host_steal_frac = state.load_avg_1m, state.steal_frac
    m.host_busy_frac, m.host_involuntary_switches = state.busy_frac, state.involuntary_switches
    first = np.array([s.get("first_token_s", np.nan) for s in served], dtype=float)
    finish = np.array([s.get("finish_s", np.nan) for s in served], dtype=float)
    price = hardware.price_per_chip_hour if hardware is not None else None
    for key, value in summarize(reqs, first, finish, trial.chips, profile, price).items():
        setattr(m, key, value)
    predicted, note = predict_stream(trial, reqs, hardware, costs)
    for key, value in predicted.items():
        setattr(m, key, value)
    deployment = trial_deployment(trial, hardware) if hardware is not None else None
    m.extra["serving"] = {
        "requests": len(reqs), "offered_rps": offered_rps(reqs), "wall_s": wall_s,
        "deployment": mode, "slots": trial.batch, "prefill_batch": 1,
        "prefill_chunk": trial.prefill_chunk, "stages": trial.stages,
        "slices": ({phase: {"chips": getattr(deployment, phase).chips,
                            "topology": list(getattr(deployment, phase).topology)}
                    for phase in ("prefill", "decode")} if deployment is not None else None),
        "warmup": {str(k): v for k, v in warmup.items()}, "prediction": note,
        # the calls and host costs measured before the stream (this host's profile), the
        # prediction's step times: every number the measurement took (`measure_before_stream`)
        "measured_before_stream": costs,
        # per request: its times on the arrivals' clock and its tokens (the engine's
        # answer: tests/test_serving_trials.py compares them with the unsharded reference)
        "per_request": [{"arrival_s": r.arrival_s, "input_len": r.input_len,
                         "output_len": r.output_len, "cached_len": r.cached_len, **s}
                        for r, s in zip(reqs, served)]}
    return m


def summarize(reqs: list[Request], first_token_s: np.ndarray, finish_s: np.ndarray, chips: int,
              profile: AppProfile, price_per_chip_hour: float | None = None) -> dict[str, float]:
    """The serving metrics of one served stream (module docstring) over the requests that
    finished: the serving model's own definitions (`stream_summary`), as Measurement fields;
    `first_token_s`/`finish_s` in seconds on the arrivals' clock (NaN: not done)."""
    done = np.isfinite(finish_s) & np.isfinite(first_token_s)
    arrival = np.array([r.arrival_s for r in reqs], dtype=float)[done]
    output = np.array([r.output_len for r in reqs], dtype=float)[done]
    out = stream_summary(arrival, first_token_s[done], finish_s[done], output, chips,
                         price_per_chip_hour, profile)
    cost = out["cost_per_million_tokens"]
    return {**{k: out[k] for k in ("ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s",
                                   "slo_attainment", "goodput_rps", "throughput_rps",
                                   "tokens_per_s_per_chip")},
            "completed": float(out["completed"]),
            "cost_per_million_tokens": math.nan if cost is None else cost}
