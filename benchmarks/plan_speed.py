"""Benchmark: how long `sweeper plan` takes to answer the issue-19 questions.

    python -m benchmarks.plan_speed [--repeats 5] [--out DIR]

Questions (the ones docs/serving.md shows): PaLM 540B on TPU v4 for the paper's chatbot
profile (§4.4: 2048-token context, 64-token answers; 1 req/s, TTFT p99 <= 1 s, TPOT p99 <=
30 ms), Llama-2-70B on H100 (1024 in, 256 out, 4 req/s, TTFT p99 <= 1 s, TPOT p99 <= 40 ms),
the paper's "chatbot that expects 100 queries per second with a 2-second latency target"
(PaLM 540B, 100 req/s, TTFT p99 <= 2 s, TPOT p99 <= 50 ms: 2000 requests per simulation),
and an unanswerable one (TPOT <= 1 ms: every slice pruned by the analytical bound). Each is
planned `repeats` times in this process (the search, `plan()`), and once end to end as a
user runs it (`python -m sweeper.cli plan ... --json --no-mlflow`: interpreter start and
imports included). Target: "in seconds" (issue 19). The host is shared: the load average
before and after is recorded with the numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from benchmarks import common, harness

NAME = "plan_speed"
QUESTIONS = {
    "palm-540b/tpu-v4 chatbot": ["--model", "palm-540b", "--hardware", "tpu-v4", "--rate", "1",
                                 "--input-len", "2048", "--output-len", "64", "--ttft", "1",
                                 "--tpot", "0.03"],
    "llama2-70b/h100": ["--model", "llama2-70b", "--hardware", "h100", "--rate", "4",
                        "--input-len", "1024", "--output-len", "256", "--ttft", "1",
                        "--tpot", "0.04"],
    "palm-540b/tpu-v4 100 req/s": ["--model", "palm-540b", "--hardware", "tpu-v4", "--rate",
                                   "100", "--input-len", "2048", "--output-len", "64",
                                   "--ttft", "2", "--tpot", "0.05"],
    "no plan (TPOT 1 ms)": ["--model", "palm-540b", "--hardware", "tpu-v4", "--rate", "1",
                            "--ttft", "2", "--tpot", "0.001"],
}


def _question(flags):
    from sweeper.cli import build_parser
    from sweeper.cli.plan import question_from_args

    return question_from_args(build_parser().parse_args(["plan", *flags]))


def run(repeats: int) -> dict:
    from sweeper.serving.plan import plan

    load_before = common.load_average()
    rows = {}
    for name, flags in QUESTIONS.items():
        walls, result = [], None
        for _ in range(repeats):
            q = _question(flags)
            start = time.perf_counter()
            result = plan(q)
            walls.append(time.perf_counter() - start)
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "sweeper.cli", "plan", *flags, "--json",
                               "--no-mlflow"], capture_output=True, text=True,
                              env={**os.environ, "SWEEPER_HOME": os.environ.get(
                                  "SWEEPER_HOME", "/tmp/sweeper-plan-bench")})
        cli_wall = time.perf_counter() - start
        answer = json.loads(proc.stdout) if proc.returncode == 0 else None
        best = result.best.to_dict() if result.best else None
        rows[name] = {
            "search_wall_s": {"mean": statistics.fmean(walls),
                              "sd": statistics.stdev(walls) if len(walls) > 1 else 0.0,
                              "min": min(walls), "max": max(walls), "n": len(walls)},
            "cli_wall_s": cli_wall, "cli_returncode": proc.returncode,
            "simulated": result.search["simulated"], "configs": result.search["configs"],
            "requests_per_simulation": result.search["requests_per_simulation"],
            "best": None if best is None else {k: best[k] for k in (
                "mode", "chips_total", "ttft_p99_s", "tpot_p99_s", "goodput_rps")},
            "reason": result.reason,
            "cli_best_matches": (answer is not None and (answer["best"] or {}).get("chips_total")
                                 == (best or {}).get("chips_total")),
        }
    return {"name": NAME, "repeats": repeats, "questions": rows,
            "command": f"python -m benchmarks.plan_speed --repeats {repeats}",
            "machine": common.machine_context(), "load_average_before": load_before,
            "load_average_after": common.load_average()}


def arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--repeats", type=int, default=5, help="searches per question in this process")


BENCHMARK = harness.Benchmark(NAME, __doc__.splitlines()[0], lambda args, previous: run(args.repeats),
                              arguments=arguments)


if __name__ == "__main__":
    sys.exit(harness.main(BENCHMARK))
