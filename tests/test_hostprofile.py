"""The host profile's peak: what it is measured as, and that MFU is measured against it.

The emulated mesh's MFU is model FLOPs / (peak x seconds) against this host's measured peak;
an early peak (one plain bf16 matmul, measured under load) read 2-3x below what the engine's
bf16 x bf16 -> f32 matmuls reach, and the quickstart showed 229% MFU. The peak is now the
larger of an in-process measurement and one pinned core's times the cores, over the
engine's own matmul form. That no program then beats it is a comparison of two timings, so
it is a benchmark's claim (benchmarks/engine_efficiency.py, `single_chip_prefill_mfu_fastest`),
not a test's: these tests check what the peak is made of and that MFU uses it.
"""

import os
import socket

import jax
import pytest
import yaml

from workloads import hostprofile
from workloads.config import HardwareProfile, ModelConfig
from workloads.layouts import PhaseLayout
from workloads.measure import run_trial
from workloads.trial import TrialConfig

MODEL = ModelConfig("peak-check", 512, 2048, 2, 8, 1, 64, 256, "parallel", "gelu", True)


def test_mfu_is_measured_against_the_larger_of_the_two_peak_measurements(sweeper_home):
    profile = hostprofile.host_profile(refresh=True)
    notes = hostprofile.cached_entry()["notes"]
    assert notes["version"] == hostprofile.PROFILE_VERSION
    assert notes["peak_flops_one_core"] and notes["peak_flops_in_process"]
    # The kept peak is the larger of the two ways of measuring it, each over the engine's
    # own matmul form (bf16 x bf16 accumulated in f32) among others.
    assert profile.peak_flops == max(notes["peak_flops_in_process"], notes["peak_flops_cores_x_one_core"])
    assert notes["peak_flops_cores_x_one_core"] == pytest.approx(
        hostprofile.host_cores() * notes["peak_flops_one_core"])
    assert ("bfloat16", "float32") in {(d, a) for _, d, a in hostprofile.MATMULS}
    trial = TrialConfig(MODEL, chips=1, batch=1, input_len=32, decode_steps=0, topology=(1, 1, 1),
                        prefill=PhaseLayout("ws2d", "head"), decode=PhaseLayout("ws2d", "head"),
                        repeats=1, warmup=0, time_budget_s=0)
    m = run_trial(trial)        # hardware=None: this host's cached profile, as a sweep uses it
    assert m.extra["peak_flops_per_chip"] == profile.peak_flops
    assert m.prefill_mfu == pytest.approx(m.extra["prefill_flops"] / (profile.peak_flops * m.prefill_s))


def test_one_core_measurement_runs_pinned_in_a_child(sweeper_home):
    result = hostprofile.measure_one_core()
    assert result is not None
    assert len(result["cores"]) == 1 and result["cores"][0] in os.sched_getaffinity(0)
    assert set(result["rates"]) == {f"{d}->{a} {n}" for n, d, a in hostprofile.MATMULS}
    assert all(rate > 0 for rate in result["rates"].values()) and result["bandwidth"] > 0
    # Which dtype pair is fastest is a timing claim (it flips under load): the peak is the
    # maximum over the pairs whatever their order (docs/measurement.md "Host profile").


def test_a_cache_from_an_older_measurement_is_measured_again(sweeper_home, monkeypatch):
    old_key = f"{socket.gethostname()}|cpus={os.cpu_count()}|jax={jax.__version__}"
    stale = HardwareProfile("host", 6.36e10, 2.3e10, 2.5e10, 1.9e9, measured=True)
    path = sweeper_home / "host_profile.yaml"
    path.write_text(yaml.safe_dump({old_key: {"profile": stale.to_dict(), "notes": {}}}))
    assert hostprofile.host_key() != old_key and hostprofile.host_key().endswith(
        f"|v{hostprofile.PROFILE_VERSION}")

    fresh = HardwareProfile("host", 4.4e11, 2.7e10, 2.5e10, 3.3e9, measured=True)
    calls = []

    def fake_measure():
        calls.append(1)
        return fresh, {"version": hostprofile.PROFILE_VERSION}

    monkeypatch.setattr(hostprofile, "measure", fake_measure)
    assert hostprofile.host_profile() == fresh
    assert hostprofile.host_profile() == fresh and len(calls) == 1       # cached under the new key
    cached = yaml.safe_load(path.read_text())
    assert set(cached) == {old_key, hostprofile.host_key()}              # the old entry is left alone


def test_a_cache_measured_on_a_busy_host_is_flagged_once_and_a_quiet_one_is_not(tmp_path, capsys):
    """A profile measured at a load far above the cores has low rates that every fit starting
    from it inherits: reading it says so, in one line, once per process."""
    profile = HardwareProfile("host", 1e11, 1e10, 2**30, 1e9, measured=True).to_dict()
    busy, quiet = tmp_path / "busy.yaml", tmp_path / "quiet.yaml"
    cores = hostprofile.host_cores()
    for path, load in ((busy, 10.0 * cores), (quiet, 0.5 * cores)):
        path.write_text(yaml.safe_dump({hostprofile.host_key(): {
            "profile": profile, "notes": {"load_average_1min": load}}}))
    hostprofile.host_profile(path=quiet)
    assert capsys.readouterr().err == ""
    for _ in range(2):
        assert hostprofile.host_profile(path=busy).hbm_bandwidth == 1e10    # still used
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and str(busy) in err[0] and "--refresh" in err[0], err
