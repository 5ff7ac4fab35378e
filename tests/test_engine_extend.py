"""The engine's extend program (workloads/engine.py `Engine.extend`, issue 38 item 4): a
prompt prefilled (b) in chunks, a ragged last chunk padded to the chunk size, or (c) from a
cached prefix's KV plus an extend of the rest, then decoded, gives (a) whole-prompt
prefill's logits (bf16 tolerance) and greedy tokens, and the unsharded reference's tokens.

The default run covers 1, 2 and 4 emulated chips, ws1d/ws2d/wg_* FFN, head and batch
attention, bf16 and int8 weights; the bigger matrix is slow + ci_slow.
"""

import dataclasses
import functools

import numpy as np
import pytest

from workloads.config import MODEL_PRESETS, ConfigError
from workloads.engine import Engine, decode_loop
from workloads.layouts import PhaseLayout, validate_layouts
from workloads.model import init_params, prompt_tokens
from workloads.quant import dequantize_params, quantize_params
from workloads.reference import reference_generate
from workloads.trial import TrialConfig

BATCH, INPUT_LEN, STEPS = 4, 12, 6
ATOL = 0.1     # as tests/test_engine_equivalence.py: bf16 rounding ~0.03, a wrong cache O(1)


def model_for(name: str, block: str = "parallel"):
    model = MODEL_PRESETS[name]
    if block == "serial":
        model = dataclasses.replace(model, name=f"{model.name}-serial", block="serial",
                                    mlp="swiglu", tie_embeddings=False)
    return model


def trial_for(model, topology, prefill, decode, weights="bf16"):
    return TrialConfig(model=model, chips=int(np.prod(topology)), batch=BATCH,
                       input_len=INPUT_LEN, decode_steps=STEPS, topology=topology,
                       weights=weights, prefill=PhaseLayout(*prefill),
                       decode=PhaseLayout(*decode), seed=0)


@functools.lru_cache(maxsize=None)
def reference_tokens(model, weights: str) -> np.ndarray:
    params = init_params(model, seed=0)
    if weights == "int8":
        params = dequantize_params(quantize_params(params))
    _, tokens = reference_generate(model, params, prompt_tokens(model, BATCH, INPUT_LEN, seed=0),
                                   STEPS)
    return np.asarray(tokens)


def then_decode(engine: Engine, logits, cache):
    """Greedy decode after a prefill's last logits and cache (prefill layout), as
    `Engine.generate` does: (logits per step, tokens [B, STEPS + 1])."""
    cache = engine.handoff(cache)
    token = engine.greedy(logits)
    run = decode_loop(engine.decode, engine.greedy, engine.params, cache, token,
                      engine.positions(STEPS), keep_logits=True)
    tokens = np.stack([np.asarray(t) for t in [token] + run.tokens], axis=1)
    return [logits] + run.logits, tokens


def chunked(engine: Engine, prompt: np.ndarray, chunk: int):
    """(b) The prompt in chunks of `chunk` tokens from an empty cache; a ragged last chunk
    padded with zeros to the chunk size (one program), its last real token's logits."""
    cache = engine.empty_cache()
    for pos in range(0, prompt.shape[1], chunk):
        take = min(chunk, prompt.shape[1] - pos)
        tokens = np.zeros((prompt.shape[0], chunk), np.int32)
        tokens[:, :take] = prompt[:, pos:pos + take]
        logits, cache = engine.extend(engine.params, cache, tokens, pos, take - 1)
    return then_decode(engine, logits, cache)


def prefix_cached(engine: Engine, prompt: np.ndarray, prefix_len: int):
    """(c) The prefix's KV (an extend from position 0), then an extend of the rest."""
    _, cache = engine.extend(engine.params, engine.empty_cache(), prompt[:, :prefix_len], 0)
    logits, cache = engine.extend(engine.params, cache, prompt[:, prefix_len:], prefix_len)
    return then_decode(engine, logits, cache)


def assert_three_ways_agree(trial, chunk: int, prefix_len: int) -> None:
    engine = Engine(trial)
    prompt = np.asarray(prompt_tokens(trial.model, BATCH, INPUT_LEN, seed=0))
    whole_logits, whole_tokens = engine.generate()
    np.testing.assert_array_equal(whole_tokens, reference_tokens(trial.model, trial.weights))
    for name, (logits, tokens) in (("chunked", chunked(engine, prompt, chunk)),
                                   ("prefix-cached", prefix_cached(engine, prompt, prefix_len))):
        assert len(logits) == STEPS + 1
        err = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
                  for a, b in zip(logits, whole_logits))
        assert err <= ATOL, f"{name}: max |logit - whole prefill's| = {err:.4f} > {ATOL}"
        np.testing.assert_array_equal(tokens, whole_tokens, err_msg=name)


