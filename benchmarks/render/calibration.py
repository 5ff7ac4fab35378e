"""The Markdown of benchmarks/calibration.py's results: every hold-out scheme with its
bootstrap interval beside the noise floor, then each measured section."""

from __future__ import annotations

from benchmarks import report
from benchmarks.calibration import (MIN_GROUPS, QUICKSTART_FLOOR_RATIO, TARGET_MAPE, TARGET_MEDIAN,
                                    TARGET_OVERHEAD_SHARE, TARGET_SCHEMES, TARGET_TOP1)


def _holdouts() -> tuple[str, ...]:
    from sweeper.analysis.holdout import HOLDOUTS   # the schemes, in their order

    return HOLDOUTS


def _second_host_lines(h: dict | None) -> list[str]:
    if not h:
        return []
    pct, meta = report.pct, h["recorded"]
    lines = ["", "## The same sweep on a second host", "",
             f"`search_spaces/calibration.yaml` run again on another VM of this project "
             f"(CPU: {meta.get('cpu')}; study {meta.get('study')}, {h['trials']} trials, median 1-min "
             f"load during its timed runs {meta.get('host_load_avg_1m_median')}; {meta.get('note')}), "
             f"fitted by the same pipeline: statistic **{h['statistic']}** (one measurement's error: "
             f"median {pct(h['noise_floor_mape']['median'])}, min {pct(h['noise_floor_mape']['min'])}), "
             f"terms {', '.join(h['terms_selected']) or 'none'}. Its trials' median prefill ran "
             f"{h['faster_than_recording']['prefill']:.1f}x and median decode step "
             f"{h['faster_than_recording']['decode']:.1f}x faster than the recording's (the same "
             "configurations). Against replicate means (measured, not the targets' data):", "",
             "| hold-out | configurations | MAPE vs replicate mean | floor (one measurement / sqrt n) "
             "| signed median per (phase, chips) |", "|---|---|---|---|---|"]
    for name, t in h["holdouts"].items():
        cells = ", ".join(f"{c['phase']} x{c['chips']} {100 * c['signed_median']:+.1f}%" for c in t["cells"])
        lines.append(f"| {name} | {t['configurations']} | {pct(t['mape_vs_mean'])} | "
                     f"{pct(t['floor_vs_mean'])} | {cells} |")
    return lines


def _one_chip_lines(o: dict | None) -> list[str]:
    if not o:
        return []
    lines = ["", "### The 1-chip fold of leave-one-chip-count-out: what the fixed costs fit to (measured)", "",
             "The fold that holds out 1 chip fits on 2-8 chips, where every decode step has the same "
             "collectives per layer (3 all-gathers, 3 reduce-scatters; n_layers 2), so a per-layer fixed "
             "cost (op_overhead_s: all a 1-chip step has beyond its FLOPs and bytes) and one kind's "
             "per-op latency explain those points equally; only the upper bound of a per-op latency "
             f"decides. fit.HOST_COLLECTIVE_LATENCY_MAX_S = {o['cap_s'] * 1e3:.2f} ms is one whole "
             "all-gather of 2.36 MB per device on 2 emulated devices on this host "
             "(benchmarks/results/collectives.md), a bound from outside this sweep; the rows at half and "
             "twice it say how much the fold hangs on it. Signed median error of the 1-chip decode "
             "against each point (the fit on every point predicts it in-sample):", "",
             "| per-op latency bound | fit | terms kept (nested selection) | op_overhead_s | "
             "latency per kind | fixed cost of a 1-chip step | decode x1 signed median |",
             "|---|---|---|---|---|---|---|"]
    def ms(seconds: float) -> str:     # a constant at its 0 bound (1e-12 s) reads 0
        return "0" if seconds < 1e-9 else f"{seconds * 1e3:.3g} ms"

    for r in o["rows"]:
        kinds = ", ".join(f"{k} {ms(v)}" for k, v in r["latency_by_kind"].items())
        lines.append(f"| {r['cap']} | {r['fit']} | {', '.join(r['terms']) or 'none'} | "
                     f"{ms(r['op_overhead_s'])} | {kinds} | {r['fixed_1chip_step_s'] * 1e3:.2f} ms | "
                     f"{100 * r['decode_x1_signed_median']:+.1f}% |")
    return lines


