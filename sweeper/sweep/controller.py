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
run.

Each Optuna trial carries user_attrs: `config` (TrialConfig.to_dict()), `flat_params`,
`measurement` (Measurement.metrics()), `prediction` (the cost model's, also for measured
trials), `source`, `hardware`, `reason`, `worker` (pid, Ray node id and IP, the resources
it held, cores, slot, start/end time, cache stats, attempts; written as soon as the worker
is up, so a running trial shows where it runs), `worker_lost` (earlier attempts whose
worker died), `constraints`, `mlflow_run_id`, `outcome` (the state being recorded),
`retry_of` (the interrupted trial it re-runs). Storage is an Optuna RDB (SQLite under
$SWEEPER_HOME by default), so `--resume` continues a study and Optuna's own tools
(optuna-dashboard, `optuna.load_study`) read it.

What happens when things fail (docs/architecture.md "Reliability"; each case has a test that injects it):

- A trial raises: FAIL with `Type: message` as its reason; the sweep goes on.
- Its worker process dies (crash, OOM, kill -9, node lost): the trial runs again on a
  fresh worker of the same slot, up to `max_retries` times (`worker_lost` lists the dead
  attempts), then FAIL with reason `worker died: N attempts ...`. Nothing is logged to
  MLflow for a dead attempt: a trial has one child run, written when it finishes.
- Past `timeout_s`: its worker is killed and replaced, FAIL with reason `timeout: ...`.
- The controller dies: every trial is recorded in Optuna (attrs, then MLflow, then tell)
  as it finishes, so completed trials survive. `--resume` tells trials that were fully
  recorded but not yet told, marks the ones left running FAIL (`interrupted`), enqueues
  their parameters again (`retry_of`), reuses the MLflow parent run and reconciles the
  child runs (`sweeper.tracking.sync`). A study whose controller is alive cannot be resumed twice
  (`sweeper.sweep.lease`).
- Every Ray node is gone (the local raylet killed): seen within seconds (`_check_cluster`);
  in-flight trials are recorded `interrupted` with that reason (re-run by `--resume`), the
  orphaned workers killed, and `ClusterLost` ends the sweep (`sweeper run` exits 3).
- MLflow is unreachable: trials are still told to Optuna (attr `mlflow_error`);
  `sweeper.tracking.link` backs off, backfills every missing run when MLflow answers
  again, and at the end of the sweep tries once more, else prints the `sweeper sync`
  command to run later.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import math
import os
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import pandas as pd

from sweeper import paths
from sweeper.analysis.pareto import pareto_front
from sweeper.formatting import one_line
from sweeper.sweep import lease, stopping
from sweeper.sweep.progress import ProgressLine
from sweeper.sweep.space import MAX_CHECKED_POINTS, SearchSpace, load_space
from sweeper.sweep.workers import (ClusterLost, LocalPool, RayPool, TrialError, WorkerLost,
                                   WorkerPool)
from sweeper.tracking.link import TrackingLink
from sweeper.tracking.mlflow_log import experiment_name
from sweeper.tracking.study import mlflow_run_ids, study_counts
from workloads.config import ConfigError, HardwareProfile
from workloads.costmodel import feasibility, predict
from workloads.hardware import chip_share, load_hardware, per_chip, worker_share
from workloads.hostprofile import physical_memory_bytes
from workloads.metrics import Measurement
from workloads.trial import TrialConfig

log = logging.getLogger(__name__)
INTERRUPTED = "interrupted: the controller stopped before this trial finished"
STATE_KEYS = {"COMPLETE": "complete", "FAIL": "failed", "PRUNED": "pruned"}
# Memory of an emulated trial (measured, issue 15: tiny model on 1 virtual chip, batch 2,048
# to 16,384, `memory_analysis()` of the compiled programs and the worker's RSS high water):
# XLA CPU holds 1.95-1.97x the cost model's per-chip peak (arguments, outputs and temporaries
# are separate host buffers) plus ~0.4 GiB per worker process (JAX and its compiled programs).
EMULATED_MEMORY_FACTOR = 2.0
EMULATED_PROCESS_BYTES = 0.4 * 2**30
EMULATED_NOTE = (f" (emulated mesh: the budget is the host's share less "
                 f"{EMULATED_PROCESS_BYTES / 2**30:.1f} GiB per process, divided by "
                 f"{EMULATED_MEMORY_FACTOR:g}, what XLA CPU allocates per byte the model counts)")


def emulated_budget(budget_per_chip: float, chips: int) -> float:
    """The cost model's per-chip memory budget that leaves room for what XLA CPU allocates."""
    return max(0.0, (budget_per_chip - EMULATED_PROCESS_BYTES / chips) / EMULATED_MEMORY_FACTOR)