FAST = [
    # model, block, weights, topology, prefill, decode, chunk, prefix_len
    ("tiny", "parallel", "bf16", (1, 1, 1), ("ws2d", "head"), ("ws2d", "head"), 5, 7),
    ("tiny-gqa", "serial", "int8", (1, 1, 2), ("ws1d", "batch"), ("ws2d", "head"), 5, 4),
    ("tiny-mha", "parallel", "bf16", (2, 2, 1), ("wg_xy", "head"), ("ws2d", "batch"), 7, 9),
]


def _id(v):
    if isinstance(v, tuple):
        return "x".join(map(str, v)) if isinstance(v[0], int) else "/".join(v)
    return str(v)


@pytest.mark.parametrize("name,block,weights,topology,prefill,decode,chunk,prefix_len", FAST,
                         ids=_id)
def test_chunked_and_prefix_cached_prefill_match_whole_prefill(name, block, weights, topology,
                                                               prefill, decode, chunk, prefix_len):
    assert_three_ways_agree(trial_for(model_for(name, block), topology, prefill, decode, weights),
                            chunk, prefix_len)


def test_a_wrong_prefix_cache_changes_the_answer():
    """The check can fail: extending from a cache whose prefix is another prompt's gives
    logits far from the whole prompt's."""
    trial = trial_for(model_for("tiny-serial"), (1, 1, 2), ("ws2d", "head"), ("ws2d", "head"))
    engine = Engine(trial)
    prompt = np.asarray(prompt_tokens(trial.model, BATCH, INPUT_LEN, seed=0))
    other = np.asarray(prompt_tokens(trial.model, BATCH, INPUT_LEN, seed=5))
    whole, _ = engine.prefill(engine.params, prompt)
    _, cache = engine.extend(engine.params, engine.empty_cache(), other[:, :6], 0)
    wrong, _ = engine.extend(engine.params, cache, prompt[:, 6:], 6)
    assert float(np.max(np.abs(np.asarray(wrong) - np.asarray(whole)))) > 10 * ATOL


def test_extend_rejects_what_it_cannot_run():
    """Tokens past the cache's positions, a `last` outside the tokens and a mixture-of-
    experts model: one ConfigError line naming the field (nothing compiled)."""
    trial = trial_for(model_for("tiny"), (1, 1, 1), ("ws2d", "head"), ("ws2d", "head"))
    engine = Engine(trial)
    cache = engine.empty_cache()
    tokens = np.zeros((BATCH, 4), np.int32)
    with pytest.raises(ConfigError, match="pos"):
        engine.extend(engine.params, cache, tokens, INPUT_LEN + STEPS - 3)
    with pytest.raises(ConfigError, match="last"):
        engine.extend(engine.params, cache, tokens, 0, 4)
    moe = Engine(trial_for(MODEL_PRESETS["tiny-moe"], (1, 1, 1), ("ws2d", "head"),
                           ("ws2d", "head")))
    with pytest.raises(ConfigError, match="moe"):
        moe.extend(moe.params, moe.empty_cache(), tokens, 0)


# --------------------------------------------------------------------------- the bigger matrix

MATRIX_LAYOUTS = [("ws1d", "head"), ("ws1d", "batch"), ("ws2d", "head"), ("ws2d", "batch"),
                  ("wg_x", "head"), ("wg_xy", "batch"), ("wg_xyz", "head")]
MATRIX_TOPOLOGIES = [(1, 1, 1), (1, 1, 2), (2, 2, 1)]


def _matrix():
    """Each prefill layout on 1, 2 and 4 chips, bf16 and int8 alternating, the three
    attention kinds in turn, chunks of 1, 5 and 8 tokens (every one ragged at 12)."""
    kinds = ["tiny", "tiny-gqa", "tiny-mha"]
    cases = []
    for n, (layout, topology) in enumerate((l, t) for l in MATRIX_LAYOUTS for t in MATRIX_TOPOLOGIES):
        weights = "int8" if n % 2 else "bf16"
        model = model_for(kinds[n % 3], "serial" if n % 4 == 1 else "parallel")
        trial = trial_for(model, topology, layout, ("ws2d", "batch" if n % 2 else "head"), weights)
        try:
            validate_layouts(trial.model, topology, trial.prefill, trial.decode, BATCH)
        except ConfigError:
            continue
        chunk = (1, 5, 8)[n % 3]
        cases.append(pytest.param(trial, chunk, 1 + n % (INPUT_LEN - 1),
                                  id=f"{model.name}-{weights}-{_id(topology)}-{_id(layout)}-c{chunk}"))
    return cases


@pytest.mark.slow
@pytest.mark.ci_slow
@pytest.mark.parametrize("trial,chunk,prefix_len", _matrix())
def test_matrix_chunked_and_prefix_cached_match_whole_prefill(trial, chunk, prefix_len):
    assert_three_ways_agree(trial, chunk, prefix_len)
