"""The paper's analytical cost model (Pope et al. 2022, §2-§3 and Appendix A). Pure Python.

Every number here is *analytical*: a prediction from peak hardware numbers, never a
measurement. Communication comes from `workloads.layouts` (the collectives of each layout
as data, shared with the engine), so the model and the engine cannot drift apart.

Per phase (prefill over B x L_input tokens, or one decode step over B tokens):
  compute_s = model FLOPs / (n * peak_flops)                                  (§2, docs/architecture.md)
              x (1 + hw.matmul_half_rows / rows) per matmul: a chip's matmul of `rows` rows
              runs at peak x rows / (rows + half_rows) (`matmul_rows`; 0 = always at peak)
              + weight-matmul FLOPs x hw.matmul_half_dim / (the weight tile's narrower side,
              `weight_tile_dim`) / (n * peak_flops)   (0 = the paper's model)
              + attention FLOPs x hw.attention_half_rows / (its rows: the queries that share a
              KV head) / (n * peak_flops)   (ATTENTION_HALF_ROWS; 0 = the paper's model)
  memory_s  = (weights read + KV cache read) per chip / hbm_bandwidth          (§2.1)
  comm_s    = sum over collectives of bytes * factor / ici_bandwidth           (§3.1)
              factor 2 for an all-reduce (= reduce-scatter + all-gather), 1 otherwise;
              like the paper we drop the ring's (K-1)/K; plus hw.collective_latency_s per op;
              on a measured host profile that carries a measured multi-group gather price,
              a weight all-gather of more than one group x that price (`multigroup_gather_scale`)
  latency_s = (1 - overlap) * (compute + memory + comm bytes) + overlap * max(...)
              + collective start-up latencies (per op; + hw.collective_latency_s_per_device
                * (group size - 1) + hw.collective_rendezvous_s * g * (g - 1) per op of
                group size g): in comm_s, but outside the overlap
              + hw.op_overhead_s * n_layers + hw.launch_overhead_s
  (overlap, the latencies and overheads default to 0: the paper's additive model;
  sweeper/analysis/calibrate.py fits them to measurements without changing this structure.)

Conventions that are choices, stated once:
- KV cache is bf16 unless a trial or plan says int8 or fp8 (`kv_vector_bytes`). Activations
  are bf16.
- int8 weights: 1 byte per element plus one bf16 scale per output channel (per-output-channel
  symmetric quantisation, as in quant.py); embeddings stay bf16 (a lookup table and the
  unembedding are small next to the blocks, and the paper quantises the matmul weights).
- Model FLOPs count every matmul parameter including the unembedding for every token
  (docs/architecture.md "Metrics"), and attention as 4 * n_layers * n_heads * d_head * keys_attended with
  keys_attended = the full context (no causal halving: PaLM's MFU convention, and what a
  dense masked attention computes).
- Weight-gathered layouts read the *gathered* weights (size / M per chip) from HBM.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass, field
from typing import Any

from workloads.config import ConfigError, HardwareProfile, ModelConfig, check_context
from workloads.hostmodel import HostModel
from workloads.layouts import (ATTN_LAYOUTS, FFN_LAYOUTS, KV_FORMATS, PHASES, WEIGHT_FORMATS,
                               Collective, PhaseLayout, axis_sizes, canonical_layout,
                               forward_collectives,
                               expert_capacity, is_expert, kv_heads_per_chip, kv_heads_sharded,
                               role_axes, split_axes, stored_weights, stores_1d, validate_layouts,
                               validate_phase)
from workloads.validate import number, one_of, positive_int

BF16 = 2                      # bytes per bf16 element (activations, KV cache, scales)
SOURCE = "analytical"


# --------------------------------------------------------------------------- input checks


def check_topology(topology, chips: int) -> tuple[int, int, int]:
    dims = tuple(int(t) for t in topology)
    if len(dims) != 3 or min(dims) <= 0 or math.prod(dims) != chips:
        x = "x".join(str(t) for t in topology)
        raise ConfigError("topology", x, f"three positive integers XxYxZ with X*Y*Z equal to chips={chips}")
    return dims  # type: ignore[return-value]


# --------------------------------------------------------------------------- parameters


def param_breakdown(model: ModelConfig, active: bool = False) -> dict[str, int]:
    """Matmul parameters by group (paper §2 notation: E, F, H heads, K KV heads, D head dim).

    A mixture-of-experts layer's `mlp` is every expert's (`active`: the experts_per_token a
    token runs through), and its router (E x experts) is its own group."""
    e, f, h, k, d, layers = (model.d_model, model.d_ff, model.n_heads, model.n_kv_heads,
                             model.d_head, model.n_layers)
    experts = model.active_experts if active else model.experts
    per_layer = {"W_q": e * h * d, "W_kv": 2 * e * k * d, "W_o": h * d * e,
                 "mlp": experts * model.mlp_matrices * e * f}
    if model.moe:
        per_layer["router"] = e * model.n_experts
    blocks = layers * sum(per_layer.values())
    embedding = model.vocab * e
    return {**{f"{name}_per_layer": v for name, v in per_layer.items()},
            "per_layer": sum(per_layer.values()), "blocks": blocks,
            "embedding": embedding, "unembedding": 0 if model.tie_embeddings else embedding}


def block_params(model: ModelConfig, active: bool = False) -> int:
    """Parameters of the Transformer blocks only (no embeddings; norms are not matmuls)."""
    return param_breakdown(model, active)["blocks"]


def param_count(model: ModelConfig, active: bool = False) -> int:
    """All matmul parameters including embeddings; tied input/output embeddings count once.
    `active`: a mixture-of-experts model's parameters one token runs through."""
    parts = param_breakdown(model, active)
    return parts["blocks"] + parts["embedding"] + parts["unembedding"]


def matmul_params(model: ModelConfig) -> int:
    """Parameters that take part in a matmul for every token: blocks + the unembedding.

    The unembedding is a V x E matmul whether or not it shares storage with the input
    embedding, whose lookup is not a matmul (docs/architecture.md "Metrics"). A
    mixture-of-experts model counts the experts a token is routed to (its active ones)."""
    return block_params(model, active=True) + model.vocab * model.d_model


def model_flops_per_token(model: ModelConfig, keys_attended: float) -> float:
    """docs/architecture.md "Metrics": 2 * matmul params (incl. unembedding) + 4 * n_layers * n_heads * d_head * keys."""
    return 2.0 * matmul_params(model) + 4.0 * model.n_layers * model.n_heads * model.d_head * keys_attended


def phase_model_flops(model: ModelConfig, batch: int, phase: str, input_len: int,
                      context: int | None = None) -> float:
    """Model FLOPs of one forward pass: prefill over batch*input_len tokens, or one decode step.

    keys_attended = context (default input_len): every query can see the whole context."""
    context = input_len if context is None else context
    tokens = batch * (input_len if phase == "prefill" else 1)
    return tokens * model_flops_per_token(model, context)


# --------------------------------------------------------------------------- weights


def weight_bytes_per_chip(model: ModelConfig, chips: int, weights: str = "bf16",
                          topology: tuple[int, int, int] | None = None, one_d: bool = False,
                          embeddings: bool = True, experts: str = "tp",
                          matrices: str = "all") -> float:
    """Stored weight bytes per chip.

    topology=None: the even split the references count with (every matrix / chips; the GQA
    chapter's "weights split as finely as you like"). With a topology: the stored layout,
    where W_k/W_v are replicated over y*z when the KV heads do not split over all chips.
    `one_d`: both phases ws1d, weights stored E F_xyz (the 2D layout with X = 1).
    int8: 1 byte per element + bf16 per-output-channel scales; embeddings stay bf16.
    A mixture-of-experts model stores each MLP matrix once per expert, split like the dense
    one (`experts` tp) or the experts split over all chips (ep), and a replicated bf16
    router. `matrices`: "all", "experts" (the MLP matrices alone) or "rest"."""
    positive_int("chips", chips)
    one_of("weights", weights, WEIGHT_FORMATS)
    if topology is not None:
        sizes = axis_sizes(check_topology(topology, chips))
        kv_split = kv_heads_sharded(model, chips)
    else:   # even split: the 1D layout on 1 x n x 1, K/V split too
        sizes, one_d, kv_split = axis_sizes((1, chips, 1)), True, True

    def split(role: str) -> int:
        return math.prod(sizes[a] for a in role_axes(role, one_d, kv_split))

    total = 0.0
    for w in stored_weights(model):   # layouts.STORED_WEIGHTS: the engine's table too
        expert = is_expert(model, w.name)
        if (matrices == "experts" and not expert) or (matrices == "rest" and expert):
            continue
        n_in, n_out = w.shape(model)
        copies = w.stacked * (model.n_experts if expert else 1)
        if expert and experts == "ep" and topology is not None:   # whole experts over all chips
            copies, rows, cols = copies / chips, 1, 1
        else:
            rows, cols = split(w.row_role), split(w.col_role)
        total += copies * n_in * n_out / (rows * cols) * weight_element_bytes(weights)
        if weights in SCALED_WEIGHTS:   # scales follow the outputs (per expert too)
            total += copies * (n_out / cols) * BF16
    if model.moe and matrices != "experts":
        total += model.d_model * model.n_experts * BF16      # the router, replicated
    total *= model.n_layers
    if embeddings and matrices != "experts":
        tables = 1 if model.tie_embeddings else 2
        total += tables * model.vocab * model.d_model * BF16 / chips   # stored V_xyz E
    return total


