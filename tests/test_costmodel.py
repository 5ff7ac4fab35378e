"""The analytical cost model against the public numbers of the references.

Sources (../shared/reference/): esti-paper-summary.txt (Pope et al. 2022: Table 1, §3.2,
Appendix A), scaling-book-part7-inference.txt (pop quiz and worked questions),
tensor-parallelism-gqa.txt (Llama-2-70B on 8 and 16 GPUs).
"""

from __future__ import annotations

import dataclasses
import math
import subprocess
import sys

import pytest

from workloads import costmodel as cm
from workloads.config import ConfigError, ModelConfig, load_hardware, load_model
from workloads.layouts import Collective, PhaseLayout, forward_collectives
from workloads.recommend import recommend
from workloads.trial import TrialConfig

TPU_V4 = load_hardware("tpu-v4")
TPU_V5E = load_hardware("tpu-v5e")


def within(value: float, expected: float, rel: float) -> bool:
    return abs(value - expected) <= rel * abs(expected)


def test_import_does_not_pull_in_jax():
    code = "import sys, workloads.costmodel; assert 'jax' not in sys.modules, 'jax imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# --------------------------------------------------------------------------- Table 1 (§4.2)


@pytest.mark.parametrize("preset, attn, batch, expected", [
    ("palm-540b-multihead", "head", 128, 1320),
    ("palm-540b-multihead", "head", 512, 330),
    ("palm-540b", "head", 128, 660),        # baseline multiquery: the one KV head replicated
    ("palm-540b", "head", 512, 165),
    ("palm-540b", "batch", 128, 43_000),    # optimized multiquery: batch-sharded KV cache
    ("palm-540b", "batch", 512, 10_700),
])
def test_table1_max_context(preset, attn, batch, expected):
    result = cm.max_context(load_model(preset), TPU_V4, 64, batch, attn, kv_fraction=0.3)
    assert within(result.max_context, expected, 0.03), result


def test_table1_head_sharded_multiquery_replicates_the_kv_head_on_every_chip():
    result = cm.max_context(load_model("palm-540b"), TPU_V4, 64, 128, "head")
    assert result.kv_heads_per_chip == 1 and result.kv_replication == 64


def test_max_context_rejects_a_batch_that_does_not_split_over_the_chips():
    with pytest.raises(ConfigError, match="batch"):
        cm.max_context(load_model("palm-540b"), TPU_V4, 64, 100, "batch")


# --------------------------------------------------------------------------- GQA chapter


def test_llama2_70b_block_parameters():
    # "855,638,016 params per layer, times 80 layers = 68,451,041,280 params total"
    assert cm.block_params(load_model("llama2-70b")) == 68_451_041_280


@pytest.mark.parametrize("tp, expected_gb", [(8, 17.11), (16, 8.56)])
def test_llama2_70b_weights_per_gpu(tp, expected_gb):
    weights = cm.weight_bytes_per_chip(load_model("llama2-70b"), tp, "bf16", embeddings=False)
    assert round(weights / 1e9, 2) == expected_gb


@pytest.mark.parametrize("tp", [8, 16])
def test_llama2_70b_kv_cache_per_gpu_hits_the_replication_ceiling(tp):
    kv = cm.kv_bytes_per_chip(load_model("llama2-70b"), tp, 32, 4096, "head")
    assert round(kv / 1e9, 2) == 5.37


def test_llama2_70b_batch_sharding_halves_the_kv_cache_at_tp16():
    model = load_model("llama2-70b")
    head = cm.kv_bytes_per_chip(model, 16, 32, 4096, "head")
    batch = cm.kv_bytes_per_chip(model, 16, 32, 4096, "batch")
    assert batch == pytest.approx(head / 2)


def test_stored_layout_replicates_kv_projections_when_kv_heads_do_not_split():
    # Stored W_k, W_v are E_x (KD) when K (8) does not split over 16 chips: replicated over y*z.
    model = load_model("llama2-70b")
    even = cm.weight_bytes_per_chip(model, 16, embeddings=False)
    stored = cm.weight_bytes_per_chip(model, 16, topology=(1, 16, 1), embeddings=False)
    kv_weights = 2 * model.d_model * model.n_kv_heads * model.d_head * model.n_layers * 2
    assert stored - even == pytest.approx(kv_weights * (1 - 1 / 16))


