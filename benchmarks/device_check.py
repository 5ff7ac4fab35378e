"""Accelerator check: the engine on ONE real device against that device's datasheet.

    python -m benchmarks.device_check            # on a GPU/TPU machine, <= 5 minutes
    python -m benchmarks.device_check --smoke    # anywhere (CPU: tiny model, seconds)

On whatever accelerator JAX sees (`jax.devices()[0]`), trials of a mid-size model run on
one device through the engine (`workloads.measure.run_trial`), bf16 and int8 weights:

- prefill MFU = model FLOPs / (peak FLOP/s x prefill_s), the peak from the hardware preset
  matching the device kind (`h100`, `h200`, `a100-80g`, `tpu-v4`, `tpu-v5e`; their sources
  are cited in workloads/config.py) or `--hardware`. int8 weights are dequantised to bf16
  before each matmul (paper §3.6), so both formats are held to the bf16 peak;
- decode step against its memory bound, (weight bytes + KV-cache bytes) / HBM bandwidth
  (the definition benchmarks/engine_efficiency.py uses on the host): int8 halves the
  weight bytes, so its bound is lower;
- `sweeper profile` of the device, when this version of the CLI has that command.

Writes `benchmarks/results/device-<kind>.md` and `.json` (kind: the device kind, e.g.
`nvidia-h200`; `cpu` for a smoke run on the host). Trials that would start after the time
budget (`--budget-s`, default 240 s) are skipped and listed as skipped. Without an
accelerator and without --smoke it exits 2: a CPU run of the mid-size model would measure
nothing this check is for.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from benchmarks import common, harness, report

# E 4096 / F 16384 as PaLM 8B (so the matmuls have a real model's shapes), 8 layers (so a
# compile takes seconds, not minutes), multiquery attention with 32 heads of 128, 32k
# vocabulary: 1.5 B parameters, 3 GB in bf16, 1.5 GB in int8.
MID_MODEL = {"name": "mid-1.5b", "d_model": 4096, "d_ff": 16384, "n_layers": 8, "n_heads": 32,
             "n_kv_heads": 1, "d_head": 128, "vocab": 32000, "block": "parallel",
             "mlp": "swiglu", "tie_embeddings": True}
# (purpose, batch, input_len, decode_steps): a prefill of 16k tokens (compute-bound),
# then a decode of a large batch over a short prompt (weight-bandwidth-bound).
FULL_TRIALS = (("prefill", 8, 2048, 8), ("decode", 64, 128, 64))
SMOKE_TRIALS = (("prefill", 2, 16, 4), ("decode", 4, 8, 4))
WEIGHTS = ("bf16", "int8")
NAME_PREFIX = "device-"


@dataclasses.dataclass
class Row:
    """One trial's numbers for the table (plain data, JSON as it is)."""

    purpose: str
    weights: str
    batch: int
    input_len: int
    decode_steps: int
    compile_s: float
    prefill_s: float
    prefill_mfu: float
    decode_step_s: float
    memory_bound_s: float
    bound_ratio: float
    weight_bytes: float
    kv_bytes: float


def device_kind_slug(kind: str) -> str:
    """'NVIDIA H200' -> 'nvidia-h200', 'TPU v4' -> 'tpu-v4', 'cpu' -> 'cpu'."""
    return re.sub(r"[^a-z0-9]+", "-", kind.lower()).strip("-") or "unknown"


def trial_config(purpose: str, batch: int, input_len: int, decode_steps: int, weights: str,
                 smoke: bool):
    from workloads.trial import TrialConfig

    return TrialConfig.from_dict({
        "model": "tiny" if smoke else MID_MODEL, "chips": 1, "topology": [1, 1, 1],
        "batch": batch, "input_len": input_len, "decode_steps": decode_steps,
        "weights": weights, "repeats": 1 if smoke else 3, "warmup": 0 if smoke else 1,
        # smoke: exactly one timed run; else runs repeat until the medians are precise
        # (docs/measurement.md "Measurement protocol") or 2 s of runs
        "time_budget_s": 0 if smoke else 2.0})


