"""The Markdown of benchmarks/serving_validation.py's results: one run (`one_run`) or several
(`several_runs`: the summary over the runs, per case, then each run as one run renders)."""

from __future__ import annotations

from benchmarks import report
from benchmarks.serving_validation import CALL_KINDS, calibration_trial
from workloads.serving.costs import renamed


def _durations_lines(analysis: list[dict], groups_: list[dict] | None = None) -> list[str]:
    """The rendered section of `duration_analysis` (render): the table, then one sentence
    per case with a TTFT or TPOT p50 miss in `groups_` (every case without them)."""
    if not analysis:
        return []
    label = {"prefill_first": "prefill to first tokens", "prefill_after": "prefill after them",
             "decode_step": "decode step", "handover_insert": "handover insert"}
    lines = ["", "#### What the misses are made of: the stream's calls vs the closed loop's", "",
             "Per stream, each kind of call the stream made (its call log) against what the loop "
             "model charged for the same calls (the closed loop measured before the deployment's "
             "streams): the stream's mean (median) vs the loop model's mean, then the stream's sum over "
             "the loop model's - 1, the mean over the replicates; "
             "`spread`: (max - min) / mean of the replicates' stream means (seed to seed). "
             "Utilisation: the rate over the capacity at the closed loop's times (what the load "
             "assumed) and at those times scaled by the stream's ratios (what the stream's calls "
             "imply). Explained: the loop model simulated again with its times scaled per kind by "
             "those ratios (the model's own sensitivity, same arrivals and spread draws); its TTFT "
             "p50 error is what remains once the durations are the stream's. Drift within the "
             "closed loop: (max - min) / mean of its five blocks' means (prefill to first tokens, "
             "decode step). Prefill to first tokens is split too: calls right after other work "
             "(back-to-back) and calls that found the loop idle (after idle, with their wake)."
             + (" Near: the same against a closed loop re-measured right before each stream "
                "(`--remeasure`); run-to-run drift: (max - min) / mean of the closed loops' "
                "charges (the deployment's first and each stream's)." if any("kinds_near" in a for a in analysis)
                else ""), ""]
    rows = []
    for a in analysis:
        cells = []
        for k in CALL_KINDS:
            v = a["kinds"].get(k)
            if v:
                near = a.get("kinds_near", {}).get(k)
                cells.append(f"{label[k]} {report.ms(v['stream_mean_s'])} (median "
                             f"{report.ms(v['stream_median_s'])}) vs {report.ms(v['loop_mean_s'])}: "
                             f"{report.pct(v['ratio'] - 1, 0)}"
                             + (f" (back-to-back {report.pct(v['ratio_busy'] - 1, 0)} in "
                                f"{v['calls'] - v['idle_calls']} calls, after idle "
                                f"{report.pct(v['ratio_idle'] - 1, 0)} in {v['idle_calls']})"
                                if "ratio_busy" in v and "ratio_idle" in v else "")
                             + f", spread {report.pct(v['replicate_spread'], 0)}"
                             + (f"; near {report.pct(near['ratio'] - 1, 0)}" if near else "")
                             + (f", drift {report.pct(a['run_drift'][k], 0)}"
                                if k in a.get("run_drift", {}) else ""))
        drift = " / ".join(report.pct(a["block_drift"].get(k), 0) for k in ("prefill_first", "decode_step"))
        rows.append([a["deployment"], f"{a['load']:.0%}", "; ".join(cells),
                     f"{a['utilisation_assumed']:.0%} / {a['utilisation_stream']:.0%}",
                     report.pct(a["ttft_p50_error_loop"], 0), report.pct(a["ttft_p50_error_scaled"], 0),
                     report.pct(a["ttft_p50_error_loop"] - a["ttft_p50_error_scaled"], 0), drift]
                    + ([report.pct(a["ttft_p50_error_loop_near"], 0) if "ttft_p50_error_loop_near" in a else "-"]
                       if any("kinds_near" in x for x in analysis) else []))
    lines += report.table(["deployment", "load", "stream vs loop model, per call kind (mean)",
                           "utilisation assumed / stream's", "loop model TTFT p50 error",
                           "at the stream's durations", "explained by the durations",
                           "drift within the closed loop (prefill / step)"]
                          + (["loop model TTFT p50 error, near"] if any("kinds_near" in x for x in analysis) else []),
                          rows)
    lines.append("")
    missed: dict | None = None
    if groups_ is not None:
        missed = {}
        for g in groups_:
            if g["metric"] in ("ttft_p50_s", "tpot_p50_s") and g["within_target"] is False:
                missed.setdefault((g["deployment"], g["load"]), []).append(
                    f"{g['metric'][:4].upper()} p50 {report.pct(g['error'], 0)}, "
                    f"{g.get('responsible') or 'responsible unknown'}")
    for a in analysis:
        key = (a["deployment"], a["load"])
        if missed is None or key in missed:
            why = f" ({'; '.join(missed[key])})" if missed else ""
            lines.append(f"- {a['deployment']} at {a['load']:.0%}{why}: {duration_sentence(a)}")
    return lines


