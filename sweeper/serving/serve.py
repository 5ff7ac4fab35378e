"""`sweeper serve`: the engine really serves a Poisson request stream with a plan's deployment,
and its measured TTFT/TPOT percentiles are set beside the serving model's prediction.

    result = serve(deployment, reqs, seed=0)      # real Ray workers, real engine
    result.measured   # ttft_p50_s, ttft_p99_s, tpot_p50_s, tpot_p99_s, completed, throughput_rps
    result.predicted  # simulate() of the same deployment and the SAME request list

Measured (docs/serving.md "Real serving runs"): TTFT = first token on the host - arrival;
TPOT = (last token - first token) / (output_len - 1), per request, wall clock. The summary
statistics are computed by the serving model's own `SimResult.summary`, so both columns are
the same statistic of the same requests.

Predicted: `simulate(deployment, requests)` with the cost model's step times and the
deployment's hardware profile, as the plan was made; on an emulated mesh a measured profile
(`host`, or a `sweeper fit` profile of this host) is scaled to the cores each worker is
pinned to (`workloads.hardware.worker_share`, as a sweep's trials are). Nothing of the run
feeds the headline prediction. A second, separately labelled prediction ("calibrated")
uses the step times the workers measured while warming up, before the stream: a diagnostic
of how much of the error is the step-time model and how much the serving model.

Aggregated: one worker per replica (`replicas` workers, each on its share of this host's
cores), requests routed as the serving model routes them, round-robin in arrival order
(workloads/serving/model.py `simulate`: replica r serves the r-th, (r+R)-th, ... arrival),
known in advance, so the router is exact online too; one measured/predicted/replayed
comparison of the whole stream. Disaggregated: one worker per prefill replica and one per
decode replica; prefill replicas get requests round-robin in arrival order and each sends a
request's KV cache to the decode replica the serving model routes it to
(workloads/serving/model.py `decode_route`: the answers of more than one token, round-robin
in arrival order), so the router is exact online here too.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from workloads.config import ConfigError
from workloads.deployment import Deployment, PhaseSlice
from workloads.serving.costs import HostCosts
from workloads.serving.profile import Request, context_len, merge_decoded

KEYS = ("ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s", "completed", "throughput_rps")
START_MARGIN_S = 0.5          # workers start serving this long after the driver says go
SETUP_TIMEOUT_S = 600.0


@dataclass
class ServeResult:
    deployment: Deployment
    requests: list[Request]
    measured: dict[str, Any]
    predicted: dict[str, Any]
    calibrated: dict[str, Any]              # diagnostic: the serving model on warm-up step times
    per_request: list[dict]                 # arrival, first token, finish, tokens
    warmup: dict[str, dict]                 # each worker's warm-up step times
    workers: dict[str, dict] = field(default_factory=dict)   # where each worker ran
    wall_s: float = 0.0
    calls: dict[str, list] = field(default_factory=dict)     # each worker's call log (server.py)
    replayed: dict[str, Any] = field(default_factory=dict)   # diagnostic: the model on that log
    stop: dict | None = None      # a stream cut short: `Stop.to_dict()` (None: all served)

    @property
    def completed(self) -> int:
        return int(self.measured["completed"])

    @property
    def percentiles_of(self) -> str:
        """What the percentiles are of: 'N completed' (of M requests, when fewer)."""
        n, total = self.completed, len(self.requests)
        return f"{n} completed" + (f" of {total} requests" if n < total else "")

    @property
    def status(self) -> str:
        """finished, or why not: worker_lost, worker_failed, signal."""
        return "finished" if self.stop is None else self.stop["kind"]

    def to_json(self) -> dict:
        return {"status": self.status, "stop": self.stop,
                "percentiles_of": self.percentiles_of, "completed": self.completed,
                "measured": {k: self.measured[k] for k in KEYS},
                "predicted": {k: self.predicted[k] for k in KEYS},
                "calibrated": {k: self.calibrated[k] for k in KEYS},
                "replayed": {k: self.replayed[k] for k in KEYS} if self.replayed else None,
                "relative_error": relative_errors(self.measured, self.predicted),
                "deployment": self.deployment.to_dict(),
                "requests": len(self.requests), "warmup": self.warmup,
                "workers": {name: {k: w.get(k) for k in ("pid", "cores")}
                            for name, w in self.workers.items() if isinstance(w, dict)},
                "hardware_label": "host" if self.emulated else "devices"}

    @property
    def emulated(self) -> bool:
        return bool(self.workers.get("emulated", True))


def relative_errors(measured: dict, predicted: dict) -> dict[str, float]:
    """predicted / measured - 1 per latency statistic (NaN where either is missing)."""
    out = {}
    for key in KEYS[:4]:
        m, p = measured.get(key), predicted.get(key)
        ok = m is not None and p is not None and math.isfinite(m) and math.isfinite(p) and m > 0
        out[key] = p / m - 1 if ok else float("nan")
    return out


# --------------------------------------------------------------------------- checks (no JAX, no Ray)


def topology_of(deployment: Deployment, part: PhaseSlice) -> tuple[int, int, int]:
    from workloads.costmodel import best_topology

    if part.topology:                         # one pipeline stage's mesh
        return tuple(part.topology)
    return best_topology(deployment.model.unpadded, part.stage_chips)


def aggregated_names(replicas: int) -> list[str]:
    """The workers of an aggregated deployment, replica 0 first: `aggregated` (the one a
    host-cost measurement and the warm-up diagnostic read), then `aggregated-1`, ..."""
    return ["aggregated"] + [f"aggregated-{r}" for r in range(1, replicas)]


def disaggregated_names(prefill_replicas: int, decode_replicas: int) -> list[str]:
    """The workers of a disaggregated deployment: `prefill`, `prefill-1`, ..., then `decode`,
    `decode-1`, ... (replica 0 of each is the one a host-cost measurement reads)."""
    return [phase if r == 0 else f"{phase}-{r}"
            for phase, n in (("prefill", prefill_replicas), ("decode", decode_replicas))
            for r in range(n)]


def route(requests: list[Request], replicas: int) -> list[list[int]]:
    """Each replica's requests (indices into `requests`): round-robin in arrival order, the
    serving model's rule (workloads/serving/model.py `simulate`)."""
    order = sorted(range(len(requests)), key=lambda i: requests[i].arrival_s)
    return [order[r::replicas] for r in range(replicas)]


