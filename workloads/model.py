"""Parameters of the PaLM-style decoder: names, shapes, deterministic init from a seed.

One unsharded pytree (bf16 NumPy arrays on the host) shared by the reference and the
engine, which shards it into the stored layout (`workloads/partitioning.py`):

  embed       [V, E]         token embedding; also the unembedding when tied
  unembed     [E, V]         only when `tie_embeddings` is false
  final_norm  [E]            RMSNorm scale before the unembedding
  layers[i]:
    norm        [E]          parallel block: one norm feeds attention and MLP (paper §3.4)
    attn_norm, mlp_norm [E]  serial block: one norm each
    w_q [E, H*D]  w_k, w_v [E, K*D]  w_o [H*D, E]
    w_in [E, F] (gelu) or w_gate, w_up [E, F] (swiglu, geglu);  w_out [F, E]
    mixture of experts (X experts): w_router [E, X], and every MLP matrix stacked per
    expert, w_gate [X, E, F] ... w_out [X, F, E]

Norms are RMSNorm (no mean subtraction, no bias; a simplification of PaLM's LayerNorm
that changes no layout). Positions are RoPE (rotate-half, base 10000).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from workloads.config import ConfigError, ModelConfig

# Every weight that is the right-hand side of a matmul inside a layer: what int8 quantises
# and what the weight-gathered layouts all-gather (the embedding stays bf16).
MATMUL_WEIGHTS = ("w_q", "w_k", "w_v", "w_o", "w_in", "w_gate", "w_up", "w_out")

ROPE_BASE = 10_000.0
NORM_EPS = 1e-6


def check_model(model: ModelConfig) -> None:
    """Constraints of this implementation (not of a layout)."""
    if model.d_head % 2:
        raise ConfigError("model.d_head", model.d_head, "an even number (RoPE rotates pairs)")


def mlp_weight_names(model: ModelConfig) -> tuple[str, ...]:
    return ("w_gate", "w_up", "w_out") if model.mlp_matrices == 3 else ("w_in", "w_out")


def layer_shapes(model: ModelConfig) -> dict[str, tuple[int, ...]]:
    e, f, h, k, d = model.d_model, model.d_ff, model.n_heads, model.n_kv_heads, model.d_head
    shapes: dict[str, tuple[int, ...]] = {}
    if model.block == "parallel":
        shapes["norm"] = (e,)
    else:
        shapes["attn_norm"] = (e,)
        shapes["mlp_norm"] = (e,)
    shapes.update(w_q=(e, h * d), w_k=(e, k * d), w_v=(e, k * d), w_o=(h * d, e))
    stack = (model.n_experts,) if model.moe else ()
    if model.moe:
        shapes["w_router"] = (e, model.n_experts)
    for name in mlp_weight_names(model):
        shapes[name] = stack + ((f, e) if name == "w_out" else (e, f))
    return shapes


def init_params(model: ModelConfig, seed: int) -> dict:
    """Deterministic bf16 weights: N(0, 1/fan_in) matrices, N(0, 1) embedding, norms ~ 1.

    NumPy arrays on the host (bf16 through ml_dtypes, which rounds to nearest even as XLA's
    convert does), as every weight helper here returns them: building and padding weights
    compiles nothing, and a caller places them where it computes (the engine on its mesh in
    one `device_put`; each JAX op here used to be a small compiled program, a dozen per
    process: docs/performance.md, "What a trial compiles").

    A random model's next-token logits are nearly tied, so bf16 rounding differences between
    layouts would flip greedy tokens; here the residual stream keeps the current token's
    embedding, which makes every prediction confident (top-1 margin ~3 logit std).

    Norm scales are perturbed around 1 so that a mis-sharded norm scale changes the result.
    """
    check_model(model)
    rng = np.random.default_rng(seed)

    def normal(shape, std):
        return (rng.standard_normal(shape, dtype=np.float32) * std).astype(jnp.bfloat16)

    def norm_scale(e):
        return (1.0 + 0.1 * rng.standard_normal(e, dtype=np.float32)).astype(jnp.bfloat16)

    params: dict = {"embed": normal((model.vocab, model.d_model), 1.0)}
    if not model.tie_embeddings:
        # The embedding of a fixed permutation of the vocabulary: like a tied model (which
        # predicts its current token), an untied one then makes confident predictions, here
        # "next = perm(current)", so greedy tokens are varied yet far from ties, and the
        # layouts' greedy tokens can be compared exactly despite bf16 rounding.
        params["unembed"] = np.ascontiguousarray(params["embed"][rng.permutation(model.vocab)].T)
    layers = []
    for _ in range(model.n_layers):
        layer = {}
        for name, shape in layer_shapes(model).items():
            layer[name] = norm_scale(shape[0]) if name.endswith("norm") else normal(shape, shape[-2] ** -0.5)
        layers.append(layer)
    params["layers"] = layers
    params["final_norm"] = norm_scale(model.d_model)
    return _routing_margins(model, params, rng) if model.moe else params


ROUTER_GAIN = 1.0      # router logit per unit of a routing feature (init_params, MoE)
ROUTING_LEVELS = 2.0   # routing features span [-2, 2]


def _routing_margins(model: ModelConfig, params: dict, rng) -> dict:
    """A mixture-of-experts model whose top-k choices hold by a wide margin, like the
    confident logits above: a random router's k-th and (k+1)-th logits are nearly tied for
    some tokens, so bf16 rounding differences between layouts would flip experts. Here the
    first X embedding features of each token are a permutation of X evenly spaced levels,
    no layer writes them (zero W_o and W_out columns), the norms scale them by 1 and the
    router reads feature j for expert j: every token's experts are its k highest levels,
    apart by 4/(X-1) feature units (before the norm's common scale), and they vary from
    token to token, so dispatch and combine are exercised with a non-trivial routing."""
    x = model.n_experts
    if x > model.d_model:
        raise ConfigError("model.n_experts", x, f"at most d_model={model.d_model} (the engine's "
                          "routing features, model.init_params)")
    levels = np.linspace(-ROUTING_LEVELS, ROUTING_LEVELS, x, dtype=np.float32)
    order = rng.random((model.vocab, x)).argsort(axis=1)
    embed = np.asarray(params["embed"], np.float32)
    embed[:, :x] = levels[order]
    router = np.zeros((model.d_model, x), np.float32)
    router[np.arange(x), np.arange(x)] = ROUTER_GAIN
    layers = []
    for layer in params["layers"]:
        layer = dict(layer)
        for name in [n for n in layer if n.endswith("norm")]:
            scale = np.asarray(layer[name], np.float32)
            scale[:x] = 1.0
            layer[name] = scale.astype(jnp.bfloat16)
        for name in ("w_o", "w_out"):
            w = np.asarray(layer[name], np.float32)
            w[..., :x] = 0.0
            layer[name] = w.astype(jnp.bfloat16)
        layer["w_router"] = router.astype(jnp.bfloat16)
        layers.append(layer)
    return {**params, "embed": embed.astype(jnp.bfloat16), "layers": layers}


def init_verification_params(model: ModelConfig, seed: int, copy_gain: float = 4.0,
                             sharpness: float = 16.0) -> dict:
    """Weights under which the next greedy token depends on the context, by construction,
    with wide margins (so comparing greedy tokens between layouts proves something):
    layer 0 is a *previous-token copy*: every head attends (one-hot) to position i-1 and
    copies its normed embedding, scaled by `copy_gain`, into the residual stream, so the
    model predicts the token BEFORE the current one. Removing attention (the model then
    predicts the current token) or corrupting the KV-cache entry of position i-1 changes
    the greedy tokens; test_engine_equivalence.py proves both.

    How: embedding dimension 0 is a constant, so W_q, W_k read a position-independent
    q, k from it; k is q rotated by one RoPE step per frequency pair, so after RoPE the score
    peaks at relative position 1 (sum_f cos((i - j - 1) theta_f)); `sharpness` sets the
    gap to the runner-up (~0.5 * sharpness^2 / sqrt(D) logits, 32 for D = 16). W_v = identity and
    W_o = copy_gain * identity need H·D = K·D = E (a multihead model such as tiny-mha).
    The other layers and the MLPs keep the default init, scaled down by 10, so every
    weight still reaches the logits (the logit tolerance checks them)."""
    e, h, k, d = model.d_model, model.n_heads, model.n_kv_heads, model.d_head
    if not (h == k and h * d == e and model.n_layers >= 1):
        raise ConfigError("model", model.name, "a multihead model with n_heads * d_head = "
                          "d_model (e.g. tiny-mha) for the previous-token verification init")
    params = init_params(model, seed)
    embed = np.asarray(params["embed"], np.float32)
    embed[:, 0] = 1.0                                  # the constant feature q and k read
    # Every row with RMS 1: the normed input's feature 0 is then the same for every token,
    # so the scores depend on relative position only.
    embed /= np.sqrt(np.mean(embed * embed, axis=1, keepdims=True))
    params["embed"] = embed.astype(jnp.bfloat16)
    half = d // 2
    theta = ROPE_BASE ** (-np.arange(half) / half)
    # Only the two fastest RoPE frequencies (theta 1 and 10^(-4/half)...): the score
    # sum_f cos((i - j - 1) theta_f) then has its runner-up 25% below the peak for the
    # contexts the tests use (<= 16; slower pairs would flatten it).
    amplitude = np.where(np.arange(half) < 2, sharpness, 0.0)
    q = np.concatenate([amplitude, np.zeros(half)])                          # (q1, q2) = (a, 0)
    key = np.concatenate([amplitude * np.cos(theta), amplitude * np.sin(theta)])  # q rotated by theta
    w_q, w_k = np.zeros((e, h * d), np.float32), np.zeros((e, k * d), np.float32)
    w_q[0] = np.tile(q, h)
    w_k[0] = np.tile(key, k)

    def small(w):
        return (np.asarray(w, np.float32) * 0.1).astype(jnp.bfloat16)

    layers = []
    for i, w in enumerate(params["layers"]):
        w = {name: (small(v) if name in ("w_o", "w_out", "w_in", "w_gate", "w_up") else v)
             for name, v in w.items()}
        if i == 0:
            w.update(w_q=w_q.astype(jnp.bfloat16), w_k=w_k.astype(jnp.bfloat16),
                     w_v=np.eye(e, k * d).astype(jnp.bfloat16),
                     w_o=(copy_gain * np.eye(h * d, e)).astype(jnp.bfloat16))
        layers.append(w)
    params["layers"] = layers
    return params


def _head_slots(model: ModelConfig) -> tuple[np.ndarray, np.ndarray]:
    """Positions of the real query heads and real KV heads in a padded model's head
    dimensions (layouts.pad_model: each KV group's first H/K query heads are real; a
    multihead model's first K KV heads are)."""
    base = model.unpadded
    group, padded_group = base.n_heads // base.n_kv_heads, model.n_heads // model.n_kv_heads
    q = np.array([g * padded_group + j for g in range(base.n_kv_heads) for j in range(group)]) \
        if model.n_kv_heads == base.n_kv_heads else np.arange(base.n_heads)
    return q, np.arange(base.n_kv_heads)


def _embed_heads(w, axis: int, slots: np.ndarray, padded: int, d_head: int):
    """Place the heads of `w` (head-major along `axis`, d_head each) at `slots` of
    `padded` heads; the others are zero (NumPy, as init_params)."""
    w = np.asarray(w, np.float32)
    shape = list(w.shape)
    heads = shape[axis] // d_head
    split = w.reshape(shape[:axis] + [heads, d_head] + shape[axis + 1:])
    out = np.zeros(shape[:axis] + [padded, d_head] + shape[axis + 1:], np.float32)
    index = [slice(None)] * out.ndim
    index[axis] = slots
    out[tuple(index)] = split
    return out.reshape(shape[:axis] + [padded * d_head] + shape[axis + 1:]).astype(jnp.bfloat16)


def pad_params(params: dict, model: ModelConfig) -> dict:
    """Unpadded model weights -> the head-padded `model`'s (paper §4): padded query heads
    get zero W_q columns and zero W_o rows, so they add nothing to the residual stream;
    a multihead model's padded KV heads get zero W_k, W_v columns."""
    base = model.unpadded
    params = _pad_vocab(params, model)
    if model is base or model.n_heads == base.n_heads:
        return params
    q_slots, kv_slots = _head_slots(model)
    d = model.d_head
    layers = []
    for w in params["layers"]:
        w = dict(w)
        w["w_q"] = _embed_heads(w["w_q"], 1, q_slots, model.n_heads, d)
        w["w_o"] = _embed_heads(w["w_o"], 0, q_slots, model.n_heads, d)
        if model.n_kv_heads != base.n_kv_heads:
            for name in ("w_k", "w_v"):
                w[name] = _embed_heads(w[name], 1, kv_slots, model.n_kv_heads, d)
        layers.append(w)
    return {**params, "layers": layers}


def _pad_vocab(params: dict, model: ModelConfig) -> dict:
    """Padded tokens (layouts.padded_vocab_size): zero embedding rows and zero unembedding
    columns; their logits are masked before the argmax (never generated) and never input."""
    extra = model.vocab - model.unpadded.vocab
    if extra <= 0 or params["embed"].shape[0] == model.vocab:
        return params
    out = dict(params)
    embed = np.asarray(params["embed"])
    out["embed"] = np.concatenate([embed, np.zeros((extra, embed.shape[1]), embed.dtype)])
    if "unembed" in params:
        unembed = np.asarray(params["unembed"])
        out["unembed"] = np.concatenate([unembed, np.zeros((unembed.shape[0], extra), unembed.dtype)],
                                        axis=1)
    return out


def unpad_params(params: dict, model: ModelConfig) -> dict:
    """The inverse of pad_params: the real heads' and tokens' weights only (for the reference)."""
    base = model.unpadded
    if model.vocab != base.vocab:
        params = {**params, "embed": params["embed"][:base.vocab]}
        if "unembed" in params:
            params["unembed"] = params["unembed"][:, :base.vocab]
    if model is base or model.n_heads == base.n_heads:
        return params
    q_slots, kv_slots = _head_slots(model)
    d = model.d_head

    def take(w, axis, slots, heads):
        w = np.asarray(w)
        shape = list(w.shape)
        split = w.reshape(shape[:axis] + [heads, d] + shape[axis + 1:])
        kept = np.take(split, slots, axis=axis)
        return kept.reshape(shape[:axis] + [len(slots) * d] + shape[axis + 1:])

    layers = []
    for w in params["layers"]:
        w = dict(w)
        w["w_q"] = take(w["w_q"], 1, q_slots, model.n_heads)
        w["w_o"] = take(w["w_o"], 0, q_slots, model.n_heads)
        if model.n_kv_heads != base.n_kv_heads:
            for name in ("w_k", "w_v"):
                w[name] = take(w[name], 1, kv_slots, model.n_kv_heads)
        layers.append(w)
    return {**params, "layers": layers}


def prompt_tokens(model: ModelConfig, batch: int, length: int, seed: int) -> np.ndarray:
    """Deterministic prompt [batch, length] int32 from a seed (independent of the weights' stream)."""
    rng = np.random.default_rng([seed, 1])
    return rng.integers(0, model.unpadded.vocab, size=(batch, length), dtype=np.int32)  # real tokens
