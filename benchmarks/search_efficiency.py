"""Benchmark: how many trials does each sampler need to find the Pareto frontier?

    python -m benchmarks.search_efficiency [--seeds N] [--samplers random,tpe,...] [--out DIR]

The grid (issue 14): the RECORDED calibration sweep (`benchmarks/data/calibration-trials.csv`,
real measurements of `search_spaces/calibration.yaml` on this host, where layouts genuinely
differ), replayed: every sampler is told the numbers of that one measurement, so all samplers
are compared on the same values, not on timing noise. The seed parameter is not searched: the
grid is the space without it, and the trials of one seed (`--score-seed`, default 1) are the
values scored. `guided+fit` seeds from a profile fitted to the OTHER seed's trials (another
measurement, never scored). `--spaces analytical` adds the PaLM 540B grid on the analytical
TPU v4 profile (there the cost model is the ground truth and guided's seeds are its frontier
by construction: a check of recommend-and-seed, not of prediction).

Accounting, as the controller dispatches: a point that is infeasible (PRUNED) or was not
measured is told PRUNED and not charged; a point already evaluated is told its value again
and not charged (draws without replacement). Each sampler runs over >= 10 seeds; the result
is the median and spread (min, max) of the trials charged until the evaluated points reach
95% of the grid's hypervolume (log10 of both objectives, reference 1.1 x the worst value; the
linear count, `sweeper pareto`'s convention, is beside it). A run that has not reached it when
every dispatchable point is evaluated, or after 50 x the grid's size in asks, is censored.
Target (issue 7): guided <= 20% of the grid's dispatchable points and fewer than every plain
sampler.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import itertools
import sys
import time
from pathlib import Path

import numpy as np
import yaml

from benchmarks import common, harness

NAME = "search_efficiency"
TARGET_FRACTION = 0.95
TARGET_GUIDED_SHARE = 0.20
SAMPLERS = ("random", "tpe", "nsga2", "gp", "guided")
# name -> (sampler type, options); `guided+fit` is added when a study to calibrate on is given
SAMPLER_VARIANTS: dict[str, tuple[str, dict]] = {}
ROOT = Path(__file__).resolve().parents[1]
RECORDED = ROOT / "benchmarks" / "data" / "calibration-trials.csv"
RECORDED_BASE = ROOT / "benchmarks" / "data" / "calibration-host.yaml"
CALIBRATION_SPACE = ROOT / "search_spaces" / "calibration.yaml"
MAX_ASKS_PER_POINT = 50


def analytical_space() -> dict:
    """paper-540b.yaml with the batch range written out, so every sampler sees the grid."""
    data = yaml.safe_load((ROOT / "search_spaces" / "paper-540b.yaml").read_text())
    data["params"]["batch"] = [2**i for i in range(11)]
    data["name"] = "bench-search-540b"
    return data


def host_space() -> dict:
    return {
        "name": "bench-search-host", "model": "tiny", "hardware": "host",
        "input_len": 32, "decode_steps": 8, "repeats": 3, "warmup": 1,
        "prefill": {"ffn": "ws2d", "attn": "head"},
        "params": {"batch": [4, 8, 16], "chips": [1, 2, 4], "decode_ffn": ["ws1d", "ws2d"],
                   "decode_attn": ["head", "batch"]},
        "objectives": [{"metric": "decode_step_s", "direction": "minimize"},
                       {"metric": "decode_cost_chip_s_per_token", "direction": "minimize"}],
        "sampler": {"type": "grid", "seed": 0}, "trials": 36, "parallel": 2,
        "timeout_s": 240, "memory_budget_bytes": "1GiB",
    }


def _key(params: dict) -> tuple:
    return tuple(sorted(params.items()))


class Grid:
    """Every point of a space: key -> (state, objective values or None)."""

    def __init__(self, space, table: dict, source: str, extra: dict | None = None):
        from sweeper.analysis.pareto import hypervolume

        self.space, self.table, self.source = space, table, source
        self.extra = extra or {}
        points = np.array([v for state, v in table.values() if state == "COMPLETE"], float)
        self.points = points
        # linear: the project's convention (`sweeper pareto`: reference 1.1 x the worst value)
        self.reference = tuple(float(x) for x in points.max(axis=0) * 1.1)
        self.hv = hypervolume(points, self.reference)
        # log10 of both objectives (Figure 1's axes are log-log; the latencies and costs span
        # decades): the same reference, scaled the same way
        self.log_reference = tuple(float(x) for x in np.log10(self.reference))
        self.hv_log = hypervolume(np.log10(points), self.log_reference)

    def fractions(self, found: list) -> tuple[float, float]:
        """(log, linear) hypervolume of `found` as a fraction of the whole grid's."""
        from sweeper.analysis.pareto import hypervolume

        if not found:
            return 0.0, 0.0
        pts = np.asarray(found, float)
        return (hypervolume(np.log10(pts), self.log_reference) / self.hv_log,
                hypervolume(pts, self.reference) / self.hv)

    @property
    def size(self) -> int:
        return len(self.table)

    @property
    def dispatchable(self) -> int:
        """Points the controller would run: not infeasible, and measured."""
        return int(sum(s not in ("PRUNED", "MISSING") for s, _ in self.table.values()))

    def summary(self) -> dict:
        return {"source": self.source, "points": self.size,
                "complete": int(sum(s == "COMPLETE" for s, _ in self.table.values())),
                "pruned": int(sum(s in ("PRUNED", "MISSING") for s, _ in self.table.values())),
                "missing": int(sum(s == "MISSING" for s, _ in self.table.values())),
                "failed": int(sum(s == "FAIL" for s, _ in self.table.values())),
                "hypervolume": self.hv, "reference": list(self.reference),
                "hypervolume_log10": self.hv_log, "reference_log10": list(self.log_reference),
                "pareto_points": int(non_dominated_count(self.points)),
                "pareto_configurations": int(non_dominated_count(np.unique(self.points, axis=0))),
                **self.extra}


