"""`sweeper calibrate` and the host cost model (docs/host-calibration.md): the model's fit
and held-out errors, the profile's resolution (`host` is the calibrated profile of THIS
host only), the corrections a study fit makes on it, the probe draws, and one real quick
calibration through the pinned processes."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from sweeper.calibrate import tasks
from workloads import costmodel, hostmodel, hostprofile, probes
from workloads.config import ConfigError, HardwareProfile, load_hardware as load_file
from workloads.hardware import describe, load_hardware, per_chip
from workloads.trial import TrialConfig

ROOT = Path(__file__).resolve().parents[1]
HOST = HardwareProfile("host", 4e11, 3e10, 2.4e10, 2e9, measured=True)


def _trial(**fields) -> TrialConfig:
    data = dict(model="tiny", chips=2, batch=4, input_len=32, decode_steps=8,
                prefill={"ffn": "ws2d", "attn": "head"}, decode={"ffn": "ws1d", "attn": "batch"})
    data.update(fields)
    return TrialConfig.from_dict(data).resolved()


def _costs(scale: float = 1.0) -> dict:
    """A made-up host: plausible costs per unit for both phases."""
    one = {"launch": 2e-5, "layer_device": 3e-5, "collective_op": 1e-5, "gather_bytes": 5e-10,
           "matmul_flops": 6e-12, "matmul_weights": 8e-11, "memory_bytes": 4e-11, "dequant": 3e-10}
    return {ph: {t: v * scale for t, v in one.items()} for ph in ("prefill", "decode")}


# ----------------------------------------------------------------------------- the model


def test_counts_sum_over_the_devices_that_share_a_core():
    """Per-device work counts once per device: the same trial on 2 chips has twice the
    layer-device dispatches of 1 chip, the same total matmul FLOPs, and collectives and
    the per-layer handover only on more than one chip."""
    one = costmodel.host_counts(costmodel.phase_calls(_trial(chips=1))["decode"])
    two = costmodel.host_counts(costmodel.phase_calls(_trial(chips=2))["decode"])
    assert two["layer_device"] == 2 * one["layer_device"]
    assert two["matmul_flops"] == pytest.approx(one["matmul_flops"], rel=0.05)
    assert one["collective_op"] == 0 and two["collective_op"] > 0
    # a mesh's per-layer handover: layers x devices past one device, none on one
    four = costmodel.host_counts(costmodel.phase_calls(_trial(chips=4))["decode"])
    layers = _trial().model.n_layers
    assert (one["layer_mesh"], two["layer_mesh"], four["layer_mesh"]) == (0, 2 * layers, 4 * layers)
    int8 = costmodel.host_counts(costmodel.phase_calls(_trial(weights="int8"))["decode"])
    assert int8["dequant"] > 0 and two["dequant"] == 0


def test_fit_recovers_known_costs_and_holds_out_by_group():
    """Counts of random trials x known costs = their 'measured' times: the non-negative fit
    finds times within 1%, and each model's held-out error (a fit without it) is small."""
    rng = random.Random(3)
    draw = probes.draw(11, 5, 2, prefix="t")
    true = _costs()
    rows, measured, groups = [], [], []
    for t in draw.trials:
        counts = costmodel.host_counts(costmodel.phase_calls(t)["decode"], 8 * 2**20)
        rows.append(counts)
        measured.append(hostmodel.predict_seconds(counts, true["decode"]) * (1 + rng.gauss(0, 0.01)))
        groups.append(t.model.name)
    fitted = hostmodel.fit_costs(rows, measured)
    predicted = [hostmodel.predict_seconds(r, fitted) for r in rows]
    assert max(abs(p / m - 1) for p, m in zip(predicted, measured)) < 0.05
    errors = hostmodel.heldout_errors(rows, measured, groups)
    assert len(errors) == len(rows) and all(math.isfinite(e) for e in errors)
    assert sorted(abs(e) for e in errors)[len(errors) // 2] < 0.1


def test_prior_pulls_an_unconstrained_cost_toward_the_microbenchmark():
    """A term no row exercises stays at its prior; without a prior it is 0."""
    rows = [{t: (1.0 if t == "launch" else 0.0) for t in hostmodel.TERMS}] * 3
    with_prior = hostmodel.fit_costs(rows, [1e-4] * 3, prior={"dequant": 5e-10, "launch": 1e-4})
    assert with_prior["dequant"] == pytest.approx(5e-10, rel=1e-6)
    assert with_prior["launch"] == pytest.approx(1e-4, rel=1e-3)
    assert hostmodel.fit_costs(rows, [1e-4] * 3)["dequant"] == 0.0


def test_the_collective_latency_bound_is_the_slowest_kinds_smallest_whole_collective():
    """Issue 35: `sweeper calibrate` measures the profile's `collective_latency_max_s` on the
    host it describes: per kind, the whole op at the smallest payload, group and device count
    measured; the slowest kind's. No collective measured: 0 (none)."""
    from sweeper.calibrate import fitting

    def rec(op, group, devices, nbytes, seconds):
        return {"task": {"kind": "collective", "op": op, "group": group, "bytes": nbytes},
                "devices": devices, "ok": True, "bytes_per_chip": nbytes, "seconds": seconds}

    records = [rec("all-gather", 2, 2, 4096, 3e-4), rec("all-gather", 2, 2, 2**20, 9e-4),
               rec("all-gather", 2, 4, 4096, 5e-4), rec("all-gather", 4, 4, 4096, 7e-4),
               rec("reduce-scatter", 2, 2, 4096, 4e-4), rec("reduce-scatter", 2, 2, 2**20, 2e-3),
               {"task": {"kind": "dispatch"}, "devices": 2, "ok": True, "call_s": 1e-4, "op_s": 1e-5}]
    assert fitting.microbench(records).collective_latency_max_s() == 4e-4
    assert fitting.microbench(records[-1:]).collective_latency_max_s() == 0.0


def test_predict_phase_takes_a_calibrated_hosts_latency_from_its_model():
    """With a host_model, a trial's predicted latency is sum(count x cost) at its worker's
    share: a worker with twice the calibration's share runs the throughput terms twice as
    fast, and the dispatch terms as fast as before."""
    costs = _costs()
    hw = dataclasses.replace(HOST, host_model=hostmodel.HostModel(costs, 0.5, 0.0).to_dict())
    trial = _trial(chips=2)
    call = costmodel.phase_calls(trial)["decode"]
    counts = costmodel.host_counts(call)
    at_calibration = costmodel.predict(trial, per_chip(hw, 2, 0.5)).decode_step_s
    assert at_calibration == pytest.approx(hostmodel.predict_seconds(counts, costs["decode"]))
    whole = costmodel.predict(trial, per_chip(hw, 2, 1.0)).decode_step_s
    fixed = sum(counts[t] * c for t, c in costs["decode"].items() if t not in hostmodel.THROUGHPUT_TERMS)
    assert whole == pytest.approx(fixed + (at_calibration - fixed) / 2)
    # the paper's model without one
    assert costmodel.predict(trial, per_chip(HOST, 2, 0.5)).decode_step_s != at_calibration


def test_more_cores_than_devices_do_not_speed_a_worker_up():
    """A worker's extra cores speed the throughput terms up only to one core per device: a
    one-device worker on the whole host predicts as at the calibration's one-core share, a
    four-device one on two cores at half; a worker_cores the profile does not name is 1."""
    costs = _costs()
    host = hostmodel.HostModel(costs, 0.5, 0.0)
    assert host.throughput_ratio(1.0, 1) == 1.0 and host.throughput_ratio(0.5, 1) == 1.0
    assert host.throughput_ratio(1.0, 4) == 0.5 and host.throughput_ratio(0.5, 4) == 1.0
    assert hostmodel.HostModel.from_dict({"share": 0.5, "costs": costs}).worker_cores == 1.0
    hw = dataclasses.replace(HOST, host_model=host.to_dict())
    trial = _trial(chips=1)
    assert costmodel.predict(trial, per_chip(hw, 1, 1.0)).decode_step_s == pytest.approx(
        costmodel.predict(trial, per_chip(hw, 1, 0.5)).decode_step_s)


def test_profile_round_trip_and_bad_host_model(tmp_path):
    hw = dataclasses.replace(HOST, host_model=hostmodel.HostModel(_costs(), 0.5, 3e7).to_dict(),
                             calibration={"host_key": "x"})
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(hw.to_dict()))
    back = load_file(str(path))
    assert back.host_model == hw.host_model and back.calibration == {"host_key": "x"}
    data = hw.to_dict()
    data["host_model"] = {"costs": "fast"}
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError, match="host_model"):
        load_file(str(path))


