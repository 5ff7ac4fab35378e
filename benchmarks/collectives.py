"""Benchmark: how the emulated mesh runs an all-gather of several replica groups.

    python -m benchmarks.collectives [--rounds N] [--out DIR]

The calibration sweep's weight-gathered prefill of more than one gather group (wg_xy on
1x2x2 and 1x4x2: the gather over y runs once per z slice) costs about what ws2d costs,
which gathers no weights, while wg_xyz (one group over every device) pays what its bytes
predict (docs/calibration.md, "What is responsible for the prefill cells"). This benchmark
answers why, by measurement, in one process on an 8-device emulated mesh (it re-runs itself
with XLA_FLAGS=--xla_force_host_platform_device_count=8 when the flag is missing):

(a) an all-gather of the same per-device shard (bf16 768 x 384, as the engine's W_in shard
    of wg_xy/wg_xyz on 8 chips) in 1 group of 2, 2 of 2, 4 of 2, 1 of 4, 2 of 4, 1 of 8:
    alone; followed by the matmul that consumes it as the engine does (rows = 512 / g, the
    batch split over the gather axes, so every device does the same FLOPs); and that
    matmul alone on weights already gathered (no collective);
(b) the engine's own prefill programs of the calibration model (`calib`, batch 8, 64
    tokens, head-sharded attention) in wg_xy, wg_xyz and ws2d on 2, 4 and 8 chips (the
    sweep's topologies), with the collectives XLA compiled (from the optimized HLO:
    count, group size x groups, bytes per device, whether hoisted to the program start)
    beside the times, and the same layouts' FFN matmul shapes run alone on the mesh.

Every row of a part is timed interleaved with the others (round robin, `--rounds` rounds of
`--reps` calls, the median of a round's calls; the figure is the median over rounds and the
spread is the interquartile range over rounds), the process's CPU time per call beside it.
All times are host timings (emulated mesh on this machine), with the load average.
Writes benchmarks/results/collectives.{json,md}.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import numpy as np

from benchmarks import common, harness

NAME = "collectives"
DEVICES = 8
FLAG = f"--xla_force_host_platform_device_count={DEVICES}"
E, F_SHARD, TOKENS = 768, 384, 512        # shard E x F_SHARD per device; rows = TOKENS / g
GROUPINGS = ((1, 2), (2, 2), (4, 2), (1, 4), (2, 4), (1, 8))   # (groups, g): devices = groups * g
ENGINE_TOPOLOGIES = {2: (1, 2, 1), 4: (1, 2, 2), 8: (1, 4, 2)}  # search_spaces/calibration.yaml
ENGINE_LAYOUTS = ("wg_xy", "wg_xyz", "ws2d")
MICRO_VARIANTS = ("gather", "gather+matmul", "matmul", "2 gathers+2 matmuls", "2 matmuls")


# --------------------------------------------------------------------------- timing


def interleaved(calls: dict, rounds: int, reps: int) -> dict:
    """{name: fn} -> {name: {median_s, iqr_s, cpu_s_per_call, rounds}}, round robin."""
    import jax

    for fn in calls.values():                         # warm up (and compile) each once
        jax.block_until_ready(fn())
    walls = {k: [] for k in calls}
    cpus = {k: [] for k in calls}
    for _ in range(rounds):
        for name, fn in calls.items():
            samples = []
            cpu0 = time.process_time()
            for _ in range(reps):
                t0 = time.perf_counter()
                jax.block_until_ready(fn())
                samples.append(time.perf_counter() - t0)
            cpus[name].append((time.process_time() - cpu0) / reps)
            walls[name].append(float(np.median(samples)))
    out = {}
    for name in calls:
        w = np.array(walls[name])
        q1, q3 = np.percentile(w, [25, 75])
        out[name] = {"median_s": float(np.median(w)), "iqr_s": float(q3 - q1),
                     "cpu_s_per_call": float(np.median(cpus[name])), "rounds": rounds,
                     "reps": reps}
    return out


# --------------------------------------------------------------------------- (a) micro


def micro_calls(groups: int, g: int):
    """(gather, gather+matmul, matmul) callables on a (groups, g) mesh of the first
    groups*g devices, gathering over the axis of size g."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    n = groups * g
    mesh = Mesh(np.array(jax.devices()[:n]).reshape(groups, g), ("a", "b"))
    rows = TOKENS // g
    rng = np.random.default_rng(0)
    shards = jnp.asarray(rng.standard_normal((n * E, F_SHARD), np.float32), jnp.bfloat16)
    gathered = jnp.asarray(rng.standard_normal((n * E, F_SHARD * g), np.float32), jnp.bfloat16)
    x = jnp.asarray(rng.standard_normal((n * rows, E), np.float32), jnp.bfloat16)
    spec = P(("a", "b"), None)
    shards, gathered, x = (jax.device_put(a, NamedSharding(mesh, spec)) for a in (shards, gathered, x))

    def gather(w):                       # [E, F] -> [E, g*F], as partitioning.gathered_weight
        full = jax.lax.all_gather(w, "b", axis=0, tiled=False)        # [g, E, F]
        return full.transpose(1, 0, 2).reshape(E, g * F_SHARD)

    def matmul(h, w):                    # as partitioning.matmul
        return jnp.einsum("ri,io->ro", h, w, preferred_element_type=jnp.float32).astype(jnp.bfloat16)

    def smap(body, n_in):
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec,) * n_in, out_specs=spec))

    only_gather = smap(gather, 1)
    gather_matmul = smap(lambda h, w: matmul(h, gather(w)), 2)
    only_matmul = smap(matmul, 2)
    # two weights, as a layer's W_in and W_out: both gathers are issued at the start, the
    # second can run while the first matmul does
    two_gather_matmul = smap(lambda h, w: matmul(h, gather(w)) + matmul(h, gather(w * 2)), 2)
    two_matmul = smap(lambda h, w: matmul(h, w) + matmul(h, w * 2), 2)
    hlo = only_gather.lower(shards).compile().as_text()
    return ({"gather": lambda: only_gather(shards),
             "gather+matmul": lambda: gather_matmul(x, shards),
             "matmul": lambda: only_matmul(x, gathered),
             "2 gathers+2 matmuls": lambda: two_gather_matmul(x, shards),
             "2 matmuls": lambda: two_matmul(x, gathered)}, hlo, rows)


