"""Benchmark: how close does the engine get to this host's peak?

    python -m benchmarks.engine_efficiency [--quick] [--small-row-matmul] [--out DIR]

Anchor: the paper's 76% prefill MFU (PaLM 540B, §4). Targets (issue 7):
- single-chip large-batch prefill >= 70% of the host's measured peak;
- every FFN layout on 8 emulated chips within 1.3x of the single-chip prefill time for the
  same work (same model, batch and prompt);
- decode step within 2x of its memory bound: (weight + KV-cache bytes) / host bandwidth.

Each mesh size runs in its own process (the virtual device count is fixed when JAX starts:
`--xla_force_host_platform_device_count=N`), one after the other in one run. Prefill MFU is
`run_trial`'s (model FLOPs / (n x peak per chip x median prefill_s)) against the `host`
profile (`workloads/hostprofile.py`). Beside it, to tell engine inefficiency from a busy
machine, each prefill is run a few more times while this process's CPU time is counted:
- cpu_share = CPU seconds / (wall seconds x host cores): how much of the host it got;
- mfu_per_cpu_s = FLOPs / (CPU seconds x one core's peak): efficiency per core-second it
  did get (independent of other jobs; XLA's spinning worker threads count as busy);
and the largest single-chip prefill is profiled: the same matmuls alone (`matmul_share`:
the part of the prefill spent in matmuls; `matmul_shape_efficiency`: their rate against the
best square matmul). Decode is profiled the same way: its weight matmuls alone
(`matmul_bandwidth`: bytes streamed per second by XLA CPU's small-batch dot).
Last, the small-row matmul formulations (`small_row_matmul`): the engine's bf16 dot against
other ways to write it (weight stored transposed, multiply-and-reduce, XLA CPU library
options) at 1 to 128 rows, beside a reduction over the same bytes, on one core and on every
core (docs/performance.md, "Why decode is above its memory bound"); `--small-row-matmul`
runs only these and merges them into the existing results files.
Everything is a wall time of this host (emulated mesh), labelled so.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import common, harness

NAME = "engine_efficiency"
TARGET_PREFILL_MFU = 0.70
TARGET_SHARDED_RATIO = 1.3
TARGET_DECODE_RATIO = 2.0
FFN_LAYOUTS = ("ws1d", "ws2d", "wg_x", "wg_xy", "wg_xyz")
MESH_8 = (2, 2, 2)
# E 1024, F 4096, 2 layers, 8 query heads of 128, one KV head (multiquery), vocab 256:
# matmuls large enough for the CPU's dot kernels, 43 MB of bf16 weights (more than the
# 32 MB L3, so decode streams them from memory), and the unembedding (which the FLOP
# count charges every prefill token, but the engine computes for the last one only) is
# 1.2% of the matmul parameters.
BENCH_MODEL = {"name": "bench-1k", "d_model": 1024, "d_ff": 4096, "n_layers": 2, "n_heads": 8,
               "n_kv_heads": 1, "d_head": 128, "vocab": 256, "block": "parallel", "mlp": "gelu",
               "tie_embeddings": True}
BATCH = 8
PROMPTS = (16, 64, 256)              # tokens per batch 128, 512, 2048
DECODE_BATCHES = (1, 8)
DECODE_PROMPT, DECODE_STEPS = 128, 8
CPU_REPEATS = 3


# ------------------------------------------------------------ small-row matmul formulations

SMALL_ROWS = (1, 2, 4, 8, 16)
SMALL_ROW_SHAPES = ((1024, 4096), (4096, 1024))   # bench-1k's W_in [E, F] and W_out [F, E]
SMALL_ROW_COPIES = 8          # distinct weights a call: 67 MB of bf16, more than the 32 MB L3
SMALL_ROW_ROUNDS = 15
PREFILL_ROWS = (32, 128)      # prefill-sized: 128 = the smallest prefill here (16 tokens x batch 8)
# ynn_fusion_type INVALID switches XLA CPU's default library fusion for this dot off (it
# then converts both operands to f32); onednn_fusion_type DOT hands that dot to oneDNN.
_YNN_OFF = {"xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_INVALID"}
SMALL_ROW_OPTIONS = {"": {}, "ynn_off": _YNN_OFF,
                     "onednn": {**_YNN_OFF, "xla_cpu_use_onednn": True,
                                "xla_cpu_experimental_onednn_fusion_type": "LIBRARY_FUSION_TYPE_DOT"}}


def _small_row_formulations():
    """id -> (label, fn(x [rows, in], w), weight stored transposed [out, in]?, compiler
    options, row counts it is timed at). Every one takes bf16 inputs, accumulates in f32 and casts the
    result to bf16, as `partitioning.matmul` does."""
    import jax.numpy as jnp
    from jax import lax

    f32, bf16 = jnp.float32, jnp.bfloat16

    def dot(x, w):          # partitioning.matmul today (rows >= 2)
        return jnp.einsum("ti,io->to", x, w, preferred_element_type=f32).astype(bf16)

    def dot_pad2(x, w):     # partitioning.matmul today for one row: padded to two
        return dot(jnp.pad(x, ((0, 1), (0, 0))), w)[:1]

    def dot_t(x, wt):       # weight stored [out, in]: contract on its minor dim
        return jnp.einsum("ti,oi->to", x, wt, preferred_element_type=f32).astype(bf16)

    def dot_t_pad2(x, wt):
        return dot_t(jnp.pad(x, ((0, 1), (0, 0))), wt)[:1]

    def mul_reduce(x, w):   # sum over the weight's major dim, in f32
        return (x.astype(f32)[:, :, None] * w.astype(f32)[None]).sum(1).astype(bf16)

    def mul_reduce_t(x, wt):  # the same along the weight's contiguous dim
        return (x.astype(f32)[:, None, :] * wt.astype(f32)[None]).sum(-1).astype(bf16)

    def x_f32(x, w):        # only x converted: an f32 x bf16 dot
        return lax.dot_general(x.astype(f32), w, (((1,), (0,)), ((), ())),
                               preferred_element_type=f32).astype(bf16)

    decode, several = (1, 8), tuple(r for r in SMALL_ROWS if r > 1)
    # the multiply-reduce forms at one row ran at 0.1 GB/s or less in a first screen (one
    # call 1 s or more), and the f32 paths at 0.6 GB/s or less at every row count: they are
    # timed at fewer row counts so that the rounds stay short
    forms = {"dot": ("dot (today)", dot, False, {}, several + PREFILL_ROWS),
             "dot_pad2": ("dot, 1 row padded to 2 (today)", dot_pad2, False, {}, (1,)),
             "dot_one_row": ("dot, 1 row unpadded", dot, False, {}, (1,)),
             "dot_t": ("dot, weight stored [out, in]", dot_t, True, {}, several + PREFILL_ROWS),
             "dot_t_pad2": ("dot, weight stored [out, in], 1 row padded to 2", dot_t_pad2, True, {}, (1,)),
             "dot_t_one_row": ("dot, weight stored [out, in], 1 row unpadded", dot_t, True, {}, (1,)),
             "mul_reduce": ("multiply-reduce in f32", mul_reduce, False, {}, several),
             "mul_reduce_t": ("multiply-reduce in f32, weight stored [out, in]", mul_reduce_t, True, {},
                              several),
             "x_f32": ("x converted to f32 only", x_f32, False, {}, decode)}
    for label, options in SMALL_ROW_OPTIONS.items():
        if options:
            forms[f"dot_{label}"] = (f"dot, XLA option: {label}", dot, False, options, decode)
    return forms


def small_row_matmul(rounds: int = SMALL_ROW_ROUNDS) -> dict:
    """GB/s of weight bytes each formulation of a small-row bf16 matmul reaches, for each of
    SMALL_ROW_SHAPES and SMALL_ROWS, round-robin in this process next to one jitted
    reduction over the same weights (the same bytes, read once): median of `rounds`.
    `max_rel_diff`: max |out - today's out| / max |today's out|, both bf16."""
    import statistics

    import jax
    import jax.numpy as jnp

    forms = _small_row_formulations()
    programs, reference, reduce_fns, weights = {}, {}, {}, {}
    for e, f in SMALL_ROW_SHAPES:
        ws = [jax.random.normal(jax.random.key(i), (e, f), jnp.bfloat16) for i in range(SMALL_ROW_COPIES)]
        wts = [jnp.asarray(w.T) for w in ws]
        weights[(e, f)] = (ws, wts)
        reduce_fns[(e, f)] = jax.jit(lambda ws: sum(jnp.sum(w.astype(jnp.float32)) for w in ws))
        for rows in SMALL_ROWS + PREFILL_ROWS:
            xs = [jax.random.normal(jax.random.key(100 + i), (rows, e), jnp.bfloat16)
                  for i in range(SMALL_ROW_COPIES)]
            for name, (_, fn, transposed, options, applies) in forms.items():
                if rows not in applies:
                    continue
                w_args = wts if transposed else ws
                compiled = jax.jit(lambda xs, ws, fn=fn: [fn(x, w) for x, w in zip(xs, ws)]) \
                    .lower(xs, w_args).compile(compiler_options=options or None)
                out = jnp.stack(compiled(xs, w_args)).astype(jnp.float32)
                if name in ("dot", "dot_pad2"):
                    reference[(e, f, rows)] = out
                programs[(e, f, rows, name)] = (compiled, xs, w_args, out)
    for (e, f) in SMALL_ROW_SHAPES:
        jax.block_until_ready(reduce_fns[(e, f)](weights[(e, f)][0]))
    samples: dict = {key: [] for key in programs}
    samples.update({("reduce", e, f): [] for e, f in SMALL_ROW_SHAPES})
    for _ in range(rounds):
        for (e, f) in SMALL_ROW_SHAPES:
            t0 = time.perf_counter()
            jax.block_until_ready(reduce_fns[(e, f)](weights[(e, f)][0]))
            samples[("reduce", e, f)].append(time.perf_counter() - t0)
        for key, (compiled, xs, w_args, _) in programs.items():
            t0 = time.perf_counter()
            jax.block_until_ready(compiled(xs, w_args))
            samples[key].append(time.perf_counter() - t0)
    rows_out = []
    for (e, f) in SMALL_ROW_SHAPES:
        nbytes = e * f * 2 * SMALL_ROW_COPIES
        reduce_s = statistics.median(samples[("reduce", e, f)])
        weight = "w_in" if (e, f) == SMALL_ROW_SHAPES[0] else "w_out"
        rows_out.append({"shape": [e, f], "weight": weight, "rows": 0, "form": "reduce",
                         "formulation": "reduction over the same bytes",
                         "median_s": reduce_s, "bandwidth": nbytes / reduce_s, "n": rounds,
                         "ratio_to_reduce": 1.0, "max_rel_diff": None})
        order = list(forms)
        for (e2, f2, rows, name), (_, _, _, out) in sorted(programs.items(),
                                                           key=lambda kv: (order.index(kv[0][3]), kv[0][2])):
            if (e2, f2) != (e, f):
                continue
            median_s = statistics.median(samples[(e, f, rows, name)])
            ref = reference[(e, f, rows)]
            rows_out.append({"shape": [e, f], "weight": weight, "rows": rows, "form": name,
                             "formulation": forms[name][0], "median_s": median_s,
                             "bandwidth": nbytes / median_s, "n": rounds,
                             "ratio_to_reduce": median_s / reduce_s,
                             "max_rel_diff": float(jnp.max(jnp.abs(out - ref)) / jnp.max(jnp.abs(ref)))})
    return {"rows": rows_out, "copies": SMALL_ROW_COPIES, "rounds": rounds,
            "cpus": sorted(os.sched_getaffinity(0)), "load_average": common.load_average()}


def run_small_row_child(one_core: bool) -> dict:
    """small_row_matmul in a fresh process: pinned to one core (XLA sizes its thread pool to
    the process's CPUs) or on every core, as the engine runs."""
    cpus = sorted(os.sched_getaffinity(0))
    prefix = ["taskset", "-c", str(cpus[-1])] if one_core else []
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "small_rows.json"
        cmd = prefix + [sys.executable, "-m", "benchmarks.engine_efficiency", "--child-small-rows",
                        "--child-out", str(out)]
        subprocess.run(cmd, env=env, check=True, cwd=Path(__file__).resolve().parents[1])
        return json.loads(out.read_text())


# ----------------------------------------------------------------------------- child side


def _cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system


def _timed_with_cpu(fn, repeats: int, min_total_s: float = 0.5) -> tuple[float, float]:
    """(wall, CPU) seconds per call of fn() (which blocks), over at least `repeats` calls
    and `min_total_s` of wall time (CPU time is counted in 10 ms ticks)."""
    calls, c0, w0 = 0, _cpu_seconds(), time.perf_counter()
    while calls < repeats or time.perf_counter() - w0 < min_total_s:
        fn()
        calls += 1
    return (time.perf_counter() - w0) / calls, (_cpu_seconds() - c0) / calls


def _trial(model, chips, topology, batch, input_len, decode_steps, prefill_ffn, decode_ffn):
    from workloads.layouts import PhaseLayout
    from workloads.trial import TrialConfig

    return TrialConfig(model, chips=chips, batch=batch, input_len=input_len,
                       decode_steps=decode_steps, topology=topology,
                       prefill=PhaseLayout(prefill_ffn, "head"),
                       decode=PhaseLayout(decode_ffn, "head"), repeats=3, warmup=1)


def matmul_only_s(model, tokens: int, repeats: int = 3) -> tuple[float, float, float]:
    """(wall s, CPU s, FLOPs) of the prefill's weight matmuls alone, as the engine writes
    them (bf16 x bf16 -> f32 -> bf16), for `tokens` rows: the part no layout can avoid."""
    import jax
    import jax.numpy as jnp

    e, f, h, k, d = model.d_model, model.d_ff, model.n_heads, model.n_kv_heads, model.d_head
    shapes = [(e, f), (f, e), (e, h * d), (e, 2 * k * d), (h * d, e)]
    key = jax.random.key(0)
    xs = {n: jax.random.normal(key, (tokens, n), jnp.bfloat16) for n in {s[0] for s in shapes}}
    ws = [jax.random.normal(key, s, jnp.bfloat16) for s in shapes]

    @jax.jit
    def layer(xs, ws):
        return [jnp.einsum("ti,io->to", xs[w.shape[0]], w, preferred_element_type=jnp.float32)
                .astype(jnp.bfloat16) for w in ws]

    jax.block_until_ready(layer(xs, ws))
    wall, cpu = _timed_with_cpu(lambda: jax.block_until_ready(layer(xs, ws)), repeats)
    flops = 2.0 * tokens * sum(a * b for a, b in shapes)
    return wall * model.n_layers, cpu * model.n_layers, flops * model.n_layers


def matvec_only_s(model, batch: int, repeats: int = 5) -> tuple[float, float]:
    """(wall s, weight bytes) of one decode step's weight matmuls alone at `batch` rows."""
    import jax
    import jax.numpy as jnp

    e, f, h, k, d = model.d_model, model.d_ff, model.n_heads, model.n_kv_heads, model.d_head
    shapes = [(e, f), (f, e), (e, h * d), (e, 2 * k * d), (h * d, e)] * model.n_layers
    key = jax.random.key(0)
    ws = [jax.random.normal(key, s, jnp.bfloat16) for s in shapes]
    xs = {n: jax.random.normal(key, (batch, n), jnp.bfloat16) for n in {s[0] for s in shapes}}

    @jax.jit
    def step(xs, ws):
        return [jnp.einsum("ti,io->to", xs[w.shape[0]], w, preferred_element_type=jnp.float32)
                for w in ws]

    jax.block_until_ready(step(xs, ws))
    wall, _ = _timed_with_cpu(lambda: jax.block_until_ready(step(xs, ws)), repeats)
    return wall, float(sum(a * b * 2 for a, b in shapes))


def decode_variants(engine, bound_s: float, rounds: int = 7) -> dict:
    """Where a one-chip decode step's time goes beyond streaming weights and KV cache: the
    same greedy loop (decode_steps steps, synchronised once at the end, as measure.py times
    it) written four ways, timed round-robin in one process so load hits them alike:
    `as_run` engine.decode_loop (decode and greedy argmax: two dispatches per step),
    `decode_only` the decode program alone (argmax dropped: what the extra dispatch costs),
    `fused` decode and argmax in one program (one dispatch per step), `one_program` every
    step in one jitted fori_loop (no per-step dispatch at all). Plus two facts read from
    the compiled decode program: the KV cache is updated in place (donated, aliased to the
    output) and how many f32 converts of weight-sized arrays (>= 1M elements) it holds."""
    import re
    import statistics

    import jax

    from workloads.engine import decode_loop

    params, positions, greedy = engine.params, engine.positions(), engine.greedy
    logits, cache = engine.prefill(params, engine.input_tokens())
    token = jax.block_until_ready(greedy(logits))
    step = engine._decode   # the jitted shard_map decode program (cache donated)
    fused = jax.jit(lambda p, c, t, pos: (lambda lg, c2: (greedy(lg), c2))(*step(p, c, t, pos)),
                    donate_argnums=1)

    def loop_program(p, c, t, pos0):
        def body(i, carry):
            c, t = carry
            lg, c = step(p, c, t, pos0 + i)
            return c, greedy(lg)
        return jax.lax.fori_loop(0, len(positions), body, (c, t))
    one_program = jax.jit(loop_program, donate_argnums=1)
    state = {"cache": cache}

    def as_run():
        d = decode_loop(engine.decode, greedy, params, state["cache"], token, positions)
        state["cache"] = jax.block_until_ready((d.cache, d.tokens[-1]))[0]

    def decode_only():
        c = state["cache"]
        for pos in positions:
            _, c = step(params, c, token, pos)
        state["cache"] = jax.block_until_ready(c)

    def fused_run():
        c, t = state["cache"], token
        for pos in positions:
            t, c = fused(params, c, t, pos)
        state["cache"] = jax.block_until_ready((c, t))[0]

    def one_program_run():
        c, t = one_program(params, state["cache"], token, positions[0])
        state["cache"] = jax.block_until_ready((c, t))[0]

    # The bound measured in the same rounds: one jitted reduction over exactly the bytes a
    # step must read (every weight and the KV cache), so load moves it with the variants.
    import jax.numpy as jnp

    read_all = jax.jit(lambda p, c: sum(jnp.sum(x.astype(jnp.float32)) for x in jax.tree.leaves(p))
                       + jnp.sum(c.astype(jnp.float32)))

    def stream():   # one step's bytes, repeated as many times as the loop has steps
        for _ in positions:
            out = read_all(params, state["cache"])
        jax.block_until_ready(out)

    variants = {"as_run": as_run, "decode_only": decode_only, "fused": fused_run,
                "one_program": one_program_run, "stream": stream}
    for fn in variants.values():     # compile and warm each
        fn()
    samples: dict = {name: [] for name in variants}
    for _ in range(rounds):
        for name, fn in variants.items():
            t0 = time.perf_counter()
            fn()
            samples[name].append((time.perf_counter() - t0) / len(positions))
    hlo = engine.lowered()["decode"].compile().as_text()
    big_f32 = [m for m in re.findall(r"= f32\[([0-9,]*)\][^ ]* convert\(", hlo)
               if m and math.prod(int(x) for x in m.split(",")) >= 1 << 20]
    stream_s = statistics.median(samples["stream"])
    out = {name: {"median_s": statistics.median(v), "min_s": min(v), "max_s": max(v),
                  "n": len(v), "ratio_to_bound": statistics.median(v) / bound_s,
                  "ratio_to_stream": statistics.median(v) / stream_s}
           for name, v in samples.items()}
    return {"variants": out, "steps": len(positions), "rounds": rounds, "stream_s": stream_s,
            "stream_bandwidth": (engine_bytes := sum(x.nbytes for x in jax.tree.leaves(params))
                                 + state["cache"].nbytes) / stream_s, "bytes_read": engine_bytes,
            "cache_aliased": "input_output_alias" in hlo.split("\n", 1)[0],
            "f32_weight_converts": len(big_f32), "load_average": common.load_average()}


def child_run(devices: int, quick: bool, profile_dict: dict) -> dict:
    """Runs in a process with `devices` virtual devices. With 1: the single-chip trials.
    With 8: each 8-chip trial right after a 1-chip reference of the same work in this same
    process (the first device alone), so each 8c/1c ratio is measured side by side, under
    the same load; the 1-device process gives the headline single-chip MFU."""
    import jax

    from workloads import costmodel
    from workloads.config import HardwareProfile, ModelConfig
    from workloads.measure import cache_key, run_trial

    assert jax.device_count() >= devices, (jax.device_count(), devices)
    model = ModelConfig(**BENCH_MODEL)
    host = HardwareProfile.from_dict(profile_dict)
    cores = os.cpu_count() or 1
    core_peak = host.peak_flops / cores
    # one chip: every FFN layout is the same program (collectives over size-1 axes are skipped)
    runs = [(1, "ws2d")] + ([(8, f) for f in FFN_LAYOUTS] if devices >= 8 else [])
    prompts = PROMPTS[-2:] if quick else PROMPTS
    cache: dict = {}
    rows = []
    for input_len in prompts:
        for chips, ffn in runs:
            topology = (1, 1, 1) if chips == 1 else MESH_8
            trial = _trial(model, chips, topology, BATCH, input_len, 0, ffn,
                           "ws1d" if ffn == "ws1d" else "ws2d")
            m = run_trial(trial, engine_cache=cache, hardware=host)
            entry = cache[cache_key(trial.resolved())]
            engine, prog = entry.engine, entry.compiled["prefill"]
            tokens = engine.input_tokens()
            wall, cpu = _timed_with_cpu(
                lambda: jax.block_until_ready(prog(engine.params, tokens)), CPU_REPEATS)
            flops = m.extra["prefill_flops"]
            rows.append({
                "phase": "prefill", "chips": chips, "process_devices": devices,
                "topology": "x".join(map(str, topology)),
                "ffn": ffn, "batch": BATCH, "input_len": input_len, "tokens": BATCH * input_len,
                "prefill_s": m.prefill_s, "prefill_s_min": m.prefill_s_min, "prefill_mfu": m.prefill_mfu,
                "flops": flops, "gflops_per_s": flops / m.prefill_s / 1e9,
                "cpu_timed_wall_s": wall, "cpu_s": cpu, "cpu_share": cpu / (wall * cores),
                "window_mfu": flops / (host.peak_flops * wall),
                "mfu_per_cpu_s": flops / (cpu * core_peak),
                "comm_bytes_per_chip": m.prefill_comm_bytes_per_chip,
                "compile_s": m.compile_s, "load_average": common.load_average()})
            print(f"  [{devices} devices] {chips} chip(s) {ffn:7s} tokens {BATCH * input_len:5d}: "
                  f"prefill {m.prefill_s * 1e3:8.1f} ms  MFU {m.prefill_mfu:6.1%}  per CPU-s "
                  f"{rows[-1]['mfu_per_cpu_s']:6.1%}  cpu share {rows[-1]['cpu_share']:5.1%}",
                  file=sys.stderr)
    profile = {}
    if devices == 1:   # where the time of the largest prefill goes
        tokens = BATCH * prompts[-1]
        mm_wall, mm_cpu, mm_flops = matmul_only_s(model, tokens)
        big = rows[-1]
        profile = {"tokens": tokens, "matmul_only_s": mm_wall, "matmul_only_cpu_s": mm_cpu,
                   "matmul_flops": mm_flops, "prefill_model_flops": big["flops"],
                   "matmul_share": mm_wall / big["prefill_s"],
                   "matmul_share_cpu": mm_cpu / big["cpu_s"],
                   "matmul_rate_per_cpu_s": mm_flops / mm_cpu,
                   "matmul_shape_efficiency": mm_flops / mm_cpu / core_peak,
                   "flops_counted_not_computed": (BATCH * prompts[-1] - BATCH) * 2.0
                   * model.vocab * model.d_model / big["flops"]}
    decode_runs = [(1, "ws2d")] + ([(8, "ws1d"), (8, "ws2d")] if devices >= 8 else [])
    decode_rows = []
    for batch in DECODE_BATCHES:
        for chips, ffn in decode_runs:
            topology = (1, 1, 1) if chips == 1 else MESH_8
            trial = _trial(model, chips, topology, batch, DECODE_PROMPT, DECODE_STEPS, ffn, ffn)
            m = run_trial(trial, engine_cache=cache, hardware=host)
            bytes_read = chips * (m.weight_bytes_per_chip + m.kv_bytes_per_chip)
            bound = bytes_read / host.hbm_bandwidth
            profiled = devices == 1
            mv_wall, mv_bytes = matvec_only_s(model, batch) if profiled else (None, None)
            mv2_wall = matvec_only_s(model, 2)[0] if profiled and batch == 1 else None
            ops = sum(c.count for c in m.collectives.get("decode", []))
            decode_rows.append({
                "phase": "decode", "chips": chips, "process_devices": devices,
                "topology": "x".join(map(str, topology)),
                "ffn": ffn, "attn": "head", "batch": batch, "context": DECODE_PROMPT + DECODE_STEPS,
                "decode_step_s": m.decode_step_s, "decode_step_s_min": m.decode_step_s_min,
                "weight_bytes": chips * m.weight_bytes_per_chip, "kv_bytes": chips * m.kv_bytes_per_chip,
                "memory_bound_s": bound, "ratio_to_bound": m.decode_step_s / bound,
                "collective_ops": ops, "decode_comm_bytes_per_chip": m.decode_comm_bytes_per_chip,
                "matvec_only_s": mv_wall,
                "matvec_bandwidth": mv_bytes / mv_wall if mv_wall else None,
                "matvec_two_rows_s": mv2_wall,
                "load_average": common.load_average()})
            if profiled:   # side by side: the loop as run against the loop without what the engine adds
                entry = cache[cache_key(trial.resolved())]
                decode_rows[-1]["variants"] = decode_variants(entry.engine, bound)
            print(f"  [{devices} devices] {chips} chip(s) decode {ffn} B={batch}: step "
                  f"{m.decode_step_s * 1e3:.2f} ms, bound {bound * 1e3:.2f} ms "
                  f"({m.decode_step_s / bound:.2f}x)", file=sys.stderr)
    return {"devices": devices, "prefill": rows, "decode": decode_rows, "profile": profile,
            "params": costmodel.param_count(model)}


# ----------------------------------------------------------------------------- parent side


def run_child(chips: int, quick: bool, profile: dict) -> dict:
    env = dict(os.environ)
    flags = [f for f in env.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]
    env["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={chips}"])
    env["JAX_PLATFORMS"] = "cpu"
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "child.json"
        cmd = [sys.executable, "-m", "benchmarks.engine_efficiency", "--child", str(chips),
               "--child-out", str(out), "--profile-json", json.dumps(profile)]
        if quick:
            cmd.append("--quick")
        root = Path(__file__).resolve().parents[1]
        subprocess.run(cmd, env=env, check=True, cwd=root)
        return json.loads(out.read_text())


