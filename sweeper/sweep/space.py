"""Search spaces: a YAML file -> a validated `SearchSpace` -> Optuna distributions -> TrialConfigs.

A space file names a model, a hardware backend, the trial fields that stay fixed, the
parameters to search, what to optimise and under which constraints:

    name: quickstart
    model: tiny                      # preset, model YAML (relative to this file) or mapping
    hardware: host                   # host | devices | devices:<profile> | analytical:<profile or YAML>
    input_len: 32                    # any TrialConfig field not searched is fixed here
    decode_steps: 8
    params:                          # searched: batch chips topology weights input_len decode_steps
      batch: [4, 8, 16]              #   prefill_ffn prefill_attn decode_ffn decode_attn,
                                     #   ffn / attn (the same layout in both phases),
                                     #   pad_heads (auto | none | N: paper §4 head padding),
                                     #   and seed (replicates)
      chips: {choices: [1, 2, 4]}    # categorical (a list is shorthand for choices)
      input_len: {low: 16, high: 256, log: true}   # integer range (optional log, step)
      decode_ffn: [ws1d, ws2d]
    objectives:                      # one or more; metric = a numeric Measurement field
      - {metric: decode_step_s, direction: minimize}
      - {metric: decode_cost_chip_s_per_token, direction: minimize}
    constraints: ["decode_step_s <= 0.05"]
    sampler: {type: tpe, seed: 0}    # tpe | nsga2 | gp | random | grid (+ options: {...})
    trials: 20
    parallel: 2                      # trials in flight at once (one Ray worker each)
    timeout_s: 300                   # per trial
    max_retries: 1                   # re-runs of a trial whose worker died
    memory_budget_bytes: 2GiB        # per chip, host only (feasibility check)
    resources: {GPU: 1}              # Ray resources per worker (devices; per host if hosts > 1)
    hosts: 2                         # JAX processes per trial (a fixed field or a param; default 1)
    verify: true                     # also compare each measured trial with the reference
    serving: {rate: 2, ttft: 1.0}    # the serving workload a plan is made for (kept as read;
                                     #   sweeper.serving.workload.profile_from_dict parses it)

The trial fields, which of them can be searched, and what each accepts are declared once
on `TrialConfig` (workloads/trial.py); the lists below derive from its metadata.
Everything is checked here, before Ray, Optuna or MLflow start; each error is one
`ConfigError` line naming the file, the field, the value and what is accepted.
A sampled point becomes a `TrialConfig`; a point that cannot run for its shape raises
`ConfigError` from `trial_config` and the controller records it as a pruned trial.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import itertools
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from workloads.config import (ConfigError, HardwareProfile, ModelConfig, load_model,
                              parse_quantity, parse_topology, parse_yaml,
                              read_text)
from workloads.costmodel import best_topology, factorizations
from workloads.hardware import HOST, load_hardware
from workloads.layouts import PhaseLayout, stores_1d, validate_layouts
from workloads.metrics import METRIC_NAMES, Measurement
from workloads.trial import (FIELDS, FLAT_BY_NAME, PHASE_PARTS, REQUIRED, SEARCHABLE, TRIAL_FIELDS,
                             FlatParam, TrialConfig, flat_params_of, parse_field)
from workloads.validate import boolean, check_keys as _check_keys, integer, number, one_of

# What can be searched: TrialConfig's searchable flat parameters, plus `ffn` / `attn`,
# which set the layout of both phases at once (e.g. Figure 6 compares ws1d and ws2d with the
# same layout in prefill and decode).
SEARCHED: dict[str, FlatParam] = {**{name: FLAT_BY_NAME[name] for name in SEARCHABLE},
                                  **{part: FlatParam(part, "prefill", part) for part in PHASE_PARTS}}
PARAM_NAMES = tuple(SEARCHED)
INT_PARAMS = tuple(name for name, p in SEARCHED.items() if p.integer)   # (seed: replicates)
LAYOUT_PARAMS = {name: p.choices for name, p in SEARCHED.items() if p.part}
AUTO_TOPOLOGY = "auto"   # the cost model's best split (TrialConfig.topology = None)

# Trial fields that a space file may fix (the model is the space's own `model`).
FIXED_FIELDS = tuple(name for name in FIELDS if name != "model")
SPACE_FIELDS = ("name", "description", "model", "hardware", "params", "objectives",
                "constraints", "sampler", "trials", "parallel", "timeout_s", "max_retries",
                "memory_budget_bytes", "resources", "verify", "serving")

HARDWARE_KINDS = ("host", "devices", "analytical")
SAMPLERS = ("tpe", "nsga2", "gp", "random", "grid", "guided")   # guided: sweeper/sweep/guided.py
DIRECTIONS = ("minimize", "maximize")
# Numeric metrics an objective or constraint may name (booleans like `fits` are not targets).
NUMERIC_METRICS = tuple(f for f in METRIC_NAMES
                        if Measurement.__dataclass_fields__[f].type == "float")
# The analytical breakdown exists only in cost-model predictions, never in measurements.
ANALYTICAL_ONLY = tuple(f"{p}_{k}_s" for p in ("prefill", "decode") for k in ("compute", "memory", "comm"))
GRID_LIMIT = 100_000

DEFAULTS = {"trials": 20, "parallel": 1, "timeout_s": 600.0, "max_retries": 1}
DEFAULT_OBJECTIVES = (("decode_step_s", "minimize"), ("decode_cost_chip_s_per_token", "minimize"))


# ----------------------------------------------------------------------------- helpers


def _one_of(field: str, value: Any, choices, source: str | None, what: str = "one of") -> Any:
    return one_of(field, value, choices, source, what, suggest=True)


def _positive_number(value: Any, field: str, source: str | None) -> float:
    """A positive number, or a quantity with a unit (2GiB)."""
    return number(field, parse_quantity(value, field, source), source, positive=True)


# ----------------------------------------------------------------------------- parts


@dataclass(frozen=True)
class Param:
    """One searched parameter: categorical `choices`, or an integer range low..high."""

    name: str
    choices: tuple | None = None
    low: int | None = None
    high: int | None = None
    log: bool = False
    step: int = 1

    def distribution(self):
        from optuna.distributions import CategoricalDistribution, IntDistribution   # lazy: Optuna (~1 s)

        if self.choices is not None:
            return CategoricalDistribution(self.choices)
        return IntDistribution(self.low, self.high, log=self.log, step=self.step)

    def grid_values(self) -> list:
        """Every value a grid search visits (a log range visits low, 2*low, 4*low, ...)."""
        if self.choices is not None:
            return list(self.choices)
        if self.log:
            values, v = [], self.low
            while v <= self.high:
                values.append(v)
                v *= 2
            return values
        return list(range(self.low, self.high + 1, self.step))

    @classmethod
    def parse(cls, name: str, spec: Any, source: str | None) -> "Param":
        where = f"params.{name}"
        if isinstance(spec, (list, tuple)):
            spec = {"choices": list(spec)}
        if not isinstance(spec, Mapping):
            raise ConfigError(where, spec, "a list of choices, {choices: [...]} or "
                              "{low: .., high: .., log: .., step: ..}", source)
        allowed = ["choices"] if "choices" in spec else ["low", "high", "log", "step"]
        _check_keys(spec, allowed, source, f"{where}.")
        if "choices" in spec:
            choices = spec["choices"]
            if not isinstance(choices, (list, tuple)) or not choices:
                raise ConfigError(f"{where}.choices", choices, "a non-empty list", source)
            values = tuple(_param_value(name, v, f"{where}.choices", source) for v in choices)
            if len(set(values)) != len(values):
                raise ConfigError(f"{where}.choices", list(choices), "a list without repeats", source)
            return cls(name, choices=values)
        if name not in INT_PARAMS:
            raise ConfigError(where, dict(spec), f"{{choices: [...]}} ({name} is categorical; "
                              f"integer ranges are for {list(INT_PARAMS)})", source)
        for key in ("low", "high"):
            if key not in spec:
                raise ConfigError(f"{where}.{key}", None, "an integer (required for a range)", source)
        minimum = SEARCHED[name].minimum
        low = integer(f"{where}.low", spec["low"], source, minimum)
        high = integer(f"{where}.high", spec["high"], source, minimum)
        if high < low:
            raise ConfigError(f"{where}.high", high, f"an integer >= low={low}", source)
        log = boolean(f"{where}.log", spec.get("log", False), source)
        step = integer(f"{where}.step", spec.get("step", 1), source)
        if log and step != 1:
            raise ConfigError(f"{where}.step", step, "1 (Optuna's log ranges take no step)", source)
        if log and low < 1:
            raise ConfigError(f"{where}.low", low, "an integer >= 1 for a log range", source)
        return cls(name, low=low, high=high, log=log, step=step)


def _param_value(name: str, value: Any, field: str, source: str | None):
    """Check one candidate value of a searched parameter (as TrialConfig checks the field)."""
    if name == "topology":      # Optuna choices must be scalars: XxYxZ or auto
        if value == AUTO_TOPOLOGY:
            return value
        x, y, z = parse_topology(value, None, field, source)
        return f"{x}x{y}x{z}"
    return SEARCHED[name].check(value, field, source)


@dataclass(frozen=True)
class Objective:
    metric: str
    direction: str = "minimize"

    @classmethod
    def parse(cls, spec: Any, index: int, source: str | None) -> "Objective":
        where = f"objectives[{index}]"
        if isinstance(spec, str):
            spec = {"metric": spec}
        if not isinstance(spec, Mapping):
            raise ConfigError(where, spec, "{metric: <Measurement field>, direction: minimize|maximize}",
                              source)
        _check_keys(spec, ["metric", "direction"], source, f"{where}.")
        if "metric" not in spec:
            raise ConfigError(f"{where}.metric", None, "a numeric Measurement field (required)", source)
        metric = _one_of(f"{where}.metric", spec["metric"], NUMERIC_METRICS, source,
                         "a numeric Measurement field:")
        direction = _one_of(f"{where}.direction", spec.get("direction", "minimize"), DIRECTIONS,
                            source)
        return cls(metric, direction)


_CONSTRAINT = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_]*)\s*(<=|>=|<|>)\s*(\S.*?)\s*$")


@dataclass(frozen=True)
class Constraint:
    """`metric <= bound` or `metric >= bound`; Optuna's convention: value <= 0 is feasible."""

    metric: str
    op: str
    bound: float
    text: str

    def value(self, metrics: Mapping[str, float]) -> float:
        got = metrics.get(self.metric, math.nan)
        if got is None or not math.isfinite(got):
            return math.inf     # a metric the trial did not report cannot satisfy anything
        return got - self.bound if self.op in ("<=", "<") else self.bound - got

    @classmethod
    def parse(cls, spec: Any, index: int, source: str | None) -> "Constraint":
        where = f"constraints[{index}]"
        match = _CONSTRAINT.match(spec) if isinstance(spec, str) else None
        if not match:
            raise ConfigError(where, spec, "'<metric> <= <number>' or '<metric> >= <number>', "
                              "e.g. 'decode_step_s <= 0.05'", source)
        metric = _one_of(f"{where}.metric", match.group(1), NUMERIC_METRICS, source,
                         "a numeric Measurement field:")
        bound = parse_quantity(match.group(3), f"{where}.bound", source)
        return cls(metric, match.group(2), bound, spec.strip())


