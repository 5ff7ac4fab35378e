"""One source for every published benchmark number: the numbers in README.md, docs/*.md and
benchmarks/results/summary.md are generated from `benchmarks/results/*.json` (and the recorded
data in `benchmarks/data/`) by this script; `make bench` runs it last.

    python -m benchmarks.readme_numbers            # rewrite every generated number in place
    python -m benchmarks.readme_numbers --check    # exit 1, naming file and line, if one is stale

Three forms (every measured number in a page comes from a results file):

- a block, `<!-- generated:NAME -->` ... `<!-- /generated:NAME -->`: a table or paragraph
  from one results file, rendered by that benchmark's `benchmarks/render/<name>.py`
  (`doc_block`; NAME is a key of BLOCKS: each of DOC_BLOCKS, `serving_validation_summary`,
  and `example-NAME`, a recorded example output of benchmarks/examples.py);
- a number in a sentence, `<!-- n:FILE:PATH:FORMAT -->TEXT<!-- /n -->`: FILE is a results
  file (`engine_efficiency` = benchmarks/results/engine_efficiency.json) or `data/NAME.EXT`
  (benchmarks/data/, JSON or YAML); PATH is dotted keys, `[3]` an index, `[k=v,k2=v2]` the
  first element with those values, and `A / B` the ratio of two paths; FORMAT is a key of
  FORMATS. The comments do not show in rendered Markdown;
- `benchmarks/results/summary.md`, generated whole (every target with its measured value,
  each benchmark's `summary_rows`).

Nothing outside the markers is touched. A "met" appears only where the results file says so,
with its sample size. It also checks that no figure is typed by hand in a page
(benchmarks/figures.py). Reads JSON and YAML only: it runs in `make test` in seconds.
"""

from __future__ import annotations

import argparse
import importlib
import json
import re
import sys
from pathlib import Path

from benchmarks import common, figures, report

ROOT = Path(__file__).resolve().parents[1]
# the blocks a page can quote: each benchmark's `doc_block` (benchmarks/render/<name>.py),
# rendered from its results file
DOC_BLOCKS = ("engine_efficiency", "sweep_overhead", "calibration", "profile_predict",
              "search_efficiency", "paper_fit", "plan_speed", "serving_validation", "blind",
              "world")
# summary.md: the benchmarks whose render module gives `summary_rows`, in its order
SUMMARY_ORDER = ("engine_efficiency", "sweep_overhead", "calibration", "search_efficiency",
                 "paper_fit", "serving_validation", "plan_speed")
DETAILS = ("engine_efficiency", "sweep_overhead", "calibration", "profile_predict",
           "search_efficiency", "paper_fit", "plan_speed")


def _load(results: Path, name: str) -> dict | None:
    path = results / f"{name}.json"
    return json.loads(path.read_text()) if path.is_file() else None


def _signed_pct(v: float) -> str:
    return f"{100 * v:+.0f}%"


FORMATS = {
    "pct": report.pct,                                  # 0.115 -> 11.5%
    "pct0": lambda v: report.pct(v, 0),                 # 0.115 -> 12%
    "spct": _signed_pct,                                # 1.35 -> +135%
    "x1": lambda v: f"{v:.1f}×",
    "x2": lambda v: f"{v:.2f}×",
    "f0": lambda v: f"{v:.0f}",
    "f1": lambda v: f"{v:.1f}",
    "f2": lambda v: f"{v:.2f}",
    "int": lambda v: f"{int(round(v)):,}",
    "ms0": lambda v: f"{v * 1e3:.0f} ms",
    "ms1": lambda v: f"{v * 1e3:.1f} ms",
    "ms2": lambda v: f"{v * 1e3:.2f} ms",
    "s0": lambda v: f"{v:.0f} s",
    "s1": lambda v: f"{v:.1f} s",
    "s2": lambda v: f"{v:.2f} s",
    "min1": lambda v: f"{v / 60:.1f} minutes",
    "gflops": lambda v: f"{v / 1e9:.0f} GFLOP/s",
    "tflops": lambda v: f"{v / 1e12:.0f} TFLOP/s",
    "gbs1": lambda v: f"{v / 1e9:.1f} GB/s",
    "gbs0": lambda v: f"{v / 1e9:.0f} GB/s",
    "tbs1": lambda v: f"{v / 1e12:.1f} TB/s",
    "str": str,
    "len": lambda v: str(len(v)),                      # a list: how many entries
}

SPAN = re.compile(r"<!-- n:(?P<file>[^:>]+):(?P<path>[^:>]+):(?P<fmt>\w+) -->(?P<text>.*?)<!-- /n -->")
BLOCK = re.compile(r"(<!-- generated:(?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- /generated:(?P=name) -->)", re.S)
STEP = re.compile(r"([^.\[\]]+)|\[([^\]]*)\]")


