"""The serving workers: Ray actors that each own one emulated mesh (or the real devices) and
serve a request stream with the engine's slot server (workloads/serving.py).

Aggregated: one `ServingWorker` runs prefill and decode on its mesh, in the engine's one
aggregated loop (workloads/serving.py `serve_aggregated`, the loop the serving model
simulates, workloads/servingmodel.py `_aggregated_replica`): when prompts wait and
slots are free, one prefill call (at most `prefill.batch` prompts of one length) is inserted
between two decode steps; the decode step runs every slot.

Disaggregated: a prefill worker runs prefill calls back to back in arrival order and hands
each request's KV cache (a host array) to the decode worker in one Ray call per prefill
call (`deliver.remote`: Ray moves an argument over 100 KiB through its object store); the
decode worker (two threads: one receives handovers, one serves) puts every received request
into a free slot before its next step, one insertion after the other (the serving model
charges each `handover_overhead_s` of the decode loop's time, docs/serving.md).

Serving host costs (`measure_host_costs`, `handover_receive`; sweeper/serving/overheads.py):
a worker times its own serving loop's work against the engine's timed calls of the same
shape, outside any served stream.

Arrivals are wall-clock: every worker waits for a shared start time and then for each
request's `arrival_s` after it. Times are `time.time()` (one host: the same clock in every
process). Each worker reports, per request, when its first token was on the host and when
its last was, and the tokens themselves.

A worker is started as the sweep's workers are (sweeper/sweep/workers.py): the emulated
chip count in XLA_FLAGS before JAX starts, pinned to its share of this process's cores
(`split_cores`), `num_cpus=0` (the pinning decides the cores, not Ray's accounting).
"""

from __future__ import annotations

import os
import queue
import re
import time
from typing import Any

from workloads.servingprofile import Request

try:    # the sweep's mesh-worker helpers (sweeper/sweep/meshworker.py since the workers split)
    from sweeper.sweep.meshworker import split_cores, where_am_i
except ImportError:
    from sweeper.sweep.workers import split_cores, where_am_i

POLL_S = 0.0005           # a waiting decode worker checks for handovers this often


def prompt_for(model, request_index: int, input_len: int, seed: int):
    """Request `request_index`'s prompt tokens (deterministic from the seed)."""
    from workloads.model import prompt_tokens

    return prompt_tokens(model, 1, input_len, seed * 1_000_003 + request_index)[0]


def _nowhere(handover: list[dict]) -> None:
    raise RuntimeError(f"a prefill worker without a decode worker cannot hand over requests "
                       f"{[h['request'] for h in handover]} (answers longer than one token)")


