"""The Markdown of benchmarks/idle_wake.py's results."""

from __future__ import annotations

from benchmarks import report


def _ms(v: float) -> str:
    return f"{1e3 * v:.2f}"


def markdown(r: dict) -> str:
    m, s = r["machine"], r["summary"]
    git = r.get("git") or {}
    lines = [f"# The idle wake against the loop's idle time ({len(r['models'])} models, "
             f"{r['repeats']} repeats)", "",
             f"Reproduce: `{r['command']}`. Commit `{git.get('commit')}`"
             f"{' (dirty tree)' if git.get('dirty') else ' (clean tree)'}. Host: {m['cpus']} CPUs "
             f"({m.get('cpu')}), load average {r['load_average_before']} before, "
             f"{r['load_average_after']} after; steal {m.get('steal_pct') or 0:.1f}% of the CPUs' "
             f"time; wall {r['wall_s'] / 60:.1f} min. A bare process pinned to one core (no Ray, "
             "no driver beside it): this host's timings.", "",
             "The rule (HostCosts `wake_after`) is each repeat's own measurement as `sweeper "
             "calibrate` makes it (a wake after a long and after a short idle), scored on that "
             "repeat's wakes at the other gaps; the constant is its long wake at every idle "
             f"time (the rule before). Points where the loop never idled (the gap shorter than "
             f"the call): {r['unscored_points']}, shown, not scored.", "",
             f"- two-point rule: median |error| {s['rule']['median_abs_ms']:.2f} ms, worst "
             f"{s['rule']['max_abs_ms']:.2f} ms (n={s['rule']['n']} points)",
             f"- one constant: median |error| {s['constant']['median_abs_ms']:.2f} ms, worst "
             f"{s['constant']['max_abs_ms']:.2f} ms (n={s['constant']['n']})", ""]
    rows = []
    for model in r["models"]:
        for k, run in enumerate(model["repeats"]):
            rule = run["rule"]
            rows.append([model["model"]["name"], k, _ms(model["engine_prefill_s"]),
                         f"{_ms(rule['prefill_wake_short_s'])} ({_ms(rule['prefill_wake_short_idle_s'])})",
                         f"{_ms(rule['prefill_wake_s'])} ({_ms(rule['prefill_wake_idle_s'])})",
                         *[f"{_ms(p['wake_s'])} ({_ms(p['idle_s'])})" for p in run["points"]]])
    lines += ["Wake ms (the loop's median idle before the calls, ms):", ""]
    lines += report.table(["model", "repeat", "engine prefill ms", "rule: short", "rule: long",
                           *[f"{g:g} s gaps" for g in r["gaps_s"]]], rows)
    lines += ["", "Scored points:", ""]
    rows = [[m["model"]["name"], f"{h['gap_s']:g}", _ms(h["idle_s"]), _ms(h["wake_s"]),
             _ms(h["rule_s"]), _ms(h["constant_s"])] for m in r["models"] for h in m["heldout"]]
    lines += report.table(["model", "gap s", "idle ms", "measured wake ms", "rule ms",
                           "constant ms"], rows)
    return "\n".join(lines) + "\n"