def _multigroup_lines(m: dict | None) -> list[str]:
    if not m:
        return []
    pct = report.pct
    fits = m["fits"]
    lines = ["", "### What is responsible for the prefill cells: weight-gathered programs of more than one group "
             "(measured)", "",
             f"The same terms ({', '.join(m['terms']) or 'none'}; not chosen again) on every point and without "
             f"the {m['excluded_points']} prefill points of {', '.join(m['excluded_cells'])} (weights gathered "
             "over y in more than one group, left split over z); held-out, against replicate means:", "",
             "| hold-out | MAPE, all points | worst cell, all points | MAPE, without them | worst cell, without them |",
             "|---|---|---|---|---|"]
    for scheme, a in fits.get("all points", {}).items():
        b = fits.get("without multi-group gathers", {}).get(scheme, {})
        lines.append(f"| {scheme} | {pct(a['mape_vs_mean'])} | {a['worst_cell']['cell']} "
                     f"{a['worst_cell']['signed_median']:+.1%} | {pct(b.get('mape_vs_mean'))} | "
                     + (f"{b['worst_cell']['cell']} {b['worst_cell']['signed_median']:+.1%} |" if b else "— |"))
    off = fits.get("all points, no multi-group price")
    if off:
        lines += ["", f"The emulated host's price of a weight gather of several groups "
                  f"(costmodel.HOST_MULTIGROUP_GATHER_SCALE = {m['gather_scale']}: measured by "
                  "benchmarks/collectives.py) against none (every byte at one group's price), the same terms, "
                  "every point; held-out, against replicate means:", "",
                  "| hold-out | MAPE, with the price | worst cell | MAPE, without it | worst cell |", "|---|---|---|---|---|"]
        for scheme, a in fits.get("all points", {}).items():
            b = off.get(scheme, {})
            lines.append(f"| {scheme} | {pct(a['mape_vs_mean'])} | {a['worst_cell']['cell']} "
                         f"{a['worst_cell']['signed_median']:+.1%} | {pct(b.get('mape_vs_mean'))} | "
                         + (f"{b['worst_cell']['cell']} {b['worst_cell']['signed_median']:+.1%} |" if b else "— |"))
    hlo = m.get("hlo_comm_bytes_per_chip", {})
    if hlo:
        lines += ["", "Collective bytes per chip of each prefill program, read from its HLO (median over its "
                  "trials; bf16 collectives run in f32): " + ", ".join(
                      f"{k} {v / 1e6:.1f} MB" for k, v in hlo.items()) + "."]
    return lines


def _gather_lines(g: dict | None) -> list[str]:
    if not g or not g.get("rows"):
        return []
    return ["", "### The prefill residual by weight-gathered layout: the cache guess (measured)", "",
            "Per (chips, prefill layout), k-fold held-out, against replicate means; a gather of g devices "
            "in n/g groups; weights gathered per layer (one layer's weights / the chips they stay split "
            "over); the mesh's devices share one worker's caches; time above ws2d's (which gathers no "
            "weights), mean over the same batches, seeds and attention layouts:", "",
            "| chips (topology) | prefill layout | gather: g x groups | gathered per device per layer "
            "| by the mesh per layer | signed median error | measured above ws2d | predicted above ws2d |",
            "|---|---|---|---|---|---|---|---|", *(f"| {row} |" for row in g["rows_md"]), "", g["text"]]


