"""`sweeper examples`: the search spaces shipped with the project, runnable by name.

`sweeper examples` lists them (name and description, one line each); `sweeper examples NAME`
prints one file, to read or to copy and edit (`sweeper examples quickstart > mine.yaml`).
`sweeper run NAME` runs one from any directory (sweeper/paths.py `resolve_space`).
"""

from __future__ import annotations

import argparse
import sys

from sweeper import paths
from sweeper.cli import options
from sweeper.cli.output import print_json
from workloads.config import ConfigError, read_yaml


def add_examples_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", nargs="?", help="print this space's file (default: list them all)")
    options.add_json(p, "the list as one JSON object")


def summary(path) -> str:
    """The space's `description` on one line, else its first comment line, else ''."""
    text = path.read_text(encoding="utf-8")
    try:
        data = read_yaml(path)
    except ConfigError:
        data = None
    description = data.get("description") if isinstance(data, dict) else None
    if isinstance(description, str) and description.strip():
        return " ".join(description.split())
    for line in text.splitlines():
        if line.startswith("#") and line.strip("# "):
            return line.strip("# ").strip()
    return ""


def cmd_examples(args: argparse.Namespace) -> int:
    shipped = paths.shipped_spaces()
    if args.name is not None:
        if args.name not in shipped:
            raise ConfigError("NAME", args.name, f"a shipped space: {', '.join(shipped)}")
        sys.stdout.write(shipped[args.name].read_text(encoding="utf-8"))
        return 0
    rows = {name: summary(path) for name, path in shipped.items()}
    folder = paths.shipped_spaces_dir()
    if args.json:
        print_json({"folder": str(folder),
                    "spaces": [{"name": name, "file": str(shipped[name]), "description": text}
                               for name, text in rows.items()]})
        return 0
    width = max((len(name) for name in rows), default=0)
    for name, text in rows.items():
        print(f"{name:<{width}}  {text}")
    print(f"\nrun one:   sweeper run NAME  (e.g. sweeper run quickstart --set trials=4)\n"
          f"edit one:  sweeper examples NAME > mine.yaml; sweeper run mine.yaml\n"
          f"files in   {folder}")
    return 0