def in_stream_order(routed: list[list[int]], parts: list[list[dict]], n: int) -> list[dict]:
    """The replicas' per-request records (each in its share's order, `route`) as one list in
    the stream's order."""
    per_request: list[dict] = [{}] * n
    for ids, part in zip(routed, parts):
        for i, served in zip(ids, part):
            per_request[i] = served
    return per_request


def slot_specs(deployment: Deployment, context_len: int, seed: int,
               prefix_len: int = 0) -> dict[str, dict]:
    """The SlotSpec (as plain data) of each worker: {"aggregated": ...} or {"prefill", "decode"};
    validated here, before Ray or JAX start (ConfigError names the plan field). The
    prefill slice's `chunk` (aggregated) and the stream's shared `prefix_len` (prefix
    caching) go to the servers that prefill."""
    from workloads.layouts import PhaseLayout, resolve_padding, validate_layouts, validate_phase

    d = deployment
    for part, name in ((d.prefill, "prefill"), (d.decode, "decode")):
        if d.model.n_layers % part.stages:        # workloads/serving/pipeline.py: equal stages
            raise ConfigError(f"{name}.stages", part.stages, f"a divisor of the model's "
                              f"{d.model.n_layers} layers (the emulated engine gives every "
                              "pipeline stage the same layers)")
        if part.stages > 1 and (d.prefill.chunk or prefix_len):
            raise ConfigError(f"{name}.stages", part.stages, "1 with chunked prefill or a "
                              "shared prefix (the staged server has no extend program)")
    if (d.prefill.chunk or prefix_len) and d.model.moe:
        raise ConfigError("prefill.chunk" if d.prefill.chunk else "prefix_len",
                          d.prefill.chunk or prefix_len, "0 for a mixture-of-experts model "
                          "(chunked prefill and prefix caching run dense models only)")
    if prefix_len >= context_len:
        raise ConfigError("prefix_len", prefix_len, f"fewer tokens than a slot holds "
                          f"({context_len})")
    for part, name in ((d.prefill, "prefill"), (d.decode, "decode")):   # the slot server's own
        for key, runs in (("experts", "tp"), ("kv_cache", "bf16")):      # (workloads/serving/slots.py)
            if getattr(part, key) != runs:
                raise ConfigError(f"{name}.{key}", getattr(part, key), f"{runs} (the slot server "
                                  "runs tp experts and a bf16 KV cache; the plan's prediction "
                                  "assumes otherwise)")
    pre = PhaseLayout(d.prefill.ffn, d.prefill.attn)
    dec = PhaseLayout(d.decode.ffn, d.decode.attn)
    model = d.model.to_dict()

    def spec(topology, prefill, decode, weights):
        stages = (d.decode if decode else d.prefill).stages
        return {"model": model, "topology": list(topology), "stages": stages,
                "prefill": [prefill.ffn, prefill.attn] if prefill else None,
                "decode": [decode.ffn, decode.attn] if decode else None,
                "slots": d.decode.batch if decode else 1, "prefill_batch": d.prefill.batch,
                "context_len": context_len, "weights": weights, "seed": seed,
                "chunk": d.prefill.chunk if prefill and decode else 0,
                "prefix_len": prefix_len if prefill else 0}

    def check(topology, prefill, decode):
        both = (prefill or decode, decode or prefill)
        run = resolve_padding(d.model, "auto", topology, *both)
        validate_layouts(run, topology, both[0], both[1], math.lcm(d.prefill.batch, d.decode.batch))
        if prefill:
            validate_phase(run, topology, prefill, d.prefill.batch, "prefill")
        if decode:
            validate_phase(run, topology, decode, d.decode.batch, "decode")
        return run

    if d.mode == "aggregated":
        topology = topology_of(d, d.decode)
        check(topology, pre, dec)
        one = spec(topology, pre, dec, d.decode.weights)
        return {name: one for name in aggregated_names(d.decode.replicas)}
    tp, td = topology_of(d, d.prefill), topology_of(d, d.decode)
    run_p, run_d = check(tp, pre, None), check(td, None, dec)
    if run_p.n_kv_heads != run_d.n_kv_heads:
        raise ConfigError("decode.topology", "x".join(map(str, td)),
                          f"a topology whose head padding keeps n_kv_heads={run_p.n_kv_heads} "
                          "(the prefill slice's), so the KV cache can be handed over")
    prefill = spec(tp, pre, None, d.prefill.weights)
    decode = spec(td, None, dec, d.decode.weights)
    return {name: prefill if name.startswith("prefill") else decode
            for name in disaggregated_names(d.prefill.replicas, d.decode.replicas)}


