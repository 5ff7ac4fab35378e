"""`sampler: guided`: start a study at the cost model's recommendations, then search.

    sampler: {type: guided, seed: 0}                        # then TPE
    sampler: {type: guided, seed: 0, options: {base: nsga2, fronts: 1, max_seeds: 8}}
    sampler: {type: guided, options: {hardware: fitted.yaml}}   # predict with `sweeper fit`'s profile

Seeding (`seed_points(space)`): for every combination of the searched workload parameters
(batch, chips, input_len, decode_steps, weights), `workloads.recommend.recommend` picks the fastest
layout and, when `topology` is searched, topology of each phase, among the layouts the
space allows (paper §3: which layout wins depends on batch, chips and phase; the cost
model decides, no hand-written rule). Each recommended point becomes a trial config,
is checked like the controller checks it (layout constraints, memory budget), and is
predicted on the space's objectives. The predicted non-dominated fronts (the first
`fronts` of them, best first, at most `max_seeds` points) are enqueued with
`study.enqueue_trial` when the study asks for its first trial; after them the `base`
sampler (TPE or NSGA-II) continues, learning from the seeded trials' real results.

For a minimised decode objective pair (latency, chip-seconds per token) the fastest layout
of a (batch, chips) point is also its cheapest, so the recommended points contain the
predicted frontier: on an analytical space the seeds are the frontier itself, on a
measured space they are where the model expects it.

The hardware the model predicts with: `options.hardware` when given (a preset or YAML, e.g.
the calibrated profile `sweeper fit --out` writes from an earlier sweep); else
`analytical:<profile>` and `devices:<profile>` that profile, `host` this host's measured
profile; a measured host profile is shared out as the controller does (the worker's cores,
split over the trial's chips). `devices` without a profile has nothing to predict with, so
the study runs the base sampler alone.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
from types import SimpleNamespace
from typing import Any

import optuna
from optuna.samplers import BaseSampler

from workloads import costmodel
from workloads.config import ConfigError
from workloads.hardware import load_hardware, per_chip, worker_share
from workloads.recommend import recommend
from workloads.trial import DEFAULTS as TRIAL_DEFAULTS
from workloads.validate import integer, one_of

log = logging.getLogger(__name__)

BASES = ("tpe", "nsga2")
WORKLOAD_PARAMS = ("batch", "chips", "input_len", "decode_steps", "weights")
MAX_COMBINATIONS = 4096          # workload combinations the seeding enumerates at most
SEEDED_ATTR = "guided_seeds"     # study user attr: the seeded params (also marks "seeded")


def _base_sampler(base: str, seed: int | None, options: dict):
    one_of("sampler.options.base", base, BASES)
    cls = optuna.samplers.TPESampler if base == "tpe" else optuna.samplers.NSGAIISampler
    return cls(seed=seed, **options)


class GuidedSampler(BaseSampler):
    """Enqueue the cost model's recommended points, then delegate to `base` (TPE/NSGA-II).

    `search_space`: the SearchSpace (sweeper/spec/space.py) the study runs; `base_options`: the
    base sampler's keyword arguments (e.g. {n_startup_trials: 5})."""

    def __init__(self, search_space, seed: int | None = None, base: str = "tpe", fronts: int = 2,
                 max_seeds: int = 24, base_options: dict | None = None, hardware: str | None = None):
        integer("sampler.options.fronts", fronts)
        integer("sampler.options.max_seeds", max_seeds, minimum=0)
        if hardware not in (None, "host"):      # checked now; `host` is measured only when used
            load_hardware(hardware, source=search_space.source, field="sampler.options.hardware")
        self.space = search_space
        self.fronts, self.max_seeds, self.hardware = fronts, max_seeds, hardware
        self.base_name = base
        self._base = _base_sampler(base, seed, dict(base_options or {}))
        self._seeded_studies: set[str] = set()
        self._seeds: list[dict] | None = None    # computed on first use (needs the profile)

    # ------------------------------------------------------------------ seeding
    def seeds(self) -> list[dict]:
        """The points this sampler enqueues (computed once)."""
        if self._seeds is None:
            self._seeds = [s.params for s in seed_points(self.space, self.fronts, self.max_seeds,
                                                         self.hardware)]
        return self._seeds

    def before_trial(self, study, trial) -> None:
        if study.study_name not in self._seeded_studies:
            self._seeded_studies.add(study.study_name)
            self._seed(study, trial)
        self._base.before_trial(study, trial)

    def _seed(self, study, trial) -> None:
        """Enqueue the seeds once per study (a resumed study was seeded when it started).
        The trial being created now was made before this hook ran: it takes the first seed
        (as an enqueued trial would, through Optuna's `fixed_params`)."""
        if SEEDED_ATTR in study.user_attrs:
            return
        try:
            seeds = self.seeds()
        except Exception as err:  # noqa: BLE001 - no guidance is a plain base-sampler study
            log.warning("guided sampler: no seeds (%s); running %s alone", err, self.base_name)
            seeds = []
        study.set_user_attr(SEEDED_ATTR, seeds)
        if not seeds:
            return
        first, rest = seeds[0], seeds[1:]
        if not trial.system_attrs.get("fixed_params") and not trial.params:
            study._storage.set_trial_system_attr(trial._trial_id, "fixed_params", first)
            trial.system_attrs["fixed_params"] = first     # the Trial reads this frozen copy
        else:
            rest = seeds
        for params in rest:
            study.enqueue_trial(params, skip_if_exists=True)

    # ------------------------------------------------------------------ delegation
    def infer_relative_search_space(self, study, trial):
        return self._base.infer_relative_search_space(study, trial)

    def sample_relative(self, study, trial, search_space):
        return self._base.sample_relative(study, trial, search_space)

    def sample_independent(self, study, trial, param_name, param_distribution):
        return self._base.sample_independent(study, trial, param_name, param_distribution)

    def after_trial(self, study, trial, state, values) -> None:
        self._base.after_trial(study, trial, state, values)

    def reseed_rng(self) -> None:
        self._base.reseed_rng()