@dataclass(frozen=True)
class SamplerSpec:
    type: str = "tpe"
    seed: int | None = 0
    options: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def parse(cls, spec: Any, source: str | None) -> "SamplerSpec":
        if spec is None:
            return cls()
        if isinstance(spec, str):
            spec = {"type": spec}
        if not isinstance(spec, Mapping):
            raise ConfigError("sampler", spec, "{type: tpe|nsga2|gp|random|grid, seed: N}", source)
        _check_keys(spec, ["type", "seed", "options"], source, "sampler.")
        kind = _one_of("sampler.type", spec.get("type", "tpe"), SAMPLERS, source)
        seed = spec.get("seed", 0)
        if seed is not None:
            seed = integer("sampler.seed", seed, source, minimum=0)
        options = spec.get("options") or {}
        if not isinstance(options, Mapping):
            raise ConfigError("sampler.options", options, "a mapping of sampler arguments", source)
        if kind == "gp" and importlib.util.find_spec("torch") is None:
            raise ConfigError("sampler.type", kind, "tpe, nsga2, random or grid (Optuna's GP "
                              "sampler needs PyTorch: pip install torch)", source)
        allowed = _sampler_arguments(kind)
        _check_keys(options, allowed, source, "sampler.options.")
        return cls(kind, seed, dict(options))