MAX_WORKERS = 64          # Ray worker processes a serving run starts on this host
MAX_EMULATED_CHIPS = 64   # XLA CPU devices of one worker's emulated mesh


def check_fits(deployment: Deployment, context_len: int, input_len: int,
               source: str | None = None, emulated: bool = True) -> None:
    """ConfigError, before Ray or JAX start, when the deployment cannot run here: more
    workers or emulated chips than MAX_WORKERS / MAX_EMULATED_CHIPS, or a worker whose
    memory per chip (the cost model's weights + KV cache of every slot at `context_len` +
    working set, as `sweeper run` checks a trial: docs/reliability.md) exceeds the plan's
    chip (a preset's HBM) or, on an emulated mesh, this host's memory shared by every chip
    of every worker (sweeper/sweep/preflight.py `emulated_budget`)."""
    from sweeper.sweep.preflight import EMULATED_NOTE, emulated_budget
    from workloads.hostprofile import physical_memory_bytes

    d = deployment
    parts = ([("decode", d.decode)] if d.mode == "aggregated"
             else [("prefill", d.prefill), ("decode", d.decode)])
    workers = sum(part.replicas for _, part in parts)
    if workers > MAX_WORKERS:
        field_ = "decode.replicas" if d.mode == "aggregated" else "replicas"
        raise ConfigError(field_, workers, f"at most {MAX_WORKERS} workers in all on this host "
                          "(one Ray process per replica and phase)", source)
    for name, part in parts:
        if emulated and part.chips > MAX_EMULATED_CHIPS:
            raise ConfigError(f"{name}.chips", part.chips, f"at most {MAX_EMULATED_CHIPS} chips "
                              "per replica on an emulated mesh (XLA CPU devices in one process)",
                              source)
    chips_here = sum(part.chips * part.replicas for _, part in parts)
    for name, part in parts:
        weights, kv, working = memory_per_chip(d, name, context_len, input_len)
        need = weights + kv + working
        budgets = []
        if not d.hardware.measured:
            budgets.append((d.hardware.hbm_bytes, f"{d.hardware.name}'s HBM per chip"))
        if emulated:
            share = physical_memory_bytes() / chips_here
            plural = "s" if chips_here > 1 else ""
            budgets.append((emulated_budget(share, part.chips),
                            f"this host's memory shared by {chips_here} emulated chip{plural}"
                            f"{EMULATED_NOTE}"))
        for budget, what in budgets:
            if need > budget:
                worst = f"{name}.batch" if kv + working > weights else f"{name}.chips"
                raise ConfigError(worst, getattr(part, worst.split(".")[1]),
                                  f"a deployment that fits in memory: a {name} replica needs "
                                  f"weights {_gib(weights)} + KV cache {_gib(kv)} + working set "
                                  f"{_gib(working)} = {_gib(need)} per chip, more than the "
                                  f"{_gib(budget)} of {what}", source)


def memory_per_chip(deployment: Deployment, phase: str, context_len: int,
                    input_len: int) -> tuple[float, float, float]:
    """(weights, KV cache, working set) bytes per chip of one replica of `phase` (the cost
    model's, workloads/costmodel.py): a decode replica holds every slot's cache at
    `context_len` tokens (aggregated: plus a prefill call's working set); a prefill replica
    one call of `prefill.batch` prompts of `input_len` tokens."""
    from workloads.costmodel import predict_phase, working_set_bytes
    from workloads.hardware import per_chip
    from workloads.layouts import PhaseLayout

    from workloads.serving.model import stage_model

    d = deployment
    part = getattr(d, phase)
    topology = topology_of(d, part)
    layout = PhaseLayout(part.ffn, part.attn)
    model, chips = stage_model(d.model, part.stages), part.stage_chips   # one pipeline stage
    hw = per_chip(d.hardware, chips)
    if phase == "prefill":
        m = predict_phase(model, hw, chips, part.batch, "prefill", input_len=input_len,
                          layout=layout, weights=part.weights, topology=topology, validate=False)
        return m.weight_bytes_per_chip, m.kv_bytes_per_chip, m.working_set_bytes_per_chip
    m = predict_phase(model, hw, chips, part.batch, "decode", context=context_len,
                      layout=layout, weights=part.weights, topology=topology, validate=False)
    working = m.working_set_bytes_per_chip
    if d.mode == "aggregated":
        working += working_set_bytes(model, topology, PhaseLayout(d.prefill.ffn, d.prefill.attn),
                                     d.prefill.batch, input_len, part.weights)
    return m.weight_bytes_per_chip, m.kv_bytes_per_chip, working


