"""Serving validation (issue 19, deliverable 6): measured vs predicted TTFT and TPOT of real
serving runs on this host's emulated meshes.

    python -m benchmarks.serving_validation            # ~8 min on 2 cores (2-3 of calibration)
    python -m benchmarks.serving_validation --requests 10 --out /tmp/sv
    python -m benchmarks.serving_validation --profile benchmarks/results/serving_validation.fitted.yaml \
        --deployments dis-1+1chip-4slots --loads 0.85 --out /tmp/sv    # one deployment, one load
    python -m benchmarks.serving_validation --profile benchmarks/results/serving_validation.fitted.yaml \
        --deployments agg-1chip-4slots --loads 0.85 --remeasure --out /tmp/sv   # closed loop before each stream too
    python -m benchmarks.serving_validation --runs 3   # three whole runs, each with its own calibration
    python -m benchmarks.serving_validation --deployments agg-2chip-2stages-4slots --runs 3
        # some cells only, MERGED into the results file (each run into its run, with its profile)

Six deployments of the `calib` model (three aggregated, three disaggregated; on 1-2 emulated
chips per worker, since this host has 2 cores), and three aggregated cells of the serving
behaviours (chunked prefill, prefix caching, two pipeline stages), each served at two loads (35% and 85% of its
capacity: the second near saturation), each load twice with different seeds (arrivals and
prompts): the replicate spread of the measurement is stated beside every error. Each
deployment's workers start and warm up once (sweeper/serving/serve.py `ServingSession`),
then serve its four streams.

The protocol is engine-dominated, as a real deployment is: `calib` (d_model 768, 2 layers)
takes ~5 ms per decode step and ~10-40 ms per 32-token prefill on this host's cores, where the
serving loop's own host work is ~0.5-1 ms per call; the serving host costs
(sweeper/serving/overheads.py: per decode step, per prefill call, per KV handover) are
measured on each deployment's own workers BEFORE its streams, outside them (a closed loop
with every slot full and no arrivals, the engine's timed calls of the same shapes, KV
handovers of two sizes, and the decode loop stepping with handovers arriving at a stream's
rate: the charge per handover), and written into the deployment's profile (`with_overheads`). The
loads are fractions of the capacity those closed-loop measurements give (`capacity_rps` on
the loop's mean step, prefill and handover times: interruptions by other processes
included): the experiment's design, measured outside the streams, never a served request.

Calibration first, as the tool promises its users (docs/calibration.md): before serving,
a small `sweeper run` sweep on THIS host (`CALIBRATION_SPACE`: the deployments' model, chip
counts, layouts, weights and prefill/decode batches at the served prompt length, about 2 min)
into a temporary SWEEPER_HOME (`--keep-calibration DIR`: that folder, kept), then the `sweeper
fit` pipeline on that study IN that SWEEPER_HOME (its `host` is the profile the sweep measured;
see `fit`) with the extra
terms (launch_overhead_s, per-device collective latency, ...) chosen by nested
cross-validation (`terms="select"`; the `sweeper fit` CLI has no flag for it). Its decode
trials run ONE step per timed call (`decode_steps: 1`), synchronised as the server's step is
(every serving step brings its tokens to the host), so the per-call dispatch and sync is in
the measurements the fit sees; the engine's multi-step runs pipeline the steps and hide it.
The fitted profile (with its held-out residuals: the plans' error bands) is written to
`benchmarks/results/serving_validation.fitted.yaml` and is the deployments' hardware. If the
fit refuses to publish (the 3x worst-fold rule), the committed `host-fitted.yaml` is used and
the results say so. None of the calibration measurements is a serving run.

Predicted (the headline): `simulate()` of the same deployment and the same requests with the
cost model's step times and that profile, scaled to each worker's core share. Nothing of the
serving runs feeds it.
The host costs are the closed loop's means (the prefill's per prompt), and every call is
scaled by a factor drawn from the closed loop's spread of durations (`duration_spread`).
Loop model (a diagnostic, separately labelled): the same simulation on the serving loop's
step, prefill and handover times measured in the closed loop before the streams; its error is
the serving model's own (queueing, slots, handover, step-time variation under load) with the
step-time model taken out.
Replay (a diagnostic): the same simulation on each stream's own logged call durations, in
order (`replay_step_times`): its error is the serving model's rules alone.

Cores: every worker is pinned to one core of its own (`CORES_PER_WORKER`; disaggregated:
prefill and decode never share one), the share the calibration sweep's trials ran on, and the
predictions scale the fitted profile to that share; the host costs are measured on the same
cores.
Targets: p50 within 15%, p99 within 30% (issue 19). The host's load average is
recorded before and after, and the hypervisor steal and iowait over the serving and over the
calibration sweep (percent of all CPUs' time, /proc/stat: benchmarks/common.py): other
processes and other guests share its cores, and on a loaded host the measured latencies
include their interference.

Partial runs (`--deployments`, `--loads`) into a folder that has a results file merge into it
(`merge_run`): the (deployment, load) cells they serve replace that file's rows of those
cells, every other cell stays, and the groups and summaries are computed again over the
merged rows. Each run of the file gets the partial run's run of the same number, predicted
with that run's fitted profile (no new calibration, so the new cells are predicted as the
cells beside them; `--profile` overrides, and every row records its profile); a file of
other runs, requests per stream or protocol is refused in one line before anything runs.
The file lists the partial runs merged into it (`merged`).

Issue 38's serving behaviours are cells too: prefill in chunks mixed into the decode steps,
a shared prefix whose KV the worker caches, and a replica in two pipeline stages of one chip
each (`agg-2chip-2stages-4slots`: predicted as `sweeper plan` prices stages,
workloads/serving/model.py; served by workloads/serving/pipeline.py `StagedSlotServer`).

Several runs (`--runs N`): N whole runs one after another, each with its own calibration
(run i > 1 fits `serving_validation.fitted.run<i>.yaml` beside the first's; with
`--keep-calibration DIR`, in DIR/run<i>) and its own host costs. The results keep every run
and add the summary over them (`over_runs`): every run's counts with its load and steal, the
median of the counts (never the best run), and per case the median error over the runs, the
runs' spread and the pooled error (docs/serving.md, "Validation on this host").
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import yaml

from benchmarks import common, harness
from workloads.serving.costs import HostCosts

NAME = "serving_validation"
MODEL = "calib"               # workloads/config.py: steps of ms, not tens of microseconds
INPUT_LEN, OUTPUT_LEN = 32, 16
LOADS = (0.35, 0.85)          # fractions of the capacity the closed-loop measurements give
SEEDS = (1, 2)
# Every worker on one core, as the calibration sweep's trials (`parallel: 2` on this 2-core
# host: one core each): the fitted profile scaled to a worker's share then describes the
# cores it really has (a one-chip program does not run twice as fast on two cores).
CORES_PER_WORKER = 1
METRICS = ("ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s")
TARGET = {"p50": 0.15, "p99": 0.30}
FALLBACK_PROFILE = common.RESULTS / "host-fitted.yaml"   # fitted on the calibration sweep's shapes
FITTED_PROFILE = common.RESULTS / "serving_validation.fitted.yaml"
# The calibration sweep (a space file, written to the temporary SWEEPER_HOME): the served
# shapes and their neighbours; decode_steps 1: one synchronised step per timed call, as served.
CALIBRATION_SPACE = {
    "name": "serving-validation-calibration",
    "description": "calibration for benchmarks/serving_validation.py: the served shapes on this host",
    "model": MODEL, "hardware": "host", "weights": "bf16", "input_len": INPUT_LEN, "decode_steps": 1,
    "repeats": 6, "warmup": 1, "ci_target": 0.02, "time_budget_s": 1.0,   # as calibration.yaml
    "params": {"chips": [1, 2], "batch": [1, 4, 8], "prefill_ffn": ["ws2d"],
               "decode_ffn": ["ws2d", "ws1d"], "attn": ["head", "batch"]},
    "objectives": [{"metric": "decode_step_s", "direction": "minimize"},
                   {"metric": "prefill_s", "direction": "minimize"}],
    "sampler": {"type": "grid", "seed": 0}, "trials": 24, "parallel": 2, "timeout_s": 300,
    "max_retries": 1, "memory_budget_bytes": "2GiB"}


def _part(chips, ffn, attn, batch, chunk=0, stages=1):
    """One slice of a deployment (a plan file's `prefill`/`decode`); `chunk`, `stages` written
    only when not the default, as `sweeper plan` writes them."""
    out = {"chips": chips, "replicas": 1, "ffn": ffn, "attn": attn, "batch": batch,
           "weights": "bf16"}
    return {**out, **({"chunk": chunk} if chunk else {}), **({"stages": stages} if stages > 1 else {})}


# Worker chips <= 2: a worker runs on 1-2 of this host's 2 cores (module docstring).
DEPLOYMENTS = {
    "agg-1chip-4slots": ("aggregated", _part(1, "ws2d", "head", 1), _part(1, "ws2d", "head", 4)),
    "agg-2chip-8slots": ("aggregated", _part(2, "ws2d", "head", 1), _part(2, "ws2d", "batch", 8)),
    "agg-2chip-prefill4": ("aggregated", _part(2, "ws2d", "batch", 4), _part(2, "ws2d", "batch", 4)),
    "dis-1+1chip-4slots": ("disaggregated", _part(1, "ws2d", "head", 1), _part(1, "ws2d", "head", 4)),
    "dis-1+1chip-8slots": ("disaggregated", _part(1, "ws2d", "head", 1), _part(1, "ws2d", "head", 8)),
    "dis-1+2chip-4slots": ("disaggregated", _part(1, "ws2d", "head", 1), _part(2, "ws1d", "head", 4)),
    # the serving behaviours of issue 38: prefill in chunks of 8 tokens mixed into the decode
    # steps (Sarathi-Serve, vLLM); a shared prefix whose KV the worker caches (PREFIX)
    "agg-2chip-8slots-chunk8": ("aggregated", _part(2, "ws2d", "head", 1, chunk=8),
                                _part(2, "ws2d", "batch", 8)),
    "agg-1chip-4slots-prefix16": ("aggregated", _part(1, "ws2d", "head", 1),
                                  _part(1, "ws2d", "head", 4)),
    # pipeline stages: the replica's 2 chips as 2 stages of one chip, each holding one of the
    # model's 2 layers (an aggregated replica's phases have the same stages); predicted as
    # `sweeper plan` prices a staged slice (workloads/serving/model.py: the slots in up to 2
    # micro-batches through both stages, the bubble, the activations' transfer)
    "agg-2chip-2stages-4slots": ("aggregated", _part(2, "ws2d", "head", 1, stages=2),
                                 _part(2, "ws2d", "head", 4, stages=2)),
}
# Deployments whose streams share a prompt prefix (prefix caching): (prefix_len, prefix_hit)
PREFIX = {"agg-1chip-4slots-prefix16": (16, 0.8)}


def calibrate(keep: Path | None = None, fitted_yaml: Path = FITTED_PROFILE) -> dict:
    """The calibration sweep and fit (module docstring): which profile the plans use, and why.
    `keep`: the sweep's SWEEPER_HOME (study, MLflow runs, host profile) is this folder, kept
    for inspection (`--keep-calibration`); default a temporary one. `fitted_yaml`: where the
    fitted profile goes (the results folder's; `--out` elsewhere leaves the committed one)."""
    if keep is not None:
        keep.mkdir(parents=True, exist_ok=True)
        return _calibrate(keep, fitted_yaml)
    with tempfile.TemporaryDirectory(prefix="sweeper-sv-") as home:
        return _calibrate(Path(home), fitted_yaml)


def _calibrate(home: Path, fitted_yaml: Path = FITTED_PROFILE) -> dict:
    started, load, cpu = time.time(), common.load_average(), common.cpu_times()
    study = "serving-validation-calibration"
    space = home / "space.yaml"
    space.write_text(yaml.safe_dump(CALIBRATION_SPACE, sort_keys=False))
    sweeper = Path(sys.executable).parent / "sweeper"     # the CLI, as a user runs it
    run = subprocess.run([str(sweeper), "run", str(space), "--study", study,
                          "--no-analysis"], env={**os.environ, "SWEEPER_HOME": str(home)},
                         capture_output=True, text=True)
    sweep_s = time.time() - started
    out = {"space": CALIBRATION_SPACE, "sweep_wall_s": sweep_s, "load_average_before": load,
           "load_average_after_sweep": common.load_average(),
           # the sweep's trials run two at once, one per core: the steal over it (docs/serving.md)
           **{f"sweep_{k}": v for k, v in common.cpu_time_shares(cpu, common.cpu_times()).items()}}
    if run.returncode != 0:
        out.update(used=str(FALLBACK_PROFILE.relative_to(common.ROOT)),
                   why=f"the calibration sweep failed (exit {run.returncode}): "
                       f"{run.stderr.strip()[-300:]}")
        return out
    out.update(fit(study, f"sqlite:///{home}/optuna.db", home / "fit", fitted_yaml, sweeper_home=home))
    out["fit_wall_s"] = time.time() - started - sweep_s
    return out


@contextlib.contextmanager
def _sweeper_home(home: Path | None):
    """SWEEPER_HOME set to `home` for the block (None: unchanged)."""
    if home is None:
        yield
        return
    before = os.environ.get("SWEEPER_HOME")
    os.environ["SWEEPER_HOME"] = str(home)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("SWEEPER_HOME", None)
        else:
            os.environ["SWEEPER_HOME"] = before


def fit(study: str, storage: str, artifacts: Path, fitted_yaml: Path = FITTED_PROFILE,
        sweeper_home: Path | None = None) -> dict:
    """The `sweeper fit` pipeline on the calibration study, the extra terms chosen by nested
    cross-validation; the fitted profile (with held-out residuals) written unless refused.

    `sweeper_home`: the sweep's SWEEPER_HOME, where `sweeper fit` runs as a user runs it after
    `sweeper run`: the study's `host` label resolves to the host profile cached THERE (the one
    the sweep measured and priced its trials with), not to this process's own cache. The fit's
    rate ceilings and prior are that profile (sweeper/analysis/fit.py, "rates never above the
    start profile's measured peak"): a stale cache measured under heavy load (./.sweeper's:
    load 24, HBM 8.6 GB/s where the quiet host reads 32 GB/s) capped the bandwidth, and decode
    was mispredicted by +25-60% (benchmarks/results/serving_validation.md)."""
    from sweeper.analysis import calibrate as cal
    from sweeper.analysis import holdout

    data = cal.load_study_data(study, storage)
    with _sweeper_home(sweeper_home):
        swept = cal.study_base_profile(data.attrs)
    points = cal.points_from_frame(data.frame, swept, data.configs)
    result = holdout.calibrate(points, swept, ("kfold",), study, terms=holdout.SELECT)
    cal.write_outputs(result, artifacts, None if result.refused else fitted_yaml)
    main = result.main
    # each trial's measured medians and its host's state while it ran (docs/serving.md,
    # "Validation on this host": the deployments' engine calls beside them)
    cols = ("number", "chips", "batch", "prefill_ffn", "prefill_attn", "decode_ffn", "decode_attn",
            "prefill_s", "decode_step_s", "decode_step_s_min", "decode_spread", "decode_repeats",
            "host_load_avg_1m", "host_busy_frac", "host_steal_frac")
    trials_measured = [{c: row.get(c) for c in cols}
                       for row in data.frame.to_dict("records") if row.get("state") == "COMPLETE"]
    out = {"trials_measured": trials_measured,
           "base_profile": {k: getattr(swept, k) for k in ("name", "peak_flops", "hbm_bandwidth",
                                                           "ici_bandwidth")},
           "trials": len({p.trial for p in points}), "points": len(points),
           "terms": list(result.terms), "heldout_mape": main.mape,
           "heldout_median_ape": main.median_ape, "heldout_max_ape": main.max_ape,
           "heldout_mape_by_phase": {ph: float(np.mean(np.abs(v))) for ph, v in
                                     main.summary()["residuals"].items() if v},
           "refused": result.refused,
           "fitted": {k: getattr(result.fitted, k) for k in (
               "peak_flops", "hbm_bandwidth", "ici_bandwidth", "op_overhead_s", "overlap",
               "launch_overhead_s", "device_overhead_s", "collective_latency_s_per_device")}}
    if result.refused:
        out.update(used=str(FALLBACK_PROFILE.relative_to(common.ROOT)),
                   why=f"the fit refused to publish ({result.refused}): fell back to the "
                       "committed profile fitted on the calibration sweep's shapes")
    else:
        out.update(used=str(fitted_yaml.relative_to(common.ROOT)) if fitted_yaml.is_relative_to(common.ROOT)
                   else str(fitted_yaml), why="fitted by this run on this host's calibration sweep")
    return out


def deployment(name: str, profile: Path):
    from workloads.deployment import Deployment

    mode, prefill, decode = DEPLOYMENTS[name]
    hardware = yaml.safe_load(profile.read_text())
    return Deployment.from_dict({"model": MODEL, "hardware": hardware, "mode": mode,
                                 "prefill": prefill, "decode": decode}, str(profile))


def stream(rate: float, n: int, seed: int, name: str | None = None):
    """A stream of fixed lengths; deployment `name`'s shared prefix (PREFIX), if it has one."""
    from workloads.serving.profile import AppProfile, Length, requests

    prefix_len, prefix_hit = PREFIX.get(name, (0, 1.0))
    return requests(AppProfile(rate=rate, input_len=Length("fixed", INPUT_LEN, INPUT_LEN, INPUT_LEN),
                               output_len=Length("fixed", OUTPUT_LEN, OUTPUT_LEN, OUTPUT_LEN),
                               prefix_len=prefix_len, prefix_hit=prefix_hit),
                    n, seed)


def features() -> dict[str, str]:
    """The deployments that exercise a serving behaviour, and which (the renderer's note)."""
    out = {}
    for name, (_, prefill, _) in DEPLOYMENTS.items():
        if prefill.get("chunk"):
            out[name] = (f"chunked prefill: {prefill['chunk']}-token chunks of the prompts mixed "
                         "into the decode steps")
    for name, (_, _, decode) in DEPLOYMENTS.items():
        if decode.get("stages", 1) > 1:
            out[name] = (f"pipeline stages: {decode['stages']} stages of "
                         f"{decode['chips'] // decode['stages']} chip(s), the layers split "
                         "between them, the activations moved from one stage's devices to the next")
    for name, (length, hit) in PREFIX.items():
        out[name] = (f"prefix caching: {hit:.0%} of the prompts start with a shared "
                     f"{length}-token prefix whose KV the worker computed before the streams")
    return out


def step_times(d, session, costs: dict) -> dict:
    """The step times behind the predictions: the cost model's (fitted profile scaled to the
    workers' core share) plus the measured host costs, beside the serving loop's measured
    medians (closed loop, before the streams) and the workers' warm-up medians."""
    from sweeper.serving.serve import prediction_deployment
    from workloads.serving.model import cost_model_step_times

    model = cost_model_step_times(prediction_deployment(d, session.share))
    pre = session.warmup.get("aggregated") or session.warmup["prefill"]
    dec = session.warmup.get("aggregated") or session.warmup["decode"]
    detail = costs["detail"]
    loop_pre = detail.get("aggregated") or detail["prefill"]
    loop_dec = detail.get("aggregated") or detail["decode"]
    context = INPUT_LEN + OUTPUT_LEN / 2
    prompts = loop_pre.get("loop_prefill_prompts", d.prefill.batch)   # per closed-loop call
    return {"prefill_s": {"predicted": model.prefill_s(d.prefill.batch, INPUT_LEN)
                          + prompts * model.host_costs.prefill_overhead_per_prompt_s,
                          "engine": loop_pre["engine_prefill_s"], "loop": loop_pre["loop_prefill_s"],
                          "warmup": pre[f"prefill_s@{INPUT_LEN}"]},
            "decode_step_s": {"predicted": model.decode_step_s(d.decode.batch, context)
                              + model.host_costs.step_overhead_s,
                              "engine": loop_dec["engine_step_s"], "loop": loop_dec["loop_step_s"],
                              "warmup": dec["decode_step_s"]},
            "kv_transfer_s": {"predicted": model.kv_transfer_s(INPUT_LEN)
                              + model.host_costs.handover_overhead_s
                              if d.mode == "disaggregated" else 0.0},
            "host_costs": HostCosts.from_measured(costs).to_dict()}


def without_stepping_calls(costs: dict) -> dict:
    """`costs` without the stepping handovers' call log (overheads.py
    `measure_stepping_handovers`; kept in the deployment's first row)."""
    stepping = costs.get("detail", {}).get("stepping_handovers")
    if not stepping or "calls" not in stepping:
        return costs
    stepping = {k: v for k, v in stepping.items() if k != "calls"}
    return {**costs, "detail": {**costs["detail"], "stepping_handovers": stepping}}


def loop_step_times(d, costs: dict, statistic: str = "mean"):
    """StepTimes of the serving loop as measured before the streams (closed loop: its step;
    its prefill, the engine's call and the loop's host work per prompt after it; the
    handover's fixed part). Means (interruptions by other processes included: what a
    stream's queue pays, docs/serving.md "Checking the model against the server"): the
    loop-model diagnostic and the loads' capacity (module docstring); medians on request."""
    from workloads.serving.model import StepTimes

    measured = HostCosts.from_measured(costs)
    detail = costs["detail"]
    pre = detail.get("aggregated") or detail["prefill"]
    dec = detail.get("aggregated") or detail["decode"]
    suffix = "_mean_s" if statistic == "mean" else "_s"
    engine_prefill, step = pre["engine_prefill_s"], dec["loop_step" + suffix]
    per_prompt = (max(pre["loop_prefill" + suffix] - engine_prefill, 0.0)
                  / (pre.get("loop_prefill_prompts") or 1.0)) if "loop_prefill" + suffix in pre else 0.0
    if statistic == "mean":     # the measurement's own (aggregated: the paired prefill calls)
        per_prompt = measured.prefill_overhead_per_prompt_s
    # the loop's own step has its host work in it: no step overhead on top
    host = dataclasses.replace(measured, step_overhead_s=0.0, prefill_overhead_per_prompt_s=per_prompt)
    return StepTimes(lambda b, n: engine_prefill, lambda b, c: step, source="serving loop",
                     host_costs=host)


def handover_s(per_request: list[dict]) -> float | None:
    """Disaggregated: measured mean seconds from the first token to the request's KV in a
    decode slot (export, the object store, insert, and any wait for a free slot)."""
    gaps = [p["kv_ready_s"] - p["first_token_s"] for p in per_request
            if "kv_ready_s" in p and "first_token_s" in p]
    return float(np.mean(gaps)) if gaps else None


def run(n_requests: int, calibration: dict, names: list[str] | None = None,
        loads: list[float] | None = None, remeasure: bool = False) -> dict:
    """Serve every deployment at every load (default) or the given subset (a quick check of
    one deployment: `--deployments`, `--loads`). `remeasure`: the host costs measured again
    on the same workers right before each stream too (`host_costs_stream` in its row; the
    predictions keep the deployment's first measurement, the loads its capacity), so the
    stream's calls can be set against a closed loop seconds before them (`duration_analysis`)."""
    from sweeper.serving.overheads import duration_spread, measure_session, with_deployment_overheads
    from sweeper.serving.serve import ServingSession, relative_errors
    from workloads.serving.model import capacity_rps

    rows, started = [], time.time()
    start = common.machine_context()       # its CPU time counters: the steal over serving
    load_before = start["load_average"]
    context = INPUT_LEN + OUTPUT_LEN + 1
    profile = common.ROOT / calibration["used"]
    names = list(names or DEPLOYMENTS)
    loads = list(loads or LOADS)
    for name in names:
        d = deployment(name, profile)
        t0 = time.time()
        prefix_len = PREFIX.get(name, (0, 1.0))[0]
        with ServingSession(d, context, sorted({INPUT_LEN // 2, INPUT_LEN}), seed=0,
                            cores_per_worker=CORES_PER_WORKER, prefix_len=prefix_len,
                            cached=[(INPUT_LEN, prefix_len)] if prefix_len else None) as session:
            setup_s = time.time() - t0
            costs = measure_session(session, INPUT_LEN, OUTPUT_LEN)   # before any stream
            # the measured host costs into the deployment's profile (the step, the prefill
            # per prompt, the handover, a prefill on an idle loop, the part of a prefill's
            # host work before its first tokens): the predictions read them from there
            d = with_deployment_overheads(d, costs)
            session.deployment = d
            # the closed loop's spread of call durations: the prediction and the loop model
            # draw each call's factor from it (docs/serving.md "The serving model")
            session.duration_spread = duration_spread(costs)
            session.diagnostic_step_times = dataclasses.replace(
                loop_step_times(d, costs), prefill_spread=session.duration_spread[0],
                step_spread=session.duration_spread[1])
            capacity = capacity_rps(d, loop_step_times(d, costs, "mean"), INPUT_LEN, OUTPUT_LEN)["rps"]
            steps = step_times(d, session, costs)
            print(f"{name}: host costs " + ", ".join(
                f"{k} {costs[k] * 1e3:.2f} ms" for k in ("step_overhead_s",
                                                        "prefill_overhead_per_prompt_s",
                                                        "handover_overhead_s"))
                  + f"; capacity {capacity:.1f} req/s", flush=True)
            for load in loads:
                rate = load * capacity
                for seed in SEEDS:
                    # the stepping handovers' call log (~600 calls) once per deployment
                    row_costs = costs if load == loads[0] and seed == SEEDS[0] else \
                        without_stepping_calls(costs)
                    reqs = stream(rate, n_requests, seed, name)
                    near = measure_session(session, INPUT_LEN, OUTPUT_LEN) if remeasure else None
                    result = session.run(reqs, seed)
                    replay = result.replayed      # the model on the stream's own call log
                    rows.append({
                        "deployment": name, "mode": d.mode, "load": load, "rate_rps": rate,
                        # the profile of its predictions (rows of a merged file may differ)
                        "profile": calibration["used"],
                        "capacity_rps_loop": capacity, "host_costs": row_costs, "seed": seed, "requests": n_requests,
                        "measured": result.measured, "predicted": result.predicted,
                        "warmup_model": result.calibrated,
                        "error": relative_errors(result.measured, result.predicted),
                        "error_warmup_model": relative_errors(result.measured, result.calibrated),
                        "replay": replay, "error_replay": relative_errors(result.measured, replay),
                        "warmup": result.warmup, "step_times": steps,
                        "handover_measured_s": handover_s(result.per_request),
                        # each worker's call log (server.py `last_calls`): the stream's calls
                        # per kind, beside the closed loop's in `host_costs`
                        "calls": result.calls,
                        **({"host_costs_stream": near} if near is not None else {}),
                        "wall_s": result.wall_s, "setup_s": setup_s,
                        "load_average": common.load_average()})
                    print(f"{name} load {load:.2f} ({rate:.2f} req/s) seed {seed}: " + ", ".join(
                        f"{k} {result.measured[k] * 1e3:.0f}/{result.predicted[k] * 1e3:.0f} ms"
                        for k in METRICS), flush=True)
    return {"rows": rows, "groups": groups(rows), "summary": summarize(groups(rows)),
            "steps": deployment_steps(rows),
            "context": {**common.machine_context(since=start), "load_average_before": load_before},
            "wall_s": time.time() - started, "model": MODEL, "input_len": INPUT_LEN,
            "output_len": OUTPUT_LEN, "loads": loads, "seeds": list(SEEDS),
            "features": {k: v for k, v in features().items() if k in names},
            "profile": calibration["used"], "calibration": calibration, "target": TARGET,
            "command": "python -m benchmarks.serving_validation"
                       + (f" --requests {n_requests}" if n_requests != DEFAULT_REQUESTS else "")
                       + (f" --deployments {','.join(names)}" if names != list(DEPLOYMENTS) else "")
                       + (f" --loads {','.join(str(x) for x in loads)}" if loads != list(LOADS) else "")
                       + (" --remeasure" if remeasure else "")}


def groups(rows: list[dict]) -> list[dict]:
    """Per deployment, load and metric: the replicates' measured mean and spread
    (max - min over the mean), the mean error of the prediction and of the loop model."""
    out = []
    keys = sorted({(r["deployment"], r["load"]) for r in rows},
                  key=lambda k: (list(DEPLOYMENTS).index(k[0]), k[1]))
    for name, load in keys:
        reps = [r for r in rows if (r["deployment"], r["load"]) == (name, load)]
        for metric in METRICS:
            measured = np.array([r["measured"][metric] for r in reps], dtype=float)
            error = np.array([r["error"][metric] for r in reps], dtype=float)
            warm = np.array([r["error_warmup_model"][metric] for r in reps], dtype=float)
            replay = np.array([r.get("error_replay", {}).get(metric, np.nan) for r in reps], dtype=float)
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
                        "error_replay": float(np.mean(replay)),
                        "target": target,
                        "responsible": responsible(err, float(np.mean(warm)), target,
                                                   float(np.mean(replay)))})
    return out


def responsible(error: float, warmup_error: float, target: float,
                replay_error: float = float("nan")) -> str:
    """What a miss is owed to, measured. The replay runs the simulation on the stream's own
    logged call durations, so its error is the serving model's rules alone; the loop model
    runs it on the serving loop's durations measured in the closed loop before the streams,
    so where the replay is within target and the loop model is not, the stream's calls took
    other durations than the closed loop's (other processes' load on this host changed, or
    the calls interfere in a stream as they do not in a closed loop); the rest of a miss is
    the step-time prediction's."""
    if not math.isfinite(error) or abs(error) <= target:
        return ""
    if math.isfinite(replay_error) and abs(replay_error) > target:
        return "serving model rules"
    if not math.isfinite(warmup_error):
        return "unknown"
    if abs(warmup_error) <= target:
        return "step-time prediction"
    if not math.isfinite(replay_error):     # a results file from before the replay
        if abs(warmup_error) < 0.5 * abs(error):
            return "mostly step-time prediction"
        return "serving model" if abs(warmup_error) >= abs(error) else "both"
    if abs(warmup_error) < 0.5 * abs(error):
        return "mostly step-time prediction"
    return "stream's call durations" if abs(warmup_error) >= abs(error) else "both"


def deployment_steps(rows: list[dict]) -> list[dict]:
    """Per deployment: predicted vs measured (closed loop) step times, the host costs, and
    the disaggregated KV handover."""
    out = []
    for name in DEPLOYMENTS:
        reps = [r for r in rows if r["deployment"] == name]
        if not reps:
            continue
        st = reps[0]["step_times"]
        hand = [r["handover_measured_s"] for r in reps if r.get("handover_measured_s") is not None]
        out.append({"deployment": name,
                    "prefill_predicted_s": st["prefill_s"]["predicted"],
                    "prefill_warmup_s": st["prefill_s"]["warmup"],
                    "prefill_engine_s": st["prefill_s"].get("engine"),
                    "prefill_loop_s": st["prefill_s"].get("loop"),
                    "decode_step_engine_s": st["decode_step_s"].get("engine"),
                    "decode_step_loop_s": st["decode_step_s"].get("loop"),
                    "host_costs": st.get("host_costs", {}),
                    "decode_step_predicted_s": st["decode_step_s"]["predicted"],
                    "decode_step_warmup_s": st["decode_step_s"]["warmup"],
                    "kv_transfer_predicted_s": st["kv_transfer_s"]["predicted"],
                    "handover_measured_s": float(np.mean(hand)) if hand else None,
                    "handover_spread": float((max(hand) - min(hand)) / np.mean(hand))
                    if len(hand) > 1 and np.mean(hand) > 0 else None})
    return out


# ------------------------------------------------------------------ what the misses are made of
# The replay (the model on a stream's own calls) meets the targets where the loop model (the
# model on the closed loop's calls measured before the streams) misses: the difference is in
# the call durations. Per stream, each kind of call the stream made against what the loop
# model charged for the same calls, and the loop model again with its times scaled by the
# stream/closed-loop ratio per kind: the TTFT error the durations alone explain, by the
# model's own sensitivity (docs/serving.md "Validation on this host").

CALL_KINDS = ("prefill_first", "prefill_after", "decode_step", "handover_insert")


def stream_calls(deployment, calls: dict, requests, costs: dict) -> dict[str, dict]:
    """Per call kind: the stream's own durations (`calls`, server.py `last_calls`) and, for
    the same calls, what the loop model charges (`loop_step_times` on the closed loop's
    `costs`), seconds. prefill_first: a prefill call's start to its first tokens, plus its
    idle wake (serve.py `idle_wakes`) where it found the loop idle; prefill_after: its host
    work after them (aggregated: its rows' inserts; a prefill slice: the KV's export and send);
    decode_step: a step with its bookkeeping; handover_insert (disaggregated): a decode loop's
    insert of a handed-over KV."""
    from sweeper.serving.serve import aggregated_names, disaggregated_names, idle_wakes, route

    times = loop_step_times(deployment, costs)
    engine = times.prefill_s(deployment.prefill.batch, INPUT_LEN)
    out = {k: {"stream": [], "loop": []} for k in CALL_KINDS}
    if deployment.mode == "aggregated":
        names = aggregated_names(deployment.decode.replicas)
        pre_names, dec_names = names, names
    else:
        names = disaggregated_names(deployment.prefill.replicas, deployment.decode.replicas)
        pre_names = [n for n in names if n.startswith("prefill")]
        dec_names = [n for n in names if n.startswith("decode")]
    for name, ids in zip(pre_names, route(requests, len(pre_names))):
        log = calls[name]
        prefills = [c for c in log if c[0] == "prefill"]
        wakes = idle_wakes(log, [requests[i].arrival_s for i in ids])
        sends = [c for c in log if c[0] == "send"]
        for k, (call, wake) in enumerate(zip(prefills, wakes)):
            idle = wake > 0
            # an idle call priced with the wake after a long idle (the closed loop's
            # 0.1 s measurement, whatever the stream's gap): the diagnostic's convention
            before, after = times.prefill_host_s(len(call[3]), math.inf if idle else 0.0)
            out["prefill_first"]["stream"].append(call[2] - call[1] + wake)
            out["prefill_first"]["loop"].append(engine + before)
            out["prefill_first"].setdefault("idle", []).append(idle)
            done = (call[4] - call[2] if len(call) == 5 else
                    sends[k][2] - sends[k][1] if k < len(sends) else None)
            if done is not None:
                out["prefill_after"]["stream"].append(done)
                out["prefill_after"]["loop"].append(after)
    step = times.decode_step_s(deployment.decode.batch, INPUT_LEN + OUTPUT_LEN / 2)
    for name in dec_names:
        for c in calls[name]:
            if c[0] == "step":
                out["decode_step"]["stream"].append(c[4] - c[1])
                out["decode_step"]["loop"].append(step)
            elif c[0] == "insert":
                out["handover_insert"]["stream"].append(c[2] - c[1])
                out["handover_insert"]["loop"].append(times.host_costs.handover_overhead_s)
    return {k: v for k, v in out.items() if v["stream"]}


def scaled_step_times(times, ratio: dict[str, float], prompts_per_call: float = 1.0):
    """The loop model's StepTimes with each kind of call scaled by `ratio` (stream over closed
    loop, `stream_calls`' kinds; 1 where absent): the engine's prefill, the host work before
    the first tokens and the idle wake by prefill_first; the host work after them by
    prefill_after (at the stream's mean prompts per call); the step by decode_step; the
    decode loop's handover charge by handover_insert."""
    first, after = ratio.get("prefill_first", 1.0), ratio.get("prefill_after", 1.0)
    step, insert = ratio.get("decode_step", 1.0), ratio.get("handover_insert", 1.0)
    engine = times.prefill_s(1, INPUT_LEN)
    step_s = times.decode_step_s(1, INPUT_LEN + OUTPUT_LEN / 2)
    host = times.host_costs
    before = host.prefill_first_overhead_s
    # per call after the first tokens: prompts x per-prompt - before -> scaled by `after`,
    # while `before` is scaled by `first`
    per_prompt = (after * host.prefill_overhead_per_prompt_s
                  + (first - after) * before / max(prompts_per_call, 1.0))
    host = dataclasses.replace(
        host, prefill_first_overhead_s=before * first, prefill_wake_s=host.prefill_wake_s * first,
        prefill_wake_short_s=host.prefill_wake_short_s * first,
        prefill_overhead_per_prompt_s=max(per_prompt, 0.0),
        prefill_idle_after_s=host.prefill_idle_after_s * after,
        handover_overhead_s=host.handover_overhead_s * insert)
    return dataclasses.replace(
        times, prefill_s=lambda b, n: engine * first, decode_step_s=lambda b, c: step_s * step,
        decode_affine=None, host_costs=host, source="serving loop, scaled")


def block_drift(detail: dict) -> dict[str, float]:
    """Within one closed-loop measurement: (max - min) / mean of its blocks' mean durations
    (prefill to first tokens, decode step): how much the loop's own calls move in seconds."""
    out = {}
    for kind, key in (("prefill_first", "loop_prefill_first_block_means_s"),
                      ("decode_step", "loop_step_block_means_s")):
        for part in detail.values():
            values = np.asarray(part.get(key) or [], dtype=float) if isinstance(part, dict) else []
            if len(values) > 1 and values.mean() > 0:
                out[kind] = float((values.max() - values.min()) / values.mean())
                break
    return out


def row_durations(row: dict, profile: Path, costs: dict | None = None) -> dict:
    """One stream's call durations against one closed-loop measurement (`costs`; default
    the row's own, `host_costs`): per kind the stream's and the loop model's mean and median
    and their ratio; the utilisation the loads assumed (rate / the closed loop's capacity) and
    the one the stream's calls imply (rate / the capacity at the scaled times); the loop
    model's TTFT p50 and p99 simulated again at the scaled times."""
    from sweeper.serving.overheads import with_deployment_overheads
    from workloads.serving.hostcosts import duration_spread
    from workloads.serving.model import capacity_rps, simulate

    costs = costs or row["host_costs"]
    d = with_deployment_overheads(deployment(row["deployment"], profile), costs)
    requests = stream(row["rate_rps"], row["requests"], row["seed"], row["deployment"])
    spread = duration_spread(costs)
    times = dataclasses.replace(loop_step_times(d, costs), prefill_spread=spread[0],
                                step_spread=spread[1])
    kinds = stream_calls(d, row["calls"], requests, costs)
    ratio = {k: float(np.sum(v["stream"]) / np.sum(v["loop"])) for k, v in kinds.items()
             if np.sum(v["loop"]) > 0}
    pre = [c for name, log in row["calls"].items() if not name.startswith("decode")
           for c in log if c[0] == "prefill"]
    prompts = float(np.mean([len(c[3]) for c in pre])) if pre else 1.0
    scaled = scaled_step_times(times, ratio, prompts)
    loop = simulate(d, requests, times).summary()
    again = simulate(d, requests, scaled).summary()
    # one kind at a time: how much of the change each kind's difference makes on its own
    alone = {k: simulate(d, requests, scaled_step_times(times, {k: ratio[k]}, prompts)).summary()
             for k in ratio}
    def split(v: dict, idle: bool) -> float | None:   # prefill calls after idle time or not
        pick = [i for i, x in enumerate(v.get("idle", [])) if x == idle]
        loop_s = sum(v["loop"][i] for i in pick)
        return sum(v["stream"][i] for i in pick) / loop_s if pick and loop_s > 0 else None

    return {"kinds": {k: {"stream_mean_s": float(np.mean(v["stream"])),
                          "stream_median_s": float(np.median(v["stream"])),
                          "loop_mean_s": float(np.mean(v["loop"])),
                          "loop_median_s": float(np.median(v["loop"])),
                          "calls": len(v["stream"]), "ratio": ratio.get(k),
                          **({"ratio_busy": split(v, False), "ratio_idle": split(v, True),
                              "idle_calls": int(sum(v["idle"]))} if "idle" in v else {})}
                      for k, v in kinds.items()},
            "utilisation_assumed": row["rate_rps"] / capacity_rps(d, times, INPUT_LEN, OUTPUT_LEN)["rps"],
            "utilisation_stream": row["rate_rps"] / capacity_rps(d, scaled, INPUT_LEN, OUTPUT_LEN)["rps"],
            "loop_model": {m: loop[m] for m in ("ttft_p50_s", "ttft_p99_s", "tpot_p50_s")},
            "scaled_loop_model": {m: again[m] for m in ("ttft_p50_s", "ttft_p99_s", "tpot_p50_s")},
            "scaled_alone": {k: {m: v[m] for m in ("ttft_p50_s", "tpot_p50_s")} for k, v in alone.items()},
            "block_drift": block_drift(costs["detail"])}


def _row_profile(row: dict, default: Path) -> Path:
    """The profile a row's predictions used: its own (`profile`, since merged partial runs)
    or its run's."""
    return common.ROOT / row["profile"] if row.get("profile") else default


def duration_analysis(r: dict, loads: tuple[float, ...] | None = None) -> list[dict]:
    """Per deployment at each of `loads` (default: every load of a results file's rows):
    `row_durations` per stream,
    then over the replicates: mean stream/closed-loop ratio and stream mean per kind, its
    replicate spread ((max - min) / mean of the streams' means), the utilisations, and the
    TTFT p50 errors of the loop model and of the loop model at the stream's durations (the
    difference: what the durations explain). Rows re-measured right before their stream
    (`host_costs_stream`, `--remeasure`) are analysed against that measurement too
    (`*_near`) and give the run-to-run drift: the closed loop before one stream vs the
    next."""
    profile = common.ROOT / r["profile"]
    out = []
    keys = sorted({(x["deployment"], x["load"]) for x in r["rows"]
                   if (loads is None or x["load"] in loads) and x.get("calls")},
                  key=lambda k: (list(DEPLOYMENTS).index(k[0]), k[1]))
    for name, load in keys:
        reps = [x for x in r["rows"] if (x["deployment"], x["load"]) == (name, load)]
        per = [row_durations(x, _row_profile(x, profile)) for x in reps]
        near = [row_durations(x, _row_profile(x, profile), x["host_costs_stream"]) for x in reps
                if x.get("host_costs_stream")]
        measured = np.array([x["measured"]["ttft_p50_s"] for x in reps])

        def kinds(results):
            out_ = {}
            for k in CALL_KINDS:
                have = [p["kinds"][k] for p in results if k in p["kinds"]]
                if not have:
                    continue
                means = np.array([h["stream_mean_s"] for h in have])
                out_[k] = {"stream_mean_s": float(means.mean()),
                           "stream_median_s": float(np.mean([h["stream_median_s"] for h in have])),
                           "loop_mean_s": float(np.mean([h["loop_mean_s"] for h in have])),
                           "ratio": float(np.mean([h["ratio"] for h in have if h["ratio"] is not None])),
                           "replicate_spread": float((means.max() - means.min()) / means.mean())
                           if len(means) > 1 and means.mean() > 0 else None,
                           "calls": int(sum(h["calls"] for h in have))}
                for part in ("busy", "idle"):    # prefill calls right after other work, after idle time
                    values = [h[f"ratio_{part}"] for h in have if h.get(f"ratio_{part}") is not None]
                    if values:
                        out_[k][f"ratio_{part}"] = float(np.mean(values))
                if any("idle_calls" in h for h in have):
                    out_[k]["idle_calls"] = int(sum(h.get("idle_calls", 0) for h in have))
            return out_

        tpot = np.array([x["measured"]["tpot_p50_s"] for x in reps])

        def errors(results, key, metric="ttft_p50_s"):
            base = measured if metric == "ttft_p50_s" else tpot
            return float(np.mean(np.array([p[key][metric] for p in results]) / base[:len(results)] - 1))

        def alone(metric):     # per kind: the loop model's error change at that kind's ratio alone
            base = measured if metric == "ttft_p50_s" else tpot
            return {k: float(np.mean([(p["loop_model"][metric] - p["scaled_alone"][k][metric]) / b
                                      for p, b in zip(per, base) if k in p["scaled_alone"]]))
                    for k in CALL_KINDS if any(k in p["scaled_alone"] for p in per)}

        entry = {"deployment": name, "load": load, "replicates": len(reps), "kinds": kinds(per),
                 "utilisation_assumed": float(np.mean([p["utilisation_assumed"] for p in per])),
                 "utilisation_stream": float(np.mean([p["utilisation_stream"] for p in per])),
                 "ttft_p50_error_loop": errors(per, "loop_model"),
                 "ttft_p50_error_scaled": errors(per, "scaled_loop_model"),
                 "ttft_p50_explained_by": alone("ttft_p50_s"),
                 "tpot_p50_error_loop": errors(per, "loop_model", "tpot_p50_s"),
                 "tpot_p50_error_scaled": errors(per, "scaled_loop_model", "tpot_p50_s"),
                 "tpot_p50_explained_by": alone("tpot_p50_s"),
                 "block_drift": per[0]["block_drift"]}
        if near:
            entry["kinds_near"] = kinds(near)
            entry["ttft_p50_error_loop_near"] = errors(near, "loop_model")
            # the closed loop right before one stream vs the one before the next (and the
            # deployment's first, before them all), per kind: max - min over their mean
            loops = {k: [p["kinds"][k]["loop_mean_s"] for p in [per[0]] + near if k in p["kinds"]]
                     for k in CALL_KINDS}
            entry["run_drift"] = {k: float((max(v) - min(v)) / np.mean(v)) for k, v in loops.items()
                                  if len(v) > 1 and np.mean(v) > 0}
        out.append(entry)
    return out


def summarize(groups_: list[dict]) -> dict:
    out = {}
    for stat in ("p50", "p99"):
        part = [g for g in groups_ if stat in g["metric"]]
        errs = np.array([abs(g["error"]) for g in part])
        warm = np.array([abs(g["error_warmup_model"]) for g in part])
        replay = np.array([abs(g.get("error_replay", np.nan)) for g in part])
        replay = replay[np.isfinite(replay)]
        spread = np.array([g["replicate_spread"] for g in part if g["replicate_spread"] is not None])
        out[stat] = {"cases": len(part), "target": TARGET[stat],
                     "within_target": int(sum(bool(g["within_target"]) for g in part)),
                     "median_abs_error": float(np.median(errs)) if len(errs) else None,
                     "warmup_within_target": int(sum(bool(g["warmup_within_target"]) for g in part)),
                     "warmup_median_abs_error": float(np.median(warm)) if len(warm) else None,
                     "replay_within_target": int(sum(replay <= TARGET[stat])) if len(replay) else None,
                     "replay_median_abs_error": float(np.median(replay)) if len(replay) else None,
                     "median_replicate_spread": float(np.median(spread)) if len(spread) else None}
    return out


def calibration_trial(calibration: dict, deployment_name: str, phase: str = "decode") -> dict | None:
    """The calibration trial of the deployment's decode (or prefill) shape: chips, batch and
    layout (`trials_measured`, recorded since the several-runs change; None before)."""
    _, prefill, decode = DEPLOYMENTS[deployment_name]
    part = decode if phase == "decode" else prefill
    for t in calibration.get("trials_measured") or []:
        if (t["chips"], t["batch"], t[f"{phase}_ffn"], t[f"{phase}_attn"]) == (
                part["chips"], part["batch"], part["ffn"], part["attn"]):
            return t
    return None


# ------------------------------------------------------------------ several runs (--runs N)
# One run's counts move with the host (load, hypervisor steal): the same code read 14/24 and
# 19/24 (p50) minutes apart. N whole runs, one after another, each with its own calibration
# and host costs, and per case the median error over the runs and how far the runs spread
# (docs/serving.md, "Validation on this host").


def over_runs(runs: list[dict]) -> dict:
    """Over N results of `run`: per run its within-target counts with its load and steal;
    per case (deployment, load, metric) the runs' errors, their median and spread (max - min,
    in error units), in how many runs it is within target, and the pooled error (the mean
    prediction over every run's replicates against the mean measurement over them); per
    statistic the counts of every run, their median, and the counts of the median errors."""
    per_run = []
    for i, r in enumerate(runs, 1):
        c, cal = r["context"], r["calibration"]
        per_run.append({"run": i, "time": c.get("time"),
                        "within_target": {k: v["within_target"] for k, v in r["summary"].items()},
                        "median_abs_error": {k: v["median_abs_error"] for k, v in r["summary"].items()},
                        "cases": {k: v["cases"] for k, v in r["summary"].items()},
                        "load_average_before": c.get("load_average_before"),
                        "load_average_after": c.get("load_average"),
                        "steal_pct": c.get("steal_pct"), "iowait_pct": c.get("iowait_pct"),
                        "calibration_load_average_before": cal.get("load_average_before"),
                        "calibration_steal_pct": cal.get("sweep_steal_pct"),
                        "profile": r.get("profile"), "wall_s": r.get("wall_s")})
    cases: dict[tuple, list] = {}
    for r in runs:
        for g in r["groups"]:
            cases.setdefault((g["deployment"], g["load"], g["metric"]), []).append(g)
    out_cases = []
    for (name, load, metric), gs in cases.items():
        errors = np.array([g["error"] for g in gs], dtype=float)
        median = float(np.median(errors))
        measured = float(np.mean([g["measured_mean_s"] for g in gs]))
        predicted = float(np.mean([g["predicted_mean_s"] for g in gs]))
        out_cases.append({"deployment": name, "load": load, "metric": metric, "runs": len(gs),
                          "target": gs[0]["target"], "errors": errors.tolist(),
                          "median_error": median,
                          "median_within_target": bool(abs(median) <= gs[0]["target"]),
                          "error_spread": float(errors.max() - errors.min()),
                          "runs_within_target": int(sum(bool(g["within_target"]) for g in gs)),
                          "pooled_error": predicted / measured - 1 if measured > 0 else None})
    summary = {}
    for stat in TARGET:
        part = [c for c in out_cases if stat in c["metric"]]
        counts = [p["within_target"][stat] for p in per_run]
        spreads = [r["summary"][stat]["median_replicate_spread"] for r in runs
                   if r["summary"][stat].get("median_replicate_spread") is not None]
        summary[stat] = {
            "cases": len(part), "target": TARGET[stat], "runs": len(runs),
            "within_target_runs": counts,
            # benchmarks/readme_numbers.py reads these keys: the median run, never the best
            "within_target": _median_count(counts),
            "median_abs_error": float(np.median([abs(c["median_error"]) for c in part])) if part else None,
            "median_replicate_spread": float(np.median(spreads)) if spreads else None,
            "median_error_within_target": int(sum(c["median_within_target"] for c in part)),
            "pooled_within_target": int(sum(c["pooled_error"] is not None
                                            and abs(c["pooled_error"]) <= TARGET[stat] for c in part)),
            "median_error_spread": float(np.median([c["error_spread"] for c in part])) if part else None}
    return {"per_run": per_run, "cases": out_cases, "summary": summary}


def _median_count(counts: list[int]) -> int | float | None:
    """The median of whole counts: a whole number where it is one (an odd number of runs)."""
    if not counts:
        return None
    median = float(np.median(counts))
    return int(median) if median.is_integer() else median


def runs_result(runs: list[dict], command: str, start: dict) -> dict:
    """The results file of several runs: each run's result as `run` returns it, the summary
    over them (`over_runs`; its `summary` where a single run's is), the whole window's
    context (its steal)."""
    over = over_runs(runs)
    return {"runs": runs, "over_runs": over, "summary": over["summary"], "command": command,
            "context": {**common.machine_context(since=start),
                        "load_average_before": start["load_average"]},
            "wall_s": sum(r["wall_s"] for r in runs), "model": MODEL, "target": TARGET}


DEFAULT_REQUESTS = 40
RAW_KEYS = ("calls", "detail")    # per-call logs and closed-loop blocks: NAME.raw.json.gz


def arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--requests", type=int, default=DEFAULT_REQUESTS, help="requests per stream")
    parser.add_argument("--profile", metavar="PROFILE.yaml",
                        help="skip the calibration: use this fitted profile (a quick check; the "
                             "results say so)")
    parser.add_argument("--keep-calibration", metavar="DIR",
                        help="run the calibration sweep with SWEEPER_HOME=DIR and keep it (its "
                             "study, MLflow runs and host profile), for inspecting the fit "
                             "(with --runs N > 1: DIR/run1 ... DIR/runN)")
    parser.add_argument("--deployments", metavar="NAME,...",
                        help="only these deployments (default all: " + ",".join(DEPLOYMENTS) + "); "
                        "a subset MERGES into the results file in --out (its cells replace theirs, "
                        "the others stay; predicted with that file's profiles unless --profile; "
                        "as many --runs and --requests as it has); with no file there, --out is "
                        "required")
    parser.add_argument("--loads", metavar="FRACTION,...",
                        help="only these loads, fractions of capacity (default "
                             + ",".join(str(x) for x in LOADS) + "); merges as --deployments")
    parser.add_argument("--remeasure", action="store_true",
                        help="also measure the host costs right before each stream (a diagnostic: "
                             "the stream's calls against a closed loop seconds before them)")
    parser.add_argument("--runs", type=int, default=1, metavar="N",
                        help="N whole runs one after another, each with its own calibration and "
                             "host costs; the results add the summary over the runs (default 1)")


def _bad(flag: str, message: str) -> SystemExit:
    print(f"serving_validation: {flag}: {message}", file=sys.stderr)
    return SystemExit(2)


def checked(args: argparse.Namespace, argv_out_given: bool, previous: dict | None = None
            ) -> tuple[list[str] | None, list[float] | None]:
    """--deployments and --loads as lists (None: all), after checking every flag: bad input
    is one line and exit 2, before any measurement. `previous`: the results file in --out,
    which a partial run merges into (`merge_run`): it must be of the same protocol, as many
    runs and requests per stream, and its profiles at hand."""
    names = loads = None
    if args.deployments:
        names = [n.strip() for n in args.deployments.split(",") if n.strip()]
        unknown = [n for n in names if n not in DEPLOYMENTS]
        if unknown or not names:
            raise _bad("--deployments", f"{','.join(unknown) or repr(args.deployments)} unknown; "
                       f"accepted: {','.join(DEPLOYMENTS)}")
    if args.loads:
        try:
            loads = [float(x) for x in args.loads.split(",") if x.strip()]
        except ValueError:
            loads = []
        if not loads or not all(0 < x <= 1.5 for x in loads):
            raise _bad("--loads", f"{args.loads!r} is not a list of fractions of capacity in "
                       "(0, 1.5], e.g. 0.35,0.85")
    if args.runs < 1:
        raise _bad("--runs", f"{args.runs} is not a number of runs; accepted: an integer >= 1")
    if (names or loads) and previous is not None:
        _check_merge(args, previous)
    elif (names or loads) and not argv_out_given:
        raise _bad("--out", "required with --deployments or --loads where there is no results "
                   f"file to merge into (a subset must not replace the full set in {common.RESULTS})")
    return names, loads


def _previous_runs(previous: dict) -> list[dict]:
    """A results file's runs: its `runs` (several), or itself (one)."""
    return previous["runs"] if "runs" in previous else [previous]


def _check_merge(args: argparse.Namespace, previous: dict) -> None:
    """A partial run merges into `previous` (one line and exit 2 where it cannot)."""
    where = Path(args.out) / f"{NAME}.json"
    runs = _previous_runs(previous)
    if len(runs) != args.runs:
        raise _bad("--runs", f"{args.runs}; {where} holds {len(runs)} run(s) and a partial run "
                   f"(--deployments/--loads) merges into each: accepted --runs {len(runs)} "
                   "(or another --out)")
    for r in runs:
        protocol = (r.get("model"), r.get("input_len"), r.get("output_len"))
        if protocol != (MODEL, INPUT_LEN, OUTPUT_LEN):
            raise _bad("--out", f"{where} holds another protocol (model, prompt, answer "
                       f"{protocol}); accepted: a results file of {(MODEL, INPUT_LEN, OUTPUT_LEN)} "
                       "to merge into, or another --out")
        served = sorted({x["requests"] for x in r["rows"]})
        if served and served != [args.requests]:
            raise _bad("--requests", f"{args.requests}; the streams in {where} have "
                       f"{','.join(map(str, served))} requests each: accepted "
                       f"--requests {served[0]} to merge into it (or another --out)")
        if not args.profile and not (common.ROOT / r["profile"]).is_file():
            raise _bad("--profile", f"none given, and the profile {r['profile']} that {where}'s "
                       "run was predicted with is missing: accepted a fitted profile file")


def _calibration(args: argparse.Namespace, out: Path, i: int, merging: dict | None = None) -> dict:
    """Run i's calibration: its own sweep and fit, or the given profile; `merging` (the run
    of the results file a partial run merges into): that run's fitted profile, so the new
    cells are predicted as the cells beside them (no sweep, no fit, no fitted file
    overwritten under rows that stay)."""
    if merging is not None and not args.profile:
        return {**merging["calibration"], "used": merging["profile"],
                "why": "the calibration of the results file this partial run merges into "
                       f"(run {i}): {merging['calibration'].get('why', '')}"}
    if args.profile:
        path = Path(args.profile).resolve()
        return {"used": str(path.relative_to(common.ROOT)) if path.is_relative_to(common.ROOT)
                else str(path), "why": "given with --profile: no calibration this run",
                "space": CALIBRATION_SPACE, "sweep_wall_s": 0.0,
                "load_average_before": common.load_average(),
                "load_average_after_sweep": common.load_average()}
    # each run's own fit: run 1's where a single run writes it, run i's beside it
    fitted = out.resolve() / (FITTED_PROFILE.name if i == 1 else
                              FITTED_PROFILE.name.replace(".fitted.", f".fitted.run{i}."))
    keep = Path(args.keep_calibration).resolve() if args.keep_calibration else None
    return calibrate(keep if keep is None or args.runs == 1 else keep / f"run{i}", fitted)


def run_all(args: argparse.Namespace, previous: dict | None) -> dict:
    """`--runs` whole runs, one after another; the results file is written after each. A
    partial run (`--deployments`, `--loads`) into a folder with a results file MERGES into
    it (`merge_run`, run i into its run i): the cells it serves replace theirs, the others
    stay."""
    names, loads = checked(args, args.out != str(common.RESULTS), previous)
    merging = _previous_runs(previous) if (names or loads) and previous is not None else None
    out = Path(args.out)
    start, runs, result = common.machine_context(), [], {}
    for i in range(1, args.runs + 1):
        calibration = _calibration(args, out, i, merging[i - 1] if merging else None)
        print(f"calibration{f' (run {i} of {args.runs})' if args.runs > 1 else ''}: "
              f"{calibration['used']} ({calibration['why']}); held-out MAPE "
              f"{calibration.get('heldout_mape')}, terms {calibration.get('terms')}", flush=True)
        runs.append(run(args.requests, calibration, names, loads, args.remeasure))
        if merging:
            result = merged_result(previous, runs, args.runs)
        else:
            result = runs[0] if args.runs == 1 else \
                runs_result(runs, runs[0]["command"] + f" --runs {args.runs}", start)
        if 1 < len(runs) < args.runs:
            s = runs[-1]["summary"]
            print(f"run {i} of {args.runs}: p50 within target in {s['p50']['within_target']}/"
                  f"{s['p50']['cases']}, p99 in {s['p99']['within_target']}/{s['p99']['cases']}", flush=True)
        harness.write_json(NAME, result, out, RAW_KEYS)   # the numbers first: nothing is lost
    return result


def merge_run(previous: dict, new: dict) -> dict:
    """A partial run `new` (some deployments, some loads) merged into `previous` (a run of
    the same protocol): previous rows of every (deployment, load) the new run did not serve
    stay, with the profile they were predicted with; the new run's rows replace the rest.
    Groups, summary, steps, loads and features are computed again over the merged rows; the
    previous run's command, calibration and context stay, the new run's are listed under
    `merged` (each partial run merged so far)."""
    served = {(r["deployment"], r["load"]) for r in new["rows"]}
    kept = [{**r, "profile": r.get("profile") or previous["profile"]} for r in previous["rows"]
            if (r["deployment"], r["load"]) not in served]
    order = list(DEPLOYMENTS)
    rows = sorted(kept + new["rows"], key=lambda r: (order.index(r["deployment"]), r["load"],
                                                      r["seed"]))
    names = [n for n in order if any(r["deployment"] == n for r in rows)]
    part = {"command": new["command"], "deployments": [n for n in order
                                                       if any(d == n for d, _ in served)],
            "loads": new["loads"], "profile": new["profile"], "time": new["context"].get("time"),
            "context": new["context"], "wall_s": new["wall_s"]}
    return {**previous, "rows": rows, "groups": groups(rows), "summary": summarize(groups(rows)),
            "steps": deployment_steps(rows), "loads": sorted({r["load"] for r in rows}),
            "features": {k: v for k, v in features().items() if k in names},
            "merged": list(previous.get("merged", [])) + [part],
            "wall_s": previous["wall_s"] + new["wall_s"]}


def merged_result(previous: dict, runs: list[dict], n_runs: int) -> dict:
    """The results file after a partial run's runs so far: each merged into the previous
    file's run of the same number (the later ones as they were); several runs: the summary
    over them again, the previous file's command and context, its `merged` list grown."""
    before = _previous_runs(previous)
    merged = [merge_run(p, r) for p, r in zip(before, runs)] + before[len(runs):]
    if "runs" not in previous:
        return merged[0]
    over = over_runs(merged)
    part = {"command": runs[0]["command"] + f" --runs {n_runs}",
            "time": runs[0]["context"].get("time"), "runs_merged": len(runs)}
    return {**previous, "runs": merged, "over_runs": over, "summary": over["summary"],
            "wall_s": sum(r["wall_s"] for r in merged),
            "merged": list(previous.get("merged", [])) + [part]}


def analyse(result: dict, args: argparse.Namespace | None = None) -> dict:
    """What the misses are made of (`duration_analysis`), per run: it simulates the streams
    again on their own call logs, so it is computed once here and rendered from the file."""
    def one(r: dict) -> dict:
        if not (common.ROOT / r["profile"]).exists():    # the deployments' profile
            return r
        return {**r, "durations": common.clean(duration_analysis(r))}

    return {**result, "runs": [one(r) for r in result["runs"]]} if "runs" in result else one(result)


BENCHMARK = harness.Benchmark(NAME, __doc__.splitlines()[0], run_all, arguments=arguments,
                              analyse=analyse, raw_keys=RAW_KEYS)


if __name__ == "__main__":
    sys.exit(harness.main(BENCHMARK))