def _sampler_class(kind: str):
    import optuna   # lazy: Optuna + SQLAlchemy take ~1 s; bad input exits first

    class GridSampler(optuna.samplers.GridSampler):
        """Optuna's grid sampler calls `study.stop()` once the grid is used up, which only
        works inside `study.optimize`; our ask/tell loop stops by trial count instead."""

        def after_trial(self, study, trial, state, values) -> None:
            pass

    from sweeper.sweep.guided import GuidedSampler   # lazy: guided imports Optuna at top

    return {"tpe": optuna.samplers.TPESampler, "nsga2": optuna.samplers.NSGAIISampler,
            "gp": optuna.samplers.GPSampler, "random": optuna.samplers.RandomSampler,
            "grid": GridSampler, "guided": GuidedSampler}[kind]


def _sampler_arguments(kind: str) -> list[str]:
    """Keyword arguments a sampler accepts from `options` (seed and search_space are ours)."""
    reserved = {"self", "seed", "search_space", "constraints_func"}
    params = inspect.signature(_sampler_class(kind).__init__).parameters
    return [p for p in params if p not in reserved]


@dataclass(frozen=True)
class HardwareSpec:
    """Where trials run: `host` (emulated mesh), `devices` (real accelerators), `analytical`."""

    kind: str
    profile: str | None = None     # analytical / devices: the cost model's hardware profile
    base_dir: str | None = None    # where a relative profile YAML is looked up

    @property
    def source(self) -> str:
        """The Measurement source this backend produces."""
        return "analytical" if self.kind == "analytical" else "measured"

    @property
    def label(self) -> str:
        return f"{self.kind}:{self.profile}" if self.profile else self.kind

    def profile_spec(self) -> str:
        """The profile as `load_hardware` takes it (a relative YAML resolved against the space)."""
        spec = self.profile or "host"
        if spec.endswith((".yaml", ".yml")) and self.base_dir and not Path(spec).is_absolute():
            candidate = Path(self.base_dir) / spec
            if candidate.is_file() or not Path(spec).is_file():
                return str(candidate)
        return spec

    def resolve(self, source: str | None = None) -> HardwareProfile | None:
        """The cost model's profile of a sweep: `host` measured (cached), a preset/YAML, or none."""
        if self.kind == "host":
            return load_hardware(HOST)
        return self.load_profile(source) if self.profile else None

    def load_profile(self, source: str | None = None) -> HardwareProfile:
        """The cost model's profile (for `host`: measured once per host and cached)."""
        return load_hardware(self.profile_spec(), source=source, field="hardware")

    @classmethod
    def parse(cls, spec: Any, source: str | None) -> "HardwareSpec":
        base_dir = str(Path(source).parent) if source else None
        if not isinstance(spec, str) or not spec:
            raise ConfigError("hardware", spec, "host, devices, devices:<profile> or "
                              "analytical:<profile or YAML>", source)
        kind, _, profile = spec.partition(":")
        kind = _one_of("hardware", kind, HARDWARE_KINDS, source)
        profile = profile.strip() or None
        if kind == "host" and profile:
            raise ConfigError("hardware", spec, "host (an emulated mesh is measured on this "
                              "host; write analytical:<profile> for a cost-model sweep)", source)
        if kind == "analytical" and not profile:
            raise ConfigError("hardware", spec, "analytical:<profile or YAML>, e.g. "
                              "analytical:tpu-v4", source)
        hardware = cls(kind, profile, base_dir)
        if profile and profile != "host":
            hardware.load_profile(source)     # a bad preset or YAML fails now, with a suggestion
        return hardware


