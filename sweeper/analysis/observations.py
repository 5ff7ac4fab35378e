"""The one calibration observation, built by both sources (docs/calibration.md, "One pipeline").

An `Observation` is a measured value, its metric (seconds, or MFU against a published peak),
its uncertainty, its hold-out group and the cost-model calls that predict it
(`costmodel.PhaseCall`, the very calls `costmodel.predict` makes). Two sources build them:

  from_frame(df, base)          a study's trials (sweeper.tracking.results columns): two
                                observations per measured trial, prefill_s and decode_step_s
  from_measurements(points)     a CSV of numbers measured elsewhere (workloads/measurements.py)

Everything downstream — the fit (fit.py), the hold-out schemes and the noise floor
(holdout.py) — sees only observations, so a study and a CSV are calibrated by the same code.

A number may cover several calls (a row's "total" is a prefill and decode_steps decode
steps) and alternatives (ffn `wg`: the fastest of three weight-gathered layouts): its
latency is the minimum over `variant` of the sum of weight x latency of the variant's calls.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Hashable, Iterable, Mapping

import pandas as pd

from workloads import costmodel
from workloads.config import HardwareProfile, load_model
from workloads.layouts import PHASES, PhaseLayout
from workloads.trial import TrialConfig, nested_of

PHASE_METRIC = {"prefill": "prefill_s", "decode": "decode_step_s"}
METRICS = ("latency_s", "mfu")
# A trial's measured statistic per phase (benchmarks/results/calibration.md, "Which statistic"):
# "median" (the default) or "min" of its timed runs.
STATISTIC_COLUMNS = {"median": PHASE_METRIC,
                     "min": {"prefill": "prefill_s_min", "decode": "decode_step_s_min"}}
UNIT = HardwareProfile("unit", peak_flops=1.0, hbm_bandwidth=1.0, hbm_bytes=1.0, ici_bandwidth=1.0)


@dataclass(frozen=True)
class Call:
    """One cost-model call of an observation: latency += weight x call's latency (variant's sum)."""

    weight: float
    variant: int
    call: costmodel.PhaseCall


@dataclass
class Observation:
    """A measured number and everything needed to predict it and to hold it out."""

    measured: float                      # in `metric` units
    metric: str                          # "latency_s" or "mfu"
    phase: str                           # prefill | decode | total
    calls: tuple[Call, ...]
    group: Hashable                      # one run: its observations are held out together (loo)
    uncertainty: float = math.nan        # relative 95% CI half-width of `measured`; nan = unknown
    # the per-chip profile = fitted profile x scale: one share of a measured host for every
    # rate, or (peak, HBM, interconnect) multipliers for a point measured on other hardware
    # than the profile fitted (sheet ratios: benchmarks/world.py's pooled fits)
    scale: float | tuple[float, float, float] = 1.0
    flops: float = 0.0                   # unpadded model FLOPs the number covers (MFU numerator)
    published_peak: float = math.nan     # the peak an MFU number is quoted against
    trial: int = 0                       # a study's trial number, a CSV's configuration index
    config: TrialConfig | None = None    # a study's trial
    info: dict[str, Any] = field(default_factory=dict)   # descriptive columns (point frames)
    replicate: Hashable = None           # same configuration measured again: same key

    # --- what the hold-out schemes and rankings group by
    @property
    def chips(self) -> int:
        return self.calls[0].call.chips

    @property
    def layout(self) -> PhaseLayout:
        return self.calls[0].call.layout

    @property
    def layout_key(self) -> str:
        return self.info.get("layout") or str(self.layout)

    @property
    def shape_key(self) -> tuple:
        """Everything but the layouts: observations of one shape compete in the rankings."""
        i = self.info
        return (i.get("model"), i.get("weights"), i.get("input_len"), i.get("decode_steps"),
                i.get("batch"), self.chips)

    @property
    def replicate_key(self) -> Hashable:
        return self.replicate if self.replicate is not None else ("single", self.group, self.phase)

    @property
    def ci_rel(self) -> float:
        return self.uncertainty

    @property
    def measured_s(self) -> float:
        """The latency the number implies (an MFU number: its FLOPs at that MFU)."""
        return self.measured if self.metric == "latency_s" else latency_of(self, self.measured)


# ----------------------------------------------------------------------------- predicting


def rate_scales(scale: float | tuple[float, float, float]) -> tuple[float, float, float]:
    """(peak, HBM, interconnect) multipliers of an observation's `scale`."""
    return tuple(scale) if isinstance(scale, tuple) else (scale, scale, scale)


def scaled_profile(profile: HardwareProfile, scale) -> HardwareProfile:
    """`profile` as one observation's chip ran it (Observation.scale)."""
    if not isinstance(scale, tuple):
        return profile.scaled(scale)
    peak, hbm, ici = scale
    return dataclasses.replace(profile, peak_flops=profile.peak_flops * peak,
                               hbm_bandwidth=profile.hbm_bandwidth * hbm,
                               ici_bandwidth=profile.ici_bandwidth * ici)


def predict_latency(obs: Observation, profile: HardwareProfile) -> float:
    """The cost model's latency of the observation with `profile` (whole, unscaled)."""
    hw = scaled_profile(profile, obs.scale)
    sums: dict[int, float] = {}
    for c in obs.calls:
        sums[c.variant] = sums.get(c.variant, 0.0) + c.weight * c.call.predict(hw).latency_s
    return min(sums.values())


def metric_of(obs: Observation, latency):
    """The observation's metric from a latency: itself, or MFU against the published peak."""
    if obs.metric == "latency_s":
        return latency
    return obs.flops / (obs.chips * obs.published_peak * latency)


