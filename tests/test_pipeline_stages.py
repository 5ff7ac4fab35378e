"""Pipeline stages on the emulated mesh (workloads/serving/pipeline.py, issue 38 item 4): the staged
engine's greedy tokens and logits are the unstaged engine's and the unsharded reference's;
the staged slot server serves requests through the serving loop with the reference's tokens;
a stage count the layers do not split into is one ConfigError line.

A 4-layer tiny model, so 2 and 4 stages both hold whole layers. The default run is three
engine cases and one served stream; the wider matrix is slow + ci_slow.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import dataclasses  # noqa: E402
import functools  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from workloads.config import MODEL_PRESETS, ConfigError  # noqa: E402
from workloads.engine import Engine  # noqa: E402
from workloads.layouts import PhaseLayout  # noqa: E402
from workloads.model import init_params, prompt_tokens  # noqa: E402
from workloads.quant import dequantize_params, quantize_params  # noqa: E402
from workloads.reference import reference_generate  # noqa: E402
from workloads.serving.pipeline import StagedEngine, StagedSlotServer, slot_server  # noqa: E402
from workloads.serving.profile import Request  # noqa: E402
from workloads.serving.slots import SlotServer, SlotSpec, reference_generation, serve_aggregated  # noqa: E402
from workloads.trial import TrialConfig  # noqa: E402

BATCH, INPUT_LEN, STEPS = 4, 8, 4
ATOL = 0.1          # as tests/test_engine_equivalence.py: bf16 rounding ~0.03, a bug O(1)
# Staged vs unstaged on the same per-stage mesh: the same per-chip layer programs, cut at
# layer boundaries. XLA CPU runs bf16 elementwise work in f32 inside one program and may skip
# a rounding that the cut (a bf16 residual stream handed over) makes, and a micro-batch's
# matmuls have other shapes: rounding-level differences, as large as the reference's (one
# stage, one micro-batch is bit-identical). A wrong stage or hand-over is O(1).
STAGE_ATOL = 0.05
LAYERS = 4


def four_layers(name: str):
    """A preset with 4 layers: tiny-serial (GQA, serial, swiglu, untied: varied tokens) or
    tiny (multiquery, parallel, gelu, tied: the last stage unembeds with the embedding)."""
    return dataclasses.replace(MODEL_PRESETS[name], name=f"{name}-4", n_layers=LAYERS)


def trial_for(model, topology, prefill, decode, weights, batch=BATCH):
    return TrialConfig(model=model, chips=int(np.prod(topology)), batch=batch,
                       input_len=INPUT_LEN, decode_steps=STEPS, topology=topology,
                       weights=weights, prefill=PhaseLayout(*prefill),
                       decode=PhaseLayout(*decode), seed=0)


@functools.lru_cache(maxsize=None)
def reference(model, weights: str, batch: int = BATCH):
    params = init_params(model, seed=0)
    if weights == "int8":
        params = dequantize_params(quantize_params(params))
    return reference_generate(model, params, prompt_tokens(model, batch, INPUT_LEN, seed=0), STEPS)


def max_error(a, b) -> float:
    return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y)))) for x, y in zip(a, b))


def assert_staged_matches(model, topology, prefill, decode, weights, stages, micro,
                          unstaged=True):
    trial = trial_for(model, topology, prefill, decode, weights)
    staged = StagedEngine(trial, stages, micro_batches=micro)
    assert [len(s.layers) for s in staged.stages] == [LAYERS // stages] * stages
    meshes = [set(s.mesh.devices.flat) for s in staged.stages]
    assert len(set().union(*meshes)) == stages * trial.chips       # disjoint device groups
    logits, tokens = staged.generate()
    assert len(logits) == STEPS + 1 and tokens.shape == (BATCH, STEPS + 1)

    ref_logits, ref_tokens = reference(model, weights)
    assert max_error(logits, ref_logits) <= ATOL
    np.testing.assert_array_equal(tokens, ref_tokens)

    if not unstaged:    # the default run: the reference only (an unstaged compile is seconds)
        return
    plain_logits, plain_tokens = Engine(trial).generate()     # one stage's mesh, all layers
    assert max_error(logits, plain_logits) <= STAGE_ATOL
    np.testing.assert_array_equal(tokens, plain_tokens)


# --------------------------------------------------------------------------- engine

FAST = [
    # model, topology (one stage), prefill, decode, weights, stages, micro-batches
    ("tiny", (2, 1, 1), ("ws2d", "head"), ("ws2d", "batch"), "int8", 2, 2),
    ("tiny-serial", (1, 1, 1), ("ws2d", "batch"), ("ws2d", "batch"), "bf16", 4, 4),
]


@pytest.mark.parametrize("name,topology,prefill,decode,weights,stages,micro", FAST)
def test_staged_engine_matches_reference(name, topology, prefill, decode, weights, stages, micro):
    assert_staged_matches(four_layers(name), topology, prefill, decode, weights, stages, micro,
                          unstaged=False)


SLOW = FAST + [
    ("tiny-serial", (1, 1, 1), ("ws1d", "head"), ("ws1d", "head"), "bf16", 2, 2),
    ("tiny-serial", (1, 2, 1), ("wg_xy", "batch"), ("ws2d", "head"), "int8", 2, 1),
    ("tiny-serial", (2, 1, 1), ("ws1d", "batch"), ("ws1d", "head"), "bf16", 4, 2),
    ("tiny", (1, 1, 2), ("wg_xyz", "head"), ("wg_x", "batch"), "bf16", 4, 1),
    ("tiny", (1, 1, 1), ("ws1d", "head"), ("ws1d", "head"), "int8", 4, 4),
    ("tiny-serial", (2, 2, 1), ("ws2d", "head"), ("ws2d", "batch"), "bf16", 2, 1),
]


@pytest.mark.slow
@pytest.mark.ci_slow
@pytest.mark.parametrize("name,topology,prefill,decode,weights,stages,micro", SLOW)
def test_staged_engine_matches_unstaged_and_reference(name, topology, prefill, decode, weights,
                                                      stages, micro):
    assert_staged_matches(four_layers(name), topology, prefill, decode, weights, stages, micro)


def test_the_comparison_sees_micro_batch_rows_and_each_stage_s_layers():
    """The checks above can fail: rows moved between micro-batches come back moved (each
    micro-batch's residual stream reaches the next stage as its own), and a stage running
    its layers in the wrong order gives logits off by more than the tolerance."""
    model = four_layers("tiny-serial")
    trial = trial_for(model, (1, 1, 1), ("ws1d", "head"), ("ws1d", "head"), "bf16")
    staged = StagedEngine(trial, 2, micro_batches=2)
    good, _ = staged.generate(steps=0)
    tokens = np.asarray(staged.input_tokens())
    swapped, _ = staged.generate(tokens=np.concatenate([tokens[2:], tokens[:2]]), steps=0)
    # rows swapped between micro-batches come back swapped, not mixed
    np.testing.assert_allclose(swapped[0], np.concatenate([good[0][2:], good[0][:2]]), atol=1e-6)
    stage = staged.stages[1]
    stage.params = {**stage.params, "layers": stage.params["layers"][::-1]}   # layer order
    broken, _ = staged.generate(steps=0)
    assert max_error(broken, good) > ATOL


# --------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("stages,accepted", [(3, "a divisor of the model's n_layers=4"),
                                             (5, "at most the model's n_layers=4"),
                                             (0, "a positive integer")])
def test_stage_counts_the_layers_do_not_split_into_are_refused(stages, accepted):
    trial = trial_for(four_layers("tiny"), (1, 1, 1), ("ws1d", "head"), ("ws1d", "head"), "bf16")
    with pytest.raises(ConfigError) as err:
        StagedEngine(trial, stages)
    assert err.value.field == "stages" and accepted in str(err.value)
    assert "\n" not in str(err.value)
    spec = SlotSpec(four_layers("tiny"), (1, 1, 1), PhaseLayout("ws1d", "head"),
                    PhaseLayout("ws1d", "head"))
    with pytest.raises(ConfigError) as err:
        slot_server(spec, stages)                  # the staged server for stages != 1
    assert err.value.field == "stages" and accepted in str(err.value)
    assert type(slot_server(spec, 1)) is SlotServer


def test_more_stages_than_devices_and_uneven_micro_batches_are_refused():
    trial = trial_for(four_layers("tiny"), (2, 2, 1), ("ws2d", "head"), ("ws2d", "head"), "bf16")
    with pytest.raises(ConfigError) as err:
        StagedEngine(trial, 4)                     # 4 x 4 chips on an 8-device host
    assert err.value.field == "stages" and "16" in str(err.value)
    with pytest.raises(ConfigError) as err:
        StagedEngine(trial, 2, micro_batches=3)
    assert err.value.field == "micro_batches" and "divisor of the batch 4" in str(err.value)


# --------------------------------------------------------------------------- serving


def served_tokens_match_reference(server, model, reqs, seed=0):
    prompts = {i: prompt_tokens(model, 1, r.input_len, seed=10 + i)[0] for i, r in enumerate(reqs)}
    served = serve_aggregated(server, reqs, lambda i: prompts[i])
    for i, (r, out) in enumerate(zip(reqs, served)):
        _, ref = reference_generation(model, seed, prompts[i], r.output_len - 1)
        assert out["tokens"] == [int(t) for t in ref], f"request {i}"
        assert out["finish_s"] >= out["first_token_s"]
    return served


def test_staged_slot_server_serves_the_reference_tokens():
    """Five requests of two prompt lengths through `serve_aggregated` on 2 stages x 1 chip
    (4 slots in 2 micro-batches): every request's tokens are the reference's."""
    model = four_layers("tiny-serial")
    server = StagedSlotServer(SlotSpec(model, (1, 1, 1), PhaseLayout("ws1d", "head"),
                                       PhaseLayout("ws2d", "batch"), slots=4, prefill_batch=2,
                                       context_len=16), stages=2, micro_batches=2)
    assert server.micro_batches == 2 and len(server.devices) == 2
    reqs = [Request(0.0, 8, 5), Request(0.0, 6, 3), Request(0.0, 8, 1), Request(0.0, 8, 6),
            Request(0.0, 6, 4)]
    served = served_tokens_match_reference(server, model, reqs)
    assert len({tuple(s["tokens"]) for s in served}) > 1          # the requests differ


@pytest.mark.slow
@pytest.mark.ci_slow
def test_staged_servers_hand_kv_over_and_warm_up():
    """Disaggregated without Ray: a 2-stage prefill server's logical KV export goes into a
    4-stage decode server (and back into a one-stage SlotServer), decoding the reference's
    tokens; warm_up times every program and the inter-stage transfer."""
    model = four_layers("tiny-serial")
    pre = StagedSlotServer(SlotSpec(model, (1, 1, 2), PhaseLayout("ws2d", "head"), None,
                                    prefill_batch=1, context_len=16), stages=2)
    dec = StagedSlotServer(SlotSpec(model, (1, 1, 1), None, PhaseLayout("ws1d", "head"),
                                    slots=4, context_len=16), stages=4)
    one = SlotServer(SlotSpec(model, (1, 1, 2), None, PhaseLayout("ws2d", "batch"), slots=2,
                              context_len=16))
    prompt = prompt_tokens(model, 1, 8, seed=4)
    done = pre.prefill(prompt)
    kv = pre.export_kv(done, 0)
    assert kv.shape[0] == LAYERS
    dec.insert(3, kv, 0, int(done.first_tokens[0]))
    one.insert(1, kv, 0, int(done.first_tokens[0]))
    first = int(done.first_tokens[0])
    staged = [first] + [int(dec.step()[3]) for _ in range(4)]
    plain = [first] + [int(one.step()[1]) for _ in range(4)]
    _, ref = reference_generation(model, 0, prompt[0], 4)
    assert staged == plain == [int(t) for t in ref]
    times = dec.warm_up(8, repeats=3)
    assert times["decode_step_s"] > 0 and times["transfer_s"] > 0
    assert pre.warm_up(8, repeats=3)["prefill_s"] > 0


def test_the_host_costs_are_measured_on_a_staged_server():
    """workloads/serving/hostcosts.py `measure_loop` (the validation benchmark's closed loop before
    its streams) on an aggregated 2-stage server: the engine's timed calls run every stage
    (`engine_prefill_call`, `engine_decode_call`: no SlotServer internals), and the loop's
    step and prefill are measured beside them; the slots still decode the reference's
    tokens afterwards."""
    from workloads.serving.hostcosts import engine_decode_call, engine_prefill_call, measure_loop

    model = four_layers("tiny-serial")
    server = StagedSlotServer(SlotSpec(model, (1, 1, 1), PhaseLayout("ws1d", "head"),
                                       PhaseLayout("ws1d", "head"), slots=2, prefill_batch=1,
                                       context_len=16), stages=2)
    server.warm_up(8, repeats=1)
    engine_prefill_call(server, 8)()
    engine_decode_call(server, 8)()
    out = measure_loop(server, 8, 4, rounds=1, blocks=1, min_block_s=0.0, wake_requests=2,
                       idle_gap_s=0.01, prefill_pairs=2)
    assert out["engine_prefill_s"] > 0 and out["engine_step_s"] > 0
    assert out["loop_step_s"] > 0 and out["loop_prefill_s"] > 0
    for slot in range(2):
        server.release(slot)
    served_tokens_match_reference(server, model, [Request(0.0, 8, 3), Request(0.0, 6, 2)])
