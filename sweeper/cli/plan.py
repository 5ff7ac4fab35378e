"""`sweeper plan`: the cheapest serving deployment that meets a latency SLO (docs/serving.md).

Pure Python up to MLflow (imported only to log the plan): bad input exits 2 in
milliseconds. The search is sweeper/serving/plan.py; this module parses and prints.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from pathlib import Path

from sweeper.cli import appprofile, options
from sweeper.cli.output import print_json, say_profile
from workloads.config import (HARDWARE_PRESETS, MEMORY_RESERVE_SOURCES, PRICE_SOURCES,
                              WORLD_CALIBRATION, ConfigError, read_yaml)
from workloads.deployment import MAX_TOTAL_CHIPS, MODES
from workloads.serving import profile as serving_profile
from workloads.validate import from_text, integer


def add_parser(sub) -> None:
    p = sub.add_parser("plan", help="the cheapest serving deployment (replicas, chips, layouts, "
                       "batch slots, weights, aggregated or disaggregated) that meets a TTFT/TPOT "
                       "SLO, with error bands (docs/serving.md)")
    p.add_argument("--space", metavar="SPACE.yaml", help="read model, hardware and the "
                   "`serving:` block from a space file (flags override it)")
    p.add_argument("--model", help="model preset or YAML (e.g. palm-540b, llama2-70b)")
    p.add_argument("--hardware", help="hardware preset or YAML; a fitted profile (`sweeper "
                   "fit --out`, or a `<chip>-world` preset) gives calibrated step times and error "
                   "bands; several, comma-separated, compare them (the cheapest plan per hardware "
                   "and overall)")
    appprofile.add_arguments(p)
    p.add_argument("--max-chips", metavar="N", help="chip budget: the most goodput within N "
                   "chips (default: the cheapest plan, searched up to 4096 chips)")
    p.add_argument("--memory-reserve", metavar="SHARE", help="share of each chip's HBM held "
                   "back for the runtime and fragmentation (default: the hardware's own, 0.1 "
                   "for the presets; docs/models.md)")
    p.add_argument("--mode", choices=["aggregated", "disaggregated", "both"], default="both",
                   help="serving modes to search (default both)")
    p.add_argument("--weights", metavar="FORMATS", help="weight formats to search, comma-"
                   "separated (bf16, int8, fp8; default: every one the chips run, fp8 where "
                   "they have FP8 units)")
    p.add_argument("--requests", metavar="N", default="400",
                   help="requests simulated per deployment (default 400)")
    p.add_argument("--seed", metavar="N", default="0", help="seed of the simulated arrivals")
    p.add_argument("--coverage", metavar="SHARE", default="0.9",
                   help="coverage of the error bands (default 0.9)")
    p.add_argument("--band-requests", metavar="N", help="requests of the served stream the "
                   "bands are for: a short stream's p99 varies more (default: as simulated)")
    p.add_argument("--out", metavar="PLAN.json", help="write the best plan for `sweeper serve "
                   "--plan`")
    options.add_json(p)
    p.add_argument("--no-mlflow", action="store_true", help="do not log the plan to MLflow")
    add_world_arguments(p)
    options.add_tracking_uri(p)
    p.set_defaults(handler=cmd_plan)


MAX_REQUESTS = 20_000       # simulated per deployment (82 deployments x 100,000: ~2 min)
MAX_SEED = 2**31 - 1


def question_from_args(args: argparse.Namespace):
    """The PlanQuestion the flags (and --space) ask; ConfigError names the flag or field."""
    from sweeper.serving.plan import PlanQuestion
    from workloads.config import load_model
    from workloads.hardware import load_hardware

    model_spec, hardware_spec, profile = args.model, args.hardware, None
    if args.space:
        data = read_yaml(args.space)
        if not isinstance(data, dict):
            raise ConfigError("document", data, "a mapping (a space file)", args.space)
        model_spec = model_spec or data.get("model")
        hardware_spec = hardware_spec or data.get("hardware")
        if "serving" not in data:
            raise ConfigError("serving", None, "a serving: block (docs/serving.md)", args.space)
        block = data["serving"]
        base = (serving_profile.block_profile(block, args.space) if isinstance(block, dict)
                else serving_profile.profile_from_dict(block, args.space))
        overrides = {f: getattr(args, f"serving_{f}") for f in serving_profile.FIELDS
                     if getattr(args, f"serving_{f}") is not None}
        if overrides:     # flags win over the file, validated as flags
            merged = base.to_dict()
            for f, v in overrides.items():
                merged[f] = v
                if f == "rate":
                    merged["trace"] = None
                if f == "trace":
                    merged["rate"] = None
            for f in ("input_len", "output_len"):
                if isinstance(merged[f], dict):
                    merged[f] = str(getattr(base, f))
            profile = serving_profile.profile_from_flags(merged)
        else:
            profile = base
    if model_spec is None:
        raise ConfigError("--model", None, "a model preset or YAML (or --space with model:)")
    if hardware_spec is None:
        raise ConfigError("--hardware", None, "a hardware preset or YAML (or --space with "
                          "hardware:)")
    if profile is None:
        profile = appprofile.from_args(args)
    if args.space and not args.hardware:
        hardware_spec = _space_hardware(hardware_spec, args.space)
    model = load_model(model_spec, args.space, "--model" if args.model else "model")
    hardware = load_hardware(hardware_spec, args.space,
                             "--hardware" if args.hardware else "hardware")
    hardware = with_memory_reserve(hardware, args.memory_reserve)
    say_profile(hardware)
    max_chips = (None if args.max_chips is None else
                 integer("--max-chips", from_text(args.max_chips), maximum=MAX_TOTAL_CHIPS))
    coverage = serving_profile._share(args.coverage, "--coverage", None)
    if coverage >= 1:
        raise ConfigError("--coverage", args.coverage, "a share in (0, 1), such as 0.9")
    modes = MODES if args.mode == "both" else (args.mode,)
    requests = integer("--requests", from_text(args.requests), minimum=10, maximum=MAX_REQUESTS)
    seed = integer("--seed", from_text(args.seed), minimum=0, maximum=MAX_SEED)
    band_requests = (None if getattr(args, "band_requests", None) is None else
                     integer("--band-requests", from_text(args.band_requests), minimum=10,
                             maximum=MAX_REQUESTS))
    return PlanQuestion(model, hardware, profile, modes=modes, max_chips=max_chips,
                        requests=requests, seed=seed, coverage=coverage,
                        band_requests=band_requests,
                        weights=weights_flag(getattr(args, "weights", None), hardware))


def weights_flag(value: str | None, hardware) -> tuple[str, ...] | None:
    """--weights bf16,fp8 as a tuple (None: every format the planner searches); a format the
    chips do not run as a plan may (fp8 without FP8 units) is refused."""
    from sweeper.serving.plan import weight_formats   # the planner's stack: inputs first

    if value is None:
        return None
    searched = weight_formats(hardware)
    formats = tuple(dict.fromkeys(w.strip() for w in str(value).split(",")))
    for w in formats:
        if w not in searched:
            raise ConfigError("--weights", value, f"weight formats from {', '.join(searched)} "
                              f"on {hardware.name}, comma-separated")
    return formats


def with_memory_reserve(hardware, value: str | None):
    """The profile with --memory-reserve's share of HBM held back (None: its own)."""
    if value is None:
        return hardware
    try:
        share = float(value)
    except ValueError:
        share = -1.0
    if not 0 <= share < 1:
        raise ConfigError("--memory-reserve", value, "a share in [0, 1) of each chip's HBM, "
                          "such as 0.1")
    return dataclasses.replace(hardware, memory_reserve=share)


