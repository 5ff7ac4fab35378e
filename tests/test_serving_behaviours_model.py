"""Chunked prefill, prefix caching and pipeline stages in the serving model and planner
(workloads/serving/model.py, sweeper/serving/plan.py, sweeper/serving/launch.py; issue 38
item 4; docs/serving-model.md "Chunked prefill, prefix caching, pipeline stages").

Closed forms:
- chunked prefill: a prompt of two chunks alone takes two iterations, each a prefill of the
  chunk on top of the earlier chunk; a prompt chunked beside a decoding request adds one
  decode step to each of its iterations;
- prefix caching: an idle replica's TTFT drops by the prefill of the prefix (the call
  prefills the rest on top of the cached tokens);
- pipeline stages: a decode step is S x one stage's time at the micro-batch (slots / S) plus
  the activation transfers, each priced over the link its boundary crosses.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import pytest

from sweeper.serving.launch import launch_lines
from sweeper.serving.plan import PlanQuestion, plan
from workloads import costmodel
from workloads.config import load_hardware, load_model
from workloads.deployment import Deployment, PhaseSlice
from workloads.serving.model import (StepTimes, capacity_rps, cost_model_step_times,
                                     memory_budget, phase_prediction, simulate, stage_links,
                                     transfer_s)
from workloads.serving.profile import AppProfile, Request, parse_length, requests

H100 = load_hardware("h100")


def _len(tokens: int):
    return parse_length(str(tokens), "--input-len", None)


def _linear_times() -> StepTimes:
    """Made-up step times: a prefill costs 1 ms per new token and 0.1 ms per cached one it
    attends to; a decode step 10 ms."""
    return StepTimes(prefill_s=lambda b, n: 1e-3 * n, decode_step_s=lambda b, c: 0.01,
                     prefill_at_s=lambda b, n, o: 1e-3 * n + 1e-4 * o)


def _aggregated(chunk: int, slots: int = 4, model: str = "llama3.1-8b", chips: int = 1,
                weights: str = "bf16", stages: int = 1, hardware=H100) -> Deployment:
    return Deployment(load_model(model), hardware, "aggregated",
                      PhaseSlice(chips, 1, "ws1d", "head", 1, weights, stages=stages,
                                 chunk=chunk),
                      PhaseSlice(chips, 1, "ws1d", "head", slots, weights, stages=stages))


# --------------------------------------------------------------------------- chunked prefill


def test_a_prompt_of_two_chunks_alone_takes_two_iterations():
    times = _linear_times()
    one = [Request(0.0, 512, 1)]
    chunked = simulate(_aggregated(chunk=256), one, times)
    two_iterations = times.prefill_call_s(1, 256, 0) + times.prefill_call_s(1, 256, 256)
    assert chunked.ttft_s[0] == pytest.approx(two_iterations)          # 0.256 + 0.2816
    assert chunked.ttft_s[0] != pytest.approx(times.prefill_s(1, 512))  # not one whole call
    whole = simulate(_aggregated(chunk=0), one, times)
    assert whole.ttft_s[0] == pytest.approx(times.prefill_s(1, 512))


def test_chunks_ride_with_the_decode_steps_of_the_requests_decoding():
    """A decodes from 0.256 s; B arrives at 0.3 s, in the middle of A's fifth step (which
    ends at 0.306 s), and is prefilled in two chunks, each iteration one decode step of A
    plus the chunk; A's steps during them are that much longer."""
    times = _linear_times()
    reqs = [Request(0.0, 256, 50), Request(0.3, 512, 2)]
    result = simulate(_aggregated(chunk=256), reqs, times)
    a_first = times.prefill_call_s(1, 256, 0)
    step = times.decode_step_s(4, 0)
    b_start = a_first + 5 * step
    b_first = b_start + (step + times.prefill_call_s(1, 256, 0)) + (
        step + times.prefill_call_s(1, 256, 256))
    assert result.first_token_s[0] == pytest.approx(a_first)
    assert result.first_token_s[1] == pytest.approx(b_first)
    # A: 49 decode steps, two of them carrying B's chunks
    assert result.finish_s[0] == pytest.approx(b_first + (49 - 5 - 2) * step)
    # B's one decode step runs beside A's after B's last chunk
    assert result.finish_s[1] == pytest.approx(b_first + step)


