"""Benchmark: the cost model against the paper's own TPU v4 numbers, unfitted and fitted.

    python -m benchmarks.paper_fit                 # benchmarks/data/paper-tpu-v4.csv, tpu-v4

Fits `tpu-v4`'s constants to every published number (sweeper/analysis/external.py, the same
fit as `sweeper fit --measurements ... --holdout loo`) and predicts each row from a fit that
did not see it (leave-one-out; a table's latency and MFU of one run are held out together).
Target (issue 11): held-out MAPE <= 15%. Pure cost model: no JAX, no timing, no host load.
Writes benchmarks/results/paper_fit.{json,md}; docs/cost-model.md quotes the md (its
`generated:paper_fit` block, filled by benchmarks.readme_numbers).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from benchmarks.common import clean, pct, table, write
from sweeper.analysis import external
from workloads.config import load_hardware

TARGET_MAPE = 0.15
DATA = Path(__file__).resolve().parent / "data" / "paper-tpu-v4.csv"


def value(metric: str, number: float) -> str:
    if metric == "mfu":
        return f"{100 * number:.1f}% MFU"
    return f"{number * 1e3:.1f} ms" if number < 1 else f"{number:.3g} s"


def run(measurements: Path, hardware: str) -> tuple[dict, str]:
    base = load_hardware(hardware, field="--hardware")
    result = external.calibrate_measurements(measurements, base, ("loo",))
    unfitted = external.unfitted_frame(result)
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
            "rows": rows}
    lines = [f"Fit of `{hardware}` to {len(rows)} published numbers ({measurements.name}), "
             f"each predicted by a fit that did not see it (leave-one-out): held-out MAPE "
             f"**{pct(mape)}** (target <= {pct(TARGET_MAPE, 0)}: "
             f"{'met' if mape <= TARGET_MAPE else 'NOT met'}), median {pct(result.main.median_ape)}, "
             f"max {pct(result.main.max_ape)}; unfitted (peak numbers) MAPE "
             f"{pct(data['mape_unfitted'])}; in-sample {pct(data['insample_mape'])}.", ""]
    lines += table(["published", "source", "unfitted", "error", "fitted, held out", "error"],
                   [[value(r["metric"], r["published"]), r["source"],
                     value(r["metric"], r["unfitted"]), f"{r['unfitted_error']:+.0%}",
                     value(r["metric"], r["fitted_heldout"]), f"{r['heldout_error']:+.0%}"]
                    for r in rows])
    return clean(data), "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--measurements", type=Path, default=DATA)
    parser.add_argument("--hardware", default="tpu-v4")
    parser.add_argument("--out", type=Path, help="results folder (default benchmarks/results)")
    args = parser.parse_args(argv)
    data, markdown = run(args.measurements, args.hardware)
    json_path, md_path = write("paper_fit", data, markdown, args.out)
    print(markdown)
    print(f"wrote {json_path} and {md_path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
