"""The serving model (workloads/serving/model.py) against closed-form cases, and its inputs.

Closed forms (docs/serving.md "The serving model"):
- one replica, deterministic arrivals slower than service: TTFT = one prefill call, TPOT =
  one decode step (aggregated), + the KV transfer spread over the answer (disaggregated);
- saturating load: throughput = the decode capacity, slots / ((K - 1) x step) per replica;
- serving host costs (per step, per prefill call, per handover in the decode loop): each
  adds to the idle TTFT/TPOT and to the saturated capacity as `capacity_rps` says;
- prefill-only M/D/1 queue (Poisson arrivals, one server, constant service D): mean wait
  rho D / (2 (1 - rho)) (Pollaczek-Khinchine).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import yaml

from sweeper.serving import bands
from workloads.deployment import Deployment, PhaseSlice, load_plan
from workloads.serving.costs import HostCosts
from workloads.serving.model import (StepTimes, capacity_rps, cost_model_step_times,
                                     kv_link_bandwidth, phase_prediction, simulate)
from workloads.serving.profile import (AppProfile, Request, parse_length, profile_from_dict,
                                       read_trace, requests)
from workloads import costmodel
from workloads.config import ConfigError, HardwareProfile, load_hardware, load_model


def _deployment(mode="aggregated", slots=4, prefill_batch=1, replicas=1, model="palm-540b",
                hardware="tpu-v4", chips=64):
    return Deployment(load_model(model), load_hardware(hardware), mode,
                      PhaseSlice(chips, replicas, "ws2d", "head", prefill_batch, "int8"),
                      PhaseSlice(chips, replicas, "ws2d", "batch", slots, "int8"))


def _constant(prefill_s, step_s, transfer_s=0.0):
    return StepTimes(lambda b, n: prefill_s, lambda b, c: step_s, lambda n: transfer_s)


def _spaced(n, gap, input_len=128, output_len=10):
    return [Request(i * gap, input_len, output_len) for i in range(n)]


def test_handover_charge_is_the_decode_process_cpu_or_the_loops_own_figure_if_more():
    """workloads/serving/hostcosts.py `handover_costs` and `combine`: the decode loop's charge per
    handover is the decode process's CPU per handover, or, where more, the loop's own
    figure (the closed loop's insert mean; where the stepping loop was measured, its
    figure, at least its inserts); never the idle loop's insert, which stays in the detail
    (docs/serving.md "What a handover costs a stepping decode loop")."""
    from workloads.serving.hostcosts import combine, handover_costs

    pre = {"engine_prefill_s": 0.009, "loop_prefill_mean_s": 0.011, "loop_prefill_prompts": 1.0}
    dec = {"engine_step_s": 0.005, "loop_step_mean_s": 0.006, "loop_step_paired_extra_s": 0.0006}
    served = [{"first_token_s": k - 0.001, "sent_s": float(k), "insert_start_s": k + 0.003,
               "kv_ready_s": k + 0.003 + ins, "finish_s": k + 0.004 + ins + 7 * 0.0056,
               "tokens": [0] * 8} for k, ins in enumerate([0.0012, 0.0013, 0.0014])]
    samples = [{"bytes": 1000, "start": 0.0, "exported": 0.001, "submitted": 0.0015,
                "in_slot": 0.004, "insert_s": ins} for ins in (0.0006, 0.0008)]
    charge, detail = handover_costs(samples, decode_cpu_s=0.0019)
    assert charge == pytest.approx(0.0019) and detail["insert_mean_s"] == pytest.approx(0.0007)
    assert handover_costs(samples, decode_cpu_s=0.0002)[0] == pytest.approx(0.0007)
    costs = combine(pre, dec, (charge, detail), served)
    assert costs["handover_overhead_s"] == pytest.approx(0.0019)
    assert costs["detail"]["idle_handovers"]["handover_overhead_s"] == pytest.approx(0.0013)
    assert costs["handover_latency_s"] == pytest.approx(0.003)
    for figure, inserts, charged in ((0.0025, 0.0008, 0.0025), (0.0005, 0.0021, 0.0021),
                                     (0.0009, 0.0008, 0.0019)):
        stepping = {"handovers": 10, "handover_overhead_s": figure, "insert_s": inserts}
        costs = combine(pre, dec, (charge, detail), served, stepping)
        assert costs["handover_overhead_s"] == pytest.approx(charged)
        assert costs["detail"]["stepping_handovers"] is stepping
    # a stepping measurement without handovers (none arrived in time) changes nothing
    costs = combine(pre, dec, (charge, detail), served, {"handovers": 0, "windows": []})
    assert costs["handover_overhead_s"] == pytest.approx(0.0019)


def test_stepping_handover_costs_closed_form():
    """workloads/serving/hostcosts.py `stepping_handover_costs` on a made-up call log: windows N W W
    N ..., 5 ms steps; in the windows with handovers each insert takes 0.6 ms and the step
    right after it 1 ms more; one step in a window with handovers is interrupted for 40 ms
    (another process), which the medians keep out of the charge: 0.6 + 1.0 ms per handover,
    where the windows' loop times paired (a diagnostic) read it in."""
    from workloads.serving.hostcosts import stepping_handover_costs, stepping_partner, stepping_with

    windows, window_s = 8, 0.2
    assert [stepping_with(k) for k in range(8)] == [False, True, True, False] * 2
    assert [stepping_partner(k) for k in (1, 2, 5, 6)] == [0, 3, 4, 7]
    calls, t = [], 0.0
    for k in range(windows):
        n = 0
        while t < (k + 1) * window_s - 0.012:
            step = 0.005
            if stepping_with(k) and n % 5 == 2:          # a handover before this step
                calls.append(("insert", t, t + 0.0006))
                t += 0.0006
                step += 0.001
            if k == 1 and n == 7:
                step += 0.040
            calls.append(("step", t, t + step))
            t += step
            n += 1
        t = (k + 1) * window_s
    out = stepping_handover_costs(calls, 0.0, windows, window_s)
    assert out["handover_overhead_s"] == pytest.approx(0.0016)
    assert out["insert_s"] == pytest.approx(0.0006) and out["step_after_s"] == pytest.approx(0.001)
    assert len(out["pairs"]) == 4 and out["handovers"] == sum(p["handovers"] for p in out["pairs"])
    window_1 = next(p for p in out["pairs"] if p["window"] == 1)
    assert window_1["window_paired_s"] > 0.0016 + 0.030 / window_1["handovers"]
    # no handovers at all: nothing to charge
    plain = [c for c in calls if c[0] == "step"]
    assert stepping_handover_costs(plain, 0.0, windows, window_s)["handovers"] == 0


@pytest.mark.parametrize("mode", ["aggregated", "disaggregated"])
def test_idle_arrivals_see_one_prefill_and_one_step_per_token(mode):
    d = _deployment(mode)
    result = simulate(d, _spaced(20, 10.0), _constant(0.25, 0.02, transfer_s=0.1))
    assert np.allclose(result.ttft_s, 0.25)
    extra = 0.1 / 9 if mode == "disaggregated" else 0.0    # the transfer, over K - 1 tokens
    assert np.allclose(result.tpot_s, 0.02 + extra)


def test_prefill_slice_sends_each_kv_before_its_next_call():
    """Disaggregated: the prefill slice exports and sends each request's KV itself before its
    next prefill call (server.py serve_prefill), so two requests arriving together see the
    second prefill start after the first's transfer: TTFT 0.25 and 0.25 + 0.1 + 0.25."""
    d = _deployment("disaggregated")
    result = simulate(d, [Request(0.0, 128, 10), Request(0.0, 128, 10)],
                      _constant(0.25, 0.02, transfer_s=0.1))
    assert np.allclose(np.sort(result.ttft_s), [0.25, 0.6])
    assert np.isclose(result.prefill_busy_s, 2 * (0.25 + 0.1))


