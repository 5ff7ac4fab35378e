"""Every layout gives the reference's logits (bf16 tolerance) and its greedy tokens.

The engine runs on an emulated mesh of 8 CPU devices; the reference runs the same
(dequantised, for int8) weights unsharded on one device without a KV cache. The default
run covers every layout function, each attention kind, both blocks, int8, a phase switch
with a KV-cache handoff and a 2x2x2 mesh; the full matrix is marked `slow`.
"""

import os

# Emulated chips: must be set before JAX is imported (the lead may move this to conftest).
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import dataclasses  # noqa: E402
import functools  # noqa: E402
import itertools  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from workloads.config import MODEL_PRESETS, ConfigError  # noqa: E402
from workloads.engine import Engine  # noqa: E402
from workloads.layouts import ATTN_LAYOUTS, FFN_LAYOUTS, PhaseLayout, validate_layouts  # noqa: E402
from workloads.model import init_params, prompt_tokens  # noqa: E402
from workloads.quant import dequantize_params, max_logit_deviation, quantize_params  # noqa: E402
from workloads.reference import reference_generate  # noqa: E402
from workloads.trial import TrialConfig  # noqa: E402

BATCH, INPUT_LEN, STEPS = 8, 8, 8
# Logits have std ~1.1 and top-1 margins ~3 (see model.init_params); a layout's bf16
# rounding differs from the reference's by ~0.03, a wrong layout by O(1).
ATOL = 0.1
TOPOLOGIES = [(1, 1, 1), (2, 1, 1), (2, 2, 1), (2, 2, 2)]
KINDS = {"multiquery": "tiny", "multihead": "tiny-mha", "grouped-query": "tiny-gqa"}


def model_for(kind: str, block: str):
    """Parallel: the gelu, tied-embedding preset; serial: the same attention with swiglu and
    untied embeddings (as tiny-serial), so both MLPs and both embeddings are covered."""
    model = MODEL_PRESETS[KINDS[kind]]
    if block == "serial":
        model = dataclasses.replace(model, name=f"{model.name}-serial", block="serial",
                                    mlp="swiglu", tie_embeddings=False)
    return model


def trial_for(model, topology, prefill, decode, weights, experts="tp"):
    return TrialConfig(model=model, chips=int(np.prod(topology)), batch=BATCH, input_len=INPUT_LEN,
                       decode_steps=STEPS, topology=topology, weights=weights,
                       prefill=PhaseLayout(*prefill), decode=PhaseLayout(*decode), seed=0,
                       experts=experts)


@functools.lru_cache(maxsize=None)
def reference(model, weights: str):
    """Reference logits and tokens; the same for every layout of one model and weight format."""
    params = init_params(model, seed=0)
    if weights == "int8":
        params = dequantize_params(quantize_params(params))
    return reference_generate(model, params, prompt_tokens(model, BATCH, INPUT_LEN, seed=0), STEPS)


def assert_matches_reference(trial):
    engine = Engine(trial)
    logits, tokens = engine.generate()
    ref_logits, ref_tokens = reference(trial.model, trial.weights)
    err = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b)))) for a, b in zip(logits, ref_logits))
    assert len(logits) == STEPS + 1
    assert err <= ATOL, f"max |logit - reference| = {err:.4f} > {ATOL}"
    np.testing.assert_array_equal(tokens, ref_tokens)
    return err


def is_valid(trial) -> bool:
    try:
        validate_layouts(trial.model, trial.topology, trial.prefill, trial.decode, trial.batch,
                         experts=trial.experts)
    except ConfigError:
        return False
    return True


# --------------------------------------------------------------------------- default subset

REPRESENTATIVE = [
    # kind, block, weights, topology, prefill, decode
    ("multiquery", "parallel", "bf16", (2, 2, 2), ("ws2d", "head"), ("ws2d", "batch")),
    ("multihead", "parallel", "int8", (2, 2, 1), ("wg_xy", "head"), ("ws2d", "batch")),
    ("grouped-query", "serial", "bf16", (2, 2, 2), ("wg_xyz", "batch"), ("wg_x", "head")),
    ("grouped-query", "parallel", "int8", (1, 2, 2), ("ws1d", "batch"), ("ws2d", "head")),
    ("multiquery", "serial", "bf16", (2, 1, 1), ("ws1d", "head"), ("ws1d", "batch")),
]


