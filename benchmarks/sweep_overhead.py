"""Benchmark: what does orchestration cost per trial, against Ray Tune doing the same?

    python -m benchmarks.sweep_overhead [--trials 50] [--no-quickstart] [--out DIR]

Overhead per trial = (sweep wall time - sum of trial run times) / trials, for `trials` trials
of a tiny workload (the `tiny` model, 1 chip, 8-token prompt, 2 decode steps, 1 timed
repeat: ~10 ms a trial once compiled), run one after the other in this process:

- `sweeper run` (`sweeper.sweep.controller.run_sweep`): Optuna TPE over a Ray actor that keeps
  its mesh and compile cache, Optuna SQLite storage, an MLflow child run per trial;
- Ray Tune: `Tuner` + `OptunaSearch` (TPE, same seed) + `MLflowLoggerCallback`, the same
  parameter space, `reuse_actors=True` (Tune's fastest setting for this), and as trainable
  the same trial function: `workloads.measure.run_trial` with an engine cache kept by the
  process (so Tune's reused actor also compiles each shape once).

Both start from Ray not running (Ray start-up is part of both), run one trial at a time
(the formula assumes serial trials) and get the same host share for MFU. A trial's run
time is the wall time of its `run_trial` call on the worker (compile included, when a
shape is new). Then the shipped quickstart (`sweeper run search_spaces/quickstart.yaml`, 20
trials, 2 workers) is run once, timed end to end; its compile-cache hit rate is reported,
and its study is what `benchmarks.calibration` then fits (run_all passes it on). Target:
sweeper overhead <= Ray Tune's, and overhead x quickstart trials < 5% of the quickstart's
wall time.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import common

NAME = "sweep_overhead"
TARGET_QUICKSTART_SHARE = 0.05
OBJECTIVES = [{"metric": "decode_step_s", "direction": "minimize"},
              {"metric": "decode_cost_chip_s_per_token", "direction": "minimize"}]
TINY_SPACE = {
    "name": "bench-overhead", "model": "tiny", "hardware": "host", "chips": 1,
    "input_len": 8, "decode_steps": 2, "repeats": 1, "warmup": 0,
    "params": {"batch": [1, 2, 4, 8], "decode_ffn": ["ws1d", "ws2d"]},
    "objectives": OBJECTIVES, "sampler": {"type": "tpe", "seed": 0},
    "trials": 50, "parallel": 1, "timeout_s": 240, "memory_budget_bytes": "1GiB",
}

# ----------------------------------------------------------------------------- the trial


_ENGINE_CACHE: dict = {}     # per process: what a sweeper worker actor keeps too
_SPACE = None


def tiny_trial(params: dict, hardware: dict) -> dict:
    """The trial function both frameworks run: a point of TINY_SPACE through run_trial."""
    global _SPACE
    from sweeper.sweep.space import load_space
    from workloads.measure import run_trial

    if _SPACE is None:
        _SPACE = load_space(dict(TINY_SPACE), source="benchmarks/sweep_overhead.py")
    config = _SPACE.trial_config(params)
    started = time.time()
    m = run_trial(config, engine_cache=_ENGINE_CACHE, hardware=hardware)
    finished = time.time()
    metrics = {k: v for k, v in m.metrics().items() if k in ("decode_step_s", "decode_cost_chip_s_per_token",
                                                              "prefill_s", "compile_s")}
    metrics.update(trial_run_s=finished - started, started=started, finished=finished,
                   cache_hit=float(bool(m.extra.get("compile_cache_hit"))))
    return metrics


def _tune_trainable(config: dict, hardware: dict) -> None:
    from ray import tune

    tune.report(tiny_trial(config, hardware))


# ----------------------------------------------------------------------------- the frameworks


def run_sweeper(trials: int, storage: str, tracking_uri: str) -> dict:
    """`sweeper run` on TINY_SPACE: wall time of the whole call and its trials' run times."""
    from sweeper.sweep.controller import run_sweep
    from sweeper.sweep.space import load_space

    space = load_space(dict(TINY_SPACE, trials=trials), source="benchmarks/sweep_overhead.py")
    start_wall = time.time()
    start = time.perf_counter()
    result = run_sweep(space, storage=storage, tracking_uri=tracking_uri, progress=False)
    wall = time.perf_counter() - start
    times = common.trial_run_times(result.study)
    runs = [finished - started for started, finished, _ in times]
    hits = sum(hit for *_, hit in times)
    first_start = min((started for started, *_ in times), default=None)
    return {"framework": "sweeper run", "wall_s": wall, "trials": len(runs),
            "counts": result.counts, "trial_run_s_sum": sum(runs),
            "overhead_per_trial_s": (wall - sum(runs)) / max(len(runs), 1),
            "until_first_trial_s": (first_start - start_wall) if first_start else None,
            "cache_hit_rate": hits / max(len(runs), 1), "study": result.study_name}


