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
a trial time out in the middle of it. It is forwarded from the controller's environment to
the workers and has no use outside tests.
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

from sweeper.formatting import one_line
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


class TrialError(RuntimeError):
    """The trial raised; `reason` is one line (type and message)."""

    def __init__(self, reason: str, config_error: bool = False):
        super().__init__(reason)
        self.reason = reason
        self.config_error = config_error


TEST_DELAY_ENV = "SWEEPER_TEST_TRIAL_DELAY_S"     # test-only, see the module docstring


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

    def __init__(self, slot: int, chips: int | None, cores: list[int] | None):
        self.slot, self.chips = slot, chips
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
        return {**where_am_i(), "slot": self.slot, "chips": self.chips}

    def info(self) -> dict[str, Any]:
        import jax   # lazy: JAX starts its backend; only in the process that runs a trial

        return {"pid": os.getpid(), "slot": self.slot, "chips": self.chips,
                "cores": sorted(os.sched_getaffinity(0)), "devices": len(jax.devices()),
                "xla_flags": os.environ.get("XLA_FLAGS", ""), "cache_entries": len(self.engine_cache),
                "trials_run": self.trials_run}

    def run(self, config: dict, hardware: dict | None, number: int | None = None) -> dict[str, Any]:
        delay = trial_delay_s(number)
        if delay:
            time.sleep(delay)       # test-only: a window to kill this worker mid-trial
        trial = TrialConfig.from_dict(config, validate=False)
        profile = HardwareProfile.from_dict(hardware) if hardware else None
        before = set(self.engine_cache)
        started = time.time()
        hoststate.reset_peak_rss()      # this trial's memory high-water, not the actor's
        measurement = run_trial(trial, engine_cache=self.engine_cache, hardware=profile)
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


