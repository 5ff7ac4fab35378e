"""`sweeper calibrate`: measure this host once, write the profile every `host` prediction
uses from then on (docs/host-calibration.md).

    result = calibrate(plan=tasks.FULL, progress=print)
    result.path          # $SWEEPER_HOME/calibration/host.yaml (or --out)

Steps: the host's peaks (workloads/hostprofile.py, cached); the microbenchmarks and the
probe trials in pinned processes, one core per slot as a sweep runs them (runner.py,
tasks.py); the host cost model fitted to the probes with the microbenchmarks as its prior,
every probe model also predicted by a fit without it (fitting.py); the serving loop's host
costs on a probe deployment (sweeper/serving/overheads.py), unless skipped; the profile
YAML, its `calibration` notes and a side file of every measured point.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import yaml

from sweeper.calibrate import fitting, runner, tasks
from workloads import hostmodel, hostprofile
from workloads.config import HardwareProfile

CALIBRATION_VERSION = 1


def last_level_cache_bytes() -> float:
    """The host's last-level cache (the largest cache sysfs lists for CPU 0), 0 if unknown."""
    best = 0.0
    base = Path("/sys/devices/system/cpu/cpu0/cache")
    for index in base.glob("index*"):
        try:
            text = (index / "size").read_text().strip().upper()
        except OSError:
            continue
        scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
        try:
            best = max(best, float(text.rstrip("KMG")) * scale)
        except ValueError:
            continue
    return best


@dataclass
class Result:
    profile: HardwareProfile
    path: Path
    points_path: Path
    fit: fitting.HostFit
    micro: fitting.Microbench
    failed: list[dict]
    elapsed_s: float


def _progress_counter(total: int, progress: Callable[[str], None] | None, start: float):
    done = [0]

    def on_record(rec: dict) -> None:
        done[0] += 1
        if progress is None:
            return
        task = rec["task"]
        what = task["kind"] if task["kind"] != "trial" else f"probe {task.get('model', '')}"
        elapsed = time.perf_counter() - start
        eta = elapsed / done[0] * (total - done[0])
        status = "" if rec.get("ok") else f" FAILED: {rec.get('error', '')[:80]}"
        progress(f"[calibrate {done[0]}/{total}] {rec['devices']} device(s): {what}{status}"
                 f" | {elapsed:.0f} s, ETA {eta:.0f} s")

    return on_record


def calibrate(plan: tasks.Plan = tasks.FULL, quick: bool = False, out: Path | None = None,
              progress: Callable[[str], None] | None = None, slots: list[list[int]] | None = None,
              serving: Callable[[HardwareProfile], dict] | None = None) -> Result:
    """Measure, fit and write this host's profile. `serving`: a function that measures the
    serving loop's host costs with the fitted profile (None: not measured)."""
    start = time.perf_counter()
    load_before = os.getloadavg()[0]
    base = hostprofile.host_profile(calibrated=False)          # the peaks (measured once, cached)
    slots = slots or runner.slots_of_this_host()
    share = len(slots[0]) / max(hostprofile.host_cores(), 1)
    batches = tasks.batches(plan, quick=quick)
    total = sum(len(b.tasks) for b in batches)
    outcome = runner.run(batches, slots, _progress_counter(total, progress, start))
    micro = fitting.microbench(outcome.records)
    # the host's cache as the model counts it: the read sweep's, measured at this share
    # (HostModel.cache_for gives it back to a worker of the share); sysfs's where none
    listed, measured = last_level_cache_bytes(), micro.effective_cache_bytes()
    cache = measured / share if measured > 0 else listed
    overlap_rows = micro.overlap_rows()
    probes = fitting.probes(outcome.records, cache * share, overlap_rows)
    if len({p.group for p in probes}) < 2:
        raise RuntimeError(f"only {len(probes)} probe trials finished ({len(outcome.failed)} "
                           "measurements failed): too few to fit a host model")
    host_fit = fitting.fit(probes, micro.prior(), share, cache, worker_cores=len(slots[0]),
                           overlap_rows=overlap_rows)
    profile = dataclasses.replace(
        base, name="host", host_model=host_fit.model.to_dict(),
        collective_latency_max_s=micro.collective_latency_max_s(),
        heldout_residuals={ph: [round(e, 6) for e in errs] for ph, errs in host_fit.heldout.items()})
    path = Path(out) if out else hostprofile.calibration_path()
    notes = {
        "host_key": hostprofile.host_key(), "version": CALIBRATION_VERSION,
        "terms_version": hostmodel.TERMS_VERSION,
        "calibrated_at": time.strftime("%Y-%m-%d %H:%M"), "path": str(path),
        "probe_seed": plan.seed, "probe_models": len({p.group for p in probes}),
        "probe_trials": len(probes), "chips": list(plan.chips), "worker_share": share,
        "heldout_mape": {ph: round(v, 4) for ph, v in host_fit.mape().items()},
        "failed_measurements": len(outcome.failed),
        "load_average_1min": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "cache_bytes": cache,
        "cache_source": "read sweep" if measured > 0 else "sysfs",
        "cache_bytes_sysfs": listed,
    }
    profile = dataclasses.replace(profile, calibration=notes)
    if serving is not None:
        costs = serving(profile)
        profile = dataclasses.replace(profile, **costs.get("fields", {}))
        notes["serving_host_costs"] = costs.get("detail", {})
        notes["serving_spread"] = costs.get("spread", {})    # a plan's band draws from it
    notes["elapsed_s"] = round(time.perf_counter() - start, 1)
    profile = dataclasses.replace(profile, calibration=notes)
    points_path = write(profile, path, outcome, micro)
    return Result(profile, path, points_path, host_fit, micro, outcome.failed,
                  time.perf_counter() - start)


def write(profile: HardwareProfile, path: Path, outcome: runner.Outcome,
          micro: fitting.Microbench) -> Path:
    """The profile YAML (atomically) and `<stem>.points.json` beside it (every record)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    header = ("# sweeper calibrate: this host's measured profile (docs/host-calibration.md).\n"
              "# `hardware: host` uses it while calibration.host_key is this host's; every\n"
              "# measured point is in the .points.json beside it.\n")
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(header + yaml.safe_dump(profile.to_dict(), sort_keys=False))
    tmp.replace(path)
    points = path.with_suffix(".points.json")
    points.write_text(json.dumps({"microbench": micro.to_dict(), "records": outcome.records,
                                  "failed": outcome.failed}, indent=1, default=str))
    return points
