"""One harness for every benchmark: run -> analyse -> render.

A benchmark module is its measurement and its targets: it declares a `Benchmark` (what to
measure, how to turn the measurement into its figures and verdicts) and calls `main`. The
Markdown of its results is `benchmarks/render/<name>.py` (`markdown(result)`), on the shared
pieces of `benchmarks/report.py`. The harness gives every benchmark the same steps and flags:

    python -m benchmarks.NAME [its own flags] [--out DIR]   # measure, analyse, write, render
    python -m benchmarks.NAME --render [--out DIR]          # render DIR/NAME.json again, measure nothing

1. `run(args, previous)`: measure; `previous` is the results file already in `--out` (or
   None), for benchmarks that keep sections of an earlier run;
2. `analyse(raw, args)`: the figures and the verdicts against the targets (by default the
   measurement is the result);
3. write `NAME.json`: the result, JSON-safe (`common.clean`). Keys named in `raw_keys`
   (bulky raw logs: dicts or lists under those keys anywhere in the result) go to
   `NAME.raw.json.gz` beside it, so the
   results file stays small enough to read; `load` puts them back;
4. render `NAME.md` (`render/<name>.py`), print it; write the files a benchmark makes
   besides its results from its measurement (`extra_files(raw, args)`: world's fitted
   presets); and log one MLflow run (experiment `sweeper/benchmarks`) with
   `metrics(result)` and every file.

`--render` runs step 4's Markdown alone on the committed files: every figure of a results
file can be rendered again without measuring, and must come out the same.
"""

from __future__ import annotations

import argparse
import gzip
import importlib
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from benchmarks import common

RAW_SUFFIX = ".raw.json.gz"


@dataclass(frozen=True)
class Benchmark:
    name: str                                          # results file stem, render module
    description: str                                   # the command's one-line help
    run: Callable[[argparse.Namespace, dict | None], dict]
    arguments: Callable[[argparse.ArgumentParser], None] = lambda parser: None
    analyse: Callable[[dict, argparse.Namespace], dict] = lambda raw, args: raw
    metrics: Callable[[dict], dict] = lambda result: {}
    params: Callable[[argparse.Namespace], dict] = lambda args: {}
    raw_keys: tuple[str, ...] = ()                     # split off to NAME.raw.json.gz
    log: bool = False                                  # an MLflow run per measurement
    # files written besides the results, from `run`'s measurement (which may hold objects
    # `analyse` does not keep): their paths, logged with the results
    extra_files: Callable[[dict, argparse.Namespace], list[Path]] = field(default=lambda raw, args: [])


def markdown(name: str, result: dict) -> str:
    """The Markdown of a results file: `benchmarks.render.<name>.markdown`."""
    return importlib.import_module(f"benchmarks.render.{name}").markdown(result)


# ----------------------------------------------------------------------------- files


def _split(value: Any, keys: tuple[str, ...], raw: list) -> Any:
    """`value` with every `keys` entry replaced by its index in `raw` (which gets the entry)."""
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if k in keys and isinstance(v, (dict, list)):     # a log, not a count named alike
                raw.append(v)
                out[k] = {"raw": len(raw) - 1}
            else:
                out[k] = _split(v, keys, raw)
        return out
    if isinstance(value, list):
        return [_split(v, keys, raw) for v in value]
    return value


def _join(value: Any, keys: tuple[str, ...], raw: list) -> Any:
    if isinstance(value, dict):
        return {k: (raw[v["raw"]] if k in keys and isinstance(v, dict) and set(v) == {"raw"}
                    else _join(v, keys, raw)) for k, v in value.items()}
    if isinstance(value, list):
        return [_join(v, keys, raw) for v in value]
    return value


def write_json(name: str, result: dict, out: Path, raw_keys: tuple[str, ...] = ()) -> list[Path]:
    """NAME.json in `out`, its `raw_keys` entries in NAME.raw.json.gz beside it. A benchmark
    that measures for long calls it after each part: nothing measured is lost."""
    out.mkdir(parents=True, exist_ok=True)
    raw: list = []
    data = _split(common.clean(result), raw_keys, raw) if raw_keys else common.clean(result)
    files = [out / f"{name}.json"]
    files[0].write_text(json.dumps(data, indent=1))
    if raw:
        files.append(out / f"{name}{RAW_SUFFIX}")
        # mtime 0: the same logs give the same bytes
        with gzip.GzipFile(files[1], "wb", mtime=0) as f:
            f.write(json.dumps(raw, separators=(",", ":")).encode())
    return files


def write(name: str, result: dict, text: str, out: Path, raw_keys: tuple[str, ...] = ()) -> list[Path]:
    """NAME.json (and NAME.raw.json.gz with the `raw_keys` entries) and NAME.md in `out`."""
    files = write_json(name, result, out, raw_keys)
    (out / f"{name}.md").write_text(text)
    return [files[0], out / f"{name}.md", *files[1:]]


def load(name: str, out: Path = common.RESULTS, raw_keys: tuple[str, ...] = ()) -> dict | None:
    """A results file with its raw logs put back; None where there is none."""
    path = out / f"{name}.json"
    if not path.is_file():
        return None
    data = json.loads(path.read_text())
    raw_path = out / f"{name}{RAW_SUFFIX}"
    if raw_keys and raw_path.is_file():
        with gzip.open(raw_path, "rb") as f:
            data = _join(data, raw_keys, json.loads(f.read()))
    return data


# ----------------------------------------------------------------------------- the command


def parser_for(bench: Benchmark) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=f"python -m benchmarks.{bench.name}",
                                     description=bench.description)
    parser.add_argument("--out", default=str(common.RESULTS),
                        help=f"results folder for {bench.name}.json and .md (default: the committed ones)")
    parser.add_argument("--render", action="store_true",
                        help=f"measure nothing: render {bench.name}.md again from {bench.name}.json")
    bench.arguments(parser)
    return parser


def render_only(bench: Benchmark, out: Path) -> int:
    result = load(bench.name, out, bench.raw_keys)
    if result is None:
        print(f"{bench.name}: no results file {out / (bench.name + '.json')}", file=sys.stderr)
        return 2
    text = markdown(bench.name, result)
    (out / f"{bench.name}.md").write_text(text)
    print(f"rendered {out / (bench.name + '.md')}", file=sys.stderr)
    return 0


def main(bench: Benchmark, argv: list[str] | None = None) -> int:
    args = parser_for(bench).parse_args(argv)
    out = Path(args.out)
    if args.render:
        return render_only(bench, out)
    previous = load(bench.name, out, bench.raw_keys)
    raw = bench.run(args, previous)
    result = bench.analyse(raw, args)
    text = markdown(bench.name, common.clean(result))
    files = write(bench.name, result, text, out, bench.raw_keys)
    files += bench.extra_files(raw, args)
    if bench.log:
        common.log_mlflow(bench.name, bench.metrics(result), bench.params(args), files)
    print(text)
    print(f"written: {', '.join(map(str, files))}", file=sys.stderr)
    return 0
