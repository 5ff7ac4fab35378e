"""The paper's partitioning layouts as plain data: vocabulary, shape rules, collectives.

This module is the single source of truth shared by the cost model (which turns the
collectives below into bytes and seconds) and the JAX engine (which issues exactly
these collectives inside `shard_map` and is tested against this list on the compiled
program). It imports no JAX.

Notation (paper §3.1): mesh axes x, y, z of sizes X, Y, Z, n = XYZ chips. `BLE_x` means
the E dimension of a [B, L, E] tensor is split over x. T = B*L tokens in the phase.

Every FFN layout splits the mesh axes into
  G = the axes weights are all-gathered over (and the batch is split over), and
  R = the remaining axes (E, F and heads are split over them).
  ws1d, ws2d: G = {}           wg_x: G = {x}    wg_xy: G = {x, y}    wg_xyz: G = {x, y, z}
N = |G| chips, M = |R| = n / N chips.

Stored weights (paper §3.2.3: "weights start in the same ExFyz layout as in 2D
weight-stationary, so that we can use the same weight layout for weight-gathered
(during prefill) and weight-stationary (during decoding)"):
  W_in, W_gate: E_x F_yz    W_out: F_yz E_x    W_q: E_x (H D)_yz    W_o: (H D)_yz E_x
  W_k, W_v:     E_x (K D)_yz when K is divisible by n, else E_x (K D) (replicated over yz)
  embedding:    V_xyz E     (vocab-sharded; tied embeddings reuse it for the unembedding)
A trial whose two phases both use ws1d stores the 1D layout instead (W_in: E F_xyz, ...),
which is the same thing as the 2D layout with X = 1. Mixing ws1d with another layout
therefore needs X = 1, so that switching phases moves no weights.
Order of a multi-axis split (the engine's choice; sizes above do not depend on it): the
F / H·D / K·D columns are split z-major (F_yz = chunk z·Y + y; 1D F_xyz = chunk
(z·Y + y)·X + x), so gathering over y (wg_xy) leaves a contiguous F_z and every chip's
query heads form one contiguous chunk; the residual stream B_G L E_R and the vocabulary
V_xyz are split in mesh order (x, y, z).

Per layer, parallel block (paper §3.4 and Appendix A), elements per chip; an all-gather's
size is its output, a reduce-scatter's its input (paper §3.1 / Fig. A.1):

  ws1d (Fig. 2a)  AG_xyz(BLE_xyz -> BLE)                          T*E
                  einsums: W_in E F_xyz, W_out F_xyz E; Q heads over xyz, local K/V
                  RS_xyz(BLE partial -> BLE_xyz)                   T*E
  ws2d (Fig. 2b)  AG_yz(BLE_xyz -> BLE_x)                          T*E/X
                  RS_x (BLF_yz partial-x -> BLF_xyz)  [x (m-1) for swiglu: gate and up]
                                                                   T*F/YZ (per matrix)
                  RS_x (BL(HD)_yz partial-x -> BLH_xyzD)  (Q, fused with W_in) T*H*D/YZ
                  K/V: RS_x like Q when K % n == 0, else AR_x of BL(2KD)     T*2*K*D[/YZ]
                  AG_x (BLF_xyz -> BLF_yz)                         T*F/YZ
                  AG_x (BLH_xyzD -> BL(HD)_yz)  (attention output, fused with W_out)
                                                                   T*H*D/YZ
                  RS_yz(BLE_x partial-yz -> BLE_xyz)               T*E/X
  wg_* (Fig. A.2) AG_G(weights) for every weight matrix:           size/M  (int8 stays int8)
                  AG_R(B_G L E_R -> B_G L E)                       T*E/N  (absent if M == 1)
                  einsums local; heads over R; K/V computed locally
                  RS_R(B_G L E partial-R -> B_G L E_R)             T*E/N  (absent if M == 1)
Attention `batch` (Fig. 4c/5b) adds, in any FFN layout, all-to-alls over R that move the
head-sharded Q into batch sharding over all n chips and the output back:
                  A2A_R(Q), A2A_R(out)                             T*H*D/n each
  K and V (Fig. 5b): no chip computes K or V for sequences it does not hold.
    K % n == 0 (K/V head-sharded like Q): A2A_R(K, V)              2*T*K*D/n
    else (K/V weights replicated over yz): each chip projects only its own sequences;
      ws1d, wg_*: local, no communication (the input already holds the full E);
      ws2d: the yz-group of a chip projects the X*B/n sequences its x-row holds, partial
      over x, and RS_x (over the batch) leaves each chip its B/n   2*T*K*D/YZ
      (this replaces head-sharded attention's AR_x of the whole batch's K/V, 2*T*K*D)
Serial block: the attention and the MLP each do their own input all-gather and output
reduce-scatter over R (the paper's "two all-reduces per layer"), so the activation
collectives of the residual stream appear twice.
Per forward pass, outside the layers:
  embedding:   RS over all axes of the vocab-partial lookup, BLE partial -> residual layout
                                                                   T*E
  unembedding: AG over all axes of the last position's residual to a replicated [B, E],
               then logits B x V_xyz locally and a greedy argmax (the tiny (max, index)
               gather that follows is left out of the model)       B*E
Left out deliberately (tiny, and listed so the compiled-program check can skip them):
the norm statistics (psum of T values per norm), the argmax's (max, index) gather.

Mixture-of-experts MLP (docs/models.md; X experts of width F, top-k routing): a router
E x X (replicated, bf16) picks k experts per token, and the trial's `experts` layout says
how the experts are partitioned, the same stored layout for both phases:
  tp  every expert split like the dense MLP (W_in: [X] E_x F_yz, 1D [X] E F_xyz), so each
      phase's FFN layout runs on all X experts at once; dropless static shapes: every
      expert computes every token of the chip and the gates (0 for experts not chosen)
      weigh the outputs. Collectives: the dense layout's with F -> X*F, and in ws2d the
      router's logits all-reduced over x (its input is E_x):  AR_x(BL X)  T*X (f32)
  ep  expert parallelism (GShard, Switch): the experts split over all chips, z-major
      ([X]_zyx E F), so a phase whose weights are gathered over G (wg_*) gathers them
      into X/M whole experts per chip, split over R. The FFN input must hold whole tokens
      (E unsplit: ws1d, wg_*, ws2d with X = 1); each chip routes its own chunk of
      C = ceil(T_G / M) of the T_G tokens it holds, writes each (token, choice) into a
      buffer of C slots per expert (dropless: a token picks an expert at most once), and
                  A2A_R(dispatch [X, C, E] -> the experts' chips)     X*C*E
                  experts: each local expert on its M*C slots
                  A2A_R(combine, back to the tokens' chips)          X*C*E
      then weighs its tokens' k outputs by their gates into a zero B L E partial, which
      the layout's output reduce-scatter over R sums (each token nonzero on one chip).
      wg_*: AG_G of the experts' weights, X*E*F/M per matrix.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from workloads.config import COLLECTIVE_KINDS, ConfigError, ModelConfig  # COLLECTIVE_KINDS: re-exported
from workloads.validate import one_of

AXES = ("x", "y", "z")
FFN_LAYOUTS = ("ws1d", "ws2d", "wg_x", "wg_xy", "wg_xyz")
ATTN_LAYOUTS = ("head", "batch")
WEIGHT_FORMATS = ("bf16", "int8", "fp8")      # fp8: float8_e4m3fn with scales (quant.py)
KV_FORMATS = ("bf16", "int8", "fp8")          # the KV cache's formats (quant.py)
PHASES = ("prefill", "decode")
# How a mixture-of-experts model's experts are partitioned (module doc): tensor-parallel
# like the dense MLP, or expert-parallel with all-to-all dispatch.
EXPERT_LAYOUTS = ("tp", "ep")
EXPERT_AXES = ("z", "y", "x")     # ep stores the experts split over these, major first

# Axes the weights are all-gathered over (= axes the batch is split over), per FFN layout.
GATHER_AXES: dict[str, tuple[str, ...]] = {
    "ws1d": (),
    "ws2d": (),
    "wg_x": ("x",),
    "wg_xy": ("x", "y"),
    "wg_xyz": ("x", "y", "z"),
}



@dataclass(frozen=True)
class PhaseLayout:
    """The layout one phase runs with (prefill and decode each have one)."""

    ffn: str = "ws2d"
    attn: str = "head"

    def __str__(self) -> str:
        return f"{self.ffn}/{self.attn}"


@dataclass(frozen=True)
class Collective:
    """One collective of one forward pass: `count` ops of `elements` per chip each."""

    kind: str                 # one of COLLECTIVE_KINDS
    axes: tuple[str, ...]     # mesh axes it runs over
    elements: int             # per chip: AG output, RS input, AR tensor, A2A tensor
    dtype_bytes: int          # 2 for bf16 activations/weights, 1 for int8/fp8 weights
    count: int                # how many times per forward pass (n_layers for per-layer ops)
    what: str                 # e.g. "ffn.in", "attn.q", "weights.W_in"

    @property
    def bytes_per_chip(self) -> int:
        return self.elements * self.dtype_bytes * self.count


def axis_sizes(topology: tuple[int, int, int]) -> dict[str, int]:
    return dict(zip(AXES, topology))


def split_axes(ffn: str, topology: tuple[int, int, int]) -> tuple[tuple[str, ...], tuple[str, ...], int, int]:
    """(G, R, N, M): gathered axes, remaining axes and their sizes for an FFN layout."""
    sizes = axis_sizes(topology)
    gather = GATHER_AXES[ffn]
    rest = tuple(a for a in AXES if a not in gather)
    n_gather = math.prod(sizes[a] for a in gather)
    return gather, rest, n_gather, math.prod(topology) // n_gather


def stores_1d(prefill: PhaseLayout, decode: PhaseLayout) -> bool:
    """Weights are stored `E F_xyz` only when both phases use ws1d."""
    return prefill.ffn == "ws1d" and decode.ffn == "ws1d"


def kv_heads_sharded(model: ModelConfig, shards: int) -> bool:
    """KV heads are split like query heads only when they divide evenly; else replicated."""
    return model.n_kv_heads % shards == 0


def kv_heads_per_chip(model: ModelConfig, shards: int) -> int:
    """Head-sharded attention: KV heads each chip holds (GQA chapter: replication at TP > K)."""
    return max(model.n_kv_heads // shards, 1)


# --------------------------------------------------------------------------- stored weights
# The ONE table of how a layer's weights are stored (paper §3.2.3, the module doc above):
# the engine's PartitionSpecs (partitioning.param_specs) and the cost model's byte counts
# (costmodel.weight_bytes_per_chip) both read it. A dimension's role says how it is split:
#   "e":  E_x in the 2D layout, unsplit in the 1D layout (E F_xyz)
#   "f":  F_yz (z-major) in 2D, F_xyz (z, y, x) in 1D; also the H·D columns of W_q / rows of W_o
#   "kv": like "f" when the KV heads split over all chips (K % n == 0), else replicated


@dataclass(frozen=True)
class StoredWeight:
    """One stored matrix of a layer: engine name, dimension sizes by symbol, split roles."""

    name: str                 # the engine's pytree name (W_k and W_v travel stacked as w_kv)
    rows: str                 # "E", "F", "HD" or "KD"
    cols: str
    row_role: str             # "e", "f" or "kv"
    col_role: str
    stacked: int = 1          # w_kv holds W_k and W_v: [2, E, K·D]

    def shape(self, model: ModelConfig) -> tuple[int, int]:
        return _dim_size(model, self.rows), _dim_size(model, self.cols)


def _dim_size(model: ModelConfig, symbol: str) -> int:
    return {"E": model.d_model, "F": model.d_ff, "HD": model.n_heads * model.d_head,
            "KD": model.n_kv_heads * model.d_head}[symbol]


STORED_WEIGHTS: dict[str, StoredWeight] = {w.name: w for w in [
    StoredWeight("w_in", "E", "F", "e", "f"),        # gelu MLP
    StoredWeight("w_gate", "E", "F", "e", "f"),      # swiglu MLP
    StoredWeight("w_up", "E", "F", "e", "f"),
    StoredWeight("w_out", "F", "E", "f", "e"),
    StoredWeight("w_q", "E", "HD", "e", "f"),
    StoredWeight("w_o", "HD", "E", "f", "e"),
    StoredWeight("w_kv", "E", "KD", "e", "kv", stacked=2),
]}


MLP_WEIGHTS = ("w_in", "w_gate", "w_up", "w_out")


def stored_weights(model: ModelConfig) -> list[StoredWeight]:
    """The matrices of one layer as stored (W_in or W_gate + W_up, W_out, W_q, W_o, W_k/W_v);
    a mixture-of-experts model stores each MLP matrix once per expert (`is_expert`)."""
    ups = ["w_gate", "w_up"] if model.mlp_matrices == 3 else ["w_in"]
    return [STORED_WEIGHTS[name] for name in ups + ["w_out", "w_q", "w_o", "w_kv"]]


def is_expert(model: ModelConfig, name: str) -> bool:
    """A stacked expert matrix [X, in, out] of a mixture-of-experts model."""
    return model.moe and name in MLP_WEIGHTS


def role_axes(role: str, one_d: bool, kv_split: bool) -> tuple[str, ...]:
    """Mesh axes a dimension of this role is split over, major first."""
    if role == "e":
        return () if one_d else ("x",)
    f_axes = ("z", "y", "x") if one_d else ("z", "y")
    if role == "f" or (role == "kv" and kv_split):
        return f_axes
    return ()


def weight_dims(name: str, one_d: bool, kv_split: bool,
                experts: str | None = None) -> tuple[tuple[str, ...], ...]:
    """Mesh axes of each dimension of a stored weight, major first (w_kv: [2, E, K·D]).
    `experts` ("tp" or "ep") for a mixture-of-experts model's MLP matrices [X, in, out]:
    tp splits each expert like the dense matrix, ep splits the experts over EXPERT_AXES."""
    w = STORED_WEIGHTS[name]
    if experts == "ep" and name in MLP_WEIGHTS:
        return (EXPERT_AXES, (), ())
    dims = (role_axes(w.row_role, one_d, kv_split), role_axes(w.col_role, one_d, kv_split))
    if experts is not None and name in MLP_WEIGHTS:
        return ((),) + dims
    return ((),) + dims if w.stacked > 1 else dims


# --------------------------------------------------------------------------- degenerate layouts


def canonical_layout(layout: PhaseLayout, topology: tuple[int, int, int]) -> PhaseLayout:
    """The layout's name for the program it is on this topology.

    A gather over an axis of size 1 moves nothing, so a weight-gathered layout whose
    gathered axes all have size 1 is the weight-stationary program (wg_x on 1xYxZ is
    ws2d), and one whose size-1 axes are its last ones is the smaller wg layout (wg_xyz on
    XxYx1 is wg_xy). 2D weight-stationary with X = 1 is 1D weight-stationary (same stored
    layout E F_yz, same collectives). One program, one name, one prediction."""
    sizes = axis_sizes(topology)
    ffn = layout.ffn
    if ffn.startswith("wg"):
        live = tuple(a for a in GATHER_AXES[ffn] if sizes[a] > 1)
        names = {axes: name for name, axes in GATHER_AXES.items() if name.startswith("wg")}
        ffn = "ws2d" if not live else names.get(live, ffn)
    if ffn == "ws2d" and sizes["x"] == 1:
        ffn = "ws1d"
    return PhaseLayout(ffn, layout.attn)


# --------------------------------------------------------------------------- head padding
# Paper §4: "we padded the number of attention heads up from 48 to 64 in order to partition
# more effectively on 64+ chips" (18B more parameters, about 3% MFU). Padded query heads
# have zero W_q columns and zero W_o rows, so they contribute nothing; the layouts see the
# padded count, MFU keeps the unpadded model's FLOPs.

PAD_HEADS_CHOICES = ("auto", "none")


def head_divisor(topology: tuple[int, int, int], prefill: PhaseLayout, decode: PhaseLayout) -> int:
    """What the query-head count must be a multiple of: the chips each phase splits heads
    over (M) and the stored layout's split ((HD)_yz, or (HD)_xyz when both phases are ws1d)."""
    x, y, z = topology
    need = [x * y * z if stores_1d(prefill, decode) else y * z]
    need += [split_axes(layout.ffn, topology)[3] for layout in (prefill, decode)]
    return math.lcm(*need)