def test_a_chunked_replica_without_a_free_slot_waits_for_one():
    """Every slot busy: the waiting prompt's first chunk runs only after a slot frees."""
    times = _linear_times()
    reqs = [Request(0.0, 64, 20), Request(0.01, 64, 3)]
    result = simulate(_aggregated(chunk=64, slots=1), reqs, times)
    a_finish = times.prefill_call_s(1, 64, 0) + 19 * times.decode_step_s(1, 0)
    assert result.finish_s[0] == pytest.approx(a_finish)
    assert result.first_token_s[1] == pytest.approx(a_finish + times.prefill_call_s(1, 64, 0))


def test_chunked_capacity_counts_every_chunk_of_a_prompt():
    times = _linear_times()
    d = _aggregated(chunk=128)
    cap = capacity_rps(d, times, 512, 2)
    # 4 chunks of 128 at the mean offset of (512 - 128) / 2 = 192 tokens
    assert cap["prefill_rps"] == pytest.approx(1 / (4 * times.prefill_call_s(1, 128, 192)))
    assert capacity_rps(_aggregated(chunk=0), times, 512, 2)["prefill_rps"] == pytest.approx(
        1 / times.prefill_s(1, 512))


# --------------------------------------------------------------------------- prefix caching


def test_a_cached_prefix_cuts_an_idle_ttft_by_about_its_prefill():
    d = _aggregated(chunk=0)
    times = cost_model_step_times(d)
    profile = AppProfile(rate=0.05, input_len=_len(2048), output_len=_len(8),
                         ttft=5, tpot=0.1)
    cached = dataclasses.replace(profile, prefix_len=1536, prefix_hit=1.0)
    plain = simulate(d, requests(profile, 40, seed=1), times)
    hits = simulate(d, requests(cached, 40, seed=1), times)
    assert all(r.cached_len == 1536 for r in requests(cached, 40, seed=1))
    saved = float(np.median(plain.ttft_s) - np.median(hits.ttft_s))
    # the prefill of the prefix: the whole prompt's less the rest's on top of the prefix
    expected = times.prefill_s(1, 2048) - times.prefill_call_s(1, 512, 1536)
    assert expected > 0.5 * times.prefill_s(1, 1536)
    assert saved == pytest.approx(expected, rel=0.05)


def test_a_call_of_cached_and_uncached_prompts_prefills_the_longest_uncached_part():
    times = _linear_times()
    d = Deployment(load_model("llama3.1-8b"), H100, "aggregated",
                   PhaseSlice(1, 1, "ws1d", "head", 2, "bf16"),
                   PhaseSlice(1, 1, "ws1d", "head", 4, "bf16"))
    both_cached = [Request(0.0, 300, 1, cached_len=200), Request(0.0, 400, 1, cached_len=200)]
    result = simulate(d, both_cached, times)
    assert result.ttft_s[0] == pytest.approx(times.prefill_call_s(2, 200, 200))
    mixed = [Request(0.0, 300, 1, cached_len=200), Request(0.0, 250, 1)]
    assert simulate(d, mixed, times).ttft_s[0] == pytest.approx(times.prefill_call_s(2, 250, 50))


def test_the_memory_budget_holds_one_copy_of_the_prefix_per_replica():
    d = _aggregated(chunk=0, slots=8)
    plain = memory_budget(d, 2048, 2304)["replica"]
    cached = memory_budget(d, 2048, 2304, prefix_len=1024)["replica"]
    per_token = costmodel.kv_bytes_per_token(d.model)        # one chip holds the whole cache
    assert "prefix_kv_bytes" not in plain
    assert cached["prefix_kv_bytes"] == pytest.approx(1024 * per_token)
    assert plain["free_bytes"] - cached["free_bytes"] == pytest.approx(1024 * per_token)
    assert plain["kv_capacity_tokens"] - cached["kv_capacity_tokens"] == pytest.approx(1024, abs=1)