def check_memory_fits(space: SearchSpace) -> None:
    """ConfigError when no point of a `host` space fits in this machine's memory (checked
    before Ray starts on every grid point, for a grid of at most MAX_CHECKED_POINTS and no
    log ranges; else on the point with every searched value at its smallest)."""
    if space.hardware.kind != "host":
        return
    names = [p.name for p in space.params]
    if space.params and (any(p.log for p in space.params) or space.grid_size() > MAX_CHECKED_POINTS):
        # numbers at their smallest (least memory); every choice of a layout or a name
        grids = [[p.low] if p.choices is None else
                 [min(p.choices, key=_order)] if all(_number(c) for c in p.choices) else
                 list(p.choices) for p in space.params]
        if math.prod(len(g) for g in grids) > MAX_CHECKED_POINTS:
            return
    else:
        grids = [p.grid_values() for p in space.params]
    memory = physical_memory_bytes()
    first = None
    for values in itertools.product(*grids):
        try:
            config = space.trial_config(dict(zip(names, values)))
        except ConfigError:
            continue
        # only the byte counts of the prediction are used: any profile's speeds will do
        profile = dataclasses.replace(load_hardware("tpu-v4"), hbm_bytes=memory / config.chips)
        budget = emulated_budget(profile.hbm_bytes, config.chips)   # real memory only
        reason = feasibility(config, profile, budget)
        if reason is None or not reason.startswith("memory"):
            return
        first = first or reason
    if first is not None:
        raise ConfigError("space", space.name, f"a space with a point that fits in this host's "
                          f"memory; none does, e.g. {first}{EMULATED_NOTE}", space.source)


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _order(value: Any) -> Any:
    return (0, value) if isinstance(value, (int, float)) else (1, str(value))


CLUSTER_CHECK_S = 3.0      # how often the controller asks Ray which nodes are alive
PLACE_GRACE_S = 10.0       # a worker not started by then may be waiting on idle workers
SHUTDOWN_WAIT_S = 30.0     # at most this long for ray.shutdown() when a sweep ends


