"""The Markdown of benchmarks/engine_efficiency.py's results."""

from __future__ import annotations

from benchmarks import report
from benchmarks.engine_efficiency import (BATCH, BENCH_MODEL, SMALL_ROW_COPIES, TARGET_DECODE_RATIO,
                                          TARGET_PREFILL_MFU, TARGET_SHARDED_RATIO)


def _decode_explanations(r: dict) -> list[str]:
    """Per 8-chip decode row: the time above the 1-chip step measured next to it, per collective."""
    single = {d["batch"]: d for d in r["decode"] if d["chips"] == 1 and d["process_devices"] == 8}
    out = []
    for d in r["decode"]:
        base = single.get(d["batch"])
        if d["chips"] == 1 or base is None or not d["collective_ops"]:
            continue
        extra = d["decode_step_s"] - base["decode_step_s"]
        if extra <= 0:
            out.append(f"  - 8 chips {d['ffn']} batch {d['batch']}: no slower than one chip "
                       f"({report.ms(d['decode_step_s'])} vs {report.ms(base['decode_step_s'])})")
            continue
        out.append(f"  - 8 chips {d['ffn']} batch {d['batch']}: {report.ms(extra)} above one chip "
                   f"({report.ms(base['decode_step_s'])}) for {d['collective_ops']} collectives per "
                   f"step: {extra / d['collective_ops'] * 1e6:.0f} us each, for "
                   f"{d['decode_comm_bytes_per_chip'] / 1024:.0f} KiB per chip in all")
    return out


def _chips_label(row: dict) -> str:
    return str(row["chips"]) if row["process_devices"] == row["chips"] else \
        f"{row['chips']} (next to the 8-chip runs)"


