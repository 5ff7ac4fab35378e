"""Where trials run: a pool of Ray actors, each owning one mesh for its whole life.

Emulated mesh (`hardware: host`): an actor's process is started with
`XLA_FLAGS=--xla_force_host_platform_device_count=N` (Ray `runtime_env` env_vars: the
device count is fixed when JAX starts, so one process serves one chip count) and pins
itself to its slot's CPU cores with `os.sched_setaffinity` before JAX is imported. The
pool splits this process's cores into `parallel` disjoint slots and never runs two trials
in one slot at once, so concurrent trials do not share cores or pollute each other's
timings (2 cores, parallel 2: one core each). An actor whose chip count a trial does not
match is not reused; the slot starts (or reuses) one for that count, keeping a few alive.

Real devices (`hardware: devices`): an actor asks Ray for the space's `resources` (e.g.
{GPU: 1}, {TPU: 4}); no device-count flag, no pinning.

Multi-host trials (`hosts: H`, README "Multi-host trials"): the slot's worker is a group of
H actors, one per host, reserved together by a placement group (`sweeper/sweep/slices.py`:
STRICT_SPREAD over nodes on a cluster, PACK on one machine); each owns `chips / H` devices
(emulated: its device-count flag and a share of the slot's cores) and joins the others
with `jax.distributed.initialize` at rank 0's address before its first trial, then waits
at a barrier before each trial (`JOIN_TIMEOUT_S`). Every host runs the same trial and
measures; the trial's numbers are the slowest host's (largest `total_s`), each host's in
`extra["hosts"]`. When any host raises or dies, the trial fails with that host's reason and
every actor of the group is killed and its placement group removed (the others would wait
in a collective forever); the slot starts a new group for its next trial.

Every actor keeps an engine/compile cache (`run_trial(engine_cache=...)`) across its
trials, so a repeated shape and layout is not compiled again.

Analytical (`hardware: analytical:*`): `LocalPool` evaluates the cost model in this process
(microseconds; no Ray), behind the same interface, so the controller does not care.

Where a trial runs: every actor answers `where()` (pid, Ray node id and IP, the Ray
resources it holds) as soon as its process is up, before its first trial; the controller
stores that on the running trial (user attr `worker`), so an operator can find the process
of any running trial, and after the trial the node and resources stay in its record.

Faults: an actor whose process dies (crash, OOM, `kill -9`, its node lost) fails its trial's
ObjectRef with `RayActorError` -> `WorkerLost`; the controller retries the trial on a fresh
actor of the same slot up to `max_retries` times. A trial past its `timeout_s` has its actor
killed (`discard`) and the slot starts a new one for the next trial.

Test-only: `SWEEPER_TEST_TRIAL_DELAY_S` makes a worker sleep before a trial (`SECONDS`, or
`SECONDS:N1,N2` for trials N1 and N2 only), so that the fault tests can kill a worker or let
a trial time out in the middle of it. `SWEEPER_TEST_FAIL_HOST=RANK` makes host RANK of a
multi-host trial raise before the trial. Both are forwarded from the controller's environment
to the workers and have no use outside tests.
"""

from __future__ import annotations

import os
import re
import socket
import time
import traceback
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Protocol

import psutil

from sweeper.formatting import one_line
from sweeper.sweep.slices import JOIN_TIMEOUT_S, PLACE_TIMEOUT_S, SlicePlan, free_port, plan_slice
from workloads.config import ConfigError, HardwareProfile
from workloads.costmodel import predict
from workloads import hoststate
from workloads.measure import run_trial
from workloads.metrics import Measurement
from workloads.trial import TrialConfig


@dataclass
class Outcome:
    """What one trial returned, and where and when it ran."""

    measurement: Measurement
    started: float                 # time.time() on the worker when the trial began
    finished: float
    worker: dict[str, Any] = field(default_factory=dict)   # pid, slot, cores, cache stats


class WorkerLost(RuntimeError):
    """The worker process died under a trial (crash, out of memory, killed)."""


