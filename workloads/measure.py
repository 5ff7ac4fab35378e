"""Run one trial on a mesh and measure it: `run_trial(config) -> Measurement`.

What is measured (docs/architecture.md "Metrics"; paper §4 for MFU and chip-seconds per token):

- compile once (`compile_s`, never part of a latency); the compiled programs are kept in
  an `engine_cache` dict the caller owns, keyed by the trial's shape and layouts, so a
  repeated shape does not recompile (`extra["compile_cache_hit"]`);
- `warmup` untimed runs, then timed runs of the whole trial (docs/architecture.md,
  "Measurement protocol"): prefill and the phase handoff (KV cache from the prefill layout to the
  decode layout), each synchronised, then all `decode_steps` decode steps dispatched back
  to back and synchronised once, as a serving loop runs them; a run's decode time / its
  steps is its `decode_step_s`. Runs repeat (at least `repeats`) until the 95% confidence
  interval of both medians is within +-`ci_target` of the median, or the timed runs have
  taken `time_budget_s`. `prefill_s` / `decode_step_s` are the medians over runs, with
  `*_ci_rel` (CI half-width / median), `*_repeats` and `*_spread` beside them, and the
  host's load, CPU steal and involuntary context switches during the runs (`host_*`);
  `total_s` is the median over runs of prefill + handoff + decode (end-to-end latency);
- MFU = model FLOPs / (n_chips x peak FLOP/s per chip x seconds), with model FLOPs from
  `costmodel.phase_model_flops` (the same definition the analytical model uses). On an
  emulated mesh the peak is THIS host's measured peak split over the n virtual chips
  (`workloads.hardware.per_chip`), never a TPU's;
- chip-seconds per token = n_chips x seconds / tokens (prefill: B·L tokens; decode: B);
- memory per device from the compiled programs: weight and KV-cache bytes are the shard
  sizes of those arguments under the programs' input shardings; peak is the largest
  argument + output - aliased + temporary bytes of any program (`memory_analysis()`);
- collectives per program from the optimized HLO (`workloads/hlo.py`).

Timings on an emulated mesh are wall times of this host, labelled `hardware="host"`.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

from workloads.config import ConfigError, HardwareProfile
from workloads.hardware import load_hardware, per_chip
from workloads.hoststate import HostSampler, HostState
from workloads.metrics import Measurement
from workloads.trial import TrialConfig

PROGRAMS = ("prefill", "handoff", "decode")
# FP8 in the engine (workloads/quant.py): stored and moved in 8 bits, computed in bf16.
FP8_LABEL = ("emulated: FP8 (float8_e4m3fn) weights and KV cache are stored and moved in 8 bits "
             "and turned into bf16 before each matmul (XLA CPU has no FP8 matmul); FP8 units' "
             "FLOP/s are in the cost model's predictions for hardware that has them, not here")

# jax device_kind (lower case, substring) -> hardware preset, for MFU on real accelerators.
DEVICE_KIND_PRESETS = (
    ("h200", "h200"), ("h100", "h100"), ("a100", "a100-80g"),
    ("tpu v4", "tpu-v4"), ("tpu v5 lite", "tpu-v5e"), ("tpu v5e", "tpu-v5e"),
)


@dataclass
class CompiledTrial:
    """What `engine_cache` holds for one trial shape: the engine, its mesh and programs."""

    engine: Any
    mesh: Any
    compiled: dict[str, Any]
    compile_s: float
    seed: int
    analysis: dict[str, Any] = field(default_factory=dict)   # memory and collectives, computed once
    inputs: tuple | None = None     # (params, prompt, decode positions) placed: see run_inputs


def run_inputs(entry: CompiledTrial) -> tuple:
    """The programs' inputs, placed on the mesh once per seed, so a timed run spends its
    time budget on running, not on rebuilding the prompt and positions."""
    if entry.inputs is None:
        engine = entry.engine
        params, tokens = _place((engine.params, engine.input_tokens()), entry.compiled["prefill"])
        entry.inputs = (params, tokens, engine.positions())
    return entry.inputs


def cache_key(trial: TrialConfig) -> tuple:
    """Everything that changes the compiled programs; not the seed, repeats or warmup.
    The model is the one the engine runs (`run_model`: heads and vocabulary padded)."""
    return (tuple(sorted(trial.model.to_dict().items())), trial.run_model.n_heads,
            trial.run_model.vocab, trial.chips, tuple(trial.mesh_shape),
            trial.batch, trial.input_len, trial.decode_steps, trial.weights, trial.experts,
            trial.kv_cache,
            (trial.prefill.ffn, trial.prefill.attn), (trial.decode.ffn, trial.decode.attn))


# --------------------------------------------------------------------------- hardware


def is_emulated() -> bool:
    import jax

    return jax.default_backend() == "cpu"


def resolve_hardware(hardware, chips: int) -> HardwareProfile | None:
    """The per-chip profile MFU is computed against.

    None: on CPU, this host's measured profile split over the virtual chips; on an
    accelerator, the preset matching the device kind (None if there is none: MFU NaN).
    A name, YAML path, mapping or HardwareProfile: that profile (`host` is split too).
    """
    import jax

    if hardware is None:
        if is_emulated():
            hardware = "host"
        else:
            kind = jax.devices()[0].device_kind.lower()
            preset = next((p for key, p in DEVICE_KIND_PRESETS if key in kind), None)
            if preset is None:
                return None
            hardware = preset
    profile = load_hardware(hardware)
    if profile.name == "host" and profile.measured:
        profile = per_chip(profile, chips)
    return profile


def hardware_label() -> str:
    """`host` on an emulated CPU mesh, else the accelerator's device kind."""
    import jax

    return "host" if is_emulated() else jax.devices()[0].device_kind


