"""Handlers of the analytical commands: max-context, predict, recommend.

Thin: parse and check the arguments (bad input -> ConfigError, which the CLI turns into one
line and exit code 2), call workloads.costmodel, print JSON or a table. Every number printed
here is an analytical prediction from peak hardware numbers, and is labelled so.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Callable

from sweeper.cli import options
from sweeper.cli.output import say_profile
from sweeper.formatting import format_fields, format_table, human_bytes, human_seconds, percent
from workloads import costmodel
from workloads.config import load_model, parse_topology
from workloads.hardware import load_hardware
from workloads.layouts import (ATTN_LAYOUTS, EXPERT_LAYOUTS, FFN_LAYOUTS, KV_FORMATS,
                               PAD_VOCAB_CHOICES, PHASES, WEIGHT_FORMATS, PhaseLayout,
                               resolve_padding)
from workloads.recommend import recommend
from workloads.trial import parse_pad_heads
from workloads.validate import one_of, positive_int

HEADER = "analytical prediction (Pope et al. 2022 cost model from peak hardware numbers; not a measurement)"


# --------------------------------------------------------------------------- parsers


def add_parsers(sub) -> None:
    """Register max-context, predict and recommend on the `sweeper` subparsers."""
    p = sub.add_parser("max-context", help="longest context whose KV cache fits a fraction of HBM "
                       "(paper Table 1)")
    _common_args(p)
    p.add_argument("--attn", required=True, help=f"attention layout: {' | '.join(ATTN_LAYOUTS)}")
    p.add_argument("--kv-fraction", type=float, default=0.3,
                   help="fraction of each chip's HBM reserved for the KV cache (default 0.3; "
                   "at most what the usable HBM holds beside the weights)")
    options.add_trial_flag(p, "kv_cache")
    p.set_defaults(handler=run_max_context)

    p = sub.add_parser("predict", help="analytical latency, MFU, cost and memory of one phase")
    _common_args(p)
    _phase_args(p)
    p.add_argument("--ffn", help=f"FFN layout: {' | '.join(FFN_LAYOUTS)} (default: recommended)")
    p.add_argument("--attn", help=f"attention layout: {' | '.join(ATTN_LAYOUTS)} (default: recommended)")
    options.add_trial_flag(p, "weights")
    options.add_trial_flag(p, "topology")
    _pad_arg(p)
    _model_args(p)
    p.set_defaults(handler=run_predict)

    p = sub.add_parser("recommend", help="fastest FFN/attention layout for one phase, with alternatives")
    _common_args(p)
    _phase_args(p)
    options.add_trial_flag(p, "weights")
    p.add_argument("--topology", help="XxYxZ to choose on (default: the best ws2d split, as the "
                   "paper keeps X, Y, Z of the stored weights)")
    p.add_argument("--search-topology", action="store_true",
                   help="also try every X*Y*Z factorisation of chips")
    _pad_arg(p)
    _model_args(p)
    p.set_defaults(handler=run_recommend)


def _model_args(p: argparse.ArgumentParser) -> None:
    """The KV cache's format and a mixture-of-experts model's experts (docs/models.md)."""
    options.add_trial_flag(p, "kv_cache")
    p.add_argument("--experts", help="a mixture-of-experts model's experts: tp | ep (default: "
                   "recommended; tp with --ffn and --attn given)")


def _model_choices(args) -> tuple[str, str | None]:
    return (one_of("--kv-cache", args.kv_cache, KV_FORMATS),
            None if args.experts is None else one_of("--experts", args.experts, EXPERT_LAYOUTS))


def _pad_arg(p: argparse.ArgumentParser) -> None:
    options.add_trial_flag(p, "pad_heads")
    options.add_trial_flag(p, "pad_vocab")


def _common_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="model preset or YAML file")
    p.add_argument("--hardware", required=True, help="hardware preset or YAML file")
    options.add_trial_flag(p, "chips", type=int, required=True)
    options.add_trial_flag(p, "batch", type=int, required=True)
    options.add_json(p)


def _phase_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--phase", required=True, help="prefill | decode")
    p.add_argument("--input-len", type=int, default=2048,
                   help="prefill: tokens per sequence in this pass (default 2048)")
    p.add_argument("--context", type=int,
                   help="keys attended / KV-cache length (default: --input-len)")


# --------------------------------------------------------------------------- argument checks


def _load(args):
    model = load_model(args.model, field="--model")
    hw = load_hardware(args.hardware, field="--hardware")
    say_profile(hw)
    positive_int("--chips", args.chips)
    positive_int("--batch", args.batch)
    return model, hw


def _phase_inputs(args) -> tuple[str, int, int]:
    phase = one_of("--phase", args.phase, PHASES)
    input_len = positive_int("--input-len", args.input_len)
    context = input_len if args.context is None else positive_int("--context", args.context)
    return phase, input_len, context


def _topology(args):
    return None if args.topology is None else parse_topology(args.topology, args.chips, "--topology")


def _emit(args, payload: dict, text: Callable[[], str]) -> None:
    try:
        print(json.dumps(payload, indent=2, default=str) if args.json else text(), flush=True)
    except BrokenPipeError:   # `sweeper ... | head` closed the pipe: not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def _title(model, hw, chips: int, batch: int, what: str) -> str:
    return f"{HEADER}\n{what}: {model.name} on {chips} x {hw.name}, batch {batch}"


# --------------------------------------------------------------------------- max-context


def run_max_context(args) -> int:
    model, hw = _load(args)
    attn = one_of("--attn", args.attn, ATTN_LAYOUTS)
    kv_cache = one_of("--kv-cache", args.kv_cache, KV_FORMATS)
    result = costmodel.max_context(model, hw, args.chips, args.batch, attn, args.kv_fraction,
                                   kv_cache=kv_cache)
    payload = {"source": "analytical", "model": model.name, "hardware": hw.name,
               "chips": args.chips, "batch": args.batch, "attn": attn, **result.to_dict()}
    _emit(args, payload, lambda: _max_context_text(model, hw, args, attn, result))
    return 0


def _usable_text(hw) -> str:
    """The HBM a model may fill per chip, and the reserve held back (docs/models.md)."""
    if not hw.memory_reserve:
        return human_bytes(hw.hbm_bytes)
    return (f"{human_bytes(hw.usable_hbm_bytes)} usable ({human_bytes(hw.hbm_bytes)} less its "
            f"{percent(hw.memory_reserve, 0)} reserve)")


def _max_context_text(model, hw, args, attn: str, result: costmodel.MaxContext) -> str:
    r = result.to_dict()
    heads = f"{model.n_kv_heads} KV head{'s' if model.n_kv_heads != 1 else ''}"
    return format_fields([
        ("max context", f"{r['max_context']:,} tokens" + (
            " (the model's context window; the KV budget holds more)"
            if r["limited_by"] == "context window" else "")),
        ("attention", f"{attn}-sharded, {model.attention_kind} ({heads} x d_head {model.d_head})"),
        ("KV per token per chip", human_bytes(r["kv_bytes_per_token_per_chip"])),
        ("KV heads per chip", r["kv_heads_per_chip"]),
        ("sequences per chip", r["sequences_per_chip"]),
        ("KV replication", f"{r['kv_replication']:g}x"),
        ("KV budget per chip", f"{human_bytes(r['kv_budget_bytes_per_chip'])} "
                               f"({percent(r['kv_fraction'], 0)} of {human_bytes(hw.hbm_bytes)}, "
                               f"at most {_usable_text(hw)} less the weights)"),
        ("weights per chip", human_bytes(r["weight_bytes_per_chip"])),
    ], title=_title(model, hw, args.chips, args.batch, "max-context"))


# --------------------------------------------------------------------------- predict


def run_predict(args) -> int:
    model, hw = _load(args)
    phase, input_len, context = _phase_inputs(args)
    weights = one_of("--weights", args.weights, WEIGHT_FORMATS)
    ffn = None if args.ffn is None else one_of("--ffn", args.ffn, FFN_LAYOUTS)
    attn = None if args.attn is None else one_of("--attn", args.attn, ATTN_LAYOUTS)
    topology = _topology(args)
    pad = parse_pad_heads(args.pad_heads, field="--pad-heads")
    pad_vocab = one_of("--pad-vocab", args.pad_vocab, PAD_VOCAB_CHOICES)
    kv_cache, experts = _model_choices(args)
    if ffn is not None and attn is not None:
        layout = PhaseLayout(ffn, attn)
        mesh = topology or costmodel.best_topology(model, args.chips)
        run_model = resolve_padding(model, pad, mesh, layout, layout, None, pad_vocab=pad_vocab)
        pred = costmodel.predict_phase(run_model, hw, args.chips, args.batch, phase, input_len,
                                       context, layout, weights, mesh, experts=experts or "tp",
                                       kv_cache=kv_cache)
        result, chosen = pred.to_dict(), "given"
        result["same_program_as"] = [ffn] if pred.ffn != ffn else []
    else:   # fill in what was left out with the best layout consistent with what was given
        result = recommend(model, hw, args.chips, args.batch, phase, input_len, context, weights,
                           topology, ffn=ffn, attn=attn, pad_heads=pad,
                           pad_vocab=pad_vocab, experts=experts, kv_cache=kv_cache).to_dict()
        for key in ("alternatives", "candidates", "rejected", "gather_degree_continuous",
                    "ws2d_crossover_chips"):
            result.pop(key, None)
        chosen = "recommended"
    result["pad_heads"] = pad
    result["pad_vocab"] = pad_vocab
    payload = {"source": "analytical", "model": model.name, "hardware": hw.name,
               "input_len": input_len, "layout_chosen_by": chosen, **result}
    _emit(args, payload, lambda: _predict_text(model, hw, args, result, chosen))
    return 0


def _predict_text(model, hw, args, r: dict, chosen: str) -> str:
    what = (f"{r['phase']} of {r['tokens']:,} tokens (context {r['context']:,})" if r["phase"] == "prefill"
            else f"one decode step (context {r['context']:,})")
    head = format_fields([
        ("phase", what),
        ("layout", f"ffn {r['ffn']}, attention {r['attn']}, topology "
                   f"{'x'.join(map(str, r['topology']))}, weights {r['weights']}, KV cache "
                   f"{r['kv_cache']}" + (f", experts {r['experts']} ({r['moe_kernel']} kernel)"
                                         if r.get("experts") else "") + f" ({chosen})"),
        ("latency", f"{human_seconds(r['latency_s'])}  ({r['bound']}-bound)"),
        ("  compute", human_seconds(r["compute_s"])),
        ("  memory", human_seconds(r["memory_s"])),
        ("  communication", human_seconds(r["comm_s"])),
        ("MFU", percent(r["mfu"])),
        ("heads", _heads_text(r)),
        ("cost", f"{human_seconds(r['cost_chip_s_per_token'])} chip-time per token"),
        ("weights per chip", human_bytes(r["weight_bytes_per_chip"])),
        ("KV cache per chip", human_bytes(r["kv_bytes_per_chip"])),
        ("peak per chip", f"{human_bytes(r['peak_bytes_per_chip'])} of {_usable_text(hw)}"
                          f" -> {'fits' if r['fits'] else 'DOES NOT FIT'}"),
        ("communication per chip", human_bytes(r["comm_bytes_per_chip"])),
    ], title=_title(model, hw, args.chips, args.batch, "predict"))
    rows = _collective_rows(r["collectives"])
    table = format_table(rows, ["what", "kind", "axes", "count", "bytes per chip"],
                         formats={"bytes per chip": human_bytes},
                         title="collectives per forward pass (per chip)") if rows else \
        "collectives per forward pass: none"
    return f"{head}\n\n{table}"


def _heads_text(r: dict) -> str:
    """Query heads as run; the padding's cost when padded (paper §4)."""
    alias = f"; {', '.join(r['same_program_as'])} is this program here" if r.get("same_program_as") else ""
    if r["heads"] == r["unpadded_heads"]:
        return f"{r['heads']} (pad_heads {r['pad_heads']}, no padding needed){alias}"
    return (f"{r['unpadded_heads']} padded to {r['heads']} (+{r['padding_params'] / 1e9:.1f}B zero "
            f"parameters, counted in time and memory; MFU counts the unpadded model){alias}")