def run_tune(trials: int, tracking_uri: str, hardware: dict, workdir: str) -> dict:
    """Ray Tune on the same space and trial function (Tuner + OptunaSearch + MLflow)."""
    import ray
    from optuna.samplers import TPESampler
    from ray import tune
    from ray.air.integrations.mlflow import MLflowLoggerCallback
    from ray.tune.search.optuna import OptunaSearch

    from sweeper.sweep.space import load_space

    space = load_space(dict(TINY_SPACE), source="benchmarks/sweep_overhead.py")
    search = OptunaSearch(space=space.distributions(), metric=space.metric_names,
                          mode=["min" if d == "minimize" else "max" for d in space.directions],
                          sampler=TPESampler(seed=0))
    tuner = tune.Tuner(
        tune.with_parameters(_tune_trainable, hardware=hardware),
        tune_config=tune.TuneConfig(search_alg=search, num_samples=trials, max_concurrent_trials=1,
                                    reuse_actors=True),
        run_config=tune.RunConfig(name="bench-overhead-tune", storage_path=workdir, verbose=0,
                                  callbacks=[MLflowLoggerCallback(
                                      tracking_uri=tracking_uri,
                                      experiment_name="sweeper/bench-overhead (ray tune)")]))
    start_wall = time.time()
    start = time.perf_counter()
    # What run_sweep does too: start Ray, with this project importable by its workers.
    root = str(Path(__file__).resolve().parents[1])
    ray.init(include_dashboard=False, log_to_driver=False, logging_level=logging.WARNING,
             runtime_env={"env_vars": {"PYTHONPATH": root}})
    grid = tuner.fit()
    wall = time.perf_counter() - start
    frame = grid.get_dataframe()
    ray.shutdown()
    runs = frame["trial_run_s"].dropna().tolist() if "trial_run_s" in frame else []
    hits = frame["cache_hit"].fillna(0).sum() if "cache_hit" in frame else 0
    first = float(frame["started"].min()) - start_wall if "started" in frame and len(frame) else None
    return {"framework": "ray tune (Tuner + OptunaSearch + MLflowLoggerCallback)", "wall_s": wall,
            "trials": len(runs), "errors": int(grid.num_errors), "trial_run_s_sum": float(sum(runs)),
            "overhead_per_trial_s": (wall - sum(runs)) / max(len(runs), 1),
            "until_first_trial_s": first,
            "cache_hit_rate": float(hits) / max(len(runs), 1), "reuse_actors": True}


def run_quickstart(storage: str, tracking_uri: str) -> dict:
    """The shipped quickstart, timed end to end (Ray start-up included)."""
    from sweeper.sweep.controller import run_sweep

    start = time.perf_counter()
    result = run_sweep(str(Path(__file__).resolve().parents[1] / "search_spaces" / "quickstart.yaml"),
                       storage=storage, tracking_uri=tracking_uri, progress=False)
    wall = time.perf_counter() - start
    return {"study": result.study_name, "storage": storage, "counts": result.counts,
            "trials": sum(result.counts.values()),
            **common.orchestration(result.study, wall, parallel=2)}


def _host_hardware() -> dict:
    """What a parallel-1 sweeper worker gets: the whole host profile (its share = all cores)."""
    from workloads.hostprofile import host_profile

    return host_profile().to_dict()


def summarize(sweeper: dict, tune: dict | None, quick: dict | None) -> dict:
    for run in (sweeper, tune):
        if run and run.get("until_first_trial_s") is not None and run["trials"]:
            # per trial once the first trial has started (start-up taken out)
            run["steady_overhead_per_trial_s"] = (run["wall_s"] - run["until_first_trial_s"]
                                                  - run["trial_run_s_sum"]) / run["trials"]
    out = {"sweeper": sweeper, "tune": tune, "quickstart": quick,
           "targets": {"sweeper_overhead_le_tune": True,
                       "quickstart_overhead_share_max": TARGET_QUICKSTART_SHARE}}
    if tune:
        out["sweeper_over_tune"] = sweeper["overhead_per_trial_s"] / tune["overhead_per_trial_s"]
        out["meets_tune_target"] = sweeper["overhead_per_trial_s"] <= tune["overhead_per_trial_s"]
    if quick:
        share = sweeper["overhead_per_trial_s"] * quick["trials"] / quick["wall_s"]
        out["quickstart_overhead_share"] = share
        out["meets_quickstart_target"] = share < TARGET_QUICKSTART_SHARE
    return out


