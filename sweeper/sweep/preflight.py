"""Checks a sweep passes before anything is started (its arguments, its stores, whether any
point of a `host` space fits in this machine's memory), and each point before it runs.

    target = check_run_arguments(space, storage, tracking_uri, trials, parallel, ...)
    reason, prediction = check_point(space, config, chip_profile)   # reason: prune it

Each failure is a `ConfigError` (one line, exit 2) raised before Ray, Optuna's storage or
MLflow are touched; nothing is created on disk.

Memory of an emulated trial (measured, issue 15: tiny model on 1 virtual chip, batch 2,048
to 16,384, `memory_analysis()` of the compiled programs and the worker's RSS high water):
XLA CPU holds 1.95-1.97x the cost model's per-chip peak (arguments, outputs and temporaries
are separate host buffers) plus ~0.4 GiB per worker process (JAX and its compiled programs).
"""

from __future__ import annotations

import dataclasses
import math
import sys
from typing import Any

from sweeper import paths
from sweeper.sweep.session import check_ray_address
from sweeper.tracking.store_health import prepare_tracking_store
from sweeper.spec.space import MAX_CHECKED_POINTS, SearchSpace, checked_points
from workloads.config import ConfigError, HardwareProfile
from workloads.costmodel import feasibility, predict_trial
from workloads.hardware import load_hardware
from workloads.hostprofile import physical_memory_bytes
from workloads.validate import is_number, positive_int

EMULATED_MEMORY_FACTOR = 2.0
EMULATED_PROCESS_BYTES = 0.4 * 2**30
EMULATED_NOTE = (f" (emulated mesh: the budget is the host's share less "
                 f"{EMULATED_PROCESS_BYTES / 2**30:.1f} GiB per process, divided by "
                 f"{EMULATED_MEMORY_FACTOR:g}, what XLA CPU allocates per byte the model counts)")


def emulated_budget(budget_per_chip: float, chips: int) -> float:
    """The cost model's per-chip memory budget that leaves room for what XLA CPU allocates;
    `chips`: the chips of one process (`process_chips`)."""
    return max(0.0, (budget_per_chip - EMULATED_PROCESS_BYTES / chips) / EMULATED_MEMORY_FACTOR)


def process_chips(config) -> int:
    """The chips one of a trial's processes holds: a disaggregated serving trial runs each
    slice in a process of its own on half the chips (docs/space-files.md, "Serving
    trials"), so each process's own overhead is spread over half the chips."""
    return config.chips // 2 if config.disaggregated else config.chips


def check_run_arguments(space: SearchSpace, *, storage: str | None, tracking_uri: str | None,
                        study_name: str | None, trials: int | None, parallel: int | None,
                        address: str | None) -> tuple[str, str, int]:
    """(storage URL, tracking URI, trials to run), every argument and both stores checked;
    ConfigError before anything is created."""
    if trials is not None:
        positive_int("--trials", trials)
    if parallel is not None:
        positive_int("--parallel", parallel)
    if study_name is not None:
        paths.check_study_name(study_name)      # it names folders: checked before anything
    if address is not None:
        check_ray_address(address)
    storage = paths.check_storage_url(storage) if storage else paths.default_storage(create=False)
    tracking_uri = (paths.check_tracking_uri(tracking_uri) if tracking_uri
                    else paths.default_tracking_uri(create=False))
    # a half-created MLflow schema with no run is moved aside (one line); a damaged MLflow
    # store is a ConfigError naming `sweeper sync` (sweeper/tracking/store_health.py)
    moved = prepare_tracking_store(tracking_uri, study_name, storage)
    if moved:
        print(moved, file=sys.stderr)
    for url, flag in ((storage, "--storage"), (tracking_uri, "--tracking-uri")):
        if url == paths.default_storage(create=False) or \
                url == paths.default_tracking_uri(create=False):
            paths.check_home(url)            # before Ray starts (it writes there too)
        paths.check_sqlite_store(url, flag)  # both stores intact before either is written
    target = trials if trials is not None else space.planned_trials()
    if space.sampler.type == "grid":
        target = min(target, space.grid_size())
    check_memory_fits(space)      # before Ray starts: a space that cannot fit is bad input
    return storage, tracking_uri, target


def memory_grids(space: SearchSpace) -> list[list] | None:
    """The values whose points are checked for memory: the whole grid when it is small (at
    most MAX_CHECKED_POINTS, no log ranges, as space.py checks that some point runs); else
    every layout or name choice with each number at its smallest (least memory); None when
    even that is too many."""
    if space.params and (any(p.log for p in space.params) or space.grid_size() > MAX_CHECKED_POINTS):
        grids = [[p.low] if p.choices is None else
                 [min(p.choices, key=_order)] if all(is_number(c) for c in p.choices) else
                 list(p.choices) for p in space.params]
        return grids if math.prod(len(g) for g in grids) <= MAX_CHECKED_POINTS else None
    return [p.grid_values() for p in space.params]


def check_memory_fits(space: SearchSpace) -> None:
    """ConfigError when no point of a `host` space fits in this machine's memory (checked
    before Ray starts on the points of `memory_grids`)."""
    if space.hardware.kind != "host":
        return
    grids = memory_grids(space)
    if grids is None:
        return
    memory = physical_memory_bytes()
    first = None
    for config in checked_points(space, grids):
        if isinstance(config, ConfigError):      # cannot run for its shape: not a memory case
            continue
        # only the byte counts of the prediction are used: any profile's speeds will do
        profile = dataclasses.replace(load_hardware("tpu-v4"), hbm_bytes=memory / config.chips)
        budget = emulated_budget(profile.hbm_bytes, process_chips(config))   # real memory only
        reason = feasibility(config, profile, budget)
        if reason is None or not reason.startswith("memory"):
            return
        first = first or reason
    if first is not None:
        raise ConfigError("space", space.name, f"a space with a point that fits in this host's "
                          f"memory; none does, e.g. {first}{EMULATED_NOTE}", space.source)


def _order(value: Any) -> Any:
    return (0, value) if isinstance(value, (int, float)) else (1, str(value))


def check_point(space: SearchSpace, config, chip_profile: HardwareProfile | None
                ) -> tuple[str | None, dict[str, float]]:
    """(why the point cannot run on `chip_profile`, or None; the cost model's prediction of
    it): layout divisibility and memory against the profile's HBM or, for `host`, the
    space's `memory_budget_bytes` (default: this host's share, less what XLA CPU adds).
    A disaggregated serving trial is checked and predicted per slice, on its half of the
    chips (costmodel `feasibility`, `predict_slices`): the whole mesh never runs; the prediction
    of any serving trial prefills one prompt per call (`predict_trial`)."""
    if chip_profile is None:
        return None, {}
    budget = None
    if space.hardware.kind == "host":
        # the space's memory_budget_bytes is compared with the cost model as stated;
        # the default (the host's memory) leaves room for what XLA CPU allocates
        budget = space.memory_budget_bytes or emulated_budget(chip_profile.hbm_bytes,
                                                              process_chips(config))
    prediction: dict[str, float] = {}
    try:
        reason = feasibility(config, chip_profile, budget)
        if reason and not space.memory_budget_bytes and budget is not None and \
                reason.startswith("memory"):
            reason += EMULATED_NOTE
        prediction = predict_trial(config, chip_profile).metrics()
    except ConfigError as err:
        reason = str(err)
    return reason, prediction