@pytest.mark.parametrize("mode", ["aggregated", "disaggregated"])
def test_a_prefill_on_an_idle_loop_pays_the_wake(mode):
    """HostCosts `prefill_wake_s` (docs/serving.md "Serving host costs"): a prefill call that
    starts on a loop that had nothing to do until its arrival takes the wake longer before
    its first token; one that starts right after other work does not. Two requests arriving
    together after idle: TTFT 0.25 + 0.05, then (aggregated) one decode step later the
    second's call, or (disaggregated) after the first's transfer, with no wake: 0.3 + 0.02
    + 0.25, 0.3 + 0.1 + 0.25. Spaced arrivals each find the loop idle: every TTFT 0.3."""
    d = _deployment(mode)
    times = _host(_constant(0.25, 0.02, transfer_s=0.1), prefill_wake_s=0.05)
    together = simulate(d, [Request(0.0, 128, 10), Request(0.0, 128, 10)], times)
    second = 0.3 + (0.02 if mode == "aggregated" else 0.1) + 0.25
    assert np.allclose(np.sort(together.ttft_s), [0.3, second])
    spaced = simulate(d, _spaced(5, 10.0), times)
    assert np.allclose(spaced.ttft_s, 0.3)
    # no wake measured: as before
    assert np.allclose(simulate(d, _spaced(5, 10.0), _constant(0.25, 0.02, 0.1)).ttft_s, 0.25)


def test_the_idle_wake_grows_with_the_idle_time_between_its_two_measurements():
    """HostCosts `wake_after`: straight in log(idle) from the short idle's wake to the long
    one's, flat beyond them; one measured idle (or none recorded): that wake at any idle."""
    costs = HostCosts(prefill_wake_s=0.05, prefill_wake_idle_s=10.0,
                      prefill_wake_short_s=0.01, prefill_wake_short_idle_s=0.1)
    assert costs.wake_after(1.0) == pytest.approx(0.03)          # log-midway
    assert costs.wake_after(0.1 * 10 ** 0.5) == pytest.approx(0.02)   # a quarter of the way
    assert costs.wake_after(0.001) == costs.wake_after(0.1) == 0.01
    assert costs.wake_after(100.0) == costs.wake_after(float("inf")) == 0.05
    for one in (HostCosts(prefill_wake_s=0.05, prefill_wake_idle_s=10.0),
                HostCosts(prefill_wake_s=0.05)):
        assert one.wake_after(0.01) == one.wake_after(100.0) == 0.05


@pytest.mark.parametrize("mode", ["aggregated", "disaggregated"])
def test_an_idle_calls_wake_is_the_wake_after_as_long_as_the_loop_idled(mode):
    """The serving model prices a call on an idle loop with the wake after the time the loop
    idled (from its previous work's end to the arrival; HostCosts `wake_after`): one-token
    requests, prefill 0.25, wakes 0.01 after 0.1 s idle and 0.05 after 10 s. The first
    (idle since the start) pays 0.05 and frees the loop at 0.3; one arriving 1.0 s later
    pays 0.03; 0.05 s later, 0.01; 10 s later, 0.05."""
    d = _deployment(mode)
    times = _host(_constant(0.25, 0.02), prefill_wake_s=0.05, prefill_wake_idle_s=10.0,
                  prefill_wake_short_s=0.01, prefill_wake_short_idle_s=0.1)
    for idle, wake in ((1.0, 0.03), (0.05, 0.01), (10.0, 0.05)):
        out = simulate(d, [Request(0.0, 128, 1), Request(0.3 + idle, 128, 1)], times)
        assert np.allclose(out.ttft_s, [0.3, 0.25 + wake]), idle


@pytest.mark.parametrize("mode", ["aggregated", "disaggregated"])
def test_a_prefills_host_work_before_its_first_tokens_delays_them(mode):
    """HostCosts `prefill_first_overhead_s` (docs/serving.md "Serving host costs"): of a
    prefill call's host work (0.03 per prompt), the part before its first tokens (0.01)
    delays them on every call, the rest (0.02) comes after; the call's total is the same.
    Two requests together after idle, wake 0.005 (less than 0.01: the call pays 0.01):
    TTFT 0.25 + 0.01; the second's call starts after the first's 0.25 + 0.03 and
    (aggregated) one decode step 0.02, or (disaggregated) the transfer 0.1, and pays 0.01
    before its first token. With a wake of 0.05 an idle call pays the wake instead."""
    d = _deployment(mode)
    times = _host(_constant(0.25, 0.02, transfer_s=0.1), prefill_wake_s=0.005,
                  prefill_overhead_per_prompt_s=0.03, prefill_first_overhead_s=0.01)
    together = simulate(d, [Request(0.0, 128, 10), Request(0.0, 128, 10)], times)
    second = 0.28 + (0.02 if mode == "aggregated" else 0.1) + 0.25 + 0.01
    assert np.allclose(np.sort(together.ttft_s), [0.26, second])
    assert np.isclose(together.prefill_busy_s, 2 * (0.28 + (0.0 if mode == "aggregated" else 0.1)))
    # all of the host work after the first tokens (0 before them): TTFT the engine's call
    after = _host(times, prefill_first_overhead_s=0.0, prefill_wake_s=0.0)
    assert np.allclose(np.sort(simulate(d, [Request(0.0, 128, 10)] * 2, after).ttft_s),
                       [0.25, second - 0.01])
    woken = _host(times, prefill_wake_s=0.05)
    assert np.allclose(simulate(d, _spaced(5, 10.0), woken).ttft_s, 0.3)


def test_cost_model_step_times_give_the_predicted_prefill_and_transfer():
    """With the default (analytical) step times an idle deployment's TTFT is the cost
    model's prefill latency, and its disaggregated TPOT adds the KV bytes over the link."""
    reqs = _spaced(5, 100.0, input_len=2048, output_len=64)
    agg_d = _deployment("aggregated", slots=64)    # batch-sharded attention: slots % 64 chips
    agg = simulate(agg_d, reqs)
    assert np.allclose(agg.ttft_s, phase_prediction(agg_d, "prefill", 1, 2048).latency_s)
    dis_d = _deployment("disaggregated", slots=64)
    dis = simulate(dis_d, reqs)
    bandwidth, _ = kv_link_bandwidth(dis_d)
    transfer = costmodel.kv_bytes_per_token(dis_d.model) * 2048 / bandwidth
    assert np.allclose(dis.kv_transfer_s, transfer)
    assert np.allclose(dis.ttft_s, phase_prediction(dis_d, "prefill", 1, 2048).latency_s)
    # decode steps of one request: context 2049 .. 2111 (affine in the context)
    steps = [phase_prediction(dis_d, "decode", 64, 1, c).latency_s for c in (2049, 2111)]
    expected = (transfer + 63 * (steps[0] + steps[1]) / 2) / 63
    assert np.allclose(dis.tpot_s, expected, rtol=1e-6)


