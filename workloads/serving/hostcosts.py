"""Serving host costs measured on a slot server: what a serving loop adds on the host to the
engine's own calls, outside any served stream (docs/serving.md "Serving host costs").

The measuring code is here, in `workloads`, so that every process that holds a slot server
runs the same code: `sweeper serve --measure-overheads`'s Ray workers (sweeper/serving/
server.py `ServingWorker.measure_host_costs`, sweeper/serving/overheads.py
`measure_session`) and a serving trial's own worker before its stream
(workloads/serving/trial.py; disaggregated, its decode slice's actor,
sweeper/sweep/meshworker.py `DecodeSliceWorker`). What each number means, and why the
means are paired medians of block means: sweeper/serving/overheads.py's docstring.

    loop = measure_loop(server, input_len, output_len)        # one worker's closed loop
    costs = combine(loop, loop)                               # aggregated: one worker
    costs = combine(pre, dec, handover_costs(samples, cpu), served)   # disaggregated
"""

from __future__ import annotations

import time
from typing import Any, Callable, Mapping

import numpy as np

from workloads.serving.costs import SLICE_WAKE
from workloads.serving.profile import Request

ROUNDS = 2      # rounds of the closed loop, repeated until a block has run MIN_BLOCK_S
BLOCKS = 5      # blocks; the median of the blocks' means
MIN_BLOCK_S = 0.25
WAKE_REQUESTS = 12   # requests on an idle loop (`prefill_wake_s`)
# their tokens on an aggregated loop: the first, then this many decode steps after it
# (`decode_after_wake_s`: the first steps after an idle are slower too); one on a prefill slice
WAKE_DECODE_STEPS = 3
# An aggregated server's prefill calls, paired one by one with the engine's (per block): a
# saturated loop of a multi-prompt prefill makes ~1 timed call per block (docs/serving.md
# "Serving host costs", "A prefill's host work, paired call by call")
PREFILL_PAIRS = 8
IDLE_GAP_S = 0.1     # ... this far apart
IDLE_SHORT_GAP_S = 0.01   # ... and as many about this long idle (the wake after a short idle)
# The engine's decode steps per pipelined run (`engine_decode_run`), as a trial's decode loop
# (8 steps in a calibration probe, sweeper/calibrate/tasks.py)
PIPELINED_STEPS = 8


def prompt_for(model, request_index: int, input_len: int, seed: int):
    """Request `request_index`'s prompt tokens (deterministic from the seed)."""
    from workloads.model import prompt_tokens   # lazy: imports JAX (only where a mesh runs)

    return prompt_tokens(model, 1, input_len, seed * 1_000_003 + request_index)[0]


def _nowhere(handover: list[dict]) -> None:
    raise RuntimeError(f"a prefill worker without a decode worker cannot hand over requests "
                       f"{[h['request'] for h in handover]} (answers longer than one token)")


def measure_loop(srv, input_len: int, output_len: int, rounds: int = ROUNDS,
                 blocks: int = BLOCKS, min_block_s: float = MIN_BLOCK_S,
                 wake_requests: int = WAKE_REQUESTS, idle_gap_s: float = IDLE_GAP_S,
                 send: Callable[[list[dict]], Any] | None = None,
                 wait: Callable[[list], Any] | None = None,
                 prefill_pairs: int = PREFILL_PAIRS) -> dict[str, Any]:
    """A slot server's serving loop against the engine's timed calls of the same shapes.

    Engine: the prefill program alone, and the decode call of the full slot batch (decode
    program and argmax), arguments placed before the timer, synchronised each call; and
    the decode call run PIPELINED_STEPS times back to back, synchronised once
    (`engine_step_pipelined_s`, per step): as a trial's decode loop runs its steps, the
    step the host cost model prices (`host_costs` charges the difference to the loop, which
    waits for every step's tokens). Loop: the serving loop itself at saturation, with no
    arrivals: aggregated, `serve_aggregated`'s loop on a burst of `rounds x slots`
    requests (one prefill call inserted per decode step while prompts wait: prompts,
    `srv.prefill`, its rows into slots; a step: `srv.step()`, the clock read, `advance_slots`);
    a prefill slice, `4 x rounds` prefill calls and their KV exported back to back; a
    decode slice, every slot full, stepping `rounds x output_len` steps, each step right
    after an engine call of the same slot batch (paired: `loop_step_paired_extra_s`,
    the median over blocks of the block's mean step minus its paired engine calls' mean,
    and each block's `loop_step_paired_block_extra_s`; overheads.py charges it); the
    aggregated loop's steps are paired by block instead, against the engine's decode
    calls just before and after the block (its steps cannot be interleaved with engine
    calls without changing the loop).

    The loop runs in `blocks` blocks, the engine's calls before the first and after each
    (so the blocks are spread over the measurement's seconds, docs/serving.md "Serving
    host costs"); a block repeats the loop above until it has run `min_block_s` (the
    first call of each repetition dropped). Robust means: {loop_step_mean_s,
    loop_prefill_mean_s} are the MEDIAN of the blocks' means: a mean, what a stream's queue
    pays, but one that a burst of other processes' load over fewer than half the blocks
    does not move; the blocks' means {loop_step_block_means_s, ...} and the mean over
    every call {loop_step_pooled_mean_s, ...} beside them. Medians: {engine_step_s,
    loop_step_s, engine_prefill_s, loop_prefill_s} (a phase the server does not run is
    absent), the measurement's wall clock `measured_s`, the loop's prompts per prefill
    call and every closed-loop call's seconds {loop_step_samples_s, loop_prefill_samples_s}.

    Aggregated, each block also times `prefill_pairs` prefill calls paired one by one
    with the engine's (`paired_prefill_calls`: a decode step, the engine's prefill, a decode
    step, the loop's prefill branch with its rows into slots; the prompts per call cycling
    1..prefill_batch, the counts a stream's calls take). The part before the first tokens
    `loop_prefill_first_paired_extra_s` and the host work per prompt
    `loop_prefill_paired_per_prompt_s` are MEDIANS of those pairs' differences (first
    tokens - engine; call - engine per prompt count, summed over the counts, over their
    prompts): an interruption by other processes lands on either call of a pair alike, so
    the median, not a mean, finds the host work under it; per block in `..._block_...`
    (diagnostic), every pair in `prefill_pair_*`. The saturated loop's
    prefill calls (one per block with 4 prompts of 4 slots) stay in the detail.

    `send` (a prefill slice with a decode worker): the closed loop also hands each prefill
    call's KV to it in one call, as a stream's prefill slice does, without waiting for it
    (`wait(sent)` after each block): the submission and the work it leaves on this core
    are in the loop's prefill, as a stream's prefill pays them.

    Idle loop (a server with a prefill phase): `wake_requests` short requests
    `idle_gap_s` apart (the loop idle between them) served by the server's own serving
    loop (`serve_aggregated` or `serve_prefill_slice`, sleeps and wake-ups included): the
    median of their TTFTs `prefill_after_idle_s`, and `prefill_wake_s` = that minus the
    engine's prefill (what a call on an idle loop adds before its first token: a
    stream's prefill worker is idle between arrivals, the closed loop above never is),
    after the loop idled `prefill_wake_idle_s` (median); then as many leaving the loop
    about `IDLE_SHORT_GAP_S` idle: `prefill_wake_short_s` after `prefill_wake_short_idle_s`;
    on an aggregated loop, each set's decoding after the first token too (`combine`:
    `decode_after_wake_s`; `idle_prefill_wake`)."""
    loop = _ClosedLoop(srv, input_len, output_len, rounds, send, prefill_pairs)
    began = time.perf_counter()
    loop.engine_calls()          # between the blocks: a drift in the host's load
    for _ in range(max(blocks, 1)):
        loop.block(min_block_s, wait)
    out: dict[str, Any] = {"measured_s": time.perf_counter() - began, "blocks": max(blocks, 1)}
    out.update(loop.block_figures())
    out.update(loop.prefill_pair_figures(out.get("loop_prefill_first_paired_extra_s")))
    out.update(loop.step_figures())
    if srv.spec.prefill is not None and wake_requests > 0:
        out.update(idle_prefill_wake(srv, input_len, wake_requests, idle_gap_s,
                                     out["engine_prefill_s"]))
    return out