def test_representative_subset_covers_every_layout():
    """The default subset exercises every FFN and attention layout, in both phases."""
    seen_ffn = {layout[0] for case in REPRESENTATIVE for layout in case[4:]}
    seen_attn = {layout[1] for case in REPRESENTATIVE for layout in case[4:]}
    assert seen_ffn == set(FFN_LAYOUTS) and seen_attn == set(ATTN_LAYOUTS)
    assert {c[0] for c in REPRESENTATIVE} == set(KINDS) and {c[1] for c in REPRESENTATIVE} == {"parallel", "serial"}
    assert "int8" in {c[2] for c in REPRESENTATIVE} and (2, 2, 2) in {c[3] for c in REPRESENTATIVE}


@pytest.mark.parametrize("kind,block,weights,topology,prefill,decode", REPRESENTATIVE,
                         ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) and isinstance(v[0], int)
                         else "/".join(v) if isinstance(v, tuple) else str(v))
def test_layout_matches_reference(kind, block, weights, topology, prefill, decode):
    trial = trial_for(model_for(kind, block), topology, prefill, decode, weights)
    assert_matches_reference(trial)


def test_int8_logit_deviation_is_reported_and_small():
    model = MODEL_PRESETS["tiny"]
    params = init_params(model, seed=0)
    tokens = prompt_tokens(model, BATCH, INPUT_LEN, seed=0)
    deviation = max_logit_deviation(model, params, tokens)
    # Quantisation changes the weights (so the logits) but by little: per-channel int8 keeps
    # ~0.4% relative weight error; the logits' std is ~1.1.
    assert 0.0 < deviation < 0.25, deviation


# --------------------------------------------------------------------------- mixture of experts
# tiny-moe: a tiny Mixtral (serial block, SwiGLU, 8 query heads over 2 KV heads, 4 experts of
# F 256, top-2). Its parallel-block variant has a GELU MLP and tied embeddings.


def moe_model(block: str):
    model = MODEL_PRESETS["tiny-moe"]
    if block == "parallel":
        model = dataclasses.replace(model, name="tiny-moe-parallel", block="parallel", mlp="gelu",
                                    tie_embeddings=True)
    return model


MOE_REPRESENTATIVE = [
    # block, weights, experts, topology, prefill, decode
    ("serial", "bf16", "tp", (2, 2, 1), ("ws2d", "head"), ("ws2d", "batch")),
    ("serial", "int8", "ep", (1, 2, 2), ("wg_xy", "batch"), ("ws1d", "head")),
    ("serial", "bf16", "ep", (2, 2, 1), ("wg_x", "head"), ("wg_xyz", "batch")),
    ("parallel", "bf16", "ep", (1, 4, 1), ("ws1d", "batch"), ("ws2d", "head")),
    ("parallel", "int8", "tp", (2, 1, 2), ("wg_x", "batch"), ("ws2d", "head")),
]


def test_moe_subset_covers_both_expert_layouts_and_every_ffn_layout():
    seen = {layout[0] for case in MOE_REPRESENTATIVE for layout in case[4:]}
    assert seen == set(FFN_LAYOUTS) and {c[2] for c in MOE_REPRESENTATIVE} == {"tp", "ep"}


@pytest.mark.parametrize("block,weights,experts,topology,prefill,decode", MOE_REPRESENTATIVE,
                         ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) and isinstance(v[0], int)
                         else "/".join(v) if isinstance(v, tuple) else str(v))
def test_moe_layout_matches_reference(block, weights, experts, topology, prefill, decode):
    assert_matches_reference(trial_for(moe_model(block), topology, prefill, decode, weights, experts))


