"""What `sweeper calibrate` measures, as task lists for workloads/hostcal.py processes
(docs/host-calibration.md "What it measures").

Per device count n of the calibration (1, 2, 4 by default):
- the dispatch chain (per call and per op on n devices);
- the engine's matmul at MATMUL_SHAPES (rows 1 to 512 against square and skewed weights);
- int8 dequantisation of DEQUANT_ELEMENTS weight elements;
- read bandwidth;
- on one device, the read sweep: a decode row's matmul over weights of CACHE_BYTES, whose time
  per element steps up where the weights outgrow the cache the worker gets;
- every collective kind over every group size g > 1 dividing n, at COLLECTIVE_BYTES;
- the probe trials of that chip count (workloads/probes.py, CALIBRATION_SEED).
"""

from __future__ import annotations

from dataclasses import dataclass

from sweeper.calibrate.runner import Batch
from workloads import probes
from workloads.opprofile import KINDS, group_sizes

MATMUL_SHAPES = tuple((m, k, n) for m in (1, 2, 8, 32, 128, 512)
                      for k, n in ((256, 256), (1024, 1024), (512, 2048), (2048, 512)))
DEQUANT_ELEMENTS = (2**18, 2**22)
# the read sweep's weight sizes: from well inside a core's share of a last-level cache to
# well past any (the step's position is what it measures; `--quick` takes every other one)
CACHE_BYTES = tuple(int(mib * 2**20) for mib in (1, 2, 3, 4, 6, 8, 10, 12, 16, 24, 32, 48, 64))
COLLECTIVE_BYTES = (4 * 2**10, 64 * 2**10, 2**20)
# At least 3 timed runs (a sweep's default is 5): the probes with the slowest layouts on
# this host (weight-gathered decode steps of 0.2-0.5 s) spend most of the calibration in
# their minimum runs, while a fast probe runs until its CI or the budget stops it. 8 decode
# steps, as the blind benchmark's trials: 16 took the calibration past 5 minutes once the
# ladder (probes.ladder) was added; one calibration of each predicted the development
# trials about as well (docs/host-calibration.md).
PROBE_FIELDS = dict(repeats=3, warmup=1, time_budget_s=0.6, decode_steps=8)


@dataclass(frozen=True)
class Plan:
    chips: tuple[int, ...]
    probe_models: int
    trials_per_chip: int
    seed: int = probes.CALIBRATION_SEED
    ladder: bool = True             # probes.ladder's trials too

    def probe_draw(self) -> probes.Draw:
        """The random probes, then the ladder of the distribution's cheapest corner."""
        drawn = probes.draw(self.seed, self.probe_models, self.trials_per_chip, self.chips,
                            prefix="probe", **PROBE_FIELDS)
        if not self.ladder:
            return drawn
        rungs = probes.ladder(self.seed, self.chips, prefix="probe", **PROBE_FIELDS)
        return probes.Draw(self.seed, drawn.models + rungs.models, drawn.trials + rungs.trials)


FULL = Plan(chips=(1, 2, 4), probe_models=12, trials_per_chip=2)
QUICK = Plan(chips=(1, 2), probe_models=4, trials_per_chip=1)


def micro_tasks(n: int, quick: bool = False) -> list[dict]:
    shapes = MATMUL_SHAPES[::3] if quick else MATMUL_SHAPES
    tasks = [{"kind": "dispatch"}, {"kind": "memory"}]
    tasks += [{"kind": "matmul", "m": m, "k": k, "n": nn} for m, k, nn in shapes]
    tasks += [{"kind": "dequant", "elements": e} for e in DEQUANT_ELEMENTS]
    if n == 1:
        tasks += [{"kind": "cache", "bytes": b} for b in (CACHE_BYTES[::2] if quick else CACHE_BYTES)]
    sizes = COLLECTIVE_BYTES[::2] if quick else COLLECTIVE_BYTES
    tasks += [{"kind": "collective", "op": op, "group": g, "bytes": b}
              for g in group_sizes(n) for op in KINDS for b in sizes]
    return tasks


def batches(plan: Plan, quick: bool = False) -> list[Batch]:
    """One shared task list per chip count: its microbenchmarks, then its probes (the slots'
    processes take tasks from it in turn: runner.py)."""
    draw = plan.probe_draw()
    out = []
    for n in plan.chips:
        tasks = micro_tasks(n, quick)
        tasks += [{"kind": "trial", "config": t.to_dict(), "model": t.model.name}
                  for t in draw.trials if t.chips == n]
        out.append(Batch(n, tasks, cost_s=len(tasks) * (1 + n), label=f"{n} chip(s)"))
    return out