class _ClosedLoop:
    """`measure_loop`'s closed loop and the engine's calls beside it: what each block
    timed, gathered over the blocks, and the figures made of them."""

    REPEATS = 5          # per engine block (its first dropped): blocks + 1 of them

    def __init__(self, srv, input_len: int, output_len: int, rounds: int,
                 send: Callable[[list[dict]], Any] | None, prefill_pairs: int):
        self.srv, self.spec, self.model = srv, srv.spec, srv.model.unpadded
        self.input_len, self.output_len, self.rounds = input_len, output_len, rounds
        self.send, self.prefill_pairs = send, prefill_pairs
        self.engine_prefill: list[float] = []
        self.engine_step: list[float] = []
        self.engine_pipelined: list[float] = []   # per step, of the pipelined runs
        self.pair_prompts: list[int] = []         # aggregated: each paired prefill call's prompts,
        self.pair_first: list[float] = []         # its first tokens - the engine's call before it,
        self.pair_whole: list[float] = []         # its whole branch - the engine's call before it
        self.pair_calls: list[float] = []         # its whole branch
        self.pair_first_blocks: list[float] = []  # per block: median of first tokens - engine
        self.pair_per_prompt_blocks: list[float] = []   # per block: sum(call - engine) / prompts
        self.paired_engine: list[float] = []     # a decode slice: the engine's call before each step
        self.first_token: list[float] = []       # each closed-loop prefill call to its first tokens
        self.first_blocks: list[list[float]] = []
        self.engine_prefill_blocks: list[float] = []   # each engine block's mean prefill
        self.engine_step_blocks: list[float] = []      # each engine block's mean decode call
        self.first_extra: list[float] = []       # per block: to first tokens - engine blocks beside
        self.prefill_extra: list[float] = []     # per block: mean prefill call - engine blocks beside
        self.paired_blocks: list[float] = []     # per block: mean step - mean paired engine calls
        self.step_blocks: list[list[float]] = []
        self.prefill_blocks: list[list[float]] = []
        self.prompts: list[float] = []
        self.sent: list = []         # the closed loop's handovers through `send`, if any

    def engine_calls(self) -> None:
        """The engine's calls, timed as a trial times them (the first of each dropped)."""
        if self.spec.prefill is not None:                 # the prefill program alone
            calls = self._timed(engine_prefill_call(self.srv, self.input_len), self.REPEATS)
            self.engine_prefill.extend(calls)
            self.engine_prefill_blocks.append(float(np.mean(calls)))
        if self.spec.decode is not None:                  # decode and argmax of the slot batch
            calls = self._timed(engine_decode_call(self.srv, self.input_len), self.REPEATS * 2)
            self.engine_step.extend(calls)
            self.engine_step_blocks.append(float(np.mean(calls)))
            run = engine_decode_run(self.srv, self.input_len, PIPELINED_STEPS)
            if run is not None:       # as a trial runs its steps (one wait per run)
                self.engine_pipelined.extend(
                    c / PIPELINED_STEPS for c in self._timed(run, 3))

    @staticmethod
    def _timed(call: Callable[[], None], repeats: int) -> list[float]:
        """`call`'s seconds, `repeats` times, the first dropped."""
        calls = []
        for k in range(repeats):
            start = time.perf_counter()
            call()
            if k:
                calls.append(time.perf_counter() - start)
        return calls

    def loop_once(self) -> tuple[list[float], list[float], float]:
        """One run of the closed loop: its steps' and prefill calls' seconds, and its
        prompts per prefill call."""
        spec = self.spec
        if spec.prefill is not None and spec.decode is not None:
            return saturated_aggregated(self.srv, self.input_len, self.output_len,
                                        self.rounds * spec.slots, self.first_token)
        if spec.prefill is not None:
            return [], self.prefill_slice_calls(), float(spec.prefill_batch)
        return self.decode_slice_steps(), [], 0.0

    def prefill_slice_calls(self) -> list[float]:
        """A prefill slice's closed loop: `4 x rounds + 1` prefill calls, each call's KV
        exported (and sent through `send`, not waited for); each call's seconds."""
        srv, spec, prefills = self.srv, self.spec, []
        for n in range(self.rounds * 4 + 1):
            start = time.perf_counter()
            take = range(spec.prefill_batch)
            done = srv.prefill([prompt_for(self.model, n * 64 + i, self.input_len, 7)
                                for i in take])
            int(done.first_tokens[0])      # the first tokens on the host, as served
            self.first_token.append(time.perf_counter() - start)
            handover = [{"request": row, "kv": srv.export_kv(done, row),
                         "first_token": int(done.first_tokens[row]),
                         "output_len": self.output_len} for row in take]
            if self.send is not None:      # as a stream's prefill slice sends (not waited for)
                self.sent.append(self.send(handover))
            prefills.append(time.perf_counter() - start)
        return prefills

    def decode_slice_steps(self) -> list[float]:
        """A decode slice's closed loop: every slot full, no arrivals, `rounds` times until
        the slots are done, the engine's call of the same slot batch right before each
        step (paired: the other processes' load of that moment is in both, docs/serving.md
        "Serving host costs"; it writes position `input_len` of every slot, which no timing
        reads); each step's seconds."""
        import jax   # lazy: JAX only in a process that holds a mesh
        import jax.numpy as jnp   # lazy: as jax
        from workloads.serving.slots import advance_slots   # lazy: imports JAX, as above

        srv, spec, steps = self.srv, self.spec, []
        kv = np.zeros((srv.model.n_layers, self.input_len, 2, srv.model.n_kv_heads,
                       srv.model.d_head), jnp.bfloat16)
        slot_request = [-1] * spec.slots
        remaining = [0] * spec.slots
        record = [{"tokens": []} for _ in range(spec.slots)]
        decode_e = engine_decode_call(srv, self.input_len)
        for _ in range(self.rounds):
            for slot in range(spec.slots):            # every slot full, no arrivals
                srv.insert(slot, kv, 0, 0)
                slot_request[slot], remaining[slot] = slot, max(self.output_len - 1, 1)
                record[slot]["tokens"] = []
            jax.block_until_ready(srv.cache)
            while any(r >= 0 for r in slot_request):
                start = time.perf_counter()
                decode_e()
                self.paired_engine.append(time.perf_counter() - start)
                start = time.perf_counter()
                tokens = srv.step()
                advance_slots(srv, tokens, time.time(), slot_request, remaining, record)
                steps.append(time.perf_counter() - start)
        return steps

    def block(self, min_block_s: float, wait: Callable[[list], Any] | None) -> None:
        """One block: the closed loop repeated until it has run `min_block_s` (the first
        call of each repetition dropped), aggregated the paired prefill calls, then the
        engine's calls; each block's figures paired with the engine's blocks beside it."""
        block_began = time.perf_counter()
        steps, prefills = [], []
        engine_before: list[float] = []
        firsts: list[float] = []
        while True:         # at least `min_block_s` of the loop per block
            self.paired_engine.clear()
            self.first_token.clear()
            more_steps, more_prefills, block_prompts = self.loop_once()
            steps += more_steps[1:]
            engine_before += self.paired_engine[1:]
            firsts += self.first_token[1:]
            prefills += more_prefills[1:]
            if more_prefills[1:]:
                self.prompts.append(block_prompts)
            if time.perf_counter() - block_began >= min_block_s:
                break
        if self.spec.prefill is not None and self.spec.decode is not None \
                and self.prefill_pairs > 0:
            self.pair_prefill_calls()
        if steps:
            self.step_blocks.append(steps)
        if firsts:
            self.first_blocks.append(firsts)
            self.first_extra.append(float(np.mean(firsts)))   # the engine block after: below
        if steps and engine_before:
            self.paired_blocks.append(float(np.mean(steps) - np.mean(engine_before)))
        if prefills:
            self.prefill_blocks.append(prefills)
            self.prefill_extra.append(float(np.mean(prefills)))   # the engine block after: below
        if self.sent:
            if wait is not None:
                wait(self.sent)
            self.sent.clear()
        self.engine_calls()   # (other processes' work) shows in both, not in their difference
        if firsts:          # paired with the engine's blocks before and after this one
            self.first_extra[-1] -= float(np.mean(self.engine_prefill_blocks[-2:]))
        if prefills:        # as the first tokens
            self.prefill_extra[-1] -= float(np.mean(self.engine_prefill_blocks[-2:]))
        if steps and not engine_before:   # aggregated: paired with the engine's blocks
            self.paired_blocks.append(float(np.mean(steps) - np.mean(self.engine_step_blocks[-2:])))

    def pair_prefill_calls(self) -> None:
        """Aggregated: this block's prefill calls paired one by one with the engine's."""
        k, f, w, c = paired_prefill_calls(self.srv, self.input_len, self.prefill_pairs,
                                          len(self.pair_prompts))
        self.pair_calls.extend(c)
        self.pair_prompts.extend(k)
        self.pair_first.extend(f)
        self.pair_whole.extend(w)
        self.pair_first_blocks.append(float(np.median(f)))
        self.pair_per_prompt_blocks.append(float(np.sum(w) / np.sum(k)))

    def block_figures(self) -> dict[str, Any]:
        """The engine's medians, the blocks' robust means and the prefill's pairing by block."""
        out: dict[str, Any] = {}
        if self.engine_prefill:
            out["engine_prefill_s"] = float(np.median(self.engine_prefill))
        if self.engine_step:
            out["engine_step_s"] = float(np.median(self.engine_step))
        if self.engine_pipelined:
            out["engine_step_pipelined_s"] = float(np.median(self.engine_pipelined))
        for name, per_block in (("prefill", self.prefill_blocks), ("step", self.step_blocks),
                                ("prefill_first", self.first_blocks)):
            if not per_block:
                continue
            every = [x for block in per_block for x in block]
            means = [float(np.mean(block)) for block in per_block]
            # the median of the blocks' means (robust to a burst of load over a few blocks);
            # the median of the calls (the typical call); the pooled mean (diagnostic)
            out[f"loop_{name}_s"] = float(np.median(every))
            out[f"loop_{name}_mean_s"] = float(np.median(means))
            out[f"loop_{name}_block_means_s"] = means
            out[f"loop_{name}_pooled_mean_s"] = float(np.mean(every))
            out[f"loop_{name}_samples_s"] = [float(x) for x in every]   # their spread
        if self.first_extra:
            # a prefill call's host work before its first tokens, paired: the median over
            # blocks of (the block's mean call to its first tokens - the mean of the engine's
            # prefill calls just before and after the block)
            out["loop_prefill_first_paired_extra_s"] = float(np.median(self.first_extra))
            out["loop_prefill_first_paired_block_extra_s"] = self.first_extra
        if self.prefill_extra:
            # a prefill call's host work, paired by block as its part before the first tokens:
            # unpaired (the loop's mean - the median of every engine call), engine calls caught
            # in a burst of load made it 0 (dis-1+1chip-4slots: engine 18.1 ms, loop 13.1 ms)
            out["loop_prefill_paired_extra_s"] = float(np.median(self.prefill_extra))
            out["loop_prefill_paired_block_extra_s"] = self.prefill_extra
        return out

    def step_figures(self) -> dict[str, Any]:
        """The host work per step, paired; the closed loop's prompts per prefill call."""
        out: dict[str, Any] = {}
        if self.paired_blocks:
            # the host work per step, paired: the median over blocks of (the block's mean
            # step - the mean of the engine's calls just before each step (a decode slice) or
            # in the engine's blocks just before and after the block (aggregated))
            out["loop_step_paired_extra_s"] = float(np.median(self.paired_blocks))
            out["loop_step_paired_block_extra_s"] = self.paired_blocks
        if self.prefill_blocks:
            out["loop_prefill_prompts"] = float(np.mean(self.prompts))   # prompts per prefill call
        return out

    def prefill_pair_figures(self, saturated_first: float | None) -> dict[str, Any]:
        """Aggregated: the prefill calls paired call by call, at 1..prefill_batch prompts
        (they replace the per-block pairing of the saturated loop's few calls,
        `saturated_first`, which stays in the detail); {} without them."""
        if not self.pair_first_blocks:
            return {}
        out: dict[str, Any] = {"loop_prefill_first_saturated_paired_extra_s": saturated_first}
        # The MEDIAN of the pairs' differences: an interruption by another process lands on
        # the loop's call or on the engine's alike, so the differences are the host work plus
        # a noise symmetric about 0 whose tails (tens of ms on a loaded host) would move a mean
        out["loop_prefill_first_paired_extra_s"] = float(np.median(self.pair_first))
        out["loop_prefill_first_paired_block_extra_s"] = self.pair_first_blocks
        # per prompt: each prompt count's median call - engine, summed over the counts, over
        # their prompts (the counts are measured equally often)
        counts = sorted(set(self.pair_prompts))
        out["loop_prefill_paired_per_prompt_s"] = float(
            sum(np.median([w for k, w in zip(self.pair_prompts, self.pair_whole) if k == n])
                for n in counts) / sum(counts))
        out["loop_prefill_paired_block_per_prompt_s"] = self.pair_per_prompt_blocks
        out["prefill_pair_prompts"] = self.pair_prompts
        out["prefill_pair_first_extra_s"] = self.pair_first
        out["prefill_pair_extra_s"] = self.pair_whole
        out["prefill_pair_call_s"] = self.pair_calls
        return out


