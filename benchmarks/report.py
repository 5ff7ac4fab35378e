"""The pieces every benchmark's Markdown is made of (benchmarks/render/): numbers with their
unit, tables, verdicts, and the sentence that says where and under which load a run was
measured. Formatting only: what a figure is and whether it meets its target is decided in
the benchmark's own module."""

from __future__ import annotations

import math
from typing import Any, Mapping


def pct(value: float | None, digits: int = 1) -> str:
    return "—" if value is None or not math.isfinite(value) else f"{100 * value:.{digits}f}%"


def ms(value: float | None) -> str:
    return "—" if value is None or not math.isfinite(value) else f"{value * 1e3:.2f} ms"


def x(value: float | None, digits: int = 2) -> str:
    return "—" if value is None else f"{value:.{digits}f}×"


def table(header: list[str], rows: list[list[Any]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return lines


def met(flag: bool | None) -> str:
    return "—" if flag is None else ("**met**" if flag else "**not met**")


def steal_text(context: Mapping[str, Any] | None) -> str:
    """`hypervisor steal S%, iowait W% of the CPUs' time` of a context with them, else ''."""
    if not context or context.get("steal_pct") is None:
        return ""
    return (f"hypervisor steal {context['steal_pct']:.1f}%, iowait "
            f"{context.get('iowait_pct') or 0.0:.1f}% of the CPUs' time")


def steal_clause(context: Mapping[str, Any] | None) -> str:
    """`steal_text` as a clause to append after a load average (`; hypervisor steal ...`),
    '' for a context without it (results files from before it render as they did)."""
    text = steal_text(context)
    return f"; {text}" if text else ""


def load_text(result: Mapping[str, Any]) -> str:
    """`load average A at the start, B at the end` of a result's `context`/`context_end`."""
    start = (result.get("context") or {}).get("load_average")
    end = (result.get("context_end") or {}).get("load_average")
    return f"load average {start} at the start, {end} at the end" if start else "load not recorded"


def lines(*parts: str | list[str]) -> str:
    """Paragraphs and line lists joined into one Markdown text ending in a newline."""
    out: list[str] = []
    for part in parts:
        out += part if isinstance(part, list) else [part]
    return "\n".join(out).rstrip() + "\n"