def reserve_source(hardware, override: str | None) -> dict:
    """The plan's memory reserve per chip and where it comes from (docs/models.md)."""
    preset = HARDWARE_PRESETS.get(hardware.name)
    if override is not None:
        source = "--memory-reserve"
    elif preset is not None and preset.memory_reserve == hardware.memory_reserve:
        source = MEMORY_RESERVE_SOURCES.get(hardware.name, "the preset")
    else:
        source = "the hardware file's memory_reserve"
    return {"share": hardware.memory_reserve, "source": source}


def _space_hardware(spec, space: str):
    """A space file's `hardware:` (host | devices:<profile> | analytical:<profile or YAML>,
    docs/space-files.md) as a profile spec; a relative YAML is looked up beside the space."""
    if isinstance(spec, str) and ":" in spec and spec.split(":", 1)[0] in ("analytical", "devices"):
        spec = spec.split(":", 1)[1]
    if spec == "devices":
        raise ConfigError("hardware", spec, "a hardware profile to plan with (devices:<profile> "
                          "or analytical:<profile>)", space)
    if isinstance(spec, str) and spec.endswith((".yaml", ".yml")) and not Path(spec).is_absolute():
        beside = Path(space).parent / spec
        if beside.is_file():
            spec = str(beside)
    return spec