def non_dominated_count(points: np.ndarray) -> int:
    from sweeper.analysis.pareto import non_dominated_mask

    return int(non_dominated_mask(points[:, 0], points[:, 1]).sum())


def _space(data: dict, source: str):
    from sweeper.spec.space import load_space

    return load_space(copy.deepcopy(data), source=source)


def analytical_grid(data: dict) -> Grid:
    """Evaluate every point with the cost model, as the controller would (prune, predict)."""
    from workloads.config import ConfigError
    from workloads.costmodel import feasibility, predict

    space = _space(data, str(ROOT / "search_spaces" / "paper-540b.yaml"))
    profile = space.hardware.load_profile(space.source)
    grid = space.grid()
    table = {}
    for combo in itertools.product(*grid.values()):
        params = dict(zip(grid, combo))
        try:
            config = space.trial_config(params)
            if feasibility(config, profile):
                table[_key(params)] = ("PRUNED", None)
                continue
            metrics = predict(config, profile).metrics()
        except ConfigError:
            table[_key(params)] = ("PRUNED", None)
            continue
        table[_key(params)] = ("COMPLETE", [metrics[m] for m in space.metric_names])
    return Grid(space, table, "analytical (cost model, tpu-v4)")


def measured_grid(data: dict, storage: str, tracking_uri: str, study_name: str | None = None) -> Grid:
    """Measure every point once with a grid sweep on this host (or reuse the finished grid
    study `study_name`); the table is its results."""
    import optuna

    from sweeper.sweep.controller import run_sweep

    grid_space = _space(data, str(ROOT / "search_spaces" / "quickstart.yaml"))
    start = time.perf_counter()
    if study_name:
        study = optuna.load_study(study_name=study_name, storage=storage)
    else:
        result = run_sweep(grid_space, storage=storage, tracking_uri=tracking_uri, progress=False)
        study, study_name = result.study, result.study_name
    elapsed = time.perf_counter() - start
    table = {}
    for t in study.get_trials(deepcopy=False):
        state = t.state.name
        table[_key(t.params)] = (state, list(t.values) if state == "COMPLETE" else None)
    expected = grid_space.grid_size()
    if len(table) != expected:
        raise RuntimeError(f"grid sweep measured {len(table)} of {expected} points")
    table, groups = merge_equivalent(grid_space, table)
    replay = dict(data, sampler={"type": "tpe", "seed": 0})
    return Grid(_space(replay, grid_space.source), table, "measured on this host (emulated mesh)",
                {"study": study_name, "measure_s": elapsed, "configurations": groups,
                 "load_average": common.load_average()})