def test_moe_routing_is_varied_and_the_experts_reach_the_logits():
    """The check can fail: every expert is chosen by some tokens, and swapping two experts'
    weights moves the reference's logits by far more than the tolerance."""
    import jax.numpy as jnp

    from workloads.reference import reference_forward

    model = moe_model("serial")
    params = init_params(model, seed=0)
    tokens = prompt_tokens(model, BATCH, INPUT_LEN, seed=0)
    x = np.asarray(params["embed"], np.float32)[tokens]
    chosen = np.argsort(x[..., :model.n_experts] @ np.asarray(params["layers"][0]["w_router"],
                                                                np.float32)[:model.n_experts],
                        axis=-1)[..., -model.experts_per_token:]
    assert set(np.unique(chosen)) == set(range(model.n_experts))
    swapped = {**params, "layers": [{**w, **{n: w[n][[1, 0, 2, 3]] for n in ("w_gate", "w_up", "w_out")}}
                                    for w in params["layers"]]}
    exact = reference_forward(model, params, jnp.asarray(tokens))
    moved = reference_forward(model, swapped, jnp.asarray(tokens))
    assert float(jnp.max(jnp.abs(exact - moved))) > 10 * ATOL


# --------------------------------------------------------------------------- full matrix
# The whole matrix is 480 layouts x models x meshes and 90 phase switches, ~5 s each on 2
# cores (~48 min): more than CI's budget. CI runs a pairwise-covering subset of each
# (`pairwise`): every pair of values of any two factors that occurs in the matrix occurs in
# at least one case run (each layout on every mesh, with every model kind, block and weight
# format; each prefill layout's FFN and attention with each decode layout's), the classic
# covering argument that a fault triggered by two settings together is caught; the cases
# left out differ from a case run only in a third factor. `SWEEPER_FULL_MATRIX=1` runs the
# whole matrix (`make test-all` with it set). The MoE matrix (tiny-moe, tp and ep experts)
# is run the same way.

FULL = os.environ.get("SWEEPER_FULL_MATRIX", "") not in ("", "0")


def pairwise(cases: list[tuple]) -> list[tuple]:
    """A subset of `cases` (tuples of factor values) in which every pair of values that two
    factors take together in some case appears together in a chosen case: greedy (each step
    takes the first case covering the most pairs not yet covered), so deterministic."""
    def pairs(case):
        return {(i, case[i], j, case[j]) for i, j in itertools.combinations(range(len(case)), 2)}

    uncovered = set().union(*(pairs(c) for c in cases))
    chosen = []
    while uncovered:
        best = max(cases, key=lambda c: len(pairs(c) & uncovered))
        chosen.append(best)
        uncovered -= pairs(best)
    return chosen


def _matrix_cases() -> list[tuple]:
    """(topology, kind, block, weights, (ffn, attn)) of every valid case of the matrix."""
    cases = []
    for topology, kind, block, weights in itertools.product(TOPOLOGIES, KINDS, ("parallel", "serial"),
                                                            ("bf16", "int8")):
        for layout in itertools.product(FFN_LAYOUTS, ATTN_LAYOUTS):
            if is_valid(trial_for(model_for(kind, block), topology, layout, layout, weights)):
                cases.append((topology, kind, block, weights, layout))
    return cases


def _switch_cases() -> list[tuple]:
    """(prefill ffn, prefill attn, decode ffn, decode attn) of every valid phase switch."""
    model = model_for("grouped-query", "parallel")
    layouts = list(itertools.product(FFN_LAYOUTS, ATTN_LAYOUTS))
    return [(*pre, *dec) for pre, dec in itertools.product(layouts, layouts)
            if pre != dec and is_valid(trial_for(model, (1, 2, 2), pre, dec, "bf16"))]


def _full_matrix():
    cases = _matrix_cases()
    for topology, kind, block, weights, (ffn, attn) in (cases if FULL else pairwise(cases)):
        trial = trial_for(model_for(kind, block), topology, (ffn, attn), (ffn, attn), weights)
        yield pytest.param(trial, id=f"{'x'.join(map(str, topology))}-{kind}-{block}-{weights}-{ffn}-{attn}")