class ClusterLost(RuntimeError):
    """No Ray node is left to run trials (the local raylet was killed, the cluster stopped):
    the controller stops and records its in-flight trials `interrupted` (see controller)."""


class TrialError(RuntimeError):
    """The trial raised; `reason` is one line (type and message)."""

    def __init__(self, reason: str, config_error: bool = False):
        super().__init__(reason)
        self.reason = reason
        self.config_error = config_error


TEST_DELAY_ENV = "SWEEPER_TEST_TRIAL_DELAY_S"     # test-only, see the module docstring
TEST_FAIL_HOST_ENV = "SWEEPER_TEST_FAIL_HOST"      # test-only, see the module docstring


def trial_delay_s(number: int | None, environ: dict | None = None) -> float:
    """Seconds a worker waits before trial `number` (test-only; 0 when the variable is unset)."""
    spec = (environ if environ is not None else os.environ).get(TEST_DELAY_ENV, "").strip()
    if not spec:
        return 0.0
    seconds, _, numbers = spec.partition(":")
    if numbers.strip() and number not in {int(n) for n in numbers.split(",") if n.strip()}:
        return 0.0
    return float(seconds)


def where_am_i() -> dict[str, Any]:
    """This process: pid, host, and (inside Ray) node id, node IP and assigned resources."""
    info: dict[str, Any] = {"pid": os.getpid(), "host": socket.gethostname()}
    try:
        import ray   # lazy: Ray (~1 s) only where a pool or cluster is used

        if ray.is_initialized():
            context = ray.get_runtime_context()
            info["node_id"] = context.get_node_id()
            info["node_ip"] = ray.util.get_node_ip_address()
            info["resources"] = {k: float(v) for k, v in context.get_assigned_resources().items()}
    except Exception:  # noqa: BLE001 - outside a Ray worker there is no node to report
        pass
    return info


def lost_reason(err: BaseException, placement: dict | None) -> str:
    """'pid 123 on node 0a1b2c3d (10.0.0.2) died: <what Ray says, shortened>'."""
    where = "its worker "          # (it died before it could say where it runs)
    if placement:
        where = f"pid {placement.get('pid')}"
        if placement.get("node_id"):
            where += f" on node {str(placement['node_id'])[:8]} ({placement.get('node_ip')})"
        where += " "
    text = " ".join(str(err).split())
    # Ray's message lists every possible cause; keep what it knows about this death.
    detail = re.search(r"(Worker exit type: \S+.*?)(?: (?:Some common causes|There are some "
                       r"potential root causes)\b|$)", text)
    said = detail.group(1) if detail else text
    return f"{where}died ({type(err).__name__}: {said[:300]})"


# ----------------------------------------------------------------------------- cores


def split_cores(parallel: int, available: list[int] | None = None) -> list[list[int]]:
    """`parallel` disjoint groups of this process's cores (overlapping only if too few)."""
    cores = sorted(available if available is not None else os.sched_getaffinity(0))
    if parallel >= len(cores):
        return [[cores[i % len(cores)]] for i in range(parallel)]
    size, extra = divmod(len(cores), parallel)
    groups, start = [], 0
    for i in range(parallel):
        end = start + size + (1 if i < extra else 0)
        groups.append(cores[start:end])
        start = end
    return groups


# ----------------------------------------------------------------------------- the actor