# ----------------------------------------------------------------------------- the space


@dataclass(frozen=True)
class SearchSpace:
    name: str
    model: ModelConfig
    hardware: HardwareSpec
    fixed: Mapping[str, Any]                 # fixed TrialConfig fields (as in the YAML)
    params: tuple[Param, ...]
    objectives: tuple[Objective, ...]
    constraints: tuple[Constraint, ...] = ()
    sampler: SamplerSpec = field(default_factory=SamplerSpec)
    trials: int = DEFAULTS["trials"]
    parallel: int = DEFAULTS["parallel"]
    timeout_s: float = DEFAULTS["timeout_s"]
    max_retries: int = DEFAULTS["max_retries"]
    memory_budget_bytes: float | None = None
    resources: Mapping[str, float] = field(default_factory=dict)
    verify: bool = False                     # measured trials also run the unsharded reference
    serving: Mapping[str, Any] | None = None  # the `serving:` block as read (sweeper.serving parses it)
    description: str = ""
    source: str | None = None                # the space file
    text: str | None = None                  # its contents (logged as an MLflow artifact)

    # --------------------------------------------------------------- Optuna side
    @property
    def directions(self) -> list[str]:
        return [o.direction for o in self.objectives]

    @property
    def metric_names(self) -> list[str]:
        return [o.metric for o in self.objectives]

    def distributions(self) -> dict:
        """Optuna distributions of the searched parameters (for `study.ask`)."""
        return {p.name: p.distribution() for p in self.params}

    def grid(self) -> dict[str, list]:
        return {p.name: p.grid_values() for p in self.params}

    def grid_size(self) -> int:
        return math.prod(len(v) for v in self.grid().values()) if self.params else 1

    def planned_trials(self) -> int:
        """`trials`, capped at the grid size for a grid search (each point once)."""
        if self.sampler.type == "grid":
            return min(self.trials, self.grid_size())
        return self.trials

    def make_sampler(self):
        cls = _sampler_class(self.sampler.type)
        kwargs = dict(self.sampler.options)
        if self.sampler.type == "grid":
            return cls(self.grid(), seed=self.sampler.seed, **kwargs)
        if self.sampler.type == "guided":     # seeds from the cost model need the space
            return cls(self, seed=self.sampler.seed, **kwargs)
        return cls(seed=self.sampler.seed, **kwargs)

    # --------------------------------------------------------------- trials
    def trial_dict(self, params: Mapping[str, Any]) -> dict[str, Any]:
        """Fixed fields + one sampled point, as `TrialConfig.from_dict` takes them."""
        data: dict[str, Any] = {k: v for k, v in self.fixed.items()}
        data["model"] = self.model
        for phase in ("prefill", "decode"):
            layout = dict(data.get(phase) or {})
            for part in ("ffn", "attn"):
                for name in (part, f"{phase}_{part}"):
                    if name in params:
                        layout[part] = params[name]
            data[phase] = layout
        for name, param in SEARCHED.items():
            if param.part is None and name in params:
                data[name] = params[name]
        if data.get("topology") == AUTO_TOPOLOGY:
            data["topology"] = None
        return data

    def trial_config(self, params: Mapping[str, Any]) -> TrialConfig:
        """The TrialConfig of a sampled point, topology resolved; ConfigError if it cannot run."""
        # No file name in these errors: they become a pruned trial's reason, about the point.
        trial = TrialConfig.from_dict(self.trial_dict(params), source=None, validate=False)
        if trial.topology is None:
            trial = dataclasses.replace(trial, topology=auto_topology(
                trial.model, trial.chips, trial.prefill, trial.decode, trial.batch))
        return trial.validate()

    def flat_params(self, params: Mapping[str, Any]) -> dict[str, Any]:
        """Best-effort flat parameters of a point, also for points that are not valid trials."""
        data = self.trial_dict(params)
        topology = data.get("topology")
        if isinstance(topology, (list, tuple)):
            topology = "x".join(str(v) for v in topology)
        return flat_params_of({**data, "model": self.model.name, "topology": topology or AUTO_TOPOLOGY})

    def summary(self) -> dict[str, Any]:
        return {"name": self.name, "model": self.model.name, "hardware": self.hardware.label,
                "params": {p.name: (list(p.choices) if p.choices is not None else
                                    {"low": p.low, "high": p.high, "log": p.log, "step": p.step})
                           for p in self.params},
                "objectives": [f"{o.direction} {o.metric}" for o in self.objectives],
                "constraints": [c.text for c in self.constraints],
                "sampler": self.sampler.type, "trials": self.planned_trials(),
                "parallel": self.parallel}


