"""Benchmark: the cost model against the paper's own TPU v4 numbers, unfitted and fitted.

    python -m benchmarks.paper_fit                 # benchmarks/data/paper-tpu-v4.csv, tpu-v4

Fits `tpu-v4`'s constants to every published number (sweeper/analysis/external.py, the
pipeline of `sweeper fit --measurements ... --holdout loo --loss soft_l1`) with the named
terms of fit.MEASUREMENT_CANDIDATES chosen by nested cross-validation (each held-out row's fit
chooses its terms on its own training rows), and predicts each row from a fit that did not
see it (leave-one-out; a table's latency and MFU of one run are held out together).
Targets (issues 11, 20): held-out MAPE <= 15% with every fitted constant physically possible;
int8's decode advantage kept; a small CSV (Table 2's 8 numbers) never blows up. Where the
target is missed, the results name what is responsible, computed here from the rows and the
sheet (`responsible`), and the same fit on parts of the CSV and with the named fixed step
cost (`VARIANTS`). Pure cost model: no JAX, no timing (6.5 min at load 8 on 2 shared cores: the nested
term selection fits 2^4 x 3 inner folds per held-out row; 13 min at load 5).
Writes benchmarks/results/paper_fit.{json,md}; docs/cost-model.md quotes the md (its
`generated:paper_fit` block, filled by benchmarks.readme_numbers).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from benchmarks import harness
from sweeper.analysis import external
from sweeper.analysis.fit import EXTRA_BOUNDS, MEASUREMENT_CANDIDATES
from sweeper.analysis.holdout import SELECT
from workloads.config import load_hardware

TARGET_MAPE = 0.15
# The headline fit: a robust loss (soft_l1: a row far off counts linearly, not squared, so
# one doubtful reading cannot drag every constant; `sweeper fit --loss soft_l1`) and the named
# terms a TPU's published numbers can need, chosen per fit by nested cross-validation
# (sweeper/analysis/fit.py EXTRA_TERMS: their reasons and bounds), as `sweeper fit
# --measurements --terms select` does; attention_half_rows among them: Figure 8's
# head-sharded and multihead steps grow with the context faster than their K/V reads.
LOSS = "soft_l1"
DATA = Path(__file__).resolve().parent / "data" / "paper-tpu-v4.csv"


def int8_advantage(profile) -> dict:
    """PaLM 540B decode at batch 64 on 64 chips (4x4x4, ws2d/batch, context 2048 + 32), int8 vs
    bf16 per step: the paper's central int8 result is 28.5 vs 36.9 ms (1.29x, Section 4.4)."""
    from workloads import costmodel
    from workloads.config import load_model
    from workloads.layouts import PhaseLayout, resolve_padding

    layout = PhaseLayout("ws2d", "batch")
    model = resolve_padding(load_model("palm-540b"), 64, (4, 4, 4), layout, layout)
    step = {w: costmodel.predict_phase(model, profile, 64, 64, "decode", 2048, 2048 + 32, layout, w,
                                       (4, 4, 4)).latency_s for w in ("int8", "bf16")}
    return {"int8_s": step["int8"], "bf16_s": step["bf16"], "ratio": step["bf16"] / step["int8"],
            "paper_ratio": 36.9 / 28.5}


def physical(fitted: dict, sheet) -> dict:
    """Every fitted rate at or below the sheet's, every overhead >= 0, every named term
    within its stated bound (fit.EXTRA_BOUNDS)."""
    return {"terms_within_bounds": all(0 <= fitted[t] <= EXTRA_BOUNDS[t][1] for t in MEASUREMENT_CANDIDATES),
            "peak_flops": fitted["peak_flops"] <= sheet.peak_flops,
            "hbm_bandwidth": fitted["hbm_bandwidth"] <= sheet.hbm_bandwidth,
            "ici_bandwidth": fitted["ici_bandwidth"] <= sheet.ici_bandwidth,
            "overheads_nonnegative": min(fitted["op_overhead_s"], fitted["collective_latency_s"],
                                         fitted["launch_overhead_s"],
                                         fitted["collective_latency_s_per_device"],
                                         *fitted["collective_latency_s_by_kind"].values()) >= 0}


def subset(measurements: Path, keep, name: str, folder: Path) -> Path:
    """A CSV of the rows whose source `keep` accepts (the header and comments kept)."""
    lines = measurements.read_text().splitlines()
    body = [line for line in lines if line and not line.startswith("#")]
    path = folder / name
    kept = [_absolute_model(line, measurements.parent) for line in body[1:] if keep(line)]
    path.write_text("\n".join([body[0]] + kept) + "\n")
    return path


