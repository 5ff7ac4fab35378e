"""The serving workers: Ray actors that each own one emulated mesh (or the real devices) and
serve a request stream with the engine's slot server (workloads/serving/slots.py).

Aggregated: one `ServingWorker` runs prefill and decode on its mesh, in the engine's one
aggregated loop (workloads/serving/slots.py `serve_aggregated`, the loop the serving model
simulates, workloads/serving/model.py `_aggregated_replica`): when prompts wait and
slots are free, one prefill call (at most `prefill.batch` prompts of one length) is inserted
between two decode steps; the decode step runs every slot. With chunked prefill
(`prefill.chunk`), each iteration is a decode step then one chunk of the oldest waiting
prompt. With prefix caching (the profile's `prefix_len`) the worker computes the shared
prefix's KV at set-up and prefills only the rest of the prompts that start with it.

Disaggregated: a prefill worker runs prefill calls back to back in arrival order and hands
each request's KV cache (a host array) to its decode worker (serve.py routes them) in one
Ray call per prefill call and decode worker (`deliver.remote`: Ray moves an argument over 100 KiB through its object store); the
decode worker (two threads: one receives handovers, one serves) puts every received request
into a free slot before its next step, one insertion after the other (the serving model
charges each `handover_overhead_s` of the decode loop's time, docs/serving.md).

Serving host costs (`measure_host_costs`, `handover_receive`; sweeper/serving/overheads.py):
a worker times its own serving loop's work against the engine's timed calls of the same
shape, outside any served stream, with workloads/serving/hostcosts.py (the code a serving trial's
worker runs too); a decode worker steps beside the prefill worker's measurement
(`decode_beside`), as its loop does during a stream's prefill calls.

Arrivals are wall-clock: every worker waits for a shared start time and then for each
request's `arrival_s` after it. Times are `time.time()` (one host: the same clock in every
process). Each worker reports, per request, when its first token was on the host and when
its last was, and the tokens themselves.

A worker is started as the sweep's workers are (sweeper/sweep/workers.py): the emulated
chip count in XLA_FLAGS before JAX starts, pinned to at most one core per chip of its share
of this process's cores (`worker_cores`), `num_cpus=0` (the pinning decides the cores, not
Ray's accounting).
"""

from __future__ import annotations

import dataclasses
import os
import queue
import re
import time
from typing import Any

import numpy as np

from sweeper.sweep.meshworker import device_cores, split_cores, where_am_i
from workloads.hardware import worker_share
from workloads.serving.hostcosts import _nowhere, prompt_for
from workloads.serving.profile import Request

