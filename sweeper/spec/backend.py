"""Where a sweep's trials run, a space file's `hardware:`: `host` (an emulated mesh on this
machine), `devices` (real accelerators) or `analytical:<profile>` (the cost model).

    hardware: host                   # host | devices | devices:<profile> | analytical:<profile or YAML>
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from workloads.config import ConfigError, HardwareProfile
from workloads.hardware import HOST, load_hardware
from workloads.validate import one_of

HARDWARE_KINDS = ("host", "devices", "analytical")


@dataclass(frozen=True)
class HardwareSpec:
    """Where trials run: `host` (emulated mesh), `devices` (real accelerators), `analytical`."""

    kind: str
    profile: str | None = None     # analytical / devices: the cost model's hardware profile
    base_dir: str | None = None    # where a relative profile YAML is looked up

    @property
    def source(self) -> str:
        """The Measurement source this backend produces."""
        return "analytical" if self.kind == "analytical" else "measured"

    @property
    def label(self) -> str:
        return f"{self.kind}:{self.profile}" if self.profile else self.kind

    def profile_spec(self) -> str:
        """The profile as `load_hardware` takes it (a relative YAML resolved against the space)."""
        spec = self.profile or "host"
        if spec.endswith((".yaml", ".yml")) and self.base_dir and not Path(spec).is_absolute():
            candidate = Path(self.base_dir) / spec
            if candidate.is_file() or not Path(spec).is_file():
                return str(candidate)
        return spec

    def resolve(self, source: str | None = None) -> HardwareProfile | None:
        """The cost model's profile of a sweep: `host` measured (cached), a preset/YAML, or none."""
        if self.kind == "host":
            return load_hardware(HOST)
        return self.load_profile(source) if self.profile else None

    def load_profile(self, source: str | None = None) -> HardwareProfile:
        """The cost model's profile (for `host`: measured once per host and cached)."""
        return load_hardware(self.profile_spec(), source=source, field="hardware")

    @classmethod
    def parse(cls, spec: Any, source: str | None) -> "HardwareSpec":
        base_dir = str(Path(source).parent) if source else None
        if not isinstance(spec, str) or not spec:
            raise ConfigError("hardware", spec, "host, devices, devices:<profile> or "
                              "analytical:<profile or YAML>", source)
        kind, _, profile = spec.partition(":")
        kind = one_of("hardware", kind, HARDWARE_KINDS, source, suggest=True)
        profile = profile.strip() or None
        if kind == "host" and profile:
            raise ConfigError("hardware", spec, "host (an emulated mesh is measured on this "
                              "host; write analytical:<profile> for a cost-model sweep)", source)
        if kind == "analytical" and not profile:
            raise ConfigError("hardware", spec, "analytical:<profile or YAML>, e.g. "
                              "analytical:tpu-v4", source)
        hardware = cls(kind, profile, base_dir)
        if profile and profile != "host":
            hardware.load_profile(source)     # a bad preset or YAML fails now, with a suggestion
        return hardware