def part_a(rounds: int, reps: int) -> list[dict]:
    from workloads import hlo as hlo_mod

    calls, meta = {}, {}
    for groups, g in GROUPINGS:
        fns, text, rows = micro_calls(groups, g)
        ops = hlo_mod.collective_ops(text, (groups, g))
        key = f"{groups}x{g}"
        meta[key] = {"groups": groups, "group_size": g, "devices": groups * g, "rows": rows,
                     "gather_bytes_per_device": sum(op.nbytes for op in ops),
                     "gather_dtype": ",".join(sorted({op.dtype for op in ops})),
                     "hlo_groups": [op.groups for op in ops]}
        for variant, fn in fns.items():
            calls[(key, variant)] = fn
    times = interleaved(calls, rounds, reps)
    rows = []
    for key, m in meta.items():
        row = dict(m, config=key)
        for variant in MICRO_VARIANTS:
            row[variant] = times[(key, variant)]
        rows.append(row)
    return rows


# --------------------------------------------------------------------------- (b) engine


def engine_trial(chips: int, ffn: str):
    from workloads.trial import TrialConfig

    return TrialConfig.from_dict({
        "model": "calib", "chips": chips, "topology": list(ENGINE_TOPOLOGIES[chips]),
        "batch": 8, "input_len": 64, "decode_steps": 8,
        "prefill": {"ffn": ffn, "attn": "head"}, "decode": {"ffn": "ws2d", "attn": "head"}})


