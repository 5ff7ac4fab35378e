"""recommend(): every layout evaluated or rejected with its reason; an error only when no
layout is valid; degenerate layouts (a gather over size-1 axes) are one program."""

import pytest

from workloads import costmodel as cm
from workloads.config import HARDWARE_PRESETS, MODEL_PRESETS, ConfigError, ModelConfig
from workloads.layouts import PhaseLayout, canonical_layout
from workloads.recommend import BATCH, HEADS, MEMORY, recommend

PALM, TPU_V4 = MODEL_PRESETS["palm-540b"], HARDWARE_PRESETS["tpu-v4"]


def test_palm_540b_decode_on_64_chips_is_the_papers_2d_layout_with_padded_heads():
    """The issue's question: 48 heads on 64 chips. Padded to 64 (auto), 2D weight-stationary
    with batch-sharded attention wins, as in the paper's Table 2 decode."""
    rec = recommend(PALM, TPU_V4, 64, 64, "decode", context=2048)
    assert (rec.best.ffn, rec.best.attn, rec.best.topology, rec.best.heads) == ("ws2d", "batch", (4, 4, 4), 64)
    assert rec.best.prediction.latency_s < 0.030         # not wg_x's ~316 ms
    assert rec.best.prediction.padding_params > 17e9
    assert all(r.kind == MEMORY for r in rec.rejected)  # only what does not fit is rejected


def test_without_padding_the_invalid_layouts_are_listed_not_fatal():
    rec = recommend(PALM, TPU_V4, 64, 64, "decode", context=2048, pad_heads="none")
    assert rec.best.ffn.startswith("wg")
    heads = {(r.ffn, r.attn) for r in rec.rejected if r.kind == HEADS}
    assert heads == {("ws1d", "head"), ("ws1d", "batch"), ("ws2d", "head"), ("ws2d", "batch")}
    assert all("n_heads" in r.reason for r in rec.rejected if r.kind == HEADS)


def test_a_batch_that_does_not_divide_rejects_only_those_layouts():
    rec = recommend(PALM, TPU_V4, 64, 8, "decode", context=2048)
    batch = {(r.ffn, r.attn) for r in rec.rejected if r.kind == BATCH}
    assert ("ws2d", "batch") in batch and ("wg_xyz", "head") in batch
    assert (rec.best.ffn, rec.best.attn) == ("ws2d", "head")
    assert all(c.attn == "head" for c in rec.candidates)


def test_nothing_valid_is_one_error_naming_every_reason():
    model = ModelConfig("odd", 18, 54, 2, 3, 1, 6, 64)        # nothing splits over 4 chips
    with pytest.raises(ConfigError) as err:
        recommend(model, TPU_V4, 4, 3, "decode", topology=(2, 2, 1), pad_heads="none")
    assert "every one is rejected" in str(err.value) and "\n" not in str(err.value)


def test_a_gather_over_size_one_axes_is_weight_stationary():
    assert canonical_layout(PhaseLayout("wg_x", "head"), (1, 4, 4)).ffn == "ws1d"
    assert canonical_layout(PhaseLayout("wg_xy", "batch"), (4, 1, 4)).ffn == "wg_x"
    assert canonical_layout(PhaseLayout("wg_xyz", "head"), (2, 2, 1)).ffn == "wg_xy"
    assert canonical_layout(PhaseLayout("wg_xyz", "head"), (1, 1, 1)).ffn == "ws1d"
    assert canonical_layout(PhaseLayout("ws2d", "head"), (1, 4, 4)).ffn == "ws1d"
    assert canonical_layout(PhaseLayout("wg_xy", "head"), (2, 2, 4)).ffn == "wg_xy"


def test_the_issue_model_on_1x4x4_gets_one_prediction_for_one_program():
    """d_model 2048, d_ff 16384 on 16 chips as 1x4x4: wg_x gathers over x = 1 chip, so it is
    the weight-stationary program; it used to win by 4% through different accounting."""
    model = ModelConfig("issue", 2048, 16384, 16, 16, 1, 128, 32000)
    rec = recommend(model, TPU_V4, 16, 16, "decode", context=2048, topology=(1, 4, 4))
    assert rec.best.ffn == "ws1d" and sorted(rec.best.aliases) == ["wg_x", "ws2d"]
    names = [(c.ffn, c.attn) for c in rec.candidates]
    assert len(names) == len(set(names)) and not {"wg_x", "ws2d"} & {c.ffn for c in rec.candidates}
    wg_x = cm.predict_phase(model, TPU_V4, 16, 16, "decode", 1, 2048, PhaseLayout("wg_x", "batch"),
                            topology=(1, 4, 4))
    ws1d = cm.predict_phase(model, TPU_V4, 16, 16, "decode", 1, 2048, PhaseLayout("ws1d", "batch"),
                            topology=(1, 4, 4))
    assert wg_x.ffn == "ws1d" and wg_x.latency_s == ws1d.latency_s
    assert wg_x.memory_read_bytes_per_chip == ws1d.memory_read_bytes_per_chip


def test_the_dict_form_keeps_the_former_costmodel_contract():
    out = recommend(PALM, TPU_V4, 64, 512, "prefill", 2048).to_dict()
    assert out["ffn"].startswith("wg") and out["alternatives"][0]["ffn"] == out["ffn"]
    assert isinstance(out["rejected"], list) and out["candidates"] >= len(out["alternatives"])
    assert {"kind", "reason", "ffn", "attn", "topology"} <= set(out["rejected"][0]) if out["rejected"] else True


def test_a_2d_torus_is_never_offered_a_3d_topology():
    """Issue 24: TPU v5e is a 2-D torus (torus_dims 2); its recommendations, searched or
    not, split at most two mesh axes, and a fixed 3-D topology is a one-line error."""
    v5e = HARDWARE_PRESETS["tpu-v5e"]
    assert v5e.torus_dims == 2 and TPU_V4.torus_dims == 3
    rec = recommend(PALM, v5e, 64, 64, "decode", context=2048)
    assert sum(d > 1 for d in rec.best.topology) == 2
    searched = recommend(PALM, v5e, 64, 64, "decode", context=2048, search_topology=True)
    assert all(sum(d > 1 for d in c.topology) <= 2 for c in searched.candidates)
    assert any(sum(d > 1 for d in t) == 3 for t in cm.factorizations(64))   # there were some
    with pytest.raises(ConfigError, match="2-D torus"):
        recommend(PALM, v5e, 64, 64, "decode", context=2048, topology=(4, 4, 4))
    # a 3-D torus keeps the paper's 4x4x4
    assert recommend(PALM, TPU_V4, 64, 64, "decode", context=2048).best.topology == (4, 4, 4)