def idle_prefill_wake(srv, input_len: int, wake_requests: int, idle_gap_s: float,
                      engine_prefill: float, short_gap_s: float = IDLE_SHORT_GAP_S,
                      decode_steps: int | None = None) -> dict[str, Any]:
    """A prefill on an idle loop: `wake_requests` requests `idle_gap_s` apart through the
    server's own serving loop; the median of their TTFTs and what it adds to the engine's
    prefill (`measure_loop`'s docstring), with the median time the loop idled before each
    (its previous request done to the arrival). Then as many spaced `short_gap_s` plus
    that TTFT and decoding (`prefill_wake_short_s`, after `prefill_wake_short_idle_s`): the
    wake grows with the idle time (HostCosts `wake_after`; benchmarks/idle_wake.py); none
    where that spacing is half `idle_gap_s` or more. On an aggregated loop each request
    decodes `decode_steps` steps after its first token (default `WAKE_DECODE_STEPS`; none on
    a prefill slice): each set's seconds from the first token to the last
    (`wake_decoding_s`, `wake_short_decoding_s`) give `decode_after_wake_s` in `combine`,
    where the loop's step is known."""
    steps = 0 if srv.spec.decode is None else (
        WAKE_DECODE_STEPS if decode_steps is None else decode_steps)
    ttft, idles, decoding = _idle_requests(srv, input_len, wake_requests, idle_gap_s, steps)
    after_idle = float(np.median(ttft))
    out = {"prefill_after_idle_s": after_idle, "idle_gap_s": idle_gap_s,
           "prefill_wake_s": max(after_idle - engine_prefill, 0.0),
           "prefill_wake_idle_s": float(np.median(idles))}
    if steps:
        out.update(wake_decode_steps=steps, wake_decoding_s=decoding)
    # the short set spaced to idle about `short_gap_s` whatever the call's length (a call
    # longer than the spacing would queue the next, not wake it; the long set's TTFT is the
    # longer, with its longer wake); none near the long one
    spacing = short_gap_s + after_idle + (float(np.median(decoding)) if steps else 0.0)
    if 0.0 < short_gap_s and spacing < idle_gap_s / 2:
        ttft, idles, decoding = _idle_requests(srv, input_len, wake_requests, spacing, steps)
        out.update(prefill_wake_short_s=max(float(np.median(ttft)) - engine_prefill, 0.0),
                   prefill_wake_short_idle_s=float(np.median(idles)))
        if steps:
            out["wake_short_decoding_s"] = decoding
    return out


