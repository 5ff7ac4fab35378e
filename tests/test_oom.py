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