# --------------------------------------------------------------------------- parameters, FLOPs


def test_palm_540b_has_540b_parameters():
    assert within(cm.param_count(load_model("palm-540b")), 540e9, 0.01)


def test_model_flops_per_token_definition():
    model = load_model("tiny-serial")   # untied: the unembedding is a separate matmul
    e, f, h, k, d, v = (model.d_model, model.d_ff, model.n_heads, model.n_kv_heads,
                        model.d_head, model.vocab)
    blocks = model.n_layers * (3 * e * f + 2 * e * h * d + 2 * e * k * d)
    assert cm.param_count(model) == blocks + 2 * v * e
    assert cm.matmul_params(model) == blocks + v * e
    expected = 2 * (blocks + v * e) + 4 * model.n_layers * h * d * 100
    assert cm.model_flops_per_token(model, 100) == expected


def test_int8_weights_are_one_byte_plus_bf16_output_channel_scales():
    model = load_model("tiny")
    e, f, h, k, d = model.d_model, model.d_ff, model.n_heads, model.n_kv_heads, model.d_head
    elements = model.n_layers * (2 * e * f + 2 * e * h * d + 2 * e * k * d)
    out_channels = model.n_layers * (f + e + h * d + e + 2 * k * d)
    embedding = model.vocab * e * 2
    assert cm.weight_bytes_per_chip(model, 1, "int8") == elements + 2 * out_channels + embedding
    assert cm.weight_bytes_per_chip(model, 1, "bf16") == 2 * elements + embedding


# --------------------------------------------------------------------------- 1D vs 2D (§3.2, A.2.1)

# The paper's pure formula needs a GELU MLP (two matrices) and F = 4E.
GELU_4E = ModelConfig("gelu-4e", d_model=1024, d_ff=4096, n_layers=2, n_heads=64, n_kv_heads=64,
                      d_head=16, vocab=1024, block="parallel", mlp="gelu")


def _ffn_activation_bytes(model, topology, ffn, tokens=8):
    collectives = forward_collectives(model, topology, PhaseLayout(ffn, "head"), tokens, 1)
    return cm.comm_bytes([c for c in collectives if c.count == model.n_layers], ("resid", "ffn"))


def test_ws2d_on_64_chips_splits_x4_yz16_and_halves_ws1d_communication():
    topology = cm.best_topology(GELU_4E, 64)
    assert topology[0] == 4 and topology[1] * topology[2] == 16
    ws1d = _ffn_activation_bytes(GELU_4E, topology, "ws1d")
    ws2d = _ffn_activation_bytes(GELU_4E, topology, "ws2d")
    assert ws2d * 2 == ws1d


def test_ws2d_equals_ws1d_at_16_chips():
    topology = cm.best_topology(GELU_4E, 16)
    assert _ffn_activation_bytes(GELU_4E, topology, "ws2d") == _ffn_activation_bytes(GELU_4E, topology, "ws1d")
    assert cm.ws2d_crossover_chips(GELU_4E) == 16


def test_best_topology_is_a_deterministic_factorisation():
    model = load_model("palm-540b")
    for chips in (1, 2, 4, 6, 8, 12, 16, 32, 64, 128, 256):
        topology = cm.best_topology(model, chips)
        assert math.prod(topology) == chips
        assert cm.best_topology(model, chips) == topology
    assert cm.best_topology(model, 64) == (4, 4, 4)


# --------------------------------------------------------------------------- weight-gathered (A.2.2)

PALM = load_model("palm-540b-padded")   # the paper padded 48 heads to 64 for 64 chips


def test_best_gather_degree_for_palm_540b_prefill():
    result = cm.best_gather_degree(PALM, 64, 512, 2048)
    assert 29 <= result["continuous"] <= 31      # sqrt(BL n / F) = sqrt(2^20 * 64 / 73728)
    # On the 4x4x4 torus the discrete choices bracketing N* = 30 are xy (16) and xyz (64).
    assert result["layout"] in ("wg_xy", "wg_xyz")
    # Twice the tokens (2M): all-gathering over all 64 chips moves the least.
    assert cm.best_gather_degree(PALM, 64, 512, 4096)["layout"] == "wg_xyz"


def recommend_dict(*args, **kwargs) -> dict:
    return recommend(*args, **kwargs).to_dict()


