"""TrialConfig: one point of a sweep, plain data, identical for the engine and the cost model.

Every trial field is declared once, below, as a dataclass field whose metadata says what it
accepts (`integer`, `minimum`, `choices` or its own `parse`), whether a space may search it
(`searchable`), whether it is one of the flat parameters (`flat`: MLflow params, the results
table's columns, the space's flat view), its `unit` and a `help` line. Everything else is
derived from that metadata: `FIELDS`, `FLAT_PARAMS`, `INT_FLAT_PARAMS`, `LAYOUT_PARAMS`,
`SEARCHABLE`, `DEFAULTS`, `to_dict` / `from_dict`, the space loader's checks and its JSON
Schema (sweeper/spec/space.py, schema.py) and the results columns (sweeper/tracking/results.py).

Validation happens here, before any expensive work: every error is a `ConfigError` naming
file, field, value and what is accepted (the validators are workloads/validate.py's).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ClassVar, Mapping

from workloads.config import (ConfigError, ModelConfig, check_context, check_keys,
                              check_stages, load_model, parse_topology, read_yaml)
from workloads.costmodel import best_topology
from workloads.layouts import (ATTN_LAYOUTS, EXPERT_LAYOUTS, FFN_LAYOUTS, KV_FORMATS, PAD_HEADS_CHOICES,
                               PAD_VOCAB_CHOICES, WEIGHT_FORMATS, PhaseLayout, resolve_padding,
                               validate_layouts, validate_phase)
from workloads.serving.profile import FIELDS as PROFILE_FIELDS
from workloads.serving.profile import block_profile
from workloads.validate import integer, is_int, number, one_of

# The parts of a phase layout (PhaseLayout's fields) and the layouts each accepts (paper §3).
PHASE_PARTS: dict[str, tuple[str, ...]] = {"ffn": FFN_LAYOUTS, "attn": ATTN_LAYOUTS}


def parse_pad_heads(value: Any, source: str | None = None, field: str = "pad_heads") -> str | int:
    """auto | none | a positive integer (a YAML `null` or `false` reads as none)."""
    if value is None or value is False:
        return "none"
    if value in PAD_HEADS_CHOICES:
        return value
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if not is_int(value) or value <= 0:
        raise ConfigError(field, value, "auto, none or a positive integer (query heads to run)", source)
    return value


def parse_phase_layout(data: Any, phase: str, source: str | None = None) -> PhaseLayout:
    if isinstance(data, PhaseLayout):
        return data
    if not isinstance(data, Mapping):
        raise ConfigError(phase, data, "a mapping {ffn: ..., attn: ...}", source)
    check_keys(data, list(PHASE_PARTS), source, prefix=f"{phase}.")
    parts = {part: one_of(f"{phase}.{part}", data.get(part, getattr(PhaseLayout, part)), choices,
                          source, suggest=True)
             for part, choices in PHASE_PARTS.items()}
    return PhaseLayout(**parts)


SERVING_REQUESTS = 32      # requests per serving trial unless the block says `requests`


def parse_serving(value: Any, where: str = "serving", source: str | None = None,
                  context: Mapping | None = None) -> dict | None:
    """A serving trial's stream: the application profile's fields (rate or trace, input_len,
    output_len, ttft, tpot, ...; workloads/serving/profile.py) plus `requests`, the requests
    served per trial; checked by the profile's own parsers, kept as plain data
    (`AppProfile.to_dict()` plus `requests`). None: not a serving trial."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise ConfigError(where, value, "a mapping of serving fields "
                          f"{sorted([*PROFILE_FIELDS, 'requests'])}", source)
    check_keys(value, [*PROFILE_FIELDS, "requests"], source, prefix=f"{where}.")
    profile = block_profile(value, source, prefix=f"{where}.")
    requests = integer(f"{where}.requests", value.get("requests", SERVING_REQUESTS), source, 1)
    out = {**profile.to_dict(), "requests": requests}
    if out["trace"] is not None:     # read where the trial runs (a worker's own directory)
        out["trace"] = str(Path(out["trace"]).resolve())
    return out