def _idle_requests(srv, input_len: int, requests: int, gap_s: float, steps: int = 0
                   ) -> tuple[list[float], list[float], list[float]]:
    """`requests` requests of 1 + `steps` tokens `gap_s` apart (after one not counted)
    through the server's serving loop: their TTFTs, how long the loop idled before each,
    and each one's seconds from its first token to its last."""
    from workloads.serving.slots import serve_aggregated, serve_prefill_slice   # lazy: JAX

    model = srv.model.unpadded
    reqs = [Request((k + 1) * gap_s, input_len, 1 + steps) for k in range(requests + 1)]
    start_at = time.time() + gap_s
    prompt = lambda i: prompt_for(model, 9000 + i, input_len, 7)   # noqa: E731
    if srv.spec.decode is not None:
        served = serve_aggregated(srv, reqs, prompt, start_at)
    else:
        served, _ = serve_prefill_slice(
            srv, [dict(arrival_s=r.arrival_s, input_len=r.input_len, output_len=1)
                  for r in reqs], prompt, start_at, _nowhere)
    ttft = [s["first_token_s"] - r.arrival_s for s, r in zip(served, reqs)][1:]
    done = [s.get("finish_s", s["first_token_s"]) for s in served]
    idles = [max(r.arrival_s - end, 0.0) for r, end in zip(reqs[1:], done[:-1])]
    decoding = [end - s["first_token_s"] for s, end in zip(served, done)][1:]
    return ttft, idles, decoding


def paired_prefill_calls(srv, input_len: int, pairs: int, offset: int = 0
                         ) -> tuple[list[int], list[float], list[float], list[float]]:
    """An aggregated slot server's prefill calls, each paired with the engine's prefill
    program right before it: `pairs` times a decode step (untimed: a stream's prefill call
    follows one), the engine's prefill (timed as a trial times it), a decode step, then the
    serving loop's prefill branch as `serve_aggregated` runs it (prompts made, `srv.prefill`,
    the first tokens on the host; its rows into slots, synchronised), its slots released
    after. The prompts per call cycle 1..prefill_batch (from `offset`). Returns each call's
    prompts, its seconds to the first tokens minus the engine's call, its whole seconds
    minus the engine's call, and its whole seconds (docs/serving.md "Serving host costs")."""
    import jax   # lazy: JAX only in a process that holds a mesh

    spec = srv.spec
    model = srv.model.unpadded
    most = max(min(spec.prefill_batch, spec.slots), 1)
    program = engine_prefill_call(srv, input_len)
    for slot in range(spec.slots):
        srv.release(slot)
    prompts, first, whole, calls = [], [], [], []
    for n in range(pairs):
        k = (offset + n) % most + 1
        srv.step()
        start = time.perf_counter()
        program()
        engine = time.perf_counter() - start
        srv.step()
        start = time.perf_counter()
        done = srv.prefill([prompt_for(model, 5000 + n * 64 + i, input_len, 7) for i in range(k)])
        tokens = [int(t) for t in done.first_tokens[:k]]   # on the host, as served
        to_first = time.perf_counter() - start
        for row in range(k):
            srv.insert(row, done, row, tokens[row])
        jax.block_until_ready(srv.cache)
        call = time.perf_counter() - start
        for row in range(k):
            srv.release(row)
        prompts.append(k)
        first.append(to_first - engine)
        whole.append(call - engine)
        calls.append(call)
    return prompts, first, whole, calls


def saturated_aggregated(srv, input_len: int, output_len: int, n: int,
                         first_token: list | None = None) -> tuple[list, list, float]:
    """`serve_aggregated`'s loop on a burst of `n` requests at time 0: the seconds of each
    decode step and of each prefill branch (synchronised after its inserts, so their
    time is the prefill's, not the next step's; workloads/serving/slots.py `serve_aggregated`),
    and the mean prompts per prefill call after the first."""
    from workloads.serving.slots import serve_aggregated   # lazy: imports JAX (the server's mesh)

    model = srv.model.unpadded
    timings: dict[str, list[float]] = {"step_s": [], "prefill_s": []}
    calls: list = []
    serve_aggregated(srv, [Request(0.0, input_len, output_len)] * n,
                     lambda i: prompt_for(model, i, input_len, 7), timings=timings, calls=calls)
    prompts = [len(c[3]) for c in calls if c[0] == "prefill"][1:] or [1]
    if first_token is not None:    # each prefill call to its first tokens on the host
        first_token += [c[2] - c[1] for c in calls if c[0] == "prefill"]
    return timings["step_s"], timings["prefill_s"], float(np.mean(prompts))


def step_beside(srv, stopped: set, token: int, max_s: float = 60.0) -> int:
    """Decode steps of every slot of `srv`, back to back, until `token` is in `stopped` (put
    there by another thread; removed here) or `max_s`: a decode slice's loop running beside
    the prefill slice's closed loop, as it runs during most of a stream's prefill calls
    (docs/serving.md "The prefill slice beside a stepping decode slice"; sweeper/serving/
    server.py `decode_beside`, a serving trial's decode slice). The steps made."""
    stop = time.time() + max_s
    steps = 0
    while token not in stopped and time.time() < stop:
        srv.step()
        steps += 1
    stopped.discard(token)
    return steps