def _collective_rows(collectives: list[dict]) -> list[dict]:
    return [{"what": c["what"], "kind": c["kind"], "axes": c["axes"], "count": c["count"],
             "bytes per chip": c["bytes_per_chip"]} for c in collectives]


# --------------------------------------------------------------------------- recommend


def run_recommend(args) -> int:
    model, hw = _load(args)
    phase, input_len, context = _phase_inputs(args)
    weights = one_of("--weights", args.weights, WEIGHT_FORMATS)
    topology = _topology(args)
    pad = parse_pad_heads(args.pad_heads, field="--pad-heads")
    pad_vocab = one_of("--pad-vocab", args.pad_vocab, PAD_VOCAB_CHOICES)
    kv_cache, experts = _model_choices(args)
    result = recommend(model, hw, args.chips, args.batch, phase, input_len, context, weights,
                       topology, search_topology=args.search_topology, pad_heads=pad,
                       pad_vocab=pad_vocab, experts=experts, kv_cache=kv_cache).to_dict()
    payload = {"source": "analytical", "model": model.name, "hardware": hw.name,
               "input_len": input_len, **result, "pad_vocab": pad_vocab}
    _emit(args, payload, lambda: _recommend_text(model, hw, args, result))
    return 0


def _recommend_text(model, hw, args, r: dict) -> str:
    head = format_fields([
        ("phase", f"{r['phase']}, {r['tokens']:,} tokens in the pass, context {r['context']:,}"),
        ("recommended", f"ffn {r['ffn']}, attention {r['attn']}, topology "
                        f"{'x'.join(map(str, r['topology']))}"
                        + (f", experts {r['experts']}" if model.moe else "")),
        ("latency", f"{human_seconds(r['latency_s'])}  ({r['bound']}-bound), MFU {percent(r['mfu'])}"),
        ("heads", _heads_text(r)),
        ("peak per chip", f"{human_bytes(r['peak_bytes_per_chip'])} of {_usable_text(hw)}"
                          f" -> {'fits' if r['fits'] else 'DOES NOT FIT (nothing fits)'}"),
        ("gather degree N*", f"{r['gather_degree_continuous']:.1f}  (sqrt(BL n / F), App. A.2.2)"),
        ("ws2d beats ws1d", f"above {r['ws2d_crossover_chips']:g} chips (from the A.2.1 formulas)"),
    ], title=_title(model, hw, args.chips, args.batch, "recommend"))
    alternatives = [{**a, "same_program_as": ", ".join(a["same_program_as"]) or "-"}
                    for a in r["alternatives"]]
    table = format_table(
        alternatives,
        ["ffn", "attn", "topology"] + (["experts"] if model.moe else []) + ["heads", "latency_s", "compute_s", "memory_s", "comm_s", "mfu",
         "peak_bytes_per_chip", "fits", "same_program_as"],
        headers={"latency_s": "latency", "compute_s": "compute", "memory_s": "memory",
                 "comm_s": "comm", "mfu": "MFU", "peak_bytes_per_chip": "peak/chip"},
        formats={"latency_s": human_seconds, "compute_s": human_seconds, "memory_s": human_seconds,
                 "comm_s": human_seconds, "mfu": percent, "peak_bytes_per_chip": human_bytes},
        title=f"alternatives, best per layout ({r['candidates']} valid candidates, "
              f"{len(r['rejected'])} rejected)")
    rejected = format_table(
        [{**x, "topology": "x".join(map(str, x["topology"]))} for x in r["rejected"]],
        ["ffn", "attn", "topology", "kind", "reason"],
        title="rejected layouts") if r["rejected"] else "rejected layouts: none"
    return f"{head}\n\n{table}\n\n{rejected}"