def markdown(r: dict) -> str:
    h, p, notes = r["host_profile"], r["profile"], r["host_profile_notes"]
    one_core = notes.get("peak_flops_one_core") or 0
    largest = [s for s in r["sharded"] if s["tokens"] == max(x["tokens"] for x in r["sharded"])] \
        if r["sharded"] else []
    decode1 = {d["batch"]: d for d in r["decode"] if d["chips"] == 1 and d["process_devices"] == 1}
    lines = [
        "# Engine efficiency (measured on this host, emulated mesh)",
        "",
        f"Host peak {h['peak_flops'] / 1e9:.0f} GFLOP/s ({notes.get('peak_flops_from', '')}; "
        f"one core {one_core / 1e9:.0f} GFLOP/s, bf16 x bf16 -> f32 matmuls as the engine runs "
        f"them), read bandwidth {h['hbm_bandwidth'] / 1e9:.1f} GB/s, copy bandwidth "
        f"{h['ici_bandwidth'] / 1e9:.1f} GB/s; {r['context']['cpus']} CPUs; load average "
        f"{r['context']['load_average']} at the start, {r['context_end']['load_average']} at the "
        f"end{report.steal_clause(r['context_end'])} (other jobs share this machine; every number "
        "here moves with them). "
        f"Model `{BENCH_MODEL['name']}`: E {BENCH_MODEL['d_model']}, F {BENCH_MODEL['d_ff']}, "
        f"{BENCH_MODEL['n_layers']} layers, {BENCH_MODEL['n_heads']} heads x {BENCH_MODEL['d_head']}, "
        f"multiquery, bf16 weights; prefill batch {BATCH}. 8 chips = topology 2x2x2. "
        f"Took {r['elapsed_s']:.0f} s.",
        "",
        *report.table(["target", "value", ""], [
            [f"single-chip prefill MFU >= {report.pct(TARGET_PREFILL_MFU, 0)} (largest batch)",
             f"{report.pct(r['single_chip_prefill_mfu'])} (fastest repeat "
             f"{report.pct(r['single_chip_prefill_mfu_fastest'])}; per CPU-second it got: "
             f"{report.pct(r['single_chip_prefill_mfu_per_cpu_s'])}, with "
             f"{report.pct(r['single_chip_cpu_share'])} of the cores)", report.met(r["meets_prefill_target"])],
            [f"8 chips / 1 chip prefill time <= {TARGET_SHARDED_RATIO}x (largest batch, every layout)",
             f"{r['best_sharded_ratio_largest']:.2f}x (best) to {r['worst_sharded_ratio_largest']:.2f}x"
             if r["worst_sharded_ratio_largest"] else "—", report.met(r["meets_sharded_target"])],
            [f"decode step / memory bound <= {TARGET_DECODE_RATIO}x",
             f"worst {r['worst_decode_ratio']:.2f}x", report.met(r["meets_decode_target"])],
        ]),
        "",
        "## Prefill MFU as tokens per batch grow",
        "",
        "MFU: `run_trial`'s, against the host peak split over the chips (median of 3 repeats). "
        "The next three come from a second timing window right after it, in which this process's "
        "CPU time is counted: the MFU in that window, `CPU share` = CPU seconds / (wall seconds x "
        "cores), and `MFU per CPU-s` = FLOPs / (CPU seconds x one core's peak), what the engine "
        "does with the core time it gets (load changes between the two windows show as a gap "
        "between the two MFUs).",
        "",
        *report.table(["chips", "FFN layout", "tokens", "prefill", "GFLOP/s", "MFU", "window MFU",
                       "CPU share", "MFU per CPU-s", "comm/chip", "8c / 1c"],
                      [[_chips_label(row), row["ffn"], row["tokens"], report.ms(row["prefill_s"]),
                        f"{row['gflops_per_s']:.0f}", report.pct(row["prefill_mfu"]),
                        report.pct(row["window_mfu"]), report.pct(row["cpu_share"]),
                        report.pct(row["mfu_per_cpu_s"]),
                        f"{row['comm_bytes_per_chip'] / 2**20:.1f} MiB",
                        next((f"{s['ratio']:.2f}x (fastest {s['ratio_fastest']:.2f}x)" for s in r["sharded"]
                              if s["ffn"] == row["ffn"] and s["tokens"] == row["tokens"]
                              and row["chips"] == 8), "")]
                       for row in r["prefill_rows"]]),
        "",
        "## Decode step against its memory bound ((weights + KV cache) / read bandwidth)",
        "",
        *report.table(["chips", "FFN", "batch", "step", "bound", "ratio", "collectives/step",
                       "weight matmuls alone", "their streaming rate"],
                      [[_chips_label(d), d["ffn"], d["batch"], report.ms(d["decode_step_s"]),
                        report.ms(d["memory_bound_s"]), f"{d['ratio_to_bound']:.2f}x", d["collective_ops"],
                        report.ms(d["matvec_only_s"]) if d["matvec_only_s"] else "",
                        f"{d['matvec_bandwidth'] / 1e9:.1f} GB/s" if d["matvec_bandwidth"] else ""]
                       for d in r["decode"]]),
        "",
        "## Why (profile)",
        "",
        "Single-chip prefill, largest batch:",
        f"- the weight matmuls alone take {report.pct(p.get('matmul_share'))} of its wall time "
        f"({report.pct(p.get('matmul_share_cpu'))} of its CPU time); the rest is attention, RoPE, "
        "norms and GELU in f32;",
        f"- those matmuls ([{p.get('tokens')} x E] x [E x F] and the others) run at "
        f"{report.pct(p.get('matmul_shape_efficiency'))} of one core's best square-matmul rate per "
        "CPU-second: their shapes, not the engine, cap the MFU near that figure;",
        f"- the FLOP count (docs/architecture.md) charges the unembedding for every prompt token, the engine "
        f"computes it for the last position only: {report.pct(p.get('flops_counted_not_computed'))} "
        "of the counted FLOPs are never executed.",
        "",
        "8 chips against 1 (largest batch; the 1-chip time measured in the same process right "
        "before): on an emulated mesh the interconnect is host memory, "
        "and the collectives are copies made by the same cores that run the matmuls, so "
        "communication adds to compute instead of overlapping it; each virtual chip's matmuls are "
        "also 1/8 the size. Time above one chip against the collective bytes of all chips at the "
        "host's copy bandwidth:",
        "",
        *report.table(["layout", "8 chips", "1 chip", "extra", "all chips' collective bytes / copy bandwidth"],
                      [[s["ffn"], report.ms(s["prefill_s"]), report.ms(s["single_chip_s"]),
                        report.ms(s["extra_s"]), report.ms(s["comm_copy_s"])] for s in largest]),
        "",
        "Decode:",
    ]
    if 1 in decode1 and decode1[1].get("matvec_only_s"):
        d1 = decode1[1]
        two = d1.get("matvec_two_rows_s")
        lines.append(f"- batch 1: the weight matmuls alone take {report.ms(d1['matvec_only_s'])} "
                     f"({d1['matvec_bandwidth'] / 1e9:.1f} GB/s): XLA CPU's bf16 x bf16 -> f32 dot with "
                     "ONE row takes a slow path; the same matmuls with 2 rows take "
                     f"{report.ms(two)}" + (f" ({d1['matvec_only_s'] / two:.1f}x faster)" if two else "")
                     + ": padding a 1-row matmul to 2 rows is the engine fix (docs/performance.md, \"Why decode is above its memory bound\");")
    for batch, d in sorted(decode1.items()):
        if batch > 1 and d.get("matvec_only_s"):
            lines.append(f"- batch {batch}: the weight matmuls alone take {report.ms(d['matvec_only_s'])}, "
                         f"streaming weights at {d['matvec_bandwidth'] / 1e9:.1f} GB/s against "
                         f"{h['hbm_bandwidth'] / 1e9:.1f} GB/s for a plain reduction: XLA CPU's "
                         "small-batch dot kernel, not the engine, sets this ratio;")
    lines += ["- 8 chips: every collective is a rendezvous of 8 virtual devices' threads on the "
              "host's cores:", *_decode_explanations(r), ""]
    lines += _variant_lines(decode1)
    lines += _small_row_lines(r.get("small_row_matmul"))
    return "\n".join(lines)