def recorded_space() -> dict:
    """The calibration space without its replicate parameter (seed), replayed with TPE."""
    data = yaml.safe_load(CALIBRATION_SPACE.read_text())
    data["params"] = {k: v for k, v in data["params"].items() if k != "seed"}
    data["name"] = "bench-search-recorded"
    # `host`, as the sweep ran: the cost model gives each trial's chips their share of the
    # host (a worker's cores split over the chips). `devices:<profile>` would give every
    # virtual chip the whole host and predict 8 chips 8x too fast. The guided variants
    # predict with the profile the sweep predicted with (`guided_hardware`, recorded_grid).
    data["hardware"] = "host"
    return data


def recorded_grid(data: dict, csv: Path, score_seed: int) -> Grid:
    """Every point of the space: the recorded trial of seed `score_seed` (COMPLETE with its
    objective values, PRUNED), or MISSING when the sweep did not measure it."""
    import pandas as pd

    space = _space(data, str(CALIBRATION_SPACE))
    frame = pd.read_csv(csv)
    frame = frame[frame["seed"] == score_seed]
    names = [p.name for p in space.params]
    flat = {"attn": "prefill_attn", "ffn": "prefill_ffn"}      # joint params -> a column
    table = {}
    for _, row in frame.iterrows():
        params = {n: _cast(row[flat.get(n, n)], space, n) for n in names}
        state = str(row["state"]).upper()
        values = [float(row[m]) for m in space.metric_names] if state == "COMPLETE" else None
        if state in ("RUNNING", "WAITING"):
            continue                     # the sweep was stopped before it finished: unmeasured
        table[_key(params)] = (state if state in ("COMPLETE", "PRUNED") else "FAIL", values)
    grid = space.grid()
    missing = 0
    for combo in itertools.product(*grid.values()):
        key = _key(dict(zip(grid, combo)))
        if key not in table:
            table[key] = ("MISSING", None)
            missing += 1
    table, groups = merge_equivalent(space, table)
    return Grid(space, table, f"recorded on this host (`{csv.name}`, seed {score_seed})",
                {"csv": str(csv.relative_to(ROOT)), "score_seed": score_seed,
                 "guided_hardware": str(RECORDED_BASE),
                 "unmeasured_before_merge": missing, "configurations": groups})


def _cast(value, space, name: str):
    param = next(p for p in space.params if p.name == name)
    for choice in param.grid_values():
        if str(choice) == str(value) or (isinstance(choice, (int, float)) and not isinstance(choice, bool)
                                         and isinstance(value, (int, float)) and choice == value):
            return choice
    raise ValueError(f"recorded {name}={value!r} is not in the space's {param.grid_values()}")


def profile_fitted_to_seed(csv: Path, seed: int, path: Path) -> Path:
    """`sweeper fit`'s fit (no hold-outs) to the recorded trials of one seed, as a YAML."""
    import pandas as pd

    from sweeper.analysis import calibrate as cal
    from sweeper.analysis import fit as calfit
    from workloads.hardware import load_hardware

    frame = pd.read_csv(csv)
    base = load_hardware(str(RECORDED_BASE), field="hardware")
    points = calfit.points_from_frame(frame[frame["seed"] == seed], base)
    fit = calfit.fit_profile(points, base, calfit.default_space(points), "linear", name="host-fitted")
    return cal.write_profile(fit.profile, path, note=f"fitted to the seed-{seed} trials of {csv.name} "
                             "by benchmarks.search_efficiency (not the trials it is scored on)")


def sampler_variant(grid: Grid, name: str) -> tuple[str, dict]:
    """(sampler type, options) of a variant; guided predicts with the grid's own profile
    unless the variant names another (guided+fit)."""
    kind, options = SAMPLER_VARIANTS.get(name, (name, {}))
    if kind == "guided" and "hardware" not in options and grid.extra.get("guided_hardware"):
        options = {**options, "hardware": grid.extra["guided_hardware"]}
    return kind, options


