"""The example outputs of README.md and docs/: each a real run of its command, recorded.

    python -m benchmarks.examples [--only quickstart,plan-llama,...] [--out DIR]
    python -m benchmarks.examples --render

Each example runs its command as a user types it, in a subprocess (the interpreter's start,
the imports and everything after them included), in a fresh folder with a fresh
SWEEPER_HOME, and records its whole stdout and stderr, exit code, wall time, the load average
before and after, the CPU and the commit. The pages show them through
`<!-- generated:example-NAME -->` blocks (benchmarks/render/examples.py), each trimmed by
its example's own rule (the lines it shows; `...` where lines were left out), so no output
in the docs is pasted by hand. `--only` records some examples again and keeps the others.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

from benchmarks import common, harness

NAME = "examples"


@dataclass(frozen=True)
class Example:
    command: tuple[str, ...]      # as the page shows it (`sweeper ...`)
    show: tuple[str, ...] = ()    # regexes of the stdout lines a page shows; () = all
    stderr: str | None = None     # a regex: show the first stderr line matching it instead


EXAMPLES = {
    # README.md "Quickstart": the sweep's report, and one of its progress lines
    "quickstart": Example(
        ("sweeper", "run", "quickstart"),
        show=(r"^Pareto-optimal", r"^#\s", r"^\d+\s", r"^$", r"^(study|optuna|mlflow|browse)\s",
              r"^(prefill|decode) Pareto frontier", r"^  #\d+", r"^held-out \(kfold\)",
              r"^fitted profile", r"^report:")),
    "quickstart-progress": Example(("sweeper", "run", "quickstart"), stderr=r"^\[3/\d+\] .*ETA"),
    # README.md "Serving plans"
    "plan-llama": Example(
        ("sweeper", "plan", "--model", "llama2-70b", "--hardware", "h100", "--rate", "4",
         "--input-len", "1024", "--output-len", "128", "--ttft", "1", "--tpot", "0.05",
         "--out", "plan.json"),
        show=(r"^llama2-70b on", r"^best plan per mode", r"^  (aggregated|disaggregated)\s",
              r"^    [^ ]", r"^error band")),
    # docs/serving.md "Examples": the paper's chatbot (§4.4), and at 100 requests per second
    "plan-palm": Example(
        ("sweeper", "plan", "--model", "palm-540b", "--hardware", "tpu-v4", "--rate", "1",
         "--input-len", "2048", "--output-len", "64", "--ttft", "1", "--tpot", "0.03",
         "--out", "plan.json"),
        show=(r"^palm-540b on", r"^best plan per mode", r"^  (aggregated|disaggregated)\s",
              r"^    [^ ]", r"^best:", r"^searched")),
    "plan-palm-100": Example(
        ("sweeper", "plan", "--model", "palm-540b", "--hardware", "tpu-v4", "--rate", "100",
         "--input-len", "2048", "--output-len", "64", "--ttft", "2", "--tpot", "0.05"),
        show=(r"^palm-540b on", r"^best plan per mode", r"^  (aggregated|disaggregated)\s",
              r"^    [^ ]", r"^best:", r"^searched")),
    # docs/cost-model.md "Worked example": the paper's Tables 1 and 2 (analytical, seconds)
    "max-context-palm": Example(
        ("sweeper", "max-context", "--model", "palm-540b", "--hardware", "tpu-v4", "--chips", "64",
         "--batch", "128", "--attn", "batch"),
        show=(r"^analytical prediction", r"^max-context:", r"^  max context")),
    "recommend-palm-decode": Example(
        ("sweeper", "recommend", "--model", "palm-540b", "--hardware", "tpu-v4", "--chips", "64",
         "--batch", "64", "--phase", "decode", "--context", "2048", "--weights", "int8"),
        show=(r"^analytical prediction", r"^recommend:", r"^  ", r"^$", r"^alternatives", r"^ffn ",
              r"^-----", r"^ws[12]d\s+batch", r"^ws2d\s+head", r"^wg_xyz\s+batch", r"^rejected")),
    "predict-palm-decode": Example(
        ("sweeper", "predict", "--model", "palm-540b", "--hardware", "tpu-v4", "--chips", "64",
         "--batch", "64", "--phase", "decode", "--context", "2048", "--ffn", "ws2d", "--attn",
         "batch", "--weights", "int8")),
}


def view(name: str) -> dict:
    """How a page shows example `name` (benchmarks/render/examples.py `trimmed`)."""
    ex = EXAMPLES[name]
    return {"show": list(ex.show), "stderr": ex.stderr}


def _commit() -> str | None:
    try:
        done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=common.ROOT,
                              capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() or None


def record(command: tuple[str, ...], timeout_s: float = 1800) -> dict:
    """One run of `command` as a user runs it: the `sweeper` of this interpreter's
    environment, in a fresh folder with a fresh SWEEPER_HOME (removed after)."""
    folder = tempfile.mkdtemp(prefix="sweeper-example-")
    home = os.path.join(folder, "home")
    sweeper = os.path.join(os.path.dirname(sys.executable), "sweeper")
    argv = [sweeper if command[0] == "sweeper" and os.path.exists(sweeper) else command[0], *command[1:]]
    env = dict(os.environ, SWEEPER_HOME=home)
    start_context = common.machine_context()
    began = time.time()
    start = time.perf_counter()
    done = subprocess.run(argv, cwd=folder, env=env, capture_output=True, text=True, timeout=timeout_s)
    wall = time.perf_counter() - start
    end_context = common.machine_context(since=start_context)
    shutil.rmtree(folder, ignore_errors=True)
    return {"command": " ".join(command), "commit": _commit(), "sweeper_home": home,
            "returncode": done.returncode,
            "stdout": done.stdout, "stderr": done.stderr, "wall_s": wall,
            "started": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(began)),
            "context": start_context, "context_end": end_context}


def run(args: argparse.Namespace, previous: dict | None) -> dict:
    names = list(EXAMPLES) if not args.only else args.only.split(",")
    unknown = set(names) - set(EXAMPLES)
    if unknown:
        raise SystemExit(f"--only: unknown examples {sorted(unknown)}; one of {list(EXAMPLES)}")
    runs = dict((previous or {}).get("runs") or {})
    examples = dict((previous or {}).get("examples") or {})
    recorded: set[str] = set()
    for name in names:
        ex = EXAMPLES[name]
        key = " ".join(ex.command)
        if key not in recorded:                  # two examples of one run: recorded once
            print(f"examples: {key}", file=sys.stderr)
            runs[key] = record(ex.command)
            recorded.add(key)
        examples[name] = {"run": key}
    return {"runs": runs, "examples": examples}


def arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--only", help=f"comma-separated examples of {', '.join(EXAMPLES)} "
                        "(the others keep their recorded runs)")


BENCHMARK = harness.Benchmark(NAME, __doc__.splitlines()[0], run, arguments=arguments, log=False)


if __name__ == "__main__":
    sys.exit(harness.main(BENCHMARK))