class MeshWorker:
    """Owns one mesh (N emulated or real devices) and an engine cache; runs trials on it."""

    def __init__(self, slot: int, chips: int | None, cores: list[int] | None,
                 rank: int = 0, hosts: int = 1):
        self.slot, self.chips = slot, chips        # chips: the whole mesh's, all hosts
        self.rank, self.hosts = rank, hosts
        self.joined = hosts == 1                   # jax.distributed joined (multi-host)
        self.trials_started = 0
        self.cores: list[int] | None = None
        if cores:
            mine = os.sched_getaffinity(0)
            wanted = set(cores) & mine if mine else set(cores)
            if wanted:   # on another node of a cluster the driver's core ids may not exist
                os.sched_setaffinity(0, wanted)
                self.cores = sorted(wanted)
        self.engine_cache: dict = {}
        self.trials_run = 0

    def where(self) -> dict[str, Any]:
        """Where this worker runs (no JAX import: answers as soon as the process is up)."""
        info = {**where_am_i(), "slot": self.slot, "chips": self.chips}
        if self.hosts > 1:
            info.update(rank=self.rank, hosts=self.hosts)
        return info

    def coordinator(self) -> str:
        """Rank 0 of a multi-host group: `ip:port` of the coordinator service it will start
        (this node's IP and a port free on it), the address every host joins."""
        return f"{where_am_i().get('node_ip') or '127.0.0.1'}:{free_port()}"

    def join(self, coordinator: str) -> None:
        """Join the slice's other hosts (once), then meet them at this trial's barrier, so a
        host that never arrives fails the trial after JOIN_TIMEOUT_S instead of hanging."""
        import jax   # lazy: JAX starts its backend; only in the process that runs a trial
        from jax._src import distributed   # the runtime client: the one barrier with a timeout

        if not self.joined:
            # CPU collectives across processes (the emulated mesh) go over gloo.
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
            jax.distributed.initialize(coordinator_address=coordinator, num_processes=self.hosts,
                                       process_id=self.rank, initialization_timeout=JOIN_TIMEOUT_S)
            self.joined = True
        self.trials_started += 1
        distributed.global_state.client.wait_at_barrier(
            f"sweeper-trial-{self.trials_started}", JOIN_TIMEOUT_S * 1000)

    def info(self) -> dict[str, Any]:
        import jax   # lazy: JAX starts its backend; only in the process that runs a trial

        return {"pid": os.getpid(), "slot": self.slot, "chips": self.chips,
                "cores": sorted(os.sched_getaffinity(0)), "devices": len(jax.devices()),
                "xla_flags": os.environ.get("XLA_FLAGS", ""), "cache_entries": len(self.engine_cache),
                "trials_run": self.trials_run}

    def run(self, config: dict, hardware: dict | None, number: int | None = None,
            coordinator: str | None = None, verify: bool = False) -> dict[str, Any]:
        delay = trial_delay_s(number)
        if delay:
            time.sleep(delay)       # test-only: a window to kill this worker mid-trial
        if self.hosts > 1:
            if os.environ.get(TEST_FAIL_HOST_ENV, "") == str(self.rank):
                raise RuntimeError(f"injected failure on host {self.rank} ({TEST_FAIL_HOST_ENV})")
            self.join(coordinator)
        trial = TrialConfig.from_dict(config, validate=False)
        profile = HardwareProfile.from_dict(hardware) if hardware else None
        before = set(self.engine_cache)
        started = time.time()
        hoststate.reset_peak_rss()      # this trial's memory high-water, not the actor's
        measurement = run_trial(trial, engine_cache=self.engine_cache, hardware=profile,
                                verify=verify)
        measurement.worker_rss_peak_bytes = hoststate.peak_rss_bytes()
        finished = time.time()
        self.trials_run += 1
        new_entries = len(set(self.engine_cache) - before)
        return {"measurement": measurement.to_dict(), "started": started, "finished": finished,
                "worker": {**self.where(),
                           "cores": sorted(os.sched_getaffinity(0)),
                           "cache_entries": len(self.engine_cache),
                           "new_cache_entries": new_entries,
                           "cache_hit": bool(measurement.extra.get(
                               "compile_cache_hit", bool(before) and new_entries == 0)),
                           "trials_run": self.trials_run}}


# ----------------------------------------------------------------------------- pools


@dataclass
class _Handle:
    slot: int
    key: Any
    ref: Any = None                 # Ray ObjectRef (RayPool) or the finished result (LocalPool)
    error: BaseException | None = None
    where: Any = None               # ObjectRef of the actor's `where()` (RayPool)
    refs: list = field(default_factory=list)     # RayPool: one run() ObjectRef per host
    wheres: list = field(default_factory=list)   # RayPool: one where() ObjectRef per host
    done: set = field(default_factory=set)       # indices of hosts whose run() has returned
    failed: bool = False            # a host of a multi-host trial raised or died