def cmd_plan(args: argparse.Namespace) -> int:
    if len(hardware_specs(args)) > 1:
        return cmd_compare(args)
    question = with_price(question_from_args(args), prices(args, None))   # inputs checked first
    out_dir = check_out_dir(args)
    if args.out:
        out = Path(args.out)
        if out.exists() and out.is_dir():
            raise ConfigError("--out", args.out, "a file path for the plan JSON")
    from sweeper.serving.plan import plan

    result = plan(question)
    data = result.to_dict()
    if args.out and result.best is not None:
        Path(args.out).write_text(json.dumps(result.plan_file(), indent=2, default=_json) + "\n")
        data["out"] = str(args.out)
    if not args.no_mlflow:
        from sweeper.tracking.serving_log import log_plan

        data["mlflow_run_id"] = log_plan(result, args.tracking_uri)
    data["launch"] = best_launch_lines(result)
    data["memory_reserve"] = reserve_source(question.hardware, args.memory_reserve)
    if out_dir:
        data["files"] = write_files(out_dir, [choice_of(result)], result.question)
    if args.json:
        print_json(_clean(data))
    else:
        print(render(result, data))
        print(render_launch(data["launch"], data.get("files")))
    return 0


def _json(value):
    return None


def _clean(value):
    """NaN/inf -> None so the JSON is standard."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def _seconds(value) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    return f"{value * 1e3:.1f} ms" if value < 1 else f"{value:.2f} s"


def _line(plan: dict, stat_ttft: str, stat_tpot: str) -> str:
    cost = plan.get("cost_per_million_tokens")
    cost_text = f"  ${cost:,.2f}/M tokens" if cost is not None else ""
    band = plan.get("band") or "-"
    risk = "  AT RISK" if plan.get("at_risk") else ""
    ttft_band = plan.get(f"ttft_{stat_ttft}_band_s")
    tpot_band = plan.get(f"tpot_{stat_tpot}_band_s")
    bands = ""
    if ttft_band and tpot_band:
        bands = (f"  band TTFT [{_seconds(ttft_band[0])}, {_seconds(ttft_band[1])}] TPOT "
                 f"[{_seconds(tpot_band[0])}, {_seconds(tpot_band[1])}]")
    return (f"{plan['mode']:<14} {plan['chips_total']:>5} chips  TTFT p50/p99 "
            f"{_seconds(plan['ttft_p50_s'])}/{_seconds(plan['ttft_p99_s'])}  TPOT p50/p99 "
            f"{_seconds(plan['tpot_p50_s'])}/{_seconds(plan['tpot_p99_s'])}  goodput "
            f"{plan['goodput_rps']:.3g} req/s  {plan['tokens_per_s_per_chip']:.3g} tok/s/chip"
            f"{cost_text}  binds: {plan['binding']}  band: {band}{bands}{risk}")


def _precision(s: dict) -> str:
    """A slice's weights, and its KV cache and experts layout where they are not the defaults."""
    kv = f", KV {s['kv_cache']}" if s.get("kv_cache", "bf16") != "bf16" else ""
    experts = f", experts {s['experts']}" if s.get("experts", "tp") != "tp" else ""
    return f"{s['weights']}{kv}{experts}"


def _stages(s: dict) -> str:
    """' in 2 stages of 8' for a pipelined slice ('' without stages)."""
    stages = s.get("stages", 1)
    return f" in {stages} stages of {s['chips'] // stages}" if stages > 1 else ""