# --------------------------------------------------------------------------- pipeline stages


def test_stage_boundaries_cross_the_node_link_only_between_nodes():
    assert stage_links(H100, 8, 2) == [(H100.inter_domain_bandwidth, "between domains")]
    assert stage_links(H100, 4, 2) == [(H100.ici_bandwidth, "fast interconnect")]
    links = [bw for bw, _ in stage_links(H100, 4, 4)]      # boundaries at chips 4, 8, 12
    assert links == [H100.ici_bandwidth, H100.inter_domain_bandwidth, H100.ici_bandwidth]
    model = load_model("llama3.1-70b")
    tokens = 16
    assert transfer_s(model, H100, 8, 2, tokens) == pytest.approx(
        tokens * model.d_model * 2 / H100.inter_domain_bandwidth)
    assert transfer_s(model, H100, 8, 1, tokens) == 0


def test_a_pipelined_decode_step_is_the_stages_at_the_micro_batch_and_the_transfers():
    d = _aggregated(chunk=0, slots=32, model="llama3.1-70b", chips=16, stages=2)
    times = cost_model_step_times(d)
    stage_at_micro = phase_prediction(d, "decode", 16, 1, 2048).latency_s
    stage_at_all = phase_prediction(d, "decode", 32, 1, 2048).latency_s
    transfer_micro = transfer_s(d.model, H100, 8, 2, 16)
    step = times.decode_step_s(32, 2048)
    assert step == pytest.approx(2 * stage_at_micro + transfer_micro, rel=1e-6)
    # without micro-batches the stages would take the whole batch in turn, one idle
    unpipelined = 2 * stage_at_all + transfer_s(d.model, H100, 8, 2, 32)
    assert step < unpipelined
    # one slot cannot be split: the bubble, every stage in turn for one sequence
    assert times.decode_step_s(1, 2048) == pytest.approx(
        2 * phase_prediction(d, "decode", 1, 1, 2048).latency_s
        + transfer_s(d.model, H100, 8, 2, 1), rel=1e-6)
    # a stage holds half the layers: about half the whole model's step on the same chips
    whole = phase_prediction(dataclasses.replace(d, decode=dataclasses.replace(
        d.decode, stages=1, chips=8), prefill=dataclasses.replace(d.prefill, stages=1, chips=8)),
        "decode", 16, 1, 2048).latency_s
    assert 0.45 < stage_at_micro / whole < 0.6


def test_a_slower_node_link_slows_the_staged_step_by_the_transfer():
    d = _aggregated(chunk=0, slots=32, model="llama3.1-70b", chips=16, stages=2)
    slow_hw = dataclasses.replace(H100, inter_domain_bandwidth=H100.inter_domain_bandwidth / 4)
    slow = dataclasses.replace(d, hardware=slow_hw)
    extra = (cost_model_step_times(slow).decode_step_s(32, 2048)
             - cost_model_step_times(d).decode_step_s(32, 2048))
    size = 16 * d.model.d_model * 2
    assert extra == pytest.approx(size / slow_hw.inter_domain_bandwidth
                                  - size / H100.inter_domain_bandwidth, rel=1e-3)
    prefill_extra = (cost_model_step_times(slow).prefill_s(1, 2048)
                     - cost_model_step_times(d).prefill_s(1, 2048))
    size = 2048 * d.model.d_model * 2
    assert prefill_extra == pytest.approx(size / slow_hw.inter_domain_bandwidth
                                          - size / H100.inter_domain_bandwidth, rel=1e-3)