class Stale(Exception):
    """A marker this script cannot fill: unknown file, path, format or block."""


def read_file(results: Path, name: str) -> dict:
    if name.startswith("data/"):
        path = common.DATA / name[len("data/"):]
    else:
        path = results / f"{name}.json"
    if not path.is_file():
        raise Stale(f"no results file {path}")
    if path.suffix in (".yaml", ".yml"):
        import yaml   # PyYAML, a dependency of the package

        return yaml.safe_load(path.read_text())
    return json.loads(path.read_text())


def lookup(data, path: str):
    """`a.b[2].c[k=v]`: keys, an index, or the first element whose fields match."""
    value = data
    for key, selector in STEP.findall(path.strip()):
        if key:
            if not isinstance(value, dict) or key not in value:
                raise Stale(f"{path}: no key {key!r}")
            value = value[key]
        elif selector.isdigit():
            value = value[int(selector)]
        else:
            want = dict(part.split("=", 1) for part in selector.split(","))
            match = [e for e in value if all(str(e.get(k)) == v for k, v in want.items())]
            if not match:
                raise Stale(f"{path}: no element with {selector}")
            value = match[0]
    return value


def number(results: Path, file: str, path: str, fmt: str) -> str:
    if fmt not in FORMATS:
        raise Stale(f"unknown format {fmt!r} (one of {', '.join(FORMATS)})")
    data = read_file(results, file)
    parts = path.split(" / ")
    value = lookup(data, parts[0])
    for divisor in parts[1:]:
        value = value / lookup(data, divisor)
    return FORMATS[fmt](value)


def doc_block(name: str, function: str = "doc_block"):
    """A block rendered from results file `name` by benchmarks/render/<name>.py `function`."""
    def render(results: Path) -> str:
        data = _load(results, name)
        if data is None:
            raise Stale(f"no results file {results / (name + '.json')}")
        return getattr(importlib.import_module(f"benchmarks.render.{name}"), function)(data)
    return render


def example_block(name: str):
    """A recorded example output (benchmarks/examples.py), trimmed as its example says."""
    def render(results: Path) -> str:
        from benchmarks import examples
        from benchmarks.render import examples as shown

        data = _load(results, "examples")
        if data is None or name not in data.get("examples", {}):
            raise Stale(f"no recorded example {name!r} in {results / 'examples.json'} "
                        f"(python -m benchmarks.examples --only {name})")
        return shown.block(data, name, examples.view(name))
    return render


def _example_names() -> tuple[str, ...]:
    from benchmarks import examples

    return tuple(examples.EXAMPLES)


BLOCKS = {name: doc_block(name) for name in DOC_BLOCKS}
BLOCKS["serving_validation_summary"] = doc_block("serving_validation", "summary_block")
BLOCKS.update({f"example-{name}": example_block(name) for name in _example_names()})


def fill(text: str, results: Path, where: str) -> tuple[str, list[str]]:
    """The text with every block and span regenerated, and the problems found."""
    problems: list[str] = []
    current = [text]   # the text being substituted, for line numbers

    def line_of(pos: int) -> int:
        return current[0].count("\n", 0, pos) + 1

    def block(m: re.Match) -> str:
        name = m["name"]
        try:
            if name not in BLOCKS:
                raise Stale(f"unknown block {name!r} (one of {', '.join(BLOCKS)})")
            body = BLOCKS[name](results)
        except Stale as err:
            problems.append(f"{where}:{line_of(m.start())}: generated:{name}: {err}")
            return m.group(0)
        if body != m["body"]:
            problems.append(f"{where}:{line_of(m.start())}: generated:{name} is out of date")
        return m.group(1) + body + m.group(4)

    def span(m: re.Match) -> str:
        try:
            value = number(results, m["file"], m["path"], m["fmt"])
        except (Stale, KeyError, IndexError, TypeError, ZeroDivisionError) as err:
            problems.append(f"{where}:{line_of(m.start())}: n:{m['file']}:{m['path']}: {err}")
            return m.group(0)
        if value != m["text"]:
            problems.append(f"{where}:{line_of(m.start())}: {m['file']}:{m['path']} is {value}, "
                            f"the text says {m['text']!r}")
        return m.group(0).replace(f"-->{m['text']}<!--", f"-->{value}<!--", 1)

    # spans first: a value is one line, so the blocks' line numbers stay the file's own
    current[0] = SPAN.sub(span, text)
    return BLOCK.sub(block, current[0]), problems


