"""The cost model's mixture-of-experts, FP8 and KV-cache terms (docs/models.md)."""

import dataclasses
import json

import numpy as np
import pytest

from sweeper.cli import main
from sweeper.serving.plan import PlanQuestion, plan
from workloads import costmodel as cm
from workloads.config import MODEL_PRESETS, ConfigError, load_hardware
from workloads.layouts import PhaseLayout, forward_collectives
from workloads.recommend import recommend
from workloads.serving.profile import AppProfile, parse_length
from workloads.trial import TrialConfig

MIXTRAL = MODEL_PRESETS["mixtral-8x7b"]
QWEN = MODEL_PRESETS["qwen3-30b-a3b"]
H100 = load_hardware("h100")
WS1D = PhaseLayout("ws1d", "head")


def decode(model=MIXTRAL, batch=1, experts="tp", kernel="grouped", hw=H100, weights="bf16",
           chips=8, topology=(1, 8, 1), kv_cache="bf16", context=2048):
    return cm.predict_phase(model, hw, chips, batch, "decode", 1, context, WS1D, weights, topology,
                            experts=experts, moe_kernel=kernel, kv_cache=kv_cache)


# --------------------------------------------------------------------------- experts hit


def test_distinct_experts_hit_at_batch_b():
    """k at batch 1, all X at large batch, and X (1 - (1 - k/X)^B) between, as a simulation
    of uniform top-k routing gives."""
    assert cm.experts_hit(MIXTRAL, 1) == pytest.approx(2)
    assert cm.experts_hit(MIXTRAL, 256) == pytest.approx(8)
    rng = np.random.default_rng(0)
    for batch in (2, 4, 16):
        hits = [len(np.unique(np.argsort(rng.random((batch, 128)), axis=1)[:, :8]))
                for _ in range(2000)]
        assert cm.experts_hit(QWEN, batch) == pytest.approx(np.mean(hits), rel=0.02)


def test_decode_reads_the_experts_some_token_chose():
    """tp, grouped kernel: a chip reads its share of the non-expert weights and of the
    experts hit; at batch 1 that is 2 of Mixtral's 8 experts."""
    expert_bytes = cm.weight_bytes_per_chip(MIXTRAL, 8, "bf16", (1, 8, 1), True, matrices="experts")
    rest = cm.weight_bytes_per_chip(MIXTRAL, 8, "bf16", (1, 8, 1), True, embeddings=False,
                                    matrices="rest") + MIXTRAL.vocab * MIXTRAL.d_model * 2 / 8
    kv = cm.kv_bytes_per_chip(MIXTRAL, 8, 1, 2048, "head", (1, 8, 1), "ws1d")
    for batch in (1, 4, 64):
        p = decode(batch=batch)
        hit = cm.experts_hit(MIXTRAL, batch) / 8
        assert p.memory_read_bytes_per_chip == pytest.approx(rest + hit * expert_bytes + kv * batch)
        assert p.experts_read == pytest.approx(8 * hit)
    padded = decode(kernel="padded")     # the engine's program reads every expert
    assert padded.memory_read_bytes_per_chip == pytest.approx(rest + expert_bytes + kv)


def test_expert_parallel_waits_for_the_busiest_chip():
    """ep, batch 1 on 8 chips of one expert each: two chips read their whole expert, so the
    step reads one expert's bytes (the busiest chip's), where tp reads 2/8 of all eight."""
    ep, tp = decode(experts="ep"), decode(experts="tp")
    assert ep.experts_read == pytest.approx(1.0) and tp.experts_read == pytest.approx(2.0)
    assert ep.memory_s > 3 * tp.memory_s
    assert ep.expert_imbalance == pytest.approx(4.0)          # 1 pair on a chip, mean 1/4


@pytest.mark.parametrize("tokens,experts,k,chips", [(8, 8, 2, 8), (64, 8, 2, 8), (256, 8, 2, 4),
                                                    (16, 128, 8, 8), (64, 128, 8, 16), (32, 4, 2, 4)])