@dataclass
class _Worker:
    """A slot's worker for one mesh: one actor, or one per host with their placement group."""

    actors: list
    wheres: list                    # ObjectRefs of each actor's where()
    group: Any = None               # placement group (multi-host)
    coordinator: Any = None         # ObjectRef of rank 0's coordinator() (multi-host)
    error: BaseException | None = None   # the group could not be placed


class WorkerPool(Protocol):
    """What the controller needs of a pool of trial workers (RayPool, LocalPool).

    A pool has `parallel` slots; each slot runs one trial at a time. `slot_cores[slot]` are the
    host cores a slot's worker is pinned to (empty when not pinned) out of `total_cores`.
    """

    local: bool                     # True: trials run in this process (the cost model)
    shares_cores: bool              # more slots than cores: timings disturb each other
    total_cores: int
    slot_cores: list[list[int]]

    def warm_slot(self, slot: int, chips: int, hosts: int = 1) -> bool:
        """The slot's worker already has a mesh of `chips` devices over `hosts` processes
        (compiled programs cached)."""

    def submit(self, slot: int, trial: TrialConfig, hardware: HardwareProfile | None,
               number: int | None = None) -> _Handle:
        """Start one trial on the slot's worker; its result comes from `outcome`."""

    def placement(self, handle: _Handle, timeout: float = 0.0) -> dict | None:
        """Where the trial's worker runs (node, pid, cores), None if not known yet."""

    def ready(self, handles: list[_Handle], timeout: float) -> list[_Handle]:
        """The handles whose trial has finished, waiting at most `timeout` seconds."""

    def outcome(self, handle: _Handle) -> Outcome:
        """The finished trial's result; raises TrialError, or WorkerLost if the worker died."""

    def discard(self, handle: _Handle) -> None:
        """Give up on a trial (timed out): its worker is stopped."""

    def workers(self) -> list[dict]:
        """Each live worker's placement."""

    def close(self) -> None:
        """Stop every worker."""


