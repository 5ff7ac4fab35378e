"""What a sweep optimises and under which constraints: a space file's `objectives:` and
`constraints:` (sweeper/spec/space.py loads the rest of the file).

    objectives:                      # one or more; metric = a numeric Measurement field
      - {metric: decode_step_s, direction: minimize}
    constraints: ["decode_step_s <= 0.05"]

A space with a `serving:` block runs serving trials (docs/space-files.md, "Serving trials"):
its objectives and constraints name serving metrics (`SERVING_METRICS`: ttft_p99_s,
goodput_rps, ...; default: TTFT p99 and TPOT p99, both minimised), and a space without one
cannot name them (its trials do not serve a stream).

Each error is one `ConfigError` line naming the file, the field, the value and what is accepted.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Mapping

from workloads.config import ConfigError, parse_quantity
from workloads.metrics import METRIC_NAMES, SERVING_METRICS, Measurement
from workloads.validate import check_keys, one_of

DIRECTIONS = ("minimize", "maximize")
# Numeric metrics an objective or constraint may name (booleans like `fits` are not targets).
NUMERIC_METRICS = tuple(f for f in METRIC_NAMES
                        if Measurement.__dataclass_fields__[f].type == "float")
# The analytical breakdown exists only in cost-model predictions, never in measurements.
ANALYTICAL_ONLY = tuple(f"{p}_{k}_s" for p in ("prefill", "decode") for k in ("compute", "memory", "comm"))
DEFAULT_OBJECTIVES = (("decode_step_s", "minimize"), ("decode_cost_chip_s_per_token", "minimize"))
DEFAULT_SERVING_OBJECTIVES = (("ttft_p99_s", "minimize"), ("tpot_p99_s", "minimize"))


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
        check_keys(spec, ["metric", "direction"], source, f"{where}.")
        if "metric" not in spec:
            raise ConfigError(f"{where}.metric", None, "a numeric Measurement field (required)", source)
        metric = one_of(f"{where}.metric", spec["metric"], NUMERIC_METRICS, source,
                        "a numeric Measurement field:", suggest=True)
        direction = one_of(f"{where}.direction", spec.get("direction", "minimize"), DIRECTIONS,
                           source, suggest=True)
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
        metric = one_of(f"{where}.metric", match.group(1), NUMERIC_METRICS, source,
                        "a numeric Measurement field:", suggest=True)
        bound = parse_quantity(match.group(3), f"{where}.bound", source)
        return cls(metric, match.group(2), bound, spec.strip())


def parse_goals(data: Mapping, backend_source: str, source: str | None, serving: bool = False
                ) -> tuple[tuple[Objective, ...], tuple[Constraint, ...]]:
    """A space's objectives (default: Figure 1's axes; serving trials: TTFT and TPOT p99)
    and constraints; `backend_source` is `measured` or `analytical` (a measured sweep cannot
    target a cost-model-only metric); `serving`: the space has a `serving:` block."""
    objectives_spec = data.get("objectives")
    if objectives_spec is None:
        objectives = tuple(Objective(m, d) for m, d in
                           (DEFAULT_SERVING_OBJECTIVES if serving else DEFAULT_OBJECTIVES))
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
    if backend_source == "measured":
        for where, metric in ([(f"objectives[{i}].metric", o.metric) for i, o in enumerate(objectives)]
                              + [(f"constraints[{i}]", c.metric) for i, c in enumerate(constraints)]):
            if metric in ANALYTICAL_ONLY:
                raise ConfigError(where, metric, "a metric that a measured trial reports "
                                  f"({metric} exists only in cost-model predictions)", source)
    for where, metric in ([(f"objectives[{i}].metric", o.metric) for i, o in enumerate(objectives)]
                          + [(f"constraints[{i}]", c.metric) for i, c in enumerate(constraints)]):
        if serving and metric not in SERVING_METRICS:
            raise ConfigError(where, metric, f"a serving metric, one of {list(SERVING_METRICS)} "
                              "(the space's serving: block makes each trial a serving run)", source)
        if not serving and metric in SERVING_METRICS:
            raise ConfigError(where, metric, "a metric this space's trials report (serving "
                              f"trials report {metric}: add a serving: block)", source)
    return objectives, constraints