def handover_send(srv, input_len: int, receive: Callable[[list[dict]], dict],
                  repeats: int = 8) -> list[dict]:
    """KV handovers of `input_len` tokens from a prefill slot server, as a stream's prefill
    slice sends them (export, one call), one at a time; `receive(handover)` hands them to
    the decode side and returns its `handover_receive` answer. Per handover the wall clock
    when the export starts, when it is done, when the call is submitted (what the prefill
    loop pays), when the decode side has the KV in a slot, and its insert alone (what its
    loop pays)."""
    prompt = [prompt_for(srv.model.unpadded, 0, input_len, 7)]
    done = srv.prefill(prompt)
    out = []
    for _ in range(repeats + 1):
        start = time.time()
        kv = srv.export_kv(done, 0)
        exported = time.time()
        pending = receive([{"request": 0, "kv": kv, "first_token": int(done.first_tokens[0]),
                            "output_len": 2}])
        submitted = time.time()
        received = pending() if callable(pending) else pending
        out.append({"start": start, "exported": exported, "submitted": submitted,
                    "in_slot": received["in_slot"], "insert_s": received["insert_s"],
                    "bytes": int(kv.nbytes)})
    return out[1:]


def handover_receive(srv, handover: list[dict]) -> dict[str, float]:
    """The decode side of one handover: the KV into slot 0, synchronised; the wall clock
    then, and the seconds of the insert itself (as a decode slice's loop pays it)."""
    import jax   # lazy: only where a mesh runs

    began = time.perf_counter()
    for item in handover:
        srv.insert(0, item["kv"], 0, item["first_token"])
    jax.block_until_ready(srv.cache)
    insert_s = time.perf_counter() - began
    done = time.time()
    srv.release(0)
    return {"in_slot": done, "insert_s": insert_s}


def handover_costs(samples: list[dict], decode_cpu_s: float) -> tuple[float, dict]:
    """(`handover_overhead_s`, its detail) from `handover_send`'s samples and the decode
    process's CPU seconds per handover: that CPU, at least the inserts' mean. The receipt
    (Ray receiving and unpickling the KV) runs on the decode worker's Ray threads, which
    are not pinned with its loop, so whether it lands on the loop's core depends on the
    other core's load; in the validation runs it did more often than not (docs/serving.md
    "What a handover costs a stepping decode loop"). Not the handover's whole wall clock
    (sweeper/serving/overheads.py's docstring)."""
    size = np.array([s["bytes"] for s in samples], dtype=float)
    seconds = np.array([s["in_slot"] - s["start"] for s in samples])
    if len(set(size)) > 1:
        slope, intercept = np.polyfit(size, seconds, 1)
    else:
        slope, intercept = 0.0, float(np.median(seconds))
    insert = float(np.mean([s["insert_s"] for s in samples]))
    submit = float(np.mean([s["submitted"] - s["exported"] for s in samples]))
    detail = {"bytes": sorted(set(size.tolist())),
              "median_s": {int(b): float(np.median(seconds[size == b])) for b in sorted(set(size))},
              "fixed_s": max(float(intercept), 0.0), "insert_mean_s": insert,
              "decode_cpu_s": decode_cpu_s, "submit_mean_s": submit,
              "seconds_per_byte": float(slope), "samples": len(samples)}
    return max(decode_cpu_s, insert), detail


IDLE_HANDOVERS = 8      # requests through the slices' loops, each on an idle decode loop
IDLE_HANDOVER_GAP_S = 0.05


def idle_handover_gap_s(prefill: dict, decode: dict, output_len: int) -> float:
    """The idle handovers' spacing: `IDLE_HANDOVER_GAP_S`, or twice a request's prefill and
    decoding in the closed loops (`measure_loop`'s means) when that is longer, so that each
    finds the decode loop idle (a request still decoding would be in the next one's latency
    and decoding)."""
    one = prefill["loop_prefill_mean_s"] + max(output_len - 1, 1) * decode["loop_step_mean_s"]
    return max(IDLE_HANDOVER_GAP_S, 2 * one)


def idle_handover_requests(input_len: int, output_len: int, gap_s: float = IDLE_HANDOVER_GAP_S,
                           n: int = IDLE_HANDOVERS) -> list[dict]:
    """`n` requests `gap_s` apart (plain, as `serve_prefill_slice` takes them): each finds
    the decode loop idle, its previous request decoded (`idle_handover_costs`)."""
    return [dict(arrival_s=(k + 1) * gap_s, input_len=input_len, output_len=max(output_len, 2))
            for k in range(n)]


def idle_handover_costs(served: list[dict], step_s: float) -> dict[str, Any]:
    """A disaggregated deployment's handover as a stream pays it, from `idle_handover_requests`
    served by the real slice loops (`serve_prefill_slice` sending through the deployment's
    transport to `serve_decode_slice`, running on the decode worker): per request its send's
    end (`sent_s`), its insert's start and the KV in a slot (`insert_start_s`, `kv_ready_s`)
    and its last token (`finish_s`). The closed loops cannot see these: the decode loop
    there never idles, and `handover_send` hands the KV to a decode worker waiting for it.

    `handover_latency_s`: the median of insert start - send end (the KV's transport to the
    decode process and the idle loop's poll; HostCosts `handover_latency_s`).
    `handover_overhead_s`: the median insert, on the decode loop's clock (what that loop
    pays per handover). `decode_wake_s`: the median of what each request's decoding took
    after its insert beyond `step_s` per step (the serving model's step), at least 0: the
    decode process's first step after idling (HostCosts `decode_wake_s`).
    `prefill_idle_after_s`: the median of send end - first token (the prefill call's export
    and send on an idle loop, per prompt: one per call; HostCosts `prefill_idle_after_s`).
    Measured in the
    `serving-modes` trial's stream before this: its inserts took ~0.86 ms where
    `handover_send`'s took ~0.36 ms, the step after an insert ~0.75 ms where the next ones
    took ~0.45 ms, and the KV reached the decode process ~0.9 ms after the send
    (docs/serving.md "Serving host costs")."""
    done = [s for s in served if "finish_s" in s and "insert_start_s" in s and "sent_s" in s]
    if not done:
        return {"requests": 0}
    latency = [s["insert_start_s"] - s["sent_s"] for s in done]
    insert = [s["kv_ready_s"] - s["insert_start_s"] for s in done]
    decoding = [s["finish_s"] - s["kv_ready_s"] for s in done]
    steps = [len(s["tokens"]) - 1 for s in done]          # the first token is the prefill's
    after = [s["sent_s"] - s["first_token_s"] for s in done]
    extra = [d - k * step_s for d, k in zip(decoding, steps)]
    return {"handover_latency_s": max(float(np.median(latency)), 0.0),
            "handover_overhead_s": float(np.median(insert)),
            "decode_wake_s": max(float(np.median(extra)), 0.0), "requests": len(done),
            "latency_samples_s": latency, "insert_samples_s": insert,
            "decoding_samples_s": decoding, "model_step_s": step_s,
            # an idle prefill loop's export and send after its first tokens, per prompt
            # (one per call here): HostCosts `prefill_idle_after_s`
            "prefill_idle_after_s": max(float(np.median(after)), 0.0),
            "send_after_first_token_samples_s": after}


