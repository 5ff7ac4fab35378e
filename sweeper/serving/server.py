"""The serving workers: Ray actors that each own one emulated mesh (or the real devices) and
serve a request stream with the engine's slot server (workloads/serving.py).

Aggregated: one `ServingWorker` runs prefill and decode on its mesh, in the loop the serving
model simulates (sweeper/serving/simulate.py `_aggregated_replica`): when prompts wait and
slots are free, one prefill call (at most `prefill.batch` prompts of one length) is inserted
between two decode steps; the decode step runs every slot.

Disaggregated: a prefill worker runs prefill calls back to back in arrival order and hands
each request's KV cache to the decode worker through Ray (`ray.put` in the prefill process,
`ray.get` in the decode process; the object store); the decode worker (two threads: one
receives handovers, one serves) puts every ready request into a free slot before its next
step.

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
from collections import deque
from typing import Any

try:    # the sweep's mesh-worker helpers (sweeper/sweep/meshworker.py since the workers split)
    from sweeper.sweep.meshworker import split_cores, where_am_i
except ImportError:
    from sweeper.sweep.workers import split_cores, where_am_i

POLL_S = 0.0005           # a waiting decode worker checks for handovers this often


def prompt_for(model, request_index: int, input_len: int, seed: int):
    """Request `request_index`'s prompt tokens (deterministic from the seed)."""
    from workloads.model import prompt_tokens

    return prompt_tokens(model, 1, input_len, seed * 1_000_003 + request_index)[0]


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

    def serve_aggregated(self, requests: list[dict], start_at: float, seed: int) -> list[dict]:
        srv, spec = self.server, self.spec
        model = srv.model.unpadded
        n = len(requests)
        out = [{"tokens": []} for _ in range(n)]
        pending = deque(sorted(range(n), key=lambda i: requests[i]["arrival_s"]))
        waiting: deque[int] = deque()
        slot_request = [-1] * spec.slots
        remaining = [0] * spec.slots
        prefilled_since_step = False
        _sleep_until(start_at)
        while pending or waiting or any(r >= 0 for r in slot_request):
            now = time.time() - start_at
            while pending and requests[pending[0]]["arrival_s"] <= now:
                waiting.append(pending.popleft())
            active = sum(r >= 0 for r in slot_request)
            if not waiting and not active:
                _sleep_until(start_at + requests[pending[0]]["arrival_s"])
                continue
            free = [s for s in range(spec.slots) if slot_request[s] < 0]
            if waiting and free and not (prefilled_since_step and active):
                take = _take(waiting, requests, min(spec.prefill_batch, len(free)))
                prompts = [prompt_for(model, i, requests[i]["input_len"], seed) for i in take]
                done = srv.prefill(prompts)
                t = time.time() - start_at
                for row, i in enumerate(take):
                    out[i].update(first_token_s=t, tokens=[int(done.first_tokens[row])])
                    if requests[i]["output_len"] <= 1:
                        out[i]["finish_s"] = t
                        continue
                    slot = free.pop(0)
                    srv.insert(slot, done, row, int(done.first_tokens[row]))
                    slot_request[slot], remaining[slot] = i, requests[i]["output_len"] - 1
                prefilled_since_step = True
                continue
            tokens = srv.step()
            t = time.time() - start_at
            _advance(srv, tokens, t, slot_request, remaining, out)
            prefilled_since_step = False
        return out

    # ---- disaggregated

    def serve_prefill(self, requests: list[dict], start_at: float, seed: int, decode) -> list[dict]:
        """Prefill calls back to back in arrival order; each KV cache to `decode` via Ray."""
        import ray   # lazy: only inside a Ray worker

        srv, spec = self.server, self.spec
        model = srv.model.unpadded
        n = len(requests)
        out = [{"tokens": []} for _ in range(n)]
        queue_ = deque(sorted(range(n), key=lambda i: requests[i]["arrival_s"]))
        _sleep_until(start_at)
        sent = []
        while queue_:
            _sleep_until(start_at + requests[queue_[0]]["arrival_s"])
            now = time.time() - start_at
            arrived = deque(i for i in queue_ if requests[i]["arrival_s"] <= now)
            take = _take(arrived, requests, spec.prefill_batch)
            for i in take:
                queue_.remove(i)
            prompts = [prompt_for(model, i, requests[i]["input_len"], seed) for i in take]
            done = srv.prefill(prompts)
            t = time.time() - start_at
            handover = []
            for row, i in enumerate(take):
                out[i].update(first_token_s=t, tokens=[int(done.first_tokens[row])])
                if requests[i]["output_len"] <= 1:
                    out[i]["finish_s"] = t
                    continue
                kv = ray.put(srv.export_kv(done, row))
                handover.append({"request": i, "kv": [kv], "first_token": int(done.first_tokens[row]),
                                 "output_len": requests[i]["output_len"]})
            if handover:
                sent.append(decode.deliver.remote(handover))
        ray.get(sent)
        return out

    def deliver(self, handover: list[dict]) -> None:
        """Receive prefilled requests (runs on the decode worker's second thread)."""
        for item in handover:
            self.inbox.put(item)

    def serve_decode(self, expected: int, start_at: float) -> dict[int, dict]:
        """Decode the `expected` requests the prefill worker hands over; per request, when
        its KV was in a slot, its last token's time and its decoded tokens."""
        import ray   # lazy: only inside a Ray worker

        srv, spec = self.server, self.spec
        out: dict[int, dict] = {}
        waiting: deque[dict] = deque()
        slot_request = [-1] * spec.slots
        remaining = [0] * spec.slots
        received = 0
        _sleep_until(start_at)
        while received < expected or waiting or any(r >= 0 for r in slot_request):
            while True:
                try:
                    waiting.append(self.inbox.get_nowait())
                    received += 1
                except queue.Empty:
                    break
            free = [s for s in range(spec.slots) if slot_request[s] < 0]
            while waiting and free:
                item = waiting.popleft()
                kv = ray.get(item["kv"][0])
                slot = free.pop(0)
                srv.insert(slot, kv, 0, item["first_token"])
                i = item["request"]
                out[i] = {"kv_ready_s": time.time() - start_at, "tokens": []}
                slot_request[slot], remaining[slot] = i, item["output_len"] - 1
            if not any(r >= 0 for r in slot_request):
                time.sleep(POLL_S)
                continue
            tokens = srv.step()
            t = time.time() - start_at
            _advance(srv, tokens, t, slot_request, remaining, out)
        return out


def _sleep_until(when: float) -> None:
    delay = when - time.time()
    if delay > 0:
        time.sleep(delay)


def _take(waiting: deque, requests: list[dict], most: int) -> list[int]:
    """Up to `most` waiting requests with the first one's prompt length (one prefill call
    has one shape), in arrival order; removed from `waiting`."""
    length = requests[waiting[0]]["input_len"]
    take = [i for i in waiting if requests[i]["input_len"] == length][:most]
    for i in take:
        waiting.remove(i)
    return take


def _advance(srv, tokens, t: float, slot_request: list[int], remaining: list[int], out) -> None:
    """After a decode step: append each slot's token; free the slots whose answers are done."""
    for slot, i in enumerate(slot_request):
        if i < 0:
            continue
        out[i]["tokens"].append(int(tokens[slot]))
        remaining[slot] -= 1
        if remaining[slot] == 0:
            out[i]["finish_s"] = t
            slot_request[slot] = -1
            srv.release(slot)


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
