"""The Markdown of benchmarks/plan_speed.py's results."""

from __future__ import annotations

from benchmarks import report


def markdown(r: dict) -> str:
    lines = [f"# `sweeper plan` speed ({r['repeats']} repeats per question)", "",
             f"Reproduce: `{r['command']}`. Host: {r['machine']['cpus']} CPUs, load average "
             f"{r['load_average_before']} before, {r['load_average_after']} after (a shared "
             "host: wall times move with the load).", ""]
    rows = []
    for name, q in r["questions"].items():
        s = q["search_wall_s"]
        best = q["best"]
        answer = (f"{best['mode']} {best['chips_total']} chips" if best else "none (" +
                  q["reason"].split(": ", 1)[-1][:60] + ")")
        rows.append([name, f"{s['mean']:.2f} ± {s['sd']:.2f} (min {s['min']:.2f}, max "
                     f"{s['max']:.2f}, n={s['n']})", f"{q['cli_wall_s']:.2f}",
                     q["simulated"], q["configs"], answer])
    lines += report.table(["question", "search wall s (mean ± sd)", "CLI end to end s (n=1)",
                           "simulated", "configurations", "best"], rows)
    return "\n".join(lines) + "\n"


def doc_block(r: dict) -> str:
    """docs/serving.md's block: the results' table, without the title."""
    return "\n".join(markdown(r).rstrip().splitlines()[1:]).strip() + "\n"


def summary_rows(speed: dict) -> list[list]:
    """benchmarks/results/summary.md's rows: each answerable question "in seconds"."""
    rows = []
    for name, q in speed["questions"].items():
        if q.get("best") is None:
            continue
        w = q["search_wall_s"]
        rows.append(["serving", f"`sweeper plan` answers {name} in seconds",
                     f"search {w['mean']:.2f} ± {w['sd']:.2f} s (n={w['n']}); CLI {q['cli_wall_s']:.1f} s",
                     report.met(q["cli_wall_s"] < 60)])
    return rows