def host_costs(prefill: dict, decode: dict) -> dict[str, float]:
    """The step and prefill host costs from `measure_loop`'s answers: the loop's MEANS (the
    median of its blocks' means) against the engine's medians, the prefill's per prompt of
    the closed loop's calls. Means: a stream's queue is paid in mean service time; a replay
    of served streams through the serving model with their own calls' durations reproduces
    the measured TTFT with the means, and misses it by ~25% (p50, 85% load) with the
    medians (docs/serving.md "Checking the model against the server")."""
    prompts = float(prefill.get("loop_prefill_prompts") or 1.0)
    if "loop_prefill_paired_per_prompt_s" in prefill:
        # aggregated: the prefill calls paired one by one with the engine's, at 1..batch
        # prompts (measure_loop `paired_prefill_calls`): the saturated loop of a multi-prompt
        # prefill times ~1 call per block, whose block means moved by +-10 ms
        per_prompt = max(prefill["loop_prefill_paired_per_prompt_s"], 0.0)
    elif "loop_prefill_paired_extra_s" in prefill:
        # a prefill slice: its calls paired by block with the engine's blocks beside them
        per_prompt = max(prefill["loop_prefill_paired_extra_s"], 0.0) / prompts
    else:
        per_prompt = max(prefill["loop_prefill_mean_s"] - prefill["engine_prefill_s"], 0.0) / prompts
    # the step is paired with the engine's calls (a decode slice: the call just before each
    # step; aggregated: the engine's blocks just before and after each block of the loop):
    # its host work per step is the median over blocks of their means' difference, so that
    # the other processes' load during the measurement (in both) is not charged to every
    # step of a stream that may not see it (sweeper/serving/overheads.py's docstring)
    step = decode.get("loop_step_paired_extra_s")
    if step is None:
        step = decode["loop_step_mean_s"] - decode["engine_step_s"]
    return {"step_overhead_s": max(step, 0.0) + step_sync_s(decode),
            "prefill_overhead_per_prompt_s": per_prompt}


def step_sync_s(decode: dict) -> float:
    """What waiting for every step's tokens adds to the engine's step: its call timed alone
    (synchronised) minus its steps run back to back (`engine_step_pipelined_s`, as a trial
    times them, the step the host cost model prices); 0 where not measured (a staged
    server) or below the timers' noise. The serving loop pays it on every step, so it is
    part of `step_overhead_s`."""
    pipelined = decode.get("engine_step_pipelined_s")
    if pipelined is None:
        return 0.0
    return max(decode["engine_step_s"] - pipelined, 0.0)


def engine_step_priced_s(decode: dict) -> float:
    """The engine's step that `step_overhead_s` is charged on top of: the pipelined step
    where measured, else the synchronised call."""
    return decode.get("engine_step_pipelined_s", decode["engine_step_s"])


def model_step_s(decode: dict, costs: Mapping[str, float]) -> float:
    """A decode step as the serving model charges it: the engine's step that
    `step_overhead_s` is charged on top of (`engine_step_priced_s`), plus that overhead."""
    return engine_step_priced_s(decode) + costs["step_overhead_s"]


def first_token_overhead(prefill: dict) -> float:
    """Of a prefill call's host work, the seconds before its first tokens (per call): the
    closed loop's calls to their first tokens minus the engine's prefill program, paired
    (per block, against the engine's calls just before and after it; the median over
    blocks), at most the call's whole host work; 0 for a measurement without it."""
    if "loop_prefill_first_paired_extra_s" not in prefill:
        return 0.0
    if "prefill_pair_extra_s" in prefill:      # aggregated: the paired calls' mean host work
        whole = max(float(np.mean(prefill["prefill_pair_extra_s"])), 0.0)
    elif "loop_prefill_paired_extra_s" in prefill:    # a prefill slice: paired by block
        whole = max(prefill["loop_prefill_paired_extra_s"], 0.0)
    else:
        whole = max(prefill["loop_prefill_mean_s"] - prefill["engine_prefill_s"], 0.0)
    return min(max(prefill["loop_prefill_first_paired_extra_s"], 0.0), whole)


def combine(prefill: dict, decode: dict, handover: tuple[float, dict] | None = None,
            idle_handovers: list[dict] | None = None,
            stepping: dict | None = None) -> dict[str, Any]:
    """The measurement's costs, each under its `HostCosts` name (workloads/serving/costs.py;
    the disaggregated ones 0 or absent for an aggregated server), and their `detail`, from the prefill side's and the decode side's `measure_loop` (the
    same answer twice for an aggregated server) and, for a disaggregated deployment,
    `handover_costs`, the served `idle_handover_requests` (`idle_handover_costs`) and
    `stepping_handover_costs`. `handover_overhead_s`: the decode process's CPU per
    handover, or the stepping loop's figure (its inserts, and the step after each when
    slower) where that is more (`handover_costs`' insert mean where the stepping loop was
    not measured; docs/serving.md "What a handover costs a stepping decode loop"); the
    idle loop's insert stays in the detail."""
    out: dict[str, Any] = {**host_costs(prefill, decode), "handover_overhead_s": 0.0,
                           # a prefill call on an idle loop: its extra seconds
                           "prefill_wake_s": float(prefill.get("prefill_wake_s", 0.0)),
                           # ... after how long idle; and after a short idle
                           **{name: float(prefill.get(name, 0.0)) for name in (
                               "prefill_wake_idle_s", "prefill_wake_short_s",
                               "prefill_wake_short_idle_s")},
                           # of a prefill call's host work, the part before its first tokens
                           "prefill_first_overhead_s": first_token_overhead(prefill)}
    if prefill is decode:
        out.update(decode_after_wake(prefill, out))
    else:       # a prefill slice's loop: its wake is the slice's own (HostCosts `for_mode`)
        out.update({f"slice_wake{name}": out[f"prefill_wake{name}"] for name in SLICE_WAKE})
    detail: dict[str, Any] = ({"aggregated": prefill} if prefill is decode
                              else {"prefill": prefill, "decode": decode})
    if handover is not None:
        out["handover_overhead_s"], detail["handover"] = handover
    if idle_handovers is not None:
        # the handover as the stream's loops pay it replaces the closed loop's decode CPU
        # per handover (kept in detail["handover"]): measured on the loop it is charged to
        idle = idle_handover_costs(idle_handovers,
                                   model_step_s(decode, out))
        if idle["requests"]:
            # the idle loop's insert median stays in the detail, not charged: an idle
            # loop's insert is longer than a stepping one's (docs/serving.md "What a
            # handover costs a stepping decode loop")
            for name in ("handover_latency_s", "decode_wake_s", "prefill_idle_after_s"):
                out[name] = idle[name]
        detail["idle_handovers"] = idle
    if stepping is not None:
        detail["stepping_handovers"] = stepping
        if stepping.get("handovers"):
            # measured on the loop it is charged to, stepping, with handovers at a
            # stream's rate: its inserts, and the step after each when that is slower;
            # at least the decode process's CPU per handover (`handover_costs`)
            cpu = detail.get("handover", {}).get("decode_cpu_s", 0.0)
            out["handover_overhead_s"] = max(stepping["handover_overhead_s"],
                                             stepping["insert_s"], cpu, 0.0)
    out["detail"] = detail
    return out


