"""The host cost model: what one phase call of the engine costs on an emulated mesh of THIS
host, as a sum of physical terms, each a count the call implies times a cost per unit
that `sweeper calibrate` measured on this host (docs/host-calibration.md).

An emulated mesh's n virtual devices share the worker's cores (docs/architecture.md,
"Emulated mesh"): XLA CPU runs every device's ops on them, one after another where they
share one core, so a call costs the sum over its devices of what each device does. Every
count below is therefore summed over the n devices (`per chip x n`), and the paper's
overlap of compute, memory and communication does not happen on one core: the terms add.

| term            | count (summed over the devices)                               | cost per unit          |
|-----------------|---------------------------------------------------------------|------------------------|
| launch          | 1 per call                                                    | s per program call     |
| layer_device    | layers x devices                                              | s (per-layer dispatch) |
| collective_op   | collective ops x devices                                      | s (rendezvous, launch) |
| layer_mesh      | layers x devices, on a mesh of more than one device           | s (per-layer handover) |
| gather_bytes    | all-gather bytes per chip x devices                           | s per byte             |
| dram_gather     | gather_bytes beyond the worker's cache (as dram_bytes)        | s per byte             |
| scatter_bytes   | reduce-scatter bytes per chip x devices                       | s per byte             |
| exchange_bytes  | all-to-all and all-reduce bytes x devices                     | s per byte             |
| matmul_flops    | weight-matmul FLOPs (paper §2: 2 per multiply-add)            | s per FLOP             |
| matmul_weights  | weight elements each matmul pass streams (FLOPs / rows / 2)   | s per element          |
| attention_flops | attention FLOPs (paper §2 convention)                         | s per FLOP             |
| attention_rows  | attention FLOPs / the rows sharing a KV head (§3.3)           | s per FLOP-row         |
| memory_bytes    | weight and KV bytes read (costmodel.predict_phase's)          | s per byte             |
| dram_bytes      | the part of those bytes beyond the worker's cache             | s per byte             |
| dram_weights    | matmul_weights beyond the cache, the same fraction            | s per element          |
| dequant         | int8 weight elements turned back into bf16 each call          | s per element          |
| dram_dequant    | dequant elements beyond the cache, the same fraction          | s per element          |
| fault_bytes     | a device's temp buffer x devices, where it is past malloc's   | s per byte             |
|                 | mmap threshold (32 MiB): mapped and page-faulted every call   |                        |
| elementwise     | prefill: prompt tokens x layers x (d_model x devices + d_ff)  | s per element          |

A decode call's `dram_weights` count shrinks as its matmuls' rows approach `overlap_rows`
(the rows at which FLOPs take as long as streaming the weights from DRAM, from the read
bandwidth and matmul microbenchmarks): past it the stream runs under the compute.

Costs are fitted per phase (prefill and decode run different kernels) by non-negative
least squares on relative error, over real trials of random probe models
(workloads/probes.py), with a stated pull toward the microbenchmarks' figures where one
measured the same quantity (`PRIOR_WEIGHT`); then each mesh size's probes give it a factor
on every term (`device_factors`: what a mesh adds past the shared costs). The probes of one
model are held out together to score it (`heldout_errors`), so the residuals a plan's band
is built from are of models the fit never saw.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np


TERMS = ("launch", "layer_device", "collective_op", "layer_mesh", "gather_bytes", "dram_gather",
         "scatter_bytes", "exchange_bytes", "matmul_flops", "matmul_weights", "attention_flops",
         "attention_rows", "memory_bytes", "dram_bytes", "dram_weights", "dequant", "dram_dequant",
         "fault_bytes", "elementwise")
UNITS = {"launch": "s", "layer_device": "s", "collective_op": "s", "layer_mesh": "s",
         "gather_bytes": "s/B", "dram_gather": "s/B",
         "scatter_bytes": "s/B", "exchange_bytes": "s/B", "matmul_flops": "s/FLOP",
         "matmul_weights": "s/element", "attention_flops": "s/FLOP", "attention_rows": "s/FLOP-row",
         "memory_bytes": "s/B", "dram_bytes": "s/B", "dram_weights": "s/element",
         "dequant": "s/element", "dram_dequant": "s/element", "fault_bytes": "s/B",
         "elementwise": "s/element"}
# Terms whose count is work the devices share the cores for: a worker with more cores than
# the calibration's runs them faster, up to one core per device (`throughput_ratio`); the
# dispatch terms do not.
THROUGHPUT_TERMS = frozenset(TERMS) - {"launch", "layer_device", "collective_op", "layer_mesh"}
PHASES = ("prefill", "decode")
# Bumped whenever TERMS or a count changes: a calibration made with other terms is stale
# (hostprofile.calibrated_profile ignores it; `sweeper calibrate` makes a new one).
TERMS_VERSION = 7
# The pull toward a microbenchmark's figure: a coefficient at 2x its microbenchmark costs as
# much as one probe mispredicted by PRIOR_WEIGHT x ln 2 (3.5%); terms without one are free.
PRIOR_WEIGHT = 0.05


@dataclass(frozen=True)
class HostModel:
    """A host's fitted costs: {phase: {term: cost per unit}}, the worker share they were
    measured at (a worker's cores / the host's cores) and the host's cache as the model
    counts it (a calibration worker's, from its read sweep, over its share: `cache_for`)."""

    costs: Mapping[str, Mapping[str, float]]
    share: float
    cache_bytes: float = 0.0
    worker_cores: float = 1.0     # the cores each calibration worker had (`share` of the host)
    # The costs on a mesh of more than one device, where a study's fit found them to differ
    # (sweeper/analysis/hostfit.py); None: `costs` at every chip count, as calibrated.
    mesh_costs: Mapping[str, Mapping[str, float]] | None = None
    # the weight rows at which a matmul's FLOPs take as long as streaming its bf16 weights
    # from DRAM on this host (costmodel.host_counts; 0: no overlap)
    overlap_rows: float = 0.0
    # {phase: {devices: factor}}: how much slower than the terms price them the calibration's
    # own probes on a mesh of that many devices ran (`device_factors`); None: 1 everywhere
    device_factors: Mapping[str, Mapping[int, float]] | None = None

    def to_dict(self) -> dict:
        out = {"share": self.share, "cache_bytes": self.cache_bytes,
               "worker_cores": self.worker_cores, "overlap_rows": self.overlap_rows,
               "costs": {phase: dict(terms) for phase, terms in self.costs.items()}}
        if self.mesh_costs is not None:
            out["mesh_costs"] = {phase: dict(terms) for phase, terms in self.mesh_costs.items()}
        if self.device_factors:
            out["device_factors"] = {phase: {int(n): float(f) for n, f in table.items()}
                                     for phase, table in self.device_factors.items()}
        return out

    @classmethod
    def from_dict(cls, data: Mapping) -> "HostModel":
        def costs_of(table) -> dict:
            return {phase: {t: float(v) for t, v in terms.items() if t in TERMS}
                    for phase, terms in (table or {}).items() if phase in PHASES}

        mesh = data.get("mesh_costs")
        factors = {phase: {int(n): float(f) for n, f in (table or {}).items()}
                   for phase, table in (data.get("device_factors") or {}).items()
                   if phase in PHASES}
        return cls(costs_of(data.get("costs")), float(data.get("share", 1.0)),
                   float(data.get("cache_bytes", 0.0)), float(data.get("worker_cores", 1.0)),
                   costs_of(mesh) if mesh else None, float(data.get("overlap_rows", 0.0)),
                   factors or None)

    def costs_for(self, phase: str, chips: int) -> Mapping[str, float]:
        """A phase's costs on `chips` devices: `mesh_costs` past one device where a fit set them."""
        if chips > 1 and self.mesh_costs and phase in self.mesh_costs:
            return self.mesh_costs[phase]
        return self.costs[phase]

    def device_factor(self, phase: str, chips: int) -> float:
        """The factor a call on `chips` devices is priced at (`device_factors`): 1 on one
        device; a calibrated count's own; between two, straight in log(devices); past the
        largest, the largest's (a mesh the calibration did not run is not extrapolated)."""
        table = (self.device_factors or {}).get(phase) or {}
        if chips <= 1 or not table:
            return 1.0
        counts, factors = zip(*sorted({1: 1.0, **table}.items()))
        # np.interp clamps at both ends: flat past the largest count, as the docstring says
        return float(np.exp(np.interp(np.log(chips), np.log(counts), np.log(factors))))

    def throughput_ratio(self, share: float, chips: int) -> float:
        """The throughput terms' time on a worker with `share` of the host and `chips`
        emulated devices, over their time at the calibration. The devices' work spreads
        over at most one core per device: the sweep's and the serve's workers are pinned
        to at most that many (sweeper/sweep/meshworker.py `device_cores`), so a worker runs
        them min(its cores, chips) at a time, the calibration's workers min(worker_cores,
        chips). Unpinned, a one-device worker on two cores was neither: 9-17% slower than
        on one on a d128 model, 25-35% faster on a d640 one."""
        return min(self.worker_cores, chips) / self.busy_cores(share, chips)

    def busy_cores(self, share: float, chips: int) -> float:
        """The cores a worker with `share` of the host runs its `chips` devices on: at most
        one per device (the workers are pinned so)."""
        return min(share / self.share * self.worker_cores, chips)

    def cache_for(self, share: float, chips: int = 1) -> float:
        """The cache a worker with `share` of the host running `chips` devices keeps its
        weights in: a calibration worker's (`cache_bytes` x `share` at the calibration's
        share) per core it runs devices on (`busy_cores`). Not its share of the host's: on
        the development host a lone worker's read sweep stepped to DRAM at the same size as
        one beside another (docs/host-calibration.md, "What it measures")."""
        return self.cache_bytes * self.share / self.worker_cores * self.busy_cores(share, chips)

    def term_seconds(self, term_counts: Mapping[str, float], phase: str, share: float,
                     chips: int) -> dict[str, float]:
        """{term: seconds} of a call (its `costmodel.host_counts`) on a worker with `share` of
        the host running `chips` devices: count x cost, throughput terms scaled, every term
        times the mesh's `device_factor`."""
        factor = self.device_factor(phase, chips)
        seconds = term_seconds(term_counts, self.costs_for(phase, chips),
                               self.throughput_ratio(share, chips))
        return {t: v * factor for t, v in seconds.items()} if factor != 1.0 else seconds


def term_seconds(term_counts: Mapping[str, float], costs: Mapping[str, float],
                 throughput_ratio: float = 1.0) -> dict[str, float]:
    """{term: count x cost}; throughput terms scaled by the calibration's share / the worker's."""
    return {t: term_counts[t] * c * (throughput_ratio if t in THROUGHPUT_TERMS else 1.0)
            for t, c in costs.items()}


def predict_seconds(term_counts: Mapping[str, float], costs: Mapping[str, float],
                    throughput_ratio: float = 1.0) -> float:
    """The sum of `term_seconds`."""
    return sum(term_seconds(term_counts, costs, throughput_ratio).values())


# --------------------------------------------------------------------------- fitting


def fit_costs(rows: Sequence[Mapping[str, float]], measured: Sequence[float],
              prior: Mapping[str, float] | None = None, terms: Sequence[str] = TERMS) -> dict[str, float]:
    """Non-negative costs minimising sum((predicted / measured - 1)^2) over the rows, plus
    PRIOR_WEIGHT x (cost / prior - 1) for each term with a prior (scipy's lsq_linear)."""
    import numpy as np
    from scipy.optimize import lsq_linear

    prior = {t: v for t, v in (prior or {}).items() if t in terms and v and v > 0}
    y = np.asarray(measured, float)
    a = np.array([[r[t] for t in terms] for r in rows], float) / y[:, None]
    b = np.ones(len(y))
    scale = np.abs(a).max(axis=0)
    scale[scale == 0] = 1.0
    extra_a, extra_b = [], []
    for j, t in enumerate(terms):
        if t in prior:
            row = np.zeros(len(terms))
            row[j] = PRIOR_WEIGHT / prior[t]
            extra_a.append(row)
            extra_b.append(PRIOR_WEIGHT)
    if extra_a:
        a = np.vstack([a, np.array(extra_a)])
        b = np.concatenate([b, extra_b])
    solution = lsq_linear(a / scale, b, bounds=(0, np.inf), method="bvls")
    return {t: float(v) for t, v in zip(terms, solution.x / scale)}


def device_factors(rows: Sequence[Mapping[str, float]], measured: Sequence[float],
                   devices: Sequence[int], costs: Mapping[str, float]) -> dict[int, float]:
    """{devices: factor} for each device count past one among the rows: the median of
    measured / predicted (geometric) of that count's rows at `costs`.

    The terms add each device's work as if the devices took the core in turn, and the fit
    shares one cost per term over every device count, so what a mesh adds beyond that
    lands on its residuals: on the development host the calibration's own 4-device probes
    ran a median 6-11% slower than the fitted terms priced them, its 1- and 2-device ones
    about as priced, and applying the factor cut the profile's error on the trials of three
    spent blind runs by 1-2 points in each phase (docs/host-calibration.md)."""
    logs: dict[int, list[float]] = {}
    for r, m, n in zip(rows, measured, devices):
        predicted = predict_seconds(r, costs)
        if n > 1 and predicted > 0 and m > 0:
            logs.setdefault(int(n), []).append(math.log(m / predicted))
    return {n: math.exp(statistics.median(v)) for n, v in sorted(logs.items())}


def heldout_errors(rows: Sequence[Mapping[str, float]], measured: Sequence[float],
                   groups: Sequence, prior: Mapping[str, float] | None = None,
                   devices: Sequence[int] | None = None) -> list[float]:
    """Each row's relative error (predicted / measured - 1) from a fit without its group
    (with `devices`, each row's device count: the fit's `device_factors` too)."""
    out = [math.nan] * len(rows)
    for g in sorted(set(groups), key=str):
        train = [i for i, gg in enumerate(groups) if gg != g]
        if not train:
            continue
        costs = fit_costs([rows[i] for i in train], [measured[i] for i in train], prior)
        factors = (device_factors([rows[i] for i in train], [measured[i] for i in train],
                                  [devices[i] for i in train], costs) if devices else {})
        for i, gg in enumerate(groups):
            if gg == g:
                factor = factors.get(int(devices[i]), 1.0) if devices else 1.0
                out[i] = factor * predict_seconds(rows[i], costs) / measured[i] - 1.0
    return out
