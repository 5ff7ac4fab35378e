"""Run calibration tasks in pinned processes, the way a sweep's mesh workers run trials
(docs/host-calibration.md "How it works").

A `Batch` is a list of tasks for processes of `devices` emulated devices
(`python -m sweeper.calibrate.worker`), one process per slot (disjoint core groups, as `sweeper run`
pins one worker per slot) at a time. Batches run largest first, and every slot that is free
starts a process on the first batch with tasks left: the processes on one batch share its
list (`--claim`), each taking the next task as it finishes one, so the slots finish
together however long each probe takes. Each task's result is one JSON line; a process that
dies or runs past its time limit loses only the task it was running, recorded as failed
with the reason (nothing measured is lost).
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
MAX_BARREN = 2      # processes of one list that fail before a record: its other tasks fail too


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
               timeout_s: float, tasks_file: str, claim_file: str) -> str | None:
    """Run one process on the batch's shared list until no task is left; None, or why it
    stopped early."""
    cmd = [sys.executable, "-m", "sweeper.calibrate.worker", "--devices", str(batch.devices),
           "--cores", ",".join(map(str, cores)), "--tasks", tasks_file, "--claim", claim_file]
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
    if proc.returncode == 0:
        return None
    last = next((ln for ln in reversed(stderr.strip().splitlines()) if ln.strip()), "")
    if proc.returncode < 0:
        return f"process killed by signal {-proc.returncode} (limit {timeout_s:.0f} s)" + (
            f": {last}" if last else "")
    return f"process exited {proc.returncode}: {last}"


@dataclass
class _Shared:
    """A batch's task list and claim counter on disk, and what its processes reported."""

    batch: Batch
    tasks_file: str
    claim_file: str
    seen: set[int] = field(default_factory=set)
    errors: list[str] = field(default_factory=list)
    barren: int = 0       # processes that failed before reporting anything

    def give_up(self) -> None:
        """No process will take this list's remaining tasks (they are recorded as failed)."""
        Path(self.claim_file).write_text(str(len(self.batch.tasks)))

    def claimed(self) -> int:
        try:
            return int(Path(self.claim_file).read_text().strip() or 0)
        except (OSError, ValueError):
            return len(self.batch.tasks)

    def has_tasks(self) -> bool:
        return self.claimed() < len(self.batch.tasks)


def _share(batch: Batch, folder: str) -> _Shared:
    tasks_file = tempfile.NamedTemporaryFile("w", suffix=".json", dir=folder, delete=False)
    with tasks_file:
        json.dump(batch.tasks, tasks_file)
    claim_file = Path(tasks_file.name).with_suffix(".claim")
    claim_file.write_text("0")
    return _Shared(batch, tasks_file.name, str(claim_file))


def run(batches: list[Batch], slots: list[list[int]], on_record: Callable[[dict], None] | None = None,
        timeout_s: float = BATCH_TIMEOUT_S) -> Outcome:
    """Every batch on the slots, in parallel; each record also passed to `on_record` (progress)."""
    outcome = Outcome()
    lock = threading.Lock()

    def record(batch: Batch, rec: dict) -> None:
        rec["batch"] = batch.label
        with lock:
            (outcome.records if rec.get("ok") else outcome.failed).append(rec)
            if on_record:
                on_record(rec)

    with tempfile.TemporaryDirectory(prefix="sweeper-calibrate-") as folder:
        shared = [_share(b, folder) for b in sorted(batches, key=lambda b: -b.cost_s)]

        def worker(cores: list[int]) -> None:
            while True:
                with lock:
                    share = next((s for s in shared if s.has_tasks()), None)
                if share is None:
                    return

                def keep(rec: dict, share=share) -> None:
                    share.seen.add(rec["index"])
                    record(share.batch, rec)

                reported = len(share.seen)
                why = _run_batch(share.batch, cores, keep, timeout_s, share.tasks_file,
                                 share.claim_file)
                if why:
                    with lock:
                        share.errors.append(why)
                        share.barren += len(share.seen) == reported
                        if share.barren >= MAX_BARREN:    # it cannot start: not again and again
                            share.give_up()

        threads = [threading.Thread(target=worker, args=(cores,), daemon=True) for cores in slots]
        start = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        outcome.elapsed_s = time.perf_counter() - start
    for share in shared:      # a task claimed by a process that was lost: failed, with why
        for i, task in enumerate(share.batch.tasks):
            if i not in share.seen:
                record(share.batch, {"index": i, "devices": share.batch.devices, "task": task,
                                     "ok": False, "error": "; ".join(share.errors) or "not run",
                                     "wall_s": 0.0})
    return outcome