def test_host_model_decode_steps_follow_the_cache_kink_at_short_contexts():
    """A calibrated host's step time is not affine in the context: past the worker's cache
    its DRAM terms start (workloads/hostmodel.py). The serving model evaluates it on a grid
    of contexts (`CONTEXT_GRID`), so a short stream's steps are the host model's own, not a
    line through two long contexts; the closed-form run of steps agrees with stepping."""
    from workloads import hostmodel
    from workloads.serving.model import CONTEXT_GRID

    costs = {"launch": 2e-5, "layer_device": 3e-5, "matmul_flops": 6e-12,
             "matmul_weights": 8e-11, "memory_bytes": 4e-11, "dram_bytes": 4e-10,
             "dram_weights": 1e-9, "attention_flops": 1e-11}
    model = load_model("tiny")
    kv_per_token = costmodel.kv_bytes_per_token(model)
    weights = costmodel.weight_bytes_per_chip(model, 1)
    # the cache ends between contexts 1024 and 2048 of a 4-slot step
    cache = weights + kv_per_token * 4 * 1400
    host = hostmodel.HostModel({"prefill": costs, "decode": costs}, 1.0, cache)
    hw = HardwareProfile("host", 4e11, 3e10, 2.4e10, 2e9, measured=True, host_model=host.to_dict())
    d = Deployment(model, hw, "aggregated", PhaseSlice(1, 1, "ws1d", "head", 1, "bf16"),
                   PhaseSlice(1, 1, "ws1d", "head", 4, "bf16"))
    times = cost_model_step_times(d)

    def exact(c):
        return phase_prediction(d, "decode", 4, 1, c).latency_s

    # the kink is there: a line through 1024 and 2048 misses the short contexts by far
    slope = (exact(2048) - exact(1024)) / 1024
    assert exact(1024) - slope * (1024 - 40) < 0.8 * exact(40)
    for c in (CONTEXT_GRID, 2 * CONTEXT_GRID, 1024, 2048):
        assert times.decode_step_s(4, c) == pytest.approx(exact(c), rel=1e-9)
    for c in (40, 100, 1500):
        assert times.decode_step_s(4, c) == pytest.approx(exact(c), rel=0.03)
    reqs = _spaced(6, 0.002, input_len=40, output_len=60)
    closed = simulate(d, reqs, times)
    stepped = simulate(d, reqs, dataclasses.replace(times, decode_affine=None))
    assert np.allclose(closed.finish_s, stepped.finish_s, rtol=1e-3)
    # one request alone: its TPOT is the mean step over its contexts
    alone = simulate(d, _spaced(1, 1.0, input_len=40, output_len=60), times)
    assert alone.tpot_s[0] == pytest.approx(np.mean([exact(c) for c in range(41, 100)]), rel=0.02)


def test_a_calibrated_hosts_idle_wake_moves_with_the_weights_up_to_the_cache():
    """workloads/serving/model.py `host_costs_for`: on a calibrated host a prefill after an
    idle gap streams from DRAM the weights a warm call found in cache, so the wake measured
    on one deployment moves by the host model's DRAM time of the weight difference (the
    decode phase's cost per element: nothing hides it), up to the worker's cache; a profile that does not record the weights it measured the wake
    with, or is not a calibrated host's, keeps its wake."""
    from workloads import hostmodel
    from workloads.serving.model import host_costs_for, prefill_weight_bytes

    dram = 4e-10                                   # s per bf16 element from DRAM, unhidden
    costs = {"launch": 2e-5, "layer_device": 3e-5, "matmul_flops": 6e-12, "dram_weights": dram}
    cache = 40e6                                   # the worker's (share 0.5 of 80 MB)
    # a prefill's own DRAM cost is what its matmuls do not hide: not the cold call's
    host = hostmodel.HostModel({"prefill": {**costs, "dram_weights": dram / 8}, "decode": costs},
                               0.5, 2 * cache)
    small, wide = load_model("tiny"), load_model("small")

    def deployment(model, wake_bytes, host_model=host.to_dict()):
        hw = HardwareProfile("host", 4e11, 3e10, 2.4e10, 2e9, measured=True, host_share=0.5,
                             host_model=host_model, host_costs=HostCosts(
                                 prefill_wake_s=0.002, prefill_wake_weight_bytes=wake_bytes,
                                 prefill_wake_short_s=0.0005))
        one = PhaseSlice(1, 1, "ws1d", "head", 1, "bf16")
        return Deployment(model, hw, "aggregated", one, one)

    measured_on = prefill_weight_bytes(deployment(small, 0.0))
    assert 0 < measured_on < cache
    assert host_costs_for(deployment(small, measured_on)).prefill_wake_s == pytest.approx(0.002)
    # a wider model: its extra weights (up to the cache) from DRAM
    wider = deployment(wide, measured_on)
    extra = min(prefill_weight_bytes(wider), cache) - measured_on
    assert extra > 0
    assert host_costs_for(wider).prefill_wake_s == pytest.approx(0.002 + extra / 2 * dram)
    # the short idle's wake moves by its share of the long one's (a quarter here), ...
    assert host_costs_for(wider).prefill_wake_short_s == pytest.approx(0.0005 + extra / 2 * dram / 4)
    # measured on weights past the cache: a narrower model's wake is smaller, never < 0,
    # ... and the short idle's wake never above the long one's
    narrower = host_costs_for(deployment(small, 10 * cache))
    assert narrower.prefill_wake_s == pytest.approx(max(0.002 - (cache - measured_on) / 2 * dram, 0.0))
    assert narrower.prefill_wake_short_s == pytest.approx(
        min(max(0.0005 * narrower.prefill_wake_s / 0.002, 0.0), narrower.prefill_wake_s))
    # the weights not recorded, or not a calibrated host: the wake as measured
    assert host_costs_for(deployment(wide, 0.0)).prefill_wake_s == 0.002
    assert host_costs_for(deployment(wide, measured_on, host_model={})).prefill_wake_s == 0.002
    # the serving model charges it: an idle arrival's TTFT is the prefill and the wake
    d = wider
    times = cost_model_step_times(d)
    alone = simulate(d, _spaced(1, 1.0, input_len=32, output_len=1), times)
    assert alone.ttft_s[0] == pytest.approx(times.prefill_s(1, 32) + times.host_costs.prefill_wake_s)


def _with_host_costs(times, step=0.0, prefill=0.0, handover=0.0):
    return _host(times, step_overhead_s=step, prefill_overhead_per_prompt_s=prefill,
                 handover_overhead_s=handover)


def _host(times, **costs):
    """`times` with these host costs (workloads/serving/costs.py HostCosts) replaced."""
    return dataclasses.replace(times, host_costs=dataclasses.replace(times.host_costs, **costs))


@pytest.mark.parametrize("mode", ["aggregated", "disaggregated"])
def test_idle_arrivals_pay_the_serving_host_costs(mode):
    """Serving host costs (docs/serving.md): at idle, TTFT = the prefill call alone (the
    server has the first token on the host before it writes the row into a slot or exports
    its KV); TPOT = decode step + its host work, plus, over K - 1 tokens, the prompt's host
    work after its first token (disaggregated: + the transfer and the handover's host work)."""
    times = _with_host_costs(_constant(0.25, 0.02, transfer_s=0.1), step=0.005, prefill=0.03,
                             handover=0.04)
    result = simulate(_deployment(mode), _spaced(20, 10.0), times)
    assert np.allclose(result.ttft_s, 0.25)
    extra = (0.1 + 0.04) / 9 if mode == "disaggregated" else 0.0
    assert np.allclose(result.tpot_s, 0.02 + 0.005 + 0.03 / 9 + extra)


@pytest.mark.parametrize("mode", ["aggregated", "disaggregated"])
def test_prefill_host_cost_is_paid_per_prompt_the_call_takes(mode):
    """The prefill host cost is per prompt of the call (its rows' inserts or KV exports;
    a replay of served streams showed a 1-prompt call of a 4-prompt deployment pays ~1/4 of
    the 4-prompt call's host cost): one prompt, then a burst of four 1 s later; the burst's
    call ends its host work 4 p after its first tokens, the lone prompt's p after."""
    p, call = 0.01, 0.2
    d = _deployment(mode, slots=4, prefill_batch=4)
    times = _with_host_costs(_constant(call, 0.001), prefill=p)
    reqs = [Request(0.0, 128, 2)] + [Request(1.0, 128, 2) for _ in range(4)]
    result = simulate(d, reqs, times)
    assert np.allclose(result.first_token_s, [call] + [1.0 + call] * 4)
    assert np.isclose(result.prefill_busy_s, 2 * call + 5 * p)


def test_handovers_are_serialised_through_the_decode_loop():
    """Disaggregated: a burst's handovers are inserted one after the other by the decode
    slice (each handover_overhead_s of its loop): four requests prefilled in one call are
    all inserted (4 h) before the first step, and then decode together."""
    d = _deployment("disaggregated", slots=4, prefill_batch=4)
    h, step, prefill = 0.05, 0.01, 0.2
    times = _with_host_costs(_constant(prefill, step), handover=h)
    result = simulate(d, [Request(0.0, 128, 11) for _ in range(4)], times)
    assert np.allclose(result.finish_s, prefill + 4 * h + 10 * step)
    assert np.isclose(result.decode_busy_s, 4 * h + 10 * step)


