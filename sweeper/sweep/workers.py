"""Where measured trials run: `RayPool`, a pool of Ray actors (`meshworker.MeshWorker`),
each owning one mesh for its whole life. It implements `sweeper.sweep.pool.WorkerPool`.

Emulated mesh (`hardware: host`): the pool splits this process's cores into `parallel`
disjoint slots (`meshworker.split_cores`) and never runs two trials in one slot at once, so
concurrent trials do not share cores or pollute each other's timings (2 cores, parallel 2:
one core each). An actor gets its device count (`XLA_FLAGS`) and the sweep's environment
through its constructor (`PooledMeshWorker`), which sets them before anything imports JAX,
not through a Ray `runtime_env`: an actor with no runtime_env of its own can take one of
the worker processes Ray starts idle with the cluster, already past their `import ray`,
instead of booting a new one (docs/performance.md, "Start-up and shutdown"). An actor whose chip count a trial does not match is not reused; the slot
starts (or reuses) one for that count, keeping `max_workers_per_slot` alive (the controller
passes the number of device counts the space has, so a grid that interleaves chip counts
starts one process per slot and count, not one per change of count: issue 22). Each
worker remembers the configurations it ran (`pool.replicate_key`), so the controller can
keep a configuration's replicates from meeting in one warm process (see the controller's
`_pick`).

Real devices (`hardware: devices`): an actor asks Ray for the space's `resources` (e.g.
{GPU: 1}, {TPU: 4}); no device-count flag, no pinning.

Multi-host trials (`hosts: H`, README "Multi-host trials"): the slot's worker is a group of
H actors, one per host, reserved together by a placement group (`sweeper/sweep/slices.py`:
STRICT_SPREAD over nodes on a cluster, PACK on one machine); each owns `chips / H` devices
(emulated: its device-count flag and a share of the slot's cores). Every host runs the same
trial and measures; the trial's numbers are the slowest host's (largest `total_s`), each
host's in `extra["hosts"]`. When any host raises or dies, the trial fails with that host's
reason and every actor of the group is killed and its placement group removed (the others
would wait in a collective forever); the slot starts a new group for its next trial.

Where a trial runs: the controller stores each actor's `where()` on the running trial (user
attr `worker`), so an operator can find the process of any running trial, and after the
trial the node and resources stay in its record.

Faults: an actor whose process dies (crash, OOM, `kill -9`, its node lost) fails its trial's
ObjectRef with `RayActorError` -> `WorkerLost`; the controller retries the trial on a fresh
actor of the same slot up to `max_retries` times. A trial past its `timeout_s` has its actor
killed (`discard`) and the slot starts a new one for the next trial.
"""

from __future__ import annotations

import os
import re
import socket
import sys
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import psutil

from sweeper.formatting import one_line
from sweeper.sweep.meshworker import TEST_ENVS, MeshWorker, split_cores
from sweeper.sweep.pool import Handle, Outcome, TrialError, WorkerLost, replicate_key
# re-exported from the module that held them before the split (the CLI, tests import them)
from sweeper.sweep.pool import ClusterLost, LocalPool, WorkerPool  # noqa: F401
from sweeper.sweep.slices import PLACE_TIMEOUT_S, SlicePlan, plan_slice
from workloads.config import ConfigError, HardwareProfile
from workloads.metrics import Measurement
from workloads.trial import TrialConfig


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


class PooledMeshWorker(MeshWorker):
    """A `MeshWorker` whose environment (device count, $SWEEPER_HOME, the compilation
    cache) is set by its constructor, so that it can run in a worker process Ray started
    idle (see the module docstring). JAX reads `XLA_FLAGS` once, when it starts: a process
    that has imported JAX already cannot take another device count, and says so."""

    def __init__(self, env: dict[str, str], slot: int, chips: int | None,
                 cores: list[int] | None, rank: int = 0, hosts: int = 1):
        if "jax" in sys.modules and os.environ.get("XLA_FLAGS") != env.get("XLA_FLAGS"):
            raise RuntimeError(f"worker process {os.getpid()} imported JAX before its "
                               f"XLA_FLAGS were set ({env.get('XLA_FLAGS')!r})")
        os.environ.update(env)
        super().__init__(slot, chips, cores, rank, hosts)


