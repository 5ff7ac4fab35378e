"""The sweep controller: Optuna ask/tell over a pool of workers, every trial tracked.

    space = load_space("search_spaces/quickstart.yaml")      # validated first
    result = run_sweep(space)                                  # -> SweepResult

Loop: while fewer than `trials` trials have finished and fewer than `parallel` run,
ask Optuna for a point; turn it into a TrialConfig (a point that cannot run for its
shape -> PRUNED with the reason); ask the cost model whether it fits (layout
divisibility, memory against the hardware's HBM or, for `host`, the space's per-chip
`memory_budget_bytes`; no -> PRUNED with the reason); otherwise dispatch it to a free
slot of the pool. `ray.wait` returns finished trials; each is told to Optuna (values
of the objectives, constraint values through `Trial.set_constraint`, which every Optuna
5 sampler reads — the successor of `constraints_func`) and logged as an MLflow child
run. A trial that raises is FAIL with its reason, a trial past `timeout_s` is FAIL and
its worker replaced, a worker that dies is retried up to `max_retries` times; the sweep
goes on in every case.

Each Optuna trial carries user_attrs: `config` (TrialConfig.to_dict()), `flat_params`,
`measurement` (Measurement.metrics()), `prediction` (the cost model's, also for measured
trials), `source`, `hardware`, `reason`, `worker` (pid, cores, slot, start/end time,
cache stats), `constraints`, `mlflow_run_id`. Storage is an Optuna RDB (SQLite under
$SWEEPER_HOME by default), so `--resume` continues a study and Optuna's own tools
(optuna-dashboard, `optuna.load_study`) read it.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from workloads.config import ConfigError, HardwareProfile
from workloads.metrics import Measurement

from sweeper import paths
from sweeper.progress import ProgressLine
from sweeper.space import SearchSpace, load_space
from sweeper.workers import LocalPool, RayPool, TrialError, WorkerLost, host_share, one_line

log = logging.getLogger(__name__)
INTERRUPTED = "interrupted: the controller stopped before this trial finished"


@dataclass
class SweepResult:
    study: Any                           # optuna.Study
    study_name: str
    storage: str
    tracking_uri: str
    parent_run_id: str | None
    experiment: str
    experiment_id: str | None
    source: str                          # measured | analytical
    counts: dict[str, int]               # complete, failed, pruned (the whole study)
    pareto: list[dict[str, Any]]         # non-dominated feasible trials
    objectives: list[tuple[str, str]]    # (metric, direction)
    searched: list[str] = field(default_factory=list)   # the space's searched params
    elapsed_s: float = 0.0
    tracking_errors: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"study": self.study_name, "trials_complete": self.counts["complete"],
                "trials_failed": self.counts["failed"], "trials_pruned": self.counts["pruned"],
                "pareto": self.pareto, "parent_run_id": self.parent_run_id,
                "tracking_uri": self.tracking_uri, "storage": self.storage,
                "experiment": self.experiment, "experiment_id": self.experiment_id,
                "source": self.source,
                "elapsed_s": round(self.elapsed_s, 3)}


@dataclass
class _InFlight:
    trial: Any                           # optuna.Trial
    config: Any                          # TrialConfig
    flat: dict[str, Any]
    prediction: dict[str, float]
    hardware: HardwareProfile | None
    slot: int
    handle: Any
    deadline: float
    attempt: int = 0


def _positive(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(name, value, "a positive integer")
    return value


# ----------------------------------------------------------------------------- study naming


def _study_summaries(storage: str):
    db = paths.sqlite_path(storage)
    if db is not None and not db.exists():
        return []          # nothing to list; do not create the database just to look
    import optuna

    return optuna.study.get_all_study_summaries(storage, include_best_trial=False)


def check_ray_address(address: str, timeout_s: float = 5.0) -> None:
    """Fail fast on an address nothing listens on (ray.init would retry for minutes)."""
    import socket

    if address in ("auto", "local"):
        return
    hostport = address.split("://", 1)[-1].rstrip("/")
    host, _, port = hostport.rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError("--address", address, "HOST:PORT of a Ray cluster's head (e.g. "
                          "10.0.0.1:6379), ray://HOST:10001 or auto")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            pass
    except OSError as err:
        raise ConfigError("--address", address, f"the address of a running Ray cluster head "
                          f"(nothing answers there: {err.strerror or err})") from None


def choose_study(space: SearchSpace, storage: str, study_name: str | None, resume: bool) -> tuple[str, bool]:
    """(study name, exists). New sweeps get `<space>-<timestamp>`; --resume finds the latest."""
    summaries = _study_summaries(storage)
    existing = {s.study_name: s for s in summaries}
    if study_name is not None:
        if study_name in existing and not resume:
            raise ConfigError("--study", study_name, "a new study name, or --resume to continue "
                              "this one")
        if resume and study_name not in existing:
            raise ConfigError("--study", study_name, f"an existing study to resume in {storage} "
                              f"(have {sorted(existing)[-10:]})")
        if study_name in existing:
            _check_resumable(space, existing[study_name])
        return study_name, study_name in existing
    if resume:
        mine = [s for s in summaries if s.user_attrs.get("space") == space.name
                and s.user_attrs.get("hardware") == space.hardware.label]
        if not mine:
            raise ConfigError("--resume", space.name, f"a space with a study in {storage} to "
                              "resume (none found; run without --resume to start one)")
        latest = max(mine, key=lambda s: (s.datetime_start or 0, s._study_id))
        _check_resumable(space, latest)
        return latest.study_name, True
    base = f"{space.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    name, i = base, 1
    while name in existing:
        i += 1
        name = f"{base}-{i}"
    return name, False


def _check_resumable(space: SearchSpace, summary) -> None:
    """A study continues only with the hardware and objectives it was started with."""
    attrs = summary.user_attrs
    if attrs.get("hardware") not in (None, space.hardware.label):
        raise ConfigError("hardware", space.hardware.label, f"{attrs['hardware']!r}, the hardware "
                          f"study {summary.study_name!r} was run on", space.source)
    if attrs.get("objectives") not in (None, space.metric_names) or \
            attrs.get("directions") not in (None, space.directions):
        raise ConfigError("objectives", space.metric_names, f"the objectives of study "
                          f"{summary.study_name!r}: {attrs.get('objectives')} "
                          f"{attrs.get('directions')}", space.source)


# ----------------------------------------------------------------------------- the controller


class Controller:
    def __init__(self, space: SearchSpace, *, storage: str, tracking_uri: str, study_name: str,
                 resume: bool, trials: int, parallel: int, address: str | None, progress: bool,
                 on_trial: Callable[[dict], None] | None = None):
        self.space = space
        self.storage = storage
        self.tracking_uri = tracking_uri
        self.study_name = study_name
        self.resume = resume
        self.target = trials
        self.parallel = parallel
        self.address = address
        self.show_progress = progress
        self.on_trial = on_trial
        self.source = space.hardware.source
        self.counts = {"complete": 0, "failed": 0, "pruned": 0}
        self.best: tuple[str, float, int] | None = None
        self.tracking_errors: list[str] = []
        self.in_flight: dict[int, _InFlight] = {}
        self.ran = 0
        self._ray_started = False
        self.pool = None
        self.tracker = None
        self.parent_run_id: str | None = None

    # ------------------------------------------------------------------ setup
    def _hardware(self) -> HardwareProfile | None:
        """The cost model's profile: the preset/YAML, or this host measured once (cached)."""
        hw = self.space.hardware
        if hw.kind == "host":
            from workloads.hostprofile import host_profile

            return host_profile()
        if hw.profile:
            return hw.load_profile(self.space.source)
        return None

    def trial_hardware(self, chips: int, slot: int = 0) -> tuple[HardwareProfile | None,
                                                                 HardwareProfile | None]:
        """(profile given to the worker, per-chip profile the cost model predicts with).

        `host`: the worker's share of this host (its cores), which `run_trial` splits over
        the trial's virtual chips exactly as `per_chip` does for the prediction.
        """
        if self.profile is None:
            return None, None
        from workloads.hostprofile import per_chip

        profile = self.profile
        if self.space.hardware.kind == "host":
            cores = len(self.pool.slot_cores[slot]) or 1
            profile = host_share(self.profile, cores, self.pool.total_cores)
        per_chip_profile = per_chip(profile, chips) if profile.measured else profile
        return profile, per_chip_profile

    def _open_study(self, exists: bool):
        import optuna

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        space = self.space
        study = optuna.create_study(storage=paths.open_optuna_storage(self.storage),
                                    study_name=self.study_name,
                                    sampler=space.make_sampler(), directions=space.directions,
                                    load_if_exists=exists)
        if not exists:   # (a resumed study was checked against the space by choose_study)
            for key, value in {"space": space.name, "hardware": space.hardware.label,
                               "source": self.source, "objectives": space.metric_names,
                               "directions": space.directions, "space_file": space.source,
                               "constraints": [c.text for c in space.constraints]}.items():
                study.set_user_attr(key, value)
        return study

    def _start_tracking(self):
        from sweeper.tracking import Tracker, experiment_name

        self.tracker = Tracker(self.tracking_uri)
        self.experiment = experiment_name(self.space.name, self.source)
        parent = self.study.user_attrs.get("mlflow_parent_run_id")
        same_store = self.study.user_attrs.get("tracking_uri") == self.tracking_uri
        if parent and same_store:
            try:
                self.tracker.resume_sweep(parent)
            except Exception:   # noqa: BLE001 - a deleted parent run: start a new one
                parent = None
        else:
            parent = None
        if parent is None:
            parent = self.tracker.start_sweep(self.space, self.study_name, self.storage)
            self.study.set_user_attr("mlflow_parent_run_id", parent)
            self.study.set_user_attr("tracking_uri", self.tracking_uri)
        self.parent_run_id = parent
        self.experiment_id = self.tracker.experiment_of(parent)

    def _start_pool(self):
        hw = self.space.hardware
        if hw.kind == "analytical":
            return LocalPool(self.parallel)
        import ray

        if not ray.is_initialized():
            kwargs: dict[str, Any] = {"include_dashboard": False, "log_to_driver": False,
                                      "logging_level": logging.WARNING}
            if self.address:
                check_ray_address(self.address)
                kwargs["address"] = self.address
                # Remote nodes import the project from here, installed or not.
                root = Path(__file__).resolve().parents[1]
                kwargs["runtime_env"] = {"py_modules": [str(root / "sweeper"), str(root / "workloads")]}
            try:
                ray.init(**kwargs)
            except (ConnectionError, TimeoutError, ValueError, RuntimeError) as err:
                if not self.address:
                    raise
                raise ConfigError("--address", self.address, f"the address of a running Ray "
                                  f"cluster, e.g. 10.0.0.1:6379 ({one_line(err)})") from None
            self._ray_started = True
        env = {paths.HOME_ENV: str(paths.sweeper_home(create=True))}
        return RayPool(hw.kind, self.parallel, self.space.resources, env=env)

    def _finished_before(self) -> int:
        """Trials of a resumed study that count toward `trials`; stale RUNNING ones -> FAIL."""
        import optuna

        done = 0
        for t in self.study.get_trials(deepcopy=False):
            if t.state == optuna.trial.TrialState.RUNNING:
                self.study._storage.set_trial_user_attr(t._trial_id, "reason", INTERRUPTED)
                self.study._storage.set_trial_user_attr(t._trial_id, "interrupted", True)
                self.study.tell(t.number, state=optuna.trial.TrialState.FAIL)
                continue
            if t.user_attrs.get("interrupted"):
                continue
            if t.state.is_finished():
                done += 1
                key = {"COMPLETE": "complete", "FAIL": "failed", "PRUNED": "pruned"}[t.state.name]
                self.counts[key] += 1
                if t.state.name == "COMPLETE" and t.user_attrs.get("feasible", True):
                    self._update_best(t.number, t.user_attrs.get("measurement") or {})
        return done

    # ------------------------------------------------------------------ running
    def run(self) -> SweepResult:
        import optuna

        start = time.monotonic()
        self.progress = ProgressLine(self.target, self.show_progress)
        status = "FINISHED"
        try:
            self.pool = self._start_pool()     # first: a bad --address creates no study or run
            self.study = self._open_study(self.resume)
            done_before = self._finished_before() if self.resume else 0
            self.remaining = max(0, self.target - done_before)
            self._start_tracking()
            # After Ray and git have forked their processes: measuring `host` imports JAX
            # (multithreaded) into this process.
            self.profile = self._hardware()
            if self.pool.shares_cores:
                print(f"sweeper: parallel {self.parallel} > {self.pool.total_cores} cores: "
                      "concurrent trials share cores and disturb each other's timings",
                      file=sys.stderr)
            self._loop()
        except BaseException as err:
            status = "FAILED" if isinstance(err, Exception) else "KILLED"
            for flight in list(self.in_flight.values()):
                self._record(flight.trial, optuna.trial.TrialState.FAIL, INTERRUPTED, flight.config,
                             flight.flat, None, flight.prediction, interrupted=True)
            self.in_flight.clear()
            raise
        finally:
            self.progress.close()
            self._close(status)
        return SweepResult(
            study=self.study, study_name=self.study_name, storage=self.storage,
            tracking_uri=self.tracking_uri, parent_run_id=self.parent_run_id,
            experiment=self.experiment, experiment_id=self.experiment_id, source=self.source,
            counts=self._study_counts(),
            pareto=pareto_rows(self.study, self.space),
            objectives=[(o.metric, o.direction) for o in self.space.objectives],
            searched=[p.name for p in self.space.params],
            elapsed_s=time.monotonic() - start, tracking_errors=self.tracking_errors)

    def _close(self, status: str) -> None:
        try:
            if self.pool is not None:
                self.pool.close()
        finally:
            try:
                if self.tracker is not None and self.parent_run_id:
                    self.tracker.finish_sweep(self.parent_run_id, self._study_counts(), status)
            except Exception as err:  # noqa: BLE001
                self.tracking_errors.append(one_line(err))
            if self._ray_started:
                import ray

                ray.shutdown()

    def _study_counts(self) -> dict[str, int]:
        counts = {"complete": 0, "failed": 0, "pruned": 0}
        names = {"COMPLETE": "complete", "FAIL": "failed", "PRUNED": "pruned"}
        for t in self.study.get_trials(deepcopy=False):
            if t.state.name in names:
                counts[names[t.state.name]] += 1
        return counts

    def _loop(self) -> None:
        asked = 0
        free = list(range(self.parallel))
        self._show()
        while True:
            while free and asked < self.remaining:
                asked += 1
                self._dispatch(free)
            if not self.in_flight:
                if asked >= self.remaining:
                    break
                continue
            now = time.monotonic()
            next_deadline = min(f.deadline for f in self.in_flight.values())
            wait = min(1.0, max(0.0, next_deadline - now))
            handles = [f.handle for f in self.in_flight.values()]
            for handle in self.pool.ready(handles, wait):
                flight = self.in_flight.pop(id(handle))
                if self._finish(flight):
                    free.append(flight.slot)
            now = time.monotonic()
            for key, flight in list(self.in_flight.items()):
                if now > flight.deadline:
                    del self.in_flight[key]
                    self.pool.discard(flight.handle)      # the worker is killed and replaced
                    self._fail(flight, f"timeout: still running after {self.space.timeout_s:g}s "
                                       "(timeout_s); its worker was restarted")
                    free.append(flight.slot)
            self._show()
        self._show()

    def _dispatch(self, free: list[int]) -> None:
        """Ask one point; prune it or start it on a free slot (removed from `free`)."""
        import optuna

        PRUNED = optuna.trial.TrialState.PRUNED
        trial = self.study.ask(self.space.distributions())
        flat = self.space.flat_params(trial.params)
        try:
            config = self.space.trial_config(trial.params)
        except ConfigError as err:
            self._record(trial, PRUNED, f"infeasible: {err}", None, flat, None, {})
            return
        flat = config.flat_params()
        slot = self._choose_slot(free, config.chips)
        hardware, chip_profile = self.trial_hardware(config.chips, slot)
        prediction: dict[str, float] = {}
        if chip_profile is not None:
            from workloads.costmodel import feasibility, predict

            budget = self.space.memory_budget_bytes if self.space.hardware.kind == "host" else None
            try:
                reason = feasibility(config, chip_profile, budget)
                prediction = predict(config, chip_profile).metrics()
            except ConfigError as err:
                reason = str(err)
            if reason:
                self._record(trial, PRUNED, f"infeasible: {reason}", config, flat, None, prediction)
                return
        free.remove(slot)
        # The analytical pool evaluates the per-chip profile; a worker gets the whole share.
        handle = self.pool.submit(slot, config, chip_profile if self.pool.local else hardware)
        self.in_flight[id(handle)] = _InFlight(trial, config, flat, prediction, hardware, slot,
                                               handle, time.monotonic() + self.space.timeout_s)

    def _choose_slot(self, free: list[int], chips: int) -> int:
        """A free slot whose worker already has this mesh (warm compile cache), else any."""
        for slot in free:
            if self.pool.warm_slot(slot, chips):
                return slot
        return free[0]

    def _finish(self, flight: _InFlight) -> bool:
        """Record a returned trial; False if it was resubmitted (the slot stays busy)."""
        import optuna

        try:
            outcome = self.pool.outcome(flight.handle)
        except WorkerLost as err:
            if flight.attempt < self.space.max_retries:
                flight.attempt += 1
                flight.handle = self.pool.submit(flight.slot, flight.config, flight.hardware)
                flight.deadline = time.monotonic() + self.space.timeout_s
                self.in_flight[id(flight.handle)] = flight
                return False
            self._fail(flight, f"worker died ({flight.attempt + 1} attempts): {err}")
            return True
        except TrialError as err:
            state = optuna.trial.TrialState.PRUNED if err.config_error else optuna.trial.TrialState.FAIL
            prefix = "infeasible: " if err.config_error else ""
            self._record(flight.trial, state, prefix + err.reason, flight.config, flight.flat,
                         None, flight.prediction)
            self.ran += 1
            return True
        self.ran += 1
        metrics = outcome.measurement.metrics()
        worker = dict(outcome.worker, started=outcome.started, finished=outcome.finished,
                      attempts=flight.attempt + 1)
        missing = [m for m in self.space.metric_names if not math.isfinite(metrics.get(m, math.nan))]
        if missing:
            self._record(flight.trial, optuna.trial.TrialState.FAIL, f"objective not reported: "
                         f"{', '.join(missing)}", flight.config, flight.flat, metrics,
                         flight.prediction, worker=worker, measurement_obj=outcome.measurement)
            return True
        self._record(flight.trial, optuna.trial.TrialState.COMPLETE, None, flight.config,
                     flight.flat, metrics, flight.prediction, worker=worker,
                     measurement_obj=outcome.measurement)
        return True

    def _fail(self, flight: _InFlight, reason: str) -> None:
        import optuna

        self.ran += 1
        self._record(flight.trial, optuna.trial.TrialState.FAIL, reason, flight.config, flight.flat,
                     None, flight.prediction)

    # ------------------------------------------------------------------ recording
    def _record(self, trial, state, reason: str | None, config, flat: dict, metrics: dict | None,
                prediction: dict, *, worker: dict | None = None,
                measurement_obj: Measurement | None = None, interrupted: bool = False) -> None:
        """user_attrs -> MLflow child run -> constraints -> tell (Optuna state last)."""
        # One hardware label per sweep (host, devices:<profile>, analytical:<profile>); what the
        # engine reported (e.g. the accelerator's device kind) is kept as `device`.
        hardware = self.space.hardware.label
        attrs: dict[str, Any] = {"flat_params": flat, "source": self.source, "hardware": hardware,
                                 "prediction": prediction, "measurement": metrics or {}}
        extra_tags: dict[str, str] = {}
        if measurement_obj is not None:
            attrs["device"] = measurement_obj.hardware
            extra_tags["device"] = str(measurement_obj.hardware)
        if config is not None:
            attrs["config"] = config.to_dict()
        if reason:
            attrs["reason"] = reason
        if worker:
            attrs["worker"] = worker
        if interrupted:
            attrs["interrupted"] = True
        values = None
        feasible = True
        if state.name == "COMPLETE":
            constraint_values = {c.text: c.value(metrics) for c in self.space.constraints}
            feasible = all(v <= 0 for v in constraint_values.values())
            attrs["constraints"] = constraint_values
            attrs["feasible"] = feasible
            for i, value in enumerate(constraint_values.values()):
                trial.set_constraint(str(i), value)
            values = [metrics[m] for m in self.space.metric_names]
        for key, value in attrs.items():
            trial.set_user_attr(key, value)
        try:
            run_id = self.tracker.log_trial(
                self.parent_run_id, self.experiment_id, number=trial.number, params=flat,
                metrics=metrics, prediction=prediction, state=state.name, reason=reason,
                source=self.source, hardware=hardware,
                extra_tags={**extra_tags, "feasible": str(feasible).lower()}
                if state.name == "COMPLETE" else extra_tags)
            trial.set_user_attr("mlflow_run_id", run_id)
        except Exception as err:  # noqa: BLE001 - tracking trouble must not lose the trial
            self.tracking_errors.append(one_line(err))
            trial.set_user_attr("mlflow_error", one_line(err))
            if len(self.tracking_errors) == 1:
                print(f"sweeper: MLflow logging failed (trials are still stored in Optuna): "
                      f"{one_line(err)}", file=sys.stderr)
        self.study.tell(trial, values=values, state=state)
        key = {"COMPLETE": "complete", "FAIL": "failed", "PRUNED": "pruned"}[state.name]
        if not interrupted:
            self.counts[key] += 1
        if state.name == "COMPLETE" and feasible:
            self._update_best(trial.number, metrics)
        if self.on_trial is not None:
            self.on_trial({"number": trial.number, "state": state.name, "reason": reason,
                           "params": flat, "metrics": metrics or {}, "worker": worker})

    def _update_best(self, number: int, metrics: dict) -> None:
        objective = self.space.objectives[0]
        value = metrics.get(objective.metric)
        if value is None or not math.isfinite(value):
            return
        better = (self.best is None or (value < self.best[1] if objective.direction == "minimize"
                                        else value > self.best[1]))
        if better:
            self.best = (objective.metric, value, number)

    def _show(self) -> None:
        c = self.counts
        self.progress.update(c["complete"], c["failed"], c["pruned"], len(self.in_flight),
                             self.best, self.ran)