def padded_head_count(model: ModelConfig, pad_heads, topology: tuple[int, int, int],
                      prefill: PhaseLayout, decode: PhaseLayout, source: str | None = None) -> int:
    """Query heads to run with: `none` -> as is; `auto` -> the smallest count >= n_heads the
    layouts' sharded axes divide (also a multiple of the KV heads, so GQA groups stay whole);
    an integer N -> N (at least n_heads)."""
    heads = model.n_heads
    if pad_heads in (None, "none") or any(l.ffn not in GATHER_AXES for l in (prefill, decode)):
        return heads        # an unknown layout: validate_layouts names it
    step = model.n_kv_heads if model.n_kv_heads < heads else 1   # MHA pads K with H
    if pad_heads == "auto":
        unit = math.lcm(head_divisor(topology, prefill, decode), step)
        return -(-heads // unit) * unit
    if isinstance(pad_heads, bool) or not isinstance(pad_heads, int) or pad_heads < heads \
            or pad_heads % step:
        _reject("pad_heads", pad_heads, f"auto, none or an integer >= n_heads={heads}"
                + (f" and a multiple of n_kv_heads={step}" if step > 1 else ""), source)
    return pad_heads


def pad_model(model: ModelConfig, heads: int) -> ModelConfig:
    """The model with `heads` query heads, the extra ones zero (`padded_from` = the original).

    Multiquery / grouped-query: every KV group gets heads / K query heads (the first H / K
    of each group are the real ones). Multihead (K = H): K is padded with H."""
    base = model.unpadded
    if heads == base.n_heads:
        return base
    kv = heads if base.n_kv_heads == base.n_heads else base.n_kv_heads
    return dataclasses.replace(base, n_heads=heads, n_kv_heads=kv, padded_from=base)


# Vocabulary padding (issue 20): the embedding is stored V_xyz, so the vocabulary must split
# over all chips; like Megatron and MaxText, a vocabulary that does not is padded with
# never-used tokens (zero embedding rows, zero unembedding columns, logits masked before the
# greedy argmax) to the next multiple of the chips. They cost memory and unembedding FLOPs
# (the cost model charges the padded vocabulary); MFU counts the unpadded model's FLOPs.
PAD_VOCAB_CHOICES = ("auto", "none")


def padded_vocab_size(model: ModelConfig, pad_vocab, chips: int, source: str | None = None) -> int:
    """Vocabulary to run with: `none` -> as is; `auto` -> the smallest multiple of the chips
    >= vocab; an integer N -> N (at least vocab, a multiple of the chips)."""
    vocab = model.vocab
    if pad_vocab in (None, "none"):
        return vocab
    if pad_vocab == "auto":
        return -(-vocab // chips) * chips
    if isinstance(pad_vocab, bool) or not isinstance(pad_vocab, int) or pad_vocab < vocab \
            or pad_vocab % chips:
        _reject("pad_vocab", pad_vocab, f"auto, none or an integer >= vocab={vocab} and a "
                f"multiple of chips={chips}", source)
    return pad_vocab


def parse_pad_vocab(value, source: str | None = None, field: str = "pad_vocab") -> str | int:
    """auto | none | a positive integer (a YAML/CLI value)."""
    if isinstance(value, str) and value.strip().lower() in PAD_VOCAB_CHOICES:
        return value.strip().lower()
    try:
        number = int(value)
    except (TypeError, ValueError):
        number = 0
    if isinstance(value, bool) or number <= 0 or str(value).strip() != str(number):
        _reject(field, value, "auto, none or a positive integer (vocabulary to pad to)", source)
    return number


def resolve_padding(model: ModelConfig, pad_heads, topology: tuple[int, int, int],
                    prefill: PhaseLayout, decode: PhaseLayout, source: str | None = None,
                    pad_vocab="auto") -> ModelConfig:
    """The model as run: heads padded per `pad_heads` (auto | none | N) for these layouts,
    and the vocabulary per `pad_vocab` (auto | none | N) for the chips."""
    base = model.unpadded
    run = pad_model(base, padded_head_count(base, pad_heads, topology, prefill, decode, source))
    vocab = padded_vocab_size(base, pad_vocab, math.prod(topology), source)
    if vocab != base.vocab:
        run = dataclasses.replace(run, vocab=vocab, padded_from=base)
    return run


# --------------------------------------------------------------------------- validation


def _reject(field: str, value, accepted: str, source: str | None):
    raise ConfigError(field, value, accepted, source)


def validate_phase(model: ModelConfig, topology: tuple[int, int, int], layout: PhaseLayout,
                   batch: int, phase: str, source: str | None = None,
                   experts: str = "tp") -> None:
    """Reject a layout that cannot run for this shape, naming the constraint (before compiling)."""
    field = f"{phase}"
    one_of(f"{field}.ffn", layout.ffn, FFN_LAYOUTS, source)
    one_of(f"{field}.attn", layout.attn, ATTN_LAYOUTS, source)
    n = math.prod(topology)
    gather, rest, n_gather, m_rest = split_axes(layout.ffn, topology)
    shards = f"{'·'.join(rest) or '1'}={m_rest}"
    if batch % n_gather:
        _reject("batch", batch, f"a multiple of {n_gather} ({layout.ffn} splits the batch over "
                f"{'·'.join(gather)}={n_gather} chips in {phase})", source)
    whole_experts = experts == "ep" and model.moe      # experts are not split over R
    for dim, size in (("d_model", model.d_model), ("d_ff", model.d_ff), ("n_heads", model.n_heads)):
        if dim == "d_ff" and whole_experts:
            continue
        if size % m_rest:
            _reject(f"model.{dim}", size, f"a multiple of {m_rest} ({layout.ffn} splits {dim} over "
                    f"axes {shards} in {phase})", source)
    k = model.n_kv_heads
    if k % m_rest and m_rest % k:
        _reject("model.n_kv_heads", k, f"a divisor or a multiple of {m_rest} ({layout.ffn} splits "
                f"heads over axes {shards} in {phase})", source)
    if layout.attn == "batch" and batch % n:
        _reject("batch", batch, f"a multiple of chips={n} (batch-sharded attention splits the "
                f"KV cache over all chips in {phase})", source)
    if experts == "ep" and model.moe and layout.ffn == "ws2d" and topology[0] > 1:
        _reject("experts", experts, f"tp with {phase} ws2d on X={topology[0]} (expert "
                "parallelism routes whole tokens, and ws2d splits E over x: use ws1d, a "
                "weight-gathered layout or X = 1)", source)


def validate_experts(model: ModelConfig, topology: tuple[int, int, int], experts: str,
                     source: str | None = None) -> None:
    """The experts layout suits the model and the mesh (module doc, mixture-of-experts)."""
    one_of("experts", experts, EXPERT_LAYOUTS, source)
    n = math.prod(topology)
    if experts == "ep" and not model.moe:
        _reject("experts", experts, f"tp ({model.name} is dense: no experts to spread)", source)
    if experts == "ep" and model.n_experts % n:
        _reject("experts", experts, f"tp, or n_experts={model.n_experts} a multiple of chips={n} "
                "(ep stores the experts split over all chips)", source)


def validate_layouts(model: ModelConfig, topology: tuple[int, int, int], prefill: PhaseLayout,
                     decode: PhaseLayout, batch: int, source: str | None = None,
                     experts: str = "tp") -> None:
    """Both phases valid, and the stored weight layout serves both (no weight movement)."""
    validate_experts(model, topology, experts, source)
    x, y, z = topology
    if not stores_1d(prefill, decode):
        for dim, size, div, axes in (("d_model", model.d_model, x, "x"),
                                     ("d_ff", model.d_ff, y * z, "y·z"),
                                     ("n_heads", model.n_heads, y * z, "y·z")):
            if size % div and not (dim == "d_ff" and experts == "ep" and model.moe):
                _reject(f"model.{dim}", size, f"a multiple of {div} (weights are stored "
                        f"{'E_x' if axes == 'x' else 'split over ' + axes} on topology {x}x{y}x{z})",
                        source)
        if "ws1d" in (prefill.ffn, decode.ffn) and x != 1:
            _reject("topology", f"{x}x{y}x{z}", "X = 1 when ws1d is combined with another FFN "
                    "layout (ws1d stores weights E F_xyz, the others E_x F_yz)", source)
    n = x * y * z
    if model.vocab % n:
        _reject("model.vocab", model.vocab, f"a multiple of chips={n} (the embedding is stored "
                "V_xyz E)", source)
    validate_phase(model, topology, prefill, batch, "prefill", source, experts)
    validate_phase(model, topology, decode, batch, "decode", source, experts)


# --------------------------------------------------------------------------- collectives


def layer_collectives(model: ModelConfig, topology: tuple[int, int, int], layout: PhaseLayout,
                      tokens: int, weights: str = "bf16", one_d: bool = False,
                      experts: str = "tp") -> list[Collective]:
    """Collectives of ONE layer for one forward pass over `tokens` = B*L tokens (count = 1).

    `one_d`: the weights are stored in the 1D layout (both phases ws1d), which only matters
    for the sizes of gathered weights (never gathered in ws1d) and is kept for clarity.
    `experts`: a mixture-of-experts model's experts layout (module doc).
    """
    sizes = axis_sizes(topology)
    n = math.prod(topology)
    x, yz = sizes["x"], sizes["y"] * sizes["z"]
    e, h, k, d = model.d_model, model.n_heads, model.n_kv_heads, model.d_head
    ep = experts == "ep" and model.moe
    # tp runs every expert on every token (dropless static shapes): the MLP's activations
    # and weights are X times the dense MLP's; ep's MLP moves none of them
    f = 0 if ep else model.d_ff * model.experts
    t = tokens
    up_matrices = model.mlp_matrices - 1      # W_in (gelu) or W_gate + W_up (swiglu)
    gather, rest, n_gather, m_rest = split_axes(layout.ffn, topology)
    act = 2                                   # activations are bf16
    wbytes = 2 if weights == "bf16" else 1          # int8 and fp8 travel in 8 bits
    out: list[Collective] = []

    def add(kind, axes, elements, what, dtype_bytes=act):
        if elements and axes and math.prod(sizes[a] for a in axes) > 1:
            out.append(Collective(kind, tuple(axes), int(elements), dtype_bytes, 1, what))

    blocks = 2 if model.block == "serial" else 1   # serial: attention and MLP each pay the E-side
    kv_split = kv_heads_sharded(model, n)

    if layout.ffn == "ws1d":
        for _ in range(blocks):
            add("all-gather", AXES, t * e, "resid.in")
            add("reduce-scatter", AXES, t * e, "resid.out")
    elif layout.ffn == "ws2d":
        for _ in range(blocks):
            add("all-gather", ("y", "z"), t * e // x, "resid.in")
            add("reduce-scatter", ("y", "z"), t * e // x, "resid.out")
        for _ in range(up_matrices):
            add("reduce-scatter", ("x",), t * f // yz, "ffn.in")
        add("all-gather", ("x",), t * f // yz, "ffn.out")
        if model.moe and not ep:    # the router's input is E_x: its logits partial over x
            add("all-reduce", ("x",), t * model.n_experts, "moe.router", 4)
        add("reduce-scatter", ("x",), t * h * d // yz, "attn.q")
        if kv_split:
            add("reduce-scatter", ("x",), 2 * t * k * d // yz, "attn.kv")
        elif layout.attn == "batch":   # Fig. 5b: project own x-row's sequences, RS_x over batch
            add("reduce-scatter", ("x",), 2 * t * k * d // yz, "attn.kv_to_batch")
        else:
            add("all-reduce", ("x",), 2 * t * k * d, "attn.kv")
        add("all-gather", ("x",), t * h * d // yz, "attn.out")
    else:  # weight-gathered over G; activations B_G L E_R
        for _ in range(blocks):
            add("all-gather", rest, t * e // n_gather, "resid.in")
            add("reduce-scatter", rest, t * e // n_gather, "resid.out")
        # tp: [X] E x F/M per matrix; ep: the X/M whole experts of this chip's R index
        ffn_weight = (model.n_experts * e * model.d_ff // m_rest) if ep else e * f // m_rest
        for name in (["W_gate", "W_up"] if up_matrices == 2 else ["W_in"]) + ["W_out"]:
            add("all-gather", gather, ffn_weight, f"weights.{name}", wbytes)
        add("all-gather", gather, e * h * d // m_rest, "weights.W_q", wbytes)
        add("all-gather", gather, e * h * d // m_rest, "weights.W_o", wbytes)
        # W_k, W_v: stored E_x (KD)_yz when K splits over all chips, else E_x (KD) (only the
        # x part is gathered then).
        kv_axes = gather if kv_split else tuple(a for a in gather if a == "x")
        add("all-gather", kv_axes, _kv_weight_gather_elements(model, topology, gather),
            "weights.W_kv", wbytes)

    if ep:   # GShard dispatch and combine over R (module doc): X experts x C slots x E
        slots = model.n_experts * expert_capacity(t // n_gather, m_rest) * e
        add("all-to-all", rest, slots, "moe.dispatch")
        add("all-to-all", rest, slots, "moe.combine")
    if layout.attn == "batch":
        add("all-to-all", rest, t * h * d // n, "attn.q_to_batch")
        add("all-to-all", rest, t * h * d // n, "attn.out_to_heads")
        if kv_split:  # K/V arrive head-sharded (see the stored layout above)
            add("all-to-all", rest, 2 * t * k * d // n, "attn.kv_to_batch")
    return out


def _kv_weight_gather_elements(model: ModelConfig, topology: tuple[int, int, int],
                               gather: tuple[str, ...]) -> int:
    """Output size per chip of all-gathering W_k and W_v over the gathered axes."""
    sizes = axis_sizes(topology)
    n = math.prod(topology)
    full = 2 * model.d_model * model.n_kv_heads * model.d_head
    if kv_heads_sharded(model, n):
        # stored E_x (KD)_yz; after gathering over G, split over the axes not in G
        return full // math.prod(sizes[a] for a in AXES if a not in gather)
    # stored E_x (KD) replicated over yz: only the x part is gathered
    return full if "x" in gather else full // sizes["x"]


def expert_capacity(group_tokens: int, shards: int) -> int:
    """Slots per expert in a chip's ep dispatch buffer: its chunk of the `group_tokens` its
    R-group holds, ceil(T_G / M) (a token picks an expert at most once: dropless)."""
    return -(-group_tokens // shards)


def forward_collectives(model: ModelConfig, topology: tuple[int, int, int], layout: PhaseLayout,
                        batch: int, seq_len: int, weights: str = "bf16",
                        experts: str = "tp") -> list[Collective]:
    """All collectives of one forward pass (prefill: seq_len = input_len; decode: seq_len = 1)."""
    tokens = batch * seq_len
    per_layer = layer_collectives(model, topology, layout, tokens, weights, experts=experts)
    out = [Collective(c.kind, c.axes, c.elements, c.dtype_bytes, model.n_layers, c.what) for c in per_layer]
    n = math.prod(topology)
    if n > 1:
        out.append(Collective("reduce-scatter", AXES, tokens * model.d_model, 2, 1, "embed"))
        out.append(Collective("all-gather", AXES, batch * model.d_model, 2, 1, "unembed"))
    return out


# Ops the model leaves out on purpose (the compiled-program check skips them by size).
LEFT_OUT = (
    "norm statistics: one psum of T float32 values per norm (RMS over a sharded E)",
    "greedy argmax: all-gather of (max, index) per vocab shard, B*n values",
)