def seed_descriptions(grid: Grid, variants: list[str]) -> dict[str, list[str]]:
    """Each guided variant's seeds, labelled, with their measured (table) values."""
    from sweeper.spec import guided

    out = {}
    for variant in variants:
        _, options = sampler_variant(grid, variant)
        seeds = guided.seed_points(grid.space, 2, 24, options.get("hardware"))
        texts = []
        for s in seeds:
            state, values = grid.table.get(_key(s.params), ("?", None))
            label = "/".join(str(v) for v in s.params.values())
            texts.append(f"{label} ({'x'.join(f'{v:.3g}' for v in values) if values else state})")
        out[variant] = texts
    return out


def fitted_host_profile(study: str, storage: str, path: Path) -> Path:
    """Fit the host profile to another study's measurements (`sweeper fit`'s fit, no
    hold-outs) and write it as a hardware YAML for `sampler.options.hardware`."""
    from sweeper.analysis import calibrate as cal
    from sweeper.analysis import fit as calfit

    data = cal.load_study_data(study, storage)
    base = cal.study_base_profile(data.attrs)
    points = calfit.points_from_frame(data.frame, base, data.configs)
    fit = calfit.fit_profile(points, base, calfit.default_space(points), "linear", name="host-fitted")
    return cal.write_profile(fit.profile, path, note=f"fitted to study {study} by benchmarks.search_efficiency")


def merge_equivalent(space, table: dict) -> tuple[dict, int]:
    """Points that run the same program are one configuration: each gets the median of
    their measurements. Two points are the same program when the cost model predicts every
    number of theirs alike (as `sweeper fit` counts them): on one chip every layout is
    (its collectives are over axes of size 1 and are skipped), and so are ws1d and ws2d
    on an X = 1 torus. Without this, which of four identical 1-chip programs "is" the
    frontier would be decided by timing noise, which no sampler can learn."""
    from workloads.costmodel import predict
    from workloads.hardware import per_chip
    from workloads.hostprofile import host_profile

    profile = host_profile()
    groups: dict[tuple, list] = {}
    for key in table:
        config = space.trial_config(dict(key))
        m = predict(config, per_chip(profile, config.chips)).metrics()
        signature = (config.batch, config.chips, config.weights,
                     tuple(sorted((k, float(f"{v:.9g}")) for k, v in m.items())))
        groups.setdefault(signature, []).append(key)
    merged = {}
    for keys in groups.values():
        done = [table[k][1] for k in keys if table[k][0] == "COMPLETE"]
        value = ("COMPLETE", [float(v) for v in np.median(np.array(done, float), axis=0)]) if done \
            else table[keys[0]]
        for k in keys:
            merged[k] = value
    return merged, len(groups)


def replay(grid: Grid, sampler: str, seed: int, stop_fraction: float | None) -> dict:
    """One sampler, one seed: ask/tell against the table; hypervolume after each CHARGED
    trial (module docstring: pruned, unmeasured and repeated points are not charged)."""
    import dataclasses

    import optuna
    from optuna.trial import TrialState

    from sweeper.spec.space import SamplerSpec

    kind, options = sampler_variant(grid, sampler)
    space = dataclasses.replace(grid.space, sampler=SamplerSpec(kind, seed, dict(options)))
    study = optuna.create_study(sampler=space.make_sampler(), directions=space.directions)
    distributions = space.distributions()
    found, curve, linear, charged = [], [], [], set()
    asks = 0
    start = time.perf_counter()
    while len(charged) < grid.dispatchable and asks < MAX_ASKS_PER_POINT * grid.size:
        asks += 1
        trial = study.ask(distributions)
        key = _key(trial.params)
        state, values = grid.table[key]
        if state == "COMPLETE":
            study.tell(trial, values)
        else:
            study.tell(trial, state=TrialState.FAIL if state == "FAIL" else TrialState.PRUNED)
        if state in ("PRUNED", "MISSING") or key in charged:
            continue                     # the controller never dispatches it (again)
        charged.add(key)
        if state == "COMPLETE":
            found.append(values)
        log_fraction, linear_fraction = grid.fractions(found)
        curve.append(log_fraction)
        linear.append(linear_fraction)
        if stop_fraction is not None and min(curve[-1], linear[-1]) >= stop_fraction:
            break
    reached = next((i + 1 for i, f in enumerate(curve) if f >= TARGET_FRACTION), None)
    reached_linear = next((i + 1 for i, f in enumerate(linear) if f >= TARGET_FRACTION), None)
    return {"sampler": sampler, "seed": seed, "curve": curve, "trials_to_target": reached,
            "trials_to_target_linear": reached_linear, "asks": asks,
            "distinct_points": len(charged), "seconds": time.perf_counter() - start}


