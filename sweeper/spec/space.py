"""Search spaces: a YAML file -> a validated `SearchSpace` -> Optuna distributions -> TrialConfigs.

A space file names a model, a hardware backend, the trial fields that stay fixed, the
parameters to search, what to optimise and under which constraints:

    name: quickstart
    model: tiny                      # preset, model YAML or HF config.json (relative to this file) or mapping
    hardware: host                   # host | devices | devices:<profile> | analytical:<profile or YAML>
    input_len: 32                    # any TrialConfig field not searched is fixed here
    decode_steps: 8
    params:                          # searched: batch chips topology weights input_len decode_steps
      batch: [4, 8, 16]              #   prefill_ffn prefill_attn decode_ffn decode_attn,
                                     #   ffn / attn (the same layout in both phases),
                                     #   pad_heads (auto | none | N: paper §4 head padding),
                                     #   pad_vocab (auto | none: vocabulary padding),
                                     #   kv_cache (bf16 | int8 | fp8), experts (tp | ep:
                                     #   a mixture-of-experts model, docs/models.md),
                                     #   serving_mode (aggregated | disaggregated: a
                                     #   serving trial's deployment), stages and
                                     #   prefill_chunk (a serving trial's pipeline stages
                                     #   and chunked prefill), and seed (replicates)
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
    retry_oom: false                 # also re-run one the kernel killed for memory
    memory_budget_bytes: 2GiB        # per chip, host only (feasibility check)
    resources: {GPU: 1}              # Ray resources per worker (devices; per host if hosts > 1)
    hosts: 2                         # JAX processes per trial (a fixed field or a param; default 1)
    verify: true                     # also compare each measured trial with the reference
    serving: {rate: 2, ttft: 1.0}    # serving trials: each trial serves this request stream
                                     #   (docs/space-files.md "Serving trials"; `sweeper plan
                                     #   --space` plans for the same block)

The trial fields, which of them can be searched, and what each accepts are declared once
on `TrialConfig` (workloads/trial.py); the lists below derive from its metadata. The
`hardware:`, `objectives:`/`constraints:` and `sampler:` entries are read by modules of
their own (backend.py, objectives.py, samplers.py).
Everything is checked here, before Ray, Optuna or MLflow start; each error is one
`ConfigError` line naming the file, the field, the value and what is accepted.
A sampled point becomes a `TrialConfig`; a point that cannot run for its shape raises
`ConfigError` from `trial_config` and the controller records it as a pruned trial.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

# The space file's parts, each in a module of its own (re-exported here for the schema):
from sweeper.spec.backend import HARDWARE_KINDS, HardwareSpec  # noqa: F401
from sweeper.spec.objectives import (ANALYTICAL_ONLY, DIRECTIONS, NUMERIC_METRICS,  # noqa: F401
                                      Constraint, Objective, parse_goals)
from sweeper.spec.samplers import SAMPLERS, SamplerSpec, sampler_class  # noqa: F401
from workloads.config import (ConfigError, ModelConfig, load_model, parse_quantity, parse_topology,
                              parse_yaml, read_text)
from workloads.costmodel import best_topology, factorizations
from workloads.layouts import PhaseLayout, stores_1d, validate_layouts
from workloads.serving.profile import block_profile, length_stats
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
                "constraints", "sampler", "trials", "parallel", "timeout_s", "max_retries", "retry_oom",
                "memory_budget_bytes", "resources", "verify", "serving")

GRID_LIMIT = 100_000

DEFAULTS = {"trials": 20, "parallel": 1, "timeout_s": 600.0, "max_retries": 1}


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
    retry_oom: bool = False                  # re-run a worker the kernel killed for memory
    memory_budget_bytes: float | None = None
    resources: Mapping[str, float] = field(default_factory=dict)
    verify: bool = False                     # measured trials also run the unsharded reference
    serving: Mapping[str, Any] | None = None  # the `serving:` block as read (parsed: fixed["serving"])
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
        cls = sampler_class(self.sampler.type)
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
            trial = dataclasses.replace(trial, topology=auto_topology(   # one stage's mesh
                trial.model, trial.stage_chips, trial.prefill, trial.decode, trial.batch))
        return trial.validate()     # a disaggregated serving trial: each slice on its half

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

    if fixed.get("serving") is not None:
        _serving_trials(fixed, searched, hardware, data, source)
    else:
        _no_serving_fields(fixed, searched, source)
    objectives, constraints = parse_goals(data, hardware.source, source,
                                          serving=fixed.get("serving") is not None)
    sampler = SamplerSpec.parse(data.get("sampler"), source)
    trials = integer("trials", data.get("trials", DEFAULTS["trials"]), source)
    parallel = integer("parallel", data.get("parallel", DEFAULTS["parallel"]), source)
    timeout_s = parse_quantity(data.get("timeout_s", DEFAULTS["timeout_s"]), "timeout_s", source)
    timeout_s = number("timeout_s", timeout_s, source, positive=True)
    max_retries = integer("max_retries", data.get("max_retries", DEFAULTS["max_retries"]), source,
                          minimum=0)
    budget = data.get("memory_budget_bytes")
    if budget is not None:
        budget = parse_quantity(budget, "memory_budget_bytes", source)   # (a quantity: 2GiB)
        budget = number("memory_budget_bytes", budget, source, positive=True)
    resources = data.get("resources") or {}
    if not isinstance(resources, Mapping):
        raise ConfigError("resources", resources, "a mapping such as {GPU: 1}", source)
    for key, value in resources.items():
        number(f"resources.{key}", value, source)
    description = data.get("description") or ""
    verify = boolean("verify", data.get("verify", False), source)
    retry_oom = boolean("retry_oom", data.get("retry_oom", False), source)
    serving = data.get("serving")
    if serving is not None and not isinstance(serving, Mapping):
        raise ConfigError("serving", serving, "a mapping of serving-workload fields "
                          "(rate or trace, input_len, output_len, ttft, tpot, ...)", source)

    space = SearchSpace(name=name, model=model, hardware=hardware, fixed=fixed, params=params,
                        objectives=objectives, constraints=constraints, sampler=sampler,
                        trials=trials, parallel=parallel, timeout_s=timeout_s,
                        max_retries=max_retries, retry_oom=retry_oom, memory_budget_bytes=budget,
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


def _serving_trials(fixed: dict[str, Any], searched: set[str], hardware: HardwareSpec,
                    data: Mapping, source: str | None) -> None:
    """A `serving:` block makes every trial a serving run (workloads/serving/trial.py): on a
    real mesh, one host, its prompt and answer lengths from the block. The trial's
    `input_len` and `decode_steps` become the longest prompt and answer - 1 (the memory
    check and the prediction size the slots for them)."""
    if hardware.kind == "analytical":
        raise ConfigError("hardware", data.get("hardware"), "host or devices for a space with a "
                          "serving: block (each trial is a real serving run; plan analytically with "
                          "`sweeper plan --space`)", source)
    for name in ("input_len", "decode_steps"):
        if name in searched or name in data:
            where = f"params.{name}" if name in searched else name
            raise ConfigError(where, (data.get("params") or {}).get(name, data.get(name)),
                              "no value: a serving trial's prompt and answer lengths are the "
                              "serving block's input_len and output_len", source)
    if hardware.kind != "host" and ("serving_mode" in searched
                                    or fixed.get("serving_mode") == "disaggregated"):
        raise ConfigError("serving_mode", fixed.get("serving_mode", "searched"), "aggregated "
                          "with hardware devices (disaggregated serving trials run on the "
                          "emulated mesh, hardware: host)", source)
    if "hosts" in searched or fixed.get("hosts", 1) != 1:
        raise ConfigError("hosts", fixed.get("hosts", "searched"), "1 (a serving trial runs "
                          "on one host)", source)
    if data.get("verify"):
        raise ConfigError("verify", data.get("verify"), "false (a serving trial serves a "
                          "stream; it runs no reference comparison)", source)
    if "pad_vocab" in searched or fixed.get("pad_vocab", "auto") != "auto":
        raise ConfigError("pad_vocab", fixed.get("pad_vocab", "searched"), "auto (the serving "
                          "engine pads the vocabulary to a multiple of the chips)", source)
    lengths = length_stats(block_profile(fixed["serving"], source))
    fixed["input_len"] = int(lengths["input_max"])
    fixed["decode_steps"] = int(lengths["output_max"]) - 1


# A serving trial's fields (their `serving_only` metadata): serving_mode, stages, prefill_chunk.
SERVING_ONLY = tuple(name for name, f in TRIAL_FIELDS.items() if f.metadata.get("serving_only"))


def _no_serving_fields(fixed: Mapping[str, Any], searched: set[str], source: str | None) -> None:
    """A space without a `serving:` block neither searches a serving trial's field nor fixes
    it to another value than its default."""
    for name in SERVING_ONLY:
        default = TRIAL_FIELDS[name].default
        if name in searched or fixed.get(name, default) != default:
            raise ConfigError(name, fixed.get(name, "searched"), f"its default {default!r} "
                              "without a serving: block (a serving trial's field: it shapes "
                              "the deployment that serves the stream)", source)


def _parse_params(spec: Any, fixed: Mapping[str, Any], source: str | None) -> tuple[Param, ...]:
    if not isinstance(spec, Mapping):
        raise ConfigError("params", spec, f"a mapping from {list(PARAM_NAMES)} to choices or ranges",
                          source)
    params = []
    for name, param_spec in spec.items():
        one_of("params", name, PARAM_NAMES, source, "a searchable field, one of", suggest=True)
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