def markdown(r: dict) -> str:
    s, t, q = r["sweeper"], r["tune"], r["quickstart"]
    def row(run: dict) -> list:
        first = run.get("until_first_trial_s")
        steady = run.get("steady_overhead_per_trial_s")
        return [run["framework"], run["trials"], f"{run['wall_s']:.1f} s", f"{run['trial_run_s_sum']:.1f} s",
                f"**{run['overhead_per_trial_s'] * 1e3:.0f} ms**",
                "—" if first is None else f"{first:.1f} s",
                "—" if steady is None else f"{steady * 1e3:.0f} ms", common.pct(run["cache_hit_rate"])]

    rows = [row(s)] + ([row(t)] if t else [])
    lines = [
        "# Sweep overhead: orchestration time per trial, sweeper against Ray Tune",
        "",
        f"{s['trials']} trials of a tiny workload (`tiny` model, 1 chip, prompt 8, 2 decode steps), "
        "one at a time, same TPE seed, same trial function (`run_trial` with a per-process "
        "engine cache), Ray start-up included in both. Measured on this host; load average "
        f"{r['context']['load_average']} at the start, {r['context_end']['load_average']} at the "
        f"end. Took {r['elapsed_s']:.0f} s.",
        "",
        *common.table(["framework", "trials", "wall", "sum of trial run times",
                       "overhead per trial", "start-up (until the first trial runs)",
                       "overhead per trial after start-up", "compile-cache hits"], rows),
        "",
    ]
    if t:
        lines.append(f"- sweeper overhead / Ray Tune overhead: {r['sweeper_over_tune']:.2f} "
                     f"(target <= 1: {common.met(r['meets_tune_target'])})")
    if s.get("until_first_trial_s") is not None:
        lines.append("- start-up = from the call until the first trial's `run_trial` begins: Ray "
                     "start-up, the worker process and its imports (JAX), in both")
    if q:
        lines += [
            f"- quickstart (`sweeper run search_spaces/quickstart.yaml`): {q['wall_s']:.1f} s end to end, "
            f"{q['counts']}; compile-cache hit rate **{common.pct(q['compile_cache_hit_rate'])}** "
            f"({q['compile_cache_hits']} of {q['ran']} trials reused a compiled shape); study `{q['study']}`",
            f"- sweeper overhead per trial x {q['trials']} quickstart trials = "
            f"{common.pct(r['quickstart_overhead_share'])} of the quickstart's wall time (target < "
            f"{common.pct(TARGET_QUICKSTART_SHARE, 0)}: {common.met(r['meets_quickstart_target'])})",
            f"- measured directly in the quickstart: {common.pct(q['orchestration_share'])} of its "
            f"{q['parallel']} slots' time was outside trials (start-up of Ray and of one worker per "
            "chip count with its JAX import, Optuna, MLflow, and the slots idle while the last "
            "trial ran)",
        ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=50)
    parser.add_argument("--no-tune", action="store_true")
    parser.add_argument("--no-quickstart", action="store_true")
    parser.add_argument("--out", default=str(common.RESULTS))
    parser.add_argument("--storage")
    parser.add_argument("--tracking-uri")
    args = parser.parse_args(argv)
    import optuna

    from sweeper import paths

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    logging.getLogger("ray").setLevel(logging.WARNING)
    storage = args.storage or paths.default_storage()
    tracking = args.tracking_uri or paths.default_tracking_uri()
    start = time.perf_counter()
    context = common.machine_context()
    hardware = _host_hardware()
    print(f"sweep overhead: sweeper run, {args.trials} trials", file=sys.stderr)
    sweeper = run_sweeper(args.trials, storage, tracking)
    tune = None
    if not args.no_tune:
        print(f"sweep overhead: ray tune, {args.trials} trials", file=sys.stderr)
        with tempfile.TemporaryDirectory() as workdir:
            tune = run_tune(args.trials, tracking, hardware, workdir)
    quick = None
    if not args.no_quickstart:
        print("sweep overhead: the quickstart", file=sys.stderr)
        quick = run_quickstart(storage, tracking)
    result = summarize(sweeper, tune, quick)
    result.update(context=context, context_end=common.machine_context(),
                  elapsed_s=time.perf_counter() - start)
    text = markdown(result)
    files = common.write(NAME, result, text, Path(args.out))
    metrics = {"sweeper_overhead_per_trial_s": sweeper["overhead_per_trial_s"]}
    if tune:
        metrics["tune_overhead_per_trial_s"] = tune["overhead_per_trial_s"]
    if quick:
        metrics.update(quickstart_wall_s=quick["wall_s"],
                       quickstart_cache_hit_rate=quick["compile_cache_hit_rate"],
                       quickstart_overhead_share=result["quickstart_overhead_share"])
    common.log_mlflow(NAME, metrics, {"trials": args.trials, "load_average": context["load_average"]},
                      list(files))
    print(text)
    print(json.dumps({"quickstart_study": quick["study"] if quick else None}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