def decode_after_wake(loop: dict, costs: Mapping[str, float]) -> dict[str, float]:
    """An aggregated loop's `decode_after_wake_s` (and `_short_s`) from its idle requests
    (`idle_prefill_wake`): the median of each request's seconds from its first token to
    its last beyond what the serving model charges there (the prefill's host work after
    its first tokens, `prefill_overhead_per_prompt_s` - `prefill_first_overhead_s`, and
    `wake_decode_steps` steps of the engine's step and `step_overhead_s`), at least 0.
    Measured on this host (docs/serving-model.md "A prefill on an idle loop"): in a 1-slot
    stream at a third of its capacity, the first step after ~0.1 s idle took 0.6 ms more
    than a busy loop's, the second 0.2 ms, the rest as many; none after a 1-10 ms idle.
    {} without the requests' decoding (a prefill slice; an older measurement)."""
    steps = loop.get("wake_decode_steps", 0)
    if not steps or "wake_decoding_s" not in loop:
        return {}
    after = max(costs["prefill_overhead_per_prompt_s"] - costs["prefill_first_overhead_s"], 0.0)
    charged = after + steps * model_step_s(loop, costs)
    out = {}
    for name, key in (("decode_after_wake_s", "wake_decoding_s"),
                      ("decode_after_wake_short_s", "wake_short_decoding_s")):
        if loop.get(key):
            out[name] = max(float(np.median(loop[key])) - charged, 0.0)
    return out


def duration_spread(costs: dict) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """(prefill, decode step) duration factors of mean 1 from a measurement's closed loops
    (each call's seconds over their mean): the spread the serving model draws from
    (StepTimes `prefill_spread`, `step_spread`)."""
    detail = costs["detail"]
    pre = detail["aggregated"] if "aggregated" in detail else detail["prefill"]
    dec = detail["aggregated"] if "aggregated" in detail else detail["decode"]

    def factors(samples) -> tuple[float, ...]:
        values = np.asarray([] if samples is None else samples, dtype=float)
        return tuple((values / values.mean()).tolist()) if values.size and values.mean() > 0 else ()

    # aggregated: the paired prefill calls too (measure_loop: a multi-prompt prefill's
    # saturated loop times ~1 call per block, too few for a spread), each over the mean of
    # the calls of its own prompt count: their host work grows with the prompts, which is
    # the model's per-prompt cost, not a spread
    prefill = list(factors(pre.get("loop_prefill_samples_s")))
    pairs = np.asarray(pre.get("prefill_pair_call_s") or [], dtype=float)
    counts = np.asarray(pre.get("prefill_pair_prompts") or [], dtype=int)
    for k in sorted(set(counts.tolist())):
        prefill += factors(pairs[counts == k])
    return tuple(prefill), factors(dec.get("loop_step_samples_s"))


def engine_prefill_s(srv, input_len: int, repeats: int = 5) -> float:
    """The median of `repeats` timed calls of the engine's prefill program of `input_len`
    tokens (the first dropped), as `measure_loop` times it: another prompt length's engine
    call beside one measurement."""
    program = engine_prefill_call(srv, input_len)
    calls = []
    for k in range(repeats + 1):
        start = time.perf_counter()
        program()
        if k:
            calls.append(time.perf_counter() - start)
    return float(np.median(calls))


def engine_prefill_call(srv, input_len: int) -> Callable[[], None]:
    """The engine's prefill program alone, as a call that runs it once and waits for it: the
    prefill batch's prompts of `input_len` tokens, no host work. A pipeline-staged server
    (workloads/serving/pipeline.py `StagedSlotServer`) runs every stage's program in turn, the
    residual stream moved between their devices, as its `prefill` does."""
    import jax   # lazy: only where a mesh runs

    batch = np.stack([prompt_for(srv.model.unpadded, i, input_len, 7)
                      for i in range(srv.spec.prefill_batch)])
    if _staged(srv):
        from workloads.engine import _Shapes

        engine, shapes = srv.engine, _Shapes(srv.spec.prefill_batch, input_len, input_len)
        inputs = engine.split(batch, 1)
        return lambda: jax.block_until_ready(engine.run("prefill", inputs, shapes))
    program = srv._prefill_program(input_len)
    placed = jax.device_put(batch, srv._replicated)
    return lambda: jax.block_until_ready(program(srv.params, placed))


def engine_decode_run(srv, input_len: int, steps: int) -> Callable[[], None] | None:
    """`engine_decode_call`'s decode and argmax `steps` times back to back, each step fed
    the last one's tokens and waited for once, after the last (workloads/engine.py
    `decode_loop`, as a trial runs its steps); None for a staged server."""
    import jax   # lazy: only where a mesh runs

    if _staged(srv):
        return None
    tokens_d, positions_d = (jax.device_put(x, srv._replicated)
                             for x in _slot_inputs(srv, input_len))

    def run() -> None:
        token = tokens_d
        for _ in range(steps):
            logits, srv.cache = srv.engine.decode(srv.params, srv.cache, token, positions_d)
            token = srv.engine.greedy(logits)
        jax.block_until_ready((srv.cache, token))
    return run


def engine_decode_call(srv, input_len: int) -> Callable[[], None]:
    """The engine's decode of the whole slot batch and its argmax, as a call that runs it once
    and waits for it (every slot at position `input_len`; it writes that position of the
    caches, which no timing reads): the step without the loop's host work. A staged server
    runs its micro-batches through every stage as its `step` does."""
    import jax   # lazy: only where a mesh runs

    tokens, positions = _slot_inputs(srv, input_len)
    if _staged(srv):
        engine, micro = srv.engine, srv.micro_batches
        inputs = engine.split(tokens, micro)
        placed = list(zip(*[engine.split(positions, micro, s) for s in srv.stages]))

        def staged() -> None:
            logits, srv._caches = engine.run("decode", inputs, srv._decode_shapes, srv._caches,
                                             placed)
            jax.block_until_ready((srv._caches, [engine.greedy(x) for x in logits]))
        return staged
    tokens_d, positions_d = (jax.device_put(x, srv._replicated) for x in (tokens, positions))

    def one() -> None:
        logits, srv.cache = srv.engine.decode(srv.params, srv.cache, tokens_d, positions_d)
        jax.block_until_ready((srv.cache, srv.engine.greedy(logits)))
    return one