# --------------------------------------------------------------------------- compile


def compile_trial(trial: TrialConfig, engine_cache: dict | None = None) -> tuple[CompiledTrial, bool]:
    """The engine and compiled programs for this trial's shape: from the cache, or built now."""
    from workloads.engine import Engine, make_mesh

    key = cache_key(trial)
    cached = engine_cache.get(key) if engine_cache is not None else None
    if cached is not None:
        if cached.seed != trial.seed:      # same programs, other weights: re-initialise only
            cached.engine = Engine(trial, mesh=cached.mesh)
            cached.seed = trial.seed
            cached.inputs = None
        return cached, True
    mesh = make_mesh(trial.mesh_shape)
    engine = Engine(trial, mesh=mesh)
    start = time.perf_counter()
    lowered = engine.lowered()
    # An identity handoff never runs (the engine passes the cache through): not compiled.
    skip = {"handoff"} if engine.handoff_is_identity else set()
    compiled = {name: lowered[name].compile() for name in PROGRAMS
                if name in lowered and name not in skip}
    entry = CompiledTrial(engine, mesh, compiled, time.perf_counter() - start, trial.seed)
    if engine_cache is not None:
        engine_cache[key] = entry
    return entry, False


def _place(args: tuple, compiled) -> tuple:
    """Put arguments where a compiled program expects them (a no-op when they already are)."""
    import jax

    shardings = compiled.input_shardings[0]
    placed = []
    for arg, sharding in zip(args, shardings):
        leaves, tree = jax.tree.flatten(arg)
        shard_leaves = jax.tree.leaves(sharding)
        if len(shard_leaves) != len(leaves):
            placed.append(arg)
            continue
        moved = [leaf if _placed_as(leaf, s) else jax.device_put(leaf, s)
                 for leaf, s in zip(leaves, shard_leaves)]
        placed.append(jax.tree.unflatten(tree, moved))
    return tuple(placed)


def _placed_as(leaf, sharding) -> bool:
    current = getattr(leaf, "sharding", None)
    return current is not None and current.is_equivalent_to(sharding, leaf.ndim)


# --------------------------------------------------------------------------- analysis


