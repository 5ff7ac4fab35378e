"""The Markdown of benchmarks/profile_predict.py's results."""

from __future__ import annotations

from benchmarks import report


def markdown(r: dict) -> str:
    pct = report.pct
    prof = r.get("profiling") or {}
    rows = [("op-level profile alone (no trial-level fit)", r["profiled"]),
            ("same profile, collectives by the scalar ici/latency only", r["profiled_scalar_only"]),
            ("host profile the sweep predicted with (unprofiled)", r["host_unprofiled"])]
    if r.get("fit_kfold"):
        rows.append(("trial-level fit, held-out k-fold (calibration.json)", r["fit_kfold"]))
    lines = ["# Op-level profile predicts the calibration sweep", "",
             f"Profile `{r['profile']}` ({r['profile_devices']} devices; `{prof.get('command', '?')}`, "
             f"{prof.get('elapsed_s', '?')} s, load average {prof.get('load_average_start')} at the start, "
             f"{prof.get('load_average_stop')} at the end, 2-core host shared with other jobs). "
             f"{r['n_points']} points of the recorded calibration sweep, every one held out by "
             "construction (the profiler never ran a whole trial).", "",
             "| predictor | points | MAPE | median APE | max APE | top-1 | groups |",
             "|---|---|---|---|---|---|---|"]
    for name, s in rows:
        lines.append(f"| {name} | {s['n']} | {pct(s['mape'])} | {pct(s['median'])} | {pct(s['max'])} | "
                     f"{pct(s['top1'])} | {s['ranking_groups']} |")
    nf = r.get("noise_floor") or {}
    lines += ["", f"Noise floor (replicate error, calibration.json): MAPE {pct(nf.get('mape'))}, "
              f"median {pct(nf.get('median_ape'))}.", "",
              "## Per phase and chip count", "",
              "| phase | chips | n | profile MAPE | median | max | median signed (pred/meas - 1) | "
              "host MAPE | fit k-fold MAPE |", "|---|---|---|---|---|---|---|---|---|"]
    host = {(x["phase"], x["chips"]): x for x in r["host_unprofiled"]["by_phase_chips"]}
    kfold = {(x["phase"], x["chips"]): x for x in (r.get("fit_kfold") or {}).get("by_phase_chips", [])}
    for x in r["profiled"]["by_phase_chips"]:
        key = (x["phase"], x["chips"])
        lines.append(f"| {x['phase']} | {x['chips']} | {x['n']} | {pct(x['mape'])} | {pct(x['median'])} | "
                     f"{pct(x['max'])} | {x['median_signed']:+.1%} | {pct(host.get(key, {}).get('mape'))} | "
                     f"{pct(kfold.get(key, {}).get('mean'))} |")
    return "\n".join(lines) + "\n"


def doc_block(r: dict) -> str:
    """docs/measurement.md's block: the profile alone against the fits."""
    prof = r.get("profiling") or {}
    lines = [f"**Op-level profile alone** (`benchmarks/profile_predict.py`, profile `{r['profile']}`, "
             f"load average {prof.get('load_average_start')} -> {prof.get('load_average_stop')} while "
             f"profiling; {r['n_points']} calibration points, all held out by construction):", ""]
    rows = [["op-level profile", r["profiled"]], ["host profile (unprofiled)", r["host_unprofiled"]]]
    if r.get("fit_kfold"):
        rows.append(["trial-level fit, k-fold held out", r["fit_kfold"]])
    lines += report.table(["predictor", "MAPE", "median", "max", "top-1"],
                          [[name, report.pct(s["mape"]), report.pct(s["median"]), report.pct(s["max"]),
                            f"{report.pct(s['top1'])} over {s['ranking_groups']} groups"] for name, s in rows])
    return report.lines(lines)