def duration_sentence(a: dict) -> str:
    """One sentence per case: the call kind whose stream/closed-loop ratio alone moves the
    loop model's TTFT p50 (and TPOT p50) most, measured (its ratio and seed-to-seed spread),
    and how much of the loop model's error the durations of every kind explain."""
    kinds = a["kinds"]
    label = {"prefill_first": "prefill calls to their first tokens", "prefill_after":
             "prefill host work after the first tokens", "decode_step": "decode steps",
             "handover_insert": "handover inserts"}
    parts = []
    for metric in ("ttft_p50", "tpot_p50"):
        by = a.get(f"{metric}_explained_by") or {}
        if not by:
            continue
        big = max(by, key=lambda k: abs(by[k]))
        k = kinds[big]
        explained = a[f"{metric}_error_loop"] - a[f"{metric}_error_scaled"]
        parts.append(
            f"{metric.replace('_', ' ').replace('ttft', 'TTFT').replace('tpot', 'TPOT')}: loop model {report.pct(a[f'{metric}_error_loop'], 0)}, "
            f"{report.pct(a[f'{metric}_error_scaled'], 0)} at the stream's durations (explained "
            f"{report.pct(explained, 0)}), most of it ({report.pct(by[big], 0)}) the {label[big]}, "
            f"{report.pct(abs(k['ratio'] - 1), 0)} {'longer' if k['ratio'] > 1 else 'shorter'} in the "
            f"stream than in the closed loop (seed-to-seed spread {report.pct(k['replicate_spread'], 0)})")
    return ("; ".join(parts) + f"; utilisation {a['utilisation_assumed']:.0%} assumed, "
            f"{a['utilisation_stream']:.0%} at the stream's calls.")


def _merged(r: dict) -> str:
    """The partial runs merged into a results file since its run (serving_validation.py
    `merge_run`): their cells replace the earlier rows of the same cells."""
    parts = r.get("merged") or []
    if not parts:
        return ""
    return (" Partial runs merged in since (each replaces the rows of the cells it served; the "
            "other cells are this command's): " + "; ".join(
                f"`{m['command']}`" + (f" ({m['time']})" if m.get("time") else "") for m in parts)
            + ".")


