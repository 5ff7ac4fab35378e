"""One source for every published benchmark number: the README's performance tables are
generated from `benchmarks/results/*.json` by this script (`make bench` runs it last).

    python -m benchmarks.readme_numbers            # rewrite README.md between the markers
    python -m benchmarks.readme_numbers --check    # exit 1 if README.md is out of date

The generated text sits between `<!-- bench:begin -->` and `<!-- bench:end -->` in the
README's "Performance" section; nothing outside the markers is touched. A "met" appears
only where the results file says so, with its sample size (issue 14).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from benchmarks import common

ROOT = Path(__file__).resolve().parents[1]
BEGIN, END = "<!-- bench:begin -->", "<!-- bench:end -->"


def _load(results: Path, name: str) -> dict | None:
    path = results / f"{name}.json"
    return json.loads(path.read_text()) if path.is_file() else None


def _x(value, digits: int = 2) -> str:
    return "—" if value is None else f"{value:.{digits}f}×"


def _load_text(block: dict) -> str:
    start = (block.get("context") or {}).get("load_average")
    end = (block.get("context_end") or {}).get("load_average")
    return f"load average {start} at the start, {end} at the end" if start else "load not recorded"


def engine_section(r: dict) -> list[str]:
    single = {row["tokens"]: row["prefill_mfu"] for row in r["prefill_rows"]
              if row["chips"] == 1 and row["process_devices"] == 1}
    largest = max(row["tokens"] for row in r["sharded"])
    ratios = ", ".join(f"{row['ffn']} {_x(row['ratio'])}" for row in
                       sorted((s for s in r["sharded"] if s["tokens"] == largest), key=lambda s: s["ratio"]))
    dec = {(d["batch"], d["chips"], d["ffn"]): d["ratio_to_bound"] for d in r["decode"]
           if d["process_devices"] == d["chips"] or d["chips"] > 1}
    dec_text = "; ".join(f"batch {b}, {c} chip{'s' if c > 1 else ''} {f}: {_x(v)}"
                         for (b, c, f), v in sorted(dec.items()))
    return [
        f"**Engine efficiency** (`benchmarks/engine_efficiency.py`, model `{r['model']['name']}`, run of "
        f"{r['context']['time']}, {_load_text(r)}):",
        "",
        *common.table(["target", "measured", "verdict"], [
            [f"single-chip prefill MFU ≥ {common.pct(r['targets']['single_chip_prefill_mfu_min'], 0)} of host peak",
             "; ".join(f"{common.pct(v)} at {t} tokens" for t, v in sorted(single.items()))
             + f" (per CPU-second {common.pct(r['single_chip_prefill_mfu_per_cpu_s'])} at the largest)",
             common.met(r["meets_prefill_target"])],
            [f"8 emulated chips within {r['targets']['sharded_over_single_max']}× of 1 chip ({largest} tokens)",
             ratios, common.met(r["meets_sharded_target"])],
            [f"decode step within {r['targets']['decode_over_memory_bound_max']}× of its memory bound",
             f"{_x(r['best_decode_ratio'])} to {_x(r['worst_decode_ratio'])} ({dec_text})",
             common.met(r["meets_decode_target"])],
        ]),
    ]


def overhead_section(r: dict) -> list[str]:
    rows = []
    for key in ("sweeper", "tune"):
        b = r.get(key)
        if b:
            rows.append([b["framework"], f"{b['wall_s']:.1f} s", f"{b['trial_run_s_sum']:.1f} s",
                         f"{b['overhead_per_trial_s'] * 1e3:.0f} ms", f"{b['until_first_trial_s']:.1f} s",
                         f"{b['steady_overhead_per_trial_s'] * 1e3:.0f} ms"])
    q = r.get("quickstart") or {}
    lines = [f"**Sweep overhead** (`benchmarks/sweep_overhead.py`, {r['sweeper']['trials']} tiny trials "
             f"one at a time, run of {r['context']['time']}, {_load_text(r)}):", "",
             *common.table(["framework", "wall", "sum of trials", "overhead/trial", "start-up",
                            "overhead/trial after start-up"], rows), ""]
    lines.append(f"- sweeper overhead per trial ≤ Ray Tune's: ratio {r['sweeper_over_tune']:.2f} "
                 f"({common.met(r['meets_tune_target'])}, one run each);")
    if q:
        lines.append(f"- overhead < {common.pct(r['targets']['quickstart_overhead_share_max'], 0)} of the "
                     f"quickstart's wall time: {common.pct(r['quickstart_overhead_share'])} of "
                     f"{q['wall_s']:.1f} s ({q['trials']} trials, compile-cache hit rate "
                     f"{common.pct(q['compile_cache_hit_rate'])}): {common.met(r['meets_quickstart_target'])}.")
    return lines


def search_section(r: dict) -> list[str]:
    lines = [f"**Search efficiency** (`benchmarks/search_efficiency.py`, {r['seeds']} seeds per sampler, "
             f"{_load_text(r)}): trials each sampler is charged for (dispatched trials only) until "
             "the found points reach 95% of the grid's hypervolume; median [min–max] over seeds.", ""]
    for name, block in r["spaces"].items():
        g = block["grid"]
        header = ["sampler", "median", "spread (min–max)", "not reached"]
        rows = []
        for sampler, s in block["samplers"].items():
            spread = (f"{s.get('min_trials_to_target', '—')}–{s['max_trials_to_target']}")
            rows.append([sampler, f"{s['median_trials_to_target']:.1f}", spread, s["censored_runs"]])
        lines += [f"*{name}*: {g['source']}, {g['points']} points ({g['complete']} dispatched, "
                  f"{g['pruned']} pruned or infeasible).", "", *common.table(header, rows), ""]
        for variant, v in (block.get("verdict") or {}).items():
            lines.append(f"- `{variant}`: median {common.pct(v['guided_share_of_grid'])} of the grid "
                         f"(≤ 20%: {common.met(v['meets_share_target'])}); fewer trials than every "
                         f"plain sampler: {common.met(v['beats_every_plain'])}.")
        lines.append("")
    if r.get("fit_note"):
        lines.append(f"`guided+fit`: {r['fit_note']}.")
    return lines


def calibration_section(r: dict) -> list[str]:
    lines = [f"**Calibration** (`benchmarks/calibration.py`, {r['source_text']}; "
             f"{r['trials_complete']} trials, {r['n_points']} points):", ""]
    rows = []
    for name, h in r["holdouts"].items():
        if h.get("skipped"):
            rows.append([name, "skipped", "", "", "", "", h["skipped"]])
            continue
        ci = h.get("mape_ci95") or [None, None]
        rows.append([name, h["n_points"], f"{common.pct(h['mape_heldout'])} [{common.pct(ci[0])}, "
                     f"{common.pct(ci[1])}]", common.pct(h["median_ape_heldout"]),
                     common.pct(h.get("noise_floor_mape")),
                     f"{common.pct(h['top1_agreement'])} over {h['ranking_groups']} groups",
                     h.get("verdict_text", "—")])
    lines += common.table(["hold-out", "points", "MAPE [95% CI]", "median", "noise floor",
                           "top-1", "verdict"], rows)
    return lines


def profile_predict_section(r: dict) -> list[str]:
    prof = r.get("profiling") or {}
    lines = [f"**Op-level profile alone** (`benchmarks/profile_predict.py`, profile `{r['profile']}`, "
             f"load average {prof.get('load_average_start')} -> {prof.get('load_average_stop')} while "
             f"profiling; {r['n_points']} calibration points, all held out by construction):", ""]
    rows = [["op-level profile", r["profiled"]], ["host profile (unprofiled)", r["host_unprofiled"]]]
    if r.get("fit_kfold"):
        rows.append(["trial-level fit, k-fold held out", r["fit_kfold"]])
    lines += common.table(["predictor", "MAPE", "median", "max", "top-1"],
                          [[name, common.pct(s["mape"]), common.pct(s["median"]), common.pct(s["max"]),
                            f"{common.pct(s['top1'])} over {s['ranking_groups']} groups"] for name, s in rows])
    return lines


def generate(results: Path) -> str:
    parts = ["_Generated by `python -m benchmarks.readme_numbers` from `benchmarks/results/*.json`; "
             "do not edit by hand._", ""]
    for name, section in (("engine_efficiency", engine_section), ("sweep_overhead", overhead_section),
                          ("calibration", calibration_section), ("profile_predict", profile_predict_section),
                          ("search_efficiency", search_section)):
        data = _load(results, name)
        if data is None:
            parts += [f"**{name}**: no results file.", ""]
            continue
        try:
            parts += section(data) + [""]
        except KeyError as err:   # a results file from an older version of its benchmark
            parts += [f"**{name}**: results file lacks {err} (run `make bench`).", ""]
    return "\n".join(parts).rstrip() + "\n"


def replace_between(text: str, body: str) -> str:
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        raise SystemExit(f"README.md: markers {BEGIN} ... {END} not found")
    return text[:start + len(BEGIN)] + "\n" + body + text[end:]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", default=str(common.RESULTS))
    parser.add_argument("--readme", default=str(ROOT / "README.md"))
    parser.add_argument("--check", action="store_true", help="exit 1 if the README is out of date")
    args = parser.parse_args(argv)
    readme = Path(args.readme)
    text = readme.read_text()
    new = replace_between(text, generate(Path(args.results)))
    if args.check:
        if new != text:
            print(f"{readme}: performance numbers out of date; run python -m benchmarks.readme_numbers",
                  file=sys.stderr)
            return 1
        return 0
    readme.write_text(new)
    print(f"{readme}: performance section regenerated from {args.results}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
