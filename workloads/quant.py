"""8-bit weights and KV cache (paper §3.6, AQT; docs/models.md "Precision").

Weights: int8 or FP8 (float8_e4m3fn), per-output-channel symmetric quantisation. A quantised
weight is a dict {"q": int8 or float8 [..., in, out], "scale": float32 [..., out]} with scale =
max|w| over the input dimension / 127 (int8) or / 448 (FP8's largest finite value). It is
stored and all-gathered in 8 bits and turned back into bf16 right before its matmul
(`dequantize`), so the arithmetic stays bf16 as in the paper ("the matmuls still use bfloat16
arithmetic"): on a chip with FP8 units a serving engine would multiply in FP8 (the cost model
prices that, workloads/costmodel.py); the engine emulates FP8 weights on XLA CPU, which has no
FP8 matmul, and says so (workloads/measure.py). The embedding is not quantised (it is a lookup,
and the paper quantises the layers' matmul weights); neither is an MoE router.

The KV cache's 8-bit formats are workloads/kvcache.py's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from workloads.model import MATMUL_WEIGHTS

WEIGHT_MAX = {"int8": 127.0, "fp8": 448.0}
QUANTIZED = tuple(WEIGHT_MAX)              # weight formats stored in 8 bits with scales
FP8 = jnp.float8_e4m3fn
FP8_MAX = WEIGHT_MAX["fp8"]     # float8_e4m3fn's largest finite value


def quantize(w: jax.Array, fmt: str = "int8") -> dict:
    """[..., in, out] -> {"q": int8 or fp8, "scale": f32 [..., out]}; symmetric, per output channel."""
    w32 = jnp.asarray(w, jnp.float32)
    scale = jnp.max(jnp.abs(w32), axis=-2) / WEIGHT_MAX[fmt]
    scale = jnp.where(scale > 0, scale, 1.0)
    scaled = w32 / scale[..., None, :]
    if fmt == "fp8":
        return {"q": jnp.clip(scaled, -FP8_MAX, FP8_MAX).astype(FP8), "scale": scale}
    return {"q": jnp.clip(jnp.round(scaled), -127, 127).astype(jnp.int8), "scale": scale}


def dequantize(q: jax.Array, scale: jax.Array) -> jax.Array:
    """int8/fp8 [..., in, out] x f32 [..., out] -> bf16. The engine runs this same expression per shard."""
    return (q.astype(jnp.float32) * scale[..., None, :]).astype(jnp.bfloat16)


def is_quantized(leaf) -> bool:
    return isinstance(leaf, dict) and set(leaf) == {"q", "scale"}


def quantize_params(params: dict, fmt: str = "int8") -> dict:
    """Replace every layer matmul weight by its 8-bit form; everything else is unchanged."""
    layers = [{name: quantize(w, fmt) if name in MATMUL_WEIGHTS else w for name, w in layer.items()}
              for layer in params["layers"]]
    return {**params, "layers": layers}


def dequantize_params(params: dict) -> dict:
    """The bf16 weights an 8-bit model actually computes with: what the reference must run."""
    layers = [{name: dequantize(w["q"], w["scale"]) if is_quantized(w) else w for name, w in layer.items()}
              for layer in params["layers"]]
    return {**params, "layers": layers}


def weights_as_run(params: dict, fmt: str) -> dict:
    """The bf16 weights a trial of weight format `fmt` computes with (the reference's)."""
    return dequantize_params(quantize_params(params, fmt)) if fmt in QUANTIZED else params


def max_logit_deviation(model, params: dict, tokens, fmt: str = "int8") -> float:
    """Max |logits(8-bit weights) - logits(bf16 weights)| over every position of `tokens`.

    Both run on the single-device reference with the same token sequence (teacher forcing),
    so the number measures quantisation error only, never a diverged greedy path.
    """
    from workloads.reference import reference_forward

    exact = reference_forward(model, params, tokens)
    quantised = reference_forward(model, weights_as_run(params, fmt), tokens)
    return float(jnp.max(jnp.abs(exact - quantised)))
