"""TrialConfig: one point of a sweep, plain data, identical for the engine and the cost model.

Serialisable to and from YAML/JSON (`to_dict` / `from_dict`). Validation happens here,
before any expensive work: every error is a `ConfigError` naming file, field, value and
what is accepted.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping

from workloads.config import (ConfigError, ModelConfig, check_keys, load_model, parse_topology,
                              read_yaml)
from workloads.costmodel import best_topology
from workloads.layouts import (ATTN_LAYOUTS, FFN_LAYOUTS, PAD_HEADS_CHOICES, WEIGHT_FORMATS,
                               PhaseLayout, resolve_padding, validate_layouts)


@dataclass(frozen=True)
class TrialConfig:
    model: ModelConfig
    chips: int
    batch: int
    input_len: int = 32
    decode_steps: int = 8
    topology: tuple[int, int, int] | None = None   # None: the cost model's best ws2d split
    weights: str = "bf16"
    prefill: PhaseLayout = field(default_factory=PhaseLayout)
    decode: PhaseLayout = field(default_factory=PhaseLayout)
    seed: int = 0
    repeats: int = 3              # the fewest timed runs (docs/architecture.md, "Measurement protocol")
    warmup: int = 1
    ci_target: float = 0.02       # stop timing once both medians' 95% CI is within +-2%
    time_budget_s: float = 2.0    # ... or once the timed runs have taken this long
    # Paper §4 head padding: auto (pad the query heads to the smallest count the layouts'
    # sharded axes divide; no-op when they already do) | none | an integer N.
    pad_heads: str | int = "auto"
    hosts: int = 1                # JAX processes the mesh spans, chips / hosts each (README "Multi-host trials")

    FIELDS = ("model", "chips", "batch", "input_len", "decode_steps", "topology", "weights",
              "prefill", "decode", "seed", "repeats", "warmup", "ci_target", "time_budget_s",
              "pad_heads", "hosts")
    # The flat parameter names (MLflow params, table columns, the search space's flat view):
    # the one list everything else derives from. LAYOUT_PARAMS: how a trial is partitioned.
    LAYOUT_PARAMS = ("weights", "prefill_ffn", "prefill_attn", "decode_ffn", "decode_attn")
    FLAT_PARAMS = ("model", "chips", "batch", "input_len", "decode_steps", "topology", "weights",
                   "prefill_ffn", "prefill_attn", "decode_ffn", "decode_attn", "seed", "repeats",
                   "pad_heads", "hosts")
    INT_FLAT_PARAMS = ("chips", "batch", "input_len", "decode_steps", "seed", "repeats", "hosts")

    @property
    def run_model(self) -> ModelConfig:
        """The model as the engine and the cost model run it: padded per `pad_heads`."""
        return resolve_padding(self.model, self.pad_heads, self.mesh_shape, self.prefill, self.decode)

    @property
    def context_len(self) -> int:
        """KV-cache length: the prompt plus every generated token."""
        return self.input_len + self.decode_steps

    @property
    def mesh_shape(self) -> tuple[int, int, int]:
        if self.topology is not None:
            return self.topology
        return best_topology(self.model, self.chips)

    def resolved(self) -> "TrialConfig":
        """The same trial with its topology filled in."""
        return dataclasses.replace(self, topology=self.mesh_shape)

    def validate(self, source: str | None = None) -> "TrialConfig":
        model = resolve_padding(self.model, self.pad_heads, self.mesh_shape, self.prefill,
                                self.decode, source)
        validate_layouts(model, self.mesh_shape, self.prefill, self.decode, self.batch, source)
        return self

    def to_dict(self) -> dict:
        """Plain data; the model as a mapping so the dict alone reproduces the trial."""
        return {
            "model": self.model.to_dict(),
            "chips": self.chips,
            "batch": self.batch,
            "input_len": self.input_len,
            "decode_steps": self.decode_steps,
            "topology": list(self.topology) if self.topology else None,
            "weights": self.weights,
            "prefill": dataclasses.asdict(self.prefill),
            "decode": dataclasses.asdict(self.decode),
            "seed": self.seed,
            "repeats": self.repeats,
            "warmup": self.warmup,
            "ci_target": self.ci_target,
            "time_budget_s": self.time_budget_s,
            "pad_heads": self.pad_heads,
            "hosts": self.hosts,
        }

    def flat_params(self) -> dict[str, Any]:
        """Flat key/values for MLflow params and tables (one name per quantity across runs)."""
        x, y, z = self.mesh_shape
        return flat_params_of({**self.to_dict(), "model": self.model.name, "topology": f"{x}x{y}x{z}"})

    @classmethod
    def from_dict(cls, data: Mapping, source: str | None = None, validate: bool = True) -> "TrialConfig":
        if not isinstance(data, Mapping):
            raise ConfigError("trial", data, "a mapping of trial fields", source)
        check_keys(data, list(cls.FIELDS), source)
        if "model" not in data:
            raise ConfigError("model", None, "a preset name, a YAML path or a mapping (required)", source)
        model = load_model(data["model"], source=source)
        values: dict[str, Any] = {"model": model}
        for key in ("chips", "batch", "input_len", "decode_steps", "seed", "repeats", "warmup",
                    "hosts"):
            value = data.get(key, DEFAULTS.get(key))
            if value is None:
                raise ConfigError(key, None, "a positive integer (required)", source)
            minimum = 0 if key in ("seed", "warmup") else 1
            if key == "decode_steps":
                minimum = 0
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ConfigError(key, value, f"an integer >= {minimum}", source)
            values[key] = value
        for key in ("ci_target", "time_budget_s"):
            values[key] = parse_nonnegative(data.get(key, getattr(cls, key)), key, source)
        if values["chips"] % values["hosts"]:
            raise ConfigError("hosts", values["hosts"], f"a divisor of chips={values['chips']} "
                              "(each host owns chips / hosts devices)", source)
        if data.get("topology") is not None:
            values["topology"] = parse_topology(data["topology"], values["chips"], "topology", source)
        weights = data.get("weights", DEFAULTS["weights"])
        if weights not in WEIGHT_FORMATS:
            raise ConfigError("weights", weights, f"one of {list(WEIGHT_FORMATS)}", source)
        values["weights"] = weights
        for phase in ("prefill", "decode"):
            values[phase] = parse_phase_layout(data.get(phase, {}), phase, source)
        values["pad_heads"] = parse_pad_heads(data.get("pad_heads", DEFAULTS["pad_heads"]), source)
        trial = cls(**values)
        return trial.validate(source) if validate else trial

    @classmethod
    def from_yaml(cls, path: str) -> "TrialConfig":
        return cls.from_dict(read_yaml(path), source=str(path))


def parse_nonnegative(value: Any, key: str, source: str | None = None) -> float:
    """A finite number >= 0 (ci_target 0: never stop early; time_budget_s 0: `repeats` runs)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < float("inf"):
        raise ConfigError(key, value, "a number >= 0", source)
    return float(value)