def _small_row_lines(s: dict | None) -> list[str]:
    """The small-row matmul formulations: GB/s of weight bytes (x the reduction's time)."""
    if not s:
        return []
    lines = ["## Small-row matmuls: formulations against a reduction over the same bytes", "",
             f"{SMALL_ROW_COPIES} distinct bf16 weights a call ({SMALL_ROW_COPIES} x 8 MiB, more "
             "than the L3), x [rows, in] bf16, f32 accumulation, bf16 result; every formulation "
             "and the reduction compiled in one process and timed round-robin; each cell: weight "
             "bytes per second (median of the rounds) and, in brackets, time / the reduction's "
             "time in the same rounds. `max diff` = the largest |difference| from today's output "
             "over its largest |value| (a bf16 value's rounding step is 0.4% to 0.8% of it). "
             "(docs/performance.md, \"Why decode is above its memory bound\")", ""]
    for key, label in (("one_core", "one core (taskset)"), ("all_cores", "every core, as the engine runs")):
        run = s.get(key)
        if not run:
            continue
        lines += [f"### {label}: CPUs {run['cpus']}, {run['rounds']} rounds, load average "
                  f"{run['load_average']} at the end", ""]
        # the shapes and row counts the run timed, in its order
        shapes = list(dict.fromkeys(tuple(x["shape"]) for x in run["rows"]))
        counts = sorted({x["rows"] for x in run["rows"] if x["rows"]})
        for shape in shapes:
            cells = [x for x in run["rows"] if tuple(x["shape"]) == shape]
            reduce = next(x for x in cells if x["rows"] == 0)
            names = list(dict.fromkeys(x["formulation"] for x in cells if x["rows"]))
            table_rows = [[f"reduction over the same bytes: {reduce['bandwidth'] / 1e9:.1f} GB/s",
                           *[""] * len(counts), ""]]
            for name in names:
                row = [name]
                diffs = []
                for rows in counts:
                    x = next((c for c in cells if c["rows"] == rows and c["formulation"] == name), None)
                    row.append(f"{x['bandwidth'] / 1e9:.1f} ({x['ratio_to_reduce']:.2f}x)" if x else "")
                    if x and x["max_rel_diff"] is not None:
                        diffs.append(x["max_rel_diff"])
                row.append(f"{100 * max(diffs):.2f}%" if diffs else "")
                table_rows.append(row)
            lines += [f"weight [{shape[0]}, {shape[1]}] ({reduce['weight']}):", "",
                      *report.table(["formulation", *[f"{r} row{'s' if r > 1 else ''}" for r in counts],
                                     "max diff"], table_rows), ""]
    return lines


_VARIANT_LABELS = {"as_run": "as run (engine.decode_loop: decode, then the greedy argmax, two dispatches a step)",
                   "decode_only": "decode program alone (argmax dropped)",
                   "fused": "decode and argmax in one program (one dispatch a step)",
                   "one_program": "all steps in one program (jitted fori_loop, no per-step dispatch)",
                   "stream": "reading the step's bytes alone (weights + KV cache, one jitted reduction)"}


