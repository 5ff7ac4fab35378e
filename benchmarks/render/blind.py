"""The Markdown of benchmarks/blind.py's results."""

from __future__ import annotations

from benchmarks import report

PHASES = ("prefill", "decode")
SERVE_METRICS = ("ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s")
LABELS = ("blind", "development")


def mape_ci_text(s: dict | None) -> str:
    """"a-b (k models)": the MAPE's 95% CI over models (benchmarks/blind.py `mape_ci`)."""
    ci = (s or {}).get("mape_ci95")
    return f"{report.pct(ci[0])}-{report.pct(ci[1])} ({s.get('models')} models)" if ci else "—"


def _stats(s: dict | None) -> list[str]:
    s = s or {}
    return [str(s.get("n", 0)), report.pct(s.get("mape")), mape_ci_text(s), report.pct(s.get("median")),
            report.pct(s.get("p90")), report.pct(s.get("worst_signed")), report.pct(s.get("median_signed"))]


def provenance(r: dict) -> str:
    git = r.get("git") or {}
    seeds = ", ".join(f"{e['seed']} ({e['label']})" for e in r.get("seeds", []))
    dirty = "dirty tree: " + ", ".join(git.get("changed") or []) if git.get("dirty") else "clean tree"
    cal = r.get("calibration") or {}
    ctx = r.get("context") or {}
    return (f"Command: `{r.get('command')}`. Seeds: {seeds or 'none'}. Commit `{git.get('commit')}` "
            f"({dirty}). Host: {ctx.get('cpus')} CPUs ({ctx.get('cpu')}), {report.load_text(r)}"
            f"{report.steal_clause(r.get('context_end'))}; wall {((r.get('wall_s') or 0) / 60):.1f} min. "
            f"Profile: {cal.get('describe')} ({cal.get('how')}).")


def verdict_table(r: dict) -> list[str]:
    rows = [[v["target"], v["measured"], report.met(v["met"]), v.get("responsible") or ""]
            for v in r.get("verdicts", [])]
    return report.table(["target (issue 35, blind seeds only)", "measured", "", "most responsible (measured)"], rows)


def score_table(summary: dict) -> list[str]:
    rows = []
    for label in LABELS:
        s = summary.get(label)
        if not s:
            continue
        for phase in PHASES:
            rows.append([label, phase, "calibrated profile alone, every trial", *_stats(s["profile"].get(phase))])
            rows.append([label, phase, "calibrated profile alone, (b)'s held-out points",
                         *_stats(s["fit"]["profile_same_points"].get(phase))])
            rows.append([label, phase, "after a fit on <= 12 points, the rest",
                         *_stats(s["fit"]["fit"].get(phase))])
    return report.table(["label", "phase", "predictor", "n", "MAPE", "MAPE 95% CI", "median", "p90",
                         "worst (signed)", "median signed"], rows)


def noise_lines(summary: dict) -> list[str]:
    out = []
    for label in LABELS:
        s = summary.get(label)
        if not s:
            continue
        n = s["noise"]
        parts = []
        for phase in PHASES:
            rep, ci = n["replicates"].get(phase) or {}, n["trial_ci"].get(phase) or {}
            parts.append(f"{phase}: replicate error {report.pct(rep.get('mape'))} per measurement "
                         f"(n={rep.get('n', 0)} configurations run twice), median trial 95% CI "
                         f"±{report.pct(ci.get('median'))} (n={ci.get('n', 0)})")
        late = n.get("rerun") or {}
        drift = ""
        if any((late.get(ph) or {}).get("n") for ph in PHASES):
            drift = (f" Run-to-run drift (each model's sweep run again at the end, a median "
                     f"{(n.get('rerun_after_s') or 0) / 60:.0f} min after its first; the later "
                     "measurement's error as a prediction of the first): " + "; ".join(
                         f"{ph} MAPE {report.pct(late[ph].get('mape'))}, median signed "
                         f"{report.pct(late[ph].get('median_signed'))} (n={late[ph].get('n', 0)})"
                         for ph in PHASES if (late.get(ph) or {}).get("n")) + ".")
        host = s.get("host") or {}
        out.append(f"- **{label}** (seeds {s['seeds']}, {s['models']} models, {s['trials_measured']} "
                   f"measured trials; predictions {'checked to be' if s['profile_checks_ok'] else 'NOT all'} "
                   f"the calibrated profile's, recomputed from it): " + "; ".join(parts)
                   + f". Trials' median host load {host.get('trial_load_median')}, steal "
                   f"{report.pct(host.get('trial_steal_median'))}." + drift)
    return out