def test_the_memory_budget_of_a_stage_holds_its_share_of_weights_and_cache():
    one = _aggregated(chunk=0, slots=16, model="llama3.1-405b", chips=8, weights="fp8")
    two = _aggregated(chunk=0, slots=16, model="llama3.1-405b", chips=16, weights="fp8",
                      stages=2)
    m1 = memory_budget(one, 2048, 2304)["replica"]
    m2 = memory_budget(two, 2048, 2304)["replica"]
    assert m2["stages"] == 2 and "stages" not in m1
    assert m2["kv_bytes"] == pytest.approx(m1["kv_bytes"] / 2)        # 63 of 126 layers
    # half the blocks, the embeddings in every stage: a little over half the weights
    assert 0.5 < m2["weights_bytes"] / m1["weights_bytes"] < 0.53


# --------------------------------------------------------------------------- the planner


def _question(**changes) -> PlanQuestion:
    profile = AppProfile(rate=1.0, input_len=_len(2048),
                         output_len=_len(256), ttft=5, tpot=0.1)
    return dataclasses.replace(PlanQuestion(load_model("llama3.1-405b"), H100, profile,
                                            requests=100), **changes)


def test_405b_in_bf16_on_h100_is_planned_in_stages_across_nodes_in_seconds():
    started = time.perf_counter()
    result = plan(_question(weights=("bf16",)))
    assert time.perf_counter() - started < 30
    best = result.best
    assert best is not None and best.meets_slo
    dec = best.deployment.decode
    assert dec.weights == "bf16" and dec.stages >= 2
    assert dec.stage_chips == H100.domain_chips        # tensor parallel inside one node
    assert best.chips_total >= 16
    data = best.to_dict()
    assert data["decode"]["stages"] == dec.stages
    assert result.plan_file()["deployment"]["decode"]["stages"] == dec.stages
    lines = {x["engine"]: x["command"] for x in launch_lines(data, result.question.model,
                                                             H100, result.question.profile)}
    assert f"--tensor-parallel-size 8 --pipeline-parallel-size {dec.stages}" in lines["vllm"]
    assert f"--tp 8 --pp-size {dec.stages}" in lines["sglang"]


def test_the_planner_offers_chunked_prefill_and_clips_the_chunks_to_the_prompt():
    from sweeper.serving.plan import CHUNK_SIZES, _Options

    short = _question(profile=dataclasses.replace(_question().profile,
                                                  input_len=_len(600)))
    assert _Options(short).chunk_sizes() == (0, 256, 512, 600)
    assert _Options(_question()).chunk_sizes() == CHUNK_SIZES


# --------------------------------------------------------------------------- launch lines


def _plan_dict(stages=1, chunk=0) -> dict:
    part = dict(chips=8 * stages, replicas=1, ffn="ws1d", attn="head", batch=32, weights="bf16",
                topology="1x8x1", stages=stages)
    return {"mode": "aggregated", "prefill": {**part, "batch": 1, "chunk": chunk},
            "decode": dict(part)}


def test_launch_lines_carry_stages_chunks_and_the_prefix_cache():
    model = load_model("llama3.1-405b")
    plain = AppProfile(rate=1.0, input_len=_len(2048), output_len=_len(256),
                       ttft=5, tpot=0.1)
    prefixed = dataclasses.replace(plain, prefix_len=1024, prefix_hit=0.5)
    lines = {x["engine"]: x for x in launch_lines(_plan_dict(stages=2, chunk=512), model, H100,
                                                   prefixed)}
    vllm, sglang = lines["vllm"]["command"], lines["sglang"]["command"]
    assert "--tensor-parallel-size 8 --pipeline-parallel-size 2" in vllm
    # vLLM's token budget counts one token per decoding slot beside the chunk
    assert "--enable-chunked-prefill --max-num-batched-tokens 544" in vllm
    assert "--enable-prefix-caching" in vllm and "--no-enable-chunked-prefill" not in vllm
    assert "--tp 8 --pp-size 2" in sglang
    assert "--chunked-prefill-size 512 --enable-mixed-chunk" in sglang
    assert "--disable-radix-cache" not in sglang
    assert lines["vllm"]["lacks"] == [] and lines["sglang"]["lacks"] == []
    off = {x["engine"]: x["command"] for x in launch_lines(_plan_dict(), model, H100, plain)}
    assert "--pipeline-parallel-size" not in off["vllm"] and "--pp-size" not in off["sglang"]
    assert "--no-enable-chunked-prefill" in off["vllm"]
    assert "--enable-prefix-caching" not in off["vllm"]
    assert "--chunked-prefill-size -1" in off["sglang"] and "--disable-radix-cache" in off["sglang"]
    (tpu,) = launch_lines(_plan_dict(stages=2, chunk=512), model, load_hardware("tpu-v5e"),
                          prefixed)
    assert any("pipeline stages" in f for f in tpu["lacks"])
    assert any("chunked prefill" in f for f in tpu["lacks"])


