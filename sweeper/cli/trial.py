"""`sweeper trial` and `sweeper host-profile`: one measured trial in this process.

JAX reads the number of virtual CPU devices (`--xla_force_host_platform_device_count`)
once, when its backend starts. So `trial` validates the YAML first (bad input exits 2
before JAX is imported), then makes sure the process has at least `chips` devices:
if JAX is not imported yet it sets the flag; if JAX already runs with fewer devices
(or on an accelerator with fewer chips than asked for) it re-executes itself as
`python -m sweeper.cli trial ...` with the flag set (and `JAX_PLATFORMS=cpu` in the
accelerator case, so the trial runs on an emulated mesh instead).
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
from pathlib import Path

from sweeper.formatting import fixed_bytes, jsonable
from workloads import hostprofile
from workloads.config import ConfigError
from workloads.measure import run_trial
from workloads.trial import TrialConfig

DEVICE_FLAG = "--xla_force_host_platform_device_count"
REEXEC_ENV = "SWEEPER_TRIAL_REEXEC"


# --------------------------------------------------------------------------- devices


def xla_flags_with_devices(flags: str, chips: int) -> str:
    """XLA_FLAGS with at least `chips` host-platform devices (an existing larger count stays)."""
    match = re.search(rf"{DEVICE_FLAG}=(\d+)", flags)
    if match:
        if int(match.group(1)) >= chips:
            return flags
        return flags.replace(match.group(0), f"{DEVICE_FLAG}={chips}")
    return f"{flags} {DEVICE_FLAG}={chips}".strip()


def ensure_devices(chips: int, argv: list[str]) -> None:
    """Make this process have >= chips JAX devices, re-executing it if it cannot."""
    env_flags = os.environ.get("XLA_FLAGS", "")
    if "jax" not in sys.modules:
        os.environ["XLA_FLAGS"] = xla_flags_with_devices(env_flags, chips)
    import jax   # lazy: JAX starts its backend; only in the process that runs a trial

    if jax.device_count() >= chips:
        return
    if os.environ.get(REEXEC_ENV):
        raise ConfigError("chips", chips, f"at most {jax.device_count()} devices "
                          f"({jax.default_backend()}), even after restarting with {DEVICE_FLAG}")
    env = dict(os.environ)
    env["XLA_FLAGS"] = xla_flags_with_devices(env_flags, chips)
    env[REEXEC_ENV] = "1"
    if jax.default_backend() != "cpu":
        env["JAX_PLATFORMS"] = "cpu"          # too few accelerators: emulate the mesh instead
    print(f"sweeper trial: restarting with {chips} virtual devices (this process has "
          f"{jax.device_count()} {jax.default_backend()} device(s))", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, "-m", "sweeper.cli", *argv], env)


def _trial_argv(args) -> list[str]:
    argv = ["trial", "--config", str(Path(args.config).resolve())]
    return argv + (["--verify"] if args.verify else []) + (["--json"] if args.json else [])


# --------------------------------------------------------------------------- trial


def trial(args) -> int:
    config = TrialConfig.from_yaml(args.config)       # ConfigError -> exit 2, before JAX
    ensure_devices(config.chips, _trial_argv(args))
    m = run_trial(config, verify=args.verify)
    if args.json:
        print(json.dumps(jsonable(m.to_dict()), indent=2))
    else:
        print(format_measurement(config.resolved(), m))
    return 0


def _seconds(v: float) -> str:
    if not math.isfinite(v):
        return "-"
    return f"{v * 1e3:.3f} ms" if v < 1 else f"{v:.3f} s"


_bytes = fixed_bytes


def _pct(v: float) -> str:
    return "-" if not math.isfinite(v) else f"{100 * v:.2f} %"


def _noise(ci_rel: float, repeats: float) -> str:
    """'  +-1.8% (95% CI of the median, 14 runs)'; the CI needs >= 6 runs."""
    runs = f"{repeats:.0f} runs" if math.isfinite(repeats) else "no runs"
    if not math.isfinite(ci_rel):
        return f"  (no 95% CI: {runs})"
    return f"  +-{100 * ci_rel:.1f}% (95% CI of the median, {runs})"


def format_measurement(config, m) -> str:
    x, y, z = config.mesh_shape
    rows = [
        ("trial", f"{config.model.name} chips={config.chips} topology={x}x{y}x{z} batch={config.batch} "
                  f"input_len={config.input_len} decode_steps={config.decode_steps} weights={config.weights}"),
        ("layouts", f"prefill {config.prefill}  decode {config.decode}"),
        ("measured on", f"{m.hardware}" + (" (emulated mesh: wall times of this host)"
                                            if m.extra.get("emulated_mesh") else "")),
        ("compile_s", f"{m.compile_s:.3f} s" + (" (cache hit)" if m.extra.get("compile_cache_hit") else "")),
        ("prefill_s", f"{_seconds(m.prefill_s)}  [min {_seconds(m.prefill_s_min)}, max {_seconds(m.prefill_s_max)}]"
                      f"{_noise(m.prefill_ci_rel, m.prefill_repeats)}"),
        ("decode_step_s", f"{_seconds(m.decode_step_s)}  [min {_seconds(m.decode_step_s_min)}, "
                          f"max {_seconds(m.decode_step_s_max)}]{_noise(m.decode_ci_rel, m.decode_repeats)}"),
        ("handoff_s", _seconds(m.extra.get("handoff_s", math.nan))),
        ("host while timed", f"load {m.host_load_avg_1m:.2f} on {m.extra.get('host_cores', '?')} core(s), "
                             f"busy {_pct(m.host_busy_frac)}, steal {_pct(m.host_steal_frac)}, "
                             f"{m.host_involuntary_switches:,.0f} involuntary switches"),
        ("total_s", _seconds(m.total_s)),
        ("prefill_mfu", _pct(m.prefill_mfu)),
        ("decode_mfu", _pct(m.decode_mfu)),
        ("prefill_cost", f"{m.prefill_cost_chip_s_per_token:.3e} chip-s/token"),
        ("decode_cost", f"{m.decode_cost_chip_s_per_token:.3e} chip-s/token"),
        ("prefill_tokens/s", f"{m.prefill_tokens_per_s:,.0f}"),
        ("decode_tokens/s", f"{m.decode_tokens_per_s:,.0f}"),
        ("weights/chip", _bytes(m.weight_bytes_per_chip)),
        ("kv_cache/chip", _bytes(m.kv_bytes_per_chip)),
        ("peak/chip", _bytes(m.peak_bytes_per_chip)),
        ("prefill comm/chip", _bytes(m.prefill_comm_bytes_per_chip)),
        ("decode comm/chip", _bytes(m.decode_comm_bytes_per_chip)),
    ]
    if m.tokens_match is not None:
        rows.append(("verify_max_abs_err", f"{m.verify_max_abs_err:.4g}"))
        rows.append(("tokens_match", str(m.tokens_match)))
    if math.isfinite(m.int8_max_logit_dev):
        rows.append(("int8_max_logit_dev", f"{m.int8_max_logit_dev:.4g}"))
    width = max(len(r[0]) for r in rows)
    lines = [f"{name:<{width}}  {value}" for name, value in rows]
    for phase, stats in m.collectives.items():
        lines.append(f"collectives ({phase}, per chip per forward pass):")
        for s in stats:
            lines.append(f"  {s.kind:<15} x{s.count:<4} {s.elements_per_chip:>12,} elements  "
                         f"{_bytes(s.bytes_per_chip):>10}  {s.dtype}")
    return "\n".join(lines)


# --------------------------------------------------------------------------- host profile


def host_profile(args) -> int:
    profile = hostprofile.host_profile(refresh=args.refresh)
    entry = hostprofile.cached_entry() or {}
    out = {"profile": profile.to_dict(), "notes": entry.get("notes", {}),
           "key": hostprofile.host_key(), "cache": str(hostprofile.cache_path())}
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    rows = [("host", out["key"]),
            ("peak_flops", f"{profile.peak_flops / 1e9:,.1f} GFLOP/s (bf16 matmul)"),
            ("hbm_bandwidth", f"{profile.hbm_bandwidth / 1e9:,.2f} GB/s (memory read)"),
            ("ici_bandwidth", f"{profile.ici_bandwidth / 1e9:,.2f} GB/s ({out['notes'].get('ici_measured_as', '')})"),
            ("hbm_bytes", _bytes(profile.hbm_bytes) + " (physical memory)"),
            ("cache", out["cache"])]
    width = max(len(r[0]) for r in rows)
    print("\n".join(f"{n:<{width}}  {v}" for n, v in rows))
    print("On an emulated mesh of n virtual devices each chip gets 1/n of these numbers.")
    return 0