def arg_bytes_per_device(compiled, index: int) -> float:
    """Bytes one device holds of positional argument `index` under the compiled sharding."""
    import jax
    import numpy as np

    avals = jax.tree.leaves(compiled.in_avals[0][index])
    shardings = jax.tree.leaves(compiled.input_shardings[0][index])
    total = 0
    for aval, sharding in zip(avals, shardings):
        shape = sharding.shard_shape(aval.shape)
        total += math.prod(shape) * np.dtype(aval.dtype).itemsize
    return float(total)


def peak_bytes(compiled) -> float:
    """Live bytes at peak per device: arguments + outputs - aliased (donated) + temporaries."""
    stats = compiled.memory_analysis()
    if stats is None:
        return math.nan
    return float(stats.argument_size_in_bytes + stats.output_size_in_bytes
                 - stats.alias_size_in_bytes + stats.temp_size_in_bytes)


def analyse(entry: CompiledTrial, mesh_shape: tuple[int, int, int]) -> dict[str, Any]:
    """Memory per device and collectives of every compiled program (computed once per shape)."""
    from workloads import hlo

    if entry.analysis:
        return entry.analysis
    decode = entry.compiled["decode"]
    ops = {name: hlo.collective_ops(prog.as_text(), mesh_shape) for name, prog in entry.compiled.items()}
    entry.analysis = {
        "weight_bytes_per_chip": arg_bytes_per_device(decode, 0),     # decode(params, kv, token, pos)
        "kv_bytes_per_chip": arg_bytes_per_device(decode, 1),
        "peak_bytes_per_chip": max(peak_bytes(p) for p in entry.compiled.values()),
        "collective_ops": ops,
        "collectives": {name: hlo.summarize(o) for name, o in ops.items() if o},
        "comm_bytes": {name: hlo.comm_bytes(o) for name, o in ops.items()},
    }
    return entry.analysis


# --------------------------------------------------------------------------- timing


def _timed(fn, *args):
    import jax

    start = time.perf_counter()
    out = fn(*args)
    jax.block_until_ready(out)
    return time.perf_counter() - start, out


@dataclass
class RunTimes:
    """One timed run of the whole trial."""

    prefill_s: float
    handoff_s: float
    decode_s: float            # every decode step, dispatched back to back, synchronised once
    steps: int
    logits: list[Any]          # prefill's last position, then every decode step (if kept)
    tokens: list[Any]          # the greedy token after each of them (if kept)

    @property
    def decode_step_s(self) -> float:
        return self.decode_s / self.steps if self.steps else math.nan

    @property
    def total_s(self) -> float:
        return self.prefill_s + self.handoff_s + self.decode_s


def run_once(entry: CompiledTrial, trial: TrialConfig, keep_logits: bool = False) -> RunTimes:
    """One whole trial: prefill and handoff, each synchronised, then `decode_steps` greedy
    steps through `engine.decode_loop`, synchronised once at the end (a user sees the
    steps' throughput, not one step's round trip). Arguments are placed before each timer
    starts, so only the programs are timed."""
    import jax

    from workloads.engine import decode_loop

    engine, progs = entry.engine, entry.compiled
    params, tokens, positions = run_inputs(entry)
    prefill_s, (logits, kv) = _timed(progs["prefill"], params, tokens)
    # The engine skips the handoff when both phases shard the cache alike (then ~0 s).
    handoff_s, kv = _timed(engine.handoff, kv)
    token = jax.block_until_ready(engine.greedy(logits))
    decode_s, decoded = 0.0, None
    if positions:
        params, kv, token, _ = _place((params, kv, token, positions[0]), progs["decode"])
        start = time.perf_counter()
        decoded = decode_loop(progs["decode"], engine.greedy, params, kv, token, positions, keep_logits)
        jax.block_until_ready((decoded.cache, decoded.tokens[-1]))
        decode_s = time.perf_counter() - start
    kept_logits, kept_tokens = [], []
    if keep_logits:
        kept_logits = [logits] + (decoded.logits if decoded else [])
        kept_tokens = [token] + (decoded.tokens if decoded else [])
    return RunTimes(prefill_s, handoff_s, decode_s, len(positions), kept_logits, kept_tokens)


# --------------------------------------------------------------------------- noise


MIN_CI_SAMPLES = 6     # below 6 samples no pair of order statistics covers the median at 95%


