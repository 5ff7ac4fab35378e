"""Parameters of the PaLM-style decoder: names, shapes, deterministic init from a seed.

One unsharded pytree (bf16 numpy-backed jax arrays) shared by the reference and the
engine, which shards it into the stored layout (`workloads/partitioning.py`):

  embed       [V, E]         token embedding; also the unembedding when tied
  unembed     [E, V]         only when `tie_embeddings` is false
  final_norm  [E]            RMSNorm scale before the unembedding
  layers[i]:
    norm        [E]          parallel block: one norm feeds attention and MLP (paper §3.4)
    attn_norm, mlp_norm [E]  serial block: one norm each
    w_q [E, H*D]  w_k, w_v [E, K*D]  w_o [H*D, E]
    w_in [E, F] (gelu) or w_gate, w_up [E, F] (swiglu);  w_out [F, E]

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
    return ("w_gate", "w_up", "w_out") if model.mlp == "swiglu" else ("w_in", "w_out")


def layer_shapes(model: ModelConfig) -> dict[str, tuple[int, ...]]:
    e, f, h, k, d = model.d_model, model.d_ff, model.n_heads, model.n_kv_heads, model.d_head
    shapes: dict[str, tuple[int, ...]] = {}
    if model.block == "parallel":
        shapes["norm"] = (e,)
    else:
        shapes["attn_norm"] = (e,)
        shapes["mlp_norm"] = (e,)
    shapes.update(w_q=(e, h * d), w_k=(e, k * d), w_v=(e, k * d), w_o=(h * d, e))
    for name in mlp_weight_names(model):
        shapes[name] = (f, e) if name == "w_out" else (e, f)
    return shapes


def init_params(model: ModelConfig, seed: int) -> dict:
    """Deterministic bf16 weights: N(0, 1/fan_in) matrices, N(0, 1) embedding, norms ~ 1.

    A random model's next-token logits are nearly tied, so bf16 rounding differences between
    layouts would flip greedy tokens; here the residual stream keeps the current token's
    embedding, which makes every prediction confident (top-1 margin ~3 logit std).

    Norm scales are perturbed around 1 so that a mis-sharded norm scale changes the result.
    """
    check_model(model)
    rng = np.random.default_rng(seed)

    def normal(shape, std):
        return jnp.asarray(rng.standard_normal(shape, dtype=np.float32) * std, dtype=jnp.bfloat16)

    def norm_scale(e):
        return jnp.asarray(1.0 + 0.1 * rng.standard_normal(e, dtype=np.float32), dtype=jnp.bfloat16)

    params: dict = {"embed": normal((model.vocab, model.d_model), 1.0)}
    if not model.tie_embeddings:
        # The embedding of a fixed permutation of the vocabulary: like a tied model (which
        # predicts its current token), an untied one then makes confident predictions, here
        # "next = perm(current)", so greedy tokens are varied yet far from ties, and the
        # layouts' greedy tokens can be compared exactly despite bf16 rounding.
        params["unembed"] = params["embed"][rng.permutation(model.vocab)].T
    layers = []
    for _ in range(model.n_layers):
        layer = {}
        for name, shape in layer_shapes(model).items():
            layer[name] = norm_scale(shape[0]) if name.endswith("norm") else normal(shape, shape[0] ** -0.5)
        layers.append(layer)
    params["layers"] = layers
    params["final_norm"] = norm_scale(model.d_model)
    return params


def prompt_tokens(model: ModelConfig, batch: int, length: int, seed: int) -> np.ndarray:
    """Deterministic prompt [batch, length] int32 from a seed (independent of the weights' stream)."""
    rng = np.random.default_rng([seed, 1])
    return rng.integers(0, model.vocab, size=(batch, length), dtype=np.int32)
