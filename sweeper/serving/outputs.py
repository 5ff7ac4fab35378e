"""A plan's files for people (`sweeper plan --out-dir DIR`, docs/world.md): the cost/latency
frontier of every hardware planned, as CSV and as a PNG plot.

    rows = frontier_rows(choices)          # one dict per plan on a frontier
    write_frontier(rows, out_dir)          # frontier.csv, frontier.png

A row is one plan that meets the SLO and that no other plan of its hardware beats on chips,
TTFT and TPOT (plan.pareto), with its price per hour (chips x price per chip-hour) where the
hardware has a price, its predicted percentiles, its error band and whether it is the best
plan of its hardware; the serving behaviours it uses (docs/serving-behaviours.md): each
phase's pipeline stages (`prefill_stages`, `decode_stages`: 1 without), the prefill chunk
(`prefill_chunk`: tokens per decode step, 0 for whole prompts) and the profile's shared
prefix it was planned for (`prefix_len`, `prefix_hit`: 0 and empty without one). The plot
draws each hardware's frontier: TPOT and TTFT (the SLO's statistics) against dollars per hour (chips where a hardware has no price).
"""

from __future__ import annotations

import csv
from pathlib import Path

COLUMNS = ("hardware", "price_per_chip_hour", "price_source", "best", "mode", "chips_total",
           "dollars_per_hour", "cost_per_million_tokens", "ttft_p50_s", "ttft_p99_s",
           "tpot_p50_s", "tpot_p99_s", "ttft_slo_stat_s", "tpot_slo_stat_s", "goodput_rps",
           "tokens_per_s_per_chip", "binding", "band", "at_risk", "prefill", "decode",
           "prefill_stages", "prefill_chunk", "decode_stages", "prefix_len", "prefix_hit")


def _layout(part: dict) -> str:
    return (f"{part['replicas']}x{part['chips']} {part['topology']} {part['ffn']}/{part['attn']} "
            f"batch {part['batch']} {part['weights']}")


def frontier_rows(choices) -> list[dict]:
    """The frontier of each choice (plan.HardwareChoice) as flat rows (COLUMNS)."""
    rows = []
    for choice in choices:
        result, price = choice.result, choice.hardware.price_per_chip_hour
        best = result.best
        profile = result.question.profile
        prefix_len = profile.prefix_len
        for plan in result.frontier:
            d = plan.to_dict()
            rows.append({
                "hardware": choice.hardware.name, "price_per_chip_hour": price,
                "price_source": choice.price_source, "best": plan is best, "mode": d["mode"],
                "chips_total": d["chips_total"],
                "dollars_per_hour": d["chips_total"] * price if price is not None else None,
                "cost_per_million_tokens": d["cost_per_million_tokens"],
                **{k: d[k] for k in ("ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s",
                                     "goodput_rps", "tokens_per_s_per_chip", "binding")},
                "ttft_slo_stat_s": plan.summary["ttft_slo_stat_s"],
                "tpot_slo_stat_s": plan.summary["tpot_slo_stat_s"],
                "band": d.get("band"), "at_risk": d.get("at_risk"),
                "prefill": _layout(d["prefill"]), "decode": _layout(d["decode"]),
                "prefill_stages": d["prefill"].get("stages", 1),
                "prefill_chunk": d["prefill"].get("chunk", 0),
                "decode_stages": d["decode"].get("stages", 1),
                "prefix_len": prefix_len, "prefix_hit": profile.prefix_hit if prefix_len else None})
    return rows


def write_frontier(rows: list[dict], out_dir: str | Path, title: str = "") -> dict[str, str]:
    """frontier.csv and frontier.png under `out_dir` (created); {kind: path}."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    csv_path = out / "frontier.csv"
    with csv_path.open("w", newline="") as stream:
        writer = csv.DictWriter(stream, fieldnames=COLUMNS)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: ("" if row[k] is None else row[k]) for k in COLUMNS})
    png_path = out / "frontier.png"
    _plot(rows, png_path, title)
    return {"csv": str(csv_path), "png": str(png_path)}


def _plot(rows: list[dict], path: Path, title: str) -> None:
    # matplotlib only here, lazily: `sweeper plan` without --out-dir never imports it
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    priced = all(r["dollars_per_hour"] is not None for r in rows) and rows
    x_key, x_label = (("dollars_per_hour", "dollars per hour") if priced
                      else ("chips_total", "chips"))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, key, label in ((axes[0], "tpot_slo_stat_s", "TPOT (SLO statistic), ms"),
                           (axes[1], "ttft_slo_stat_s", "TTFT (SLO statistic), ms")):
        for hardware in dict.fromkeys(r["hardware"] for r in rows):
            mine = sorted((r for r in rows if r["hardware"] == hardware), key=lambda r: r[x_key])
            ax.plot([r[x_key] for r in mine], [1e3 * r[key] for r in mine], "o", label=hardware,
                    alpha=0.8)
            for r in mine:
                if r["best"]:
                    ax.plot([r[x_key]], [1e3 * r[key]], "k*", markersize=12)
        ax.set_xlabel(x_label)
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].legend(title="hardware (* best)")
    fig.suptitle(title or "cost/latency frontier (analytical: serving model on the cost model)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
