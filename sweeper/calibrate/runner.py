"""Run calibration tasks in pinned processes, the way a sweep's mesh workers run trials
(docs/host-calibration.md "How it works").

A `Batch` is a list of tasks for one process of `devices` emulated devices
(`python -m workloads.hostcal`); batches run on `slots` (disjoint core groups, one process per
slot at a time, as `sweeper run` pins one worker per slot), largest first. Each task's result
is one JSON line; a process that dies or runs past its time limit loses only its unfinished
tasks, which are recorded as failed with the reason (nothing measured is lost).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from sweeper.sweep.meshworker import split_cores

BATCH_TIMEOUT_S = 600.0


@dataclass
class Batch:
    devices: int
    tasks: list[dict]
    cost_s: float = 0.0          # expected seconds (scheduling: largest first)
    label: str = ""


@dataclass
class Outcome:
    records: list[dict] = field(default_factory=list)
    failed: list[dict] = field(default_factory=list)
    elapsed_s: float = 0.0


def slots_of_this_host(parallel: int | None = None) -> list[list[int]]:
    """One core per slot over this process's cores (a sweep's default), or `parallel` groups."""
    cores = sorted(os.sched_getaffinity(0))
    return split_cores(parallel or len(cores), cores)


def _process_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env["JAX_PLATFORMS"] = "cpu"
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return env


def _run_batch(batch: Batch, cores: list[int], on_record: Callable[[dict], None],
               timeout_s: float) -> str | None:
    """Run one batch to the end; None, or why it stopped early."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(batch.tasks, f)
        tasks_file = f.name
    cmd = [sys.executable, "-m", "workloads.hostcal", "--devices", str(batch.devices),
           "--cores", ",".join(map(str, cores)), "--tasks", tasks_file]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=_process_env())
    killer = threading.Timer(timeout_s, proc.kill)
    killer.start()
    try:
        for line in proc.stdout:
            try:
                on_record(json.loads(line))
            except json.JSONDecodeError:
                continue
        proc.wait()
        stderr = proc.stderr.read()
    finally:
        killer.cancel()
        Path(tasks_file).unlink(missing_ok=True)
    if proc.returncode == 0:
        return None
    last = next((ln for ln in reversed(stderr.strip().splitlines()) if ln.strip()), "")
    if proc.returncode < 0:
        return f"process killed by signal {-proc.returncode} (limit {timeout_s:.0f} s)" + (
            f": {last}" if last else "")
    return f"process exited {proc.returncode}: {last}"


def run(batches: list[Batch], slots: list[list[int]], on_record: Callable[[dict], None] | None = None,
        timeout_s: float = BATCH_TIMEOUT_S) -> Outcome:
    """Every batch on the slots, in parallel; each record also passed to `on_record` (progress)."""
    outcome = Outcome()
    lock = threading.Lock()
    queue = sorted(batches, key=lambda b: -b.cost_s)

    def record(batch: Batch, rec: dict) -> None:
        rec["batch"] = batch.label
        with lock:
            (outcome.records if rec.get("ok") else outcome.failed).append(rec)
            if on_record:
                on_record(rec)

    def worker(cores: list[int]) -> None:
        while True:
            with lock:
                if not queue:
                    return
                batch = queue.pop(0)
            seen: set[int] = set()

            def keep(rec: dict, batch=batch, seen=seen) -> None:
                seen.add(rec["index"])
                record(batch, rec)

            why = _run_batch(batch, cores, keep, timeout_s)
            if why:
                for i, task in enumerate(batch.tasks):
                    if i not in seen:
                        record(batch, {"index": i, "devices": batch.devices, "task": task,
                                       "ok": False, "error": why, "wall_s": 0.0})

    threads = [threading.Thread(target=worker, args=(cores,), daemon=True) for cores in slots]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    outcome.elapsed_s = time.perf_counter() - start
    return outcome
