"""Benchmark: the hardware presets against published measurements of real engines.

    python -m benchmarks.world [--out DIR] [--presets FILE]   # seconds; no JAX, no accelerator
    python -m benchmarks.world --render [--out DIR]           # DIR/world.md again from world.json

Every row of benchmarks/data/published-serving.csv (TensorRT-LLM, lmdeploy and NeMo on A100,
H100 and H200) and of benchmarks/data/paper-tpu-v4.csv (Pope et al. 2022 on TPU v4) is
predicted twice: by the shipped datasheet preset of its chip (workloads/config.py
HARDWARE_PRESETS) and by a preset fitted to the OTHER sources' rows (leave one source out,
sweeper/analysis/external.py "the world"). Errors are in the row's published metric (TTFT,
TPOT, end-to-end latency, throughput or MFU), per chip and metric, median and worst, with n.
Targets (issue 38): held-out median error <= 20% on TPOT and TTFT, <= 25% on throughput, no
fitted constant above the datasheet. A row that needs a behaviour the model lacks (FP8,
chunked prefill, pipeline stages, ...: its `needs`) is predicted and listed apart, never
fitted and never in the headline.

It also writes the fitted presets the package ships (workloads/presets/world.yaml, loaded
into HARDWARE_PRESETS as `<chip>-world`): each chip's family fitted to every usable row,
carrying the leave-one-source-out residuals of its family's rows as its error band
(sweeper/serving/bands.py). Results: benchmarks/results/world.{json,md} (the Markdown:
benchmarks/render/world.py); docs/world.md.

On the harness (benchmarks/harness.py): `measure` is the measurement (every row predicted,
the presets fitted), `analyse` its figures and verdicts against the targets, `write_presets`
the file it writes besides its results (logged to MLflow with them).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import numpy as np
import yaml

from benchmarks import harness
from benchmarks.common import DATA, ROOT, clean
from sweeper.analysis import external
from sweeper.analysis.holdout import heldout
from sweeper.analysis.observations import metric_of, predict_latency
from workloads.config import load_hardware
from workloads.measurements import (MeasuredPoint, configuration_key, load_measurements,
                                    predict_point, published_from_latency)

SERVING = DATA / "published-serving.csv"
PAPER = DATA / "paper-tpu-v4.csv"
PAPER_DEFAULTS = dict(hardware="tpu-v4", source_id="pope2022",
                      framework="Pope et al. 2022: JAX/XLA partitioned engine on TPU v4",
                      url="https://arxiv.org/abs/2211.05102")
PRESETS = ROOT / "workloads" / "presets" / "world.yaml"
TARGETS = {"tpot": 0.20, "ttft": 0.20, "throughput": 0.25}
PHASE_METRIC = {"prefill": "ttft", "decode": "tpot", "total": "e2e"}
RATES = ("peak_flops", "hbm_bandwidth", "ici_bandwidth")


def load_rows(serving: Path = SERVING, paper: Path | None = PAPER) -> list[MeasuredPoint]:
    """The published rows: the serving CSV's, and the paper's with its chip and source."""
    rows = load_measurements(serving)
    if paper is not None:
        rows += [dataclasses.replace(p, **{k: getattr(p, k) or v for k, v in PAPER_DEFAULTS.items()},
                                     from_figure=p.source.startswith("Figure"))
                 for p in load_measurements(paper)]
    return rows


def metric_name(p: MeasuredPoint) -> str:
    """The row's published metric: ttft, tpot, e2e, throughput or mfu."""
    if p.published_metric:
        return p.published_metric
    return PHASE_METRIC[p.phase] if p.latency_s is not None else "mfu"


def published(p: MeasuredPoint) -> float:
    return p.published_value if p.published_metric else p.measured


def in_metric(p: MeasuredPoint, latency_s: float, sheets) -> float:
    """A predicted latency of the row in its published metric."""
    if p.metric == "mfu":
        obs = external.world_observation(p, sheets, sheets[p.hardware])
        return float(metric_of(obs, latency_s))
    return published_from_latency(p, latency_s)