def auto_topology(model: ModelConfig, chips: int, prefill: PhaseLayout, decode: PhaseLayout,
                  batch: int) -> tuple[int, int, int]:
    """`topology: auto`: the cost model's best ws2d split (App. A.2.1), except when ws1d is
    mixed with another FFN layout: that needs X = 1 (layouts.py), so take the most balanced
    1 x Y x Z that the layouts accept."""
    mixed_1d = "ws1d" in (prefill.ffn, decode.ffn) and not stores_1d(prefill, decode)
    if not mixed_1d:
        return best_topology(model, chips)
    candidates = sorted((t for t in factorizations(chips) if t[0] == 1 and t[1] >= t[2]),
                        key=lambda t: t[1] - t[2])
    for topology in candidates:
        try:
            validate_layouts(model, topology, prefill, decode, batch)
            return topology
        except ConfigError:
            continue
    return candidates[0]


def load_space(spec: Any, source: str | None = None) -> SearchSpace:
    """A space file path (or an already-read mapping) -> a validated SearchSpace."""
    if isinstance(spec, SearchSpace):
        return spec
    text = None
    if isinstance(spec, (str, Path)):
        source = str(spec)
        text = read_text(spec)              # one read: the text is logged with the sweep
        data = parse_yaml(text, source)
    else:
        data = spec
    if not isinstance(data, Mapping):
        raise ConfigError("space", type(data).__name__, "a mapping of search-space fields", source)
    _check_keys(data, list(SPACE_FIELDS) + list(FIXED_FIELDS), source)

    name = data.get("name") or (Path(source).stem if source else None)
    # (the study is named <name>-<date-time>: a study name is at most 100 characters)
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,79}", name):
        raise ConfigError("name", name, "a name of at most 80 letters, digits, '-', '_' or '.'",
                          source)
    if "model" not in data:
        raise ConfigError("model", None, "a model preset, a model YAML or a mapping (required)", source)
    model_spec = data["model"]
    if isinstance(model_spec, str) and model_spec.endswith((".yaml", ".yml")) and source:
        candidate = Path(source).parent / model_spec
        model_spec = str(candidate) if candidate.is_file() else model_spec
    model = load_model(model_spec, source=source)
    hardware = HardwareSpec.parse(data.get("hardware", "host"), source)

    fixed = _parse_fixed(data, source)
    params = _parse_params(data.get("params") or {}, fixed, source)
    searched = {p.name for p in params}
    for required in (name for name in REQUIRED if name != "model"):
        if required not in fixed and required not in searched:
            raise ConfigError(required, None, f"a fixed value or an entry under params "
                              f"({required} is required)", source)

    objectives_spec = data.get("objectives")
    if objectives_spec is None:
        objectives = tuple(Objective(m, d) for m, d in DEFAULT_OBJECTIVES)
    else:
        if isinstance(objectives_spec, (str, Mapping)):
            objectives_spec = [objectives_spec]
        if not isinstance(objectives_spec, list) or not objectives_spec:
            raise ConfigError("objectives", objectives_spec, "a non-empty list of "
                              "{metric, direction}", source)
        objectives = tuple(Objective.parse(o, i, source) for i, o in enumerate(objectives_spec))
    if len({o.metric for o in objectives}) != len(objectives):
        raise ConfigError("objectives", [o.metric for o in objectives], "distinct metrics", source)
    constraints_spec = data.get("constraints") or []
    if isinstance(constraints_spec, str):
        constraints_spec = [constraints_spec]
    if not isinstance(constraints_spec, list):
        raise ConfigError("constraints", constraints_spec, "a list such as ['decode_step_s <= 0.05']",
                          source)
    constraints = tuple(Constraint.parse(c, i, source) for i, c in enumerate(constraints_spec))
    if hardware.source == "measured":
        for where, metric in ([(f"objectives[{i}].metric", o.metric) for i, o in enumerate(objectives)]
                              + [(f"constraints[{i}]", c.metric) for i, c in enumerate(constraints)]):
            if metric in ANALYTICAL_ONLY:
                raise ConfigError(where, metric, "a metric that a measured trial reports "
                                  f"({metric} exists only in cost-model predictions)", source)

    sampler = SamplerSpec.parse(data.get("sampler"), source)
    trials = integer("trials", data.get("trials", DEFAULTS["trials"]), source)
    parallel = integer("parallel", data.get("parallel", DEFAULTS["parallel"]), source)
    timeout_s = _positive_number(data.get("timeout_s", DEFAULTS["timeout_s"]), "timeout_s", source)
    max_retries = integer("max_retries", data.get("max_retries", DEFAULTS["max_retries"]), source,
                          minimum=0)
    budget = data.get("memory_budget_bytes")
    budget = None if budget is None else _positive_number(budget, "memory_budget_bytes", source)
    resources = data.get("resources") or {}
    if not isinstance(resources, Mapping):
        raise ConfigError("resources", resources, "a mapping such as {GPU: 1}", source)
    for key, value in resources.items():
        number(f"resources.{key}", value, source)
    description = data.get("description") or ""
    verify = boolean("verify", data.get("verify", False), source)
    serving = data.get("serving")
    if serving is not None and not isinstance(serving, Mapping):
        raise ConfigError("serving", serving, "a mapping of serving-workload fields "
                          "(rate or trace, input_len, output_len, ttft, tpot, ...)", source)

    space = SearchSpace(name=name, model=model, hardware=hardware, fixed=fixed, params=params,
                        objectives=objectives, constraints=constraints, sampler=sampler,
                        trials=trials, parallel=parallel, timeout_s=timeout_s,
                        max_retries=max_retries, memory_budget_bytes=budget,
                        resources=dict(resources), verify=verify,
                        serving=dict(serving) if serving is not None else None,
                        description=str(description).strip(),
                        source=source, text=text)
    if sampler.type == "grid" and space.grid_size() > GRID_LIMIT:
        raise ConfigError("sampler.type", "grid", f"tpe, nsga2 or random for a space of "
                          f"{space.grid_size()} points (grid search is limited to {GRID_LIMIT})",
                          source)
    try:
        space.make_sampler()     # sampler options are checked by the sampler itself
    except (TypeError, ValueError) as err:
        raise ConfigError("sampler.options", dict(sampler.options), f"arguments "
                          f"{type(err).__name__} accepts ({err})", source) from None
    _check_some_point_runs(space)
    return space