def _parse_topology(value: Any, where: str, source: str | None, context: Mapping) -> Any:
    """None: the cost model's best split; else XxYxZ whose product is chips (when known), or
    with pipeline stages one stage's chips (chips / stages, as a plan's PhaseSlice.topology)."""
    if value is None:
        return None
    chips, stages = context.get("chips"), context.get("stages", 1)
    known = isinstance(chips, int) and isinstance(stages, int) and stages > 0 and not chips % stages
    if not known or stages == 1:
        return parse_topology(value, chips if known else None, where, source)
    try:
        return parse_topology(value, chips // stages, where, source)
    except ConfigError as err:      # say whose chips: one stage's
        raise ConfigError(err.field, err.value, f"{err.accepted} (one pipeline stage's mesh: "
                          f"chips={chips} / stages={stages})", source) from None


def _spec(help: str, *, unit: str | None = None, integer: bool = False,
          minimum: float | None = None, choices: tuple | None = None,
          parse: Callable[[Any, str, str | None, Mapping], Any] | None = None,
          parts: Mapping[str, tuple] | None = None, searchable: bool = False, flat: bool = True,
          layout: bool = False, serving_only: bool = False) -> dict:
    """A trial field's metadata. `parse(value, where, source, context)` for a field that the
    generic checks (integer/minimum, number/minimum, choices, parts) do not describe; `context`
    holds the fields parsed before it. `parts`: a phase layout (`parse_phase_layout`), flattened
    as <field>_<part>. `unit`: what one of it counts (the schema shows it). `flat`: one of the
    flat parameters (a quantity of the trial, not of the timing protocol). `layout`: how the
    trial is partitioned (MLflow tags). `serving_only`: a serving trial's field; a space
    without a `serving:` block may neither search it nor fix it to another value than its
    default (sweeper/spec/space.py)."""
    meta = {"help": help, "unit": unit, "integer": integer, "minimum": minimum,
            "choices": choices, "parse": parse, "parts": parts, "searchable": searchable,
            "flat": flat, "layout": layout, "serving_only": serving_only}
    return {k: v for k, v in meta.items() if v is not None}


def _field(default: Any = dataclasses.MISSING, factory: Any = dataclasses.MISSING, **spec) -> Any:
    return field(default=default, default_factory=factory, metadata=_spec(**spec))


@dataclass(frozen=True)
class TrialConfig:
    model: ModelConfig = _field(
        help="a model preset, a model YAML or a mapping of model fields",
        parse=lambda value, where, source, _: load_model(value, source=source, field=where))
    chips: int = _field(help="chips the mesh spans (X*Y*Z)", integer=True, minimum=1,
                        searchable=True, unit="chips")
    batch: int = _field(help="sequences per step", integer=True, minimum=1, searchable=True,
                        unit="sequences")
    input_len: int = _field(32, help="prompt tokens per sequence (prefill)", integer=True,
                            minimum=1, searchable=True, unit="tokens")
    decode_steps: int = _field(8, help="tokens generated per sequence (0: prefill only)",
                               integer=True, minimum=0, searchable=True, unit="tokens")
    # Pipeline stages of a serving trial (docs/serving-behaviours.md "Serving trials"): the
    # chips as `stages` meshes of chips / stages chips, each holding n_layers / stages layers
    # (workloads/serving/pipeline.py `StagedSlotServer`); `topology` is then one stage's mesh.
    # Before `topology`, whose product it sets.
    stages: int = _field(1, help="a serving trial's pipeline stages (1: none): chips / stages "
                         "chips per stage, n_layers / stages layers each, topology one stage's "
                         "mesh; aggregated, without prefill_chunk or a shared prefix",
                         integer=True, minimum=1, searchable=True, unit="stages",
                         serving_only=True)
    # None: the cost model's best ws2d split
    topology: tuple[int, int, int] | None = _field(
        None, help="mesh shape XxYxZ, product = chips (with stages: one stage's, chips / stages; "
        "default: the cost model's best split)",
        parse=_parse_topology, searchable=True)
    weights: str = _field("bf16", help="weight storage format", choices=WEIGHT_FORMATS,
                          searchable=True, layout=True)
    # The KV cache's format (workloads/quant.py): bf16, int8 (a bf16 scale per head vector)
    # or fp8 (float8_e4m3fn); attention reads K and V at that precision.
    kv_cache: str = _field("bf16", help="KV cache format: bf16, int8 (per-vector scales) or fp8",
                           choices=KV_FORMATS, searchable=True, layout=True)
    # A mixture-of-experts model's experts (layouts.py): tp, each split like the dense MLP;
    # ep, spread over the chips with all-to-all dispatch (GShard/Switch). Both phases.
    experts: str = _field("tp", help="a mixture-of-experts model's experts: tp (each split "
                          "like the dense MLP) or ep (spread over the chips, tokens dispatched "
                          "by all-to-all)", choices=EXPERT_LAYOUTS, searchable=True, layout=True)
    prefill: PhaseLayout = _field(
        factory=PhaseLayout, help="the prefill phase's layout {ffn, attn} (paper §3.2-3.3)",
        parts=PHASE_PARTS, searchable=True, layout=True)
    decode: PhaseLayout = _field(
        factory=PhaseLayout, help="the decode phase's layout {ffn, attn} (paper §3.2-3.3)",
        parts=PHASE_PARTS, searchable=True, layout=True)
    seed: int = _field(0, help="random seed of weights and inputs (search it for replicates)",
                       integer=True, minimum=0, searchable=True)
    # the fewest timed runs (docs/architecture.md, "Measurement protocol")
    repeats: int = _field(3, help="the fewest timed runs of each phase", integer=True, minimum=1,
                          unit="runs")
    warmup: int = _field(1, help="untimed runs before timing", integer=True, minimum=0,
                         unit="runs", flat=False)
    ci_target: float = _field(0.02, help="stop timing once both medians' 95% CI is within "
                              "+-ci_target (0: never stop early)", minimum=0, flat=False)
    time_budget_s: float = _field(2.0, help="stop timing once the timed runs have taken this long "
                                  "(0: exactly `repeats` runs)", minimum=0, unit="s", flat=False)
    # Paper §4 head padding: auto (pad the query heads to the smallest count the layouts'
    # sharded axes divide; no-op when they already do) | none | an integer N.
    pad_heads: str | int = _field(
        "auto", help="paper §4 head padding: auto, none or N query heads",
        parse=lambda value, where, source, _: parse_pad_heads(value, source, where),
        searchable=True)
    # Vocabulary padding (docs/cost-model.md): auto pads the vocabulary with never-used tokens
    # to the next multiple of the chips (the embedding is stored V_xyz) | none (refuses a
    # vocabulary the chips do not divide).
    pad_vocab: str = _field("auto", help="vocabulary padding: auto (to a multiple of the chips) "
                            "or none", choices=PAD_VOCAB_CHOICES, searchable=True)
    hosts: int = _field(1, help="JAX processes the mesh spans, chips / hosts devices each",
                        integer=True, minimum=1, searchable=True, unit="hosts")
    # A serving trial (docs/space-files.md, "Serving trials"): the engine serves a request
    # stream with this trial's deployment (batch = decode slots) instead of timing one batch.
    serving: dict | None = _field(
        None, help="a serving trial's request stream (rate or trace, input_len, output_len, "
        "ttft, tpot, ..., requests); none: a prefill/decode trial",
        parse=parse_serving, flat=False)
    # A serving trial's deployment (docs/space-files.md, "Serving trials"): aggregated (one
    # mesh) or disaggregated (a prefill and a decode slice of half the chips each).
    serving_mode: str = _field("aggregated", help="a serving trial's deployment: aggregated or "
                               "disaggregated (prefill and decode slices of half the chips each)",
                               choices=("aggregated", "disaggregated"), searchable=True,
                               serving_only=True)
    # Chunked prefill of a serving trial (docs/serving-behaviours.md "Serving trials"; the
    # plan's prefill.chunk): prompt tokens prefilled per decode step (SlotSpec.chunk).
    prefill_chunk: int = _field(0, help="a serving trial's chunked prefill: prompt tokens per "
                                "decode step (0: whole prompts in their own prefill calls); "
                                "aggregated only", integer=True, minimum=0, searchable=True,
                                unit="tokens", serving_only=True)

    # Derived from the fields' metadata below the class (module-level names of the same).
    FIELDS: ClassVar[tuple[str, ...]]
    FLAT_PARAMS: ClassVar[tuple[str, ...]]
    INT_FLAT_PARAMS: ClassVar[tuple[str, ...]]
    LAYOUT_PARAMS: ClassVar[tuple[str, ...]]

    @property
    def run_model(self) -> ModelConfig:
        """The model as the engine and the cost model run it: padded per `pad_heads` and
        `pad_vocab`."""
        return resolve_padding(self.model, self.pad_heads, self.mesh_shape, self.prefill,
                               self.decode, pad_vocab=self.pad_vocab)

    @property
    def context_len(self) -> int:
        """KV-cache length: the prompt plus every generated token."""
        return self.input_len + self.decode_steps

    @property
    def mesh_shape(self) -> tuple[int, int, int]:
        if self.topology is not None:
            return self.topology
        return best_topology(self.model, self.stage_chips)

    @property
    def stage_chips(self) -> int:
        """Chips of one pipeline stage (all the chips without stages): the mesh the layouts
        split over; `validate` refuses stages that do not divide the chips)."""
        divides = isinstance(self.stages, int) and self.stages > 0 and not self.chips % self.stages
        return self.chips // self.stages if divides else self.chips

    def resolved(self) -> "TrialConfig":
        """The same trial with its topology filled in."""
        return dataclasses.replace(self, topology=self.mesh_shape)

    @property
    def disaggregated(self) -> bool:
        """A disaggregated serving trial: a prefill and a decode slice of half the chips each
        (docs/space-files.md, "Serving trials"); its whole mesh never runs."""
        return self.serving is not None and self.serving_mode == "disaggregated"

    def slice_trials(self, source: str | None = None) -> dict[str, "TrialConfig"]:
        """A disaggregated serving trial's slices, each as the trial its slot server's engine
        runs (workloads/serving/slots.py `SlotServer`): half the chips, split as the cost model
        splits them (`best_topology`, as workloads/serving/trial.py `slice_topologies`);
        `prefill`: the prefill layout in both phases, one prompt per call (batch 1, one
        slot); `decode`: the decode layout in both phases, `batch` slots. Lengths, weights,
        padding and seed are the trial's. ConfigError (field `chips`) when the chips cannot
        be halved."""
        if self.chips < 2 or self.chips % 2:
            raise ConfigError("chips", self.chips, "an even number of chips for a disaggregated "
                              "serving trial (half for its prefill slice, half for its decode "
                              "slice)", source)
        half = dict(chips=self.chips // 2, topology=best_topology(self.model, self.chips // 2),
                    serving=None, serving_mode="aggregated", stages=1, prefill_chunk=0)
        return {"prefill": dataclasses.replace(self, batch=1, decode=self.prefill, **half),
                "decode": dataclasses.replace(self, prefill=self.decode, **half)}

    def validate(self, source: str | None = None) -> "TrialConfig":
        self._validate_behaviours(source)
        check_context(self.model, self.context_len, "input_len", self.input_len, source,
                      f"input_len {self.input_len} + decode_steps {self.decode_steps} = "
                      f"{self.context_len} tokens")
        if self.serving is not None:     # the slot server (workloads/serving/slots.py) keeps its own
            for name, default in (("kv_cache", "bf16"), ("experts", "tp")):   # cache and layout
                if getattr(self, name) != default:
                    raise ConfigError(name, getattr(self, name), f"{default} in a serving trial "
                                      "(its slot server runs a bf16 KV cache and tp experts)",
                                      source)
        if self.disaggregated:
            return self._validate_slices(source)
        model = resolve_padding(self.model, self.pad_heads, self.mesh_shape, self.prefill,
                                self.decode, source, pad_vocab=self.pad_vocab)
        validate_layouts(model, self.mesh_shape, self.prefill, self.decode, self.batch, source,
                         self.experts)
        if self.serving is not None:    # a serving trial prefills one prompt per call
            validate_phase(model, self.mesh_shape, self.prefill, 1, "prefill", source,
                           self.experts)
        return self

    def _validate_behaviours(self, source: str | None) -> None:
        """A serving trial's pipeline `stages` and `prefill_chunk` (docs/serving-behaviours.md
        "Serving trials"), as `sweeper serve` checks a plan's (sweeper/serving/serve.py
        `slot_specs`): serving trials only; chunks aggregated and dense; stages that divide
        the layers and the chips, aggregated, with neither chunks nor a shared prefix (the
        staged server has no extend program)."""
        for name, default in (("stages", 1), ("prefill_chunk", 0)):
            if self.serving is None and getattr(self, name) != default:
                raise ConfigError(name, getattr(self, name), f"{default} outside a serving "
                                  "trial (a space's serving: block serves a stream with it)",
                                  source)
        chunk, prefix = self.prefill_chunk, (self.serving or {}).get("prefix_len", 0)
        if chunk and self.serving_mode == "disaggregated":
            raise ConfigError("prefill_chunk", chunk, "0 with serving_mode disaggregated (chunks "
                              "are mixed into an aggregated replica's decode steps)", source)
        if (chunk or prefix) and self.model.moe:
            raise ConfigError("prefill_chunk" if chunk else "serving.prefix_len", chunk or prefix,
                              "0 for a mixture-of-experts model (chunked prefill and prefix "
                              "caching run dense models only)", source)
        if self.stages == 1:
            return
        check_stages(self.model, self.stages, source)
        if self.chips % self.stages:
            raise ConfigError("stages", self.stages, f"a divisor of chips={self.chips} (each "
                              "pipeline stage has chips / stages chips)", source)
        clashes = {"serving_mode": self.serving_mode if self.disaggregated else None,
                   "prefill_chunk": chunk or None, "serving.prefix_len": prefix or None}
        for clash, value in clashes.items():
            if value is not None:
                raise ConfigError("stages", self.stages, f"1 with {clash}={value!r} (the staged "
                                  "server is aggregated and has no extend program: no chunks, "
                                  "no prefix caching)", source)

    def _validate_slices(self, source: str | None) -> "TrialConfig":
        """A disaggregated serving trial: each slice valid on its half (`slice_trials`), not
        the whole mesh, which never runs; both slices hold the same KV heads (the cache is
        handed over as it is)."""
        slices = self.slice_trials(source)
        for phase, part in slices.items():
            try:    # the phase the slice runs first (its error names that phase), then both
                model = resolve_padding(part.model, part.pad_heads, part.mesh_shape, part.prefill,
                                        part.decode, source, pad_vocab=part.pad_vocab)
                validate_phase(model, part.mesh_shape, getattr(part, phase), part.batch, phase,
                               source, part.experts)
                part.validate(source)
            except ConfigError as err:
                x, y, z = part.mesh_shape
                raise ConfigError(err.field, err.value, f"{err.accepted}, on the {phase} slice "
                                  f"({part.chips} of the {self.chips} chips, topology {x}x{y}x{z})",
                                  source) from None
        kv_heads = {phase: part.run_model.n_kv_heads for phase, part in slices.items()}
        if kv_heads["prefill"] != kv_heads["decode"]:
            raise ConfigError("pad_heads", self.pad_heads, "a padding that gives both slices the "
                              f"same KV heads (prefill {kv_heads['prefill']}, decode "
                              f"{kv_heads['decode']})", source)
        return self

    def to_dict(self) -> dict:
        """Plain data; the model as a mapping so the dict alone reproduces the trial."""
        return {name: _plain(getattr(self, name)) for name in FIELDS}

    def flat_params(self) -> dict[str, Any]:
        """Flat key/values for MLflow params and tables (one name per quantity across runs)."""
        x, y, z = self.mesh_shape
        return flat_params_of({**self.to_dict(), "model": self.model.name, "topology": f"{x}x{y}x{z}"})

    @classmethod
    def from_dict(cls, data: Mapping, source: str | None = None, validate: bool = True) -> "TrialConfig":
        if not isinstance(data, Mapping):
            raise ConfigError("trial", data, "a mapping of trial fields", source)
        check_keys(data, FIELDS, source)
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):       # in order: chips is known before topology
            if f.name in data:
                values[f.name] = parse_field(f.name, data[f.name], source, context=values)
            elif f.name in REQUIRED:
                raise ConfigError(f.name, None, f"{accepted(f.name)} (required)", source)
        hosts = values.get("hosts", DEFAULTS["hosts"])
        if values["chips"] % hosts:
            raise ConfigError("hosts", hosts, f"a divisor of chips={values['chips']} "
                              "(each host owns chips / hosts devices)", source)
        trial = cls(**values)
        return trial.validate(source) if validate else trial

    @classmethod
    def from_yaml(cls, path: str) -> "TrialConfig":
        """A trial file (`sweeper trial --config`): one timed batch, so no serving stream."""
        data = read_yaml(path)
        if isinstance(data, Mapping) and data.get("serving") is not None:
            raise ConfigError("serving", "{...}", "no serving block in a trial file (it times one "
                              "batch; serve a stream with a space's serving: block in `sweeper "
                              "run`, or `sweeper serve --plan`)", str(path))
        return cls.from_dict(data, source=str(path))


