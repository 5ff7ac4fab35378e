"""Measurements taken elsewhere (e.g. the paper's TPU v4 numbers), one CSV row per number.

    points = load_measurements("benchmarks/data/paper-tpu-v4.csv")
    predict_point(points[0], load_hardware("tpu-v4"))    # the cost model's value for that row

Columns (header required; the order is free):
  model        preset name or model YAML path (relative: to the CSV's folder first)  required
  chips        number of chips                                      required
  topology     XxYxZ (default: the cost model's best 2D split)      optional
  batch        sequences                                            required
  phase        prefill | decode | total (prefill + decode_steps decode steps)   required
  input_len    prompt tokens (prefill length; the KV history decode starts from)  required
  context      prefill: keys attended (>= input_len when a history is cached);
               decode: KV length at the (first) decode step        optional (= input_len)
  decode_steps decode steps the latency covers (decode, total)     optional (= 1)
  ffn          ws1d | ws2d | wg_x | wg_xy | wg_xyz, or `wg`: the fastest of the three
               weight-gathered variants (a figure that plots the family)        required
  attn         head | batch                                         required
  weights      bf16 | int8 | fp8                                    required
  block        parallel | serial: overrides the model's block       optional
  pad_heads    auto | none | N (paper §4 head padding)              optional (= auto)
  latency_s    measured seconds (of the whole phase / all steps)    one of latency_s, mfu
  mfu          measured model FLOPs utilisation, a fraction in (0, 1]
  source       where the number is published (table, figure, section)          required

Decode over several steps is predicted at the mean KV length, context + decode_steps / 2
(costmodel.decode_context's convention). MFU counts the unpadded model's FLOPs, as the
paper does. A bad row raises ConfigError naming file, row, column, value and what is
accepted (the CLI prints it as one line and exits 2).

Serving measurements of real engines (benchmarks/data/published-serving.csv, scored by
benchmarks/world.py) use these optional columns instead of phase/latency_s/ffn/attn/weights:
  source_id    the independent source (a leave-one-source-out fold holds out its rows)
  hardware     the hardware preset (or YAML) the number was measured on
  tp, pp       tensor-parallel and pipeline degrees: chips = tp x pp when `chips` is empty;
               without ffn/attn the layout is Megatron's tensor parallelism, ws1d/head on
               1 x tp x 1 (paper §3.2.1: 1D weight-stationary)
  precision    bf16 | fp16 | int8 | fp8 (weights: fp16 = bf16 bytes; fp8 = int8 bytes, and
               the row needs `fp8`: FP8 compute and KV cache the model lacks)
  framework    the engine and its version (free text)
  output_len   output tokens per request (the first from the prefill: output_len - 1 steps)
  metric       ttft | tpot | e2e | throughput, with `value` in `unit`:
               ttft (s, ms): the prefill of batch x input_len (phase prefill)
               tpot (s, ms): one decode step, over output_len - 1 steps (phase decode)
               e2e (s, ms): prefill + output_len - 1 decode steps (phase total)
               throughput (tok/s, tok/s/chip): output tokens per second of the batch, whole
               or per chip: batch x output_len / the e2e latency (phase total)
  from_figure  yes | no: the value was read off a figure
  needs        behaviours the cost model lacks, `;`-separated (NEEDS): the row is scored and
               reported, never fitted (pp > 1 adds pipeline-stages, fp8 adds fp8)
  url, note    where it is published; free text
Each such row is stored as the latency it implies (`latency_s`, the fit's metric) beside the
published number (`published_metric`, `published_value`, `published_unit`);
`published_from_latency` turns a predicted latency back into the published metric.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from workloads import costmodel, validate
from workloads.csv_input import read_csv
from workloads.config import (BLOCKS, ConfigError, HardwareProfile, ModelConfig, load_hardware,
                              load_model, parse_topology)
from workloads.layouts import (ATTN_LAYOUTS, FFN_LAYOUTS, WEIGHT_FORMATS, PhaseLayout,
                               resolve_padding, stores_1d, validate_layouts)
from workloads.trial import parse_pad_heads

MEASURED_PHASES = ("prefill", "decode", "total")
GATHERED_FAMILY = "wg"          # ffn value: the best of wg_x, wg_xy, wg_xyz
REQUIRED = ("model", "chips", "batch", "phase", "input_len", "ffn", "attn", "weights", "source")
OPTIONAL = ("topology", "context", "decode_steps", "block", "pad_heads", "latency_s", "mfu")
COLUMNS = REQUIRED + OPTIONAL
# The serving columns (module doc); a row with them may leave out what they imply.
SERVING_COLUMNS = ("source_id", "hardware", "tp", "pp", "precision", "framework", "output_len",
                   "metric", "value", "unit", "from_figure", "needs", "url", "note")
ALL_COLUMNS = COLUMNS + SERVING_COLUMNS
IMPLIED_BY = {"chips": "tp", "phase": "metric", "ffn": "tp", "attn": "tp", "weights": "precision"}
PUBLISHED_METRICS = {"ttft": ("s", "ms"), "tpot": ("s", "ms"), "e2e": ("s", "ms"),
                     "throughput": ("tok/s", "tok/s/chip")}
PRECISIONS = {"bf16": "bf16", "fp16": "bf16", "int8": "int8", "fp8": "int8"}
# Behaviours of real engines the cost model lacks (a row needing one is never fitted).
NEEDS = ("fp8", "chunked-prefill", "prefix-caching", "pipeline-stages", "moe",
         "speculative-decoding", "int4")
TENSOR_PARALLEL = ("ws1d", "head")   # Megatron's layout (paper §3.2.1), what GPU engines run
_UNIT_HW = HardwareProfile("unit", 1.0, 1.0, 1.0, 1.0)   # FLOP counts need no real profile


@dataclass(frozen=True)
class MeasuredPoint:
    """One published number and the configuration it was measured on."""

    model: str
    chips: int
    topology: tuple[int, int, int] | None
    batch: int
    phase: str                   # prefill | decode | total
    input_len: int
    context: int
    decode_steps: int
    ffn: str                     # a layout, or "wg" (the fastest weight-gathered variant)
    attn: str
    weights: str
    block: str | None
    pad_heads: str | int
    latency_s: float | None
    mfu: float | None
    source: str
    row: int = 0                 # line number in the file
    # serving columns (module doc); None / () where the row has none
    source_id: str | None = None
    hardware: str | None = None
    tp: int | None = None
    pp: int = 1
    precision: str | None = None
    framework: str | None = None
    output_len: int | None = None
    published_metric: str | None = None      # ttft | tpot | e2e | throughput
    published_value: float | None = None     # as published, in published_unit
    published_unit: str | None = None
    from_figure: bool | None = None
    needs: tuple[str, ...] = ()
    url: str | None = None
    note: str | None = None

    @property
    def metric(self) -> str:
        """"latency_s" or "mfu": what this row measured."""
        return "latency_s" if self.latency_s is not None else "mfu"

    @property
    def measured(self) -> float:
        return self.latency_s if self.latency_s is not None else self.mfu

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["topology"] = "x".join(map(str, self.topology)) if self.topology else None
        out["needs"] = list(self.needs)
        return out


# --------------------------------------------------------------------------- loading


def load_measurements(path: str | Path) -> list[MeasuredPoint]:
    """Read and check every row; the first bad one raises ConfigError (file, row, column)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError("file", str(path), "an existing CSV file of measurements")
    # limits, encoding, BOM, duplicated columns, non-finite numbers: workloads/csv_input.py
    header, rows = read_csv(path, numeric=("latency_s", "mfu"))
    _check_header(header, str(path))
    points = [_parse_row(row, number, str(path)) for number, row in rows]
    if not points:
        raise ConfigError("rows", 0, "at least one measurement row", str(path))
    return points


