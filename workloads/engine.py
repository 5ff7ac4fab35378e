"""The sharded inference engine: a mesh, weights in their stored layout, and jitted
`shard_map` programs for prefill, decode and the KV-cache handoff between them.

    engine = Engine(trial)                       # validates the trial before compiling
    logits, cache = engine.prefill(engine.params, engine.input_tokens())
    cache = engine.handoff(cache)                # identity unless decode shards attention differently
    logits, cache = engine.decode(engine.params, cache, token, pos)

Each phase runs its own `PhaseLayout` (workloads/partitioning.py has one function per
layout); the weights keep one stored layout, so switching phases moves no weights
(paper §3.2.3). The mesh axes are always x, y, z.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from workloads import partitioning as part
from workloads.config import ConfigError, ModelConfig
from workloads.layouts import (AXES, KV_FORMATS, WEIGHT_FORMATS, PhaseLayout, resolve_padding,
                               stores_1d, validate_layouts)
from workloads.model import check_model, init_params, pad_params, prompt_tokens, unpad_params
from workloads.partitioning import Plan
from workloads.quant import QUANTIZED, dequantize_params, quantize_params
from workloads.trial import TrialConfig
from workloads.validate import one_of


def make_mesh(topology: tuple[int, int, int], devices=None) -> Mesh:
    """Mesh(devices.reshape(X, Y, Z), ('x', 'y', 'z')) over the first X·Y·Z devices."""
    devices = list(jax.devices() if devices is None else devices)
    n = math.prod(topology)
    if n > len(devices):
        x, y, z = topology
        raise ConfigError("topology", f"{x}x{y}x{z}", f"at most {len(devices)} chips on this host "
                          f"(emulate more with XLA_FLAGS=--xla_force_host_platform_device_count={n} "
                          "set before JAX is imported)")
    return Mesh(np.array(devices[:n]).reshape(topology), AXES)


# --------------------------------------------------------------------------- one layer


_FFN = {  # FFN layout -> (gather_input, qkv, ffn, attn_out, scatter_output)
    "ws1d": (part.ws1d_gather_input, part.ws1d_qkv, part.ws1d_ffn, part.ws1d_attn_out,
             part.ws1d_scatter_output),
    "ws2d": (part.ws2d_gather_input, part.ws2d_qkv, part.ws2d_ffn, part.ws2d_attn_out,
             part.ws2d_scatter_output),
}
for _wg in ("wg_x", "wg_xy", "wg_xyz"):
    _FFN[_wg] = (part.wg_gather_input, part.wg_qkv, part.weight_gathered_ffn, part.wg_attn_out,
                 part.wg_scatter_output)
_ATTN = {"head": part.head_sharded_attention, "batch": part.batch_sharded_attention}


def _layer(plan: Plan, x, w, cache, i: int, pos, prefill: bool):
    """One Transformer layer on the residual stream x (B_G L E_R). Parallel block (§3.4):
    one input all-gather and one output reduce-scatter shared by attention and MLP."""
    gather_input, qkv, ffn, attn_out, scatter_output = _FFN[plan.layout.ffn]
    if plan.model.moe:      # the experts in this phase's layout (layouts.py, mixture of experts)
        ffn = part.moe_ffn
    attention = _ATTN[plan.layout.attn]

    def attn_branch(h, cache):
        q, kv = qkv(plan, h, w)
        o, cache = attention(plan, q, kv, cache, i, pos, prefill)
        return attn_out(plan, o, w), cache

    if plan.model.block == "parallel":
        h = gather_input(plan, x, w["norm"])
        a, cache = attn_branch(h, cache)
        return x + scatter_output(plan, a + ffn(plan, h, w)), cache
    a, cache = attn_branch(gather_input(plan, x, w["attn_norm"]), cache)
    x = x + scatter_output(plan, a)
    return x + scatter_output(plan, ffn(plan, gather_input(plan, x, w["mlp_norm"]), w)), cache


def _forward(plan: Plan, params, tokens, cache, pos, prefill: bool, last=None):
    """Embedding, layers (unrolled: the compiled program lists every layer's collectives),
    unembedding of the last position (`last`: the index of the last real token, for an
    extend whose tokens end in padding). Runs per chip inside shard_map."""
    x = part.embed(plan, tokens, params["embed"])
    for i, w in enumerate(params["layers"]):
        x, cache = _layer(plan, x, w, cache, i, pos, prefill)
    tied = "unembed" not in params
    table = params["embed"] if tied else params["unembed"]
    x_last = x[:, -1] if last is None else jax.lax.dynamic_index_in_dim(x, last, 1, keepdims=False)
    return part.unembed(plan, x_last, params["final_norm"], table, tied), cache


# --------------------------------------------------------------------------- programs


@dataclasses.dataclass(frozen=True)
class _Shapes:
    batch: int
    input_len: int
    context_len: int


@functools.lru_cache(maxsize=64)
def _programs(mesh: Mesh, prefill_plan: Plan, decode_plan: Plan, shapes: _Shapes, int8: bool):
    """Jitted prefill / decode / handoff, shared by every Engine with the same key (the jit
    objects keep their compiled executables, so a second Engine does not recompile).
    `int8`: the weights are 8-bit with scales (int8 or fp8, quant.QUANTIZED)."""
    specs = part.param_specs(prefill_plan.model, prefill_plan.one_d, prefill_plan.kv_split, int8,
                             prefill_plan.experts)
    logits_spec = P(None, AXES)                  # logits B V_xyz
    b, ctx = shapes.batch, shapes.context_len
    slot_p = prefill_plan.kv_slots()

    def prefill_body(params, tokens):
        local = prefill_plan.cache_shape(b, ctx)
        cache = jnp.zeros(_local_shape(mesh, local, prefill_plan.cache_spec()), prefill_plan.cache_dtype)
        return _forward(prefill_plan, params, tokens, cache, 0, prefill=True)

    def decode_body(params, cache, token, pos):
        return _forward(decode_plan, params, token[:, None], cache, pos, prefill=False)

    prefill = jax.jit(jax.shard_map(prefill_body, mesh=mesh, in_specs=(specs, P()),
                                    out_specs=(logits_spec, prefill_plan.cache_spec())))
    decode = jax.jit(jax.shard_map(decode_body, mesh=mesh, in_specs=(specs, decode_plan.cache_spec(), P(), P()),
                                   out_specs=(logits_spec, decode_plan.cache_spec())),
                     donate_argnums=1)

    # Handoff: slot s of the decode cache reads the prefill slot holding the same KV head,
    # then the array is resharded into decode's attention sharding (one explicit step).
    first = {int(kv): s for s, kv in reversed(list(enumerate(slot_p)))}
    take = np.array([first[int(kv)] for kv in decode_plan.kv_slots()])
    same_slots = len(take) == len(slot_p) and bool((take == np.arange(len(slot_p))).all())
    identity = same_slots and prefill_plan.cache_spec() == decode_plan.cache_spec()
    decode_cache = NamedSharding(mesh, decode_plan.cache_spec())
    handoff = jax.jit(lambda c: c if same_slots else jnp.take(c, take, axis=4),
                      out_shardings=decode_cache)
    return prefill, decode, handoff, identity


@functools.lru_cache(maxsize=32)
def _extend_program(mesh: Mesh, plan: Plan, int8: bool):
    """Jitted extend in `plan`'s layout: tokens [B, L] at positions [pos, pos + L) into a KV
    cache [layers, B, ctx, ...] that holds [0, pos); the logits of position pos + last.

    The decode path of `_forward` (prefill=False) with L tokens: each layer writes the L new
    K/V at pos, then attends to the whole cache under the causal mask (key <= query
    position), so the new tokens see the cached prefix and each other, never the stale or
    padding positions beyond. One jit: it compiles once per token shape [B, L] (the
    serving loop pads a ragged last chunk to the chunk size: one program per chunk size).
    The cache is donated (written in place, as decode's)."""
    specs = part.param_specs(plan.model, plan.one_d, plan.kv_split, int8, plan.experts)

    def extend_body(params, cache, tokens, pos, last):
        return _forward(plan, params, tokens, cache, pos, prefill=False, last=last)

    return jax.jit(jax.shard_map(extend_body, mesh=mesh,
                                 in_specs=(specs, plan.cache_spec(), P(), P(), P()),
                                 out_specs=(P(None, AXES), plan.cache_spec())),
                   donate_argnums=1)


def _local_shape(mesh: Mesh, shape, spec: P):
    sizes = dict(zip(mesh.axis_names, mesh.devices.shape))
    out = []
    for dim, axes in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec))):
        axes = (axes,) if isinstance(axes, str) else (axes or ())
        out.append(dim // math.prod(sizes[a] for a in axes))
    return tuple(out)


# --------------------------------------------------------------------------- engine


def stored_params(params: dict) -> dict:
    """Model pytree (bf16 or int8) -> the engine's pytree: W_k and W_v stacked as
    w_kv [2, E, K·D], so one collective moves both (the paper fuses them, §3.4)."""
    def layer(w):
        w = dict(w)
        k, v = w.pop("w_k"), w.pop("w_v")
        # stacked on the host (no compiled stack: see Engine.__init__)
        w["w_kv"] = jax.tree.map(lambda a, b: np.stack([a, b]), k, v)
        return w
    return {**params, "layers": [layer(w) for w in params["layers"]]}


class Engine:
    """A trial's model on a mesh: stored weights, and prefill/decode/handoff programs."""

    def __init__(self, trial: TrialConfig, mesh: Mesh | None = None, params: dict | None = None):
        topology = tuple(mesh.devices.shape) if mesh is not None else trial.mesh_shape
        _validate(trial, topology)
        self.trial = dataclasses.replace(trial, topology=topology)
        # The model as run: query heads padded per trial.pad_heads (paper §4; zero heads).
        self.model: ModelConfig = self.trial.run_model
        self.mesh = mesh if mesh is not None else make_mesh(topology)
        one_d = stores_1d(trial.prefill, trial.decode)
        self.prefill_plan = Plan(self.model, topology, trial.prefill, one_d, trial.experts,
                                 trial.kv_cache)
        self.decode_plan = Plan(self.model, topology, trial.decode, one_d, trial.experts,
                                trial.kv_cache)

        # `params` (and the default init) are the unpadded model's; padding adds zero heads.
        # Built on the host and placed by one device_put, which slices NumPy arrays on the
        # host: no program is compiled for the weights (JAX arrays resharded by device_put
        # compiled a few per layout).
        source = init_params(self.model.unpadded, trial.seed) if params is None else params
        source = pad_params(source, self.model)
        int8 = trial.weights in QUANTIZED        # int8 or fp8 weights with scales (quant.py)
        self._model_params = quantize_params(source, trial.weights) if int8 else source
        specs = part.param_specs(self.model, one_d, self.prefill_plan.kv_split, int8, trial.experts)
        self.params = jax.device_put(stored_params(self._model_params),
                                     jax.tree.map(lambda s: NamedSharding(self.mesh, s), specs,
                                                  is_leaf=lambda s: isinstance(s, P)))
        shapes = _Shapes(trial.batch, trial.input_len, trial.context_len)
        self._prefill, self._decode, self._handoff, self._handoff_is_identity = _programs(
            self.mesh, self.prefill_plan, self.decode_plan, shapes, int8)

    # ---- the three programs

    def prefill(self, params, tokens):
        """tokens [B, input_len] -> (logits of the last position [B, V] f32, KV cache)."""
        return self._prefill(params, tokens)

    def handoff(self, kv_cache):
        """Reshard the KV cache from prefill's attention sharding to decode's (not part of
        either phase's timing). The same array when both phases shard it alike."""
        return kv_cache if self._handoff_is_identity else self._handoff(kv_cache)

    @property
    def handoff_is_identity(self) -> bool:
        """True when both phases shard the KV cache alike: `handoff` returns its argument."""
        return self._handoff_is_identity

    def decode(self, params, kv_cache, token, pos):
        """token [B] int32 at position pos -> (logits [B, V] f32, KV cache). The cache is donated."""
        return self._decode(params, kv_cache, jnp.asarray(token, jnp.int32), jnp.asarray(pos, jnp.int32))

    def extend(self, params, kv_cache, tokens, pos, last=None):
        """Prefill tokens [B, L] at positions [pos, pos + L) into `kv_cache` (the prefill
        layout's, [layers, B, ctx, ...], `empty_cache`), which holds positions [0, pos):
        chunked prefill (one call per chunk) and prefix caching (a cached prefix's KV, then
        the rest of the prompt). -> (logits [B, V] f32 of position pos + `last`, default the
        last token's; the updated cache). Tokens after `last` are padding: their K/V land
        beyond the prompt, where the causal mask never reads them before a later token
        overwrites them. The cache is donated; pos + L must fit in its ctx positions."""
        if not isinstance(tokens, jax.Array):     # replicated, as decode's token input
            tokens = jax.device_put(np.asarray(tokens, np.int32), NamedSharding(self.mesh, P()))
        length, ctx = tokens.shape[1], kv_cache.shape[2]
        if isinstance(pos, (int, np.integer)) and not 0 <= pos <= ctx - length:
            raise ConfigError("pos", int(pos), f"0 to {ctx - length} (the {length} tokens must fit "
                              f"in the cache's {ctx} positions)")
        last = length - 1 if last is None else last
        if isinstance(last, (int, np.integer)) and not 0 <= last < length:
            raise ConfigError("last", int(last), f"0 to {length - 1} (a token of the extend)")
        if self.model.moe:
            raise ConfigError("model.moe", True, "a dense model (extend, chunked prefill and "
                              "prefix caching run dense models only)")
        return _extend_program(self.mesh, self.prefill_plan, self.trial.weights in QUANTIZED)(
            params, kv_cache, tokens, jnp.asarray(pos, jnp.int32), jnp.asarray(last, jnp.int32))

    def empty_cache(self, batch: int | None = None, context: int | None = None) -> jax.Array:
        """A zero KV cache in the prefill layout [layers, batch, context, ...] (default the
        trial's batch and context_len): `extend`'s starting point."""
        plan = self.prefill_plan
        shape = plan.cache_shape(self.trial.batch if batch is None else batch,
                                 self.trial.context_len if context is None else context)
        return _zeros_program(self.mesh, shape, plan.cache_dtype, plan.cache_spec())()

    # ---- conveniences

    def input_tokens(self) -> jax.Array:
        """The trial's deterministic prompt [B, input_len] (from trial.seed)."""
        t = self.trial
        tokens = prompt_tokens(self.model, t.batch, t.input_len, t.seed)
        return jax.device_put(tokens, NamedSharding(self.mesh, P()))

    def generate(self, tokens=None, steps: int | None = None):
        """Greedy: (logits per step [steps + 1 of [B, V]], tokens [B, steps + 1])."""
        steps = self.trial.decode_steps if steps is None else steps
        if steps > self.trial.decode_steps:
            raise ConfigError("steps", steps, f"at most decode_steps={self.trial.decode_steps} "
                              "(the KV cache holds input_len + decode_steps positions)")
        tokens = self.input_tokens() if tokens is None else tokens
        logits, cache = self.prefill(self.params, tokens)
        cache = self.handoff(cache)
        token = self.greedy(logits)
        run = decode_loop(self.decode, self.greedy, self.params, cache, token,
                          self.positions(steps), keep_logits=True)
        generated = [token] + run.tokens
        return [logits] + run.logits, np.stack([np.asarray(t) for t in generated], axis=1)

    def greedy(self, logits) -> jax.Array:
        """logits [B, V] -> the next token [B] int32, replicated as decode takes it."""
        return _greedy_program(self.mesh, self.model.unpadded.vocab)(logits)

    def positions(self, steps: int | None = None) -> list[jax.Array]:
        """Decode step i's position (input_len + i) as a replicated device scalar, made before
        a timed loop so the loop only dispatches."""
        steps = self.trial.decode_steps if steps is None else steps
        replicated = NamedSharding(self.mesh, P())
        return [jax.device_put(jnp.int32(self.trial.input_len + i), replicated) for i in range(steps)]

    def reference_params(self) -> dict:
        """Unsharded bf16 weights the engine computes with (dequantised for int8/fp8), without
        the zero padded heads: run the reference on `self.model.unpadded` (= trial.model)
        with these to compare like with like."""
        params = self._model_params
        if self.trial.weights in QUANTIZED:
            params = dequantize_params(params)
        return unpad_params(params, self.model)

    def cache_sharding(self, phase: str) -> NamedSharding:
        plan = self.prefill_plan if phase == "prefill" else self.decode_plan
        return NamedSharding(self.mesh, plan.cache_spec())

    def cache_struct(self, phase: str) -> jax.ShapeDtypeStruct:
        plan = self.prefill_plan if phase == "prefill" else self.decode_plan
        shape = plan.cache_shape(self.trial.batch, self.trial.context_len)
        return jax.ShapeDtypeStruct(shape, plan.cache_dtype, sharding=self.cache_sharding(phase))

    def lowered(self) -> dict:
        """{"prefill", "decode", "handoff"}: jax.stages.Lowered, for compiled-program analysis."""
        t, replicated = self.trial, NamedSharding(self.mesh, P())
        tokens = jax.ShapeDtypeStruct((t.batch, t.input_len), jnp.int32, sharding=replicated)
        token = jax.ShapeDtypeStruct((t.batch,), jnp.int32, sharding=replicated)
        pos = jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated)
        return {
            "prefill": self._prefill.lower(self.params, tokens),
            "decode": self._decode.lower(self.params, self.cache_struct("decode"), token, pos),
            "handoff": self._handoff.lower(self.cache_struct("prefill")),
        }