SCALED_WEIGHTS = ("int8", "fp8")  # per-output-channel scales beside 8-bit elements (quant.py)


def weight_element_bytes(weights: str) -> int:
    """Bytes per stored weight element: bf16 2, int8 and fp8 1."""
    return 1 if weights in SCALED_WEIGHTS else BF16


def kv_vector_bytes(kv_cache: str, d_head: int) -> int:
    """Bytes of one head's K (or V) vector of D values in a KV cache of this format
    (workloads/quant.py): bf16 2D, fp8 D, int8 D + a 2-byte scale."""
    one_of("kv_cache", kv_cache, KV_FORMATS)
    return {"bf16": BF16 * d_head, "fp8": d_head, "int8": d_head + BF16}[kv_cache]


def _gathered_weight_read_bytes(model: ModelConfig, chips: int, weights: str, m_rest: int,
                                matrices: str = "all") -> float:
    """HBM bytes one chip reads per forward pass in a weight-gathered layout: every matrix
    after the all-gather is size / M (M = chips the weights stay split over); a
    mixture-of-experts model's experts too (tp: every expert's F / M; ep: X / M whole
    experts), its router replicated. `matrices` as weight_bytes_per_chip's."""
    wbytes = weight_element_bytes(weights)
    per_layer = 0.0
    for w in stored_weights(model):
        expert = is_expert(model, w.name)
        if (matrices == "experts" and not expert) or (matrices == "rest" and expert):
            continue
        per_layer += w.stacked * math.prod(w.shape(model)) * (model.n_experts if expert else 1)
    blocks = model.n_layers * per_layer * wbytes / m_rest
    if matrices == "experts":
        return blocks
    router = model.n_layers * model.d_model * model.n_experts * BF16
    return blocks + router + model.vocab * model.d_model * BF16 / chips   # unembedding stays V_xyz


# --------------------------------------------------------------------------- KV cache


def kv_bytes_per_token(model: ModelConfig, dtype_bytes: int = BF16,
                       kv_cache: str | None = None) -> int:
    """Whole-model KV cache per token: 2 (K and V) * n_layers * K heads * d_head * bytes
    (`kv_cache`: a cache format's bytes per head vector, `kv_vector_bytes`, instead)."""
    if kv_cache is not None:
        return 2 * model.n_layers * model.n_kv_heads * kv_vector_bytes(kv_cache, model.d_head)
    return 2 * model.n_layers * model.n_kv_heads * model.d_head * dtype_bytes


def kv_placement(model: ModelConfig, chips: int, batch: int, attn: str = "head",
                 topology: tuple[int, int, int] | None = None, ffn: str = "ws2d") -> dict:
    """How the KV cache is spread: (sequence, KV head) pairs per chip and the replication.

    head:  heads split over the R axes of the FFN layout (all chips for ws1d/ws2d), batch
           over the gathered axes G; a chip holds max(K / M, 1) KV heads, so when K < M the
           heads are replicated M / K times (paper Fig. 4b; GQA chapter's ceiling at TP > K).
    batch: (sequence, KV head) pairs split over all chips, no replication (paper Fig. 4c)."""
    positive_int("chips", chips)
    positive_int("batch", batch)
    one_of("attn", attn, ATTN_LAYOUTS)
    one_of("ffn", ffn, FFN_LAYOUTS)
    if attn == "batch":
        pairs = math.ceil(batch * model.n_kv_heads / chips)
        return {"kv_heads_per_chip": min(model.n_kv_heads, pairs), "sequences_per_chip": batch / chips,
                "pairs_per_chip": pairs, "replication": 1.0}
    if topology is None:
        topology = (1, chips, 1) if ffn in ("ws1d", "ws2d") else best_topology(model, chips)
    topology = check_topology(topology, chips)
    _, _, n_gather, m_rest = split_axes(ffn, topology)
    heads = kv_heads_per_chip(model, m_rest)
    seqs = math.ceil(batch / n_gather)
    replication = heads * m_rest / model.n_kv_heads
    return {"kv_heads_per_chip": heads, "sequences_per_chip": seqs, "pairs_per_chip": heads * seqs,
            "replication": replication}


def kv_bytes_per_chip(model: ModelConfig, chips: int, batch: int, context: int, attn: str = "head",
                      topology: tuple[int, int, int] | None = None, ffn: str = "ws2d",
                      kv_cache: str = "bf16") -> float:
    """KV-cache bytes per chip for `batch` sequences of `context` tokens (`kv_cache` format)."""
    place = kv_placement(model, chips, batch, attn, topology, ffn)
    per_pair_token = 2 * model.n_layers * kv_vector_bytes(kv_cache, model.d_head)
    return float(place["pairs_per_chip"] * per_pair_token * context)