def _check_header(header: list[str], source: str) -> None:
    for name in header:
        if name not in ALL_COLUMNS:
            raise ConfigError("header", name, f"one of the columns {list(ALL_COLUMNS)}", source)
    for name in REQUIRED:
        if name not in header and IMPLIED_BY.get(name) not in header:
            implied = f" or {IMPLIED_BY[name]!r}" if name in IMPLIED_BY else ""
            raise ConfigError("header", ",".join(header), f"a column {name!r}{implied} (required: "
                              f"{list(REQUIRED)})", source)
    if "latency_s" not in header and "mfu" not in header and "metric" not in header:
        raise ConfigError("header", ",".join(header), "a latency_s or an mfu column (or metric, "
                          "value and unit)", source)


class _Row:
    """One CSV row's cells, read with the error that names file, row and column."""

    def __init__(self, row: dict, number: int, source: str):
        self.row, self.number, self.source = row, number, source

    def get(self, column: str) -> str:
        return self.row.get(column, "") or ""

    def field(self, column: str) -> str:
        return f"row {self.number}, column {column}"

    def bad(self, column: str, accepted: str) -> ConfigError:
        return ConfigError(self.field(column), self.row.get(column), accepted, self.source)

    def integer(self, column: str, default: int | None = None, minimum: int = 1) -> int:
        text = self.get(column)
        if text == "" and default is not None:
            return default
        return validate.integer(self.field(column), validate.from_text(text), self.source, minimum)

    def positive_number(self, column: str, what: str, maximum: float | None = None
                        ) -> float | None:
        text = self.get(column)
        if text == "":
            return None
        return validate.number(self.field(column), validate.from_text(text, float), self.source,
                               positive=True, maximum=maximum, what=what)

    def choice(self, column: str, choices, default: str | None = None) -> str | None:
        value = self.get(column)
        if value == "" and (default is not None or column in OPTIONAL + SERVING_COLUMNS):
            return default
        return validate.one_of(self.field(column), value, choices, self.source)