@contextlib.contextmanager
def signals_deferred():
    """SIGTERM and SIGINT wait until the block (ray.init) has returned, then reach the
    caller's handlers (the CLI's: stop cleanly, exit 143 / 130).

    Interrupted half-way, ray.init leaves a core worker that crashes the process at exit
    (SIGSEGV or abort instead of 143, seen with a SIGTERM 10-11 s into a sweep); and it
    replaces the driver's SIGTERM handler with its own sys.exit(15) (a traceback, exit 15),
    which is kept from being installed here and the caller's put back after."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    # Ray's core worker installs a C++ failure handler (absl) for SIGTERM too while it
    # connects: a SIGTERM then printed a stack dump and the process ended in abort (-6).
    # Without it the signal reaches the handler below. (Inherited by the Ray processes
    # started here: their C++ crash stacks are not written to Ray's logs; set the variable
    # to 0 to keep them.)
    os.environ.setdefault("RAY_DISABLE_FAILURE_SIGNAL_HANDLER", "1")
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    pending: list[int] = []
    for sig in previous:
        signal.signal(sig, lambda signum, _frame: pending.append(signum))
    try:
        import ray._private.utils as ray_utils    # lazy: Ray (~1 s)
    except ImportError:
        ray_utils = None
    set_sigterm = getattr(ray_utils, "set_sigterm_handler", None)
    if set_sigterm is not None:
        ray_utils.set_sigterm_handler = lambda handler: None
    try:
        yield
    finally:
        if set_sigterm is not None:
            ray_utils.set_sigterm_handler = set_sigterm
        for sig, handler in previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
    if pending and callable(previous[pending[0]]):
        previous[pending[0]](pending[0], None)     # raises: the stop the caller asked for


def shutdown_ray(wait_s: float = SHUTDOWN_WAIT_S) -> bool:
    """ray.shutdown(), waited for at most `wait_s`; False when it did not return in time.

    Everything is recorded before it is called, and a stopped sweep must exit: a shutdown
    that waits on a lost node or a control store that stopped answering is left behind
    (in a daemon thread; the process exits without it, and the OS ends its children)."""
    import ray   # lazy: Ray (~1 s) only where a pool or cluster is used

    done = threading.Event()

    def shutdown() -> None:
        try:
            ray.shutdown()
        except Exception:  # noqa: BLE001 - a Ray half started or already gone: nothing to end
            pass
        finally:
            done.set()

    threading.Thread(target=shutdown, name="ray-shutdown", daemon=True).start()
    if done.wait(wait_s):
        return True
    print(f"sweeper: Ray did not shut down within {wait_s:g}s; leaving it (every trial is "
          "recorded)", file=sys.stderr)
    return False


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
    interrupted: int = 0                 # of `failed`: left running by a controller that died
    mlflow_missing: int = 0              # finished trials with no MLflow run yet (sweeper sync)

    def to_json(self) -> dict[str, Any]:
        return {"study": self.study_name, "trials_complete": self.counts["complete"],
                "trials_failed": self.counts["failed"], "trials_pruned": self.counts["pruned"],
                "trials_interrupted": self.interrupted,
                "pareto": self.pareto, "parent_run_id": self.parent_run_id,
                "tracking_uri": self.tracking_uri, "storage": self.storage,
                "experiment": self.experiment, "experiment_id": self.experiment_id,
                "source": self.source, "mlflow_missing": self.mlflow_missing,
                "tracking_errors": len(self.tracking_errors),
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
    placement: dict | None = None        # where the current attempt's worker runs
    lost: list[dict] = field(default_factory=list)   # earlier attempts whose worker died
    submitted: float = field(default_factory=time.monotonic)   # this attempt's, monotonic


@dataclass
class TrialRecord:
    """What the controller stores on a trial it ends (its Optuna user attrs; MLflow logs the
    same through sweeper/tracking/mlflow_log.trial_run_fields)."""

    flat_params: dict[str, Any]          # TrialConfig.FLAT_PARAMS
    source: str                          # measured | analytical
    hardware: str                        # the sweep's hardware label
    prediction: dict[str, float]         # the cost model's metrics (per-chip profile)
    measurement: dict[str, float]        # what the worker reported ({} if it did not run)
    outcome: str                         # COMPLETE | PRUNED | FAIL: stored last
    device: str | None = None            # what the engine reported it ran on
    config: dict | None = None           # TrialConfig.to_dict()
    reason: str | None = None            # why PRUNED / FAIL
    worker: dict | None = None           # placement of the worker that ran it
    interrupted: bool = False            # Ctrl-C / lost controller: run again on --resume
    constraints: dict[str, float] | None = None   # COMPLETE: each constraint's value (<= 0 met)
    feasible: bool | None = None         # COMPLETE: every constraint met

    def user_attrs(self) -> dict[str, Any]:
        """The attrs to store, `outcome` last: with it stored, `--resume` tells the trial."""
        attrs: dict[str, Any] = {"flat_params": self.flat_params, "source": self.source,
                                 "hardware": self.hardware, "prediction": self.prediction,
                                 "measurement": self.measurement}
        optional = {"device": self.device, "config": self.config, "reason": self.reason,
                    "worker": self.worker, "interrupted": self.interrupted or None,
                    "constraints": self.constraints, "feasible": self.feasible}
        attrs.update({k: v for k, v in optional.items() if v is not None})
        attrs["outcome"] = self.outcome
        return attrs


def _positive(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(name, value, "a positive integer")
    return value


# ----------------------------------------------------------------------------- study naming


def _study_summaries(storage: str):
    db = paths.sqlite_path(storage)
    if db is not None and not db.exists():
        return []          # nothing to list; do not create the database just to look
    import optuna   # lazy: Optuna + SQLAlchemy take ~1 s; bad input exits first

    try:
        return optuna.study.get_all_study_summaries(paths.open_optuna_storage(storage),
                                                    include_best_trial=False)
    except Exception as err:  # noqa: BLE001 - a bad URL, an unreachable database server
        raise ConfigError("--storage", storage, f"a reachable Optuna RDB storage "
                          f"({one_line(err)[:300]})") from None


def check_ray_address(address: str, timeout_s: float = 5.0) -> None:
    """Fail fast on an address nothing listens on (ray.init would retry for minutes)."""
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
            _check_resumable(space, existing[study_name], storage)
        return study_name, study_name in existing
    if resume:
        mine = [s for s in summaries if s.user_attrs.get("space") == space.name
                and s.user_attrs.get("hardware") == space.hardware.label]
        if not mine:
            raise ConfigError("--resume", space.name, f"a space with a study in {storage} to "
                              "resume (none found; run without --resume to start one)")
        latest = max(mine, key=lambda s: (s.datetime_start or 0, s._study_id))
        _check_resumable(space, latest, storage)
        return latest.study_name, True
    return _free_name(f"{space.name}-{time.strftime('%Y%m%d-%H%M%S')}", existing), False


def _free_name(base: str, taken) -> str:
    name, i = base, 1
    while name in taken:
        i += 1
        name = f"{base}-{i}"
    return name


def _check_resumable(space: SearchSpace, summary, storage: str) -> None:
    """A study continues only with the hardware, objectives and parameter values it was
    started with, and only when no live controller is running it."""
    attrs = summary.user_attrs
    if attrs.get("hardware") not in (None, space.hardware.label):
        raise ConfigError("hardware", space.hardware.label, f"{attrs['hardware']!r}, the hardware "
                          f"study {summary.study_name!r} was run on", space.source)
    if attrs.get("objectives") not in (None, space.metric_names) or \
            attrs.get("directions") not in (None, space.directions):
        raise ConfigError("objectives", space.metric_names, f"the objectives of study "
                          f"{summary.study_name!r}: {attrs.get('objectives')} "
                          f"{attrs.get('directions')}", space.source)
    lease.check_free(attrs, summary.study_name, "--resume")
    _check_same_params(space, summary.study_name, storage)


def _check_same_params(space: SearchSpace, study_name: str, storage: str) -> None:
    """Each searched parameter keeps the kind of values (and a categorical its choices) its
    trials were asked with: Optuna's samplers cannot read old trials under changed choices
    (a ValueError in the middle of the resumed sweep, RUNNING trials left behind)."""
    import optuna   # lazy: Optuna + SQLAlchemy take ~1 s; bad input exits first

    study = optuna.load_study(study_name=study_name, storage=paths.open_optuna_storage(storage))
    asked: dict[str, Any] = {}
    for t in study.get_trials(deepcopy=False):
        for name, distribution in t.distributions.items():
            asked.setdefault(name, distribution)
    for name, new in space.distributions().items():
        old = asked.get(name)
        if old is None:
            continue
        try:
            optuna.distributions.check_distribution_compatibility(old, new)
        except ValueError:
            raise ConfigError(f"params.{name}", _values(new), f"the values study {study_name!r} "
                              f"was run with, {_values(old)} (start a new study for a changed "
                              "space)", space.source) from None


def _values(distribution) -> Any:
    choices = getattr(distribution, "choices", None)
    if choices is not None:
        return list(choices)
    return f"{type(distribution).__name__}({distribution.low}..{distribution.high})"


# ----------------------------------------------------------------------------- the controller


class Controller:
    def __init__(self, space: SearchSpace, *, storage: str, tracking_uri: str, study_name: str,
                 resume: bool, trials: int, parallel: int, address: str | None, progress: bool,
                 on_trial: Callable[[dict], None] | None = None, generated_name: bool = False):
        self.space = space
        self.storage = storage
        self.tracking_uri = tracking_uri
        self.study_name = study_name
        self.generated_name = generated_name     # a clash with a concurrent sweep: pick another
        self.resume = resume
        self.target = trials
        self.parallel = parallel
        self.address = address
        self.show_progress = progress
        self.on_trial = on_trial
        self.source = space.hardware.source
        self.counts = {"complete": 0, "failed": 0, "pruned": 0}
        self.best: tuple[str, float, int] | None = None
        self.in_flight: dict[int, _InFlight] = {}
        self.ran = 0
        self.interrupted = 0
        self.retry_params: list[tuple[int, dict]] = []   # interrupted trials to run again
        self._ray_started = False
        self.pool: WorkerPool | None = None
        self.study = None
        self.lease: dict | None = None
        self.tracking: TrackingLink | None = None
        self.experiment = experiment_name(space.name, self.source)
        self._next_heartbeat = 0.0
        self._next_cluster_check = 0.0

    # ------------------------------------------------------------------ setup
    def _hardware(self) -> HardwareProfile | None:
        """The cost model's profile: the preset/YAML, or this host measured once (cached)."""
        return self.space.hardware.resolve(self.space.source)

    def trial_hardware(self, chips: int, slot: int = 0) -> tuple[HardwareProfile | None,
                                                                 HardwareProfile | None, float]:
        """(profile given to the worker, per-chip profile the cost model predicts with, the
        share of the profile one chip of the trial gets).

        `host`: the worker's share of this host (its cores), which `run_trial` splits over
        the trial's virtual chips exactly as `per_chip` does for the prediction.
        """
        if self.profile is None:
            return None, None, 1.0
        share = 1.0
        if self.space.hardware.kind == "host":
            cores = len(self.pool.slot_cores[slot]) or 1
            share = worker_share(cores, self.pool.total_cores)
        profile = self.profile.scaled(share)
        return profile, per_chip(self.profile, chips, share), chip_share(self.profile, chips, share)

    def _open_study(self, exists: bool):
        import optuna   # lazy: Optuna + SQLAlchemy take ~1 s; bad input exits first

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        space = self.space
        base = self.study_name
        while True:
            try:
                study = optuna.create_study(storage=paths.open_optuna_storage(self.storage),
                                            study_name=self.study_name,
                                            sampler=space.make_sampler(),
                                            directions=space.directions, load_if_exists=exists)
                break
            except optuna.exceptions.DuplicatedStudyError:
                # Another sweep created this name since choose_study looked (two sweeps of
                # one space started in the same second): a generated name moves on.
                if not self.generated_name:
                    raise ConfigError("--study", self.study_name, "a new study name (another "
                                      "sweep has just created this one), or --resume") from None
                self.study_name = _free_name(base, set(_names(self.storage)))
        if not exists:   # (a resumed study was checked against the space by choose_study)
            for key, value in {"space": space.name, "hardware": space.hardware.label,
                               "source": self.source, "objectives": space.metric_names,
                               "directions": space.directions, "space_file": space.source,
                               "constraints": [c.text for c in space.constraints]}.items():
                study.set_user_attr(key, value)
        return study

    def _start_pool(self) -> WorkerPool:
        hw = self.space.hardware
        if hw.kind == "analytical":
            return LocalPool(self.parallel)
        import ray   # lazy: Ray (~1 s) only where a pool or cluster is used

        if not ray.is_initialized():
            kwargs: dict[str, Any] = {"include_dashboard": False, "log_to_driver": False,
                                      "logging_level": logging.WARNING}
            if not self.address and not os.environ.get("RAY_ADDRESS"):
                # a new local cluster: ray.init() would join any cluster `ray start` left on
                # this machine (another user's sweep), whose node this sweep does not own
                kwargs["address"] = "local"
            if self.address:
                kwargs["address"] = self.address
                # Remote nodes import the project from here, installed or not.
                root = Path(__file__).resolve().parents[2]
                kwargs["runtime_env"] = {"py_modules": [str(root / "sweeper"), str(root / "workloads")]}
            self._ray_started = True
            try:
                with signals_deferred():
                    ray.init(**kwargs)
            except Exception as err:  # noqa: BLE001 - Ray raises a bare Exception on a timeout
                if not self.address:      # (a loaded machine): one line, no study created
                    raise ClusterLost(f"the local Ray cluster did not start "
                                      f"({one_line(err)[:200]}); try again") from None
                raise ConfigError("--address", self.address, f"the address of a running Ray "
                                  f"cluster, e.g. 10.0.0.1:6379 ({one_line(err)})") from None
        env = {paths.HOME_ENV: str(paths.sweeper_home(create=True))}
        return RayPool(hw.kind, self.parallel, self.space.resources, env=env,
                       verify=self.space.verify)

    def _finished_before(self) -> int:
        """Trials of a resumed study that count toward `trials`.

        A RUNNING trial was left by a controller that died: if it had been fully recorded
        (`outcome` stored) it is told now with its result; otherwise it is FAIL
        (`interrupted`, not counted) and its parameters are queued to run again.
        """
        import optuna   # lazy: Optuna + SQLAlchemy take ~1 s; bad input exits first

        TrialState = optuna.trial.TrialState
        trials = self.study.get_trials(deepcopy=False)
        retried = {t.user_attrs.get("retry_of") for t in trials}
        done = 0
        for t in trials:
            attrs = t.user_attrs
            state = t.state
            if state == TrialState.RUNNING:
                state = self._tell_recorded(t)
                if state is None:
                    self.study._storage.set_trial_user_attr(t._trial_id, "reason", INTERRUPTED)
                    self.study._storage.set_trial_user_attr(t._trial_id, "interrupted", True)
                    self.study.tell(t.number, state=TrialState.FAIL)
                    attrs = {**attrs, "interrupted": True}
            if attrs.get("interrupted"):
                self.interrupted += 1
                if t.number not in retried:
                    self.retry_params.append((t.number, dict(t.params)))
                continue
            if state.is_finished():
                done += 1
                self.counts[STATE_KEYS[state.name]] += 1
                if state.name == "COMPLETE" and attrs.get("feasible", True):
                    self._update_best(t.number, attrs.get("measurement") or {})
        return done

    def _tell_recorded(self, t):
        """Tell a trial whose record was complete when its controller died; its state or None."""
        import optuna   # lazy: Optuna + SQLAlchemy take ~1 s; bad input exits first

        outcome = t.user_attrs.get("outcome")
        if outcome not in STATE_KEYS:
            return None
        state = optuna.trial.TrialState[outcome]
        values = None
        if outcome == "COMPLETE":
            measured = t.user_attrs.get("measurement") or {}
            values = [measured.get(m) for m in self.space.metric_names]
            if not all(isinstance(v, (int, float)) and math.isfinite(v) for v in values):
                return None
        self.study.tell(t.number, values=values, state=state)
        return state

    def _enqueue_retries(self) -> None:
        """Interrupted trials run again first, with the same parameters (`retry_of`)."""
        searched = set(self.space.distributions())
        for number, params in self.retry_params[:self.remaining]:
            # (the controller asks every parameter at once; a trial without them has no point)
            if searched and set(params) >= searched:
                self.study.enqueue_trial(params, user_attrs={"retry_of": number})

    # ------------------------------------------------------------------ running
    def run(self) -> SweepResult:
        import optuna   # lazy: Optuna + SQLAlchemy take ~1 s; bad input exits first

        start = time.monotonic()
        self.progress = ProgressLine(self.target, self.show_progress)
        status = "finished"
        try:
            self.pool = self._start_pool()     # first: a bad --address creates no study or run
            self.study = self._open_study(self.resume)
            self.lease = lease.claim(self.study)
            done_before = self._finished_before() if self.resume else 0
            self.remaining = max(0, self.target - done_before)
            self._enqueue_retries()
            self.tracking = TrackingLink(self.tracking_uri, space=self.space, study=self.study,
                                         study_name=self.study_name, storage=self.storage,
                                         resumed=self.resume)
            self.tracking.start()
            # After Ray and git have forked their processes: measuring `host` imports JAX
            # (multithreaded) into this process.
            self.profile = self._hardware()
            if self.pool.shares_cores:
                print(f"sweeper: parallel {self.parallel} > {self.pool.total_cores} cores: "
                      "concurrent trials share cores and disturb each other's timings",
                      file=sys.stderr)
            self._loop()
        except BaseException as err:
            status = "failed" if isinstance(err, Exception) else "killed"
            reason = INTERRUPTED
            if isinstance(err, ClusterLost):
                reason = f"interrupted: {err}"
                if self.pool is not None:     # (None: the local Ray did not start)
                    self.pool.kill_orphans()  # no raylet is left to stop them
            for flight in list(self.in_flight.values()):
                self._record(flight.trial, optuna.trial.TrialState.FAIL, reason, flight.config,
                             flight.flat, None, flight.prediction, interrupted=True)
            self.in_flight.clear()
            raise
        finally:
            self.progress.close()
            self._close(status)
        tracking = self.tracking
        return SweepResult(
            study=self.study, study_name=self.study_name, storage=self.storage,
            tracking_uri=self.tracking_uri, parent_run_id=tracking.parent_run_id,
            experiment=self.experiment, experiment_id=tracking.experiment_id, source=self.source,
            counts=self._study_counts(),
            pareto=pareto_rows(self.study, self.space),
            objectives=[(o.metric, o.direction) for o in self.space.objectives],
            searched=[p.name for p in self.space.params],
            elapsed_s=time.monotonic() - start, tracking_errors=tracking.errors,
            interrupted=self.interrupted, mlflow_missing=len(tracking.unlogged))

    def _close(self, status: str) -> None:
        try:
            if self.pool is not None:
                self.pool.close()
        finally:
            try:
                if self.tracking is not None:
                    self.tracking.finish(status, self._study_counts)
            finally:
                try:
                    if self.study is not None and self.lease is not None:
                        lease.release(self.study, self.lease, status)
                except Exception as err:  # noqa: BLE001 - the trials are stored; say so only
                    if status == "finished":   # (else the error that stopped the sweep says why)
                        print(f"sweeper: could not release study {self.study_name!r} "
                              f"({one_line(err)[:200]})", file=sys.stderr)
                finally:
                    if self._ray_started:
                        shutdown_ray()

    def _study_counts(self) -> dict[str, int]:
        return study_counts(self.study)

    def _loop(self) -> None:
        asked = 0
        free = list(range(self.parallel))
        self._show()
        while True:
            stopping.raise_if_requested()     # a signal whose exception Python dropped
            waiting = self._waiting_for_a_worker(free)
            while free and asked < self.remaining and not waiting:
                asked += 1
                self._dispatch(free)
            if not self.in_flight:
                if asked >= self.remaining:
                    break
                continue
            now = time.monotonic()
            next_deadline = min(f.deadline for f in self.in_flight.values())
            wait = min(0.5, max(0.0, next_deadline - now))
            handles = [f.handle for f in self.in_flight.values()]
            for handle in self.pool.ready(handles, wait):
                flight = self.in_flight.pop(id(handle))
                if self._finish(flight):
                    free.append(flight.slot)
            self._note_placements()
            self._check_cluster()
            now = time.monotonic()
            for key, flight in list(self.in_flight.items()):
                if now > flight.deadline:
                    del self.in_flight[key]
                    placement = flight.placement or self.pool.placement(flight.handle, 1.0)
                    self.pool.discard(flight.handle)      # the worker is killed and replaced
                    worker = {**(placement or {}), "attempts": flight.attempt + 1,
                              "killed": "timeout"}
                    if flight.lost:
                        worker["lost"] = flight.lost
                    self._fail(flight, f"timeout: still running after {self.space.timeout_s:g}s "
                                       "(timeout_s); its worker was restarted", worker)
                    free.append(flight.slot)
            self._heartbeat()
            self._show()
        self._show()

    def _waiting_for_a_worker(self, free: list[int]) -> bool:
        """True while a trial has waited more than PLACE_GRACE_S for its worker to start,
        which Ray cannot place because idle workers of free slots hold the resources it
        needs (a node was lost: a retried trial asks for a `slice` that only the survivor
        has, held by the worker another slot keeps for its next trial). Those idle workers
        are released and no new trial is started until it has its worker: the retried
        trial goes first, and the sweep goes on at the parallelism the cluster has left."""
        release = getattr(self.pool, "release_slot", None)
        if release is None or not free:
            return False
        now = time.monotonic()
        if not any(f.placement is None and now - f.submitted > PLACE_GRACE_S
                   for f in self.in_flight.values()):
            return False
        for slot in free:
            release(slot)
        return True

    def _check_cluster(self, now: bool = False) -> None:
        """ClusterLost when Ray counts no node alive (every few seconds, and at once when a
        worker died): waiting for the trials' timeouts would record them FAIL `timeout`,
        which is false and not re-run by --resume. While some node is alive, a trial whose
        worker's node died runs again on another (its retry)."""
        alive_nodes = getattr(self.pool, "alive_nodes", None)
        if alive_nodes is None or (not now and time.monotonic() < self._next_cluster_check):
            return
        self._next_cluster_check = time.monotonic() + CLUSTER_CHECK_S
        try:
            alive = alive_nodes()
        except Exception as err:  # noqa: BLE001 - the control store itself is gone
            raise ClusterLost(f"the Ray cluster stopped answering ({one_line(err)[:150]})") from None
        if not alive:
            raise ClusterLost("the Ray node running the sweep was lost (no node alive)")

    def _note_placements(self) -> None:
        """Record where each running trial's worker is, as soon as the worker is up."""
        for flight in self.in_flight.values():
            if flight.placement is None:
                placement = self.pool.placement(flight.handle)
                if placement:
                    flight.placement = placement
                    flight.trial.set_user_attr("worker", {**placement, "running": True,
                                                          "attempts": flight.attempt + 1})

    def _heartbeat(self) -> None:
        now = time.monotonic()
        if now >= self._next_heartbeat:
            self._next_heartbeat = now + lease.HEARTBEAT_S
            if self.lease is not None:
                lease.heartbeat(self.study, self.lease)

    def _dispatch(self, free: list[int]) -> None:
        """Ask one point; prune it or start it on a free slot (removed from `free`)."""
        import optuna   # lazy: Optuna + SQLAlchemy take ~1 s; bad input exits first

        PRUNED = optuna.trial.TrialState.PRUNED
        trial = self.study.ask(self.space.distributions())
        flat = self.space.flat_params(trial.params)
        try:
            config = self.space.trial_config(trial.params)
        except ConfigError as err:
            self._record(trial, PRUNED, f"infeasible: {err}", None, flat, None, {})
            return
        flat = config.flat_params()
        slot = self._choose_slot(free, config.chips, config.hosts)
        hardware, chip_profile, share = self.trial_hardware(config.chips, slot)
        # recorded so calibration reads the share the prediction used (docs/architecture.md)
        trial.set_user_attr("hardware_share", share)
        prediction: dict[str, float] = {}
        if chip_profile is not None:
            budget = None
            if self.space.hardware.kind == "host":
                # the space's memory_budget_bytes is compared with the cost model as stated;
                # the default (the host's memory) leaves room for what XLA CPU allocates
                budget = self.space.memory_budget_bytes or emulated_budget(chip_profile.hbm_bytes,
                                                                          config.chips)
            try:
                reason = feasibility(config, chip_profile, budget)
                if reason and not self.space.memory_budget_bytes and budget is not None and \
                        reason.startswith("memory"):
                    reason += EMULATED_NOTE
                prediction = predict(config, chip_profile).metrics()
            except ConfigError as err:
                reason = str(err)
            if reason:
                self._record(trial, PRUNED, f"infeasible: {reason}", config, flat, None, prediction)
                return
        free.remove(slot)
        # The analytical pool evaluates the per-chip profile; a worker gets the whole share.
        hardware = chip_profile if self.pool.local else hardware
        try:
            handle = self.pool.submit(slot, config, hardware, trial.number)
        except BaseException:     # Ctrl-C or a pool failure: the trial did not run
            self._record(trial, optuna.trial.TrialState.FAIL, INTERRUPTED, config, flat, None,
                         prediction, interrupted=True)
            raise
        self.in_flight[id(handle)] = _InFlight(trial, config, flat, prediction, hardware, slot,
                                               handle, time.monotonic() + self.space.timeout_s)

    def _choose_slot(self, free: list[int], chips: int, hosts: int = 1) -> int:
        """A free slot whose worker already has this mesh (warm compile cache), else any."""
        for slot in free:
            if self.pool.warm_slot(slot, chips, hosts):
                return slot
        return free[0]

    def _finish(self, flight: _InFlight) -> bool:
        """Record a returned trial; False if it was resubmitted (the slot stays busy)."""
        import optuna   # lazy: Optuna + SQLAlchemy take ~1 s; bad input exits first

        try:
            outcome = self.pool.outcome(flight.handle)
        except WorkerLost as err:
            self.in_flight[id(flight.handle)] = flight    # recorded interrupted if the
            self._check_cluster(now=True)                 # whole cluster is gone
            del self.in_flight[id(flight.handle)]
            flight.lost.append({**(flight.placement or {}), "attempt": flight.attempt + 1,
                                "reason": str(err)})
            if flight.attempt < self.space.max_retries:
                flight.attempt += 1
                flight.trial.set_user_attr("worker_lost", flight.lost)
                flight.handle = self.pool.submit(flight.slot, flight.config, flight.hardware,
                                                 flight.trial.number)
                flight.deadline = time.monotonic() + self.space.timeout_s
                flight.placement = None
                flight.submitted = time.monotonic()
                self.in_flight[id(flight.handle)] = flight
                return False
            worker = {**(flight.placement or {}), "attempts": flight.attempt + 1,
                      "lost": flight.lost}
            self._fail(flight, f"worker died: {flight.attempt + 1} attempts (max_retries "
                               f"{self.space.max_retries}); last: {err}", worker)
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
        if flight.lost:
            worker["lost"] = flight.lost
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

    def _fail(self, flight: _InFlight, reason: str, worker: dict | None = None) -> None:
        import optuna   # lazy: Optuna + SQLAlchemy take ~1 s; bad input exits first

        self.ran += 1
        self._record(flight.trial, optuna.trial.TrialState.FAIL, reason, flight.config, flight.flat,
                     None, flight.prediction, worker=worker)

    # ------------------------------------------------------------------ recording
    def _record(self, trial, state, reason: str | None, config, flat: dict, metrics: dict | None,
                prediction: dict, *, worker: dict | None = None,
                measurement_obj: Measurement | None = None, interrupted: bool = False) -> None:
        """user_attrs (`outcome` last) -> MLflow child run -> tell (Optuna state last).

        A controller killed in between leaves a RUNNING trial: with `outcome` stored,
        `--resume` tells it with its result; without, it re-runs it.
        """
        # One hardware label per sweep (host, devices:<profile>, analytical:<profile>); what the
        # engine reported (e.g. the accelerator's device kind) is kept as `device`.
        record = TrialRecord(
            flat_params=flat, source=self.source, hardware=self.space.hardware.label,
            prediction=prediction, measurement=metrics or {}, outcome=state.name,
            device=measurement_obj.hardware if measurement_obj is not None else None,
            config=config.to_dict() if config is not None else None, reason=reason or None,
            worker=worker or None, interrupted=interrupted)
        values = None
        feasible = True
        if state.name == "COMPLETE":
            record.constraints = {c.text: c.value(metrics) for c in self.space.constraints}
            feasible = record.feasible = all(v <= 0 for v in record.constraints.values())
            for i, value in enumerate(record.constraints.values()):
                trial.set_constraint(str(i), value)
            values = [metrics[m] for m in self.space.metric_names]
        for key, value in record.user_attrs().items():
            trial.set_user_attr(key, value)
        run_id = self.tracking.log_trial(trial, state.name) if self.tracking else None
        if run_id:
            trial.set_user_attr("mlflow_run_id", run_id)
        else:
            trial.set_user_attr("mlflow_error", self.tracking.last_error if self.tracking
                                else "not logged: the sweep stopped before MLflow was set up")
        self.study.tell(trial, values=values, state=state)
        if interrupted:
            self.interrupted += 1
        else:
            self.counts[STATE_KEYS[state.name]] += 1
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


