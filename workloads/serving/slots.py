"""Slot serving on the sharded engine: a decode batch of fixed slots, each holding one
request at its own position, refilled by inserting freshly prefilled requests between
decode steps (iteration-level batching, as JetStream's slots and vLLM do; issue 19).

    server = SlotServer(SlotSpec(model, topology, prefill=..., decode=..., slots=4,
                                 prefill_batch=1, context_len=96))
    first, kv = server.prefill(prompts)          # prompts [n <= prefill_batch, L]
    staged = server.begin_prompt(prompt)         # chunked prefill (SlotSpec.chunk > 0):
    done = server.prefill_chunk(staged)          # ... a Prefilled after the last chunk
    server.insert(slot, kv, row, first[row])      # between decode steps
    tokens = server.step()                        # next token of every slot [slots]
    server.release(slot)
    served = serve_aggregated(server, requests, prompt, start_at)   # the aggregated loop

The programs are the engine's own (`workloads/engine.py` `_programs`): prefill as in a
trial, decode with a vector of per-row positions (`partitioning.attend_rows`). A slot's
cache row keeps stale K/V past its position from an earlier request; the causal mask never
reads them and each step writes its position before attending.

Chunked prefill (`SlotSpec.chunk`, aggregated only; Sarathi-Serve, vLLM): a prompt is
prefilled `chunk` tokens at a time into a staging KV cache by the engine's extend program
(workloads/engine.py `Engine.extend`), one chunk per loop iteration after the decode step,
its first token after its last chunk; then it takes a slot as a whole prompt does. Prefix
caching (`SlotSpec.prefix_len`): the server computes the shared prefix's KV once when it is
built; a request that starts with it (`Request.cached_len` > 0) prefills only the rest of
its prompt, extending a copy of that KV.

Roles: an aggregated server runs both phases on one mesh (weights stored once for both
layouts); a disaggregated deployment runs a prefill-only server and a decode-only server
on two meshes and hands the KV cache over as a logical array [layers, L, 2, K, D]
(`export_kv` / `insert(..., kv=ndarray)`), which the decode side lays out for its own
attention sharding.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import queue
import time
from collections import deque
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from workloads.config import ConfigError, ModelConfig
from workloads.layouts import WEIGHT_FORMATS, PhaseLayout, validate_phase
from workloads.partitioning import write_rows
from workloads.quant import QUANTIZED
from workloads.serving.profile import Request
from workloads.validate import integer, one_of


@dataclasses.dataclass(frozen=True)
class SlotSpec:
    """One serving mesh: its model, topology, the layouts of the phases it runs (None: the
    phase runs elsewhere), decode slots, prompts per prefill call and the slots' KV length."""

    model: ModelConfig
    topology: tuple[int, int, int]
    prefill: PhaseLayout | None
    decode: PhaseLayout | None
    slots: int = 1
    prefill_batch: int = 1
    context_len: int = 64            # the longest prompt + answer a slot holds
    weights: str = "bf16"
    seed: int = 0
    pad_heads: str | int = "auto"
    chunk: int = 0                   # prompt tokens per chunked-prefill step (0: whole prompts)
    prefix_len: int = 0              # the shared prefix's tokens whose KV is cached (0: none)

    @property
    def chips(self) -> int:
        return math.prod(self.topology)


PREFIX_SEED = 424_242      # the shared prefix's tokens: the same in every stream (a system prompt)


@functools.lru_cache(maxsize=8)
def shared_prefix(model: ModelConfig, prefix_len: int) -> np.ndarray:
    """The shared prefix every prefix-hitting request starts with [prefix_len] int32 (a
    request with cached_len < prefix_len starts with its first cached_len tokens)."""
    from workloads.model import prompt_tokens   # lazy, as hostcosts.prompt_for

    prefix = prompt_tokens(model, 1, prefix_len, PREFIX_SEED)[0]
    prefix.setflags(write=False)
    return prefix


def with_shared_prefix(model: ModelConfig, prompt, cached_len: int, prefix_len: int) -> np.ndarray:
    """A request's prompt [L] with its first `cached_len` tokens the shared prefix's (prefix
    caching; `prefix_len`: the prefix the servers cache)."""
    prompt = np.array(prompt, np.int32)
    if cached_len:
        prompt[:cached_len] = shared_prefix(model.unpadded, max(prefix_len, cached_len))[:cached_len]
    return prompt


@dataclasses.dataclass
class Staged:
    """A prompt being prefilled in chunks: its tokens, the next position to prefill and the
    staging KV cache (prefill layout, [layers, chunk_rows, context_len + chunk, ...])."""

    prompt: np.ndarray
    pos: int
    cache: jax.Array
    began: float                     # perf_counter when its first chunk began

    @property
    def remaining(self) -> int:
        return len(self.prompt) - self.pos