@dataclass
class _Worker:
    """A slot's worker for one mesh: one actor, or one per host with their placement group."""

    actors: list
    wheres: list                    # ObjectRefs of each actor's where()
    group: Any = None               # placement group (multi-host)
    coordinator: Any = None         # ObjectRef of rank 0's coordinator() (multi-host)
    error: BaseException | None = None   # the group could not be placed
    warmed: list = field(default_factory=list)   # ObjectRefs of each actor's warm()
    ran: set = field(default_factory=set)   # replicate_key of each trial it was given



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
        self._remote = ray.remote(PooledMeshWorker)
        self._pids: set[int] = set()           # this host's worker processes seen

    # (chips, hosts) -> worker, per slot (emulated: one process per device count; devices:
    # one per slot and host count)
    def _worker_key(self, chips: int, hosts: int = 1):
        return (chips, hosts) if self.emulated else ("devices", hosts)

    def _options(self, local_chips: int) -> tuple[dict[str, Any], dict[str, str]]:
        """(Ray's actor options, the environment the actor's constructor sets)."""
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
        for name in TEST_ENVS:
            if os.environ.get(name):
                env[name] = os.environ[name]
        opts["max_restarts"] = 0
        opts["max_concurrency"] = 1
        return opts, env

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
        opts, env = self._options(chips)
        actor = self._remote.options(**opts).remote(env, slot, chips, cores)
        where = actor.where.remote()          # where() runs first (one thread), then warm()
        return _Worker([actor], [where], warmed=[actor.warm.remote()])

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
            opts, env = self._options(plan.chips_per_host)
            if self.emulated:
                opts["num_cpus"] = plan.bundles[rank]["CPU"]      # fits its bundle exactly
            opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                group, placement_group_bundle_index=rank)
            actors.append(self._remote.options(**opts).remote(env, slot, chips, cores[rank], rank,
                                                              hosts))
        wheres = [a.where.remote() for a in actors]
        return _Worker(actors, wheres, group, coordinator=actors[0].coordinator.remote())

    def _kill(self, worker: _Worker) -> None:
        for actor in worker.actors:
            self.ray.kill(actor)
        if worker.group is not None:
            from ray.util.placement_group import remove_placement_group   # lazy: Ray

            remove_placement_group(worker.group)
            worker.group = None

    def prestart(self, slot: int, chips: int) -> None:
        """Start the slot's worker for `chips` devices now: its process imports JAX while
        the controller finishes setting up (the actor's __init__ runs at once)."""
        self.worker(slot, chips, 1)

    def wait_started(self, timeout: float) -> None:
        """Until every live worker has warmed up (JAX and the engine imported, the
        compilation cache set), at most `timeout` seconds; a worker that died is the
        trial's business."""
        refs = [ref for slot in self._workers for w in slot.values() for ref in w.warmed]
        if refs:
            self.ray.wait(refs, num_returns=len(refs), timeout=timeout)

    def warm_slot(self, slot: int, chips: int, hosts: int = 1,
                  trial: TrialConfig | None = None) -> bool:
        worker = self._workers[slot].get(self._worker_key(chips, hosts))
        if worker is None or worker.error is not None:
            return False
        return trial is None or replicate_key(trial) not in worker.ran

    def submit(self, slot: int, trial: TrialConfig, hardware: HardwareProfile | None,
               number: int | None = None) -> Handle:
        worker = self.worker(slot, trial.chips, trial.hosts)
        handle = Handle(slot, self._worker_key(trial.chips, trial.hosts), wheres=worker.wheres)
        if worker.error is not None:
            self._workers[slot].pop(handle.key, None)
            handle.error = worker.error
            return handle
        worker.ran.add(replicate_key(trial))
        args = (trial.to_dict(), hardware.to_dict() if hardware else None, number)
        # Rank 0's address is an ObjectRef argument: Ray hands it over once rank 0 answers.
        handle.refs = [a.run.remote(*args, worker.coordinator, self.verify) for a in worker.actors]
        handle.ref = handle.refs[0]
        handle.where = worker.wheres[0]
        return handle

    def placement(self, handle: Handle, timeout: float = 0.0) -> dict | None:
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

    def _finished(self, handle: Handle) -> bool:
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

    def ready(self, handles: list[Handle], timeout: float) -> list[Handle]:
        if not handles:
            return []
        finished = [h for h in handles if self._finished(h)]
        if finished:
            return finished
        pending = [r for h in handles for i, r in enumerate(h.refs) if i not in h.done]
        if pending:
            self.ray.wait(pending, num_returns=1, timeout=max(timeout, 0.0))
        return [h for h in handles if self._finished(h)]

    def outcome(self, handle: Handle) -> Outcome:
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

    def _result(self, handle: Handle, rank: int) -> Outcome:
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

    def _host_placement(self, handle: Handle, rank: int) -> dict | None:
        if rank >= len(handle.wheres):
            return None
        ready, _ = self.ray.wait([handle.wheres[rank]], timeout=0)
        try:
            return self.ray.get(handle.wheres[rank]) if ready else None
        except Exception:  # noqa: BLE001 - the actor died before it could answer
            return None

    def discard(self, handle: Handle) -> None:
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
