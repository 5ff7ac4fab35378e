"""The model on one device, unsharded, no KV cache: the engine's ground truth.

Written to be checked by eye against the paper (§2, §3.4) and nanoGPT: a decoder-only
Transformer with RMSNorm, RoPE, multihead / multiquery / grouped-query attention, a
parallel or serial block, and a dense or mixture-of-experts (top-k routed) MLP. Generation recomputes the whole (causal) sequence every step,
so it shares no cache logic with the engine.

Numerics (the engine follows the same policy): bf16 activations and weights, matmuls
accumulate in f32 and round to bf16; norms, softmax and logits in f32.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from workloads.config import ModelConfig
from workloads.model import NORM_EPS, ROPE_BASE
from workloads.kvcache import kv_round_trip

f32, bf16 = jnp.float32, jnp.bfloat16


def linear(x, w):
    return jnp.einsum("...i,io->...o", x, w, preferred_element_type=f32).astype(bf16)


def rms_norm(x, scale):
    x = x.astype(f32)
    x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + NORM_EPS)
    return (x * scale.astype(f32)).astype(bf16)


def rope(x, positions):
    """Rotate-half RoPE. x: [B, L, heads, D]; positions: [L]."""
    d = x.shape[-1]
    freqs = ROPE_BASE ** (-jnp.arange(0, d // 2, dtype=f32) / (d // 2))
    angles = positions.astype(f32)[:, None] * freqs[None, :]          # [L, D/2]
    cos, sin = jnp.cos(angles)[:, None, :], jnp.sin(angles)[:, None, :]
    x1, x2 = jnp.split(x.astype(f32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(bf16)


def mlp(model: ModelConfig, p, x):
    if model.mlp == "swiglu":
        h = jax.nn.silu(linear(x, p["w_gate"]).astype(f32)) * linear(x, p["w_up"]).astype(f32)
    elif model.mlp == "geglu":
        h = jax.nn.gelu(linear(x, p["w_gate"]).astype(f32)) * linear(x, p["w_up"]).astype(f32)
    else:
        h = jax.nn.gelu(linear(x, p["w_in"]).astype(f32))
    return linear(h.astype(bf16), p["w_out"])


def mixture_of_experts(model: ModelConfig, p, x):
    """Top-k routing (Mixtral): softmax over the router's logits, the k most probable
    experts, their probabilities renormalised as gates; the output is the gate-weighted sum
    of the chosen experts' MLPs. Every expert is run on every token and weighted by its
    gate (0 when not chosen): slow, and plainly the definition."""
    logits = jnp.einsum("bte,ex->btx", x, p["w_router"], preferred_element_type=f32)
    top, chosen = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), model.experts_per_token)
    gates = top / jnp.sum(top, axis=-1, keepdims=True)
    out = jnp.zeros(x.shape, f32)
    for expert in range(model.n_experts):
        gate = jnp.sum(jnp.where(chosen == expert, gates, 0.0), axis=-1)        # [B, T]
        weights = {name: p[name][expert] for name in ("w_in", "w_gate", "w_up", "w_out") if name in p}
        out = out + gate[..., None] * mlp(model, weights, x).astype(f32)
    return out.astype(bf16)


def feed_forward(model: ModelConfig, p, x):
    return mixture_of_experts(model, p, x) if model.moe else mlp(model, p, x)


def attention(model: ModelConfig, p, x, kv_cache: str = "bf16"):
    b, t, _ = x.shape
    h, k, d = model.n_heads, model.n_kv_heads, model.d_head
    positions = jnp.arange(t)
    q = rope(linear(x, p["w_q"]).reshape(b, t, h, d), positions)
    key = rope(linear(x, p["w_k"]).reshape(b, t, k, d), positions)
    value = linear(x, p["w_v"]).reshape(b, t, k, d)
    # K and V as a KV cache of this format holds them (workloads/quant.py): the engine's
    # attention reads them back at that precision
    key, value = kv_round_trip(key, kv_cache), kv_round_trip(value, kv_cache)
    # Grouped-query attention: query head i reads key/value head i // (H/K).
    key, value = jnp.repeat(key, h // k, axis=2), jnp.repeat(value, h // k, axis=2)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, key, preferred_element_type=f32) * d ** -0.5
    causal = jnp.tril(jnp.ones((t, t), bool))
    probs = jax.nn.softmax(jnp.where(causal, scores, -1e30), axis=-1)
    out = jnp.einsum("bhqk,bkhd->bqhd", probs.astype(bf16), value, preferred_element_type=f32)
    return linear(out.astype(bf16).reshape(b, t, h * d), p["w_o"])


def block(model: ModelConfig, p, x, kv_cache: str = "bf16"):
    if model.block == "parallel":   # paper §3.4: y = x + Attn(norm(x)) + MLP(norm(x))
        h = rms_norm(x, p["norm"])
        return x + attention(model, p, h, kv_cache) + feed_forward(model, p, h)
    x = x + attention(model, p, rms_norm(x, p["attn_norm"]), kv_cache)
    return x + feed_forward(model, p, rms_norm(x, p["mlp_norm"]))


@functools.partial(jax.jit, static_argnums=(0, 3))
def reference_forward(model: ModelConfig, params, tokens, kv_cache: str = "bf16"):
    """Logits [B, L, V] (f32) at every position of tokens [B, L]; `kv_cache`: K and V
    rounded as a cache of that format holds them (bf16, int8, fp8)."""
    x = params["embed"][tokens]
    for p in params["layers"]:
        x = block(model, p, x, kv_cache)
    x = rms_norm(x, params["final_norm"])
    unembed = params["embed"].T if model.tie_embeddings else params["unembed"]
    return jnp.einsum("ble,ev->blv", x, unembed, preferred_element_type=f32) * model.d_model ** -0.5


def reference_generate(model: ModelConfig, params, tokens, steps: int, kv_cache: str = "bf16"):
    """Greedy generation: (logits per step, tokens [B, steps + 1]).

    Step 0 is the prompt's last position (what prefill returns), steps 1..steps are the
    decode steps; each step's argmax is appended to the sequence. The sequence is padded
    to its final length once, which causality makes invisible to earlier positions.
    """
    tokens = np.asarray(tokens, np.int32)
    b, prompt_len = tokens.shape
    seq = np.zeros((b, prompt_len + steps), np.int32)
    seq[:, :prompt_len] = tokens
    all_logits, generated = [], []
    for i in range(steps + 1):
        logits = reference_forward(model, params, jnp.asarray(seq), kv_cache)[:, prompt_len - 1 + i]
        token = np.asarray(jnp.argmax(logits, axis=-1), np.int32)
        all_logits.append(logits)
        generated.append(token)
        if i < steps:
            seq[:, prompt_len + i] = token
    return all_logits, np.stack(generated, axis=1)