# ---------------------------------------------------------------------------- the seeds


class Seed:
    """One recommended point: the searched params, its trial config and predicted objectives."""

    def __init__(self, params: dict, config, predicted: list[float]):
        self.params, self.config, self.predicted = params, config, predicted

    def __repr__(self) -> str:
        return f"Seed({self.params}, predicted={self.predicted})"


def _model_profile(space, hardware: str | None = None):
    """A function chips -> per-chip HardwareProfile the cost model predicts with, or None.

    `hardware` (e.g. the YAML `sweeper fit` writes) replaces the space's own profile. A
    measured host profile is the whole machine: like the controller, each trial gets its
    worker's share of the cores (`parallel` slots), split over the trial's chips."""
    hw = space.hardware
    if hardware is not None:
        profile = load_hardware(hardware, source=space.source, field="sampler.options.hardware")
    else:
        profile = hw.resolve(space.source)
    if profile is None:
        return None
    if hw.kind == "host" and profile.measured:
        total = len(os.sched_getaffinity(0))
        share = worker_share(max(1, total // max(space.parallel, 1)), total)
        return lambda chips: per_chip(profile, chips, share)
    return lambda chips: profile


def _objective_phase(space) -> str:
    """The phase a joint `ffn`/`attn` param is chosen for: the first objective's phase."""
    metric = space.objectives[0].metric if space.objectives else "decode_step_s"
    return "prefill" if metric.startswith("prefill") else "decode"


def _allowed(space, phase: str, part: str) -> tuple | None:
    """Layout values the space allows for one phase's ffn/attn (None: any)."""
    by_name = {p.name: p for p in space.params}
    for name in (f"{phase}_{part}", part):
        if name in by_name:
            return tuple(by_name[name].grid_values())
    fixed = (space.fixed.get(phase) or {}).get(part)
    return (fixed,) if fixed else None


def _recommended(space, profile, values: dict, phase: str, search_topology: bool) -> dict | None:
    """recommend()'s best allowed (ffn, attn, topology) for one phase, or None."""
    fixed = space.fixed
    chips, batch = values.get("chips", fixed.get("chips")), values.get("batch", fixed.get("batch"))
    if chips is None or batch is None:
        return None
    shape = {k: values.get(k, fixed.get(k, TRIAL_DEFAULTS[k]))
             for k in ("input_len", "decode_steps", "weights")}
    input_len, weights = shape["input_len"], shape["weights"]
    # the decode context as costmodel.predict computes it for the trial
    context = (input_len if phase == "prefill"
               else costmodel.decode_context(SimpleNamespace(**shape)))
    try:
        rec = recommend(space.model, profile(chips), chips, batch, phase, input_len=input_len,
                        context=context, weights=weights, search_topology=search_topology).to_dict()
    except ConfigError:
        return None
    ffns, attns = _allowed(space, phase, "ffn"), _allowed(space, phase, "attn")
    ok = [a for a in rec["alternatives"]
          if (ffns is None or a["ffn"] in ffns) and (attns is None or a["attn"] in attns)]
    if not ok and chips == 1 and rec["alternatives"]:
        # One chip: every layout is the same program (nothing to shard, no collectives), and
        # recommend names it ws1d; any layout the space allows runs that program.
        best = min(rec["alternatives"], key=lambda a: (not a["fits"], a["latency_s"]))
        return {"ffn": ffns[0] if ffns else best["ffn"], "attn": attns[0] if attns else best["attn"],
                "topology": tuple(best["topology"])}
    if not ok:
        return None
    best = min(ok, key=lambda a: (not a["fits"], a["latency_s"]))
    return {"ffn": best["ffn"], "attn": best["attn"], "topology": tuple(best["topology"])}


def _point(space, values: dict, recs: dict[str, dict], objective_phase: str) -> dict:
    """Searched params of one recommended point (layouts, topology from the recommendation)."""
    params = dict(values)
    names = {p.name: p for p in space.params}
    for part in ("ffn", "attn"):
        if part in names:
            params[part] = recs[objective_phase][part]
        for phase in ("prefill", "decode"):
            if f"{phase}_{part}" in names:
                params[f"{phase}_{part}"] = recs[phase][part]
    if "topology" in names:
        text = "x".join(str(v) for v in recs[objective_phase]["topology"])
        choices = names["topology"].grid_values()
        if text in choices:
            params["topology"] = text
        elif "auto" in choices:
            params["topology"] = "auto"
    return params


def non_dominated_ranks(values: list[list[float]]) -> list[int]:
    """Pareto rank of each point (0 = non-dominated), all objectives minimised."""
    ranks = [-1] * len(values)
    remaining = set(range(len(values)))
    rank = 0
    while remaining:
        front = {i for i in remaining
                 if not any(all(a <= b for a, b in zip(values[j], values[i])) and values[j] != values[i]
                            for j in remaining if j != i)}
        for i in front:
            ranks[i] = rank
        remaining -= front
        rank += 1
    return ranks


def seed_points(space, fronts: int = 2, max_seeds: int = 24, hardware: str | None = None) -> list[Seed]:
    """The recommended points, predicted, best fronts first (see the module docstring)."""
    profile = _model_profile(space, hardware)
    if profile is None or max_seeds == 0:
        return []
    names = {p.name: p for p in space.params}
    workload = [n for n in WORKLOAD_PARAMS if n in names]
    grids = [names[n].grid_values() for n in workload]
    if math.prod(len(g) for g in grids) > MAX_COMBINATIONS:
        raise ConfigError("sampler.type", "guided", f"a space with at most {MAX_COMBINATIONS} "
                          "combinations of batch, chips, input_len, decode_steps and weights")
    objective_phase = _objective_phase(space)
    phases = sorted({objective_phase} | {ph for ph in ("prefill", "decode")
                                         if f"{ph}_ffn" in names or f"{ph}_attn" in names})
    search_topology = "topology" in names
    budget = space.memory_budget_bytes if space.hardware.kind == "host" else None
    signs = [1.0 if o.direction == "minimize" else -1.0 for o in space.objectives]

    seeds, seen = [], set()
    for combo in itertools.product(*grids):
        values = dict(zip(workload, combo))
        recs = {ph: _recommended(space, profile, values, ph, search_topology) for ph in phases}
        if any(r is None for r in recs.values()):
            continue
        params = _point(space, values, recs, objective_phase)
        key = tuple(sorted(params.items()))
        if key in seen:
            continue
        seen.add(key)
        try:
            config = space.trial_config(params)
            chip_profile = profile(config.chips)
            if costmodel.feasibility(config, chip_profile, budget):
                continue
            metrics = costmodel.predict(config, chip_profile).metrics()
        except ConfigError:
            continue
        predicted = [metrics.get(o.metric, math.nan) for o in space.objectives]
        if not all(math.isfinite(v) for v in predicted):
            continue
        seeds.append(Seed(params, config, predicted))
    if not seeds:
        return []
    ranks = non_dominated_ranks([[s * v for s, v in zip(signs, seed.predicted)] for seed in seeds])
    order = sorted(range(len(seeds)), key=lambda i: (ranks[i], [signs[k] * seeds[i].predicted[k]
                                                                for k in range(len(signs))]))
    chosen = [seeds[i] for i in order if ranks[i] < fronts]
    return chosen[:max_seeds]


def describe(space) -> list[dict[str, Any]]:
    """The seeds as rows (params + predicted objectives), for reports and tests."""
    options = space.sampler.options
    return [{**s.params, **{f"pred_{o.metric}": v for o, v in zip(space.objectives, s.predicted)}}
            for s in seed_points(space, options.get("fronts", 2), options.get("max_seeds", 24),
                                 options.get("hardware"))]