class ServingWorker:
    """One mesh serving a stream (see the module docstring)."""

    def __init__(self, cores: list[int] | None):
        self.cores = None
        if cores:
            wanted = set(cores) & os.sched_getaffinity(0)
            if wanted:
                os.sched_setaffinity(0, wanted)
                self.cores = sorted(wanted)
        self.server = None
        self.inbox: queue.Queue = queue.Queue()
        self.calls: list = []            # the last stream's call log (`last_calls`)

    def where(self) -> dict[str, Any]:
        return {**where_am_i(), "cores": self.cores}

    def setup(self, spec: dict, prompt_lens: list[int]) -> dict[str, float]:
        """Build the slot server and warm up every program it will run (no request pays a
        compile); the warm calls' seconds (a diagnostic, see serve.py)."""
        from workloads.serving import SlotServer, SlotSpec
        from workloads.config import ModelConfig
        from workloads.layouts import PhaseLayout

        spec = dict(spec)
        spec["model"] = ModelConfig.from_dict(spec["model"])
        spec["topology"] = tuple(spec["topology"])
        for phase in ("prefill", "decode"):
            if spec[phase] is not None:
                spec[phase] = PhaseLayout(*spec[phase])
        self.spec = SlotSpec(**spec)
        self.server = SlotServer(self.spec)
        times: dict[str, float] = {"devices": float(len(self.server.mesh.devices.flat))}
        for length in sorted(set(prompt_lens)):
            warm = self.server.warm_up(length)
            if "prefill_s" in warm:
                times[f"prefill_s@{length}"] = warm["prefill_s"]
            if "decode_step_s" in warm:
                times["decode_step_s"] = warm["decode_step_s"]
        return times

    # ---- aggregated

    def serve_aggregated(self, requests: list[dict], start_at: float, seed: int,
                         indices: list[int] | None = None) -> list[dict]:
        """The stream in the engine's aggregated loop (workloads/serving.py
        `serve_aggregated`), prompts from `seed`; `indices`: each request's index in the
        whole stream (one replica's share, serve.py `route`), which its prompt is made from."""
        from workloads.serving import serve_aggregated   # lazy: imports JAX (the worker's mesh)

        model = self.server.model.unpadded
        reqs = [Request(**r) for r in requests]
        index = list(indices) if indices is not None else list(range(len(reqs)))
        self.calls = []
        return serve_aggregated(self.server, reqs,
                                lambda i: prompt_for(model, index[i], reqs[i].input_len, seed),
                                start_at, calls=self.calls)

    def last_calls(self) -> list:
        """The last stream's call log, seconds after its start: aggregated as
        `serve_aggregated` writes it; a prefill slice `("prefill", start, end, [requests])`
        (end: the first tokens on the host) and `("send", start, end, [requests])` (their KV
        exported and `deliver.remote` submitted); a decode slice `("insert", start, end,
        request)` and `("step", start, tokens on the host, busy slots, end of the slots'
        bookkeeping)`."""
        return self.calls

    # ---- disaggregated

    def serve_prefill(self, requests: list[dict], start_at: float, seed: int, decode) -> list[dict]:
        """Prefill calls back to back in arrival order; each KV cache to `decode` via Ray
        (workloads/serving.py `serve_prefill_slice`, the one prefill-slice loop). `decode`
        None: answers of one token only, nothing to hand over (`measure_host_costs`)."""
        import ray   # lazy: only inside a Ray worker
        from workloads.serving import serve_prefill_slice   # lazy: imports JAX

        model = self.server.model.unpadded
        self.calls = []
        out, sent = serve_prefill_slice(
            self.server, requests, lambda i: prompt_for(model, i, requests[i]["input_len"], seed),
            start_at, decode.deliver.remote if decode is not None else _nowhere, self.calls)
        if sent:
            ray.get(sent)
        return out

    def deliver(self, handover: list[dict]) -> None:
        """Receive prefilled requests (runs on the decode worker's second thread)."""
        for item in handover:
            self.inbox.put(item)

    def serve_decode(self, expected: int, start_at: float) -> dict[int, dict]:
        """Decode the `expected` requests the prefill worker hands over; per request, when
        its KV was in a slot, its last token's time and its decoded tokens
        (workloads/serving.py `serve_decode_slice`, the one decode-slice loop)."""
        from workloads.serving import serve_decode_slice   # lazy: imports JAX

        self.calls = []
        return serve_decode_slice(self.server, self.inbox, expected, start_at, self.calls, POLL_S)


    # ---- serving host costs (sweeper/serving/overheads.py), outside any served stream

    def measure_host_costs(self, input_len: int, output_len: int, rounds: int = 2,
                           blocks: int = 5, min_block_s: float = 0.25,
                           wake_requests: int = 12, idle_gap_s: float = 0.1,
                           decode=None) -> dict:
        """This worker's serving loop against the engine's timed calls of the same shapes.

        Engine: the prefill program alone, and the decode call of the full slot batch (decode
        program and argmax), arguments placed before the timer, synchronised: as a
        calibration trial times them. Loop: the serving loop itself at saturation, with no
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
        loop_step_s, engine_prefill_s, loop_prefill_s} (a phase the worker does not run is
        absent), the measurement's wall clock `measured_s`, the loop's prompts per prefill
        call and every closed-loop call's seconds {loop_step_samples_s, loop_prefill_samples_s}.

        `decode` (a prefill slice's decode worker): the closed loop also hands each prefill
        call's KV to it in one Ray call, as `serve_prefill` does (`sink` drops it), without
        waiting for it: the submission and the Ray work it leaves on this worker's core
        after `.remote()` returns are in the loop's prefill, as a stream's prefill pays them.

        Idle loop (a worker with a prefill phase): `wake_requests` one-token requests
        `idle_gap_s` apart (the loop idle between them) served by this worker's own serving
        loop (`serve_aggregated` or `serve_prefill`, sleeps and wake-ups included): the
        median of their TTFTs `prefill_after_idle_s`, and `prefill_wake_s` = that minus the
        engine's prefill (what a call on an idle loop adds before its first token: a
        stream's prefill worker is idle between arrivals, the closed loop above never is)."""
        import jax   # lazy: only inside a Ray worker (its mesh is set up there)
        import jax.numpy as jnp   # lazy: as jax
        import numpy as np
        from workloads.serving import advance_slots   # lazy: imports JAX, as above

        srv, spec = self.server, self.spec
        model = srv.model.unpadded
        out: dict[str, Any] = {}
        repeats = 5                 # per engine block (its first dropped): blocks + 1 of them
        engine_prefill: list[float] = []
        engine_step: list[float] = []

        def engine_calls() -> None:
            """The engine's calls, timed as a trial times them (the first of each dropped)."""
            if spec.prefill is not None:                 # the prefill program alone
                program = srv._prefill_program(input_len)
                batch = np.stack([prompt_for(model, i, input_len, 7)
                                  for i in range(spec.prefill_batch)])
                placed = jax.device_put(batch, srv._replicated)
                calls = []
                for k in range(repeats):
                    start = time.perf_counter()
                    jax.block_until_ready(program(srv.params, placed))
                    if k:
                        calls.append(time.perf_counter() - start)
                engine_prefill.extend(calls)
                engine_prefill_blocks.append(float(np.mean(calls)))
            if spec.decode is not None:                  # decode and argmax of the slot batch
                tokens = jax.device_put(np.zeros(spec.slots, np.int32), srv._replicated)
                positions = jax.device_put(np.full(spec.slots, input_len, np.int32), srv._replicated)
                calls = []
                for k in range(repeats * 2):
                    start = time.perf_counter()
                    logits, srv.cache = srv.engine.decode(srv.params, srv.cache, tokens, positions)
                    jax.block_until_ready((srv.cache, srv.engine.greedy(logits)))
                    if k:
                        calls.append(time.perf_counter() - start)
                engine_step.extend(calls)
                engine_step_blocks.append(float(np.mean(calls)))

        def loop_block() -> tuple[list[float], list[float], float]:
            """One block of the closed loop: its steps' and prefill calls' seconds, and its
            prompts per prefill call."""
            steps: list[float] = []
            prefills: list[float] = []
            if spec.prefill is not None and spec.decode is not None:
                return self._saturated_aggregated(input_len, output_len, rounds * spec.slots,
                                                  first_token)
            if spec.prefill is not None:
                for n in range(rounds * 4 + 1):
                    start = time.perf_counter()
                    take = range(spec.prefill_batch)
                    done = srv.prefill([prompt_for(model, n * 64 + i, input_len, 7) for i in take])
                    int(done.first_tokens[0])      # the first tokens on the host, as served
                    first_token.append(time.perf_counter() - start)
                    handover = [{"request": row, "kv": srv.export_kv(done, row),
                                 "first_token": int(done.first_tokens[row]),
                                 "output_len": output_len} for row in take]
                    if decode is not None:      # as serve_prefill sends (not waited for)
                        sent.append(decode.sink.remote(handover))
                    prefills.append(time.perf_counter() - start)
                return steps, prefills, float(spec.prefill_batch)
            kv = np.zeros((srv.model.n_layers, input_len, 2, srv.model.n_kv_heads,
                           srv.model.d_head), jnp.bfloat16)
            slot_request = [-1] * spec.slots
            remaining = [0] * spec.slots
            record = [{"tokens": []} for _ in range(spec.slots)]
            # the engine's call of the same slot batch right before each step (paired: the
            # other processes' load of that moment is in both, docs/serving.md "Serving host
            # costs"); it writes position `input_len` of every slot, which no timing reads
            tokens_e = jax.device_put(np.zeros(spec.slots, np.int32), srv._replicated)
            positions_e = jax.device_put(np.full(spec.slots, input_len, np.int32), srv._replicated)
            for _ in range(rounds):
                for slot in range(spec.slots):            # every slot full, no arrivals
                    srv.insert(slot, kv, 0, 0)
                    slot_request[slot], remaining[slot] = slot, max(output_len - 1, 1)
                    record[slot]["tokens"] = []
                jax.block_until_ready(srv.cache)
                while any(r >= 0 for r in slot_request):
                    start = time.perf_counter()
                    logits, srv.cache = srv.engine.decode(srv.params, srv.cache, tokens_e, positions_e)
                    jax.block_until_ready((srv.cache, srv.engine.greedy(logits)))
                    paired_engine.append(time.perf_counter() - start)
                    start = time.perf_counter()
                    tokens = srv.step()
                    advance_slots(srv, tokens, time.time(), slot_request, remaining, record)
                    steps.append(time.perf_counter() - start)
            return steps, prefills, 0.0

        paired_engine: list[float] = []     # a decode slice: the engine's call before each step
        first_token: list[float] = []       # each closed-loop prefill call to its first tokens
        first_blocks: list[list[float]] = []
        engine_prefill_blocks: list[float] = []   # each engine block's mean prefill
        engine_step_blocks: list[float] = []      # each engine block's mean decode call
        first_extra: list[float] = []       # per block: to first tokens - engine blocks beside
        paired_blocks: list[float] = []     # per block: mean step - mean paired engine calls
        began = time.perf_counter()
        engine_calls()          # between the blocks: a drift in the host's load
        step_blocks: list[list[float]] = []
        prefill_blocks: list[list[float]] = []
        prompts: list[float] = []
        sent: list = []         # the closed loop's handovers to `decode`, if any
        for _ in range(max(blocks, 1)):
            block_began = time.perf_counter()
            steps, prefills = [], []
            engine_before: list[float] = []
            firsts: list[float] = []
            while True:         # at least `min_block_s` of the loop per block
                paired_engine.clear()
                first_token.clear()
                more_steps, more_prefills, block_prompts = loop_block()
                steps += more_steps[1:]
                engine_before += paired_engine[1:]
                firsts += first_token[1:]
                prefills += more_prefills[1:]
                if more_prefills[1:]:
                    prompts.append(block_prompts)
                if time.perf_counter() - block_began >= min_block_s:
                    break
            if steps:
                step_blocks.append(steps)
            if firsts:
                first_blocks.append(firsts)
                first_extra.append(float(np.mean(firsts)))   # the engine block after: below
            if steps and engine_before:
                paired_blocks.append(float(np.mean(steps) - np.mean(engine_before)))
            if prefills:
                prefill_blocks.append(prefills)
            if sent:
                import ray   # lazy: only with a decode worker, inside a Ray worker
                ray.get(sent)
                sent.clear()
            engine_calls()      # (other processes' work) shows in both, not in their difference
            if firsts:          # paired with the engine's blocks before and after this one
                first_extra[-1] -= float(np.mean(engine_prefill_blocks[-2:]))
            if steps and not engine_before:   # aggregated: paired with the engine's blocks
                paired_blocks.append(float(np.mean(steps) - np.mean(engine_step_blocks[-2:])))
        out["measured_s"] = time.perf_counter() - began
        out["blocks"] = max(blocks, 1)
        if engine_prefill:
            out["engine_prefill_s"] = float(np.median(engine_prefill))
        if engine_step:
            out["engine_step_s"] = float(np.median(engine_step))
        for name, per_block in (("prefill", prefill_blocks), ("step", step_blocks),
                                ("prefill_first", first_blocks)):
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
        if first_extra:
            # a prefill call's host work before its first tokens, paired: the median over
            # blocks of (the block's mean call to its first tokens - the mean of the engine's
            # prefill calls just before and after the block)
            out["loop_prefill_first_paired_extra_s"] = float(np.median(first_extra))
            out["loop_prefill_first_paired_block_extra_s"] = first_extra
        if paired_blocks:
            # the host work per step, paired: the median over blocks of (the block's mean
            # step - the mean of the engine's calls just before each step (a decode slice) or
            # in the engine's blocks just before and after the block (aggregated))
            out["loop_step_paired_extra_s"] = float(np.median(paired_blocks))
            out["loop_step_paired_block_extra_s"] = paired_blocks
        if prefill_blocks:
            out["loop_prefill_prompts"] = float(np.mean(prompts))   # prompts per prefill call
        if spec.prefill is not None and wake_requests > 0:
            from workloads.serving import serve_aggregated   # lazy: imports JAX, as above

            reqs = [Request((k + 1) * idle_gap_s, input_len, 1) for k in range(wake_requests + 1)]
            start_at = time.time() + idle_gap_s
            if spec.decode is not None:
                served = serve_aggregated(srv, reqs, lambda i: prompt_for(model, 9000 + i, input_len, 7),
                                          start_at)
            else:
                served = self.serve_prefill([dict(arrival_s=r.arrival_s, input_len=r.input_len,
                                                  output_len=1) for r in reqs], start_at, 7, None)
                self.calls = []
            ttft = [s["first_token_s"] - r.arrival_s for s, r in zip(served, reqs)][1:]
            out["prefill_after_idle_s"] = float(np.median(ttft))
            out["prefill_wake_s"] = max(out["prefill_after_idle_s"] - out["engine_prefill_s"], 0.0)
            out["idle_gap_s"] = idle_gap_s
        return out

    def _saturated_aggregated(self, input_len: int, output_len: int, n: int,
                              first_token: list | None = None) -> tuple[list, list, float]:
        """`serve_aggregated`'s loop on a burst of `n` requests at time 0: the seconds of each
        decode step and of each prefill branch (synchronised after its inserts, so their
        time is the prefill's, not the next step's; workloads/serving.py `serve_aggregated`),
        and the mean prompts per prefill call after the first."""
        import numpy as np   # lazy: as the JAX imports
        from workloads.serving import serve_aggregated   # lazy: imports JAX (the worker's mesh)

        model = self.server.model.unpadded
        timings: dict[str, list[float]] = {"step_s": [], "prefill_s": []}
        calls: list = []
        serve_aggregated(self.server, [Request(0.0, input_len, output_len)] * n,
                         lambda i: prompt_for(model, i, input_len, 7), timings=timings, calls=calls)
        prompts = [len(c[3]) for c in calls if c[0] == "prefill"][1:] or [1]
        if first_token is not None:    # each prefill call to its first tokens on the host
            first_token += [c[2] - c[1] for c in calls if c[0] == "prefill"]
        return timings["step_s"], timings["prefill_s"], float(np.mean(prompts))

    def export_for_handover(self, done, row: int):
        """What serve_prefill does per request before sending: the KV as a host array."""
        return self.server.export_kv(done, row)

    def handover_send(self, input_len: int, decode, repeats: int = 8) -> list[dict]:
        """KV handovers of `input_len` tokens to `decode`, as serve_prefill sends them (export,
        one `deliver`-like Ray call), one at a time: per handover the wall clock when the
        prefill worker starts the export, when the export is done, when the Ray call is
        submitted (what the prefill loop pays), when the decode worker has the KV in a slot,
        and the decode worker's insert alone (what its loop pays)."""
        import ray   # lazy: only inside a Ray worker

        srv = self.server
        prompt = [prompt_for(srv.model.unpadded, 0, input_len, 7)]
        done = srv.prefill(prompt)
        out = []
        for _ in range(repeats + 1):
            start = time.time()
            kv = srv.export_kv(done, 0)
            exported = time.time()
            ref = decode.handover_receive.remote(
                [{"request": 0, "kv": kv, "first_token": int(done.first_tokens[0]), "output_len": 2}])
            submitted = time.time()
            received = ray.get(ref)
            out.append({"start": start, "exported": exported, "submitted": submitted,
                        "in_slot": received["in_slot"], "insert_s": received["insert_s"],
                        "bytes": int(kv.nbytes)})
        return out[1:]

    def sink(self, handover: list[dict]) -> int:
        """Receive a closed loop's handover and drop it (`measure_host_costs` with `decode`)."""
        return len(handover)

    def cpu_seconds(self) -> float:
        """This worker process's CPU seconds so far, all its threads (Ray's receiving ones
        included): on a worker pinned to one core, what its loop does not get."""
        return time.process_time()

    def handover_receive(self, handover: list[dict]) -> dict[str, float]:
        """The decode side of one handover: the KV into slot 0, synchronised; the wall clock
        then, and the seconds of the insert itself (as `serve_decode`'s loop pays it)."""
        import jax   # lazy: only inside a Ray worker

        began = time.perf_counter()
        for item in handover:
            self.server.insert(0, item["kv"], 0, item["first_token"])
        jax.block_until_ready(self.server.cache)
        insert_s = time.perf_counter() - began
        done = time.time()
        self.server.release(0)
        return {"in_slot": done, "insert_s": insert_s}


def actor_options(chips: int | None, cores: list[int] | None, threads: int = 1,
                  env: dict[str, str] | None = None) -> dict[str, Any]:
    """Ray options of a serving worker: as the sweep's emulated-mesh workers (module docstring)."""
    env = dict(env or {})
    if chips is not None:
        inherited = re.sub(r"--xla_force_host_platform_device_count=\S*", "",
                           os.environ.get("XLA_FLAGS", "")).split()
        env["XLA_FLAGS"] = " ".join([*inherited, f"--xla_force_host_platform_device_count={chips}"])
    return {"num_cpus": 0, "max_restarts": 0, "max_concurrency": threads,
            "runtime_env": {"env_vars": env}}


def worker_cores(workers: int) -> list[list[int]]:
    """Each worker's cores: this process's cores split into `workers` disjoint groups."""
    return split_cores(workers)
