"""The Markdown of benchmarks/sweep_overhead.py's results: the tiny sweep against Ray Tune
(`overview`), then every sweep section and its targets (`time_in_trials`)."""

from __future__ import annotations

from benchmarks import report
from benchmarks.sweep_overhead import (SWEEP_LABELS, SWEEPS, TARGET_QUICKSTART_SHARE,
                                       TARGET_QUICKSTART_WALL_S, TARGET_REUSE, TARGET_SPAN_SHARE,
                                       TARGET_WALL_SHARE, every_run, sweep_verdicts)


def markdown(r: dict) -> str:
    return overview(r) + time_in_trials(r)


def overview(r: dict) -> str:
    """The tiny sweep against Ray Tune, and the quickstart's share."""
    s, t, q = r["sweeper"], r["tune"], r["quickstart"]
    def row(run: dict) -> list:
        first = run.get("until_first_trial_s")
        steady = run.get("steady_overhead_per_trial_s")
        return [run["framework"], run["trials"], f"{run['wall_s']:.1f} s", f"{run['trial_run_s_sum']:.1f} s",
                f"**{run['overhead_per_trial_s'] * 1e3:.0f} ms**",
                "—" if first is None else f"{first:.1f} s",
                "—" if steady is None else f"{steady * 1e3:.0f} ms", report.pct(run["cache_hit_rate"])]

    rows = [row(s)] + ([row(t)] if t else [])
    lines = [
        "# Sweep overhead: orchestration time per trial, sweeper against Ray Tune",
        "",
        f"{s['trials']} trials of a tiny workload (`tiny` model, 1 chip, prompt 8, 2 decode steps), "
        "one at a time, same TPE seed, same trial function (`run_trial` with a per-process "
        "engine cache), Ray start-up included in both. Measured on this host; load average "
        f"{r['context']['load_average']} at the start, {r['context_end']['load_average']} at the "
        f"end{report.steal_clause(r['context_end'])}. Took {r['elapsed_s']:.0f} s.",
        "",
        *report.table(["framework", "trials", "wall", "sum of trial run times",
                       "overhead per trial", "start-up (until the first trial runs)",
                       "overhead per trial after start-up", "compile-cache hits"], rows),
        "",
    ]
    if t:
        lines.append(f"- sweeper overhead / Ray Tune overhead: {r['sweeper_over_tune']:.2f} "
                     f"(target <= 1: {report.met(r['meets_tune_target'])})")
    if s.get("until_first_trial_s") is not None:
        lines.append("- start-up = from the call until the first trial's `run_trial` begins: Ray "
                     "start-up, the worker process and its imports (JAX), in both")
    if q:
        lines += [
            f"- quickstart (`sweeper run search_spaces/quickstart.yaml`): {q['wall_s']:.1f} s in-process "
            "(the sweep's call to its return), "
            f"{q['counts']}; compile-cache hit rate **{report.pct(q['compile_cache_hit_rate'])}** "
            f"({q['compile_cache_hits']} of {q['ran']} trials reused a compiled shape); study `{q['study']}`",
            f"- sweeper overhead per trial x {q['trials']} quickstart trials = "
            f"{report.pct(r['quickstart_overhead_share'])} of the quickstart's in-process wall time (target < "
            f"{report.pct(TARGET_QUICKSTART_SHARE, 0)}: {report.met(r['meets_quickstart_target'])})",
            f"- measured directly in the quickstart: {report.pct(q['orchestration_share'])} of its "
            f"{q['parallel']} slots' time was outside trials (start-up of Ray and of one worker per "
            "chip count with its JAX import, Optuna, MLflow, and the slots idle while the last "
            "trial ran)",
        ]
    return "\n".join(lines) + "\n"