class WorkerPool(Protocol):
    """What the controller needs of a pool of trial workers (RayPool, LocalPool).

    A pool has `parallel` slots; each slot runs one trial at a time. `slot_cores[slot]` are the
    host cores a slot's worker is pinned to (empty when not pinned) out of `total_cores`.
    """

    local: bool                     # True: trials run in this process (the cost model)
    shares_cores: bool              # more slots than cores: timings disturb each other
    total_cores: int
    slot_cores: list[list[int]]

    def warm_slot(self, slot: int, chips: int) -> bool:
        """The slot's worker already has a mesh of `chips` devices (compiled programs cached)."""

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
    """`parallel` slots; each slot runs one trial at a time on an actor it owns."""

    local = False

    def __init__(self, hardware_kind: str, parallel: int, resources: dict[str, float] | None = None,
                 env: dict[str, str] | None = None, max_workers_per_slot: int = 3):
        import ray   # lazy: Ray (~1 s) only where a pool or cluster is used

        self.ray = ray
        self.kind = hardware_kind
        self.parallel = parallel
        self.resources = dict(resources or {})
        self.env = dict(env or {})
        self.max_workers_per_slot = max_workers_per_slot
        self.emulated = hardware_kind == "host"
        self.slot_cores = split_cores(parallel) if self.emulated else [[] for _ in range(parallel)]
        self.total_cores = len(os.sched_getaffinity(0))
        self.shares_cores = self.emulated and parallel > self.total_cores
        self._actors: list[OrderedDict] = [OrderedDict() for _ in range(parallel)]
        self._where: dict[Any, Any] = {}       # actor -> ObjectRef of its where()
        self._remote = ray.remote(MeshWorker)

    # chips -> actor, per slot (emulated: one process per device count; devices: one per slot)
    def _actor_key(self, chips: int):
        return chips if self.emulated else "devices"

    def _options(self, chips: int) -> dict[str, Any]:
        env = dict(self.env)
        if self.emulated:
            # This process's own XLA flags pass on, minus any device count of its own.
            inherited = re.sub(r"--xla_force_host_platform_device_count=\S*", "",
                               os.environ.get("XLA_FLAGS", "")).split()
            env["XLA_FLAGS"] = " ".join(
                [*inherited, f"--xla_force_host_platform_device_count={chips}"])
            # Our own pinning decides the cores, not Ray's CPU accounting.
            opts: dict[str, Any] = {"num_cpus": 0}
        else:
            res = dict(self.resources)
            opts = {"num_cpus": res.pop("CPU", 0), "num_gpus": res.pop("GPU", 0)}
            if res:
                opts["resources"] = res
        if os.environ.get(TEST_DELAY_ENV):
            env[TEST_DELAY_ENV] = os.environ[TEST_DELAY_ENV]
        opts["runtime_env"] = {"env_vars": env}
        opts["max_restarts"] = 0
        opts["max_concurrency"] = 1
        return opts

    def actor(self, slot: int, chips: int):
        actors = self._actors[slot]
        key = self._actor_key(chips)
        if key in actors:
            actors.move_to_end(key)
            return actors[key]
        while len(actors) >= self.max_workers_per_slot:
            _, old = actors.popitem(last=False)        # least recently used
            self._kill(old)
        cores = self.slot_cores[slot] if self.emulated else None
        actor = self._remote.options(**self._options(chips)).remote(slot, chips, cores)
        self._where[actor] = actor.where.remote()     # runs first: the actor is single-threaded
        actors[key] = actor
        return actor

    def _kill(self, actor) -> None:
        self._where.pop(actor, None)
        self.ray.kill(actor)

    def warm_slot(self, slot: int, chips: int) -> bool:
        return self._actor_key(chips) in self._actors[slot]

    def submit(self, slot: int, trial: TrialConfig, hardware: HardwareProfile | None,
               number: int | None = None) -> _Handle:
        actor = self.actor(slot, trial.chips)
        ref = actor.run.remote(trial.to_dict(), hardware.to_dict() if hardware else None, number)
        return _Handle(slot, self._actor_key(trial.chips), ref, where=self._where.get(actor))

    def placement(self, handle: _Handle, timeout: float = 0.0) -> dict | None:
        """Where the trial's worker runs, once its process has answered (else None)."""
        if handle.where is None:
            return None
        ready, _ = self.ray.wait([handle.where], num_returns=1, timeout=timeout)
        if not ready:
            return None
        try:
            return self.ray.get(handle.where)
        except Exception:  # noqa: BLE001 - the actor died before it could answer
            handle.where = None
            return None

    def ready(self, handles: list[_Handle], timeout: float) -> list[_Handle]:
        if not handles:
            return []
        by_ref = {h.ref: h for h in handles}
        done, _ = self.ray.wait(list(by_ref), num_returns=1, timeout=max(timeout, 0.0))
        if done:  # collect everything already finished, not just one
            done, _ = self.ray.wait(list(by_ref), num_returns=len(by_ref), timeout=0)
        return [by_ref[r] for r in done]

    def outcome(self, handle: _Handle) -> Outcome:
        ray = self.ray
        try:
            data = ray.get(handle.ref)
        except ray.exceptions.RayTaskError as err:      # the trial itself raised
            cause = getattr(err, "cause", None) or err
            raise TrialError(one_line(cause), isinstance(cause, ConfigError)) from None
        except ray.exceptions.RayError as err:
            # The actor died (RayActorError), Ray's memory monitor killed it (OutOfMemoryError),
            # its node died, its result was lost: the worker is gone either way.
            placement = self.placement(handle)
            self.discard(handle)
            raise WorkerLost(lost_reason(err, placement)) from None
        return Outcome(Measurement.from_dict(data["measurement"]), data["started"],
                       data["finished"], data["worker"])

    def discard(self, handle: _Handle) -> None:
        """Kill the worker a trial ran on (timeout, crash): the slot starts a fresh one."""
        actor = self._actors[handle.slot].pop(handle.key, None)
        if actor is not None:
            self._kill(actor)

    def workers(self) -> list[dict]:
        refs = [a.info.remote() for slot in self._actors for a in slot.values()]
        return self.ray.get(refs) if refs else []

    def close(self) -> None:
        for slot in self._actors:
            for actor in slot.values():
                self._kill(actor)
            slot.clear()


class LocalPool:
    """The analytical backend: the cost model, evaluated in this process."""

    shares_cores = False
    local = True
    total_cores = 1

    def __init__(self, parallel: int = 1):
        self.parallel = parallel
        self.slot_cores = [[] for _ in range(parallel)]

    def warm_slot(self, slot: int, chips: int) -> bool:
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
