"""The Markdown of benchmarks/collectives.py's results."""

from __future__ import annotations

from benchmarks import report
from benchmarks.collectives import DEVICES, NAME


def _ms(v: float) -> str:
    return f"{v * 1e3:.2f}"


def markdown(r: dict) -> str:
    ctx = r["context"]
    lines = [f"# {NAME}: how the emulated mesh runs all-gathers of several groups",
             "",
             "    python -m benchmarks.collectives" + (f" --rounds {r['rounds']} --reps {r['reps']}"),
             "",
             f"Host timings (emulated mesh of {DEVICES} CPU devices, {ctx['cpus']} cores), one "
             f"process, rows of a part interleaved; {r['rounds']} rounds x {r['reps']} calls, "
             "median over rounds (IQR); load average "
             f"{ctx['load_average']} before, {r['load_after']} after. CPU = this process's CPU "
             "time per call.",
             "",
             "## (a) One all-gather of a bf16 768 x 384 shard per device, by grouping",
             "",
             "groups x g on groups*g devices; then the matmul that consumes it (rows = 512 / g "
             "per device: the same FLOPs on every device); and that matmul alone on weights "
             "already gathered.", ""]
    rows = []
    for a in r["micro"]:
        gm, g_, mm = a["gather+matmul"], a["gather"], a["matmul"]
        rows.append([a["config"], a["devices"],
                     f"{a['gather_bytes_per_device'] / 1e6:.2f} MB {a['gather_dtype']}",
                     f"{a['gather_bytes_per_device'] * a['devices'] / 1e6:.1f} MB",
                     f"{_ms(g_['median_s'])} ({_ms(g_['iqr_s'])})", _ms(g_["cpu_s_per_call"]),
                     f"{_ms(mm['median_s'])} ({_ms(mm['iqr_s'])})",
                     f"{_ms(gm['median_s'])} ({_ms(gm['iqr_s'])})",
                     f"{_ms(gm['median_s'] - mm['median_s'])}",
                     f"{_ms(a['2 gathers+2 matmuls']['median_s'])}",
                     f"{_ms(a['2 gathers+2 matmuls']['median_s'] - a['2 matmuls']['median_s'])}"])
    lines += report.table(["groups x g", "devices", "gathered per device (as run)",
                           "by the mesh", "gather ms", "gather CPU ms", "matmul ms",
                           "gather+matmul ms", "gather's share ms",
                           "2 gathers + 2 matmuls ms", "gathers' share ms"], rows)
    lines += ["", "## (b) The engine's prefill (calib, batch 8 x 64 tokens, head attention)", "",
              "Collectives of the compiled prefill (optimized HLO); weight gathers = those "
              "fed by a parameter; hoisted = collectives of the entry computation before its "
              "first matmul; FFN matmul = one FFN input matmul of the layout per device, run "
              "alone on the mesh.", ""]
    rows = []
    ws2d = {b["chips"]: b for b in r["engine"] if b["layout"] == "ws2d"}
    for b in r["engine"]:
        base = ws2d[b["chips"]]
        p, m = b["prefill"], b["ffn_matmul_time"]
        rows.append([f"{b['chips']} ({b['topology']})", b["layout"], b["collectives"],
                     f"{b['weight_gathers']} ({', '.join(b['weight_gather_shape']) or '-'})",
                     f"{b['weight_gather_bytes_per_device'] / 1e6:.1f} MB",
                     f"{b['comm_bytes_per_device'] / 1e6:.1f} MB", b["hoisted_to_start"],
                     f"{_ms(p['median_s'])} ({_ms(p['iqr_s'])})",
                     f"{(p['median_s'] - base['prefill']['median_s']) * 1e3:+.1f}",
                     _ms(p["cpu_s_per_call"]),
                     "-" if not b.get("no_weight_gathers") else
                     f"{_ms(b['no_weight_gathers']['median_s'])} ({_ms(b['no_weight_gathers']['iqr_s'])})",
                     "-" if not b.get("no_weight_gathers") else
                     f"{(p['median_s'] - b['no_weight_gathers']['median_s']) * 1e3:+.1f}",
                     "-" if not b.get("no_weight_gathers") else
                     f"{(p['cpu_s_per_call'] - b['no_weight_gathers']['cpu_s_per_call']) * 1e3:+.1f}",
                     "x".join(map(str, b["ffn_matmul"])),
                     f"{_ms(m['median_s'])} ({_ms(m['iqr_s'])})",
                     f"{(m['median_s'] - base['ffn_matmul_time']['median_s']) * 1e3:+.2f}"])
    lines += report.table(["chips", "layout", "collectives", "weight gathers (g x groups)",
                           "weight gathered / device", "all collectives / device", "hoisted",
                           "prefill ms", "above ws2d ms", "prefill CPU ms",
                           "without weight gathers ms", "the gathers' wall ms", "the gathers' CPU ms",
                           "FFN matmul",
                           "FFN matmul ms", "above ws2d ms"], rows)
    if r.get("findings"):
        lines += ["", "## What it shows", ""] + [f"- {f}" for f in r["findings"]]
    return "\n".join(lines) + "\n"