def _gib(value: float) -> str:
    return f"{value / 2**30:.3g} GiB"


# --------------------------------------------------------------------------- the run

POLL_S = 0.25          # the driver looks at the stream's calls this often while it runs
PROGRESS_S = 0.5       # ... and asks each worker for the requests it has done since (`progress`)
ANSWER_S = 5.0         # after a stop, a live worker's last records and a liveness ping wait this


@dataclass
class Stop:
    """Why a stream ended before every request was served (plain data in `ServeResult`)."""

    kind: str                      # "worker_lost" | "worker_failed" | "signal"
    reason: str                    # one line
    worker: str | None = None      # the lost worker's name (`aggregated-1`, `decode`, ...)
    phase: str | None = None       # its phase: aggregated, prefill or decode
    pid: int | None = None
    signal: str | None = None      # SIGINT | SIGTERM

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


class _Stopped(Exception):
    def __init__(self, stop: Stop):
        super().__init__(stop.reason)
        self.stop = stop


def phase_of(name: str) -> str:
    """A worker's phase from its name (`aggregated_names`, `disaggregated_names`)."""
    return name.split("-", 1)[0]


class ServingSession:
    """A deployment's workers, started and warmed up once, serving one stream after another
    (the validation benchmark serves several loads and seeds on one set of workers).

    Ray is the sweep's session (sweeper/sweep/session.py `RaySession`: a local cluster on the
    loopback only, SIGTERM/SIGINT held while Ray starts, a shutdown bounded whatever Ray
    does), so `sweeper serve` has every fix `sweeper run` has. While a stream runs the
    driver watches every worker's call and asks each for what it has done (`run`): a lost
    worker ends the stream within about a second, a signal at once, and what completed is
    kept (docs/reliability.md, "Serving")."""

    def __init__(self, deployment: Deployment, context_len: int, prompt_lens: list[int],
                 seed: int = 0, emulated: bool = True, cores_per_worker: int | None = None,
                 prefix_len: int = 0, cached: list[tuple[int, int]] | None = None):
        """`cores_per_worker`: pin each worker to that many of this process's cores (disjoint
        while they last) instead of sharing all of them out, so that every worker runs on
        the share a calibration sweep's trials ran on (docs/serving.md, validation).
        `prefix_len`: the shared prefix whose KV the prefilling workers cache (prefix
        caching); `cached`: the (input_len, cached_len) shapes of the prompts that hit it,
        warmed up too (`prefix_shapes`)."""
        from sweeper import paths
        from sweeper.serving.server import ServingWorker, actor_options, worker_cores
        from sweeper.sweep.session import RaySession

        self.deployment, self.seed, self.emulated = deployment, seed, emulated
        # the diagnostic ("calibrated") prediction's step times; None: the warm-up medians
        self.diagnostic_step_times = None
        # the spread of the calls' durations the prediction draws from (StepTimes
        # prefill_spread, step_spread; overheads.py `duration_spread`); () : none
        self.duration_spread: tuple[tuple, tuple] = ((), ())
        # the serving host costs (a prefill on an idle loop, the part of a prefill's host
        # work before its first tokens, ...) are the deployment's hardware profile's
        # (overheads.py `with_deployment_overheads`), not attributes of the session
        specs = slot_specs(deployment, context_len, seed, prefix_len)
        self.prefix_len = prefix_len
        self.names = list(specs)
        self.actors: dict[str, Any] = {}
        self.workers: dict[str, Any] = {}
        self.session = RaySession(None)       # a local cluster of our own (never a `ray start` one)
        try:
            self.session.start()
            import ray   # lazy: Ray (~1 s), started by the session above

            self.ray = ray
            devices = {name: math.prod(specs[name]["topology"]) * specs[name].get("stages", 1)
                       for name in self.names}
            self.cores, self.share = (worker_cores(list(devices.values()), cores_per_worker)
                                      if emulated else ([None] * len(self.names), 1.0))
            remote = ray.remote(ServingWorker)
            env = {paths.HOME_ENV: str(paths.sweeper_home(create=True))}
            for name, mine in zip(self.names, self.cores):
                chips = devices[name] if emulated else None
                # a second thread answers `progress` (and `where`) while the stream runs; a
                # decode worker's third receives the handovers (`deliver`)
                threads = 3 if name.startswith("decode") else 2
                self.actors[name] = remote.options(**actor_options(chips, mine, threads, env)).remote(mine)
            # where each worker runs (its pid: a lost worker is named by it), before the
            # warm-up, so that a worker lost while it compiles is named too
            wheres = {n: self.actors[n].where.remote() for n in self.names}
            try:
                self.workers = dict(zip(self.names, ray.get(list(wheres.values()),
                                                            timeout=SETUP_TIMEOUT_S)))
            except ray.exceptions.RayError as err:
                raise WorkerLost(self._stop_for(err, {ref: n for n, ref in wheres.items()},
                                                "as it started")) from None
            self.workers["emulated"] = emulated
            setups = {n: self.actors[n].setup.remote(specs[n], sorted(set(prompt_lens)), cached)
                      for n in self.names}
            try:
                self.warmup = dict(zip(setups, ray.get(list(setups.values()),
                                                       timeout=SETUP_TIMEOUT_S)))
            except ray.exceptions.RayError as err:
                raise WorkerLost(self._stop_for(err, {ref: n for n, ref in setups.items()},
                                                "while it warmed up")) from None
        except BaseException:
            from sweeper.sweep.stopping import held

            with held():       # (a signal now must not cut the shutdown short)
                self.close()
            raise

    # ---- one stream

    def run(self, requests: list[Request], seed: int,
            on_start: Callable[[dict], None] | None = None) -> ServeResult:
        """Serve one stream (prompts from `seed`); measured and predicted. A stream cut short
        (a worker lost, a worker's error, SIGINT or SIGTERM) still returns: its `stop` says
        why, and its numbers are those of the requests that completed. `on_start(workers)`:
        called once the stream is started (`workers`: each one's name -> pid)."""
        plain = [dataclasses.asdict(r) for r in requests]
        begin = time.time()
        start_at = begin + START_MARGIN_S
        results: dict[str, Any] = {}
        progress: dict[str, dict] = {n: {} for n in self.names}
        stop = None
        try:
            tasks = self._submit(requests, plain, start_at, seed)
            if on_start is not None:
                on_start({n: self.workers[n].get("pid") for n in self.names})
            self._watch(tasks, results, progress)
        except _Stopped as stopped:
            stop = stopped.stop
        except KeyboardInterrupt as err:        # the CLI's SIGINT/SIGTERM handler raised it
            from sweeper.sweep.stopping import signal_name

            name = signal_name(err)
            stop = Stop("signal", f"stopped by {name}", signal=name)
        wall = time.time() - begin - START_MARGIN_S
        if stop is not None:
            self._last_progress(progress, results)
        return self._result(requests, results, progress, stop, wall)

    def _submit(self, requests: list[Request], plain: list[dict], start_at: float,
                seed: int) -> dict:
        """Start the stream on every worker; {the call's ref: the worker's name}."""
        tasks = {}
        if self.deployment.mode == "aggregated":
            for n, ids in zip(self.names, route(requests, len(self.names))):
                ref = self.actors[n].serve_aggregated.remote([plain[i] for i in ids], start_at,
                                                             seed, ids)
                tasks[ref] = n
            return tasks
        from workloads.serving.model import decode_route

        d = self.deployment
        prefills = [n for n in self.names if n.startswith("prefill")]
        decode_names = [n for n in self.names if n.startswith("decode")]
        decodes = [self.actors[n] for n in decode_names]
        decoded_ids = decode_route(requests, d.decode.replicas)
        target = {i: r for r, ids in enumerate(decoded_ids) for i in ids}   # its decode replica
        for n, ids in zip(decode_names, decoded_ids):
            tasks[self.actors[n].serve_decode.remote(len(ids), start_at)] = n
        for n, ids in zip(prefills, route(requests, d.prefill.replicas)):
            ref = self.actors[n].serve_prefill.remote([plain[i] for i in ids], start_at, seed,
                                                      decodes, ids, [target.get(i, 0) for i in ids])
            tasks[ref] = n
        return tasks

    def _watch(self, tasks: dict, results: dict, progress: dict) -> None:
        """Wait for every worker's stream (`results[name]`), asking each every PROGRESS_S for
        the requests it has done (`progress[name]`); _Stopped as soon as a call fails."""
        ray = self.ray
        pending = dict(tasks)
        asked: dict = {}          # progress ref -> worker
        last_ask = -math.inf
        while pending:
            if time.monotonic() - last_ask >= PROGRESS_S:
                busy = set(asked.values())
                for name in set(pending.values()) - busy:
                    asked[self.actors[name].progress.remote()] = name
                last_ask = time.monotonic()
            refs = [*pending, *asked]
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=POLL_S)
            for ref in ready:
                name = pending.pop(ref, None) or asked.pop(ref)
                try:
                    value = ray.get(ref)
                except ray.exceptions.RayError as err:
                    raise _Stopped(self._stop_for(err, {ref: name}, "mid-stream")) from None
                if ref in tasks:
                    results[name] = value
                else:
                    progress[name].update(value)

    def _alive(self) -> dict[str, bool | None]:
        """Each worker: True (answered), False (its actor is dead), None (no answer in
        ANSWER_S)."""
        ray = self.ray
        pings = {self.actors[n].where.remote(): n for n in self.names}
        ready, _ = ray.wait(list(pings), num_returns=len(pings), timeout=ANSWER_S)
        alive: dict[str, bool | None] = {n: None for n in self.names}
        for ref in ready:
            try:
                ray.get(ref)
                alive[pings[ref]] = True
            except ray.exceptions.RayError:
                alive[pings[ref]] = False
        return alive

    def _stop_for(self, err: BaseException, calls: dict, when: str) -> Stop:
        """The Stop for a failed call (`calls`: its ref -> worker): the worker whose process
        is gone (the call's own, or, when a worker raised because another was lost, e.g. a
        prefill worker whose handover failed, the one that no longer answers), else the
        worker that raised."""
        ray = self.ray
        failed = next(iter(calls.values()))
        for ref, name in calls.items() if len(calls) > 1 else ():   # which call failed
            if ray.wait([ref], timeout=0)[0]:
                try:
                    ray.get(ref)
                except ray.exceptions.RayError as one:
                    err, failed = one, name
                    break
        lost = [failed] if isinstance(err, ray.exceptions.RayActorError) else \
            [n for n, ok in self._alive().items() if ok is False]
        if lost:
            name = lost[0]
            pid = self.workers.get(name, {}).get("pid")
            why = explain_lost(pid, err)
            return Stop("worker_lost", f"the {phase_of(name)} worker '{name}' (pid {pid}) was "
                        f"lost {when} ({why})", worker=name, phase=phase_of(name), pid=pid)
        from sweeper.formatting import one_line

        cause = getattr(err, "cause", None) or err
        pid = self.workers.get(failed, {}).get("pid")
        return Stop("worker_failed", f"the {phase_of(failed)} worker '{failed}' (pid {pid}) "
                    f"failed {when}: {one_line(cause)[:300]}", worker=failed,
                    phase=phase_of(failed), pid=pid)

    def _last_progress(self, progress: dict, results: dict) -> None:
        """After a stop: the records of every worker still alive (waited for ANSWER_S)."""
        ray = self.ray
        asks = {}
        for name in self.names:
            if name not in results:
                try:
                    asks[self.actors[name].progress.remote()] = name
                except Exception:  # noqa: BLE001 - a dead actor: what it reported before is kept
                    continue
        ready, _ = ray.wait(list(asks), num_returns=len(asks), timeout=ANSWER_S) if asks else ([], [])
        for ref in ready:
            try:
                progress[asks[ref]].update(ray.get(ref))
            except ray.exceptions.RayError:
                continue

    def _result(self, requests: list[Request], results: dict, progress: dict,
                stop: Stop | None, wall: float) -> ServeResult:
        per_request = self._per_request(requests, results, progress)
        for i, r in enumerate(requests):
            per_request[i]["arrival_s"] = r.arrival_s
        measured, predicted, calibrated = compare(self.deployment, requests, per_request,
                                                  self.warmup, self.share,
                                                  self.diagnostic_step_times, self.duration_spread)
        calls, replayed = {}, {}
        if stop is None:
            from workloads.serving.model import simulate

            ray = self.ray
            calls = dict(zip(self.names, ray.get([self.actors[n].last_calls.remote()
                                                  for n in self.names])))
            replayed = simulate(self.deployment, requests,
                                replay_step_times(self.deployment, calls, requests)).summary()
        return ServeResult(self.deployment, requests, measured, predicted, calibrated,
                           per_request, self.warmup, self.workers, wall, calls, replayed,
                           stop=stop.to_dict() if stop else None)

    def _per_request(self, requests: list[Request], results: dict, progress: dict) -> list[dict]:
        """Each request's record in the stream's order: a worker's whole stream where it
        finished, else what it reported (`progress`); requests nobody reported are empty."""
        n = len(requests)
        per_request: list[dict] = [{"tokens": []} for _ in range(n)]

        def take(name: str, ids: list[int]) -> None:
            if name in results:
                for i, served in zip(ids, results[name]):
                    per_request[i] = served
            else:
                for i, served in progress[name].items():
                    per_request[i] = served

        if self.deployment.mode == "aggregated":
            for name, ids in zip(self.names, route(requests, len(self.names))):
                take(name, ids)
            return per_request
        prefills = [x for x in self.names if x.startswith("prefill")]
        for name, ids in zip(prefills, route(requests, len(prefills))):
            take(name, ids)
        for name in self.names:
            if name.startswith("decode"):
                merge_decoded(per_request, results[name] if name in results else progress[name])
        return per_request

    def close(self) -> None:
        """Every worker killed, then the Ray session closed (bounded: session.py)."""
        ray = getattr(self, "ray", None)
        for actor in self.actors.values():
            try:
                ray.kill(actor)
            except Exception:  # noqa: BLE001 - already dead, or Ray already gone
                pass
        self.actors = {}
        self.session.close()

    def __enter__(self) -> "ServingSession":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class WorkerLost(Exception):
    """A worker was lost (or failed) before the stream started: nothing was served."""

    def __init__(self, stop: Stop):
        super().__init__(stop.reason)
        self.stop = stop