def hoisted_collectives(hlo_text: str) -> int:
    """How many collectives of the ENTRY computation come before its first dot fusion:
    issued at the program's start (they depend on parameters only)."""
    entry = hlo_text[hlo_text.index("\nENTRY"):]
    count = 0
    for line in entry.splitlines()[1:]:
        if "all-gather(" in line or "reduce-scatter(" in line or "all-reduce(" in line:
            count += 1
        elif "dot_general" in line or " dot(" in line:
            break
    return count


def without_weight_gathers(entry):
    """The trial's prefill compiled again with every weight all-gather (Fig. A.2's AG_G in
    `partitioning.gathered_weight`) replaced by a local broadcast of the shard to the
    gathered shape: the same program, the same shapes and matmuls after it, no collective.
    Its time against the real prefill's is what the gathers cost inside the program."""
    import contextlib

    import jax.numpy as jnp

    from workloads import engine as engine_mod
    from workloads import partitioning as part

    inside = {"weight": False}
    real_gather, real_gathered_weight = part.all_gather, part.gathered_weight

    def all_gather(plan, x, axes, axis, tiled=True):
        if not inside["weight"] or tiled or not plan.live(axes):
            return real_gather(plan, x, axes, axis, tiled)
        n = plan.size(plan.live(axes))
        return jnp.broadcast_to(jnp.expand_dims(x, axis), x.shape[:axis] + (n,) + x.shape[axis:])

    def gathered_weight(plan, leaf, name):
        inside["weight"] = True
        try:
            return real_gathered_weight(plan, leaf, name)
        finally:
            inside["weight"] = False

    @contextlib.contextmanager
    def patched():
        part.all_gather, part.gathered_weight = all_gather, gathered_weight
        try:
            yield
        finally:
            part.all_gather, part.gathered_weight = real_gather, real_gathered_weight

    eng = entry.engine
    t = eng.trial
    shapes = engine_mod._Shapes(t.batch, t.input_len, t.context_len)
    with patched():
        prefill = engine_mod._programs.__wrapped__(entry.mesh, eng.prefill_plan, eng.decode_plan,
                                                   shapes, t.weights == "int8")[0]
        params, tokens, _ = entry.inputs
        return prefill.lower(params, tokens).compile()


def ffn_matmul_shape(chips: int, ffn: str) -> tuple[int, int, int]:
    """(rows, E, F columns) of one FFN input matmul per device (docs/architecture.md; paper
    §3.2): ws2d keeps every token and splits F over y*z; wg_* split the batch over the
    gather axes G and F over the rest R."""
    x, y, z = ENGINE_TOPOLOGIES[chips]
    ffn_width = 3072
    gathered = {"ws2d": 1, "wg_xy": x * y, "wg_xyz": x * y * z}[ffn]
    return TOKENS // gathered, E, ffn_width * gathered // chips