def test_handover_latency_delays_the_kv_not_the_prefill_loop():
    """HostCosts `handover_latency_s` (disaggregated: the KV's transport to the decode process
    and its idle loop's poll, charged to neither loop): at idle each request's KV is ready
    `latency` after its send, so TPOT grows by latency / (K - 1); two requests arriving
    together see the second prefill right after the first's transfer, as without it (TTFT
    0.25 and 0.6), and the prefill loop's busy time is unchanged."""
    d = _deployment("disaggregated")
    latency = 0.07
    times = _host(_constant(0.25, 0.02, transfer_s=0.1), handover_latency_s=latency)
    idle = simulate(d, _spaced(20, 10.0), times)
    assert np.allclose(idle.ttft_s, 0.25)
    assert np.allclose(idle.tpot_s, 0.02 + (0.1 + latency) / 9)
    burst = simulate(d, [Request(0.0, 128, 10), Request(0.0, 128, 10)], times)
    assert np.allclose(np.sort(burst.ttft_s), [0.25, 0.6])
    assert np.isclose(burst.prefill_busy_s, 2 * (0.25 + 0.1))


def test_an_aggregated_loops_first_steps_after_an_idle_prefill_pay_their_wake():
    """HostCosts `decode_after_wake_s` (aggregated): the decode steps right after a prefill
    call that found the loop idle take the decode wake after as long as the loop idled
    (`decode_wake_after`) longer; a request prefilled on a busy loop pays none. Spaced
    arrivals (idle over 10 s, past the long idle): TPOT = step + 0.03 / (K - 1). Two requests
    together: the first's steps pay it, the second's (prefilled on the busy loop) do not.
    Arrivals 0.3 + 1.0 s apart (log-midway between the idles): 0.02."""
    d = _deployment("aggregated", slots=4)
    times = _host(_constant(0.25, 0.02), decode_after_wake_s=0.03, prefill_wake_idle_s=10.0,
                  decode_after_wake_short_s=0.01, prefill_wake_short_idle_s=0.1)
    idle = simulate(d, _spaced(5, 20.0), times)
    assert np.allclose(idle.tpot_s, 0.02 + 0.03 / 9)
    burst = [Request(0.0, 128, 10), Request(0.0, 128, 10)]
    together, plain = simulate(d, burst, times), simulate(d, burst, _constant(0.25, 0.02))
    first, second = np.argsort(plain.first_token_s)
    assert np.allclose(together.finish_s - plain.finish_s, 0.03)     # one wake, before both
    assert np.isclose(together.tpot_s[first], plain.tpot_s[first] + 0.03 / 9)
    assert np.isclose(together.tpot_s[second], plain.tpot_s[second])
    apart = simulate(d, [Request(0.0, 128, 2), Request(0.25 + 0.03 + 0.02 + 1.0, 128, 2)], times)
    assert np.allclose(apart.tpot_s, [0.02 + 0.03, 0.02 + 0.02])
    # none measured (a preset, an older profile): as before
    assert np.allclose(simulate(d, _spaced(5, 10.0), _constant(0.25, 0.02)).tpot_s, 0.02)
    assert np.allclose(simulate(_deployment("disaggregated"), _spaced(5, 10.0), times).tpot_s,
                       simulate(_deployment("disaggregated"), _spaced(5, 10.0),
                                _constant(0.25, 0.02)).tpot_s)


def test_the_decode_wake_after_an_idle_interpolates_between_its_two_idles():
    """HostCosts `decode_wake_after`: as `wake_after`, on the prefill wake's two idles."""
    costs = HostCosts(prefill_wake_idle_s=10.0, prefill_wake_short_idle_s=0.1,
                      decode_after_wake_s=0.05, decode_after_wake_short_s=0.01)
    assert costs.decode_wake_after(1.0) == pytest.approx(0.03)
    assert costs.decode_wake_after(0.01) == 0.01 and costs.decode_wake_after(100.0) == 0.05
    assert HostCosts(decode_after_wake_s=0.05).decode_wake_after(0.01) == 0.05


def test_a_disaggregated_deployments_prefill_wake_is_its_slice_loops_where_measured():
    """HostCosts `for_mode` and model `host_costs_for`: a profile measured on both kinds of
    loop (`sweeper calibrate`) prices a disaggregated deployment's idle prefill with the
    prefill slice's wake, an aggregated one's with the aggregated loop's; without a slice
    wake both take `prefill_wake_s`. One-token requests 20 s apart: TTFT = prefill + wake."""
    from workloads.serving.model import cost_model_step_times, host_costs_for

    costs = HostCosts(prefill_wake_s=0.05, prefill_wake_idle_s=1.0, slice_wake_s=0.02,
                      slice_wake_idle_s=2.0, slice_wake_short_s=0.01, slice_wake_short_idle_s=0.1)
    sliced = costs.for_mode("disaggregated")
    assert (sliced.prefill_wake_s, sliced.prefill_wake_idle_s, sliced.prefill_wake_short_s,
            sliced.prefill_wake_short_idle_s) == (0.02, 2.0, 0.01, 0.1)
    assert costs.for_mode("aggregated") == costs
    assert HostCosts(prefill_wake_s=0.05).for_mode("disaggregated").prefill_wake_s == 0.05
    for mode, wake in (("aggregated", 0.05), ("disaggregated", 0.02)):
        d = _deployment(mode)
        d = dataclasses.replace(d, hardware=dataclasses.replace(d.hardware, host_costs=costs))
        assert host_costs_for(d).prefill_wake_s == wake
        times = dataclasses.replace(_constant(0.25, 0.02), host_costs=host_costs_for(d))
        assert np.allclose(simulate(d, _spaced(3, 20.0, output_len=1), times).ttft_s, 0.25 + wake)


def test_the_decode_wake_is_the_idle_requests_decoding_beyond_the_models_charge():
    """hostcosts.decode_after_wake: each set's median seconds from first token to last,
    minus the prefill's host work after its first tokens and the steps the model charges
    (engine step + step overhead each), at least 0; nothing without the requests."""
    from workloads.serving.hostcosts import decode_after_wake

    costs = {"prefill_overhead_per_prompt_s": 0.003, "prefill_first_overhead_s": 0.001,
             "step_overhead_s": 0.0005}
    loop = {"wake_decode_steps": 3, "engine_step_s": 0.002, "engine_step_pipelined_s": 0.0015,
            "wake_decoding_s": [0.012, 0.010, 0.030], "wake_short_decoding_s": [0.005, 0.006, 0.007]}
    out = decode_after_wake(loop, costs)
    assert out["decode_after_wake_s"] == pytest.approx(0.012 - 0.002 - 3 * 0.002)
    assert out["decode_after_wake_short_s"] == 0.0          # 0.006 - 0.008 < 0
    assert decode_after_wake({"wake_decode_steps": 0}, costs) == {}


def test_an_idle_decode_loops_first_step_pays_the_wake():
    """HostCosts `decode_wake_s`: the decode slice's first step after it was idle (no slot
    busy) takes `wake` longer; a request inserted while another decodes does not wake it.
    Idle arrivals: TPOT = step + (transfer + wake) / (K - 1). Two requests 0.05 s apart
    (prefill 0.01, steps 0.02, 10 tokens): the second is inserted during the first's
    decoding, so the loop's busy time is one wake, not two."""
    d = _deployment("disaggregated", slots=4)
    wake = 0.03
    times = _host(_constant(0.25, 0.02, transfer_s=0.1), decode_wake_s=wake)
    idle = simulate(d, _spaced(20, 10.0), times)
    assert np.allclose(idle.tpot_s, 0.02 + (0.1 + wake) / 9)
    times = _host(_constant(0.01, 0.02), decode_wake_s=wake)
    close = simulate(d, [Request(0.0, 128, 10), Request(0.05, 128, 10)], times)
    assert np.isclose(close.finish_s[0], 0.01 + wake + 9 * 0.02)
    assert np.isclose(close.decode_busy_s, wake + (close.finish_s[1] - 0.01 - wake))