def measure(config, hardware, cache: dict, purpose: str) -> Row:
    from workloads.measure import run_trial

    m = run_trial(config, engine_cache=cache, hardware=hardware)
    hbm = hardware.hbm_bandwidth if hardware else math.nan     # unknown device: no bound
    bound = (m.weight_bytes_per_chip + m.kv_bytes_per_chip) / hbm
    return Row(purpose, config.weights, config.batch, config.input_len, config.decode_steps,
               m.extra.get("compile_s_when_built", m.compile_s), m.prefill_s, m.prefill_mfu,
               m.decode_step_s, bound, m.decode_step_s / bound, m.weight_bytes_per_chip,
               m.kv_bytes_per_chip)


def sweeper_profile(timeout_s: float) -> dict:
    """`sweeper profile` of this device, if the installed CLI has the command."""
    exe = shutil.which("sweeper")
    cmd = [exe] if exe else [sys.executable, "-m", "sweeper.cli"]
    probe = subprocess.run([*cmd, "profile", "--help"], capture_output=True, text=True,
                           timeout=120)
    if probe.returncode != 0:
        return {"ran": False, "note": "this version of `sweeper` has no `profile` command; "
                "skipped"}
    proc = subprocess.run([*cmd, "profile"], capture_output=True, text=True, timeout=timeout_s)
    return {"ran": True, "returncode": proc.returncode, "command": " ".join([*cmd, "profile"]),
            "output": (proc.stdout + proc.stderr)[-6000:]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.device_check",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true",
                        help="tiny model, one repeat: seconds on any machine (CPU included)")
    parser.add_argument("--hardware", help="profile for MFU and the bound (default: the preset "
                        "matching the device kind; on CPU the host's measured profile)")
    parser.add_argument("--budget-s", type=float, default=240.0,
                        help="start no trial after this many seconds (default 240)")
    parser.add_argument("--out", type=Path, help="folder for the results "
                        "(default benchmarks/results)")
    parser.add_argument("--no-profile", action="store_true", help="skip `sweeper profile`")
    args = parser.parse_args(argv)

    import jax

    from workloads.config import ConfigError
    from workloads.measure import is_emulated, resolve_hardware

    if is_emulated() and not args.smoke:
        print("device_check: error: JAX sees no accelerator (backend cpu); run it on a GPU/TPU "
              "machine, or pass --smoke", file=sys.stderr)
        return 2
    try:
        hardware = resolve_hardware(args.hardware, 1)
    except ConfigError as err:
        print(f"device_check: error: {err}", file=sys.stderr)
        return 2
    first = jax.devices()[0]
    device = {"platform": jax.default_backend(), "device_kind": first.device_kind,
              "device_count": jax.device_count(), **common.machine_context()}
    started = time.monotonic()
    cache: dict = {}
    rows: list[Row] = []
    skipped: list[str] = []
    for purpose, batch, input_len, steps in SMOKE_TRIALS if args.smoke else FULL_TRIALS:
        for weights in WEIGHTS:
            label = f"{purpose}/{weights}"
            if time.monotonic() - started > args.budget_s:
                skipped.append(label)
                continue
            config = trial_config(purpose, batch, input_len, steps, weights, args.smoke)
            rows.append(measure(config, hardware, cache, purpose))
            r = rows[-1]
            print(f"{label}: prefill {report.ms(r.prefill_s)} MFU {report.pct(r.prefill_mfu)}; "
                  f"decode step {report.ms(r.decode_step_s)} = {r.bound_ratio:.2f}x its memory "
                  f"bound", file=sys.stderr)
    profile = {"ran": False, "note": "skipped (--no-profile)"} if args.no_profile else \
        sweeper_profile(timeout_s=max(60.0, 300.0 - (time.monotonic() - started)))
    elapsed = time.monotonic() - started
    kind = "cpu" if is_emulated() else device_kind_slug(first.device_kind)
    data = {"device": device, "smoke": args.smoke,
            "hardware": hardware.to_dict() if hardware else None,
            "model": "tiny" if args.smoke else MID_MODEL,
            "trials": [dataclasses.asdict(r) for r in rows], "skipped": skipped,
            "sweeper_profile": profile, "elapsed_s": elapsed}
    from benchmarks.render.device_check import markdown

    files = harness.write(f"{NAME_PREFIX}{kind}", data, markdown(common.clean(data)),
                          Path(args.out or common.RESULTS))
    print(f"wrote {', '.join(map(str, files))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