MAX_CHECKED_POINTS = 256


def checked_points(space: SearchSpace, grids: list[list] | None = None):
    """Each point of `grids` (one list of values per searched parameter, in order; default
    the whole grid) as its TrialConfig, or the ConfigError saying why it cannot run (also
    sweeper/sweep/preflight.py's memory check)."""
    names = [p.name for p in space.params]
    for values in itertools.product(*(grids if grids is not None else
                                      [p.grid_values() for p in space.params])):
        try:
            yield space.trial_config(dict(zip(names, values)))
        except ConfigError as err:
            yield err


def _check_some_point_runs(space: SearchSpace) -> None:
    """Reject a space none of whose points can run for its shape (e.g. a fixed batch that
    batch-sharded attention cannot split over the chips): a sweep of it would prune every
    trial. Checked when the grid is small and is the whole space (no log ranges)."""
    if any(p.log for p in space.params) or space.grid_size() > MAX_CHECKED_POINTS:
        return
    first: ConfigError | None = None
    for point in checked_points(space):
        if not isinstance(point, ConfigError):
            return
        first = first or point
    if first is not None:
        raise ConfigError(first.field, first.value, f"{first.accepted} (no point of this space "
                          "can run)", space.source)


def _parse_fixed(data: Mapping, source: str | None) -> dict[str, Any]:
    """The trial fields the file fixes, each checked as TrialConfig checks it (a phase layout
    keeps only the parts the file names: a param may search the others)."""
    fixed: dict[str, Any] = {}
    for key in FIXED_FIELDS:       # in field order: chips is known before topology
        if key not in data:
            continue
        value = data[key]
        if key == "topology" and value in (None, AUTO_TOPOLOGY):
            continue
        parsed = parse_field(key, value, source, context=fixed)
        if TRIAL_FIELDS[key].metadata.get("parts"):
            parsed = {part: getattr(parsed, part) for part in PHASE_PARTS if part in value}
        elif key == "topology":
            parsed = list(parsed)
        fixed[key] = parsed
    return fixed


def _parse_params(spec: Any, fixed: Mapping[str, Any], source: str | None) -> tuple[Param, ...]:
    if not isinstance(spec, Mapping):
        raise ConfigError("params", spec, f"a mapping from {list(PARAM_NAMES)} to choices or ranges",
                          source)
    params = []
    for name, param_spec in spec.items():
        _one_of("params", name, PARAM_NAMES, source, "a searchable field, one of")
        phase, _, part = name.partition("_")
        if name in fixed or (part in ("ffn", "attn") and part in (fixed.get(phase) or {})):
            raise ConfigError(f"params.{name}", param_spec, f"a field that is not also fixed "
                              f"(remove the fixed {name if name in fixed else phase + '.' + part})",
                              source)
        if name in ("ffn", "attn"):
            clash = [f"params.{p}_{name}" for p in ("prefill", "decode") if f"{p}_{name}" in spec]
            clash += [f"{p}.{name}" for p in ("prefill", "decode") if name in (fixed.get(p) or {})]
            if clash:
                raise ConfigError(f"params.{name}", param_spec, f"either {name} (both phases) or "
                                  f"the per-phase field, not both (also set: {', '.join(clash)})",
                                  source)
        params.append(Param.parse(name, param_spec, source))
    return tuple(params)