def test_an_idle_prefills_work_after_its_first_tokens_is_at_least_its_measured_floor():
    """HostCosts `prefill_idle_after_s` (disaggregated: an idle prefill loop's export and
    send after its first tokens, per prompt): two requests arriving together on an idle
    prefill slice (prefill 0.25, closed-loop work per prompt 0.01, idle floor 0.04): the
    first call, on the idle loop, ends 0.04 after its first tokens, so the second's first
    token is at 0.25 + 0.04 + 0.25; the second call (not idle) keeps 0.01. A floor below
    the closed loop's work changes nothing."""
    d = _deployment("disaggregated")
    times = _host(_with_host_costs(_constant(0.25, 0.02), prefill=0.01), prefill_idle_after_s=0.04)
    burst = simulate(d, [Request(0.0, 128, 10), Request(0.0, 128, 10)], times)
    assert np.allclose(np.sort(burst.first_token_s), [0.25, 0.25 + 0.04 + 0.25])
    assert np.isclose(burst.prefill_busy_s, 0.25 + 0.04 + 0.25 + 0.01)
    low = _host(times, prefill_idle_after_s=0.005)
    assert np.allclose(np.sort(simulate(d, [Request(0.0, 128, 10)] * 2, low).first_token_s),
                       [0.25, 0.25 + 0.01 + 0.25])


def test_idle_handover_costs_from_served_records():
    """workloads/serving/hostcosts.py `idle_handover_costs`: from requests served one at a time by
    the slice loops, the handover's latency (insert start - send end), its insert on the
    decode loop's clock, the decode wake (decoding after the insert beyond the model's
    steps) and the idle prefill's work after its first tokens (send end - first token),
    each the median over requests, the wake at least 0."""
    from workloads.serving.hostcosts import idle_handover_costs

    served = [{"first_token_s": 1.0 * k - 0.0005 - 0.0001 * k,
               "sent_s": 1.0 * k, "insert_start_s": 1.0 * k + lat, "kv_ready_s": 1.0 * k + lat + ins,
               "finish_s": 1.0 * k + lat + ins + 7 * 0.001 + extra, "tokens": [0] * 8}
              for k, (lat, ins, extra) in enumerate([(0.0010, 0.0008, 0.0020),
                                                     (0.0012, 0.0009, 0.0022),
                                                     (0.0030, 0.0020, 0.0100)])]
    costs = idle_handover_costs(served, step_s=0.001)
    assert costs["handover_latency_s"] == pytest.approx(0.0012)
    assert costs["handover_overhead_s"] == pytest.approx(0.0009)
    assert costs["decode_wake_s"] == pytest.approx(0.0022)
    assert costs["prefill_idle_after_s"] == pytest.approx(0.0006)
    assert costs["requests"] == 3
    assert idle_handover_costs(served, step_s=0.01)["decode_wake_s"] == 0.0
    assert idle_handover_costs([{"tokens": [0]}], step_s=0.001) == {"requests": 0}


@pytest.mark.parametrize("mode", ["aggregated", "disaggregated"])
def test_saturating_load_with_host_costs_serves_at_the_capacity_they_give(mode):
    """At saturation the throughput is capacity_rps with the host costs in the steps and
    calls (aggregated: 1 / ((K-1)(step + s)/slots + prefill + p); disaggregated, decode-bound:
    slots / ((K-1)(step + s) + slots x h))."""
    slots, output_len, step, prefill = 8, 41, 0.01, 0.002
    d = _deployment(mode, slots=slots)
    times = _with_host_costs(_constant(prefill, step), step=0.002, prefill=0.001, handover=0.003)
    burst = [Request(0.0, 128, output_len) for _ in range(1500)]
    summary = simulate(d, burst, times).summary()
    capacity = capacity_rps(d, times, 128, output_len)
    if mode == "aggregated":
        expected = 1 / ((output_len - 1) * 0.012 / slots + 0.003)
    else:
        expected = slots / ((output_len - 1) * 0.012 + slots * 0.003)
    assert capacity["rps"] == pytest.approx(expected, rel=1e-9)
    assert summary["throughput_rps"] == pytest.approx(expected, rel=0.03)


def test_cost_model_step_times_carry_the_profiles_host_costs():
    d = _deployment("disaggregated", slots=64)
    costs = HostCosts(*(0.001 * (k + 1) for k in range(len(HostCosts.names()))))
    hw = dataclasses.replace(d.hardware, host_costs=costs)
    # (a disaggregated deployment's: its prefill slice's wake, `for_mode`)
    assert cost_model_step_times(dataclasses.replace(d, hardware=hw)).host_costs == costs.for_mode(
        "disaggregated") != costs
    assert cost_model_step_times(d).host_costs == HostCosts() == d.hardware.host_costs
    # a profile file carries them as a `host_costs:` mapping; a negative one is refused
    from workloads.config import ConfigError, HardwareProfile

    assert hw.to_dict()["host_costs"] == costs.to_dict()
    assert HardwareProfile.from_dict(yaml.safe_load(yaml.safe_dump(hw.to_dict()))) == hw
    for key in HostCosts.names():
        with pytest.raises(ConfigError, match=f"host_costs.{key}"):
            HardwareProfile.from_dict({**hw.to_dict(), "host_costs": {**costs.to_dict(), key: -1}})
    with pytest.raises(ConfigError, match="step_overhead_z"):
        HardwareProfile.from_dict({**hw.to_dict(), "host_costs": {"step_overhead_z": 0.1}})


def test_profiles_written_before_host_costs_still_load():
    """A profile YAML of the old flat `serving_*_s` keys (committed results, a user's host
    profile) loads into the same HostCosts; flat keys beside a `host_costs:` mapping and a
    negative flat one are refused."""
    from workloads.config import ConfigError, HardwareProfile
    from workloads.serving.costs import OLD_NAMES

    d = _deployment("disaggregated")
    costs = HostCosts(*(0.001 * (k + 1) for k in range(len(HostCosts.names()))))
    new = {k: v for k, v in d.hardware.to_dict().items() if k != "host_costs"}
    old_name = {new_name: old for old, new_name in OLD_NAMES.items()}
    flat = {old_name.get(k, k): v for k, v in costs.to_dict().items()}
    assert "serving_step_overhead_s" in flat and "handover_overhead_s" in flat
    loaded = HardwareProfile.from_dict({**new, **flat})
    assert loaded.host_costs == costs
    assert loaded == dataclasses.replace(d.hardware, host_costs=costs)
    assert HardwareProfile.from_dict(loaded.to_dict()) == loaded          # written nested
    with pytest.raises(ConfigError, match="serving_decode_wake_s"):
        HardwareProfile.from_dict({**new, "serving_decode_wake_s": -1})
    with pytest.raises(ConfigError, match="serving_step_overhead_s"):
        HardwareProfile.from_dict({**new, "serving_step_overhead_s": 0.1,
                                   "host_costs": {"decode_wake_s": 0.1}})
    # a committed profile of the flat keys (0 there: fitted, not measured)
    path = Path(__file__).resolve().parents[1] / "benchmarks/results/serving_validation.fitted.yaml"
    assert "serving_step_overhead_s" in yaml.safe_load(path.read_text())
    assert load_hardware(str(path)).host_costs == HostCosts()