def test_large_batch_prefill_recommends_weight_gathered_over_most_chips():
    result = recommend_dict(PALM, TPU_V4, 64, 512, "prefill", 2048)
    assert result["ffn"] in ("wg_xy", "wg_xyz") and result["fits"]
    # The paper's choice (Table 2) is within 2% of the best by the formulas; see docs/architecture.md "The analytical cost model".
    xyz = recommend_dict(PALM, TPU_V4, 64, 512, "prefill", 2048, ffn="wg_xyz")
    assert xyz["latency_s"] <= 1.02 * result["latency_s"]
    ws2d = recommend_dict(PALM, TPU_V4, 64, 512, "prefill", 2048, ffn="ws2d")
    assert ws2d["comm_s"] > 4 * result["comm_s"]


@pytest.mark.parametrize("batch, input_len", [(1, 2048), (64, 1)])
def test_small_token_count_prefill_recommends_weight_stationary(batch, input_len):
    result = recommend_dict(PALM, TPU_V4, 64, batch, "prefill", input_len)
    assert result["ffn"] in ("ws1d", "ws2d")


def test_unpadded_palm_540b_cannot_shard_48_heads_over_64_chips_but_xyz_gathered_runs():
    model = load_model("palm-540b")
    with pytest.raises(ConfigError, match="n_heads"):
        cm.predict_phase(model, TPU_V4, 64, 64, "decode", 1, 2048, PhaseLayout("ws2d", "head"))
    pred = cm.predict_phase(model, TPU_V4, 64, 512, "prefill", 2048, None, PhaseLayout("wg_xyz", "head"))
    assert pred.fits


def test_decode_with_a_long_context_recommends_batch_sharded_attention():
    result = recommend_dict(PALM, TPU_V4, 64, 512, "decode", 1, 2048)
    assert (result["ffn"], result["attn"]) == ("ws2d", "batch")


# --------------------------------------------------------------------------- scaling book part 7


def test_scaling_book_pop_quiz_decode_lower_bound():
    # 30B params in int8 on a TPU v5e 4x4 (16 chips), 8192 context, 100 kB of KV per token.
    def bound(batch):
        return cm.decode_step_lower_bound(param_bytes=30e9, kv_bytes_per_token=100e3, context=8192,
                                          batch=batch, chips=16, hw=TPU_V5E, param_count=30e9)
    assert within(bound(4), 2.5e-3, 0.05)
    assert within(bound(256), 21e-3, 0.05)


def test_scaling_book_18b_model_has_262kb_of_int8_kv_per_token():
    model = ModelConfig("sb-18b", d_model=4096, d_ff=16384, n_layers=64, n_heads=32, n_kv_heads=8,
                        d_head=256, vocab=32128, block="parallel", mlp="swiglu", tie_embeddings=True)
    assert round(cm.kv_bytes_per_token(model, dtype_bytes=1) / 1e3) == 262
    assert within(cm.param_count(model), 18.4e9, 0.01)


# --------------------------------------------------------------------------- parallel block (§3.4)


def _activation_bytes(model, ffn, topology=(4, 4, 4)):
    collectives = forward_collectives(model, topology, PhaseLayout(ffn, "head"), 64, 1)
    return cm.comm_bytes([c for c in collectives if c.count == model.n_layers], ("resid", "ffn"))


def test_parallel_block_halves_ws1d_activation_communication():
    parallel = load_model("palm-62b")
    serial = dataclasses.replace(parallel, block="serial")
    assert _activation_bytes(serial, "ws1d") == 2 * _activation_bytes(parallel, "ws1d")


def test_parallel_block_reduces_ws2d_activation_communication():
    parallel = load_model("palm-62b")
    serial = dataclasses.replace(parallel, block="serial")
    assert _activation_bytes(parallel, "ws2d") < _activation_bytes(serial, "ws2d")


# --------------------------------------------------------------------------- time model (§3.1)


def test_all_reduce_costs_twice_its_bytes_and_each_op_pays_the_latency():
    hw = dataclasses.replace(TPU_V4, collective_latency_s=1e-6)
    collectives = [Collective("all-reduce", ("x",), 1000, 2, 3, "a"),
                   Collective("all-gather", ("y",), 500, 2, 1, "b")]
    expected = (2 * 6000 + 1000) / hw.ici_bandwidth + 4 * 1e-6
    assert cm.comm_time_s(collectives, hw) == pytest.approx(expected)