def _plain(value: Any) -> Any:
    """A field's value as YAML/JSON data (a model as its mapping, a layout as {ffn, attn})."""
    if isinstance(value, ModelConfig):
        return value.to_dict()
    if dataclasses.is_dataclass(value):
        return dataclasses.asdict(value)
    return list(value) if isinstance(value, tuple) else value


# ----------------------------------------------------------------------------- derived

TRIAL_FIELDS: dict[str, dataclasses.Field] = {f.name: f for f in dataclasses.fields(TrialConfig)}
FIELDS: tuple[str, ...] = tuple(TRIAL_FIELDS)
# Fields without a default: a trial file (or a space, fixed or searched) must give them.
REQUIRED: tuple[str, ...] = tuple(f.name for f in TRIAL_FIELDS.values()
                                  if f.default is dataclasses.MISSING
                                  and f.default_factory is dataclasses.MISSING)
# The trial defaults (a phase layout's defaults are PhaseLayout's).
DEFAULTS: dict[str, Any] = {f.name: f.default for f in TRIAL_FIELDS.values()
                            if f.default is not dataclasses.MISSING}


def accepted(name: str) -> str:
    """What a trial field accepts, in words (for a 'required' error)."""
    meta = TRIAL_FIELDS[name].metadata
    if meta.get("integer"):
        return f"an integer >= {meta['minimum']}"
    if meta.get("choices"):
        return f"one of {list(meta['choices'])}"
    return meta["help"]


