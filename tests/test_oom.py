"""OOM kills named as such (issue 23, sweeper/sweep/oom.py), with real kernel OOM kills.

A child process is put in a real memory cgroup (v2 `memory.max`, else v1
`memory.limit_in_bytes`) of 64 MiB and allocates 512 MiB: the kernel kills it. Its exit
(SIGKILL), the kernel log line and the cgroup's `oom_kill` counter each name the OOM; a
plain `kill -9` in the same cgroup, and a normal exit, are not called OOM. Skipped where no
memory cgroup can be created (not root, or a read-only /sys/fs/cgroup).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from requires import require

from sweeper.sweep import oom

LIMIT = 64 * 2**20
HOG = ("import time; time.sleep(0.5); b = bytearray(512 * 2**20); "
       "b[::4096] = b'x' * len(b[::4096])")


def _make_cgroup() -> Path | None:
    name = f"sweeper-oom-{uuid.uuid4().hex[:8]}"
    v2 = oom.CGROUP_ROOT
    if (v2 / "cgroup.controllers").is_file() and \
            "memory" in (v2 / "cgroup.controllers").read_text().split():
        folder = v2 / name
        limit_file = "memory.max"
    else:
        folder = oom.CGROUP_ROOT / "memory" / name
        limit_file = "memory.limit_in_bytes"
    try:
        folder.mkdir()
    except OSError:
        return None
    try:
        (folder / limit_file).write_text(str(LIMIT))
        if limit_file == "memory.max" and (folder / "memory.swap.max").exists():
            (folder / "memory.swap.max").write_text("0")
    except OSError:
        folder.rmdir()
        return None
    return folder


@pytest.fixture
def cgroup():
    folder = _make_cgroup()
    require(folder is not None, "no writable memory cgroup here (needs root and a cgroup v1/v2 "
            "memory controller)")
    yield folder
    for _ in range(50):            # the killed processes leave it within milliseconds
        try:
            folder.rmdir()
            return
        except OSError:
            time.sleep(0.1)


def _start_in(folder: Path, code: str) -> subprocess.Popen:
    return subprocess.Popen(["sh", "-c", f"echo $$ > {folder}/cgroup.procs; exec "
                             f"{sys.executable} -c \"{code}\""])


def _wait_in_cgroup(proc: subprocess.Popen, folder: Path) -> None:
    for _ in range(100):
        if oom.cgroup_memory_dir(proc.pid) == folder:
            return
        time.sleep(0.05)
    raise AssertionError("the child did not join the cgroup")


def test_a_real_cgroup_oom_kill_is_named_by_the_kernel_log_and_the_counter(cgroup):
    proc = _start_in(cgroup, HOG)
    _wait_in_cgroup(proc, cgroup)
    before = oom.snapshot(proc.pid)
    assert before.cgroup == cgroup and before.cgroup_kills is not None
    exitcode = proc.wait(timeout=60)
    assert exitcode == -signal.SIGKILL
    why = oom.explain_exit(proc.pid, exitcode, since=before)
    assert why is not None and why.startswith(oom.OOM_PHRASE), why
    if oom.kernel_oom_line(proc.pid) is not None:          # root: the kernel log names it
        assert f"pid {proc.pid}" in why
    # the counter alone (no kernel log, e.g. dmesg_restrict for a non-root user)
    assert oom.cgroup_oom_kills(cgroup) > before.cgroup_kills
    by_counter = oom.explain_exit(None, exitcode, since=before)
    assert by_counter is not None and "oom_kill" in by_counter and str(cgroup) in by_counter


def test_a_plain_sigkill_and_a_normal_exit_are_not_called_oom(cgroup):
    proc = _start_in(cgroup, "import time; time.sleep(60)")
    _wait_in_cgroup(proc, cgroup)
    before = oom.snapshot(proc.pid)
    os.kill(proc.pid, signal.SIGKILL)
    exitcode = proc.wait(timeout=30)
    assert exitcode == -signal.SIGKILL
    assert oom.explain_exit(proc.pid, exitcode, since=before) is None
    done = subprocess.run([sys.executable, "-c", "raise SystemExit(3)"])
    assert oom.explain_exit(None, done.returncode, since=oom.snapshot()) is None
    # SIGTERM is never the OOM killer's
    assert oom.explain_exit(proc.pid, -signal.SIGTERM, since=before) is None


def test_ray_memory_monitor_kills_are_recognised():
    assert oom.ray_memory_kill("pid 1 died (OutOfMemoryError: Task was killed due to the "
                               "node running low on memory.)")
    assert not oom.ray_memory_kill("pid 1 died (ActorDiedError: Worker exit type: "
                                   "UNEXPECTED_SYSTEM_EXIT ... End of file.)")


@pytest.mark.ci_slow
def test_a_ray_worker_killed_by_the_kernel_for_memory_is_named_and_not_retried(
        cgroup, shared_sweeper_home, tmp_path):
    """A real sweep: trial 0's worker waits (test delay), is moved into the 64 MiB cgroup
    and then allocates 512 MiB (SWEEPER_TEST_TRIAL_ALLOC_MB; a trial's own allocations once
    sufficed, but no longer exceed 64 MiB since a worker stopped importing scipy.stats
    in its first trial); the kernel kills it."""
    pytest.importorskip("ray")
    import json
    import sqlite3

    import optuna
    import yaml

    space = tmp_path / "qs.yaml"
    space.write_text(yaml.safe_dump({
        "name": "qs", "model": "tiny", "hardware": "devices", "chips": 1, "input_len": 8,
        "decode_steps": 2, "repeats": 1, "warmup": 0, "timeout_s": 120,
        "params": {"batch": [2, 4]}, "sampler": {"type": "grid"}, "trials": 2, "parallel": 1,
        "max_retries": 1,
        "objectives": [{"metric": "decode_step_s", "direction": "minimize"},
                       {"metric": "decode_cost_chip_s_per_token", "direction": "minimize"}]}))
    db = tmp_path / "optuna.db"
    storage = f"sqlite:///{db}"
    env = dict(os.environ, SWEEPER_TEST_TRIAL_DELAY_S="6:0", SWEEPER_TEST_TRIAL_ALLOC_MB="512")
    proc = subprocess.Popen([sys.executable, "-m", "sweeper.cli", "run", str(space), "--study",
                             "oom", "--storage", storage, "--tracking-uri",
                             f"sqlite:///{tmp_path / 'mlflow.db'}", "--no-analysis"],
                            env=env, stdout=subprocess.DEVNULL, stderr=open(tmp_path / "err", "w"))
    deadline = time.monotonic() + 600
    pid = None
    while pid is None:                 # the worker's pid, recorded as soon as it is up
        assert proc.poll() is None, (tmp_path / "err").read_text()[-2000:]
        assert time.monotonic() < deadline
        try:
            with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5) as c:
                row = c.execute("SELECT value_json FROM trial_user_attributes a JOIN trials t "
                                "ON a.trial_id = t.trial_id WHERE t.number = 0 AND "
                                "a.key = 'worker'").fetchone()
            pid = json.loads(row[0])["pid"] if row else None
        except sqlite3.Error:
            pass
        time.sleep(0.3)
    (cgroup / "cgroup.procs").write_text(str(pid))
    assert proc.wait(timeout=600) == 0, (tmp_path / "err").read_text()[-2000:]
    trial = optuna.load_study(study_name="oom", storage=storage).trials[0]
    reason = trial.user_attrs["reason"]
    assert trial.state.name == "FAIL" and oom.OOM_PHRASE in reason, reason
    assert "not retried" in reason and trial.user_attrs["worker"]["attempts"] == 1
