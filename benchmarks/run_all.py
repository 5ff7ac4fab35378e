"""Run every benchmark and write `benchmarks/results/summary.md` (what `make bench` runs).

    python -m benchmarks.run_all [--out DIR] [--quick]

Order: the host profile is measured afresh (so every MFU in this run uses one peak), then
engine efficiency, sweep overhead (which also runs the quickstart), calibration and search
efficiency (both on the recorded calibration sweep, benchmarks/data/: no measurement), and
last `benchmarks.readme_numbers`, which regenerates the README's performance tables from
the results files. Each runs in its own process, one after the other, so a failure in one is
reported and the others still run. The summary lists every target with its measured value
and the load average around it: on a shared machine the timings move with the other jobs.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from benchmarks import common

ROOT = Path(__file__).resolve().parents[1]


def run(module: str, args: list[str]) -> tuple[int, float]:
    start = time.perf_counter()
    print(f"\n=== {module} {' '.join(args)}", file=sys.stderr, flush=True)
    rc = subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT).returncode
    return rc, time.perf_counter() - start


def _load(out: Path, name: str) -> dict | None:
    path = out / f"{name}.json"
    return json.loads(path.read_text()) if path.is_file() else None


def _f(value, fmt: str) -> str:
    return "—" if value is None else format(value, fmt)


def summary(out: Path, runs: dict, profile: dict, notes: dict, context: dict, end: dict,
            elapsed: float) -> str:
    def fresh(name: str) -> dict | None:
        """A step's results if it ran and succeeded now, or was skipped (kept from before)."""
        if name in runs and runs[name][0] != 0:
            return None
        return _load(out, name)

    eng, ovh, cal, srch = (fresh(n) for n in ("engine_efficiency", "sweep_overhead",
                                              "calibration", "search_efficiency"))
    rows = []
    if eng:
        rows += [
            ["engine", "single-chip large-batch prefill MFU >= 70% of host peak",
             f"{common.pct(eng['single_chip_prefill_mfu'])} (per CPU-second: "
             f"{common.pct(eng['single_chip_prefill_mfu_per_cpu_s'])})", common.met(eng["meets_prefill_target"])],
            ["engine", "8 emulated chips within 1.3x of 1 chip (prefill, same work)",
             f"{_f(eng['best_sharded_ratio_largest'], '.2f')}x to {_f(eng['worst_sharded_ratio_largest'], '.2f')}x",
             common.met(eng["meets_sharded_target"])],
            ["engine", "decode step within 2x of its memory bound",
             f"worst {eng['worst_decode_ratio']:.2f}x", common.met(eng["meets_decode_target"])],
        ]
    if ovh:
        if ovh.get("tune"):
            rows.append(["sweep overhead", "sweeper overhead per trial <= Ray Tune's",
                         f"{ovh['sweeper']['overhead_per_trial_s'] * 1e3:.0f} ms vs "
                         f"{ovh['tune']['overhead_per_trial_s'] * 1e3:.0f} ms", common.met(ovh["meets_tune_target"])])
        if ovh.get("quickstart"):
            q = ovh["quickstart"]
            rows.append(["sweep overhead", "overhead < 5% of the quickstart's wall time",
                         f"{common.pct(ovh['quickstart_overhead_share'])} of {q['wall_s']:.0f} s "
                         f"(compile-cache hit rate {common.pct(q['compile_cache_hit_rate'])})",
                         common.met(ovh["meets_quickstart_target"])])
    if cal:
        for name in ("kfold", "chips", "extrapolation"):
            h = cal["holdouts"].get(name) or {}
            if h.get("skipped") or not h:
                continue
            ci = h["mape_ci95"]
            rows.append(["calibration", f"{name}: held-out MAPE <= 10%, median <= 5%",
                         f"{common.pct(h['mape_heldout'])} [95% CI {common.pct(ci[0])}-{common.pct(ci[1])}], "
                         f"median {common.pct(h['median_ape_heldout'])}, noise floor "
                         f"{common.pct(h['noise_floor_mape'])} ({h['n_points']} points)",
                         common.met(h["verdict"]["mape"]["met"] and h["verdict"]["median"]["met"])])
        k = cal["holdouts"]["kfold"]
        rows.append(["calibration", "top-1 layout agreement >= 90% over >= 10 groups",
                     f"{common.pct(k['top1_agreement'])} over {k['ranking_groups']} groups",
                     common.met(k["verdict"]["top1"]["met"])])
    if srch:
        for name, block in srch["spaces"].items():
            plain = ", ".join(f"{k} {s['median_trials_to_target']:.1f}" for k, s in block["samplers"].items()
                              if not k.startswith("guided"))
            size = block["grid"]["complete"]
            for variant, v in (block.get("verdict") or {}).items():
                g = block["samplers"][variant]
                rows.append(["search", f"{name}: {variant} reaches 95% HV within 20% of the "
                             f"{size} dispatchable points (every seed)",
                             f"median {g['median_trials_to_target']:.1f}, worst {g['max_trials_to_target']} "
                             f"over {len(g['runs'])} seeds", common.met(v["meets_share_target"])])
                rows.append(["search", f"{name}: {variant}'s worst seed beats every plain median",
                             f"plain medians: {plain}", common.met(v["beats_every_plain"])])
    lines = [
        "# Benchmarks: summary",
        "",
        f"`make bench` (= `python -m benchmarks.run_all`) on {context['hostname']}: {context['cpus']} CPUs, "
        f"jax {context['jax']}; {elapsed / 60:.1f} minutes. Load average {context['load_average']} at the "
        f"start, {end['load_average']} at the end: **this machine is shared with other jobs, so every "
        "emulated-mesh timing here is noisy**; ratios were measured side by side in this one run.",
        "",
        f"Host profile ({notes.get('measured_at', '?')}, load {notes.get('load_average_1min', '?')}): peak {profile['peak_flops'] / 1e9:.0f} GFLOP/s "
        f"({notes.get('peak_flops_from', '')}: one core {(notes.get('peak_flops_one_core') or 0) / 1e9:.0f} "
        f"GFLOP/s, in-process {(notes.get('peak_flops_in_process') or 0) / 1e9:.0f} GFLOP/s), read "
        f"bandwidth {profile['hbm_bandwidth'] / 1e9:.1f} GB/s.",
        "",
        *common.table(["benchmark", "target", "measured", ""], rows),
        "",
        "Details: " + ", ".join(f"[{n}]({n}.md)" for n in ("engine_efficiency", "sweep_overhead",
                                                          "calibration", "search_efficiency")
                                if (out / f"{n}.md").is_file()) + ".",
        "",
        *common.table(["step", "exit code", "minutes"],
                      [[name, rc, f"{seconds / 60:.1f}"] for name, (rc, seconds) in runs.items()]),
        "",
        "A step with a non-zero exit code has no row above (its error is in the run's log); a "
        "skipped step (`--skip`) shows its results from an earlier run.",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(common.RESULTS))
    parser.add_argument("--quick", action="store_true", help="fewer sizes, trials and seeds")
    parser.add_argument("--skip", default="", help="comma-separated steps to skip, keeping their "
                        "results from an earlier run (engine_efficiency, sweep_overhead, calibration, "
                        "search_efficiency)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    context = common.machine_context()

    from workloads import hostprofile

    profile = hostprofile.host_profile(refresh=not args.skip)
    notes = (hostprofile.cached_entry() or {}).get("notes", {})
    quick = ["--quick"] if args.quick else []
    skip = set(filter(None, args.skip.split(",")))
    runs: dict[str, tuple[int, float]] = {}

    def step(name: str, argv: list[str]) -> None:
        if name in skip:
            return
        runs[name] = run(f"benchmarks.{name}", argv)

    step("engine_efficiency", ["--out", str(out), *quick])
    step("sweep_overhead", ["--out", str(out)] + (["--trials", "20"] if args.quick else []))
    # calibration and search efficiency use the recorded calibration sweep (benchmarks/data/)
    step("calibration", ["--out", str(out)])
    # the committed op-level profile (benchmarks/data/) alone against the same sweep
    step("profile_predict", ["--out", str(out)])
    step("search_efficiency", ["--out", str(out), "--gp-seeds", "3"]
         + (["--seeds", "3"] if args.quick else ["--seeds", "10"]))
    text = summary(out, runs, profile.to_dict(), notes, context, common.machine_context(),
                   time.perf_counter() - start)
    (out / "summary.md").write_text(text)
    print(text)
    step("readme_numbers", ["--results", str(out)])
    return 0 if all(rc == 0 for rc, _ in runs.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
