"""benchmarks/serving_validation.py: the calibration fit starts from the host profile of the
sweep's own SWEEPER_HOME (the one its trials were priced with), not this process's cache
(docs/serving.md, "Validation on this host")."""

from __future__ import annotations

import os

import yaml

from benchmarks import serving_validation as sv
from sweeper.analysis import calibrate as cal
from workloads import hostprofile
from workloads.config import HardwareProfile


def _cache(home, hbm: float) -> None:
    profile = HardwareProfile("host", peak_flops=4e11, hbm_bandwidth=hbm, hbm_bytes=2e10,
                              ici_bandwidth=6e9, measured=True)
    (home / "host_profile.yaml").write_text(yaml.safe_dump(
        {hostprofile.host_key(): {"profile": profile.to_dict(), "notes": {}}}))


def test_the_fit_resolves_host_in_the_sweeps_home(tmp_path, monkeypatch):
    mine, sweeps = tmp_path / "mine", tmp_path / "sweep"
    mine.mkdir(), sweeps.mkdir()
    _cache(mine, 8.6e9)          # a stale cache measured under load
    _cache(sweeps, 3.2e10)       # what the calibration sweep measured
    monkeypatch.setenv("SWEEPER_HOME", str(mine))
    attrs = {"hardware": "host"}
    assert cal.study_base_profile(attrs).hbm_bandwidth == 8.6e9
    with sv._sweeper_home(sweeps):
        assert cal.study_base_profile(attrs).hbm_bandwidth == 3.2e10
    assert os.environ["SWEEPER_HOME"] == str(mine)     # restored after the block
    with sv._sweeper_home(None):
        assert cal.study_base_profile(attrs).hbm_bandwidth == 8.6e9
