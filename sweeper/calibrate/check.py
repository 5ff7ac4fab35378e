"""`sweeper calibrate --check`: has this host drifted since its calibration?
(docs/host-calibration.md "Is the calibration still this host's?")

A calibrated profile prices calls at the speed the host had while `sweeper calibrate` ran.
An emulated mesh shares the host with everything else, and a virtual machine with its
neighbours. The check re-measures some of the calibration's own probe trials (the same
configurations, in the same pinned processes: runner.py) and compares each with what the
calibration measured: measured now / measured then, per phase; and the read sweep's
largest weights (`streaming`): the probe models mostly fit the cache, and a memory-bound
model's decode step moves with the DRAM's bandwidth, which a neighbour can take. Per phase
the median ratio is the host's drift; its 95% interval is the order statistics a sign test
gives (distribution free; with five points or fewer, their range), so "drifted" says the
interval excludes 1, not that a threshold was crossed.

A prediction is not changed by it: the check says how far the calibration's host is from
this one now (a plan made now would be off by about that), and the blind benchmark records
it beside each served stream (benchmarks/blind.py) to name the host's share of a miss.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Callable

from scipy.stats import binom

from sweeper.calibrate import runner
from workloads import hostprofile
from workloads.config import ConfigError

PER_CHIPS = 3          # probe trials re-measured per chip count (about 10 s each on 2 cores)
PHASES = (("prefill", "prefill_s"), ("decode", "decode_step_s"))
# ... and the read sweep's largest weights (a decode row streaming them from DRAM): the probe
# models mostly fit the cache, so their trials do not see a host whose DRAM got slower
STREAMING = 3


def load_records(points_path: Path) -> list[dict]:
    """Every measurement the calibration recorded (its `.points.json`)."""
    try:
        return json.loads(points_path.read_text())["records"]
    except (OSError, ValueError, KeyError, TypeError):
        raise ConfigError("points", str(points_path), "the readable .points.json `sweeper "
                          "calibrate` writes beside its profile") from None


def probe_records(records: list[dict]) -> list[dict]:
    """The measured probe trials."""
    return [r for r in records if r.get("ok") and r.get("task", {}).get("kind") == "trial"
            and all(isinstance(r.get(key), (int, float)) and r[key] > 0 for _, key in PHASES)]


def pick(records: list[dict], per_chips: int = PER_CHIPS) -> list[dict]:
    """`per_chips` probes of each chip count, evenly spaced over its probes ordered by their
    prefill time (cheap and dear ones alike; deterministic: the same ones every check)."""
    chosen = []
    for devices in sorted({r["devices"] for r in records}):
        these = sorted((r for r in records if r["devices"] == devices),
                       key=lambda r: (r["prefill_s"], json.dumps(r["task"], sort_keys=True)))
        k = min(per_chips, len(these))
        chosen += [these[int((i + 0.5) * len(these) / k)] for i in range(k)]   # each k-th's middle
    return chosen


def streaming_records(records: list[dict], n: int = STREAMING) -> list[dict]:
    """The one-device read sweep's `n` largest weights (`cache` tasks: a decode row's matmul
    streaming them), measured by the calibration."""
    sweep = [r for r in records if r.get("ok") and r.get("devices") == 1
             and r.get("task", {}).get("kind") == "cache" and (r.get("seconds") or 0) > 0]
    return sorted(sweep, key=lambda r: r["task"]["bytes"])[-n:]


def median_interval(ratios: list[float], level: float = 0.95) -> tuple[float, float, float]:
    """(median, low, high): the sign test's interval for the median, the widest pair of order
    statistics covering it with probability >= level ((min, max) with fewer points)."""
    xs = sorted(ratios)
    n = len(xs)
    med = float(xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2)
    # the largest k with P(Binomial(n, 1/2) < k) <= (1 - level) / 2: [x_(k), x_(n+1-k)]
    k = max((j for j in range(1, n // 2 + 1) if binom.cdf(j - 1, n, 0.5) <= (1 - level) / 2),
            default=1)
    return med, float(xs[k - 1]), float(xs[n - k])


def drift(ratios: list[float]) -> dict:
    """The median now / then of some re-measurements, its interval and whether it excludes 1."""
    med, low, high = median_interval(ratios)
    return {"median": med, "low": low, "high": high, "n": len(ratios),
            "drifted": not (low <= 1.0 <= high)}


def check(path: Path | None = None, per_chips: int = PER_CHIPS,
          progress: Callable[[str], None] | None = None,
          slots: list[list[int]] | None = None) -> dict:
    """Re-measure `per_chips` of the profile's probe trials per chip count; plain data
    (`format_check` prints it). ConfigError (one line) where there is no calibration here."""
    path = Path(path) if path else hostprofile.calibration_path()
    profile = hostprofile.calibrated_profile(path)
    if profile is None:
        raise ConfigError("--check", str(path), "a profile `sweeper calibrate` wrote on this "
                          "host (none here: run `sweeper calibrate` first)")
    records = load_records(path.with_suffix(".points.json"))
    chosen = pick(probe_records(records), per_chips)
    if not chosen:
        raise ConfigError("points", str(path.with_suffix(".points.json")),
                          "the points of a calibration whose probe trials ran (none did)")
    streaming = streaming_records(records)
    start, load_before = time.perf_counter(), os.getloadavg()[0]
    by_devices: dict[int, list[dict]] = {}
    for rec in chosen + streaming:
        by_devices.setdefault(rec["devices"], []).append(rec)
    batches = [runner.Batch(n, [r["task"] for r in recs], cost_s=len(recs) * (1 + n),
                            label=f"check {n} chip(s)") for n, recs in by_devices.items()]
    done = [0]

    def on_record(rec: dict) -> None:
        done[0] += 1
        if progress:
            task = rec["task"]
            what = (f"probe {task.get('model', '')}" if task["kind"] == "trial"
                    else f"read sweep {task.get('bytes', 0) / 2**20:.0f} MiB")
            progress(f"[check {done[0]}/{len(chosen) + len(streaming)}] {rec['devices']} "
                     f"device(s): {what}" + ("" if rec.get("ok") else " FAILED")
                     + f" | {time.perf_counter() - start:.0f} s")

    outcome = runner.run(batches, slots or runner.slots_of_this_host(), on_record)
    then = {(r["devices"], json.dumps(r["task"], sort_keys=True)): r for r in chosen + streaming}
    points, swept = [], []
    for rec in outcome.records:
        old = then.get((rec["devices"], json.dumps(rec["task"], sort_keys=True)))
        if old is None:
            continue
        if rec["task"]["kind"] == "cache":
            swept.append({"bytes": rec["task"]["bytes"], "then_s": old["seconds"],
                          "now_s": rec["seconds"], "ratio": rec["seconds"] / old["seconds"]})
            continue
        points.append({"devices": rec["devices"], "model": rec["task"].get("model", ""),
                       **{f"{ph}_then_s": old[key] for ph, key in PHASES},
                       **{f"{ph}_now_s": rec[key] for ph, key in PHASES},
                       **{f"{ph}_ratio": rec[key] / old[key] for ph, key in PHASES}})
    ratio = {phase: drift([p[f"{phase}_ratio"] for p in points]) for phase, _ in PHASES
             if points}
    if swept:
        ratio["streaming"] = drift([p["ratio"] for p in swept])
    cal = profile.calibration or {}
    try:
        then_at = time.mktime(time.strptime(cal.get("calibrated_at", ""), "%Y-%m-%d %H:%M"))
        hours = (time.time() - then_at) / 3600
    except (ValueError, OverflowError):
        hours = math.nan
    return {"profile": str(path), "calibrated_at": cal.get("calibrated_at"),
            "hours_since_calibration": hours, "checked_at": time.strftime("%Y-%m-%d %H:%M"),
            "trials": len(chosen), "measured": len(points), "failed": len(outcome.failed),
            "ratio": ratio, "points": points, "streaming": swept, "elapsed_s": time.perf_counter() - start,
            "load_average_1min": [round(load_before, 2), round(os.getloadavg()[0], 2)],
            "calibration_load_average_1min": cal.get("load_average_1min")}


def format_check(result: dict) -> str:
    """The check's summary: the drift per phase with its interval, and what to do."""
    hours = result["hours_since_calibration"]
    age = f"{hours:.1f} h ago" if math.isfinite(hours) else "at an unknown time"
    lines = [f"checked this host against its calibration of {result['calibrated_at']} ({age}): "
             f"{result['measured']} of its probe trials measured again in "
             f"{result['elapsed_s']:.0f} s, load {result['load_average_1min'][0]} -> "
             f"{result['load_average_1min'][1]}"]
    drifted = []
    for phase, r in result["ratio"].items():
        verdict = ("slower" if r["median"] > 1 else "faster") if r["drifted"] else "no drift shown"
        what = "trials" if phase != "streaming" else "read sweeps: weights from DRAM"
        interval = "95% interval" if r["n"] > 5 else "range"     # the sign test's, or all
        lines.append(f"  {phase:<9} now / then x{r['median']:.2f} ({interval} x{r['low']:.2f}"
                     f"-x{r['high']:.2f}, {r['n']} {what}): {verdict}")
        if r["drifted"]:
            drifted.append(f"{phase} {abs(r['median'] - 1):.0%} {verdict}")
    if result["failed"]:
        lines.append(f"  {result['failed']} re-measurement(s) failed")
    if drifted:
        lines.append("this host runs " + ", ".join(drifted) + " than when it was calibrated: "
                     "the profile's predictions are off by about that now (`sweeper calibrate` "
                     "measures the host again)")
    else:
        lines.append("the host runs as it did when calibrated, within the check's interval")
    return "\n".join(lines)