def _cpu_lines(r: dict) -> list[str]:
    """Per sweep: its processes' CPU time, where the trials' run time went, the cores kept
    busy between the controller's phases, and the phases."""
    lines = []
    for key in SWEEPS:
        b = r.get(key)
        cpu = (b or {}).get("cpu_s")
        if cpu:
            cores = (b.get("context") or {}).get("cpus")
            lines.append(
                f"- {key}: CPU time during the sweep, {cpu['total_s']:.1f} s in all: trial "
                f"workers {cpu['workers_s']:.1f} s ({cpu['worker_processes_seen']} processes: "
                f"their start, JAX imports and trials; the trials' own run time is "
                f"{b['trial_run_s_sum']:.1f} s of wall), Ray's own processes "
                f"{cpu['ray_s'] + cpu['ray_idle_s']:.1f} s, the controller "
                f"{cpu['controller_s']:.1f} s"
                + (f"; / {cores} cores = {cpu['total_s'] / cores:.1f} s against a wall of "
                   f"{b['wall_s']:.1f} s" if cores else ""))
            if b.get("compile_s_sum") is not None:
                rest = b["trial_run_s_sum"] - b["compile_s_sum"] - b["measure_s_sum"]
                lines.append(
                    f"- {key}: where the trials' own run time ({b['trial_run_s_sum']:.1f} s of "
                    f"slot wall) went: compiling (lowering and XLA) {b['compile_s_sum']:.1f} s, "
                    f"the timed runs {b['measure_s_sum']:.1f} s, the rest (engine set-up, "
                    f"warm-up, memory and HLO analysis, the worker's start of the trial) "
                    f"{rest:.1f} s")
            use = {k: v for k, v in (b.get("cores_in_use") or {}).items() if v is not None}
            if use:
                lines.append(f"- {key}: cores kept busy by the sweep's processes (of {cores}), "
                             "between the controller's phases: " + ", ".join(
                                 f"{k.replace('_', ' ')} {v:.2f}" for k, v in use.items()))
        if b and b.get("timeline_s"):
            tl = ", ".join(f"{k} {v:.1f}" for k, v in b["timeline_s"].items())
            lines.append(f"- {key}: controller phases, seconds since the call began: {tl}")
    return lines