@functools.lru_cache(maxsize=16)
def _greedy_program(mesh: Mesh, vocab: int):
    """argmax over the (vocab-sharded) logits, output replicated: decode's token input.
    Padded tokens (index >= vocab, layouts.padded_vocab_size) are masked: never generated."""
    def greedy(logits):
        real = jnp.arange(logits.shape[-1]) < vocab
        return jnp.argmax(jnp.where(real, logits, -jnp.inf), axis=-1).astype(jnp.int32)
    return jax.jit(greedy, out_shardings=NamedSharding(mesh, P()))


@functools.lru_cache(maxsize=16)
def _zeros_program(mesh: Mesh, shape: tuple, dtype, spec: P):
    """A zero array made on the mesh in its sharding (nothing built on the host). Made by a
    shard_map, as the programs' outputs are, so that its sharding is written as theirs: an
    equal sharding written otherwise (`P(('z', 'y', 'x'))` for `P('z')` on a 1x1x2 mesh)
    would compile the extend program a second time."""
    local = _local_shape(mesh, shape, spec)
    return jax.jit(jax.shard_map(lambda: jnp.zeros(local, dtype), mesh=mesh, in_specs=(),
                                 out_specs=spec))


@dataclasses.dataclass
class Decoded:
    """What `decode_loop` returns: device arrays, not yet synchronised."""

    cache: jax.Array
    tokens: list            # the greedy token after each step, [B] int32
    logits: list            # each step's logits [B, V] (empty unless kept)


