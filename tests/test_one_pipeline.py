"""Issue 20: one calibration pipeline. A study's trials and a CSV of published numbers become
the same `Observation`, fitted by the same bounded fit and held out by the same routine; the
extra terms are chosen by nested cross-validation; the noise floor is one measurement's error."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import numpy as np

from sweeper.analysis import holdout as calho
from sweeper.analysis import observations as ob
from sweeper.analysis.fit import fit_profile
from synthetic import synthetic_trials
from test_calibrate import START, TRUTH, grid
from workloads import costmodel
from workloads.config import load_hardware
from workloads.measurements import load_measurements, predict_point

PAPER = Path(__file__).resolve().parent.parent / "benchmarks" / "data" / "paper-tpu-v4.csv"


def test_a_study_observation_predicts_what_the_sweep_predicts():
    """The observation's call is costmodel.phase_calls's: its latency is costmodel.predict's."""
    config = grid(chips=(4,))[0].resolved()
    measured = costmodel.predict(config, TRUTH)
    for phase, value in (("prefill", measured.prefill_s), ("decode", measured.decode_step_s)):
        obs = ob.from_config(config, phase, value)
        assert ob.predict_latency(obs, TRUTH) == value


def test_a_csv_observation_predicts_what_measurements_predicts():
    sheet = load_hardware("tpu-v4")
    rows = load_measurements(PAPER)
    for row, obs in zip(rows, ob.from_measurements(rows, sheet.peak_flops)):
        assert math.isclose(ob.predict_value(obs, sheet), predict_point(row, sheet), rel_tol=1e-9)
        assert obs.metric == row.metric and obs.measured == row.measured


def test_rates_never_exceed_the_start_profile_and_overheads_stay_nonnegative():
    """Noise-free points from a truth FASTER than the start: the fit stops at the start's
    rates (the ceiling) instead of inventing an impossible bandwidth."""
    fast = dataclasses.replace(TRUTH, peak_flops=START.peak_flops * 3,
                               hbm_bandwidth=START.hbm_bandwidth * 3)
    points = ob.from_frame(synthetic_trials(grid(chips=(2, 4)), fast, START, noise=0.0), START)
    fitted = fit_profile(points, START).profile
    assert fitted.peak_flops <= START.peak_flops and fitted.hbm_bandwidth <= START.hbm_bandwidth
    assert fitted.ici_bandwidth <= START.ici_bandwidth
    assert min(fitted.op_overhead_s, *fitted.collective_latency_s_by_kind.values()) >= 0


def test_nested_selection_frees_a_term_the_truth_has_and_only_then():
    with_launch = dataclasses.replace(TRUTH, launch_overhead_s=2e-3)
    configs = grid(chips=(2, 4), batches=(4,))
    for truth, expect in ((with_launch, True), (TRUTH, False)):
        points = ob.from_frame(synthetic_trials(configs, truth, START, noise=0.01, seed=3), START)
        chosen = calho.select_terms(points, START)
        assert ("launch_overhead_s" in chosen) is expect, chosen


def test_noise_floor_is_one_measurements_error():
    """Two replicates a and b: each against the other is |a - b| / x; one measurement's error
    is that / sqrt 2 (and against the pair's mean, / sqrt 2 again)."""
    config = grid(chips=(2,))[0].resolved()
    a = ob.from_config(dataclasses.replace(config, seed=0), "decode", 1.0, trial=0)
    b = ob.from_config(dataclasses.replace(config, seed=1), "decode", 1.2, trial=1)
    floor = calho.noise_floor([a, b])
    expected = np.mean([0.2 / 1.0, 0.2 / 1.2]) / math.sqrt(2)
    assert math.isclose(floor.mape, expected) and math.isclose(floor.mean_mape, expected / math.sqrt(2))


def test_device_overhead_is_charged_per_layer_and_chip_and_round_trips():
    """Issue 20's per-device dispatch term: + device_overhead_s x n_layers x chips, outside
    the overlap and not scaled by the chip's share of the host."""
    from workloads.config import HardwareProfile

    config = grid(chips=(4,))[0].resolved()
    call = costmodel.phase_calls(config)["decode"]
    with_term = dataclasses.replace(TRUTH, device_overhead_s=1e-4)
    extra = call.predict(with_term).latency_s - call.predict(TRUTH).latency_s
    assert math.isclose(extra, 1e-4 * config.run_model.n_layers * 4, rel_tol=1e-9)
    share = with_term.scaled(0.25)
    assert math.isclose(call.predict(share).latency_s - call.predict(TRUTH.scaled(0.25)).latency_s,
                        extra, rel_tol=1e-9)
    assert HardwareProfile.from_dict(with_term.to_dict()).device_overhead_s == 1e-4


def test_collective_rendezvous_is_fitted_within_its_bound_and_recovered():
    """Noise-free points from a truth with collective_rendezvous_s: the fit that frees it
    recovers it within its bound (fit.EXTRA_BOUNDS), and the fast path matches predict_phase."""
    from sweeper.analysis.fit import EXTRA_BOUNDS, default_space, predict_point

    truth = dataclasses.replace(TRUTH, collective_rendezvous_s=2e-5)
    points = ob.from_frame(synthetic_trials(grid(chips=(2, 4, 8)), truth, START, noise=0.0), START)
    fitted = fit_profile(points, START, default_space(points, ("collective_rendezvous_s",))).profile
    low, high = EXTRA_BOUNDS["collective_rendezvous_s"]
    assert low <= fitted.collective_rendezvous_s <= high
    assert math.isclose(fitted.collective_rendezvous_s, 2e-5, rel_tol=0.05)
    assert max(abs(predict_point(p, fitted) / p.measured - 1) for p in points) < 0.01