def explain_lost(pid: int | None, err: BaseException) -> str:
    """Why a worker's process is gone, in a few words: the kernel's OOM killer when its log
    says so (sweeper/sweep/oom.py), else that its process died, in Ray's word for it."""
    from sweeper.sweep.oom import explain_exit

    oom = explain_exit(pid) if pid else None
    return oom or f"its process died: {type(err).__name__}"


def serve(deployment: Deployment, requests: list[Request], seed: int = 0,
          emulated: bool = True, on_start: Callable[[dict], None] | None = None) -> ServeResult:
    """Serve `requests` (wall-clock arrivals) with `deployment` on Ray mesh workers; measure,
    and predict the same requests with the serving model (module docstring). `on_start`:
    as `ServingSession.run`'s."""
    from sweeper.sweep.stopping import held

    session = ServingSession(deployment, context_len(requests), [r.input_len for r in requests],
                             seed, emulated, prefix_len=prefix_len_of(requests),
                             cached=prefix_shapes(requests))
    try:
        return session.run(requests, seed, on_start)
    finally:
        with held():          # a signal now must not cut the shutdown short (stray processes)
            session.close()


def prefix_len_of(requests: list[Request]) -> int:
    """The shared prefix a stream's workers cache: its longest `cached_len` (a request
    that hits it caches all of it unless its prompt is shorter; 0: no prefix caching)."""
    return max((r.cached_len for r in requests), default=0)