def part_b(rounds: int, reps: int) -> list[dict]:
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from workloads import hlo as hlo_mod
    from workloads.engine import make_mesh
    from workloads.measure import analyse, compile_trial, run_inputs

    calls, meta = {}, {}
    rng = np.random.default_rng(0)
    for chips in ENGINE_TOPOLOGIES:
        for ffn in ENGINE_LAYOUTS:
            entry, _ = compile_trial(engine_trial(chips, ffn))
            params, tokens, _ = run_inputs(entry)
            prog = entry.compiled["prefill"]
            text = prog.as_text()
            ops = analyse(entry, ENGINE_TOPOLOGIES[chips])["collective_ops"]["prefill"]
            weight_gathers = [op for op in ops if op.from_parameter is not None]
            meta[(chips, ffn)] = {
                "chips": chips, "topology": "x".join(map(str, ENGINE_TOPOLOGIES[chips])),
                "layout": ffn, "collectives": len(ops),
                "comm_bytes_per_device": hlo_mod.comm_bytes(ops),
                "weight_gathers": len(weight_gathers),
                "weight_gather_bytes_per_device": sum(op.total_bytes for op in weight_gathers),
                "weight_gather_shape": sorted({f"{op.group_size} x {len(op.groups)}"
                                               for op in weight_gathers}),
                "hoisted_to_start": hoisted_collectives(text),
                "ffn_matmul": ffn_matmul_shape(chips, ffn)}
            calls[("prefill", chips, ffn)] = (lambda p=prog, a=params, t=tokens: p(a, t))
            if weight_gathers:
                bare = without_weight_gathers(entry)
                left = hlo_mod.collective_ops(bare.as_text(), ENGINE_TOPOLOGIES[chips])
                meta[(chips, ffn)]["collectives_without_weight_gathers"] = len(left)
                calls[("no weight gathers", chips, ffn)] = (lambda p=bare, a=params, t=tokens: p(a, t))
            # the FFN input matmul of this layout alone, every device at once, no collective
            rows, e, cols = meta[(chips, ffn)]["ffn_matmul"]
            mesh = make_mesh(ENGINE_TOPOLOGIES[chips])
            spec = P(("x", "y", "z"), None)
            h = jax.device_put(jnp.asarray(rng.standard_normal((chips * rows, e), np.float32),
                                           jnp.bfloat16), NamedSharding(mesh, spec))
            w = jax.device_put(jnp.asarray(rng.standard_normal((chips * e, cols), np.float32),
                                           jnp.bfloat16), NamedSharding(mesh, spec))
            mm = jax.jit(jax.shard_map(
                lambda a, b: jnp.einsum("ri,io->ro", a, b, preferred_element_type=jnp.float32
                                        ).astype(jnp.bfloat16),
                mesh=mesh, in_specs=(spec, spec), out_specs=spec))
            calls[("ffn_matmul", chips, ffn)] = (lambda f=mm, a=h, b=w: f(a, b))
    times = interleaved(calls, rounds, reps)
    out = []
    for (chips, ffn), m in meta.items():
        out.append(dict(m, prefill=times[("prefill", chips, ffn)],
                        no_weight_gathers=times.get(("no weight gathers", chips, ffn)),
                        ffn_matmul_time=times[("ffn_matmul", chips, ffn)]))
    return out


# --------------------------------------------------------------------------- analysis


def gather_costs(r: dict) -> dict:
    """Per-mesh-MB cost of the gathers (ms of wall and of CPU per MB all devices receive):
    the micro gathers alone, and the engine's weight gathers (prefill minus the same program
    without them)."""
    micro = {a["config"]: {"groups": a["groups"],
                           "mesh_mb": a["gather_bytes_per_device"] * a["devices"] / 1e6,
                           "wall_ms_per_mb": a["gather"]["median_s"] * 1e3
                           / (a["gather_bytes_per_device"] * a["devices"] / 1e6),
                           "cpu_ms_per_mb": a["gather"]["cpu_s_per_call"] * 1e3
                           / (a["gather_bytes_per_device"] * a["devices"] / 1e6)}
             for a in r["micro"]}
    engine = {}
    for b in r["engine"]:
        if not b.get("no_weight_gathers"):
            continue
        mesh_mb = b["weight_gather_bytes_per_device"] * b["chips"] / 1e6
        groups = int(b["weight_gather_shape"][0].split(" x ")[1])
        engine[f"{b['layout']} x{b['chips']}"] = {
            "groups": groups, "mesh_mb": mesh_mb,
            "wall_ms_per_mb": (b["prefill"]["median_s"] - b["no_weight_gathers"]["median_s"])
            * 1e3 / mesh_mb,
            "cpu_ms_per_mb": (b["prefill"]["cpu_s_per_call"]
                              - b["no_weight_gathers"]["cpu_s_per_call"]) * 1e3 / mesh_mb}
    def mean(key, several):
        vals = [v[key] for v in engine.values() if (v["groups"] > 1) == several]
        return sum(vals) / len(vals) if vals else float("nan")

    # several groups' cost per byte over one group's (mean over the programs of each): what
    # costmodel.HOST_MULTIGROUP_GATHER_SCALE prices
    ratio = {key: mean(key, True) / mean(key, False) for key in ("wall_ms_per_mb", "cpu_ms_per_mb")}
    return {"micro": micro, "engine": engine, "several_over_one": ratio}


