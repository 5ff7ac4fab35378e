"""A space file's `sampler:` (which Optuna sampler searches it, its seed and options) and the
sampler classes behind the names.

    sampler: {type: tpe, seed: 0}    # tpe | nsga2 | gp | random | grid | guided (+ options: {...})

Options are checked against the sampler's own keyword arguments; Optuna is imported only
when a sampler is built or its arguments are read.
"""

from __future__ import annotations

import importlib.util
import inspect
from dataclasses import dataclass, field
from typing import Any, Mapping

from workloads.config import ConfigError
from workloads.validate import check_keys, integer, one_of

SAMPLERS = ("tpe", "nsga2", "gp", "random", "grid", "guided")   # guided: sweeper/spec/guided.py


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
        check_keys(spec, ["type", "seed", "options"], source, "sampler.")
        kind = one_of("sampler.type", spec.get("type", "tpe"), SAMPLERS, source, suggest=True)
        seed = spec.get("seed", 0)
        if seed is not None:
            seed = integer("sampler.seed", seed, source, minimum=0)
        options = spec.get("options") or {}
        if not isinstance(options, Mapping):
            raise ConfigError("sampler.options", options, "a mapping of sampler arguments", source)
        if kind == "gp" and importlib.util.find_spec("torch") is None:
            raise ConfigError("sampler.type", kind, "tpe, nsga2, random or grid (Optuna's GP "
                              "sampler needs PyTorch: pip install torch)", source)
        allowed = sampler_arguments(kind)
        check_keys(options, allowed, source, "sampler.options.")
        return cls(kind, seed, dict(options))


def sampler_class(kind: str):
    import optuna   # lazy: Optuna + SQLAlchemy take ~1 s; bad input exits first

    class GridSampler(optuna.samplers.GridSampler):
        """Optuna's grid sampler calls `study.stop()` once the grid is used up, which only
        works inside `study.optimize`; our ask/tell loop stops by trial count instead."""

        def after_trial(self, study, trial, state, values) -> None:
            pass

    from sweeper.spec.guided import GuidedSampler   # lazy: guided imports Optuna at top

    return {"tpe": optuna.samplers.TPESampler, "nsga2": optuna.samplers.NSGAIISampler,
            "gp": optuna.samplers.GPSampler, "random": optuna.samplers.RandomSampler,
            "grid": GridSampler, "guided": GuidedSampler}[kind]


def sampler_arguments(kind: str) -> list[str]:
    """Keyword arguments a sampler accepts from `options` (seed and search_space are ours)."""
    reserved = {"self", "seed", "search_space", "constraints_func"}
    params = inspect.signature(sampler_class(kind).__init__).parameters
    return [p for p in params if p not in reserved]
