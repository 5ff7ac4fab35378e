"""The recorded example outputs (benchmarks/examples.py): the whole of each run in
`examples.md`, and each page's trimmed view for its `<!-- generated:example-NAME -->` block."""

from __future__ import annotations

import re

from benchmarks import report


def trimmed(example: dict, run: dict) -> list[str]:
    """The lines a page shows: the example's `stderr` line, or its `show` lines of stdout in
    order, one `...` where lines were left out between or after them."""
    if example.get("stderr"):
        pattern = re.compile(example["stderr"])
        return [next((line for line in run["stderr"].splitlines() if pattern.search(line)),
                     "(no such line in this run's stderr)")]
    lines = run["stdout"].rstrip("\n").splitlines()
    if not example.get("show"):
        return lines
    patterns = [re.compile(p) for p in example["show"]]
    out: list[str] = []
    for line in lines:
        if any(p.search(line) for p in patterns):
            out.append(line)
        elif out and out[-1] != "...":
            out.append("...")
    while out and out[-1] in ("...", ""):
        out.pop()
    return out


def caption(run: dict) -> str:
    c = run.get("context") or {}
    load = (c.get("load_average") or [None])[0]
    return (f"_Recorded by `python -m benchmarks.examples` on {run['started']}"
            + (f" (commit {run['commit']})" if run.get("commit") else "")
            + f", {c.get('cpus')} CPUs, load average {load} before: the whole command took "
            f"{run['wall_s']:.1f} s._")


def context(run: dict) -> str:
    """Where and how: the CPU, the load before and after, steal, the exit code."""
    c, e = run.get("context") or {}, run.get("context_end") or {}
    return (f"CPU {c.get('cpu')}, load average {c.get('load_average')} before and "
            f"{e.get('load_average')} after{report.steal_clause(e)}; exit code {run['returncode']}; "
            "run in a fresh folder with a fresh SWEEPER_HOME.")


def block(result: dict, name: str, example: dict) -> str:
    """The generated block of one example: its caption and its output trimmed as `example`
    says (benchmarks/examples.py `view`)."""
    run = result["runs"][result["examples"][name]["run"]]
    if example.get("stderr"):
        return report.lines(f"_A line of its stderr, from the run recorded on {run['started']} "
                            "(below)._", "", "```", trimmed(example, run), "```")
    body = [f"$ {run['command']}", *trimmed(example, run)]
    return report.lines(caption(run), "", "```", body, "```")


def markdown(result: dict) -> str:
    parts = ["# Example outputs", "",
             "Real runs of the commands README.md and docs/ show (`python -m benchmarks.examples`); "
             "the pages show each trimmed to its example's lines. Whole outputs below.", ""]
    for command, run in result["runs"].items():
        parts += [f"## `{command}`", "", caption(run), context(run), "", "```", f"$ {command}",
                  *run["stdout"].rstrip("\n").splitlines(), "```", ""]
        if run["stderr"].strip():
            parts += ["stderr:", "", "```", *run["stderr"].rstrip("\n").splitlines(), "```", ""]
    return report.lines(parts)
