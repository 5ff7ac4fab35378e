"""Pipeline stages on the emulated mesh (issue 38, item 4): a slice's chips as S equal groups,
each a mesh of its own that holds n_layers/S consecutive layers and their KV cache, the
residual stream passed from one stage's mesh to the next (`jax.device_put`, the inter-stage
transfer). The first stage also embeds, the last also runs the final norm and unembeds.

    engine = StagedEngine(trial, stages=2, micro_batches=2)   # trial: ONE stage's mesh
    logits, tokens = engine.generate()                         # as Engine.generate
    server = StagedSlotServer(spec, stages=2)                  # as SlotServer (spec: one stage)
    served = serve_aggregated(server, requests, prompt)        # the serving loop, unchanged

Within a stage everything is the engine's own (workloads/engine.py): the same layer function
(`_layer`), embedding and unembedding (partitioning.py), stored weights (`stored_params`,
`param_specs`), KV-cache layouts and greedy program, with the stage's layers only. Stage s
runs on devices [s * stage_chips, (s + 1) * stage_chips).

Micro-batches: a batch is split into M micro-batches and the stages' programs are issued in
pipeline order (stage s on micro-batch m while stage s + 1 is on m - 1; JAX dispatch is
asynchronous, so programs on different devices overlap as far as the host's cores allow).
One decode step of all slots still ends with every token on the host (the serving loop's
step), so each step has its fill-and-drain bubble: S + M - 1 stage-slots for M
micro-batches (GPipe-style; the pipeline does not carry micro-batches over from one step to
the next).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from workloads import partitioning as part
from workloads.config import ConfigError, ModelConfig, check_stages
from workloads.engine import (_greedy_program, _layer, _local_shape, _programs, _Shapes,
                              _validate, make_mesh, stored_params)
from workloads.layouts import AXES, WEIGHT_FORMATS, stores_1d, validate_phase
from workloads.model import init_params, pad_params, prompt_tokens
from workloads.partitioning import Plan
from workloads.quant import QUANTIZED, quantize_params
from workloads.serving.slots import Prefilled, SlotServer, SlotSpec, _insert_program, prompt_batch
from workloads.trial import TrialConfig
from workloads.validate import is_int, one_of


# --------------------------------------------------------------------------- checks


def check_micro_batches(micro_batches, batch: int, field: str = "micro_batches") -> None:
    if not is_int(micro_batches) or micro_batches < 1 or batch % micro_batches:
        raise ConfigError(field, micro_batches, f"a divisor of the batch {batch} "
                          "(micro-batches of equal size)")


def stage_devices(stages: int, stage_chips: int, devices=None) -> list[list]:
    """Stage s's devices: [s * stage_chips, (s + 1) * stage_chips) of `devices` (default all)."""
    devices = list(jax.devices() if devices is None else devices)
    need = stages * stage_chips
    if need > len(devices):
        raise ConfigError("stages", stages, f"stages x {stage_chips} chips per stage = {need} "
                          f"at most the {len(devices)} devices on this host (emulate more with "
                          f"XLA_FLAGS=--xla_force_host_platform_device_count={need} set before "
                          "JAX is imported)")
    return [devices[s * stage_chips:(s + 1) * stage_chips] for s in range(stages)]


# --------------------------------------------------------------------------- one stage


def residual_spec(plan: Plan) -> P:
    """The residual stream B_G L E_R as a global array (partitioning.embed's layout: G and R
    are in mesh order, G a prefix of x, y, z), what crosses from one stage to the next."""
    return P(plan.gather or None, None, plan.rest or None)


def stage_param_specs(plan: Plan, int8: bool, first: bool, last: bool) -> dict:
    """`partitioning.param_specs` of a stage's model (its layers only), keeping the embedding
    on the first stage and the final norm and unembedding on the last (a tied model's
    unembedding is the embedding: the last stage holds it too)."""
    specs = part.param_specs(plan.model, plan.one_d, plan.kv_split, int8, plan.experts)
    return _stage_pytree(specs, plan.model.tie_embeddings, first, last)