@pytest.mark.parametrize("mode,replicas", [("aggregated", 1), ("disaggregated", 2)])
def test_saturating_load_serves_at_the_decode_capacity(mode, replicas):
    slots, output_len, step, prefill = 8, 41, 0.01, 0.002
    d = _deployment(mode, slots=slots, replicas=replicas)
    burst = [Request(0.0, 128, output_len) for _ in range(1500)]
    result = simulate(d, burst, _constant(prefill, step))
    if mode == "aggregated":    # each request also holds its replica for one prefill call
        capacity = replicas / ((output_len - 1) * step / slots + prefill)
    else:                       # prefill (500 req/s per slice) is not the bottleneck
        capacity = replicas * slots / ((output_len - 1) * step)
    summary = result.summary()
    assert summary["throughput_rps"] == pytest.approx(capacity, rel=0.03)
    assert summary["goodput_rps"] == summary["throughput_rps"]      # no SLO given
    assert summary["completed"] == 1500


def test_prefill_only_queue_matches_md1_mean_wait():
    """Output length 1: a replica is a single server with constant service D (M/D/1)."""
    service, rate = 0.1, 5.0             # rho = 0.5: mean wait rho D / (2 (1 - rho)) = 0.05 s
    profile = AppProfile(rate=rate, input_len=parse_length(64, "x", None),
                         output_len=parse_length(1, "x", None))
    result = simulate(_deployment(), requests(profile, 20000, seed=3), _constant(service, 0.01))
    rho = rate * service
    expected = service + rho * service / (2 * (1 - rho))
    assert float(np.mean(result.ttft_s)) == pytest.approx(expected, rel=0.05)
    assert np.isnan(result.tpot_s).all()     # a one-token answer has no TPOT


def test_more_replicas_never_slow_the_stream():
    profile = AppProfile(rate=30.0, input_len=parse_length(512, "x", None),
                         output_len=parse_length(32, "x", None), ttft=1.0, tpot=0.05)
    reqs = requests(profile, 600, seed=1)
    p99 = [simulate(_deployment(replicas=r, slots=8), reqs, _constant(0.05, 0.02), slo=profile)
           .summary()["ttft_p99_s"] for r in (1, 2, 4)]
    assert p99[0] > p99[1] >= p99[2]


def test_summary_goodput_counts_requests_meeting_both_slos():
    profile = AppProfile(rate=1.0, ttft=0.3, tpot=0.05)
    reqs = [Request(0.0, 64, 11), Request(50.0, 64, 11)]
    times = StepTimes(lambda b, n: 0.2, lambda b, c: 0.04)
    result = simulate(_deployment(slots=1), reqs, times, slo=profile)
    s = result.summary()
    # goodput = completed requests meeting the SLO per second, over throughput's span
    assert s["slo_attainment"] == 1.0 and s["goodput_rps"] == pytest.approx(2 / s["span_s"])
    assert s["offered_rps"] == pytest.approx(1 / 50.0)      # this two-request stream's rate
    assert s["throughput_rps"] == pytest.approx(2 / s["span_s"]) and s["span_s"] > 50
    tight = AppProfile(rate=1.0, ttft=0.1, tpot=0.05)
    assert result.summary(tight)["slo_attainment"] == 0.0
    assert result.summary(tight)["goodput_rps"] == 0.0
    assert s["cost_per_million_tokens"] > 0       # tpu-v4 has a price
    no_price = _deployment(slots=1, model="llama2-70b", chips=8)
    no_price.hardware = dataclasses.replace(no_price.hardware, price_per_chip_hour=None)
    assert simulate(no_price, reqs, times).summary()["cost_per_million_tokens"] is None


# --------------------------------------------------------------------------- inputs


def test_deployment_round_trip_and_plan_file(tmp_path):
    d = _deployment("disaggregated")
    d.decode.topology = (4, 4, 4)
    again = Deployment.from_dict(json.loads(json.dumps(d.to_dict())))
    assert again.to_dict() == d.to_dict() and again.decode.topology == (4, 4, 4)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({"deployment": d.to_dict()}))
    assert load_plan(path).to_dict() == d.to_dict()
    fitted = d.hardware.from_dict({**d.hardware.to_dict(), "name": "mine",
                                     "heldout_residuals": {"decode": [0.1, -0.2]}})
    d.hardware = fitted      # a profile that is not a preset travels whole
    assert Deployment.from_dict(d.to_dict()).hardware.heldout_residuals == {"decode": [0.1, -0.2]}


@pytest.mark.parametrize("change,field", [
    ({"mode": "both"}, "mode"),
    ({"prefill": {"chips": 32, "replicas": 1, "ffn": "ws2d", "attn": "head", "batch": 1,
                  "weights": "int8"}}, "prefill.chips"),
    ({"decode": {"chips": 64, "ffn": "ws3d", "attn": "head", "batch": 1}}, "decode.ffn"),
    ({"decode": {"chips": 64, "ffn": "ws2d", "attn": "head", "batch": 0}}, "decode.batch"),
    ({"model": "palm-999b"}, "model"),
    ({"slots": 4}, "slots"),
])
def test_bad_deployment_is_one_line(change, field):
    data = {**_deployment().to_dict(), **change}
    with pytest.raises(ConfigError) as err:
        Deployment.from_dict(data, "plan.json")
    assert err.value.field == field and "\n" not in str(err.value)
    assert str(err.value).startswith("plan.json: ")


def test_serving_block_and_lengths(tmp_path):
    p = profile_from_dict({"rate": 2, "input_len": {"dist": "uniform", "low": 100, "high": 200},
                           "output_len": "lognormal:64:0.5", "ttft": 1, "tpot": 0.05,
                           "slo_stat": "p90", "tpot_stat": "mean"}, "space.yaml")
    assert (p.ttft_statistic, p.tpot_statistic) == ("p90", "mean")
    reqs = requests(p, 4000, seed=0)
    inputs = np.array([r.input_len for r in reqs])
    outputs = np.array([r.output_len for r in reqs])
    assert inputs.min() >= 100 and inputs.max() <= 200
    assert outputs.mean() == pytest.approx(64, rel=0.05)
    gaps = np.diff([0.0] + [r.arrival_s for r in reqs])
    assert gaps.mean() == pytest.approx(0.5, rel=0.05)          # Poisson at 2 req/s
    assert profile_from_dict(p.to_dict()) == p                   # the plan file round trip
    trace = tmp_path / "trace.csv"
    trace.write_text("arrival_s,input_len,output_len\n0.5,10,3\n0.0,20,4\n")
    t = profile_from_dict({"trace": str(trace), "ttft": 1, "tpot": 0.1})
    assert [r.input_len for r in requests(t, 10)] == [20, 10]


@pytest.mark.parametrize("block,field", [
    ({"rate": -1, "ttft": 1, "tpot": 1}, "serving.rate"),
    ({"ttft": 1, "tpot": 1}, "serving.rate"),
    ({"rate": 1, "ttft": "soon", "tpot": 1}, "serving.ttft"),
    ({"rate": 1, "input_len": "gaussian:3", "tpot": 1}, "serving.input_len"),
    ({"rate": 1, "input_len": {"dist": "uniform", "low": 9, "high": 3}}, "serving.input_len.high"),
    ({"rate": 1, "slo_stat": "p100"}, "serving.slo_stat"),
    ({"rate": 1, "attainment": 1.5}, "serving.attainment"),
    ({"rate": 1, "ttfb": 1}, "serving.ttfb"),
    ({"trace": "/no/such.csv"}, "serving.trace"),
])
def test_bad_serving_block_is_one_line(block, field):
    with pytest.raises(ConfigError) as err:
        profile_from_dict(block, "space.yaml")
    assert err.value.field == field and "\n" not in str(err.value)


def test_bad_trace_rows_are_one_line(tmp_path):
    trace = tmp_path / "t.csv"
    trace.write_text("arrival_s,input_len,output_len\n0.0,10,3\n1.0,-4,3\n")
    with pytest.raises(ConfigError, match="line 3"):
        read_trace(str(trace))


# --------------------------------------------------------------------------- bands