@dataclass(frozen=True)
class MaxContext:
    """The longest context that fits, and the per-chip KV accounting behind it (`analytical`):
    the KV budget's, or the model's context window where that is shorter (`limited_by`)."""
    max_context: int
    limited_by: str                 # "memory" or "context window"
    context_window: int | None      # the model's (ModelConfig.max_context); None: not stated
    kv_bytes_per_token_per_chip: float
    kv_budget_bytes_per_chip: float
    kv_fraction: float
    kv_heads_per_chip: float
    sequences_per_chip: float
    kv_replication: float
    weight_bytes_per_chip: float
    attention_kind: str
    source: str = SOURCE

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def max_context(model: ModelConfig, hw: HardwareProfile, chips: int, batch: int, attn: str = "head",
                kv_fraction: float = 0.3, topology: tuple[int, int, int] | None = None,
                ffn: str = "ws2d", kv_cache: str = "bf16") -> MaxContext:
    """Longest context whose KV cache fits in kv_fraction of each chip's HBM (paper §4.2, Table 1),
    and beside the weights within the usable HBM (HBM less the hardware's memory_reserve,
    docs/models.md), whichever is less.

    Table 1 reserves 30% of 32 GiB per chip for the KV cache on 64 TPU v4 chips."""
    number("kv_fraction", kv_fraction, positive=True, maximum=1)
    positive_int("chips", chips)
    positive_int("batch", batch)
    if attn == "batch" and batch % chips:
        raise ConfigError("batch", batch, f"a multiple of chips={chips} (batch-sharded attention "
                          "splits the KV cache over all chips)")
    place = kv_placement(model, chips, batch, attn, topology, ffn)
    per_token = kv_bytes_per_chip(model, chips, batch, 1, attn, topology, ffn, kv_cache)
    weights = weight_bytes_per_chip(model, chips)
    budget = max(min(kv_fraction * hw.hbm_bytes, hw.usable_hbm_bytes - weights), 0.0)
    fitting = int(budget // per_token)
    window = model.unpadded.max_context
    return MaxContext(
        max_context=fitting if window is None else min(fitting, window),
        limited_by="memory" if window is None or fitting <= window else "context window",
        context_window=window,
        kv_bytes_per_token_per_chip=per_token,
        kv_budget_bytes_per_chip=budget,
        kv_fraction=kv_fraction,
        kv_heads_per_chip=place["kv_heads_per_chip"],
        sequences_per_chip=place["sequences_per_chip"],
        kv_replication=place["replication"],
        weight_bytes_per_chip=weights,
        attention_kind=model.attention_kind,
    )


# --------------------------------------------------------------------------- communication


def collective_factor(kind: str) -> float:
    """Paper §3.1: an all-reduce costs two all-gathers; the others move their size once."""
    return 2.0 if kind == "all-reduce" else 1.0


def multigroup_gather_scale(c: Collective, hw: HardwareProfile,
                            topology: tuple[int, int, int] | None) -> float:
    """On a measured (emulated-mesh) profile that carries one, its measured per-byte price of a
    weight all-gather in more than one replica group against one group's
    (`HardwareProfile.multigroup_gather_scale`: inside the engine's weight-gathered prefill
    benchmarks/collectives.py measures it on its own host, benchmarks/results/collectives.md);
    1 otherwise. A real interconnect prices a chip's bytes whatever the groups."""
    scale = hw.multigroup_gather_scale
    if (scale == 1.0 or not hw.measured or topology is None or c.kind != "all-gather"
            or not c.what.startswith("weights.")):
        return 1.0
    groups = math.prod(topology) // collective_group_size(c, topology)
    return scale if groups > 1 else 1.0


def comm_time_s(collectives: list[Collective], hw: HardwareProfile,
                topology: tuple[int, int, int] | None = None) -> float:
    """Bytes * factor / interconnect bandwidth, plus a fixed latency per collective op; a
    collective whose kind the profile measured by group size (`sweeper profile`) is priced
    from that measurement instead. On an emulated mesh a weight gather of several groups
    moves its bytes at `multigroup_gather_scale` of the cost."""
    seconds = 0.0
    for c in collectives:
        profiled = _profiled_op_s(c, hw, topology)
        if profiled is not None:
            seconds += c.count * profiled
            continue
        seconds += (c.bytes_per_chip * collective_factor(c.kind) / hw.ici_bandwidth
                    * multigroup_gather_scale(c, hw, topology))
        # per-kind fitted latency where calibrate.py set one (HardwareProfile field)
        seconds += c.count * hw.collective_latency_s_by_kind.get(c.kind, hw.collective_latency_s)
    return seconds


# XLA CPU runs bf16 collectives in f32, and `sweeper profile` times f32 tensors
# (workloads/opprofile.py), so a profiled bf16 op moves 4 bytes per element.
_PROFILED_ELEMENT_BYTES = {2: 4}


def _profiled_op_s(c: Collective, hw: HardwareProfile,
                   topology: tuple[int, int, int] | None) -> float | None:
    """One op of `c` as `sweeper profile` measured it: latency + bytes / bandwidth for its
    kind and group size (no all-reduce factor: the profile timed all-reduce itself); None
    when the profile has no such measurement."""
    latency = hw.collective_latency_s_by_group.get(c.kind)
    bandwidth = hw.collective_bandwidth_by_group.get(c.kind)
    if topology is None or not latency or not bandwidth:
        return None
    g = collective_group_size(c, topology)
    # a group size the profile did not time (e.g. g = 1 or a mesh wider than the profiled
    # one): the nearest one it did, the best measured stand-in for the same kind
    nearest = lambda sizes: min(sizes, key=lambda k: (abs(k - g), k))  # noqa: E731
    op_bytes = c.elements * _PROFILED_ELEMENT_BYTES.get(c.dtype_bytes, c.dtype_bytes)
    return latency[nearest(latency)] + op_bytes / bandwidth[nearest(bandwidth)]


def collective_fixed_s(collectives: list[Collective], hw: HardwareProfile,
                       topology: tuple[int, int, int] | None = None) -> float:
    """The fixed part of comm_time_s + group_latency_s: each op's start-up latency (per kind,
    and per device of its group). It waits for the op that produces the collective's input,
    so it cannot hide behind that op's memory reads: `predict_phase` charges it outside the
    overlap (issue 20: hiding it let a fit erase int8's decode advantage)."""
    seconds = 0.0
    for c in collectives:
        if _profiled_op_s(c, hw, topology) is None:
            seconds += c.count * hw.collective_latency_s_by_kind.get(c.kind, hw.collective_latency_s)
    if topology is not None:
        seconds += group_latency_s(collectives, topology, hw)
    return seconds


def collective_group_size(c: Collective, topology: tuple[int, int, int]) -> int:
    """Devices taking part in one op of `c`: the product of its axes' sizes."""
    sizes = dict(zip(("x", "y", "z"), topology))
    return math.prod(sizes[a] for a in c.axes)


def group_latency_s(collectives: list[Collective], topology: tuple[int, int, int],
                    hw: HardwareProfile) -> float:
    """Latency that grows with the group: a ring passes each op through g - 1 hops, and an
    emulated mesh meets g device threads at a rendezvous (fitted, issue 10); where those g
    threads share cores, each waits through the other g - 1 threads' turns, a cost that
    grows as g x (g - 1) (`collective_rendezvous_s`, issue 20; 0 = the paper's model)."""
    if not (hw.collective_latency_s_per_device or hw.collective_rendezvous_s):
        return 0.0
    sizes = [(c.count, collective_group_size(c, topology)) for c in collectives]
    return (sum(n * (g - 1) for n, g in sizes) * hw.collective_latency_s_per_device
            + sum(n * g * (g - 1) for n, g in sizes) * hw.collective_rendezvous_s)


def comm_bytes(collectives: list[Collective], what: tuple[str, ...] | None = None) -> int:
    """Bytes per chip of the collectives (optionally only those whose `what` starts with one of `what`)."""
    return sum(c.bytes_per_chip for c in collectives if what is None or c.what.startswith(what))


# --------------------------------------------------------------------------- torus split (A.2.1)


@functools.lru_cache(maxsize=None)
def factorizations(chips: int) -> tuple[tuple[int, int, int], ...]:
    """Every ordered (X, Y, Z) with X*Y*Z = chips (axes play different roles)."""
    out = []
    for x in range(1, chips + 1):
        if chips % x:
            continue
        for y in range(1, chips // x + 1):
            if (chips // x) % y == 0:
                out.append((x, y, chips // x // y))
    return tuple(out)


def _ws2d_ops(model: ModelConfig) -> tuple[int, int]:
    """Collectives of one ws2d layer on the E side (over y,z) and the F side (over x).

    E side: AG + RS of BLE/X per block (twice for a serial block). F side: one RS of BLF/YZ per
    up-projection (2 for SwiGLU) and one AG of BLF/YZ before W_out (layouts.py). For the
    paper's parallel GELU block this is (2, 2), i.e. 2BL(E/X + F/YZ) of Appendix A.2.1."""
    blocks = 2 if model.block == "serial" else 1
    return 2 * blocks, model.mlp_matrices


def ws2d_comm_per_token(model: ModelConfig, x: int, yz: int) -> float:
    """Appendix A.2.1 FFN activation elements per chip per token: e_ops*E/X + f_ops*F/YZ."""
    e_ops, f_ops = _ws2d_ops(model)
    return e_ops * model.d_model / x + f_ops * model.d_ff / yz


def ws2d_optimal_x(model: ModelConfig, chips: int) -> float:
    """Continuous optimum of A.2.1: X = sqrt(e_ops E n / (f_ops F)) (= sqrt(E n / F) for GELU)."""
    e_ops, f_ops = _ws2d_ops(model)
    return math.sqrt(e_ops * model.d_model * chips / (f_ops * model.d_ff))


def ws2d_crossover_chips(model: ModelConfig) -> float:
    """Chip count above which ws2d (at its optimal X) moves less than ws1d.

    From the formulas: ws1d moves e_ops*E per token, ws2d 2*sqrt(e_ops f_ops E F / n), so
    ws2d wins when n > 4 f_ops F / (e_ops E) = 4 F/E for the paper's GELU block. The summary
    states the rule as sqrt(n) > F/E; both give n > 16 at F = 4E but they differ for other
    ratios (F = 2E: 8 chips by the formulas, 4 by the stated rule); we trust the formulas."""
    e_ops, f_ops = _ws2d_ops(model)
    return 4.0 * f_ops * model.d_ff / (e_ops * model.d_model)


def _stores_cleanly(model: ModelConfig, topology: tuple[int, int, int]) -> bool:
    x, y, z = topology
    return (model.d_model % x == 0 and model.d_ff % (y * z) == 0 and model.n_heads % (y * z) == 0)


@functools.lru_cache(maxsize=None)
def best_topology(model: ModelConfig, chips: int) -> tuple[int, int, int]:
    """Best X x Y x Z for ws2d: minimise 2BL(E/X + F/YZ) over integer factorisations (App. A.2.1).

    Only splits under which the weights can be stored (E % X, F % YZ, n_heads % YZ) are
    considered when any exists. Ties, in order: the ring's exact cost with its (k-1)/k
    factors, then the smaller X, then the most balanced Y >= Z (a torus-like Y x Z)."""
    positive_int("chips", chips)
    candidates = [t for t in factorizations(chips) if t[1] >= t[2]]
    clean = [t for t in candidates if _stores_cleanly(model, t)]
    candidates = clean or candidates
    e_ops, f_ops = _ws2d_ops(model)

    def key(t):
        x, y, z = t
        yz = y * z
        exact = e_ops * model.d_model / x * (yz - 1) / yz + f_ops * model.d_ff / yz * (x - 1) / x
        return (round(ws2d_comm_per_token(model, x, yz), 9), round(exact, 9), x, y - z)

    return min(candidates, key=key)


# --------------------------------------------------------------------------- gather degree (A.2.2)


def best_gather_degree(model: ModelConfig, chips: int, batch: int, seq_len: int,
                       topology: tuple[int, int, int] | None = None, weights: str = "bf16") -> dict:
    """Appendix A.2.2: the all-gather degree N that minimises weight + activation communication.

    `continuous`: the paper's N = sqrt(BL n / F) (2 matrices of E x F, activations 2BLE/N).
    `layout` / `degree`: the best discrete choice among ws2d (N = 1), wg_x, wg_xy, wg_xyz on
    the topology (best_topology if None), by the per-layer communication bytes of
    layouts.py (all matrices, gathered int8 weights stay int8); `best_weight_gathered`: the
    best of the three wg layouts alone.

    The cost is a*N + b/N, so neighbouring degrees N1 < N2 cost the same where the continuous
    optimum is sqrt(N1 * N2). For PaLM 540B at 512 x 2048 tokens on 4x4x4, N* = 30.2 sits just
    below sqrt(16 * 64) = 32: the formulas pick xy (16) by a small margin where the summary
    argues "29 is closer to 64" for xyz (the paper's Table 2 choice); xyz wins from ~1.5M
    tokens. We trust the formulas (docs/architecture.md "The analytical cost model")."""
    positive_int("chips", chips)
    positive_int("batch", batch)
    positive_int("seq_len", seq_len)
    topology = best_topology(model, chips) if topology is None else check_topology(topology, chips)
    tokens = batch * seq_len
    per_layout = {}
    for ffn in ("ws2d", "wg_x", "wg_xy", "wg_xyz"):
        _, _, n_gather, _ = split_axes(ffn, topology)
        colls = forward_collectives(model, topology, PhaseLayout(ffn, "head"), batch, seq_len, weights)
        per_layout[ffn] = {"degree": n_gather, "comm_bytes_per_chip": comm_bytes(colls),
                           "batch_divisible": batch % n_gather == 0}
    eligible = {k: v for k, v in per_layout.items() if v["batch_divisible"]}
    def cheapest(names):
        return min(names, key=lambda k: (eligible[k]["comm_bytes_per_chip"], eligible[k]["degree"]))

    best = cheapest(eligible)
    gathered = [k for k in eligible if k.startswith("wg")]
    return {"continuous": math.sqrt(tokens * chips / model.d_ff), "tokens": tokens,
            "topology": list(topology), "layout": best, "degree": per_layout[best]["degree"],
            "best_weight_gathered": cheapest(gathered) if gathered else None,
            "layouts": per_layout}


# --------------------------------------------------------------------------- one phase


@dataclass
class PhasePrediction:
    """Analytical prediction of one phase (a prefill pass or one decode step)."""

    phase: str
    ffn: str
    attn: str
    weights: str
    chips: int
    batch: int
    tokens: int                    # tokens processed in this pass
    context: float                 # keys attended / KV length (a trial's decode uses the mean)
    topology: tuple[int, int, int]
    latency_s: float
    compute_s: float
    memory_s: float
    comm_s: float
    flops: float
    mfu: float
    cost_chip_s_per_token: float
    weight_bytes_per_chip: float   # stored
    kv_bytes_per_chip: float       # at `context`
    working_set_bytes_per_chip: float
    peak_bytes_per_chip: float     # weights + KV + working set
    memory_read_bytes_per_chip: float
    comm_bytes_per_chip: float
    fits: bool
    hbm_bytes: float
    collectives: list[Collective] = field(default_factory=list)
    source: str = SOURCE
    executed_flops: float = 0.0    # what the chips run: `flops` plus the padded heads' share
    heads: int = 0                 # query heads as run (padded)
    unpadded_heads: int = 0        # the model's own; MFU counts these (paper §4)
    padding_params: int = 0        # parameters the padded heads add (zero weights)
    experts: str = ""              # a mixture-of-experts model's: tp | ep ("" when dense)
    moe_kernel: str = ""           # padded | grouped (expert_terms)
    experts_read: float = 0.0      # expected experts per layer whose weights a chip reads
    expert_imbalance: float = 1.0  # busiest chip's routed load over the mean (ep, grouped)
    kv_cache: str = "bf16"         # the KV cache's format

    @property
    def bound(self) -> str:
        """The largest of the three terms: what limits this phase."""
        terms = {"compute": self.compute_s, "memory": self.memory_s, "communication": self.comm_s}
        return max(terms, key=terms.get)

    def to_dict(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "collectives"}
        out["topology"] = list(self.topology)
        out["bound"] = self.bound
        out["collectives"] = [{"what": c.what, "kind": c.kind, "axes": "".join(c.axes),
                               "count": c.count, "bytes_per_chip": c.bytes_per_chip}
                              for c in self.collectives]
        return out


def working_set_bytes(model: ModelConfig, topology: tuple[int, int, int], layout: PhaseLayout,
                      batch: int, seq_len: int, weights: str = "bf16", experts: str = "tp",
                      moe_kernel: str = "grouped") -> float:
    """Rough per-chip working set of one layer beyond weights and KV cache (an estimate).

    Residual stream in and out, the MLP's up-projections, Q/K/V/out, and in weight-gathered
    layouts the largest gathered matrix (dequantised to bf16); int8 weight-stationary
    layouts hold one dequantised matrix. Attention scores are assumed computed in chunks
    (not materialised whole). Calibration compares this with the compiled program's peak.
    A mixture-of-experts MLP holds its experts' activations and dispatch buffers instead
    (`expert_terms`)."""
    x, y, z = topology
    n = x * y * z
    _, _, n_gather, m_rest = split_axes(layout.ffn, topology)
    e, f, h, d = model.d_model, model.d_ff, model.n_heads, model.d_head
    if layout.ffn == "ws1d":
        t_loc, e_loc, f_loc, h_loc = batch * seq_len, e, f / n, h / n
    elif layout.ffn == "ws2d":
        t_loc, e_loc, f_loc, h_loc = batch * seq_len, e / x, f / (y * z), h / n
    else:
        t_loc, e_loc, f_loc, h_loc = math.ceil(batch / n_gather) * seq_len, e, f / m_rest, h / m_rest
    k_loc = kv_heads_per_chip(model, m_rest if layout.ffn.startswith("wg") else n)
    mlp = t_loc * (model.mlp_matrices - 1) * f_loc
    if model.moe:
        mlp = expert_terms(model, topology, layout, batch, seq_len, experts,
                           moe_kernel).working_elements(model, t_loc, e_loc, f_loc)
    elements = t_loc * (2 * e_loc + 2 * h_loc * d + 2 * k_loc * d) + mlp
    largest = max(e * f * model.experts, e * h * d)
    if layout.ffn.startswith("wg"):
        elements += largest / m_rest
    elif weights in SCALED_WEIGHTS:
        elements += largest / n
    return elements * BF16


def matmul_rows(model: ModelConfig, topology: tuple[int, int, int], layout: PhaseLayout,
                batch: int, seq_len: int) -> tuple[float, float]:
    """Rows (the M dimension) of one chip's matmuls in a pass: (weight matmuls, attention).

    Weight matmuls multiply the chip's tokens: every token in weight-stationary layouts
    (paper §3.2.1-3.2.2: the weights are split, the activations are not), the chip's
    batch share in weight-gathered ones (§3.2.3: B/N sequences). Attention multiplies the
    queries that share one K/V head on the chip (§3.3): the query heads a KV head serves,
    all of them when attention is batch-sharded, the chip's share when head-sharded; times
    the tokens of each sequence (seq_len). Multihead decode is a matrix-vector product
    (1 row), multiquery batch-sharded decode has n_heads rows."""
    _, _, n_gather, m_rest = split_axes(layout.ffn, topology)
    tokens = batch * seq_len
    weight_rows = tokens if layout.ffn in ("ws1d", "ws2d") else math.ceil(batch / n_gather) * seq_len
    group = max(model.n_heads // model.n_kv_heads, 1)       # query heads per KV head
    shards = m_rest if layout.attn == "head" else 1
    queries = min(group, max(model.n_heads // shards, 1))
    return float(weight_rows), float(seq_len * queries)


def weight_tile_dim(model: ModelConfig, topology: tuple[int, int, int], ffn: str) -> float:
    """The narrower side of a chip's weight matrix as it multiplies (E x F per layer, §3.2):
    E/X x F/YZ in ws2d, E x F/n in ws1d, the gathered E x F/M in the weight-gathered
    layouts (§3.2.3). For PaLM 540B on 4x4x4: 4608 in ws2d, 18432 in wg_xyz."""
    x, y, z = topology
    n = x * y * z
    e, f = model.d_model, model.d_ff
    if ffn == "ws2d":
        return float(min(e / x, f / (y * z)))
    if ffn == "ws1d":
        return float(min(e, f / n))
    _, _, _, m_rest = split_axes(ffn, topology)
    return float(min(e, f / m_rest))


def _row_weighted_flops(model: ModelConfig, topology: tuple[int, int, int], layout: PhaseLayout,
                        batch: int, seq_len: int, context: float) -> tuple[float, float]:
    """Executed FLOPs divided by their matmul's rows, (weight matmuls, attention): compute_s
    grows by matmul_half_rows x their sum / (chips x peak), so a matmul of `rows` rows runs
    at peak x rows / (rows + matmul_half_rows) (HardwareProfile.matmul_half_rows), and by
    attention_half_rows x the attention part alone (ATTENTION_HALF_ROWS)."""
    weight_rows, attention_rows = matmul_rows(model, topology, layout, batch, seq_len)
    tokens = batch * seq_len
    weight_flops = tokens * 2.0 * matmul_params(model)
    attention_flops = tokens * 4.0 * model.n_layers * model.n_heads * model.d_head * context
    return weight_flops / weight_rows, attention_flops / attention_rows


# Attention's own small-shape efficiency (issue 20), 0 = the paper's model: each (sequence,
# KV head) pair's attention is its own matmul of the few queries that share the KV head
# (paper §3.3; `matmul_rows`) against that pair's K/V cache, so its pass fills and drains
# once per pair, while a weight matmul's pass is shared by the chip's whole batch. A chip's
# attention of r rows runs at peak x r / (r + attention_half_rows) on top of
# matmul_half_rows (HardwareProfile.attention_half_rows).
ATTENTION_HALF_ROWS = "attention_half_rows"


def attention_half_rows(hw: HardwareProfile) -> float:
    """The profile's `attention_half_rows` (0: the paper's model)."""
    return float(hw.attention_half_rows)


# --------------------------------------------------------------------------- mixture of experts
# docs/models.md, "Mixture of experts". What an MoE layer's experts cost depends on the
# kernel that runs them:
#   padded   the engine's static shapes (workloads/partitioning.py): every expert computes
#            every token of its chip (tp) or a buffer of C = ceil(T_G / M) slots per source
#            chip (ep), dropless; every local expert's weights are read every pass;
#   grouped  a serving engine's grouped GEMM over the routed tokens (vLLM/SGLang fused MoE,
#            DeepEP dispatch): T x k rows, the busiest chip's share under ep (load
#            imbalance), and only the experts some token chose are read.
MOE_KERNELS = ("padded", "grouped")


def default_moe_kernel(hw: HardwareProfile) -> str:
    """padded on a measured host (only the engine runs there), grouped on a hardware preset
    or fitted accelerator profile (what a plan is served with)."""
    return "padded" if hw.measured else "grouped"


def experts_hit(model: ModelConfig, tokens: float) -> float:
    """Expected distinct experts `tokens` tokens choose, each picking k of X uniformly:
    X (1 - (1 - k/X)^tokens). A decode step at batch 1 reads k experts; at large batch all X."""
    x, k = model.n_experts, model.experts_per_token
    return x * (1.0 - (1.0 - k / x) ** tokens)


@functools.lru_cache(maxsize=None)
def expected_max_normal(count: int) -> float:
    """E[max of `count` independent standard normals]: the integral of x * count * phi(x) *
    Phi(x)^(count - 1) (trapezoid rule on [-8, 8]; 0 for one). 0.56 for 2, 1.03 for 4, 1.42
    for 8, 1.77 for 16."""
    if count <= 1:
        return 0.0
    step, total = 0.005, 0.0
    for i in range(int(16 / step) + 1):
        x = -8.0 + i * step
        pdf = math.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)
        cdf = 0.5 * (1.0 + math.erf(x / math.sqrt(2)))
        total += x * count * pdf * cdf ** (count - 1) * (0.5 if i in (0, int(16 / step)) else 1.0)
    return total * step


def expert_load_imbalance(model: ModelConfig, tokens: float, shards: int) -> float:
    """The busiest of M = `shards` chips' routed (token, expert) pairs over the mean, when
    `tokens` tokens each pick k distinct experts of X uniformly and every chip holds X/M: a
    chip's count is a sum of per-token hypergeometric counts, mean T k / M, variance
    T k (1/M)(1 - 1/M)(X - k)/(X - 1); the busiest is the mean plus E[max of M normals]
    standard deviations (`expected_max_normal`), at least the mean rounded up (counts are
    whole) and at most every token's min(k, X/M) pairs on one chip. 1 on one chip."""
    if shards <= 1 or tokens <= 0:
        return 1.0
    x, k = model.n_experts, model.experts_per_token
    mean = tokens * k / shards
    std = math.sqrt(tokens * k / shards * (1 - 1 / shards) * (x - k) / max(x - 1, 1))
    busiest = min(max(mean + expected_max_normal(shards) * std, math.ceil(mean)),
                  tokens * min(k, x // shards))
    return max(1.0, busiest / mean)


def destination_chips(model: ModelConfig, shards: int) -> float:
    """Expected distinct chips (of M, X/M experts each) holding a token's k experts: a token
    is sent to each such chip once (DeepEP's dispatch), M (1 - C(X - X/M, k) / C(X, k))."""
    x, k = model.n_experts, model.experts_per_token
    return shards * (1.0 - math.comb(x - x // shards, k) / math.comb(x, k))


@dataclass(frozen=True)
class ExpertTerms:
    """An MoE layer's experts in one pass of one phase (per layer; docs/models.md)."""

    experts: str            # tp | ep
    kernel: str             # padded | grouped
    tokens: int             # T = B x L of the pass
    group_tokens: int       # T_G: the tokens one R-group of chips holds (B / N x L)
    shards: int             # M: chips an R-group spreads the experts (ep) or F (tp) over
    rows: float             # expert-MLP rows the whole mesh runs (>= T x k), the busiest chip's
    hit_fraction: float     # of a chip's expert weights read per pass
    imbalance: float        # busiest chip's routed load over the mean (ep, grouped)
    slots: int              # ep: C, each expert's slots per source chip (padded)

    def extra_flops(self, model: ModelConfig) -> float:
        """FLOPs run beyond the useful T x k expert rows (padding, the busiest chip's excess)."""
        rows = self.rows - self.tokens * model.experts_per_token
        return rows * 2.0 * model.mlp_matrices * model.d_model * model.d_ff * model.n_layers

    def working_elements(self, model: ModelConfig, t_loc: float, e_loc: float, f_loc: float) -> float:
        """Elements per chip of the experts' activations (and ep's dispatch buffers)."""
        k, x = model.experts_per_token, model.n_experts
        up = (model.mlp_matrices - 1)
        if self.experts == "tp":
            rows = t_loc * (x if self.kernel == "padded" else k)
            return rows * (up * f_loc + e_loc)
        rows = x * self.slots if self.kernel == "padded" else self.slots * k * self.imbalance
        return rows * (2 * model.d_model + up * model.d_ff)


def expert_terms(model: ModelConfig, topology: tuple[int, int, int], layout: PhaseLayout,
                 batch: int, seq_len: int, experts: str = "tp",
                 kernel: str = "grouped") -> ExpertTerms:
    """The experts' rows, weight reads, imbalance and slots of one pass (module section)."""
    one_of("moe_kernel", kernel, MOE_KERNELS)
    _, _, n_gather, m_rest = split_axes(layout.ffn, topology)
    n = math.prod(topology)
    tokens = batch * seq_len
    group = math.ceil(batch / n_gather) * seq_len
    k, x = model.experts_per_token, model.n_experts
    ep = experts == "ep"
    slots = expert_capacity(group, m_rest) if ep else 0
    if kernel == "padded":
        rows = n * x * slots if ep else tokens * x
        return ExpertTerms(experts, kernel, tokens, group, m_rest, rows, 1.0, 1.0, slots)
    if not ep:    # every chip holds a shard of every expert: balanced, reads the union's
        return ExpertTerms(experts, kernel, tokens, group, m_rest, tokens * k,
                           experts_hit(model, group) / x, 1.0, slots)
    # ep: the step waits for the busiest chip, which routes `imbalance` x the mean pairs
    # (a token at most min(k, X/M) of them to one chip) and reads the distinct experts its
    # pairs hit among its X/M
    local = x // m_rest
    imbalance = expert_load_imbalance(model, group, m_rest)
    busiest = imbalance * group * k / m_rest
    return ExpertTerms(experts, kernel, tokens, group, m_rest, tokens * k * imbalance,
                       1.0 - (1.0 - 1.0 / local) ** busiest, imbalance, slots)


def grouped_collectives(model: ModelConfig, collectives: list[Collective], terms: ExpertTerms,
                        ) -> list[Collective]:
    """The layout's collectives (layouts.py: the engine's padded program) as a grouped
    kernel moves them: tp's F-side activations of the k chosen experts instead of all X;
    ep's dispatch and combine of each token once per chip holding one of its experts, the
    busiest chip's share."""
    if terms.kernel != "grouped":
        return collectives
    out = []
    for c in collectives:
        if c.what in ("ffn.in", "ffn.out"):
            c = dataclasses.replace(c, elements=round(c.elements * model.experts_per_token
                                                      / model.n_experts))
        elif c.what in ("moe.dispatch", "moe.combine"):
            # a chip sends each of its C tokens once per chip holding one of its experts and
            # the busiest receives `imbalance` x the mean: whichever is more
            per_token = destination_chips(model, terms.shards)
            tokens = max(terms.slots * per_token,
                         terms.imbalance * terms.group_tokens * per_token / terms.shards)
            c = dataclasses.replace(c, elements=round(tokens * model.d_model))
        out.append(c)
    return out


def predict_phase(model: ModelConfig, hw: HardwareProfile, chips: int, batch: int, phase: str,
                  input_len: int = 1, context: int | None = None,
                  layout: PhaseLayout = PhaseLayout(), weights: str = "bf16",
                  topology: tuple[int, int, int] | None = None, one_d: bool | None = None,
                  validate: bool = True, experts: str = "tp",
                  moe_kernel: str | None = None, kv_cache: str = "bf16") -> PhasePrediction:
    """Analytical latency of one phase: prefill of batch x input_len tokens, or one decode step.

    context: keys attended and the KV cache read (default input_len). A prefill on top of a
    history (paper Table 2: 64 new tokens after 1920) passes input_len=64, context=1984.
    A mixture-of-experts model: `experts` (tp | ep, layouts.py) and `moe_kernel` (padded:
    the engine's program; grouped: a serving engine's; `expert_terms`; None: the engine's
    on a measured host, a serving engine's on a hardware preset, `default_moe_kernel`).
    Precision (docs/models.md): `weights` fp8 on hardware with FP8 units (hw.fp8_flops) runs
    the weight matmuls at that rate (W8A8); `kv_cache` bf16, int8 or fp8 sets the bytes of
    the KV cache held and read."""
    moe_kernel = default_moe_kernel(hw) if moe_kernel is None else moe_kernel
    one_of("kv_cache", kv_cache, KV_FORMATS)
    positive_int("chips", chips)
    positive_int("batch", batch)
    positive_int("input_len", input_len)
    one_of("phase", phase, PHASES)
    one_of("weights", weights, WEIGHT_FORMATS)
    one_of("ffn", layout.ffn, FFN_LAYOUTS)
    one_of("attn", layout.attn, ATTN_LAYOUTS)
    if context is not None:
        number("context", context, positive=True)   # (kept as given: an int stays an int)
    context = input_len if context is None else context
    topology = best_topology(model, chips) if topology is None else check_topology(topology, chips)
    layout = canonical_layout(layout, topology)   # a gather over size-1 axes is weight-stationary
    one_d = (layout.ffn == "ws1d") if one_d is None else one_d
    if validate:   # this phase's constraints first (so the message names it), then storage
        check_context(model, context, "context")
        validate_phase(model, topology, layout, batch, phase, experts=experts)
        validate_layouts(model, topology, layout, layout, batch, experts=experts)
    seq_len = input_len if phase == "prefill" else 1
    tokens = batch * seq_len
    moe = expert_terms(model, topology, layout, batch, seq_len, experts, moe_kernel) \
        if model.moe else None

    # Paper §4: padded heads cost compute time but not MFU, which counts the unpadded
    # model's FLOPs (`flops`); the chips execute `executed_flops` (with an MoE model's
    # padded or imbalanced expert rows too).
    flops = tokens * model_flops_per_token(model.unpadded, context)
    executed_flops = tokens * model_flops_per_token(model, context)
    if moe is not None:
        executed_flops += moe.extra_flops(model)
    compute_s = executed_flops / (chips * hw.peak_flops)
    if weights == "fp8" and hw.fp8_flops:    # the weight matmuls on FP8 units (W8A8)
        compute_s -= fp8_matmul_saving_s(model, hw, chips, tokens, context, executed_flops)
    if hw.matmul_half_rows or attention_half_rows(hw):   # small per-chip matmuls run below peak
        weight_per_row, attention_per_row = _row_weighted_flops(   # (matmul_rows)
            model, topology, layout, batch, seq_len, context)
        compute_s += (hw.matmul_half_rows * (weight_per_row + attention_per_row)
                      + attention_half_rows(hw) * attention_per_row) / (chips * hw.peak_flops)
    if hw.matmul_half_dim:    # and so do narrow weight tiles (weight_tile_dim)
        compute_s += hw.matmul_half_dim * tokens * 2.0 * matmul_params(model) \
            / weight_tile_dim(model, topology, layout.ffn) / (chips * hw.peak_flops)

    stored = weight_bytes_per_chip(model, chips, weights, topology, one_d, experts=experts)
    weights_read = _weights_read_bytes(model, chips, weights, topology, one_d, layout, experts, moe)
    kv = kv_bytes_per_chip(model, chips, batch, context, layout.attn, topology, layout.ffn,
                           kv_cache)
    memory_read = weights_read + kv     # prefill: the KV it writes; decode: the cache it reads
    memory_s = memory_read / hw.hbm_bandwidth

    collectives = forward_collectives(model, topology, layout, batch, seq_len, weights, experts)
    if moe is not None:
        collectives = grouped_collectives(model, collectives, moe)
    comm_s = comm_time_s(collectives, hw, topology) + group_latency_s(collectives, topology, hw)

    # Bytes stream and overlap (compute, HBM reads, interconnect); each collective's fixed
    # start-up latency does not (collective_fixed_s) and adds, like the per-layer overheads.
    fixed_s = collective_fixed_s(collectives, hw, topology)
    terms = (compute_s, memory_s, comm_s - fixed_s)
    latency_s = ((1 - hw.overlap) * sum(terms) + hw.overlap * max(terms) + fixed_s
                 + hw.op_overhead_s * model.n_layers
                 # each layer's ops dispatched once per device, whatever the device's share
                 # of the host (issue 20: the 8-chip bias on the emulated mesh)
                 + hw.device_overhead_s * model.n_layers * chips
                 # one program per phase call: dispatch and the host sync, whatever its size
                 + hw.launch_overhead_s)
    if hw.host_model:   # a calibrated host: its own measured costs (workloads/hostmodel.py)
        host = HostModel.from_dict(hw.host_model)
        share = hw.host_share * chips
        call = PhaseCall(model, chips, batch, phase, input_len, context, layout, weights,
                         tuple(topology), one_d, experts, moe_kernel, kv_cache)
        latency_s = sum(host_term_seconds(host, call, share).values())
    working = working_set_bytes(model, topology, layout, batch, seq_len, weights, experts,
                                moe_kernel)
    peak = stored + kv + working
    return PhasePrediction(
        phase=phase, ffn=layout.ffn, attn=layout.attn, weights=weights, chips=chips, batch=batch,
        tokens=tokens, context=context, topology=tuple(topology), latency_s=latency_s,
        compute_s=compute_s, memory_s=memory_s, comm_s=comm_s, flops=flops,
        mfu=flops / (chips * hw.peak_flops * latency_s),
        cost_chip_s_per_token=chips * latency_s / tokens,
        weight_bytes_per_chip=stored, kv_bytes_per_chip=kv, working_set_bytes_per_chip=working,
        peak_bytes_per_chip=peak, memory_read_bytes_per_chip=memory_read,
        comm_bytes_per_chip=float(comm_bytes(collectives)), fits=peak <= hw.usable_hbm_bytes,
        hbm_bytes=hw.hbm_bytes, collectives=collectives, executed_flops=executed_flops,
        heads=model.n_heads, unpadded_heads=model.unpadded.n_heads,
        padding_params=param_count(model) - param_count(model.unpadded),
        experts=experts if model.moe else "", moe_kernel=moe_kernel if model.moe else "",
        experts_read=(moe.hit_fraction * model.n_experts / (moe.shards if experts == "ep" else 1)
                      if moe else 0.0),   # of the chip's own (ep: X/M; tp: shards of all X)
        expert_imbalance=(moe.imbalance if moe else 1.0), kv_cache=kv_cache)


def fp8_matmul_saving_s(model: ModelConfig, hw: HardwareProfile, chips: int, tokens: int,
                        context: float, executed_flops: float) -> float:
    """Seconds an FP8 model saves on FP8 units (hw.fp8_flops): its weight matmuls (every
    executed FLOP but attention's, which reads the KV cache in bf16) run at the FP8 rate
    instead of the bf16 one."""
    attention = tokens * 4.0 * model.n_layers * model.n_heads * model.d_head * context
    weight_flops = max(executed_flops - attention, 0.0)
    return weight_flops / chips * (1.0 / hw.peak_flops - 1.0 / hw.fp8_flops)


def _weights_read_bytes(model: ModelConfig, chips: int, weights: str,
                        topology: tuple[int, int, int], one_d: bool, layout: PhaseLayout,
                        experts: str, moe: "ExpertTerms | None") -> float:
    """HBM bytes of weights one chip reads per pass: the blocks (as stored, or as gathered
    in a weight-gathered layout, size / M) and the unembedding; the input embedding is a
    lookup of B*L rows. A mixture-of-experts model reads the experts some token chose
    (grouped kernel; all of them when padded)."""
    _, _, _, m_rest = split_axes(layout.ffn, topology)

    def part(matrices: str) -> float:
        if layout.ffn.startswith("wg"):
            return _gathered_weight_read_bytes(model, chips, weights, m_rest, matrices)
        rest = 0.0 if matrices == "experts" else model.vocab * model.d_model * BF16 / chips
        return rest + weight_bytes_per_chip(model, chips, weights, topology, one_d,
                                            embeddings=False, experts=experts, matrices=matrices)

    if moe is None:
        return part("all")
    return part("rest") + moe.hit_fraction * part("experts")


# --------------------------------------------------------------------------- a calibrated host

_HOST_UNIT = HardwareProfile("unit", 1.0, 1.0, 1e30, 1.0)
# glibc's largest dynamic mmap threshold on 64-bit hosts (DEFAULT_MMAP_THRESHOLD_MAX, 4 Mi x
# sizeof(long); mallopt(3)): XLA CPU allocates a program's temp buffer at every call, and
# malloc serves one larger than this with a fresh mmap, whose pages fault (and are zeroed)
# again each call; a smaller one is reused from the heap (docs/host-calibration.md).
MMAP_THRESHOLD_BYTES = 32 * 2**20


def host_temp_bytes(call: "PhaseCall") -> float:
    """The bytes of one device's temp buffer the host model prices: XLA hoists every weight's
    dequantisation and all-gather to the program's start, so the buffer holds a bf16 copy of
    each local (or gathered) weight matrix at once: 2 bytes per element of 8-bit weights,
    2 x 2 per gathered bf16 element (the gathered matrix and its relaid copy); none for
    weight-stationary bf16, which the matmuls read in place."""
    layout = canonical_layout(call.layout, call.topology)
    _, _, _, m_rest = split_axes(layout.ffn, call.topology)
    gathered = layout.ffn.startswith("wg")
    local = block_params(call.model) / (m_rest if gathered else call.chips)
    if call.weights in SCALED_WEIGHTS:
        return 2.0 * local
    return 4.0 * local if gathered else 0.0


def host_term_seconds(host: HostModel, call: "PhaseCall", share: float) -> dict[str, float]:
    """{term: seconds} of one call on a calibrated host (`host_counts` at the cache and
    overlap of a worker with `share` of it, times `HostModel.term_seconds`)."""
    counts = host_counts(call, host.cache_for(share, call.chips), host.overlap_rows)
    return host.term_seconds(counts, call.phase, share, call.chips)


def host_counts(call: "PhaseCall", cache_bytes: float = 0.0,
                overlap_rows: float = 0.0) -> dict[str, float]:
    """The counts of the host cost model's terms (workloads/hostmodel.py TERMS) for one call,
    summed over its devices. `cache_bytes`: the last-level cache the trial's devices share
    (0: no cache term). `overlap_rows`: the weight rows at which a matmul's FLOPs take as
    long as streaming its weights from DRAM (`HostModel.overlap_rows`; 0: no overlap).

    A mixture-of-experts call counts what the engine's padded program runs (expert_terms):
    its executed expert rows as matmul FLOPs, every local expert's weights streamed once per
    pass, its dispatch and combine all-to-alls as exchange bytes; 8-bit weights (int8, and
    FP8, which XLA CPU emulates) and an 8-bit KV cache as the elements turned back into bf16
    each call (docs/models.md)."""
    p = predict_phase(hw=_HOST_UNIT, **call.arguments())
    model, topology, n = call.model, call.topology, call.chips
    layout = canonical_layout(call.layout, topology)
    seq = call.input_len if call.phase == "prefill" else 1
    tokens = call.batch * seq
    weight_rows, attention_rows = matmul_rows(model, topology, layout, call.batch, seq)
    attention_flops = tokens * 4.0 * model.n_layers * model.n_heads * model.d_head * call.context
    # all chips together; executed: an MoE trial's padded expert rows too. A prefill call
    # unembeds its last position only (workloads/engine.py), not every token the model
    # FLOPs (`executed_flops`, docs/architecture.md "Metrics") count
    unembedded = tokens - call.batch
    weight_flops = max(p.executed_flops - attention_flops
                       - unembedded * 2.0 * model.vocab * model.d_model, 0.0)
    _, _, _, m_rest = split_axes(layout.ffn, topology)
    gathered = layout.ffn.startswith("wg")
    copies = n / m_rest if gathered else 1.0          # the weight copies the mesh multiplies with
    per_expert = model.mlp_matrices * model.d_model * model.d_ff * model.n_layers if model.moe else 0
    dense_flops = tokens * 2.0 * (matmul_params(model) - model.active_experts * per_expert)
    # each weight element is streamed once per pass of its matmul's rows; an expert's once
    # per pass over its whole buffer (every local expert when padded, those hit when grouped)
    hit = expert_terms(model, topology, layout, call.batch, seq, call.experts,
                       call.moe_kernel).hit_fraction if model.moe else 0.0
    weights_streamed = dense_flops / weight_rows / 2.0 + copies * hit * model.n_experts * per_expert
    matrices = block_params(model)           # the layers' matmul weights (all experts)
    dequant = matrices * copies if call.weights in SCALED_WEIGHTS else 0.0
    if call.kv_cache != "bf16":              # K/V read back into bf16 (workloads/kvcache.py)
        dequant += p.kv_bytes_per_chip * n
    memory = p.memory_s * n                          # bytes read per chip (bandwidth 1) x chips
    beyond = max(0.0, 1.0 - cache_bytes / memory) if cache_bytes and memory > 0 else 0.0
    temp = host_temp_bytes(call)
    # a prefill layer's elementwise ops over its prompt's activations: the d_model-wide ones
    # (norms, residual adds) on every device, the FFN's activation function once over the
    # devices' shards; a decode step's few rows ride on its per-layer dispatch instead
    ffn_width = model.d_ff * (model.active_experts if model.moe else 1)
    elementwise = (tokens * model.n_layers * (model.d_model * n + ffn_width)
                   if call.phase == "prefill" else 0.0)
    # a decode matmul of few rows waits on its weights' stream from DRAM; with overlap_rows
    # rows or more, the stream runs under the FLOPs (the cost is about their max, not sum)
    hidden = (min(weight_rows / overlap_rows, 1.0) if overlap_rows > 0 and call.phase == "decode"
              else 0.0)
    by_kind = {"all-gather": 0.0, "reduce-scatter": 0.0, "all-to-all": 0.0, "all-reduce": 0.0}
    ops = 0
    for c in p.collectives:
        by_kind[c.kind] += c.elements * c.dtype_bytes * c.count
        ops += c.count
    return {
        "launch": 1.0,
        "layer_device": float(model.n_layers * n),
        "collective_op": float(ops * n),
        # a mesh's devices hand the core to one another at every layer (docs/host-calibration.md)
        "layer_mesh": float(model.n_layers * n) if n > 1 else 0.0,
        "gather_bytes": by_kind["all-gather"] * n,
        # a weight-gathered layout's gathered weights are written, then streamed by the
        # matmuls, from DRAM once they outgrow the cache (docs/host-calibration.md)
        "dram_gather": by_kind["all-gather"] * n * beyond,
        "scatter_bytes": by_kind["reduce-scatter"] * n,
        "exchange_bytes": (by_kind["all-to-all"] + by_kind["all-reduce"]) * n,
        "matmul_flops": weight_flops,
        "matmul_weights": weights_streamed,
        "attention_flops": attention_flops,
        "attention_rows": attention_flops / attention_rows,
        "memory_bytes": memory,
        "dram_bytes": memory * beyond,
        "dram_weights": weights_streamed * beyond * (1.0 - hidden),
        "dequant": dequant,
        "dram_dequant": dequant * beyond,
        # a temp buffer past malloc's mmap threshold is faulted in afresh at every call
        "fault_bytes": temp * n if temp > MMAP_THRESHOLD_BYTES else 0.0,
        "elementwise": elementwise,
    }


# --------------------------------------------------------------------------- a whole trial


def _collective_stats(collectives: list[Collective]):
    from workloads.metrics import CollectiveStat   # plain dataclasses, no JAX

    by_kind: dict[str, Any] = {}
    for c in collectives:
        dtype = "s8" if c.dtype_bytes == 1 else "bf16"
        key = (c.kind, dtype)
        stat = by_kind.setdefault(key, CollectiveStat(c.kind, 0, 0, 0, dtype))
        stat.count += c.count
        stat.bytes_per_chip += c.bytes_per_chip
        stat.elements_per_chip += c.elements * c.count
    return list(by_kind.values())


def decode_context(trial) -> float:
    """The mean KV length over the decode steps: input_len + decode_steps / 2."""
    return trial.input_len + trial.decode_steps / 2


@dataclass(frozen=True)
class PhaseCall:
    """The arguments of one `predict_phase` call: what `predict` computes for a trial's phase,
    and what a published row (workloads/measurements.py) needs. The one place a
    configuration becomes a cost-model call, so the fit (sweeper/analysis/fit.py) predicts
    exactly what the sweep predicts."""

    model: ModelConfig
    chips: int
    batch: int
    phase: str
    input_len: int
    context: float
    layout: PhaseLayout
    weights: str
    topology: tuple[int, int, int]
    one_d: bool
    experts: str = "tp"            # a mixture-of-experts model's experts layout
    moe_kernel: str = "grouped"    # a trial's is "padded": the engine's program (expert_terms)
    kv_cache: str = "bf16"

    def arguments(self) -> dict[str, Any]:
        """predict_phase's keyword arguments (all but hw), unvalidated (the caller checked)."""
        return {**{f.name: getattr(self, f.name) for f in dataclasses.fields(self)},
                "validate": False}

    def predict(self, hw: HardwareProfile) -> "PhasePrediction":
        return predict_phase(hw=hw, **self.arguments())


def phase_calls(trial) -> dict[str, PhaseCall]:
    """The cost-model call of each phase of a TrialConfig (prefill over input_len tokens, one
    decode step at the mean KV length `decode_context`), on the model as run (padded)."""
    topology = tuple(trial.mesh_shape)
    one_d = stores_1d(trial.prefill, trial.decode)
    common = dict(model=trial.run_model, chips=trial.chips, batch=trial.batch,
                  input_len=trial.input_len, weights=trial.weights, topology=topology,
                  one_d=one_d, experts=trial.experts, moe_kernel="padded",
                  kv_cache=trial.kv_cache)
    return {"prefill": PhaseCall(phase="prefill", context=trial.input_len, layout=trial.prefill,
                                 **common),
            "decode": PhaseCall(phase="decode", context=decode_context(trial), layout=trial.decode,
                                **common)}


def predict(trial, hw: HardwareProfile):
    """A TrialConfig's analytical Measurement (source="analytical"): both phases, total, memory."""
    from workloads.metrics import Measurement

    topology = trial.mesh_shape
    model = trial.run_model            # padded per trial.pad_heads (paper §4) and pad_vocab
    validate_layouts(model, topology, trial.prefill, trial.decode, trial.batch,
                     experts=trial.experts)
    calls = phase_calls(trial)
    pre, dec = calls["prefill"].predict(hw), calls["decode"].predict(hw)
    ctx = calls["decode"].context
    kv_full = max(kv_bytes_per_chip(model, trial.chips, trial.batch, trial.context_len,
                                    layout.attn, topology, layout.ffn, trial.kv_cache)
                  for layout in (trial.prefill, trial.decode))
    peak = pre.weight_bytes_per_chip + kv_full + max(pre.working_set_bytes_per_chip,
                                                     dec.working_set_bytes_per_chip)
    m = Measurement(source=SOURCE, hardware=hw.name)
    m.prefill_s = pre.latency_s
    m.decode_step_s = dec.latency_s
    m.total_s = pre.latency_s + trial.decode_steps * dec.latency_s
    m.prefill_mfu, m.decode_mfu = pre.mfu, dec.mfu
    m.prefill_cost_chip_s_per_token = pre.cost_chip_s_per_token
    m.decode_cost_chip_s_per_token = dec.cost_chip_s_per_token
    m.prefill_tokens_per_s = pre.tokens / pre.latency_s
    m.decode_tokens_per_s = dec.tokens / dec.latency_s
    m.weight_bytes_per_chip = pre.weight_bytes_per_chip
    m.kv_bytes_per_chip = kv_full
    m.peak_bytes_per_chip = peak
    m.prefill_comm_bytes_per_chip = pre.comm_bytes_per_chip
    m.decode_comm_bytes_per_chip = dec.comm_bytes_per_chip
    m.prefill_compute_s, m.prefill_memory_s, m.prefill_comm_s = pre.compute_s, pre.memory_s, pre.comm_s
    m.decode_compute_s, m.decode_memory_s, m.decode_comm_s = dec.compute_s, dec.memory_s, dec.comm_s
    m.fits = peak <= hw.usable_hbm_bytes
    m.collectives = {"prefill": _collective_stats(pre.collectives),
                     "decode": _collective_stats(dec.collectives)}
    m.extra = {"topology": list(topology), "decode_context": ctx,
               "prefill_bound": pre.bound, "decode_bound": dec.bound,
               "prefill_flops": pre.flops, "decode_flops": dec.flops,
               "heads": model.n_heads, "padding_params": pre.padding_params}
    if model.moe:
        m.extra.update(experts=trial.experts, moe_kernel=dec.moe_kernel,
                       decode_experts_read=dec.experts_read)
    return m


def slice_predictions(trial, hw: HardwareProfile) -> dict[str, Any]:
    """A disaggregated serving trial's slices (`TrialConfig.slice_trials`: half the chips
    each, docs/space-files.md "Serving trials"), each priced as the trial its engine runs:
    {"prefill": Measurement, "decode": Measurement}. A slice's peak memory per chip counts
    the working set of the phase it runs only (a decode slice never prefills, a prefill
    slice never decodes its batch); weights and KV cache as `predict` counts them.
    ConfigError when a slice's layout cannot run on its half."""
    out = {}
    for phase, part in trial.slice_trials().items():
        m = predict(part, hw)
        working = phase_calls(part)[phase].predict(hw).working_set_bytes_per_chip
        m.peak_bytes_per_chip = m.weight_bytes_per_chip + m.kv_bytes_per_chip + working
        m.fits = m.peak_bytes_per_chip <= hw.usable_hbm_bytes
        out[phase] = m
    return out


def predict_trial(trial, hw: HardwareProfile):
    """The analytical Measurement of the program a trial runs: `predict`'s, except for a
    serving trial, whose prefill takes one prompt per call (docs/space-files.md, "Serving
    trials"): aggregated, the whole mesh's prefill of one prompt beside its decode of
    `batch` slots; disaggregated, its slices (`predict_slices`); in pipeline stages, one
    stage's (`one_stage`)."""
    if getattr(trial, "disaggregated", False):
        return predict_slices(trial, hw)
    trial = one_stage(trial)
    m = predict(trial, hw)
    if getattr(trial, "serving", None) is None or trial.batch == 1:
        return m
    # one prompt through the prefill layout (valid at batch 1: TrialConfig.validate checks it)
    one = predict(dataclasses.replace(trial, batch=1, decode=trial.prefill), hw)
    for f in dataclasses.fields(m):
        if f.name.startswith("prefill_"):
            setattr(m, f.name, getattr(one, f.name))
    m.total_s = one.prefill_s + trial.decode_steps * m.decode_step_s
    m.collectives = {**m.collectives, "prefill": one.collectives["prefill"]}
    m.extra = {**m.extra, "prefill_bound": one.extra["prefill_bound"],
               "prefill_flops": one.extra["prefill_flops"]}
    return m


def stage_layers(model: ModelConfig, stages: int) -> int:
    """Layers of the fullest pipeline stage: the pipeline runs at its pace."""
    return -(-model.n_layers // stages)


def stage_model(model: ModelConfig, stages: int) -> ModelConfig:
    """One pipeline stage as a model of its own: the fullest stage's layers, and (an
    approximation, a few per cent of a large model) the embedding and unembedding in every
    stage, where a real pipeline has them in its first and last. The model itself for one
    stage."""
    if stages == 1:
        return model
    layers = stage_layers(model, stages)
    base = model.padded_from
    return dataclasses.replace(model, n_layers=layers, padded_from=None if base is None else
                               dataclasses.replace(base, n_layers=layers))


def one_stage(trial):
    """A serving trial in pipeline stages (`TrialConfig.stages` > 1) as the trial of one
    stage: the model of its layers (`stage_model`) on its chips and
    topology; any other trial as it is."""
    stages = getattr(trial, "stages", 1)
    if stages == 1:
        return trial
    return dataclasses.replace(trial, model=stage_model(trial.model, stages),
                               chips=trial.stage_chips, topology=tuple(trial.mesh_shape), stages=1)


def predict_slices(trial, hw: HardwareProfile):
    """A disaggregated serving trial's analytical Measurement, of the slices that run
    (`slice_predictions`): each phase's numbers from the slice that runs it (prefill_*: one
    prompt on the prefill slice; decode_*: one step of `batch` slots on the decode slice),
    total_s = prefill_s + decode_steps x decode_step_s, the memory per chip of the slice
    with the larger peak (the worse slice decides), fits when both fit."""
    slices = slice_predictions(trial, hw)
    pre, dec = slices["prefill"], slices["decode"]
    m = dataclasses.replace(dec)
    for f in dataclasses.fields(m):
        if f.name.startswith("prefill_"):
            setattr(m, f.name, getattr(pre, f.name))
    m.total_s = pre.prefill_s + trial.decode_steps * dec.decode_step_s
    worse = max(slices, key=lambda phase: slices[phase].peak_bytes_per_chip)
    for name in ("weight_bytes_per_chip", "kv_bytes_per_chip", "peak_bytes_per_chip"):
        setattr(m, name, getattr(slices[worse], name))
    m.fits = pre.fits and dec.fits
    m.collectives = {"prefill": pre.collectives["prefill"], "decode": dec.collectives["decode"]}
    m.extra = {**dec.extra, "prefill_bound": pre.extra["prefill_bound"],
               "prefill_flops": pre.extra["prefill_flops"], "memory_slice": worse,
               "slices": {phase: {"chips": trial.chips // 2,
                                  "topology": part.extra["topology"],
                                  "peak_bytes_per_chip": part.peak_bytes_per_chip}
                          for phase, part in slices.items()}}
    m.extra.pop("topology", None)
    return m


def feasibility(trial, hw: HardwareProfile, memory_budget_bytes: float | None = None) -> str | None:
    """None when the trial can run; else a one-line reason (layout constraint or memory).
    A disaggregated serving trial is checked per slice, on its half of the chips (the whole
    mesh never runs): each slice's layout, and the memory of the slice with the larger
    peak per chip, named in the reason. A serving trial in pipeline stages: one stage's
    (`one_stage`)."""
    if getattr(trial, "disaggregated", False):
        return _slices_feasibility(trial, hw, memory_budget_bytes)
    trial = one_stage(trial)
    try:
        topology = trial.mesh_shape
        validate_layouts(trial.run_model, topology, trial.prefill, trial.decode, trial.batch,
                         experts=trial.experts)
    except ConfigError as err:
        return str(err)
    budget = hw.usable_hbm_bytes if memory_budget_bytes is None else memory_budget_bytes
    m = predict(trial, hw)
    if m.peak_bytes_per_chip > budget:
        working = m.peak_bytes_per_chip - m.weight_bytes_per_chip - m.kv_bytes_per_chip
        return (f"memory: weights {bytes_text(m.weight_bytes_per_chip)} + KV cache "
                f"{bytes_text(m.kv_bytes_per_chip)} + working set {bytes_text(working)} = "
                f"{bytes_text(m.peak_bytes_per_chip)} per chip exceeds the budget of {bytes_text(budget)}")
    return None


def _slices_feasibility(trial, hw: HardwareProfile, memory_budget_bytes: float | None) -> str | None:
    """`feasibility` of a disaggregated serving trial (`slice_predictions`)."""
    try:
        trial.validate()                  # each slice's layout on its half, the slice named
        slices = slice_predictions(trial, hw)
    except ConfigError as err:
        return str(err)
    budget = hw.usable_hbm_bytes if memory_budget_bytes is None else memory_budget_bytes
    phase = max(slices, key=lambda name: slices[name].peak_bytes_per_chip)
    m = slices[phase]
    if m.peak_bytes_per_chip <= budget:
        return None
    chips = trial.chips // 2
    working = m.peak_bytes_per_chip - m.weight_bytes_per_chip - m.kv_bytes_per_chip
    return (f"memory: {phase} slice ({chips} chip{'s' if chips > 1 else ''}, "
            f"topology {'x'.join(map(str, m.extra['topology']))}): weights "
            f"{bytes_text(m.weight_bytes_per_chip)} + KV cache {bytes_text(m.kv_bytes_per_chip)} "
            f"+ working set {bytes_text(working)} = {bytes_text(m.peak_bytes_per_chip)} per chip "
            f"exceeds the budget of {bytes_text(budget)}")


def bytes_text(value: float) -> str:
    for scale, unit in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if value >= scale:
            return f"{value / scale:.2f} {unit}"
    return f"{value:.0f} B"


# --------------------------------------------------------------------------- recommendation


def topology_candidates(model: ModelConfig, chips: int) -> list[tuple[int, int, int]]:
    """best_topology first (so ties keep the paper's split), then the rest in a fixed order."""
    first = best_topology(model, chips)
    return [first] + [t for t in factorizations(chips) if t != first]


def significant(value: float, digits: int = 9) -> float:
    """Round to significant digits, so float noise in a sum never decides a ranking."""
    return float(f"{value:.{digits}g}")


# --------------------------------------------------------------------------- scaling-book roofline


def decode_step_lower_bound(param_bytes: float, kv_bytes_per_token: float, context: int, batch: int,
                            chips: int, hw: HardwareProfile, param_count: float) -> float:
    """Scaling book part 7, "Theoretical Step Time (General)": the attention is always
    bandwidth-bound, the MLP takes the max of its FLOPs and its parameter load:

      step >= B * KV_bytes(context) / (n * W_hbm) + max(2 * B * P / (n * C), P_bytes / (n * W_hbm))
    """
    total_bw = chips * hw.hbm_bandwidth
    attention = batch * kv_bytes_per_token * context / total_bw
    mlp = max(2.0 * batch * param_count / (chips * hw.peak_flops), param_bytes / total_bw)
    return attention + mlp