def one_run(r: dict) -> str:
    c, cal = r["context"], r["calibration"]
    lines = ["# Serving validation: measured vs predicted TTFT and TPOT",
             "",
             f"Command: `{r['command']}`. Model {r['model']}, prompts {r['input_len']} and answers "
             f"{r['output_len']} tokens, {r['rows'][0]['requests'] if r['rows'] else 0} requests per "
             f"stream, loads {', '.join(f'{x:.0%}' for x in r['loads'])} of each deployment's "
             f"capacity (from the serving loop's step times measured before the streams), {len(r['seeds'])} replicates (seeds "
             f"{', '.join(map(str, r['seeds']))}) each. Emulated meshes on this host (`host` "
             f"timings): {c['cpus']} CPUs, load average {cal['load_average_before']} before the "
             f"calibration, {c['load_average_before']} before serving and {c['load_average']} "
             f"after" + (f"; {report.steal_text(c)} over serving" if report.steal_text(c) else "")
             + f"; serving wall {r['wall_s'] / 60:.1f} min." + _merged(r),
             "",
             "#### Calibration (before serving, on this host, no serving run in it)",
             ""]
    sp = cal["space"]
    lines.append(
        f"`sweeper run` of a generated space ({sp['model']}, chips {sp['params']['chips']}, batch "
        f"{sp['params']['batch']}, prefill {sp['params']['prefill_ffn']}, decode "
        f"{sp['params']['decode_ffn']}, attention {sp['params']['attn']}, {sp['weights']}, input "
        f"{sp['input_len']} tokens, decode_steps {sp['decode_steps']}: one synchronised step per "
        f"timed call, as the server steps; repeats as search_spaces/calibration.yaml) in "
        f"{cal['sweep_wall_s'] / 60:.1f} min, load average {cal['load_average_before']} before and "
        f"{cal['load_average_after_sweep']} after"
        + (f" ({report.steal_text({'steal_pct': cal['sweep_steal_pct'], 'iowait_pct': cal.get('sweep_iowait_pct')})}"
           " over the sweep)" if cal.get("sweep_steal_pct") is not None else "")
        + "; then the `sweeper fit` pipeline with the extra terms chosen by nested cross-validation.")
    if "heldout_mape" in cal:
        by_phase = ", ".join(f"{ph} {report.pct(v, 0)}" for ph, v in cal["heldout_mape_by_phase"].items())
        fitted = cal["fitted"]
        base = cal.get("base_profile")
        lines.append("")
        if base:
            lines += [f"- start profile of the fit (its rate ceilings and prior): `{base['name']}` as "
                      f"the sweep measured and cached it in its SWEEPER_HOME: peak "
                      f"{base['peak_flops'] / 1e9:.0f} GFLOP/s, HBM {base['hbm_bandwidth'] / 1e9:.1f} GB/s, "
                      f"ICI {base['ici_bandwidth'] / 1e9:.1f} GB/s (whole host; a trial's chip gets "
                      "its core share / chips)."]
        lines += [f"- {cal['trials']} trials, {cal['points']} points; terms freed: "
                  f"{', '.join(cal['terms']) or 'none'}; held-out (k-fold) MAPE "
                  f"{report.pct(cal['heldout_mape'], 1)} ({by_phase}), median "
                  f"{report.pct(cal['heldout_median_ape'], 1)}, max {report.pct(cal['heldout_max_ape'], 0)}.",
                  f"- fitted: launch_overhead_s {fitted['launch_overhead_s'] * 1e3:.3f} ms, "
                  f"op_overhead_s {fitted['op_overhead_s'] * 1e6:.1f} us/layer, device_overhead_s "
                  f"{fitted['device_overhead_s'] * 1e6:.1f} us, collective latency/device "
                  f"{fitted['collective_latency_s_per_device'] * 1e6:.1f} us, overlap {fitted['overlap']:.2f}."]
    lines += ["", f"**Profile used: `{cal['used']}`** ({cal['why']}).", "",
              "#### Results", "",
              "Predicted: the serving model (`simulate`) with the cost model's step times and that "
              "profile, plus the serving host costs measured on the deployment's workers before its "
              "streams (sweeper/serving/overheads.py: the closed loop's means, the prefill's per "
              "prompt), each call scaled by a factor drawn from the closed loop's spread of "
              "durations. Loop model (diagnostic): the same simulation on the serving loop's "
              "step, prefill and handover times measured in that closed loop, with the same spread. "
              "Replay (diagnostic): the same simulation on each stream's own logged call durations, "
              "in order (sweeper/serving/serve.py `replay_step_times`): its error is the serving "
              "model's rules alone (docs/serving-model.md, \"Checking the model against the server\"). "
              "Error = predicted / measured - 1, the mean over the replicates; spread = "
              "(max - min) / mean of the replicates' measured values. Responsible (for a miss, "
              "measured): `serving model rules` when the replay misses; `step-time prediction` "
              "when the loop model is within target; `stream's call durations` when the replay is "
              "within target and the loop model misses as much or more (the stream's calls took "
              "other durations than the closed loop's before it: other processes' load changed, "
              "or calls interfere in a stream as they do not in a closed loop).",
              ""]
    for stat, s in r["summary"].items():
        lines.append(f"- **{stat}** (target within {s['target']:.0%}): prediction within target "
                     f"in {s['within_target']}/{s['cases']} cases, median |error| "
                     f"{report.pct(s['median_abs_error'], 0)}; loop model within target in "
                     f"{s['warmup_within_target']}/{s['cases']}, median |error| "
                     f"{report.pct(s['warmup_median_abs_error'], 0)}; "
                     + (f"replay within target in {s['replay_within_target']}/{s['cases']}, median "
                        f"|error| {report.pct(s['replay_median_abs_error'], 0)}; "
                        if s.get("replay_within_target") is not None else "")
                     + f"median replicate spread "
                     f"{report.pct(s['median_replicate_spread'], 0)}.")
    lines.append("")
    rows = [[g["deployment"], f"{g['load']:.0%} ({g['rate_rps']:.2f}/s)", g["metric"],
             report.ms(g["measured_mean_s"]), report.pct(g["replicate_spread"], 0),
             report.ms(g["predicted_mean_s"]), report.pct(g["error"], 0),
             "yes" if g["within_target"] else "no", report.pct(g["error_warmup_model"], 0),
             report.pct(g.get("error_replay", float("nan")), 0), g.get("responsible", "")]
            for g in r["groups"]]
    lines += report.table(["deployment", "load", "metric", "measured", "spread", "predicted",
                           "error", "within target", "loop model error", "replay error",
                           "responsible"], rows)
    if r.get("features"):        # the deployments that exercise a serving behaviour (issue 38)
        lines += ["", "Serving behaviours: " + "; ".join(
            f"`{name}`, {what}" for name, what in r["features"].items()) + "."]
    lines += _steps_lines(r)
    # what the misses are made of: `analyse` simulated it (serving_validation.duration_analysis)
    lines += _durations_lines(r.get("durations") or [], r.get("groups"))
    return "\n".join(lines) + "\n"