def parse_field(name: str, value: Any, source: str | None = None, where: str | None = None,
                context: Mapping[str, Any] | None = None) -> Any:
    """One trial field's value checked against its metadata; `where` names it in errors
    (default: its name), `context` holds fields already parsed (a topology checks chips)."""
    meta = TRIAL_FIELDS[name].metadata
    where = where or name
    if "parse" in meta:
        return meta["parse"](value, where, source, context or {})
    if "parts" in meta:
        return parse_phase_layout(value, where, source)
    if meta.get("integer"):
        return integer(where, value, source, meta["minimum"])
    if "choices" in meta:
        return one_of(where, value, meta["choices"], source, suggest=True)
    return number(where, value, source, meta["minimum"])


@dataclass(frozen=True)
class FlatParam:
    """One flat parameter: a trial field, or one part of a phase layout (`prefill_ffn`)."""

    name: str
    field: str                    # the TrialConfig field it belongs to
    part: str | None = None       # the phase layout's part (ffn, attn), for prefill_* / decode_*

    @property
    def meta(self) -> Mapping[str, Any]:
        return TRIAL_FIELDS[self.field].metadata

    @property
    def integer(self) -> bool:
        return bool(self.meta.get("integer"))

    @property
    def minimum(self) -> float | None:
        return self.meta.get("minimum")

    @property
    def choices(self) -> tuple | None:
        return self.meta["parts"][self.part] if self.part else self.meta.get("choices")

    @property
    def searchable(self) -> bool:
        return bool(self.meta.get("searchable"))

    @property
    def default(self) -> Any:
        return getattr(PhaseLayout, self.part) if self.part else DEFAULTS.get(self.field)

    def check(self, value: Any, where: str, source: str | None = None) -> Any:
        """One value of this parameter (e.g. a searched choice), checked like the field."""
        if self.part:
            return one_of(where, value, self.choices, source, suggest=True)
        return parse_field(self.field, value, source, where)