def _parse_row(row: dict, number: int, source: str) -> MeasuredPoint:
    # a model YAML named relative to the CSV's folder (the CSV's own models travel with it)
    beside = Path(source).parent / row.get("model", "")
    if row.get("model", "").endswith((".yaml", ".yml")) and beside.is_file():
        row = {**row, "model": str(beside)}
    r = _Row(row, number, source)
    try:
        load_model(row.get("model", ""), field="model")
    except ConfigError as err:
        raise r.bad("model", err.accepted) from None
    serving = _serving_cells(r)
    chips = r.integer("chips") if r.get("chips") or serving["tp"] is None else \
        serving["tp"] * serving["pp"]
    if serving["tp"] is not None and chips != serving["tp"] * serving["pp"]:
        raise r.bad("chips", f"tp x pp = {serving['tp'] * serving['pp']} (or empty)")
    topology = None
    if r.get("topology"):
        try:
            topology = parse_topology(row["topology"], chips)
        except ConfigError as err:
            raise r.bad("topology", err.accepted) from None
    elif serving["tp"] is not None and not r.get("ffn"):
        topology = (1, chips, 1)       # tensor parallelism over every chip (pp: flagged)
    input_len = r.integer("input_len")
    batch = r.integer("batch")
    timing = _timing(r, serving, batch, chips, input_len)
    try:
        pad = parse_pad_heads(row.get("pad_heads") or "auto")
    except ConfigError as err:
        raise r.bad("pad_heads", err.accepted) from None
    if not row.get("source"):
        raise r.bad("source", "where the number is published (table, figure or section)")
    tensor_parallel = serving["tp"] is not None and not r.get("ffn") and not r.get("attn")
    weights = (PRECISIONS[serving["precision"]] if serving["precision"] and not r.get("weights")
               else r.choice("weights", WEIGHT_FORMATS))
    point = MeasuredPoint(
        model=row["model"], chips=chips, topology=topology, batch=batch,
        input_len=input_len, context=r.integer("context", default=input_len),
        ffn=TENSOR_PARALLEL[0] if tensor_parallel else r.choice("ffn", FFN_LAYOUTS + (GATHERED_FAMILY,)),
        attn=TENSOR_PARALLEL[1] if tensor_parallel else r.choice("attn", ATTN_LAYOUTS),
        weights=weights, block=r.choice("block", BLOCKS), pad_heads=pad, source=row["source"],
        row=number, **timing, **serving)
    try:   # the layout must run this model on this mesh (heads, batch, dimensions divide)
        for ffn in _ffns(point):
            _run_model(point, PhaseLayout(ffn, point.attn), _topology(point))
    except ConfigError as err:
        raise r.bad("ffn/attn", f"a layout that runs this row ({err})") from None
    return point


