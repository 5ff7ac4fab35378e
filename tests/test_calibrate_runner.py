"""`sweeper calibrate`'s runner (sweeper/calibrate/runner.py): real `sweeper.calibrate.worker`
processes on this host's slots share one task list, each task run once; a list whose
processes cannot start has its tasks recorded as failed with the reason, and the run ends."""

from __future__ import annotations

import os

from sweeper.calibrate import runner
from sweeper.calibrate.tasks import FULL, batches

CHEAP = [{"kind": "dequant", "elements": 2**12} for _ in range(8)]


def test_two_slots_share_one_list_and_run_each_task_once():
    core = sorted(os.sched_getaffinity(0))[0]
    seen = []
    outcome = runner.run([runner.Batch(1, CHEAP, label="cheap")], [[core], [core]], seen.append)
    assert not outcome.failed
    assert sorted(r["index"] for r in outcome.records) == list(range(len(CHEAP)))
    assert len(seen) == len(CHEAP) and all(r["batch"] == "cheap" for r in seen)
    assert len({r["pid"] for r in outcome.records}) == 2       # both slots' processes took tasks


def test_a_list_whose_processes_cannot_start_fails_its_tasks_with_the_reason():
    outcome = runner.run([runner.Batch(1, CHEAP[:3], label="cheap")], [[10**6]])   # no such core
    assert not outcome.records and len(outcome.failed) == 3
    assert all("process exited" in r["error"] for r in outcome.failed)


def test_one_list_per_chip_count_with_its_microbenchmarks_first():
    lists = batches(FULL)
    assert [b.devices for b in lists] == list(FULL.chips)
    for b in lists:
        kinds = [t["kind"] for t in b.tasks]
        assert kinds[0] == "dispatch" and kinds.index("trial") == len(kinds) - kinds.count("trial")
        probes = [t for t in FULL.probe_draw().trials if t.chips == b.devices]
        assert kinds.count("trial") == len(probes) > 0