def test_conformal_band_needs_enough_held_out_points():
    assert bands.minimum_points(0.9) == 19
    few = bands.conformal_ratio_band([0.1] * 18, 0.9)
    assert few.status == "too few held-out points" and not few.known
    assert bands.conformal_ratio_band([], 0.9).status == "uncalibrated"
    # residuals r = pred/meas - 1 of 0.25 and -0.2: measured/predicted 0.8 and 1.25
    band = bands.conformal_ratio_band([0.25] * 10 + [-0.2] * 10, 0.9)
    assert band.known and band.low == pytest.approx(0.8) and band.high == pytest.approx(1.25)
    hw = load_hardware({"name": "fitted", "peak_flops": 1e12, "hbm_bandwidth": 1e11,
                        "hbm_bytes": 1e10, "ici_bandwidth": 1e10,
                        "heldout_residuals": {"prefill": [0.0] * 19}})
    assert bands.profile_bands(hw)["prefill"].known
    assert bands.profile_bands(hw)["decode"].status == "uncalibrated"


@pytest.mark.parametrize("bad", [{"decode": [0.1, "x"]}, {"generate": [0.1]}, {"decode": [-1.5]},
                                 [0.1]])
def test_bad_heldout_residuals_are_one_line(bad):
    with pytest.raises(ConfigError) as err:
        load_hardware({"peak_flops": 1e12, "hbm_bandwidth": 1e11, "hbm_bytes": 1e10,
                       "ici_bandwidth": 1e10, "heldout_residuals": bad})
    assert "heldout_residuals" in err.value.field


@pytest.mark.parametrize("field,value", [("domain_chips", -8), ("torus_dims", 4),
                                         ("price_per_chip_hour", -1),
                                         ("inter_domain_bandwidth", "fast")])
def test_bad_serving_hardware_fields_are_one_line(field, value):
    with pytest.raises(ConfigError) as err:
        load_hardware({"peak_flops": 1e12, "hbm_bandwidth": 1e11, "hbm_bytes": 1e10,
                       "ici_bandwidth": 1e10, field: value}, "gpu.yaml")
    assert err.value.field == f"hardware.{field}" and "\n" not in str(err.value)


def test_kv_transfer_crosses_domains_at_the_inter_domain_bandwidth():
    """An 8-GPU NVLink node: pools that fit in it use NVLink, larger ones InfiniBand."""
    h100 = load_hardware("h100")
    small = Deployment(load_model("llama2-70b"), h100, "disaggregated",
                       PhaseSlice(2, 1, "ws1d", "head", 1, "int8"),
                       PhaseSlice(4, 1, "ws1d", "head", 8, "int8"))
    assert kv_link_bandwidth(small) == (2 * h100.ici_bandwidth, "fast interconnect (one domain)")
    small.decode.replicas = 2          # 2 + 8 chips: two nodes
    assert kv_link_bandwidth(small) == (2 * h100.inter_domain_bandwidth, "between domains")


def test_host_costs_are_the_loops_means_per_prompt():
    """sweeper/serving/overheads.py: the step cost is the loop's mean step minus the engine's
    median (a queue pays the mean); the prefill cost is per prompt of the closed loop's
    calls; a loop faster than the engine (timer noise) costs 0."""
    from sweeper.serving.overheads import host_costs

    worker = {"engine_step_s": 0.004, "loop_step_s": 0.0045, "loop_step_mean_s": 0.005,
              "engine_prefill_s": 0.025, "loop_prefill_s": 0.030, "loop_prefill_mean_s": 0.033,
              "loop_prefill_prompts": 4.0}
    costs = host_costs(worker, worker)
    assert costs["step_overhead_s"] == pytest.approx(0.001)
    assert costs["prefill_overhead_per_prompt_s"] == pytest.approx(0.002)
    fast = {**worker, "loop_step_mean_s": 0.003, "loop_prefill_mean_s": 0.02}
    assert host_costs(fast, fast) == {"step_overhead_s": 0.0, "prefill_overhead_per_prompt_s": 0.0}


def test_first_token_overhead_is_the_paired_part_of_the_prefills_host_work():
    """sweeper/serving/overheads.py `first_token_overhead`: the closed loop's paired time
    before a prefill's first tokens, never below 0 nor above the call's whole host work;
    0 for a measurement without it (all of the host work after the first tokens)."""
    from sweeper.serving.overheads import first_token_overhead

    pre = {"engine_prefill_s": 0.010, "loop_prefill_mean_s": 0.013,
           "loop_prefill_first_paired_extra_s": 0.001}
    assert first_token_overhead(pre) == pytest.approx(0.001)
    assert first_token_overhead({**pre, "loop_prefill_first_paired_extra_s": -0.0005}) == 0.0
    assert first_token_overhead({**pre, "loop_prefill_first_paired_extra_s": 0.005}) == pytest.approx(0.003)
    assert first_token_overhead({"engine_prefill_s": 0.01, "loop_prefill_mean_s": 0.013}) == 0.0


def test_decode_slice_step_cost_is_the_paired_difference():
    """A decode slice's closed loop pairs each step with the engine's call just before it
    (server.py `measure_host_costs`): its step cost is that paired difference, not the loop's
    mean minus the engine's median, which charges every step of a stream the other
    processes' load during the measurement (dis-1+1chip-4slots once read 1.82 ms for a
    0.85 ms median difference; docs/serving.md "Serving host costs")."""
    from sweeper.serving.overheads import host_costs

    prefill = {"engine_prefill_s": 0.008, "loop_prefill_mean_s": 0.010, "loop_prefill_prompts": 1.0}
    decode = {"engine_step_s": 0.0048, "loop_step_s": 0.0057, "loop_step_mean_s": 0.0066,
              "loop_step_paired_extra_s": 0.0007}
    assert host_costs(prefill, decode)["step_overhead_s"] == pytest.approx(0.0007)
    noisy = {**decode, "loop_step_paired_extra_s": -0.0002}     # timer noise: costs 0
    assert host_costs(prefill, noisy)["step_overhead_s"] == 0.0
    unpaired = {k: v for k, v in decode.items() if k != "loop_step_paired_extra_s"}
    assert host_costs(prefill, unpaired)["step_overhead_s"] == pytest.approx(0.0018)


def test_step_cost_adds_the_wait_for_each_steps_tokens():
    """workloads/serving/hostcosts.py `step_sync_s`: the host model prices the engine's step
    as a trial times it, pipelined (one wait per run of steps); the loop waits for every
    step's tokens, so what the synchronised call takes beyond the pipelined step is part of
    the step's host cost, and the step it is charged on top of is the pipelined one."""
    from workloads.serving.hostcosts import engine_step_priced_s, host_costs, step_sync_s

    prefill = {"engine_prefill_s": 0.008, "loop_prefill_mean_s": 0.010, "loop_prefill_prompts": 1.0}
    decode = {"engine_step_s": 0.0048, "loop_step_mean_s": 0.0066,
              "loop_step_paired_extra_s": 0.0007, "engine_step_pipelined_s": 0.0045}
    assert step_sync_s(decode) == pytest.approx(0.0003)
    assert host_costs(prefill, decode)["step_overhead_s"] == pytest.approx(0.0010)
    # the loop's step is the same either way: the pipelined step + the cost
    assert engine_step_priced_s(decode) + host_costs(prefill, decode)["step_overhead_s"] == \
        pytest.approx(0.0048 + 0.0007)
    # a pipelined run slower than the call (timer noise) adds nothing; unmeasured, nothing
    assert step_sync_s({**decode, "engine_step_pipelined_s": 0.005}) == 0.0
    old = {k: v for k, v in decode.items() if k != "engine_step_pipelined_s"}
    assert step_sync_s(old) == 0.0 and engine_step_priced_s(old) == 0.0048