def _slices(plan: dict) -> str:
    def one(name, s):
        topo = f" {s['topology']}" if s.get("topology") else ""
        return (f"{name} {s['replicas']} x {s['chips']} chips{_stages(s)}{topo} {s['ffn']}/"
                f"{s['attn']} batch {s['batch']} {_precision(s)}")
    if plan["mode"] == "aggregated":
        pre = plan["prefill"]
        prompts = (f"in chunks of {pre['chunk']} tokens per decode step" if pre.get("chunk")
                   else f"{pre['batch']} prompts per call")
        return (f"    {plan['decode']['replicas']} replica(s) x {plan['decode']['chips']} chips"
                f"{_stages(plan['decode'])} ({plan['decode']['topology']}, "
                f"{_precision(plan['decode'])}): prefill {pre['ffn']}/{pre['attn']} {prompts}, "
                f"decode {plan['decode']['ffn']}/{plan['decode']['attn']} "
                f"{plan['decode']['batch']} slots")
    return f"    {one('prefill', plan['prefill'])}; {one('decode', plan['decode'])}"


def _memory_lines(plan: dict) -> list[str]:
    """Each slice's memory per chip: HBM, reserve, weights, working set, the slots' KV cache
    at the longest request, and the KV capacity in tokens."""
    def gb(value):
        return f"{value / 1e9:.1f} GB"

    out = []
    for name, m in (plan.get("memory_per_chip") or {}).items():
        capacity = m["kv_capacity_tokens"]
        stage = f", a chip of one of {m['stages']} stages" if m.get("stages") else ""
        prefix = (f", shared prefix {gb(m['prefix_kv_bytes'])}" if m.get("prefix_kv_bytes")
                  else "")
        out.append(f"    memory per chip ({name}{stage}): {gb(m['hbm_bytes'])} HBM, "
                   f"{gb(m['reserve_bytes'])} reserved, weights {gb(m['weights_bytes'])}, working "
                   f"set {gb(m['working_bytes'])}, KV cache {gb(m['kv_bytes'])} for "
                   f"{m['kv_tokens']:,} tokens{prefix}; KV capacity {capacity:,} tokens"
                   if capacity is not None else "")
    return [line for line in out if line]


def render(result, data: dict) -> str:
    q = result.question
    p = q.profile
    st, sp = p.ttft_statistic, p.tpot_statistic
    lines = [f"{q.model.name} on {q.hardware.name}: {p.describe()}"]
    if q.max_chips:
        lines[0] += f"; budget {q.max_chips} chips"
    if data.get("memory_reserve"):
        r = data["memory_reserve"]
        lines.append(f"memory: {r['share']:.0%} of each chip's HBM reserved for the runtime and "
                     f"fragmentation ({r['source']}); plans fill the rest")
    lines.append("best plan per mode:")
    for mode, plan in data["best_per_mode"].items():
        if plan is None:
            lines.append(f"  {mode:<14} none meets the SLO")
        else:
            lines.append("  " + _line(plan, st, sp))
            lines.append(_slices(plan))
            lines += _memory_lines(plan)
    if data["plans"]:
        lines.append(f"plans on the cost/latency frontier (none beats another on chips, TTFT {st} and TPOT {sp}):")
        for plan in data["plans"][:12]:
            lines.append(f"  {plan['chips_total']:>5} chips {plan['mode']:<14} TTFT p99 "
                         f"{_seconds(plan['ttft_p99_s'])}  TPOT p99 {_seconds(plan['tpot_p99_s'])}"
                         f"  goodput {plan['goodput_rps']:.3g} req/s  binds {plan['binding']}")
    best = data["best"]
    if best is None:
        lines.append(f"no plan: {data['reason']}")
    else:
        lines.append(f"best: {data['reason']}")
        if best.get("at_risk") is None:
            lines.append(f"error band: uncalibrated ({q.hardware.name} has no held-out residuals; "
                         "`sweeper fit --out FILE.yaml` writes them, then `--hardware FILE.yaml`"
                         f"{world_hint(q.hardware.name)})")
        elif best.get("at_risk"):
            lines.append("AT RISK: the SLO target lies inside the plan's error band")
    if result.settle and best is not None:
        lines.append(f"to settle it: {result.settle}")
    s = data["search"]
    lines.append(f"searched {s['configs']} configurations, simulated {s['simulated']} deployments "
                 f"x {s['requests_per_simulation']} requests in {s['wall_s']:.1f} s "
                 f"({s['step_times']} step times)")
    if data.get("out"):
        lines.append(f"plan written to {data['out']}")
    if data.get("mlflow_run_id"):
        lines.append(f"logged to MLflow run {data['mlflow_run_id']}")
    return "\n".join(lines)


# --------------------------------------------------------------------------- several chips, files


