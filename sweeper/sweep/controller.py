"""The sweep controller: the trial loop, Optuna ask/tell over a pool of workers.

    space = load_space("search_spaces/quickstart.yaml")      # validated first
    result = run_sweep(space)                                  # -> SweepResult

Loop: while fewer than `trials` trials have finished and fewer than `parallel` run,
ask Optuna for a point; turn it into a TrialConfig (a point that cannot run for its
shape -> PRUNED with the reason); ask the cost model whether it fits (layout
divisibility, memory against the hardware's HBM or, for `host`, the space's per-chip
`memory_budget_bytes`; no -> PRUNED with the reason); otherwise dispatch it to a free
slot of the pool. The pool returns finished trials; each is recorded
(`sweeper.sweep.recording`: user attrs, one MLflow child run, then told to Optuna with the
objectives' values and the constraint values through `Trial.set_constraint`, which every
Optuna 5 sampler reads). Storage is an Optuna RDB (SQLite under $SWEEPER_HOME by default),
so `--resume` continues a study and Optuna's own tools (optuna-dashboard,
`optuna.load_study`) read it.

Over 500 lines because the loop and its dispatch policy (which asked point goes to which
warm worker, `_pick` and `_prestart`, issue 22) read and change the same in-flight state.
The other jobs of a sweep live beside it: checks before anything starts
(`sweep/preflight.py`), which study to write (`sweep/naming.py`), the Ray session and its
bounded shutdown (`sweep/session.py`), recording (`sweep/recording.py`), the pools
(`sweep/pool.py`, `sweep/workers.py`) and the result (`sweep/result.py`).

What happens when things fail (a trial raises, its worker dies, it times out, the
controller dies, the Ray cluster is lost or does not shut down, MLflow is unreachable) is
listed in docs/architecture.md, "Reliability"; each case has a test that injects it.
"""

from __future__ import annotations

import contextlib
import math
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from sweeper import paths
from sweeper.formatting import one_line
from sweeper.spec import lease
from sweeper.sweep import compile_cache, oom, stopping
from sweeper.sweep.naming import choose_study, open_study
from sweeper.sweep.pool import (ClusterLost, Handle, LocalPool, TrialError, WorkerLost,
                                WorkerPool)
from sweeper.sweep.preflight import (check_memory_fits,  # noqa: F401 (re-exported for tests)
                                     check_point, check_run_arguments)
from sweeper.sweep.progress import ProgressLine
from sweeper.sweep.recording import INTERRUPTED, Recorder, TrialOutcome, resume_trials
from sweeper.sweep.result import SweepResult, pareto_rows
from sweeper.sweep.session import RaySession, quiet_ray_auth_notice
from sweeper.spec.space import SearchSpace, load_space
from sweeper.sweep.workers import RayPool
from sweeper.tracking.link import TrackingLink
from sweeper.tracking.mlflow_log import Tracker, experiment_name
from sweeper.tracking.store_health import StoreLost, StoreMonitor
from sweeper.tracking.study import study_counts
from workloads.config import ConfigError, HardwareProfile
from workloads.hardware import chip_share, per_chip, worker_share
from workloads.trial import TrialConfig

CLUSTER_CHECK_S = 3.0      # how often the controller asks Ray which nodes are alive
PLACE_GRACE_S = 10.0       # a worker not started by then may be waiting on idle workers
MAX_WORKERS_PER_SLOT = 6   # live processes a slot keeps, one per device count (memory)
PRESTART_WAIT_S = 120.0    # at most this long for the workers started with Ray to be up
# Samplers whose next point does not depend on the results so far: the controller may ask
# a few points ahead and run first the one a live worker can take (see `_pick`).
ORDER_FREE_SAMPLERS = ("grid", "random")
# The last run's phases, seconds since `run_sweep` was called (checked: the arguments and
# stores checked, ray, study, tracking, profile, workers, trials_done, pool_closed, closed,
# result): benchmarks/sweep_overhead.py reads where start-up and shutdown go.
TIMELINE: dict[str, float] = {}