def _count(value: float) -> str:
    return f"{value:g}"


def _steps_lines(r: dict) -> list[str]:
    """The step-time table: each deployment's predicted step and prefill beside the engine's
    and the closed loop's, the host costs, the handover."""
    cal, lines = r["calibration"], []
    lines += ["", "#### Step times and host costs: predicted vs measured before the streams", "",
              "Prefill: one call of the prefill batch at the prompt length; decode: one step of the "
              "full slot batch. Predicted: the cost model (fitted profile, the worker's core share) "
              "plus the measured host cost. Engine: the engine's timed call (as a calibration trial "
              "times it); loop: the serving loop's (closed loop, slots full); host cost = loop - "
              "engine. Handover (disaggregated): predicted (KV bytes over the link + the decode "
              "loop's measured insert) vs the streams' measured mean from the first token to the KV in a decode "
              "slot (export, Ray, insert, and any wait for the decode loop or a free slot).", ""]
    # a prefill call on an idle loop (docs/serving.md "Serving host costs"): runs since its
    # measurement have it
    wake = any("prefill_wake_s" in s.get("host_costs", {}) for s in r["steps"])
    if wake:
        lines[-1:] = ["Idle prefill's wake: how much longer a prefill call on an idle loop takes "
                      "to its first token than the engine's (one-token requests 0.1 s apart through "
                      "the worker's own loop; the prediction charges it to such calls).", ""]
    # a prefill's host work before its first tokens (docs/serving.md "Serving host costs")
    first = any("prefill_first_overhead_s" in s.get("host_costs", {}) for s in r["steps"])
    if first:
        lines[-1:] = ["Before the first tokens: of a prefill call's host work, the part before its "
                      "first tokens (closed loop, paired with the engine's calls; the prediction "
                      "delays every call's first tokens by it, the rest after them).", ""]
    trials = bool(cal.get("trials_measured"))
    if trials:
        lines[-1:] = ["Calibration trial: the calibration sweep's trial of the deployment's decode "
                      "shape (chips, batch, layout), its median step (one synchronised step per "
                      "timed call, as the engine's) and the share of the CPUs busy while it ran "
                      "(its neighbour trial on the other core included): the point the fit saw.", ""]
    rows = []
    for s in r["steps"]:
        hc = renamed(s.get("host_costs", {}))    # older results: the costs' old names
        t = calibration_trial(cal, s["deployment"]) if trials else None
        rows.append([
            s["deployment"], report.ms(s["prefill_predicted_s"]), report.ms(s.get("prefill_engine_s")),
            report.ms(s.get("prefill_loop_s")),
            report.pct(s["prefill_predicted_s"] / s["prefill_loop_s"] - 1, 0)
            if s.get("prefill_loop_s") else "-",
            report.ms(s["decode_step_predicted_s"]), report.ms(s.get("decode_step_engine_s")),
            *([f"{report.ms(t['decode_step_s'])} (busy {report.pct(t.get('host_busy_frac'), 0)})"
               if t else "-"] if trials else []),
            report.ms(s.get("decode_step_loop_s")),
            report.pct(s["decode_step_predicted_s"] / s["decode_step_loop_s"] - 1, 0)
            if s.get("decode_step_loop_s") else "-",
            f"{report.ms(hc.get('step_overhead_s'))} / "
            f"{report.ms(hc.get('prefill_overhead_per_prompt_s'))} / "
            f"{report.ms(hc.get('handover_overhead_s'))}"
            + (f" / {report.ms(hc['prefill_wake_s'])}" if wake else "")
            + (f" / {report.ms(hc.get('prefill_first_overhead_s'))}" if first else "") if hc else "-",
            report.ms(s["kv_transfer_predicted_s"]) if s["handover_measured_s"] is not None else "-",
            (f"{report.ms(s['handover_measured_s'])} (spread {report.pct(s['handover_spread'], 0)})"
             if s["handover_measured_s"] is not None else "-")])
    lines += report.table(["deployment", "prefill predicted", "engine", "loop", "error",
                           "decode step predicted", "engine",
                           *(["calibration trial"] if trials else []), "loop", "error",
                           "host costs step / prefill / handover"
                           + (" / idle prefill's wake" if wake else "")
                           + (" / before the first tokens" if first else ""), "handover predicted",
                           "handover measured"], rows)
    return lines


