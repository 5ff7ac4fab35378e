"""Serving validation (issue 19, deliverable 6): measured vs predicted TTFT and TPOT of real
serving runs on this host's emulated meshes.

    python -m benchmarks.serving_validation            # ~10 min on 2 cores
    python -m benchmarks.serving_validation --requests 10 --out /tmp/sv

Six deployments of a tiny model (three aggregated, three disaggregated), each served at two
loads (about 35% and 85% of its capacity: the second near saturation), each load twice with
different seeds (arrivals and prompts): the replicate spread of the measurement is stated
beside every error. Each deployment's workers start and warm up once (sweeper/serving/serve.py
`ServingSession`), then serve its four streams.

Predicted (the headline): `simulate()` of the same deployment and the same requests with the
cost model's step times and the plan's hardware profile: `benchmarks/results/host-fitted.yaml`
(a profile `sweeper fit` made from the calibration sweep's trials, none of them serving runs),
scaled to each worker's core share. Nothing of the serving runs feeds it.
Warm-up model (a diagnostic, separately labelled): the same simulation on the step times the
workers measured while warming up before the streams; its error is the serving model's own
(queueing, slots, handover) with the step-time model taken out.

The loads are set from the warm-up step times (`capacity_rps`): the experiment's design, not
a prediction. Targets: p50 within 15%, p99 within 30% (issue 19). The host's load average is
recorded before and after: other processes share its cores, and on a loaded host the
measured latencies include their interference.
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import numpy as np
import yaml

from benchmarks import common

MODEL = "tiny-serial"
INPUT_LEN, OUTPUT_LEN = 16, 12
LOADS = (0.35, 0.85)          # fractions of the capacity the warm-up step times give
SEEDS = (1, 2)
METRICS = ("ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s")
TARGET = {"p50": 0.15, "p99": 0.30}
PROFILE = common.RESULTS / "host-fitted.yaml"


def _part(chips, ffn, attn, batch):
    return {"chips": chips, "replicas": 1, "ffn": ffn, "attn": attn, "batch": batch,
            "weights": "bf16"}


DEPLOYMENTS = {
    "agg-1chip-4slots": ("aggregated", _part(1, "ws2d", "head", 1), _part(1, "ws2d", "head", 4)),
    "agg-2chip-8slots": ("aggregated", _part(2, "ws2d", "head", 1), _part(2, "ws2d", "batch", 8)),
    "agg-4chip-prefill4": ("aggregated", _part(4, "wg_xyz", "batch", 4), _part(4, "ws2d", "batch", 4)),
    "dis-1+1chip-4slots": ("disaggregated", _part(1, "ws2d", "head", 1), _part(1, "ws2d", "head", 4)),
    "dis-2+2chip-8slots": ("disaggregated", _part(2, "ws2d", "head", 1), _part(2, "ws2d", "batch", 8)),
    "dis-1+2chip-4slots": ("disaggregated", _part(1, "ws2d", "head", 1), _part(2, "ws1d", "head", 4)),
}


def deployment(name: str):
    from sweeper.serving.deployment import Deployment

    mode, prefill, decode = DEPLOYMENTS[name]
    hardware = yaml.safe_load(PROFILE.read_text())
    return Deployment.from_dict({"model": MODEL, "hardware": hardware, "mode": mode,
                                 "prefill": prefill, "decode": decode}, str(PROFILE))


def stream(rate: float, n: int, seed: int):
    from sweeper.serving.workload import AppProfile, Length, requests

    return requests(AppProfile(rate=rate, input_len=Length("fixed", INPUT_LEN, INPUT_LEN, INPUT_LEN),
                               output_len=Length("fixed", OUTPUT_LEN, OUTPUT_LEN, OUTPUT_LEN)),
                    n, seed)


def run(n_requests: int) -> dict:
    from sweeper.serving.serve import ServingSession, relative_errors, warmup_step_times
    from sweeper.serving.simulate import capacity_rps

    rows, started = [], time.time()
    load_before = common.load_average()
    context = INPUT_LEN + OUTPUT_LEN + 1
    for name in DEPLOYMENTS:
        d = deployment(name)
        t0 = time.time()
        with ServingSession(d, context, [INPUT_LEN], seed=0) as session:
            setup_s = time.time() - t0
            capacity = capacity_rps(d, warmup_step_times(d, session.warmup), INPUT_LEN, OUTPUT_LEN)["rps"]
            for load in LOADS:
                rate = load * capacity
                for seed in SEEDS:
                    result = session.run(stream(rate, n_requests, seed), seed)
                    rows.append({
                        "deployment": name, "mode": d.mode, "load": load, "rate_rps": rate,
                        "capacity_rps_warmup": capacity, "seed": seed, "requests": n_requests,
                        "measured": result.measured, "predicted": result.predicted,
                        "warmup_model": result.calibrated,
                        "error": relative_errors(result.measured, result.predicted),
                        "error_warmup_model": relative_errors(result.measured, result.calibrated),
                        "warmup": result.warmup, "wall_s": result.wall_s, "setup_s": setup_s,
                        "load_average": common.load_average()})
                    print(f"{name} load {load:.2f} ({rate:.2f} req/s) seed {seed}: " + ", ".join(
                        f"{k} {result.measured[k] * 1e3:.0f}/{result.predicted[k] * 1e3:.0f} ms"
                        for k in METRICS), flush=True)
    return {"rows": rows, "groups": groups(rows), "summary": summarize(groups(rows)),
            "context": {**common.machine_context(), "load_average_before": load_before},
            "wall_s": time.time() - started, "model": MODEL, "input_len": INPUT_LEN,
            "output_len": OUTPUT_LEN, "loads": list(LOADS), "seeds": list(SEEDS),
            "profile": str(PROFILE.relative_to(common.ROOT)), "target": TARGET,
            "command": "python -m benchmarks.serving_validation"
                       + (f" --requests {n_requests}" if n_requests != DEFAULT_REQUESTS else "")}


def groups(rows: list[dict]) -> list[dict]:
    """Per deployment, load and metric: the replicates' measured mean and spread
    (max - min over the mean), the mean error of the prediction and of the warm-up model."""
    out = []
    keys = sorted({(r["deployment"], r["load"]) for r in rows},
                  key=lambda k: (list(DEPLOYMENTS).index(k[0]), k[1]))
    for name, load in keys:
        reps = [r for r in rows if (r["deployment"], r["load"]) == (name, load)]
        for metric in METRICS:
            measured = np.array([r["measured"][metric] for r in reps], dtype=float)
            error = np.array([r["error"][metric] for r in reps], dtype=float)
            warm = np.array([r["error_warmup_model"][metric] for r in reps], dtype=float)
            mean = float(np.mean(measured))
            target = TARGET["p50" if "p50" in metric else "p99"]
            err = float(np.mean(error))
            out.append({"deployment": name, "mode": reps[0]["mode"], "load": load,
                        "rate_rps": float(np.mean([r["rate_rps"] for r in reps])),
                        "metric": metric, "replicates": len(reps), "measured_mean_s": mean,
                        "replicate_spread": float((measured.max() - measured.min()) / mean) if mean > 0 else None,
                        "predicted_mean_s": float(np.mean([r["predicted"][metric] for r in reps])),
                        "error": err, "within_target": bool(abs(err) <= target) if math.isfinite(err) else None,
                        "error_warmup_model": float(np.mean(warm)),
                        "warmup_within_target": bool(abs(float(np.mean(warm))) <= target)
                        if math.isfinite(float(np.mean(warm))) else None,
                        "target": target})
    return out


def summarize(groups_: list[dict]) -> dict:
    out = {}
    for stat in ("p50", "p99"):
        part = [g for g in groups_ if stat in g["metric"]]
        errs = np.array([abs(g["error"]) for g in part])
        warm = np.array([abs(g["error_warmup_model"]) for g in part])
        spread = np.array([g["replicate_spread"] for g in part if g["replicate_spread"] is not None])
        out[stat] = {"cases": len(part), "target": TARGET[stat],
                     "within_target": int(sum(bool(g["within_target"]) for g in part)),
                     "median_abs_error": float(np.median(errs)) if len(errs) else None,
                     "warmup_within_target": int(sum(bool(g["warmup_within_target"]) for g in part)),
                     "warmup_median_abs_error": float(np.median(warm)) if len(warm) else None,
                     "median_replicate_spread": float(np.median(spread)) if len(spread) else None}
    return out


def render(r: dict) -> str:
    c = r["context"]
    lines = ["# Serving validation: measured vs predicted TTFT and TPOT",
             "",
             f"Command: `{r['command']}`. Model {r['model']}, prompts {r['input_len']} and answers "
             f"{r['output_len']} tokens, {r['rows'][0]['requests'] if r['rows'] else 0} requests per "
             f"stream, loads {', '.join(f'{x:.0%}' for x in r['loads'])} of each deployment's "
             f"capacity (from its warm-up step times), {len(r['seeds'])} replicates (seeds "
             f"{', '.join(map(str, r['seeds']))}) each. Emulated meshes on this host (`host` "
             f"timings): {c['cpus']} CPUs, load average {c['load_average_before']} before and "
             f"{c['load_average']} after; wall {r['wall_s'] / 60:.1f} min.",
             "",
             f"Predicted: the serving model (`simulate`) with the cost model's step times and "
             f"`{r['profile']}`. Warm-up model (diagnostic): the same simulation on the workers' "
             "warm-up step times. Error = predicted / measured - 1, the mean over the replicates; "
             "spread = (max - min) / mean of the replicates' measured values.",
             ""]
    for stat, s in r["summary"].items():
        lines.append(f"- **{stat}** (target within {s['target']:.0%}): prediction within target "
                     f"in {s['within_target']}/{s['cases']} cases, median |error| "
                     f"{common.pct(s['median_abs_error'], 0)}; warm-up model within target in "
                     f"{s['warmup_within_target']}/{s['cases']}, median |error| "
                     f"{common.pct(s['warmup_median_abs_error'], 0)}; median replicate spread "
                     f"{common.pct(s['median_replicate_spread'], 0)}.")
    lines.append("")
    rows = [[g["deployment"], f"{g['load']:.0%} ({g['rate_rps']:.2f}/s)", g["metric"],
             common.ms(g["measured_mean_s"]), common.pct(g["replicate_spread"], 0),
             common.ms(g["predicted_mean_s"]), common.pct(g["error"], 0),
             "yes" if g["within_target"] else "no", common.pct(g["error_warmup_model"], 0)]
            for g in r["groups"]]
    lines += common.table(["deployment", "load", "metric", "measured", "spread", "predicted",
                           "error", "within target", "warm-up model error"], rows)
    return "\n".join(lines) + "\n"


DEFAULT_REQUESTS = 40


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=DEFAULT_REQUESTS, help="requests per stream")
    parser.add_argument("--out", default=str(common.RESULTS), help="results folder")
    args = parser.parse_args(argv)
    result = run(args.requests)
    common.publish("serving_validation", result, render, Path(args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
