"""int8 weights: per-output-channel symmetric quantisation (paper §3.6, AQT).

A quantised weight is a dict {"q": int8 [..., in, out], "scale": float32 [..., out]} with
scale = max|w| over the input dimension / 127. It is stored and all-gathered as int8 and
turned back into bf16 right before its matmul (`dequantize`), so the arithmetic stays bf16
as in the paper ("the matmuls still use bfloat16 arithmetic"). The embedding is not
quantised (it is a lookup, and the paper quantises the layers' matmul weights).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from workloads.model import MATMUL_WEIGHTS


def quantize(w: jax.Array) -> dict:
    """[..., in, out] -> {"q": int8, "scale": f32 [..., out]}; symmetric, per output channel."""
    w32 = jnp.asarray(w, jnp.float32)
    scale = jnp.max(jnp.abs(w32), axis=-2) / 127.0
    scale = jnp.where(scale > 0, scale, 1.0)
    q = jnp.clip(jnp.round(w32 / scale[..., None, :]), -127, 127).astype(jnp.int8)
    return {"q": q, "scale": scale}


def dequantize(q: jax.Array, scale: jax.Array) -> jax.Array:
    """int8 [..., in, out] x f32 [..., out] -> bf16. The engine runs this same expression per shard."""
    return (q.astype(jnp.float32) * scale[..., None, :]).astype(jnp.bfloat16)


def is_quantized(leaf) -> bool:
    return isinstance(leaf, dict) and set(leaf) == {"q", "scale"}


def quantize_params(params: dict) -> dict:
    """Replace every layer matmul weight by its int8 form; everything else is unchanged."""
    layers = [{name: quantize(w) if name in MATMUL_WEIGHTS else w for name, w in layer.items()}
              for layer in params["layers"]]
    return {**params, "layers": layers}


def dequantize_params(params: dict) -> dict:
    """The bf16 weights an int8 model actually computes with: what the reference must run."""
    layers = [{name: dequantize(w["q"], w["scale"]) if is_quantized(w) else w for name, w in layer.items()}
              for layer in params["layers"]]
    return {**params, "layers": layers}


def max_logit_deviation(model, params: dict, tokens) -> float:
    """Max |logits(int8 weights) - logits(bf16 weights)| over every position of `tokens`.

    Both run on the single-device reference with the same token sequence (teacher forcing),
    so the number measures quantisation error only, never a diverged greedy path.
    """
    from workloads.reference import reference_forward

    exact = reference_forward(model, params, tokens)
    quantised = reference_forward(model, dequantize_params(quantize_params(params)), tokens)
    return float(jnp.max(jnp.abs(exact - quantised)))
