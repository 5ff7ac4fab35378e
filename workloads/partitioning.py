"""The paper's layouts as code: one small function per figure, run inside `jax.shard_map`.

Every collective is written out (`all_gather`, `psum_scatter`, `psum`, `all_to_all`) and
is the one `workloads/layouts.py` lists for the layout, over the same axes, with the same
per-chip size. Notation (paper §3.1): `BLE_x` = E split over mesh axis x; G = the axes
weights are gathered over (= the batch's axes), R = the other axes (E, F, heads).

Order of split axes (the paper leaves it open; these choices make the layouts compose):
  * the residual stream is B_G L E_R with G and R in mesh order (x, y, z); ws1d/ws2d
    are the G = {} case, BLE_xyz;
  * the F, H·D and K·D columns of stored weights are split z-major: F_yz is stored as
    `P('x', ('z', 'y'))`, so gathering over y (wg_xy) leaves a contiguous F_z, and the
    1D layout E F_xyz is `P(None, ('z', 'y', 'x'))`;
  * so every chip's query heads are one contiguous chunk, indexed z-major over R
    (`Plan.head_axes`), and GQA groups never straddle chips.
A collective over axes of total size 1 is skipped (it moves nothing; layouts.py skips it too).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from workloads.config import ModelConfig
from workloads.layouts import (AXES, MLP_WEIGHTS, PhaseLayout, kv_heads_sharded, split_axes,
                               weight_dims)
from workloads.model import NORM_EPS, ROPE_BASE, layer_shapes
from workloads.kvcache import kv_dequantize, kv_dtype, kv_quantize, kv_width
from workloads.quant import is_quantized

f32, bf16 = jnp.float32, jnp.bfloat16


# --------------------------------------------------------------------------- plan


@dataclass(frozen=True)
class Plan:
    """One phase's layout resolved on a topology: which axes do what."""

    model: ModelConfig
    topology: tuple[int, int, int]
    layout: PhaseLayout
    one_d: bool = False          # weights stored 1D (E F_xyz): both phases use ws1d
    experts: str = "tp"          # a mixture-of-experts model's experts layout (layouts.py)
    kv_cache: str = "bf16"       # the KV cache's format (quant.py): bf16, int8 or fp8

    @property
    def sizes(self) -> dict[str, int]:
        return dict(zip(AXES, self.topology))

    @property
    def n(self) -> int:
        return math.prod(self.topology)

    @property
    def gather(self) -> tuple[str, ...]:          # G
        return split_axes(self.layout.ffn, self.topology)[0]

    @property
    def rest(self) -> tuple[str, ...]:            # R
        return split_axes(self.layout.ffn, self.topology)[1]

    @property
    def n_gather(self) -> int:                    # N = |G|
        return split_axes(self.layout.ffn, self.topology)[2]

    @property
    def n_rest(self) -> int:                      # M = |R|
        return split_axes(self.layout.ffn, self.topology)[3]

    @property
    def head_axes(self) -> tuple[str, ...]:
        """Axes the query heads are split over, major first (z-major, see the module doc)."""
        return tuple(reversed(self.rest))

    @property
    def kv_split(self) -> bool:
        """K/V weights stored head-split (E_x (KD)_yz) rather than replicated over yz."""
        return kv_heads_sharded(self.model, self.n)

    @property
    def batch_attention(self) -> bool:
        return self.layout.attn == "batch"

    @property
    def expert_parallel(self) -> bool:
        """Experts spread over the chips, tokens dispatched by all-to-all (layouts.py, ep)."""
        return self.model.moe and self.experts == "ep"

    def dims(self, name: str) -> tuple[tuple[str, ...], ...]:
        """Mesh axes of each dimension of stored weight `name` (layouts.weight_dims)."""
        experts = self.experts if self.model.moe else None
        return weight_dims(name, self.one_d, self.kv_split, experts)

    def live(self, axes) -> tuple[str, ...]:
        return tuple(a for a in axes if self.sizes[a] > 1)

    def size(self, axes) -> int:
        return math.prod(self.sizes[a] for a in axes)

    # ---- shardings of what crosses the shard_map boundary

    def kv_slots(self) -> np.ndarray:
        """Logical KV head held in each slot of the cache's head dimension.

        Batch-sharded attention: every chip holds all K heads of its sequences. Head-
        sharded: chip c (of M) holds the heads its queries read, max(K/M, 1) of them, so a
        KV head is replicated over M/K chips when K < M (paper Fig. 4b; the GQA ceiling).
        """
        m = self.model
        if self.batch_attention:
            return np.arange(m.n_kv_heads)
        chips, per_chip = self.n_rest, max(m.n_kv_heads // self.n_rest, 1)
        group = m.n_heads // m.n_kv_heads
        starts = [(c * (m.n_heads // chips)) // group for c in range(chips)]
        return np.array([s + j for s in starts for j in range(per_chip)])

    def cache_shape(self, batch: int, context: int) -> tuple[int, ...]:
        """[layers, B, context, 2 (K and V), slots, D] (D + 2 for an int8 cache: quant.py)."""
        m = self.model
        return (m.n_layers, batch, context, 2, len(self.kv_slots()), kv_width(self.kv_cache, m.d_head))

    @property
    def cache_dtype(self):
        return kv_dtype(self.kv_cache)

    def cache_spec(self) -> P:
        if self.batch_attention:                  # KV cache B_xyz (Fig. 5b)
            return P(None, AXES, None, None, None, None)
        return P(None, self.gather or None, None, None, self.head_axes or None, None)


# --------------------------------------------------------------------------- stored weights
# Which mesh axes each stored dimension is split over: layouts.weight_dims, the one table
# (layouts.STORED_WEIGHTS) the cost model counts bytes from too.


def param_specs(model: ModelConfig, one_d: bool, kv_split: bool, int8: bool,
                experts: str = "tp") -> dict:
    """PartitionSpecs of the engine's stored pytree (`engine.stored_params`); int8 scales
    and a mixture-of-experts router are replicated (tiny; each chip slices what it holds)."""
    def weight(name):
        dims = weight_dims(name, one_d, kv_split, experts if model.moe else None)
        spec = P(*[axes or None for axes in dims])
        return {"q": spec, "scale": P()} if int8 else spec

    names = [n for n in layer_shapes(model) if n not in ("w_k", "w_v")] + ["w_kv"]
    layer = {n: P() if n.endswith("norm") or n == "w_router" else weight(n) for n in names}
    specs = {"embed": P(AXES, None), "final_norm": P(), "layers": [layer] * model.n_layers}
    if not model.tie_embeddings:
        specs["unembed"] = P(None, AXES)                     # unembedding E V_xyz
    return specs


# --------------------------------------------------------------------------- collectives
# Thin wrappers that skip axes of size 1 (and the whole op when nothing is left).


def all_gather(plan: Plan, x, axes, axis: int, tiled: bool = True):
    axes = plan.live(axes)
    if not axes:
        return x if tiled else jnp.expand_dims(x, axis)
    return jax.lax.all_gather(x, axes, axis=axis, tiled=tiled)


def psum_scatter(plan: Plan, x, axes, axis: int, tiled: bool = True):
    axes = plan.live(axes)
    if not axes:
        return x if tiled else jnp.squeeze(x, axis)
    return jax.lax.psum_scatter(x, axes, scatter_dimension=axis, tiled=tiled)


def psum(plan: Plan, x, axes):
    axes = plan.live(axes)
    return jax.lax.psum(x, axes) if axes else x


def all_to_all(plan: Plan, x, axes, split_axis: int, concat_axis: int):
    axes = plan.live(axes)
    return jax.lax.all_to_all(x, axes, split_axis, concat_axis, tiled=True) if axes else x


def axis_index(plan: Plan, axes):
    axes = plan.live(axes)
    return jax.lax.axis_index(axes) if axes else 0


def local_chunk(plan: Plan, x, axes, axis: int):
    """This chip's chunk of a replicated array split over `axes` (major first)."""
    size = x.shape[axis] // plan.size(axes)
    if size == x.shape[axis]:
        return x
    return jax.lax.dynamic_slice_in_dim(x, axis_index(plan, axes) * size, size, axis)


# --------------------------------------------------------------------------- weights in use


def _dequantize(plan: Plan, leaf, dims):
    """bf16 weight from a bf16 leaf or an int8 leaf. The scale [..., out] is replicated:
    slice it to the local columns (`dims[-1]`, the axes still splitting the output) and, for
    stacked experts, to the local experts (`dims[0]`)."""
    if not is_quantized(leaf):
        return leaf
    scale = local_chunk(plan, leaf["scale"], dims[-1], axis=-1)
    if leaf["q"].ndim == 3 and dims[0]:
        scale = local_chunk(plan, scale, dims[0], axis=0)
    return (leaf["q"].astype(f32) * scale[..., None, :]).astype(bf16)


def stationary_weight(plan: Plan, leaf, name: str):
    """Weight-stationary: use the local shard as stored (dequantised if int8)."""
    return _dequantize(plan, leaf, plan.dims(name))


def gathered_weight(plan: Plan, leaf, name: str):
    """Weight-gathered (Fig. A.2): ONE all-gather over G of the stored E_x F_yz shard, in
    its stored dtype (int8 stays int8), then dequantise. Gathered axes are always the minor
    axes of their dimension, so the result is a contiguous block, split over R only."""
    dims = plan.dims(name)
    gather = tuple(a for a in plan.live(plan.gather) if any(a in d for d in dims))
    q = leaf["q"] if is_quantized(leaf) else leaf
    if gather:
        full = all_gather(plan, q, gather, axis=0, tiled=False)          # [N, *local]
        full = full.reshape(tuple(plan.sizes[a] for a in gather) + q.shape)
        order = []
        for d, axes in enumerate(dims):   # put each gathered axis just before its dimension
            order += [gather.index(a) for a in axes if a in gather] + [len(gather) + d]
        q = full.transpose(order).reshape(
            tuple(s * plan.size([a for a in dims[d] if a in gather]) for d, s in enumerate(q.shape)))
    remaining = tuple(tuple(a for a in axes if a not in gather) for axes in dims)
    return _dequantize(plan, {"q": q, "scale": leaf["scale"]} if is_quantized(leaf) else q,
                       remaining)


def at_least_two_rows(product, x):
    """`product(x)` for an x of one row along axis 0, run on two (the second zeros) and cut
    back: XLA CPU runs a one-row bf16 product as a matrix-vector product that first converts
    the WHOLE weight to f32 (the unembedding of a batch of one converted the embedding table
    every decode step: 12 ms of a 38 ms step, docs/performance.md), where two rows take its
    bf16 matmul path. The rows' results are independent, so the cut is exact."""
    if x.shape[0] != 1 or math.prod(x.shape[1:-1]) != 1:
        return product(x)
    return product(jnp.concatenate([x, jnp.zeros_like(x)], axis=0))[:1]


def matmul(x, w):
    """bf16 x bf16 -> f32 accumulation -> bf16, as on the paper's TPUs."""
    rows = math.prod(x.shape[:-1])
    if rows == 1:
        # XLA CPU takes a slow matrix-vector path for a single row (batch-1 decode on one
        # chip: ~6x slower); two rows, one of them padding, take the fast matmul path.
        # benchmarks/engine_efficiency.py measures it.
        x2 = jnp.pad(x.reshape(1, x.shape[-1]), ((0, 1), (0, 0)))
        return matmul(x2, w)[:1].reshape(x.shape[:-1] + (w.shape[-1],))
    return jnp.einsum("...i,io->...o", x, w, preferred_element_type=f32).astype(bf16)


def activation(model: ModelConfig, up):
    """gelu(W_in x), or silu(W_gate x) * (W_up x) for swiglu, gelu(W_gate x) * (W_up x) for
    geglu; `up` = (in,) or (gate, up)."""
    if model.mlp == "swiglu":
        return (jax.nn.silu(up[0].astype(f32)) * up[1].astype(f32)).astype(bf16)
    if model.mlp == "geglu":
        return (jax.nn.gelu(up[0].astype(f32)) * up[1].astype(f32)).astype(bf16)
    return jax.nn.gelu(up[0].astype(f32)).astype(bf16)


def rms_norm(plan: Plan, x, scale, e_axes=()):
    """RMSNorm of x whose E dimension is split over `e_axes` (statistics psum-ed over them;
    layouts.py leaves this T-element psum out on purpose)."""
    x32 = x.astype(f32)
    mean_sq = psum(plan, jnp.sum(x32 * x32, axis=-1, keepdims=True), e_axes) / plan.model.d_model
    scale = local_chunk(plan, scale, e_axes, axis=0).astype(f32)
    return (x32 * jax.lax.rsqrt(mean_sq + NORM_EPS) * scale).astype(bf16)


def _up_names(model: ModelConfig):
    return ("w_gate", "w_up") if model.mlp_matrices == 3 else ("w_in",)


# --------------------------------------------------------------------------- embedding


def embed(plan: Plan, tokens, table):
    """Vocab-sharded lookup (table V_xyz E), then ONE reduce-scatter over all axes of the
    B L E partial sums into the residual layout B_G L E_R."""
    v_local = table.shape[0]
    local = tokens - axis_index(plan, AXES) * v_local
    hit = (local >= 0) & (local < v_local)
    x = jnp.where(hit[..., None], table[jnp.clip(local, 0, v_local - 1)], 0).astype(bf16)
    b, l, e = x.shape
    n_g, m_r = plan.n_gather, plan.n_rest
    # [B, L, E] -> [N·M, B/N, L, E/M] so chip (g, r) receives batch chunk g, E chunk r.
    x = x.reshape(n_g, b // n_g, l, m_r, e // m_r).transpose(0, 3, 1, 2, 4)
    x = x.reshape(n_g * m_r, b // n_g, l, e // m_r)
    return psum_scatter(plan, x, AXES, axis=0, tiled=False)


def unembed(plan: Plan, x_last, final_norm, table, tied: bool):
    """ONE all-gather over all axes of the last position's residual (B_G E_R -> B E), then
    logits B V_xyz locally (f32). The greedy argmax happens outside the program."""
    full = all_gather(plan, x_last, AXES, axis=0, tiled=False)            # [N·M, B/N, E/M]
    bn, em = x_last.shape
    full = full.reshape(plan.n_gather, plan.n_rest, bn, em).transpose(0, 2, 1, 3)
    h = rms_norm(plan, full.reshape(plan.n_gather * bn, plan.n_rest * em), final_norm)
    eq = "be,ve->bv" if tied else "be,ev->bv"
    logits = at_least_two_rows(lambda rows: jnp.einsum(eq, rows, table, preferred_element_type=f32), h)
    return logits * plan.model.d_model ** -0.5


# --------------------------------------------------------------------------- FFN: ws1d
# Figure 2(a), §3.2.1: weights E F_xyz / F_xyz E; activations all-gathered to a full BLE
# before the layer and reduce-scattered back to BLE_xyz after it (Megatron, no comm inside).


def ws1d_gather_input(plan: Plan, x, norm_scale):
    h = all_gather(plan, x, AXES, axis=2)                       # AG_xyz: BLE_xyz -> BLE
    return rms_norm(plan, h, norm_scale)


def ws1d_ffn(plan: Plan, h, w):
    up = [matmul(h, stationary_weight(plan, w[n], n)) for n in _up_names(plan.model)]   # BLF_xyz
    return matmul(activation(plan.model, up), stationary_weight(plan, w["w_out"], "w_out"))  # BLE partial-xyz


def ws1d_qkv(plan: Plan, h, w):
    q = matmul(h, stationary_weight(plan, w["w_q"], "w_q"))    # heads over xyz, local
    w_kv = stationary_weight(plan, w["w_kv"], "w_kv")
    if _kv_by_batch(plan):   # Fig. 5b: project only this chip's sequences (B_xyz), no comm
        return _heads(plan, q), _project_kv(plan, local_chunk(plan, h, plan.rest, axis=0), w_kv)
    return _heads(plan, q), _project_kv(plan, h, w_kv)         # local K/V


def ws1d_attn_out(plan: Plan, o, w):
    return matmul(_flat(o), stationary_weight(plan, w["w_o"], "w_o"))    # BLE partial-xyz


def ws1d_scatter_output(plan: Plan, y):
    return psum_scatter(plan, y, AXES, axis=2)                  # RS_xyz: BLE partial -> BLE_xyz


# --------------------------------------------------------------------------- FFN: ws2d
# Figure 2(b), §3.2.2 / App. A.2.1: weights E_x F_yz / F_yz E_x; residual BLE_xyz.


def ws2d_gather_input(plan: Plan, x, norm_scale):
    h = all_gather(plan, x, ("y", "z"), axis=2)                 # AG_yz: BLE_xyz -> BLE_x
    return rms_norm(plan, h, norm_scale, e_axes=("x",))


def ws2d_ffn(plan: Plan, h, w):
    up = [psum_scatter(plan, matmul(h, stationary_weight(plan, w[n], n)), ("x",), axis=2)
          for n in _up_names(plan.model)]                       # RS_x: BLF_yz partial-x -> BLF_xyz
    act = all_gather(plan, activation(plan.model, up), ("x",), axis=2)   # AG_x: BLF_xyz -> BLF_yz
    return matmul(act, stationary_weight(plan, w["w_out"], "w_out"))    # BLE_x partial-yz


def ws2d_qkv(plan: Plan, h, w):
    q = matmul(h, stationary_weight(plan, w["w_q"], "w_q"))    # BL(HD)_yz partial-x
    q = psum_scatter(plan, _heads(plan, q), ("x",), axis=2)  # RS_x -> BLH_xyzD
    w_kv = stationary_weight(plan, w["w_kv"], "w_kv")
    if _kv_by_batch(plan):
        return q, _ws2d_kv_by_batch(plan, h, w_kv)
    kv = _project_kv(plan, h, w_kv)                             # BL 2 K D, partial-x
    if plan.kv_split:
        kv = psum_scatter(plan, kv, ("x",), axis=3)             # RS_x: like Q
    else:
        kv = psum(plan, kv, ("x",))                             # AR_x: every chip gets all K heads
    return q, kv


def _ws2d_kv_by_batch(plan: Plan, h, w_kv):
    """Fig. 5b in 2D weight-stationary, K/V replicated over yz: chip (x, y, z) must end
    with the K/V of batch chunk x·YZ + yz (the cache is B_xyz, mesh order). Its yz-group
    (the X chips of one y, z) projects the X chunks {x'·YZ + yz}, partial over x (E is
    E_x), and ONE reduce-scatter over x on that batch dimension sums them and leaves chip
    x its own chunk. No chip projects the sequences of another yz-group."""
    x_size = plan.sizes["x"]
    yz = plan.size(("y", "z"))
    b = h.shape[0]
    rows = h.reshape((x_size, yz, b // (x_size * yz)) + h.shape[1:])
    mine = jax.lax.dynamic_index_in_dim(rows, axis_index(plan, ("y", "z")), axis=1, keepdims=False)
    kv = _project_kv(plan, mine.reshape((-1,) + h.shape[1:]), w_kv)     # [X·B/n, L, 2, K, D] partial-x
    kv = kv.reshape((x_size, -1) + kv.shape[1:])
    return psum_scatter(plan, kv, ("x",), axis=0, tiled=False)          # RS_x over batch -> B_xyz


def ws2d_attn_out(plan: Plan, o, w):
    o = all_gather(plan, o, ("x",), axis=2)                     # AG_x: BLH_xyzD -> BL(HD)_yz
    return matmul(_flat(o), stationary_weight(plan, w["w_o"], "w_o"))   # BLE_x partial-yz


def ws2d_scatter_output(plan: Plan, y):
    return psum_scatter(plan, y, ("y", "z"), axis=2)            # RS_yz: BLE_x partial -> BLE_xyz


# --------------------------------------------------------------------------- FFN: weight-gathered
# Figure A.2, §3.2.3 / App. A.2.2: wg_x, wg_xy, wg_xyz gather the stored E_x F_yz weights
# over G = x, xy, xyz; activations stay B_G L E_R; heads and F are split over R.


def wg_gather_input(plan: Plan, x, norm_scale):
    h = all_gather(plan, x, plan.rest, axis=2)                  # AG_R: B_G L E_R -> B_G L E
    return rms_norm(plan, h, norm_scale)


def weight_gathered_ffn(plan: Plan, h, w):
    up = [matmul(h, gathered_weight(plan, w[n], n)) for n in _up_names(plan.model)]  # AG_G(W_in)
    return matmul(activation(plan.model, up), gathered_weight(plan, w["w_out"], "w_out"))  # AG_G(W_out); partial-R


def wg_qkv(plan: Plan, h, w):
    q = matmul(h, gathered_weight(plan, w["w_q"], "w_q"))      # AG_G(W_q); heads over R
    w_kv = gathered_weight(plan, w["w_kv"], "w_kv")             # AG_G(W_k, W_v), one op
    if _kv_by_batch(plan):   # Fig. 5b: only this chip's sequences (B_G split over R), no comm
        h = local_chunk(plan, h, plan.rest, axis=0)
    return _heads(plan, q), _project_kv(plan, h, w_kv)


def wg_attn_out(plan: Plan, o, w):
    return matmul(_flat(o), gathered_weight(plan, w["w_o"], "w_o"))    # AG_G(W_o); partial-R


def wg_scatter_output(plan: Plan, y):
    return psum_scatter(plan, y, plan.rest, axis=2)             # RS_R: B_G L E partial -> B_G L E_R


# --------------------------------------------------------------------------- mixture of experts
# layouts.py's module doc, "Mixture-of-experts MLP". Routing (Mixtral, GShard top-k): the
# router's logits in f32, the top k experts, their softmax (= the softmax over all experts
# renormalised over the k) as the gates; the reference does the same (workloads/reference.py).


def route(model: ModelConfig, logits):
    """logits [..., X] f32 -> (the k chosen experts [..., k] int32, their gates [..., k] f32)."""
    top, chosen = jax.lax.top_k(logits, model.experts_per_token)
    return chosen, jax.nn.softmax(top, axis=-1)


def router_logits(plan: Plan, h, w_router, e_axes=()):
    """h [..., E or E-chunk] @ the router E x X -> logits [..., X] f32; with E split over
    `e_axes` (ws2d: x) each chip multiplies its rows and the logits are psum-ed (layouts.py
    moe.router)."""
    w = local_chunk(plan, w_router, e_axes, axis=0)
    return psum(plan, jnp.einsum("...e,ex->...x", h, w, preferred_element_type=f32), e_axes)


def expert_matmul(x, w, per_expert: bool):
    """Stacked experts w [X, in, out] on x: [..., in], every expert on every row, or
    (`per_expert`) [X, ..., in], each expert on its own rows -> [X, ..., out]; bf16 inputs,
    f32 accumulation. (Experts lead: XLA CPU has no bf16 dot with f32 output whose batch
    dimension is not the operands' first.)"""
    eq = "n...i,nio->n...o" if per_expert else "...i,nio->n...o"
    return jnp.einsum(eq, x, w, preferred_element_type=f32).astype(bf16)


def _experts_mlp(plan: Plan, h, w, weight_fn, scatter_up=(), gather_act=(), per_expert=False):
    """The experts on h: [..., E], every expert on every row, or (`per_expert`) [X, ..., E];
    optionally each up-projection reduce-scattered over `scatter_up` and the activation
    all-gathered over `gather_act` along F (ws2d's RS_x / AG_x). -> [X, ..., E-part],
    partial over the axes F is split over."""
    up = [expert_matmul(h, weight_fn(plan, w[n], n), per_expert) for n in _up_names(plan.model)]
    up = [psum_scatter(plan, u, scatter_up, axis=u.ndim - 1) for u in up]
    act = activation(plan.model, up)
    act = all_gather(plan, act, gather_act, axis=act.ndim - 1)
    return expert_matmul(act, weight_fn(plan, w["w_out"], "w_out"), per_expert=True)


def _weigh(out, chosen, gates):
    """Sum over experts of out [X, ..., E] weighted by the gates of the chosen ones (0 for
    the others), in f32 -> [..., E] bf16."""
    dense = jnp.sum(jax.nn.one_hot(chosen, out.shape[0], dtype=f32) * gates[..., None], axis=-2)
    return jnp.sum(out.astype(f32) * jnp.moveaxis(dense, -1, 0)[..., None], axis=0).astype(bf16)


def moe_tensor_parallel(plan: Plan, h, w):
    """tp: the phase's FFN layout on all X experts at once (dropless static shapes: every
    expert computes every row; the gates weigh them). Same output layout as the dense FFN:
    ws1d BLE partial-xyz, ws2d BLE_x partial-yz, wg_* B_G L E partial-R."""
    ffn = plan.layout.ffn
    if ffn == "ws2d":
        chosen, gates = route(plan.model, router_logits(plan, h, w["w_router"], ("x",)))
        out = _experts_mlp(plan, h, w, stationary_weight, ("x",), ("x",))
    else:
        chosen, gates = route(plan.model, router_logits(plan, h, w["w_router"]))
        weight_fn = stationary_weight if ffn == "ws1d" else gathered_weight
        out = _experts_mlp(plan, h, w, weight_fn)
    return _weigh(out, chosen, gates)


def moe_expert_parallel(plan: Plan, h, w):
    """ep (GShard/Switch): h [b, L, E] holds whole tokens, replicated over R. This chip routes
    its chunk of C = ceil(bL / M) of them (z-major over R), scatters each (token, choice)
    into its expert's C-slot buffer, all-to-alls the buffers to the experts' chips over R
    (experts split z-major, as stored), runs its X/M experts on the M*C slots each received,
    all-to-alls the outputs back, weighs its tokens' k outputs by their gates and returns
    B L E partial over R: its own rows, zero elsewhere (the layout's output reduce-scatter
    sums them). Dropless: a token picks an expert at most once, so C slots always suffice."""
    model, axes = plan.model, plan.live(plan.head_axes)
    b, length, e = h.shape
    shards, experts = plan.size(axes), model.n_experts
    tokens = b * length
    chunk = -(-tokens // shards)
    rows = jnp.pad(h.reshape(tokens, e), ((0, chunk * shards - tokens), (0, 0)))
    start = axis_index(plan, axes) * chunk
    mine = jax.lax.dynamic_slice_in_dim(rows, start, chunk, axis=0)          # [C, E]
    chosen, gates = route(model, router_logits(plan, mine, w["w_router"]))  # [C, k]
    flat = chosen.reshape(-1)                                               # (token, choice)
    one_hot = jax.nn.one_hot(flat, experts, dtype=jnp.int32)
    position = jnp.sum((jnp.cumsum(one_hot, axis=0) - 1) * one_hot, axis=-1)  # within its expert
    slot = flat * chunk + position                                          # unique slots
    send = jnp.zeros((experts * chunk, e), bf16).at[slot].set(
        jnp.repeat(mine, model.experts_per_token, axis=0))
    send = send.reshape(shards, experts // shards, chunk, e)                # by expert's chip
    received = all_to_all(plan, send, axes, split_axis=0, concat_axis=0)    # [M src, X/M, C, E]
    weight_fn = gathered_weight if plan.gather else stationary_weight
    local = experts // shards
    out = _experts_mlp(plan, received.transpose(1, 0, 2, 3).reshape(local, shards * chunk, e), w,
                       weight_fn, per_expert=True)                          # [X/M, M*C, E]
    out = out.reshape(local, shards, chunk, e).transpose(1, 0, 2, 3)        # [M, X/M, C, E]
    back = all_to_all(plan, out, axes, split_axis=0, concat_axis=0)         # [M, X/M, C, E]
    picked = back.reshape(experts * chunk, e)[slot].reshape(chunk, -1, e)    # [C, k, E]
    y = jnp.sum(picked.astype(f32) * gates[..., None], axis=1).astype(bf16)
    full = jax.lax.dynamic_update_slice_in_dim(jnp.zeros((chunk * shards, e), bf16), y, start, 0)
    return full[:tokens].reshape(b, length, e)


def moe_ffn(plan: Plan, h, w):
    """A mixture-of-experts layer's MLP in this phase's layout (tp or ep)."""
    return moe_expert_parallel(plan, h, w) if plan.expert_parallel else moe_tensor_parallel(plan, h, w)


# --------------------------------------------------------------------------- attention
# Figure 4 / 5, §3.3. q: [b, L, heads, D] head-sharded (this chip's chunk, Plan.head_axes);
# kv: [b, L, 2, kv heads, D], head-sharded like q when K % n == 0, else all K heads.
# cache: [layers, b, context, 2, slots, D] (this chip's part); `layer` indexes it.


def head_sharded_attention(plan: Plan, q, kv, cache, layer: int, pos, prefill: bool):
    """Fig. 4a (multihead) / 4b (multiquery baseline): attention where the heads are; when
    K/V are replicated, each chip keeps the KV heads its query heads read, for all its
    sequences (so head-sharded multiquery holds the whole cache on every chip)."""
    if not plan.kv_split:
        m = plan.model
        c = axis_index(plan, plan.head_axes)
        first = (c * (m.n_heads // plan.n_rest)) // (m.n_heads // m.n_kv_heads)
        kv = jax.lax.dynamic_slice_in_dim(kv, first, cache.shape[4], axis=3)
    if jnp.ndim(pos):   # per-row positions (serving slots): this chip's rows, B_G
        pos = local_chunk(plan, pos, plan.gather, axis=0)
    return attend(q, kv, cache, layer, pos, prefill, plan.kv_cache)


def batch_sharded_attention(plan: Plan, q, kv, cache, layer: int, pos, prefill: bool):
    """Fig. 4c / 5b: all-to-all the small per-token Q (and K/V when head-sharded) from head-
    to batch-sharding over R, attend against a KV cache sharded over batch on all n chips,
    all-to-all the output back. Replicated K/V arrive already batch-sharded: no chip
    computed them for sequences it does not hold (_kv_by_batch)."""
    rest = plan.rest
    q = _heads_in_head_order(plan, all_to_all(plan, q, rest, split_axis=0, concat_axis=2), axis=2)
    if plan.kv_split:
        kv = _heads_in_head_order(plan, all_to_all(plan, kv, rest, split_axis=0, concat_axis=3), axis=3)
    # else: the *_qkv function already projected only this chip's sequences (_kv_by_batch)
    if jnp.ndim(pos):   # per-row positions (serving slots): this chip's rows, B_xyz as the cache
        pos = local_chunk(plan, pos, AXES, axis=0)
    out, cache = attend(q, kv, cache, layer, pos, prefill, plan.kv_cache)
    out = all_to_all(plan, _heads_in_mesh_order(plan, out, axis=2), rest, split_axis=2, concat_axis=0)
    return out, cache


def attend(q, kv, cache, layer: int, pos, prefill: bool, kv_cache: str = "bf16"):
    """Local causal attention with RoPE; writes this step's K/V into the cache at `pos` (in
    the cache's format, quant.py). Prefill attends to its own fresh K/V, decode to the
    cache (masked beyond `pos`); both read K/V at the cache's precision. Decode with L > 1
    tokens is the engine's extend (chunked prefill, prefix caching; engine.py
    `_extend_program`): the L new K/V written at [pos, pos + L), each query attending to the
    cached prefix and the new keys up to its own position. `pos` a vector [b]: each row at
    its own position (serving slots, `attend_rows`)."""
    if jnp.ndim(pos):
        return attend_rows(q, kv, cache, layer, pos, kv_cache)
    b, lq, hq, d = q.shape
    positions = pos + jnp.arange(lq)
    q = rope(q, positions)
    kv = kv_quantize(jnp.stack([rope(kv[:, :, 0], positions), kv[:, :, 1]], axis=2), kv_cache)
    cache = write_rows(cache, kv[None].astype(cache.dtype), (layer, 0, pos, 0, 0, 0))
    keys = kv_dequantize(kv if prefill else cache[layer], kv_cache)
    hk = keys.shape[3]
    key_pos = jnp.arange(keys.shape[1])
    qg = q.reshape(b, lq, hk, hq // hk, d)          # query head i reads KV head i // (hq/hk)
    scores = jnp.einsum("bqgrd,bkgd->bgrqk", qg, keys[:, :, 0], preferred_element_type=f32) * d ** -0.5
    mask = key_pos[None, :] <= positions[:, None]
    probs = jax.nn.softmax(jnp.where(mask, scores, -1e30), axis=-1)
    out = jnp.einsum("bgrqk,bkgd->bqgrd", probs.astype(bf16), keys[:, :, 1], preferred_element_type=f32)
    return out.astype(bf16).reshape(b, lq, hq, d), cache


def _as_bits(x):
    """A float cache as the unsigned integers of its width (bitcasts are free), or None for an
    integer cache (int8 KV), which XLA CPU already writes in place."""
    if not jnp.issubdtype(x.dtype, jnp.floating):
        return None
    return jax.lax.bitcast_convert_type(x, {2: jnp.uint16, 1: jnp.uint8}[x.dtype.itemsize])


def write_rows(cache, update, start):
    """dynamic_update_slice of a float cache (bf16, or FP8 for an 8-bit KV cache) as the
    integers it is made of: XLA CPU runs a bf16 or fp8 dynamic-update-slice in f32,
    converting the WHOLE cache to f32 and back to write a few rows, on every layer of every
    decode step (a step then costs O(layers x cache) instead of O(new rows);
    docs/performance.md "The KV-cache write"). A bitcast to uint16/uint8 and back is free and
    keeps the write an in-place copy of the new rows."""
    bits = _as_bits(cache)
    if bits is None:
        return jax.lax.dynamic_update_slice(cache, update, start)
    written = jax.lax.dynamic_update_slice(bits, _as_bits(update), start)
    return jax.lax.bitcast_convert_type(written, cache.dtype)


def _scatter_rows(cache, index, update):
    """`cache.at[index].set(update)`, on the cache's integers for a float cache (as
    `write_rows`: XLA CPU would run the bf16/fp8 scatter in f32 over the whole cache)."""
    bits = _as_bits(cache)
    if bits is None:
        return cache.at[index].set(update)
    return jax.lax.bitcast_convert_type(bits.at[index].set(_as_bits(update)), cache.dtype)


def attend_rows(q, kv, cache, layer: int, pos, kv_cache: str = "bf16"):
    """Decode attention where row r is at position pos[r] (one new token per row): each row
    writes its K/V at its own position and attends to its own prefix. The slots of a serving
    decode batch (workloads/serving/slots.py) hold requests at different points of their answers."""
    b, lq, hq, d = q.shape
    positions = pos[:, None] + jnp.arange(lq)[None, :]                  # [b, lq]
    q = rope(q, positions)
    kv = kv_quantize(jnp.stack([rope(kv[:, :, 0], positions), kv[:, :, 1]], axis=2), kv_cache)
    rows = jnp.arange(b)
    for i in range(lq):
        cache = _scatter_rows(cache, (layer, rows, positions[:, i]), kv[:, i].astype(cache.dtype))
    keys = kv_dequantize(cache[layer], kv_cache)
    hk = keys.shape[3]
    key_pos = jnp.arange(keys.shape[1])
    qg = q.reshape(b, lq, hk, hq // hk, d)
    scores = jnp.einsum("bqgrd,bkgd->bgrqk", qg, keys[:, :, 0], preferred_element_type=f32) * d ** -0.5
    mask = key_pos[None, None, :] <= positions[:, :, None]              # [b, lq, k]
    probs = jax.nn.softmax(jnp.where(mask[:, None, None], scores, -1e30), axis=-1)
    out = jnp.einsum("bgrqk,bkgd->bqgrd", probs.astype(bf16), keys[:, :, 1], preferred_element_type=f32)
    return out.astype(bf16).reshape(b, lq, hq, d), cache


def rope(x, positions):
    """Rotate-half RoPE on [b, L, heads, D] (same formula as the reference); positions
    [L], or [b, L] for per-row positions."""
    d = x.shape[-1]
    freqs = ROPE_BASE ** (-jnp.arange(0, d // 2, dtype=f32) / (d // 2))
    angles = positions.astype(f32)[..., None] * freqs          # [L, D/2] or per row [b, L, D/2]
    cos, sin = jnp.cos(angles)[..., None, :], jnp.sin(angles)[..., None, :]
    x1, x2 = jnp.split(x.astype(f32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(bf16)


# --------------------------------------------------------------------------- small helpers


def _heads(plan: Plan, x):
    """[b, L, heads·D] -> [b, L, heads, D]."""
    return x.reshape(x.shape[:-1] + (-1, plan.model.d_head))


def _flat(o):
    return o.reshape(o.shape[:-2] + (-1,))


def _kv_by_batch(plan: Plan) -> bool:
    """Batch-sharded attention with replicated K/V weights: project K/V per batch shard."""
    return plan.batch_attention and not plan.kv_split


def _project_kv(plan: Plan, h, w_kv):
    """h @ [W_k, W_v] -> [b, L, 2, heads, D] (K and V travel together: one collective)."""
    kv = at_least_two_rows(
        lambda rows: jnp.einsum("bli,sio->blso", rows, w_kv, preferred_element_type=f32), h)
    return kv.astype(bf16).reshape(kv.shape[:3] + (-1, plan.model.d_head))


def _heads_in_head_order(plan: Plan, x, axis: int):
    """After an all-to-all over R the head chunks arrive in mesh order of their source chip
    (x-major); head order is z-major (Plan.head_axes). A local transpose."""
    return _reverse_chunk_axes(plan, x, axis, plan.live(plan.rest))


def _heads_in_mesh_order(plan: Plan, x, axis: int):
    """The inverse, before sending the attention output back over R."""
    return _reverse_chunk_axes(plan, x, axis, plan.live(plan.head_axes))


def _reverse_chunk_axes(plan: Plan, x, axis: int, axes):
    """Dimension `axis` holds chunks indexed by `axes` (major first); reindex them by the
    same axes in reverse order."""
    if len(axes) < 2:
        return x
    sizes = [plan.sizes[a] for a in axes]
    shape = x.shape
    x = x.reshape(shape[:axis] + tuple(sizes) + (shape[axis] // math.prod(sizes),) + shape[axis + 1:])
    order = list(range(axis)) + [axis + i for i in reversed(range(len(sizes)))] + \
        list(range(axis + len(sizes), x.ndim))
    return x.transpose(order).reshape(shape)