def add_world_arguments(p) -> None:
    """--price and --out-dir (docs/world.md)."""
    p.add_argument("--price", metavar="CHIP=DOLLARS", action="append",
                   help="price per chip-hour of a hardware planned, overriding its default "
                   "(workloads/config.py PRICE_SOURCES), e.g. h100=2.5; comma-separate or repeat")
    p.add_argument("--out-dir", metavar="DIR", help="write the cost/latency frontier of every "
                   "hardware planned (frontier.csv, frontier.png) and the best plans (plans.json)")


def hardware_specs(args: argparse.Namespace) -> list[str]:
    """--hardware split at commas (one spec: no comparison)."""
    if not args.hardware or "," not in args.hardware:
        return [args.hardware] if args.hardware else []
    specs = [s.strip() for s in args.hardware.split(",")]
    if any(not s for s in specs) or len(set(specs)) != len(specs):
        raise ConfigError("--hardware", args.hardware, "presets or YAML files, comma-separated, "
                          "each once (e.g. h100,h200,tpu-v5e)")
    return specs


def prices(args: argparse.Namespace, names: list[str] | None) -> dict[str, float]:
    """--price CHIP=DOLLARS[,CHIP=DOLLARS] as {chip: dollars}; a chip must be one planned
    (`names`; None: checked against the one hardware later)."""
    out: dict[str, float] = {}
    for text in args.price or []:
        for part in text.split(","):
            name, _, value = part.partition("=")
            try:
                dollars = float(value)
            except ValueError:
                dollars = -1.0
            if not name.strip() or not dollars >= 0 or dollars == float("inf"):
                raise ConfigError("--price", part, "CHIP=DOLLARS per chip-hour, such as h100=2.5")
            if names is not None and name.strip() not in names:
                raise ConfigError("--price", part, f"a price for a hardware planned ({', '.join(names)})")
            out[name.strip()] = dollars
    return out


def with_price(question, overrides: dict[str, float]):
    """The question with its hardware's price per chip-hour overridden (--price)."""
    hw = question.hardware
    unknown = set(overrides) - {hw.name}
    if unknown:
        raise ConfigError("--price", ",".join(sorted(unknown)), f"a price for the hardware planned ({hw.name})")
    if hw.name not in overrides:
        return question
    return dataclasses.replace(question, hardware=dataclasses.replace(
        hw, price_per_chip_hour=overrides[hw.name]))


def price_source(hw, overrides: dict[str, float]) -> str:
    if hw.name in overrides:
        return "--price"
    if hw.price_per_chip_hour is None:
        return "none (pass --price)"
    return PRICE_SOURCES.get(hw.name, "the hardware file")


def check_out_dir(args: argparse.Namespace) -> Path | None:
    if not args.out_dir:
        return None
    out = Path(args.out_dir)
    if out.exists() and not out.is_dir():
        raise ConfigError("--out-dir", args.out_dir, "a folder (created if missing) for the frontier files")
    return out


def world_hint(name: str) -> str:
    """'; h100-world is fitted to N published points' where a world preset has this datasheet."""
    fitted = [n for n, c in WORLD_CALIBRATION.items() if c["datasheet"] == name]
    return (f"; `--hardware {fitted[0]}` is fitted to {WORLD_CALIBRATION[fitted[0]]['points']} "
            "published points and carries a band (docs/world.md)") if fitted else ""


def choice_of(result, overrides: dict[str, float] | None = None):
    from sweeper.serving.plan import HardwareChoice   # the planner's stack: after the inputs are checked

    return HardwareChoice(result, price_source(result.question.hardware, overrides or {}))


def best_launch_lines(result) -> list[dict]:
    from sweeper.serving.launch import launch_lines   # as choice_of

    if result.best is None:
        return []
    q = result.question
    return launch_lines(result.best.to_dict(), q.model, q.hardware, q.profile)


def render_launch(lines: list[dict], files: dict | None) -> str:
    out = []
    if lines:
        out.append("launch the best plan with:")
        for line in lines:
            runs = ("runs as is" if not line["lacks"]
                    else "NOT as is: " + "; ".join(line["lacks"]))
            out.append(f"  {line['engine']:<9} {line['command']}\n            ({runs})")
    if files:
        out.append("wrote " + ", ".join(files.values()))
    return "\n".join(out)