# ----------------------------------------------------------------------------- resolution


def test_host_resolves_to_the_calibrated_profile_of_this_host_only(tmp_path, monkeypatch):
    """`host` is the calibrated profile while its host key is this host's; a profile
    calibrated elsewhere (another key) is never used: a constant fitted on one host is never
    applied to another. Commands say which one they used."""
    monkeypatch.setenv("SWEEPER_HOME", str(tmp_path))
    peaks = {"profile": HOST.to_dict(), "notes": {}}
    (tmp_path / "host_profile.yaml").write_text(yaml.safe_dump({hostprofile.host_key(): peaks}))
    assert not load_hardware("host").host_model
    assert "uncalibrated" in describe(load_hardware("host"))
    path = hostprofile.calibration_path()
    path.parent.mkdir(parents=True)
    calibrated = dataclasses.replace(
        HOST, host_model=hostmodel.HostModel(_costs(), 0.5, 0.0).to_dict(),
        calibration={"host_key": hostprofile.host_key(), "terms_version": hostmodel.TERMS_VERSION,
                     "calibrated_at": "2026-12-05 10:00",
                     "heldout_mape": {"prefill": 0.1, "decode": 0.2}, "path": str(path)})
    path.write_text(yaml.safe_dump(calibrated.to_dict()))
    got = load_hardware("host")
    assert got.host_model == calibrated.host_model
    assert "calibrated 2026-12-05 10:00" in describe(got) and "decode 20%" in describe(got)
    elsewhere = dataclasses.replace(calibrated, calibration={**calibrated.calibration, "host_key": "other|cpus=64"})
    path.write_text(yaml.safe_dump(elsewhere.to_dict()))
    assert not load_hardware("host").host_model
    # made with other terms (an older sweeper): stale, not used
    stale = dataclasses.replace(calibrated, calibration={**calibrated.calibration, "terms_version": 1})
    path.write_text(yaml.safe_dump(stale.to_dict()))
    assert not load_hardware("host").host_model