def _serving_cells(r: _Row) -> dict:
    """The serving columns of a row (module doc), checked."""
    tp = r.integer("tp") if r.get("tp") else None
    pp = r.integer("pp", default=1)
    precision = r.choice("precision", tuple(PRECISIONS))
    needs = tuple(n.strip() for n in r.get("needs").split(";") if n.strip())
    for need in needs:
        if need not in NEEDS:
            raise r.bad("needs", f"behaviours from {list(NEEDS)}, separated by ';'")
    implied = (("fp8",) if precision == "fp8" else ()) + (("pipeline-stages",) if pp > 1 else ())
    needs = needs + tuple(n for n in implied if n not in needs)
    figure = r.choice("from_figure", ("yes", "no"))
    if r.get("hardware"):      # a preset or YAML: checked here, loaded by the caller
        try:
            load_hardware(r.get("hardware"), field="hardware")
        except ConfigError as err:
            raise r.bad("hardware", err.accepted) from None
    return {"source_id": r.get("source_id") or None, "hardware": r.get("hardware") or None,
            "tp": tp, "pp": pp, "precision": precision, "framework": r.get("framework") or None,
            "output_len": r.integer("output_len") if r.get("output_len") else None,
            "from_figure": None if figure is None else figure == "yes", "needs": needs,
            "url": r.get("url") or None, "note": r.get("note") or None}


def _timing(r: _Row, serving: dict, batch: int, chips: int, input_len: int) -> dict:
    """phase, decode_steps, latency_s, mfu and the published number of a row: from the legacy
    columns (phase, latency_s or mfu) or from metric, value and unit (module doc)."""
    metric = r.get("metric")
    if not metric:
        latency = r.positive_number("latency_s", "a positive number of seconds")
        mfu = r.positive_number("mfu", "a fraction in (0, 1]", maximum=1)
        if (latency is None) == (mfu is None):
            raise r.bad("latency_s" if latency is None else "mfu",
                        "exactly one of latency_s and mfu per row (one published number per row)")
        return {"phase": r.choice("phase", MEASURED_PHASES),
                "decode_steps": r.integer("decode_steps", default=1), "latency_s": latency,
                "mfu": mfu}
    validate.one_of(r.field("metric"), metric, PUBLISHED_METRICS, r.source)
    unit = r.choice("unit", PUBLISHED_METRICS[metric])
    if unit is None:
        raise r.bad("unit", f"one of {list(PUBLISHED_METRICS[metric])} for metric {metric}")
    value = r.positive_number("value", "a positive number")
    if value is None:
        raise r.bad("value", f"the published {metric} in {unit}")
    output = serving["output_len"]
    if output is None and metric != "ttft":
        raise r.bad("output_len", f"output tokens per request (needed by metric {metric})")
    steps = max((output or 1) - 1, 1)
    seconds = value / 1000.0 if unit == "ms" else value
    if metric == "ttft":
        phase, latency = "prefill", seconds
    elif metric == "tpot":
        phase, latency = "decode", seconds * steps
    else:
        phase = "total" if output > 1 else "prefill"
        latency = (seconds if metric == "e2e" else
                   batch * output / (value * (chips if unit == "tok/s/chip" else 1)))
    return {"phase": phase, "decode_steps": steps, "latency_s": latency, "mfu": None,
            "published_metric": metric, "published_value": value, "published_unit": unit}


def published_from_latency(point: MeasuredPoint, latency_s: float) -> float:
    """A predicted latency of the row (seconds of its phase, or of all its decode steps) in
    the row's published metric and unit (module doc); a legacy row's latency stays seconds."""
    metric, unit = point.published_metric, point.published_unit
    if metric is None:
        return latency_s
    if metric == "throughput":
        return point.batch * point.output_len / latency_s / (point.chips if unit == "tok/s/chip" else 1)
    seconds = latency_s / point.decode_steps if metric == "tpot" else latency_s
    return seconds * 1000.0 if unit == "ms" else seconds


