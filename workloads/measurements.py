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
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from workloads import costmodel
from workloads.csv_input import read_csv
from workloads.config import (BLOCKS, ConfigError, HardwareProfile, ModelConfig, load_model,
                              parse_topology)
from workloads.layouts import (ATTN_LAYOUTS, FFN_LAYOUTS, WEIGHT_FORMATS, PhaseLayout,
                               resolve_padding, stores_1d, validate_layouts)
from workloads.trial import parse_pad_heads

MEASURED_PHASES = ("prefill", "decode", "total")
GATHERED_FAMILY = "wg"          # ffn value: the best of wg_x, wg_xy, wg_xyz
REQUIRED = ("model", "chips", "batch", "phase", "input_len", "ffn", "attn", "weights", "source")
OPTIONAL = ("topology", "context", "decode_steps", "block", "pad_heads", "latency_s", "mfu")
COLUMNS = REQUIRED + OPTIONAL
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
        if name not in COLUMNS:
            raise ConfigError("header", name, f"one of the columns {list(COLUMNS)}", source)
    for name in REQUIRED:
        if name not in header:
            raise ConfigError("header", ",".join(header), f"a column {name!r} (required: "
                              f"{list(REQUIRED)})", source)
    if "latency_s" not in header and "mfu" not in header:
        raise ConfigError("header", ",".join(header), "a latency_s or an mfu column", source)


def _parse_row(row: dict, number: int, source: str) -> MeasuredPoint:
    def bad(column: str, accepted: str):
        return ConfigError(f"row {number}, column {column}", row.get(column), accepted, source)

    def integer(column: str, default: int | None = None, minimum: int = 1) -> int:
        text = row.get(column, "")
        if text == "" and default is not None:
            return default
        try:
            value = int(text)
        except ValueError:
            raise bad(column, f"an integer >= {minimum}") from None
        if value < minimum:
            raise bad(column, f"an integer >= {minimum}")
        return value

    def number_in(column: str, low: float, high: float, accepted: str) -> float | None:
        text = row.get(column, "")
        if text == "":
            return None
        try:
            value = float(text)
        except ValueError:
            raise bad(column, accepted) from None
        if not low < value <= high:
            raise bad(column, accepted)
        return value

    def choice(column: str, choices, default: str | None = None) -> str | None:
        value = row.get(column, "")
        if value == "" and (default is not None or column in OPTIONAL):
            return default
        if value not in choices:
            raise bad(column, f"one of {list(choices)}")
        return value

    # a model YAML named relative to the CSV's folder (the CSV's own models travel with it)
    beside = Path(source).parent / row.get("model", "")
    if row.get("model", "").endswith((".yaml", ".yml")) and beside.is_file():
        row = {**row, "model": str(beside)}
    try:
        load_model(row.get("model", ""), field="model")
    except ConfigError as err:
        raise bad("model", err.accepted) from None
    chips = integer("chips")
    topology = None
    if row.get("topology"):
        try:
            topology = parse_topology(row["topology"], chips)
        except ConfigError as err:
            raise bad("topology", err.accepted) from None
    input_len = integer("input_len")
    context = integer("context", default=input_len)
    latency = number_in("latency_s", 0, float("inf"), "a positive number of seconds")
    mfu = number_in("mfu", 0, 1, "a fraction in (0, 1]")
    if (latency is None) == (mfu is None):
        raise bad("latency_s" if latency is None else "mfu",
                  "exactly one of latency_s and mfu per row (one published number per row)")
    try:
        pad = parse_pad_heads(row.get("pad_heads") or "auto")
    except ConfigError as err:
        raise bad("pad_heads", err.accepted) from None
    if not row.get("source"):
        raise bad("source", "where the number is published (table, figure or section)")
    point = MeasuredPoint(
        model=row["model"], chips=chips, topology=topology, batch=integer("batch"),
        phase=choice("phase", MEASURED_PHASES), input_len=input_len, context=context,
        decode_steps=integer("decode_steps", default=1),
        ffn=choice("ffn", FFN_LAYOUTS + (GATHERED_FAMILY,)), attn=choice("attn", ATTN_LAYOUTS),
        weights=choice("weights", WEIGHT_FORMATS), block=choice("block", BLOCKS),
        pad_heads=pad, latency_s=latency, mfu=mfu, source=row["source"], row=number)
    try:   # the layout must run this model on this mesh (heads, batch, dimensions divide)
        for ffn in _ffns(point):
            _run_model(point, PhaseLayout(ffn, point.attn), _topology(point))
    except ConfigError as err:
        raise bad("ffn/attn", f"a layout that runs this row ({err})") from None
    return point


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
    for name in ("latency_s", "mfu", "source", "row"):
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