def _stage_pytree(tree: dict, tied: bool, first: bool, last: bool) -> dict:
    keep = {"layers"}
    if first or (last and tied):
        keep.add("embed")
    if last:
        keep |= {"final_norm", "unembed"}
    return {k: v for k, v in tree.items() if k in keep}


def _run_stage(plan: Plan, params, inp, cache, pos, prefill: bool, first: bool, last: bool):
    """Per chip inside shard_map: embed (first stage), the stage's layers (the engine's
    `_layer`, cache index local to the stage), unembed the last position (last stage)."""
    x = part.embed(plan, inp, params["embed"]) if first else inp
    for i, w in enumerate(params["layers"]):
        x, cache = _layer(plan, x, w, cache, i, pos, prefill)
    if not last:
        return x, cache
    tied = "unembed" not in params
    table = params["embed"] if tied else params["unembed"]
    return part.unembed(plan, x[:, -1], params["final_norm"], table, tied), cache


@functools.lru_cache(maxsize=128)
def _stage_programs(mesh: Mesh, prefill_plan: Plan, decode_plan: Plan, shapes: _Shapes,
                    int8: bool, first: bool, last: bool):
    """A stage's jitted prefill (tokens or residual -> residual or logits, and the stage's
    KV cache) and decode (the same for one token per row; the cache donated)."""
    specs = stage_param_specs(prefill_plan, int8, first, last)
    b, ctx = shapes.batch, shapes.context_len

    def io_specs(plan):
        into = P() if first else residual_spec(plan)              # tokens are replicated
        out = P(None, AXES) if last else residual_spec(plan)      # logits B V_xyz
        return into, out

    def prefill_body(params, inp):
        local = _local_shape(mesh, prefill_plan.cache_shape(b, ctx), prefill_plan.cache_spec())
        cache = jnp.zeros(local, prefill_plan.cache_dtype)
        return _run_stage(prefill_plan, params, inp, cache, 0, True, first, last)

    def decode_body(params, cache, inp, pos):
        inp = inp[:, None] if first else inp                      # token [B] -> [B, 1]
        return _run_stage(decode_plan, params, inp, cache, pos, False, first, last)

    p_in, p_out = io_specs(prefill_plan)
    d_in, d_out = io_specs(decode_plan)
    prefill = jax.jit(jax.shard_map(prefill_body, mesh=mesh, in_specs=(specs, p_in),
                                    out_specs=(p_out, prefill_plan.cache_spec())))
    decode = jax.jit(jax.shard_map(decode_body, mesh=mesh,
                                   in_specs=(specs, decode_plan.cache_spec(), d_in, P()),
                                   out_specs=(d_out, decode_plan.cache_spec())),
                     donate_argnums=1)
    return prefill, decode


@dataclasses.dataclass
class Stage:
    """One pipeline stage: its mesh, layers, plans (a model of its layers only) and weights."""

    index: int
    layers: range
    mesh: Mesh
    prefill_plan: Plan
    decode_plan: Plan
    first: bool
    last: bool
    params: dict = dataclasses.field(default_factory=dict)

    def programs(self, shapes: _Shapes, int8: bool):
        return _stage_programs(self.mesh, self.prefill_plan, self.decode_plan, shapes, int8,
                               self.first, self.last)

    def handoff(self, shapes: _Shapes, int8: bool):
        """The engine's KV-cache handoff for this stage's layers (prefill -> decode sharding):
        `_programs` builds it (its prefill/decode jits are never traced here)."""
        _, _, handoff, identity = _programs(self.mesh, self.prefill_plan, self.decode_plan,
                                            shapes, int8)
        return (lambda c: c) if identity else handoff

    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, P())

    def residual(self, phase: str) -> NamedSharding:
        plan = self.prefill_plan if phase == "prefill" else self.decode_plan
        return NamedSharding(self.mesh, residual_spec(plan))


# --------------------------------------------------------------------------- the staged engine