# --------------------------------------------------------------------------- predicting


def point_model(point: MeasuredPoint) -> ModelConfig:
    """The row's model (before padding), with its block override."""
    model = load_model(point.model, field="model")
    return dataclasses.replace(model, block=point.block) if point.block else model


def _topology(point: MeasuredPoint) -> tuple[int, int, int]:
    return point.topology or costmodel.best_topology(point_model(point), point.chips)


def _ffns(point: MeasuredPoint) -> tuple[str, ...]:
    return ("wg_x", "wg_xy", "wg_xyz") if point.ffn == GATHERED_FAMILY else (point.ffn,)


def _run_model(point: MeasuredPoint, layout: PhaseLayout, topology) -> ModelConfig:
    model = resolve_padding(point_model(point), point.pad_heads, topology, layout, layout)
    validate_layouts(model, topology, layout, layout, point.batch)
    return model


def variants(point: MeasuredPoint) -> tuple[str, ...]:
    """The FFN layouts the row may have run: one, or the three weight-gathered ones (`wg`)."""
    return _ffns(point)


def configuration_key(point: MeasuredPoint) -> tuple:
    """Everything but the measured value and its source: one run of the paper (its latency
    and MFU rows are one measurement, held out together)."""
    d = point.to_dict()
    for name in ("latency_s", "mfu", "source", "row", "published_metric", "published_value",
                 "published_unit", "url", "note", "from_figure"):
        d.pop(name)
    return tuple(sorted((k, str(v)) for k, v in d.items()))


def row_calls(point: MeasuredPoint) -> list[tuple[float, int, costmodel.PhaseCall]]:
    """(weight, variant, cost-model call) of each phase the row's number covers, per FFN
    variant: the row's latency is min over variants of sum(weight x latency) (a decode over
    several steps counts each step at the mean KV length, costmodel.decode_context's rule)."""
    out = []
    topology = _topology(point)
    steps = point.decode_steps
    for variant, ffn in enumerate(_ffns(point)):
        layout = PhaseLayout(ffn, point.attn)
        common = dict(model=_run_model(point, layout, topology), chips=point.chips,
                      batch=point.batch, input_len=point.input_len, layout=layout,
                      weights=point.weights, topology=tuple(topology),
                      one_d=stores_1d(layout, layout))
        prefill = (1.0, variant, costmodel.PhaseCall(phase="prefill", context=point.context, **common))
        decode = (float(steps), variant, costmodel.PhaseCall(
            phase="decode", context=point.context + (steps / 2 if steps > 1 else 0), **common))
        out += {"prefill": [prefill], "decode": [decode], "total": [prefill, decode]}[point.phase]
    return out


def model_flops(point: MeasuredPoint) -> float:
    """The unpadded model's FLOPs of the row's number (the paper's MFU numerator)."""
    return sum(w * call.predict(_UNIT_HW).flops for w, v, call in row_calls(point) if v == 0)


def predict_point(point: MeasuredPoint, hardware: HardwareProfile) -> float:
    """The cost model's value of the row's metric: latency in seconds (of the phase, or of
    all decode steps), or MFU. For ffn `wg`, the fastest weight-gathered variant."""
    latency: dict[int, float] = {}
    for w, v, call in row_calls(point):
        latency[v] = latency.get(v, 0.0) + w * call.predict(hardware).latency_s
    best = min(latency.values())
    if point.metric == "latency_s":
        return best
    return model_flops(point) / (point.chips * hardware.peak_flops * best)


def prediction_errors(points: list[MeasuredPoint], hardware: HardwareProfile) -> list[dict]:
    """Per row: measured, predicted and the signed relative error (predicted / measured - 1)."""
    out = []
    for p in points:
        predicted = predict_point(p, hardware)
        out.append({"row": p.row, "source": p.source, "metric": p.metric, "measured": p.measured,
                    "predicted": predicted, "relative_error": predicted / p.measured - 1})
    return out