def compare(grid: Grid, sampler: str, seeds: list[int]) -> dict:
    """One sampler over seeds: trials charged to 95% (a censored run counts as the grid's
    dispatchable size), median and spread."""
    runs = []
    size = grid.dispatchable
    for seed in seeds:
        run = replay(grid, sampler, seed, TARGET_FRACTION)
        runs.append(run)
        print(f"  {grid.space.name} {sampler:10s} seed {seed}: 95% after "
              f"{run['trials_to_target'] or '>' + str(size)} charged trials ({run['asks']} asks, "
              f"linear HV: {run['trials_to_target_linear'] or '>' + str(size)}; "
              f"{run['seconds']:.1f}s)", file=sys.stderr)
    counts = [r["trials_to_target"] or size for r in runs]
    linear = [r["trials_to_target_linear"] or size for r in runs]
    at = {k: float(np.median([r["curve"][min(k, len(r["curve"])) - 1] if r["curve"] else 0.0
                              for r in runs]))
          for k in (5, 10, 20, 50) if k <= size}
    return {
        "median_trials_to_target": float(np.median(counts)),
        "mean_trials_to_target": float(np.mean(counts)),
        "min_trials_to_target": int(min(counts)),
        "max_trials_to_target": int(max(counts)),
        "iqr_trials_to_target": [float(np.percentile(counts, 25)), float(np.percentile(counts, 75))],
        "share_of_grid": float(np.median(counts)) / size,
        "censored_runs": sum(r["trials_to_target"] is None for r in runs),
        "median_trials_to_target_linear": float(np.median(linear)),
        "mean_trials_to_target_linear": float(np.mean(linear)),
        "censored_runs_linear": sum(r["trials_to_target_linear"] is None for r in runs),
        "hv_fraction_at": at,
        "runs": [{k: r[k] for k in ("seed", "trials_to_target", "trials_to_target_linear",
                                    "distinct_points", "asks", "seconds")}
                 for r in runs],
    }


def arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--samplers", default=",".join(SAMPLERS))
    parser.add_argument("--spaces", default="recorded",
                        help="comma-separated: recorded (the calibration sweep, default), "
                        "analytical (PaLM 540B on TPU v4), host (measure a tiny grid now)")
    parser.add_argument("--recorded", default=str(RECORDED), help="recorded trial table (CSV)")
    parser.add_argument("--score-seed", type=int, default=1,
                        help="the recorded trials scored; guided+fit is fitted to the other seed")
    parser.add_argument("--gp-seeds", type=int, default=None, help="seeds for gp (slow); default --seeds")
    parser.add_argument("--storage", help="Optuna storage for the host grid sweep")
    parser.add_argument("--tracking-uri", help="MLflow store for the host grid sweep")
    parser.add_argument("--host-study", help="replay this finished host grid study instead of measuring")
    parser.add_argument("--fit-study", help="a finished measured host study (e.g. the quickstart's): "
                        "adds `guided+fit`, guided with the profile fitted to it")