def median_ci(samples, confidence: float = 0.95) -> tuple[float, float]:
    """Distribution-free confidence interval of the median: the pair of order statistics
    that covers it with probability >= `confidence` (binomial), the interval of
    `scipy.stats.quantile_test(samples, q=median, p=0.5).confidence_interval(confidence)`
    (tests/test_measure.py checks they agree). (nan, nan) with fewer than MIN_CI_SAMPLES
    samples."""
    import numpy as np

    values = np.sort(np.asarray(samples, dtype=float))
    if len(values) < MIN_CI_SAMPLES:
        return math.nan, math.nan
    low, high = _median_ci_ranks(len(values), confidence)
    if low < 0:
        return math.nan, math.nan
    return float(values[low]), float(values[high])


def _median_ci_ranks(n: int, confidence: float) -> tuple[int, int]:
    """(low, high) 0-based ranks of the median's two-sided interval among n sorted samples:
    k = the smallest count with P(Binomial(n, 1/2) <= k) >= (1 - confidence) / 2 (the
    binomial's `ppf`), low = k - 1 and, the binomial being symmetric, high = n - k (its
    `isf`). `scipy.special.bdtr` is the binomial CDF `scipy.stats.binom` evaluates; not
    scipy.stats itself, whose import (~1 s of CPU) every worker process paid inside its
    first trial's timed runs (issue 22: the quickstart's workers are CPU-bound)."""
    import numpy as np
    from scipy.special import bdtr

    cdf = bdtr(np.arange(n + 1), n, 0.5)
    k = int(np.searchsorted(cdf, (1 - confidence) / 2, side="left"))
    return k - 1, n - k


def ci_rel(samples, confidence: float = 0.95) -> float:
    """Half-width of the median's confidence interval / the median; inf when too few samples."""
    low, high = median_ci(samples, confidence)
    if math.isnan(low):
        return math.inf
    return (high - low) / 2 / statistics.median(samples)


def spread(samples) -> float:
    """(max - min) / median."""
    return (max(samples) - min(samples)) / statistics.median(samples) if samples else math.nan


def repeat_until_precise(run, precise, min_runs: int, budget_s: float, clock=time.perf_counter,
                         agree=None) -> list:
    """Call `run()` at least `min_runs` times, then until `precise(results)` or until the
    calls have taken `budget_s` seconds (checked after each call, so the last one may
    overrun it by one run).

    `agree(precise, out_of_time) -> (precise, out_of_time)`: on a multi-host mesh every
    process must make the same number of runs (each run's collectives need all of them),
    so the hosts' flags are combined before deciding (`hosts_agree`)."""
    results = []
    start = clock()
    while True:
        results.append(run())
        if len(results) < min_runs:
            continue
        done, out_of_time = precise(results), clock() - start >= budget_s
        if agree is not None:
            done, out_of_time = agree(done, out_of_time)
        if done or out_of_time:
            return results


def hosts_agree(precise: bool, out_of_time: bool) -> tuple[bool, bool]:
    """Across every JAX process: precise when all hosts are, out of time when any host is."""
    import numpy as np
    from jax.experimental import multihost_utils

    flags = np.asarray(multihost_utils.process_allgather(np.array([precise, out_of_time])))
    flags = flags.reshape(-1, 2)
    return bool(flags[:, 0].all()), bool(flags[:, 1].any())


def _stats(values: list[float]) -> tuple[float, float, float]:
    if not values:
        return math.nan, math.nan, math.nan
    return statistics.median(values), min(values), max(values)


def _finite_or_nan(value: float) -> float:
    return value if math.isfinite(value) else math.nan


# --------------------------------------------------------------------------- the trial