def test_latency_is_additive_or_overlapped_plus_per_layer_overhead():
    layout = PhaseLayout("ws2d", "batch")
    additive = cm.predict_phase(PALM, TPU_V4, 64, 64, "decode", 1, 2048, layout)
    assert additive.compute_s == pytest.approx(additive.flops / (64 * TPU_V4.peak_flops))
    assert additive.latency_s == pytest.approx(additive.compute_s + additive.memory_s + additive.comm_s)
    hw = dataclasses.replace(TPU_V4, overlap=1.0, op_overhead_s=1e-5)
    overlapped = cm.predict_phase(PALM, hw, 64, 64, "decode", 1, 2048, layout)
    terms = (overlapped.compute_s, overlapped.memory_s, overlapped.comm_s)
    assert overlapped.latency_s == pytest.approx(max(terms) + 1e-5 * PALM.n_layers)
    assert overlapped.mfu == pytest.approx(overlapped.flops / (64 * hw.peak_flops * overlapped.latency_s))


def test_int8_weights_halve_small_batch_decode_memory_time():
    layout = PhaseLayout("ws2d", "batch")
    bf16 = cm.predict_phase(PALM, TPU_V4, 64, 64, "decode", 1, 128, layout, "bf16")
    int8 = cm.predict_phase(PALM, TPU_V4, 64, 64, "decode", 1, 128, layout, "int8")
    # half, plus the bf16 scales and the bf16 embedding
    assert 0.5 < int8.weight_bytes_per_chip / bf16.weight_bytes_per_chip < 0.52
    assert int8.memory_s < 0.6 * bf16.memory_s


# --------------------------------------------------------------------------- trials


def _trial(**overrides) -> TrialConfig:
    data = {"model": "tiny", "chips": 8, "batch": 8, "input_len": 16, "decode_steps": 4,
            "prefill": {"ffn": "wg_xyz", "attn": "head"}, "decode": {"ffn": "ws2d", "attn": "batch"}}
    data.update(overrides)
    return TrialConfig.from_dict(data, validate=False)


def test_predict_trial_is_an_analytical_measurement():
    trial = _trial()
    m = cm.predict(trial, TPU_V4)
    assert m.source == "analytical"
    assert m.total_s == pytest.approx(m.prefill_s + trial.decode_steps * m.decode_step_s)
    assert m.prefill_s == pytest.approx(m.prefill_compute_s + m.prefill_memory_s + m.prefill_comm_s)
    assert m.fits is True and m.prefill_mfu > 0 and m.decode_cost_chip_s_per_token > 0
    assert m.kv_bytes_per_chip == cm.kv_bytes_per_chip(trial.model, 8, 8, trial.context_len, "batch",
                                                        trial.mesh_shape, "ws2d")
    assert {s.kind for s in m.collectives["prefill"]} >= {"all-gather"}


def test_predicted_flops_match_the_shared_definition_used_for_measured_mfu():
    trial = _trial(decode_steps=5)   # odd: the mean decode context is not an integer
    m = cm.predict(trial, TPU_V4)
    ctx = cm.decode_context(trial)
    assert ctx == trial.input_len + 2.5
    assert m.extra["decode_flops"] == cm.phase_model_flops(trial.model, 8, "decode", 16, ctx)
    assert m.extra["prefill_flops"] == cm.phase_model_flops(trial.model, 8, "prefill", 16)
    assert m.decode_mfu == pytest.approx(m.extra["decode_flops"] / (8 * TPU_V4.peak_flops * m.decode_step_s))


def test_feasibility_names_the_layout_constraint():
    """Without padding, 48 heads do not split over 64 chips; `auto` pads them (paper §4)."""
    unpadded = _trial(model="palm-540b", chips=64, batch=64, pad_heads="none",
                      prefill={"ffn": "ws2d"}, decode={"ffn": "ws2d"})
    reason = cm.feasibility(unpadded, TPU_V4)
    assert reason is not None and "n_heads" in reason
    assert cm.feasibility(dataclasses.replace(unpadded, pad_heads="auto"), TPU_V4) is None