def _moe_matrix_cases() -> list[tuple]:
    """(topology, block, weights, experts, (ffn, attn)) of every valid MoE case (tiny-moe)."""
    cases = []
    for topology, block, weights, experts in itertools.product(
            TOPOLOGIES, ("parallel", "serial"), ("bf16", "int8"), ("tp", "ep")):
        for layout in itertools.product(FFN_LAYOUTS, ATTN_LAYOUTS):
            if is_valid(trial_for(moe_model(block), topology, layout, layout, weights, experts)):
                cases.append((topology, block, weights, experts, layout))
    return cases


def _moe_matrix():
    cases = _moe_matrix_cases()
    for topology, block, weights, experts, (ffn, attn) in (cases if FULL else pairwise(cases)):
        trial = trial_for(moe_model(block), topology, (ffn, attn), (ffn, attn), weights, experts)
        yield pytest.param(trial, id=f"{'x'.join(map(str, topology))}-moe-{block}-{weights}-"
                           f"{experts}-{ffn}-{attn}")


@pytest.mark.ci_slow
@pytest.mark.parametrize("trial", list(_moe_matrix()))
def test_moe_matrix_matches_reference(trial):
    assert_matches_reference(trial)


def _phase_switches():
    """Prefill layouts with other decode layouts, on one mesh that allows ws1d mixing."""
    model = model_for("grouped-query", "parallel")
    cases = _switch_cases()
    for pre_ffn, pre_attn, dec_ffn, dec_attn in (cases if FULL else pairwise(cases)):
        trial = trial_for(model, (1, 2, 2), (pre_ffn, pre_attn), (dec_ffn, dec_attn), "bf16")
        yield pytest.param(trial, id=f"{pre_ffn}/{pre_attn}->{dec_ffn}/{dec_attn}")


def test_the_ci_subsets_cover_every_pair_of_the_matrix():
    """The pairwise subsets CI runs leave no pair of factor values of the whole matrix (and
    of the phase switches) untested, and are a small part of it."""
    for cases in (_matrix_cases(), _switch_cases(), _moe_matrix_cases()):
        chosen = pairwise(cases)
        for i, j in itertools.combinations(range(len(cases[0])), 2):
            assert {(c[i], c[j]) for c in cases} == {(c[i], c[j]) for c in chosen}, (i, j)
        assert len(chosen) < len(cases) / 2
    for cases in (_matrix_cases(), _moe_matrix_cases()):
        layouts = {c[4] for c in pairwise(cases)}
        assert layouts == set(itertools.product(FFN_LAYOUTS, ATTN_LAYOUTS))


@pytest.mark.ci_slow
@pytest.mark.parametrize("trial", list(_full_matrix()))
def test_full_matrix_matches_reference(trial):
    assert_matches_reference(trial)


@pytest.mark.ci_slow
@pytest.mark.parametrize("trial", list(_phase_switches()))
def test_phase_switch_matches_reference(trial):
    assert_matches_reference(trial)


@pytest.mark.parametrize("kind", ["multiquery", "grouped-query", "multihead"])
@pytest.mark.parametrize("ffn", ["ws2d", "wg_x", "wg_xy"])
def test_kv_cache_placement(kind, ffn):
    """Per-chip KV cache of each attention layout (from its sharding; nothing is compiled):
    batch-sharded holds 1/n of the cache, head-sharded multiquery all of it, and both agree
    with the cost model's placement."""
    from workloads.costmodel import kv_bytes_per_chip

    model, topology = model_for(kind, "parallel"), (2, 2, 2)
    engine = Engine(trial_for(model, topology, (ffn, "head"), (ffn, "batch"), "bf16"))
    whole = 2 * model.n_layers * BATCH * engine.trial.context_len * model.n_kv_heads * model.d_head * 2
    per_chip = {}
    for phase, attn in (("prefill", "head"), ("decode", "batch")):
        struct = engine.cache_struct(phase)
        per_chip[attn] = int(np.prod(struct.sharding.shard_shape(struct.shape))) * 2   # bf16
        assert per_chip[attn] == kv_bytes_per_chip(model, 8, BATCH, engine.trial.context_len, attn,
                                                   topology, ffn)
    assert per_chip["batch"] == whole // 8
    if kind == "multiquery" and ffn == "ws2d":
        assert per_chip["head"] == whole