def several_runs(r: dict) -> str:
    """The Markdown of a results file of several runs: the counts of every run and their
    median, per case the median error and the runs' spread, then each run as one run renders."""
    over, n = r["over_runs"], len(r["runs"])
    c = r["context"]
    lines = ["# Serving validation: measured vs predicted TTFT and TPOT", "",
             f"Command: `{r['command']}`: {n} whole runs one after another, each with its own "
             "calibration sweep and fit (or the given profile) and its own host costs measured "
             "before its streams. Over all of them: load average "
             f"{c.get('load_average_before')} before and {c.get('load_average')} after"
             + (f"; {report.steal_text(c)}" if report.steal_text(c) else "")
             + f"; serving wall {r['wall_s'] / 60:.1f} min in all." + _merged(r), "",
             "#### Over the runs", ""]
    for stat, s in over["summary"].items():
        counts = ", ".join(f"{k}/{s['cases']}" for k in s["within_target_runs"])
        lines.append(
            f"- **{stat}** (target within {s['target']:.0%}): prediction within target in {counts} "
            f"cases (runs 1-{n}; median {_count(s['within_target'])}/{s['cases']}); the median "
            f"error over the runs within target in {s['median_error_within_target']}/{s['cases']}, "
            f"median |median error| {report.pct(s['median_abs_error'], 0)}; the pooled error (mean "
            f"prediction over every run's replicates against their mean measurement) within target "
            f"in {s['pooled_within_target']}/{s['cases']}; the runs' errors of a case spread "
            f"(max - min) by a median of {report.pct(s['median_error_spread'], 0)}; median "
            f"replicate spread {report.pct(s['median_replicate_spread'], 0)}.")
    lines += ["", "Per run: its counts, the host's load average before and after serving and the "
              "hypervisor steal and iowait over its serving (percent of all CPUs' time; /proc/stat) "
              "and over its calibration sweep.", ""]
    rows = []
    for p in over["per_run"]:
        rows.append([p["run"], p["time"] or "-",
                     f"{p['within_target']['p50']}/{p['cases']['p50']}",
                     f"{p['within_target']['p99']}/{p['cases']['p99']}",
                     f"{report.pct(p['median_abs_error']['p50'], 0)} / {report.pct(p['median_abs_error']['p99'], 0)}",
                     f"{p['load_average_before']} / {p['load_average_after']}",
                     "-" if p["steal_pct"] is None else f"{p['steal_pct']:.1f}% / {p['iowait_pct']:.1f}%",
                     "-" if p["calibration_steal_pct"] is None else f"{p['calibration_steal_pct']:.1f}%"])
    lines += report.table(["run", "ended", "p50 within target", "p99 within target",
                           "median abs error p50 / p99", "load average before / after serving",
                           "steal / iowait over serving", "steal over the calibration"], rows)
    lines += ["", "Per case: each run's error (predicted / measured - 1, the mean over its "
              "replicates), their median, their spread (max - min), in how many runs the case was "
              "within target, and the pooled error.", ""]
    rows = [[x["deployment"], f"{x['load']:.0%}", x["metric"],
             ", ".join(report.pct(e, 0) for e in x["errors"]), report.pct(x["median_error"], 0),
             report.pct(x["error_spread"], 0), f"{x['runs_within_target']}/{x['runs']}",
             report.pct(x["pooled_error"], 0)] for x in over["cases"]]
    lines += report.table(["deployment", "load", "metric", "errors (runs 1-%d)" % n, "median error",
                           "spread", "within target", "pooled error"], rows)
    for i, run_ in enumerate(r["runs"], 1):
        # without its title, its headings one level down: docs/serving.md quotes the whole
        # file under a level-3 heading (benchmarks/readme_numbers.py)
        body = ["#" + x if x.startswith("#### ") else x for x in one_run(run_).rstrip().splitlines()[2:]]
        lines += ["", f"#### Run {i} of {n}", ""] + body
    return "\n".join(lines) + "\n"


