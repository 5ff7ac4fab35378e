"""Op-level profiling (workloads/opprofile.py): a quick profile of 4 emulated devices is
fitted with positive latencies and bandwidths and written as a profile `load_hardware`
reads back; the fit recovers known constants; bad profile fields are ConfigErrors."""

import math

import pytest
import yaml

from workloads import opprofile
from workloads.config import COLLECTIVE_KINDS, ConfigError
from workloads.hardware import load_hardware, per_chip


@pytest.fixture(scope="module")
def quick_profile():
    """--quick on 4 devices (~20-30 s on the 2-core VM): every kind, group sizes 2 and 4."""
    return opprofile.profile(4, quick=True, settings=opprofile.Settings(
        ci_target=0.1, time_budget_s=0.1, loop_target_s=5e-3))


def test_group_sizes_are_the_divisors_above_one():
    assert opprofile.group_sizes(8) == [2, 4, 8]
    assert opprofile.group_sizes(6) == [2, 3, 6]
    assert opprofile.group_sizes(1) == []


def test_message_bytes_follow_the_hlo_convention():
    # all-gather: the output (group x the carried input); the others: the carried tensor
    elements = opprofile.local_elements("all-gather", 4, 64 * 1024)
    assert opprofile.message_bytes("all-gather", 4, elements) == 64 * 1024
    elements = opprofile.local_elements("reduce-scatter", 4, 64 * 1024)
    assert opprofile.message_bytes("reduce-scatter", 4, elements) == 64 * 1024
    assert elements % 4 == 0


def test_the_fit_recovers_known_latency_and_bandwidth():
    latency, bandwidth = 30e-6, 2e9
    points = [opprofile.CollectivePoint("all-gather", 4, b, latency + b / bandwidth, 0.01, 6)
              for b in opprofile.SIZES]
    fit = opprofile.fit_collective(points)
    assert fit.latency_s == pytest.approx(latency, rel=1e-3)
    assert fit.bandwidth == pytest.approx(bandwidth, rel=1e-3)
    assert fit.max_rel_err < 1e-3
    # timings lost in noise (<= 0) are left out; fewer than two left: no fit
    noisy = [opprofile.CollectivePoint("all-to-all", 2, 1024, -1e-6, math.nan, 6), points[0]]
    assert opprofile.fit_collective(noisy) is None


def test_quick_profile_fits_every_kind_and_group(quick_profile):
    op = quick_profile
    assert {(f.kind, f.group) for f in op.fits} <= {(k, g) for k in opprofile.KINDS for g in (2, 4)}
    assert len(op.fits) >= 6          # a point or two may drown in a loaded host's noise
    for f in op.fits:
        assert f.latency_s > 0 and f.bandwidth > 0 and math.isfinite(f.bandwidth), f
    sizes = {p.bytes_per_chip for p in op.collectives if p.kind == "all-gather"}
    assert min(sizes) <= 4 * 1024 and max(sizes) >= 8 * 1024 * 1024
    # larger messages take longer (1 MiB vs 4 KiB: far beyond the noise)
    for kind in opprofile.KINDS:
        by_size = {p.bytes_per_chip: p.seconds for p in op.collectives if p.kind == kind and p.group == 4}
        assert by_size[max(by_size)] > by_size[min(by_size)]
    assert op.peak_flops > 0 and op.memory_bandwidth > 0 and op.hbm_bytes > 0
    assert {m.what for m in op.matmuls} >= {"prefill ffn_in", "decode ffn_in"}


def test_profile_yaml_loads_as_hardware(quick_profile, tmp_path):
    path = opprofile.write_profile(quick_profile, tmp_path / "prof.yaml")
    hw = load_hardware(str(path))
    assert hw.name == "prof" and hw.measured          # the whole host: trials take their share
    chip = per_chip(hw, quick_profile.devices)         # one of the profiled mesh's devices
    assert chip.peak_flops == pytest.approx(quick_profile.peak_flops)
    assert chip.hbm_bytes == pytest.approx(quick_profile.hbm_bytes)
    for f in quick_profile.fits:
        assert chip.collective_latency_s_by_group[f.kind][f.group] == pytest.approx(f.latency_s)
        assert chip.collective_bandwidth_by_group[f.kind][f.group] == pytest.approx(f.bandwidth)
    assert set(hw.collective_latency_s_by_kind) <= set(COLLECTIVE_KINDS)
    assert (tmp_path / "prof.points.json").exists()


@pytest.mark.parametrize("field, value", [
    ("collective_latency_s_by_group", {"all-gather": {1: 1e-5}}),
    ("collective_latency_s_by_group", {"broadcast": {2: 1e-5}}),
    ("collective_bandwidth_by_group", {"all-gather": {2: 0}}),
    ("collective_bandwidth_by_group", {"all-gather": [2, 1e9]}),
])
def test_bad_profile_fields_are_config_errors(tmp_path, field, value):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({"peak_flops": 1e12, "hbm_bandwidth": 1e11, "hbm_bytes": 1e9,
                                    "ici_bandwidth": 1e10, field: value}))
    with pytest.raises(ConfigError, match=field):
        load_hardware(str(path))


def test_profile_command_writes_a_profile_predict_accepts(tmp_path):
    """`sweeper profile --chips 2 --quick` in a fresh process (it sets its own device count),
    then `sweeper predict --hardware` that file."""
    import json
    import os
    import subprocess
    import sys

    out = tmp_path / "host-2.yaml"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}   # the command sets it
    done = subprocess.run([sys.executable, "-m", "sweeper.cli", "profile", "--chips", "2",
                           "--quick", "--out", str(out), "--json"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout)
    assert report["devices"] == 2 and report["profile"] == str(out)
    assert {f["group"] for f in report["fits"]} == {2}
    hw = load_hardware(str(out))
    assert set(hw.collective_bandwidth_by_group["all-gather"]) == {2}
    predicted = subprocess.run([sys.executable, "-m", "sweeper.cli", "predict", "--model", "calib",
                                "--hardware", str(out), "--chips", "2", "--batch", "8",
                                "--phase", "decode", "--json"],
                               capture_output=True, text=True, env=env, timeout=120)
    assert predicted.returncode == 0, predicted.stderr[-2000:]
    assert json.loads(predicted.stdout)


def test_one_device_profile_has_no_collectives(tmp_path):
    op = opprofile.OpProfile(1, "cpu", "calib", memory_bandwidth=1e10, hbm_bytes=1e9,
                             matmuls=[opprofile.MatmulPoint("decode ffn_in", 8, 8, 8, 1e-3, 1e9, 0.01)])
    hw = opprofile.to_hardware(op)
    assert hw.ici_bandwidth == 1e10 and hw.collective_latency_s == 0.0
    assert hw.collective_latency_s_by_group == {}