def summary(results: Path) -> str:
    """benchmarks/results/summary.md: every target with its measured value, from the results
    files; each benchmark's own .md says when and under which load it ran."""
    eng = _load(results, "engine_efficiency")
    rows = []
    for name in SUMMARY_ORDER:      # each benchmark's targets, from its render module
        data = _load(results, name)
        if data is not None:
            rows += importlib.import_module(f"benchmarks.render.{name}").summary_rows(data)
    host = []
    if eng and eng.get("host_profile"):
        hp, notes = eng["host_profile"], eng.get("host_profile_notes") or {}
        host.append(f"- engine efficiency's MFU is against the host profile measured at "
                    f"{notes.get('measured_at', '?')} (load {notes.get('load_average_1min', '?')}): peak "
                    f"{hp['peak_flops'] / 1e9:.0f} GFLOP/s ({notes.get('peak_flops_from', '?')}; one core "
                    f"{(notes.get('peak_flops_one_core') or 0) / 1e9:.0f} GFLOP/s, in-process "
                    f"{(notes.get('peak_flops_in_process') or 0) / 1e9:.0f} GFLOP/s), read bandwidth "
                    f"{hp['hbm_bandwidth'] / 1e9:.1f} GB/s;")
    calib_host = common.DATA / "calibration-host.yaml"
    if calib_host.is_file():
        hp = read_file(results, "data/calibration-host.yaml")
        host.append(f"- the calibration sweep predicted with the host profile in "
                    f"`benchmarks/data/calibration-host.yaml`: peak {hp['peak_flops'] / 1e9:.0f} GFLOP/s, "
                    f"read bandwidth {hp['hbm_bandwidth'] / 1e9:.1f} GB/s.")
    lines = [
        "# Benchmarks: summary",
        "",
        "_Generated by `python -m benchmarks.readme_numbers` from `benchmarks/results/*.json`; "
        "do not edit by hand. `make bench` (= `python -m benchmarks.run_all`) reruns the "
        "benchmarks, then this._",
        "",
        "Every emulated-mesh timing is this host's and moves with its load: each benchmark's "
        "own file says when it ran and the load average around it. Ratios were measured side "
        "by side in one run.",
        "",
        *report.table(["benchmark", "target", "measured", ""], rows),
        "",
        "Host profiles (MFU is a fraction of the measured peak):",
        "",
        *host,
        "",
        "Details: " + ", ".join(f"[{n}]({n}.md)" for n in DETAILS
                                if (results / f"{n}.md").is_file()) + ".",
        "",
    ]
    return "\n".join(lines)


def documents(root: Path = ROOT) -> list[Path]:
    """The Markdown files whose numbers this script owns."""
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", default=str(common.RESULTS))
    parser.add_argument("--root", default=str(ROOT), help="the checkout whose README.md and docs/ to fill")
    parser.add_argument("--check", action="store_true", help="exit 1 if any generated number is out of date")
    args = parser.parse_args(argv)
    results, root = Path(args.results), Path(args.root)
    problems: list[str] = []
    changed: list[Path] = []
    for path in documents(root):
        if not path.is_file():
            continue
        text = path.read_text()
        where = str(path.relative_to(root))
        new, found = fill(text, results, where)
        problems += found
        bare = figures.bare_figures(text, where, BLOCK, SPAN, readme=where == "README.md")
        if where in figures.PENDING:
            if bare:      # listed, not failed: figures.PENDING says why
                print(f"{where}: {len(bare)} figures typed by hand, pending: "
                      f"{figures.PENDING[where]}", file=sys.stderr)
                print("\n".join(f"  pending {line}" for line in bare), file=sys.stderr)
        else:
            problems += bare
        if new != text:
            changed.append(path)
            if not args.check:
                path.write_text(new)
    summary_path = results / "summary.md"
    text = summary(results)
    if not summary_path.is_file() or summary_path.read_text() != text:
        changed.append(summary_path)
        problems.append(f"{summary_path}: out of date")
        if not args.check:
            summary_path.write_text(text)
    if args.check:
        for line in problems:
            print(line, file=sys.stderr)
        if problems:
            print("generated numbers out of date; run: python -m benchmarks.readme_numbers", file=sys.stderr)
        return 1 if problems else 0
    # what rewriting cannot fix: a marker that names nothing, a number typed by hand
    unfixable = [p for p in problems if "out of date" not in p
                 and ("typed by hand" in p or ", the text says " not in p)]
    for line in unfixable:
        print(line, file=sys.stderr)
    print(f"regenerated from {results}: {', '.join(str(p) for p in changed) or 'nothing changed'}",
          file=sys.stderr)
    return 1 if unfixable else 0


if __name__ == "__main__":
    sys.exit(main())
