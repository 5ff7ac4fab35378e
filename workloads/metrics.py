"""Measurement: the one definition of every metric (docs/architecture.md "Metrics").

The engine fills it with `source="measured"` (timings of the mesh it ran on: on an
emulated mesh, this host), the cost model with `source="analytical"`. MLflow, Optuna
and the reports read the same field names; they never mix the two sources.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any


@dataclass
class CollectiveStat:
    """Collectives of one kind found in a compiled program (or predicted by the model)."""

    kind: str                # all-gather | reduce-scatter | all-reduce | all-to-all
    count: int
    bytes_per_chip: int      # as run (on the XLA CPU backend bf16 collectives run in f32)
    elements_per_chip: int
    dtype: str               # dtype seen, e.g. "bf16", "f32", "s8"


@dataclass
class Measurement:
    source: str                        # "measured" | "analytical"
    hardware: str                      # profile name; "host" for an emulated mesh
    # Latency (seconds): medians over the timed runs, with min and max (decode: per step, a
    # run's decode time / its steps, so min and max are over runs).
    prefill_s: float = math.nan
    prefill_s_min: float = math.nan
    prefill_s_max: float = math.nan
    decode_step_s: float = math.nan
    decode_step_s_min: float = math.nan
    decode_step_s_max: float = math.nan
    total_s: float = math.nan          # prefill + all decode steps: the user's end-to-end latency
    compile_s: float = math.nan        # reported separately, never part of a latency
    # XLA compiles of this trial served by the sweep's persistent compilation cache, and
    # those XLA had to compile (set by the sweep's worker: sweeper/sweep/compile_cache.py)
    programs_from_cache: float = math.nan
    programs_compiled: float = math.nan
    # Noise of the numbers above (docs/architecture.md, "Measurement protocol"):
    # *_ci_rel = half-width of the 95% confidence interval of the median / the median;
    # *_repeats = timed runs used; *_spread = (max - min) / median over those runs.
    prefill_ci_rel: float = math.nan
    decode_ci_rel: float = math.nan
    prefill_repeats: float = math.nan
    decode_repeats: float = math.nan
    prefill_spread: float = math.nan
    decode_spread: float = math.nan
    measure_s: float = math.nan        # wall time of the timed runs (bounded by time_budget_s)
    # The host while the runs were timed (workloads/hoststate.py): 1-min load average at the
    # end, steal and busy shares of this process's cores, involuntary context switches.
    host_load_avg_1m: float = math.nan
    host_steal_frac: float = math.nan
    host_busy_frac: float = math.nan
    host_involuntary_switches: float = math.nan
    # Peak resident memory of the worker process over the trial (workloads/hoststate.py;
    # set by the sweep's worker, sweeper/sweep/workers.py): a trial near the host's memory
    # is a noisy one.
    worker_rss_peak_bytes: float = math.nan
    # Efficiency: mfu = model_flops / (n_chips * peak_flops_per_chip * seconds).
    prefill_mfu: float = math.nan
    decode_mfu: float = math.nan
    # Cost: chip-seconds per token = n_chips * seconds / tokens processed (paper §4).
    prefill_cost_chip_s_per_token: float = math.nan
    decode_cost_chip_s_per_token: float = math.nan
    prefill_tokens_per_s: float = math.nan
    decode_tokens_per_s: float = math.nan
    # Memory per chip (bytes).
    weight_bytes_per_chip: float = math.nan
    kv_bytes_per_chip: float = math.nan
    peak_bytes_per_chip: float = math.nan
    # Communication per chip per forward pass (bytes), all collectives together.
    prefill_comm_bytes_per_chip: float = math.nan
    decode_comm_bytes_per_chip: float = math.nan
    # Analytical breakdown (cost model only; NaN when measured).
    prefill_compute_s: float = math.nan
    prefill_memory_s: float = math.nan
    prefill_comm_s: float = math.nan
    decode_compute_s: float = math.nan
    decode_memory_s: float = math.nan
    decode_comm_s: float = math.nan
    # Serving trials (a space's `serving:` block, workloads/serving/trial.py): one request
    # stream served with wall-clock arrivals; definitions as `sweeper serve`'s (docs/serving.md):
    # TTFT = first token - arrival, TPOT = (finish - first token) / (output tokens - 1),
    # percentiles over the requests; throughput and tokens over the span from the first
    # arrival to the last finish; goodput = SLO attainment x the offered rate.
    ttft_p50_s: float = math.nan
    ttft_p99_s: float = math.nan
    tpot_p50_s: float = math.nan
    tpot_p99_s: float = math.nan
    slo_attainment: float = math.nan       # share of requests meeting both SLOs
    goodput_rps: float = math.nan
    throughput_rps: float = math.nan
    tokens_per_s_per_chip: float = math.nan
    completed: float = math.nan            # requests answered
    cost_per_million_tokens: float = math.nan   # output tokens; the profile's price per chip-hour
    # The serving model's prediction of the same stream (workloads/serving/model.py `simulate`:
    # the trial's deployment, its requests, the hardware profile the worker was given),
    # analytical; NaN when the profile cannot price the deployment. Named as predictions are
    # (docs/architecture.md "Names"): `pred_<metric>` beside the measured `<metric>`.
    pred_ttft_p50_s: float = math.nan
    pred_ttft_p99_s: float = math.nan
    pred_tpot_p50_s: float = math.nan
    pred_tpot_p99_s: float = math.nan
    # Verification (engine with --verify).
    verify_max_abs_err: float = math.nan
    tokens_match: bool | None = None
    int8_max_logit_dev: float = math.nan
    fits: bool | None = None
    collectives: dict[str, list[CollectiveStat]] = field(default_factory=dict)  # per phase
    extra: dict[str, Any] = field(default_factory=dict)

    def metrics(self) -> dict[str, float]:
        """Every finite numeric field, flat: what MLflow logs and tables show."""
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool):
                out[f.name] = float(value)
            elif isinstance(value, (int, float)) and math.isfinite(value):
                out[f.name] = float(value)
        return out

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "Measurement":
        data = dict(data)
        data["collectives"] = {phase: [CollectiveStat(**c) for c in stats]
                               for phase, stats in data.get("collectives", {}).items()}
        return cls(**data)


# A serving trial's predictions beside its measurements (the serving model's, analytical).
SERVING_PREDICTIONS = ("pred_ttft_p50_s", "pred_ttft_p99_s", "pred_tpot_p50_s", "pred_tpot_p99_s")
# The measured metrics: a `pred_` field is a prediction of the metric it names, which the
# results table and MLflow already carry as `pred_<metric>` (sweeper/tracking/results.py),
# so it is not a metric of its own (no `pred_pred_` column, no objective on it).
METRIC_NAMES = tuple(f.name for f in dataclasses.fields(Measurement)
                     if f.type in ("float", "bool | None") and f.name not in SERVING_PREDICTIONS)
# What a serving trial reports (and only it): the metrics an objective or constraint of a
# space with a `serving:` block names (sweeper/spec/objectives.py).
SERVING_METRICS = ("ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s", "slo_attainment",
                   "goodput_rps", "throughput_rps", "tokens_per_s_per_chip", "completed",
                   "cost_per_million_tokens")
