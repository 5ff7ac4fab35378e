"""Which hardware profile a trial is predicted and measured with: one resolver for everyone.

A profile is a preset, a YAML file, a mapping, or `host` (this machine, measured once by
workloads/hostprofile.py and cached). On an emulated CPU mesh the measured host is shared:

  host profile (whole machine)
    x worker share   = the worker's pinned cores / the host's cores   (`worker_share`)
    / chips          = one of the trial's n virtual chips             (`per_chip`)

Presets and YAML profiles already describe one chip and are used as they are. The share a
trial ran with is recorded with it (`hardware_share`), so calibration never has to guess it.
See docs/architecture.md, "Hardware profiles and shares".
"""

from __future__ import annotations

from typing import Any

from workloads import config
from workloads.config import HardwareProfile

HOST = "host"


def load_hardware(spec: Any, source: str | None = None, field: str = "hardware") -> HardwareProfile:
    """Preset name, YAML path, mapping, or `host` (measured once, cached under $SWEEPER_HOME)."""
    if spec == HOST:
        from workloads.hostprofile import host_profile   # measures with JAX on a cache miss

        return host_profile()
    return config.load_hardware(spec, source, field)


UNCALIBRATED_HINT = ("uncalibrated: peaks only, predictions on this host can be several times off; "
                     "`sweeper calibrate` (about 5 minutes, once) fixes it")


def describe(profile: HardwareProfile) -> str:
    """One line saying which profile a command used and how far to trust it."""
    cal = profile.calibration
    if cal:
        err = cal.get("heldout_mape") or {}
        scores = ", ".join(f"{phase} {value:.0%}" for phase, value in err.items()
                           if isinstance(value, (int, float)))
        where = f"; {cal['path']}" if cal.get("path") else ""
        return (f"{profile.name}, calibrated {cal.get('calibrated_at', '?')}"
                + (f" (held-out error on its probes: {scores})" if scores else "") + where)
    if profile.measured:
        return f"{profile.name}, {UNCALIBRATED_HINT}"
    residuals = profile.heldout_residuals
    if residuals:
        return f"{profile.name} (band from {sum(map(len, residuals.values()))} held-out residuals)"
    return f"{profile.name} (datasheet numbers, uncalibrated)"


def worker_share(cores: int, total: int) -> float:
    """The fraction of a host that a worker pinned to `cores` of its `total` cores owns."""
    return min(1.0, cores / max(total, 1))


def chip_share(profile: HardwareProfile, chips: int, share: float = 1.0) -> float:
    """The fraction of `profile` that one chip of a trial gets: share/chips for a measured host."""
    return share / max(chips, 1) if profile.measured else 1.0


def per_chip(profile: HardwareProfile, chips: int, share: float = 1.0) -> HardwareProfile:
    """The per-chip profile the cost model predicts with (memory split only over the chips)."""
    if not profile.measured:
        return profile
    return profile.scaled(share).scaled(1.0 / max(chips, 1), memory=True)