def prefix_shapes(requests: list[Request]) -> list[tuple[int, int]]:
    """The (input_len, cached_len) of a stream's prompts that start with the shared
    prefix: the extends a worker warms up before the stream."""
    return sorted({(r.input_len, r.cached_len) for r in requests if r.cached_len})


def prediction_deployment(deployment: Deployment, share: float) -> Deployment:
    """The deployment as this host runs it: a measured profile scaled to the workers' core
    share (a preset or fitted accelerator profile is used as it is)."""
    hw = deployment.hardware
    return dataclasses.replace(deployment, hardware=hw.scaled(share)) if hw.measured else deployment


def compare(deployment: Deployment, requests: list[Request], per_request: list[dict],
            warmup: dict[str, dict], share: float, diagnostic=None,
            spread: tuple[tuple, tuple] = ((), ())) -> tuple[dict, dict, dict]:
    """(measured, predicted, calibrated) summaries of the same requests; `diagnostic`: the
    StepTimes of the calibrated column (default: the warm-up medians); `spread`: (prefill,
    step) duration factors the prediction draws from (none by default). The serving host
    costs the prediction charges (`HostCosts`) are the deployment's
    hardware profile's (overheads.py `with_overheads`)."""
    from workloads.serving.model import SimResult, cost_model_step_times, simulate

    arrival = np.array([r.arrival_s for r in requests])
    first = np.array([p.get("first_token_s", np.nan) for p in per_request], dtype=float)
    finish = np.array([p.get("finish_s", np.nan) for p in per_request], dtype=float)
    output = np.array([r.output_len for r in requests], dtype=np.int64)
    done = np.isfinite(finish) & np.isfinite(first)
    measured = SimResult(deployment, arrival[done], first[done], finish[done], output[done]).summary()
    measured["completed"] = int(done.sum())
    predicting = prediction_deployment(deployment, share)
    times = None
    if spread[0] or spread[1]:
        times = dataclasses.replace(cost_model_step_times(predicting),
                                    prefill_spread=tuple(spread[0]), step_spread=tuple(spread[1]))
    # the whole stream is simulated (a request's wait depends on those before it); a stream
    # cut short is compared on the requests that completed (`completed_only`)
    predicted = completed_only(simulate(predicting, requests, times), done).summary()
    calibrated = completed_only(simulate(deployment, requests,
                                         diagnostic or warmup_step_times(deployment, warmup)),
                                done).summary()
    return measured, predicted, calibrated


