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
             f"{r['load_average_after']} after; steal {m.get('steal_pct')}%; wall "
             f"{r['wall_s'] / 60:.1f} min. A bare process pinned to one core (no Ray, no driver "
             "beside it): this host's timings.", "",
             f"The rule (HostCosts `wake_after`) is made of each repeat's own "
             f"{' s and '.join(f'{g:g}' for g in r['rule_gaps_s'])} s points and scored on that "
             "repeat's other gaps; the constant is the 0.1 s point at every idle time.", "",
             f"- two-point rule: median |error| {s['rule']['median_abs_ms']:.2f} ms, worst "
             f"{s['rule']['max_abs_ms']:.2f} ms (n={s['rule']['n']} held-out points)",
             f"- one constant: median |error| {s['constant']['median_abs_ms']:.2f} ms, worst "
             f"{s['constant']['max_abs_ms']:.2f} ms (n={s['constant']['n']})", ""]
    rows = []
    for model in r["models"]:
        name = model["model"]["name"]
        for k, run in enumerate(model["repeats"]):
            rows.append([name, k, _ms(model["engine_prefill_s"]),
                         *[f"{_ms(p['wake_s'])} ({_ms(p['idle_s'])})" for p in run]])
    lines += report.table(["model", "repeat", "engine prefill ms",
                           *[f"wake ms after {g:g} s gaps (idle ms)" for g in r["gaps_s"]]], rows)
    lines += [""]
    rows = [[m["model"]["name"], f"{h['gap_s']:g}", _ms(h["idle_s"]), _ms(h["wake_s"]),
             _ms(h["rule_s"]), _ms(h["constant_s"])] for m in r["models"] for h in m["heldout"]]
    lines += report.table(["model", "gap s", "idle ms", "measured wake ms", "rule ms",
                           "constant ms"], rows)
    return "\n".join(lines) + "\n"