# ----------------------------------------------------------------------------- Pareto rows

ROW_PARAMS = ("batch", "chips", "topology", "weights", "prefill_ffn", "prefill_attn", "decode_ffn",
              "decode_attn", "input_len", "decode_steps")


def pareto_rows(study, space: SearchSpace) -> list[dict[str, Any]]:
    """The non-dominated COMPLETE trials that meet every constraint, best first.

    Two objectives: `sweeper.pareto.pareto_front` (the same front `sweeper pareto` draws);
    otherwise Optuna's own `best_trials` (any number of objectives).
    """
    trials = [t for t in study.get_trials(deepcopy=False)
              if t.state.name == "COMPLETE" and t.user_attrs.get("feasible", True)]
    if not trials:
        return []
    metrics = space.metric_names
    numbers: list[int]
    if len(metrics) == 2:
        import pandas as pd

        from sweeper.pareto import pareto_front

        df = pd.DataFrame([{"number": t.number, **(t.user_attrs.get("flat_params") or {}),
                            metrics[0]: t.values[0], metrics[1]: t.values[1]} for t in trials])
        maximize = [o.metric for o in space.objectives if o.direction == "maximize"]
        phase = "prefill" if metrics[0].startswith("prefill") else "decode"
        numbers = [int(n) for n in pareto_front(df, metrics[0], metrics[1], phase=phase,
                                                maximize=maximize)["number"]]
    else:
        best = {t.number for t in study.best_trials}
        ordered = sorted((t for t in trials if t.number in best),
                         key=lambda t: t.values[0] * (1 if space.directions[0] == "minimize" else -1))
        numbers = [t.number for t in ordered]
    by_number = {t.number: t for t in trials}
    rows, seen = [], set()
    for number in numbers:
        t = by_number[number]
        flat = t.user_attrs.get("flat_params") or {}
        key = tuple(sorted((k, str(v)) for k, v in flat.items()))
        if key in seen:      # the sampler revisited a point: list each configuration once
            continue
        seen.add(key)
        row: dict[str, Any] = {"number": number}
        row.update({m: v for m, v in zip(metrics, t.values)})
        row.update({k: flat.get(k) for k in ROW_PARAMS})
        row["mlflow_run_id"] = t.user_attrs.get("mlflow_run_id")
        rows.append(row)
    return rows