@dataclasses.dataclass
class Prefilled:
    """A prefill call's output: first tokens [rows] and the KV cache on the prefill mesh."""

    first_tokens: np.ndarray
    cache: jax.Array                 # [layers, prefill_batch, L, 2, slots_p, D]
    prompt_len: int
    seconds: float = 0.0
    logits: jax.Array | None = None  # [prefill_batch, V] f32             # wall time of the call, tokens on the host


class SlotServer:
    """The engine serving a slot batch on one mesh (see the module docstring)."""

    def __init__(self, spec: SlotSpec, mesh=None):
        from workloads.engine import Engine, make_mesh
        from workloads.trial import TrialConfig

        if spec.prefill is None and spec.decode is None:
            raise ConfigError("roles", None, "a prefill layout, a decode layout or both")
        one_of("weights", spec.weights, WEIGHT_FORMATS)
        _check_chunk_prefix(spec)
        prefill = spec.prefill or spec.decode
        decode = spec.decode or spec.prefill
        self.spec = spec
        self.mesh = mesh if mesh is not None else make_mesh(spec.topology)
        # One batch validates both phases in the engine; each phase's own batch first.
        batch = math.lcm(spec.prefill_batch, spec.slots)
        trial = TrialConfig(model=spec.model, chips=spec.chips, batch=batch, input_len=1,
                            decode_steps=max(spec.context_len - 1, 0), topology=tuple(spec.topology),
                            weights=spec.weights, prefill=prefill, decode=decode, seed=spec.seed,
                            pad_heads=spec.pad_heads)
        run_model = trial.run_model
        if spec.prefill is not None:
            validate_phase(run_model, spec.topology, spec.prefill, spec.prefill_batch, "prefill")
        if spec.decode is not None:
            validate_phase(run_model, spec.topology, spec.decode, spec.slots, "decode")
        self.engine = Engine(trial, mesh=self.mesh)
        self.model = self.engine.model
        self.params = self.engine.params
        self._int8 = spec.weights in QUANTIZED     # int8 or fp8 weights with scales
        self._replicated = NamedSharding(self.mesh, P())
        if spec.decode is not None:
            plan = self.engine.decode_plan
            shape = plan.cache_shape(spec.slots, spec.context_len)
            self.cache = jax.device_put(jnp.zeros(shape, jnp.bfloat16),
                                        NamedSharding(self.mesh, plan.cache_spec()))
            self.tokens = np.zeros(spec.slots, np.int32)
            self.positions = np.zeros(spec.slots, np.int32)
            self.active = np.zeros(spec.slots, bool)
        plan = self.engine.prefill_plan
        # a chunk runs one prompt: the fewest rows the prefill layout splits (the batch
        # over its gathered axes, and over every chip for batch-sharded attention)
        self.chunk_rows = math.lcm(plan.n_gather, plan.n if plan.batch_attention else 1)
        # the staging cache of a chunked or prefix-extended prompt: a padded last chunk
        # writes up to `chunk` positions past the prompt (never read; insert cuts them off)
        self.staging_len = spec.context_len + spec.chunk
        self._prefix: dict[int, jax.Array] = {}    # rows -> the shared prefix's KV
        if spec.prefix_len and spec.prefill is not None:   # set-up: outside any stream
            self.prefix_tokens = shared_prefix(self.model.unpadded, spec.prefix_len)
            self.prefix_cache(self.chunk_rows if spec.chunk else spec.prefill_batch)

    # ---- prefix caching

    def prefix_cache(self, rows: int) -> jax.Array:
        """The shared prefix's KV in the prefill layout [layers, rows, staging_len, ...]
        (every row the same), computed once per row count: an extend from position 0."""
        if rows not in self._prefix:
            tokens = np.broadcast_to(self.prefix_tokens, (rows, len(self.prefix_tokens)))
            _, cache = self.engine.extend(self.params, self.engine.empty_cache(rows, self.staging_len),
                                          jax.device_put(np.array(tokens), self._replicated), 0)
            self._prefix[rows] = jax.block_until_ready(cache)
        return self._prefix[rows]

    def _check_cached(self, cached_len: int) -> None:
        if self.spec.prefill is None or not 0 < cached_len <= self.spec.prefix_len:
            raise ConfigError("cached_len", cached_len, f"0 (no prefix) or 1 to prefix_len="
                              f"{self.spec.prefix_len} (the server's cached prefix)")

    def _cached_start(self, prompts: np.ndarray, cached_len: int, rows: int) -> jax.Array:
        """A copy of the prefix's KV for prompts that start with its first `cached_len`
        tokens (the extend donates the cache it is given; the prefix's stays)."""
        self._check_cached(cached_len)
        if not np.array_equal(prompts[:, :cached_len],
                              np.broadcast_to(self.prefix_tokens[:cached_len], (len(prompts), cached_len))):
            raise ConfigError("prompts", "a prompt with cached_len > 0", "prompts that start with "
                              "the shared prefix (serving.with_shared_prefix)")
        source = self.prefix_cache(rows)
        return _copy_program(self.mesh, source.sharding)(source)

    # ---- prefill

    def _prefill_program(self, prompt_len: int):
        from workloads.engine import _programs, _Shapes

        shapes = _Shapes(self.spec.prefill_batch, prompt_len, prompt_len)
        return _programs(self.mesh, self.engine.prefill_plan, self.engine.decode_plan, shapes,
                         self._int8)[0]

    def prefill(self, prompts, cached_len: int = 0) -> Prefilled:
        """prompts [n, L] (n <= prefill_batch; missing rows are padding) -> first tokens and
        the cache, synchronised (the first tokens are on the host). `cached_len` > 0: the
        prompts start with that much of the shared prefix (prefix caching), whose KV is
        extended by the rest (one program per distinct remaining length, as a whole
        prompt's prefill compiles per length)."""
        if self.spec.chunk:
            raise ConfigError("chunk", self.spec.chunk, "0 for whole-prompt prefill calls (a "
                              "chunked server prefills with begin_prompt / prefill_chunk)")
        batch, n, length = prompt_batch(self.spec, prompts)
        if cached_len:       # padding rows start with the prefix too (they share its KV)
            batch[n:, :cached_len] = self.prefix_tokens[:cached_len]
        start = time.perf_counter()
        if cached_len:       # prefix caching: only the rest of the prompts, after the prefix's KV
            cache = self._cached_start(batch, cached_len, self.spec.prefill_batch)
            logits, cache = self.engine.extend(
                self.params, cache, jax.device_put(batch[:, cached_len:], self._replicated),
                cached_len)
        else:
            logits, cache = self._prefill_program(length)(self.params,
                                                          jax.device_put(batch, self._replicated))
        first = np.asarray(self.engine.greedy(logits))[:n]
        return Prefilled(first, cache, length, time.perf_counter() - start, logits)

    # ---- chunked prefill

    def begin_prompt(self, prompt, cached_len: int = 0) -> Staged:
        """Start prefilling one prompt [L] in chunks (`prefill_chunk`), from the shared
        prefix's KV when it starts with it (`cached_len` > 0), else from an empty cache."""
        if not self.spec.chunk:
            raise ConfigError("chunk", 0, "a chunk size > 0 (SlotSpec.chunk) to prefill in chunks")
        prompt = np.asarray(prompt, np.int32).reshape(-1)
        if not cached_len < len(prompt) < self.spec.context_len:
            raise ConfigError("input_len", len(prompt), f"more than cached_len={cached_len} and "
                              f"less than context_len={self.spec.context_len}")
        began = time.perf_counter()
        rows = self.chunk_rows
        cache = (self._cached_start(np.broadcast_to(prompt, (rows, len(prompt))), cached_len, rows)
                 if cached_len else self.engine.empty_cache(rows, self.staging_len))
        return Staged(prompt, cached_len, cache, began)

    def prefill_chunk(self, staged: Staged) -> Prefilled | None:
        """The next chunk of up to `chunk` tokens of a staged prompt (a ragged last chunk
        padded to `chunk`: one program; synchronised). After the last chunk: the prompt's
        first token and KV (a Prefilled, `insert` puts it in a slot; `seconds` from its
        first chunk); before it, None."""
        chunk = self.spec.chunk
        take = min(chunk, staged.remaining)
        tokens = np.zeros((self.chunk_rows, chunk), np.int32)
        tokens[:, :take] = staged.prompt[staged.pos:staged.pos + take]
        logits, staged.cache = self.engine.extend(
            self.params, staged.cache, jax.device_put(tokens, self._replicated), staged.pos,
            take - 1)
        staged.pos += take
        if staged.remaining:
            jax.block_until_ready(staged.cache)
            return None
        first = np.asarray(self.engine.greedy(logits))[:1]
        return Prefilled(first, staged.cache, len(staged.prompt),
                         time.perf_counter() - staged.began, logits)

    def prefill_chunked(self, prompt, cached_len: int = 0) -> Prefilled:
        """One prompt prefilled in chunks back to back (no decode steps between them)."""
        staged = self.begin_prompt(prompt, cached_len)
        while (done := self.prefill_chunk(staged)) is None:
            pass
        return done

    def export_kv(self, done: Prefilled, row: int) -> np.ndarray:
        """Row `row`'s KV cache as a logical host array [layers, L, 2, K, D] (K: the run
        model's KV heads), for a decode server on another mesh."""
        slots = self.engine.prefill_plan.kv_slots()
        first = [int(np.flatnonzero(slots == kv)[0]) for kv in range(self.model.n_kv_heads)]
        return np.asarray(done.cache[:, row])[:, :done.prompt_len][:, :, :, first]

    # ---- slots

    def insert(self, slot: int, kv, row: int, first_token: int) -> None:
        """Put a prefilled request into `slot`: its KV (a `Prefilled` from this server, or a
        logical array from `export_kv`) and its first token; it decodes from the next step."""
        if self.spec.decode is None:
            raise ConfigError("decode", None, "a server with a decode layout")
        if not 0 <= slot < self.spec.slots:
            raise ConfigError("slot", slot, f"0 to {self.spec.slots - 1}")
        if isinstance(kv, Prefilled):
            source, src_slots, length = kv.cache, tuple(self.engine.prefill_plan.kv_slots()), kv.prompt_len
        else:
            kv = np.asarray(kv)
            if kv.shape[3] != self.model.n_kv_heads:
                raise ConfigError("kv", kv.shape, f"[layers, L, 2, {self.model.n_kv_heads}, D] "
                                  "(the decode model's KV heads)")
            source = jax.device_put(kv[:, None], self._replicated)
            src_slots, length, row = tuple(range(kv.shape[3])), kv.shape[1], 0
        if length >= self.spec.context_len:
            raise ConfigError("input_len", length, f"less than context_len={self.spec.context_len}")
        program = _insert_program(self.mesh, self.engine.decode_plan.cache_spec(), src_slots,
                                  tuple(int(s) for s in self.engine.decode_plan.kv_slots()))
        self.cache = program(self.cache, source, jnp.int32(row), jnp.int32(slot))
        self.tokens[slot], self.positions[slot], self.active[slot] = first_token, length, True

    def release(self, slot: int) -> None:
        self.active[slot] = False
        self.tokens[slot] = self.positions[slot] = 0

    def _check_room(self) -> None:
        """A busy slot at the end of its KV cache cannot step again."""
        if np.any(self.positions[self.active] >= self.spec.context_len):
            raise ConfigError("context_len", self.spec.context_len,
                              "more positions than a slot's answer needs")

    def step(self) -> np.ndarray:
        """One decode step of every slot (idle slots compute on padding at position 0):
        the next token of each slot [slots], on the host."""
        self._check_room()
        tokens = jax.device_put(self.tokens, self._replicated)
        positions = jax.device_put(self.positions, self._replicated)
        logits, self.cache = self.engine.decode(self.params, self.cache, tokens, positions)
        self.last_logits = logits        # [slots, V] f32 on the mesh (tests compare them)
        out = np.asarray(self.engine.greedy(logits))
        self.tokens = np.where(self.active, out, 0).astype(np.int32)
        self.positions = np.where(self.active, self.positions + 1, 0).astype(np.int32)
        return out

    def warm_up(self, prompt_len: int, repeats: int = 9, cached_len: int = 0) -> dict[str, float]:
        """Compile and run every program once (so no request pays a compile), then time
        `repeats` warm calls of each: their median seconds (a diagnostic, not a prediction).
        Chunked: `prefill_s` is a whole prompt's chunks back to back, `chunk_s` one chunk's.
        `cached_len`: prompts that start with that much of the shared prefix."""
        prompt = np.zeros((1, prompt_len), np.int32)
        if cached_len:
            self._check_cached(cached_len)
            prompt[0, :cached_len] = self.prefix_tokens[:cached_len]
        times: dict[str, float] = {}
        done = None
        if self.spec.prefill is not None and self.spec.chunk:
            runs = [self.prefill_chunked(prompt[0], cached_len) for _ in range(repeats + 1)]
            done = runs[-1]
            times["prefill_s"] = float(np.median([r.seconds for r in runs[1:]]))
            times["chunk_s"] = times["prefill_s"] / -(-(prompt_len - cached_len) // self.spec.chunk)
        elif self.spec.prefill is not None:
            runs = [self.prefill(prompt, cached_len) for _ in range(repeats + 1)]
            done = runs[-1]
            times["prefill_s"] = float(np.median([r.seconds for r in runs[1:]]))
            if self.spec.decode is None:
                self.export_kv(done, 0)
        if self.spec.decode is not None:
            kv = done if done is not None else np.zeros(
                (self.model.n_layers, prompt_len, 2, self.model.n_kv_heads, self.model.d_head),
                jnp.bfloat16)
            steps = []
            for _ in range(repeats + 1):
                self.insert(0, kv, 0, 0)            # back to the prompt's end: any context_len
                jax.block_until_ready(self.cache)   # the step's time only, not the insert's
                start = time.perf_counter()
                self.step()
                steps.append(time.perf_counter() - start)
            times["decode_step_s"] = float(np.median(steps[1:]))
            self.release(0)
        return times


# ---- the aggregated serving loop (docs/serving.md, "Real serving runs"): `sweeper serve`'s
# aggregated worker, its host-cost measurement (sweeper/serving/server.py) and a serving trial
# of `sweeper run` (workloads/serving/trial.py) all run this one loop.

def serve_aggregated(server: SlotServer, reqs: Sequence[Request], prompt: Callable[[int], Any],
                     start_at: float | None = None, prefill_batch: int | None = None,
                     timings: dict[str, list[float]] | None = None,
                     calls: list | None = None,
                     records: list | None = None) -> list[dict[str, Any]]:
    """Serve `reqs` on an aggregated slot server, in the loop the serving model simulates
    (workloads/serving/model.py `_aggregated_replica`): when prompts wait and slots are free,
    one prefill call (up to `prefill_batch` waiting prompts of the first one's length, in
    arrival order; default the server's `prefill_batch`) between two decode steps while
    requests decode, its rows into free slots; then a decode step of every slot; a slot is
    freed as soon as its answer is done (an answer of one token never takes a slot).

    `start_at` (`time.time()`): request i joins the waiting queue at `start_at + arrival_s`,
    the loop sleeping while nothing waits or decodes; None: a burst, every request waiting
    from the loop's start (its `arrival_s` unread). `prompt(i)`: request i's prompt tokens,
    made when it is prefilled.

    `timings`: when given, the seconds of each decode step with its bookkeeping are appended
    to `timings["step_s"]`, and those of each prefill branch (taking the prompts, the call,
    the inserts, synchronised after the inserts so that their time is the prefill's, not the
    next step's) to `timings["prefill_s"]`.

    `calls`: when given, the loop's call log is appended to it, seconds after the start on
    the arrivals' clock: `("prefill", start, first tokens on the host, [requests], end of its
    rows' inserts)` per prefill call and `("step", start, tokens on the host, busy slots, end
    of the slots' bookkeeping)` per decode step (a trace the serving model is replayed
    against, sweeper/serving/serve.py `replay_step_times`; docs/serving.md "Checking the
    model against the server").

    With prefix caching, one call takes prompts of one (input_len, cached_len). With
    chunked prefill (the server's `chunk` > 0) the loop is `_serve_chunked`: a decode step,
    then one chunk, per iteration (no whole-prompt calls; `prefill_batch` unused).

    Per request: `first_token_s` (the first token on the host) and `finish_s` (the last),
    seconds after the start, and its tokens. `records`: when given, those records are built
    in this list as the loop goes (`records` is returned), so that another thread can read
    what has completed (sweeper/serving/server.py `progress`: `sweeper serve` keeps it when a
    worker is lost)."""
    if server.spec.chunk:
        return _serve_chunked(server, reqs, prompt, start_at, timings, calls, records)
    slots = server.spec.slots
    most = server.spec.prefill_batch if prefill_batch is None else prefill_batch
    n = len(reqs)
    out = _records(records, n)
    input_lens = [(r.input_len, r.cached_len) for r in reqs]   # one prefill call, one shape
    start_at, pending, waiting = _stream_queues(reqs, start_at)
    slot_request = [-1] * slots
    remaining = [0] * slots
    prefilled_since_step = False
    sleep_until(start_at)
    while pending or waiting or any(r >= 0 for r in slot_request):
        now = time.time() - start_at
        while pending and reqs[pending[0]].arrival_s <= now:
            waiting.append(pending.popleft())
        active = sum(r >= 0 for r in slot_request)
        if not waiting and not active:
            sleep_until(start_at + reqs[pending[0]].arrival_s)
            continue
        free = [s for s in range(slots) if slot_request[s] < 0]
        if waiting and free and not (prefilled_since_step and active):
            began = time.perf_counter()
            call_start = time.time() - start_at
            take = take_one_length(waiting, input_lens, min(most, len(free)))
            done = server.prefill([prompt(i) for i in take], reqs[take[0]].cached_len)
            t = time.time() - start_at
            for row, i in enumerate(take):
                first = int(done.first_tokens[row])
                out[i].update(first_token_s=t, tokens=[first])
                if reqs[i].output_len <= 1:
                    out[i]["finish_s"] = t
                    continue
                slot = free.pop(0)
                server.insert(slot, done, row, first)
                slot_request[slot], remaining[slot] = i, reqs[i].output_len - 1
            if timings is not None:
                jax.block_until_ready(server.cache)
                timings.setdefault("prefill_s", []).append(time.perf_counter() - began)
            if calls is not None:
                calls.append(("prefill", call_start, t, list(take), time.time() - start_at))
            prefilled_since_step = True
            continue
        decode_step(server, start_at, slot_request, remaining, out, calls, timings)
        prefilled_since_step = False
    return out


def _serve_chunked(server: SlotServer, reqs: Sequence[Request], prompt: Callable[[int], Any],
                   start_at: float | None, timings: dict | None, calls: list | None,
                   records: list | None) -> list[dict[str, Any]]:
    """`serve_aggregated` with chunked prefill (SlotSpec.chunk > 0; Sarathi-Serve, vLLM):
    each iteration runs a decode step of every slot (when any is busy), then one chunk of
    up to `chunk` tokens of the prompt being prefilled: the oldest waiting one, begun when
    a slot is free. Two programs per iteration (Sarathi fuses them into one batch). After
    its last chunk a prompt's first token is out and it takes the free slot (an answer of
    one token takes none). `calls`: `("step", ...)` as `serve_aggregated`'s and
    `("chunk", start, end, request, tokens, first token on the host or None)` per chunk;
    `timings`: `step_s` and `chunk_s`."""
    slots = server.spec.slots
    n = len(reqs)
    out = _records(records, n)
    start_at, pending, waiting = _stream_queues(reqs, start_at)
    slot_request = [-1] * slots
    remaining = [0] * slots
    staged, staged_request = None, -1
    sleep_until(start_at)
    while pending or waiting or staged is not None or any(r >= 0 for r in slot_request):
        now = time.time() - start_at
        while pending and reqs[pending[0]].arrival_s <= now:
            waiting.append(pending.popleft())
        active = sum(r >= 0 for r in slot_request)
        if not waiting and not active and staged is None:
            sleep_until(start_at + reqs[pending[0]].arrival_s)
            continue
        if active:
            decode_step(server, start_at, slot_request, remaining, out, calls, timings)
        free = [s for s in range(slots) if slot_request[s] < 0]
        if staged is None and waiting and free:     # the slot it takes stays free: only
            staged_request = waiting.popleft()     # a finished prompt takes one
            staged = server.begin_prompt(prompt(staged_request), reqs[staged_request].cached_len)
        if staged is None:
            continue
        began, call_start = time.perf_counter(), time.time() - start_at
        chunk_tokens = min(server.spec.chunk, staged.remaining)
        done = server.prefill_chunk(staged)
        t = time.time() - start_at
        i = staged_request
        if done is not None:
            first = int(done.first_tokens[0])
            out[i].update(first_token_s=t, tokens=[first])
            if reqs[i].output_len <= 1:
                out[i]["finish_s"] = t
            else:
                slot = free[0]
                server.insert(slot, done, 0, first)
                slot_request[slot], remaining[slot] = i, reqs[i].output_len - 1
            staged, staged_request = None, -1
        if calls is not None:
            calls.append(("chunk", call_start, time.time() - start_at, i, chunk_tokens,
                          t if done is not None else None))
        if timings is not None:
            if done is not None:
                jax.block_until_ready(server.cache)
            timings.setdefault("chunk_s", []).append(time.perf_counter() - began)
    return out


# A disaggregated deployment's two loops (docs/serving.md "Real serving runs"): a prefill
# slice and a decode slice, each on its own mesh and process, the KV cache handed over by
# the caller's transport (`send`, `inbox`: Ray in `sweeper serve`'s workers,
# sweeper/serving/server.py, and in a disaggregated serving trial, sweeper/sweep/meshworker.py).

def serve_prefill_slice(server: SlotServer, reqs: Sequence[dict], prompt: Callable[[int], Any],
                        start_at: float, send: Callable[[list[dict]], Any],
                        calls: list | None = None,
                        records: list | None = None) -> tuple[list[dict[str, Any]], list]:
    """Prefill calls back to back in arrival order (`reqs`: plain requests, `arrival_s`,
    `input_len`, `output_len`), up to the server's `prefill_batch` prompts of one length per
    call; after each call its requests' KV caches (`export_kv`) go to the decode slice in
    one `send([{request, kv, first_token, output_len}, ...])` (an answer of one token is
    done at its first). Per request `first_token_s` and its first token (and `finish_s`
    when that was its last); with what each `send` returned (the caller waits for them).
    Each handed-over request's `sent_s`: when its `send` returned.
    `calls`: `("prefill", start, first tokens on the host, [requests])` per call and
    `("send", start, end, [requests])` per handover (server.py `last_calls`); `records`: as
    `serve_aggregated`'s."""
    spec = server.spec
    n = len(reqs)
    out = _records(records, n)
    input_lens = [(r["input_len"], r.get("cached_len", 0)) for r in reqs]   # one call, one shape
    queue_ = deque(sorted(range(n), key=lambda i: reqs[i]["arrival_s"]))
    calls = [] if calls is None else calls
    sleep_until(start_at)
    sent = []
    while queue_:
        sleep_until(start_at + reqs[queue_[0]]["arrival_s"])
        now = time.time() - start_at
        arrived = deque(i for i in queue_ if reqs[i]["arrival_s"] <= now)
        take = take_one_length(arrived, input_lens, spec.prefill_batch)
        for i in take:
            queue_.remove(i)
        done = server.prefill([prompt(i) for i in take], reqs[take[0]].get("cached_len", 0))
        t = time.time() - start_at
        calls.append(("prefill", now, t, list(take)))
        handover = []
        for row, i in enumerate(take):
            out[i].update(first_token_s=t, tokens=[int(done.first_tokens[row])])
            if reqs[i]["output_len"] <= 1:
                out[i]["finish_s"] = t
                continue
            handover.append({"request": i, "kv": server.export_kv(done, row),
                             "first_token": int(done.first_tokens[row]),
                             "output_len": reqs[i]["output_len"]})
        if handover:
            sent.append(send(handover))
            sent_s = time.time() - start_at
            calls.append(("send", t, sent_s, [h["request"] for h in handover]))
            for h in handover:
                out[h["request"]]["sent_s"] = sent_s
    return out, sent


def serve_decode_slice(server: SlotServer, inbox, expected: int, start_at: float,
                       calls: list | None = None, poll_s: float = 0.0005,
                       records: dict | None = None) -> dict[int, dict]:
    """Decode the `expected` requests handed over into `inbox` (a `queue.Queue` of
    `serve_prefill_slice`'s handover items, filled by another thread): before each decode
    step every received request goes into a free slot, one insertion after the other; a
    step runs every slot. Per request: when its insert began (`insert_start_s`) and its KV
    was in a slot (`kv_ready_s`), when the receiving thread had it (`delivered_s`, for items
    stamped `delivered` on the wall clock), its last token's time (`finish_s`) and its
    decoded tokens. `calls`: `("insert", start, end,
    request)` and `("step", start, tokens on the host, busy slots, end of the slots'
    bookkeeping)` (server.py `last_calls`); `poll_s`: how often an idle loop looks;
    `records`: a dict the per-request records are built in as the loop goes (as
    `serve_aggregated`'s)."""
    spec = server.spec
    out: dict[int, dict] = {} if records is None else records
    waiting: deque[dict] = deque()
    slot_request = [-1] * spec.slots
    remaining = [0] * spec.slots
    received = 0
    calls = [] if calls is None else calls
    sleep_until(start_at)
    while received < expected or waiting or any(r >= 0 for r in slot_request):
        while True:
            try:
                waiting.append(inbox.get_nowait())
                received += 1
            except queue.Empty:
                break
        free = [s for s in range(spec.slots) if slot_request[s] < 0]
        while waiting and free:
            item = waiting.popleft()
            slot = free.pop(0)
            began = time.time() - start_at
            server.insert(slot, item["kv"], 0, item["first_token"])
            i = item["request"]
            out[i] = {"kv_ready_s": time.time() - start_at, "insert_start_s": began,
                      "tokens": []}
            if "delivered" in item:       # when the receiving thread had it (wall clock)
                out[i]["delivered_s"] = item["delivered"] - start_at
            calls.append(("insert", began, out[i]["kv_ready_s"], i))
            slot_request[slot], remaining[slot] = i, item["output_len"] - 1
        if not any(r >= 0 for r in slot_request):
            time.sleep(poll_s)
            continue
        began = time.time() - start_at
        active = sum(r >= 0 for r in slot_request)
        tokens = server.step()
        t = time.time() - start_at
        advance_slots(server, tokens, t, slot_request, remaining, out)
        calls.append(("step", began, t, active, time.time() - start_at))
    return out


def _records(records: list | None, n: int) -> list[dict[str, Any]]:
    """`n` empty per-request records, in `records` when given (filled in place)."""
    fresh: list[dict[str, Any]] = [{"tokens": []} for _ in range(n)]
    if records is None:
        return fresh
    records[:] = fresh
    return records


def _stream_queues(reqs: Sequence[Request], start_at: float | None):
    """(start_at, pending, waiting): the requests in arrival order, pending until they
    arrive; without a start time every request is waiting from now (a closed loop)."""
    order = sorted(range(len(reqs)), key=lambda i: reqs[i].arrival_s)
    if start_at is None:
        return time.time(), deque(), deque(order)
    return start_at, deque(order), deque()


def sleep_until(when: float) -> None:
    """Sleep until `time.time()` reaches `when` (no sleep when it has)."""
    delay = when - time.time()
    if delay > 0:
        time.sleep(delay)


def take_one_length(waiting: deque, input_lens: Sequence, most: int) -> list[int]:
    """Up to `most` waiting requests with the first one's prompt length (one prefill call
    has one shape; with prefix caching a length is (input_len, cached_len)), in arrival
    order; removed from `waiting`."""
    length = input_lens[waiting[0]]
    take = [i for i in waiting if input_lens[i] == length][:most]
    for i in take:
        waiting.remove(i)
    return take


def prompt_batch(spec: SlotSpec, prompts) -> tuple[np.ndarray, int, int]:
    """(the prefill call's [prefill_batch, L] tokens, prompts n, length L) of `prompts`
    [n, L]: checked against the server's spec, the missing rows zero padding."""
    if spec.prefill is None:
        raise ConfigError("prefill", None, "a server with a prefill layout")
    prompts = np.asarray(prompts, np.int32)
    n, length = prompts.shape
    if not 0 < n <= spec.prefill_batch:
        raise ConfigError("prompts", n, f"1 to prefill_batch={spec.prefill_batch} prompts")
    if spec.decode is not None and length >= spec.context_len:
        raise ConfigError("input_len", length, f"less than context_len={spec.context_len}")
    batch = np.zeros((spec.prefill_batch, length), np.int32)
    batch[:n] = prompts
    return batch, n, length


def decode_step(server: SlotServer, start_at: float, slot_request: list[int],
                remaining: list[int], out, calls: list | None, timings: dict | None) -> None:
    """One decode step of every busy slot, its tokens given to their requests
    (`advance_slots`); `calls` gets `("step", start, end, busy slots, host time after)`,
    `timings["step_s"]` its duration."""
    active = sum(r >= 0 for r in slot_request)
    began, call_start = time.perf_counter(), time.time() - start_at
    tokens = server.step()
    t = time.time() - start_at
    advance_slots(server, tokens, t, slot_request, remaining, out)
    if calls is not None:
        calls.append(("step", call_start, t, active, time.time() - start_at))
    if timings is not None:
        timings.setdefault("step_s", []).append(time.perf_counter() - began)


def advance_slots(server: SlotServer, tokens, t: float, slot_request: list[int],
                  remaining: list[int], out) -> None:
    """After a decode step: append each busy slot's token to its request's; free the slots
    whose answers are done (their `finish_s`: `t`)."""
    for slot, i in enumerate(slot_request):
        if i < 0:
            continue
        out[i]["tokens"].append(int(tokens[slot]))
        remaining[slot] -= 1
        if remaining[slot] == 0:
            out[i]["finish_s"] = t
            slot_request[slot] = -1
            server.release(slot)


@functools.lru_cache(maxsize=32)
def _insert_program(mesh, cache_spec: P, src_slots: tuple, dst_slots: tuple):
    """cache [layers, S, ctx, 2, slots_d, D], source [layers, B, L, 2, slots_s, D], row, slot
    -> the cache with row `row` of the source in slot `slot`, its KV heads laid out as the
    decode side holds them (the first source slot holding each head; as `Engine.handoff`)."""
    first = {kv: s for s, kv in reversed(list(enumerate(src_slots)))}
    take = np.array([first[kv] for kv in dst_slots])

    def insert(cache, source, row, slot):
        piece = jax.lax.dynamic_index_in_dim(source, row, axis=1, keepdims=True)
        # a staging cache (chunked or prefix-extended prefill) is `chunk` positions longer
        # than a slot: the padding's positions, cut off
        piece = jnp.take(piece[:, :, :cache.shape[2]], take, axis=4).astype(cache.dtype)
        return write_rows(cache, piece, (0, slot, 0, 0, 0, 0))   # in place (partitioning.py)

    return jax.jit(insert, out_shardings=NamedSharding(mesh, cache_spec), donate_argnums=0)


@functools.lru_cache(maxsize=8)
def _copy_program(mesh, sharding):
    """A copy of an array in the same sharding (the prefix's KV, before an extend donates it)."""
    return jax.jit(lambda a: jnp.array(a, copy=True), out_shardings=sharding)


def _check_chunk_prefix(spec: SlotSpec) -> None:
    """The chunk size and the shared prefix suit the server (one ConfigError line)."""
    integer("chunk", spec.chunk, minimum=0,
            what="0 (whole prompts) or a number of prompt tokens per step")
    if spec.chunk and (spec.prefill is None or spec.decode is None):
        raise ConfigError("chunk", spec.chunk, "0 on a prefill-only or decode-only server "
                          "(chunks are mixed into an aggregated server's decode steps)")
    if not isinstance(spec.prefix_len, int) or not 0 <= spec.prefix_len < spec.context_len:
        raise ConfigError("prefix_len", spec.prefix_len, f"0 (no prefix caching) or fewer "
                          f"tokens than context_len={spec.context_len}")
    if (spec.chunk or spec.prefix_len) and spec.model.moe:
        raise ConfigError("model.moe", True, "a dense model (chunked prefill and prefix "
                          "caching run dense models only)")


def reference_generation(model: ModelConfig, seed: int, prompt, steps: int):
    """The unsharded reference (workloads/reference.py) for one prompt, bf16 weights:
    (logits per step [steps + 1 of [V]], greedy tokens [steps + 1])."""
    from workloads.model import init_params
    from workloads.reference import reference_generate

    # built on the host and placed in one device_put: no small weight programs (docs/performance.md)
    params = jax.device_put(init_params(model.unpadded, seed))
    logits, tokens = reference_generate(model.unpadded, params, np.asarray(prompt, np.int32)[None], steps)
    return [np.asarray(l[0]) for l in logits], tokens[0]
