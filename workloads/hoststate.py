"""What else the host was doing while a trial was timed: load average, CPU steal and
involuntary context switches (docs/architecture.md, "Measurement protocol").

An emulated mesh shares this host's cores with every other process, so a timing is only
as good as the host was quiet. `HostSampler` reads the counters before and after the timed
runs; the differences go into `Measurement` next to the timings they disturbed.

- load average: the kernel's 1-minute average of runnable tasks (`/proc/loadavg`), at the end;
- CPU steal: the share of this process's cores' time a hypervisor gave to other guests
  (`/proc/stat`, columns of the `cpuN` lines the process may run on);
- busy: the share of those cores' time spent not idle (by us or anyone else);
- involuntary context switches of this process, all threads (`getrusage`, which the kernel
  fills from the same per-task counters `/proc/<pid>/status` shows).
Every reading is best effort: NaN where the file does not exist (not Linux).
"""

from __future__ import annotations

import math
import os
import resource
from dataclasses import dataclass
from pathlib import Path

PROC_STAT = Path("/proc/stat")
PROC_LOADAVG = Path("/proc/loadavg")
# /proc/stat cpu columns: user nice system idle iowait irq softirq steal guest guest_nice.
# guest time is already counted in user, so the total is the first eight.
IDLE_COLUMNS = (3, 4)
STEAL_COLUMN = 7
TOTAL_COLUMNS = 8


@dataclass
class CpuTimes:
    """Jiffies summed over a set of cores."""

    total: float = math.nan
    idle: float = math.nan
    steal: float = math.nan


@dataclass
class HostState:
    """The host during one timed interval (fields of `Measurement` as host_*)."""

    load_avg_1m: float = math.nan
    steal_frac: float = math.nan
    busy_frac: float = math.nan
    involuntary_switches: float = math.nan
    cores: int = 0


def process_cores() -> tuple[int, ...]:
    """The cores this process may run on (a Ray worker may be pinned to some)."""
    try:
        return tuple(sorted(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return tuple(range(os.cpu_count() or 1))


def cpu_times(cores: tuple[int, ...], stat_text: str | None = None) -> CpuTimes:
    """Total, idle and steal jiffies of `cores` from /proc/stat (or the given text)."""
    if stat_text is None:
        try:
            stat_text = PROC_STAT.read_text()
        except OSError:
            return CpuTimes()
    wanted = {f"cpu{c}" for c in cores}
    times = CpuTimes(0.0, 0.0, 0.0)
    found = False
    for line in stat_text.splitlines():
        name, *values = line.split()
        if name not in wanted:
            continue
        numbers = [float(v) for v in values[:TOTAL_COLUMNS]]
        numbers += [0.0] * (TOTAL_COLUMNS - len(numbers))   # old kernels lack steal
        times.total += sum(numbers)
        times.idle += sum(numbers[i] for i in IDLE_COLUMNS)
        times.steal += numbers[STEAL_COLUMN]
        found = True
    return times if found else CpuTimes()


def load_average() -> float:
    try:
        return float(PROC_LOADAVG.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return math.nan


def involuntary_switches() -> float:
    return float(resource.getrusage(resource.RUSAGE_SELF).ru_nivcsw)


def interval_state(before: CpuTimes, after: CpuTimes, switches: float, load: float,
                   cores: int) -> HostState:
    """HostState of an interval from its two /proc/stat readings."""
    total = after.total - before.total
    if not total > 0:
        return HostState(load, math.nan, math.nan, switches, cores)
    steal = (after.steal - before.steal) / total
    busy = 1.0 - (after.idle - before.idle) / total
    return HostState(load, steal, busy, switches, cores)


class HostSampler:
    """`start()` before the timed runs, `stop()` after: the host's state in between."""

    def __init__(self) -> None:
        self.cores = process_cores()
        self._cpu = CpuTimes()
        self._switches = math.nan

    def start(self) -> "HostSampler":
        self._cpu = cpu_times(self.cores)
        self._switches = involuntary_switches()
        return self

    def stop(self) -> HostState:
        return interval_state(self._cpu, cpu_times(self.cores),
                              involuntary_switches() - self._switches, load_average(),
                              len(self.cores))


# ----------------------------------------------------------------------------- memory high-water
# The peak resident set size of a worker process over one trial (`worker_rss_peak_bytes`):
# the kernel's VmHWM, reset before the trial by writing 5 to /proc/self/clear_refs (Linux
# >= 4.0), so a long-lived Ray actor reports each trial's own peak, not its lifetime's.
PROC_STATUS = Path("/proc/self/status")
PROC_CLEAR_REFS = Path("/proc/self/clear_refs")


def reset_peak_rss() -> bool:
    """Start a new high-water interval; False where the kernel does not allow it."""
    try:
        PROC_CLEAR_REFS.write_text("5")
        return True
    except OSError:
        return False


def peak_rss_bytes() -> float:
    """VmHWM of this process in bytes (getrusage's lifetime peak where /proc is missing)."""
    try:
        for line in PROC_STATUS.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return float(line.split()[1]) * 1024.0       # reported in kB
    except (OSError, ValueError, IndexError):
        pass
    return float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024.0   # kB on Linux