# --------------------------------------------------------------------------- verification that can fail
# With the default init every prediction is the current token (confident, so greedy tokens
# compare exactly) but attention never changes an argmax: greedy equality alone would pass a
# broken attention. model.init_verification_params makes layer 0 a previous-token copy, so
# the greedy tokens depend on the context; these tests prove the check can fail.

VERIFY = MODEL_PRESETS["tiny-mha"]


def _greedy(model, params):
    return reference_generate(model, params, prompt_tokens(model, BATCH, INPUT_LEN, seed=0), STEPS)


def _without_attention(params):
    return {**params, "layers": [{**w, "w_o": w["w_o"] * 0} for w in params["layers"]]}


@pytest.mark.parametrize("block", ["parallel", "serial"])
def test_removing_attention_changes_the_greedy_tokens(block):
    from workloads.model import init_verification_params

    model = model_for("multihead", block)
    params = init_verification_params(model, seed=0)
    logits, tokens = _greedy(model, params)
    _, tokens_without = _greedy(model, _without_attention(params))
    assert (tokens != tokens_without).mean() > 0.3, (tokens, tokens_without)
    # and the predictions stay confident, so layouts' bf16 rounding cannot flip them
    top2 = [np.sort(np.asarray(step), axis=-1)[:, -2:] for step in logits]
    assert min(float(np.min(t[:, 1] - t[:, 0])) for t in top2) > 1.0
    # the default init would not have noticed (the observation)
    _, default = _greedy(model, init_params(model, seed=0))
    _, default_without = _greedy(model, _without_attention(init_params(model, seed=0)))
    assert (default == default_without).all()


@pytest.mark.parametrize("prefill,decode,topology", [
    (("ws2d", "head"), ("ws2d", "batch"), (2, 2, 2)),
    (("wg_xy", "batch"), ("ws1d", "head"), (1, 2, 2)),
])
def test_sharded_engine_matches_the_reference_under_the_verification_init(prefill, decode, topology):
    from workloads.model import init_verification_params

    params = init_verification_params(VERIFY, seed=0)
    trial = trial_for(VERIFY, topology, prefill, decode, "bf16")
    logits, tokens = Engine(trial, params=params).generate()
    ref_logits, ref_tokens = _greedy(VERIFY, params)
    err = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b)))) for a, b in zip(logits, ref_logits))
    assert err <= ATOL, err
    np.testing.assert_array_equal(tokens, ref_tokens)


def test_corrupting_one_kv_cache_entry_changes_the_next_token():
    """Decode step 1 attends (layer 0) to the last prompt position: negating that one
    position's V in the cache changes every sequence's next token; the intact cache gives
    the reference's."""
    import jax.numpy as jnp

    from workloads.model import init_verification_params

    params = init_verification_params(VERIFY, seed=0)
    engine = Engine(trial_for(VERIFY, (2, 2, 2), ("ws2d", "head"), ("ws2d", "batch"), "bf16"),
                    params=params)
    logits, cache = engine.prefill(engine.params, engine.input_tokens())
    cache = engine.handoff(cache)
    token = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    last = INPUT_LEN - 1
    corrupted = jax.device_put(cache.at[0, :, last, 1].multiply(-1), engine.cache_sharding("decode"))
    _, ref_tokens = _greedy(VERIFY, params)
    bad_logits, _ = engine.decode(engine.params, corrupted, token, INPUT_LEN)
    good_logits, _ = engine.decode(engine.params, cache, token, INPUT_LEN)
    np.testing.assert_array_equal(np.asarray(jnp.argmax(good_logits, -1)), ref_tokens[:, 1])
    assert (np.asarray(jnp.argmax(bad_logits, -1)) != ref_tokens[:, 1]).all()


def test_emulated_devices_available():
    assert len(jax.devices()) >= 8
