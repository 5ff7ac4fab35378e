"""`sweeper serve`: serve a Poisson request stream with a plan's deployment on Ray mesh workers
(emulated meshes here), and print each measured TTFT/TPOT percentile beside the serving
model's prediction for the same requests (sweeper/serving/serve.py; docs/serving.md
"Real serving runs").

Bad input (no plan file, a bad rate or count, a deployment this host cannot run) is one line
and exit 2, before Ray or JAX start.
"""

from __future__ import annotations

import json
import sys

from sweeper.cli import options
from sweeper.cli.output import say_profile
from workloads.config import ConfigError
from workloads.serving.costs import HostCosts
from workloads.validate import from_text, integer, number


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="really serve a Poisson request stream with a plan's "
                       "deployment; measured TTFT/TPOT beside the serving model's prediction")
    p.add_argument("--plan", required=True, metavar="PLAN.json",
                   help="deployment to run (`sweeper plan --out`, or written by hand)")
    p.add_argument("--rate", metavar="RPS", help="requests per second (Poisson; required unless "
                   "--measure-overheads)")
    p.add_argument("--requests", default="20", metavar="N", help="requests in the stream (default 20)")
    p.add_argument("--seed", default="0", metavar="S", help="arrivals, lengths and prompts (default 0)")
    p.add_argument("--input-len", metavar="N", help="prompt tokens (default: the plan's profile)")
    p.add_argument("--output-len", metavar="K", help="answer tokens (default: the plan's profile)")
    p.add_argument("--prefix-len", metavar="N", help="leading prompt tokens shared across "
                   "requests, their KV cached by the workers (prefix caching; default: the "
                   "plan's profile, else 0)")
    p.add_argument("--prefix-hit", metavar="SHARE", help="share of requests that start with "
                   "the shared prefix (default: the plan's profile, else 1.0)")
    p.add_argument("--measure-overheads", metavar="OUT.yaml",
                   help="serve nothing: measure this host's serving host costs for the plan's "
                   "deployment (per decode step, per prefill call, per KV handover; "
                   "docs/serving.md) and write the plan's hardware profile with them to OUT.yaml")
    p.add_argument("--no-mlflow", action="store_true", help="do not log the run to MLflow")
    options.add_tracking_uri(p)
    options.add_json(p)
    p.set_defaults(handler=cmd_serve)


MAX_REQUESTS = 10_000     # a served stream's requests (each is logged to MLflow)
MAX_SEED = 2**31 - 1       # the prompts' seed (JAX's PRNG key)


def stream_of(args):
    """(deployment, requests, rate, seed) from the flags and the plan; ConfigError on bad input."""
    from workloads.deployment import load_plan, load_plan_profile
    from workloads.serving.profile import AppProfile, parse_length, requests

    if args.rate is None:
        raise ConfigError("--rate", None, "requests per second (required unless --measure-overheads)")
    rate = number("--rate", from_text(args.rate, float), positive=True,
                  what="a positive number of requests per second")
    count = integer("--requests", from_text(args.requests), minimum=1, maximum=MAX_REQUESTS)
    seed = integer("--seed", from_text(args.seed), minimum=0, maximum=MAX_SEED)
    deployment = load_plan(args.plan)
    profile = load_plan_profile(args.plan)
    lengths = {}
    for key, flag in (("input_len", "--input-len"), ("output_len", "--output-len")):
        value = getattr(args, key)
        if value is not None:
            lengths[key] = parse_length(value, flag, None)
        elif profile is not None:
            lengths[key] = getattr(profile, key)
        else:
            raise ConfigError(flag, None, "a token count (the plan has no profile to take it from)")
    prefix = {}
    for key in ("prefix_len", "prefix_hit"):      # the flags, else the plan's profile
        value = getattr(args, key, None)
        if value is None and profile is not None:
            value = getattr(profile, key)
        if value is not None:
            prefix[key] = value
    stream = profile_of(rate, lengths, prefix)
    return deployment, requests(stream, count, seed), rate, seed