def completed_only(result, done: np.ndarray):
    """A simulated stream's SimResult restricted to the requests `done` marks (all: as it is)."""
    if done.all():
        return result
    return dataclasses.replace(result, arrival_s=result.arrival_s[done],
                               first_token_s=result.first_token_s[done],
                               finish_s=result.finish_s[done], output_len=result.output_len[done])


def warmup_step_times(deployment: Deployment, warmup: dict[str, dict]):
    """StepTimes from the workers' warm-up calls (one call per shape: a diagnostic only), with
    the profile's KV handover host cost (the warm-up has no handover)."""
    from workloads.serving.model import StepTimes

    pre = warmup.get("aggregated") or warmup["prefill"]
    dec = warmup.get("aggregated") or warmup["decode"]

    def prefill_s(batch: int, input_len: int) -> float:
        return float(pre.get(f"prefill_s@{input_len}", max(
            v for k, v in pre.items() if k.startswith("prefill_s@"))))

    return StepTimes(prefill_s, lambda batch, context: float(dec["decode_step_s"]),
                     lambda input_len: 0.0, source="warm-up", host_costs=HostCosts(
                         handover_overhead_s=deployment.hardware.host_costs.handover_overhead_s))


def replay_step_times(deployment: Deployment, calls: dict[str, list],
                      requests: list[Request] | None = None):
    """StepTimes that give a served stream's own calls back, in the order it made them
    (`ServeResult.calls`, server.py `last_calls`): simulating the same requests with them
    tests the serving model's RULES apart from its step times (docs/serving.md "Checking the
    model against the server"). Each prefill call lasts as logged to its first tokens; the
    work after them (aggregated: its rows' inserts; a prefill slice: the export and the Ray
    submission) is the per-prompt host cost (aggregated: the stream's mean per prompt; a
    prefill slice: each request's own, as its KV transfer); each decode step as logged with
    its bookkeeping; each decode-slice handover its stream's mean insert. A simulation that
    asks for more calls than the stream made gets the stream's mean. With `requests` (the
    stream's, for their arrivals), a prefill call that found the loop idle also lasts its
    wake-up, from the arrival to the call's start (`idle_wakes`: in no call's duration)."""
    from workloads.serving.model import StepTimes

    def replay(values: list[float]):
        mean = float(np.mean(values)) if values else 0.0
        it = iter(values)
        return lambda *_: next(it, mean)

    def prefills(log: list, arrivals: list[float] | None) -> list[float]:
        wakes = idle_wakes(log, arrivals) if arrivals is not None else None
        durations = [c[2] - c[1] for c in log if c[0] == "prefill"]
        return durations if wakes is None else [d + w for d, w in zip(durations, wakes)]

    def replicas_prefills(names: list[str]) -> list[float]:
        """The prefill replicas' logs one after the other, replica 0 first: the order
        `simulate` asks for them; a replica simulated with more calls than it made takes
        the next replica's first durations (docs/serving.md); a replica's log names its
        requests by their index in its share (`route`)."""
        routed = route(requests, len(names)) if requests is not None else [None] * len(names)
        return [d for name, ids in zip(names, routed) for d in prefills(
            calls[name], None if ids is None else [requests[i].arrival_s for i in ids])]

    if deployment.mode == "aggregated" and deployment.prefill.chunk:
        # chunked prefill (workloads/serving/slots.py `_serve_chunked`): each chunk's call is a "prefill"
        # duration (its prompt tokens at most `chunk`), each decode step as logged; the
        # loop's host work between them is in neither (an approximation: the serving
        # model's chunked iteration is the model helper's to replay exactly)
        names = aggregated_names(deployment.decode.replicas)
        log = [c for name in names for c in calls[name]]
        return StepTimes(replay([c[2] - c[1] for c in log if c[0] == "chunk"]),
                         replay([c[4] - c[1] for c in log if c[0] == "step"]), source="replay")
    if deployment.mode == "aggregated":
        names = aggregated_names(deployment.decode.replicas)
        prefill = replicas_prefills(names)
        log = [c for name in names for c in calls[name]]
        after = [(c[4] - c[2]) / len(c[3]) for c in log if c[0] == "prefill"]
        steps = [c[4] - c[1] for c in log if c[0] == "step"]
        return StepTimes(replay(prefill), replay(steps), source="replay", host_costs=HostCosts(
            prefill_overhead_per_prompt_s=float(np.mean(after)) if after else 0.0))
    # each phase's replicas' logs one after the other, replica 0 first, as `simulate`
    # asks for them
    names = disaggregated_names(deployment.prefill.replicas, deployment.decode.replicas)
    pre_names = [n for n in names if n.startswith("prefill")]
    prefill = replicas_prefills(pre_names)
    pre = [c for name in pre_names for c in calls[name]]
    dec = [c for name in names if name.startswith("decode") for c in calls[name]]
    sends = [(c[2] - c[1]) / len(c[3]) for c in pre if c[0] == "send" for _ in c[3]]
    steps = [c[4] - c[1] for c in dec if c[0] == "step"]
    inserts = [c[2] - c[1] for c in dec if c[0] == "insert"]
    return StepTimes(replay(prefill), replay(steps), replay(sends), source="replay",
                     host_costs=HostCosts(
                         handover_overhead_s=float(np.mean(inserts)) if inserts else 0.0))