def test_replay_of_a_served_aggregated_log_gives_its_first_tokens_back():
    """A trace test of the aggregated rules (docs/serving.md "Checking the model against the
    server"): the call log the server writes for a burst of 3 requests on 2 slots (prefill,
    step, prefill, step, prefill, step, step: one prefill between two decode steps while
    requests decode), replayed with its own durations (sweeper/serving/serve.py
    `replay_step_times`), gives each request's logged first token and its last step's end."""
    from sweeper.serving.serve import replay_step_times

    d = _deployment("aggregated", slots=2)
    calls = {"aggregated": [
        ("prefill", 0.0, 0.010, [0], 0.011), ("step", 0.011, 0.016, 1, 0.0165),
        ("prefill", 0.0165, 0.0265, [1], 0.0275), ("step", 0.0275, 0.0325, 2, 0.033),
        ("prefill", 0.033, 0.043, [2], 0.044), ("step", 0.044, 0.049, 2, 0.0495),
        ("step", 0.0495, 0.0545, 1, 0.055)]}
    result = simulate(d, [Request(0.0, 128, 3) for _ in range(3)], replay_step_times(d, calls))
    assert np.allclose(result.first_token_s, [0.010, 0.0265, 0.043])
    assert np.allclose(result.finish_s, [0.033, 0.0495, 0.055])


def test_replay_with_arrivals_charges_an_idle_call_its_logged_wake():
    """A loop asleep until a request's arrival starts its prefill late (the wake is in no
    call's duration): replayed with the stream's arrivals, a call that found the loop idle
    lasts its own wake as well (here 2 ms and 4 ms); a call right after other work does
    not (sweeper/serving/serve.py `idle_wakes`)."""
    from sweeper.serving.serve import idle_wakes, replay_step_times

    d = _deployment("aggregated", slots=2)
    # request 0 arrives at 0 (started at 2 ms), request 1 at 5 ms while 0 decodes (no
    # wake), request 2 at 100 ms after everything ended (started at 104 ms)
    calls = {"aggregated": [
        ("prefill", 0.002, 0.012, [0], 0.013), ("step", 0.013, 0.018, 1, 0.0185),
        ("prefill", 0.0185, 0.0285, [1], 0.0295), ("step", 0.0295, 0.0345, 2, 0.035),
        ("step", 0.035, 0.040, 1, 0.0405),
        ("prefill", 0.104, 0.114, [2], 0.115), ("step", 0.115, 0.120, 1, 0.1205),
        ("step", 0.1205, 0.1255, 1, 0.126)]}
    reqs = [Request(0.0, 128, 3), Request(0.005, 128, 3), Request(0.100, 128, 3)]
    assert idle_wakes(calls["aggregated"], [r.arrival_s for r in reqs]) == \
        pytest.approx([0.002, 0.0, 0.004])
    result = simulate(d, reqs, replay_step_times(d, calls, reqs))
    # the idle calls' logged first tokens; without arrivals, their wakes are lost
    assert np.allclose(result.first_token_s[[0, 2]], [0.012, 0.114])
    without = simulate(d, reqs, replay_step_times(d, calls))
    assert np.allclose(without.first_token_s[[0, 2]], [0.010, 0.110])


def test_replay_of_a_served_disaggregated_log_charges_the_decode_loop_its_inserts():
    """Disaggregated: the prefill slice's send (export and Ray submission) delays the KV's
    arrival, the decode loop pays only its insert (the delivery between the processes
    overlaps both loops): first token at the logged prefill end; the last token at send end
    + insert + two steps."""
    from sweeper.serving.serve import replay_step_times

    d = _deployment("disaggregated", slots=2)
    calls = {"prefill": [("prefill", 0.0, 0.010, [0]), ("send", 0.010, 0.012, [0])],
             "decode": [("insert", 0.0125, 0.0135, 0), ("step", 0.0135, 0.018, 1, 0.0185),
                        ("step", 0.0185, 0.023, 1, 0.0235)]}
    result = simulate(d, [Request(0.0, 128, 3)], replay_step_times(d, calls))
    assert np.allclose(result.first_token_s, [0.010])
    assert np.allclose(result.finish_s, [0.012 + 0.001 + 2 * 0.005])


def test_prefill_spread_gives_the_mg1_mean_wait():
    """Prefill durations with a spread (factors 0.2 or 1.8, mean 1): a prefill-only replica
    is an M/G/1 queue, mean wait lambda E[S^2] / (2 (1 - rho)) (Pollaczek-Khinchine), above
    the M/D/1 wait of the same mean service."""
    service, rate = 0.1, 5.0
    profile = AppProfile(rate=rate, input_len=parse_length(64, "x", None),
                         output_len=parse_length(1, "x", None))
    times = dataclasses.replace(_constant(service, 0.01), prefill_spread=(0.2, 1.8), spread_seed=4)
    result = simulate(_deployment(), requests(profile, 20000, seed=3), times)
    second_moment = service ** 2 * (0.2 ** 2 + 1.8 ** 2) / 2
    rho = rate * service
    expected = service + rate * second_moment / (2 * (1 - rho))
    assert float(np.mean(result.ttft_s)) == pytest.approx(expected, rel=0.05)


def test_step_spread_keeps_the_mean_tpot_and_spreads_it():
    """Decode steps with a spread (mean-1 factors): at idle the mean TPOT is still one step,
    and the p99 is above the p50."""
    times = dataclasses.replace(_constant(0.25, 0.02), step_spread=(0.5, 1.0, 1.5), spread_seed=1)
    result = simulate(_deployment(), _spaced(2000, 10.0, output_len=5), times)
    assert float(np.mean(result.tpot_s)) == pytest.approx(0.02, rel=0.02)
    assert np.percentile(result.tpot_s, 99) > np.percentile(result.tpot_s, 50) * 1.2


def test_duration_spread_is_the_closed_loops_calls_over_their_mean():
    from sweeper.serving.overheads import duration_spread

    costs = {"detail": {"prefill": {"loop_prefill_samples_s": [0.01, 0.03]},
                        "decode": {"loop_step_samples_s": [0.004, 0.004, 0.010]}}}
    prefill, step = duration_spread(costs)
    assert prefill == pytest.approx((0.5, 1.5))
    assert step == pytest.approx((2 / 3, 2 / 3, 5 / 3))
    assert duration_spread({"detail": {"aggregated": {}}}) == ((), ())
    # aggregated paired prefill calls: each over the mean of its own prompt count's calls
    # (a 4-prompt call is longer by its prompts' host work, not by a spread)
    paired = {"loop_prefill_samples_s": [0.02], "prefill_pair_prompts": [1, 4, 1, 4],
              "prefill_pair_call_s": [0.009, 0.018, 0.011, 0.022],
              "loop_step_samples_s": [0.005]}
    prefill, step = duration_spread({"detail": {"aggregated": paired}})
    assert prefill == pytest.approx((1.0, 0.9, 1.1, 0.9, 1.1))
    assert step == pytest.approx((1.0,))


@pytest.mark.parametrize("rate,slots", [(2.0, 8), (10.0, 4), (40.0, 2)])
def test_goodput_is_completed_requests_meeting_the_slo_per_second(rate, slots):
    """Issue 39: a plan reported goodput 10 req/s beside throughput 8.4 (goodput was
    attainment x the offered rate). By definition goodput counts completed requests that
    meet both SLOs over the span the throughput divides by, so it never exceeds it; from
    an underloaded stream to one twenty times the capacity."""
    profile = AppProfile(rate=rate, input_len=parse_length(128, "x", None),
                         output_len=parse_length(16, "x", None), ttft=1.0, tpot=0.05)
    result = simulate(_deployment(slots=slots), requests(profile, 400, seed=2),
                      _constant(0.02, 0.03), slo=profile)
    s = result.summary()
    meeting = int(np.count_nonzero(result.meets_slo(profile)))
    assert s["goodput_rps"] == pytest.approx(meeting / s["span_s"])
    assert s["throughput_rps"] == pytest.approx(s["completed"] / s["span_s"])
    assert s["goodput_rps"] <= s["throughput_rps"]
    assert s["goodput_rps"] == pytest.approx(s["slo_attainment"] * s["throughput_rps"])
