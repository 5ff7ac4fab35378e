"""One calibration process of `sweeper calibrate` (docs/host-calibration.md): on a mesh of N
devices pinned to its cores, the operations the host cost model adds up, timed one kind at a
time, then real trials of the probe models (workloads/probes.py) through the engine.

    python -m sweeper.calibrate.worker --devices N --cores 0 --tasks FILE.json [--claim FILE]

(its entry point, sweeper/calibrate/worker.py, parses the flags and calls `serve_tasks`)
writes one JSON object per line to stdout as each measurement finishes (the parent shows
progress and keeps whatever finished if the process is lost). With `--claim`, processes on
other cores share the list: each takes the next unclaimed task from the counter in that file
(under a lock) until none is left, so the slots finish together whatever each task costs.
Tasks (a JSON list):

  {"kind": "dispatch"}                 per-call and per-op cost of a compiled program: a chain of
                                       k tiny engine matmuls on every device, k = 1 and 1 + DEPTH
  {"kind": "matmul", "m":, "k":, "n":} the engine's matmul (`partitioning.matmul`: bf16 inputs,
                                       f32 accumulation) of [m, k] x [k, n] on every device at once
  {"kind": "dequant", "elements":}     the engine's int8 -> bf16 dequantisation of that many
                                       weight elements per device (`quant.dequantize`)
  {"kind": "memory"}                   read bandwidth per device, every device reading at once
  {"kind": "cache", "bytes":}          a one-row engine matmul over bf16 weights of that many
                                       bytes per device: the time per weight element streamed,
                                       from cache or from DRAM (the read sweep)
  {"kind": "collective", "op":, "group":, "bytes":}
                                       one collective op over groups of `group` devices (all N
                                       devices in N / group groups at once, as a layout's op over
                                       one mesh axis runs): workloads/opprofile.py's timing
  {"kind": "trial", "config": {...}}   a probe trial through `measure.run_trial`

Everything is timed by the protocol of docs/architecture.md "Measurement protocol": repeats
until the median's 95% CI is within the target, or the time budget is spent.

`serve_tasks` pins the process to `--cores` and sets the device count BEFORE importing JAX (XLA
sizes its thread pool then), as a sweep's mesh worker does (sweeper/sweep/meshworker.py).
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import statistics
import time
import traceback

DEPTH = 32                  # extra ops of the dispatch chain
SETTINGS = dict(ci_target=0.05, time_budget_s=0.4, min_repeats=6)


def _timer(fn, *args) -> float:
    import jax

    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - start


def _repeat(fn, *args) -> dict:
    """Median, min and CI of `fn(*args)`'s wall time (compiled and warmed first)."""
    from workloads.measure import ci_rel, repeat_until_precise

    jax_ready = _timer(fn, *args)          # compile and warm up
    del jax_ready
    samples = repeat_until_precise(lambda: _timer(fn, *args),
                                   lambda s: ci_rel(s) <= SETTINGS["ci_target"],
                                   SETTINGS["min_repeats"], SETTINGS["time_budget_s"])
    ci = ci_rel(samples)
    return {"seconds": statistics.median(samples), "min_s": min(samples), "repeats": len(samples),
            "ci_rel": ci if math.isfinite(ci) else None}


def _mesh(n: int):
    import jax
    import numpy as np
    from jax.sharding import Mesh

    return Mesh(np.array(jax.devices()[:n]), ("d",))


def _on_every_device(mesh, fn, *arrays):
    """jit(shard_map(fn)) over the 'd' axis and the arrays placed one per device."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    spec = P("d")
    program = jax.jit(jax.shard_map(lambda *xs: fn(*(x[0] for x in xs))[None], mesh=mesh,
                                    in_specs=(spec,) * len(arrays), out_specs=spec))
    placed = [jax.device_put(a, NamedSharding(mesh, spec)) for a in arrays]
    return program, placed


def dispatch(n: int) -> dict:
    """A chain of k dependent [4, 64] x [64, 64] engine matmuls on each of n devices, k = 1
    and 1 + DEPTH: the extra ops' time / DEPTH is one op's dispatch on n devices (the
    arithmetic is ~0.03 MFLOP), the one-op program's time its launch and sync."""
    import jax.numpy as jnp

    from workloads.partitioning import matmul

    mesh = _mesh(n)
    out = {}
    for k in (1, 1 + DEPTH):
        def chain(x, w, k=k):
            for _ in range(k):
                x = matmul(x, w)
            return x
        program, args = _on_every_device(mesh, chain, jnp.ones((n, 4, 64), jnp.bfloat16),
                                         jnp.full((n, 64, 64), 1 / 64, jnp.bfloat16))
        out[k] = _repeat(program, *args)
    one, many = out[1]["seconds"], out[1 + DEPTH]["seconds"]
    per_op = max(many - one, 0.0) / DEPTH
    return {"call_s": max(one - per_op, 0.0), "op_s": per_op, "one": out[1], "chain": out[1 + DEPTH]}


