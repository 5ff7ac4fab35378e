"""What every benchmark shares: where results go, the machine context, MLflow logging.

Each benchmark writes `benchmarks/results/<name>.json` (the numbers) and `<name>.md` (a
readable summary) through `benchmarks/harness.py`, and logs one MLflow run (experiment
`sweeper/benchmarks`, run name = the benchmark) with its headline metrics and both files as
artifacts. The Markdown's pieces are in `benchmarks/report.py`. Every result carries
the machine context: CPU count and the load average before and after, because on a shared
machine emulated-mesh timings move with the load; and the host's CPU time counters
(`cpu_times`), so that the context taken at the end of a run (`machine_context(since=start)`)
states how much of the CPUs' time over the run the hypervisor gave to other guests (steal)
and how much waited on I/O (iowait): a virtual machine's timings move with its steal too,
which the load average does not show.
"""

from __future__ import annotations

import math
import os
import platform
import socket
import sys
import time
from pathlib import Path
from typing import Any, Mapping

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
DATA = ROOT / "benchmarks" / "data"       # recorded measurements the benchmarks replay
EXPERIMENT = "sweeper/benchmarks"


def load_average() -> list[float]:
    return [round(v, 2) for v in os.getloadavg()]


# The CPU states of the `cpu` line of /proc/stat, in its order (proc(5)); guest time is
# already counted in user and nice, so these eight sum to all the CPUs' time.
CPU_STATES = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")


def cpu_times(stat: Path | str = "/proc/stat") -> dict[str, int] | None:
    """The host's cumulative CPU time per state, all CPUs together, in clock ticks (the
    `cpu` line of /proc/stat); None where there is no such file (not Linux)."""
    try:
        text = Path(stat).read_text()
    except OSError:
        return None
    for line in text.splitlines():
        fields = line.split()
        if fields and fields[0] == "cpu":
            values = [int(v) for v in fields[1:1 + len(CPU_STATES)]]
            values += [0] * (len(CPU_STATES) - len(values))    # old kernels: no steal column
            return dict(zip(CPU_STATES, values))
    return None


def cpu_time_shares(before: Mapping[str, int] | None, after: Mapping[str, int] | None,
                    ticks_per_s: float | None = None) -> dict[str, float | None]:
    """Over the window between two `cpu_times` snapshots: the percent of all CPUs' time that
    was stolen by the hypervisor (`steal_pct`: the virtual CPUs were runnable but other
    guests ran) and that waited on I/O (`iowait_pct`), and the window's CPU-seconds
    (`cpu_s`, all CPUs together). None where a snapshot is missing or nothing elapsed."""
    none = {"steal_pct": None, "iowait_pct": None, "cpu_s": None}
    if not before or not after:
        return none
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in CPU_STATES}
    total = sum(delta.values())
    if total <= 0:
        return none
    ticks = ticks_per_s or os.sysconf("SC_CLK_TCK")
    return {"steal_pct": 100.0 * delta["steal"] / total,
            "iowait_pct": 100.0 * delta["iowait"] / total, "cpu_s": total / ticks}