FLAT: tuple[FlatParam, ...] = tuple(
    FlatParam(f"{f.name}_{part}", f.name, part) if f.metadata.get("parts") else FlatParam(f.name, f.name)
    for f in TRIAL_FIELDS.values() if f.metadata.get("flat")
    for part in (f.metadata.get("parts") or (None,)))
FLAT_BY_NAME: dict[str, FlatParam] = {p.name: p for p in FLAT}
# The flat parameter names (MLflow params, table columns, the search space's flat view).
FLAT_PARAMS: tuple[str, ...] = tuple(FLAT_BY_NAME)
INT_FLAT_PARAMS: tuple[str, ...] = tuple(p.name for p in FLAT if p.integer)
# How a trial is partitioned (MLflow tags).
LAYOUT_PARAMS: tuple[str, ...] = tuple(p.name for p in FLAT if p.meta.get("layout"))
# What a search space may search (besides its shorthands for both phases).
SEARCHABLE: tuple[str, ...] = tuple(p.name for p in FLAT if p.searchable)

TrialConfig.FIELDS = FIELDS
TrialConfig.FLAT_PARAMS = FLAT_PARAMS
TrialConfig.INT_FLAT_PARAMS = INT_FLAT_PARAMS
TrialConfig.LAYOUT_PARAMS = LAYOUT_PARAMS


