"""The Markdown of benchmarks/world.py's results (docs/world.md quotes it up to its every-row
table: `doc_block`)."""

from __future__ import annotations

from benchmarks.report import pct, table

EVERY_ROW = "## Every row"     # docs/world.md quotes the results up to here


def _pct_pair(median: float, worst: float) -> str:
    return f"{pct(median, 0)} / {pct(worst, 0)}"


def _errors(data: dict) -> list[str]:
    """The opening paragraph and the error per chip and metric, then over every chip."""
    t = data["targets"]
    lines = [f"{data['rows_total']} published numbers from {len(data['sources'])} sources "
             f"({', '.join(data['sources'])}) on {len(data['hardware'])} chips "
             f"({', '.join(data['hardware'])}); {data['rows_usable']} need no behaviour the model "
             "lacks. Each is predicted by the shipped datasheet preset and by a preset fitted to "
             "the other sources (leave one source out: the chip's family, else every chip; loss "
             f"{data['loss']}, extra term {', '.join(data['terms']) or 'none'}). Error = |predicted "
             "/ published - 1| in the published metric; median / worst.", ""]
    lines += table(["chip", "metric", "n", "datasheet preset", "fitted, source held out", "bias (held out)"],
                   [[s["hardware"], s["metric"] + (" (needs " + ", ".join(sorted(
                       {n for r in data["rows"] if r["hardware"] == s["hardware"] and r["metric"] == s["metric"]
                        for n in r["needs"]})) + ")" if s["needs_missing_behaviour"] else ""),
                     s["n"], _pct_pair(s["sheet_median"], s["sheet_worst"]),
                     _pct_pair(s["heldout_median"], s["heldout_worst"]), f"{s['heldout_bias']:+.0%}"]
                    for s in data["by_hardware_metric"]])
    lines += ["", "Every chip together (rows that need no missing behaviour):", ""]
    lines += table(["metric", "n", "datasheet preset", "fitted, source held out", "target", "verdict"],
                   [[s["metric"], s["n"], _pct_pair(s["sheet_median"], s["sheet_worst"]),
                     _pct_pair(s["heldout_median"], s["heldout_worst"]),
                     f"<= {pct(t[s['metric']]['limit'], 0)}" if s["metric"] in t else "-",
                     ("met" if t[s["metric"]]["met"] else "NOT met") if s["metric"] in t else "-"]
                    for s in data["by_metric"] if not s["needs_missing_behaviour"]])
    return lines


def _checks(data: dict) -> list[str]:
    """The physical check, the other pooling rules, and the chips alone in their family."""
    p = data["physical"]
    lines = ["", f"No fitted constant above the datasheet (every shipped preset and every held-out "
             f"fold): {'met' if p['met'] else 'NOT met'}.", ""]
    v = data["variants"]
    lines += ["Other pooling rules, measured (held-out median per metric, n): "
              + "; ".join(f"{name.replace('_', ' ')}: " + ", ".join(
                  f"{m} {pct(x['heldout_median'], 0)} ({x['n']})" for m, x in rules.items())
                  for name, rules in v.items()) + ".", ""]
    for chip, a in data["alone_in_family"].items():
        lines += [f"{chip}: no other source of its family, so its held-out rows are predicted from "
                  "other chips' efficiencies and fixed costs. The same rows predicted by fits on the "
                  "rest of their own source (each run held out; the error without that transfer): "
                  + ", ".join(f"{m} {pct(x, 0)} ({a['n'][m]})" for m, x in a["within_source_median"].items())
                  + "; the held-out headline without the rows read off a figure: "
                  + ", ".join(f"{s['metric']} {pct(s['heldout_median'], 0)} ({s['n']})"
                              for s in a["without_figures"]) + ".", ""]
    return lines


def _presets(data: dict) -> list[str]:
    """The shipped fitted presets beside their datasheets, and the rows set apart."""
    lines = ["Shipped fitted presets (workloads/presets/world.yaml), beside their datasheets:", ""]
    lines += table(["preset", "published points (on the chip)", "sources", "peak", "HBM", "interconnect",
                    "overlap", "per layer", "per call", "held-out residuals"],
                   [[name, f"{e['points']} ({e['points_on_chip']})", ", ".join(e["sources"]),
                     f"{e['fitted']['peak_flops'] / 1e12:.0f} of {e['sheet']['peak_flops'] / 1e12:.0f} TFLOP/s",
                     f"{e['fitted']['hbm_bandwidth'] / 1e12:.2f} of {e['sheet']['hbm_bandwidth'] / 1e12:.2f} TB/s",
                     f"{e['fitted']['ici_bandwidth'] / 1e9:.0f} of {e['sheet']['ici_bandwidth'] / 1e9:.0f} GB/s",
                     f"{e['fitted']['overlap']:.2f}", f"{e['fitted']['op_overhead_s'] * 1e6:.1f} us",
                     f"{e['fitted']['launch_overhead_s'] * 1e3:.2f} ms",
                     ", ".join(f"{k} {n}" for k, n in e["residuals"].items())]
                    for name, e in data["presets"].items()])
    needs = data["needs"]
    lines += ["", "Rows that need a behaviour the model lacks (predicted, never fitted): "
              + ("; ".join(f"{k}: {x['n']} rows" for k, x in needs.items()) if needs else "none")
              + ". None of the sources ran chunked prefill, prefix caching or pipeline stages "
              "(static batches, PP 1), so no row needs them."]
    return lines


def _every_row(data: dict) -> list[str]:
    return ["", EVERY_ROW, ""] + table(
        ["row", "source", "chip", "model", "TP", "batch", "in/out", "metric", "published",
         "datasheet", "held out", "needs"],
        [[r["row"], r["source_id"], r["hardware"], r["model"], r["tp"] or "-", r["batch"],
          f"{r['input_len']}/{r['output_len'] or '-'}", r["metric"],
          f"{r['published']:.4g} {r['unit']}", f"{r['sheet_error']:+.0%}",
          f"{r['heldout_error']:+.0%}", ", ".join(r["needs"]) or "-"]
         for r in data["rows"]])


def markdown(data: dict) -> str:
    """benchmarks/results/world.md."""
    return "\n".join(_errors(data) + _checks(data) + _presets(data) + _every_row(data)) + "\n"


def doc_block(data: dict) -> str:
    """docs/world.md's `generated:world` block: the results up to the every-row table."""
    return markdown(data).split(EVERY_ROW)[0].rstrip() + "\n"
