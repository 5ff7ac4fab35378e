"""benchmarks/common.py: the machine context of every benchmark result, with the hypervisor
steal and iowait over a run (the CPU time counters of /proc/stat)."""

from __future__ import annotations

import sys

import pytest

from benchmarks import common, report

LINUX = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/stat is Linux's")


def test_cpu_time_shares_of_given_counters():
    before = {"user": 1000, "nice": 0, "system": 200, "idle": 700, "iowait": 50, "irq": 0,
              "softirq": 10, "steal": 40}
    after = {"user": 1600, "nice": 0, "system": 300, "idle": 900, "iowait": 70, "irq": 0,
             "softirq": 20, "steal": 110}
    # 1000 ticks elapsed over all CPUs: 70 stolen, 20 waiting on I/O
    shares = common.cpu_time_shares(before, after, ticks_per_s=100)
    assert shares["steal_pct"] == pytest.approx(7.0)
    assert shares["iowait_pct"] == pytest.approx(2.0)
    assert shares["cpu_s"] == pytest.approx(10.0)
    assert report.steal_text(shares) == "hypervisor steal 7.0%, iowait 2.0% of the CPUs' time"
    # nothing elapsed, or a snapshot missing (not Linux, an old results file): unknown
    assert common.cpu_time_shares(before, before)["steal_pct"] is None
    assert common.cpu_time_shares(None, after)["steal_pct"] is None
    assert report.steal_text({"load_average": [1.0, 1.0, 1.0]}) == ""


def test_cpu_times_reads_the_cpu_line(tmp_path):
    stat = tmp_path / "stat"
    stat.write_text("cpu  6020612 3201078 951747 5636460 49753 0 16605 108477 0 0\n"
                    "cpu0 1 2 3 4 5 6 7 8 0 0\nintr 1 2\n")
    times = common.cpu_times(stat)
    assert times == {"user": 6020612, "nice": 3201078, "system": 951747, "idle": 5636460,
                     "iowait": 49753, "irq": 0, "softirq": 16605, "steal": 108477}
    stat.write_text("cpu  10 20 30 40\n")          # a kernel without the later columns
    assert common.cpu_times(stat)["steal"] == 0 and common.cpu_times(stat)["idle"] == 40
    assert common.cpu_times(tmp_path / "missing") is None


@LINUX
def test_machine_context_states_the_steal_over_its_window():
    start = common.machine_context()
    assert set(start["cpu_times"]) == set(common.CPU_STATES)
    assert "steal_pct" not in start                  # a start context has no window yet
    sum(i * i for i in range(2_000_000))             # some CPU time for the window
    end = common.machine_context(since=start)
    assert all(end["cpu_times"][k] >= start["cpu_times"][k] for k in common.CPU_STATES)
    assert end["cpu_s"] > 0
    assert 0.0 <= end["steal_pct"] <= 100.0 and 0.0 <= end["iowait_pct"] <= 100.0


def test_a_results_header_gets_the_steal_clause_only_where_the_context_has_it():
    """report.steal_clause: appended after a load average by the engine-efficiency, search-
    efficiency and sweep-overhead headers; '' for a context from before steal was recorded."""
    assert report.steal_clause({"load_average": [1.0, 1.0, 1.0]}) == ""
    assert report.steal_clause(None) == ""
    clause = report.steal_clause({"steal_pct": 2.5, "iowait_pct": 0.25})
    assert clause == "; hypervisor steal 2.5%, iowait 0.2% of the CPUs' time"


def test_cpu_model_names_the_cpu_and_its_bf16_instructions(tmp_path):
    """The VM behind 'this host' changes between sessions: every context names its CPU, and
    whether it has AVX-512 BF16 (XLA CPU's bf16 matmuls, most of an emulated trial)."""
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu avx2 avx512f avx512_bf16\n\n"
                    "processor\t: 1\nmodel name\t: AMD EPYC\nflags\t\t: fpu avx2 avx512f avx512_bf16\n")
    assert common.cpu_model(info) == "AMD EPYC, avx512_bf16"
    info.write_text("model name\t: Intel(R) Xeon(R) Platinum 8375C CPU @ 2.90GHz\nflags\t: fpu avx2 avx512f\n")
    assert common.cpu_model(info) == "Intel(R) Xeon(R) Platinum 8375C CPU @ 2.90GHz"
    assert common.cpu_model(tmp_path / "missing") is None
    info.write_text("processor\t: 0\n")          # no model name line (some ARM kernels)
    assert common.cpu_model(info) is None