def summarize(host: dict, notes: dict, results: dict[int, dict]) -> dict:
    single = {r["input_len"]: r for r in results[1]["prefill"]}
    largest = max(single)
    eight = results.get(8, {})
    # the 1-chip reference measured next to the 8-chip trials, in their process
    reference = {r["input_len"]: r for r in eight.get("prefill", []) if r["chips"] == 1}
    sharded = []
    for r in eight.get("prefill", []):
        base = reference.get(r["input_len"])
        if r["chips"] != 8 or base is None:
            continue
        sharded.append({**{k: r[k] for k in ("ffn", "chips", "tokens", "prefill_s", "prefill_s_min",
                                             "prefill_mfu", "mfu_per_cpu_s", "cpu_share",
                                             "comm_bytes_per_chip")},
                        "single_chip_s": base["prefill_s"], "ratio": r["prefill_s"] / base["prefill_s"],
                        "ratio_fastest": r["prefill_s_min"] / base["prefill_s_min"],
                        "extra_s": r["prefill_s"] - base["prefill_s"],
                        # the emulated interconnect is host memory: every chip's collective
                        # bytes copied by the same cores that run the matmuls
                        "comm_copy_s": r["chips"] * r["comm_bytes_per_chip"] / host["ici_bandwidth"]})
    big_sharded = [s for s in sharded if s["tokens"] == BATCH * largest]
    decode = results[1]["decode"] + eight.get("decode", [])
    top = single[largest]
    return {
        "targets": {"single_chip_prefill_mfu_min": TARGET_PREFILL_MFU,
                    "sharded_over_single_max": TARGET_SHARDED_RATIO,
                    "decode_over_memory_bound_max": TARGET_DECODE_RATIO},
        "single_chip_prefill_mfu": top["prefill_mfu"],
        "single_chip_prefill_mfu_fastest": top["prefill_mfu"] * top["prefill_s"] / top["prefill_s_min"],
        "single_chip_prefill_mfu_per_cpu_s": top["mfu_per_cpu_s"],
        "single_chip_cpu_share": top["cpu_share"],
        "meets_prefill_target": top["prefill_mfu"] >= TARGET_PREFILL_MFU,
        "sharded": sharded,
        "worst_sharded_ratio_largest": max((s["ratio"] for s in big_sharded), default=None),
        "best_sharded_ratio_largest": min((s["ratio"] for s in big_sharded), default=None),
        "meets_sharded_target": all(s["ratio"] <= TARGET_SHARDED_RATIO for s in big_sharded)
        if big_sharded else None,
        "decode": decode,
        "worst_decode_ratio": max(d["ratio_to_bound"] for d in decode),
        "best_decode_ratio": min(d["ratio_to_bound"] for d in decode),
        "meets_decode_target": all(d["ratio_to_bound"] <= TARGET_DECODE_RATIO for d in decode),
        "profile": results[1]["profile"],
        "host_profile": host, "host_profile_notes": notes,
        "prefill_rows": results[1]["prefill"] + eight.get("prefill", []),
    }