def score(rows: list[MeasuredPoint], sheets: dict) -> list[dict]:
    """Per row: the datasheet preset's and the held-out fit's prediction and error."""
    held = {id(h["row"]): h for h in external.leave_one_source_out(rows, sheets)}
    out = []
    for p in rows:
        h = held[id(p)]
        # the sheet's latency (an MFU row asked as a latency row), then in the row's metric
        sheet_latency = predict_point(dataclasses.replace(p, mfu=None, latency_s=1.0), sheets[p.hardware])
        value, sheet, fitted = published(p), in_metric(p, sheet_latency, sheets), in_metric(p, h["latency_s"], sheets)
        out.append({"row": p.row, "source_id": p.source_id, "hardware": p.hardware,
                    "model": Path(p.model).stem, "chips": p.chips, "tp": p.tp, "pp": p.pp,
                    "batch": p.batch, "input_len": p.input_len, "output_len": p.output_len,
                    "precision": p.precision or p.weights, "framework": p.framework,
                    "metric": metric_name(p), "unit": p.published_unit or ("s" if p.metric == "latency_s" else "fraction"),
                    "published": value, "sheet": sheet, "sheet_error": sheet / value - 1,
                    "heldout": fitted, "heldout_error": fitted / value - 1,
                    "latency_residual": h["latency_s"] / p.latency_s - 1 if p.latency_s else
                    published(p) / fitted - 1,
                    "needs": list(p.needs), "from_figure": p.from_figure, "training": h["training"],
                    "source": p.source, "url": p.url})
    return out


def summarise(scored: list[dict], keys: tuple[str, ...]) -> list[dict]:
    """n, median and worst |error| of the datasheet and the held-out fit per group of `keys`
    (rows that need a missing behaviour apart)."""
    groups: dict[tuple, list[dict]] = {}
    for r in scored:
        groups.setdefault(tuple(r[k] for k in keys) + (bool(r["needs"]),), []).append(r)
    out = []
    for key, rs in sorted(groups.items(), key=lambda kv: tuple(map(str, kv[0]))):
        sheet = np.abs([r["sheet_error"] for r in rs])
        held = np.abs([r["heldout_error"] for r in rs])
        out.append({**dict(zip(keys, key)), "needs_missing_behaviour": key[-1], "n": len(rs),
                    "sheet_median": float(np.median(sheet)), "sheet_worst": float(sheet.max()),
                    "heldout_median": float(np.median(held)), "heldout_worst": float(held.max()),
                    "heldout_bias": float(np.median([r["heldout_error"] for r in rs]))})
    return out


def targets(by_metric: list[dict]) -> dict:
    out = {}
    for metric, limit in TARGETS.items():
        row = next((s for s in by_metric if s["metric"] == metric and not s["needs_missing_behaviour"]), None)
        out[metric] = {"limit": limit, "n": row["n"] if row else 0,
                       "heldout_median": row["heldout_median"] if row else None,
                       "met": bool(row and row["heldout_median"] <= limit)}
    return out


def shipped_presets(rows: list[MeasuredPoint], scored: list[dict], sheets: dict) -> dict:
    """Per chip with usable rows: its family fitted to every usable row, carrying the
    family's held-out (leave-one-source-out) residuals, attributed to a phase each."""
    usable = [p for p in rows if not p.needs]
    residual = {(r["source_id"], r["row"]): r["latency_residual"] for r in scored}
    out = {}
    for chip in sorted({p.hardware for p in usable}):
        kin = [p for p in usable if external.family(p.hardware) == external.family(chip)]
        name = f"{chip}-world"
        fitted = external.fit_world(kin, sheets[chip], sheets, name=name).profile
        phases: dict[str, list[float]] = {"prefill": [], "decode": []}
        for p in kin:
            phases[external.residual_phase(p, fitted)].append(round(residual[(p.source_id, p.row)], 6))
        profile = dataclasses.replace(fitted, heldout_residuals={k: v for k, v in phases.items() if v})
        out[name] = {"datasheet": chip, "sources": sorted({p.source_id for p in kin}),
                     "points": len(kin), "points_on_chip": sum(p.hardware == chip for p in kin),
                     "profile": profile}
    return out


def physical(profiles: dict, sheets: dict) -> dict:
    """Every fitted rate at or below its datasheet's; every fixed cost >= 0."""
    checks = {}
    for name, entry in profiles.items():
        p, sheet = entry["profile"], sheets[entry["datasheet"]]
        checks[name] = all(getattr(p, r) <= getattr(sheet, r) * (1 + 1e-9) for r in RATES) and min(
            p.op_overhead_s, p.launch_overhead_s, p.collective_latency_s,
            *p.collective_latency_s_by_kind.values()) >= 0
    return checks