def test_feasibility_reports_memory():
    assert cm.feasibility(_trial(), TPU_V4) is None
    reason = cm.feasibility(_trial(), TPU_V4, memory_budget_bytes=1e5)
    assert reason is not None and reason.startswith("memory:")
    big = _trial(model="palm-540b-padded", chips=8, batch=64, input_len=2048, decode_steps=64,
                 prefill={"ffn": "ws2d"}, decode={"ffn": "ws2d"})
    assert "memory" in cm.feasibility(big, TPU_V4)


def test_one_stored_weight_table_feeds_the_cost_model_and_the_engine_specs():
    """layouts.STORED_WEIGHTS is the one table: the cost model's stored bytes per chip equal
    the sizes of the engine's PartitionSpecs (partitioning.param_specs reads it too)."""
    from workloads.layouts import STORED_WEIGHTS, stored_weights, weight_dims

    model = load_model("tiny-gqa")
    topology, chips = (2, 2, 2), 8
    sizes = dict(zip("xyz", topology))
    elements = 0
    for w in stored_weights(model):
        dims = weight_dims(w.name, False, model.n_kv_heads % chips == 0)
        shape = ((w.stacked,) if w.stacked > 1 else ()) + w.shape(model)
        elements += math.prod(n // math.prod(sizes[a] for a in axes) for n, axes in zip(shape, dims))
    expected = model.n_layers * elements * 2 + model.vocab * model.d_model * 2 / chips
    assert cm.weight_bytes_per_chip(model, chips, "bf16", topology) == expected
    assert set(STORED_WEIGHTS) == {"w_in", "w_gate", "w_up", "w_out", "w_q", "w_o", "w_kv"}
    assert not hasattr(cm, "_weight_matrices")


# --------------------------------------------------------------------------- profiled collectives


def test_profiled_collectives_are_priced_by_kind_and_group_size():
    """`sweeper profile`'s fields: one op = latency[g] + bytes / bandwidth[g] (bf16 moves as
    f32 on XLA CPU, so 4 bytes per element; no all-reduce factor); a missing g uses the
    nearest measured one; a kind not profiled keeps the paper's formula."""
    hw = dataclasses.replace(
        TPU_V4, collective_latency_s=1e-6,
        collective_latency_s_by_group={"all-reduce": {2: 3e-5, 8: 9e-5}},
        collective_bandwidth_by_group={"all-reduce": {2: 2e9, 8: 1e9}})
    topology = (2, 4, 1)
    ar_x = Collective("all-reduce", ("x",), 1000, 2, 3, "a")          # g = 2: measured
    ar_y = Collective("all-reduce", ("y",), 1000, 2, 1, "b")          # g = 4: nearest is 2
    ar_xy = Collective("all-reduce", ("x", "y"), 1000, 2, 2, "c")     # g = 8: measured
    ag = Collective("all-gather", ("y",), 500, 2, 1, "d")             # not profiled
    expected = (3 * (3e-5 + 4000 / 2e9) + 1 * (3e-5 + 4000 / 2e9) + 2 * (9e-5 + 4000 / 1e9)
                + 1000 / hw.ici_bandwidth + 1e-6)
    assert cm.comm_time_s([ar_x, ar_y, ar_xy, ag], hw, topology) == pytest.approx(expected)
    # without a topology (or without the fields) the paper's formula, unchanged
    plain = dataclasses.replace(hw, collective_latency_s_by_group={}, collective_bandwidth_by_group={})
    assert cm.comm_time_s([ar_x, ag], hw) == cm.comm_time_s([ar_x, ag], plain, topology) == \
        pytest.approx((2 * 6000 + 1000) / hw.ici_bandwidth + 4 * 1e-6)


def test_a_profile_with_group_measurements_changes_predict_phase_and_scales_with_its_share():
    layout = PhaseLayout("ws2d", "batch")
    base = cm.predict_phase(PALM, TPU_V4, 64, 64, "decode", 1, 2048, layout)
    kinds = {c.kind for c in base.collectives}
    profiled = dataclasses.replace(
        TPU_V4, collective_latency_s_by_group={k: {2: 1e-4} for k in kinds},
        collective_bandwidth_by_group={k: {2: 1e9} for k in kinds})
    pred = cm.predict_phase(PALM, profiled, 64, 64, "decode", 1, 2048, layout)
    topology = base.topology
    expected = sum(c.count * (1e-4 + c.elements * 4 / 1e9) for c in base.collectives)
    assert pred.comm_s == pytest.approx(expected)
    assert pred.compute_s == base.compute_s and pred.memory_s == base.memory_s
    # a share of the profile gets that share of each measured bandwidth (latency unchanged)
    half = profiled.scaled(0.5)
    assert half.collective_bandwidth_by_group == {k: {2: 5e8} for k in kinds}
    assert half.collective_latency_s_by_group == profiled.collective_latency_s_by_group
    assert topology == pred.topology


# --------------------------------------------------------------------------- matmul efficiency
# HardwareProfile.matmul_half_rows (issue 20): a chip's matmul of r rows runs at
# peak x r / (r + half_rows); 0 (every preset but a fitted one) = the paper's model.

MQ8 = ModelConfig("mq8", d_model=512, d_ff=2048, n_layers=2, n_heads=8, n_kv_heads=1,
                  d_head=64, vocab=512)


def test_matmul_rows_of_each_layout():
    """Weight matmuls: every token (weight-stationary) or the chip's batch share (gathered);
    attention: the queries sharing one K/V head on the chip (paper §3.3)."""
    topo = (2, 2, 2)
    ws2d_batch, ws2d_head = PhaseLayout("ws2d", "batch"), PhaseLayout("ws2d", "head")
    assert cm.matmul_rows(MQ8, topo, ws2d_batch, 16, 1) == (16, 8)        # all 8 heads share K/V
    assert cm.matmul_rows(MQ8, topo, ws2d_head, 16, 1) == (16, 1)         # 1 query head per chip
    assert cm.matmul_rows(MQ8, topo, PhaseLayout("wg_xyz", "batch"), 16, 4) == (2 * 4, 8 * 4)
    multihead = dataclasses.replace(MQ8, n_kv_heads=8)
    assert cm.matmul_rows(multihead, topo, ws2d_batch, 16, 1)[1] == 1    # a matrix-vector product


def test_rows_equal_to_half_rows_halve_the_matmul_rate():
    """Batch 8 on multiquery batch-sharded decode: weight matmuls and attention both have 8
    rows, so half_rows = 8 doubles compute_s exactly and changes nothing else."""
    layout, topo = PhaseLayout("ws2d", "batch"), (2, 2, 2)
    assert cm.matmul_rows(MQ8, topo, layout, 8, 1) == (8, 8)
    args = (MQ8, 8, 8, "decode", 64, 64, layout, "bf16", topo)
    paper = cm.predict_phase(MQ8, TPU_V4, *args[1:])
    half = cm.predict_phase(MQ8, dataclasses.replace(TPU_V4, matmul_half_rows=8.0), *args[1:])
    assert half.compute_s == pytest.approx(2 * paper.compute_s, rel=1e-12)
    assert (half.memory_s, half.comm_s, half.flops) == (paper.memory_s, paper.comm_s, paper.flops)
    assert half.latency_s - paper.latency_s == pytest.approx(paper.compute_s, rel=1e-12)   # additive
    # and in closed form for unequal rows: weight FLOPs / 8 rows x (1 + h/8), attention / 1 row
    head = PhaseLayout("ws2d", "head")
    h = 24.0
    got = cm.predict_phase(MQ8, dataclasses.replace(TPU_V4, matmul_half_rows=h), 8, 8, "decode",
                           64, 64, head, "bf16", topo).compute_s
    weight_flops = 8 * 2.0 * cm.matmul_params(MQ8)
    attention_flops = 8 * 4.0 * MQ8.n_layers * MQ8.n_heads * MQ8.d_head * 64
    expected = (weight_flops * (1 + h / 8) + attention_flops * (1 + h / 1)) / (8 * TPU_V4.peak_flops)
    assert got == pytest.approx(expected, rel=1e-12)


def test_matmul_half_rows_reads_from_yaml_and_refuses_a_negative():
    from workloads.config import HardwareProfile

    data = {"peak_flops": 1e12, "hbm_bandwidth": 1e11, "hbm_bytes": 1e9, "ici_bandwidth": 1e10}
    assert HardwareProfile.from_dict({**data, "matmul_half_rows": 96}).matmul_half_rows == 96
    with pytest.raises(ConfigError, match="matmul_half_rows"):
        HardwareProfile.from_dict({**data, "matmul_half_rows": -1})


# costmodel.ATTENTION_HALF_ROWS (issue 20): attention's own small-shape efficiency,
# 0 = the paper's model.
def test_attention_half_rows_slows_attention_alone():
    """Head-sharded multiquery decode on 2x2x2: attention has 1 row per KV head on a chip
    (weight matmuls 8), so attention_half_rows = h adds attention FLOPs x h / 1 row; the
    weight matmuls, memory and communication are unchanged, and h = 0 is the paper's model."""
    topo, head = (2, 2, 2), PhaseLayout("ws2d", "head")
    args = (MQ8, 8, 8, "decode", 64, 64, head, "bf16", topo)
    paper = cm.predict_phase(MQ8, TPU_V4, *args[1:])
    zero = cm.predict_phase(MQ8, dataclasses.replace(TPU_V4, **{cm.ATTENTION_HALF_ROWS: 0.0}), *args[1:])
    assert zero == paper
    h = 24.0
    got = cm.predict_phase(MQ8, dataclasses.replace(TPU_V4, **{cm.ATTENTION_HALF_ROWS: h}), *args[1:])
    attention_flops = 8 * 4.0 * MQ8.n_layers * MQ8.n_heads * MQ8.d_head * 64
    assert got.compute_s - paper.compute_s == pytest.approx(
        attention_flops * h / 1 / (8 * TPU_V4.peak_flops), rel=1e-12)
    assert (got.memory_s, got.comm_s, got.flops) == (paper.memory_s, paper.comm_s, paper.flops)
    # on top of matmul_half_rows, which slows weight matmuls and attention alike
    both = cm.predict_phase(MQ8, dataclasses.replace(TPU_V4, matmul_half_rows=8.0,
                                                     **{cm.ATTENTION_HALF_ROWS: h}), *args[1:])
    rows_only = cm.predict_phase(MQ8, dataclasses.replace(TPU_V4, matmul_half_rows=8.0), *args[1:])
    assert both.compute_s - rows_only.compute_s == pytest.approx(got.compute_s - paper.compute_s,
                                                                 rel=1e-12)


def test_a_weight_tile_as_wide_as_half_dim_halves_the_weight_matmul_rate():
    """matmul_half_dim: PaLM 540B's ws2d tile on 4x4x4 is E/X x F/YZ = 4608 x 4608, wg_xyz's
    the whole E x F (18432 narrower side); half_dim = 4608 doubles ws2d's weight-matmul time."""
    palm = load_model("palm-540b")
    assert cm.weight_tile_dim(palm, (4, 4, 4), "ws2d") == 4608
    assert cm.weight_tile_dim(palm, (4, 4, 4), "wg_xyz") == 18432
    layout = PhaseLayout("ws2d", "batch")
    args = (palm, 64, 64, "decode", 2048, 2048, layout, "bf16", (4, 4, 4))
    paper = cm.predict_phase(args[0], TPU_V4, *args[1:], validate=False)
    half = cm.predict_phase(args[0], dataclasses.replace(TPU_V4, matmul_half_dim=4608.0), *args[1:],
                            validate=False)
    weight_s = 64 * 2.0 * cm.matmul_params(palm) / (64 * TPU_V4.peak_flops)
    assert half.compute_s - paper.compute_s == pytest.approx(weight_s, rel=1e-12)


def test_collective_rendezvous_is_charged_per_op_times_g_times_g_minus_1():
    """collective_rendezvous_s (issue 20): + per collective op x g x (g - 1), g its group size,
    outside the overlap and not scaled by a chip's share of the host; 0 changes nothing."""
    from workloads.config import HardwareProfile

    layout, topo = PhaseLayout("ws2d", "head"), (2, 2, 2)
    args = (MQ8, 8, 8, "decode", 64, 64, layout, "bf16", topo)
    hw = dataclasses.replace(TPU_V4, overlap=0.5)
    paper = cm.predict_phase(MQ8, hw, *args[1:])
    ops = forward_collectives(MQ8, topo, layout, 8, 1, "bf16")
    sizes = {"x": 2, "y": 2, "z": 2}
    pairs = sum(c.count * math.prod(sizes[a] for a in c.axes)
                * (math.prod(sizes[a] for a in c.axes) - 1) for c in ops)
    assert pairs > 0
    term = cm.predict_phase(MQ8, dataclasses.replace(hw, collective_rendezvous_s=1e-6), *args[1:])
    assert term.latency_s - paper.latency_s == pytest.approx(pairs * 1e-6, rel=1e-9)
    assert term.comm_s - paper.comm_s == pytest.approx(pairs * 1e-6, rel=1e-9)
    assert (term.compute_s, term.memory_s) == (paper.compute_s, paper.memory_s)
    one_chip = cm.predict_phase(MQ8, dataclasses.replace(hw, collective_rendezvous_s=1e-6), 1, 8,
                                "decode", 64, 64, layout, "bf16", (1, 1, 1))
    assert one_chip.latency_s == cm.predict_phase(MQ8, hw, 1, 8, "decode", 64, 64, layout, "bf16",
                                                  (1, 1, 1)).latency_s   # no collective, no cost
    data = {"peak_flops": 1e12, "hbm_bandwidth": 1e11, "hbm_bytes": 1e9, "ici_bandwidth": 1e10}
    assert HardwareProfile.from_dict({**data, "collective_rendezvous_s": 2e-6}).collective_rendezvous_s == 2e-6
    with pytest.raises(ConfigError, match="collective_rendezvous_s"):
        HardwareProfile.from_dict({**data, "collective_rendezvous_s": -1})


def test_a_weight_gather_of_several_groups_is_priced_only_where_the_profile_measured_it():
    """HardwareProfile.multigroup_gather_scale (issue 20, issue 35): on a measured host profile
    that carries a measured price (here 0.3, what benchmarks/results/collectives.md measured on
    its host), wg_xy on 1x2x2 gathers its weights over y in 2 groups (one per z slice) and
    those bytes cost 0.3 of their time; activation collectives, one-group gathers (wg_xyz),
    a measured profile without the field and any real-hardware profile are priced as the paper
    prices them."""
    layout, topo = PhaseLayout("wg_xy", "head"), (1, 2, 2)
    args = (MQ8, 4, 8, "prefill", 64, 64, layout, "bf16", topo)
    sheet = dataclasses.replace(TPU_V4, ici_bandwidth=1e10)
    plain_host = dataclasses.replace(sheet, measured=True)
    host = dataclasses.replace(plain_host, multigroup_gather_scale=0.3)
    ops = forward_collectives(MQ8, topo, layout, 8, 64, "bf16")
    weight_bytes = sum(c.bytes_per_chip for c in ops if c.what.startswith("weights."))
    assert weight_bytes > 0 and {c.axes for c in ops if c.what.startswith("weights.")} == {("x", "y")}
    paper, emulated = cm.predict_phase(MQ8, sheet, *args[1:]), cm.predict_phase(MQ8, host, *args[1:])
    assert paper.comm_s - emulated.comm_s == pytest.approx(weight_bytes * 0.7 / 1e10, rel=1e-12)
    assert (emulated.compute_s, emulated.memory_s) == (paper.compute_s, paper.memory_s)
    assert cm.predict_phase(MQ8, plain_host, *args[1:]).comm_s == paper.comm_s   # no price measured
    one_group = (MQ8, 4, 8, "prefill", 64, 64, PhaseLayout("wg_xyz", "head"), "bf16", topo)
    assert (cm.predict_phase(MQ8, host, *one_group[1:]).comm_s
            == cm.predict_phase(MQ8, sheet, *one_group[1:]).comm_s)
    activation = Collective("all-gather", ("y",), 1000, 2, 1, "ffn.in")
    assert cm.multigroup_gather_scale(activation, host, topo) == 1.0
    weight = Collective("all-gather", ("y",), 1000, 2, 1, "weights.W_in")
    assert cm.multigroup_gather_scale(weight, host, topo) == 0.3
    assert cm.multigroup_gather_scale(weight, plain_host, topo) == 1.0   # measured, no price
    assert cm.multigroup_gather_scale(weight, host, (1, 2, 1)) == 1.0     # one group: all chips
    assert cm.multigroup_gather_scale(weight, dataclasses.replace(sheet, multigroup_gather_scale=0.3),
                                      topo) == 1.0                        # real interconnect