def markdown(r: dict) -> str:
    """A results file of one run (`one_run`) or of several (`several_runs`)."""
    return several_runs(r) if "runs" in r else one_run(r)


def doc_block(r: dict) -> str:
    """docs/serving-validation.md's block: the results' header and, of a several-run file,
    the summary over the runs and the table of the runs; the per-case tables stay in the
    results file."""
    lines = markdown(r).rstrip().splitlines()[1:]
    cut = next((i for i, line in enumerate(lines)
                if line.startswith("Per case:") or line.startswith("| deployment |")), len(lines))
    return "\n".join(lines[:cut]).strip() + "\n"


def summary_block(data: dict) -> str:
    """docs/serving.md's block: the within-target counts alone, of every run."""
    each = data.get("runs") or [data]
    lines = []
    for stat, s in data["summary"].items():
        def counts(key: str) -> str:
            return ", ".join(f"{r['summary'][stat][key]}/{s['cases']}" for r in each
                             if r["summary"][stat].get(key) is not None)
        of = f" ({len(each)} runs)" if len(each) > 1 else ""
        lines.append(f"- **{stat}** (target: within {report.pct(s['target'], 0)}): the prediction "
                     f"within target in {counts('within_target')} cases{of}; the replay (the "
                     f"model's rules on the streams' own calls) in {counts('replay_within_target')}.")
    return "\n".join(lines) + "\n"


def summary_rows(serving: dict) -> list[list]:
    """benchmarks/results/summary.md's rows, per statistic: the median run's count, every
    run's; the error named for what it is."""
    rows = []
    for stat, v in serving["summary"].items():
        # several runs (serving_validation --runs N): the median run's count, every run's
        runs = v.get("within_target_runs")
        several = bool(runs and len(runs) > 1)
        of_runs = f" (median of {len(runs)} runs: {', '.join(str(n) for n in runs)})" if several else ""
        # of several runs, the summary's error is a median over the cases of each case's
        # median over the runs, smaller than any run's own median error: named as such
        error = (f"median over the cases of each case's absolute median error over the runs "
                 f"{report.pct(v['median_abs_error'])} (each run's own median absolute error: " + ", ".join(
                     report.pct(r["summary"][stat]["median_abs_error"], 0) for r in serving["runs"]) + ")"
                 if several and serving.get("runs") else
                 f"median absolute error over the cases {report.pct(v['median_abs_error'])}")
        rows.append(["serving", f"predicted {stat} TTFT/TPOT within {report.pct(v['target'], 0)} of "
                     "real serving runs",
                     f"{v['within_target']}/{v['cases']} cases{of_runs}, {error}; median replicate "
                     f"spread {report.pct(v['median_replicate_spread'])}",
                     report.met(v["within_target"] == v["cases"])])
    return rows
