"""Benchmark: how a prefill's idle wake grows with the time its serving loop idled.

    python -m benchmarks.idle_wake [--models 3] [--seed N] [--repeats 2] [--out DIR]

`sweeper calibrate` and `sweeper serve --measure-overheads` measure the wake of a prefill
call on an idle loop at two idle times (one-token requests 0.1 s apart, then about 0.01 s
idle, through the server's own serving loop, workloads/serving/hostcosts.py
`idle_prefill_wake`), and the serving model prices a call after any other idle time by a
straight line in log(idle) between them, flat beyond (HostCosts `wake_after`;
docs/serving-model.md "Serving host costs"). This checks that rule on idle times it was not
given: per model (the calibration's serving probe, and `--models` models drawn at run time
from `--seed` as the blind benchmark draws them), one slot server on one device in this
process, pinned to one core; per repeat, the rule measured as calibrate measures it, then the
wake at each gap of `GAPS` (`WAKE_REQUESTS` requests each, the median, with the loop's median
idle before them). Each repeat's rule is scored on that repeat's gaps (the wake's error in
ms), beside one constant wake (the rule's 0.1 s wake at every idle time: the rule before). A
gap shorter than the call leaves the loop no idle time (the next request queues): such
points are shown and not scored. Timings are this host's, in a bare process (no Ray, no
driver beside it).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from benchmarks import common, harness

NAME = "idle_wake"
GAPS = (0.003, 0.006, 0.02, 0.04, 0.06, 0.2)    # seconds between the requests' arrivals
MIN_IDLE_S = 1e-4                                # below: the loop never idled (not scored)
INPUT_LEN = 32
# what a rule is made of (HostCosts fields, as `idle_prefill_wake` returns them)
RULE_FIELDS = ("prefill_wake_s", "prefill_wake_idle_s", "prefill_wake_short_s",
               "prefill_wake_short_idle_s")


def _server(model):
    from workloads.layouts import PhaseLayout
    from workloads.serving.slots import SlotServer, SlotSpec

    one = PhaseLayout("ws1d", "head")
    server = SlotServer(SlotSpec(model, (1, 1, 1), one, one, slots=1, context_len=INPUT_LEN + 17))
    server.warm_up(INPUT_LEN)
    return server


def measure_model(model, repeats: int) -> dict:
    """Per repeat, the rule's measurement and each gap's wake and the loop's median idle
    before the calls (seconds)."""
    from workloads.serving.hostcosts import (IDLE_GAP_S, WAKE_REQUESTS, engine_prefill_s,
                                             idle_prefill_wake)

    server = _server(model)
    engine = engine_prefill_s(server, INPUT_LEN)
    runs = []
    for _ in range(repeats):
        # one-token requests: the prefill's wake alone, each gap's idle as the gap says
        rule = idle_prefill_wake(server, INPUT_LEN, WAKE_REQUESTS, IDLE_GAP_S, engine,
                                 decode_steps=0)
        points = []
        for gap in GAPS:
            out = idle_prefill_wake(server, INPUT_LEN, WAKE_REQUESTS, gap, engine, short_gap_s=0.0,
                                    decode_steps=0)
            points.append({"gap_s": gap, "idle_s": out["prefill_wake_idle_s"],
                           "wake_s": out["prefill_wake_s"]})
        runs.append({"rule": {k: rule.get(k, 0.0) for k in RULE_FIELDS}, "points": points})
    return {"model": model.to_dict(), "engine_prefill_s": engine, "repeats": runs}


def scored(runs: list[dict]) -> list[dict]:
    """Each repeat's gaps where the loop idled: measured wake, the rule's and the constant's."""
    from workloads.serving.costs import HostCosts

    out = []
    for run_ in runs:
        rule = HostCosts(**run_["rule"])
        out += [{**p, "rule_s": rule.wake_after(p["idle_s"]), "constant_s": rule.prefill_wake_s}
                for p in run_["points"] if p["idle_s"] >= MIN_IDLE_S]
    return out


def _stats(errors: list[float]) -> dict:
    return {"median_abs_ms": 1e3 * statistics.median(abs(e) for e in errors),
            "max_abs_ms": 1e3 * max(abs(e) for e in errors), "n": len(errors)}


def run(args: argparse.Namespace, previous: dict | None) -> dict:
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")
    if hasattr(os, "sched_setaffinity") and len(os.sched_getaffinity(0)) > 1:
        os.sched_setaffinity(0, {max(os.sched_getaffinity(0))})    # one core, as a worker
    from benchmarks.blind import draw, fresh_seed, git_state
    from sweeper.calibrate.serving import MODEL as PROBE

    seed = args.seed if args.seed is not None else fresh_seed()
    models = [PROBE, *draw(seed, args.models, set())]
    load_before, context, began = common.load_average(), common.machine_context(), time.time()
    rows = []
    for model in models:
        measured = measure_model(model, args.repeats)
        measured["heldout"] = scored(measured["repeats"])
        rows.append(measured)
        print(f"  {model.name}: " + ", ".join(f"{p['gap_s']:g}s {1e3 * p['wake_s']:.2f} ms"
                                              for p in measured["repeats"][0]["points"]),
              file=sys.stderr, flush=True)
    heldout = [h for r in rows for h in r["heldout"]]
    unscored = sum(len(r_["points"]) for r in rows for r_ in r["repeats"]) - len(heldout)
    return {"name": NAME, "seed": seed, "repeats": args.repeats, "gaps_s": list(GAPS),
            "models": rows, "unscored_points": unscored,
            "summary": {"rule": _stats([h["rule_s"] - h["wake_s"] for h in heldout]),
                        "constant": _stats([h["constant_s"] - h["wake_s"] for h in heldout]),
                        "wake_ms_by_gap": wake_by_gap(rows)},
            "command": f"python -m benchmarks.idle_wake --models {args.models} --seed {seed} "
                       f"--repeats {args.repeats}",
            "git": git_state(), "machine": common.machine_context(since=context),
            "load_average_before": load_before,
            "load_average_after": common.load_average(), "wall_s": time.time() - began}


def wake_by_gap(rows: list[dict]) -> list[dict]:
    """Per gap of `GAPS`, the wakes measured (ms) over models and repeats: min, median, max."""
    out = []
    for gap in GAPS:
        values = [1e3 * p["wake_s"] for r in rows for run_ in r["repeats"] for p in run_["points"]
                  if p["gap_s"] == gap]
        out.append({"gap_s": gap, "min": min(values), "median": statistics.median(values),
                    "max": max(values), "n": len(values)})
    return out


def arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--models", type=int, default=3, help="models drawn besides the probe")
    parser.add_argument("--seed", type=int, default=None, help="their seed (default: drawn now)")
    parser.add_argument("--repeats", type=int, default=2, help="measurements of every gap")


def metrics(result: dict) -> dict:
    return {f"{k}_median_abs_ms": result["summary"][k]["median_abs_ms"] for k in ("rule", "constant")}


BENCHMARK = harness.Benchmark(NAME, __doc__.splitlines()[0], run, arguments=arguments,
                              metrics=metrics)


if __name__ == "__main__":
    sys.exit(harness.main(BENCHMARK))