def time_runs(entry: CompiledTrial, trial: TrialConfig) -> tuple[list[RunTimes], float, HostState]:
    """Timed runs until both medians are precise or the budget is spent; their wall time
    and the host's state meanwhile."""
    def precise(runs: list[RunTimes]) -> bool:
        phases = [[r.prefill_s for r in runs]]
        if trial.decode_steps:
            phases.append([r.decode_step_s for r in runs])
        return all(ci_rel(times) <= trial.ci_target for times in phases)

    import jax

    host = HostSampler().start()
    start = time.perf_counter()
    runs = repeat_until_precise(lambda: run_once(entry, trial), precise, trial.repeats,
                                trial.time_budget_s,
                                agree=hosts_agree if jax.process_count() > 1 else None)
    return runs, time.perf_counter() - start, host.stop()


def fill_timings(m: Measurement, runs: list[RunTimes], decodes: bool) -> None:
    """Medians, min and max, and the noise of each (CI, runs, spread)."""
    prefill = [r.prefill_s for r in runs]
    m.prefill_s, m.prefill_s_min, m.prefill_s_max = _stats(prefill)
    m.prefill_ci_rel, m.prefill_spread = _finite_or_nan(ci_rel(prefill)), spread(prefill)
    m.prefill_repeats = float(len(runs))
    if decodes:
        decode = [r.decode_step_s for r in runs]
        m.decode_step_s, m.decode_step_s_min, m.decode_step_s_max = _stats(decode)
        m.decode_ci_rel, m.decode_spread = _finite_or_nan(ci_rel(decode)), spread(decode)
        m.decode_repeats = float(len(runs))
    m.total_s = statistics.median(r.total_s for r in runs)


def run_trial(config: TrialConfig, engine_cache: dict | None = None, verify: bool = False,
              hardware=None) -> Measurement:
    """Compile (or reuse), warm up, time and analyse one trial; optionally verify it.

    `engine_cache`: a dict the caller owns (a Ray worker keeps one per actor).
    `verify`: also run the unsharded reference with the same (dequantised) weights and
    fill `verify_max_abs_err`, `tokens_match` and, for int8, `int8_max_logit_dev`.
    `hardware`: the per-chip profile for MFU (see `resolve_hardware`).
    """
    from workloads import costmodel

    trial = config.resolved().validate()
    import jax

    if jax.device_count() < trial.chips:
        raise ConfigError("chips", trial.chips, f"at most the {jax.device_count()} devices this "
                          f"process has ({jax.default_backend()}); set XLA_FLAGS="
                          f"--xla_force_host_platform_device_count={trial.chips} before importing jax")
    if jax.process_count() != trial.hosts:
        raise ConfigError("hosts", trial.hosts, f"the number of JAX processes this trial runs in "
                          f"({jax.process_count()}); a sweep's Ray pool starts one per host")
    profile = resolve_hardware(hardware, trial.chips)
    entry, hit = compile_trial(trial, engine_cache)
    analysis = analyse(entry, trial.mesh_shape)

    for _ in range(trial.warmup):
        run_once(entry, trial)
    runs, measure_s, state = time_runs(entry, trial)

    n, b = trial.chips, trial.batch
    m = Measurement(source="measured", hardware=hardware_label())
    fill_timings(m, runs, trial.decode_steps > 0)
    m.measure_s = measure_s
    m.host_load_avg_1m, m.host_steal_frac = state.load_avg_1m, state.steal_frac
    m.host_busy_frac, m.host_involuntary_switches = state.busy_frac, state.involuntary_switches
    m.compile_s = 0.0 if hit else entry.compile_s     # this trial compiled nothing on a hit

    prefill_tokens, decode_tokens = b * trial.input_len, b
    prefill_flops = costmodel.phase_model_flops(trial.model, b, "prefill", trial.input_len)
    decode_flops = costmodel.phase_model_flops(trial.model, b, "decode", trial.input_len,
                                               costmodel.decode_context(trial))
    if profile is not None:
        m.prefill_mfu = prefill_flops / (n * profile.peak_flops * m.prefill_s)
        if trial.decode_steps:
            m.decode_mfu = decode_flops / (n * profile.peak_flops * m.decode_step_s)
    m.prefill_cost_chip_s_per_token = n * m.prefill_s / prefill_tokens
    m.prefill_tokens_per_s = prefill_tokens / m.prefill_s
    if trial.decode_steps:
        m.decode_cost_chip_s_per_token = n * m.decode_step_s / decode_tokens
        m.decode_tokens_per_s = decode_tokens / m.decode_step_s

    m.weight_bytes_per_chip = analysis["weight_bytes_per_chip"]
    m.kv_bytes_per_chip = analysis["kv_bytes_per_chip"]
    m.peak_bytes_per_chip = analysis["peak_bytes_per_chip"]
    m.prefill_comm_bytes_per_chip = analysis["comm_bytes"]["prefill"]
    m.decode_comm_bytes_per_chip = analysis["comm_bytes"]["decode"]
    m.collectives = {name: list(stats) for name, stats in analysis["collectives"].items()}

    handoff = [r.handoff_s for r in runs]
    m.extra = {
        "compile_cache_hit": hit,
        "compile_s_when_built": entry.compile_s,
        "topology": "x".join(str(v) for v in trial.mesh_shape),
        "handoff_s": statistics.median(handoff),
        "handoff_comm_bytes_per_chip": analysis["comm_bytes"].get("handoff", 0.0),
        "prefill_flops": prefill_flops,
        "decode_flops": decode_flops,
        "peak_flops_per_chip": profile.peak_flops if profile else math.nan,
        "hardware_profile": profile.name if profile else None,
        "platform": jax.default_backend(),
        "emulated_mesh": is_emulated(),
        "repeats": len(runs),
        "min_repeats": trial.repeats,
        "warmup": trial.warmup,
        "ci_target": trial.ci_target,
        "time_budget_s": trial.time_budget_s,
        "decode_run_s": statistics.median(r.decode_s for r in runs),
        "host_cores": state.cores,
        "process_index": jax.process_index(),
        "process_count": jax.process_count(),
    }
    if is_emulated():
        m.extra["note"] = (f"emulated mesh: {n} virtual devices on this host; wall times of this "
                           "host, MFU against this host's measured peak split over the chips")
    if "fp8" in (trial.weights, trial.kv_cache):
        m.extra["fp8"] = FP8_LABEL
    if verify:
        verify_trial(entry, trial, m)
    return m


