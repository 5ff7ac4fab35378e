"""Head padding as the paper did it (§4: PaLM 540B's 48 heads padded to 64, "+18B
parameters ... a 3% MFU cost"): the knob, the cost model's accounting, and the engine,
whose padded model still equals the unpadded reference (padded heads are zero)."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import dataclasses  # noqa: E402
import re  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from workloads import costmodel as cm  # noqa: E402
from workloads.config import HARDWARE_PRESETS, MODEL_PRESETS, ConfigError, ModelConfig  # noqa: E402
from workloads.layouts import PhaseLayout, padded_head_count, pad_model, resolve_padding  # noqa: E402
from workloads.trial import TrialConfig  # noqa: E402

PALM, TPU_V4 = MODEL_PRESETS["palm-540b"], HARDWARE_PRESETS["tpu-v4"]
WS2D, WGXYZ = PhaseLayout("ws2d", "batch"), PhaseLayout("wg_xyz", "batch")
TORUS = (4, 4, 4)


def test_auto_pads_to_what_the_sharded_axes_need():
    assert padded_head_count(PALM, "auto", TORUS, WS2D, WS2D) == 64      # heads over 64 chips
    assert padded_head_count(PALM, "auto", TORUS, WGXYZ, WGXYZ) == 48    # stored (HD)_yz: 16 | 48
    assert padded_head_count(PALM, "none", TORUS, WS2D, WS2D) == 48
    assert padded_head_count(PALM, 96, TORUS, WS2D, WS2D) == 96
    gqa = ModelConfig("gqa", 64, 256, 2, 6, 2, 16, 64)                  # groups of 3 -> of 4
    assert padded_head_count(gqa, "auto", (2, 2, 1), WS2D, WS2D) == 8
    with pytest.raises(ConfigError, match="pad_heads"):
        padded_head_count(PALM, 40, TORUS, WS2D, WS2D)


def test_the_paper_padding_adds_18b_parameters_and_costs_mfu_not_flops():
    padded = resolve_padding(PALM, "auto", TORUS, WS2D, WS2D)
    assert padded.n_heads == 64 and padded.unpadded is PALM
    extra = cm.param_count(padded) - cm.param_count(PALM)
    assert 17.5e9 < extra < 18.5e9                                      # paper §4: "18B"
    # the same shapes as the hand-padded preset
    preset = MODEL_PRESETS["palm-540b-padded"]
    assert dataclasses.replace(padded, padded_from=None, name=preset.name) == preset
    # compute-bound prefill: the padded heads' FLOPs take time; MFU counts the unpadded model
    p = cm.predict_phase(padded, TPU_V4, 64, 512, "prefill", 2048, layout=WGXYZ, topology=TORUS)
    u = cm.predict_phase(PALM, TPU_V4, 64, 512, "prefill", 2048, layout=WGXYZ, topology=TORUS)
    assert p.flops == u.flops and p.executed_flops > u.executed_flops
    assert p.mfu < u.mfu and 0.01 < (u.mfu - p.mfu) / u.mfu < 0.05   # "about 3% MFU"
    assert p.weight_bytes_per_chip > u.weight_bytes_per_chip
    assert (p.heads, p.unpadded_heads, p.padding_params) == (64, 48, extra)


def test_a_trial_pads_by_default_and_says_so():
    trial = TrialConfig.from_dict(dict(model="palm-540b", chips=64, batch=64, topology="4x4x4"))
    assert trial.pad_heads == "auto" and trial.run_model.n_heads == 64
    assert trial.flat_params()["pad_heads"] == "auto"
    assert TrialConfig.from_dict(trial.to_dict()).run_model == trial.run_model
    with pytest.raises(ConfigError, match="n_heads"):
        TrialConfig.from_dict(dict(model="palm-540b", chips=64, batch=64, topology="4x4x4",
                                   pad_heads="none"))
    with pytest.raises(ConfigError, match="pad_heads: got 'some'"):
        TrialConfig.from_dict(dict(model="tiny", chips=8, batch=8, pad_heads="some"))
    m = cm.predict(trial, TPU_V4)
    assert m.extra["heads"] == 64 and m.extra["padding_params"] > 17e9


# --------------------------------------------------------------------------- engine


SIX = dict(d_model=64, d_ff=256, n_layers=2, n_heads=6, d_head=16, vocab=64)


@pytest.mark.parametrize("kv,weights,prefill,decode,topology", [
    (1, "bf16", ("ws2d", "head"), ("ws2d", "batch"), (2, 2, 1)),      # multiquery, 6 -> 8
    (2, "int8", ("wg_xy", "batch"), ("ws2d", "head"), (2, 2, 2)),     # grouped-query, groups 3 -> 4
    (6, "bf16", ("ws1d", "batch"), ("ws1d", "head"), (1, 2, 2)),      # multihead: K padded with H
])
def test_padded_engine_equals_the_unpadded_reference(kv, weights, prefill, decode, topology):
    from workloads.engine import Engine
    from workloads.model import init_params, prompt_tokens
    from workloads.reference import reference_generate

    model = ModelConfig("six-heads", n_kv_heads=kv, **SIX)
    trial = TrialConfig(model=model, chips=int(np.prod(topology)), batch=8, input_len=8,
                        decode_steps=4, topology=topology, weights=weights,
                        prefill=PhaseLayout(*prefill), decode=PhaseLayout(*decode))
    engine = Engine(trial)
    assert engine.model.n_heads == 8 and engine.model.unpadded == model
    # the padded heads are zero in the stored weights the engine runs
    w_o = np.asarray(engine._model_params["layers"][0]["w_o"]["q"] if weights == "int8"
                     else engine._model_params["layers"][0]["w_o"], np.float32)
    assert np.count_nonzero(np.abs(w_o).sum(axis=1) == 0) == 2 * model.d_head
    logits, tokens = engine.generate()
    params = init_params(model, 0)
    if weights == "int8":
        from workloads.quant import dequantize_params, quantize_params
        params = dequantize_params(quantize_params(params))
    ref_logits, ref_tokens = reference_generate(model, params, prompt_tokens(model, 8, 8, 0), 4)
    err = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b)))) for a, b in zip(logits, ref_logits))
    assert err <= 0.1, err
    np.testing.assert_array_equal(tokens, ref_tokens)


def test_pad_and_unpad_are_inverse():
    from workloads.model import init_params, pad_params, unpad_params

    model = ModelConfig("gqa", n_kv_heads=2, **SIX)
    padded = pad_model(model, 8)
    params = init_params(model, 0)
    back = unpad_params(pad_params(params, padded), padded)
    for a, b in zip(params["layers"], back["layers"]):
        for name in ("w_q", "w_o", "w_k", "w_v"):
            np.testing.assert_array_equal(np.asarray(a[name]), np.asarray(b[name]))


def test_trials_differing_only_in_padding_do_not_share_compiled_programs():
    from workloads.measure import cache_key
    from workloads.trial import TrialConfig

    base = {"model": "palm-540b", "chips": 64, "batch": 64, "topology": [4, 4, 4]}
    to64, to128 = (TrialConfig.from_dict(dict(base, pad_heads=n)) for n in (64, 128))
    assert (to64.run_model.n_heads, to128.run_model.n_heads) == (64, 128)
    assert cache_key(to64) != cache_key(to128)


# --------------------------------------------------------------------------- vocabulary (issue 20)


def test_a_vocabulary_that_does_not_split_is_padded_not_rejected():
    """vocab 50000 on 64 chips: the embedding is stored V_xyz, so unpadded every layout is
    rejected; padded to 50048 (Megatron/MaxText's practice) every layout gets an answer."""
    from workloads.layouts import padded_vocab_size, validate_layouts
    from workloads.recommend import recommend

    model = ModelConfig("v50k", d_model=4096, d_ff=16384, n_layers=4, n_heads=32, n_kv_heads=8,
                        d_head=128, vocab=50000)
    with pytest.raises(ConfigError, match="vocab"):
        validate_layouts(model, TORUS, WS2D, WS2D, 64)
    assert padded_vocab_size(model, "auto", 64) == 50048 and padded_vocab_size(model, "none", 64) == 50000
    with pytest.raises(ConfigError, match="pad_vocab"):
        padded_vocab_size(model, 50001, 64)
    run = resolve_padding(model, "auto", TORUS, WS2D, WS2D)
    assert run.vocab == 50048 and run.unpadded == model and run.n_heads == 64   # heads too (ws2d: 64)
    answer = recommend(model, TPU_V4, 64, 64, "decode", input_len=2048)
    assert answer.candidates and answer.best.prediction.fits
    assert not any("vocab" in r.reason for r in answer.rejected)
    # the padded tokens cost memory and unembedding FLOPs, not MFU (the unpadded model's FLOPs)
    padded = cm.predict_phase(run, TPU_V4, 64, 64, "decode", 2048, layout=WS2D, topology=TORUS)
    assert padded.executed_flops > padded.flops
    assert padded.flops == pytest.approx(64 * cm.model_flops_per_token(model, 2048))
    assert cm.param_breakdown(run)["embedding"] - cm.param_breakdown(model)["embedding"] == 48 * 4096


def test_pad_vocab_is_a_trial_field_the_cost_model_honours():
    """TrialConfig.pad_vocab (auto | none, default auto): vocab 50000 on 64 chips is answered
    under auto and refused under none, every layout naming the divisibility of the vocabulary."""
    from workloads.recommend import recommend

    model = ModelConfig("v50k", d_model=4096, d_ff=16384, n_layers=4, n_heads=32, n_kv_heads=8,
                        d_head=128, vocab=50000)
    base = dict(model=model, chips=64, batch=64, input_len=128, topology=TORUS,
                prefill=WS2D, decode=WS2D)
    auto = TrialConfig.from_dict(base)
    assert auto.pad_vocab == "auto" and auto.run_model.vocab == 50048
    assert cm.predict(auto, TPU_V4).decode_step_s > 0
    with pytest.raises(ConfigError, match=r"model.vocab.*multiple of chips=64"):
        TrialConfig.from_dict({**base, "pad_vocab": "none"})
    unpadded = TrialConfig.from_dict({**base, "pad_vocab": "none"}, validate=False)
    with pytest.raises(ConfigError, match=r"model.vocab.*multiple of chips=64"):
        cm.predict(unpadded, TPU_V4)                  # the cost model honours it too
    with pytest.raises(ConfigError, match="pad_vocab"):
        TrialConfig.from_dict({**base, "pad_vocab": "sometimes"})
    assert recommend(model, TPU_V4, 64, 64, "decode", input_len=2048, pad_vocab="auto").candidates
    with pytest.raises(ConfigError) as refused:
        recommend(model, TPU_V4, 64, 64, "decode", input_len=2048, pad_vocab="none")
    reasons = re.findall(r"(\w+/\w+) on 4x4x4: ([\w.]+): got (\w+)", str(refused.value))
    assert len(reasons) >= 2 and all(r[1:] == ("model.vocab", "50000") for r in reasons), reasons
    assert str(refused.value).count("expected a multiple of chips=64") == len(reasons)


def test_vocab_padded_engine_equals_the_unpadded_reference():
    """A 62-token vocabulary on 4 chips runs padded to 64: zero rows, masked logits, the
    reference's tokens exactly."""
    from workloads.engine import Engine
    from workloads.model import init_params, pad_params, prompt_tokens, unpad_params
    from workloads.reference import reference_generate

    model = ModelConfig("v62", n_kv_heads=1, **dict(SIX, n_heads=4, vocab=62))
    trial = TrialConfig(model=model, chips=4, batch=4, input_len=8, decode_steps=4,
                        topology=(1, 4, 1), prefill=PhaseLayout("ws2d", "head"),
                        decode=PhaseLayout("ws2d", "batch"))
    engine = Engine(trial)
    assert engine.model.vocab == 64 and engine.model.unpadded == model
    logits, tokens = engine.generate()
    params = init_params(model, 0)
    ref_logits, ref_tokens = reference_generate(model, params, prompt_tokens(model, 4, 8, 0), 4)
    err = max(float(np.max(np.abs(np.asarray(a)[..., :62] - np.asarray(b))))
              for a, b in zip(logits, ref_logits))
    assert err <= 0.1, err
    np.testing.assert_array_equal(tokens, ref_tokens)
    assert int(np.max(tokens)) < 62
    back = unpad_params(pad_params(params, engine.model), engine.model)
    np.testing.assert_array_equal(np.asarray(back["embed"]), np.asarray(params["embed"]))
