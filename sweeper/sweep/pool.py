"""What the controller needs of a pool of trial workers, and the pool that needs no Ray.

    pool: WorkerPool = LocalPool(parallel)          # or workers.RayPool(...)
    handle = pool.submit(slot, trial, hardware, number)
    for done in pool.ready([handle], timeout=0.5):
        outcome = pool.outcome(done)                # raises TrialError or WorkerLost

A pool has `parallel` slots; each runs one trial at a time. `WorkerPool` lists everything
the controller calls; `RayPool` (`sweeper/sweep/workers.py`) runs trials on Ray actors,
`LocalPool` evaluates the cost model in this process (`hardware: analytical:*`:
microseconds, no Ray) behind the same interface, so the controller does not care.
This module imports no Ray: the CLI imports `ClusterLost` from it at start-up.
"""

from __future__ import annotations

import json
import os
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Protocol

from sweeper.formatting import one_line
from sweeper.sweep.meshworker import trial_delay_s
from workloads.config import ConfigError, HardwareProfile
from workloads.costmodel import predict
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



def replicate_key(trial: TrialConfig) -> str:
    """The trial's configuration without its seed: replicates (seed 0, 1) share it."""
    data = trial.to_dict()
    data.pop("seed", None)
    return json.dumps(data, sort_keys=True, default=str)


@dataclass
class Handle:
    slot: int
    key: Any
    ref: Any = None                 # Ray ObjectRef (RayPool) or the finished result (LocalPool)
    error: BaseException | None = None
    where: Any = None               # ObjectRef of the actor's `where()` (RayPool)
    refs: list = field(default_factory=list)     # RayPool: one run() ObjectRef per host
    wheres: list = field(default_factory=list)   # RayPool: one where() ObjectRef per host
    done: set = field(default_factory=set)       # indices of hosts whose run() has returned
    failed: bool = False            # a host of a multi-host trial raised or died



class WorkerPool(Protocol):
    """What the controller needs of a pool of trial workers (RayPool, LocalPool).

    A pool has `parallel` slots; each slot runs one trial at a time. `slot_cores[slot]` are the
    host cores a slot's worker is pinned to (empty when not pinned) out of `total_cores`.
    """

    local: bool                     # True: trials run in this process (the cost model)
    shares_cores: bool              # more slots than cores: timings disturb each other
    total_cores: int
    slot_cores: list[list[int]]

    def warm_slot(self, slot: int, chips: int, hosts: int = 1,
                  trial: TrialConfig | None = None) -> bool:
        """The slot's worker already has a mesh of `chips` devices over `hosts` processes
        (compiled programs cached) and, given `trial`, has not yet run a replicate of it
        (`replicate_key`)."""

    def prestart(self, slot: int, chips: int) -> None:
        """Start the slot's single-host worker for `chips` devices now (before its trial)."""

    def wait_started(self, timeout: float) -> None:
        """Wait (at most `timeout` s) until every worker started so far is up."""

    def submit(self, slot: int, trial: TrialConfig, hardware: HardwareProfile | None,
               number: int | None = None) -> Handle:
        """Start one trial on the slot's worker; its result comes from `outcome`."""

    def placement(self, handle: Handle, timeout: float = 0.0) -> dict | None:
        """Where the trial's worker runs (node, pid, cores), None if not known yet."""

    def ready(self, handles: list[Handle], timeout: float) -> list[Handle]:
        """The handles whose trial has finished, waiting at most `timeout` seconds."""

    def outcome(self, handle: Handle) -> Outcome:
        """The finished trial's result; raises TrialError, or WorkerLost if the worker died."""

    def discard(self, handle: Handle) -> None:
        """Give up on a trial (timed out): its worker is stopped."""

    def release_slot(self, slot: int) -> None:
        """Stop a free slot's idle workers: the resources they hold go back to the cluster."""

    def alive_nodes(self) -> list[str]:
        """The nodes that can still run trials ([]: the cluster is lost)."""

    def kill_orphans(self) -> list[int]:
        """Kill this host's worker processes a lost node left running; the pids killed."""

    def workers(self) -> list[dict]:
        """Each live worker's placement."""

    def close(self) -> None:
        """Stop every worker."""


class LocalPool:
    """The analytical backend: the cost model, evaluated in this process."""

    shares_cores = False
    local = True
    total_cores = 1

    def __init__(self, parallel: int = 1):
        self.parallel = parallel
        self.slot_cores = [[] for _ in range(parallel)]

    def warm_slot(self, slot: int, chips: int, hosts: int = 1,
                  trial: TrialConfig | None = None) -> bool:
        return True

    def prestart(self, slot: int, chips: int) -> None:
        pass                        # nothing to start

    def wait_started(self, timeout: float) -> None:
        pass

    def submit(self, slot: int, trial: TrialConfig, hardware: HardwareProfile | None,
               number: int | None = None) -> Handle:
        delay = trial_delay_s(number)
        if delay:
            time.sleep(delay)       # test-only: stretches an analytical sweep in time
        started = time.time()
        handle = Handle(slot, None)
        try:
            measurement = predict(trial, hardware)
            handle.ref = Outcome(measurement, started, time.time(),
                                 {"pid": os.getpid(), "slot": slot, "local": True})
        except Exception as err:  # noqa: BLE001 - a failed trial is data
            handle.error = err
            handle.ref = traceback.format_exc(limit=3)
        return handle

    def ready(self, handles: list[Handle], timeout: float) -> list[Handle]:
        return list(handles)

    def outcome(self, handle: Handle) -> Outcome:
        if handle.error is not None:
            raise TrialError(one_line(handle.error), isinstance(handle.error, ConfigError))
        return handle.ref

    def discard(self, handle: Handle) -> None:
        pass

    def placement(self, handle: Handle, timeout: float = 0.0) -> dict | None:
        return None

    def release_slot(self, slot: int) -> None:
        pass                        # nothing is held between trials

    def alive_nodes(self) -> list[str]:
        return ["local"]            # this process

    def kill_orphans(self) -> list[int]:
        return []

    def workers(self) -> list[dict]:
        return []

    def close(self) -> None:
        pass