def _slot_inputs(srv, input_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Every slot's token (0) and position (`input_len`) for a decode of the slot batch."""
    return (np.zeros(srv.spec.slots, np.int32), np.full(srv.spec.slots, input_len, np.int32))


def _staged(srv) -> bool:
    """A pipeline-staged slot server (its `stages`: the Stage list)."""
    return isinstance(getattr(srv, "stages", None), list)


# ---- a handover as a STEPPING decode loop pays it (docs/serving.md "Serving host costs",
# "What a handover costs a stepping decode loop")

STEPPING_WINDOWS = 12     # alternating windows, with handovers in `stepping_with(k)` ones
STEPPING_WINDOW_S = 0.3
STEPPING_LOAD = 0.85      # handovers at this fraction of the decode slice's closed-loop capacity


def stepping_with(window: int) -> bool:
    """Whether window `window` has handovers: N W W N N W W N ..., so that every window with
    handovers has one without them beside it (`stepping_partner`) and a drift of the host's
    load over the measurement is in both sides of the pairs alike."""
    return window % 4 in (1, 2)


def stepping_partner(window: int) -> int:
    """The window without handovers paired with window `window` (one with them)."""
    return window - 1 if window % 4 == 1 else window + 1


def stepping_rate(prefill: dict, decode: dict, slots: int, output_len: int,
                  load: float = STEPPING_LOAD) -> float:
    """Handovers per second for `stepping_send`: `load` x the decode slice's capacity at its
    closed loop's mean step (slots / ((output_len - 1) x step): the rate at which a stream
    at that load frees its slots), at most 90% of one prompt per prefill call at the prefill
    slice's closed-loop mean call (so the prefill worker keeps to the schedule)."""
    step = decode["loop_step_mean_s"]
    decode_rps = slots / (max(output_len - 1, 1) * step)
    prefill_rps = 0.9 / prefill["loop_prefill_mean_s"]
    return min(load * decode_rps, prefill_rps)


def stepping_decode_loop(srv, inbox, start_at: float, windows: int = STEPPING_WINDOWS,
                         window_s: float = STEPPING_WINDOW_S) -> list[tuple]:
    """The decode slice's loop stepping every slot back to back from `start_at` for `windows`
    x `window_s` seconds; before each step every handover in `inbox` (a `queue.Queue` filled
    by the worker's receiving thread, as a stream's) goes into a slot, one after the other,
    as `serve_decode_slice` inserts them (round robin over the slots, each freed after its
    answer's steps: the step runs every slot, so which are busy does not change its
    time). The call log on the wall clock:
    `("step", start, end)` and `("insert", start, end)`; the handovers left in `inbox` at the
    end are dropped."""
    spec = srv.spec
    calls: list[tuple] = []
    remaining = [0] * spec.slots
    slot = 0
    sleep_for = start_at - time.time()
    if sleep_for > 0:
        time.sleep(sleep_for)
    end = start_at + windows * window_s
    while time.time() < end:
        while True:
            try:
                item = inbox.get_nowait()
            except Exception:             # queue.Empty: nothing more received
                break
            began = time.time()
            srv.insert(slot, item["kv"], 0, item["first_token"])
            calls.append(("insert", began, time.time()))
            remaining[slot] = max(item["output_len"] - 1, 1)
            slot = (slot + 1) % spec.slots
        began = time.time()
        tokens = srv.step()
        for s, left in enumerate(remaining):     # as `advance_slots`: a done answer's slot freed
            if left > 0:
                int(tokens[s])
                remaining[s] -= 1
                if remaining[s] == 0:
                    srv.release(s)
        calls.append(("step", began, time.time()))
    while True:
        try:
            inbox.get_nowait()
        except Exception:
            break
    for s in range(spec.slots):
        srv.release(s)
    return calls


def stepping_send(srv, input_len: int, output_len: int, start_at: float, rate: float,
                  send: Callable[[list[dict]], Any], windows: int = STEPPING_WINDOWS,
                  window_s: float = STEPPING_WINDOW_S) -> tuple[list[int], list]:
    """The prefill side of `stepping_decode_loop`: from `start_at`, one prompt every 1 /
    `rate` seconds prefilled and its KV exported, as a stream's prefill slice does, in every
    window; sent through `send` (as `serve_prefill_slice` sends, not waited for) only in the
    windows with handovers (`stepping_with`), so that the prefill core's work beside the
    decode loop is the same in both windows of a pair. Returns the handovers sent per window
    and `send`'s answers."""
    model = srv.model.unpadded
    per_window = [0] * windows
    sent: list = []
    n = 0
    while True:
        when = start_at + (n + 0.5) / rate
        window = int((when - start_at) // window_s)
        if window >= windows:
            break
        sleep_for = when - time.time()
        if sleep_for > 0:
            time.sleep(sleep_for)
        done = srv.prefill([prompt_for(model, 9700 + n, input_len, 7)])
        first = int(done.first_tokens[0])
        kv = srv.export_kv(done, 0)
        if stepping_with(window) and time.time() < start_at + windows * window_s:
            sent.append(send([{"request": n, "kv": kv, "first_token": first,
                               "output_len": output_len}]))
            per_window[window] += 1
        n += 1
    return per_window, sent


def stepping_handover_costs(calls: list[tuple], start_at: float, windows: int = STEPPING_WINDOWS,
                            window_s: float = STEPPING_WINDOW_S) -> dict[str, Any]:
    """What one handover costs a stepping decode loop, from `stepping_decode_loop`'s log
    (the steps of a window: those starting in it).

    Per window with handovers: (its inserts + the steps right after an insert x their
    median's excess over the median of the window's other steps) / its handovers (medians:
    a step interrupted by another process, tens of ms on a loaded host, is as likely
    among either, and moves neither); `handover_overhead_s` is
    the median over those windows (a burst of other processes' load in fewer than half of
    them does not move it), with its parts `insert_s` and `step_after_s`. The baseline is
    the same window's other steps: the host's load moved a window's steps by 5-20% on a
    shared 2-core host, more than a handover costs per step, so windows are not compared
    with each other for the charge. The steps after an insert are chosen by position, not
    by a time stamp falling in them (a stamp lands in long steps more often: a step
    slowed by other processes would be counted as the handover's).

    Diagnostics: `window_paired_s` (per window with handovers, its loop time - its steps x
    the paired window's loop time per step, `stepping_partner`, per handover: the whole
    cost, including receipt work landing on any step, but with the windows' drift in it)
    and `other_step_ratio` (the other steps' mean over the paired window's step mean: ~1
    when the handovers slow no step but the one after their insert); every window's
    figures."""
    steps = [c for c in calls if c[0] == "step"]
    inserts = [c for c in calls if c[0] == "insert"]
    per: list[dict] = []
    for k in range(windows):
        lo, hi = start_at + k * window_s, start_at + (k + 1) * window_s
        idx = [j for j, c in enumerate(steps) if lo <= c[1] < hi]
        if len(idx) < 4:
            per.append({"steps": len(idx)})
            continue
        first, last = steps[idx[0]][1], steps[idx[-1]][2]
        mine = [c for c in inserts if first <= c[1] < last]
        after = {j for j in idx[1:] if any(steps[j - 1][2] <= c[1] < steps[j][1] for c in mine)}
        durations = {j: steps[j][2] - steps[j][1] for j in idx}
        other = [durations[j] for j in idx if j not in after]
        shift = (float(np.median([durations[j] for j in after]) - np.median(other))
                 if after and other else 0.0)
        per.append({"steps": len(idx), "handovers": len(mine), "loop_s": last - first,
                    "step_mean_s": float(np.mean(list(durations.values()))),
                    "other_step_mean_s": float(np.mean(other)) if other else float("nan"),
                    "steps_after_insert": len(after),
                    "step_after_extra_s": shift * len(after),
                    "insert_s": float(np.sum([c[2] - c[1] for c in mine]))})
    pairs: list[dict] = []
    for k in range(windows):
        if not stepping_with(k) or stepping_partner(k) >= windows:
            continue
        w, n = per[k], per[stepping_partner(k)]
        if not w.get("handovers") or "loop_s" not in n or not np.isfinite(w["other_step_mean_s"]):
            continue
        h = w["handovers"]
        pairs.append({"window": k, "handovers": h,
                      "overhead_s": (w["insert_s"] + w["step_after_extra_s"]) / h,
                      "insert_s": w["insert_s"] / h, "step_after_s": w["step_after_extra_s"] / h,
                      "other_step_ratio": w["other_step_mean_s"] / n["step_mean_s"],
                      "window_paired_s": (w["loop_s"] - w["steps"] * n["loop_s"] / n["steps"]) / h})
    if not pairs:
        return {"handovers": 0, "windows": per}
    return {**{name: float(np.median([p[key] for p in pairs]))
               for name, key in (("handover_overhead_s", "overhead_s"), ("insert_s", "insert_s"),
                                 ("step_after_s", "step_after_s"),
                                 ("other_step_ratio", "other_step_ratio"),
                                 ("window_paired_s", "window_paired_s"))},
            "handovers": int(sum(p["handovers"] for p in pairs)), "pairs": pairs,
            "windows": per, "window_s": window_s}