# The named term beyond the paper's constants this benchmark tries (sweeper/analysis/fit.py
# EXTRA_TERMS): a fixed cost per phase call (program dispatch, the host sync of each step).
# Figure 8's 8-layer model at context 128 has ~2 ms of weights and FLOPs per step at the
# sheet's rates, yet takes 20-25 ms; Figure 1's 28.5 ms int8 step has ~8 ms of weight reads.
STEP_TERM = ("launch_overhead_s",)
ALL = lambda line: True  # noqa: E731
NO_FIGURE_8 = lambda line: "Figure 8" not in line  # noqa: E731
VARIANTS = (  # name, label, rows kept, loss, extra terms
    ("paper_constants", "all rows, paper's constants, linear loss (`sweeper fit` default)",
     ALL, "linear", ()),
    ("paper_constants_soft_l1", "all rows, paper's constants", ALL, LOSS, ()),
    ("with_step_term", "all rows, + launch_overhead_s", ALL, LOSS, STEP_TERM),
    ("with_matmul_terms", "all rows, + matmul_half_rows, matmul_half_dim", ALL, LOSS,
     ("matmul_half_rows", "matmul_half_dim")),
    ("without_figure_8", "without Figure 8, paper's constants", NO_FIGURE_8, LOSS, ()),
    ("without_figure_8_with_step_term", "without Figure 8, + launch_overhead_s",
     NO_FIGURE_8, LOSS, STEP_TERM),
    ("table_2_only", "Table 2 only, paper's constants", lambda line: "Table 2" in line, LOSS, ()),
)


def _absolute_model(line: str, folder: Path) -> str:
    """A row whose model is a YAML beside the CSV names it by its full path (the part is
    written elsewhere)."""
    model, rest = line.split(",", 1)
    return f"{folder / model},{rest}" if (folder / model).is_file() else line


def variants(measurements: Path, base) -> dict:
    """The same leave-one-out on parts of the CSV and with the named step term, measured
    (the 8 numbers of Table 2 alone: a small CSV that must not blow up)."""
    import tempfile

    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, label, keep, loss, terms in VARIANTS:
            part = subset(measurements, keep, f"{name}.csv", Path(tmp))
            res = external.calibrate_measurements(part, base, ("loo",), loss=loss, terms=terms)
            out[name] = {"label": label, "terms": list(terms), "loss": loss, "rows": len(res.points),
                         "mape_heldout": res.main.mape, "median_ape_heldout": res.main.median_ape,
                         "max_ape_heldout": res.main.max_ape, "refused": res.refused,
                         "worst": _worst(res.main.points, 3),
                         "physical": physical(res.fitted_constants(), base),
                         "fitted": res.fitted_constants(), "int8_advantage": int8_advantage(res.fitted)}
    return out


def without(points) -> dict:
    """The headline's held-out MAPE without the rows named responsible (the same predictions)."""
    figure_8 = points["source"].str.contains("Figure 8")
    small_wg = points["source"].str.startswith("Figure 7 weight-gathered at ~125k")
    return {"figure_8": float(points.loc[~figure_8, "ape"].mean()),
            "figure_8_and_small_wg": float(points.loc[~(figure_8 | small_wg), "ape"].mean())}


def _worst(points, n: int) -> list[dict]:
    """The n held-out rows furthest off (row, source, relative error)."""
    worst = points.reindex(points["relative_error"].abs().sort_values(ascending=False).index)
    return [{"row": int(r["row"]), "source": r["source"], "error": float(r["relative_error"])}
            for _, r in worst.head(n).iterrows()]


def responsible(result, base) -> dict:
    """What no fit of these constants can reconcile, measured from the rows themselves:

    - Figure 8's context slope: its batch-sharded step grows from context 128 to 8192 by far
      more than the KV cache it adds takes to read at the sheet's HBM bandwidth (the only
      context-dependent time the model has, besides attention FLOPs); and the readings give
      attention a larger share than the paper's own quote (Section 4.2: "attention taking
      only 8-31% of total runtime").
    - MFU above the fit's ceiling: with an effective peak p, no row can reach more than
      p / published peak MFU; rows published above it are off whatever else the fit does."""
    fig8 = sorted((o for o in result.points if "Figure 8 batch-sharded" in o.info["source"]),
                  key=lambda o: o.calls[0].call.context)
    slope = None
    if len(fig8) >= 2:
        lo, hi = fig8[0], fig8[-1]
        kv = [o.calls[0].call.predict(base) for o in (lo, hi)]
        slope = {"context": [lo.calls[0].call.context, hi.calls[0].call.context],
                 "published_s": [lo.measured, hi.measured],
                 "published_growth_s": hi.measured - lo.measured,
                 "kv_read_growth_s_at_sheet": (kv[1].memory_s - kv[0].memory_s),
                 "attention_share_implied": (hi.measured - lo.measured) / hi.measured}
    ceiling = result.fitted.peak_flops / base.peak_flops
    above = [{"row": int(o.info["row"]), "source": o.info["source"], "mfu": o.measured}
             for o in result.points if o.metric == "mfu" and o.measured > ceiling]
    small_wg = None
    for o in result.points:
        if o.info["source"].startswith("Figure 7 weight-gathered at ~125k"):
            published_s = o.flops / (o.chips * o.published_peak * o.measured)
            sheet = min((c.call.predict(base) for c in o.calls), key=lambda p: p.latency_s)
            small_wg = {"row": int(o.info["row"]), "published_s": published_s, "ffn": sheet.ffn,
                        "compute_s": sheet.compute_s, "memory_s": sheet.memory_s,
                        "comm_s": sheet.comm_s, "latency_s": sheet.latency_s}
    return {"figure_8_slope": slope, "mfu_ceiling": ceiling, "mfu_above_ceiling": above,
            "small_weight_gathered": small_wg, "wide_tiles": wide_tiles(result, base)}


