"""`sweeper profile`: the op-level profile of an N-device mesh (workloads/opprofile.py),
written as a hardware profile YAML. Like `sweeper trial`, it makes sure the process has
N JAX devices first (setting `--xla_force_host_platform_device_count`, or re-executing
itself with it when JAX already runs with fewer)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from sweeper.cli import options
from sweeper.cli.trial import ensure_devices
from sweeper.formatting import jsonable
from workloads import opprofile
from workloads.config import ConfigError
from workloads.validate import integer

DEFAULT_OUT = "profiles/host-{chips}.yaml"


def add_parser(sub) -> None:
    p = sub.add_parser("profile", help="time collectives, matmuls and memory on an N-device mesh, "
                       "fit latency + bytes/bandwidth, write a hardware profile YAML")
    p.add_argument("--chips", type=int, required=True, metavar="N",
                   help="devices in the mesh (emulated on this host's CPU unless N accelerators)")
    p.add_argument("--quick", action="store_true",
                   help="4 message sizes (4 KiB .. 8 MiB) instead of 9 (1 KiB .. 64 MiB), looser CIs")
    p.add_argument("--out", metavar="FILE.yaml", help=f"where to write it (default {DEFAULT_OUT})")
    p.add_argument("--model", default="calib",
                   help="model whose per-chip matmul shapes are timed (default calib)")
    options.add_json(p, "every point and fit as JSON")
    p.set_defaults(handler=profile)


def _argv(args, out: Path) -> list[str]:
    argv = ["profile", "--chips", str(args.chips), "--out", str(out.resolve()), "--model", args.model]
    return argv + (["--quick"] if args.quick else []) + (["--json"] if args.json else [])


def profile(args) -> int:
    integer("--chips", args.chips)
    from workloads.config import load_model

    load_model(args.model, field="--model")             # bad input exits 2 before JAX starts
    out = Path(args.out or DEFAULT_OUT.format(chips=args.chips))
    if out.suffix not in (".yaml", ".yml"):
        raise ConfigError("--out", str(out), "a path ending in .yaml or .yml")
    ensure_devices(args.chips, _argv(args, out))
    progress = None if args.json else (lambda line: print(line, file=sys.stderr, flush=True))
    op = opprofile.profile(args.chips, quick=args.quick, model=args.model, progress=progress)
    path = opprofile.write_profile(op, out)
    if args.json:
        print(json.dumps(jsonable({"profile": str(path), **op.to_dict()}), indent=2))
    else:
        print(format_profile(op, path))
    return 0


def format_profile(op: opprofile.OpProfile, path: Path) -> str:
    lines = [f"op-level profile of {op.devices} {op.platform} device(s) in {op.elapsed_s:.0f} s "
             f"-> {path}  (use: --hardware {path})",
             f"{'collective':<15} {'group':>5} {'latency':>10} {'bandwidth':>12} {'worst fit':>9}"]
    for f in op.fits:
        lines.append(f"{f.kind:<15} {f.group:>5} {f.latency_s * 1e6:>7.1f} us "
                     f"{f.bandwidth / 1e9:>7.2f} GB/s {f.max_rel_err:>8.0%}")
    lines.append(f"{'matmul (per device, all at once)':<40} {'GFLOP/s':>8}")
    for m in op.matmuls:
        lines.append(f"  {m.what:<16} {m.m:>5} x {m.k:>5} x {m.n:>5}       {m.flops_per_s / 1e9:>8.2f}")
    bw = op.memory_bandwidth
    lines.append(f"memory read per device: {bw / 1e9:.2f} GB/s" if math.isfinite(bw) else "memory: -")
    return "\n".join(lines)