def fold_physical(rows: list[MeasuredPoint], sheets: dict) -> bool:
    """The same check on every held-out fold's fitted profile."""
    ok = True
    for h in external.leave_one_source_out(rows, sheets):
        sheet = sheets[h["row"].hardware]
        ok &= all(getattr(h["profile"], r) <= getattr(sheet, r) * (1 + 1e-9) for r in RATES)
    return bool(ok)


def variants(rows: list[MeasuredPoint], sheets: dict) -> dict:
    """The held-out median per metric with other pooling rules, measured beside the
    headline's (the family, else every chip): each chip alone (a source whose chip no other
    source measured is then not predicted), and every chip pooled."""
    rules = {"chip_only": lambda chip, q: q.hardware == chip, "all_chips": lambda chip, q: True}
    out = {}
    for name, same in rules.items():
        errors: dict[str, list[float]] = {}
        for source, chip in sorted({(p.source_id, p.hardware) for p in rows if not p.needs}):
            train = [q for q in rows if q.source_id != source and not q.needs and same(chip, q)]
            if not train:
                continue
            fold = external.fit_world(train, sheets[chip], sheets).profile
            for p in rows:
                if p.source_id == source and p.hardware == chip and not p.needs:
                    obs = external.world_observation(p, sheets, sheets[chip])
                    predicted = in_metric(p, predict_latency(obs, fold), sheets)
                    errors.setdefault(metric_name(p), []).append(abs(predicted / published(p) - 1))
        out[name] = {m: {"n": len(v), "heldout_median": float(np.median(v))}
                     for m, v in sorted(errors.items())}
    return out


def alone_in_family(scored: list[dict]) -> list[str]:
    """Chips whose held-out rows were predicted from other families' rows only."""
    return sorted({r["hardware"] for r in scored if not r["needs"]} - {
        r["hardware"] for r in scored if not r["needs"] and not r["training"].startswith("every")})


def within_source(rows: list[MeasuredPoint], chip: str, sheets: dict) -> dict:
    """What the chip's rows miss by, measured two ways against the held-out headline: each
    row predicted by a fit on its own source's other runs (its family's only source: the
    error without the transfer from other chips), and the headline without the rows read
    off a figure."""
    mine = [p for p in rows if p.hardware == chip and not p.needs]
    obs = [dataclasses.replace(external.world_observation(p, sheets, sheets[chip]), group=i)
           for i, p in enumerate(mine)]
    configurations = {}
    for i, p in enumerate(mine):   # a run's latency and MFU rows held out together
        obs[i] = dataclasses.replace(obs[i], group=configurations.setdefault(configuration_key(p), i))
    h = heldout(obs, sheets[chip], "loo", None, external.WORLD_LOSS, weighted=False,
                terms=external.WORLD_TERMS)
    errors: dict[str, list[float]] = {}
    for (_, row), p in zip(h.points.iterrows(), mine):
        errors.setdefault(metric_name(p), []).append(abs(row["relative_error"]))
    return {"rows": len(mine), "within_source_median": {m: float(np.median(v)) for m, v in errors.items()},
            "n": {m: len(v) for m, v in errors.items()}}


def measure(serving: Path = SERVING, paper: Path | None = PAPER) -> dict:
    """The measurement: every row predicted by its datasheet and by the held-out fits, the
    shipped presets fitted, every held-out fold's physical check, the other pooling rules and
    the within-source fits. Objects, not JSON: `analyse` makes the results of it."""
    rows = load_rows(serving, paper)
    sheets = {chip: load_hardware(chip) for chip in sorted({p.hardware for p in rows})}
    scored = score(rows, sheets)
    return {"rows": rows, "sheets": sheets, "scored": scored,
            "presets": shipped_presets(rows, scored, sheets),
            "every_fold_physical": fold_physical(rows, sheets),
            "variants": variants(rows, sheets),
            "within_source": {chip: within_source(rows, chip, sheets) for chip in alone_in_family(scored)}}