# --------------------------------------------------------------------------- verification


def verify_trial(entry: CompiledTrial, trial: TrialConfig, m: Measurement) -> None:
    """Run the engine once more keeping logits, and the unsharded reference on weights and
    prompt rebuilt from the seed (not taken from the engine), dequantised for int8."""
    import jax.numpy as jnp
    import numpy as np

    from workloads import quant
    from workloads.model import init_params, prompt_tokens
    from workloads.reference import reference_generate

    run = run_once(entry, trial, keep_logits=True)
    raw = init_params(trial.model, trial.seed)
    weights = quant.weights_as_run(raw, trial.weights)
    tokens = prompt_tokens(trial.model, trial.batch, trial.input_len, trial.seed)
    ref_logits, ref_tokens = reference_generate(trial.model, weights, tokens, trial.decode_steps,
                                                trial.kv_cache)
    vocab = trial.model.unpadded.vocab     # padded tokens' logits (masked, never picked) aside
    errors = [float(jnp.max(jnp.abs(jnp.asarray(a, jnp.float32)[..., :vocab]
                                    - jnp.asarray(r, jnp.float32))))
              for a, r in zip(run.logits, ref_logits)]
    m.verify_max_abs_err = max(errors)
    engine_tokens = np.stack([np.asarray(t) for t in run.tokens], axis=1)
    m.tokens_match = bool(np.array_equal(engine_tokens, np.asarray(ref_tokens)))
    m.extra["verify_steps"] = len(errors)
    if trial.weights in quant.QUANTIZED:
        # Teacher-forced over the prompt and every generated token, so the number is the
        # quantisation error alone, not a diverged greedy path.
        seq = np.concatenate([tokens, engine_tokens[:, :trial.decode_steps]], axis=1)
        deviation = quant.max_logit_deviation(trial.model, raw, jnp.asarray(seq), trial.weights)
        if trial.weights == "int8":
            m.int8_max_logit_dev = deviation
        else:
            m.extra["fp8_max_logit_dev"] = deviation
