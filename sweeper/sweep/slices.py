"""Multi-host slices: one Ray actor per host, JAX's distributed runtime across them.

A trial whose mesh spans several hosts (a TPU v4-32 slice is 4 hosts x 4 chips; a 16-GPU
job is 2 nodes x 8 GPUs) runs as one JAX process per host. Each process sees only its
host's chips; `jax.distributed.initialize(coordinator_address, num_processes, process_id)`
joins them, after which `jax.devices()` lists every chip of the slice and one `shard_map`
program runs over all of them (SPMD: every host runs the same trial code).

With Ray this is:

1. a placement group with one bundle per host, `{<accelerator>: chips_per_host}`, strategy
   STRICT_SPREAD (each bundle on a different node), so the slice is reserved whole or not
   at all (no half-started slice holding chips);
2. one actor per bundle (`PlacementGroupSchedulingStrategy(pg, bundle_index=rank)`);
3. the coordinator is rank 0's node: each actor reports its node IP (`where()`), then every
   actor gets `coordinator_address=<rank-0 IP>:<port>`, `num_processes=hosts`,
   `process_id=rank` and calls `jax.distributed.initialize` before it imports anything that
   starts the JAX backend.

`plan_slice` computes the bundles and, given the rank-0 address, each host's arguments;
`start_slice` reserves the slice and starts the actors on a running cluster; `SliceHost`
is a minimal actor that reports where it landed and what it would initialise with (the
tests run it on a two-node local cluster, where nothing needs a TPU). On TPU VMs Ray
exposes each host's chips as the `TPU` resource and a `TPU-<type>-head` resource on each
slice's first host; request `{"TPU-v4-32-head": 1}` for rank 0 to pin a trial to one slice.

The sweep's engine measures single-process meshes today (`hardware: host | devices`, one
worker per trial); this module is the part of a multi-host trial that does not depend on the
engine: reserving hosts, placing one worker per host and wiring the distributed runtime.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from sweeper.sweep.workers import where_am_i
from workloads.config import ConfigError

COORDINATOR_PORT = 8476       # the port JAX's own examples use for the coordinator service
ENV_COORDINATOR = "SWEEPER_JAX_COORDINATOR"
ENV_NUM_PROCESSES = "SWEEPER_JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "SWEEPER_JAX_PROCESS_ID"


@dataclass(frozen=True)
class SlicePlan:
    hosts: int
    chips_per_host: int
    accelerator: str                          # the Ray resource one chip is ("TPU", "GPU", ...)
    bundles: list[dict[str, float]] = field(default_factory=list)
    strategy: str = "STRICT_SPREAD"
    coordinator_port: int = COORDINATOR_PORT
    rank0_resources: dict[str, float] = field(default_factory=dict)   # e.g. a slice-head resource

    @property
    def chips(self) -> int:
        return self.hosts * self.chips_per_host

    def distributed_args(self, rank: int, coordinator_ip: str) -> dict[str, Any]:
        """The `jax.distributed.initialize` arguments of host `rank`."""
        if not 0 <= rank < self.hosts:
            raise ConfigError("rank", rank, f"0..{self.hosts - 1}")
        return {"coordinator_address": f"{coordinator_ip}:{self.coordinator_port}",
                "num_processes": self.hosts, "process_id": rank}

    def host_env(self, rank: int, coordinator_ip: str) -> dict[str, str]:
        """The same, as environment variables for a worker's runtime_env."""
        args = self.distributed_args(rank, coordinator_ip)
        return {ENV_COORDINATOR: args["coordinator_address"],
                ENV_NUM_PROCESSES: str(args["num_processes"]), ENV_PROCESS_ID: str(rank)}


def plan_slice(hosts: int, chips_per_host: int, accelerator: str = "TPU", *,
               rank0_resources: dict[str, float] | None = None,
               coordinator_port: int = COORDINATOR_PORT) -> SlicePlan:
    """One placement-group bundle per host, each with that host's chips."""
    for name, value in (("hosts", hosts), ("chips_per_host", chips_per_host)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(name, value, "a positive integer")
    if not accelerator:
        raise ConfigError("accelerator", accelerator, "a Ray resource name such as TPU or GPU")
    bundles = [{accelerator: float(chips_per_host)} for _ in range(hosts)]
    extra = dict(rank0_resources or {})
    if extra:
        bundles[0] = {**bundles[0], **{k: float(v) for k, v in extra.items()}}
    return SlicePlan(hosts, chips_per_host, accelerator, bundles,
                     "STRICT_SPREAD" if hosts > 1 else "STRICT_PACK", coordinator_port, extra)


def distributed_args_from_env(environ: dict[str, str] | None = None) -> dict[str, Any] | None:
    """What a worker started with `host_env` passes to `jax.distributed.initialize`."""
    env = os.environ if environ is None else environ
    if ENV_COORDINATOR not in env:
        return None
    return {"coordinator_address": env[ENV_COORDINATOR],
            "num_processes": int(env[ENV_NUM_PROCESSES]), "process_id": int(env[ENV_PROCESS_ID])}


class SliceHost:
    """One host of a slice (a Ray actor): where it runs, and its JAX distributed set-up."""

    def __init__(self, rank: int):
        self.rank = rank
        self.args: dict[str, Any] | None = None

    def where(self) -> dict[str, Any]:
        return {**where_am_i(), "rank": self.rank}

    def connect(self, args: dict[str, Any], initialize: bool = True) -> dict[str, Any]:
        """Join the slice: `jax.distributed.initialize(**args)` (skipped when not initialize)."""
        self.args = dict(args)
        if initialize:
            import jax   # lazy: JAX starts its backend; only in the process that runs a trial

            jax.distributed.initialize(**self.args)
        return {"rank": self.rank, **self.args}


def start_slice(plan: SlicePlan, actor_class=SliceHost, *, timeout_s: float = 60.0,
                initialize: bool = True):
    """Reserve the slice (placement group), start one actor per host, wire the coordinator.

    Returns (placement group, actors in rank order, their where() answers, the arguments each
    connected with). Raises TimeoutError when the cluster cannot hold the slice in time.
    """
    import ray   # lazy: Ray (~1 s) only where a pool or cluster is used
    from ray.util.placement_group import placement_group, remove_placement_group   # lazy: Ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy   # lazy: Ray

    pg = placement_group(plan.bundles, strategy=plan.strategy)
    ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
    if not ready:
        remove_placement_group(pg)
        raise TimeoutError(f"the cluster cannot place {plan.hosts} x {plan.bundles[-1]} "
                           f"({plan.strategy}) within {timeout_s:g}s")
    remote = ray.remote(actor_class)
    actors = [remote.options(num_cpus=0, scheduling_strategy=PlacementGroupSchedulingStrategy(
        pg, placement_group_bundle_index=rank)).remote(rank) for rank in range(plan.hosts)]
    places = ray.get([a.where.remote() for a in actors], timeout=timeout_s)
    coordinator_ip = places[0]["node_ip"]
    connected = ray.get([a.connect.remote(plan.distributed_args(rank, coordinator_ip), initialize)
                         for rank, a in enumerate(actors)], timeout=timeout_s)
    return pg, actors, places, connected
