"""FP8 weights and 8-bit KV caches on the engine (docs/models.md "Precision").

The reference runs the same 8-bit weights dequantised and rounds K and V as a cache of the
trial's format holds them (`reference_forward(..., kv_cache)`), so a layout is checked like
the bf16 ones: logits within 0.1 and the same greedy tokens.
"""

import os
import re

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from workloads import kvcache  # noqa: E402
from workloads.config import MODEL_PRESETS  # noqa: E402
from workloads.engine import Engine  # noqa: E402
from workloads.layouts import PhaseLayout  # noqa: E402
from workloads.measure import FP8_LABEL, run_trial  # noqa: E402
from workloads.model import init_params, prompt_tokens  # noqa: E402
from workloads.quant import quantize, weights_as_run  # noqa: E402
from workloads.reference import reference_generate  # noqa: E402
from workloads.trial import TrialConfig  # noqa: E402

BATCH, INPUT_LEN, STEPS, ATOL = 8, 8, 8, 0.1

CASES = [
    # model, topology, prefill, decode, weights, kv_cache, experts
    ("tiny-gqa", (2, 2, 1), ("ws2d", "head"), ("ws2d", "batch"), "fp8", "bf16", "tp"),
    ("tiny-gqa", (2, 2, 1), ("wg_xy", "head"), ("ws2d", "batch"), "bf16", "int8", "tp"),
    ("tiny-mha", (2, 2, 2), ("wg_xyz", "head"), ("ws2d", "batch"), "int8", "fp8", "tp"),
    ("tiny-moe", (1, 2, 2), ("wg_xy", "batch"), ("ws1d", "head"), "fp8", "fp8", "ep"),
]


@pytest.mark.parametrize("name,topology,prefill,decode,weights,kv_cache,experts", CASES,
                         ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) and isinstance(v[0], int)
                         else "/".join(v) if isinstance(v, tuple) else str(v))
def test_8bit_weights_and_kv_cache_match_the_reference(name, topology, prefill, decode, weights,
                                                       kv_cache, experts):
    model = MODEL_PRESETS[name]
    trial = TrialConfig(model=model, chips=int(np.prod(topology)), batch=BATCH, input_len=INPUT_LEN,
                        decode_steps=STEPS, topology=topology, weights=weights, kv_cache=kv_cache,
                        prefill=PhaseLayout(*prefill), decode=PhaseLayout(*decode),
                        experts=experts).validate()
    engine = Engine(trial)
    logits, tokens = engine.generate()
    params = weights_as_run(init_params(model, 0), weights)
    ref_logits, ref_tokens = reference_generate(model, params, prompt_tokens(model, BATCH, INPUT_LEN, 0),
                                                STEPS, kv_cache)
    err = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b)))) for a, b in zip(logits, ref_logits))
    assert err <= ATOL
    np.testing.assert_array_equal(tokens, ref_tokens)
    cache = engine.cache_struct("decode")
    assert cache.dtype == kvcache.kv_dtype(kv_cache)
    assert cache.shape[-1] == model.d_head + (2 if kv_cache == "int8" else 0)


def test_the_cache_format_changes_the_logits():
    """The comparison can fail: the bf16 reference differs from an int8-cache engine by more
    than bf16 rounding, and the round trip itself keeps each vector within its scale."""
    model = MODEL_PRESETS["tiny-gqa"]
    params = init_params(model, 0)
    tokens = prompt_tokens(model, BATCH, INPUT_LEN, 0)
    exact, _ = reference_generate(model, params, tokens, 2, "bf16")
    rounded, _ = reference_generate(model, params, tokens, 2, "fp8")
    assert max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(exact, rounded)) > 0.01
    x = jnp.asarray(np.random.default_rng(0).normal(size=(4, 16)), jnp.bfloat16).astype(jnp.float32)
    back = kvcache.kv_round_trip(x.astype(jnp.bfloat16), "int8").astype(jnp.float32)
    scale = jnp.max(jnp.abs(x), axis=-1, keepdims=True) / 127
    # half a quantisation step (scale rounded to bf16) plus the bf16 rounding of the result
    assert bool(jnp.all(jnp.abs(back - x) <= 0.51 * scale + jnp.abs(x) * 2.0 ** -8))


def test_fp8_weights_keep_their_channel_scales():
    w = np.random.default_rng(1).normal(size=(3, 16, 8)).astype(np.float32) * np.linspace(0.1, 10, 8)
    q = quantize(w, "fp8")
    assert q["q"].dtype == jnp.float8_e4m3fn and q["scale"].shape == (3, 8)
    assert float(jnp.max(jnp.abs(q["q"].astype(jnp.float32)))) == pytest.approx(448.0)


def test_a_measured_fp8_trial_says_fp8_is_emulated_and_matches_the_reference():
    trial = TrialConfig.from_dict(dict(model="tiny", chips=2, batch=4, input_len=8, decode_steps=4,
                                       weights="fp8", kv_cache="fp8", repeats=1, warmup=0,
                                       time_budget_s=0, prefill={"ffn": "ws1d"},
                                       decode={"ffn": "ws1d"}))
    m = run_trial(trial, verify=True)
    assert m.extra["fp8"] == FP8_LABEL and "emulated" in FP8_LABEL
    assert m.tokens_match is True and m.extra["fp8_max_logit_dev"] > 0


@pytest.mark.parametrize("kv_cache", ["bf16", "int8", "fp8"])
def test_a_decode_step_writes_its_cache_in_place_in_every_format(kv_cache):
    """XLA CPU runs a bf16 or fp8 dynamic-update-slice in f32, converting the WHOLE cache
    to f32 and back on every layer of every step (partitioning.write_rows): each format's
    compiled decode writes its cache as integers of its width and never makes an f32/f16
    copy of the whole cache (reading one layer back to bf16, fused with its slice, is fine)."""
    trial = TrialConfig(model=MODEL_PRESETS["tiny-gqa"], chips=2, batch=BATCH, input_len=INPUT_LEN,
                        decode_steps=STEPS, topology=(2, 1, 1), kv_cache=kv_cache,
                        prefill=PhaseLayout("ws1d", "head"), decode=PhaseLayout("ws1d", "head")).validate()
    engine = Engine(trial)
    cache = engine.cache_struct("decode")
    local = ",".join(map(str, cache.sharding.shard_shape(cache.shape)))
    hlo = engine.lowered()["decode"].compile().as_text()
    writes = [line for line in hlo.splitlines() if "dynamic-update-slice(" in line and f"[{local}]" in line]
    assert writes, "no cache write found"
    assert all(line.split("= ", 1)[1].startswith(("u16[", "u8[", "s8[")) for line in writes), writes
    # an instruction whose own result is the whole cache in f32/f16 (an op of a program, or
    # the root of a fused computation): the whole-cache conversion the integer write avoids.
    # Inside a fusion such a convert is computed only where the fusion's output (one layer's
    # slice) needs it.
    whole = re.compile(rf"= f(32|16)\[{local}\]")
    materialised = [line for fused, body in _computations(hlo) for line in body
                    if whole.search(line) and (not fused or line.lstrip().startswith("ROOT"))]
    assert not materialised, materialised


def _computations(hlo: str):
    """(fused?, instruction lines) of each computation of an HLO module's text."""
    out, fused, body = [], False, None
    for line in hlo.splitlines():
        if line and not line[0].isspace() and line.rstrip().endswith("{"):
            body = []
            fused = line.lstrip("%").startswith(("fused", "fusion"))
            out.append((fused, body))
        elif body is not None and line.startswith("  "):
            body.append(line)
    return out