POLL_S = 0.0005           # a waiting decode worker checks for handovers this often


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
        self._stopped: set[int] = set()  # `decode_beside` runs told to stop
        # the stream being served, as its loop builds it (`progress`): per-request records
        # (a list in this worker's share's order, or the decode loop's dict by stream
        # index), each one's index in the whole stream, and those already reported
        self.records: list | dict = []
        self.record_index: list[int] | None = None
        self.reported: set[int] = set()

    def where(self) -> dict[str, Any]:
        return {**where_am_i(), "cores": self.cores}

    def setup(self, spec: dict, prompt_lens: list[int],
              cached: list[tuple[int, int]] | None = None) -> dict[str, float]:
        """Build the slot server (with prefix caching, the shared prefix's KV: set-up, not
        the stream) and warm up every program it will run (no request pays a compile); the
        warm calls' seconds (a diagnostic, see serve.py). `cached`: the (input_len,
        cached_len) of the stream's prompts that start with the shared prefix."""
        from workloads.config import ModelConfig
        from workloads.layouts import PhaseLayout
        from workloads.serving.pipeline import slot_server
        from workloads.serving.slots import SlotSpec

        spec = dict(spec)
        stages = spec.pop("stages", 1)      # pipeline stages (workloads/serving/pipeline.py)
        spec["model"] = ModelConfig.from_dict(spec["model"])
        spec["topology"] = tuple(spec["topology"])
        for phase in ("prefill", "decode"):
            if spec[phase] is not None:
                spec[phase] = PhaseLayout(*spec[phase])
        self.spec = SlotSpec(**spec)
        self.server = slot_server(self.spec, stages)
        devices = getattr(self.server, "devices", None) or list(self.server.mesh.devices.flat)
        times: dict[str, float] = {"devices": float(len(devices))}
        for length in sorted(set(prompt_lens)):
            warm = self.server.warm_up(length)
            if "prefill_s" in warm:
                times[f"prefill_s@{length}"] = warm["prefill_s"]
            if "decode_step_s" in warm:
                times["decode_step_s"] = warm["decode_step_s"]
            if "chunk_s" in warm:
                times["chunk_s"] = warm["chunk_s"]
        for length, cached_len in sorted(set(map(tuple, cached or []))):
            if self.spec.prefill is not None:
                warm = self.server.warm_up(length, cached_len=cached_len)
                times[f"prefill_s@{length}/{cached_len}"] = warm["prefill_s"]
        return times

    def prompt(self, index: int, input_len: int, seed: int, cached_len: int = 0):
        """A request's prompt: from the seed and its index in the whole stream, starting with
        the shared prefix when it hits it (`request_prompt`)."""
        return request_prompt(self.server.model.unpadded, index, input_len, seed, cached_len,
                              self.spec.prefix_len)

    # ---- aggregated

    def serve_aggregated(self, requests: list[dict], start_at: float, seed: int,
                         indices: list[int] | None = None) -> list[dict]:
        """The stream in the engine's aggregated loop (workloads/serving/slots.py
        `serve_aggregated`), prompts from `seed`; `indices`: each request's index in the
        whole stream (one replica's share, serve.py `route`), which its prompt is made from."""
        from workloads.serving.slots import serve_aggregated   # lazy: imports JAX (the worker's mesh)

        reqs = [Request(**r) for r in requests]
        index = list(indices) if indices is not None else list(range(len(reqs)))
        self.calls = []
        return serve_aggregated(
            self.server, reqs,
            lambda i: self.prompt(index[i], reqs[i].input_len, seed, reqs[i].cached_len),
            start_at, calls=self.calls, records=self._new_stream([], index))

    def _new_stream(self, records: list | dict, index: list[int] | None) -> list | dict:
        """Start `progress`'s record of a new stream; the records the loop fills."""
        self.records, self.record_index, self.reported = records, index, set()
        return records

    def progress(self) -> dict[int, dict]:
        """The requests of the stream being served that are done on this worker since the
        last call, by their index in the whole stream (serve.py polls it, on this actor's
        second thread, so that what completed is kept when a worker is lost mid-stream):
        aggregated and decode workers the finished ones (`finish_s`), a prefill worker the
        ones whose first token is out and whose KV cache was handed over (`sent_s`) or
        which needed none (`finish_s`). Copies: the loop goes on filling its own."""
        records = self.records
        items = records.items() if isinstance(records, dict) else enumerate(list(records))
        out = {}
        for i, record in list(items):
            index = i if self.record_index is None else self.record_index[i]
            if index in self.reported or not ("finish_s" in record or "sent_s" in record):
                continue
            copy = dict(record)
            copy["tokens"] = list(copy.get("tokens", []))
            out[index] = copy
            self.reported.add(index)
        return out

    def last_calls(self) -> list:
        """The last stream's call log, seconds after its start: aggregated as
        `serve_aggregated` writes it; a prefill slice `("prefill", start, end, [requests])`
        (end: the first tokens on the host) and `("send", start, end, [requests])` (their KV
        exported and `deliver.remote` submitted); a decode slice `("insert", start, end,
        request)` and `("step", start, tokens on the host, busy slots, end of the slots'
        bookkeeping)`."""
        return self.calls

    # ---- disaggregated

    def serve_prefill(self, requests: list[dict], start_at: float, seed: int, decode,
                      indices: list[int] | None = None,
                      targets: list[int] | None = None) -> list[dict]:
        """Prefill calls back to back in arrival order; each KV cache to a decode worker via
        Ray (workloads/serving/slots.py `serve_prefill_slice`, the one prefill-slice loop).
        `decode`: one decode worker, or a list of them with `targets` (each request's index
        into it: serve.py routes as the serving model's `decode_route`); `indices`: each
        request's index in the whole stream (one replica's share), which its prompt is made
        from and by which the decode worker reports it; the call log keeps this replica's
        own indices, as an aggregated replica's. `decode` None: answers of one token only,
        nothing to hand over (`measure_host_costs`)."""
        import ray   # lazy: only inside a Ray worker
        from workloads.serving.slots import serve_prefill_slice   # lazy: imports JAX

        index = list(indices) if indices is not None else list(range(len(requests)))
        decodes = decode if isinstance(decode, list) else [decode]
        target = list(targets) if targets is not None else [0] * len(requests)

        pending: list = []      # handovers not yet seen to have arrived

        def send(handover: list[dict]) -> list:
            """One Ray call per decode worker the call's requests go to, not waited for;
            the earlier ones that have completed are checked first (`check_handovers`)."""
            check_handovers(ray, pending)
            by_worker: dict[int, list[dict]] = {}
            for item in handover:
                by_worker.setdefault(target[item["request"]], []).append(
                    {**item, "request": index[item["request"]]})
            refs = [decodes[w].deliver.remote(items) for w, items in by_worker.items()]
            pending.extend(refs)
            return refs

        self.calls = []
        out, sent = serve_prefill_slice(
            self.server, requests,
            lambda i: self.prompt(index[i], requests[i]["input_len"], seed,
                                  requests[i].get("cached_len", 0)),
            start_at, send if decode is not None else _nowhere, self.calls,
            records=self._new_stream([], index))
        if sent:
            ray.get([ref for refs in sent for ref in refs])
        return out

    def deliver(self, handover: list[dict]) -> None:
        """Receive prefilled requests (runs on the decode worker's second thread); each
        stamped with when this process had it (`delivered_s` of serve_decode's records)."""
        delivered = time.time()
        for item in handover:
            self.inbox.put({**item, "delivered": delivered})

    def serve_decode(self, expected: int, start_at: float) -> dict[int, dict]:
        """Decode the `expected` requests the prefill worker hands over; per request, when
        its KV was in a slot, its last token's time and its decoded tokens
        (workloads/serving/slots.py `serve_decode_slice`, the one decode-slice loop)."""
        from workloads.serving.slots import serve_decode_slice   # lazy: imports JAX

        self.calls = []
        return serve_decode_slice(self.server, self.inbox, expected, start_at, self.calls, POLL_S,
                                  records=self._new_stream({}, None))


    # ---- serving host costs (sweeper/serving/overheads.py), outside any served stream;
    # the measuring code is workloads/serving/hostcosts.py's (a serving trial's worker runs it too)

    def measure_host_costs(self, input_len: int, output_len: int, rounds: int = 2,
                           blocks: int = 5, min_block_s: float = 0.25,
                           wake_requests: int = 12, idle_gap_s: float = 0.1,
                           decode=None) -> dict:
        """This worker's serving loop against the engine's timed calls of the same shapes
        (workloads/serving/hostcosts.py `measure_loop`, which says what each number is). `decode` (a
        prefill slice's decode worker): the closed loop also hands each prefill call's KV to
        it in one Ray call (`sink` drops it), as `serve_prefill` does, not waited for."""
        from workloads.serving.hostcosts import measure_loop   # lazy: imports JAX (the worker's mesh)

        send = wait = None
        if decode is not None:
            import ray   # lazy: only with a decode worker, inside a Ray worker

            send, wait = decode.sink.remote, ray.get
        # a chunked server's loop is measured as its whole-prompt loop (the closed loop pairs
        # whole prefill calls with the engine's; an approximation of its host costs, which
        # the chunked loop pays per chunk rather than per prompt)
        chunk = self.server.spec.chunk
        self.server.spec = dataclasses.replace(self.server.spec, chunk=0)
        try:
            return measure_loop(self.server, input_len, output_len, rounds, blocks, min_block_s,
                                wake_requests, idle_gap_s, send=send, wait=wait)
        finally:
            self.server.spec = dataclasses.replace(self.server.spec, chunk=chunk)

    def export_for_handover(self, done, row: int):
        """What serve_prefill does per request before sending: the KV as a host array."""
        return self.server.export_kv(done, row)

    def handover_send(self, input_len: int, decode, repeats: int = 8) -> list[dict]:
        """KV handovers of `input_len` tokens to `decode`, as serve_prefill sends them
        (workloads/serving/hostcosts.py `handover_send`, one `handover_receive` Ray call each)."""
        import ray   # lazy: only inside a Ray worker
        from workloads.serving.hostcosts import handover_send   # lazy: imports JAX

        def receive(handover):
            ref = decode.handover_receive.remote(handover)
            return lambda: ray.get(ref)

        return handover_send(self.server, input_len, receive, repeats)

    def decode_beside(self, token: int, max_s: float = 60.0) -> int:
        """Decode steps of every slot, back to back, until `stop_decode_beside(token)` (or
        `max_s`): the decode slice's loop running beside the prefill slice's closed loop, as
        it runs during most of a stream's prefill calls (overheads.py `measure_session`;
        docs/serving.md "Serving host costs"). Runs on one of the decode worker's two
        threads; the closed loop's handovers (`sink`) arrive on the other. The steps made."""
        from workloads.serving.hostcosts import step_beside   # lazy: as the worker's other measures

        return step_beside(self.server, self._stopped, token, max_s)

    def stepping_decode(self, start_at: float, windows: int, window_s: float) -> list[tuple]:
        """The decode loop stepping from `start_at`, the handovers `deliver` receives on the
        other thread inserted before its steps (workloads/serving/hostcosts.py
        `stepping_decode_loop`): its call log."""
        from workloads.serving.hostcosts import stepping_decode_loop   # lazy: imports JAX

        return stepping_decode_loop(self.server, self.inbox, start_at, windows, window_s)

    def stepping_send(self, input_len: int, output_len: int, start_at: float, rate: float,
                      decode, windows: int, window_s: float) -> list[int]:
        """Prompts prefilled at `rate` from `start_at`, their KV sent to `decode`'s `deliver`
        in the windows with handovers (workloads/serving/hostcosts.py `stepping_send`); the
        handovers sent per window, after their calls are done."""
        import ray   # lazy: only inside a Ray worker
        from workloads.serving.hostcosts import stepping_send   # lazy: imports JAX

        per_window, sent = stepping_send(self.server, input_len, output_len, start_at, rate,
                                         decode.deliver.remote, windows, window_s)
        ray.get(sent)
        return per_window

    def stop_decode_beside(self, token: int) -> None:
        """End `decode_beside(token)` (before or after it started)."""
        self._stopped.add(token)

    def sink(self, handover: list[dict]) -> int:
        """Receive a closed loop's handover and drop it (`measure_host_costs` with `decode`)."""
        return len(handover)

    def cpu_seconds(self) -> float:
        """This worker process's CPU seconds so far, all its threads (Ray's receiving ones
        included): on a worker pinned to one core, what its loop does not get."""
        return time.process_time()

    def handover_receive(self, handover: list[dict]) -> dict[str, float]:
        """The decode side of one handover (workloads/serving/hostcosts.py `handover_receive`)."""
        from workloads.serving.hostcosts import handover_receive   # lazy: imports JAX

        return handover_receive(self.server, handover)