def latency_of(obs: Observation, mfu: float) -> float:
    return obs.flops / (obs.chips * obs.published_peak * mfu)


def predict_value(obs: Observation, profile: HardwareProfile) -> float:
    """The cost model's value of the observation's metric."""
    return float(metric_of(obs, predict_latency(obs, profile)))


# ----------------------------------------------------------------------------- a study


def _float(value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def config_of(row: Mapping, configs: Mapping[int, Mapping] | None) -> TrialConfig:
    """The trial a results row (or its stored config) describes; the row's flat columns are
    nested back by TrialConfig's own inverse (`nested_of`), so a trial field is read here
    as the sweep wrote it. The seed is what replicates differ by (holdout.noise_floor)."""
    number = int(row["number"])
    if configs and number in configs:
        return TrialConfig.from_dict(configs[number], validate=False).resolved()
    data = nested_of(row)
    data["model"] = load_model(row["model"])
    return TrialConfig.from_dict(data, validate=False).resolved()


def trial_scale(config: TrialConfig, row: Mapping, base: HardwareProfile) -> float:
    """The trial's per-chip share of `base`: recorded with the trial (`hardware_share`).

    Studies from before it was recorded: recovered from the compute time the sweep predicted
    (pred compute_s = FLOPs / (chips * peak_chip)); without a stored prediction, the whole
    profile split over the chips for a measured (host) profile, the profile itself otherwise."""
    recorded = _float(row.get("hardware_share"))
    if math.isfinite(recorded) and recorded > 0:
        return recorded
    calls = costmodel.phase_calls(config)
    for phase in PHASES:
        pred = _float(row.get(f"pred_{phase}_compute_s"))
        if math.isfinite(pred) and pred > 0:
            unit = calls[phase].predict(UNIT)
            return (unit.compute_s / pred) / base.peak_flops
    return 1.0 / config.chips if base.measured else 1.0


def trial_info(config: TrialConfig, phase: str) -> dict[str, Any]:
    layout = config.prefill if phase == "prefill" else config.decode
    experts = "/ep" if config.model.moe and config.experts == "ep" else ""   # docs/models.md
    return {"layout": f"{layout}{experts}", "ffn": layout.ffn, "attn": layout.attn,
            "topology": "x".join(map(str, config.mesh_shape)), "batch": config.batch,
            "model": config.model.name, "weights": config.weights, "experts": config.experts,
            "kv_cache": config.kv_cache,
            "input_len": config.input_len, "decode_steps": config.decode_steps,
            "seed": config.seed}


def from_config(config: TrialConfig, phase: str, measured_s: float, trial: int = 0,
                scale: float = 1.0, ci_rel: float = math.nan) -> Observation:
    """One measured phase time of a trial (`measured_s`: seconds of the prefill or one step)."""
    c = config
    replicate = (phase, c.model.name, c.weights, c.input_len, c.decode_steps, c.batch, c.chips,
                 tuple(c.mesh_shape), str(c.prefill), str(c.decode), c.experts, c.kv_cache)
    return Observation(measured_s, "latency_s", phase,
                       (Call(1.0, 0, costmodel.phase_calls(config)[phase]),), group=trial,
                       uncertainty=ci_rel, scale=scale, trial=trial, config=config,
                       info=trial_info(config, phase), replicate=replicate)


def from_frame(df: pd.DataFrame, base: HardwareProfile, configs: Mapping[int, Mapping] | None = None,
               sources: Iterable[str] = ("measured",), statistic: str = "median") -> list[Observation]:
    """Two observations (prefill_s, decode_step_s) per COMPLETE trial of an accepted source.
    `statistic`: which of a trial's timed-run statistics is its measurement (median or min)."""
    sources = tuple(sources)
    columns = STATISTIC_COLUMNS[statistic]
    out: list[Observation] = []
    for _, row in df.iterrows():
        if str(row.get("state", "COMPLETE")).upper() != "COMPLETE":
            continue
        if row.get("source") not in sources:
            continue
        config = config_of(row, configs)
        scale = trial_scale(config, row, base)
        for phase in PHASES:
            value = _float(row.get(columns[phase]))
            if math.isfinite(value) and value > 0:
                out.append(from_config(config, phase, value, int(row["number"]), scale,
                                       _float(row.get(f"{phase}_ci_rel"))))
    return out


# ----------------------------------------------------------------------------- a CSV


def from_measurements(points, published_peak: float) -> list[Observation]:
    """One observation per published number (workloads/measurements.py rows); the numbers of
    one run (a table's latency and MFU) share a group. MFU is read against `published_peak`
    (the chip's datasheet peak, paper §4), never a fitted one."""
    from workloads.measurements import configuration_key, row_calls

    groups: dict[tuple, int] = {}
    out = []
    for p in points:
        group = groups.setdefault(configuration_key(p), len(groups))
        calls = tuple(Call(w, v, call) for w, v, call in row_calls(p))
        flops = sum(c.weight * c.call.predict(UNIT).flops for c in calls if c.variant == 0)
        first = calls[0].call
        info = {"layout": f"{p.ffn}/{p.attn}", "ffn": p.ffn, "attn": p.attn,
                "topology": "x".join(map(str, first.topology)), "batch": p.batch,
                "model": p.model, "weights": p.weights, "input_len": p.input_len,
                "context": p.context, "decode_steps": p.decode_steps, "row": p.row,
                "source": p.source}
        out.append(Observation(p.measured, p.metric, p.phase, calls, group=group,
                               flops=flops, published_peak=published_peak, trial=group,
                               info=info))
    return out