def write_files(out_dir: Path, choices: list, question) -> dict[str, str]:
    """frontier.csv, frontier.png and plans.json under --out-dir."""
    from sweeper.serving.outputs import frontier_rows, write_frontier   # as choice_of

    rows = frontier_rows(choices)
    p = question.profile
    files = write_frontier(rows, out_dir, f"{question.model.name}: {p.describe()}")
    plans = out_dir / "plans.json"
    plans.write_text(json.dumps(_clean([{
        **c.to_dict(), "launch": best_launch_lines(c.result)} for c in choices]), indent=2,
        default=_json) + "\n")
    files["plans"] = str(plans)
    return files


def cmd_compare(args: argparse.Namespace) -> int:
    """`--hardware a,b,c`: the same question planned on each; the cheapest per hardware and
    overall, with the price each was costed at (docs/world.md)."""
    from sweeper.serving.plan import compare   # as choice_of

    specs = hardware_specs(args)
    questions = []
    for spec in specs:                            # every input checked before any search
        one = argparse.Namespace(**{**vars(args), "hardware": spec})
        questions.append(question_from_args(one))
    names = [q.hardware.name for q in questions]
    if len(set(names)) != len(names):
        raise ConfigError("--hardware", args.hardware, "hardware with different names (each once)")
    overrides = prices(args, names)
    questions = [with_price(q, {k: v for k, v in overrides.items() if k == q.hardware.name})
                 for q in questions]
    out_dir = check_out_dir(args)
    if args.out:
        raise ConfigError("--out", args.out, "one hardware (with several, --out-dir writes every plan)")
    comparison = compare(questions, {q.hardware.name: price_source(q.hardware, overrides) for q in questions})
    data = comparison.to_dict()
    for entry, choice in zip(data["hardware"], comparison.choices):
        entry["launch"] = best_launch_lines(choice.result)
    if out_dir:
        data["files"] = write_files(out_dir, comparison.choices, questions[0])
    if not args.no_mlflow:
        from sweeper.tracking.serving_log import log_plan

        data["mlflow_run_ids"] = [log_plan(c.result, args.tracking_uri) for c in comparison.choices]
    if args.json:
        print_json(_clean(data))
    else:
        print(render_compare(comparison, data))
    return 0


def render_compare(comparison, data: dict) -> str:
    q = comparison.choices[0].result.question
    p = q.profile
    lines = [f"{q.model.name} on {len(comparison.choices)} hardware: {p.describe()}",
             "cheapest plan per hardware (price per chip-hour and its source):"]
    for choice, entry in zip(comparison.choices, data["hardware"]):
        hw, best = choice.hardware, choice.result.best
        price = "no price" if hw.price_per_chip_hour is None else f"${hw.price_per_chip_hour:.2f}/chip-h"
        if best is None:
            lines.append(f"  {hw.name:<16} {price} ({choice.price_source}): no plan: {choice.result.reason}")
            continue
        d = best.to_dict()
        cost = "" if choice.dollars_per_hour is None else f"  ${choice.dollars_per_hour:,.2f}/hour"
        lines.append(f"  {hw.name:<16} {price} ({choice.price_source}): {d['mode']} "
                     f"{d['chips_total']} chips{cost}  TTFT p99 {_seconds(d['ttft_p99_s'])}  TPOT p99 "
                     f"{_seconds(d['tpot_p99_s'])}  band: {d.get('band') or '-'}"
                     f"{'  AT RISK' if d.get('at_risk') else ''}")
        lines.append(_slices(d))
    cheapest = comparison.cheapest
    if cheapest is not None:
        lines.append(f"cheapest overall: {cheapest.hardware.name}, {cheapest.result.best.chips_total} "
                     f"chips at ${cheapest.dollars_per_hour:,.2f}/hour")
        entry = next(e for e in data["hardware"] if e["hardware"] == cheapest.hardware.name)
        lines.append(render_launch(entry["launch"], None))
    else:
        lines.append("cheapest overall: none (no hardware has both a plan and a price)")
    if comparison.unpriced:
        lines.append(f"not ranked (no price; pass --price NAME=DOLLARS): {', '.join(comparison.unpriced)}")
    if data.get("files"):
        lines.append("wrote " + ", ".join(data["files"].values()))
    return "\n".join(lines)