def headline(r: dict) -> dict:
    return {"single_chip_prefill_mfu": r["single_chip_prefill_mfu"],
            "single_chip_prefill_mfu_per_cpu_s": r["single_chip_prefill_mfu_per_cpu_s"],
            "worst_sharded_ratio": r["worst_sharded_ratio_largest"] or float("nan"),
            "best_sharded_ratio": r["best_sharded_ratio_largest"] or float("nan"),
            "worst_decode_ratio": r["worst_decode_ratio"],
            "host_peak_flops": r["host_profile"]["peak_flops"]}


def arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="two prompt lengths instead of three")
    parser.add_argument("--refresh-profile", action="store_true", help="measure the host peak again")
    parser.add_argument("--small-row-matmul", action="store_true",
                        help="only the small-row matmul formulations; merged into the existing results")


def run(args: argparse.Namespace, previous: dict | None) -> dict:
    if args.small_row_matmul:
        if previous is None:
            raise SystemExit(f"--small-row-matmul: no results file in {args.out} to merge into")
        return {**previous, "small_row_matmul": {"one_core": run_small_row_child(True),
                                                 "all_cores": run_small_row_child(False)}}
    from workloads import hostprofile

    start = time.perf_counter()
    context = common.machine_context()
    profile = hostprofile.host_profile(refresh=args.refresh_profile)
    notes = (hostprofile.cached_entry() or {}).get("notes", {})
    results = {}
    for chips in (1, 8):
        print(f"engine efficiency: {chips} emulated chip(s)", file=sys.stderr)
        results[chips] = run_child(chips, args.quick, profile.to_dict())
    summary = summarize(profile.to_dict(), notes, results)
    summary["small_row_matmul"] = {"one_core": run_small_row_child(True),
                                   "all_cores": run_small_row_child(False)}
    summary.update(context=context, context_end=common.machine_context(since=context),
                   elapsed_s=time.perf_counter() - start, model=BENCH_MODEL)
    return summary


BENCHMARK = harness.Benchmark(
    NAME, __doc__.splitlines()[0], run, arguments=arguments, metrics=headline, log=True,
    params=lambda args: {"model": BENCH_MODEL["name"], "batch": BATCH,
                         "load_average": common.load_average()})


def main(argv: list[str] | None = None) -> int:
    """The benchmark (harness.main), or one of its child processes: a mesh size's trials
    (`--child N`) or the small-row matmuls (`--child-small-rows`), each writing JSON."""
    child = argparse.ArgumentParser(add_help=False)
    child.add_argument("--child", type=int)
    child.add_argument("--child-small-rows", action="store_true")
    child.add_argument("--child-out")
    child.add_argument("--profile-json")
    child.add_argument("--quick", action="store_true")
    args, rest = child.parse_known_args(argv)
    if args.child_small_rows:
        Path(args.child_out).write_text(json.dumps(common.clean(small_row_matmul())))
        return 0
    if args.child:
        result = child_run(args.child, args.quick, json.loads(args.profile_json))
        Path(args.child_out).write_text(json.dumps(common.clean(result)))
        return 0
    return harness.main(BENCHMARK, argv)


if __name__ == "__main__":
    sys.exit(main())
