"""Was a dead worker killed by the kernel for memory? (issue 23)

When the kernel's OOM killer ends a Ray worker, Ray only sees its connection close ("Worker
unexpectedly exits with a connection error code 2. End of file") and the trial was retried
as for any lost worker, so a trial that always runs out of memory was killed twice. The
kernel leaves three traces, read here:

  the exit signal        SIGKILL (an exit by any other signal or code is not an OOM kill)
  the kernel log         "Out of memory: Killed process PID (NAME) ..." or "Memory cgroup
                         out of memory: Killed process PID ..." (/dev/kmsg; needs root or
                         kernel.dmesg_restrict=0)
  the memory events      `oom_kill` of the process's memory cgroup (v2 memory.events, v1
                         memory.oom_control) and of the whole system (/proc/vmstat), which
                         grow by one per kill

    before = snapshot(pid)                     # when the worker is up (its cgroup is read)
    ...
    why = explain_exit(pid, since=before)      # after it died: one phrase or None

`explain_exit` names an OOM kill ("killed by the kernel: out of memory (...)") when the
kernel log names the pid, or when the worker's own cgroup counted a kill since the
snapshot and the exit signal (if known) was SIGKILL; a system-wide count alone is only
taken with a known SIGKILL. Ray's own memory monitor, which kills a worker before the
kernel does, says so in its error (`OutOfMemoryError`): `ray_memory_kill`.
"""

from __future__ import annotations

import errno
import os
import re
import signal
from dataclasses import dataclass, field
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
KMSG = "/dev/kmsg"
OOM_PHRASE = "killed by the kernel: out of memory"
_KILLED = re.compile(r"Killed process (\d+) \(([^)]*)\)(.*)")


def cgroup_memory_dir(pid: int | str = "self") -> Path | None:
    """The memory cgroup folder of a process (v2 unified, else v1 `memory`), or None."""
    try:
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        hierarchy, controllers, path = line.split(":", 2)
        path = path.lstrip("/")
        if hierarchy == "0" and controllers == "":
            for root in (CGROUP_ROOT, CGROUP_ROOT / "unified"):
                if (root / path / "memory.events").is_file():
                    return root / path
        elif "memory" in controllers.split(","):
            folder = CGROUP_ROOT / "memory" / path
            if (folder / "memory.oom_control").is_file():
                return folder
    return None


def _counter(path: Path, key: str) -> int | None:
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key and value.strip().isdigit():
                return int(value)
    except OSError:
        pass
    return None


def cgroup_oom_kills(folder: Path | None) -> int | None:
    """OOM kills counted in a memory cgroup (v2 `memory.events`, v1 `memory.oom_control`)."""
    if folder is None:
        return None
    for name in ("memory.events", "memory.oom_control"):
        count = _counter(folder / name, "oom_kill")
        if count is not None:
            return count
    return None


def system_oom_kills() -> int | None:
    return _counter(Path("/proc/vmstat"), "oom_kill")


@dataclass
class OomSnapshot:
    cgroup: Path | None = None
    cgroup_kills: int | None = None
    system_kills: int | None = None
    pids: list[int] = field(default_factory=list)


def snapshot(pid: int | None = None) -> OomSnapshot:
    """The OOM-kill counters now, and the memory cgroup of `pid` (read while it lives)."""
    folder = cgroup_memory_dir(pid) if pid else None
    return OomSnapshot(folder, cgroup_oom_kills(folder), system_oom_kills(),
                       [pid] if pid else [])


def kernel_oom_line(pid: int) -> str | None:
    """The kernel log's "... Killed process PID (...)" line, or None (not there, or the log
    cannot be read by this user)."""
    try:
        fd = os.open(KMSG, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return None
    found = None
    try:
        while True:
            try:
                record = os.read(fd, 8192)
            except OSError as err:
                if err.errno == errno.EPIPE:      # records overwritten while reading: go on
                    continue
                break                              # EAGAIN: the end of the log
            if not record:
                break
            message = record.decode("utf-8", "replace").partition(";")[2].strip()
            match = _KILLED.search(message)
            if match and int(match.group(1)) == int(pid):
                found = message
    finally:
        os.close(fd)
    return found


def _short(line: str) -> str:
    match = _KILLED.search(line)
    if not match:
        return line[:160]
    rss = re.search(r"anon-rss:(\d+)kB", line)
    where = "memory cgroup limit" if "Memory cgroup" in line else "system memory"
    text = f"kernel log: pid {match.group(1)} ({match.group(2)}) killed, {where}"
    if rss:
        text += f", anon-rss {int(rss.group(1)) / 1024:.0f} MiB"
    return text


def explain_exit(pid: int | None, exitcode: int | None = None, *,
                 since: OomSnapshot | None = None, exit_signal: int | None = None) -> str | None:
    """'killed by the kernel: out of memory (<evidence>)' for an OOM kill, else None.

    `exitcode` as Python reports it (negative: the signal); `exit_signal` if known otherwise.
    """
    if exit_signal is None and exitcode is not None and exitcode < 0:
        exit_signal = -exitcode
    if exit_signal is None and exitcode is not None and exitcode >= 0:
        return None                     # it exited by itself
    if exit_signal is not None and exit_signal != signal.SIGKILL:
        return None
    if pid:
        line = kernel_oom_line(pid)
        if line:
            return f"{OOM_PHRASE} ({_short(line)})"
    if since is not None:
        now = cgroup_oom_kills(since.cgroup)
        if since.cgroup_kills is not None and now is not None and now > since.cgroup_kills:
            return (f"{OOM_PHRASE} (memory cgroup {since.cgroup}: oom_kill "
                    f"{since.cgroup_kills} -> {now})")
        now = system_oom_kills()
        if exit_signal == signal.SIGKILL and since.system_kills is not None and \
                now is not None and now > since.system_kills:
            return f"{OOM_PHRASE} (SIGKILL, and /proc/vmstat oom_kill {since.system_kills} -> {now})"
    return None


def ray_memory_kill(reason: str) -> bool:
    """Ray's memory monitor killed the worker (its OutOfMemoryError), not the kernel."""
    return "OutOfMemoryError" in reason or "running low on memory" in reason
