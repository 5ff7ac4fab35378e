"""`sweeper plan`: the cheapest deployment that meets a latency SLO (docs/serving.md "The planner").

    result = plan(PlanQuestion(model, hardware, profile, modes=("aggregated",)))
    result.best, result.plans, result.reason

The search, per mode (aggregated, disaggregated):
1. Slices: chips per slice (powers of two inside one fast-interconnect domain), weights
   (int8, bf16, fp8 where the chips have FP8 units; --weights restricts them), the topology
   the hardware has axes for, and per phase the fastest layout that fits in HBM
   (workloads/recommend.py): decode per slot batch (1 .. 256, KV cache for the longest
   request in every slot, and the shared prefix's once with prefix caching), prefill per
   prompts per call (1 .. 16). Where the weights do not fit one domain in a precision,
   pipelines of whole-domain stages too (STAGE_COUNTS: tensor parallel inside an 8-GPU node,
   stages across nodes). Aggregated plans also with chunked prefill (CHUNK_SIZES).
2. Analytical bounds prune before any simulation: memory (the slice must hold the weights
   and the slots' KV cache), TTFT >= one prefill call, TPOT >= one decode step, and the
   replicas the rate needs (utilisation < 1 from the per-request busy time of each phase).
3. Best-first over chips in total: deployments are simulated (workloads/serving/model.py, a
   bounded number of requests) cheapest first; one that misses its SLO comes back with one
   more replica of the phase that missed; the first that meets the SLO sets the price, and
   the search goes on to twice that many chips (or the budget) to draw the cost/latency
   frontier. Among plans of the cheapest price the one with the most headroom (smallest
   max(stat/target)) wins. With --max-chips the objective is the most goodput within the budget.
4. Error bands: the best plan and the frontier are simulated again at the ends of the
   profile's conformal band (bands.py), each over as many other arrival streams as the band's
   coverage needs (a served stream is one draw of its arrivals); a plan whose SLO target lies
   inside its band is `at_risk`.

Costs are in chips (x price per chip-hour when the profile has one).
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
import time
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np

from sweeper.serving import bands as bands_mod
from workloads.config import ConfigError, HardwareProfile, ModelConfig, check_context
from workloads import costmodel
from workloads.deployment import MODES, Deployment, PhaseSlice
from workloads.hardware import per_chip   # a measured host profile is split over its chips
from workloads.layouts import EXPERT_LAYOUTS
from workloads.recommend import recommend, torus_topologies
from workloads.serving.model import (SimResult, StepTimes, cost_model_step_times,
                                     kv_link_bandwidth, memory_budget, micro_batch, pipelined_s,
                                     simulate, stage_hardware, stage_model, transfer_s)
from workloads.serving.profile import AppProfile, length_stats, mean_rate, requests

SLOT_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
PREFILL_BATCHES = (1, 2, 4, 8, 16)
WEIGHTS = ("int8", "bf16")
MAX_SLICE_CHIPS = 256          # the search's largest slice (a TPU v4 4x8x8)
# Pipeline stages: whole domains (8-GPU nodes) per stage, tensor parallel inside each, as
# 405B-class models are served across nodes (vLLM's TP 8 x PP 2); up to this many chips
STAGE_COUNTS = (2, 4, 8, 16)
MAX_PIPELINE_CHIPS = 128
# Chunked prefill's token budgets per step (aggregated), clipped to the longest prompt:
# vLLM's first default with chunked prefill on (--max-num-batched-tokens 512, the best
# inter-token latency on A100 in vllm-project/vllm#4580) and the budgets of a few hundred to
# a few thousand tokens Sarathi-Serve (Agrawal et al. 2024) and SGLang's
# --chunked-prefill-size use; 0: whole prompts in their own prefill calls
CHUNK_SIZES = (0, 256, 512, 1024, 2048)
DEFAULT_CHIP_CAP = 4096        # total chips searched without --max-chips (a TPU v4 pod)
FRONTIER_FACTOR = 2.0          # the frontier is searched up to this x the cheapest plan
BAND_METRICS = ("ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99")   # Plan.band["bands_s"]


@dataclass
class PlanQuestion:
    """What `sweeper plan` is asked (flags or a space file's serving: block)."""

    model: ModelConfig
    hardware: HardwareProfile
    profile: AppProfile
    modes: tuple[str, ...] = MODES
    max_chips: int | None = None
    requests: int = 400           # simulated per deployment
    seed: int = 0
    coverage: float = bands_mod.DEFAULT_COVERAGE
    max_simulations: int = 300    # per mode
    frontier_simulations: int = 40   # per mode, after the cheapest plan is found
    weights: tuple[str, ...] | None = None   # weight formats searched (None: every one the chips run)
    band_requests: int | None = None   # requests of the stream a band is for (None: as simulated)


@dataclass
class PhaseOption:
    """One phase's slice shape with its layout and analytical step time (replicas = 1)."""

    phase: str
    chips: int
    weights: str
    batch: int
    ffn: str
    attn: str
    topology: tuple[int, int, int]
    step_s: float                 # one call (prefill) or one step (decode) at the mean lengths
    peak_bytes: float
    working_bytes: float
    experts: str = "tp"           # a mixture-of-experts model's experts layout (tp | ep)
    kv_cache: str = "bf16"        # the KV cache's format
    stages: int = 1               # pipeline stages (chips: all of them; topology: one stage's)
    chunk: int = 0                # prefill, aggregated: chunked prefill's tokens per step

    def slice(self, replicas: int) -> PhaseSlice:
        return PhaseSlice(self.chips, replicas, self.ffn, self.attn, self.batch, self.weights,
                          self.topology, self.experts, self.kv_cache, self.stages, self.chunk)


@dataclass
class Plan:
    """One simulated deployment and how it fares against the SLO."""

    deployment: Deployment
    summary: dict
    meets_slo: bool
    violations: dict            # constraint -> stat / target (> 1 is a miss)
    utilization: dict           # phase -> rate / capacity
    memory: float               # peak bytes / HBM of the fullest slice
    band: dict | None = None    # filled for reported plans
    budget: dict | None = None  # memory per chip of each slice, filled for reported plans
    config: tuple | None = field(default=None, repr=False)   # the search's (mode, pre, dec)

    @property
    def chips_total(self) -> int:
        return self.deployment.chips_total

    @property
    def headroom(self) -> float:
        return max(self.violations.values())

    def binding(self) -> str:
        """The constraint closest to its limit: ttft, tpot, memory or throughput."""
        ratios = {"TTFT": self.violations["ttft"], "TPOT": self.violations["tpot"],
                  "memory": self.memory, "throughput": max(self.utilization.values())}
        return max(ratios, key=ratios.get)

    def to_dict(self) -> dict:
        s = self.summary
        d = self.deployment
        out = {"mode": d.mode, "chips_total": d.chips_total,
               "ttft_p99_s": s["ttft_p99_s"], "tpot_p99_s": s["tpot_p99_s"],
               "ttft_p50_s": s["ttft_p50_s"], "tpot_p50_s": s["tpot_p50_s"],
               "ttft_mean_s": s["ttft_mean_s"], "tpot_mean_s": s["tpot_mean_s"],
               "goodput_rps": s["goodput_rps"], "throughput_rps": s["throughput_rps"],
               "slo_attainment": s["slo_attainment"],
               "tokens_per_s_per_chip": s["tokens_per_s_per_chip"],
               "cost_per_million_tokens": s["cost_per_million_tokens"],
               "meets_slo": self.meets_slo, "binding": self.binding(),
               "slo_ratio": {k: _round(v) for k, v in self.violations.items()},
               "utilization": {k: _round(v) for k, v in self.utilization.items()},
               "memory_fraction": _round(self.memory),
               "prefill": _slice_dict(d.prefill), "decode": _slice_dict(d.decode)}
        if self.band is not None:
            out.update(self.band)
        if self.budget is not None:
            out["memory_per_chip"] = self.budget
        return out


def _slice_dict(part: PhaseSlice) -> dict:
    out = {"chips": part.chips, "replicas": part.replicas, "ffn": part.ffn, "attn": part.attn,
           "batch": part.batch, "weights": part.weights,
           "topology": "x".join(map(str, part.topology)) if part.topology else None}
    out["kv_cache"] = part.kv_cache
    if part.experts != "tp":      # a mixture-of-experts model's expert parallelism
        out["experts"] = part.experts
    out["stages"] = part.stages
    out["chunk"] = part.chunk
    return out


def _round(value: float) -> float:
    return float(f"{value:.4g}") if math.isfinite(value) else value


@dataclass
class PlanResult:
    question: PlanQuestion
    best: Plan | None
    best_per_mode: dict
    frontier: list[Plan]
    reason: str
    search: dict
    bands: dict
    settle: str | None = None

    def to_dict(self) -> dict:
        plans, seen = [], set()
        for p in [*(p for p in self.best_per_mode.values() if p), *self.frontier]:
            if id(p) not in seen:
                seen.add(id(p))
                plans.append(p.to_dict())
        return {"best": self.best.to_dict() if self.best else None,
                "best_per_mode": {m: (p.to_dict() if p else None)
                                  for m, p in self.best_per_mode.items()},
                "plans": plans, "reason": self.reason, "settle": self.settle,
                "model": self.question.model.name, "hardware": self.question.hardware.name,
                "calibration": bands_mod.calibration_text(self.question.hardware),
                "price_per_chip_hour": self.question.hardware.price_per_chip_hour,
                "profile": self.question.profile.to_dict(),
                "max_chips": self.question.max_chips,
                "error_band": {k: v.to_dict() for k, v in self.bands.items()},
                "search": self.search}

    def plan_file(self) -> dict | None:
        """What `--out plan.json` holds (docs/serving.md "Plan file")."""
        if self.best is None:
            return None
        return {"format": "sweeper-plan/1", "deployment": self.best.deployment.to_dict(),
                "profile": self.question.profile.to_dict(), "predicted": self.best.to_dict(),
                "error_band": {k: v.to_dict() for k, v in self.bands.items()}}


# --------------------------------------------------------------------------- slices


class _Options:
    """Per-phase slice options of one (model, hardware, profile), computed once."""

    def __init__(self, q: PlanQuestion):
        self.q = q
        lengths = length_stats(q.profile)
        self.input_mean = lengths["input_mean"]
        self.output_mean = lengths["output_mean"]
        self.context_full = lengths["input_max"] + lengths["output_max"]
        self.input_max = lengths["input_max"]
        self.context_mean = self.input_mean + self.output_mean / 2
        self.pruned: dict[str, str] = {}
        cap = q.max_chips or DEFAULT_CHIP_CAP
        domain = q.hardware.domain_chips or MAX_SLICE_CHIPS
        self.slice_chips = [c for c in (2 ** i for i in range(0, 10))
                            if c <= min(cap, domain, MAX_SLICE_CHIPS)]
        # prefix caching: the mean cached tokens of a prompt, and one prefix copy's KV per slice
        self.prefix_len = q.profile.prefix_len
        self.cached_mean = q.profile.prefix_len * q.profile.prefix_hit
        self.stage_counts = self._stage_counts(cap)

    def _stage_counts(self, cap: int) -> tuple[int, ...]:
        """Pipeline stages searched over slices of whole domains (the largest slice per stage:
        an 8-GPU node, tensor parallel inside it), up to MAX_PIPELINE_CHIPS chips and the
        model's layers; none where the domain is larger than a slice (a TPU pod: one slice
        inside it serves as it is) or unknown."""
        hw = self.q.hardware
        if not hw.domain_chips or hw.domain_chips > MAX_SLICE_CHIPS or not self.slice_chips:
            return ()
        stage = self.slice_chips[-1]
        return tuple(s for s in STAGE_COUNTS if s <= self.q.model.n_layers
                     and stage * s <= min(cap, MAX_PIPELINE_CHIPS))

    def shapes(self, weights: str) -> list[tuple[int, int]]:
        """(chips per stage, stages) searched in this precision: every slice inside a domain,
        and pipelines of whole-domain stages where the weights do not fit one domain in this
        precision (a pipeline of the same chips as more replicas is no cheaper: decode
        steps as slow, the same memory per chip)."""
        out = [(c, 1) for c in self.slice_chips]
        if self.stage_counts and not self.decode(self.slice_chips[-1], weights, 1):
            out += [(self.slice_chips[-1], s) for s in self.stage_counts]
        return out

    @property
    def fewest_fitting(self) -> int:
        """The smallest slice that holds the weights and one decode slot's KV cache."""
        return min((c * s for w in self.weights for c, s in self.shapes(w)
                    if self.decode(c, w, s)), default=math.inf)

    @property
    def weights(self) -> tuple[str, ...]:
        formats = weight_formats(self.q.hardware)
        if self.q.weights is None:
            return formats
        return tuple(w for w in formats if w in self.q.weights)

    @property
    def kv_formats(self) -> tuple[str, ...]:
        return kv_formats(self.q.hardware)

    def _weights_fit(self, chips: int, weights: str) -> bool:
        params = costmodel.param_count(self.q.model.unpadded)
        need = params * costmodel.weight_element_bytes(weights)
        if need > chips * per_chip(self.q.hardware, chips).usable_hbm_bytes:
            self.pruned["memory"] = (     # the largest slice tried is the one to report
                f"{self.q.model.name}'s {weights} weights ({need / 2**30:.0f} GiB) need "
                f"more than {chips} x {per_chip(self.q.hardware, chips).usable_hbm_bytes / 2**30:.0f}"
                " GiB (HBM less its reserve)")
            return False
        return True

    @lru_cache(maxsize=None)
    def topology(self, chips: int) -> tuple[int, int, int]:
        return torus_topologies(self.q.model.unpadded, chips, self.q.hardware.torus_dims)[0]

    def _prefix_bytes(self, model: ModelConfig, chips: int, candidate, kv: str) -> float:
        """Per chip, one copy of the shared prefix's KV cache (prefix caching; 0 without)."""
        if not self.prefix_len:
            return 0.0
        return costmodel.kv_bytes_per_chip(model, chips, 1, self.prefix_len, candidate.attn,
                                           candidate.prediction.topology, candidate.ffn, kv)

    @lru_cache(maxsize=None)
    def decode(self, chips: int, weights: str, stages: int = 1) -> list[PhaseOption]:
        """Decode options of a slice of `chips` chips per stage in `stages` stages: per slot
        batch the fastest layout whose stage holds its layers' weights, every slot's KV
        cache of those layers and the shared prefix's; the step pipelined (workloads/serving/model.py)."""
        out = []
        if not self._weights_fit(chips * stages, weights):
            return out
        topo = self.topology(chips)
        model = stage_model(self.q.model.unpadded, stages)
        hw = stage_hardware(self.q.hardware, chips, stages)
        for experts, kv in itertools.product(expert_layouts(self.q.model, chips), self.kv_formats):
            for slots in SLOT_BATCHES:
                try:
                    rec = recommend(model, hw, chips, slots, "decode", context=self.context_full,
                                    weights=weights, topology=topo, experts=experts, kv_cache=kv)
                except ConfigError:
                    continue
                best = rec.best
                peak = best.prediction.peak_bytes_per_chip + self._prefix_bytes(model, chips,
                                                                                best, kv)
                if not best.fits or peak > hw.usable_hbm_bytes:
                    self.pruned["memory"] = (f"decode: {slots} slots of {self.context_full} tokens "
                                             f"do not fit {chips * stages} chips ({weights})")
                    break
                layout = costmodel.PhaseLayout(best.ffn, best.attn)
                micro = micro_batch(slots, stages, self.q.hardware)
                try:
                    stage_s = costmodel.predict_phase(
                        self._padded(best, stages), hw, chips, micro, "decode", 1,
                        self.context_mean, layout, weights, topo, experts=experts,
                        kv_cache=kv).latency_s
                except ConfigError:      # the layout cannot split a micro-batch this small
                    continue
                step = pipelined_s(stage_s, transfer_s(self.q.model, self.q.hardware, chips,
                                                       stages, micro), stages)
                out.append(PhaseOption("decode", chips * stages, weights, slots, best.ffn,
                                       best.attn, topo, step, peak,
                                       best.prediction.working_set_bytes_per_chip, experts, kv,
                                       stages))
        return out

    @lru_cache(maxsize=None)
    def prefill(self, chips: int, weights: str, stages: int = 1) -> list[PhaseOption]:
        """Prefill options per prompts per call, as `decode`; the call's time at the mean
        prompt, less its mean cached prefix (prefix caching), through every stage."""
        out = []
        if not self._weights_fit(chips * stages, weights):
            return out
        topo = self.topology(chips)
        length = int(math.ceil(self.input_mean))
        new = max(int(math.ceil(self.input_mean - self.cached_mean)), 1)
        model = stage_model(self.q.model.unpadded, stages)
        hw = stage_hardware(self.q.hardware, chips, stages)
        for experts, kv in itertools.product(expert_layouts(self.q.model, chips), self.kv_formats):
            for batch in PREFILL_BATCHES:
                try:
                    rec = recommend(model, hw, chips, batch, "prefill", input_len=length,
                                    weights=weights, topology=topo, experts=experts, kv_cache=kv)
                except ConfigError:
                    continue
                best = rec.best
                peak = best.prediction.peak_bytes_per_chip + self._prefix_bytes(model, chips,
                                                                                best, kv)
                if not best.fits or peak > hw.usable_hbm_bytes:
                    break
                stage_s = best.prediction.latency_s
                if new < length:     # the cached prefix is not prefilled
                    stage_s = costmodel.predict_phase(
                        self._padded(best, stages), hw, chips, batch, "prefill", new, length,
                        costmodel.PhaseLayout(best.ffn, best.attn), weights, topo,
                        experts=experts, kv_cache=kv).latency_s
                step = pipelined_s(stage_s, transfer_s(self.q.model, self.q.hardware, chips,
                                                       stages, batch * new), stages)
                out.append(PhaseOption("prefill", chips * stages, weights, batch, best.ffn,
                                       best.attn, topo, step, peak,
                                       best.prediction.working_set_bytes_per_chip, experts, kv,
                                       stages))
        return out

    def chunk_sizes(self) -> tuple[int, ...]:
        """Chunked prefill's token budgets searched (CHUNK_SIZES clipped to the longest
        prompt, 0 first)."""
        longest = int(math.ceil(self.input_max))
        return tuple(dict.fromkeys(min(c, longest) if c else 0 for c in CHUNK_SIZES))

    def _padded(self, candidate, stages: int = 1) -> ModelConfig:
        from workloads.layouts import pad_model
        return pad_model(stage_model(self.q.model.unpadded, stages), candidate.heads)


# --------------------------------------------------------------------------- search


@dataclass(order=True)
class _Entry:
    chips_total: int
    lower_bound: float
    order: int
    config: tuple = field(compare=False)      # (mode, prefill option, decode option)
    replicas: tuple = field(compare=False)    # (prefill replicas, decode replicas)


SIMULATED_SECONDS = 20.0     # a simulation covers at least this much traffic ...
MAX_SIMULATED_REQUESTS = 2000   # ... up to this many requests (unless --requests is larger)


def simulated_requests(q: PlanQuestion, rate: float) -> int:
    """Requests per simulation: --requests, or enough for SIMULATED_SECONDS of traffic (a
    short run from an empty system misses the queue a high rate builds), at most
    MAX_SIMULATED_REQUESTS."""
    return max(q.requests, min(MAX_SIMULATED_REQUESTS, math.ceil(rate * SIMULATED_SECONDS)))


class _Search:
    def __init__(self, q: PlanQuestion, options: _Options, mode: str):
        self.q, self.o, self.mode = q, options, mode
        self.rate = mean_rate(q.profile)
        self.requests = requests(q.profile, simulated_requests(q, self.rate), q.seed)
        self.cap = q.max_chips or DEFAULT_CHIP_CAP
        self.heap: list[_Entry] = []
        self.counter = itertools.count()
        self.simulated: list[Plan] = []
        self.seen: set = set()
        self.configs = 0
        self._times: dict = {}
        self.lower_bounds: dict[str, float] = {}     # the best any config reaches: ttft, tpot
        self.needed_chips = math.inf   # the fewest chips a config over the cap needs for the rate

    # -- candidates
    def seed(self) -> None:
        """Every configuration that passes the bounds, less the dominated ones: per chip
        count, one that is no faster per call and serves no more requests per second than
        another is never cheaper (both fit; the simulation sees only their step times)."""
        o = self.o
        shapes = sorted({shape for w in o.weights for shape in o.shapes(w)},
                        key=lambda cs: (cs[0] * cs[1], cs[1]))
        for chips, stages in shapes:
            if self.mode == "aggregated":
                configs = []
                for weights in o.weights:
                    if (chips, stages) not in o.shapes(weights):
                        continue
                    for pre, dec in itertools.product(o.prefill(chips, weights, stages),
                                                      o.decode(chips, weights, stages)):
                        if (pre.topology != dec.topology or pre.experts != dec.experts
                                or pre.kv_cache != dec.kv_cache):
                            continue     # one replica stores one copy of the weights and cache
                        if dec.peak_bytes + pre.working_bytes > per_chip(
                                self.q.hardware, chips * stages).usable_hbm_bytes:
                            o.pruned.setdefault("memory", "slots' KV cache + prefill working set "
                                                "exceed HBM")
                            continue
                        configs.append(("aggregated", pre, dec))
                # chunked prefill: one prompt's chunk per decode step (no prompts per call)
                for chunk in o.chunk_sizes():
                    group = configs if not chunk else [
                        ("aggregated", dataclasses.replace(pre, chunk=chunk), dec)
                        for _, pre, dec in configs if pre.batch == 1]
                    for config in _undominated(group, lambda c: (
                            c[1].step_s, c[2].step_s, self._busy(c[1]) + self._busy(c[2]))):
                        self._add(config)
        if self.mode == "disaggregated":
            def best_of(phase):
                out = []
                for chips, stages in shapes:
                    options = [x for w in o.weights if (chips, stages) in o.shapes(w) for x in
                               (o.prefill(chips, w, stages) if phase == "prefill"
                                else o.decode(chips, w, stages))]
                    out += _undominated(options, lambda x: (x.step_s, self._busy(x)))
                return out
            prefills = best_of("prefill")
            for dec in best_of("decode"):
                for pre in prefills:
                    if pre.kv_cache == dec.kv_cache:     # the cache is handed over as it is
                        self._add(("disaggregated", pre, dec))

    def _busy(self, option: PhaseOption) -> float:
        """Seconds of one slice per request (prefill: a share of a call; decode: K - 1 steps
        shared by the slots)."""
        if option.phase == "prefill":
            return option.step_s / option.batch
        return max(self.o.output_mean - 1, 0) * option.step_s / option.batch

    def _bound(self, key: str, value: float) -> None:
        self.lower_bounds[key] = min(self.lower_bounds.get(key, math.inf), value)

    def _add(self, config: tuple) -> None:
        mode, pre, dec = config
        p = self.q.profile
        self._bound("ttft", pre.step_s)
        self._bound("tpot", dec.step_s)
        if pre.step_s > p.ttft or dec.step_s > p.tpot:
            return
        decode_busy = max(self.o.output_mean - 1, 0) * dec.step_s / dec.batch   # s per request
        prefill_busy = pre.step_s / pre.batch
        if mode == "aggregated":
            replicas = max(1, math.floor(self.rate * (decode_busy + prefill_busy)) + 1)
            reps = (replicas, replicas)
        else:
            reps = (max(1, math.floor(self.rate * prefill_busy) + 1),
                    max(1, math.floor(self.rate * decode_busy) + 1))
        self.configs += 1
        self._push(config, reps)

    def _chips(self, config, reps) -> int:
        _, pre, dec = config
        if config[0] == "aggregated":
            return dec.chips * reps[1]
        return pre.chips * reps[0] + dec.chips * reps[1]

    def _push(self, config, reps) -> None:
        chips = self._chips(config, reps)
        key = (id(config[1]), id(config[2]), reps)
        if chips > self.cap:
            self.needed_chips = min(self.needed_chips, chips)
            return
        if key in self.seen:
            return
        self.seen.add(key)
        _, pre, dec = config
        heapq.heappush(self.heap, _Entry(chips, pre.step_s / self.q.profile.ttft
                                         + dec.step_s / self.q.profile.tpot,
                                         next(self.counter), config, reps))

    def deployment(self, config, reps) -> Deployment:
        mode, pre, dec = config
        return Deployment(self.q.model, self.q.hardware, mode, pre.slice(reps[0]),
                          dec.slice(reps[1]))

    def step_times(self, config, deployment: Deployment) -> StepTimes:
        key = (id(config[1]), id(config[2]))
        if key not in self._times:
            self._times[key] = cost_model_step_times(deployment)
        times = self._times[key]
        if deployment.mode == "disaggregated":   # the link depends on the chips in total
            bandwidth, _ = kv_link_bandwidth(deployment)
            per_token = costmodel.kv_bytes_per_token(deployment.model,
                                                     kv_cache=deployment.decode.kv_cache)
            times = dataclasses.replace(times, kv_transfer_s=lambda n: per_token * n / bandwidth)
        return times

    # -- evaluation
    def evaluate(self, config, reps, times: StepTimes | None = None) -> Plan:
        d = self.deployment(config, reps)
        times = times or self.step_times(config, d)
        result = simulate(d, self.requests, times, slo=self.q.profile)
        return self._plan(d, result, config)

    def _plan(self, d: Deployment, result: SimResult, config) -> Plan:
        p = self.q.profile
        s = result.summary(p)
        violations = {"ttft": s["ttft_slo_stat_s"] / p.ttft, "tpot": s["tpot_slo_stat_s"] / p.tpot,
                      "attainment": (p.attainment / s["slo_attainment"]
                                     if s["slo_attainment"] else math.inf)}
        meets = all(v <= 1.0 for v in violations.values())
        _, pre, dec = config
        decode_busy = max(self.o.output_mean - 1, 0) * dec.step_s / dec.batch
        prefill_busy = pre.step_s / pre.batch
        if d.mode == "aggregated":
            utilization = {"replica": self.rate * (decode_busy + prefill_busy) / d.decode.replicas}
        else:
            utilization = {"prefill": self.rate * prefill_busy / d.prefill.replicas,
                           "decode": self.rate * decode_busy / d.decode.replicas}
        hbm = per_chip(self.q.hardware, dec.chips).usable_hbm_bytes   # HBM less its reserve
        memory = (dec.peak_bytes + (pre.working_bytes if d.mode == "aggregated" else 0)) / hbm
        if d.mode == "disaggregated":
            memory = max(memory, pre.peak_bytes / per_chip(self.q.hardware, pre.chips).usable_hbm_bytes)
        return Plan(d, s, meets, violations, utilization, memory, config=config)

    def run(self) -> tuple[Plan | None, list[Plan]]:
        self.seed()
        best: Plan | None = None
        limit = self.cap
        budget = self.q.max_chips is not None
        found_at = None
        while self.heap and len(self.simulated) < self.q.max_simulations:
            entry = heapq.heappop(self.heap)
            if entry.chips_total > limit:
                break
            if found_at is not None and len(self.simulated) - found_at >= self.q.frontier_simulations:
                break
            plan = self.evaluate(entry.config, entry.replicas)
            self.simulated.append(plan)
            if plan.meets_slo:
                if best is None:
                    found_at = len(self.simulated)
                if best is None or self._better(plan, best, budget):
                    best = plan
                if not budget:
                    limit = min(limit, int(best.chips_total * FRONTIER_FACTOR))
                continue
            self._retry(entry, plan)
        return best, self.simulated

    def _better(self, plan: Plan, best: Plan, budget: bool) -> bool:
        if budget:   # the most goodput within the budget, then the fewest chips
            return ((plan.summary["goodput_rps"], -plan.chips_total, -plan.headroom)
                    > (best.summary["goodput_rps"], -best.chips_total, -best.headroom))
        return (plan.chips_total, plan.headroom) < (best.chips_total, best.headroom)

    def _retry(self, entry: _Entry, plan: Plan) -> None:
        """More replicas of the phase that missed (aggregated: of the whole replica): one,
        or 5% of them when there are more than 20 (a plan at most 5% dearer than the
        cheapest, in a twentieth of the simulations)."""
        pre_reps, dec_reps = entry.replicas
        v = plan.violations

        def more(r: int) -> int:
            return r + max(1, r // 20)

        if entry.config[0] == "aggregated":
            self._push(entry.config, (more(pre_reps), more(dec_reps)))
            return
        if v["ttft"] > 1 or v["attainment"] > 1:
            self._push(entry.config, (more(pre_reps), dec_reps))
        if v["tpot"] > 1 or v["attainment"] > 1:
            self._push(entry.config, (pre_reps, more(dec_reps)))


def _undominated(items: list, key) -> list:
    """The items no other item beats or ties on every component of key(item) (smaller is
    better), one per distinct key."""
    keyed = sorted(((tuple(costmodel.significant(v) for v in key(i)), n, i)
                    for n, i in enumerate(items)), key=lambda t: (t[0], t[1]))
    out, kept = [], []
    for k, _, item in keyed:
        if any(all(a <= b for a, b in zip(other, k)) for other in kept):
            continue
        kept.append(k)
        out.append(item)
    return out


# --------------------------------------------------------------------------- bands


def band_streams(q: PlanQuestion, simulated: int) -> list[list]:
    """The arrival streams a band is simulated on: as many as a `q.coverage` band needs
    (bands.minimum_points: the chance that one more stream's statistic lies beyond all of
    them is then at most 1 - coverage), each of `q.band_requests` requests (default: as many
    as the plan simulates), none of them the plan's own. A trace gives one stream."""
    n = q.band_requests or simulated
    if q.profile.trace is not None:
        return [requests(q.profile, n, q.seed)]
    seeds = (int(np.random.SeedSequence([q.seed, k]).generate_state(1)[0])
             for k in range(bands_mod.minimum_points(q.coverage)))
    return [requests(q.profile, n, s) for s in seeds]


def _with_band(search: _Search, plan: Plan, ratio_bands: dict, streams: list[list]) -> None:
    """Simulate `plan` at the band's ends on every band stream; fills plan.band (at_risk,
    intervals: the lowest and highest statistic of those simulations and the plan's own)."""
    p = search.q.profile
    ttft_name, tpot_name = f"ttft_{p.ttft_statistic}", f"tpot_{p.tpot_statistic}"
    pre, dec = ratio_bands["prefill"], ratio_bands["decode"]
    if not (pre.known and dec.known):
        status = "uncalibrated" if not (pre.points or dec.points) else pre.status
        plan.band = {"band": status, "at_risk": None, f"{ttft_name}_band_s": None,
                     f"{tpot_name}_band_s": None}
        return
    base = search.step_times(plan.config, plan.deployment)
    # and draws each call's factor from the calibration's spread, where it has one (bands.py)
    prefill_spread, step_spread = bands_mod.serving_spread(search.q.hardware, plan.deployment.mode)
    ends = []
    for fp, fd in ((pre.low, dec.low), (pre.high, dec.high)):
        affine = base.decode_affine
        # the band scales the engine's step times; the serving host costs stay as measured
        at, gap = base.prefill_at_s, base.prefill_interval_s
        scaled = dataclasses.replace(
            base, prefill_s=lambda b, n, f=fp: base.prefill_s(b, n) * f,
            prefill_at_s=None if at is None else (lambda b, n, o, f=fp: at(b, n, o) * f),
            prefill_interval_s=None if gap is None else (lambda b, n, o, f=fp: gap(b, n, o) * f),
            decode_step_s=lambda b, c, f=fd: base.decode_step_s(b, c) * f,
            decode_affine=None if affine is None else
            (lambda b, lo, hi, f=fd: tuple(f * x for x in affine(b, lo, hi))),
            prefill_spread=prefill_spread, step_spread=step_spread)
        ends += [search._plan(plan.deployment, simulate(
            plan.deployment, stream, dataclasses.replace(scaled, spread_seed=k), slo=p),
            plan.config) for k, stream in enumerate(streams)]

    def interval(key: str) -> list[float]:   # the plan's own prediction lies inside
        values = [plan.summary[key], *(e.summary[key] for e in ends)]
        return [min(values), max(values)]

    at_risk = any(plan.meets_slo != e.meets_slo for e in ends)
    plan.band = {"band": band_label(search.q.hardware, pre, dec, len(streams)),
                 "at_risk": at_risk, f"{ttft_name}_band_s": interval("ttft_slo_stat_s"),
                 f"{tpot_name}_band_s": interval("tpot_slo_stat_s"),
                 # every percentile's band from the same simulations, so that a served
                 # stream's p50 and p99 can both be checked against it (benchmarks/blind.py)
                 "bands_s": {m: interval(f"{m}_s") for m in BAND_METRICS}}


def band_label(hardware: HardwareProfile, pre, dec, streams: int = 1) -> str:
    """What a plan's band rests on: the held-out points, the arrival streams, and for a
    preset fitted to published measurements where they come from (bands.calibration_text)."""
    pooled = "both phases" in pre.status or "both phases" in dec.status
    points = (f"{max(pre.points, dec.points)} held-out, both phases" if pooled
              else f"{pre.points}+{dec.points} held-out")
    arrivals = f", {streams} arrival streams" if streams > 1 else ""
    world = bands_mod.calibration_text(hardware)
    return (f"{world}, {pre.coverage:.0%}{arrivals}" if world
            else f"calibrated ({pre.coverage:.0%}, {points}{arrivals})")


# --------------------------------------------------------------------------- the answer


def weight_formats(hw: HardwareProfile) -> tuple[str, ...]:
    """Weight formats a plan searches: int8 and bf16, and fp8 where the chips have FP8 units
    (an FP8 matmul runs there at hw.fp8_flops; elsewhere fp8 storage is int8's twin)."""
    return ("fp8",) + WEIGHTS if hw.fp8_flops else WEIGHTS


def kv_formats(hw: HardwareProfile) -> tuple[str, ...]:
    """KV cache formats a plan searches: bf16 and one 8-bit format, fp8 where the chips have
    FP8 units, else int8 (the two hold the same bytes: one is enough to search)."""
    return ("bf16", "fp8" if hw.fp8_flops else "int8")


def expert_layouts(model: ModelConfig, chips: int) -> tuple[str, ...]:
    """The experts layouts a plan searches: tp and ep for a mixture-of-experts model on more
    than one chip (on one, ep is tp: every expert is local)."""
    return EXPERT_LAYOUTS if model.moe and chips > 1 else ("tp",)


def check_context_window(q: PlanQuestion) -> None:
    """ConfigError (naming --input-len) when the longest prompt and answer exceed the model's
    context window (issue 39: llama2-70b's 4k window took --input-len 200000)."""
    lengths = length_stats(q.profile)
    check_context(q.model, lengths["input_max"] + lengths["output_max"], "--input-len",
                  lengths["input_max"], what=f"the longest prompt, {lengths['input_max']}, and "
                  f"answer, {lengths['output_max']} tokens")


def _with_budget(options: _Options, plan: Plan) -> None:
    """Fills plan.budget: memory per chip of each slice at the longest request (workloads/serving/model.py)."""
    plan.budget = memory_budget(plan.deployment, int(math.ceil(options.input_max)),
                                int(math.ceil(options.context_full)), options.prefix_len)


def plan(q: PlanQuestion) -> PlanResult:
    """The cheapest deployment per mode meeting the SLO, the frontier, and why (module doc)."""
    check_context_window(q)
    started = time.perf_counter()
    options = _Options(q)
    ratio_bands = bands_mod.profile_bands(q.hardware, q.coverage)
    best_per_mode: dict[str, Plan | None] = {}
    searches: dict[str, _Search] = {}
    everything: list[Plan] = []
    for mode in q.modes:
        search = _Search(q, options, mode)
        best_per_mode[mode], simulated = search.run()
        searches[mode] = search
        everything += simulated
    candidates = [p for p in best_per_mode.values() if p is not None]
    budget = q.max_chips is not None
    best = None
    for p in candidates:
        if best is None or searches[p.deployment.mode]._better(p, best, budget):
            best = p
    frontier = pareto([p for p in everything if p.meets_slo])
    # drawn only where a band is simulated: an uncalibrated profile has none
    streams = (band_streams(q, simulated_requests(q, mean_rate(q.profile)))
               if all(b.known for b in ratio_bands.values()) else [])
    for p in {id(p): p for p in [*candidates, *frontier]}.values():
        _with_band(searches[p.deployment.mode], p, ratio_bands, streams)
        _with_budget(options, p)
    reason = _reason(q, best, everything, options, searches)
    settle = None
    if best is not None and (best.band or {}).get("at_risk") is not False:
        settle = (f"run `sweeper serve --plan plan.json --rate {mean_rate(q.profile):g}` (after "
                  "`sweeper plan ... --out plan.json`) and compare its measured "
                  f"ttft_{q.profile.ttft_statistic}/tpot_{q.profile.tpot_statistic} with the "
                  "SLO" + ("; or fit this hardware (`sweeper fit`) so the plan carries an error "
                           "band" if best.band.get("at_risk") is None else ""))
    search_info = {"simulated": len(everything),
                   "configs": sum(s.configs for s in searches.values()),
                   "requests_per_simulation": simulated_requests(q, mean_rate(q.profile)),
                   "pruned": dict(options.pruned),
                   "lower_bounds": {m: {k: _round(v) for k, v in s.lower_bounds.items()}
                                    for m, s in searches.items()},
                   "wall_s": round(time.perf_counter() - started, 3),
                   "step_times": costmodel.SOURCE}
    return PlanResult(q, best, best_per_mode, frontier, reason, search_info, ratio_bands, settle)


def pareto(plans: list[Plan]) -> list[Plan]:
    """Plans no other beats on chips, TTFT and TPOT statistics at once (cheapest first)."""
    def key(p: Plan):
        return (p.chips_total, p.summary["ttft_slo_stat_s"], p.summary["tpot_slo_stat_s"])

    out = []
    for p in sorted(plans, key=key):
        kp = key(p)
        if not any(all(a <= b for a, b in zip(key(o), kp)) and key(o) != kp for o in plans):
            if all(key(o) != kp for o in out):
                out.append(p)
    return out


def _miss(p: AppProfile, plan: Plan) -> str:
    """The constraint a plan misses most, and by how much."""
    name, ratio = max(plan.violations.items(), key=lambda kv: kv[1])
    s = plan.summary
    what = {"ttft": f"TTFT {p.ttft_statistic} {s['ttft_slo_stat_s']:.3g} s > {p.ttft:g} s",
            "tpot": f"TPOT {p.tpot_statistic} {s['tpot_slo_stat_s']:.3g} s > {p.tpot:g} s",
            "attainment": f"SLO attainment {s['slo_attainment']:.1%} < {p.attainment:.0%}"}[name]
    return f"{what} (off by {ratio - 1:.0%})"


def why_not_cheaper(q: PlanQuestion, best: Plan, everything: list[Plan], options: _Options) -> str:
    """What stops a plan with fewer chips: the closest cheaper simulated plan's miss, or the
    bound that pruned the cheaper slices before simulation."""
    cheaper = [p for p in everything if p.chips_total < best.chips_total]
    if cheaper:
        closest = min(cheaper, key=lambda plan: plan.headroom)
        return (f"fewer chips miss: {_miss(q.profile, closest)} with "
                f"{closest.deployment.describe()} on {closest.chips_total} chips")
    if best.chips_total <= options.fewest_fitting and "memory" in options.pruned:
        return (f"fewer chips do not fit: {q.model.name}'s weights and one slot's KV cache "
                f"need a slice of {options.fewest_fitting} chips or more")
    return (f"fewer chips: no configuration passes the analytical bounds ({mean_rate(q.profile):g} "
            "req/s needs more replicas than fit, or TTFT/TPOT below one call)")


def _reason(q: PlanQuestion, best: Plan | None, everything: list[Plan], options: _Options,
            searches: dict) -> str:
    p = q.profile
    cap = q.max_chips or DEFAULT_CHIP_CAP
    if best is not None:
        return (f"{best.deployment.mode} on {best.chips_total} chips meets the SLO; binding: "
                f"{best.binding()}; {why_not_cheaper(q, best, everything, options)}")
    if everything:
        closest = min(everything, key=lambda plan: plan.headroom)
        return (f"no plan within {cap} chips meets the SLO: {_miss(p, closest)} in the closest, "
                f"{closest.deployment.describe()} on {closest.chips_total} chips")
    bounds = {}
    for s in searches.values():
        for k, v in s.lower_bounds.items():
            bounds[k] = min(bounds.get(k, math.inf), v)
    if "tpot" in bounds and bounds["tpot"] > p.tpot:
        return (f"no plan within {cap} chips meets the SLO: TPOT: the fastest decode step of any "
                f"slice is {bounds['tpot']:.3g} s > {p.tpot:g} s (off by {bounds['tpot'] / p.tpot - 1:.0%})")
    if "ttft" in bounds and bounds["ttft"] > p.ttft:
        return (f"no plan within {cap} chips meets the SLO: TTFT: the fastest prefill call of "
                f"any slice is {bounds['ttft']:.3g} s > {p.ttft:g} s (off by "
                f"{bounds['ttft'] / p.ttft - 1:.0%})")
    needed = min((s.needed_chips for s in searches.values()), default=math.inf)
    if math.isfinite(needed):
        return (f"no plan within {cap} chips: throughput: {mean_rate(p):g} req/s needs at least "
                f"{needed} chips (off by {needed / cap - 1:.0%}) by the capacity bound of every "
                "configuration that fits")
    if "memory" in options.pruned:
        return f"no plan within {cap} chips fits in memory: {options.pruned['memory']}"
    return f"no plan within {cap} chips: the rate needs more chips than the budget allows"


# --------------------------------------------------------------------------- several chips


@dataclass
class HardwareChoice:
    """One hardware's answer in a comparison, with the price per chip-hour it was costed at
    and where that price comes from."""

    result: PlanResult
    price_source: str

    @property
    def hardware(self) -> HardwareProfile:
        return self.result.question.hardware

    @property
    def dollars_per_hour(self) -> float | None:
        """The best plan's chips x price per chip-hour (None: no plan, or no price)."""
        best, price = self.result.best, self.hardware.price_per_chip_hour
        return None if best is None or price is None else best.chips_total * price

    def to_dict(self) -> dict:
        return {"hardware": self.hardware.name, "price_per_chip_hour": self.hardware.price_per_chip_hour,
                "price_source": self.price_source, "dollars_per_hour": self.dollars_per_hour,
                "plan": self.result.to_dict()}


@dataclass
class Comparison:
    """`sweeper plan --hardware a,b,c`: the cheapest plan per hardware and overall."""

    choices: list[HardwareChoice]

    @property
    def cheapest(self) -> HardwareChoice | None:
        """The choice whose best plan costs the fewest dollars per hour (priced ones only)."""
        priced = [c for c in self.choices if c.dollars_per_hour is not None]
        return min(priced, key=lambda c: (c.dollars_per_hour, c.result.best.headroom), default=None)

    @property
    def unpriced(self) -> list[str]:
        return [c.hardware.name for c in self.choices
                if c.result.best is not None and c.hardware.price_per_chip_hour is None]

    def to_dict(self) -> dict:
        cheapest = self.cheapest
        return {"cheapest": cheapest.hardware.name if cheapest else None,
                "cheapest_dollars_per_hour": cheapest.dollars_per_hour if cheapest else None,
                "unpriced": self.unpriced, "hardware": [c.to_dict() for c in self.choices]}


def compare(questions: list[PlanQuestion], price_sources: dict[str, str]) -> Comparison:
    """Plan the same question on each hardware (its price already set on the profile);
    `price_sources`: hardware name -> where its price comes from."""
    return Comparison([HardwareChoice(plan(q), price_sources.get(q.hardware.name, "unknown"))
                       for q in questions])
