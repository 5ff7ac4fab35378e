"""The code's shape (issue 37): no function or method in `sweeper`, `workloads` or
`benchmarks` longer than `MAX_LINES` lines (its docstring and comments counted), so
that each does one thing a reader can hold at once."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("sweeper", "workloads", "benchmarks")
MAX_LINES = 150


def long_functions(limit: int = MAX_LINES) -> list[str]:
    """'path:line name (n lines)' for each function longer than `limit` lines."""
    out = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    lines = node.end_lineno - node.lineno + 1
                    if lines > limit:
                        out.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} "
                                   f"({lines} lines)")
    return out


def test_no_function_is_longer_than_the_limit():
    assert long_functions() == [], f"split these into functions of at most {MAX_LINES} lines"


def test_the_check_finds_a_long_function():
    assert long_functions(limit=10), "the packages have functions over 10 lines"