def _names(storage: str) -> list[str]:
    return [s.study_name for s in _study_summaries(storage)]


# ----------------------------------------------------------------------------- Pareto rows

# A Pareto row: the trial's flat parameters less those a sweep holds fixed.
ROW_PARAMS = tuple(p for p in TrialConfig.FLAT_PARAMS if p not in ("model", "seed", "repeats"))


def pareto_rows(study, space: SearchSpace) -> list[dict[str, Any]]:
    """The non-dominated COMPLETE trials that meet every constraint, best first.

    Two objectives: `sweeper.analysis.pareto.pareto_front` (the same front `sweeper pareto` draws);
    otherwise Optuna's own `best_trials` (any number of objectives).
    """
    trials = [t for t in study.get_trials(deepcopy=False)
              if t.state.name == "COMPLETE" and t.user_attrs.get("feasible", True)]
    if not trials:
        return []
    metrics = space.metric_names
    numbers: list[int]
    if len(metrics) == 2:
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
    run_ids = mlflow_run_ids(study)
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
        row["mlflow_run_id"] = run_ids.get(number)
        rows.append(row)
    return rows


# ----------------------------------------------------------------------------- entry point


def run_sweep(space: SearchSpace | str | os.PathLike, *, storage: str | None = None,
              tracking_uri: str | None = None, study_name: str | None = None, resume: bool = False,
              trials: int | None = None, parallel: int | None = None, address: str | None = None,
              progress: bool = True, on_trial: Callable[[dict], None] | None = None) -> SweepResult:
    """Run (or resume) a sweep; returns counts, the Pareto trials and where everything is.

    Bad input (space file, arguments, store URLs, a Ray address nothing answers at, a study
    name clash, a study another live controller runs) raises ConfigError before Ray,
    Optuna's storage or MLflow are touched, apart from listing the studies that exist;
    nothing is created on disk before that.
    """
    space = load_space(space if not isinstance(space, os.PathLike) else str(space))
    if trials is not None:
        _positive(trials, "--trials")
    if parallel is not None:
        _positive(parallel, "--parallel")
    if study_name is not None:
        paths.check_study_name(study_name)      # it names folders: checked before anything
    if address is not None:
        check_ray_address(address)
    storage = paths.check_storage_url(storage) if storage else paths.default_storage(create=False)
    tracking_uri = (paths.check_tracking_uri(tracking_uri) if tracking_uri
                    else paths.default_tracking_uri(create=False))
    for url, flag in ((storage, "--storage"), (tracking_uri, "--tracking-uri")):
        if url == paths.default_storage(create=False) or \
                url == paths.default_tracking_uri(create=False):
            paths.check_home(url)            # before Ray starts (it writes there too)
        paths.check_sqlite_store(url, flag)  # both stores intact before either is written
    target = trials if trials is not None else space.planned_trials()
    if space.sampler.type == "grid":
        target = min(target, space.grid_size())
    check_memory_fits(space)      # before Ray starts: a space that cannot fit is bad input
    name, exists = choose_study(space, storage, study_name, resume)
    # The claim is atomic before Ray starts: a lock file held for the whole run, then the
    # lease attr checked again under it (sweeper/sweep/lease.py).
    lock = lease.lock(storage, name) if exists else None
    try:
        if exists:
            choose_study(space, storage, name, True)
        controller = Controller(space, storage=storage, tracking_uri=tracking_uri, study_name=name,
                                resume=exists, trials=target,
                                parallel=parallel if parallel is not None else space.parallel,
                                address=address, progress=progress, on_trial=on_trial,
                                generated_name=study_name is None and not exists)
        return controller.run()
    finally:
        lease.unlock(lock)