class RayPool:
    """`parallel` slots; each slot runs one trial at a time on a worker it owns (one actor,
    or one actor per host for a multi-host trial)."""

    local = False

    def __init__(self, hardware_kind: str, parallel: int, resources: dict[str, float] | None = None,
                 env: dict[str, str] | None = None, max_workers_per_slot: int = 3,
                 verify: bool = False, place_timeout_s: float = PLACE_TIMEOUT_S):
        import ray   # lazy: Ray (~1 s) only where a pool or cluster is used

        self.ray = ray
        self.kind = hardware_kind
        self.parallel = parallel
        self.resources = dict(resources or {})
        self.env = dict(env or {})
        self.max_workers_per_slot = max_workers_per_slot
        self.verify = verify
        self.place_timeout_s = place_timeout_s
        self.emulated = hardware_kind == "host"
        self.slot_cores = split_cores(parallel) if self.emulated else [[] for _ in range(parallel)]
        self.total_cores = len(os.sched_getaffinity(0))
        self.shares_cores = self.emulated and parallel > self.total_cores
        self._workers: list[OrderedDict] = [OrderedDict() for _ in range(parallel)]
        self._remote = ray.remote(MeshWorker)
        self._pids: set[int] = set()           # this host's worker processes seen

    # (chips, hosts) -> worker, per slot (emulated: one process per device count; devices:
    # one per slot and host count)
    def _worker_key(self, chips: int, hosts: int = 1):
        return (chips, hosts) if self.emulated else ("devices", hosts)

    def _options(self, local_chips: int) -> dict[str, Any]:
        env = dict(self.env)
        if self.emulated:
            # This process's own XLA flags pass on, minus any device count of its own.
            inherited = re.sub(r"--xla_force_host_platform_device_count=\S*", "",
                               os.environ.get("XLA_FLAGS", "")).split()
            env["XLA_FLAGS"] = " ".join(
                [*inherited, f"--xla_force_host_platform_device_count={local_chips}"])
            # Our own pinning decides the cores, not Ray's CPU accounting.
            opts: dict[str, Any] = {"num_cpus": 0}
        else:
            res = dict(self.resources)
            opts = {"num_cpus": res.pop("CPU", 0), "num_gpus": res.pop("GPU", 0)}
            if res:
                opts["resources"] = res
        for name in (TEST_DELAY_ENV, TEST_FAIL_HOST_ENV):
            if os.environ.get(name):
                env[name] = os.environ[name]
        opts["runtime_env"] = {"env_vars": env}
        opts["max_restarts"] = 0
        opts["max_concurrency"] = 1
        return opts

    def worker(self, slot: int, chips: int, hosts: int = 1) -> _Worker:
        workers = self._workers[slot]
        key = self._worker_key(chips, hosts)
        if key in workers:
            workers.move_to_end(key)
            return workers[key]
        while len(workers) >= self.max_workers_per_slot:
            _, old = workers.popitem(last=False)        # least recently used
            self._kill(old)
        worker = self._start(slot, chips) if hosts == 1 else self._start_group(slot, chips, hosts)
        workers[key] = worker
        return worker

    def _start(self, slot: int, chips: int) -> _Worker:
        cores = self.slot_cores[slot] if self.emulated else None
        actor = self._remote.options(**self._options(chips)).remote(slot, chips, cores)
        return _Worker([actor], [actor.where.remote()])   # where() runs first: one thread

    def _start_group(self, slot: int, chips: int, hosts: int) -> _Worker:
        """Reserve one bundle per host (whole or not at all), start one actor per bundle."""
        from ray.util.placement_group import placement_group, remove_placement_group   # lazy: Ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy   # lazy: Ray

        nodes = sum(1 for n in self.ray.nodes() if n.get("Alive"))
        per_host = {} if self.emulated else self.resources
        plan: SlicePlan = plan_slice(hosts, chips // hosts, per_host, nodes=nodes)
        group = placement_group(plan.bundles, strategy=plan.strategy)
        ready, _ = self.ray.wait([group.ready()], timeout=self.place_timeout_s)
        if not ready:
            remove_placement_group(group)
            return _Worker([], [], error=TrialError(
                f"cannot place {hosts} hosts x {plan.bundles[-1]} ({plan.strategy}, {nodes} "
                f"nodes) within {self.place_timeout_s:g}s"))
        # An emulated slot's cores are shared out among its hosts (one machine).
        cores = split_cores(hosts, self.slot_cores[slot]) if self.emulated else [None] * hosts
        actors = []
        for rank in range(hosts):
            opts = self._options(plan.chips_per_host)
            if self.emulated:
                opts["num_cpus"] = plan.bundles[rank]["CPU"]      # fits its bundle exactly
            opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                group, placement_group_bundle_index=rank)
            actors.append(self._remote.options(**opts).remote(slot, chips, cores[rank], rank, hosts))
        wheres = [a.where.remote() for a in actors]
        return _Worker(actors, wheres, group, coordinator=actors[0].coordinator.remote())

    def _kill(self, worker: _Worker) -> None:
        for actor in worker.actors:
            self.ray.kill(actor)
        if worker.group is not None:
            from ray.util.placement_group import remove_placement_group   # lazy: Ray

            remove_placement_group(worker.group)
            worker.group = None

    def warm_slot(self, slot: int, chips: int, hosts: int = 1) -> bool:
        return self._worker_key(chips, hosts) in self._workers[slot]

    def submit(self, slot: int, trial: TrialConfig, hardware: HardwareProfile | None,
               number: int | None = None) -> _Handle:
        worker = self.worker(slot, trial.chips, trial.hosts)
        handle = _Handle(slot, self._worker_key(trial.chips, trial.hosts), wheres=worker.wheres)
        if worker.error is not None:
            self._workers[slot].pop(handle.key, None)
            handle.error = worker.error
            return handle
        args = (trial.to_dict(), hardware.to_dict() if hardware else None, number)
        # Rank 0's address is an ObjectRef argument: Ray hands it over once rank 0 answers.
        handle.refs = [a.run.remote(*args, worker.coordinator, self.verify) for a in worker.actors]
        handle.ref = handle.refs[0]
        handle.where = worker.wheres[0]
        return handle

    def placement(self, handle: _Handle, timeout: float = 0.0) -> dict | None:
        """Where the trial's worker runs, once its processes have answered (else None);
        a multi-host trial: rank 0's, with every host's under `hosts`."""
        if not handle.wheres:
            return None
        ready, _ = self.ray.wait(handle.wheres, num_returns=len(handle.wheres), timeout=timeout)
        if len(ready) < len(handle.wheres):
            return None
        try:
            places = self.ray.get(handle.wheres)
        except Exception:  # noqa: BLE001 - an actor died before it could answer
            handle.wheres = []
            return None
        for where in places:
            if where.get("host") == socket.gethostname() and where.get("pid"):
                self._pids.add(int(where["pid"]))
        return places[0] if len(places) == 1 else {**places[0], "hosts": places}

    def alive_nodes(self) -> list[str]:
        """The Ray nodes the cluster's control store (GCS) still counts as alive."""
        return [n["NodeID"] for n in self.ray.nodes() if n.get("Alive")]

    def kill_orphans(self) -> list[int]:
        """Kill this host's worker processes a lost node left running (no raylet is left to
        stop them); the pids killed."""
        killed = []
        for pid in sorted(self._pids):
            try:
                psutil.Process(pid).kill()
                killed.append(pid)
            except psutil.Error:
                pass
        self._pids.clear()
        return killed

    def _finished(self, handle: _Handle) -> bool:
        """Every host has returned, or one of several has failed (the others may be waiting
        for it in a collective: they are not waited for)."""
        if handle.error is not None:
            return True
        pending = [r for i, r in enumerate(handle.refs) if i not in handle.done]
        if pending:
            done, _ = self.ray.wait(pending, num_returns=len(pending), timeout=0)
            for ref in done:
                index = handle.refs.index(ref)
                handle.done.add(index)
                if len(handle.refs) > 1 and self._raised(ref):
                    handle.failed = True
        return handle.failed or len(handle.done) == len(handle.refs)

    def _raised(self, ref) -> bool:
        try:
            self.ray.get(ref, timeout=0)
        except Exception:  # noqa: BLE001 - any failure of a host fails its trial
            return True
        return False

    def ready(self, handles: list[_Handle], timeout: float) -> list[_Handle]:
        if not handles:
            return []
        finished = [h for h in handles if self._finished(h)]
        if finished:
            return finished
        pending = [r for h in handles for i, r in enumerate(h.refs) if i not in h.done]
        if pending:
            self.ray.wait(pending, num_returns=1, timeout=max(timeout, 0.0))
        return [h for h in handles if self._finished(h)]

    def outcome(self, handle: _Handle) -> Outcome:
        if handle.error is not None:
            raise handle.error
        hosts = len(handle.refs)
        results = []
        # A failed multi-host trial: the hosts that returned (the failing one among them).
        for rank in (sorted(handle.done) if handle.failed else range(hosts)):
            try:
                results.append(self._result(handle, rank))
            except (TrialError, WorkerLost) as err:
                self.discard(handle)       # every host of the trial goes, and its reservation
                if hosts == 1:
                    raise
                reason = f"host {rank} of {hosts}: {err}"
                if isinstance(err, WorkerLost):
                    raise WorkerLost(reason) from None
                raise TrialError(reason, err.config_error) from None
        if hosts == 1:
            return results[0]
        return slowest_host(results)

    def _result(self, handle: _Handle, rank: int) -> Outcome:
        ray = self.ray
        try:
            data = ray.get(handle.refs[rank])
        except ray.exceptions.RayTaskError as err:      # the trial itself raised
            cause = getattr(err, "cause", None) or err
            raise TrialError(one_line(cause), isinstance(cause, ConfigError)) from None
        except ray.exceptions.RayError as err:
            # The actor died (RayActorError), Ray's memory monitor killed it (OutOfMemoryError),
            # its node died, its result was lost: the worker is gone either way.
            placement = self._host_placement(handle, rank)
            self.discard(handle)
            raise WorkerLost(lost_reason(err, placement)) from None
        return Outcome(Measurement.from_dict(data["measurement"]), data["started"],
                       data["finished"], data["worker"])

    def _host_placement(self, handle: _Handle, rank: int) -> dict | None:
        if rank >= len(handle.wheres):
            return None
        ready, _ = self.ray.wait([handle.wheres[rank]], timeout=0)
        try:
            return self.ray.get(handle.wheres[rank]) if ready else None
        except Exception:  # noqa: BLE001 - the actor died before it could answer
            return None

    def discard(self, handle: _Handle) -> None:
        """Kill the worker a trial ran on (timeout, crash; every host of a multi-host
        trial, and its placement group): the slot starts a fresh one."""
        worker = self._workers[handle.slot].pop(handle.key, None)
        if worker is not None:
            self._kill(worker)

    def release_slot(self, slot: int) -> None:
        """Kill a free slot's idle workers: the resources they hold go back to Ray."""
        workers = self._workers[slot]
        while workers:
            self._kill(workers.popitem()[1])

    def workers(self) -> list[dict]:
        refs = [a.info.remote() for slot in self._workers for w in slot.values() for a in w.actors]
        return self.ray.get(refs) if refs else []

    def close(self) -> None:
        for slot in self._workers:
            for worker in slot.values():
                self._kill(worker)
            slot.clear()