def flat_params_of(data: Mapping[str, Any]) -> dict[str, Any]:
    """FLAT_PARAMS of trial data nested as `to_dict` writes it (phase layouts as mappings);
    a missing field takes its default. No validation: also for points that cannot run."""
    flat: dict[str, Any] = {}
    for p in FLAT:
        if p.part:
            flat[p.name] = (data.get(p.field) or {}).get(p.part, p.default)
        else:
            flat[p.name] = data.get(p.name, p.default)
    return flat


def nested_of(flat: Mapping[str, Any]) -> dict[str, Any]:
    """The inverse of `flat_params_of`: trial data nested as `from_dict` reads it, from a
    flat row (a results table's, an MLflow run's params). A missing, empty or NaN value is
    left out (the field's default applies); the integer fields come back as integers (a
    table holds them as floats); the model stays as the row names it."""
    data: dict[str, Any] = {}
    for p in FLAT:
        value = flat.get(p.name)
        if value is None or value == "" or (isinstance(value, float) and value != value):
            continue
        if p.name in INT_FLAT_PARAMS:
            value = int(value)
        if p.part:
            data.setdefault(p.field, {})[p.part] = value
        else:
            data[p.name] = value
    return data


def field_help(name: str) -> str:
    """A trial field's help line with its choices and default, for a command's flag of it
    (so a flag says what the field says: sweeper/cli/analytical.py)."""
    meta = TRIAL_FIELDS[name].metadata
    listed = meta.get("choices") and not all(c in meta["help"] for c in meta["choices"])
    choices = f": {' | '.join(meta['choices'])}" if listed else ""
    default = DEFAULTS.get(name)
    return meta["help"] + choices + ("" if default is None else f" (default {default})")