def time_in_trials(r: dict) -> str:
    """Each sweep section: processes, reuse, shares outside trials, and their targets."""
    lines = ["", "## Time in trials", "",
             "One command: `python -m benchmarks.sweep_overhead --only quickstart,grid,calibration,cache --quickstart-runs 5`. "
             "Each sweep starts with an empty compilation cache. Counts (processes, reuse, "
             "replicates) do not depend on the host's load; shares and seconds do.", ""]
    rows = []
    for key, label in SWEEP_LABELS.items():
        b = r.get(key)
        if not b:
            continue
        load = (b.get("context") or {}).get("load_average")
        rows.append([label, b["ran"], b.get("worker_processes"), f"{b['wall_s']:.1f} s",
                     report.pct(b.get("orchestration_share")), report.pct(b.get("span_share")),
                     "—" if b.get("until_first_trial_s") is None else f"{b['until_first_trial_s']:.1f} s",
                     "—" if b.get("after_last_trial_s") is None else f"{b['after_last_trial_s']:.1f} s",
                     f"{b.get('reused')} ({report.pct(b.get('reuse_rate'), 0)})",
                     f"{b.get('replicate_pairs_same_process')} of {b.get('replicate_pairs')}",
                     load])
    lines += report.table(["sweep", "trials", "worker processes", "wall", "slots' time outside "
                           "trials (whole command)", "... within the trials' span",
                           "before the first trial", "after the last", "trials compiling nothing",
                           "replicate pairs in one process", "load average (start)"], rows)
    before = r.get("before") or {}
    for key in ("quickstart", "grid", "calibration"):
        b, a = before.get(key), r.get(key)
        if b and a:
            lines.append(f"- before (commit {before.get('commit')}, one run, load "
                         f"{(b.get('context') or {}).get('load_average')}), {key}: "
                         f"{b['worker_processes']} worker processes for {b['ran']} trials, "
                         f"{b.get('reused')} trials compiling nothing, "
                         f"{b.get('replicate_pairs_same_process')} of {b.get('replicate_pairs')} "
                         f"replicate pairs in one process, {report.pct(b.get('span_share'))} of the "
                         f"slots' time outside trials within the span, "
                         f"{report.pct(b.get('orchestration_share'))} over the whole command; "
                         f"after: {a['worker_processes']}, {a.get('reused')}, "
                         f"{a.get('replicate_pairs_same_process')} of {a.get('replicate_pairs')}, "
                         f"{report.pct(a.get('span_share'))}, {report.pct(a.get('orchestration_share'))}")
    recorded = (r.get("calibration_full") or {}).get("recorded")
    if recorded and r.get("calibration_full"):
        a = r["calibration_full"]
        lines.append(f"- the whole calibration sweep against its recording in benchmarks/data "
                     f"(study {recorded.get('study')}, the code before the dispatch and cache "
                     f"changes; calibration.md): {recorded.get('worker_processes')} worker "
                     f"processes for {recorded.get('ran')} trials, "
                     f"{report.pct(recorded.get('compile_cache_hit_rate'))} of trials reusing "
                     f"compiled programs, {report.pct(recorded.get('orchestration_share'))} of the "
                     f"slots' time outside trials over the sweep; now: {a['worker_processes']} "
                     f"for {a['ran']}, {report.pct(a.get('reuse_rate'))}, "
                     f"{report.pct(a.get('orchestration_share'))} over the whole command "
                     f"({report.pct(a.get('span_share'))} within the trials' span)")
    if (r.get("calibration_full") or {}).get("earlier_runs"):
        every = every_run(r["calibration_full"])
        lines.append(f"- the whole calibration sweep, every run ({len(every)}; the table shows the "
                     "last): " + "; ".join(
                         f"{(f.get('context') or {}).get('time')} (load "
                         f"{(f.get('context') or {}).get('load_average')}): {f['worker_processes']} "
                         f"processes, {report.pct(f.get('reuse_rate'))} reused, "
                         f"{report.pct(f.get('span_share'))} within the span, "
                         f"{report.pct(f.get('orchestration_share'))} over the command, "
                         f"{f['wall_s']:.0f} s" for f in every))
    t = r.get("sweep_verdicts") or {}
    lines.append("")
    for key, b in t.items():
        parts = [f"outside trials within the span <= {report.pct(TARGET_SPAN_SHARE, 0)}: "
                 f"{report.pct(b['span_share'])} {report.met(b['meets_span'])}",
                 f"over the whole command <= {report.pct(TARGET_WALL_SHARE, 0)}: "
                 f"{report.pct(b['wall_share'])} {report.met(b['meets_wall'])}"]
        if "wall_s" in b:
            if b.get("whole_command_s") is not None:
                parts.append(f"the whole command (`sweeper run quickstart`, a subprocess) <= "
                             f"{TARGET_QUICKSTART_WALL_S:.0f} s: {b['whole_command_s']:.1f} s "
                             f"{report.met(b['meets_wall_s'])}; in-process {b['wall_s']:.1f} s")
            else:
                parts.append(f"in-process (the sweep's call to its return; the whole command not "
                             f"timed in this run) <= {TARGET_QUICKSTART_WALL_S:.0f} s: "
                             f"{b['wall_s']:.1f} s {report.met(b['meets_wall_s'])}")
            analysis_s = (r.get(key) or {}).get("analysis_s")
            if analysis_s is not None:
                parts.append(f"then `sweeper run`'s end-of-sweep analysis (fit, hold-out, "
                             f"report) {analysis_s:.1f} s after it, outside the sweep's target")
        if "reuse_rate" in b:
            parts.append(f"trials reusing compiled programs >= {report.pct(TARGET_REUSE, 0)}: "
                         f"{report.pct(b['reuse_rate'])} {report.met(b['meets_reuse'])}")
        n = b.get("runs", 1)
        lines.append(f"- {key} ({'one run' if n == 1 else f'median of {n} runs'}): "
                     + "; ".join(parts))
    every = every_run(r.get("quickstart"))
    if len(every) > 1:
        t_q = t.get("quickstart") or {}
        lines.append(
            f"- the quickstart, every run ({len(every)}, one after another; the table and the "
            f"lines below show the last): in-process <= {TARGET_QUICKSTART_WALL_S:.0f} s in "
            f"{t_q.get('runs_meeting_wall_s')} of {len(every)}"
            + (f", the whole command in {t_q['runs_meeting_whole_command_s']} of {len(every)}"
               if t_q.get("runs_meeting_whole_command_s") is not None else "") + "; " + "; ".join(
                f"{f['wall_s']:.1f} s in-process"
                + (f", {f['whole_command_s']:.1f} s whole command" if f.get("whole_command_s") else "")
                + f" (load {(f.get('context') or {}).get('load_average')}: "
                f"{f.get('reused')} of {f.get('ran')} compiling nothing, compiling "
                f"{f.get('compile_s_sum') or 0:.1f} s of the trials' "
                f"{f.get('trial_run_s_sum') or 0:.1f} s, "
                f"{f.get('until_first_trial_s') or 0:.1f} s before the first trial, CPU "
                f"{f.get('cpu_total_s') or 0:.1f} s)" for f in every))
    lines += _cpu_lines(r)
    c = r.get("cache")
    if c:
        lines.append(f"- compilation cache ({c['trial']}): compile {c['cold']['mean_s']:.2f} s "
                     f"± {c['cold']['sd_s'] or 0:.2f} cold, {c['from_cache']['mean_s']:.2f} s ± "
                     f"{c['from_cache']['sd_s'] or 0:.2f} from the cache in a fresh process "
                     f"(n = {c['cold']['n']} each, mean ± sd; load {c['context']['load_average']}): "
                     f"{report.pct(c['saved_frac'])} saved")
    return "\n".join(lines) + "\n"


