"""Multi-host slices: the plan of a trial whose mesh spans several JAX processes.

A trial with `hosts: H` (a TPU v4-32 slice is 4 hosts x 4 chips; a 16-GPU job is 2 nodes
x 8 GPUs) runs as one JAX process per host, each owning `chips / H` local devices;
`jax.distributed.initialize(coordinator_address, num_processes, process_id)` joins them,
after which `jax.devices()` lists every chip of the slice and the same `shard_map` programs
run over all of them (SPMD: every host runs the same trial code). `RayPool`
(`sweeper/sweep/workers.py`) runs such a trial with this plan:

1. a placement group with one bundle per host (`bundles`), so the slice is reserved whole
   or not at all (no half-started slice holding chips). Strategy STRICT_SPREAD (one host
   per node) when the cluster has at least H nodes, PACK otherwise (H processes on one
   machine: the emulated mesh, or a test);
2. one `MeshWorker` actor per bundle (`PlacementGroupSchedulingStrategy(pg, bundle_index=rank)`),
   its device count set by its constructor before JAX is imported (`PooledMeshWorker`);
3. rank 0 picks the coordinator: its node IP and a port free there (`free_port`); the
   address goes to every host (as an ObjectRef argument, so nothing blocks the
   controller), and each calls `jax.distributed.initialize` with `distributed_args`
   before its first trial.

On TPU VMs Ray exposes each host's chips as the `TPU` resource and a `TPU-<type>-head`
resource on each slice's first host; `rank0_resources={"TPU-v4-32-head": 1}` pins rank 0
(and so the whole slice, with STRICT_SPREAD) to one slice.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass, field
from typing import Any

from workloads.config import ConfigError
from workloads.validate import positive_int

# Seconds each host waits for the others (`jax.distributed.initialize`'s
# initialization_timeout, the barrier before each trial), and for the placement group.
JOIN_TIMEOUT_S = 120
PLACE_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class SlicePlan:
    hosts: int
    chips_per_host: int
    bundles: list[dict[str, float]] = field(default_factory=list)
    strategy: str = "STRICT_SPREAD"
    rank0_resources: dict[str, float] = field(default_factory=dict)   # e.g. a slice-head resource

    @property
    def chips(self) -> int:
        return self.hosts * self.chips_per_host

    def distributed_args(self, rank: int, coordinator_address: str,
                         timeout_s: int = JOIN_TIMEOUT_S) -> dict[str, Any]:
        """The `jax.distributed.initialize` arguments of host `rank`."""
        if not 0 <= rank < self.hosts:
            raise ConfigError("rank", rank, f"0..{self.hosts - 1}")
        return {"coordinator_address": coordinator_address, "num_processes": self.hosts,
                "process_id": rank, "initialization_timeout": int(timeout_s)}


def plan_slice(hosts: int, chips_per_host: int, per_host: dict[str, float] | None = None, *,
               nodes: int | None = None, rank0_resources: dict[str, float] | None = None) -> SlicePlan:
    """One placement-group bundle per host, each with that host's resources.

    `per_host`: the Ray resources one host's worker holds (the space's `resources`, e.g.
    {TPU: 4}); empty for an emulated mesh, whose workers hold no Ray resource, so each
    bundle asks for a sliver of CPU (a bundle cannot be empty). `nodes`: alive nodes in
    the cluster, to choose STRICT_SPREAD (enough nodes) or PACK (one machine).
    """
    positive_int("hosts", hosts)
    positive_int("chips_per_host", chips_per_host)
    bundle = {k: float(v) for k, v in (per_host or {}).items() if v} or dict(EMULATED_BUNDLE)
    bundles = [dict(bundle) for _ in range(hosts)]
    extra = {k: float(v) for k, v in (rank0_resources or {}).items()}
    if extra:
        bundles[0] = {**bundles[0], **extra}
    spread = hosts > 1 and (nodes is None or nodes >= hosts)
    return SlicePlan(hosts, chips_per_host, bundles, "STRICT_SPREAD" if spread else "PACK", extra)


EMULATED_BUNDLE = {"CPU": 0.01}      # what an emulated host's actor requests (num_cpus)


def free_port() -> int:
    """A TCP port free on this node now (the coordinator binds it moments later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]