def matmul(n: int, m: int, k: int, nn: int) -> dict:
    import jax.numpy as jnp

    from workloads.partitioning import matmul as engine_matmul

    program, args = _on_every_device(_mesh(n), engine_matmul, jnp.ones((n, m, k), jnp.bfloat16),
                                     jnp.ones((n, k, nn), jnp.bfloat16))
    return _repeat(program, *args)


def dequant(n: int, elements: int) -> dict:
    import jax.numpy as jnp

    from workloads.quant import dequantize

    cols = 1024
    rows = max(1, elements // cols)
    program, args = _on_every_device(_mesh(n), dequantize, jnp.ones((n, rows, cols), jnp.int8),
                                     jnp.ones((n, cols), jnp.float32))
    return {**_repeat(program, *args), "elements": rows * cols}


def memory(n: int) -> dict:
    from workloads.opprofile import QUICK_SETTINGS, time_memory_bandwidth

    return {"bytes_per_s": time_memory_bandwidth(n, QUICK_SETTINGS, nbytes=64 * 2**20)}


def cache(n: int, nbytes: int) -> dict:
    """One decode row against `nbytes` of bf16 weights per device (k = 1024 rows of the
    weight matrix), as a decode step streams its weights: fitting.Microbench's read sweep."""
    k = 1024
    cols = max(1, nbytes // (2 * k))
    return {**matmul(n, 1, k, cols), "elements": k * cols}


def collective(n: int, op: str, group: int, nbytes: int) -> dict:
    from workloads.opprofile import QUICK_SETTINGS, group_mesh, time_collective

    point = time_collective(group_mesh(n, group), op, nbytes, QUICK_SETTINGS)
    return {"seconds": point.seconds, "bytes_per_chip": point.bytes_per_chip,
            "ci_rel": point.ci_rel if math.isfinite(point.ci_rel) else None, "repeats": point.repeats}


def trial(config: dict, engine_cache: dict) -> dict:
    from workloads.measure import run_trial
    from workloads.trial import TrialConfig

    m = run_trial(TrialConfig.from_dict(config), engine_cache)
    keys = ("prefill_s", "prefill_s_min", "prefill_ci_rel", "prefill_repeats", "decode_step_s",
            "decode_step_s_min", "decode_ci_rel", "decode_repeats", "compile_s", "measure_s",
            "host_load_avg_1m", "host_steal_frac")
    return {k: getattr(m, k) for k in keys}


def run(task: dict, n: int, engine_cache: dict) -> dict:
    kind = task["kind"]
    if kind == "dispatch":
        return dispatch(n)
    if kind == "matmul":
        return matmul(n, task["m"], task["k"], task["n"])
    if kind == "dequant":
        return dequant(n, task["elements"])
    if kind == "memory":
        return memory(n)
    if kind == "cache":
        return cache(n, task["bytes"])
    if kind == "collective":
        return collective(n, task["op"], task["group"], task["bytes"])
    if kind == "trial":
        return trial(task["config"], engine_cache)
    raise ValueError(f"unknown task kind {kind!r}")


def claim_next(path: str, total: int) -> int | None:
    """The next unclaimed index of a shared task list (the counter in `path`, advanced under
    an exclusive lock), None when every task is claimed."""
    with open(path, "r+") as counter:
        fcntl.flock(counter, fcntl.LOCK_EX)
        index = int(counter.read().strip() or 0)
        if index >= total:
            return None
        counter.seek(0)
        counter.write(str(index + 1))
        counter.truncate()
        counter.flush()
        return index


def claimed(path: str, total: int):
    """The indices this process claims, one at a time, as it is ready for the next."""
    while (index := claim_next(path, total)) is not None:
        yield index


def serve_tasks(devices: int, cores: set[int], tasks_file: str, claim_file: str | None = None) -> int:
    """Run the task list of `tasks_file` (every task, or with `claim_file` those this process
    claims) on `devices` emulated devices pinned to `cores`, one JSON record per line on
    stdout. Call it before anything imports JAX: it pins the process and sets the device
    count first (sweeper/calibrate/worker.py, the process's entry point, parses its flags)."""
    os.sched_setaffinity(0, cores)             # before JAX: XLA sizes its threads then
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]
    os.environ["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={devices}"])
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    with open(tasks_file) as f:
        tasks = json.load(f)
    engine_cache: dict = {}
    indices = (claimed(claim_file, len(tasks)) if claim_file else range(len(tasks)))
    for index in indices:
        task = tasks[index]
        start = time.perf_counter()
        try:
            result = {"ok": True, **run(task, devices, engine_cache)}
        except Exception as err:     # one failed measurement is recorded, the others go on
            result = {"ok": False, "error": f"{type(err).__name__}: {err}",
                      "traceback": traceback.format_exc(limit=3)}
        record = {"index": index, "devices": devices, "task": task, "pid": os.getpid(),
                  "wall_s": time.perf_counter() - start, **result}
        print(json.dumps(record), flush=True)
    return 0
