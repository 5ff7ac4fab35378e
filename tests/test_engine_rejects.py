"""Combinations a layout cannot run are rejected before anything is compiled, with a
ConfigError that names the field, the value and the constraint."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import dataclasses  # noqa: E402

import pytest  # noqa: E402

from workloads import engine as engine_module  # noqa: E402
from workloads.config import MODEL_PRESETS, ConfigError  # noqa: E402
from workloads.engine import Engine  # noqa: E402
from workloads.layouts import PhaseLayout  # noqa: E402
from workloads.trial import TrialConfig  # noqa: E402

TINY = MODEL_PRESETS["tiny"]


def trial(model=TINY, topology=(2, 2, 2), batch=8, prefill=("ws2d", "head"), decode=("ws2d", "head")):
    return TrialConfig(model=model, chips=topology[0] * topology[1] * topology[2], batch=batch,
                       input_len=4, decode_steps=2, topology=topology,
                       prefill=PhaseLayout(*prefill), decode=PhaseLayout(*decode))


def rejected(t) -> ConfigError:
    """Engine(t) raises ConfigError and builds no program."""
    before = engine_module._programs.cache_info()
    with pytest.raises(ConfigError) as info:
        Engine(t)
    after = engine_module._programs.cache_info()
    assert (after.hits, after.misses) == (before.hits, before.misses), "compiled before rejecting"
    return info.value


def test_batch_not_divisible_by_batch_sharding_degree():
    err = rejected(trial(batch=4, decode=("ws2d", "batch")))
    assert err.field == "batch" and err.value == 4
    assert "a multiple of chips=8 (batch-sharded attention splits the KV cache over all chips in decode)" in str(err)


def test_batch_not_divisible_by_weight_gathered_degree():
    err = rejected(trial(batch=2, topology=(2, 2, 1), prefill=("wg_xy", "head")))
    assert err.field == "batch" and err.value == 2
    assert "a multiple of 4 (wg_xy splits the batch over x·y=4 chips in prefill)" in str(err)


def test_heads_not_divisible():
    """Without padding (pad_heads none) 4 heads do not split over 8 chips; `auto`, the
    default, pads them to 8 instead (test_padding.py)."""
    model = dataclasses.replace(TINY, name="tiny-4-heads", n_heads=4, d_head=32)
    err = rejected(dataclasses.replace(trial(model=model), pad_heads="none"))
    assert err.field == "model.n_heads" and err.value == 4
    assert "a multiple of 8 (ws2d splits n_heads over axes x·y·z=8 in prefill)" in str(err)
    err = rejected(dataclasses.replace(trial(model=model), pad_heads=6))   # padded, still not 8
    assert err.field == "model.n_heads" and err.value == 6


def test_ws1d_mixed_with_another_layout_needs_x_equal_1():
    err = rejected(trial(topology=(2, 2, 1), prefill=("ws1d", "head"), decode=("ws2d", "head")))
    assert err.field == "topology" and err.value == "2x2x1"
    assert "X = 1 when ws1d is combined with another FFN layout" in str(err)


def test_unknown_ffn_layout():
    err = rejected(trial(prefill=("ws3d", "head")))
    assert err.field == "prefill.ffn" and err.value == "ws3d"
    assert "one of ['ws1d', 'ws2d', 'wg_x', 'wg_xy', 'wg_xyz']" in str(err)


def test_unknown_attention_layout():
    err = rejected(trial(decode=("ws2d", "sequence")))
    assert err.field == "decode.attn" and err.value == "sequence"
    assert "one of ['head', 'batch']" in str(err)


def test_more_chips_than_devices():
    model = dataclasses.replace(TINY, name="tiny-16-heads", n_heads=16, d_head=8)
    err = rejected(trial(model=model, topology=(4, 2, 2), batch=16))
    assert err.field == "topology" and "at most 8 chips on this host" in str(err)


def test_odd_head_dimension():
    model = dataclasses.replace(TINY, name="tiny-odd-head", d_head=15)
    err = rejected(trial(model=model))
    assert err.field == "model.d_head" and "an even number (RoPE rotates pairs)" in str(err)