def test_uncalibrated_host_says_so_in_one_line(tmp_path):
    env = {**os.environ, "SWEEPER_HOME": str(tmp_path)}
    (tmp_path / "host_profile.yaml").write_text(yaml.safe_dump(
        {hostprofile.host_key(): {"profile": HOST.to_dict(), "notes": {}}}))
    out = subprocess.run([sys.executable, "-m", "sweeper.cli", "predict", "--model", "tiny",
                          "--hardware", "host", "--chips", "2", "--batch", "4", "--phase", "decode"],
                         capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = [ln for ln in out.stderr.splitlines() if ln.startswith("hardware:")]
    assert len(lines) == 1 and "uncalibrated" in lines[0] and "sweeper calibrate" in lines[0]


# ----------------------------------------------------------------------------- corrections


def _observed(seed: int, prefix: str, trials: int, measured, models: int = 2) -> list:
    """Both phases' observations of the first `trials` trials of a probe draw of `models`
    models, each measured as `measured(observation, trial)`."""
    from sweeper.analysis.observations import from_config

    points = []
    for i, t in enumerate(probes.draw(seed, models, 3, prefix=prefix).trials[:trials]):
        for ph in ("prefill", "decode"):
            o = from_config(t, ph, 1.0, i, 0.5 / t.chips)
            o.measured = measured(o, t)
            points.append(o)
    return points


def _compute_slower(base, factor: float = 1.3):
    """`base` with the compute terms (matmuls, dequantisation) `factor` times as costly."""
    return dataclasses.replace(base, host_model=hostmodel.HostModel(
        {ph: {t: v * (factor if t in ("matmul_flops", "matmul_weights", "dequant") else 1.0)
              for t, v in terms.items()} for ph, terms in _costs().items()}, 0.5, 0.0).to_dict())


def test_study_fit_on_a_calibrated_host_fits_corrections_with_a_prior():
    """The trials of one model run 1.3x slower in compute than the calibration says: a fit
    on 6 trials finds a compute correction near 1.3 per phase, leaves the costs' ratios
    alone, and with one point the prior keeps every factor near 1."""
    from sweeper.analysis import fit as calfit
    from sweeper.analysis.observations import predict_latency

    base = dataclasses.replace(HOST, host_model=hostmodel.HostModel(_costs(), 0.5, 0.0).to_dict())
    slow = _compute_slower(base)
    points = _observed(7, "c", 6, lambda o, t: predict_latency(o, slow), models=1)
    fitted = calfit.fit_profile(points, base).profile
    factors = fitted.host_model["corrections"]
    assert factors["decode"]["compute"] == pytest.approx(1.3, rel=0.1)
    assert all(abs(predict_latency(p, fitted) / p.measured - 1) < 0.05 for p in points)
    one = calfit.fit_profile(points[:1], base).profile.host_model["corrections"]
    assert all(0.7 < f < 1.4 for groups in one.values() for f in groups.values())


def test_corrections_prior_is_chosen_by_cross_validation_over_trials():
    """Where one model's errors follow a group (compute 1.3x slower) the cross-validation
    picks a weak prior and the fit finds the factor; where they are noise that follows no
    group (each point off by its own random factor), it picks a strong prior or none, so the
    fit stays near the calibrated profile instead of bending to the noise."""
    import random

    from sweeper.analysis import hostfit
    from sweeper.analysis.observations import predict_latency

    base = dataclasses.replace(HOST, host_model=hostmodel.HostModel(_costs(), 0.5, 0.0).to_dict())
    slow = _compute_slower(base)
    rng = random.Random(3)

    def points(truth, noise):
        return _observed(11, "cv", 10, lambda o, t: predict_latency(o, truth)
                         * math.exp(rng.gauss(0.0, noise)))

    structured = hostfit.fit(points(slow, 0.0), base)[0].host_model
    assert structured["corrections_prior"]["chosen_by"] == "cross-validation over trials"
    assert structured["corrections_prior"]["weight"] <= 1.0
    assert structured["corrections"]["decode"]["compute"] == pytest.approx(1.3, rel=0.1)
    noisy = hostfit.fit(points(base, 0.3), base)[0].host_model
    weight = noisy["corrections_prior"]["weight"]
    assert weight is None or weight >= 1.0, noisy["corrections_prior"]
    assert set(noisy["corrections_prior"]["heldout_mape_by_weight"]) == {str(w) for w in hostfit.PRIOR_WEIGHTS}
    given = hostfit.fit(points(base, 0.3), base, prior_weight=math.inf)[0].host_model
    assert given["corrections_prior"]["chosen_by"] == "given"
    assert all(f == 1.0 for groups in given["corrections"].values() for f in groups.values())


def test_a_uniform_slowdown_is_fitted_as_one_factor_per_phase():
    """Every group of a model's trials 1.2x slower than the calibration says: the
    cross-validation prefers one factor per phase (two numbers, shrunk less by their prior)
    to the groups' ten, and finds the slowdown; each structure's scores are kept."""
    from sweeper.analysis import hostfit
    from sweeper.analysis.observations import predict_latency

    base = dataclasses.replace(HOST, host_model=hostmodel.HostModel(_costs(), 0.5, 0.0).to_dict())
    points = _observed(17, "uniform", 12, lambda o, t: 1.2 * predict_latency(o, base))
    fitted = hostfit.fit(points, base)[0].host_model
    prior = fitted["corrections_prior"]
    assert prior["structure"] == "per phase", prior
    assert set(prior["heldout_mape_per_phase_by_weight"]) == {
        str(w) for w in hostfit.PRIOR_WEIGHTS if math.isfinite(w)}
    for phase in ("prefill", "decode"):
        factors = set(fitted["corrections"][phase].values())
        assert len(factors) == 1 and factors.pop() == pytest.approx(1.2, rel=0.05)
    assert "mesh_corrections" not in fitted


def test_mesh_costs_price_meshes_of_more_than_one_device_only():
    """A fitted profile's `mesh_costs` price calls on several devices; one device keeps
    `costs`; both survive the profile's dict round trip, and without them every chip count
    is priced as calibrated."""
    slow = {ph: {t: 2 * v for t, v in terms.items()} for ph, terms in _costs().items()}
    host = hostmodel.HostModel(_costs(), 0.5, 0.0, mesh_costs=slow)
    again = hostmodel.HostModel.from_dict(host.to_dict())
    assert again == host and "mesh_costs" not in hostmodel.HostModel(_costs(), 0.5).to_dict()
    counts = costmodel.host_counts(costmodel.phase_calls(_trial(chips=2))["decode"])
    plain = hostmodel.HostModel(_costs(), 0.5, 0.0)

    def seconds(model: hostmodel.HostModel, share: float, chips: int) -> float:
        return sum(model.term_seconds(counts, "decode", share, chips).values())

    assert seconds(host, 1.0, 2) == pytest.approx(2 * seconds(plain, 1.0, 2))
    assert seconds(host, 0.5, 1) == seconds(plain, 0.5, 1)


def test_device_factors_price_each_mesh_size_as_the_probes_ran():
    """A calibration whose 4-device probes ran 10% slower than the true costs price them
    (2-device ones as priced) leaves a bias on them that the mesh-only terms do not take
    up: the 4-device factor takes it, held out too (each model from a fit without it). It
    prices a call by its device count: 1 on one device, log-linear between calibrated
    counts, flat past the largest; the factors survive the dict round trip (YAML's and
    JSON's keys alike)."""
    rng = random.Random(5)
    true = _costs()
    rows, measured, devices, groups = [], [], [], []
    for t in probes.draw(12, 6, 2, chips=(1, 2, 4), prefix="t").trials:
        counts = costmodel.host_counts(costmodel.phase_calls(t)["decode"], 8 * 2**20)
        slow = 1.1 if t.chips == 4 else 1.0
        rows.append(counts)
        measured.append(slow * hostmodel.predict_seconds(counts, true["decode"])
                        * (1 + rng.gauss(0, 0.005)))
        devices.append(t.chips)
        groups.append(t.model.name)
    costs = hostmodel.fit_costs(rows, measured)
    factors = hostmodel.device_factors(rows, measured, devices, costs)
    assert set(factors) == {2, 4} and factors[4] > 1.02 and abs(factors[2] - 1) < 0.02
    with_factors = hostmodel.heldout_errors(rows, measured, groups, devices=devices)
    without = hostmodel.heldout_errors(rows, measured, groups)
    four = [i for i, n in enumerate(devices) if n == 4]
    bias = sorted(without[i] for i in four)[len(four) // 2]          # the shared fit's
    assert bias < -0.02
    assert abs(sorted(with_factors[i] for i in four)[len(four) // 2]) < abs(bias) / 2

    host = hostmodel.HostModel(_costs(), 0.5, device_factors={"decode": {2: 1.0, 4: 1.21}})
    assert [host.device_factor("decode", n) for n in (1, 2, 4, 8)] == [1.0, 1.0, 1.21, 1.21]
    assert host.device_factor("decode", 3) == pytest.approx(1.21 ** math.log2(1.5))
    assert host.device_factor("prefill", 4) == 1.0
    counts = costmodel.host_counts(costmodel.phase_calls(_trial(chips=4))["decode"])
    plain = hostmodel.HostModel(_costs(), 0.5)
    assert sum(host.term_seconds(counts, "decode", 0.5, 4).values()) == pytest.approx(
        1.21 * sum(plain.term_seconds(counts, "decode", 0.5, 4).values()))
    as_json = json.loads(json.dumps(host.to_dict()))          # keys become strings
    assert hostmodel.HostModel.from_dict(as_json) == host
    assert "device_factors" not in plain.to_dict()


def test_calibrate_says_its_mesh_factors_in_its_summary():
    """`sweeper calibrate`'s closing lines name each phase's factor per device count beside
    the held-out error, and its JSON carries them; a model without factors prints none."""
    from types import SimpleNamespace

    from sweeper.cli.calibrate import format_summary, summary

    notes = {"probe_trials": 3, "probe_models": 2, "chips": [1, 2, 4], "probe_seed": 7,
             "load_average_1min": [0.1, 0.2]}
    host = hostmodel.HostModel(_costs(), 0.5, device_factors={"prefill": {2: 1.01, 4: 1.06},
                                                              "decode": {2: 0.98, 4: 1.11}})
    fit = SimpleNamespace(model=host, heldout={"prefill": [0.1, -0.2], "decode": [0.05]})
    result = SimpleNamespace(profile=dataclasses.replace(HOST, calibration=notes), fit=fit,
                             failed=[], elapsed_s=12.0, path="p.yaml", points_path="p.json",
                             micro=SimpleNamespace(prior=dict))
    text = format_summary(result)
    assert ("mesh factors (each mesh's probes against the shared costs): prefill x1.01 on 2 "
            "devices, x1.06 on 4 devices; decode x0.98 on 2 devices, x1.11 on 4 devices") in text
    assert summary(result)["device_factors"]["decode"][4] == 1.11
    fit.model = hostmodel.HostModel(_costs(), 0.5)
    assert "mesh factors" not in format_summary(result)
    # the serving loop's probes: what a plan charges beyond the calls, and the band's spread
    assert "serving loop" not in text                      # skipped (--no-serving)
    from workloads.serving.costs import HostCosts

    costs = HostCosts(step_overhead_s=0.0004, prefill_wake_s=0.003, prefill_wake_idle_s=0.09,
                      slice_wake_s=0.0025, decode_after_wake_s=0.0018)
    spread = {"aggregated": {"prefill": [1.0], "decode": [0.9, 1.0, 1.27]}}
    result.profile = dataclasses.replace(HOST, host_costs=costs,
                                         calibration={**notes, "serving_spread": spread})
    assert ("serving loop (probe deployments): +0.40 ms per decode step; a prefill on a loop "
            "idle 90.00 ms +3.00 ms (a prefill slice's: +2.50 ms), the decode steps after it "
            "+1.80 ms; decode steps' spread: 99.5th percentile x1.27 the mean") in format_summary(result)
    assert summary(result)["host_costs"]["decode_after_wake_s"] == 0.0018


def test_study_fit_separates_what_only_a_mesh_of_devices_adds():
    """Trials whose devices share cores run 1.6x slower on 2 and 4 chips than the calibration
    says, and as it says on one: the fit puts the slowdown in the mesh factors, so a one-chip
    trial is still predicted as calibrated and a mesh trial at the slowdown, also by a fit
    on the mesh trials alone. (With one factor per group for every chip count, the
    quickstart's one-chip trials held out were predicted 92% too slow from its 2- and 4-chip
    ones.)"""
    from sweeper.analysis import hostfit
    from sweeper.analysis.observations import predict_latency

    base = dataclasses.replace(HOST, host_model=hostmodel.HostModel(_costs(), 0.5, 0.0).to_dict())
    points = _observed(13, "mesh", 10,
                       lambda o, t: predict_latency(o, base) * (1.6 if t.chips > 1 else 1.0))
    assert {p.chips for p in points} >= {1, 2}
    fitted = hostfit.fit(points, base)[0]
    model = fitted.host_model
    assert model["mesh_costs"] and model["mesh_corrections"]["decode"] > 1.3
    for p in points:
        assert predict_latency(p, fitted) / p.measured == pytest.approx(1.0, abs=0.08), p.chips
    # one chip held out: meshes alone cannot tell the groups' correction from the mesh's, so
    # all of it is the mesh's and one-chip trials are predicted as calibrated
    single = [p for p in points if p.chips == 1]
    held_out = hostfit.fit([p for p in points if p.chips > 1], base)[0]
    assert "mesh_corrections" in held_out.host_model
    assert all(predict_latency(p, held_out) / p.measured == pytest.approx(1.0, abs=1e-6)
               for p in single)
    assert all(predict_latency(p, held_out) / p.measured == pytest.approx(1.0, abs=0.1)
               for p in points if p.chips > 1)


def test_a_prefill_call_unembeds_its_last_position_only():
    """The engine's prefill unembeds the last position of each sequence (workloads/engine.py):
    the host model's matmul FLOPs grow with the vocabulary by 2 V E per sequence, not per
    prompt token; decode's, one token per sequence, by the same."""
    small, large = (dataclasses.replace(_trial().model, vocab=v) for v in (1024, 9216))

    def flops(model, phase):
        trial = _trial(model=model.to_dict(), chips=1)
        return costmodel.host_counts(costmodel.phase_calls(trial)[phase])["matmul_flops"]

    grow = 2.0 * (9216 - 1024) * small.d_model * _trial().batch
    assert flops(large, "prefill") - flops(small, "prefill") == pytest.approx(grow)
    assert flops(large, "decode") - flops(small, "decode") == pytest.approx(grow)


def test_matmul_microbenchmarks_give_the_streamed_weights_cost():
    """seconds = call + FLOPs x a + (k n) x b over the matmul shapes measured: b is the
    prior of `matmul_weights` (the probes' fit could otherwise trade it against the FLOPs)."""
    from sweeper.calibrate import fitting

    records = [{"task": {"kind": "matmul", "m": m, "k": k, "n": n}, "devices": 1, "ok": True,
                "seconds": 3e-5 + 2.0 * m * k * n * 5e-12 + k * n * 8e-11}
               for m in (1, 8, 64, 512) for k, n in ((256, 256), (1024, 1024), (512, 2048))]
    micro = fitting.microbench(records)
    assert micro.prior()["matmul_weights"] == pytest.approx(8e-11, rel=0.02)
    assert micro.prior()["matmul_flops"] == pytest.approx(5e-12, rel=0.05)


def _big_model():
    """A model whose blocks hold 21 M weight elements: an int8 copy of them (2 bytes each)
    is past glibc's 32 MiB mmap threshold on one device, and a quarter of it is not."""
    m = _trial().model
    return dataclasses.replace(m, d_model=1024, d_ff=4096, n_heads=16, d_head=64,
                               n_kv_heads=16 if m.n_kv_heads == m.n_heads else 1, n_layers=2)


def _decode_call(chips: int, weights: str, ffn: str, batch: int = 4):
    layout = {"ffn": ffn, "attn": "head"}
    return costmodel.phase_calls(_trial(model=_big_model().to_dict(), chips=chips, batch=batch,
                                        weights=weights, prefill=layout, decode=layout))["decode"]


def test_a_temp_buffer_past_the_mmap_threshold_faults_at_every_call():
    """XLA CPU's temp buffer holds the bf16 copies of the weights it dequantises or gathers:
    past malloc's 32 MiB mmap threshold it is mapped, and faulted, afresh each call
    (fault_bytes, summed over the devices); below it, or with no copy, nothing."""
    threshold = costmodel.MMAP_THRESHOLD_BYTES
    one = _decode_call(1, "int8", "ws1d")
    temp = costmodel.host_temp_bytes(one)
    assert temp == 2.0 * costmodel.block_params(one.model) > threshold
    assert costmodel.host_counts(one)["fault_bytes"] == temp
    four = _decode_call(4, "int8", "ws1d")                 # a quarter each: under the threshold
    assert costmodel.host_temp_bytes(four) < threshold
    assert costmodel.host_counts(four)["fault_bytes"] == 0.0
    assert costmodel.host_temp_bytes(_decode_call(1, "bf16", "ws1d")) == 0.0   # read in place
    gathered = _decode_call(2, "bf16", "wg_xy")
    assert costmodel.host_counts(gathered)["fault_bytes"] == pytest.approx(
        2 * 4.0 * costmodel.block_params(gathered.model))


def test_decode_streams_weights_from_dram_under_the_flops_past_the_overlap_rows():
    """A decode matmul of few rows waits on its weights from DRAM; at `overlap_rows` rows
    or more the stream runs under the FLOPs (dram_weights 0). Without an overlap measured,
    and in prefill, the count is the plain one."""
    def dram(batch, overlap, phase="decode"):
        call = _decode_call(1, "bf16", "ws1d", batch)
        if phase == "prefill":
            call = costmodel.phase_calls(_trial(model=_big_model().to_dict(), chips=1, batch=batch,
                                                decode={"ffn": "ws1d", "attn": "head"}))["prefill"]
        return costmodel.host_counts(call, 1.0, overlap)["dram_weights"]

    assert dram(1, 0.0) > 0 and dram(1, 8.0) == pytest.approx(dram(1, 0.0) * (1 - 1 / 8))
    assert dram(8, 8.0) == 0.0 and dram(16, 8.0) == 0.0
    assert dram(2, 8.0, "prefill") == dram(2, 0.0, "prefill") > 0


def test_overlap_rows_come_from_the_read_and_matmul_microbenchmarks():
    from sweeper.calibrate import fitting

    micro = fitting.Microbench(read_s={1: 6e-11, 2: 6e-11}, matmul_flop_s={1: 5e-12, 2: 5e-12})
    assert micro.overlap_rows() == pytest.approx(12.0)    # 2 B x 6e-11 s/B over 2 x 5e-12 s
    assert fitting.Microbench().overlap_rows() == 0.0
    host = hostmodel.HostModel(_costs(), 0.5, 0.0, overlap_rows=12.0)
    assert hostmodel.HostModel.from_dict(host.to_dict()) == host


def test_the_read_sweep_gives_the_cache_the_model_counts():
    """Points drawn from the model's own count (a call's fixed cost, then per bf16 element
    a + b x (1 - C / bytes) past C) give C back; a sweep without a step, or too short,
    gives 0 (sysfs's is kept)."""
    from sweeper.calibrate import fitting

    mib = 2**20
    sizes = [m * mib for m in (1, 2, 4, 6, 8, 12, 16, 32, 64)]
    rng = random.Random(5)

    def call_s(b: float, cache: float) -> float:
        per_element = 120e-12 + 200e-12 * max(0.0, 1 - cache / b)
        return (20e-6 + b / 2 * per_element) * (1 + rng.gauss(0, 0.02))

    for cache in (3 * mib, 7 * mib, 20 * mib):
        sweep = [(b, call_s(b, cache)) for b in sizes]
        found = fitting.Microbench(read_sweep=sweep).effective_cache_bytes()
        assert found == pytest.approx(cache, rel=0.2)
    flat = [(b, call_s(b, 0.0) if b < 0 else 20e-6 + b / 2 * 120e-12) for b in sizes]
    assert fitting.Microbench(read_sweep=flat).effective_cache_bytes() == 0.0
    assert fitting.Microbench(read_sweep=sweep[:3]).effective_cache_bytes() == 0.0


def test_a_worker_keeps_a_calibration_workers_cache_per_core_it_runs_devices_on():
    """Calibrated at half the host on one core each: a lone one-device worker (the serve's,
    pinned to one core) gets one calibration worker's cache, not the whole host's; a
    four-device worker on the whole host runs on both cores and gets two."""
    host = hostmodel.HostModel(_costs(), 0.5, 12e6, worker_cores=1)
    assert host.cache_for(0.5, 1) == host.cache_for(0.5, 4) == pytest.approx(6e6)
    assert host.cache_for(1.0, 1) == pytest.approx(6e6)
    assert host.cache_for(1.0, 4) == pytest.approx(12e6)


def test_prefill_counts_its_elementwise_work_per_prompt_token_and_layer():
    """A prefill layer's norms and residual adds run on every device's activations, its
    activation function once over the FFN's shards: prompt tokens x layers x (d_model x
    devices + d_ff). A decode step's few rows ride on its per-layer dispatch (none)."""
    def counts(chips, batch, phase="prefill"):
        return costmodel.host_counts(costmodel.phase_calls(_trial(chips=chips, batch=batch))[phase])

    m = _trial().model
    one = counts(1, 4)["elementwise"]
    assert one == 4 * 32 * m.n_layers * (m.d_model + m.d_ff)
    assert counts(1, 8)["elementwise"] == 2 * one
    assert counts(2, 4)["elementwise"] == 4 * 32 * m.n_layers * (2 * m.d_model + m.d_ff)
    assert counts(1, 4, "decode")["elementwise"] == 0.0


def test_every_host_term_is_in_exactly_one_correction_group():
    """A study fit prices a point by its groups' seconds (hostfit._parts): a term in no
    group would vanish from the fit's predictions and be made up by the others."""
    from sweeper.analysis.hostfit import GROUPS

    grouped = [t for terms in GROUPS.values() for t in terms]
    assert sorted(grouped) == sorted(hostmodel.TERMS)


# ----------------------------------------------------------------------------- probes


def test_probe_draws_are_reproducible_valid_and_avoid_the_calibrations():
    a, b = probes.draw(5, 3, 2), probes.draw(5, 3, 2)
    assert [t.to_dict() for t in a.trials] == [t.to_dict() for t in b.trials]
    for t in a.trials:
        t.validate()
        assert t.batch * t.input_len <= probes.MAX_PREFILL_TOKENS
        assert 128 <= t.model.d_model <= 1024 and 2 <= t.model.n_layers <= 6
    avoid = {probes.model_key(m) for m in a.models}
    other = probes.draw(5, 3, 2, avoid=avoid)
    assert not avoid & {probes.model_key(m) for m in other.models}


def test_ladder_is_the_cheapest_corner_at_two_depths_on_every_chip_count():
    rungs = probes.ladder(5, (1, 2, 4), prefix="t", repeats=3)
    again = probes.ladder(5, (1, 2, 4), prefix="t", repeats=3)
    assert [t.to_dict() for t in rungs.trials] == [t.to_dict() for t in again.trials]
    assert [m.n_layers for m in rungs.models] == list(probes.LAYERS)
    # the two rungs are one model but for their depth, so their difference is the layers'
    shapes = [{k: v for k, v in m.to_dict().items() if k not in ("name", "n_layers")}
              for m in rungs.models]
    assert shapes[0] == shapes[1] and rungs.models[0].d_model == min(probes.D_MODELS)
    assert len(rungs.trials) == 6
    for t in rungs.trials:
        t.validate()
        assert (t.batch, t.input_len, t.weights, t.repeats) == (1, min(probes.INPUT_LENS), "bf16", 3)
    assert sorted(t.chips for t in rungs.trials) == [1, 1, 2, 2, 4, 4]
    # the calibration measures it after its random probes, which it leaves as they were
    full = tasks.FULL.probe_draw()
    plain = dataclasses.replace(tasks.FULL, ladder=False).probe_draw()
    assert full.trials[:len(plain.trials)] == plain.trials
    ladder_names = {m.name for m in probes.ladder(tasks.FULL.seed).models}
    assert {t.model.name for t in full.trials[len(plain.trials):]} == ladder_names


# ----------------------------------------------------------------------------- the command


def test_calibrate_rejects_a_bad_out_before_any_work(tmp_path):
    out = subprocess.run([sys.executable, "-m", "sweeper.cli", "calibrate", "--out",
                          str(tmp_path / "host.txt")], capture_output=True, text=True, cwd=ROOT,
                         env={**os.environ, "SWEEPER_HOME": str(tmp_path)}, timeout=60)
    assert out.returncode == 2
    assert out.stderr.strip().count("\n") == 0 and "--out" in out.stderr and ".yaml" in out.stderr


def test_quick_calibration_runs_for_real_and_host_uses_it(tmp_path):
    """A real `sweeper calibrate --quick`: pinned processes run the microbenchmarks and the
    probe trials, the profile lands where `host` resolves, carries held-out residuals of
    both phases and names this host; `sweeper predict --hardware host` then says it is
    calibrated."""
    env = {**os.environ, "SWEEPER_HOME": str(tmp_path)}
    run = subprocess.run([sys.executable, "-m", "sweeper.cli", "calibrate", "--quick",
                          "--no-serving", "--json"], capture_output=True, text=True, cwd=ROOT,
                         env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    summary = json.loads(run.stdout)
    path = Path(summary["profile"])
    assert path == tmp_path / "calibration" / "host.yaml"
    profile = yaml.safe_load(path.read_text())
    assert profile["calibration"]["host_key"] and profile["host_model"]["costs"]["decode"]
    assert profile["heldout_residuals"]["prefill"] and profile["heldout_residuals"]["decode"]
    # the quick calibration's 2-device probes give each phase its mesh's factor
    for phase in ("prefill", "decode"):
        assert set(profile["host_model"]["device_factors"][phase]) == {2}
        assert summary["device_factors"][phase]["2"] == pytest.approx(
            profile["host_model"]["device_factors"][phase][2])
    points = json.loads(Path(summary["points"]).read_text())
    # issue 35: the collective latency bound is this host's measurement, the price is not measured
    whole = [r["seconds"] for r in points["records"] if r["task"]["kind"] == "collective"]
    assert 0 < profile["collective_latency_max_s"] <= max(whole)
    assert profile["multigroup_gather_scale"] == 1.0
    kinds = {r["task"]["kind"] for r in points["records"]}
    assert {"dispatch", "matmul", "dequant", "memory", "cache", "collective", "trial"} <= kinds
    # the cache the model counts is the read sweep's where it shows a step, else sysfs's
    notes = profile["calibration"]
    measured = points["microbench"]["effective_cache_bytes"]
    assert notes["cache_source"] == ("read sweep" if measured > 0 else "sysfs")
    assert notes["cache_bytes"] == pytest.approx(measured / notes["worker_share"] if measured > 0
                                                 else notes["cache_bytes_sysfs"])
    assert profile["host_model"]["cache_bytes"] == pytest.approx(notes["cache_bytes"])
    said = subprocess.run([sys.executable, "-m", "sweeper.cli", "predict", "--model", "tiny",
                           "--hardware", "host", "--chips", "2", "--batch", "4", "--phase",
                           "decode", "--json"], capture_output=True, text=True, cwd=ROOT,
                          env=env, timeout=120)
    assert said.returncode == 0, said.stderr
    assert "hardware: host, calibrated" in said.stderr
    # `--check`: some of its probe trials measured again, now / then per phase, nothing written
    before = path.read_text()
    checked = subprocess.run([sys.executable, "-m", "sweeper.cli", "calibrate", "--check",
                              "--json"], capture_output=True, text=True, cwd=ROOT, env=env,
                             timeout=600)
    assert checked.returncode == 0, checked.stderr[-2000:]
    result = json.loads(checked.stdout)
    probes_then = {(r["devices"], json.dumps(r["task"], sort_keys=True)): r
                   for r in points["records"] if r["task"]["kind"] == "trial" and r.get("ok")}
    assert result["measured"] == len(result["points"]) >= 4 and result["failed"] == 0
    assert {p["devices"] for p in result["points"]} == {1, 2}
    for p in result["points"]:
        assert p["prefill_ratio"] == pytest.approx(p["prefill_now_s"] / p["prefill_then_s"])
        assert any(r["prefill_s"] == p["prefill_then_s"] and r["devices"] == p["devices"]
                   for r in probes_then.values())
    # the read sweep's largest weights: a decode row streaming them from DRAM
    sweep = sorted(r["task"]["bytes"] for r in points["records"] if r["task"]["kind"] == "cache")
    assert [p["bytes"] for p in sorted(result["streaming"], key=lambda p: p["bytes"])] == sweep[-3:]
    assert result["ratio"]["streaming"]["n"] == 3
    for phase in ("prefill", "decode", "streaming"):
        r = result["ratio"][phase]
        assert r["low"] <= r["median"] <= r["high"]
        assert r["n"] == (result["measured"] if phase != "streaming" else 3)
        # the same host minutes later: a drift of the order of its noise, not a factor
        assert 0.5 < r["median"] < 2.0
    assert path.read_text() == before


def test_check_picks_each_chip_counts_probes_evenly_and_bounds_the_median():
    from sweeper.calibrate.check import median_interval, pick

    records = [{"devices": n, "task": {"kind": "trial", "i": i}, "prefill_s": (i + 1) * 1e-3,
                "decode_step_s": 1e-3} for n in (1, 2) for i in range(10)]
    chosen = pick(records, 3)
    assert [(r["devices"], r["task"]["i"]) for r in chosen] == [(1, 1), (1, 5), (1, 8),
                                                               (2, 1), (2, 5), (2, 8)]
    assert len(pick(records[:2], 3)) == 2
    # the sign test's 95% interval: with 9 points the 2nd and 8th order statistics
    # (P(Binomial(9, 1/2) <= 1) = 0.0195 <= 0.025); with 5, every point
    assert median_interval([1.0, 1.1, 0.9, 1.2, 0.8, 1.05, 0.95, 1.3, 0.7]) == (
        pytest.approx(1.0), pytest.approx(0.8), pytest.approx(1.2))
    assert median_interval([1.0, 1.1, 1.2, 1.3, 1.4]) == (1.2, 1.0, 1.4)


def test_check_of_an_uncalibrated_host_says_so_in_one_line(tmp_path):
    out = subprocess.run([sys.executable, "-m", "sweeper.cli", "calibrate", "--check"],
                         capture_output=True, text=True, cwd=ROOT,
                         env={**os.environ, "SWEEPER_HOME": str(tmp_path)}, timeout=60)
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().count("\n") == 0 and "sweeper calibrate" in out.stderr
