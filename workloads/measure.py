"""Run one trial on a mesh and measure it: `run_trial(config) -> Measurement`.

What is measured (docs/architecture.md "Metrics"; paper §4 for MFU and chip-seconds per token):

- compile once (`compile_s`, never part of a latency); the compiled programs are kept in
  an `engine_cache` dict the caller owns, keyed by the trial's shape and layouts, so a
  repeated shape does not recompile (`extra["compile_cache_hit"]`);
- `warmup` untimed runs, then `repeats` timed runs of the whole trial: prefill, the
  phase handoff (KV cache from the prefill layout to the decode layout), and every decode
  step, each timed with `block_until_ready`. `prefill_s` is the median over repeats;
  `decode_step_s` the median over every step of every repeat; `total_s` the median over
  repeats of prefill + handoff + all decode steps (the user's end-to-end latency);
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
from workloads.metrics import Measurement
from workloads.trial import TrialConfig

PROGRAMS = ("prefill", "handoff", "decode")

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


def cache_key(trial: TrialConfig) -> tuple:
    """Everything that changes the compiled programs; not the seed, repeats or warmup."""
    return (tuple(sorted(trial.model.to_dict().items())), trial.chips, tuple(trial.mesh_shape),
            trial.batch, trial.input_len, trial.decode_steps, trial.weights,
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
        return cached, True
    mesh = make_mesh(trial.mesh_shape)
    engine = Engine(trial, mesh=mesh)
    start = time.perf_counter()
    lowered = engine.lowered()
    compiled = {name: lowered[name].compile() for name in PROGRAMS if name in lowered}
    if getattr(engine, "_handoff_is_identity", False):
        compiled.pop("handoff", None)      # never runs: the engine passes the cache through
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


def _greedy(logits):
    import jax.numpy as jnp

    return jnp.argmax(logits, axis=-1).astype(jnp.int32)


@dataclass
class RunTimes:
    prefill_s: float
    handoff_s: float
    decode_steps_s: list[float]
    logits: list[Any]          # prefill's last position, then every decode step
    tokens: list[Any]          # the greedy token after each of them

    @property
    def total_s(self) -> float:
        return self.prefill_s + self.handoff_s + sum(self.decode_steps_s)


def run_once(entry: CompiledTrial, trial: TrialConfig, keep_logits: bool = False) -> RunTimes:
    """One whole trial: prefill, handoff, decode_steps greedy steps, each timed."""
    import jax.numpy as jnp

    engine, progs = entry.engine, entry.compiled
    params = engine.params
    tokens = engine.input_tokens()
    prefill_s, (logits, kv) = _timed(progs["prefill"], *_place((params, tokens), progs["prefill"]))
    # The engine skips the handoff when both phases shard the cache alike (then ~0 s).
    handoff_s, kv = _timed(engine.handoff, kv)
    token = _greedy(logits)
    kept_logits, kept_tokens, steps = [], [], []
    if keep_logits:
        kept_logits.append(logits)
        kept_tokens.append(token)
    for step in range(trial.decode_steps):
        pos = jnp.int32(trial.input_len + step)
        args = _place((params, kv, token, pos), progs["decode"])
        seconds, (logits, kv) = _timed(progs["decode"], *args)
        token = _greedy(logits)
        steps.append(seconds)
        if keep_logits:
            kept_logits.append(logits)
            kept_tokens.append(token)
    return RunTimes(prefill_s, handoff_s, steps, kept_logits, kept_tokens)


def _stats(values: list[float]) -> tuple[float, float, float]:
    if not values:
        return math.nan, math.nan, math.nan
    return statistics.median(values), min(values), max(values)


# --------------------------------------------------------------------------- the trial


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
    profile = resolve_hardware(hardware, trial.chips)
    entry, hit = compile_trial(trial, engine_cache)
    analysis = analyse(entry, trial.mesh_shape)

    for _ in range(trial.warmup):
        run_once(entry, trial)
    runs = [run_once(entry, trial) for _ in range(trial.repeats)]

    n, b = trial.chips, trial.batch
    m = Measurement(source="measured", hardware=hardware_label())
    m.prefill_s, m.prefill_s_min, m.prefill_s_max = _stats([r.prefill_s for r in runs])
    m.decode_step_s, m.decode_step_s_min, m.decode_step_s_max = _stats(
        [s for r in runs for s in r.decode_steps_s])
    m.total_s = statistics.median(r.total_s for r in runs)
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
        "repeats": trial.repeats,
        "warmup": trial.warmup,
    }
    if is_emulated():
        m.extra["note"] = (f"emulated mesh: {n} virtual devices on this host; wall times of this "
                           "host, MFU against this host's measured peak split over the chips")
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
    weights = quant.dequantize_params(quant.quantize_params(raw)) if trial.weights == "int8" else raw
    tokens = prompt_tokens(trial.model, trial.batch, trial.input_len, trial.seed)
    ref_logits, ref_tokens = reference_generate(trial.model, weights, tokens, trial.decode_steps)
    errors = [float(jnp.max(jnp.abs(jnp.asarray(a, jnp.float32) - jnp.asarray(r, jnp.float32))))
              for a, r in zip(run.logits, ref_logits)]
    m.verify_max_abs_err = max(errors)
    engine_tokens = np.stack([np.asarray(t) for t in run.tokens], axis=1)
    m.tokens_match = bool(np.array_equal(engine_tokens, np.asarray(ref_tokens)))
    m.extra["verify_steps"] = len(errors)
    if trial.weights == "int8":
        # Teacher-forced over the prompt and every generated token, so the number is the
        # quantisation error alone, not a diverged greedy path.
        seq = np.concatenate([tokens, engine_tokens[:, :trial.decode_steps]], axis=1)
        m.int8_max_logit_dev = quant.max_logit_deviation(trial.model, raw, jnp.asarray(seq))