@dataclass
class _InFlight:
    trial: Any                           # optuna.Trial
    config: TrialConfig
    flat: dict[str, Any]
    prediction: dict[str, float]
    hardware: HardwareProfile | None
    slot: int
    handle: Handle
    deadline: float
    attempt: int = 0
    placement: dict | None = None        # where the current attempt's worker runs
    lost: list[dict] = field(default_factory=list)   # earlier attempts whose worker died
    submitted: float = field(default_factory=time.monotonic)   # this attempt's, monotonic
    oom_before: Any = None               # OOM-kill counters when its worker was up (oom.py)

    def outcome(self, state: str, reason: str | None = None, **more: Any) -> TrialOutcome:
        return TrialOutcome(state, reason, self.config, self.flat, self.prediction, **more)


def new_local_cluster(address: str | None) -> bool:
    """Does this sweep start a new local Ray cluster (`--address local`, or none given and no
    RAY_ADDRESS to join), as RaySession decides?"""
    return address == "local" or (not address and not os.environ.get("RAY_ADDRESS"))


class Controller:
    def __init__(self, space: SearchSpace, *, storage: str, tracking_uri: str, study_name: str,
                 resume: bool, trials: int, parallel: int, address: str | None, progress: bool,
                 on_trial: Callable[[dict], None] | None = None, generated_name: bool = False,
                 after_trials: Callable[[], None] | None = None, began: float | None = None):
        self.space = space
        self.storage = storage
        self.tracking_uri = tracking_uri
        self.study_name = study_name
        self.generated_name = generated_name     # a clash with a concurrent sweep: pick another
        self.resume = resume
        self.target = trials
        self.remaining = trials                  # less those a resumed study has finished
        self.parallel = parallel
        self.address = address
        self.show_progress = progress
        self.on_trial = on_trial
        self.after_trials = after_trials         # run in a thread once the trials are done
        self.source = space.hardware.source
        self.in_flight: dict[int, _InFlight] = {}
        # asked of Optuna, shape checked, not yet on a worker: (optuna.Trial, TrialConfig)
        self.pending: list[tuple[Any, TrialConfig]] = []
        self.window = 2 * parallel if space.sampler.type in ORDER_FREE_SAMPLERS else 1
        self.asked = 0
        self._began = began                      # monotonic, when run_sweep was called
        self._started = time.monotonic()         # TIMELINE's origin (set when run() begins)
        self.ran = 0
        self.retry_params: list[tuple[int, dict]] = []   # interrupted trials to run again
        self.session: RaySession | None = None
        self.pool: WorkerPool | None = None
        self.profile: HardwareProfile | None = None      # the cost model's (set in run)
        self.study = None                                # optuna.Study (set in run)
        self.recorder: Recorder | None = None
        self.lease: dict | None = None
        self.tracking: TrackingLink | None = None
        self.progress = ProgressLine(trials, False)
        self.experiment = experiment_name(space.name, self.source)
        self._next_heartbeat = 0.0
        self._next_cluster_check = 0.0
        self.stores: StoreMonitor | None = None     # the stores are the files opened, intact

    # ------------------------------------------------------------------ setup
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

    def _start_pool(self) -> WorkerPool:
        hw = self.space.hardware
        if hw.kind == "analytical":
            return LocalPool(self.parallel)
        self.session = RaySession(self.address)
        self.session.start()
        env = {paths.HOME_ENV: str(paths.sweeper_home(create=True))}
        cache = compile_cache.cache_dir()        # shared by every worker (issue 22 item 2)
        if cache is not None:
            env[compile_cache.CACHE_DIR_ENV] = str(cache)
        return RayPool(hw.kind, self.parallel, self.space.resources, env=env,
                       verify=self.space.verify,
                       max_workers_per_slot=min(MAX_WORKERS_PER_SLOT,
                                                max(3, self._device_counts())))

    def _device_counts(self) -> int:
        """How many (chips, hosts) meshes the space's points ask for, at most."""
        count = 1
        for name in ("chips", "hosts"):
            param = next((p for p in self.space.params if p.name == name), None)
            count *= len(param.grid_values()) if param is not None else 1
        return count

    def _enqueue_retries(self) -> None:
        """Interrupted trials run again first, with the same parameters (`retry_of`)."""
        searched = set(self.space.distributions())
        for number, params in self.retry_params[:self.remaining]:
            # (the controller asks every parameter at once; a trial without them has no point)
            if searched and set(params) >= searched:
                self.study.enqueue_trial(params, user_attrs={"retry_of": number})

    # ------------------------------------------------------------------ running
    def _mark(self, phase: str) -> None:
        TIMELINE[phase] = time.monotonic() - self._started

    def run(self) -> SweepResult:
        start = time.monotonic()
        self._started = self._began if self._began is not None else start
        TIMELINE.clear()
        self._mark("checked")
        self.progress = ProgressLine(self.target, self.show_progress)
        status = "finished"
        try:
            if self.space.hardware.kind != "analytical":
                # lazy: Ray (~1 s of CPU), imported here first so that the store thread
                # below does not hold the GIL against it and delay Ray's processes; Ray reads
                # its auth mode when imported, so the notice is quieted first, as
                # RaySession.start does (sweeper/sweep/session.py)
                quiet_ray_auth_notice(None if new_local_cluster(self.address) else self.address)
                import ray  # noqa: F401
                self._warm_store_imports()     # while Ray starts, which mostly waits
            self.pool = self._start_pool()     # first: a bad --address creates no study or run
            self._mark("ray")
            self._prestart()
            self.study, self.study_name = open_study(self.space, self.storage, self.study_name,
                                                     self.resume, generated=self.generated_name)
            self.recorder = Recorder(self.study, self.space, on_trial=self.on_trial)
            self.lease = lease.claim(self.study)
            done_before = 0
            if self.resume:
                done_before, self.retry_params = resume_trials(self.study, self.space,
                                                               self.recorder)
            self.remaining = max(0, self.target - done_before)
            self._enqueue_retries()
            self._mark("study")
            self.tracking = TrackingLink(self.tracking_uri, space=self.space, study=self.study,
                                         study_name=self.study_name, storage=self.storage,
                                         resumed=self.resume)
            self.tracking.start()
            self.recorder.tracking = self.tracking
            self.stores = StoreMonitor.for_sweep(self.storage, self.tracking_uri,
                                                 self.study_name)
            self._mark("tracking")
            # After Ray and git have forked their processes: measuring `host` imports JAX
            # (multithreaded) into this process.
            self.profile = self.space.hardware.resolve(self.space.source)
            if self.profile is not None and "hardware_profile" not in self.study.user_attrs:
                # the profile the trials were predicted with, kept with the study: `sweeper
                # fit` starts from it, never from whatever `host` cache it finds later (a
                # cache re-measured under load capped the fit's bandwidth, issue 19)
                self.study.set_user_attr("hardware_profile", self.profile.to_dict())
            self._mark("profile")
            self.pool.wait_started(PRESTART_WAIT_S)
            self._mark("workers")
            if self.pool.shares_cores:
                print(f"sweeper: parallel {self.parallel} > {self.pool.total_cores} cores: "
                      "concurrent trials share cores and disturb each other's timings",
                      file=sys.stderr)
            self._loop()
            self.stores.final()        # a store deleted or damaged: non-zero, one line
            self._mark("trials_done")
            self._warm_closing_imports()
        except BaseException as err:
            status = "failed" if isinstance(err, Exception) else "killed"
            if self.stores is not None and isinstance(err, Exception) and \
                    not isinstance(err, StoreLost):
                problems = self.stores.problems()   # e.g. "no such table": the file was lost
                if problems:
                    err = StoreLost(problems)
            reason = INTERRUPTED
            if isinstance(err, ClusterLost):
                reason = f"interrupted: {err}"
                if self.pool is not None:     # (None: the local Ray did not start)
                    self.pool.kill_orphans()  # no raylet is left to stop them
            for flight in list(self.in_flight.values()):
                self._record(flight, flight.outcome("FAIL", reason, interrupted=True))
            self.in_flight.clear()
            for trial, config in self.pending:       # asked, never started: run by --resume
                self.recorder.record(trial, TrialOutcome("FAIL", reason, config,
                                                         config.flat_params(), interrupted=True))
            self.pending.clear()
            # which study the failure left (None: none was created), for the CLI's advice
            # (`--resume` or the same command again, sweeper/cli/__init__.py `store_failure`)
            with contextlib.suppress(AttributeError, TypeError):
                err.sweeper_study = self.study_name if self.study is not None else None
            if isinstance(err, StoreLost):
                raise err from None
            raise
        finally:
            self.progress.close()
            self._close(status)
        tracking = self.tracking
        self._mark("closed")
        result = SweepResult(
            study=self.study, study_name=self.study_name, storage=self.storage,
            tracking_uri=self.tracking_uri, parent_run_id=tracking.parent_run_id,
            experiment=self.experiment, experiment_id=tracking.experiment_id, source=self.source,
            counts=self._study_counts(),
            pareto=pareto_rows(self.study, self.space),
            objectives=[(o.metric, o.direction) for o in self.space.objectives],
            searched=[p.name for p in self.space.params],
            elapsed_s=time.monotonic() - start, tracking_errors=tracking.errors,
            interrupted=self.recorder.interrupted, mlflow_missing=len(tracking.unlogged))
        self._mark("result")      # counts and the Pareto rows read back
        return result

    def _close(self, status: str) -> None:
        try:
            if self.pool is not None:
                self.pool.close()
                self._mark("pool_closed")
        finally:
            try:
                if self.tracking is not None:
                    self.tracking.finish(status, self._study_counts)
                    self._mark("tracking_finished")
            finally:
                try:
                    if self.study is not None and self.lease is not None:
                        lease.release(self.study, self.lease, status)
                except Exception as err:  # noqa: BLE001 - the trials are stored; say so only
                    if status == "finished":   # (else the error that stopped the sweep says why)
                        print(f"sweeper: could not release study {self.study_name!r} "
                              f"({one_line(err)[:200]})", file=sys.stderr)
                finally:
                    if self.session is not None:
                        self.session.close()     # bounded: see sweeper/sweep/session.py
                        self._mark("ray_closed")

    def _warm_store_imports(self) -> None:
        """Import MLflow's client, entities and SQL store (~2.4 s of CPU, more than Optuna's
        and Ray's together) in a thread while Ray starts: `ray.init` mostly waits for the
        processes it launches, leaving a core idle (docs/performance.md, "Start-up and
        shutdown"). On a new local cluster (no --address) the thread also opens the MLflow
        store as `TrackingLink` will (`Tracker`: a new SQLite store runs its migrations;
        MLflow keeps the store per URI, so the link finds it built); with an --address it
        only imports, so a bad address still creates nothing. What fails here fails again,
        with its message, where the store is used."""
        local = new_local_cluster(self.address)

        def warm() -> None:
            try:
                import mlflow.entities  # noqa: F401 - lazy: MLflow (~1.6 s), imported early
                import mlflow.tracking  # noqa: F401 - lazy: as above
                if self.tracking_uri.startswith(("sqlite", "postgresql", "mysql")):
                    # lazy: the SQL store's SQLAlchemy and Alembic (~0.8 s), as above
                    import mlflow.store.tracking.sqlalchemy_store  # noqa: F401
                if local:
                    Tracker(self.tracking_uri)
            except Exception:  # noqa: BLE001 - see the docstring
                pass

        threading.Thread(target=warm, name="sweeper-store-imports", daemon=True).start()

    def _warm_closing_imports(self) -> None:
        """Import what comes after the trials (pandas and the Pareto front for the result,
        and whatever `after_trials` imports: the CLI's end-of-sweep analysis) in a thread,
        while the workers, MLflow's parent run and Ray shut down, which mostly wait
        (docs/performance.md, "Start-up and shutdown"). An import that fails here fails
        again, with its message, where the module is used."""
        def warm() -> None:
            try:
                # lazy: pandas (~1 s) only once the trials are done (sweeper/sweep/result.py)
                import sweeper.analysis.pareto  # noqa: F401
                if self.after_trials is not None:
                    self.after_trials()
            except Exception:  # noqa: BLE001 - see the docstring
                pass

        threading.Thread(target=warm, name="sweeper-closing-imports", daemon=True).start()

    def _study_counts(self) -> dict[str, int]:
        return study_counts(self.study)

    def _loop(self) -> None:
        free = list(range(self.parallel))
        self._show()
        while True:
            stopping.raise_if_requested()     # a signal whose exception Python dropped
            waiting = self._waiting_for_a_worker(free)
            while free and (self.pending or self.asked < self.remaining) and not waiting:
                while len(self.pending) < self.window and self.asked < self.remaining:
                    self.asked += 1
                    self._ask()
                if self.pending:
                    self._dispatch(free)
            if not self.in_flight:
                if self.asked >= self.remaining and not self.pending:
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
            self.stores.poll()
            self._show()
        self._show()

    def _waiting_for_a_worker(self, free: list[int]) -> bool:
        """True while a trial has waited more than PLACE_GRACE_S for its worker to start,
        which Ray cannot place because idle workers of free slots hold the resources it
        needs (a node was lost: a retried trial asks for a `slice` that only the survivor
        has, held by the worker another slot keeps for its next trial). Those idle workers
        are released and no new trial is started until it has its worker: the retried
        trial goes first, and the sweep goes on at the parallelism the cluster has left."""
        if not free:
            return False
        now = time.monotonic()
        if not any(f.placement is None and now - f.submitted > PLACE_GRACE_S
                   for f in self.in_flight.values()):
            return False
        for slot in free:
            self.pool.release_slot(slot)
        return True

    def _check_cluster(self, now: bool = False) -> None:
        """ClusterLost when Ray counts no node alive (every few seconds, and at once when a
        worker died): waiting for the trials' timeouts would record them FAIL `timeout`,
        which is false and not re-run by --resume. While some node is alive, a trial whose
        worker's node died runs again on another (its retry)."""
        if not now and time.monotonic() < self._next_cluster_check:
            return
        self._next_cluster_check = time.monotonic() + CLUSTER_CHECK_S
        try:
            alive = self.pool.alive_nodes()
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
                    if placement.get("host") == socket.gethostname():   # its cgroup, counters
                        flight.oom_before = oom.snapshot(placement.get("pid"))
                    flight.trial.set_user_attr("worker", {**placement, "running": True,
                                                          "attempts": flight.attempt + 1})

    def _heartbeat(self) -> None:
        now = time.monotonic()
        if now >= self._next_heartbeat:
            self._next_heartbeat = now + lease.HEARTBEAT_S
            if self.lease is not None:
                lease.heartbeat(self.study, self.lease)

    def _prestart(self) -> None:
        """Start every slot's workers, one per device count of the space, right after Ray
        (issue 22 item 3): their processes import JAX while this one opens the study, sets
        up MLflow and the host profile, and no new process starts later on a slot's cores
        while a trial is timed there. `wait_started` holds the first trial until they are
        up, so no trial is timed beside a worker still importing on its cores."""
        if self.pool.local or self._device_counts() > MAX_WORKERS_PER_SLOT:
            return
        names = {p.name: p for p in self.space.params}
        chips_values = (names["chips"].grid_values() if "chips" in names
                        else [self.space.fixed.get("chips", 1)])
        hosts = (names["hosts"].grid_values() if "hosts" in names
                 else [self.space.fixed.get("hosts", 1)])
        if list(hosts) != [1]:
            return                           # a multi-host group waits for its placement
        for chips in chips_values:
            for slot in range(self.parallel):
                self.pool.prestart(slot, int(chips))

    def _ask(self) -> None:
        """Ask one point; prune it (no shape) or add it to `pending`."""
        trial = self.study.ask(self.space.distributions())
        try:
            config = self.space.trial_config(trial.params)
        except ConfigError as err:
            flat = self.space.flat_params(trial.params)
            self.recorder.record(trial, TrialOutcome("PRUNED", f"infeasible: {err}", flat=flat))
            return
        self.pending.append((trial, config))

    def _dispatch(self, free: list[int]) -> None:
        """Take a pending point (`_pick`); prune it or start it on a free slot (removed
        from `free`)."""
        index, slot = self._pick(free)
        trial, config = self.pending.pop(index)
        flat = config.flat_params()
        hardware, chip_profile, share = self.trial_hardware(config.chips, slot)
        # recorded so calibration reads the share the prediction used (docs/architecture.md)
        trial.set_user_attr("hardware_share", share)
        reason, prediction = check_point(self.space, config, chip_profile)
        if reason:
            self.recorder.record(trial, TrialOutcome("PRUNED", f"infeasible: {reason}",
                                                     config, flat, prediction))
            return
        free.remove(slot)
        # The analytical pool evaluates the per-chip profile; a worker gets the whole share.
        hardware = chip_profile if self.pool.local else hardware
        try:
            handle = self.pool.submit(slot, config, hardware, trial.number)
        except BaseException:     # Ctrl-C or a pool failure: the trial did not run
            self.recorder.record(trial, TrialOutcome("FAIL", INTERRUPTED, config, flat,
                                                     prediction, interrupted=True))
            raise
        self.in_flight[id(handle)] = _InFlight(trial, config, flat, prediction, hardware, slot,
                                               handle, time.monotonic() + self.space.timeout_s)

    def _pick(self, free: list[int]) -> tuple[int, int]:
        """(index in `pending`, free slot): which asked point runs next, and where.

        A new worker process costs a JAX import and every compile, so the oldest pending
        point that a free slot's live worker can run goes first (its mesh is there); only
        when none can does the oldest point start a new process. With an order-free
        sampler (grid, random) `pending` holds up to 2 x parallel points asked ahead; other
        samplers ask one at a time, so their choices see every result as before.

        Replicates stay honest (the calibration's noise floor is their disagreement): a
        worker that ran a replicate of a configuration (`pool.replicate_key`: same
        configuration, other seed) does not count as able to run it, so a configuration's
        seeds meet in one warm process only when nothing else is runnable (a fallback,
        never a preference) — less often than in the sampler's random order, where the
        slot a point lands on depends only on which trial finished first. Which slot a
        point goes to still depends only on finishing times, never on its configuration.
        """
        for index, (_, config) in enumerate(self.pending):
            for slot in free:
                if self.pool.warm_slot(slot, config.chips, config.hosts, config):
                    return index, slot
        config = self.pending[0][1]
        for slot in free:       # its mesh is warm but ran its replicate: still no new process
            if self.pool.warm_slot(slot, config.chips, config.hosts):
                return 0, slot
        return 0, free[0]

    def _finish(self, flight: _InFlight) -> bool:
        """Record a returned trial; False if it was resubmitted (the slot stays busy)."""
        try:
            outcome = self.pool.outcome(flight.handle)
        except WorkerLost as err:
            self.in_flight[id(flight.handle)] = flight    # recorded interrupted if the
            self._check_cluster(now=True)                 # whole cluster is gone
            del self.in_flight[id(flight.handle)]
            memory = None                 # killed for memory: not retried (it would be again)
            if flight.oom_before is not None:
                memory = oom.explain_exit((flight.placement or {}).get("pid"),
                                          since=flight.oom_before)
            if memory is None and oom.ray_memory_kill(str(err)):
                memory = "killed by Ray's memory monitor: out of memory"
            if memory is not None:
                err = WorkerLost(f"{memory}; {err}")
            flight.lost.append({**(flight.placement or {}), "attempt": flight.attempt + 1,
                                "reason": str(err)})
            if flight.attempt < self.space.max_retries and \
                    (memory is None or self.space.retry_oom):
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
            if memory is not None and flight.attempt < self.space.max_retries:
                self._fail(flight, f"worker died, {err} (not retried: it would run out of "
                                   "memory again)", worker)
                return True
            self._fail(flight, f"worker died: {flight.attempt + 1} attempts (max_retries "
                               f"{self.space.max_retries}); last: {err}", worker)
            return True
        except TrialError as err:
            state = "PRUNED" if err.config_error else "FAIL"
            prefix = "infeasible: " if err.config_error else ""
            self._record(flight, flight.outcome(state, prefix + err.reason))
            self.ran += 1
            return True
        self.ran += 1
        metrics = outcome.measurement.metrics()
        worker = dict(outcome.worker, started=outcome.started, finished=outcome.finished,
                      attempts=flight.attempt + 1)
        if flight.lost:
            worker["lost"] = flight.lost
        measured = {"metrics": metrics, "worker": worker, "measurement": outcome.measurement}
        missing = [m for m in self.space.metric_names if not math.isfinite(metrics.get(m, math.nan))]
        if missing:
            self._record(flight, flight.outcome("FAIL", f"objective not reported: "
                                                f"{', '.join(missing)}", **measured))
            return True
        self._record(flight, flight.outcome("COMPLETE", **measured))
        return True

    def _fail(self, flight: _InFlight, reason: str, worker: dict | None = None) -> None:
        self.ran += 1
        self._record(flight, flight.outcome("FAIL", reason, worker=worker))

    def _record(self, flight: _InFlight, outcome: TrialOutcome) -> None:
        self.recorder.record(flight.trial, outcome)

    def _show(self) -> None:
        c = self.recorder.counts
        self.progress.update(c["complete"], c["failed"], c["pruned"], len(self.in_flight),
                             self.recorder.best, self.ran)