def doc_block(r: dict) -> str:
    """docs/performance.md's block: the tiny sweep against Ray Tune, the quickstart's share."""
    rows = []
    for key in ("sweeper", "tune"):
        b = r.get(key)
        if b:
            rows.append([b["framework"], f"{b['wall_s']:.1f} s", f"{b['trial_run_s_sum']:.1f} s",
                         f"{b['overhead_per_trial_s'] * 1e3:.0f} ms", f"{b['until_first_trial_s']:.1f} s",
                         f"{b['steady_overhead_per_trial_s'] * 1e3:.0f} ms"])
    q = r.get("quickstart") or {}
    lines = [f"**Sweep overhead** (`benchmarks/sweep_overhead.py`, {r['sweeper']['trials']} tiny trials "
             f"one at a time, run of {r['context']['time']}, {report.load_text(r)}):", "",
             *report.table(["framework", "wall", "sum of trials", "overhead/trial", "start-up",
                            "overhead/trial after start-up"], rows), ""]
    lines.append(f"- sweeper overhead per trial ≤ Ray Tune's: ratio {r['sweeper_over_tune']:.2f} "
                 f"({report.met(r['meets_tune_target'])}, one run each);")
    if q:
        lines.append(f"- overhead < {report.pct(r['targets']['quickstart_overhead_share_max'], 0)} of the "
                     f"quickstart's in-process wall time: {report.pct(r['quickstart_overhead_share'])} of "
                     f"{q['wall_s']:.1f} s ({q['trials']} trials, compile-cache hit rate "
                     f"{report.pct(q['compile_cache_hit_rate'])}): {report.met(r['meets_quickstart_target'])}.")
    return report.lines(lines)


# the summary's names of the sweep sections
_SWEEP_NAMES = {"calibration": "calibration subset", "calibration_full": "calibration sweep (all 192 trials)"}


def sweep_rows(ovh: dict) -> list[list]:
    """The sweeps' targets: the quickstart's wall time (its user's whole command where timed),
    the slots' time outside trials (within the trials' span and over the command) per sweep,
    compiled programs reused."""
    t, rows = ovh.get("targets") or {}, []
    q = ovh.get("quickstart")
    if q and t.get("quickstart_wall_s_max"):
        judged = sweep_verdicts(ovh)["quickstart"]     # the median, when repeated
        whole = judged.get("whole_command_s") is not None
        key = "whole_command_s" if whole else "wall_s"
        low, high = judged[f"{key}_range"]
        meeting = judged["runs_meeting_whole_command_s" if whole else "runs_meeting_wall_s"] \
            if judged["runs"] > 1 else None
        measured = (f"{judged[key]:.1f} s (one run, load {q['context']['load_average'][0]:.1f})"
                    if judged["runs"] == 1 else
                    f"median {judged[key]:.1f} s over {judged['runs']} runs (range {low:.1f}-{high:.1f} s, "
                    f"{meeting} of {judged['runs']} within)")
        what = ("the user's whole command, `sweeper run quickstart` as a subprocess" if whole else
                "in-process: from the sweep's call to its return")
        rows.append(["sweep overhead", f"the quickstart <= {t['quickstart_wall_s_max']:.0f} s on 2 cores "
                     f"({what})", measured, report.met(judged["meets_wall_s"])])
    for name in ("quickstart", "grid", "calibration", "calibration_full"):
        r = ovh.get(name)
        if not r or "span_share" not in r or "span_share_max" not in t:
            continue
        runs = every_run(r)
        measured = ", ".join(f"{report.pct(x['span_share'])} / {report.pct(x['orchestration_share'])}"
                             for x in runs)
        counted = "one run" if len(runs) == 1 else f"{len(runs)} runs"
        rows.append(["sweep overhead", f"{_SWEEP_NAMES.get(name, name)}: slots' time outside trials <= "
                     f"{report.pct(t['span_share_max'], 0)} within the span, <= "
                     f"{report.pct(t['wall_share_max'], 0)} over the command",
                     f"{measured} ({r['trials']} trials, {r['worker_processes']} worker processes, {counted})",
                     report.met(all(x["span_share"] <= t["span_share_max"]
                                    and x["orchestration_share"] <= t["wall_share_max"] for x in runs))])
    for name in ("calibration", "calibration_full"):
        c = ovh.get(name)
        if c and "calibration_reuse_min" in t:
            runs = every_run(c)
            rows.append(["sweep overhead", f"{_SWEEP_NAMES[name]}: compiled programs reused in >= "
                         f"{report.pct(t['calibration_reuse_min'], 0)} of trials",
                         ", ".join(report.pct(x["reuse_rate"]) for x in runs) + f" of {c['trials']} trials"
                         + ("" if len(runs) == 1 else f" ({len(runs)} runs)"),
                         report.met(all(x["reuse_rate"] >= t["calibration_reuse_min"] for x in runs))])
    return rows


def summary_rows(ovh: dict) -> list[list]:
    """benchmarks/results/summary.md's rows: against Ray Tune, then every sweep's targets."""
    rows = []
    if ovh.get("tune"):
        rows.append(["sweep overhead", "sweeper overhead per trial <= Ray Tune's",
                     f"{ovh['sweeper']['overhead_per_trial_s'] * 1e3:.0f} ms vs "
                     f"{ovh['tune']['overhead_per_trial_s'] * 1e3:.0f} ms (one run each)",
                     report.met(ovh["meets_tune_target"])])
    return rows + sweep_rows(ovh)