def _variant_lines(decode1: dict) -> list[str]:
    """The one-chip greedy loop written four ways, timed round-robin in one process."""
    rows, facts = [], []
    for batch, d in sorted(decode1.items()):
        v = d.get("variants")
        if not v:
            continue
        for name, label in _VARIANT_LABELS.items():
            x = v["variants"][name]
            rows.append([batch, label, report.ms(x["median_s"]),
                         f"{report.ms(x['min_s'])} to {report.ms(x['max_s'])}", x["n"],
                         f"{x['ratio_to_bound']:.2f}x", f"{x['ratio_to_stream']:.2f}x"])
        facts.append(f"- batch {batch}: {v['steps']} steps a loop, {v['rounds']} rounds; reading the step's "
                     f"{v['bytes_read'] / 2**20:.1f} MiB ran at {v['stream_bandwidth'] / 1e9:.1f} GB/s in these rounds; KV cache updated "
                     f"in place (donated, aliased to the output): {'yes' if v['cache_aliased'] else 'NO'}; "
                     f"f32 converts of weight-sized arrays in the compiled step: {v['f32_weight_converts']}; "
                     f"load average {v['load_average']}")
        if batch > 1 and d.get("matvec_only_s"):
            facts.append(f"  - the step's weight matmuls alone (XLA CPU's small-batch dot, timed above): "
                         f"{report.ms(d['matvec_only_s'])}, {d['matvec_only_s'] / d['memory_bound_s']:.2f}x "
                         "the bound by themselves")
    if not rows:
        return []
    return ["## Decode step: what the engine adds (one chip, side by side)", "",
            "The same greedy loop, timed round-robin in one process (per step: median, range, "
            "number of loops; ratio = median / memory bound, from the host profile's read bandwidth; "
            "the last column divides by the last row, the same bytes read in the same rounds, "
            "which moves with the load as the steps do). What separates these rows is what "
            "the engine's loop adds; what remains in the fastest is the compiled step itself, "
            "whose weight matmuls alone are timed above.", "",
            *report.table(["batch", "loop", "step", "range", "loops", "ratio to bound",
                           "ratio to reading its bytes (same rounds)"], rows), "",
            *facts, ""]


def doc_block(r: dict) -> str:
    """docs/performance.md's block: the targets with the measured values."""
    single = {row["tokens"]: row["prefill_mfu"] for row in r["prefill_rows"]
              if row["chips"] == 1 and row["process_devices"] == 1}
    largest = max(row["tokens"] for row in r["sharded"])
    ratios = ", ".join(f"{row['ffn']} {report.x(row['ratio'])}" for row in
                       sorted((s for s in r["sharded"] if s["tokens"] == largest), key=lambda s: s["ratio"]))
    dec = {(d["batch"], d["chips"], d["ffn"]): d["ratio_to_bound"] for d in r["decode"]
           if d["process_devices"] == d["chips"] or d["chips"] > 1}
    dec_text = "; ".join(f"batch {b}, {c} chip{'s' if c > 1 else ''} {f}: {report.x(v)}"
                         for (b, c, f), v in sorted(dec.items()))
    return report.lines([
        f"**Engine efficiency** (`benchmarks/engine_efficiency.py`, model `{r['model']['name']}`, run of "
        f"{r['context']['time']}, {report.load_text(r)}):",
        "",
        *report.table(["target", "measured", "verdict"], [
            [f"single-chip prefill MFU ≥ {report.pct(r['targets']['single_chip_prefill_mfu_min'], 0)} of host peak",
             "; ".join(f"{report.pct(v)} at {t} tokens" for t, v in sorted(single.items()))
             + f" (per CPU-second {report.pct(r['single_chip_prefill_mfu_per_cpu_s'])} at the largest)",
             report.met(r["meets_prefill_target"])],
            [f"8 emulated chips within {r['targets']['sharded_over_single_max']}× of 1 chip ({largest} tokens)",
             ratios, report.met(r["meets_sharded_target"])],
            [f"decode step within {r['targets']['decode_over_memory_bound_max']}× of its memory bound",
             f"{report.x(r['best_decode_ratio'])} to {report.x(r['worst_decode_ratio'])} ({dec_text})",
             report.met(r["meets_decode_target"])],
        ]),
    ])


def summary_rows(eng: dict) -> list[list]:
    """benchmarks/results/summary.md's rows: each target with its measured value."""
    return [
        ["engine", f"single-chip large-batch prefill MFU >= {report.pct(eng['targets']['single_chip_prefill_mfu_min'], 0)} of host peak",
         f"{report.pct(eng['single_chip_prefill_mfu'])} (per CPU-second: "
         f"{report.pct(eng['single_chip_prefill_mfu_per_cpu_s'])})", report.met(eng["meets_prefill_target"])],
        ["engine", f"8 emulated chips within {eng['targets']['sharded_over_single_max']}x of 1 chip (prefill, same work)",
         f"{eng['best_sharded_ratio_largest']:.2f}x to {eng['worst_sharded_ratio_largest']:.2f}x",
         report.met(eng["meets_sharded_target"])],
        ["engine", f"decode step within {eng['targets']['decode_over_memory_bound_max']}x of its memory bound",
         f"{eng['best_decode_ratio']:.2f}x to {eng['worst_decode_ratio']:.2f}x", report.met(eng["meets_decode_target"])],
    ]
