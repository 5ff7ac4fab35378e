"""The serving model: a discrete-event simulation of a deployment serving a request stream.

    result = simulate(deployment, requests(profile, 500, seed=0), slo=profile)
    result.summary()   # ttft_p99_s, tpot_p99_s, goodput_rps, slo_attainment, ...

The engine it models (docs/serving.md "The serving model"), the same `sweeper serve` runs:
- a replica is one sequential loop of engine calls; decode runs a *fixed* slot batch every
  step (`decode.batch` slots, iteration-level batching: a slot is refilled as soon as its
  request finishes, as JetStream's slots and vLLM do), priced at the full slot batch;
- aggregated: a prefill call (`prefill.batch` prompts, priced at that shape: the engine pads
  a partial call) is inserted between two decode steps whenever prompts wait and slots are
  free; one prefill per decode step while requests decode, back to back when none do. The
  prefill produces the first token; the request then takes a slot;
- disaggregated: prefill slices run prefill calls back to back (FIFO); each request's KV
  cache (`kv_bytes_per_token x input_len`) then crosses the link between the slices, one
  transfer at a time per prefill slice, at `min(prefill chips, decode chips)` x the per-chip
  bandwidth (ICI inside one fast domain, `inter_domain_bandwidth` across domains). The
  prefill slice sends them itself before its next prefill call, as the server does (its loop
  exports and sends each request's KV, sequentially), so a handover delays the next
  prefill; the decode slice puts it into a free slot before its next step;
- host work (`HostCosts`, docs/serving.md "Serving host costs"): every decode step costs
  the engine's step plus `step_overhead_s` (the serving loop's per-step host work: the tokens'
  transfer, the argmax program, the sync, slot bookkeeping), every prefill call the engine's
  call plus `prefill_overhead_per_prompt_s` per prompt it takes (writing its rows into slots,
  or exporting their KV and submitting the handover), paid after the call's first tokens
  (the server has them on the host before that work); a KV handover (disaggregated) costs
  the decode slice's loop `handover_overhead_s` (the decode process's work per handover:
  receiving the KV, its insert into a slot), one handover at a time before its next step
  (server.py `serve_decode` inserts there); the KV reaches the decode loop
  `handover_latency_s` after the send (the transport, charged to neither loop) and
  an idle decode loop's first step takes `decode_wake_s` longer, and a prefill
  call on an idle loop takes at least `prefill_idle_after_s` per prompt after its
  first tokens (measured, 0 by default); all from the
  hardware profile, 0 by default; of a prefill call's host work, the part before its
  first tokens (`prefill_first_overhead_s`, per call: the prompts made and placed,
  the argmax, the first tokens to the host) delays them, the rest of the per-prompt cost
  comes after; a prefill call on an idle loop (nothing to do until its arrival) takes
  the wake more than the engine's call before its first token instead (the larger of
  the two; measured, 0 by default): `prefill_wake_s`, or where a short idle's wake was
  measured too, the wake after as long as the loop idled (HostCosts `wake_after`); and
  (aggregated, unchunked) the decode steps right after that call take
  `decode_wake_after(idle)` longer (measured, 0 by default: the first steps after an idle
  are slower too);
- optionally (`StepTimes.prefill_spread`, `step_spread`), each call's duration scaled by a
  factor of mean 1 drawn from a measured spread (seeded): the tails of interrupted calls;
- chunked prefill (aggregated, `prefill.chunk` > 0; Sarathi-Serve, vLLM): no whole-prompt
  prefill calls; each loop iteration runs one decode step of the busy slots and the next
  chunk of up to `chunk` tokens of the oldest waiting prompt, priced as a prefill of that
  many tokens on top of the prompt's earlier chunks (`StepTimes.prefill_call_s`); the prompt
  holds a slot from its first chunk, its first token comes with its last;
- prefix caching (`Request.cached_len`, the profile's `prefix_len`/`prefix_hit`): such a
  request's call prefills its `input_len - cached_len` remaining tokens on top of the cached
  ones (a call of several prompts: the longest uncached part, on the longest prompt's cache);
- pipeline stages (`PhaseSlice.stages` = S): a stage is priced as the cost model's call of
  a model of n_layers / S layers (the fullest stage) on the stage's chips; a decode step
  splits the slots into up to S micro-batches, each passing every stage in turn, so a step
  takes S x one stage's time at the micro-batch plus the S - 1 activation transfers
  (`stage_links`: the fast interconnect inside a domain, `inter_domain_bandwidth` across
  one); on an emulated mesh, whose staged server runs one micro-batch, the stages run one
  after another, each at the worker's whole share of the cores (`stage_hardware`); a
  prefill call goes through the stages as one micro-batch (its first tokens after
  S stage times and the transfers); a disaggregated prefill slice pipelines consecutive
  calls (`StepTimes.prefill_interval_s`: the next enters the first stage one stage time
  later), an aggregated replica's loop does not (a call holds it until its first tokens);
- requests go to replicas round-robin in arrival order (decode slices too, among the
  answers of more than one token: `decode_route`), so every replica is simulated on its own (fast, and a real router's choice is no worse);
- TTFT = first token - arrival; TPOT = (finish - first token) / (output_len - 1), as the
  serving tools report them (NaN for one-token answers).

Why a small event loop and not SimPy: each replica is one sequential engine loop whose
next event is always "the current call ends" or "the next request arrives", so the whole
simulation is a loop over engine calls with numpy slot arrays; SimPy's processes and
resources would add a dependency and per-event generator overhead (the planner simulates
hundreds of deployments per question) without modelling anything this loop cannot.

Step times come from the cost model (`workloads.costmodel.predict_phase`) with the
deployment's hardware profile, chips, layouts, weights and batch, unless the caller passes
its own `StepTimes` (measured step times, for example).
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from collections import deque
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Callable

import numpy as np

from workloads.config import HardwareProfile, ModelConfig
from workloads import costmodel
from workloads.costmodel import stage_layers, stage_model  # noqa: F401 (the serving model's)
from workloads.deployment import Deployment, PhaseSlice
from workloads.hardware import per_chip
from workloads.layouts import PhaseLayout, resolve_padding, stores_1d
from workloads.serving.costs import HostCosts
from workloads.serving.profile import AppProfile, Request


# --------------------------------------------------------------------------- step times

# The decode contexts a cost model's step time is evaluated at (its multiples), linear between
# (`cost_model_step_times`): fine enough to follow a host model's kink where the KV outgrows
# the cache, coarse enough that a stream's contexts need a few dozen predictions per batch.
CONTEXT_GRID = 64


@dataclass
class StepTimes:
    """Seconds per engine call. prefill_s(prompts, input_len) is one prefill call of that
    shape; decode_step_s(slots, context) one decode step of the slot batch whose requests
    hold `context` tokens on average; kv_transfer_s(input_len) one request's KV handover
    (disaggregated)."""

    prefill_s: Callable[[int, int], float]
    decode_step_s: Callable[[int, float], float]
    kv_transfer_s: Callable[[int], float] = lambda input_len: 0.0
    source: str = "custom"
    # Optional: (slots, low, high) -> (a, b), the step time's secant over the contexts low
    # to high (decode_step_s(slots, c) ~ a + b * c there), so a run of steps is summed in
    # closed form (the cost model's step time is piecewise linear in the context).
    decode_affine: Callable[[int, float, float], tuple[float, float]] | None = None
    # The serving loop's host costs (module docstring; workloads/serving/costs.py), charged
    # on top of the calls above; none by default.
    host_costs: HostCosts = field(default_factory=HostCosts)
    # Optional: the spread of the calls' durations, as factors of mean 1 (measured durations
    # over their mean): each prefill call (with its host work) and each decode step (with
    # its host work) is scaled by one factor drawn at random (seeded by `spread_seed`). A
    # constant duration cannot give the p99s of a host whose calls other processes
    # sometimes interrupt (docs/serving.md "Checking the model against the server").
    prefill_spread: tuple[float, ...] = ()
    step_spread: tuple[float, ...] = ()
    spread_seed: int = 0
    # Optional: (prompts, tokens, offset) -> one prefill call of `tokens` new tokens per
    # prompt on top of `offset` tokens whose KV cache is already there (a cached prefix, a
    # chunked prompt's earlier chunks), attending to them. None: priced as a prefill of
    # the new tokens alone (`prefill_s(prompts, tokens)`).
    prefill_at_s: Callable[[int, int, int], float] | None = None
    # Optional, a pipelined (staged) prefill slice: (prompts, tokens, offset) -> seconds from
    # a call's start until the next call may enter the first stage (one stage's time and
    # its transfer out), the call's own first tokens still `prefill_call_s` after its start.
    # None: a call holds the loop until its first tokens (one stage, or not pipelined).
    prefill_interval_s: Callable[[int, int, int], float] | None = None

    def prefill_call_s(self, prompts: int, tokens: int, offset: int = 0) -> float:
        """One prefill call of `tokens` new tokens per prompt after `offset` cached ones."""
        if offset == 0 or self.prefill_at_s is None:
            return self.prefill_s(prompts, tokens)
        return self.prefill_at_s(prompts, tokens, offset)

    def prefill_host_s(self, prompts: int, idle: float, factor: float = 1.0) -> tuple[float, float]:
        """A prefill call's host work: (before its first tokens, after them), seconds, after
        the loop idled `idle` seconds (0: it was busy; inf: since the start). Before:
        `prefill_first_overhead_s`, or on an idle loop the wake after that idle if larger;
        after: the rest of the per-prompt cost, on an idle loop at least
        `prefill_idle_after_s` per prompt, scaled by the call's duration factor."""
        host = self.host_costs
        first = host.prefill_first_overhead_s
        before = max(host.wake_after(idle), first) if idle else first
        after = max(prompts * host.prefill_overhead_per_prompt_s - first, 0.0)
        if idle:
            after = max(after, prompts * host.prefill_idle_after_s)
        return before, after * factor

    def spread_draws(self) -> tuple[Callable[[], float], Callable[[], float]]:
        """(prefill factor, step factor) draws; 1.0 without a spread."""
        rng = np.random.default_rng(self.spread_seed)

        def draw(factors):
            if not factors:
                return lambda: 1.0
            values = np.asarray(factors, dtype=float)
            return lambda: float(values[rng.integers(len(values))])

        return draw(self.prefill_spread), draw(self.step_spread)


