"""The Markdown of benchmarks/search_efficiency.py's results."""

from __future__ import annotations

from benchmarks import report
from benchmarks.search_efficiency import TARGET_GUIDED_SHARE


def markdown(r: dict) -> str:
    lines = ["# Search efficiency: trials to reach 95% of the full grid's hypervolume", "",
             f"Seeds per sampler: {r['seeds']}; load average {r['context']['load_average']} at the "
             f"start, {r['context_end']['load_average']} at the end"
             f"{report.steal_clause(r['context_end'])}. GP: {r['gp_note']}. "
             f"guided+fit: {r['fit_note'] or 'not run (no --fit-study)'}. Took "
             f"{r['elapsed_s']:.0f} s.", ""]
    for name, block in r["spaces"].items():
        g = block["grid"]
        lines += [f"## {name}: {g['points']} points ({g['complete']} dispatchable, {g['pruned']} "
                  f"pruned or not measured), {g['source']}", ""]
        if "csv" in g:
            lines += [f"Grid: the recorded calibration sweep `{g['csv']}`, trials of seed "
                      f"{g['score_seed']} ({g['missing']} points of the space neither measured nor the same "
                      "program as a measured one: told PRUNED, never charged). Points that run the same program (every layout "
                      "on one chip; ws1d and ws2d on an X = 1 torus) share the median of their "
                      f"measurements: {g['configurations']} configurations.", ""]
        if "study" in g:
            lines += [f"Grid measured once in study `{g['study']}` ({g['measure_s']:.0f} s, load "
                      f"average {g['load_average']}); every sampler replays those numbers. Points "
                      "that run the same program (every layout on one chip; ws1d and ws2d on an "
                      f"X = 1 torus) are one configuration, given the median of their measurements: "
                      f"{g['configurations']} configurations.", ""]
        ks = list(next(iter(block["samplers"].values()))["hv_fraction_at"])
        lines += [f"Pareto frontier of the whole grid: {g['pareto_points']} points "
                  f"({g.get('pareto_configurations', g['pareto_points'])} distinct). Hypervolume of the "
                  "log10 objectives (reference 1.1 x the worst value); the last column is the same "
                  "count for the linear hypervolume (`sweeper pareto`'s), which a single good point "
                  "nearly fills when a few outliers set the reference.", ""]
        header = ["sampler", "seeds", "trials to 95% (median)", "min–max", "IQR", "share of grid",
                  "not reached"] + [f"HV after {k} (median)" for k in ks] + ["linear HV: median"]
        rows = []
        for sampler, s in block["samplers"].items():
            iqr = s["iqr_trials_to_target"]
            rows.append([f"**{sampler}**" if sampler.startswith("guided") else sampler, len(s["runs"]),
                         f"{s['median_trials_to_target']:.1f}",
                         f"{s['min_trials_to_target']}–{s['max_trials_to_target']}",
                         f"{iqr[0]:.1f}–{iqr[1]:.1f}", report.pct(s["share_of_grid"]),
                         s["censored_runs"]] + [report.pct(s["hv_fraction_at"][k]) for k in ks]
                        + [f"{s['median_trials_to_target_linear']:.1f}"])
        lines += report.table(header, rows) + [""]
        for variant, v in (block["verdict"] or {}).items():
            lines += [f"`{variant}`: median {report.pct(v['guided_share_of_grid'])} of the grid (target <= "
                      f"{report.pct(TARGET_GUIDED_SHARE, 0)}: {report.met(v['meets_share_target'])}); "
                      f"fewer trials than every plain sampler: {report.met(v['beats_every_plain'])} "
                      f"(best plain: {v['best_plain']}).", ""]
        if block.get("seeds"):
            lines += ["Seeds (the cost model's picks, in the order they run; measured values from the grid):", ""]
            for variant, seeds in block["seeds"].items():
                lines += [f"- `{variant}`: " + "; ".join(seeds)]
            lines.append("")
    return "\n".join(lines)


def doc_block(r: dict) -> str:
    """docs/performance.md's block: trials to the target per sampler, the verdicts."""
    lines = [f"**Search efficiency** (`benchmarks/search_efficiency.py`, {r['seeds']} seeds per sampler, "
             f"{report.load_text(r)}): trials each sampler is charged for (dispatched trials only) until "
             "the found points reach 95% of the grid's hypervolume; median [min–max] over seeds.", ""]
    for name, block in r["spaces"].items():
        g = block["grid"]
        header = ["sampler", "median", "spread (min–max)", "not reached"]
        rows = []
        for sampler, s in block["samplers"].items():
            spread = (f"{s.get('min_trials_to_target', '—')}–{s['max_trials_to_target']}")
            rows.append([sampler, f"{s['median_trials_to_target']:.1f}", spread, s["censored_runs"]])
        lines += [f"*{name}*: {g['source']}, {g['points']} points ({g['complete']} dispatched, "
                  f"{g['pruned']} pruned or infeasible).", "", *report.table(header, rows), ""]
        for variant, v in (block.get("verdict") or {}).items():
            lines.append(f"- `{variant}`: median {report.pct(v['guided_share_of_grid'])} of the grid "
                         f"(≤ 20%: {report.met(v['meets_share_target'])}); fewer trials than every "
                         f"plain sampler: {report.met(v['beats_every_plain'])}.")
        lines.append("")
    if r.get("fit_note"):
        lines.append(f"`guided+fit`: {r['fit_note']}.")
    return report.lines(lines)


def summary_rows(r: dict) -> list[list]:
    """benchmarks/results/summary.md's rows: per guided variant, its two targets."""
    rows = []
    for name, block in r["spaces"].items():
        plain = ", ".join(f"{s} {v['median_trials_to_target']:.1f}" for s, v in block["samplers"].items()
                          if not s.startswith("guided"))
        size = block["grid"]["complete"]
        for variant, v in (block.get("verdict") or {}).items():
            g = block["samplers"][variant]
            rows.append(["search", f"{name}: {variant} reaches 95% HV within 20% of the "
                         f"{size} dispatchable points (every seed)",
                         f"median {g['median_trials_to_target']:.1f}, worst {g['max_trials_to_target']} "
                         f"over {len(g['runs'])} seeds", report.met(v["meets_share_target"])])
            rows.append(["search", f"{name}: {variant}'s worst seed beats every plain median",
                         f"plain medians: {plain}", report.met(v["beats_every_plain"])])
    return rows
