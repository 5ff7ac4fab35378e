"""The Markdown of benchmarks/device_check.py's results (`device-<kind>.json`)."""

from __future__ import annotations

import math

from benchmarks import report


def markdown(data: dict) -> str:
    device, hardware, profile = data["device"], data["hardware"], data["sweeper_profile"]
    peak = f"{hardware['peak_flops'] / 1e12:.3g} TFLOP/s" if hardware else "—"
    hbm = f"{hardware['hbm_bandwidth'] / 1e9:.4g} GB/s" if hardware else "—"
    model = data["model"]["name"] if isinstance(data["model"], dict) else data["model"]
    lines = [f"# Device check: {device['device_kind']} ({device['platform']})", "",
             "SMOKE run (tiny model, host CPU): checks the script, measures nothing about an "
             "accelerator." if data["smoke"] else f"One device, mid-size model {model}.",
             "", f"- devices seen: {device['device_count']} x {device['device_kind']}; "
             f"jax {device['jax']}; {device['time']}",
             f"- hardware profile: `{hardware['name'] if hardware else 'none'}` (peak {peak} "
             f"bf16, HBM {hbm}); MFU against that peak, bound against that bandwidth",
             f"- elapsed {data['elapsed_s']:.0f} s", ""]
    lines += report.table(
        ["trial", "weights", "batch", "prompt", "compile", "prefill", "prefill MFU",
         "decode step", "memory bound", "step / bound"],
        [[r["purpose"], r["weights"], r["batch"], r["input_len"], f"{r['compile_s']:.1f} s",
          report.ms(r["prefill_s"]), report.pct(r["prefill_mfu"]), report.ms(r["decode_step_s"]),
          report.ms(r["memory_bound_s"]),
          f"{r['bound_ratio']:.2f}x" if r["bound_ratio"] is not None and math.isfinite(r["bound_ratio"])
          else "—"] for r in data["trials"]])
    if data["skipped"]:
        lines += ["", f"Skipped (time budget): {', '.join(data['skipped'])}"]
    lines += ["", "## sweeper profile", ""]
    if profile.get("ran"):
        lines += [f"`{profile['command']}` (exit {profile['returncode']}):", "", "```",
                  profile["output"].rstrip(), "```"]
    else:
        lines.append(profile.get("note", "not run"))
    return "\n".join(lines) + "\n"