@pytest.mark.parametrize("flags,needle", [
    (["--hardware", "tpu-v5e", "--weights", "fp8"], "--weights"),   # no FP8 units
    (["--hardware", "h100", "--weights", "bf16,fp4"], "--weights"),
])
def test_bad_weights_are_one_line_exit_2(flags, needle, capsys, tmp_path, monkeypatch):
    from sweeper.cli import main

    monkeypatch.setenv("SWEEPER_HOME", str(tmp_path))
    assert main(["plan", "--model", "llama3.1-8b", "--rate", "1", "--no-mlflow", *flags]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and needle in err and "Traceback" not in err


def test_a_plan_with_a_shared_prefix_is_answered_and_carries_its_fields(capsys, tmp_path,
                                                                        monkeypatch):
    """The JSON answer of a profile with a prefix: every plan's slices carry stages and chunk,
    the memory budget the prefix's copy, the launch line the prefix cache."""
    import json

    from sweeper.cli import main

    monkeypatch.setenv("SWEEPER_HOME", str(tmp_path))
    code = main(["plan", "--model", "llama3.1-8b", "--hardware", "h100", "--rate", "4",
                 "--input-len", "2048", "--output-len", "64", "--prefix-len", "1024",
                 "--ttft", "1", "--tpot", "0.05", "--requests", "100", "--mode", "aggregated",
                 "--json", "--no-mlflow"])
    assert code == 0
    data = json.loads(capsys.readouterr().out)
    assert data["profile"]["prefix_len"] == 1024
    best = data["best"]
    assert {"stages", "chunk"} <= set(best["prefill"]) and best["decode"]["stages"] == 1
    assert best["memory_per_chip"]["replica"]["prefix_kv_bytes"] > 0
    vllm = next(x for x in data["launch"] if x["engine"] == "vllm")["command"]
    assert "--enable-prefix-caching" in vllm


def test_a_staged_prefill_slice_pipelines_consecutive_calls():
    """Disaggregated, two stages: a burst's calls enter the pipeline one stage time apart,
    each first token a whole pipeline's time after its call entered; the KV transfers go out
    one at a time after each call's first tokens. Without pipelining each call waits for the
    previous one's first tokens and transfers."""
    model = load_model("llama3.1-8b")

    def deployment(stages):
        part = PhaseSlice(2, 1, "ws1d", "head", 1, "bf16", stages=stages)
        return Deployment(model, H100, "disaggregated", part, dataclasses.replace(part, batch=4))

    burst = [Request(0.0, 128, 2) for _ in range(3)]
    piped = StepTimes(lambda b, n: 0.3, lambda b, c: 0.01, lambda n: 0.2,
                      prefill_interval_s=lambda b, n, o: 0.1)
    result = simulate(deployment(2), burst, piped)
    assert list(result.first_token_s) == pytest.approx([0.3, 0.4, 0.5])
    # the link: 0.3 -> 0.5, then 0.5 -> 0.7, then 0.7 -> 0.9; one decode step each after
    assert sorted(result.finish_s) == pytest.approx([0.51, 0.71, 0.91])
    serial = simulate(deployment(1), burst, dataclasses.replace(piped, prefill_interval_s=None))
    assert list(serial.first_token_s) == pytest.approx([0.3, 0.8, 1.3])
    # the cost model's: the interval is one stage and a transfer, well under the call
    times = cost_model_step_times(_aggregated(chunk=0, model="llama3.1-70b", chips=16,
                                              stages=2))
    assert times.prefill_interval_s(1, 2048, 0) < 0.6 * times.prefill_s(1, 2048)
    assert cost_model_step_times(_aggregated(chunk=0)).prefill_interval_s is None


# --------------------------------------------------------------------------- the frontier files


def test_the_frontier_csv_has_each_phases_stages_the_chunk_and_the_prefix(tmp_path):
    """`sweeper plan --out-dir`'s frontier.csv (sweeper/serving/outputs.py): per plan its
    prefill and decode stages, its prefill chunk and the profile's shared prefix, beside the
    layouts; a 405B plan in bf16 on H100 nodes has its stages there."""
    import csv
    import types

    from sweeper.serving.outputs import COLUMNS, frontier_rows, write_frontier
    from sweeper.serving.plan import HardwareChoice

    result = plan(_question(weights=("bf16",)))
    best = result.best
    rows = frontier_rows([HardwareChoice(result, "test")])
    (row,) = [r for r in rows if r["best"]]
    assert row["decode_stages"] == best.deployment.decode.stages >= 2
    assert row["prefill_stages"] == best.deployment.prefill.stages
    assert row["prefill_chunk"] == best.deployment.prefill.chunk
    assert row["prefix_len"] == 0 and row["prefix_hit"] is None
    files = write_frontier(rows, tmp_path / "out")
    read = list(csv.DictReader(open(files["csv"])))
    assert tuple(read[0]) == COLUMNS and len(read) == len(rows)
    assert [r["decode_stages"] for r in read] == [str(r["decode_stages"]) for r in rows]
    # a chunked plan of a profile with a shared prefix (the plan as Plan.to_dict gives it)
    part = dict(chips=8, replicas=1, ffn="ws1d", attn="head", batch=32, weights="bf16",
                topology="1x8x1", stages=1, chunk=0)
    data = {"mode": "aggregated", "prefill": {**part, "batch": 1, "chunk": 512},
            "decode": dict(part), "chips_total": 8, "cost_per_million_tokens": 1.0,
            "ttft_p50_s": 0.1, "ttft_p99_s": 0.2, "tpot_p50_s": 0.01, "tpot_p99_s": 0.02,
            "goodput_rps": 1.0, "tokens_per_s_per_chip": 10.0, "binding": "tpot"}
    one = types.SimpleNamespace(to_dict=lambda: data,
                                summary={"ttft_slo_stat_s": 0.2, "tpot_slo_stat_s": 0.02})
    profile = dataclasses.replace(_question().profile, prefix_len=1024, prefix_hit=0.5)
    question = types.SimpleNamespace(hardware=H100, profile=profile)
    fake = types.SimpleNamespace(result=types.SimpleNamespace(best=one, frontier=[one],
                                                              question=question),
                                 hardware=H100, price_source="test")
    (row,) = frontier_rows([fake])
    assert (row["prefill_stages"], row["prefill_chunk"], row["decode_stages"]) == (1, 512, 1)
    assert (row["prefix_len"], row["prefix_hit"]) == (1024, 0.5)


def test_a_disaggregated_launch_line_says_the_prefill_pools_stages():
    """The line is the decode pool's (its tensor- and pipeline-parallel sizes); the flag of a
    disaggregated plan names the prefill pool's, which may differ."""
    model = load_model("llama3.1-405b")
    profile = AppProfile(rate=1.0, input_len=_len(2048), output_len=_len(256), ttft=5, tpot=0.1)
    plan_ = {**_plan_dict(stages=2), "mode": "disaggregated"}
    plan_["prefill"] = {**plan_["prefill"], "chips": 24, "stages": 3}
    (vllm, sglang) = launch_lines(plan_, model, H100, profile)
    assert "--tensor-parallel-size 8 --pipeline-parallel-size 2" in vllm["command"]
    assert "--tp 8 --pp-size 2" in sglang["command"]
    (flag,) = [f for f in vllm["lacks"] if "disaggregated" in f]
    assert "prefill pool's is 8 chips tensor parallel in 3 pipeline stages" in flag