class StagedEngine:
    """A trial's model in `stages` pipeline stages. `trial` describes ONE stage (its chips,
    topology and layouts, as a plan's PhaseSlice.topology does); the engine spans stages x
    trial.chips devices. `micro_batches`: how many pieces `generate` splits the batch into."""

    def __init__(self, trial: TrialConfig, stages: int, micro_batches: int = 1, devices=None,
                 params: dict | None = None):
        check_stages(trial.model, stages)
        topology = tuple(trial.mesh_shape)
        _validate(trial, topology)                  # the engine's checks, on one stage's mesh
        check_micro_batches(micro_batches, trial.batch)
        self.trial = dataclasses.replace(trial, topology=topology)
        self.model: ModelConfig = self.trial.run_model
        micro = trial.batch // micro_batches
        for phase in ("prefill", "decode"):         # each micro-batch is a batch of its own
            validate_phase(self.model, topology, getattr(trial, phase), micro, phase,
                           experts=trial.experts)
        self.micro_batches = micro_batches
        groups = stage_devices(stages, trial.chips, devices)

        source = init_params(self.model.unpadded, trial.seed) if params is None else params
        source = pad_params(source, self.model)
        self.int8 = trial.weights in QUANTIZED      # int8 or fp8 weights with scales (quant.py)
        stored = stored_params(quantize_params(source, trial.weights) if self.int8 else source)
        per_stage = self.model.n_layers // stages
        one_d = stores_1d(trial.prefill, trial.decode)
        stage_model = dataclasses.replace(self.model, n_layers=per_stage)
        self.stages: list[Stage] = []
        for s, group in enumerate(groups):
            stage = Stage(s, range(s * per_stage, (s + 1) * per_stage), make_mesh(topology, group),
                          Plan(stage_model, topology, trial.prefill, one_d, trial.experts,
                               trial.kv_cache),
                          Plan(stage_model, topology, trial.decode, one_d, trial.experts,
                               trial.kv_cache),
                          first=s == 0, last=s == stages - 1)
            stage.params = self._place(stage, stored)
            self.stages.append(stage)

    def _place(self, stage: Stage, stored: dict) -> dict:
        """The stage's weights on its mesh, in the stored layout (one device_put from the
        host, as Engine does)."""
        mine = {**stored, "layers": stored["layers"][stage.layers.start:stage.layers.stop]}
        mine = _stage_pytree(mine, self.model.tie_embeddings, stage.first, stage.last)
        specs = stage_param_specs(stage.prefill_plan, self.int8, stage.first, stage.last)
        return jax.device_put(mine, jax.tree.map(lambda s: NamedSharding(stage.mesh, s), specs,
                                                 is_leaf=lambda s: isinstance(s, P)))

    @property
    def first(self) -> Stage:
        return self.stages[0]

    @property
    def last(self) -> Stage:
        return self.stages[-1]

    # ---- the pipeline

    def run(self, phase: str, inputs: list, shapes: _Shapes, caches: list | None = None,
            positions: list | None = None):
        """Every micro-batch through every stage, issued in pipeline order (wave t runs stage
        s on micro-batch t - s, the earlier stages first so that the next micro-batch is
        queued before the host waits on a transfer). `inputs[m]`: micro-batch m's tokens on
        the first stage's mesh; decode: `caches[m][s]` (donated) and `positions[m][s]` (on
        stage s's mesh). -> (logits per micro-batch on the last stage's mesh, caches[m][s])."""
        stages, micro = len(self.stages), len(inputs)
        acts = list(inputs)
        out_caches = [[None] * stages for _ in range(micro)]
        for wave in range(stages + micro - 1):
            for s in range(stages):
                m = wave - s
                if not 0 <= m < micro:
                    continue
                stage = self.stages[s]
                x = acts[m] if stage.first else jax.device_put(acts[m], stage.residual(phase))
                prefill, decode = stage.programs(shapes, self.int8)
                if phase == "prefill":
                    acts[m], out_caches[m][s] = prefill(stage.params, x)
                else:
                    acts[m], out_caches[m][s] = decode(stage.params, caches[m][s], x,
                                                       positions[m][s])
        return acts, out_caches

    def greedy(self, logits) -> jax.Array:
        """logits [B, V] on the last stage -> next token [B], replicated there (Engine.greedy)."""
        return _greedy_program(self.last.mesh, self.model.unpadded.vocab)(logits)

    def split(self, rows, micro_batches: int, stage: Stage | None = None) -> list:
        """A batch's rows (host array or a device array) as micro-batches on `stage`'s mesh
        (replicated), default the first stage's."""
        stage = self.first if stage is None else stage
        size = len(rows) // micro_batches
        return [jax.device_put(rows[m * size:(m + 1) * size], stage.replicated())
                for m in range(micro_batches)]

    def input_tokens(self) -> np.ndarray:
        t = self.trial
        return prompt_tokens(self.model, t.batch, t.input_len, t.seed)

    def generate(self, tokens=None, steps: int | None = None):
        """Greedy, as `Engine.generate`: (logits per step [steps + 1 of [B, V]] on the host,
        tokens [B, steps + 1])."""
        t = self.trial
        steps = t.decode_steps if steps is None else steps
        if steps > t.decode_steps:
            raise ConfigError("steps", steps, f"at most decode_steps={t.decode_steps}")
        tokens = np.asarray(self.input_tokens() if tokens is None else tokens, np.int32)
        micro = self.micro_batches
        shapes = _Shapes(t.batch // micro, t.input_len, t.context_len)
        logits, caches = self.run("prefill", self.split(tokens, micro), shapes)
        handoffs = [stage.handoff(shapes, self.int8) for stage in self.stages]
        caches = [[handoffs[s](c) for s, c in enumerate(row)] for row in caches]
        kept, generated = [logits], [[self.greedy(l) for l in logits]]
        for i in range(steps):
            pos = [[jax.device_put(jnp.int32(t.input_len + i), s.replicated()) for s in self.stages]
                   for _ in range(micro)]
            feed = [jax.device_put(token, self.first.replicated()) for token in generated[-1]]
            logits, caches = self.run("decode", feed, shapes, caches, pos)
            kept.append(logits)
            generated.append([self.greedy(l) for l in logits])
        host_logits = [np.concatenate([np.asarray(l) for l in step]) for step in kept]
        host_tokens = np.stack([np.concatenate([np.asarray(x) for x in step])
                                for step in generated], axis=1)
        return host_logits, host_tokens

    def transfer_seconds(self, phase: str, batch: int, length: int, repeats: int = 20) -> list[float]:
        """Seconds of one synchronised inter-stage transfer (stage 0 -> stage 1) of a residual
        stream [batch, length, E] bf16, `repeats` times (empty with one stage)."""
        if len(self.stages) < 2:
            return []
        x = jax.device_put(jnp.zeros((batch, length, self.model.d_model), jnp.bfloat16),
                           self.first.residual(phase))
        jax.block_until_ready(x)
        target = self.stages[1].residual(phase)
        times = []
        for _ in range(repeats + 1):
            start = time.perf_counter()
            jax.block_until_ready(jax.device_put(x, target))
            times.append(time.perf_counter() - start)
        return times[1:]


# --------------------------------------------------------------------------- serving


class StagedSlotServer:
    """`SlotServer`'s interface (workloads/serving/slots.py) on `stages` pipeline stages, so that
    `serve_aggregated`, `serve_prefill_slice` and `serve_decode_slice` run it unchanged.
    `spec.topology` is ONE stage's mesh (a plan's PhaseSlice.topology); the server spans
    stages x spec.chips devices. Decode slots are split into `micro_batches` (each a valid
    decode batch); a prefill call is one micro-batch. One by default: on the emulated CPU
    mesh the stages share the host's few cores, so micro-batches overlap little and each
    adds its programs' dispatches (measured slower, docs/engine.md "Pipeline stages")."""

    def __init__(self, spec: SlotSpec, stages: int, micro_batches: int = 1, devices=None):
        if spec.prefill is None and spec.decode is None:
            raise ConfigError("roles", None, "a prefill layout, a decode layout or both")
        one_of("weights", spec.weights, WEIGHT_FORMATS)
        prefill, decode = spec.prefill or spec.decode, spec.decode or spec.prefill
        self.spec = spec
        trial = TrialConfig(model=spec.model, chips=spec.chips,
                            batch=math.lcm(spec.prefill_batch, spec.slots), input_len=1,
                            decode_steps=max(spec.context_len - 1, 0),
                            topology=tuple(spec.topology), weights=spec.weights, prefill=prefill,
                            decode=decode, seed=spec.seed, pad_heads=spec.pad_heads)
        check_stages(spec.model, stages)
        if spec.chunk or spec.prefix_len:       # both need the engine's extend program
            raise ConfigError("chunk" if spec.chunk else "prefix_len", spec.chunk or
                              spec.prefix_len, "0 on a staged server (no extend program)")
        check_micro_batches(micro_batches, spec.slots)
        self.engine = StagedEngine(trial, stages, devices=devices)
        self.model = self.engine.model
        if spec.prefill is not None:
            validate_phase(self.model, spec.topology, spec.prefill, spec.prefill_batch, "prefill")
        if spec.decode is not None:
            validate_phase(self.model, spec.topology, spec.decode, spec.slots // micro_batches,
                           "decode")
        self.micro_batches = micro_batches
        self.stages = self.engine.stages
        self.mesh = self.engine.first.mesh          # the first stage's (SlotServer has one)
        self.devices = [d for stage in self.stages for d in stage.mesh.devices.flat]
        if spec.decode is not None:
            size = spec.slots // micro_batches
            self._caches = [[jax.device_put(jnp.zeros(s.decode_plan.cache_shape(size, spec.context_len),
                                                      s.decode_plan.cache_dtype),
                                            NamedSharding(s.mesh, s.decode_plan.cache_spec()))
                             for s in self.stages] for _ in range(micro_batches)]
            self.tokens = np.zeros(spec.slots, np.int32)
            self.positions = np.zeros(spec.slots, np.int32)
            self.active = np.zeros(spec.slots, bool)
            self._decode_shapes = _Shapes(size, 1, spec.context_len)

    @property
    def cache(self) -> list:
        """The decode caches, [micro-batch][stage] (a pytree: `jax.block_until_ready` takes it)."""
        return self._caches

    # ---- prefill

    def prefill(self, prompts, cached_len: int = 0) -> Prefilled:
        """As `SlotServer.prefill`; the `Prefilled.cache` is a tuple of the stages' caches.
        No prefix caching: the stages have no extend program (`cached_len` must be 0)."""
        if cached_len:
            raise ConfigError("cached_len", cached_len, "0 (a staged server prefills whole "
                              "prompts: no prefix caching)")
        batch, n, length = prompt_batch(self.spec, prompts)
        start = time.perf_counter()
        shapes = _Shapes(self.spec.prefill_batch, length, length)
        (logits,), (caches,) = self.engine.run("prefill", self.engine.split(batch, 1), shapes)
        first = np.asarray(self.engine.greedy(logits))[:n]
        return Prefilled(first, tuple(caches), length, time.perf_counter() - start, logits)

    def export_kv(self, done: Prefilled, row: int) -> np.ndarray:
        """Row `row`'s KV cache as the logical host array [layers, L, 2, K, D] of all stages'
        layers (SlotServer.export_kv's form: any decode server can insert it)."""
        slots = self.engine.first.prefill_plan.kv_slots()
        first = [int(np.flatnonzero(slots == kv)[0]) for kv in range(self.model.n_kv_heads)]
        return np.concatenate([np.asarray(c[:, row])[:, :, :, first] for c in done.cache])

    # ---- slots

    def insert(self, slot: int, kv, row: int, first_token: int) -> None:
        """As `SlotServer.insert`: each stage's layers of the KV go into its cache of the
        slot's micro-batch."""
        if self.spec.decode is None:
            raise ConfigError("decode", None, "a server with a decode layout")
        if not 0 <= slot < self.spec.slots:
            raise ConfigError("slot", slot, f"0 to {self.spec.slots - 1}")
        if isinstance(kv, Prefilled):
            sources, length = kv.cache, kv.prompt_len
            src_slots = tuple(int(s) for s in self.engine.first.prefill_plan.kv_slots())
        else:
            kv = np.asarray(kv)
            if kv.shape[0] != self.model.n_layers or kv.shape[3] != self.model.n_kv_heads:
                raise ConfigError("kv", kv.shape, f"[{self.model.n_layers}, L, 2, "
                                  f"{self.model.n_kv_heads}, D] (the decode model's layers and "
                                  "KV heads)")
            sources = [jax.device_put(kv[s.layers.start:s.layers.stop, None], s.replicated())
                       for s in self.stages]
            src_slots, length, row = tuple(range(kv.shape[3])), kv.shape[1], 0
        if length >= self.spec.context_len:
            raise ConfigError("input_len", length, f"less than context_len={self.spec.context_len}")
        size = self.spec.slots // self.micro_batches
        m, local = divmod(slot, size)
        for s, (stage, source) in enumerate(zip(self.stages, sources)):
            plan = stage.decode_plan
            program = _insert_program(stage.mesh, plan.cache_spec(), src_slots,
                                      tuple(int(k) for k in plan.kv_slots()))
            self._caches[m][s] = program(self._caches[m][s], source, jnp.int32(row),
                                         jnp.int32(local))
        self.tokens[slot], self.positions[slot], self.active[slot] = first_token, length, True

    release = SlotServer.release           # the slots' bookkeeping is the same
    _check_room = SlotServer._check_room

    def step(self) -> np.ndarray:
        """One decode step of every slot, the micro-batches pipelined through the stages:
        the next token of each slot [slots], on the host."""
        self._check_room()
        micro = self.micro_batches
        inputs = self.engine.split(self.tokens, micro)
        positions = list(zip(*[self.engine.split(self.positions, micro, s) for s in self.stages]))
        logits, self._caches = self.engine.run("decode", inputs, self._decode_shapes,
                                               self._caches, positions)
        self._last_logits = logits
        tokens = [self.engine.greedy(l) for l in logits]     # all queued before any wait
        out = np.concatenate([np.asarray(t) for t in tokens])
        self.tokens = np.where(self.active, out, 0).astype(np.int32)
        self.positions = np.where(self.active, self.positions + 1, 0).astype(np.int32)
        return out

    @property
    def last_logits(self) -> np.ndarray:
        """The last step's logits [slots, V] f32, on the host (tests compare them)."""
        return np.concatenate([np.asarray(l) for l in self._last_logits])

    def warm_up(self, prompt_len: int, repeats: int = 9, cached_len: int = 0) -> dict[str, float]:
        """`SlotServer.warm_up` (every program compiled and run, then timed: prefill_s,
        decode_step_s), plus `transfer_s`: the median synchronised inter-stage transfer of
        one decode micro-batch's residual stream (with more than one stage)."""
        times = SlotServer.warm_up(self, prompt_len, repeats, cached_len)   # its interface only
        if self.spec.decode is not None and len(self.stages) > 1:
            size = self.spec.slots // self.micro_batches
            times["transfer_s"] = float(np.median(
                self.engine.transfer_seconds("decode", size, 1, repeats)))
        return times


def slot_server(spec: SlotSpec, stages: int = 1, mesh=None):
    """The slot server for a slice of `stages` pipeline stages: `SlotServer` for one, else
    `StagedSlotServer` (spec.topology: one stage's mesh)."""
    return SlotServer(spec, mesh=mesh) if stages == 1 else StagedSlotServer(spec, stages)
