"""The KV cache's formats (`kv_cache`, docs/models.md "Precision"): bf16; FP8, each element
cast to float8_e4m3fn (saturating, scale 1, as a serving engine's uncalibrated FP8 cache);
int8, each (token, head) vector of D values symmetric with its own bf16 scale, stored in the
vector's last two bytes ([..., D + 2] int8), so the cache stays one array whose layout and
sharding are the bf16 cache's. Attention reads K and V back at the cache's precision in both
phases (workloads/partitioning.py), so the reference applies the same rounding
(`kv_round_trip`, workloads/reference.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from workloads.layouts import KV_FORMATS  # noqa: F401 (the formats, named where they are made)

FP8 = jnp.float8_e4m3fn
FP8_MAX = 448.0                 # float8_e4m3fn's largest finite value


def kv_dtype(fmt: str):
    """The cache array's element type."""
    return {"bf16": jnp.bfloat16, "fp8": FP8, "int8": jnp.int8}[fmt]


def kv_width(fmt: str, d_head: int) -> int:
    """The cache's last dimension: D, or D + 2 for int8 (its bf16 scale's two bytes)."""
    return d_head + 2 if fmt == "int8" else d_head


def kv_quantize(x: jax.Array, fmt: str) -> jax.Array:
    """K or V [..., D] (bf16) -> the cache's form [..., kv_width]."""
    if fmt == "bf16":
        return x.astype(jnp.bfloat16)
    x32 = x.astype(jnp.float32)
    if fmt == "fp8":
        return jnp.clip(x32, -FP8_MAX, FP8_MAX).astype(FP8)
    scale = (jnp.max(jnp.abs(x32), axis=-1, keepdims=True) / 127.0).astype(jnp.bfloat16)
    scale = jnp.where(scale > 0, scale, jnp.bfloat16(1.0))
    q = jnp.clip(jnp.round(x32 / scale.astype(jnp.float32)), -127, 127).astype(jnp.int8)
    scale_bytes = jax.lax.bitcast_convert_type(scale, jnp.int8).reshape(x.shape[:-1] + (2,))
    return jnp.concatenate([q, scale_bytes], axis=-1)


def kv_dequantize(stored: jax.Array, fmt: str) -> jax.Array:
    """The cache's form [..., kv_width] -> bf16 [..., D]."""
    if fmt == "bf16":
        return stored
    if fmt == "fp8":
        return stored.astype(jnp.bfloat16)
    scale = jax.lax.bitcast_convert_type(stored[..., -2:], jnp.bfloat16)       # [...]
    return (stored[..., :-2].astype(jnp.float32) * scale.astype(jnp.float32)[..., None]
            ).astype(jnp.bfloat16)


def kv_round_trip(x: jax.Array, fmt: str) -> jax.Array:
    """K or V as attention reads it back from a cache of format `fmt` (the reference's)."""
    return x if fmt == "bf16" else kv_dequantize(kv_quantize(x, fmt), fmt)
