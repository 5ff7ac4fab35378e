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
(workloads/servingmodel.py `simulate`: replica r serves the r-th, (r+R)-th, ... arrival),
known in advance, so the router is exact online too; one measured/predicted/replayed
comparison of the whole stream. Disaggregated: one worker per prefill replica and one per
decode replica; prefill replicas get requests round-robin in arrival order and each sends a
request's KV cache to the decode replica the serving model routes it to
(workloads/servingmodel.py `decode_route`: the answers of more than one token, round-robin
in arrival order), so the router is exact online here too.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from workloads.deployment import Deployment, PhaseSlice
from workloads.servingprofile import Request, context_len, merge_decoded
from workloads.config import ConfigError
from workloads.hardware import worker_share

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

    def to_json(self) -> dict:
        return {"measured": {k: self.measured[k] for k in KEYS},
                "predicted": {k: self.predicted[k] for k in KEYS},
                "calibrated": {k: self.calibrated[k] for k in KEYS},
                "replayed": {k: self.replayed[k] for k in KEYS} if self.replayed else None,
                "relative_error": relative_errors(self.measured, self.predicted),
                "deployment": self.deployment.to_dict(),
                "requests": len(self.requests), "warmup": self.warmup,
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

    return tuple(part.topology) if part.topology else best_topology(deployment.model.unpadded, part.chips)


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
    serving model's rule (workloads/servingmodel.py `simulate`)."""
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


def slot_specs(deployment: Deployment, context_len: int, seed: int) -> dict[str, dict]:
    """The SlotSpec (as plain data) of each worker: {"aggregated": ...} or {"prefill", "decode"};
    validated here, before Ray or JAX start (ConfigError names the plan field)."""
    from workloads.layouts import PhaseLayout, resolve_padding, validate_layouts, validate_phase

    d = deployment
    for part, name in ((d.prefill, "prefill"), (d.decode, "decode")):   # the slot server's own
        for key, runs in (("experts", "tp"), ("kv_cache", "bf16")):      # (workloads/serving.py)
            if getattr(part, key) != runs:
                raise ConfigError(f"{name}.{key}", getattr(part, key), f"{runs} (the slot server "
                                  "runs tp experts and a bf16 KV cache; the plan's prediction "
                                  "assumes otherwise)")
    pre = PhaseLayout(d.prefill.ffn, d.prefill.attn)
    dec = PhaseLayout(d.decode.ffn, d.decode.attn)
    model = d.model.to_dict()

    def spec(topology, prefill, decode, weights):
        return {"model": model, "topology": list(topology),
                "prefill": [prefill.ffn, prefill.attn] if prefill else None,
                "decode": [decode.ffn, decode.attn] if decode else None,
                "slots": d.decode.batch if decode else 1, "prefill_batch": d.prefill.batch,
                "context_len": context_len, "weights": weights, "seed": seed}

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


# --------------------------------------------------------------------------- the run


def _ray_started() -> bool:
    """Start a local Ray cluster of our own unless one is connected (as a sweep does: never
    join a cluster `ray start` left on this machine); True when started here."""
    import logging

    import ray   # lazy: Ray (~1 s)

    if ray.is_initialized():
        return False
    # Ray's C++ failure handler turns a SIGTERM during start-up into a stack dump and abort
    # (docs/reliability.md); the sweep turns it off the same way.
    os.environ.setdefault("RAY_DISABLE_FAILURE_SIGNAL_HANDLER", "1")
    try:
        ray.init(address="local", include_dashboard=False, log_to_driver=False,
                 logging_level=logging.WARNING)
    except Exception as err:  # noqa: BLE001 - Ray raises a bare Exception on a start-up timeout
        from sweeper.sweep.workers import ClusterLost   # the CLI's one line, exit 3

        raise ClusterLost(f"the local Ray cluster did not start ({' '.join(str(err).split())[:200]}); "
                          "nothing was served: try again") from None
    return True


def _shutdown_ray(wait_s: float = 30.0) -> None:
    """ray.shutdown(), waited for at most `wait_s` (everything is measured by then)."""
    import threading

    import ray   # lazy: Ray (~1 s)

    thread = threading.Thread(target=ray.shutdown, name="ray-shutdown", daemon=True)
    thread.start()
    thread.join(wait_s)


class ServingSession:
    """A deployment's workers, started and warmed up once, serving one stream after another
    (the validation benchmark serves several loads and seeds on one set of workers)."""

    def __init__(self, deployment: Deployment, context_len: int, prompt_lens: list[int],
                 seed: int = 0, emulated: bool = True, cores_per_worker: int | None = None):
        """`cores_per_worker`: pin each worker to that many of this process's cores (disjoint
        while they last) instead of sharing all of them out, so that every worker runs on
        the share a calibration sweep's trials ran on (docs/serving.md, validation)."""
        import ray   # lazy: Ray (~1 s)

        from sweeper import paths
        from sweeper.serving.server import ServingWorker, actor_options, worker_cores

        self.deployment, self.seed, self.emulated = deployment, seed, emulated
        # the diagnostic ("calibrated") prediction's step times; None: the warm-up medians
        self.diagnostic_step_times = None
        # the spread of the calls' durations the prediction draws from (StepTimes
        # prefill_spread, step_spread; overheads.py `duration_spread`); () : none
        self.duration_spread: tuple[tuple, tuple] = ((), ())
        # the serving host costs (a prefill on an idle loop, the part of a prefill's host
        # work before its first tokens, ...) are the deployment's hardware profile's
        # (overheads.py `with_deployment_overheads`), not attributes of the session
        specs = slot_specs(deployment, context_len, seed)
        self.ray = ray
        self.started_ray = _ray_started()
        self.names = list(specs)
        if not emulated:
            self.cores = [None] * len(self.names)
        elif cores_per_worker:
            groups = max(len(os.sched_getaffinity(0)) // cores_per_worker, len(self.names))
            self.cores = worker_cores(groups)[:len(self.names)]
        else:
            self.cores = worker_cores(len(self.names))
        total = len(os.sched_getaffinity(0))
        self.share = float(np.mean([worker_share(len(c), total) for c in self.cores])) if emulated else 1.0
        remote = ray.remote(ServingWorker)
        env = {paths.HOME_ENV: str(paths.sweeper_home(create=True))}
        self.actors = {}
        try:
            for name, mine in zip(self.names, self.cores):
                chips = math.prod(specs[name]["topology"]) if emulated else None
                threads = 2 if name.startswith("decode") else 1   # deliver() while serve_decode() runs
                self.actors[name] = remote.options(**actor_options(chips, mine, threads, env)).remote(mine)
            setups = {n: self.actors[n].setup.remote(specs[n], sorted(set(prompt_lens)))
                      for n in self.names}
            self.warmup = dict(zip(setups, ray.get(list(setups.values()), timeout=SETUP_TIMEOUT_S)))
            self.workers = dict(zip(self.names, ray.get([self.actors[n].where.remote()
                                                         for n in self.names])))
            self.workers["emulated"] = emulated
        except BaseException:
            self.close()
            raise

    def run(self, requests: list[Request], seed: int) -> ServeResult:
        """Serve one stream (prompts from `seed`); measured and predicted."""
        ray = self.ray
        plain = [dataclasses.asdict(r) for r in requests]
        begin = time.time()
        start_at = begin + START_MARGIN_S
        if self.deployment.mode == "aggregated":
            routed = route(requests, len(self.names))
            parts = ray.get([self.actors[n].serve_aggregated.remote([plain[i] for i in ids],
                                                                    start_at, seed, ids)
                             for n, ids in zip(self.names, routed)])
            per_request = in_stream_order(routed, parts, len(requests))
        else:
            from workloads.servingmodel import decode_route

            d = self.deployment
            prefills = [n for n in self.names if n.startswith("prefill")]
            decodes = [self.actors[n] for n in self.names if n.startswith("decode")]
            decoded_ids = decode_route(requests, d.decode.replicas)
            target = {i: r for r, ids in enumerate(decoded_ids) for i in ids}   # its decode replica
            decoded_refs = [actor.serve_decode.remote(len(ids), start_at)
                            for actor, ids in zip(decodes, decoded_ids)]
            routed = route(requests, d.prefill.replicas)
            parts = ray.get([self.actors[n].serve_prefill.remote(
                [plain[i] for i in ids], start_at, seed, decodes, ids,
                [target.get(i, 0) for i in ids]) for n, ids in zip(prefills, routed)])
            per_request = in_stream_order(routed, parts, len(requests))
            for decoded in ray.get(decoded_refs):        # its finish, its KV's times
                merge_decoded(per_request, decoded)
        wall = time.time() - begin - START_MARGIN_S
        calls = dict(zip(self.names, ray.get([self.actors[n].last_calls.remote() for n in self.names])))
        for i, r in enumerate(requests):
            per_request[i]["arrival_s"] = r.arrival_s
        measured, predicted, calibrated = compare(self.deployment, requests, per_request,
                                                  self.warmup, self.share,
                                                  self.diagnostic_step_times, self.duration_spread)
        from workloads.servingmodel import simulate

        replayed = simulate(self.deployment, requests,
                            replay_step_times(self.deployment, calls, requests)).summary()
        return ServeResult(self.deployment, requests, measured, predicted, calibrated,
                           per_request, self.warmup, self.workers, wall, calls, replayed)

    def close(self) -> None:
        for actor in self.actors.values():
            self.ray.kill(actor)
        self.actors = {}
        if self.started_ray:
            _shutdown_ray()
            self.started_ray = False

    def __enter__(self) -> "ServingSession":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def serve(deployment: Deployment, requests: list[Request], seed: int = 0,
          emulated: bool = True) -> ServeResult:
    """Serve `requests` (wall-clock arrivals) with `deployment` on Ray mesh workers; measure,
    and predict the same requests with the serving model (module docstring)."""
    with ServingSession(deployment, context_len(requests), [r.input_len for r in requests],
                        seed, emulated) as session:
        return session.run(requests, seed)


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
    costs the prediction charges (`serving_prefill_wake_s`, ...) are the deployment's
    hardware profile's (overheads.py `with_overheads`)."""
    from workloads.servingmodel import SimResult, cost_model_step_times, simulate

    arrival = np.array([r.arrival_s for r in requests])
    first = np.array([p.get("first_token_s", np.nan) for p in per_request], dtype=float)
    finish = np.array([p.get("finish_s", np.nan) for p in per_request], dtype=float)
    output = np.array([r.output_len for r in requests], dtype=np.int64)
    done = np.isfinite(finish)
    measured = SimResult(deployment, arrival[done], first[done], finish[done], output[done]).summary()
    measured["completed"] = int(done.sum())
    predicting = prediction_deployment(deployment, share)
    times = None
    if spread[0] or spread[1]:
        times = dataclasses.replace(cost_model_step_times(predicting),
                                    prefill_spread=tuple(spread[0]), step_spread=tuple(spread[1]))
    predicted = simulate(predicting, requests, times).summary()
    calibrated = simulate(deployment, requests,
                          diagnostic or warmup_step_times(deployment, warmup)).summary()
    return measured, predicted, calibrated


def warmup_step_times(deployment: Deployment, warmup: dict[str, dict]):
    """StepTimes from the workers' warm-up calls (one call per shape: a diagnostic only), with
    the profile's KV handover host cost (the warm-up has no handover)."""
    from workloads.servingmodel import StepTimes

    pre = warmup.get("aggregated") or warmup["prefill"]
    dec = warmup.get("aggregated") or warmup["decode"]

    def prefill_s(batch: int, input_len: int) -> float:
        return float(pre.get(f"prefill_s@{input_len}", max(
            v for k, v in pre.items() if k.startswith("prefill_s@"))))

    return StepTimes(prefill_s, lambda batch, context: float(dec["decode_step_s"]),
                     lambda input_len: 0.0, source="warm-up",
                     handover_overhead_s=deployment.hardware.handover_overhead_s)


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
    from workloads.servingmodel import StepTimes

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

    if deployment.mode == "aggregated":
        names = aggregated_names(deployment.decode.replicas)
        prefill = replicas_prefills(names)
        log = [c for name in names for c in calls[name]]
        after = [(c[4] - c[2]) / len(c[3]) for c in log if c[0] == "prefill"]
        steps = [c[4] - c[1] for c in log if c[0] == "step"]
        return StepTimes(replay(prefill), replay(steps), source="replay",
                         prefill_overhead_per_prompt_s=float(np.mean(after)) if after else 0.0)
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
                     handover_overhead_s=float(np.mean(inserts)) if inserts else 0.0)


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
    rows.append(f"{'completed':14}{m['completed']:>12}{p['completed']:>12}")
    rows.append(f"{'throughput':14}{m['throughput_rps']:>10.2f}/s{p['throughput_rps']:>10.2f}/s")
    return "\n".join(rows)


def _ms(value) -> str:
    return "-" if value is None or not math.isfinite(value) else f"{value * 1e3:.1f} ms"


def _pct(value) -> str:
    return "-" if not math.isfinite(value) else f"{value:+.0%}"