def idle_wakes(log: list, arrivals: list[float]) -> list[float]:
    """A serving loop's wake-up per prefill call, from its call log (seconds after the
    stream's start) and its requests' arrivals: for a call that found the loop idle (its
    previous call had ended before the last of the call's requests arrived), the call's
    start minus that arrival (the loop's sleep overrunning, the scheduler waking it); 0 for
    a call right after other work."""
    wakes, previous_end = [], -math.inf
    for call in log:
        if call[0] == "prefill":
            arrived = max(arrivals[i] for i in call[3])
            wakes.append(max(call[1] - arrived, 0.0) if previous_end < arrived else 0.0)
        previous_end = call[4] if len(call) == 5 else call[2]     # the call log's ends
    return wakes


# --------------------------------------------------------------------------- printing


def table(result: ServeResult) -> str:
    """Measured beside predicted (and the warm-up diagnostic), with relative errors."""
    m, p, c = result.measured, result.predicted, result.calibrated
    err = relative_errors(m, p)
    err_c = relative_errors(m, c)
    rep = result.replayed or {k: float("nan") for k in KEYS}
    err_r = relative_errors(m, rep)
    rows = [f"{'':14}{'measured':>12}{'predicted':>12}{'rel.err':>9}   {'warm-up model':>14}{'rel.err':>9}"
            f"   {'replay':>10}{'rel.err':>9}"]
    for key in KEYS[:4]:
        rows.append(f"{key:14}{_ms(m[key]):>12}{_ms(p[key]):>12}{_pct(err[key]):>9}   "
                    f"{_ms(c[key]):>14}{_pct(err_c[key]):>9}   {_ms(rep[key]):>10}{_pct(err_r[key]):>9}")
    rows.append(f"{'completed':14}{m['completed']:>12}{p['completed']:>12}"
                f"   (percentiles of {result.percentiles_of})")
    rows.append(f"{'throughput':14}{m['throughput_rps']:>10.2f}/s{p['throughput_rps']:>10.2f}/s")
    return "\n".join(rows)


def _ms(value) -> str:
    return "-" if value is None or not math.isfinite(value) else f"{value * 1e3:.1f} ms"


def _pct(value) -> str:
    return "-" if not math.isfinite(value) else f"{value:+.0%}"