def wide_tiles(result, base) -> dict:
    """The matmul_half_dim trade, measured: the fit's profile at the sheet's peak with the
    half-dim that keeps PaLM's 4608-wide ws2d tiles (costmodel.weight_tile_dim on 4x4x4) at
    the fit's effective rate, so only wider tiles (wg_xyz: 18432) run faster. Errors of the
    rows it moves most, under the fit and under that profile."""
    import dataclasses

    from sweeper.analysis.observations import predict_value

    fitted = result.fitted
    ratio = base.peak_flops / fitted.peak_flops
    half_dim = max(4608.0 * (ratio * (1 + fitted.matmul_half_dim / 4608.0) - 1), 0.0)
    wide = dataclasses.replace(fitted, peak_flops=base.peak_flops, matmul_half_dim=half_dim)
    moved = [o for o in result.points if o.info["source"].startswith(
        ("Table 2 high-throughput prefill", "Figure 7 weight-gathered"))]
    rows = [{"row": int(o.info["row"]), "source": o.info["source"].split(":")[0],
             "fit_error": predict_value(o, fitted) / o.measured - 1,
             "wide_error": predict_value(o, wide) / o.measured - 1} for o in moved]
    return {"matmul_half_dim": half_dim, "rows": rows}


def fit_rows(measurements: Path, hardware: str) -> dict:
    base = load_hardware(hardware, field="--hardware")
    result = external.calibrate_measurements(measurements, base, ("loo",), loss=LOSS, terms=SELECT,
                                             candidates=MEASUREMENT_CANDIDATES)
    unfitted = external.unfitted_frame(result)
    int8 = int8_advantage(result.fitted)
    parts = variants(measurements, base)
    cause = responsible(result, base)
    held = result.main.points
    rows = []
    for (_, h), (_, u) in zip(held.iterrows(), unfitted.iterrows()):
        rows.append({"row": int(h["row"]), "source": h["source"], "metric": h["metric"],
                     "published": h["measured"], "unfitted": u["predicted"],
                     "unfitted_error": u["relative_error"], "fitted_heldout": h["predicted"],
                     "heldout_error": h["relative_error"]})
    mape = result.main.mape
    data = {"measurements": str(measurements.name), "hardware": hardware,
            "holdout": "loo", "target_mape": TARGET_MAPE, "mape_heldout": mape,
            "median_ape_heldout": result.main.median_ape, "max_ape_heldout": result.main.max_ape,
            "mape_unfitted": float(unfitted["ape"].mean()),
            "insample_mape": float(result.insample["ape"].mean()),
            "meets_target": bool(mape <= TARGET_MAPE), "fitted": result.fitted_constants(),
            "physical": physical(result.fitted_constants(), base), "int8_advantage": int8,
            "refused": result.refused, "blowup": result.main.blowup, "variants": parts,
            "responsible": cause, "worst": _worst(result.main.points, 5),
            "loss": LOSS, "candidate_terms": list(MEASUREMENT_CANDIDATES), "chosen_terms": list(result.terms),
            "mape_heldout_without": without(result.main.points),
            "prior_weight": __import__("sweeper.analysis.fit", fromlist=["x"]).PRIOR_WEIGHT,
            "rows": rows}
    return data


def arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--measurements", type=Path, default=DATA)
    parser.add_argument("--hardware", default="tpu-v4")


BENCHMARK = harness.Benchmark("paper_fit", __doc__.splitlines()[0],
                              lambda args, previous: fit_rows(args.measurements, args.hardware),
                              arguments=arguments)


if __name__ == "__main__":
    sys.exit(harness.main(BENCHMARK))