def test_load_imbalance_is_close_to_a_simulation_of_uniform_routing(tokens, experts, k, chips):
    model = dataclasses.replace(MODEL_PRESETS["tiny-moe"], n_experts=experts, experts_per_token=k)
    rng = np.random.default_rng(1)
    busiest = [np.bincount((np.argsort(rng.random((tokens, experts)), axis=1)[:, :k]
                            // (experts // chips)).ravel(), minlength=chips).max()
               for _ in range(3000)]
    simulated = np.mean(busiest) / (tokens * k / chips)
    assert cm.expert_load_imbalance(model, tokens, chips) == pytest.approx(simulated, rel=0.1)
    assert cm.expert_load_imbalance(model, tokens, 1) == 1.0


def test_all_to_all_volume_of_both_kernels():
    """padded: the engine's buffers, X experts x C slots x E per chip each way (layouts.py);
    grouped: each token once per chip holding one of its experts, the busiest chip's."""
    model, topology = MODEL_PRESETS["tiny-moe"], (1, 2, 2)
    batch, seq = 8, 16
    colls = {c.what: c for c in forward_collectives(model, topology, WS1D, batch, seq, "bf16", "ep")}
    slots = -(-batch * seq // 4)
    assert colls["moe.dispatch"].elements == colls["moe.combine"].elements == 4 * slots * 128
    assert colls["moe.dispatch"].axes == ("x", "y", "z") and colls["moe.dispatch"].kind == "all-to-all"
    hw = load_hardware("tpu-v4")
    grouped = cm.predict_phase(model, hw, 4, batch, "prefill", seq, None, WS1D, "bf16", topology,
                               experts="ep", moe_kernel="grouped")
    sent = {c.what: c.elements for c in grouped.collectives}
    per_token = cm.destination_chips(model, 4)                  # 4 (1 - C(3,2)/C(4,2)) = 2
    assert per_token == pytest.approx(2.0)
    imbalance = cm.expert_load_imbalance(model, batch * seq, 4)
    assert sent["moe.dispatch"] == round(max(slots * per_token, imbalance * batch * seq * per_token / 4)
                                         * 128)
    assert sent["moe.dispatch"] < colls["moe.dispatch"].elements


def test_padded_compute_is_every_expert_on_every_token_and_mfu_counts_the_active_ones():
    p = decode(kernel="padded", batch=16)
    g = decode(kernel="grouped", batch=16)
    expert_flops = 2 * 3 * MIXTRAL.d_model * MIXTRAL.d_ff * MIXTRAL.n_layers * 16
    assert p.executed_flops - g.executed_flops == pytest.approx(expert_flops * (8 - 2))
    assert p.flops == g.flops == pytest.approx(16 * cm.model_flops_per_token(MIXTRAL, 2048))


def test_trials_price_the_engines_program_and_plans_a_serving_engines():
    trial = TrialConfig.from_dict(dict(model="tiny-moe", chips=4, batch=8, topology="1x2x2",
                                       experts="ep", prefill={"ffn": "ws1d", "attn": "head"},
                                       decode={"ffn": "ws1d", "attn": "head"}))
    calls = cm.phase_calls(trial)
    assert {c.moe_kernel for c in calls.values()} == {"padded"} and calls["decode"].experts == "ep"
    m = cm.predict(trial, load_hardware("tpu-v4"))
    assert m.extra["experts"] == "ep" and m.extra["moe_kernel"] == "padded"
    assert cm.default_moe_kernel(H100) == "grouped"


def test_ep_needs_whole_tokens_and_experts_for_every_chip():
    def trial(**fields):
        return TrialConfig.from_dict(dict(dict(model="tiny-moe", batch=8, experts="ep"), **fields))

    with pytest.raises(ConfigError, match="experts: got 'ep'; expected tp with prefill ws2d on X=2"):
        trial(chips=4, topology="2x2x1", prefill={"ffn": "ws2d"}, decode={"ffn": "ws2d"})
    with pytest.raises(ConfigError, match="n_experts=4 a multiple of chips=8"):
        trial(chips=8, prefill={"ffn": "ws1d"}, decode={"ffn": "ws1d"})
    with pytest.raises(ConfigError, match="tiny is dense"):
        trial(model="tiny", chips=1)


def test_recommend_searches_both_experts_layouts():
    rec = recommend(MIXTRAL, H100, 8, 64, "decode", context=2048, topology=(1, 8, 1))
    assert {c.experts for c in rec.candidates} == {"tp", "ep"}
    dense = recommend(MODEL_PRESETS["llama2-70b"], H100, 8, 64, "decode", context=2048)
    assert {c.experts for c in dense.candidates} == {"tp"}


# --------------------------------------------------------------------------- precision


def test_fp8_runs_on_fp8_units_and_stores_like_int8():
    llama = MODEL_PRESETS["llama3.1-70b"]
    prefill = {w: cm.predict_phase(llama, H100, 8, 4, "prefill", 2048, None, WS1D, w, (1, 8, 1))
               for w in ("bf16", "int8", "fp8")}
    assert prefill["fp8"].weight_bytes_per_chip == pytest.approx(prefill["int8"].weight_bytes_per_chip)
    attention = 4 * 2048 * 4.0 * llama.n_layers * llama.n_heads * llama.d_head * 2048
    weight_flops = prefill["bf16"].executed_flops - attention
    saving = weight_flops / 8 * (1 / H100.peak_flops - 1 / H100.fp8_flops)
    assert prefill["bf16"].compute_s - prefill["fp8"].compute_s == pytest.approx(saving)
    assert prefill["fp8"].compute_s < 0.6 * prefill["bf16"].compute_s
    a100 = load_hardware("a100-80g")            # no FP8 units: weight-only, int8's cost
    assert a100.fp8_flops == 0
    no_units = {w: cm.predict_phase(llama, a100, 8, 4, "prefill", 2048, None, WS1D, w, (1, 8, 1))
                for w in ("int8", "fp8")}
    assert no_units["fp8"].latency_s == pytest.approx(no_units["int8"].latency_s)
    assert {h: load_hardware(h).fp8_flops > 0 for h in ("h100", "h200", "b200", "tpu-v4")} == \
        {"h100": True, "h200": True, "b200": True, "tpu-v4": False}


def test_kv_cache_formats_hold_their_bytes():
    llama = MODEL_PRESETS["llama3.1-8b"]
    per = {f: cm.kv_bytes_per_chip(llama, 1, 1, 1000, kv_cache=f) for f in ("bf16", "int8", "fp8")}
    assert per["fp8"] == pytest.approx(per["bf16"] / 2)
    assert per["int8"] == pytest.approx(per["bf16"] * (128 + 2) / 256)
    ctx = {f: cm.max_context(MODEL_PRESETS["palm-540b"], load_hardware("tpu-v4"), 64, 128,
                             kv_cache=f).max_context for f in ("bf16", "fp8")}
    assert ctx["fp8"] == pytest.approx(2 * ctx["bf16"], abs=1)
    reads = {f: decode(model=llama, chips=1, topology=(1, 1, 1), batch=32, kv_cache=f).memory_s
             for f in ("bf16", "fp8")}
    assert reads["fp8"] < reads["bf16"]


def test_a_mixtral_config_plan_has_fp8_kv_and_ep_options_and_a_memory_budget(capsys, tmp_path,
                                                                          monkeypatch):
    """The issue's 'done when': `sweeper plan --model <Mixtral config.json> --hardware h100`
    answers with an FP8 option and an honest memory budget."""
    monkeypatch.setenv("SWEEPER_HOME", str(tmp_path))
    code = main(["plan", "--model", "tests/data/hf/Mixtral-8x7B-v0.1/config.json", "--hardware",
                 "h100", "--rate", "4", "--input-len", "1024", "--output-len", "128", "--ttft", "1",
                 "--tpot", "0.05", "--requests", "100", "--json", "--no-mlflow"])
    assert code == 0
    data = json.loads(capsys.readouterr().out)
    best = data["best"]
    assert best is not None and data["model"] == "Mixtral-8x7B-v0.1"
    assert data["memory_reserve"] == {"share": pytest.approx(0.1),
                                      "source": "vLLM's default gpu_memory_utilization 0.9 "
                                                "(vLLM engine arguments)"}
    budget = next(iter(best["memory_per_chip"].values()))
    assert budget["weights_bytes"] + budget["working_bytes"] + budget["kv_bytes"] \
        <= budget["hbm_bytes"] - budget["reserve_bytes"]
    assert budget["kv_capacity_tokens"] >= budget["kv_tokens"] > 0
    profile = AppProfile(rate=4.0, input_len=parse_length(1024, "x", None),
                         output_len=parse_length(128, "x", None), ttft=1.0, tpot=0.05)
    result = plan(PlanQuestion(MIXTRAL, H100, profile, modes=("aggregated",), requests=100))
    from sweeper.serving.plan import _Options
    options = _Options(result.question)
    formats = {(o.weights, o.kv_cache, o.experts) for o in options.decode(8, "fp8")}
    assert {"fp8"} == {w for w, _, _ in formats} and {"bf16", "fp8"} == {kv for _, kv, _ in formats}
    assert {"tp", "ep"} == {e for _, _, e in formats}


def test_launch_lines_carry_fp8_the_kv_cache_and_expert_parallelism():
    from sweeper.serving.launch import launch_lines

    profile = AppProfile(rate=4.0, input_len=parse_length(1024, "x", None),
                         output_len=parse_length(128, "x", None), ttft=1.0, tpot=0.05)
    part = {"chips": 4, "replicas": 1, "ffn": "ws1d", "attn": "head", "batch": 16,
            "weights": "fp8", "topology": "1x4x1", "kv_cache": "fp8", "experts": "ep"}
    fp8_ep = {"mode": "aggregated", "prefill": {**part, "batch": 1}, "decode": part}
    lines = {x["engine"]: x for x in launch_lines(fp8_ep, MIXTRAL, H100, profile)}
    vllm, sglang = lines["vllm"], lines["sglang"]
    assert vllm["command"].startswith("vllm serve mistralai/Mixtral-8x7B-v0.1 ")
    for flag in ("--quantization fp8", "--kv-cache-dtype fp8", "--enable-expert-parallel",
                 "--gpu-memory-utilization 0.9"):
        assert flag in vllm["command"]
    for flag in ("--quantization fp8", "--kv-cache-dtype fp8_e4m3", "--ep-size 4"):
        assert flag in sglang["command"]
    assert vllm["lacks"] == [] and sglang["lacks"] == []
    bf16 = {**part, "weights": "bf16", "kv_cache": "int8", "experts": "tp"}
    plain = {"mode": "aggregated", "prefill": {**bf16, "batch": 1}, "decode": bf16}
    vllm = launch_lines(plain, MIXTRAL, H100, profile)[0]
    assert "--quantization" not in vllm["command"] and "--enable-expert-parallel" not in vllm["command"]
    assert any("int8 KV cache" in x for x in vllm["lacks"])


def test_the_host_cost_model_counts_the_engines_moe_and_8bit_work():
    """costmodel.host_counts on a calibrated host (workloads/hostmodel.py): an MoE call counts
    the padded program's expert rows, every local expert's weights streamed per pass, and its
    all-to-alls; 8-bit weights (FP8 too) and an 8-bit KV cache count dequantised elements."""
    moe = MODEL_PRESETS["tiny-moe"]

    def counts(experts="tp", weights="bf16", kv="bf16", model=moe, chips=2, topology=(1, 2, 1)):
        call = cm.PhaseCall(model, chips, 8, "decode", 32, 36, WS1D, weights, topology, True,
                            experts, "padded", kv)
        return call, cm.host_counts(call)

    call, tp = counts()
    p = call.predict(cm._HOST_UNIT)
    attention = 8 * 4.0 * moe.n_layers * moe.n_heads * moe.d_head * 36
    assert tp["matmul_flops"] == pytest.approx(p.executed_flops - attention)
    assert tp["matmul_flops"] > 8 * 2.0 * cm.matmul_params(moe)       # X/k x the useful rows
    expert_elements = moe.n_experts * moe.mlp_matrices * moe.d_model * moe.d_ff * moe.n_layers
    assert tp["matmul_weights"] > expert_elements
    _, ep = counts("ep")
    sent = sum(c.elements * c.dtype_bytes * c.count for c in counts("ep")[0].predict(cm._HOST_UNIT)
               .collectives if c.kind == "all-to-all")
    assert sent > 0 and ep["exchange_bytes"] >= 2 * sent and tp["exchange_bytes"] < ep["exchange_bytes"]
    assert tp["dequant"] == 0
    _, fp8 = counts(weights="fp8")
    _, int8 = counts(weights="int8")
    assert fp8["dequant"] == int8["dequant"] == pytest.approx(cm.block_params(moe))
    _, kv8 = counts(kv="fp8")
    assert kv8["dequant"] > 0 and kv8["memory_bytes"] < tp["memory_bytes"]
    dense = MODEL_PRESETS["tiny"]          # a dense call counts as before: weights once per pass
    _, d = counts(model=dense)
    assert d["matmul_weights"] == pytest.approx(cm.matmul_params(dense))


def test_what_the_slot_server_does_not_run_is_refused_in_one_line():
    """The slot server (`sweeper serve`, serving trials) runs tp experts and a bf16 KV cache
    (docs/models.md): a plan slice or a serving trial asking for ep or an 8-bit cache is
    refused naming the field, before Ray or JAX start."""
    from sweeper.serving.serve import slot_specs
    from workloads.deployment import Deployment, PhaseSlice

    def deployment(**decode):
        part = dict(chips=4, replicas=1, ffn="ws1d", attn="head", batch=4, weights="bf16")
        return Deployment(MODEL_PRESETS["tiny-moe"], load_hardware("tpu-v4"), "aggregated",
                          PhaseSlice(**{**part, "batch": 1}), PhaseSlice(**{**part, **decode}))

    assert set(slot_specs(deployment(), context_len=16, seed=1)) == {"aggregated"}
    for field, value in (("experts", "ep"), ("kv_cache", "int8"), ("kv_cache", "fp8")):
        with pytest.raises(ConfigError) as err:
            slot_specs(deployment(**{field: value}), context_len=16, seed=1)
        assert err.value.field == f"decode.{field}" and "\n" not in str(err.value)
        stream = {"rate": 40, "requests": 8, "input_len": 16, "output_len": 4}
        with pytest.raises(ConfigError, match=f"{field}: got '{value}'.*serving trial"):
            TrialConfig.from_dict(dict(model="tiny-moe", chips=2, batch=2, input_len=8,
                                       decode_steps=2, serving=stream, **{field: value}))
    TrialConfig.from_dict(dict(model="tiny-moe", chips=2, batch=2, input_len=8, decode_steps=2,
                               serving={"rate": 40, "requests": 8, "input_len": 16,
                                        "output_len": 4}))