def profile_of(rate: float, lengths: dict, prefix: dict):
    """The served stream's AppProfile; its prefix flags parsed and checked as `sweeper
    plan`'s (workloads/serving/profile.py: ConfigError names the flag)."""
    from workloads.serving.profile import AppProfile, _build

    if not prefix:
        return AppProfile(rate=rate, **lengths)
    block = {"rate": rate, **{k: v.to_value() for k, v in lengths.items()}, **prefix}
    return _build(block, None, lambda key: "--" + key.replace("_", "-"))


def lengths_of(args) -> tuple[int, int]:
    """(input_len, output_len) for --measure-overheads: the flags, else the plan's profile
    (a distribution: its mean)."""
    from workloads.deployment import load_plan_profile
    from workloads.serving.profile import parse_length

    profile = load_plan_profile(args.plan)
    out = []
    for key, flag in (("input_len", "--input-len"), ("output_len", "--output-len")):
        value = getattr(args, key)
        if value is not None:
            length = parse_length(value, flag, None)
        elif profile is not None:
            length = getattr(profile, key)
        else:
            raise ConfigError(flag, None, "a token count (the plan has no profile to take it from)")
        out.append(max(int(round(length.mean)), 1))
    return out[0], out[1]


def cmd_measure_overheads(args) -> int:
    from pathlib import Path

    import yaml

    from workloads.deployment import load_plan
    from sweeper.serving.serve import check_fits, slot_specs

    out = Path(args.measure_overheads)
    if out.suffix not in (".yaml", ".yml") or not out.parent.is_dir():
        raise ConfigError("--measure-overheads", args.measure_overheads,
                          "a .yaml path in an existing folder")
    deployment = load_plan(args.plan)
    input_len, output_len = lengths_of(args)
    slot_specs(deployment, input_len + output_len + 1, 0)    # every layout check before Ray and JAX
    check_fits(deployment, input_len + output_len + 1, input_len, args.plan)
    from sweeper.serving.overheads import measure, with_overheads

    costs = measure(deployment, input_len, output_len)
    hardware = with_overheads(deployment.hardware, costs)
    out.write_text(yaml.safe_dump(hardware.to_dict(), sort_keys=False))
    if args.json:
        from sweeper.formatting import jsonable

        print(json.dumps(jsonable({**hardware.host_costs.to_dict(), "detail": costs["detail"],
                                   "profile": str(out)}), indent=2))
        return 0
    print(f"{deployment.describe()}; prompts {input_len}, answers {output_len} tokens")
    for key, value in hardware.host_costs.to_dict().items():    # workloads/serving/costs.py
        if HostCosts.unit(key) == "B":
            print(f"{key:32}{value / 2**20:9.2f} MiB")
        else:
            print(f"{key:32}{value * 1e3:9.3f} ms")
    print(f"wrote {out} (the plan's hardware profile with them; `host` timings, measured "
          "outside any served stream: docs/serving.md \"Serving host costs\")")
    return 0


def host_costs_hint(deployment, plan_path: str) -> str | None:
    """One line when a measured (emulated host) profile has none of the serving host costs:
    its prediction is the cost model's engine calls alone, which on this host's small models
    are a fraction of what a serving loop's host work adds (docs/serving.md "Serving host
    costs")."""

    hw = deployment.hardware
    if not hw.measured or hw.host_costs != HostCosts():
        return None
    return (f"note: the plan's profile `{hw.name}` has no serving host costs, so the prediction "
            f"leaves out the serving loop's own work; `sweeper serve --plan {plan_path} "
            "--measure-overheads host-serving.yaml` measures them into a profile to plan and "
            "serve with (docs/serving.md \"Serving host costs\")")


EXIT_CODES = {"worker_lost": 1, "worker_failed": 1, "SIGINT": 130, "SIGTERM": 143}