def decode_loop(decode, greedy, params, cache, token, positions, keep_logits: bool = False) -> Decoded:
    """Greedy decode, one step per position. The one decode loop: `Engine.generate` and
    the timed runs of workloads/measure.py both call it.

    Nothing here waits for the device: each step's program is dispatched as soon as the
    previous one is queued (its outputs are futures), as a serving loop runs. A caller that
    times it synchronises once, after the last step (docs/architecture.md, "Measurement protocol")."""
    tokens, kept = [], []
    for pos in positions:
        logits, cache = decode(params, cache, token, pos)
        token = greedy(logits)
        tokens.append(token)
        if keep_logits:
            kept.append(logits)
    return Decoded(cache, tokens, kept)


def _validate(trial: TrialConfig, topology: tuple[int, int, int]) -> None:
    """Everything that can be wrong with a trial, before any compilation."""
    x, y, z = topology
    if trial.topology is not None and tuple(trial.topology) != tuple(topology):
        raise ConfigError("topology", "x".join(map(str, trial.topology)),
                          f"the mesh's topology {x}x{y}x{z}")
    if x * y * z != trial.chips:
        raise ConfigError("topology", f"{x}x{y}x{z}", f"X*Y*Z equal to chips={trial.chips}")
    one_of("weights", trial.weights, WEIGHT_FORMATS)
    one_of("kv_cache", trial.kv_cache, KV_FORMATS)
    for phase in ("prefill", "decode"):
        if not isinstance(getattr(trial, phase), PhaseLayout):
            raise ConfigError(phase, getattr(trial, phase), "a PhaseLayout(ffn, attn)")
    model = resolve_padding(trial.model, trial.pad_heads, topology, trial.prefill, trial.decode,
                            pad_vocab=trial.pad_vocab)
    validate_layouts(model, topology, trial.prefill, trial.decode, trial.batch,
                     experts=trial.experts)
    check_model(model)