def chips_table(summary: dict) -> list[str]:
    rows = []
    for label in LABELS:
        s = summary.get(label)
        if not s:
            continue
        for phase in PHASES:
            for chips, st in (s["profile"].get(phase) or {}).get("by_chips", {}).items():
                rows.append([label, phase, chips, *_stats(st)])
    return report.table(["label", "phase", "chips", "n", "MAPE", "MAPE 95% CI", "median", "p90",
                         "worst (signed)", "median signed"], rows)


def serving_lines(summary: dict) -> list[str]:
    out = []
    for label in LABELS:
        s = summary.get(label)
        if not s or not s["serving"]["cases"]:
            continue
        sv = s["serving"]

        def counts(c: dict) -> str:
            return ", ".join(f"{k} {v['within']}/{v['cases']} within {report.pct(v['target'], 0)} "
                             f"(median |error| {report.pct(v['median_abs_error'])})" for k, v in c.items())

        cov = sv["coverage"]
        out += [f"- **{label}**, {sv['cases']} served cases: the serve's prediction {counts(sv['counts'])}; "
                f"the plan's own prediction {counts(sv['plan_counts'])}; band coverage "
                f"{cov['inside']}/{cov['n']} = {report.pct(cov['coverage'])} (target "
                f"{report.pct(cov['target'], 0)}).",
                f"  Diagnostics: warm-up model (the workers' own step times) {counts(sv['warmup_counts'])}. "
                + (f"The serve's prediction scaled by the host's drift since the calibration "
                   f"(`sweeper calibrate --check` before each mode's serves: {drift_text(s)}) "
                   f"{counts(sv['host_counts'])}. " if (sv.get('host_counts') or {}).get('p50', {}).get('cases') else "")
                + "Consistency check, not a prediction: replay of each stream's own call durations "
                + f"{counts(sv['replay_counts'])}."]
    return out


def drift_text(label_summary: dict) -> str:
    """The host checks' drift ratios, per phase: their range over the checks."""
    checks = label_summary["serving"].get("host_checks") or []
    parts = []
    for ph in ("prefill", "decode"):
        v = [c[ph] for c in checks if c.get(ph) is not None]
        if v:
            parts.append(f"{ph} x{min(v):.2f}" + (f"-x{max(v):.2f}" if max(v) > min(v) else ""))
    return f"{len(checks)} checks, " + ", ".join(parts) if parts else "no check ran"


def cases_table(r: dict) -> list[str]:
    rows = []
    for e in r.get("seeds", []):
        for m in e["models"]:
            for mode, entry in ((m.get("serving") or {}).get("modes") or {}).items():
                if entry.get("skipped"):
                    rows.append([e["label"], m["model"]["name"], mode, "—", entry["skipped"][:80], "", "", "", ""])
                for c in entry.get("cases", []):
                    if "error" not in c:
                        rows.append([e["label"], m["model"]["name"], mode, f"{c['load']:g}",
                                     c.get("skipped", "")[:80], "", "", "", ""])
                        continue
                    cells = [f"{report.ms(c['measured'][k])} / {report.ms(c['predicted'][k])} "
                             f"({report.pct(c['error'][k], 0)}; plan {report.pct(c['error_plan'][k], 0)}"
                             f"{'' if c['inside_band'][k] is None else ', in band' if c['inside_band'][k] else ', OUT of band'})"
                             for k in SERVE_METRICS]
                    rows.append([e["label"], m["model"]["name"], mode,
                                 f"{c['load']:g} ({c['rate_rps']:.2f} req/s)", _deployment(c), *cells])
    return report.table(["label", "model", "mode", "load", "deployment", *[f"{k} measured / predicted"
                                                                          for k in SERVE_METRICS]], rows)