def slowest_host(results: list[Outcome]) -> Outcome:
    """A multi-host trial's outcome: the slowest host's measurement (largest `total_s`;
    every host waits for the others in each collective, so they differ little), with each
    host's timings in `extra["hosts"]` and each host's placement in `worker["hosts"]`."""
    def total(o: Outcome) -> float:
        value = o.measurement.total_s
        return value if value == value else -1.0       # NaN never wins

    rank = max(range(len(results)), key=lambda r: total(results[r]))
    slowest = results[rank].measurement
    slowest.extra = {**slowest.extra, "slowest_host": rank, "hosts": [
        {"rank": r, "prefill_s": o.measurement.prefill_s,
         "decode_step_s": o.measurement.decode_step_s, "total_s": o.measurement.total_s,
         "node_id": o.worker.get("node_id"), "pid": o.worker.get("pid")}
        for r, o in enumerate(results)]}
    worker = {**results[0].worker, "hosts": [o.worker for o in results], "slowest_host": rank}
    return Outcome(slowest, min(o.started for o in results), max(o.finished for o in results),
                   worker)


class LocalPool:
    """The analytical backend: the cost model, evaluated in this process."""

    shares_cores = False
    local = True
    total_cores = 1

    def __init__(self, parallel: int = 1):
        self.parallel = parallel
        self.slot_cores = [[] for _ in range(parallel)]

    def warm_slot(self, slot: int, chips: int, hosts: int = 1) -> bool:
        return True

    def submit(self, slot: int, trial: TrialConfig, hardware: HardwareProfile | None,
               number: int | None = None) -> _Handle:
        delay = trial_delay_s(number)
        if delay:
            time.sleep(delay)       # test-only: stretches an analytical sweep in time
        started = time.time()
        handle = _Handle(slot, None)
        try:
            measurement = predict(trial, hardware)
            handle.ref = Outcome(measurement, started, time.time(),
                                 {"pid": os.getpid(), "slot": slot, "local": True})
        except Exception as err:  # noqa: BLE001 - a failed trial is data
            handle.error = err
            handle.ref = traceback.format_exc(limit=3)
        return handle

    def ready(self, handles: list[_Handle], timeout: float) -> list[_Handle]:
        return list(handles)

    def outcome(self, handle: _Handle) -> Outcome:
        if handle.error is not None:
            raise TrialError(one_line(handle.error), isinstance(handle.error, ConfigError))
        return handle.ref

    def discard(self, handle: _Handle) -> None:
        pass

    def placement(self, handle: _Handle, timeout: float = 0.0) -> dict | None:
        return None

    def workers(self) -> list[dict]:
        return []

    def close(self) -> None:
        pass