def cmd_serve(args) -> int:
    """Serve the stream; exit 0 when every request was served, else (docs/reliability.md,
    "Serving") 1 for a lost or failed worker, 130 / 143 for SIGINT / SIGTERM, with one
    line on stderr, and what completed printed and logged (the MLflow run FAILED or
    KILLED, with the reason)."""
    if args.measure_overheads:
        return cmd_measure_overheads(args)
    deployment, reqs, rate, seed = stream_of(args)
    from sweeper.serving.serve import check_fits, prefix_len_of, slot_specs
    from workloads.serving.profile import context_len

    slot_specs(deployment, context_len(reqs), seed,           # every layout check before Ray and JAX
               prefix_len_of(reqs))
    check_fits(deployment, context_len(reqs), max(r.input_len for r in reqs), args.plan)
    say_profile(deployment.hardware)                          # checks passed: name the profile
    result = served(deployment, reqs, seed)
    if result is None:
        return EXIT_CODES["worker_lost"]
    from sweeper.sweep import stopping

    run_id = None
    with stopping.held():       # what was served is logged and printed whole
        if not args.no_mlflow:
            from sweeper.tracking.serving_log import log_serve

            run_id = log_serve(result, rate, seed, args.tracking_uri)
        print_result(args, result, rate, seed, run_id)
    late = stopping.requested()
    if result.stop is None and late is not None:
        name = stopping.signal_name(late)
        print(f"sweeper serve: stopped by {name} after the stream was served; "
              f"{result.percentiles_of} kept" + (f" in MLflow run {run_id}" if run_id else ""),
              file=sys.stderr)
        return EXIT_CODES[name]
    if result.stop is None:
        return 0
    stop = result.stop
    kept = (f"{result.percentiles_of} kept" + (f" in MLflow run {run_id}" if run_id else ""))
    if stop["kind"] == "signal":
        print(f"sweeper serve: {stop['reason']}; {kept}", file=sys.stderr)
        return EXIT_CODES[stop["signal"]]
    print(f"sweeper serve: error: {stop['reason']}; {kept}", file=sys.stderr)
    return EXIT_CODES[stop["kind"]]


def served(deployment, reqs, seed: int):
    """The ServeResult, or None (one line printed) when a worker was lost before the stream
    started (nothing was served, nothing is logged)."""
    from sweeper.serving.serve import WorkerLost, serve

    def started(workers: dict) -> None:
        pids = ", ".join(f"{name} pid {pid}" for name, pid in workers.items())
        print(f"sweeper serve: serving {len(reqs)} requests ({pids})", file=sys.stderr, flush=True)

    try:
        return serve(deployment, reqs, seed=seed, on_start=started)
    except WorkerLost as err:
        print(f"sweeper serve: error: {err}; nothing was served", file=sys.stderr)
        return None


def print_result(args, result, rate: float, seed: int, run_id: str | None) -> None:
    from sweeper.serving.serve import table

    if args.json:
        from sweeper.formatting import jsonable

        print(json.dumps(jsonable({**result.to_json(), "mlflow_run_id": run_id}), indent=2))
        return
    reqs = result.requests
    print(f"{result.deployment.describe()}")
    print(f"{len(reqs)} requests at {rate:g} req/s (Poisson, seed {seed}); wall {result.wall_s:.1f} s"
          + (f"; stopped early ({result.stop['reason']})" if result.stop else ""))
    print(f"percentiles of {result.percentiles_of}")
    print(table(result))
    print("predicted: the serving model with the plan's hardware profile (cost model); "
          "warm-up model: the same simulation on step times the workers measured before the "
          "stream (a diagnostic). Timings on an emulated mesh are this host's (`host`).")
    hint = host_costs_hint(result.deployment, args.plan)
    if hint:
        print(hint)
    if run_id:
        status = "" if result.stop is None else f", {'KILLED' if result.stop['kind'] == 'signal' else 'FAILED'}"
        print(f"MLflow run {run_id} (experiment sweeper/serve{status})")
