"""A serving deployment: how many replicas of how many chips run each phase, and how.

`Deployment` is what `sweeper plan` chooses, what `sweeper serve` runs and what the serving
model (workloads/serving/model.py) predicts. Aggregated: each of `replicas` replicas runs
prefill and decode on the same chips (prefill.chips == decode.chips, same replicas, one
stored copy of the weights: same weights and topology), `decode.batch` decode slots and
`prefill.batch` prompts per prefill call. Disaggregated: `prefill.replicas` slices of
`prefill.chips` chips prefill and hand the KV cache to `decode.replicas` slices of
`decode.chips` chips, each phase with its own layout, batch and weights.

The plan file (`sweeper plan --out plan.json`) holds the deployment under "deployment"
(docs/serving.md "Plan file"); `load_plan` also takes a file that is a bare deployment.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from workloads.config import (HARDWARE_PRESETS, MODEL_PRESETS, HardwareProfile, ModelConfig,
                              load_model, parse_topology)
from workloads.hardware import load_hardware
from workloads.layouts import ATTN_LAYOUTS, EXPERT_LAYOUTS, FFN_LAYOUTS, KV_FORMATS, WEIGHT_FORMATS
from workloads.validate import ConfigError, check_keys, integer, one_of

MODES = ("aggregated", "disaggregated")
PLAN_FORMAT = "sweeper-plan/1"
# Bounds of a plan file's counts (checked before anything is started; the planner searches
# well within them: docs/serving.md "Plan file")
MAX_SLICE_CHIPS = 4096      # chips of one slice (a TPU v4 pod)
MAX_TOTAL_CHIPS = 65536     # chips of a whole deployment (also `sweeper plan --max-chips`)
MAX_BATCH = 65536           # decode slots, or prompts per prefill call
MAX_PLAN_BYTES = 4 * 2**20  # a plan with a fitted profile is tens of KiB
MAX_PLAN_DEPTH = 32         # a plan nests 4-5 levels
MAX_STAGES = 64             # pipeline stages of one slice (more than any model has layers to split)
MAX_CHUNK = 1 << 20         # prompt tokens per chunked-prefill step


@dataclass
class PhaseSlice:
    """One phase's slices: `replicas` copies of `chips` chips, each running `ffn`/`attn`."""

    chips: int
    replicas: int
    ffn: str
    attn: str
    batch: int          # prefill: prompts per call; decode: slots
    weights: str
    topology: tuple[int, int, int] | None = None   # None: the cost model's best split
    experts: str = "tp"     # a mixture-of-experts model's experts layout (workloads/layouts.py)
    kv_cache: str = "bf16"  # the KV cache's format (workloads/quant.py)
    # pipeline stages: the slice's `chips` are `stages` groups of chips // stages chips, each
    # holding n_layers / stages layers; `topology` is one stage's mesh (docs/serving.md
    # "Plan file")
    stages: int = 1
    # prefill only, aggregated only: prompt tokens run per decode step (chunked prefill, as
    # Sarathi-Serve and vLLM do); 0 runs each prompt whole in its own prefill call
    chunk: int = 0

    @property
    def stage_chips(self) -> int:
        """Chips of one pipeline stage (the mesh the layouts split over)."""
        return self.chips // self.stages

    def to_dict(self) -> dict:
        out = {"chips": self.chips, "replicas": self.replicas, "ffn": self.ffn,
               "attn": self.attn, "batch": self.batch, "weights": self.weights,
               "topology": "x".join(map(str, self.topology)) if self.topology else None}
        for key, default in (("experts", "tp"), ("kv_cache", "bf16"), ("stages", 1), ("chunk", 0)):
            if getattr(self, key) != default:    # a plan file without them stays as it was
                out[key] = getattr(self, key)
        return out

    @classmethod
    def from_dict(cls, data: Any, source: str | None, prefix: str) -> "PhaseSlice":
        if not isinstance(data, Mapping):
            raise ConfigError(prefix, data, "a mapping {chips, replicas, ffn, attn, batch, "
                              "weights[, topology]}", source)
        check_keys(data, ["chips", "replicas", "ffn", "attn", "batch", "weights", "topology",
                          "experts", "kv_cache", "stages", "chunk"], source, f"{prefix}.")
        for key in ("chips", "ffn", "attn", "batch"):
            if key not in data:
                raise ConfigError(f"{prefix}.{key}", None, "a value (required)", source)
        chips = integer(f"{prefix}.chips", data["chips"], source, maximum=MAX_SLICE_CHIPS)
        stages = integer(f"{prefix}.stages", data.get("stages", 1), source, maximum=MAX_STAGES)
        if chips % stages:
            raise ConfigError(f"{prefix}.stages", stages, f"a divisor of {prefix}.chips={chips} "
                              "(each pipeline stage has the same chips)", source)
        chunk = data.get("chunk", 0)
        integer(f"{prefix}.chunk", chunk, source, minimum=0, maximum=MAX_CHUNK,
                what=f"0 (whole prompts) or a number of prompt tokens per step from 1 to "
                f"{MAX_CHUNK:,}")
        topology = data.get("topology")
        if topology is not None:
            topology = parse_topology(topology, chips // stages, f"{prefix}.topology", source)
        return cls(chips=chips,
                   replicas=integer(f"{prefix}.replicas", data.get("replicas", 1), source,
                                    maximum=MAX_TOTAL_CHIPS),
                   ffn=one_of(f"{prefix}.ffn", data["ffn"], FFN_LAYOUTS, source, suggest=True),
                   attn=one_of(f"{prefix}.attn", data["attn"], ATTN_LAYOUTS, source, suggest=True),
                   batch=integer(f"{prefix}.batch", data["batch"], source, maximum=MAX_BATCH),
                   weights=one_of(f"{prefix}.weights", data.get("weights", "bf16"),
                                  WEIGHT_FORMATS, source),
                   topology=topology,
                   experts=one_of(f"{prefix}.experts", data.get("experts", "tp"), EXPERT_LAYOUTS,
                                  source),
                   kv_cache=one_of(f"{prefix}.kv_cache", data.get("kv_cache", "bf16"), KV_FORMATS,
                                   source),
                   stages=stages, chunk=chunk)

    @property
    def chips_total(self) -> int:
        return self.chips * self.replicas

    def describe(self) -> str:
        topo = f" {'x'.join(map(str, self.topology))}" if self.topology else ""
        experts = f" experts {self.experts}" if self.experts != "tp" else ""
        kv = f" KV {self.kv_cache}" if self.kv_cache != "bf16" else ""
        stages = f" in {self.stages} stages" if self.stages > 1 else ""
        chunk = f" chunk {self.chunk}" if self.chunk else ""
        return (f"{self.replicas} x {self.chips} chips{stages}{topo} {self.ffn}/{self.attn} "
                f"batch {self.batch} {self.weights}{kv}{experts}{chunk}")


@dataclass
class Deployment:
    """A whole deployment (see the module docstring)."""

    model: ModelConfig
    hardware: HardwareProfile
    mode: str            # "aggregated" | "disaggregated"
    prefill: PhaseSlice
    decode: PhaseSlice

    @property
    def chips_total(self) -> int:
        if self.mode == "aggregated":
            return self.decode.chips_total
        return self.prefill.chips_total + self.decode.chips_total

    def to_dict(self) -> dict:
        """Presets by name; a profile or model that is not a preset is written out whole
        (a fitted profile travels with the plan)."""
        model = (self.model.name if MODEL_PRESETS.get(self.model.name) == self.model
                 else self.model.to_dict())
        preset = HARDWARE_PRESETS.get(self.hardware.name)
        hardware = (self.hardware.name if preset is not None and preset.to_dict() == self.hardware.to_dict()
                    else self.hardware.to_dict())
        return {"model": model, "hardware": hardware, "mode": self.mode,
                "prefill": self.prefill.to_dict(), "decode": self.decode.to_dict()}

    @classmethod
    def from_dict(cls, data: Any, source: str | None = None) -> "Deployment":
        if not isinstance(data, Mapping):
            raise ConfigError("deployment", data, "a mapping {model, hardware, mode, prefill, "
                              "decode}", source)
        check_keys(data, ["model", "hardware", "mode", "prefill", "decode"], source)
        for key in ("model", "hardware", "prefill", "decode"):
            if key not in data:
                raise ConfigError(key, None, "a value (required)", source)
        model = load_model(data["model"], source, "model")
        hardware = load_hardware(data["hardware"], source, "hardware")
        mode = one_of("mode", data.get("mode", "aggregated"), MODES, source)
        prefill = PhaseSlice.from_dict(data["prefill"], source, "prefill")
        decode = PhaseSlice.from_dict(data["decode"], source, "decode")
        if prefill.kv_cache != decode.kv_cache:    # the KV cache is handed over as it is
            raise ConfigError("prefill.kv_cache", prefill.kv_cache, f"decode.kv_cache="
                              f"{decode.kv_cache!r}: both phases hold the same KV cache", source)
        if mode == "aggregated":   # one replica runs both phases on the same stored weights
            for key in ("chips", "replicas", "weights", "topology", "experts", "kv_cache",
                        "stages"):
                if getattr(prefill, key) != getattr(decode, key) and not (
                        key == "topology" and None in (prefill.topology, decode.topology)):
                    raise ConfigError(f"prefill.{key}", getattr(prefill, key),
                                      f"decode.{key}={getattr(decode, key)!r}: an aggregated "
                                      "replica runs both phases on the same chips and weights",
                                      source)
        if decode.chunk:
            raise ConfigError("decode.chunk", decode.chunk, "0: the chunk size is the prefill "
                              "slice's (prefill.chunk)", source)
        if prefill.chunk and mode != "aggregated":
            raise ConfigError("prefill.chunk", prefill.chunk, "0 in a disaggregated deployment "
                              "(chunks are mixed into an aggregated replica's decode steps)",
                              source)
        for part, name in ((prefill, "prefill"), (decode, "decode")):
            if part.stages > model.n_layers:
                raise ConfigError(f"{name}.stages", part.stages, f"at most the model's "
                                  f"{model.n_layers} layers", source)
        deployment = cls(model, hardware, mode, prefill, decode)
        if deployment.chips_total > MAX_TOTAL_CHIPS:
            raise ConfigError("decode.replicas", decode.replicas, f"a deployment of at most "
                              f"{MAX_TOTAL_CHIPS:,} chips in all (this one has "
                              f"{deployment.chips_total:,})", source)
        return deployment

    def describe(self) -> str:
        if self.mode == "aggregated":
            d = self.decode
            stages = f" in {d.stages} stages" if d.stages > 1 else ""
            chunk = (f" in chunks of {self.prefill.chunk} tokens" if self.prefill.chunk else
                     f" batch {self.prefill.batch}")
            return (f"aggregated: {d.replicas} x {d.chips} chips{stages}, prefill "
                    f"{self.prefill.ffn}/{self.prefill.attn}{chunk}, decode {d.ffn}/{d.attn} "
                    f"{d.batch} slots, {d.weights}")
        return (f"disaggregated: prefill {self.prefill.describe()}; decode "
                f"{self.decode.describe()}")


def read_plan(path: str | Path) -> dict:
    """The plan file as a mapping (a bare deployment is wrapped as {"deployment": ...}).
    Refused in one line, before it is parsed or walked: a file over MAX_PLAN_BYTES, JSON
    nested deeper than MAX_PLAN_DEPTH (Python's parser would end in RecursionError), a
    `format` other than PLAN_FORMAT (a newer sweeper's plan)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError("--plan", str(path), "an existing plan file (sweeper plan --out "
                          "plan.json)")
    try:
        with path.open("rb") as stream:      # bounded: the file may be huge, or grow
            raw = stream.read(MAX_PLAN_BYTES + 1)
        if len(raw) > MAX_PLAN_BYTES:
            raise ConfigError("--plan", str(path), f"a plan file of at most "
                              f"{MAX_PLAN_BYTES // 2**20} MiB (this one is larger)")
        text = raw.decode("utf-8-sig")
        depth = json_depth(text)
        if depth > MAX_PLAN_DEPTH:
            raise ConfigError("--plan", str(path), f"a JSON plan nested at most "
                              f"{MAX_PLAN_DEPTH} levels (this one nests {depth:,})")
        data = json.loads(text)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ConfigError("--plan", str(path), f"a JSON plan file ({str(err)[:120]})") from None
    if isinstance(data, Mapping) and "deployment" not in data and "mode" in data:
        data = {"deployment": data}
    if not isinstance(data, Mapping) or not isinstance(data.get("deployment"), Mapping):
        raise ConfigError("deployment", None, "a plan with a \"deployment\" mapping "
                          "(docs/serving.md \"Plan file\")", str(path))
    if "format" in data and data["format"] != PLAN_FORMAT:
        raise ConfigError("format", data["format"], f"{PLAN_FORMAT!r}, the plan format this "
                          "sweeper reads (a plan written by another version: make it again "
                          "with this one's `sweeper plan --out`)", str(path))
    return dict(data)


_STRINGS = re.compile(r'"(?:[^"\\]|\\.)*"')
_BRACKETS = re.compile(r"[\[\]{}]")


def json_depth(text: str) -> int:
    """How deep a JSON text's arrays and objects nest (brackets inside strings not counted);
    a scan, so that a 100,000-deep file is measured, not parsed."""
    depth = deepest = 0
    for match in _BRACKETS.finditer(_STRINGS.sub('""', text)):
        depth += 1 if match.group() in "[{" else -1
        deepest = max(deepest, depth)
    return deepest


def load_plan(path: str | Path) -> Deployment:
    """The deployment of a plan file written by `sweeper plan --out` (or by hand)."""
    return Deployment.from_dict(read_plan(path)["deployment"], str(path))


def load_plan_profile(path: str | Path):
    """The application profile a plan was made for (an AppProfile), or None if it has none."""
    from workloads.serving.profile import profile_from_dict

    data = read_plan(path)
    return None if data.get("profile") is None else profile_from_dict(
        data["profile"], str(path), "profile.")