def analyse(raw: dict, args: argparse.Namespace | None = None) -> dict:
    """The results: the errors per chip and metric and over every chip, the verdicts against
    the targets and the datasheets, the rows set apart, the shipped presets beside their
    datasheets, and every row."""
    scored, sheets, presets = raw["scored"], raw["sheets"], raw["presets"]
    by_metric = summarise(scored, ("metric",))
    checks = physical(presets, sheets)
    needs: dict[str, list[int]] = {}
    for r in scored:
        for need in r["needs"]:
            needs.setdefault(need, []).append(r["row"])
    data = {
        "rows_total": len(scored), "rows_usable": sum(not r["needs"] for r in scored),
        "sources": sorted({r["source_id"] for r in scored}),
        "hardware": sorted({r["hardware"] for r in scored}),
        "loss": external.WORLD_LOSS, "terms": list(external.WORLD_TERMS),
        "by_hardware_metric": summarise(scored, ("hardware", "metric")), "by_metric": by_metric,
        "targets": targets(by_metric),
        "physical": {"presets": checks, "every_fold": raw["every_fold_physical"],
                     "met": all(checks.values()) and raw["every_fold_physical"]},
        "needs": {k: {"rows": v, "n": len(v)} for k, v in sorted(needs.items())},
        "variants": raw["variants"],
        "alone_in_family": {chip: within | {
            "without_figures": summarise([r for r in scored if r["hardware"] == chip
                                          and not r["from_figure"]], ("metric",))}
            for chip, within in raw["within_source"].items()},
        "presets": {name: preset_summary(entry, sheets) for name, entry in presets.items()},
        "rows": scored}
    return clean(data)


def metrics(result: dict) -> dict:
    """MLflow's: the held-out median per target metric with its verdict, the physical check."""
    out = {"rows_total": result["rows_total"], "rows_usable": result["rows_usable"],
           "physical_met": float(result["physical"]["met"])}
    for metric, t in result["targets"].items():
        out[f"{metric}_heldout_median"] = t["heldout_median"]
        out[f"{metric}_n"] = t["n"]
        out[f"{metric}_met"] = float(t["met"])
    return out


def preset_summary(entry: dict, sheets: dict) -> dict:
    p, sheet = entry["profile"], sheets[entry["datasheet"]]
    return {"datasheet": entry["datasheet"], "sources": entry["sources"], "points": entry["points"],
            "points_on_chip": entry["points_on_chip"],
            "residuals": {k: len(v) for k, v in p.heldout_residuals.items()},
            "fitted": {r: getattr(p, r) for r in RATES} | {
                "efficiency": {r: getattr(p, r) / getattr(sheet, r) for r in RATES},
                "overlap": p.overlap, "op_overhead_s": p.op_overhead_s,
                "launch_overhead_s": p.launch_overhead_s,
                "collective_latency_s_by_kind": dict(p.collective_latency_s_by_kind)},
            "sheet": {r: getattr(sheet, r) for r in RATES}}


def presets_yaml(presets: dict) -> str:
    """workloads/presets/world.yaml: what the package loads (workloads/config.py)."""
    body = {}
    for name, entry in presets.items():
        profile = entry["profile"].to_dict()
        profile = {k: v for k, v in profile.items() if v not in ({}, None) or k == "heldout_residuals"}
        body[name] = {"datasheet": entry["datasheet"], "sources": entry["sources"],
                      "points": entry["points"], "points_on_chip": entry["points_on_chip"],
                      "heldout": "leave-one-source-out", "profile": profile}
    header = ("# Generated by `python -m benchmarks.world` (benchmarks/results/world.md, docs/world.md):\n"
              "# each preset fitted to the published rows of its chip's family, with the held-out\n"
              "# (leave-one-source-out) residuals of those rows. Do not edit: rerun the benchmark.\n")
    return header + yaml.safe_dump(body, sort_keys=False)


def write_presets(raw: dict, args: argparse.Namespace) -> list[Path]:
    """The fitted presets the package ships (`--presets`, default workloads/presets/world.yaml)."""
    args.presets.parent.mkdir(parents=True, exist_ok=True)
    args.presets.write_text(presets_yaml(raw["presets"]))
    return [args.presets]


def arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--serving", type=Path, default=SERVING, help="published serving rows (CSV)")
    parser.add_argument("--paper", type=Path, default=PAPER, help="the paper's TPU v4 rows (CSV)")
    parser.add_argument("--presets", type=Path, default=PRESETS,
                        help="where to write the fitted presets (default: the package's)")


BENCHMARK = harness.Benchmark(
    "world", __doc__.splitlines()[0], lambda args, previous: measure(args.serving, args.paper),
    arguments=arguments, analyse=analyse, metrics=metrics, log=True, extra_files=write_presets,
    params=lambda args: {"serving": args.serving, "paper": args.paper, "presets": args.presets})


if __name__ == "__main__":
    sys.exit(harness.main(BENCHMARK))