def _deployment(c: dict) -> str:
    d = c.get("deployment") or {}
    pre, dec = d.get("prefill") or {}, d.get("decode") or {}
    return (f"{pre.get('replicas')}x{pre.get('chips')} {pre.get('ffn')}/{pre.get('attn')} b{pre.get('batch')}; "
            f"{dec.get('replicas')}x{dec.get('chips')} {dec.get('ffn')}/{dec.get('attn')} {dec.get('batch')} slots")


def models_table(r: dict) -> list[str]:
    rows = []
    for e in r.get("seeds", []):
        for m in e["models"]:
            md = m["model"]
            c = m.get("counts") or {}
            rows.append([e["label"], e["seed"], md["name"],
                         f"d{md['d_model']} ff{md['d_ff']} L{md['n_layers']} h{md['n_heads']}/{md['n_kv_heads']} "
                         f"dh{md['d_head']} v{md['vocab']} {md['block']} {md['mlp']}",
                         f"{c.get('COMPLETE', 0)}/{c.get('PRUNED', 0)}/{c.get('FAIL', 0)}",
                         "ok" if (m.get("profile_check") or {}).get("ok") else m.get("error") or "NOT ok",
                         f"{(m.get('sweep') or {}).get('wall_s', 0):.0f} s"])
    return report.table(["label", "seed", "model", "shape", "complete/pruned/failed", "profile check", "sweep"], rows)


def worst_lines(summary: dict) -> list[str]:
    s = summary.get("blind") or {}
    out = []
    for phase in PHASES:
        for w in (s.get("worst") or {}).get(phase, []):
            terms = ", ".join(f"{t} {v * 1e3:.2f}" for t, v in w["terms_s"].items())
            out.append(f"- {phase} {w['model']} #{w['trial']} ({w['config']}): measured "
                       f"{report.ms(w['measured_s'])}, predicted {report.ms(w['predicted_s'])} "
                       f"({report.pct(w['error'])}); largest terms (ms): {terms}")
    diag = s.get("diagnosis") or {}
    for phase, factors in (diag.get("factors") or {}).items():
        shares = (diag.get("shares") or {}).get(phase, {})
        mesh = (diag.get("mesh") or {}).get(phase)
        out.append(f"- {phase}: corrections a fit to all {diag.get('points')} blind points needs "
                   f"(prior weight {diag.get('prior_weight', '?')}): " + ", ".join(
                       f"{g} x{f:.2f} ({report.pct(shares.get(g))} of predicted)" for g, f in factors.items())
                   + (f"; on meshes of several devices x{mesh:.2f}" if mesh else ""))
    return out


def markdown(r: dict) -> str:
    summary = r.get("summary") or {}
    q = r.get("quickstart") or {}
    return report.lines(
        "# Blind validation: predictions of models nobody tuned them on", "",
        provenance(r), "",
        "## Verdicts", "", verdict_table(r), "",
        "Verdicts are decided on the blind seeds only; a served target counts every case. "
        "`development` rows are the seeds the host model was developed on, for comparison.", "",
        "## Trial predictions (a) and the fit on <= 12 points (b)", "",
        "Errors are predicted / measured - 1 of each trial's `prefill_s` and `decode_step_s`; the "
        "calibrated profile's are the `pred_*` the sweep recorded before each trial ran.", "",
        score_table(summary), "",
        "Replicate noise (configurations run twice, in other processes: one measurement's error, "
        "|pair ratio - 1| / sqrt 2) and the trials' own 95% CIs:", "", noise_lines(summary), "",
        "Per chip count (calibrated profile alone):", "", chips_table(summary), "",
        "Worst-predicted blind trials and the host model's terms:", "", worst_lines(summary), "",
        "## Plan and serve (c)", "", serving_lines(summary), "", cases_table(r), "",
        "## The quickstart's closing analysis", "",
        (f"Noise floor {report.pct(q.get('noise_floor'))} ({q.get('noise_floor_points')} points); " + ", ".join(
            f"{k} {report.pct(s.get('mape'))} = {s.get('ratio') or 0:.1f}x" for k, s in q["schemes"].items())
         if q.get("schemes") else f"Not measured: {q.get('skipped')}."), "",
        "## Models", "", models_table(r))


def doc_block(r: dict) -> str:
    """The docs' block: provenance, the verdicts and the blind vs development scores."""
    return report.lines(provenance(r), "", verdict_table(r), "", score_table(r.get("summary") or {}))
