"""From `sweeper calibrate`'s measurements to a host profile (docs/host-calibration.md
"How it works"): the microbenchmarks' physical figures, the probes' host cost model
(workloads/hostmodel.py) fitted with a stated pull toward those figures, and the probes'
held-out errors (each probe model predicted by a fit that never saw it), which become the
profile's `heldout_residuals` (the error bands of `sweeper plan`).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Iterable

from workloads import costmodel, hostmodel
from workloads.trial import TrialConfig

PHASE_KEYS = {"prefill": "prefill_s", "decode": "decode_step_s"}
# The read sweep shows a cache only where weights past it stream this much slower per element
# than weights inside it (DRAM against cache: about 2x on the development host).
MIN_CACHE_STEP = 1.3


def _plane(xs: list[tuple[float, ...]], ys: list[float]) -> tuple[float, ...]:
    """(intercept, slopes...) >= 0 of a least-squares fit y = c + sum(slope_i x_i), on
    relative error."""
    import numpy as np
    from scipy.optimize import lsq_linear

    y = np.array(ys, float)
    a = np.column_stack([np.ones(len(y)), np.array(xs, float)]) / y[:, None]
    return tuple(float(v) for v in lsq_linear(a, np.ones(len(y)), bounds=(0, np.inf)).x)


@dataclass
class Microbench:
    """The microbenchmarks' physical figures, per device count n (summed over the devices,
    the way workloads/hostmodel.py counts)."""

    call_s: dict[int, float] = field(default_factory=dict)         # one program call
    op_s: dict[int, float] = field(default_factory=dict)           # one op on every device
    dequant_s: dict[int, float] = field(default_factory=dict)      # per element (all devices)
    read_s: dict[int, float] = field(default_factory=dict)         # per byte read (all devices)
    matmul_flop_s: dict[int, float] = field(default_factory=dict)  # per FLOP, large matmuls
    # per weight element streamed, from every matmul shape: seconds = c + a FLOPs + b k n
    matmul_weight_s: dict[int, float] = field(default_factory=dict)
    collective: dict[str, tuple[float, float]] = field(default_factory=dict)  # "kind/g@n": (s/op, s/B)
    # the read sweep: (bytes of bf16 weights, seconds of the one-row matmul over them), one device
    read_sweep: list[tuple[float, float]] = field(default_factory=list)
    points: list[dict] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"call_s": self.call_s, "op_s": self.op_s, "dequant_s_per_element": self.dequant_s,
                "read_s_per_byte": self.read_s, "matmul_s_per_flop": self.matmul_flop_s,
                "matmul_s_per_weight": self.matmul_weight_s,
                "collective_s_per_op_and_per_byte": {k: list(v) for k, v in self.collective.items()},
                "read_sweep_bytes_and_s": [list(p) for p in self.read_sweep],
                "effective_cache_bytes": self.effective_cache_bytes()}

    def prior(self) -> dict[str, float]:
        """The host model's terms these figures measure directly (the fit's prior), from the
        largest device count measured (its devices share the cores as a trial's do)."""
        out: dict[str, float] = {}
        if self.call_s:
            out["launch"] = self.call_s[min(self.call_s)]
        if self.dequant_s:
            out["dequant"] = statistics.median(self.dequant_s.values())
        if self.matmul_flop_s:
            out["matmul_flops"] = statistics.median(self.matmul_flop_s.values())
        if self.matmul_weight_s:
            out["matmul_weights"] = statistics.median(self.matmul_weight_s.values())
        if self.read_s:
            out["memory_bytes"] = statistics.median(self.read_s.values())
        for term, kinds in (("gather_bytes", ("all-gather",)), ("scatter_bytes", ("reduce-scatter",)),
                            ("exchange_bytes", ("all-to-all", "all-reduce"))):
            slopes = [v[1] for k, v in self.collective.items() if k.split("/")[0] in kinds and v[1] > 0]
            if slopes:
                out[term] = statistics.median(slopes)
        ops = [v[0] for v in self.collective.values() if v[0] > 0]
        if ops:
            out["collective_op"] = statistics.median(ops)
        return out

    def overlap_rows(self) -> float:
        """The weight rows at which a matmul's FLOPs take as long as streaming its bf16
        weights from DRAM (`HostModel.overlap_rows`): per weight element, 2 bytes at the
        read bandwidth against 2 FLOPs per row (0 where either was not measured). The read
        microbenchmark's buffer is larger than the cache, so its bandwidth is DRAM's."""
        if not self.read_s or not self.matmul_flop_s:
            return 0.0
        per_element_s = 2.0 * statistics.median(self.read_s.values())
        return per_element_s / (2.0 * statistics.median(self.matmul_flop_s.values()))

    def effective_cache_bytes(self) -> float:
        """The cache a calibration worker's weights stay in, as the host model counts it
        (`costmodel.host_counts`: the share of the bytes beyond it is 1 - cache / bytes),
        from the read sweep: the cache C whose count, in seconds = call + elements x (a +
        b x max(0, 1 - C / bytes)), best fits the sweep's points on relative error (C on a
        fine grid; call, a, b >= 0 by least squares at each). 0 where the sweep is missing
        or shows no step (per element, its largest weights less than MIN_CACHE_STEP times
        slower than its fastest point): the caller keeps the cache sysfs lists."""
        import numpy as np
        from scipy.optimize import nnls

        if len(self.read_sweep) < 4:
            return 0.0
        sizes = np.array([b for b, _ in sorted(self.read_sweep)], float)
        seconds = np.array([t for _, t in sorted(self.read_sweep)], float)
        elements = sizes / 2.0                                      # bf16
        per_element = seconds / elements
        # against the fastest point, not the smallest: a small call's fixed cost inflates
        # its time per element
        if not per_element[-1] >= MIN_CACHE_STEP * per_element.min():
            return 0.0
        best = (math.inf, 0.0)
        for cache in np.geomspace(sizes.min(), sizes.max(), 400):
            a = np.column_stack([np.ones(len(sizes)), elements,
                                 elements * np.maximum(0.0, 1.0 - cache / sizes)])
            _, residual = nnls(a / seconds[:, None], np.ones(len(sizes)))
            best = min(best, (residual, float(cache)))
        return best[1]

    def collective_latency_max_s(self) -> float:
        """The profile's `collective_latency_max_s` (0: none measured): a per-op start-up
        latency is part of a collective, never more than a whole one (docs/calibration.md
        "How the fit works"). Per kind, the whole op at the smallest payload measured, on the
        smallest group and device count (the least a collective of that kind took here); the
        slowest kind's, so the bound holds for every kind the fit prices with one latency."""
        smallest: dict[str, tuple[tuple[float, int, int], float]] = {}
        for r in self.points:
            task = r["task"]
            if task["kind"] != "collective" or not r.get("ok", True) or not r.get("seconds"):
                continue
            key = (r["bytes_per_chip"], task["group"], r["devices"])
            if task["op"] not in smallest or key < smallest[task["op"]][0]:
                smallest[task["op"]] = (key, r["seconds"])
        return max((s for _, s in smallest.values()), default=0.0)


def microbench(records: Iterable[dict]) -> Microbench:
    """Summarise the microbenchmark records of workloads/hostcal.py (trial records ignored)."""
    mb = Microbench()
    largest: dict[int, tuple[float, float]] = {}
    collectives: dict[str, list[tuple[float, float]]] = {}
    shapes: dict[int, list[tuple[tuple[float, float], float]]] = {}
    for r in records:
        task, n = r["task"], r["devices"]
        kind = task["kind"]
        if kind == "trial":
            continue
        mb.points.append({k: v for k, v in r.items() if k not in ("traceback",)})
        if kind == "dispatch":
            mb.call_s[n], mb.op_s[n] = r["call_s"], r["op_s"]
        elif kind == "dequant":
            mb.dequant_s[n] = r["seconds"] / (r["elements"] * n)
        elif kind == "memory":
            mb.read_s[n] = 1.0 / (r["bytes_per_s"] * n)
        elif kind == "cache" and n == 1:
            mb.read_sweep.append((2.0 * r["elements"], r["seconds"]))
        elif kind == "matmul":
            flops = 2.0 * task["m"] * task["k"] * task["n"] * n
            if flops > largest.get(n, (0.0, 0.0))[0]:
                largest[n] = (flops, r["seconds"] / flops)
            shapes.setdefault(n, []).append(((flops, task["k"] * task["n"] * n), r["seconds"]))
        elif kind == "collective":
            key = f"{task['op']}/{task['group']}@{n}"
            collectives.setdefault(key, []).append((r["bytes_per_chip"] * n, r["seconds"]))
    mb.matmul_flop_s = {n: v[1] for n, v in largest.items()}
    for n, pts in shapes.items():
        if len(pts) >= 4:       # the call's cost, a FLOP's and a streamed weight element's
            mb.matmul_weight_s[n] = _plane([x for x, _ in pts], [y for _, y in pts])[2]
    for key, pts in collectives.items():
        n = int(key.split("@")[1])
        if len(pts) >= 2:
            intercept, slope = _plane([(x,) for x, _ in pts], [y for _, y in pts])
            mb.collective[key] = (intercept / n, slope)     # per op per device, per byte (all devices)
    return mb


@dataclass
class Probe:
    """One probe trial's measurements and the host model's counts of its two phases."""

    config: TrialConfig
    measured: dict[str, float]
    ci_rel: dict[str, float]
    counts: dict[str, dict[str, float]]

    @property
    def group(self) -> str:
        return self.config.model.name


def probes(records: Iterable[dict], cache_bytes: float, overlap_rows: float = 0.0) -> list[Probe]:
    out = []
    for r in records:
        if r["task"]["kind"] != "trial" or not r.get("ok"):
            continue
        config = TrialConfig.from_dict(r["task"]["config"]).resolved()
        calls = costmodel.phase_calls(config)
        measured = {ph: r[key] for ph, key in PHASE_KEYS.items()}
        if not all(isinstance(v, (int, float)) and v > 0 for v in measured.values()):
            continue
        ci = {ph: r.get(f"{ph}_ci_rel") for ph in PHASE_KEYS}
        out.append(Probe(config, measured, ci,
                         {ph: costmodel.host_counts(calls[ph], cache_bytes, overlap_rows)
                          for ph in PHASE_KEYS}))
    return out


@dataclass
class HostFit:
    model: hostmodel.HostModel
    heldout: dict[str, list[float]]          # per phase: predicted / measured - 1, held out
    probes: list[Probe]

    def mape(self) -> dict[str, float]:
        return {ph: statistics.fmean(abs(e) for e in errs) for ph, errs in self.heldout.items()
                if errs}


def fit(points: list[Probe], prior: dict[str, float], share: float, cache_bytes: float,
        worker_cores: float = 1.0, overlap_rows: float = 0.0) -> HostFit:
    """The host model fitted on every probe (its costs, then each mesh size's
    `hostmodel.device_factors`), and each probe model's errors from a fit without it."""
    costs, factors, heldout = {}, {}, {}
    devices = [p.config.chips for p in points]
    for phase in PHASE_KEYS:
        rows = [p.counts[phase] for p in points]
        measured = [p.measured[phase] for p in points]
        groups = [p.group for p in points]
        costs[phase] = hostmodel.fit_costs(rows, measured, prior)
        factors[phase] = hostmodel.device_factors(rows, measured, devices, costs[phase])
        heldout[phase] = [e for e in hostmodel.heldout_errors(rows, measured, groups, prior,
                                                              devices)
                          if math.isfinite(e)]
    return HostFit(hostmodel.HostModel(costs, share, cache_bytes, worker_cores,
                                       overlap_rows=overlap_rows,
                                       device_factors={ph: f for ph, f in factors.items() if f}
                                       or None), heldout, points)