# ----------------------------------------------------------------------------- entry point


def run_sweep(space: SearchSpace | str | os.PathLike, *, storage: str | None = None,
              tracking_uri: str | None = None, study_name: str | None = None, resume: bool = False,
              trials: int | None = None, parallel: int | None = None, address: str | None = None,
              progress: bool = True, on_trial: Callable[[dict], None] | None = None) -> SweepResult:
    """Run (or resume) a sweep; returns counts, the Pareto trials and where everything is.

    Bad input (space file, arguments, a study name clash) raises ConfigError before Ray,
    Optuna's storage or MLflow are touched, apart from listing the studies that exist.
    """
    space = load_space(space if not isinstance(space, os.PathLike) else str(space))
    if trials is not None:
        _positive(trials, "--trials")
    if parallel is not None:
        _positive(parallel, "--parallel")
    if study_name is not None and not study_name.strip():
        raise ConfigError("--study", study_name, "a non-empty study name")
    target = trials if trials is not None else space.planned_trials()
    if space.sampler.type == "grid":
        target = min(target, space.grid_size())
    storage = storage or paths.default_storage()
    tracking_uri = tracking_uri or paths.default_tracking_uri()
    name, exists = choose_study(space, storage, study_name, resume)
    controller = Controller(space, storage=storage, tracking_uri=tracking_uri, study_name=name,
                            resume=exists, trials=target,
                            parallel=parallel if parallel is not None else space.parallel,
                            address=address, progress=progress, on_trial=on_trial)
    return controller.run()