def run_sweep(space: SearchSpace | str | os.PathLike, *, storage: str | None = None,
              tracking_uri: str | None = None, study_name: str | None = None, resume: bool = False,
              trials: int | None = None, parallel: int | None = None, address: str | None = None,
              progress: bool = True, on_trial: Callable[[dict], None] | None = None,
              after_trials: Callable[[], None] | None = None,
              on_start: Callable[[], None] | None = None) -> SweepResult:
    """Run (or resume) a sweep; returns counts, the Pareto trials and where everything is.

    Bad input (space file, arguments, store URLs, a Ray address nothing answers at, a study
    name clash, a study another live controller runs) raises ConfigError before Ray,
    Optuna's storage or MLflow are touched, apart from listing the studies that exist;
    nothing is created on disk before that. `after_trials` runs in a thread once every
    trial is done, while the sweep shuts down (the CLI imports its analysis there);
    `on_start` runs once every check has passed, before Ray starts (the CLI names the
    hardware profile there, so a rejected command prints its one error line only).
    """
    began = time.monotonic()
    space = load_space(space if not isinstance(space, os.PathLike) else str(space))
    storage, tracking_uri, target = check_run_arguments(
        space, storage=storage, tracking_uri=tracking_uri, study_name=study_name, trials=trials,
        parallel=parallel, address=address)
    name, exists = choose_study(space, storage, study_name, resume)
    if on_start is not None:
        on_start()
    # The claim is atomic before Ray starts: a lock file held for the whole run, then the
    # lease attr checked again under it (sweeper/spec/lease.py).
    lock = lease.lock(storage, name) if exists else None
    try:
        if exists:
            choose_study(space, storage, name, True)
        controller = Controller(space, storage=storage, tracking_uri=tracking_uri, study_name=name,
                                resume=exists, trials=target,
                                parallel=parallel if parallel is not None else space.parallel,
                                address=address, progress=progress, on_trial=on_trial,
                                generated_name=study_name is None and not exists,
                                after_trials=after_trials, began=began)
        return controller.run()
    finally:
        lease.unlock(lock)