def request_prompt(model, index: int, input_len: int, seed: int, cached_len: int = 0,
                   prefix_len: int = 0):
    """Request `index`'s prompt (`prompt_for`: from the seed and its index in the whole
    stream), its first `cached_len` tokens the shared prefix's when it hits it (prefix
    caching; workloads/serving/slots.py `with_shared_prefix`)."""
    from workloads.serving.slots import with_shared_prefix   # lazy: imports JAX

    return with_shared_prefix(model, prompt_for(model, index, input_len, seed), cached_len,
                              prefix_len)


def check_handovers(ray, pending: list) -> None:
    """Raise at once if a KV handover that has completed failed (its decode worker died):
    the prefill side sees a lost decode worker at its next handover instead of prefilling
    the rest of the stream for nobody (docs/reliability.md, "Serving"). Each completed one
    is taken off `pending`; none is waited for."""
    if not pending:
        return
    done, _ = ray.wait(pending, num_returns=len(pending), timeout=0)
    if not done:
        return
    finished = set(done)
    pending[:] = [ref for ref in pending if ref not in finished]
    ray.get(done)        # RayActorError: the decode worker is gone


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


def worker_cores(devices: list[int], cores_per_worker: int | None = None
                 ) -> tuple[list[list[int]], float]:
    """(each worker's cores, their mean share of this host) for emulated workers of
    `devices` devices each. A worker's share is its group of this process's cores (the
    groups disjoint while they last; `cores_per_worker`: groups of that many) and the
    last-level cache they hold, but it runs on at most one core per device, as the host
    model prices it (sweeper/sweep/meshworker.py `device_cores`)."""
    total = len(os.sched_getaffinity(0))
    if cores_per_worker:
        groups = split_cores(max(total // cores_per_worker, len(devices)))[:len(devices)]
    else:
        groups = split_cores(len(devices))
    share = float(np.mean([worker_share(len(group), total) for group in groups]))
    return [sorted(device_cores(group, n)) for group, n in zip(groups, devices)], share
