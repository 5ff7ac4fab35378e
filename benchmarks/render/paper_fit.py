"""The Markdown of benchmarks/paper_fit.py's results (docs/cost-model.md quotes its headline)."""

from __future__ import annotations

from benchmarks.report import met, pct, table


def value(metric: str, number: float) -> str:
    if metric == "mfu":
        return f"{100 * number:.1f}% MFU"
    return f"{number * 1e3:.1f} ms" if number < 1 else f"{number:.3g} s"


def markdown(data: dict) -> str:
    lines = [f"Fit of `{data['hardware']}` to {len(data['rows'])} published numbers ({data['measurements']}), "
             f"each predicted by a fit that did not see it (leave-one-out): held-out MAPE "
             f"**{pct(data['mape_heldout'])}** (target <= {pct(data['target_mape'], 0)}: "
             f"{'met' if data['mape_heldout'] <= data['target_mape'] else 'NOT met'}), median {pct(data['median_ape_heldout'])}, "
             f"max {pct(data['max_ape_heldout'])}; unfitted (peak numbers) MAPE "
             f"{pct(data['mape_unfitted'])}; in-sample {pct(data['insample_mape'])}. Loss {data['loss']}; "
             f"named terms chosen by nested cross-validation among {', '.join(data['candidate_terms'])}: the fit "
             f"on every row chose {', '.join(data['chosen_terms']) or 'none'}. The same held-out predictions "
             f"without Figure 8's 7 rows: MAPE {pct(data['mape_heldout_without']['figure_8'])}; "
             f"without them and Figure 7's weight-gathered point at ~125k tokens: "
             f"{pct(data['mape_heldout_without']['figure_8_and_small_wg'])}.", "",
             "Fitted constants (bounded by the sheet: 275 TFLOP/s, 1.2 TB/s HBM, 270 GB/s ICI; "
             f"overheads >= 0; named terms within fit.EXTRA_BOUNDS; prior weight {data['prior_weight']} "
             f"on log(rate / sheet)): peak "
             f"{data['fitted']['peak_flops'] / 1e12:.0f} TFLOP/s, HBM {data['fitted']['hbm_bandwidth'] / 1e12:.2f} TB/s, "
             f"ICI {data['fitted']['ici_bandwidth'] / 1e9:.0f} GB/s, overlap {data['fitted']['overlap']:.3f}, "
             f"launch_overhead_s {data['fitted']['launch_overhead_s'] * 1e3:.2f} ms, matmul_half_rows "
             f"{data['fitted']['matmul_half_rows']:.0f}, matmul_half_dim {data['fitted']['matmul_half_dim']:.0f}; "
             f"physically possible: **{'yes' if all(data['physical'].values()) else 'no'}**.", "",
             f"int8's decode advantage (PaLM 540B, batch 64, 64 chips, ws2d/batch), with the fit on "
             f"every row: int8 {data['int8_advantage']['int8_s'] * 1e3:.1f} ms vs bf16 {data['int8_advantage']['bf16_s'] * 1e3:.1f} ms per step, "
             f"**{data['int8_advantage']['ratio']:.2f}x** (paper: 28.5 vs 36.9 ms, {data['int8_advantage']['paper_ratio']:.2f}x).", "",
             "Publication: " + (f"**refused** by `sweeper fit`: {data['refused']}." if data["refused"]
                                else "no held-out row blew up (worst <= 3x the median row's error)."), "",
             "The same leave-one-out on parts of the CSV and with each named term fixed on (what is "
             f"responsible, measured; loss {data['loss']} unless the row says linear):", "",
             "| rows | n | held-out MAPE | median | max | blown up | physical | int8 / bf16 | "
             "fitted peak, HBM, ICI | launch_overhead_s, half rows, half dim | worst held-out rows |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, v in data['variants'].items():
        f = v["fitted"]
        worst = "; ".join(f"{w['error']:+.0%} {w['source'].split(':')[0]}" for w in v["worst"])
        lines.append(f"| {v['label']} | {v['rows']} | {pct(v['mape_heldout'])} | {pct(v['median_ape_heldout'])} | "
                     f"{pct(v['max_ape_heldout'])} | {'yes' if v['refused'] else 'no'} | "
                     f"{'yes' if all(v['physical'].values()) else 'no'} | {v['int8_advantage']['ratio']:.2f}x | "
                     f"{f['peak_flops'] / 1e12:.0f} TFLOP/s, {f['hbm_bandwidth'] / 1e12:.2f} TB/s, "
                     f"{f['ici_bandwidth'] / 1e9:.0f} GB/s | {f['launch_overhead_s'] * 1e3:.2f} ms, "
                     f"{f['matmul_half_rows']:.0f}, {f['matmul_half_dim']:.0f} | {worst} |")
    lines += ["", "What no fit of these constants reconciles (computed from the rows and the sheet):", ""]
    slope = data['responsible']["figure_8_slope"]
    if slope:
        lines.append(
            f"- Figure 8's batch-sharded step grows by {slope['published_growth_s'] * 1e3:.1f} ms from context "
            f"{slope['context'][0]:,} to {slope['context'][1]:,}, while the KV cache it adds takes "
            f"{slope['kv_read_growth_s_at_sheet'] * 1e3:.2f} ms to read at the sheet's HBM bandwidth "
            f"({slope['published_growth_s'] / max(slope['kv_read_growth_s_at_sheet'], 1e-12):.0f}x): no "
            f"bandwidth within the sheet gives that slope. The readings also give attention at least "
            f"{slope['attention_share_implied']:.0%} of the step at context {slope['context'][1]:,}, against the "
            f"paper's own \"attention taking only 8-31% of total runtime\" (Section 4.2): the figure's "
            f"readings are doubtful, kept as read.")
    above = data['responsible']["mfu_above_ceiling"]
    lines.append(
        f"- The fit's effective peak ({data['fitted']['peak_flops'] / 1e12:.0f} TFLOP/s, "
        f"{data['responsible']['mfu_ceiling']:.0%} of the published peak) caps every predicted MFU at "
        f"{data['responsible']['mfu_ceiling']:.0%}; " + (
            "published above it: " + "; ".join(f"row {a['row']} ({a['source'].split(':')[0]}) {a['mfu']:.0%}"
                                              for a in above)
            + "." if above else "no row is published above it."))
    tiles = data['responsible']["wide_tiles"]
    lines.append(
        "- The shape term that would lift them (matmul_half_dim: wg_xyz's 18432-wide weight tiles "
        "faster than ws2d's 4608-wide ones) is held down by Figure 7's smaller weight-gathered "
        f"points: at the sheet's peak with matmul_half_dim {tiles['matmul_half_dim']:.0f} (ws2d "
        "tiles kept at the fit's rate), " + "; ".join(
            f"{r['source']} {r['fit_error']:+.0%} -> {r['wide_error']:+.0%}" for r in tiles["rows"])
        + ": Table 2's 76% and Figure 7's weight-gathered line cannot both hold under one "
        "efficiency by shape.")
    wg = data['responsible']["small_weight_gathered"]
    if wg:
        lines.append(
            f"- Figure 7's weight-gathered point at ~125k tokens (row {wg['row']}): 20% MFU is "
            f"{wg['published_s']:.2f} s per prefill; at the sheet's rates its fastest variant ({wg['ffn']}) "
            f"computes for {wg['compute_s']:.2f} s and all-gathers for {wg['comm_s']:.2f} s (HBM "
            f"{wg['memory_s']:.2f} s), {wg['latency_s']:.2f} s in all: the {wg['published_s'] - wg['latency_s']:.2f} s "
            f"it lacks would need an ICI {wg['comm_s'] / max(wg['published_s'] - wg['compute_s'], 1e-12):.2f}x the "
            f"sheet's if it were communication, while Figure 7's larger weight-gathered points and Table 2's "
            f"76% need the sheet's ICI and nearly its peak: the model has no cost that only small "
            f"weight-gathered prefills pay.")
    worst = "; ".join(f"row {w['row']} {w['error']:+.0%} ({w['source']})" for w in data["worst"])
    lines += [f"- Worst held-out rows of the headline fit: {worst}.", ""]
    lines.append("")
    lines += table(["published", "source", "unfitted", "error", "fitted, held out", "error"],
                   [[value(r["metric"], r["published"]), r["source"],
                     value(r["metric"], r["unfitted"]), f"{r['unfitted_error']:+.0%}",
                     value(r["metric"], r["fitted_heldout"]), f"{r['heldout_error']:+.0%}"]
                    for r in data['rows']])
    return "\n".join(lines) + "\n"


def doc_block(data: dict) -> str:
    """docs/cost-model.md's block: the headline paragraphs; the tables of every row and of
    every partial fit stay in the results file."""
    lines = markdown(data).rstrip().splitlines()
    cut = next((i for i, line in enumerate(lines) if line.startswith("The same leave-one-out")),
               len(lines))
    return "\n".join(lines[:cut]).strip() + "\n"


def summary_rows(paper: dict) -> list[list]:
    """benchmarks/results/summary.md's row: the held-out MAPE on the paper's numbers."""
    phys = all(v for v in (paper.get("physical") or {}).values() if isinstance(v, bool))
    ratio = (paper.get("int8_advantage") or {}).get("ratio")
    int8 = f"; int8 decode advantage {ratio:.2f}x (paper 1.29x)" if ratio else ""
    return [["paper fit", f"leave-one-out MAPE <= {pct(paper['target_mape'], 0)} on the "
             "paper's numbers, every constant physically possible",
             f"{pct(paper['mape_heldout'])} (median {pct(paper['median_ape_heldout'])}, "
             f"{len(paper['rows'])} rows); physical: {'yes' if phys else 'no'}{int8}",
             met(paper["mape_heldout"] <= paper["target_mape"] and phys)]]