# seed, repeats, ...); the layouts' defaults are PhaseLayout's.
DEFAULTS: dict[str, Any] = {f.name: f.default for f in dataclasses.fields(TrialConfig)
                            if f.default is not dataclasses.MISSING}


def flat_params_of(data: Mapping[str, Any]) -> dict[str, Any]:
    """FLAT_PARAMS of trial data nested as `to_dict` writes it (phase layouts as mappings);
    a missing field takes its default. No validation: also for points that cannot run."""
    flat: dict[str, Any] = {}
    for name in TrialConfig.FLAT_PARAMS:
        phase, _, part = name.partition("_")
        if phase in ("prefill", "decode") and part in ("ffn", "attn"):
            flat[name] = (data.get(phase) or {}).get(part, getattr(PhaseLayout, part))
        else:
            flat[name] = data.get(name, DEFAULTS.get(name))
    return flat


def parse_pad_heads(value: Any, source: str | None = None, field: str = "pad_heads") -> str | int:
    """auto | none | a positive integer (a YAML `null` or `false` reads as none)."""
    if value is None or value is False:
        return "none"
    if value in PAD_HEADS_CHOICES:
        return value
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(field, value, "auto, none or a positive integer (query heads to run)", source)
    return value


def parse_phase_layout(data: Any, phase: str, source: str | None = None) -> PhaseLayout:
    if isinstance(data, PhaseLayout):
        return data
    if not isinstance(data, Mapping):
        raise ConfigError(phase, data, "a mapping {ffn: ..., attn: ...}", source)
    check_keys(data, ["ffn", "attn"], source, prefix=f"{phase}.")
    ffn = data.get("ffn", PhaseLayout.ffn)
    attn = data.get("attn", PhaseLayout.attn)
    if ffn not in FFN_LAYOUTS:
        raise ConfigError(f"{phase}.ffn", ffn, f"one of {list(FFN_LAYOUTS)}", source)
    if attn not in ATTN_LAYOUTS:
        raise ConfigError(f"{phase}.attn", attn, f"one of {list(ATTN_LAYOUTS)}", source)
    return PhaseLayout(ffn, attn)