def markdown(r: dict) -> str:
    pct = report.pct
    rec = r["recorded"]
    nf = r["noise_floor"] or {}
    lines = [
        "# Calibration benchmark: the recorded calibration sweep",
        "",
        f"Data: {r['source_text']}; {r['trials_complete']} of {r['trials_total']} trials complete, "
        f"{r['n_points']} points (prefill_s and decode_step_s). Sweep wall time "
        f"{rec.get('wall_s') or '?'} s, load average {rec.get('load_average') or '?'} (median 1-min "
        f"load during the timed runs {rec.get('host_load_avg_1m_median') or '?'}); "
        f"{rec.get('note') or 'measured on this host'}. Every error below is on held-out points only.",
        "",
        *_orchestration_lines(rec.get("orchestration")),
        f"Noise floor (one measurement's error: {nf.get('groups', 0)} configurations measured in two "
        f"trials, each against the other, divided by sqrt 2): MAPE {pct(nf.get('mape'))}, median {pct(nf.get('median_ape'))} over "
        f"{nf.get('n_points', 0)} points (prefill {pct((nf.get('by_phase') or {}).get('prefill', {}).get('mape'))}, "
        f"decode {pct((nf.get('by_phase') or {}).get('decode', {}).get('mape'))}). Median 95% CI of one "
        f"trial's own median: prefill ±{pct(r['measurement_ci_rel_median']['prefill'])}, decode "
        f"±{pct(r['measurement_ci_rel_median']['decode'])}.",
        "",
        "| hold-out | points | MAPE [95% CI] | median APE [95% CI] | noise floor | top-1 [95% CI] | groups | verdict |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, h in r["holdouts"].items():
        if h.get("skipped"):
            lines.append(f"| {name} | — | skipped: {h['skipped']} | | | | | |")
            continue
        mc, dc, tc = h["mape_ci95"], h["median_ci95"], h["top1_ci95"]
        lines.append(f"| {name} | {h['n_points']} | {pct(h['mape_heldout'])} [{pct(mc[0])}, {pct(mc[1])}] | "
                     f"{pct(h['median_ape_heldout'])} [{pct(dc[0])}, {pct(dc[1])}] | "
                     f"{pct(h['noise_floor_mape'])} | {pct(h['top1_agreement'])} [{pct(tc[0])}, {pct(tc[1])}] | "
                     f"{h['ranking_groups']} | {h['verdict_text']} |")
    lines += _replicate_mean_lines(r)
    lines += _second_host_lines(r.get("second_host"))
    lines += _gather_lines(r.get("gather_residuals"))
    lines += _multigroup_lines(r.get("multigroup_gathers"))
    lines += _one_chip_lines(r.get("one_chip_fold"))
    uw = r["unweighted_kfold"]
    lines += [
        "",
        f"Targets: MAPE <= {pct(TARGET_MAPE, 0)} and median <= {pct(TARGET_MEDIAN, 0)} for "
        f"{', '.join(TARGET_SCHEMES)}; top-1 >= {pct(TARGET_TOP1, 0)} over >= {MIN_GROUPS} groups. "
        f"All met: **{'yes' if r['all_targets_met'] else 'no'}** (met = the 95% bootstrap interval, "
        "resampling trials or groups, is on the target's side).",
        "",
        f"- The same k-fold with equal weights (no CI weighting): MAPE {pct(uw['mape_heldout'])}, median "
        f"{pct(uw['median_ape_heldout'])}.",
        f"- The sweep's own profile, unfitted: MAPE {pct(r['unfitted_mape'])}; in-sample MAPE of the fit "
        f"on all points {pct(r['insample_mape'])} (not a claim).",
        "",
        *_noise_lines(r["noise_sources"]),
        "## What each fitted term buys (held-out MAPE)",
        "",
        "| model | " + " | ".join(TARGET_SCHEMES) + " |",
        "|---|" + "---|" * len(TARGET_SCHEMES),
        *[f"| {name} | " + " | ".join(pct(v.get(s)) for s in TARGET_SCHEMES) + " |"
          for name, v in r["term_ablation"].items()],
        "",
        "## Where the error is (measured)",
        "",
    ]
    for name in TARGET_SCHEMES:
        h = r["holdouts"].get(name)
        if not h or h.get("skipped"):
            continue
        a = h["attribution"]
        lines += [f"### {name}", ""]
        corr = ", ".join(f"{k.replace('spearman_ape_vs_', '')} {v:+.2f}" for k, v in a.items()
                         if k.startswith("spearman"))
        if corr:
            lines += [f"Spearman correlation of a point's held-out error with its own noise: {corr}.", ""]
        lines += ["| phase | chips | n | MAPE | median | median signed error (pred/meas - 1) |",
                  "|---|---|---|---|---|---|"]
        bias = {(b["phase"], b["chips"]): b["signed"] for b in a["bias_by_chips"]}
        for row in a["by_chips"]:
            lines.append(f"| {row['phase']} | {row['chips']} | {row['count']} | {pct(row['mean'])} | "
                         f"{pct(row['median'])} | {bias.get((row['phase'], row['chips']), 0):+.1%} |")
        lines += ["", "| phase | layout | n | MAPE | median |", "|---|---|---|---|---|"]
        for row in a["by_layout"][:8]:
            lines.append(f"| {row['phase']} | {row['layout']} | {row['count']} | {pct(row['mean'])} | "
                         f"{pct(row['median'])} |")
        lines.append("")
    lines += _chip_term_lines(r.get("chip_terms"))
    lines += _quickstart_lines(r.get("quickstart"))
    lines += ["## Fitted constants (fit on all points; whole host, each virtual chip gets its share)", ""]
    for key, value in r["fitted"].items():
        lines.append(f"- `{key}`: {value}")
    return "\n".join(lines) + "\n"


def _chip_term_lines(c: dict | None) -> list[str]:
    if not c:
        return []
    lines = ["## Can 1-4 chips predict the 8-chip terms? (measured)", "",
             f"The terms that grow with the devices sharing a core, freed together ({', '.join(c['terms'])}), "
             "fitted on every chip count and on chips <= 4 only; the 8-chip cells' signed median error "
             "(prediction / measurement - 1) of each fit:", "",
             "| fit on | " + " | ".join(f"`{t}`" for t in c["terms"]) + " | decode x8 | prefill x8 |",
             "|---|" + "---|" * (len(c["terms"]) + 2)]
    for f in c["fits"].values():
        lines.append(f"| {f['label']} | " + " | ".join(f"{f['values'][t]:.3g} s" for t in c["terms"])
                     + f" | {f['signed']['decode']:+.1%} | {f['signed']['prefill']:+.1%} |")
    lines += ["", "A fit that never saw 8 chips sets every such term to (about) 0: from 1 to 4 chips the "
              "measured decode step does not grow the way these terms grow, so neither the "
              "`chips` nor the `extrapolation` scheme can predict the 8-chip cells "
              f"(decode x8 {c['fits']['up_to_4_chips']['signed']['decode']:+.1%} however the terms are chosen).", ""]
    return lines


def _quickstart_lines(q: dict | None) -> list[str]:
    if not q:
        return []
    pct = report.pct
    rec = q["recorded"]
    lines = ["## The quickstart's closing analysis (every hold-out within "
             f"{QUICKSTART_FLOOR_RATIO:g}x its noise floor)", "",
             f"The quickstart study `{rec.get('study', '?')}` (`search_spaces/quickstart.yaml`, tiny model, "
             f"{q['trials_complete']} trials, {q['replicated_configurations']} configurations measured twice), "
             f"recorded in `quickstart-trials.csv`: {rec.get('note') or 'measured on this host'}; median 1-min "
             f"load during its timed runs {rec.get('host_load_avg_1m_median')}, max "
             f"{rec.get('host_load_avg_1m_max')}. Its own closing analysis is the row `median, default terms` (the "
             "trial's median, fit.STUDY_TERMS); each cell is held-out MAPE / noise floor (one measurement's error).", "",
             "| statistic, terms | selected | " + " | ".join(_holdouts()) + " | all within 2x |",
             "|---|---|" + "---|" * (len(_holdouts()) + 1)]
    for label, run in q["runs"].items():
        cells = []
        for name in _holdouts():
            h = run["schemes"].get(name)
            if not h:
                cells.append("—")
                continue
            floor = "unknown" if h["floor"] is None or h["floor"] != h["floor"] else pct(h["floor"])
            cells.append(f"{pct(h['mape'])} / {floor}" + (" ✓" if h["within"] else ""))
        judged = [h for h in run["schemes"].values() if h["floor"] is not None and h["floor"] == h["floor"]]
        ok = all(h["within"] for h in judged)
        lines.append(f"| {label} | {', '.join(run['selected']) or '—'} | " + " | ".join(cells)
                     + f" | {'yes' if ok else 'no'} (of {len(judged)} with a floor) |")
    lines += ["", "Where the error is (worst (phase, chips) cell by held-out MAPE, per scheme):", ""]
    for label, run in q["runs"].items():
        worst = "; ".join(f"{n}: {h['worst_cell']['phase']} x{h['worst_cell']['chips']} "
                          f"{pct(h['worst_cell']['mape'])} (n={h['worst_cell']['n']})"
                          for n, h in run["schemes"].items())
        lines.append(f"- {label}: {worst}")
    slopes = q.get("batch_slopes") or []
    if slopes:
        lines += ["", "The residual structure, measured (a line in batch per chip count: a decode step's "
                  "cost per sequence against a prefill's per prompt token; the paper's model gives the "
                  "ratio in the last column, from the same FLOPs per token):", "",
                  "| statistic | chips | trials | decode per sequence | prefill per token | ratio | model's ratio |",
                  "|---|---|---|---|---|---|---|"]
        lines += [f"| {r['statistic']} | {r['chips']} | {r['trials']} | {r['decode_s_per_sequence'] * 1e6:.1f} us "
                  f"| {r['prefill_s_per_token'] * 1e6:.2f} us | {r['ratio']:.2f} | {r['model_ratio']:.2f} |"
                  for r in slopes]
    lines.append("")
    return lines


def _replicate_mean_lines(r: dict) -> list[str]:
    pct = report.pct
    st, sr = r["statistic"], r["stop_rule"]
    lines = ["", "## Against replicate means, per chip count", "",
             f"Trial statistic: **{st['chosen']}** of the timed runs, chosen by measurement (one "
             f"measurement's error from the replicates: median {pct(st['noise_floor_mape']['median'])}, "
             f"min {pct(st['noise_floor_mape']['min'])}). Extra terms freed (nested cross-validation, "
             f"inner {3}-fold on each fit's own training points): "
             f"{', '.join(r['terms_selected']) or 'none (the paper constants alone won)'}.", "",
             "| hold-out | configurations | MAPE vs replicate mean | median | floor (one measurement / sqrt n) "
             "| worst (phase, chips) signed median | MAPE <= 7% | every cell within ±5% |",
             "|---|---|---|---|---|---|---|---|"]
    for name, h in r["holdouts"].items():
        t = h.get("vs_replicate_means")
        if not t:
            continue
        w = t["worst_cell"] or {}
        lines.append(f"| {name} | {t['configurations']} | {pct(t['mape_vs_mean'])} | {pct(t['median_vs_mean'])} | "
                     f"{pct(t['floor_vs_mean'])} | {w.get('phase')} x{w.get('chips')}: "
                     f"{100 * w.get('signed_median', float('nan')):+.1f}% | "
                     f"{'met' if t['met_mape'] else 'missed'} | {'met' if t['met_cells'] else 'missed'} |")
    names = [(c["phase"], c["chips"]) for c in r["holdouts"]["kfold"]["vs_replicate_means"]["cells"]]
    lines += ["", "Signed median error (held-out prediction / replicate mean - 1) per cell:", "",
              "| hold-out | " + " | ".join(f"{p} x{c}" for p, c in names) + " |",
              "|---|" + "---|" * len(names)]
    for name, h in r["holdouts"].items():
        t = h.get("vs_replicate_means")
        if t:
            got = {(c["phase"], c["chips"]): c["signed_median"] for c in t["cells"]}
            lines.append(f"| {name} | " + " | ".join(f"{100 * got[k]:+.1f}%" if k in got else "—"
                                                     for k in names) + " |")
    cs = r.get("core_share_check") or {}
    if cs:
        keys = list(next(iter(cs.values())))
        lines += ["", "Is the 8-chip bias the serialisation of virtual devices sharing a core? The noise "
                  "runs' signed median error (fitted on the sweep; one worker = 4 devices per core at 8 "
                  "chips, two = 8 per core). A serialisation term would grow with devices per core; the "
                  "bias is larger with one worker, as a fixed per-device cost is where compute is faster:", "",
                  "| fit | " + " | ".join(keys) + " |", "|---|" + "---|" * len(keys)]
        for label, cells in cs.items():
            lines.append(f"| {label} | " + " | ".join(f"{100 * cells[k]:+.1f}%" for k in keys) + " |")
    lines += ["", f"Stop rule on the recorded trials: every trial did {sr['min_runs_recorded']:.0f} runs "
              f"(min {sr['runs_recorded']['min']:.0f}, max {sr['runs_recorded']['max']:.0f}); one run takes "
              f"{sr['s_per_run_median']:.2f} s (median), so the minimum alone takes "
              f"{sr['min_runs_alone_take_s']:.1f} s against the 1 s budget: the rule never decided. "
              f"The worse phase's 95% CI after those runs is ±{pct(sr['ci_rel_worse_phase_median'])} (median). "
              "Candidate rules (CI ~ 1/sqrt(runs), from each trial's own CI):", "",
              "| CI target | min runs | budget | stopped by the CI | stopped at the minimum | runs (median) | timed s, whole sweep |",
              "|---|---|---|---|---|---|---|"]
    for c in sr["candidates"]:
        lines.append(f"| ±{pct(c['ci_target'], 0)} | {c['min_runs']} | {c['budget_s']:.0f} s | "
                     f"{pct(c['stopped_by_ci'])} | {pct(c['stopped_at_min'])} | {c['runs_median']:.0f} | "
                     f"{c['sweep_timed_s']:.0f} |")
    return lines


def _noise_lines(n: dict) -> list[str]:
    pct = report.pct
    lines = ["## Where the noise comes from (measured)", ""]
    if n["by_parallel"]:
        lines += ["The same 4 configurations (chips 1 and 8 x prefill ws2d and wg_xyz, batch 8) x 3 "
                  "seeds, run once with one worker (the whole host) and once with two (the sweep's "
                  "setting):", "",
                  "| workers | trials | replicate MAPE | replicate median | trial's own 95% CI, median (prefill / decode) | 1-min load |",
                  "|---|---|---|---|---|---|"]
        for parallel, v in n["by_parallel"].items():
            ci = v["ci_rel_median"]
            lines.append(f"| {parallel} | {v['trials']} | {pct(v['noise_floor_mape'])} | "
                         f"{pct(v['noise_floor_median'])} | ±{pct(ci['prefill'])} / ±{pct(ci['decode'])} | "
                         f"{v['load_avg_1m_median']} |")
        lines.append("")
    lines += ["Replicate error of the calibration sweep per chip count: " + ", ".join(
        f"{c} chip{'s' if int(c) > 1 else ''} {pct(v['mape'])}" for c, v in n["by_chips"].items()) + ".", ""]
    by_stat = n["replicate_mape_by_statistic"]
    lines += ["Replicate MAPE of each trial's median against its fastest run: prefill "
              f"{pct(by_stat['prefill_median'])} (median) and {pct(by_stat['prefill_min'])} (min), decode "
              f"{pct(by_stat['decode_median'])} and {pct(by_stat['decode_min'])}.", ""]
    gaps = n["ranking_gaps"]
    lines += [f"Ranking groups whose measured best beats the runner-up by more than one "
              f"measurement's replicate error ({pct(n['gap_threshold'])}): **{n['decidable_groups']} of "
              f"{len(gaps)}** (gaps: {', '.join(pct(g) for g in sorted(gaps))}). In the others a second "
              "run of the same sweep would pick another winner about as often as the model does.", ""]
    return lines


def _orchestration_lines(o: dict | None) -> list[str]:
    """Issue 14: the sweep's own orchestration overhead, measured on this sweep."""
    if not o:
        return []
    pct, share = report.pct, o["orchestration_share"]
    return [f"Sweep overhead: {o['ran']} trials ran for {o['trial_run_s_sum']:.0f} s of the "
            f"{o['parallel']} worker slots' {o['parallel'] * o['wall_s']:.0f} s, so "
            f"**{pct(share)}** of the slot time was outside trials "
            f"({o['overhead_per_trial_s']:.2f} s a trial: Ray and worker start-up, Optuna, MLflow, "
            f"idle slots at the end); target <= {pct(TARGET_OVERHEAD_SHARE, 0)}: "
            f"{report.met(share <= TARGET_OVERHEAD_SHARE)} (one sweep, no replicate: no interval). "
            f"Of that, {o['outside_trials_span_s']:.0f} s of wall time passed before the first trial "
            f"started or after the last ended (Ray start-up, the first workers' JAX import, the "
            f"closing analysis), and the sweep started {o['worker_processes']} worker processes for "
            f"{o['ran']} trials: a slot whose next trial wants another chip count gets a new "
            "process (its own device count), and the replicate of a configuration lands on a "
            f"worker that compiled it only {pct(o['compile_cache_hit_rate'])} of the time.",
            ""]


def doc_block(r: dict) -> str:
    """docs/calibration.md's block: every hold-out scheme with its verdict."""
    lines = [f"**Calibration** (`benchmarks/calibration.py`, {r['source_text']}; "
             f"{r['trials_complete']} trials, {r['n_points']} points):", ""]
    rows = []
    for name, h in r["holdouts"].items():
        if h.get("skipped"):
            rows.append([name, "skipped", "", "", "", "", h["skipped"]])
            continue
        ci = h.get("mape_ci95") or [None, None]
        rows.append([name, h["n_points"], f"{report.pct(h['mape_heldout'])} [{report.pct(ci[0])}, "
                     f"{report.pct(ci[1])}]", report.pct(h["median_ape_heldout"]),
                     report.pct(h.get("noise_floor_mape")),
                     f"{report.pct(h['top1_agreement'])} over {h['ranking_groups']} groups",
                     h.get("verdict_text", "—")])
    lines += report.table(["hold-out", "points", "MAPE [95% CI]", "median", "noise floor",
                           "top-1", "verdict"], rows)
    return report.lines(lines)


def signed_pct(v: float) -> str:
    return f"{100 * v:+.0f}%"


def summary_rows(r: dict) -> list[list]:
    """benchmarks/results/summary.md's rows: per scheme its targets, against each point and
    against replicate means, then top-1."""
    rows = []
    t = r["targets"]
    for name in t["schemes"]:
        h = r["holdouts"].get(name) or {}
        if h.get("skipped") or not h:
            continue
        ci = h["mape_ci95"]
        rows.append(["calibration", f"{name}: held-out MAPE <= {report.pct(t['mape_max'], 0)}, "
                     f"median <= {report.pct(t['median_max'], 0)}",
                     f"{report.pct(h['mape_heldout'])} [95% CI {report.pct(ci[0])}-{report.pct(ci[1])}], "
                     f"median {report.pct(h['median_ape_heldout'])}, noise floor "
                     f"{report.pct(h['noise_floor_mape'])} ({h['n_points']} points)",
                     report.met(h["verdict"]["mape"]["met"] and h["verdict"]["median"]["met"])])
    for name in t["schemes"]:      # against replicate means, every cell
        vs_means = (r["holdouts"].get(name) or {}).get("vs_replicate_means")
        if not vs_means:
            continue
        worst = max(vs_means["cells"], key=lambda c: abs(c["signed_median"]))
        rows.append(["calibration", f"{name}: held-out MAPE vs replicate means <= 7%, every "
                     "(phase, chips) cell's signed median within +-5%",
                     f"{report.pct(vs_means['mape_vs_mean'])} (noise floor {report.pct(vs_means['floor_vs_mean'])}, "
                     f"{vs_means['configurations']} configurations); worst cell {worst['phase']} at "
                     f"{worst['chips']} chips {signed_pct(worst['signed_median'])}",
                     report.met(vs_means["met"])])
    k = r["holdouts"]["kfold"]
    rows.append(["calibration", f"top-1 layout agreement >= {report.pct(t['top1_min'], 0)} over "
                 f">= {t['min_groups']} groups",
                 f"{report.pct(k['top1_agreement'])} over {k['ranking_groups']} groups",
                 report.met(k["verdict"]["top1"]["met"])])
    return rows