def _span(rows: dict, key: str, several: bool) -> str:
    vals = [v[key] for v in rows.values() if (v["groups"] > 1) == several]
    return f"{min(vals):.2f}-{max(vals):.2f}" if vals else "-"


def findings(r: dict) -> list[str]:
    c = gather_costs(r)
    m, e = c["micro"], c["engine"]
    return [
        "Alone, an all-gather costs about the same per MB the mesh receives whatever its "
        f"groups: {_span(m, 'wall_ms_per_mb', False)} ms wall and {_span(m, 'cpu_ms_per_mb', False)} "
        f"ms CPU per MB in one group, {_span(m, 'wall_ms_per_mb', True)} and "
        f"{_span(m, 'cpu_ms_per_mb', True)} in several ("
        + ", ".join(f"{k} {v['wall_ms_per_mb']:.2f}" for k, v in m.items()) + " ms wall/MB).",
        "Inside the engine's prefill the weight gathers are executed (one all-gather per "
        "weight and layer, fed by the parameter, issued at the program's start before the "
        "first matmul; none becomes a reduce-scatter of activations), but what they cost "
        "(prefill minus the same program with each weight gather replaced by a local "
        "broadcast) depends on the groups: one group "
        f"{_span(e, 'wall_ms_per_mb', False)} ms wall / {_span(e, 'cpu_ms_per_mb', False)} ms CPU "
        f"per mesh-MB, several groups {_span(e, 'wall_ms_per_mb', True)} / "
        f"{_span(e, 'cpu_ms_per_mb', True)} ("
        + ", ".join(f"{k} {v['wall_ms_per_mb']:.2f}" for k, v in e.items()) + " ms wall/MB).",
        "Per byte, the engine's several-group weight gathers cost "
        f"{c['several_over_one']['wall_ms_per_mb']:.2f}x (wall) and "
        f"{c['several_over_one']['cpu_ms_per_mb']:.2f}x (CPU) what its one-group ones cost, "
        "about what a gather costs alone: it is the one-group gathers that cost the program "
        "about 3x a lone gather's price, not the several-group ones that are free (why, "
        "inside XLA CPU's runtime, this data does not say).",
        "The matmuls are not what differs: each layout's FFN input matmul alone on the mesh "
        "is within a few ms of ws2d's (last columns of (b)).",
    ]


def run(args: argparse.Namespace, previous: dict | None) -> dict:
    result = {"context": common.machine_context(), "rounds": args.rounds, "reps": args.reps,
              "shard": [E, F_SHARD], "tokens": TOKENS}
    result["micro"] = part_a(args.rounds, args.reps)
    result["engine"] = part_b(args.rounds, max(1, args.reps // 2))
    result["load_after"] = common.load_average()
    return result


def analyse(result: dict, args: argparse.Namespace) -> dict:
    return {**result, "gather_costs": gather_costs(result), "findings": findings(result)}


def arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--reps", type=int, default=6)


BENCHMARK = harness.Benchmark(NAME, __doc__.splitlines()[0], run, arguments=arguments, analyse=analyse)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--render" not in argv and FLAG not in os.environ.get("XLA_FLAGS", ""):
        # the mesh's devices are set before JAX starts: run again with the flag
        env = dict(os.environ, XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " " + FLAG).strip())
        return subprocess.call([sys.executable, "-m", "benchmarks.collectives", *argv],
                               env=env, cwd=common.ROOT)
    return harness.main(BENCHMARK, argv)


if __name__ == "__main__":
    sys.exit(main())