def run(args: argparse.Namespace, previous: dict | None) -> dict:
    import optuna

    from sweeper import paths

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    start = time.perf_counter()
    context = common.machine_context()
    samplers = [s for s in args.samplers.split(",") if s]
    gp_note = "optuna GPSampler (PyTorch installed)"
    if "gp" in samplers and importlib.util.find_spec("torch") is None:
        samplers.remove("gp")
        gp_note = "unavailable (needs PyTorch: pip install torch)"
    seeds = list(range(args.seeds))
    fit_note = None
    if "recorded" in args.spaces.split(","):
        fit_seed = 1 - args.score_seed
        try:
            path = profile_fitted_to_seed(Path(args.recorded), fit_seed,
                                          Path(args.out) / "host-fitted.yaml")
            SAMPLER_VARIANTS["guided+fit"] = ("guided", {"hardware": str(path)})
            samplers.append("guided+fit")
            fit_note = (f"profile fitted to the recorded trials of seed {fit_seed} (a different "
                        f"measurement of the sweep, never scored) ({path.name})")
        except Exception as err:  # noqa: BLE001 - the plain samplers still run
            fit_note = f"fit to seed {fit_seed} failed: {type(err).__name__}: {err}"
            print(f"search efficiency: {fit_note}", file=sys.stderr)
    elif args.fit_study:
        try:
            path = fitted_host_profile(args.fit_study, args.storage or paths.default_storage(),
                                       Path(args.out) / "host-fitted.yaml")
            SAMPLER_VARIANTS["guided+fit"] = ("guided", {"hardware": str(path)})
            samplers.append("guided+fit")
            fit_note = f"profile fitted to study `{args.fit_study}` ({path.name})"
        except Exception as err:  # noqa: BLE001 - the plain samplers still run
            fit_note = f"fit of study {args.fit_study} failed: {type(err).__name__}: {err}"
            print(f"search efficiency: {fit_note}", file=sys.stderr)
    out = {"seeds": args.seeds, "gp_note": gp_note, "fit_note": fit_note, "context": context,
           "spaces": {}}
    for name in args.spaces.split(","):
        if name == "recorded":
            grid = recorded_grid(recorded_space(), Path(args.recorded), args.score_seed)
        elif name == "analytical":
            grid = analytical_grid(analytical_space())
        elif name == "host":
            grid = measured_grid(host_space(), args.storage or paths.default_storage(),
                                 args.tracking_uri or paths.default_tracking_uri(), args.host_study)
        else:
            raise SystemExit(f"unknown space {name!r}")
        print(f"search efficiency: {name} grid of {grid.size} points, HV {grid.hv:.4g}", file=sys.stderr)
        block = {"grid": grid.summary(), "samplers": {}, "verdict": None}
        for sampler in samplers:
            if sampler == "guided+fit" and name == "analytical":
                continue     # the analytical space's model is the truth already
            sampler_seeds = seeds[:args.gp_seeds] if sampler == "gp" and args.gp_seeds else seeds
            block["samplers"][sampler] = compare(grid, sampler, sampler_seeds)
        block["verdict"] = compare_verdict(block["samplers"], grid.dispatchable)
        block["seeds"] = seed_descriptions(grid, [s for s in block["samplers"] if s.startswith("guided")])
        out["spaces"][name] = block
    out["context_end"] = common.machine_context(since=context)
    out["elapsed_s"] = time.perf_counter() - start
    return out


def metrics(result: dict) -> dict:
    return {f"{name}_{sampler.replace('+', '_plus_')}_trials_to_95": s["median_trials_to_target"]
            for name, block in result["spaces"].items() for sampler, s in block["samplers"].items()}


def params(args: argparse.Namespace) -> dict:
    return {"seeds": args.seeds, "samplers": args.samplers}


def compare_verdict(rows: dict, size: int) -> dict:
    """Per guided variant: its median share of the dispatchable grid, and whether its median
    is below every plain sampler's AND its worst seed below their medians (a margin larger
    than its own spread over seeds)."""
    plain = {k: v for k, v in rows.items() if not k.startswith("guided")}
    out = {}
    for name, g in rows.items():
        if not name.startswith("guided"):
            continue
        out[name] = {"guided_share_of_grid": g["median_trials_to_target"] / size,
                     "meets_share_target": g["max_trials_to_target"] / size <= TARGET_GUIDED_SHARE,
                     "best_plain": min(plain, key=lambda k: plain[k]["median_trials_to_target"]) if plain else None,
                     "beats_every_plain": all(g["max_trials_to_target"] < v["median_trials_to_target"]
                                              for v in plain.values())}
    return out


BENCHMARK = harness.Benchmark(NAME, __doc__.splitlines()[0], run, arguments=arguments,
                              metrics=metrics, params=params, log=True)


if __name__ == "__main__":
    sys.exit(harness.main(BENCHMARK))