def machine_context(since: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Where and when: the load average is part of every emulated-mesh number. `cpu_times`:
    the CPU time counters now. `since`: a context taken earlier (the run's start): then also
    `steal_pct` and `iowait_pct` of all CPUs' time between the two (`cpu_time_shares`)."""
    import jax

    context = {"hostname": socket.gethostname(), "cpus": os.cpu_count(),
               "machine": platform.machine(), "cpu": cpu_model(),
               "python": platform.python_version(),
               "jax": jax.__version__, "load_average": load_average(),
               "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "cpu_times": cpu_times()}
    if since is not None:
        context.update(cpu_time_shares(since.get("cpu_times"), context["cpu_times"]))
    return context


def cpu_model(cpuinfo: Path = Path("/proc/cpuinfo")) -> str | None:
    """The CPU's model name (/proc/cpuinfo; None where there is none), with `avx512_bf16`
    appended where the CPU has it: the VM behind 'this host' changes between sessions, and
    XLA CPU's bf16 matmuls, most of an emulated trial, depend on that instruction set."""
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return None
    fields = [line.split(":", 1) for line in text.splitlines() if ":" in line]
    name = next((value.strip() for key, value in fields if key.strip() == "model name"), None)
    flags = next((value.split() for key, value in fields if key.strip() == "flags"), [])
    return None if name is None else name + (", avx512_bf16" if "avx512_bf16" in flags else "")


def clean(value: Any) -> Any:
    """JSON-safe: NaN/inf -> None, tuples -> lists, numpy scalars -> floats."""
    if isinstance(value, Mapping):
        return {str(k): clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [clean(v) for v in value]
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, int):
        return value
    try:
        number = float(value)
    except (TypeError, ValueError):
        return str(value)
    return number if math.isfinite(number) else None


def log_mlflow(name: str, metrics: Mapping[str, float], params: Mapping[str, Any],
               files: list[Path], tracking_uri: str | None = None) -> str | None:
    """One run in `sweeper/benchmarks`; the run id, or None (with a note) if logging fails."""
    try:
        from mlflow.tracking import MlflowClient

        from sweeper.paths import artifact_root, default_tracking_uri
        from sweeper.tracking.mlflow_log import _quiet_store_logs

        _quiet_store_logs()
        uri = tracking_uri or default_tracking_uri()
        client = MlflowClient(uri)
        exp = client.get_experiment_by_name(EXPERIMENT)
        exp_id = exp.experiment_id if exp else client.create_experiment(
            EXPERIMENT, artifact_location=artifact_root(uri),
            tags={"mlflow.experimentKind": "custom_model_development"})
        run = client.create_run(exp_id, run_name=name, tags={"benchmark": name})
        rid = run.info.run_id
        for key, value in params.items():
            client.log_param(rid, key, str(value)[:500])
        for key, value in metrics.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                client.log_metric(rid, key, float(value))
        for path in files:
            client.log_artifact(rid, str(path))
        client.set_terminated(rid, "FINISHED")
        return rid
    except Exception as err:  # noqa: BLE001 - the JSON/Markdown files are the record
        print(f"benchmarks: MLflow logging of {name} failed: {type(err).__name__}: {err}",
              file=sys.stderr)
        return None


def trial_run_times(study) -> list[tuple[float, float, bool]]:
    """(started, finished, compiled programs reused) of every trial a worker ran, from the
    `worker` user attribute each trial carries (epoch seconds on the worker)."""
    out = []
    for trial in study.get_trials(deepcopy=False):
        worker = trial.user_attrs.get("worker") or {}
        if "started" in worker and "finished" in worker:
            # reused: compiled nothing (the worker's memory, or every program from the
            # sweep's compilation cache); older records know the first only
            out.append((float(worker["started"]), float(worker["finished"]),
                        bool(worker.get("reused", worker.get("cache_hit")))))
    return out


def orchestration(study, wall_s: float, parallel: int) -> dict[str, float]:
    """How much of a sweep's slot time was outside trials: 1 - sum(trial run time) /
    (parallel x wall). Ray and worker start-up with their JAX imports, Optuna ask/tell,
    MLflow logging and slots idle at the end all count as orchestration."""
    runs = trial_run_times(study)
    total = sum(finished - started for started, finished, _ in runs)
    hits = sum(hit for *_, hit in runs)
    pids = {(t.user_attrs.get("worker") or {}).get("pid") for t in study.get_trials(deepcopy=False)}
    span = (max(f for _, f, _ in runs) - min(s for s, _, _ in runs)) if runs else None
    return {"wall_s": wall_s, "parallel": parallel, "ran": len(runs), "trial_run_s_sum": total,
            # before the first trial and after the last: Ray, the first workers, the analysis
            "outside_trials_span_s": wall_s - span if span is not None else None,
            "worker_processes": len(pids - {None}),
            "orchestration_share": 1 - total / (parallel * wall_s) if wall_s else None,
            "overhead_per_trial_s": (parallel * wall_s - total) / len(runs) if runs else None,
            "compile_cache_hits": hits, "compile_cache_hit_rate": hits / max(len(runs), 1)}