def run_model(deployment: Deployment):
    """The model as run: query heads padded for the layouts (paper §4, layouts.resolve_padding),
    over one pipeline stage's mesh (the whole slice's without stages)."""
    d = deployment
    pre, dec = PhaseLayout(d.prefill.ffn, d.prefill.attn), PhaseLayout(d.decode.ffn, d.decode.attn)
    topology = d.decode.topology or costmodel.best_topology(d.model.unpadded, d.decode.stage_chips)
    if d.mode == "aggregated":
        return resolve_padding(d.model, "auto", topology, pre, dec)
    pre_topology = d.prefill.topology or costmodel.best_topology(d.model.unpadded,
                                                                 d.prefill.stage_chips)
    return (resolve_padding(d.model, "auto", pre_topology, pre, pre),
            resolve_padding(d.model, "auto", topology, dec, dec))


# --------------------------------------------------------------------------- pipeline stages


# stage_layers, stage_model: in workloads/costmodel.py (its one_stage prices a staged trial)


def micro_batch(batch: int, stages: int, hardware: HardwareProfile | None = None) -> int:
    """Sequences per micro-batch: a call's batch split into up to `stages` micro-batches so
    the stages work on different ones at once (GPipe-style; vLLM's virtual engines). On an
    emulated mesh (a measured host profile) the staged slot server runs one micro-batch
    (workloads/serving/pipeline.py `StagedSlotServer`: more were measured slower there), so
    the whole batch."""
    if hardware is not None and hardware.measured:
        return batch
    return -(-batch // min(stages, batch))


def stage_hardware(hardware: HardwareProfile, stage_chips: int, stages: int) -> HardwareProfile:
    """The per-chip profile of one pipeline stage of `stage_chips` chips. Memory: every
    stage's chips hold their layers at once, so a measured host's memory is split over all
    of them. Rates: on an emulated mesh the stages run one after another (one micro-batch,
    `micro_batch`), so a stage's chips share the worker's cores with no other stage's; real
    chips are their own (`per_chip` leaves them whole)."""
    rates = per_chip(hardware, stage_chips)
    if stages == 1 or not hardware.measured:
        return rates
    return dataclasses.replace(rates, hbm_bytes=per_chip(hardware, stage_chips * stages).hbm_bytes)


def stage_links(hardware: HardwareProfile, stage_chips: int, stages: int) -> list[tuple[float, str]]:
    """Per chip, the bandwidth of each stage boundary (stages - 1 of them) and its link: each
    chip sends the activations to its peer in the next stage, over the fast interconnect
    inside a domain (an 8-GPU NVLink node) and `inter_domain_bandwidth` where the boundary
    crosses one (stage k's chips are [k * stage_chips, (k + 1) * stage_chips) of the slice,
    the slice starting a domain)."""
    domain = hardware.domain_chips
    out = []
    for boundary in range(1, stages):
        first_next = boundary * stage_chips
        crosses = domain > 0 and (stage_chips >= domain or first_next % domain == 0
                                  or (first_next - 1) // domain != first_next // domain)
        if not crosses:
            out.append((hardware.ici_bandwidth, "fast interconnect"))
        elif hardware.inter_domain_bandwidth > 0:
            out.append((hardware.inter_domain_bandwidth, "between domains"))
        else:
            out.append((hardware.ici_bandwidth, "between domains (bandwidth unknown: ICI assumed)"))
    return out


def transfer_s(model: ModelConfig, hardware: HardwareProfile, stage_chips: int, stages: int,
               tokens: int) -> float:
    """Seconds of the inter-stage transfers of one micro-batch of `tokens` tokens through a
    pipeline: its activations (tokens x d_model, bf16) over each boundary in turn (0 for
    one stage)."""
    size = tokens * model.d_model * costmodel.BF16
    return sum(size / bandwidth for bandwidth, _ in stage_links(hardware, stage_chips, stages))


def stage_transfer_s(deployment: Deployment, part: PhaseSlice, tokens: int) -> float:
    """`transfer_s` of a slice of this deployment."""
    return transfer_s(deployment.model, deployment.hardware, part.stage_chips, part.stages, tokens)


def pipelined_s(stage_s: float, transfer_s: float, stages: int) -> float:
    """A micro-batch's time through the pipeline: every stage in turn and the transfers
    between them. In a decode step each of the up to `stages` micro-batches takes this, the
    stages busy with the others meanwhile (steady state: the step time of one stage holding
    all the slots, the bubble where fewer micro-batches than stages); one stage: its time."""
    return stages * stage_s + transfer_s


def phase_prediction(deployment: Deployment, phase: str, batch: int, input_len: int,
                     context: float | None = None) -> costmodel.PhasePrediction:
    """The cost model's prediction of one call of `phase` in this deployment; with pipeline
    stages, of one stage (its layers, its chips, `batch` sequences)."""
    d = deployment
    part: PhaseSlice = d.prefill if phase == "prefill" else d.decode
    models = run_model(d)
    if d.mode == "aggregated":
        model, one_d = models, stores_1d(PhaseLayout(d.prefill.ffn, d.prefill.attn),
                                         PhaseLayout(d.decode.ffn, d.decode.attn))
    else:
        model, one_d = models[0 if phase == "prefill" else 1], part.ffn == "ws1d"
    hw = stage_hardware(d.hardware, part.stage_chips, part.stages)
    # one pipeline stage: its layers on its chips (the whole model and slice without stages)
    return costmodel.predict_phase(stage_model(model, part.stages), hw, part.stage_chips, batch,
                                   phase, input_len, context,
                                   PhaseLayout(part.ffn, part.attn), part.weights,
                                   part.topology, one_d, experts=part.experts,
                                   kv_cache=part.kv_cache)


def memory_budget(deployment: Deployment, input_len: int, context: int,
                  prefix_len: int = 0) -> dict:
    """Per chip of each slice (aggregated: the replica's): HBM, the hardware's reserve
    (HardwareProfile.memory_reserve), the weights, the working set (aggregated: decode's and
    prefill's, both live), the KV cache of every slot at `context` tokens (a prefill slice:
    one call's prompts of `input_len`), what is left, and the KV capacity: tokens of KV cache
    (over all the slice's sequences) that fit beside the weights and working set (issue 39).
    With pipeline stages, of a chip of the fullest stage: its layers' weights on its chips
    (weights / chips, plus the embeddings every stage is charged), the KV cache of its layers
    for every slot. `prefix_len` > 0 (prefix caching): `prefix_kv_bytes`, one copy of the
    shared prefix's KV per slice (disaggregated: of either phase), beside the slots' caches,
    which hold their own copy of it (an upper bound)."""
    d = deployment
    phases = {"replica": "decode"} if d.mode == "aggregated" else {"prefill": "prefill",
                                                                   "decode": "decode"}
    out = {}
    for name, phase in phases.items():
        part = d.prefill if phase == "prefill" else d.decode
        pred = (phase_prediction(d, "prefill", part.batch, input_len) if phase == "prefill"
                else phase_prediction(d, "decode", part.batch, 1, context))
        working = pred.working_set_bytes_per_chip
        if d.mode == "aggregated":    # a prefill call's working set beside the slots' cache
            working += phase_prediction(d, "prefill", d.prefill.batch,
                                        input_len).working_set_bytes_per_chip
        hw = per_chip(d.hardware, part.chips)
        tokens = part.batch * (input_len if phase == "prefill" else context)
        per_token = pred.kv_bytes_per_chip / tokens
        room = hw.usable_hbm_bytes - pred.weight_bytes_per_chip - working
        prefix = per_token * prefix_len
        room -= prefix
        out[name] = {"chips": part.chips, "hbm_bytes": hw.hbm_bytes,
                     "reserve_bytes": hw.hbm_bytes - hw.usable_hbm_bytes,
                     "weights_bytes": pred.weight_bytes_per_chip, "working_bytes": working,
                     "kv_bytes": pred.kv_bytes_per_chip, "kv_tokens": tokens,
                     "free_bytes": room - pred.kv_bytes_per_chip,
                     "kv_bytes_per_token": per_token,
                     "kv_capacity_tokens": max(int(room // per_token), 0) if per_token else None}
        if part.stages > 1:
            out[name]["stages"] = part.stages
        if prefix_len:
            out[name]["prefix_kv_bytes"] = prefix
    return out


def kv_link_bandwidth(deployment: Deployment) -> tuple[float, str]:
    """Bytes/s one request's KV cache crosses from a prefill to a decode slice, and the link."""
    d = deployment
    hw = d.hardware
    lanes = min(d.prefill.chips, d.decode.chips)    # each chip sends its own shard
    total = d.prefill.chips_total + d.decode.chips_total
    if hw.domain_chips == 0 or total <= hw.domain_chips:
        return lanes * hw.ici_bandwidth, "fast interconnect (one domain)"
    if hw.inter_domain_bandwidth > 0:
        return lanes * hw.inter_domain_bandwidth, "between domains"
    return lanes * hw.ici_bandwidth, "between domains (bandwidth unknown: ICI assumed)"


def cost_model_step_times(deployment: Deployment) -> StepTimes:
    """StepTimes from the analytical cost model (see the module docstring).

    Prefill lengths are rounded up to a multiple of 64 tokens above 64 (engines pad prompts
    to length buckets; it also bounds the calls). A decode step is predicted exactly at
    contexts `CONTEXT_GRID` apart and interpolated linearly between them. The analytical
    model's terms are affine in the context (the KV read, the attention FLOPs); a host
    model's are not where the KV pushes the bytes a step reads past the worker's cache (its
    DRAM terms start there), so a line through two far contexts misprices a short stream's
    steps (2.6x too fast on one calibrated host's 2-slot step). An analytical profile's line
    goes through contexts 1024 and 2048."""
    d = deployment

    def padded(tokens: int) -> int:
        return tokens if tokens <= 64 else -(-tokens // 64) * 64

    @lru_cache(maxsize=None)
    def prefill_at_s(batch: int, tokens: int, offset: int) -> float:
        """With stages: the call's prompts through every stage in turn (one micro-batch),
        so its first tokens come after all of them and the transfers between them."""
        new = padded(tokens)
        stage = phase_prediction(d, "prefill", batch, new,
                                 None if offset == 0 else offset + new).latency_s
        if d.prefill.stages == 1:
            return stage
        return pipelined_s(stage, stage_transfer_s(d, d.prefill, batch * new), d.prefill.stages)

    def prefill_s(batch: int, input_len: int) -> float:
        return prefill_at_s(batch, input_len, 0)

    @lru_cache(maxsize=None)
    def prefill_interval_s(batch: int, tokens: int, offset: int) -> float:
        """The first stage's time and its slowest boundary's transfer: after that the next
        call may enter the pipeline (the stages work on consecutive calls at once)."""
        new = padded(tokens)
        stage = phase_prediction(d, "prefill", batch, new,
                                 None if offset == 0 else offset + new).latency_s
        size = batch * new * d.model.d_model * costmodel.BF16
        return stage + max(size / bandwidth for bandwidth, _ in stage_links(
            d.hardware, d.prefill.stage_chips, d.prefill.stages))

    @lru_cache(maxsize=None)
    def decode_at(batch: int, context: int) -> float:
        """With stages: the slots in up to `stages` micro-batches, each through every stage
        (module docstring, pipeline stages)."""
        stages = d.decode.stages
        if stages == 1:
            return phase_prediction(d, "decode", batch, 1, context).latency_s
        micro = micro_batch(batch, stages, d.hardware)
        stage = phase_prediction(d, "decode", micro, 1, context).latency_s
        return pipelined_s(stage, stage_transfer_s(d, d.decode, micro), stages)

    if d.hardware.host_model:
        def interval(context: float) -> tuple[int, int]:
            """The two grid contexts around `context` (the first is at least 1)."""
            k = max(int(context // CONTEXT_GRID), 0)
            return max(k * CONTEXT_GRID, 1), (k + 1) * CONTEXT_GRID

        def decode_step_s(batch: int, context: float) -> float:
            low, high = interval(context)
            at_low = decode_at(batch, low)
            return at_low + (decode_at(batch, high) - at_low) * (context - low) / (high - low)

        def decode_affine(batch: int, low: float, high: float) -> tuple[float, float]:
            """The secant of `decode_step_s` from context `low` to `high` (where they are
            one context, the slope of its grid interval)."""
            if high - low < 1.0:
                low, high = interval(low)
            at_low = decode_step_s(batch, low)
            slope = (decode_step_s(batch, high) - at_low) / (high - low)
            return at_low - slope * low, slope
    else:
        # the analytical model is affine in the context: one line through two is exact
        @lru_cache(maxsize=None)
        def line(batch: int) -> tuple[float, float]:
            """The step time, a + b x context."""
            at_low = decode_at(batch, 1024)
            slope = (decode_at(batch, 2048) - at_low) / 1024
            return at_low - slope * 1024, slope

        def decode_step_s(batch: int, context: float) -> float:
            intercept, slope = line(batch)
            return intercept + slope * context

        def decode_affine(batch: int, low: float, high: float) -> tuple[float, float]:
            return line(batch)

    bandwidth, _ = kv_link_bandwidth(d)
    per_token = costmodel.kv_bytes_per_token(d.model, kv_cache=d.decode.kv_cache)

    def kv_transfer_s(input_len: int) -> float:
        return per_token * input_len / bandwidth

    return StepTimes(prefill_s, decode_step_s, kv_transfer_s, source=costmodel.SOURCE,
                     decode_affine=decode_affine, prefill_at_s=prefill_at_s,
                     prefill_interval_s=prefill_interval_s if d.prefill.stages > 1 else None,
                     host_costs=host_costs_for(d))


def prefill_weight_bytes(deployment: Deployment) -> float:
    """The weight bytes a prefill call of the deployment reads: its slice's, all its chips."""
    part = deployment.prefill
    return costmodel.weight_bytes_per_chip(deployment.model, part.chips, part.weights) * part.chips


def host_costs_for(deployment: Deployment) -> HostCosts:
    """The profile's serving host costs for this deployment (a disaggregated one's prefill
    wake its slice loop's where measured, HostCosts `for_mode`). On a calibrated host whose
    `prefill_wake_s` records the weights it was measured with, the wake moves by the DRAM
    time of the difference: after an idle gap a call finds the weights a warm one kept in
    the worker's cache gone, and streams them again (up to the cache). At the DECODE
    phase's `dram_weights` cost per element: what a call pays per weight streamed when no
    work hides it (a memory-bound step's), not a prefill's (a warm prefill streams only
    what outgrew the cache, behind its matmuls). Measured on this host, 0.1 s idle gaps, one
    run each: a 2.4M-parameter probe's wake 2.9 ms, a 12M one's 5.3 ms, a 16M one's 6.3 ms
    (docs/serving-model.md "Serving host costs"); the prefill phase's cost moved the probe's
    wake by 0.6 ms where served streams of two drawn models past the cache paid 3.7 and 5 ms
    more (development: spent blind seeds). The short idle's wake moves by its share of the
    long one's, and stays at most the long one's."""
    from workloads import hostmodel

    hw, part = deployment.hardware, deployment.prefill
    costs = hw.host_costs.for_mode(deployment.mode)     # a prefill slice's own wake
    if not (hw.host_model and costs.prefill_wake_weight_bytes > 0 and costs.prefill_wake_s > 0):
        return costs
    host = hostmodel.HostModel.from_dict(hw.host_model)
    share = hw.host_share * part.chips            # as costmodel.predict_phase prices the call
    cache = host.cache_for(share, part.chips)
    cold = min(prefill_weight_bytes(deployment), cache) - min(costs.prefill_wake_weight_bytes, cache)
    counts = {term: 0.0 for term in hostmodel.TERMS}
    counts["dram_weights"] = cold / costmodel.BF16            # bf16 elements, as host_counts
    cold_s = sum(host.term_seconds(counts, "decode", share, part.chips).values())
    wake = max(costs.prefill_wake_s + cold_s, 0.0)
    # the short idle's wake moves by the same share of the cold weights as its wake is of
    # the long one's (benchmarks/idle_wake.py: it grew with the weights too)
    short = costs.prefill_wake_short_s * (1.0 + cold_s / costs.prefill_wake_s)
    return dataclasses.replace(costs, prefill_wake_s=wake,
                               prefill_wake_short_s=min(max(short, 0.0), wake))


# --------------------------------------------------------------------------- result


def statistic(values: np.ndarray, stat: str) -> float:
    """'mean' or 'pNN' of the finite values (NaN when there are none)."""
    finite = values[np.isfinite(values)]
    if finite.size == 0:
        return float("nan")
    if stat == "mean":
        return float(finite.mean())
    return float(np.percentile(finite, float(stat[1:])))


def tpot_of(first_token_s: np.ndarray, finish_s: np.ndarray, output_len: np.ndarray) -> np.ndarray:
    """Per request: (finish - first token) / (output tokens - 1); NaN for a one-token answer."""
    steps = output_len - 1
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(steps > 0, (finish_s - first_token_s) / np.maximum(steps, 1), np.nan)


def goodput_rps(meets: np.ndarray, span_s: float) -> float:
    """Completed requests meeting the SLO per second, over the span `throughput_rps` divides
    by (first arrival to last finish), so goodput <= throughput always (docs/serving.md;
    issue 39: goodput was attainment x the offered rate, which overtook the throughput of a
    deployment that falls behind)."""
    return float(np.count_nonzero(meets)) / span_s if span_s > 0 else float("nan")


def meets_slo(ttft_s: np.ndarray, tpot_s: np.ndarray, profile: AppProfile) -> np.ndarray:
    """Per request: TTFT and TPOT both within the SLO targets (a one-token answer has no TPOT)."""
    return (ttft_s <= profile.ttft) & (np.isnan(tpot_s) | (tpot_s <= profile.tpot))


@dataclass
class SimResult:
    """Per-request times of one simulated run (arrays in request order)."""

    deployment: Deployment
    arrival_s: np.ndarray
    first_token_s: np.ndarray
    finish_s: np.ndarray
    output_len: np.ndarray
    slo: AppProfile | None = None
    prefill_busy_s: float = 0.0        # summed over prefill engines (aggregated: prefill calls)
    decode_busy_s: float = 0.0
    kv_transfer_s: np.ndarray = field(default_factory=lambda: np.zeros(0))
    step_source: str = "analytical"

    @property
    def ttft_s(self) -> np.ndarray:
        return self.first_token_s - self.arrival_s

    @property
    def tpot_s(self) -> np.ndarray:
        return tpot_of(self.first_token_s, self.finish_s, self.output_len)

    def meets_slo(self, profile: AppProfile) -> np.ndarray:
        return meets_slo(self.ttft_s, self.tpot_s, profile)

    def summary(self, profile: AppProfile | None = None) -> dict:
        return stream_summary(self.arrival_s, self.first_token_s, self.finish_s,
                              self.output_len, self.deployment.chips_total,
                              self.deployment.hardware.price_per_chip_hour,
                              profile or self.slo, step_source=self.step_source)


def stream_summary(arrival_s: np.ndarray, first_token_s: np.ndarray, finish_s: np.ndarray,
                   output_len: np.ndarray, chips: int, price_per_chip_hour: float | None,
                   profile: AppProfile | None, step_source: str = "analytical") -> dict:
    """The serving metrics of a stream's finished requests (arrays in request order, seconds
    on the arrivals' clock): a simulated run's (`SimResult.summary`) and a served one's
    (workloads/serving/trial.py), one definition (docs/serving.md)."""
    n = len(arrival_s)
    ttft = first_token_s - arrival_s
    tpot = tpot_of(first_token_s, finish_s, output_len)
    span = float(finish_s.max() - arrival_s.min()) if n else float("nan")
    tokens = float(output_len.sum())
    tokens_per_s = tokens / span if span > 0 else float("nan")
    out = {
        "ttft_p50_s": statistic(ttft, "p50"), "ttft_p90_s": statistic(ttft, "p90"),
        "ttft_p99_s": statistic(ttft, "p99"), "ttft_mean_s": statistic(ttft, "mean"),
        "tpot_p50_s": statistic(tpot, "p50"), "tpot_p90_s": statistic(tpot, "p90"),
        "tpot_p99_s": statistic(tpot, "p99"), "tpot_mean_s": statistic(tpot, "mean"),
        "completed": n,
        "throughput_rps": n / span if span > 0 else float("nan"),   # drain included
        "tokens_per_s_per_chip": tokens_per_s / chips,
        "cost_per_million_tokens": (price_per_chip_hour * chips / 3600.0 / tokens_per_s * 1e6
                                    if price_per_chip_hour is not None and tokens_per_s > 0
                                    else None),
        "chips_total": chips,
        "span_s": span,
        "step_times": step_source,
    }
    arrivals = float(arrival_s.max() - arrival_s.min()) if n else 0.0
    # the stream's rate: (n - 1) / arrival span (a burst at one instant has none)
    out["offered_rps"] = (n - 1) / arrivals if arrivals > 0 else None
    if profile is not None:
        ok = meets_slo(ttft, tpot, profile)
        out["slo_attainment"] = float(ok.mean()) if n else float("nan")
        out["goodput_rps"] = goodput_rps(ok, span)
        out["ttft_slo_stat_s"] = statistic(ttft, profile.ttft_statistic)
        out["tpot_slo_stat_s"] = statistic(tpot, profile.tpot_statistic)
    else:
        out["slo_attainment"] = None
        out["goodput_rps"] = out["throughput_rps"]
    return out


# --------------------------------------------------------------------------- the event loop


class _Slots:
    """A replica's decode slots. Each busy slot finishes at a known step count, so the
    slots are a heap of (finishing step, request) and the contexts a running sum: every
    event is O(log slots) in plain Python (no array work per decode step)."""

    def __init__(self, slots: int):
        self.size = slots
        self.steps = 0                     # decode steps run so far
        self.heap: list[tuple[int, int, int]] = []   # (finishing step, request, context then)
        self.context_sum = 0               # of the busy slots, now

    @property
    def active(self) -> int:
        return len(self.heap)

    @property
    def free(self) -> int:
        return self.size - len(self.heap)

    def insert(self, request: int, remaining: int, context: int) -> None:
        heapq.heappush(self.heap, (self.steps + remaining, request, context + remaining))
        self.context_sum += context

    def mean_context(self) -> float:
        return self.context_sum / len(self.heap)

    def min_remaining(self) -> int:
        return self.heap[0][0] - self.steps

    def advance(self, steps: int) -> list[int]:
        """`steps` decode steps (none may outlast a slot); the requests that finished."""
        self.steps += steps
        self.context_sum += steps * len(self.heap)
        finished = []
        while self.heap and self.heap[0][0] == self.steps:
            _, request, context = heapq.heappop(self.heap)
            self.context_sum -= context
            finished.append(request)
        return finished


def _decode_run(slots: _Slots, times: StepTimes, batch: int, t: float, until: float,
                step_factor: Callable[[], float] | None = None) -> tuple:
    """Decode steps from time t until a slot frees or a step ends at or after `until` (the
    next event that could change the batch): (end time, steps, busy seconds, finished).
    With an affine step time (the cost model's) and no spread the run is summed in closed
    form. Each step costs the engine's step plus the serving loop's host work
    (`step_overhead_s`), times a drawn factor when the step times have a spread."""
    context = slots.mean_context()
    overhead = times.host_costs.step_overhead_s
    most = slots.min_remaining()
    start = t
    affine = (times.decode_affine(batch, context, context + most - 1)
              if times.decode_affine and not times.step_spread else None)
    if affine is not None:
        a, b = affine          # step k (0-based) takes a + b * (context + k)
        first = a + overhead + b * context

        def elapsed(k: int) -> float:
            return k * first + b * k * (k - 1) / 2

        steps = most
        if until - t < elapsed(most):        # the first k whose end reaches `until`
            low, high = 1, most
            while low < high:
                mid = (low + high) // 2
                if t + elapsed(mid) >= until:
                    high = mid
                else:
                    low = mid + 1
            steps = low
        t += elapsed(steps)
    else:
        steps = 0
        for steps in range(1, most + 1):
            step = times.decode_step_s(batch, context + steps - 1) + overhead
            t += step * step_factor() if step_factor is not None else step
            if t >= until:
                break
    return t, steps, t - start, slots.advance(steps)


def _prefill_call_s(times: StepTimes, prompts: int, reqs: list[Request], take: list[int]) -> float:
    """One prefill call of the requests `take`, priced at `prompts` prompts (the engine pads a
    partial call) of the longest uncached part among them, on top of what the longest prompt
    has cached (prefix caching: a request's first `cached_len` tokens are not prefilled)."""
    longest = max(reqs[i].input_len for i in take)
    new = max(reqs[i].input_len - reqs[i].cached_len for i in take)
    return times.prefill_call_s(prompts, new, longest - new)


def _priced_prefill(times: StepTimes, prompts: int, reqs: list[Request], take: list[int],
                    idle: float, factor: float) -> tuple[float, float]:
    """(until the first tokens, until the loop is free) of one prefill call of `take`, the
    loop idle `idle` seconds before it (`StepTimes.prefill_host_s`): the
    call (`_prefill_call_s`) scaled by its spread `factor`, with the host's work before the
    first tokens (and the idle loop's wake) and after them (`StepTimes.prefill_host_s`)."""
    before, after = times.prefill_host_s(len(take), idle, factor)
    call = _prefill_call_s(times, prompts, reqs, take) * factor + before
    return call, call + after


def _chunked_replica(d: Deployment, reqs: list[Request], ids: list[int], times: StepTimes,
                     first: np.ndarray, finish: np.ndarray) -> tuple[float, float]:
    """An aggregated replica with chunked prefill (Sarathi-Serve, vLLM): each iteration runs
    one decode step of the busy slots and the next chunk of up to `prefill.chunk` tokens of
    the oldest waiting prompt, priced as a prefill of the chunk on top of the prompt's
    earlier chunks (and its cached prefix). The prompt holds a free slot from its first
    chunk; its first token comes at the end of its last chunk's iteration, and it decodes
    from the next. No prompt waiting or no slot free: decode steps alone, as unchunked."""
    slots = _Slots(d.decode.batch)
    waiting: deque[int] = deque()
    pending = deque(ids)
    prefill_factor, step_factor = times.spread_draws()
    t, prefill_busy, decode_busy = 0.0, 0.0, 0.0
    current: list[int] | None = None        # [request, its tokens whose KV is there]
    idle = math.inf                         # seconds the loop idled (since the start)
    while pending or waiting or current is not None or slots.active:
        while pending and reqs[pending[0]].arrival_s <= t:
            waiting.append(pending.popleft())
        if current is None and waiting and slots.free:
            i = waiting.popleft()
            current = [i, reqs[i].cached_len]
        if current is None:
            if not slots.active:
                idle, t = _idle_until(t, reqs[pending[0]].arrival_s, idle)
                continue
            until = reqs[pending[0]].arrival_s if (slots.free and pending) else math.inf
            t, _, duration, finished = _decode_run(slots, times, d.decode.batch, t, until,
                                                   step_factor)
            decode_busy += duration
            finish[finished] = t
            continue
        i, done = current
        size = min(d.prefill.chunk, reqs[i].input_len - done)
        last = done + size >= reqs[i].input_len
        chunk_s = times.prefill_call_s(1, size, done)
        if slots.active:
            factor = step_factor()
            step_s = (times.decode_step_s(d.decode.batch, slots.mean_context())
                      + times.host_costs.step_overhead_s) * factor
        else:
            factor, step_s = prefill_factor(), times.host_costs.step_overhead_s
        before, after = times.prefill_host_s(1, idle, factor) if last else (0.0, 0.0)
        idle = 0.0
        t += step_s + chunk_s * factor + before
        decode_busy += step_s
        prefill_busy += chunk_s * factor + before + after
        if slots.active:
            finish[slots.advance(1)] = t
        if not last:
            current[1] += size
            continue
        first[i] = t
        t += after
        current = None
        if reqs[i].output_len <= 1:
            finish[i] = first[i]
        else:
            slots.insert(i, reqs[i].output_len - 1, reqs[i].input_len + 1)
    return prefill_busy, decode_busy


def _aggregated_replica(d: Deployment, reqs: list[Request], ids: list[int], times: StepTimes,
                        first: np.ndarray, finish: np.ndarray) -> tuple[float, float]:
    if d.prefill.chunk:
        return _chunked_replica(d, reqs, ids, times, first, finish)
    slots = _Slots(d.decode.batch)
    waiting: deque[int] = deque()
    pending = deque(ids)               # in arrival order
    prefill_factor, step_factor = times.spread_draws()
    t, prefill_busy, decode_busy = 0.0, 0.0, 0.0
    prefilled_since_step = False
    idle = math.inf                    # seconds the loop had nothing to do (since the start)
    decode_wake = 0.0                  # what the next decode steps pay after an idle prefill
    while pending or waiting or slots.active:
        while pending and reqs[pending[0]].arrival_s <= t:
            waiting.append(pending.popleft())
        if not waiting and not slots.active:
            idle, t = _idle_until(t, reqs[pending[0]].arrival_s, idle)
            continue
        if waiting and slots.free and not (prefilled_since_step and slots.active):
            take = [waiting.popleft() for _ in range(min(len(waiting), d.prefill.batch, slots.free))]
            call, duration = _priced_prefill(times, d.prefill.batch, reqs, take, idle,
                                             prefill_factor())
            first[take] = t + call       # the first tokens, before their rows go into slots
            t += duration
            prefill_busy += duration
            for i in take:
                if reqs[i].output_len <= 1:
                    finish[i] = first[i]
                else:
                    slots.insert(i, reqs[i].output_len - 1, reqs[i].input_len + 1)
            # after an idle loop's call its rows' first steps are slower too
            decode_wake = times.host_costs.decode_wake_after(idle) if idle and slots.active else 0.0
            idle = 0.0
            prefilled_since_step = True
            continue
        # decode until a slot frees, or (with slots free) until the next prompt may be inserted
        if waiting and slots.free:
            until = t            # one step, then the waiting prompt's prefill
        elif slots.free and pending:
            until = reqs[pending[0]].arrival_s
        else:
            until = math.inf
        t += decode_wake                 # the first steps after an idle loop's prefill
        decode_busy += decode_wake
        decode_wake = 0.0
        t, _, duration, finished = _decode_run(slots, times, d.decode.batch, t, until, step_factor)
        decode_busy += duration
        finish[finished] = t
        prefilled_since_step = False
    return prefill_busy, decode_busy


def _prefill_slice(d: Deployment, reqs: list[Request], ids: list[int], times: StepTimes,
                   first: np.ndarray, ready: np.ndarray, transfer: np.ndarray) -> float:
    """Prefill calls back to back in arrival order, each followed by its requests' KV
    transfers one at a time, sent by the prefill slice before its next call (server.py
    `serve_prefill`: the export and send are in the prefill loop). A pipelined slice
    (`StepTimes.prefill_interval_s`, stages): `_pipelined_prefill_slice`."""
    if times.prefill_interval_s is not None:
        return _pipelined_prefill_slice(d, reqs, ids, times, first, ready, transfer)
    t, busy = 0.0, 0.0
    queue = deque(ids)
    prefill_factor, _ = times.spread_draws()
    idle = math.inf                              # seconds the loop had nothing to do
    while queue:
        t, take, idle = _next_call(queue, reqs, t, d.prefill.batch, idle)
        call, duration = _priced_prefill(times, d.prefill.batch, reqs, take, idle, prefill_factor())
        idle = 0.0
        first[take] = t + call           # the first tokens, before their KV is exported
        t += duration
        busy += duration
        for i in take:
            transfer[i] = times.kv_transfer_s(reqs[i].input_len)
            t += transfer[i]
            busy += transfer[i]
            ready[i] = t + times.host_costs.handover_latency_s   # the transport: the loop goes on
    return busy


def _next_call(queue: deque, reqs: list[Request], t: float, batch: int, idle: float):
    """A prefill slice's next call: (its start, the requests it takes, how long the loop
    was idle until then, `idle` carried on: 0 if busy). It starts at the first queued
    arrival if the loop is free before it, and takes up to `batch` requests that have
    arrived by then."""
    idle, t = _idle_until(t, max(t, reqs[queue[0]].arrival_s), idle)
    take = []
    while queue and reqs[queue[0]].arrival_s <= t and len(take) < batch:
        take.append(queue.popleft())
    return t, take, idle


def _idle_until(t: float, arrival: float, idle: float) -> tuple[float, float]:
    """(how long the loop has idled at `arrival`, `arrival`): a loop free at `t` waits for
    it; `idle` is what it had idled before `t` (0: busy until `t`; inf: since the start)."""
    return (idle + (arrival - t) if idle or arrival > t else 0.0), arrival


def _pipelined_prefill_slice(d: Deployment, reqs: list[Request], ids: list[int],
                             times: StepTimes, first: np.ndarray, ready: np.ndarray,
                             transfer: np.ndarray) -> float:
    """A staged prefill slice: the next call enters the first stage `prefill_interval_s`
    (plus the call's host work) after the previous one did, while that one goes on through
    the later stages; a call's first tokens come `prefill_call_s` after its start, then its
    requests' KV goes out one transfer at a time on the slice's link (after the previous
    calls' transfers)."""
    t, busy, link_free = 0.0, 0.0, 0.0
    queue = deque(ids)
    prefill_factor, _ = times.spread_draws()
    idle = math.inf
    while queue:
        t, take, idle = _next_call(queue, reqs, t, d.prefill.batch, idle)
        factor = prefill_factor()
        longest = max(reqs[i].input_len for i in take)
        new = max(reqs[i].input_len - reqs[i].cached_len for i in take)
        before, after = times.prefill_host_s(len(take), idle, factor)
        idle = 0.0
        first[take] = t + _prefill_call_s(times, d.prefill.batch, reqs, take) * factor + before
        gap = times.prefill_interval_s(d.prefill.batch, new, longest - new) * factor \
            + before + after
        sent = max(link_free, float(first[take[0]]) + after)
        for i in take:
            transfer[i] = times.kv_transfer_s(reqs[i].input_len)
            sent += transfer[i]
            ready[i] = sent + times.host_costs.handover_latency_s
        busy += gap + (sent - max(link_free, float(first[take[0]]) + after))
        link_free = sent
        t += gap
    return busy


def _decode_slice(d: Deployment, reqs: list[Request], ids: list[int], times: StepTimes,
                  ready: np.ndarray, finish: np.ndarray) -> float:
    """Decode steps of the slot batch; before each step every ready request takes a free
    slot, each insertion costing `handover_overhead_s` of this loop's time, one after the
    other (server.py `serve_decode` receives and inserts the handed-over KV between steps);
    the first step after the loop was idle (no slot busy) `decode_wake_s` longer."""
    slots = _Slots(d.decode.batch)
    pending = deque(sorted(ids, key=lambda i: ready[i]))
    waiting: deque[int] = deque()
    _, step_factor = times.spread_draws()
    t, busy = 0.0, 0.0
    while pending or waiting or slots.active:
        while pending and ready[pending[0]] <= t:
            waiting.append(pending.popleft())
        idle = not slots.active                    # no slot busy: the loop was polling
        while waiting and slots.free:
            i = waiting.popleft()
            slots.insert(i, reqs[i].output_len - 1, reqs[i].input_len + 1)
            t += times.host_costs.handover_overhead_s
            busy += times.host_costs.handover_overhead_s
        if not slots.active:
            t = max(t, ready[pending[0]])
            continue
        if idle:                                   # its first step after idling
            t += times.host_costs.decode_wake_s
            busy += times.host_costs.decode_wake_s
        until = ready[pending[0]] if (pending and slots.free) else math.inf
        t, _, duration, finished = _decode_run(slots, times, d.decode.batch, t, until, step_factor)
        busy += duration
        finish[finished] = t
    return busy


def decode_route(requests: list[Request], replicas: int) -> list[list[int]]:
    """Each decode slice's requests (indices into `requests`, sorted by arrival): the answers
    of more than one token, round-robin in arrival order, as prefill replicas get theirs;
    known in advance, so a real router (sweeper/serving/serve.py) makes the same choice
    online, whichever prefill replica sends the KV. Each slice inserts its requests in the
    order their KV is ready (`_decode_slice`)."""
    order = sorted(range(len(requests)), key=lambda i: requests[i].arrival_s)
    decoded = [i for i in order if requests[i].output_len > 1]
    return [decoded[r::replicas] for r in range(replicas)]


def simulate(deployment: Deployment, requests: list[Request], step_times: StepTimes | None = None,
             slo: AppProfile | None = None) -> SimResult:
    """Serve `requests` with `deployment` (see the module docstring); `slo` for goodput."""
    d = deployment
    reqs = sorted(requests, key=lambda r: r.arrival_s)
    times = step_times
    if times is None:        # a layout the deployment cannot run fails here, in one line
        times = cost_model_step_times(d)
        if reqs:
            times.prefill_s(d.prefill.batch, reqs[0].input_len)
            times.decode_step_s(d.decode.batch, reqs[0].input_len)
    n = len(reqs)
    first = np.full(n, np.nan)
    finish = np.full(n, np.nan)
    transfer = np.zeros(n)
    if d.mode == "aggregated":
        replicas = d.decode.replicas
        prefill_busy = decode_busy = 0.0
        for r in range(replicas):
            p, q = _aggregated_replica(d, reqs, list(range(r, n, replicas)), times, first, finish)
            prefill_busy += p
            decode_busy += q
    else:
        ready = np.full(n, np.nan)
        prefill_busy = sum(_prefill_slice(d, reqs, list(range(r, n, d.prefill.replicas)), times,
                                          first, ready, transfer)
                           for r in range(d.prefill.replicas))
        one_token = [i for i in range(n) if reqs[i].output_len <= 1]
        finish[one_token] = first[one_token]
        decoded = decode_route(reqs, d.decode.replicas)
        decode_busy = sum(_decode_slice(d, reqs, ids, times, ready, finish) for ids in decoded)
    return SimResult(
        deployment=d, arrival_s=np.array([r.arrival_s for r in reqs]), first_token_s=first,
        finish_s=finish, output_len=np.array([r.output_len for r in reqs], dtype=np.int64),
        slo=slo, prefill_busy_s=prefill_busy, decode_busy_s=decode_busy, kv_transfer_s=transfer,
        step_source=times.source)


def capacity_rps(deployment: Deployment, times: StepTimes, input_len: float, output_len: float,
                 cached_len: float = 0.0) -> dict:
    """Analytical upper bounds on requests/s (the planner prunes with them):
    decode: slots x replicas / ((output_len - 1) x step); prefill: batch x replicas / call
    (aggregated: the replica's time is shared, 1 / (prefill share + decode share)). Steps
    and calls include the serving host costs; disaggregated, the prefill slice's time per
    request includes its KV transfer and the decode slice's the handover's host work.
    `cached_len`: the prompt tokens a request has cached on average (prefix caching), not
    prefilled. Chunked prefill: a request's chunks, each at the mean offset of its chunks."""
    d = deployment
    context = input_len + output_len / 2
    step = times.decode_step_s(d.decode.batch, context) + times.host_costs.step_overhead_s
    new = max(int(math.ceil(input_len - cached_len)), 1)
    cached = int(math.ceil(input_len)) - new
    if d.prefill.chunk:
        chunks = -(-new // d.prefill.chunk)
        size = min(d.prefill.chunk, new)
        call = (chunks * times.prefill_call_s(1, size, cached + (new - size) // 2)
                + sum(times.prefill_host_s(1, False)))
        per_request_prefill = call
    else:
        call = (times.prefill_call_s(d.prefill.batch, new, cached)
                + sum(times.prefill_host_s(d.prefill.batch, False)))
        per_request_prefill = call / d.prefill.batch
    decode_steps = max(output_len - 1, 0.0)
    per_request_decode = decode_steps * step / d.decode.batch       # replica-seconds
    if d.mode == "disaggregated":
        kv = times.kv_transfer_s(int(math.ceil(input_len)))
        if times.prefill_interval_s is not None:   # pipelined: calls and link overlap
            gap = (times.prefill_interval_s(d.prefill.batch, new, cached)
                   + sum(times.prefill_host_s(d.prefill.batch, False)))
            per_request_prefill = max(gap / d.prefill.batch, kv)
        else:
            per_request_prefill += kv
        per_request_decode += times.host_costs.handover_overhead_s
    if d.mode == "aggregated":
        per_request = per_request_decode + per_request_prefill
        total = d.decode.replicas / per_request if per_request > 0 else math.inf
        return {"decode_rps": d.decode.replicas / per_request_decode if per_request_decode else math.inf,
                "prefill_rps": d.decode.replicas / per_request_prefill, "rps": total,
                "decode_step_s": step, "prefill_call_s": call}
    decode = d.decode.replicas / per_request_decode if per_request_decode else math.inf
    prefill = d.prefill.replicas / per_request_prefill
    return {"decode_rps": decode, "prefill_rps": prefill, "rps": min(decode, prefill),
            "decode_step_s": step, "prefill_call_s": call}
